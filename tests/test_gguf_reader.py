"""pantheon.formats.gguf_reader.MappedGGUF reads every file exactly as gguf.GGUFReader does, fast, and refuses damage.

Why: the loader swapped gguf's reader (20-45 s to open a 150k-260k token vocabulary, most of a
model's start-to-ready time) for its own header parser. Nothing the model is built from may change:
every catalog model and tiny fixture must give the same metadata dict (value types included: ints
stay ints, floats floats, bools bools) and the same tensors (name, type, dims, sizes, offsets,
bytes, dtypes, shapes) as gguf's reader; odd but legal values (nested and empty arrays, big-endian
files, bad UTF-8 where gguf decodes lazily) decode the same way; and a damaged header is a
ModelLoadError naming the file, never a raw exception, a huge allocation or a runaway loop.
"""

from __future__ import annotations

import struct
import time
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from conftest import TINY
from pantheon.formats import gguf_reader as gguf_reader
from pantheon.errors import ModelLoadError
from pantheon.formats.gguf_reader import MappedGGUF, open_reader, read_metadata

REAL_NAMES = ["smollm2-135m", "qwen-0.5b", "gemma3-270m"]
TINY_FILES = sorted(TINY.glob("*.gguf"))
VT = gguf.GGUFValueType


# ---- comparison helpers ---------------------------------------------------------------------------
def _typed(v: Any) -> Any:
    """A value with its type spelled out, so 1 == 1.0 == True do not pass for one another."""
    if isinstance(v, list):
        return ("list", [_typed(x) for x in v])
    return (type(v).__name__, v)


def _root(a: np.ndarray) -> np.ndarray:
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def _same_tensor_data(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal bytes (NaN-safe), compared as uint8 views of the two mappings."""
    return np.array_equal(a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8))


def assert_same_as_gguf(path: Path, all_data: bool) -> tuple[MappedGGUF, gguf.GGUFReader]:
    ours = MappedGGUF(path)
    ref = gguf.GGUFReader(str(path), "r")
    mine, theirs = read_metadata(ours, path), read_metadata(ref, path)
    assert list(mine) == list(theirs)  # same keys, same (file) order
    assert _typed(mine) == _typed(theirs)
    assert ours.data_offset == ref.data_offset and ours.alignment == int(ref.alignment)
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert type(a.tensor_type) is gguf.GGMLQuantizationType and a.tensor_type == b.tensor_type, a.name
        assert a.shape.dtype == b.shape.dtype and np.array_equal(a.shape, b.shape), a.name
        assert (a.n_elements, a.n_bytes, a.data_offset) == (int(b.n_elements), int(b.n_bytes), int(b.data_offset))
        assert type(a.n_bytes) is int and type(a.data_offset) is int
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert not a.data.flags.writeable and _root(a.data) is ours.data, a.name  # a view of the one memmap
    n = len(ours.tensors)
    picks = range(n) if all_data else sorted({0, 1, n // 2, n - 2, n - 1} & set(range(n)))
    for i in picks:
        assert _same_tensor_data(ours.tensors[i].data, ref.tensors[i].data), ours.tensors[i].name
    return ours, ref


# ---- the files the engine ships with ----------------------------------------------------------------
@pytest.mark.parametrize("path", TINY_FILES, ids=[p.stem for p in TINY_FILES])
def test_tiny_fixture_reads_as_gguf_reads_it(path):
    ours, ref = assert_same_as_gguf(path, all_data=True)
    assert list(ours.fields) == list(ref.fields)
    for key in ("GGUF.version", "GGUF.kv_count", "general.architecture", "tokenizer.ggml.tokens",
                "tokenizer.ggml.token_type"):
        if key in ref.fields:
            _assert_same_field(ours.fields[key], ref.fields[key])


@pytest.mark.real
@pytest.mark.parametrize("name", REAL_NAMES)
def test_catalog_model_reads_as_gguf_reads_it(name, real_model_path):
    assert_same_as_gguf(real_model_path(name), all_data=False)


@pytest.mark.real
def test_opening_qwen_reads_its_whole_vocabulary_once(real_model_path, capsys):
    """The reason for the reader: gguf's took ~20 s for this file's 152k-token vocabulary (ours ~0.3 s,
    printed here; speed is measured in benchmarks, not asserted)."""
    path = real_model_path("qwen-0.5b")
    gguf_reader._open_cached.cache_clear()
    t0 = time.perf_counter()
    reader = open_reader(path)
    meta = read_metadata(reader, path)
    took = time.perf_counter() - t0
    with capsys.disabled():
        print(f"\nopen_reader + read_metadata of {path.name} (fresh): {took:.2f} s")
    assert len(meta["tokenizer.ggml.tokens"]) == 151936 and len(reader.tensors) == 291
    assert open_reader(path) is reader  # cached per (path, size, mtime)


def test_metadata_lists_are_copies_the_caller_may_change():
    path = TINY / "llama.gguf"
    first = read_metadata(open_reader(path))
    first["tokenizer.ggml.tokens"].clear()
    first.pop("general.architecture")
    again = read_metadata(open_reader(path))
    assert len(again["tokenizer.ggml.tokens"]) == 512 and "general.architecture" in again


def _assert_same_field(ours: Any, ref: Any) -> None:
    """The ReaderField compatibility view: same offset, name, types, data indexes, parts and contents."""
    assert (ours.offset, ours.name, ours.types, ours.data) == (ref.offset, ref.name, ref.types, ref.data)
    assert len(ours.parts) == len(ref.parts)
    for a, b in zip(ours.parts, ref.parts):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
    assert _typed(ours.contents()) == _typed(ref.contents())


# ---- values gguf reads oddly but legally: raw files written byte by byte ------------------------------
def _s(b: bytes | str) -> bytes:
    b = b.encode() if isinstance(b, str) else b
    return struct.pack("<Q", len(b)) + b


def _kv(key: bytes | str, vtype: int, payload: bytes) -> bytes:
    return _s(key) + struct.pack("<I", vtype) + payload


def _arr(itype: int, items: list[bytes]) -> bytes:
    return struct.pack("<IQ", itype, len(items)) + b"".join(items)


def _i32(*vs: int) -> list[bytes]:
    return [struct.pack("<i", v) for v in vs]


def _raw_gguf(kvs: list[bytes], tensors: list[tuple[str, tuple[int, ...], int, bytes]] = (),
              alignment: int = 32, version: int = 3) -> bytes:
    """A GGUF of these key/value entries and (name, dims, ggml type, data) tensors, data aligned."""
    infos, data = b"", b""
    for name, dims, ttype, blob in tensors:
        infos += _s(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, ttype, len(data))
        data += blob + bytes(-len(blob) % alignment)
    head = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kvs)) + b"".join(kvs) + infos
    return head + bytes(-len(head) % alignment) + data


_F32_TENSOR = ("t.weight", (4, 2), int(gguf.GGMLQuantizationType.F32), np.arange(8, dtype="<f4").tobytes())

ODD_VALUES = [
    _kv("general.architecture", VT.STRING, _s("llama")),
    _kv("k.u8", VT.UINT8, b"\xff"), _kv("k.i8", VT.INT8, b"\xff"),
    _kv("k.u16", VT.UINT16, struct.pack("<H", 65535)), _kv("k.i16", VT.INT16, struct.pack("<h", -2)),
    _kv("k.u32", VT.UINT32, struct.pack("<I", 2 ** 32 - 1)), _kv("k.i32", VT.INT32, struct.pack("<i", -3)),
    _kv("k.u64", VT.UINT64, struct.pack("<Q", 2 ** 64 - 1)), _kv("k.i64", VT.INT64, struct.pack("<q", -2 ** 63)),
    _kv("k.f32", VT.FLOAT32, struct.pack("<f", 0.1)), _kv("k.f64", VT.FLOAT64, struct.pack("<d", 1e300)),
    _kv("k.bool0", VT.BOOL, b"\x00"), _kv("k.bool1", VT.BOOL, b"\x01"), _kv("k.bool2", VT.BOOL, b"\x02"),
    _kv("k.bools", VT.ARRAY, _arr(VT.BOOL, [b"\x00", b"\x01", b"\x07"])),
    _kv("k.f32s", VT.ARRAY, _arr(VT.FLOAT32, [struct.pack("<f", x) for x in (1.5, -0.1, 3e38)])),
    _kv("k.u64s", VT.ARRAY, _arr(VT.UINT64, [struct.pack("<Q", x) for x in (0, 2 ** 63)])),
    _kv("k.empty_str", VT.STRING, _s("")), _kv("k.unicode", VT.STRING, _s("café ☕ 你好 \U0001F600")),
    _kv("k.strs", VT.ARRAY, _arr(VT.STRING, [_s(""), _s("a b"), _s("Ġhello"), _s("\x00")])),
    _kv("k.empty", VT.ARRAY, _arr(VT.INT32, [])),
    _kv("k.empty_unknown_item_type", VT.ARRAY, struct.pack("<IQ", 99, 0)),  # gguf never reads the item type
    _kv("k.nested_ints", VT.ARRAY, _arr(VT.ARRAY, [_arr(VT.INT32, _i32(1, 2)), _arr(VT.INT32, _i32(3))])),
    _kv("k.nested_strs", VT.ARRAY, _arr(VT.ARRAY, [_arr(VT.STRING, [_s("a"), _s("bc")]),
                                                   _arr(VT.STRING, [_s("d")])])),
    _kv("k.nested_first_empty", VT.ARRAY, _arr(VT.ARRAY, [_arr(VT.INT32, []), _arr(VT.STRING, [_s("xy")])])),
    _kv("k.nested_str_then_int", VT.ARRAY, _arr(VT.ARRAY, [_arr(VT.STRING, [_s("ab")]), _arr(VT.INT32, _i32(7))])),
    _kv("k.nested_int_then_str", VT.ARRAY, _arr(VT.ARRAY, [_arr(VT.INT32, _i32(7)), _arr(VT.STRING, [_s("ab")])])),
    _kv("k.deep", VT.ARRAY, _arr(VT.ARRAY, [_arr(VT.ARRAY, [_arr(VT.UINT8, [b"\x05"])]), _arr(VT.ARRAY, [])])),
    _kv("GGUF.other", VT.UINT32, struct.pack("<I", 1)),  # GGUF.* keys are left out by read_metadata
]


def test_odd_but_legal_values_decode_as_gguf_decodes_them(tmp_path):
    p = tmp_path / "odd.gguf"
    p.write_bytes(_raw_gguf(ODD_VALUES, [_F32_TENSOR]))
    ours, ref = assert_same_as_gguf(p, all_data=True)
    assert list(ours.fields) == list(ref.fields)
    for key in ref.fields:
        _assert_same_field(ours.fields[key], ref.fields[key])
    assert "k.nested_ints" in ours.metadata and "GGUF.other" not in read_metadata(ours)


def test_a_big_endian_file_reads_as_gguf_reads_it(tmp_path):
    p = tmp_path / "be.gguf"
    w = gguf.GGUFWriter(str(p), "llama", endianess=gguf.GGUFEndian.BIG)
    w.add_uint32("llama.block_count", 3)
    w.add_float32("llama.rope.freq_base", 1e4)
    w.add_token_list(["a", "b", "ab"])
    w.add_array("k.ints", [1, -2, 3])
    w.add_tensor("t.f32", np.arange(32, dtype=np.float32).reshape(4, 8))
    w.add_tensor("t.f16", np.arange(64, dtype=np.float16).reshape(2, 32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours, _ = assert_same_as_gguf(p, all_data=True)
    assert ours.byte_order == ">" and ours.metadata["llama.block_count"] == 3
    assert ours.tensors[0].data.astype(np.float32).tolist() == np.arange(32).reshape(4, 8).tolist()


def test_alignment_is_read_as_gguf_reads_it(tmp_path):
    p = tmp_path / "align64.gguf"
    p.write_bytes(_raw_gguf([_kv("general.alignment", VT.UINT32, struct.pack("<I", 64))], [_F32_TENSOR],
                            alignment=64))
    assert assert_same_as_gguf(p, all_data=True)[0].alignment == 64


# ---- undecodable strings: where gguf decodes lazily, the key decides --------------------------------
def _bad_utf8_file(tmp_path: Path, key: str, value: bytes, as_array: bool = False) -> Path:
    payload = _arr(VT.STRING, [_s("ok"), _s(value)]) if as_array else _s(value)
    kvs = [_kv("general.architecture", VT.STRING, _s("llama")), _kv(key, VT.ARRAY if as_array else VT.STRING, payload)]
    p = tmp_path / "bad.gguf"
    p.write_bytes(_raw_gguf(kvs, [_F32_TENSOR]))
    return p


@pytest.mark.parametrize("key", ["general.name", "general.license"])
def test_bad_utf8_in_a_descriptive_key_is_skipped(tmp_path, key):
    p = _bad_utf8_file(tmp_path, key, b"caf\xe9")
    mine, theirs = read_metadata(MappedGGUF(p), p), read_metadata(gguf.GGUFReader(str(p)), p)
    assert mine == theirs and key not in mine and mine["general.architecture"] == "llama"


@pytest.mark.parametrize("key,as_array", [("tokenizer.ggml.tokens", True), ("tokenizer.chat_template", False),
                                          ("llama.some_strings", True), ("llama.rope.scaling.type", False)])
def test_bad_utf8_elsewhere_fails_naming_the_key(tmp_path, key, as_array):
    p = _bad_utf8_file(tmp_path, key, b"\xc3", as_array)
    with pytest.raises(ModelLoadError) as ours:
        read_metadata(open_reader(p), p)
    with pytest.raises(ModelLoadError) as theirs:
        read_metadata(gguf.GGUFReader(str(p)), p)
    assert str(ours.value) == str(theirs.value) and repr(key) in str(ours.value) and str(p) in str(ours.value)


def test_bad_utf8_in_architecture_fails(tmp_path):
    kvs = [_kv("general.architecture", VT.STRING, _s(b"ll\xffma"))]
    p = tmp_path / "arch.gguf"
    p.write_bytes(_raw_gguf(kvs, [_F32_TENSOR]))
    with pytest.raises(ModelLoadError, match="general.architecture"):
        read_metadata(open_reader(p), p)


@pytest.mark.parametrize("what", ["key", "tensor name"])
def test_bad_utf8_in_a_key_or_tensor_name_fails_the_open(tmp_path, what):
    kvs = [_kv(b"general.\xff" if what == "key" else "general.architecture", VT.STRING, _s("llama"))]
    tensor = (b"t.\xff" if what == "tensor name" else "t.weight",) + _F32_TENSOR[1:]
    p = tmp_path / "name.gguf"
    p.write_bytes(_raw_gguf(kvs, [tensor]))
    with pytest.raises(UnicodeDecodeError):  # gguf's reader refuses the file outright too
        gguf.GGUFReader(str(p))
    _expect_refused(p, "UTF-8")


# ---- damaged headers ---------------------------------------------------------------------------------
def _expect_refused(p: Path, *words: str) -> ModelLoadError:
    gguf_reader._open_cached.cache_clear()
    with pytest.raises(ModelLoadError) as exc:
        open_reader(p)
    msg = str(exc.value)
    assert type(exc.value) is ModelLoadError and str(p.resolve()) in msg, msg
    for w in words:
        assert w in msg, msg
    return exc.value


def test_every_truncation_of_the_header_is_refused(tmp_path):
    src = (TINY / "llama.gguf").read_bytes()
    data_offset = MappedGGUF(TINY / "llama.gguf").data_offset
    cuts = sorted(set(range(0, data_offset + 64, 53)) | {1, 4, 7, 8, 23, 24, data_offset - 1, len(src) - 1})
    p = tmp_path / "cut.gguf"
    for n in cuts:
        p.write_bytes(src[:n])
        _expect_refused(p)


@pytest.mark.parametrize("case", ["magic", "version_1", "version_99", "n_kv_huge", "n_tensors_huge", "key_len_huge",
                                  "value_type_unknown", "item_type_unknown", "array_count_huge",
                                  "string_count_huge", "string_len_huge", "item_len_huge", "nested_too_deep",
                                  "duplicate_key", "pseudo_key", "duplicate_tensor", "alignment_u64",
                                  "alignment_zero", "alignment_odd", "n_dims_zero", "n_dims_huge", "dims_overflow",
                                  "tensor_type_unknown", "tensor_past_end", "tensor_misaligned"])
def test_damaged_headers_are_refused(tmp_path, case):
    arch = _kv("general.architecture", VT.STRING, _s("llama"))
    t = _F32_TENSOR
    files = {
        "magic": b"GGUX" + _raw_gguf([arch])[4:],
        "version_1": _raw_gguf([arch], version=1),
        "version_99": _raw_gguf([arch], version=99),
        "n_kv_huge": b"GGUF" + struct.pack("<IQQ", 3, 0, 2 ** 62) + arch,
        "n_tensors_huge": b"GGUF" + struct.pack("<IQQ", 3, 2 ** 63 - 1, 1) + arch,
        "key_len_huge": b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, 2 ** 62) + b"general",
        "value_type_unknown": _raw_gguf([_kv("k", 99, b"\0" * 8)]),
        "item_type_unknown": _raw_gguf([_kv("k", VT.ARRAY, struct.pack("<IQ", 99, 1) + b"\0" * 8)]),
        "array_count_huge": _raw_gguf([_kv("k", VT.ARRAY, struct.pack("<IQ", VT.UINT32, 2 ** 61))]),
        "string_count_huge": _raw_gguf([_kv("k", VT.ARRAY, struct.pack("<IQ", VT.STRING, 2 ** 61))]),
        "string_len_huge": _raw_gguf([_kv("k", VT.STRING, struct.pack("<Q", 2 ** 62))]),
        "item_len_huge": _raw_gguf([_kv("k", VT.ARRAY, struct.pack("<IQ", VT.STRING, 2) + _s("a")
                                        + struct.pack("<Q", 2 ** 40) + b"b" * 64)]),
        "nested_too_deep": _raw_gguf([_kv("k", VT.ARRAY, struct.pack("<IQ", VT.ARRAY, 1) * 2000
                                          + struct.pack("<IQ", VT.UINT8, 0))]),
        "duplicate_key": _raw_gguf([arch, arch]),
        "pseudo_key": _raw_gguf([arch, _kv("GGUF.version", VT.UINT32, struct.pack("<I", 3))]),
        "duplicate_tensor": _raw_gguf([arch], [t, t]),
        "alignment_u64": _raw_gguf([arch, _kv("general.alignment", VT.UINT64, struct.pack("<Q", 32))], [t]),
        "alignment_zero": _raw_gguf([arch, _kv("general.alignment", VT.UINT32, struct.pack("<I", 0))], [t]),
        "alignment_odd": _raw_gguf([arch, _kv("general.alignment", VT.UINT32, struct.pack("<I", 24))], [t]),
        "n_dims_zero": _raw_gguf([arch], [("t", (), t[2], t[3])]),
        "n_dims_huge": _raw_gguf([arch], [("t", (1,) * 5, t[2], t[3])]),
        "dims_overflow": _raw_gguf([arch], [("t", (2 ** 62, 2 ** 62), t[2], t[3])]),
        "tensor_type_unknown": _raw_gguf([arch], [("t", (4, 2), 200, t[3])]),
        "tensor_past_end": _raw_gguf([arch], [("t", (4, 2 ** 20), t[2], t[3])]),
        "tensor_misaligned": _raw_gguf([arch], [t, ("u", (4, 2), t[2], t[3])]),
    }
    raw = files[case]
    if case == "tensor_misaligned":  # point the second tensor's offset one byte past where it starts
        at = raw.index(b"\x01\x00\x00\x00\x00\x00\x00\x00u") + 9 + 4 + 16 + 4
        raw = raw[:at] + struct.pack("<Q", 33) + raw[at + 8:]
    p = tmp_path / f"{case}.gguf"
    p.write_bytes(raw)
    _expect_refused(p)


def test_missing_file_and_directory_are_refused(tmp_path):
    _expect_refused(tmp_path / "nope.gguf", "does not exist")
    _expect_refused(tmp_path, "not a regular file")
    (tmp_path / "empty.gguf").write_bytes(b"")
    _expect_refused(tmp_path / "empty.gguf", "not a GGUF")
