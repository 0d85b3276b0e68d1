"""Crafted (damaged or lying) GGUF files must fail to load with ModelLoadError, never anything else.

Why: the admin API loads files a client names. A file that makes the load path raise a raw
IndexError, struct.error, ZeroDivisionError or MemoryError answers 500 `internal_error` (a bug, as
far as the client can tell) and may leave memory or a table slot behind. Every variant here is the
tiny llama fixture damaged one way -- truncated at several offsets, header fields flipped, counts and
sizes that overflow, metadata that is missing, mistyped or absurd, tokenizer arrays that do not
match, tensors whose shape or type disagree with the metadata -- and each must raise ModelLoadError
(HTTP 500 `model_load_error`) naming the file, from the entry point the admin load uses
(`Registry.load`) and from `engine.load`, leave nothing reserved, and let a good load work after.
"""

from __future__ import annotations

import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from conftest import tiny_fixture
from pantheon.runtime import engine
from pantheon.config import load_settings
from pantheon.errors import ModelLoadError
from pantheon.serving.registry import Registry
from pantheon.runtime import reference

SRC, _, _ = tiny_fixture("llama")
VT = gguf.GGUFValueType


# ---- byte-level edits of the fixture ------------------------------------------------------------------
def _layout() -> dict[str, Any]:
    """Offsets in the fixture: header counts, each key's value, each tensor's info fields."""
    r = gguf.GGUFReader(str(SRC))
    out: dict[str, Any] = {"data_offset": r.data_offset, "fields": {}, "tensors": {}}
    for name, f in r.fields.items():
        out["fields"][name] = f
    for t in r.tensors:
        # tensor info parts: name length, name, n_dims, dims, type, data offset
        parts = t.field.parts
        off = t.field.offset
        offs = []
        for p in parts:
            offs.append(off)
            off += p.nbytes
        out["tensors"][t.name] = {"n_dims": offs[2], "dims": offs[3], "type": offs[4], "offset": offs[5],
                                  "data_offset": int(t.data_offset), "n_bytes": int(t.n_bytes)}
    return out


LAYOUT = _layout()


def _field_value_offset(key: str) -> int:
    """Byte offset of a key's value (after its name, name length and type)."""
    f = LAYOUT["fields"][key]
    return f.offset + sum(p.nbytes for p in f.parts[:3])


def _patch(data: bytearray, offset: int, fmt: str, *values: Any) -> bytearray:
    struct.pack_into(fmt, data, offset, *values)
    return data


def _bytes_edit(edit: Callable[[bytearray], bytearray]) -> Callable[[Path], None]:
    def make(dst: Path) -> None:
        dst.write_bytes(bytes(edit(bytearray(SRC.read_bytes()))))
    return make


def _truncate(n: int) -> Callable[[Path], None]:
    return _bytes_edit(lambda d: d[:n])


def _tokens_array_offset() -> int:
    f = LAYOUT["fields"]["tokenizer.ggml.tokens"]
    return f.offset + sum(p.nbytes for p in f.parts[:3])  # -> the array's item type (u32), then count (u64)


def _first_token_string_offset() -> int:
    f = LAYOUT["fields"]["tokenizer.ggml.tokens"]
    return f.offset + sum(p.nbytes for p in f.parts[:6])  # past item type, count and the first length


def _non_utf8_arch(d: bytearray) -> bytearray:
    off = _field_value_offset("general.architecture") + 8  # the string's bytes after its u64 length
    d[off] = 0xFF
    return d


def _non_utf8_token(d: bytearray) -> bytearray:
    d[_first_token_string_offset()] = 0xC3  # a lone UTF-8 lead byte
    return d


T0 = LAYOUT["tensors"]["blk.0.attn_q.weight"]
EMB = LAYOUT["tensors"]["token_embd.weight"]
SIZE = SRC.stat().st_size


# ---- rewritten variants (the gguf package's writer) ----------------------------------------------------
def _contents() -> tuple[list[tuple[str, Any, VT, VT | None]], list[tuple[str, np.ndarray, Any]]]:
    """(key, value, type, array item type) of every key and (name, array in numpy order, type) of every tensor."""
    r = gguf.GGUFReader(str(SRC))
    kvs = []
    for name, f in r.fields.items():
        if name.startswith("GGUF."):
            continue
        vtype = f.types[0]
        sub = f.types[1] if vtype == VT.ARRAY else None
        kvs.append((name, f.contents(), vtype, sub))
    tensors = [(t.name, np.array(t.data), t.tensor_type) for t in r.tensors]
    return kvs, tensors


def _rewrite(kv_edit: Callable[[dict], None] | None = None,
             tensor_edit: Callable[[dict], None] | None = None) -> Callable[[Path], None]:
    """A variant written from the fixture's contents with `kv_edit(kvs)` / `tensor_edit(tensors)` applied
    (dicts name -> (value, type, item type) and name -> array)."""
    def make(dst: Path) -> None:
        kv_list, t_list = _contents()
        kvs = {k: (v, t, s) for k, v, t, s in kv_list}
        tensors = {n: a for n, a, _ in t_list}
        if kv_edit:
            kv_edit(kvs)
        if tensor_edit:
            tensor_edit(tensors)
        w = gguf.GGUFWriter(str(dst), "llama")
        w.kv_data[0].clear()  # drop the writer's own general.architecture: the edits decide
        for k, (v, t, s) in kvs.items():
            w.add_key_value(k, v, t, sub_type=s)
        for n, a in tensors.items():
            w.add_tensor(n, a)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return make


def _set(key: str, value: Any, vtype: VT, sub: VT | None = None) -> Callable[[dict], None]:
    def edit(kvs: dict) -> None:
        kvs[key] = (value, vtype, sub)
    return edit


def _drop(*keys: str) -> Callable[[dict], None]:
    def edit(kvs: dict) -> None:
        for k in keys:
            kvs.pop(k, None)
    return edit


def _tensor(name: str, value: np.ndarray | None) -> Callable[[dict], None]:
    def edit(tensors: dict) -> None:
        if value is None:
            tensors.pop(name)
        else:
            tensors[name] = value
    return edit


def _short_token_types(kvs: dict) -> None:
    v, t, s = kvs["tokenizer.ggml.token_type"]
    kvs["tokenizer.ggml.token_type"] = (v[:100], t, s)


def _short_vocab(kvs: dict) -> None:
    """A tokenizer larger than the embedding: ids past the embedding's rows would index nothing."""
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
        v, t, s = kvs[key]
        kvs[key] = (v + (v[-1:] if key.endswith("type") else ["extra-a"]) * 40, t, s)


VARIANTS: dict[str, Callable[[Path], None]] = {
    # truncation: inside the magic, the header counts, the metadata, the tensor infos, the data
    "empty": _truncate(0),
    "trunc_magic": _truncate(3),
    "trunc_counts": _truncate(20),
    "trunc_metadata": _truncate(2000),
    "trunc_tensor_infos": _truncate(T0["type"]),
    "trunc_data_half": _truncate(SIZE // 2),
    "trunc_last_byte": _truncate(SIZE - 1),
    # header fields
    "bad_magic": _bytes_edit(lambda d: _patch(d, 0, "<4s", b"GGUX")),
    "version_99": _bytes_edit(lambda d: _patch(d, 4, "<I", 99)),
    "version_1": _bytes_edit(lambda d: _patch(d, 4, "<I", 1)),
    "n_tensors_huge": _bytes_edit(lambda d: _patch(d, 8, "<Q", 2 ** 63 - 1)),
    "n_tensors_extra": _bytes_edit(lambda d: _patch(d, 8, "<Q", len(LAYOUT["tensors"]) + 1)),
    "n_kv_huge": _bytes_edit(lambda d: _patch(d, 16, "<Q", 2 ** 62)),
    "key_length_huge": _bytes_edit(lambda d: _patch(d, 24, "<Q", 2 ** 62)),
    "value_type_unknown": _bytes_edit(lambda d: _patch(d, LAYOUT["fields"]["general.architecture"].offset + 8 + 20,
                                                       "<I", 99)),
    "tokens_count_huge": _bytes_edit(lambda d: _patch(d, _tokens_array_offset() + 4, "<Q", 2 ** 61)),
    "non_utf8_arch": _bytes_edit(_non_utf8_arch),
    "non_utf8_token": _bytes_edit(_non_utf8_token),
    # tensor infos
    "n_dims_huge": _bytes_edit(lambda d: _patch(d, T0["n_dims"], "<I", 2 ** 31)),
    "dim_huge": _bytes_edit(lambda d: _patch(d, T0["dims"], "<Q", 2 ** 40)),
    "dim_overflow": _bytes_edit(lambda d: _patch(d, T0["dims"], "<QQ", 2 ** 62, 2 ** 62)),
    "dim_zero": _bytes_edit(lambda d: _patch(d, EMB["dims"], "<Q", 0)),
    "dtype_unknown": _bytes_edit(lambda d: _patch(d, T0["type"], "<I", 200)),
    "dtype_f16": _bytes_edit(lambda d: _patch(d, T0["type"], "<I", int(gguf.GGMLQuantizationType.F16))),
    "dtype_q8_0": _bytes_edit(lambda d: _patch(d, EMB["type"], "<I", int(gguf.GGMLQuantizationType.Q8_0))),
    "data_offset_past_end": _bytes_edit(lambda d: _patch(d, T0["offset"], "<Q", SIZE)),
    "data_offset_misaligned": _bytes_edit(lambda d: _patch(d, T0["offset"], "<Q",
                                                           T0["data_offset"] - LAYOUT["data_offset"] + 1)),
    # metadata: missing, mistyped, absurd
    "no_architecture": _rewrite(_drop("general.architecture")),
    "unknown_architecture": _rewrite(_set("general.architecture", "llama9", VT.STRING)),
    "architecture_not_string": _rewrite(_set("general.architecture", 7, VT.UINT32)),
    "no_block_count": _rewrite(_drop("llama.block_count")),
    "no_embedding_length": _rewrite(_drop("llama.embedding_length")),
    "block_count_string": _rewrite(_set("llama.block_count", "four", VT.STRING)),
    "block_count_zero": _rewrite(_set("llama.block_count", 0, VT.UINT32)),
    "block_count_more_than_tensors": _rewrite(_set("llama.block_count", 8, VT.UINT32)),
    "block_count_absurd": _rewrite(_set("llama.block_count", 2 ** 31, VT.UINT32)),
    "embedding_length_wrong": _rewrite(_set("llama.embedding_length", 128, VT.UINT32)),
    "head_count_zero": _rewrite(_set("llama.attention.head_count", 0, VT.UINT32)),
    "head_count_kv_zero": _rewrite(_set("llama.attention.head_count_kv", 0, VT.UINT32)),
    "head_count_kv_not_dividing": _rewrite(_set("llama.attention.head_count_kv", 3, VT.UINT32)),
    "head_count_absurd": _rewrite(_set("llama.attention.head_count", 2 ** 30, VT.UINT32)),
    "key_length_absurd": _rewrite(_set("llama.attention.key_length", 2 ** 24, VT.UINT32)),
    "rope_dims_odd": _rewrite(_set("llama.rope.dimension_count", 15, VT.UINT32)),
    "rms_eps_nan": _rewrite(_set("llama.attention.layer_norm_rms_epsilon", float("nan"), VT.FLOAT32)),
    "rope_base_negative": _rewrite(_set("llama.rope.freq_base", -1.0, VT.FLOAT32)),
    "per_layer_head_counts": _rewrite(_set("llama.attention.head_count", [4, 4, 2, 4], VT.ARRAY, VT.UINT32)),
    # tokenizer arrays
    "no_tokenizer": _rewrite(_drop("tokenizer.ggml.tokens")),
    "tokens_not_strings": _rewrite(_set("tokenizer.ggml.tokens", list(range(512)), VT.ARRAY, VT.INT32)),
    "token_types_short": _rewrite(_short_token_types),
    "tokenizer_model_unknown": _rewrite(_set("tokenizer.ggml.model", "wordpiece9", VT.STRING)),
    "merges_malformed": _rewrite(_set("tokenizer.ggml.merges", ["nospace"], VT.ARRAY, VT.STRING)),
    "bos_out_of_range": _rewrite(_set("tokenizer.ggml.bos_token_id", 100000, VT.UINT32)),
    "vocab_larger_than_embedding": _rewrite(_short_vocab),
    "chat_template_not_string": _rewrite(_set("tokenizer.chat_template", 7, VT.UINT32)),
    # tensors that disagree with the metadata
    "tensor_missing": _rewrite(tensor_edit=_tensor("blk.1.ffn_up.weight", None)),
    "tensor_wrong_shape": _rewrite(tensor_edit=_tensor("blk.0.attn_q.weight", np.zeros((32, 64), np.float32))),
    "embedding_wrong_width": _rewrite(tensor_edit=_tensor("token_embd.weight", np.zeros((512, 48), np.float32))),
}


def _settings(tmp_path: Path):
    env = {"PANTHEON_HOME": str(tmp_path / "home"), "PANTHEON_WARMUP": "0", "PANTHEON_BATCH_SLOTS": "2",
           "PANTHEON_MAX_SEQ": "64", "PANTHEON_PREFILL_CHUNK": "16", "PANTHEON_NATIVE_MATMUL": "0"}
    return load_settings(env)


class _Backend:
    """The registry's backend hook: the crafted loads must fail before a backend is ever built."""

    built = 0

    def __init__(self, model: Any, settings: Any):
        type(self).built += 1
        self.model = model

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def crafted(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("crafted")
    out = {}
    for name, make in VARIANTS.items():
        p = d / f"{name}.gguf"
        make(p)
        out[name] = p
    return out


def test_variants_differ_from_the_fixture(crafted):
    good = SRC.read_bytes()
    assert len(VARIANTS) >= 24
    for name, p in crafted.items():
        assert p.read_bytes() != good, name


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_registry_load_of_a_crafted_file_is_a_model_load_error(name, crafted, tmp_path):
    reg = Registry(_settings(tmp_path), make_backend=_Backend,
                   devices=lambda s: [{"die": 0, "budget_bytes": 8 * 1024 ** 3}])
    built = _Backend.built
    with pytest.raises(ModelLoadError) as exc:
        reg.load(str(crafted[name]), name="crafted", resolve=Path)
    err = exc.value
    assert type(err) is ModelLoadError and err.code == "model_load_error" and err.status == 500
    assert str(crafted[name]) in str(err) or crafted[name].name in str(err), str(err)
    assert err.problem and "internal" not in err.problem.lower()
    assert reg.snapshot() == [] and _Backend.built == built  # no slot, no backend
    assert all(d["used_bytes"] == 0 and not d["models"] for d in reg.dies())  # nothing stays reserved


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_engine_load_of_a_crafted_file_is_a_model_load_error(name, crafted):
    with pytest.raises(ModelLoadError) as exc:
        engine.load(crafted[name], engine.LoadOptions(n_slots=2, max_seq=64, prefill_chunk=16, native_matmul=False))
    assert type(exc.value) is ModelLoadError


def test_a_good_load_works_after_the_crafted_ones(crafted, tmp_path):
    reg = Registry(_settings(tmp_path), devices=lambda s: [{"die": 0, "budget_bytes": 8 * 1024 ** 3}])
    for name in ("trunc_data_half", "dim_overflow", "block_count_absurd", "vocab_larger_than_embedding"):
        with pytest.raises(ModelLoadError):
            reg.load(str(crafted[name]), name="m", resolve=Path)
    good = tmp_path / "good.gguf"
    shutil.copyfile(SRC, good)
    info = reg.load(str(good), name="m", resolve=Path)
    try:
        assert info["state"] == "ready"
        entry = reg.acquire("m")
        try:
            ids = entry.model.tokenizer.encode("hello world")
            out = list(reference.generate(entry.model, ids, max_tokens=3))
            assert 1 <= len(out) <= 3
        finally:
            reg.release(entry)
    finally:
        reg.unload("m")
    assert reg.snapshot() == []
