"""Weights stay as the file stores them: no f32 copies on the device, every format, clear failures.

The engine holds each matrix as its GGUF blocks (pantheon.ops.weights.QuantWeight) and multiplies it with
one `linear`. These tests pin what that promises: the device holds about the file's bytes, every
format a file may use loads and computes the same logits through the native kernels and XLA's
expansion, and a tensor no kernel reads is expanded alone (or, when even gguf cannot read it, the
load fails naming the tensor and leaves nothing on the device).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import gguf
import jax
import numpy as np
import pytest

from pantheon.runtime import engine
from pantheon.ops import native
from pantheon.config import load_settings
from pantheon.errors import ModelLoadError
from pantheon.ops.quant_formats import FORMATS
from pantheon.ops.weights import MappedStack, QuantWeight

from test_gguf_loader import add_tiny_tokenizer
from pantheon.runtime import reference

H, FF, L, NH, NKV = 256, 512, 2, 4, 2  # 256-wide rows: whole super-blocks for the K-quants

# The f16 scale fields of each block format (byte offsets in a block): set to small values so a
# random block is a plausible weight (random bytes there would be any f16, inf and NaN included).
_SCALE_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q2_K": (80, 82),
                 "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,),
                 "IQ2_XXS": (0,)}


def random_blocks(qtype: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, row bytes] of random blocks of `qtype` with small finite scales."""
    bw, bb = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    blocks = rng.integers(0, 256, size=(rows * cols // bw, bb), dtype=np.uint8)
    for off in _SCALE_FIELDS[qtype]:
        scale = rng.uniform(0.002, 0.01, size=blocks.shape[0]).astype(np.float16)
        blocks[:, off: off + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, cols // bw * bb)


def write_llama(path: Path, formats: dict[str, str], seed: int = 0) -> Path:
    """A 2-layer random llama whose matrices use `formats` (GGUF name part -> type; F32 otherwise)."""
    w = gguf.GGUFWriter(str(path), "llama")
    for k, v in {"block_count": L, "embedding_length": H, "feed_forward_length": FF, "attention.head_count": NH,
                 "attention.head_count_kv": NKV, "context_length": 128}.items():
        w.add_uint32(f"llama.{k}", v)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-6)
    vocab = add_tiny_tokenizer(w)
    rng = np.random.default_rng(seed)
    hd = H // NH
    shapes = {"token_embd.weight": (vocab, H), "output_norm.weight": (H,), "output.weight": (vocab, H)}
    for i in range(L):
        shapes.update({f"blk.{i}.attn_norm.weight": (H,), f"blk.{i}.attn_q.weight": (NH * hd, H),
                       f"blk.{i}.attn_k.weight": (NKV * hd, H), f"blk.{i}.attn_v.weight": (NKV * hd, H),
                       f"blk.{i}.attn_output.weight": (H, NH * hd), f"blk.{i}.ffn_norm.weight": (H,),
                       f"blk.{i}.ffn_gate.weight": (FF, H), f"blk.{i}.ffn_up.weight": (FF, H),
                       f"blk.{i}.ffn_down.weight": (H, FF)})
    for name, shape in shapes.items():
        fmt = next((f for part, f in formats.items() if part in name), None) if len(shape) == 2 else None
        if fmt in (None, "F32", "F16"):
            values = rng.normal(0, 0.05 if len(shape) == 2 else 1.0, size=shape).astype(np.float32)
            if len(shape) == 1:
                values = 1.0 + 0.1 * values
            w.add_tensor(name, values.astype(np.float16) if fmt == "F16" else values)
        else:
            qtype = gguf.GGMLQuantizationType[fmt]
            w.add_tensor(name, random_blocks(fmt, shape[0], shape[1], rng), raw_dtype=qtype)  # shape from the bytes
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _weights(model) -> list[QuantWeight | MappedStack]:
    """Every weight of the params, a stack left in the mapped file included."""
    kinds = (QuantWeight, MappedStack)
    return [x for x in jax.tree.leaves(model.params, is_leaf=lambda v: isinstance(v, kinds)) if isinstance(x, kinds)]


def _device_bytes(model) -> int:
    """Bytes of the params' weights as the device holds them: a matrix of a MappedStack is counted at its
    size in the file it is read from (the stacks share the one aliased file buffer), every other array
    at its own size; a widened block format would show as 4-8x its file bytes."""
    return sum(int(x.nbytes) for x in jax.tree.leaves(model.params, is_leaf=lambda v: isinstance(v, MappedStack)))


def _file_tensor_bytes(path: Path) -> int:
    return sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors)


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen-0.5b", "gemma3-270m"])
def test_a_catalog_model_holds_about_its_files_bytes_on_the_device(name, load_real, real_model_path):
    model = load_real(name)
    file_bytes = _file_tensor_bytes(real_model_path(name))
    assert _device_bytes(model) <= 1.1 * file_bytes, (name, _device_bytes(model), file_bytes)
    assert model.weight_bytes <= 1.1 * file_bytes
    # every matrix keeps the file's format: not one block format was widened to f32
    stored = {t.tensor_type.name for t in gguf.GGUFReader(str(real_model_path(name))).tensors if len(t.shape) == 2}
    assert {w.qtype for w in _weights(model)} <= stored


MIXES = {  # every block format the engine holds, a few at a time (a Q4_K_M file mixes like this)
    "legacy": {"attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q5_0", "attn_output": "Q5_1", "ffn_gate": "Q8_0",
               "ffn_up": "Q8_0", "ffn_down": "Q4_0", "token_embd": "Q8_0", "output": "Q5_0"},
    "k-quants": {"attn_q": "Q2_K", "attn_k": "Q3_K", "attn_v": "Q6_K", "attn_output": "Q4_K", "ffn_gate": "Q4_K",
                 "ffn_up": "Q4_K", "ffn_down": "Q5_K", "token_embd": "Q4_K", "output": "Q6_K"},
    "iq-and-16-bit": {"attn_q": "IQ4_NL", "attn_k": "IQ4_XS", "attn_v": "F16", "attn_output": "IQ4_XS",
                      "ffn_gate": "BF16", "ffn_up": "BF16", "ffn_down": "IQ4_NL", "token_embd": "F16",
                      "output": "IQ4_NL"},
}


def rewrite(path: Path, tensor: Any) -> Path:
    """Rewrite the GGUF at `path` in place, every tensor passed through `tensor(t) -> (data, type)`."""
    r = gguf.GGUFReader(str(path))
    w = gguf.GGUFWriter(str(path) + ".new", "llama")
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = f.types[0]
        w.add_key_value(key, f.contents(), vtype, f.types[1] if vtype == gguf.GGUFValueType.ARRAY else None)
    for t in r.tensors:
        data, qtype = tensor(t)
        w.add_tensor(t.name, data, raw_dtype=qtype)  # a quantized tensor's shape comes from its bytes
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    Path(str(path) + ".new").replace(path)
    return path


def _bf16_file(path: Path, formats: dict[str, str]) -> Path:
    """write_llama, except that BF16 matrices are written as real BF16 tensors."""
    write_llama(path, {k: ("F32" if v == "BF16" else v) for k, v in formats.items()})
    bf16 = gguf.GGMLQuantizationType.BF16

    def tensor(t: Any) -> tuple[np.ndarray, Any]:
        fmt = next((f for part, f in formats.items() if part in t.name), None) if len(t.shape) == 2 else None
        if fmt == "BF16":
            return gguf.quants.quantize(np.asarray(t.data, np.float32), bf16), bf16
        return np.asarray(t.data), t.tensor_type

    return rewrite(path, tensor)


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_every_format_loads_as_it_is_stored_and_both_kernels_agree(mix, tmp_path):
    if not native.enable(load_settings().home / "native"):
        pytest.fail(f"the native kernels did not build: {native.unavailable_reason()}")
    path = _bf16_file(tmp_path / f"{mix}.gguf", MIXES[mix])
    opts = dict(n_slots=2, max_seq=64, prefill_chunk=16, kv_dtype="float32")
    on = engine.load(path, engine.LoadOptions(native_matmul=True, **opts))
    off = engine.load(path, engine.LoadOptions(native_matmul=False, **opts))
    assert on.native_matmul and not off.native_matmul
    used = {w.qtype for w in _weights(on)}
    assert set(MIXES[mix].values()) <= used  # nothing widened to f32
    assert _device_bytes(on) <= 1.1 * _file_tensor_bytes(path)
    ids = [1, 5, 9, 13, 2, 7, 11, 3, 4]
    a, b = reference.logits(on, ids), reference.logits(off, ids)
    assert np.all(np.isfinite(a)) and np.abs(a).max() > 1e-3
    np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-4 * np.abs(b).max())
    for m in (on, off):
        m.free()


def test_a_type_no_kernel_reads_is_expanded_alone_with_a_log_line(tmp_path, caplog):
    path = write_llama(tmp_path / "iq2.gguf", {"ffn_down": "IQ2_XXS", "attn_q": "Q4_K"})
    assert "IQ2_XXS" not in FORMATS
    with caplog.at_level(logging.INFO, logger="pantheon.formats.gguf_loader"):
        model = engine.load(path, engine.LoadOptions(n_slots=1, max_seq=32, prefill_chunk=16))
    assert "blk.0.ffn_down.weight" in caplog.text and "IQ2_XXS" in caplog.text
    kinds = {w.qtype for w in _weights(model)}
    assert "Q4_K" in kinds and "F32" in kinds  # only the IQ2_XXS matrices were widened
    assert np.all(np.isfinite(reference.logits(model, [1, 2, 3])))
    model.free()


def _write_with_raw_tensor(path: Path, qtype: gguf.GGMLQuantizationType, nbytes_per_row: int) -> Path:
    """write_llama's file with blk.0.ffn_down stored as `qtype` (raw bytes gguf cannot dequantize)."""
    write_llama(path, {})

    def tensor(t: Any) -> tuple[np.ndarray, Any]:
        if t.name == "blk.0.ffn_down.weight":
            return np.zeros((int(t.shape[1]), nbytes_per_row), np.uint8), qtype
        return np.asarray(t.data), t.tensor_type

    return rewrite(path, tensor)


def test_a_type_gguf_cannot_read_either_fails_the_load_naming_it_and_leaves_nothing(tmp_path):
    q = gguf.GGMLQuantizationType.Q8_1
    bw, bb = gguf.GGML_QUANT_SIZES[q]
    path = _write_with_raw_tensor(tmp_path / "q81.gguf", q, FF // bw * bb)
    before = len(jax.live_arrays())
    with pytest.raises(ModelLoadError) as err:
        engine.load(path, engine.LoadOptions(n_slots=1, max_seq=32, prefill_chunk=16))
    assert "blk.0.ffn_down.weight" in str(err.value) and "Q8_1" in str(err.value)
    assert len(jax.live_arrays()) == before


def test_a_truncated_file_fails_the_load_and_leaves_nothing(tmp_path):
    path = write_llama(tmp_path / "whole.gguf", {"ffn_gate": "Q4_K", "ffn_up": "Q4_K"})
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size - 4096])
    before = len(jax.live_arrays())
    with pytest.raises(ModelLoadError):
        engine.load(cut, engine.LoadOptions(n_slots=1, max_seq=32, prefill_chunk=16))
    assert len(jax.live_arrays()) == before
