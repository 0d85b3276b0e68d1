"""The one GGUF header parser: metadata as plain Python values, tensors as views of one mapping.

Kept apart from the tensor loader so the tokenizer and chat-template code can read a file's
vocabulary without touching its weights. Every reader of a GGUF's layout goes through here: the
load path (pantheon.formats.gguf_loader.open_gguf) and the load estimate an admin load is admitted
by (pantheon.serving.dies, through open_gguf too), so a damaged table is refused the same way
everywhere (`check_tensor_layout`: a ModelLoadError naming the tensor), never turned into an absurd
estimate, a huge allocation or a raw exception.

Why a reader of our own rather than `gguf.GGUFReader`: gguf's reader builds a numpy view of the
mapped file for every item of every array (two per vocabulary string), which takes 20-45 s for a
150k-260k token vocabulary -- most of a model's start-to-ready time. `MappedGGUF` parses the same
header with struct/bytes loops (strings decoded straight into Python lists, numeric arrays through
np.frombuffer) in well under a second, and gives tensors exactly as gguf's reader does (same names,
types, shapes, offsets and views of one read-only np.memmap of the file). Parses are cached per
(path, size, mtime), so an estimate followed by the load parses the header once.
"""

from __future__ import annotations

import functools
import math
import mmap
import struct
import sys
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import gguf
import numpy as np
from gguf.gguf_reader import ReaderField

from pantheon.errors import ModelLoadError

GGML_MAX_DIMS = 4  # ggml tensors have at most four dimensions (ggml.h)
DEFAULT_ALIGNMENT = 32  # GGUF's data alignment when general.alignment is absent
# Keys whose value may be skipped when it cannot be decoded: descriptive only, nothing reads them to
# build the model. Any other undecodable key (architecture, tokenizer, hyper-parameters) fails the load.
_SKIPPABLE_PREFIXES = ("general.",)
_NEEDED_GENERAL_KEYS = ("general.architecture", "general.alignment")

SUPPORTED_VERSIONS = (2, 3)  # what gguf's reader and llama.cpp read; v1 had 32-bit counts
_MAX_NESTING = 16  # arrays of arrays: llama.cpp refuses them outright, gguf's reader recurses without bound

_VT = gguf.GGUFValueType
_STRING, _ARRAY, _UINT32 = int(_VT.STRING), int(_VT.ARRAY), int(_VT.UINT32)
# Scalar value type id -> struct / numpy format character (the file's byte order is prefixed per file).
_SCALAR_CHARS = {int(_VT.UINT8): "B", int(_VT.INT8): "b", int(_VT.UINT16): "H", int(_VT.INT16): "h",
                 int(_VT.UINT32): "I", int(_VT.INT32): "i", int(_VT.FLOAT32): "f", int(_VT.BOOL): "?",
                 int(_VT.UINT64): "Q", int(_VT.INT64): "q", int(_VT.FLOAT64): "d"}
# Tensor types gguf's reader hands out as typed arrays in the logical shape; every other type comes as
# uint8 rows of bytes (its quant_shape_to_byte_shape), which is what TensorSource expects.
_TYPED_TENSORS = {gguf.GGMLQuantizationType.F16: "f2", gguf.GGMLQuantizationType.F32: "f4",
                  gguf.GGMLQuantizationType.F64: "f8", gguf.GGMLQuantizationType.I8: "i1",
                  gguf.GGMLQuantizationType.I16: "i2", gguf.GGMLQuantizationType.I32: "i4",
                  gguf.GGMLQuantizationType.I64: "i8"}
_HOST_ORDER = "<" if sys.byteorder == "little" else ">"
_OTHER_ORDER = ">" if _HOST_ORDER == "<" else "<"
_PSEUDO_KEYS = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count")  # gguf's reader lists these as fields


class MappedTensor(NamedTuple):
    """One tensor of a MappedGGUF, with the attributes (and values) of gguf's ReaderTensor that the loader uses.

    `shape` is the dims in GGUF order (ne0 first) as a uint64 array; `data` a read-only view of the
    file's memmap: typed and in the logical (reversed) shape for F16/F32/F64/I8..I64, uint8 rows of
    bytes for every block-quantized type and BF16.
    """

    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: np.ndarray
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


class _Undecodable:
    """A metadata value gguf's ReaderField.contents() would fail on (invalid UTF-8): kept, not raised.

    Why defer: gguf's reader decodes values lazily, so a bad string only fails the key that holds it,
    and read_metadata decides per key whether that is fatal (skipped for descriptive general.* keys).
    """

    __slots__ = ("exc",)

    def __init__(self, exc: Exception):
        self.exc = exc


class _Parser:
    """Sequential reader of a GGUF header held in a bytes-like buffer (the file's mmap).

    Every length and count is checked against the bytes left in the file before anything is read,
    sliced or allocated, so a crafted 2**62 cannot become a huge allocation or a long loop; each
    failure is a ModelLoadError naming the file, what was being read and where.
    """

    def __init__(self, path: Path, raw: Any, size: int):
        self.path, self.raw, self.size = path, raw, size
        self.pos = 0
        self.where = ""
        self.set_order(_HOST_ORDER)

    def set_order(self, order: str) -> None:
        self.order = order
        self._u32 = struct.Struct(order + "I").unpack_from
        self._u64 = struct.Struct(order + "Q").unpack_from
        self.scalars = {t: struct.Struct(order + c) for t, c in _SCALAR_CHARS.items()}

    def error(self, problem: str) -> ModelLoadError:
        return ModelLoadError(self.path, problem + self.where)

    def truncated(self, n: int, what: str) -> ModelLoadError:
        return self.error(f"truncated or corrupt GGUF header: {what} needs {n} bytes at offset {self.pos}, "
                          f"the file has {max(0, self.size - self.pos)} left")

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise self.truncated(n, what)

    def u32(self, what: str) -> int:
        self.need(4, what)
        (v,) = self._u32(self.raw, self.pos)
        self.pos += 4
        return v

    def u64(self, what: str) -> int:
        self.need(8, what)
        (v,) = self._u64(self.raw, self.pos)
        self.pos += 8
        return v

    def span(self, what: str) -> tuple[int, int]:
        """(start, end) of a length-prefixed string, the position moved past it."""
        n = self.u64(f"the length of {what}")
        self.need(n, what)
        start = self.pos
        self.pos += n
        return start, self.pos

    def text(self, what: str) -> str:
        """A string that must decode (keys, tensor names: gguf's reader decodes them while parsing)."""
        start, end = self.span(what)
        try:
            return self.raw[start:end].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.error(f"{what} at offset {start} is not valid UTF-8 ({exc})") from None

    def value(self, vtype: int) -> Any:
        """One metadata value as gguf's ReaderField.contents() gives it (str, int, float, bool or a flat
        list), or an _Undecodable where contents() would raise."""
        if vtype == _STRING:
            start, end = self.span("a string value")
            try:
                return self.raw[start:end].decode("utf-8")
            except UnicodeDecodeError as exc:
                return _Undecodable(exc)
        st = self.scalars.get(vtype)
        if st is not None:
            self.need(st.size, "a value")
            (v,) = st.unpack_from(self.raw, self.pos)
            self.pos += st.size
            return v
        if vtype != _ARRAY:
            raise self.error(f"unknown GGUF value type {vtype}")
        itype = self.u32("an array's item type")
        count = self.u64("an array's length")
        if count == 0:
            return []  # gguf's reader never looks at the item type of an empty array
        st = self.scalars.get(itype)
        if st is not None:
            n = count * st.size
            self.need(n, f"an array of {count} values")
            arr = np.frombuffer(self.raw, dtype=self.order + _SCALAR_CHARS[itype], count=count, offset=self.pos)
            self.pos += n
            return arr.tolist()
        if itype == _STRING:
            return self.strings(count)
        return self.nested(itype, count)

    def strings(self, count: int) -> list[str] | _Undecodable:
        """An array of `count` strings decoded into a list (the vocabulary and merges: the hot loop).

        One unpack, one slice and one decode per item: a 150k-token vocabulary takes a fraction of
        a second. An item that is not UTF-8 makes the whole value an _Undecodable (as gguf's
        contents() fails on it), and the rest of the array is only walked.
        """
        self.need(count * 8, f"an array of {count} strings")  # each item is at least its u64 length
        raw, size, u64 = self.raw, self.size, self._u64
        pos = self.pos
        out: list[str] = []
        add = out.append
        done = 0
        try:
            for done in range(count):
                (n,) = u64(raw, pos)
                end = pos + 8 + n
                if end > size:
                    break
                add(raw[pos + 8:end].decode())
                pos = end
            else:
                self.pos = pos
                return out
        except UnicodeDecodeError as exc:
            self.pos = end
            self.skip_strings(count - done - 1)
            return _Undecodable(exc)
        except struct.error:  # fewer than 8 bytes left for a length
            pass
        self.pos = pos
        raise self.truncated(8 if pos + 8 > size else int(u64(raw, pos)[0]) + 8, "a string in an array")

    def skip_strings(self, count: int) -> None:
        """Walk past `count` length-prefixed strings, checking each against the end of the file."""
        for _ in range(count):
            self.span("a string in an array")

    def nested(self, itype: int, count: int) -> list[Any] | _Undecodable:
        """An array of arrays, flattened the way gguf's ReaderField.contents() flattens it.

        gguf keeps every leaf (string or scalar) and the type chain of the *first* element only; the
        innermost type of that chain decides how all leaves are read: as strings when it is STRING,
        else as numbers (a string leaf then contributes its bytes as ints). Rare and odd, but kept
        so that every file decodes to the same values as before.
        """
        leaves: list[tuple[int, int, int]] = []
        types = self._collect_array(itype, count, 1, leaves)
        try:
            if types[-1] == _STRING:
                return [self.raw[s:e].decode("utf-8") for _, s, e in leaves]
            out: list[Any] = []
            for t, s, e in leaves:
                if t == _STRING:
                    out.extend(self.raw[s:e])
                else:
                    out.append(self.scalars[t].unpack_from(self.raw, s)[0])
            return out
        except UnicodeDecodeError as exc:
            return _Undecodable(exc)

    def _collect_array(self, itype: int, count: int, depth: int, leaves: list[tuple[int, int, int]]) -> list[int]:
        if depth > _MAX_NESTING:
            raise self.error(f"arrays nested more than {_MAX_NESTING} deep")
        if count:
            st = self.scalars.get(itype)
            least = st.size if st is not None else 8 if itype == _STRING else 12 if itype == _ARRAY else None
            if least is None:
                raise self.error(f"unknown GGUF array item type {itype}")
            self.need(count * least, f"an array of {count} items")
        types = [_ARRAY]
        for i in range(count):
            chain = self._collect(itype, depth, leaves)
            if i == 0:
                types += chain
        return types

    def _collect(self, vtype: int, depth: int, leaves: list[tuple[int, int, int]]) -> list[int]:
        if vtype == _STRING:
            start, end = self.span("a string")
            leaves.append((vtype, start, end))
            return [vtype]
        st = self.scalars.get(vtype)
        if st is not None:
            self.need(st.size, "a value")
            leaves.append((vtype, self.pos, self.pos + st.size))
            self.pos += st.size
            return [vtype]
        itype = self.u32("an array's item type")
        count = self.u64("an array's length")
        return self._collect_array(itype, count, depth + 1, leaves)


class MappedGGUF:
    """A GGUF file mapped once, read-only: header parsed eagerly and fast, tensors as views of the map.

    What the load path needs of gguf.GGUFReader, in a fraction of the time: `tensors` (MappedTensor,
    same attributes and values as gguf's ReaderTensor), `data_offset`, `alignment`, `data` (the
    np.memmap; the engine aliases tensor views of it into device buffers, so it lives as long as
    this reader or any view does), and `metadata` (decoded values, file order). `fields` offers
    gguf's ReaderField objects for code written against gguf's reader, built per key on first access.

    Every malformed header -- bad magic, unsupported version, truncation, absurd counts or lengths,
    unknown types, duplicate keys or tensors, a tensor table that does not describe the file
    (check_tensor_layout) -- raises ModelLoadError naming the file.
    """

    def __init__(self, path: str | Path):
        p = Path(path)
        self.path = p
        try:
            mm = np.memmap(p, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as exc:  # ValueError: an empty file cannot be mapped
            raise ModelLoadError(p, f"cannot map file: {exc}") from exc
        self.data: np.memmap = mm
        raw = getattr(mm, "_mmap", None)  # the mmap object under the memmap: slices to bytes quickly
        if raw is None or len(raw) != mm.size:  # a numpy without it: map the file once more, read-only
            try:
                with open(p, "rb") as fh:
                    raw = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError) as exc:
                raise ModelLoadError(p, f"cannot map file: {exc}") from exc
        try:
            self._parse(raw, int(mm.size))
        except ModelLoadError:
            raise
        except Exception as exc:  # a safety net: the parser checks before it reads, nothing else should escape
            raise ModelLoadError(p, f"corrupt or truncated GGUF: {type(exc).__name__}: {exc}") from exc
        self._fields: _ReaderFields | None = None

    def _parse(self, raw: Any, size: int) -> None:
        p = self.path
        pr = _Parser(p, raw, size)
        magic = bytes(raw[:4])
        if magic != b"GGUF":
            raise ModelLoadError(p, f"not a GGUF file (magic {magic!r}, expected b'GGUF')")
        pr.pos = 4
        version = pr.u32("the version")
        if version & 0xFFFF == 0:  # gguf's test for a file written with the other byte order
            pr.set_order(_OTHER_ORDER)
            pr.pos = 4
            version = pr.u32("the version")
        if version not in SUPPORTED_VERSIONS:
            raise ModelLoadError(p, f"unsupported GGUF version {version} (versions "
                                    f"{', '.join(map(str, SUPPORTED_VERSIONS))} are supported)")
        self.byte_order = pr.order
        self.version = version
        n_tensors = pr.u64("the tensor count")
        n_kv = pr.u64("the metadata count")
        pr.need(n_kv * 12, f"{n_kv} metadata entries")  # each at least a key length and a value type

        values: dict[str, Any] = {}
        entries: dict[str, tuple[int, int]] = {}  # key -> (offset of the entry, value type)
        for _ in range(n_kv):
            at = pr.pos
            pr.where = ""
            key = pr.text("a metadata key")
            if key in entries or key in _PSEUDO_KEYS:
                raise ModelLoadError(p, f"metadata key {key!r} appears twice")
            pr.where = f" (metadata {key!r})"
            vtype = pr.u32("a value type")
            values[key] = pr.value(vtype)
            entries[key] = (at, vtype)
        pr.where = ""

        alignment = DEFAULT_ALIGNMENT
        if "general.alignment" in entries:
            vtype = entries["general.alignment"][1]
            if vtype != _UINT32:  # gguf's reader and llama.cpp accept only a u32
                raise ModelLoadError(p, f"general.alignment has type {_VT(vtype).name}, expected UINT32")
            alignment = _alignment(p, values["general.alignment"])

        pr.need(n_tensors * 24, f"{n_tensors} tensor infos")  # each at least name length, n_dims, type, offset
        infos: list[tuple[str, tuple[int, ...], int, int]] = []
        names: set[str] = set()
        for i in range(n_tensors):
            pr.where = f" (tensor info {i})"
            name = pr.text("a tensor name")
            pr.where = f" (tensor {name!r})"
            n_dims = pr.u32("the dimension count")
            if not 1 <= n_dims <= GGML_MAX_DIMS:
                raise ModelLoadError(p, f"tensor {name!r} has {n_dims} dimensions (1 to {GGML_MAX_DIMS} allowed)")
            pr.need(8 * n_dims, "the dimensions")
            dims = struct.unpack_from(f"{pr.order}{n_dims}Q", raw, pr.pos)
            pr.pos += 8 * n_dims
            type_id = pr.u32("the type")
            offset = pr.u64("the data offset")
            if name in names:
                raise ModelLoadError(p, f"tensor {name!r} is listed twice")
            names.add(name)
            infos.append((name, dims, type_id, offset))
        pr.where = ""
        data_offset = -(-pr.pos // alignment) * alignment
        check_tensor_layout(p, size, data_offset, alignment, infos)  # before any view is taken

        mm = self.data
        tensors: list[MappedTensor] = []
        for name, dims, type_id, offset in infos:
            qtype = gguf.GGMLQuantizationType(type_id)
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            n_elements = math.prod(dims)
            n_bytes = n_elements // block * type_size
            start = data_offset + offset
            logical = tuple(reversed(dims))
            view = mm[start:start + n_bytes]
            typed = _TYPED_TENSORS.get(qtype)
            if typed is not None:
                view = view.view(np.dtype(pr.order + typed)).reshape(logical)
            else:
                view = view.reshape(logical[:-1] + (logical[-1] // block * type_size,))
            tensors.append(MappedTensor(name, qtype, np.array(dims, dtype=pr.order + "u8"), n_elements, n_bytes,
                                        start, view))

        self.alignment = alignment
        self.data_offset = data_offset
        self.tensors = tensors
        self._values = values
        self._entries = entries

    @property
    def metadata(self) -> dict[str, Any]:
        """Every key's decoded value in file order, undecodable values left out (see read_metadata)."""
        return {k: v for k, v in self._values.items() if not isinstance(v, _Undecodable)}

    @property
    def fields(self) -> Mapping[str, ReaderField]:
        """gguf.GGUFReader.fields for code written against gguf's reader (GGUF.* pseudo keys included).

        Each ReaderField is built (per-item numpy views, as gguf builds them) only when its key is
        looked up, so the cost gguf's reader pays for a whole vocabulary is paid only by who asks.
        """
        if self._fields is None:
            self._fields = _ReaderFields(self)
        return self._fields

    def _reader_field(self, key: str) -> ReaderField:
        u8 = self.data.view(np.ndarray)
        order = self.byte_order

        def get(off: int, char: str, count: int = 1) -> np.ndarray:
            dt = np.dtype(order + char)
            return u8[off:off + dt.itemsize * count].view(dt)

        if key == "GGUF.version":
            return ReaderField(4, key, [get(4, "I")], [0], [_VT.UINT32])
        if key in ("GGUF.tensor_count", "GGUF.kv_count"):
            off = 8 if key == "GGUF.tensor_count" else 16
            return ReaderField(off, key, [get(off, "Q")], [0], [_VT.UINT64])
        at, vtype = self._entries[key]
        klen = get(at, "Q")
        kdata = get(at + 8, "B", int(klen[0]))
        pos = at + 8 + kdata.size
        head = [klen, kdata, get(pos, "I")]
        _, parts, idxs, types = self._value_parts(pos + 4, vtype, get)
        return ReaderField(at, key, head + parts, [i + len(head) for i in idxs], types)

    def _value_parts(self, pos: int, vtype: int, get: Any) -> tuple[int, list[np.ndarray], list[int], list[Any]]:
        """(size, parts, indexes of the data parts, types) of a value the parse already validated."""
        if vtype == _STRING:
            n = get(pos, "Q")
            return 8 + int(n[0]), [n, get(pos + 8, "B", int(n[0]))], [1], [_VT.STRING]
        char = _SCALAR_CHARS.get(vtype)
        if char is not None:
            v = get(pos, char)
            return int(v.nbytes), [v], [0], [_VT(vtype)]
        itype, count = get(pos, "I"), get(pos + 4, "Q")
        parts: list[np.ndarray] = [itype, count]
        idxs: list[int] = []
        types: list[Any] = [_VT.ARRAY]
        cur = pos + 12
        for i in range(int(count[0])):
            size, sub_parts, sub_idxs, sub_types = self._value_parts(cur, int(itype[0]), get)
            if i == 0:
                types += sub_types
            idxs += [len(parts) + j for j in sub_idxs]
            parts += sub_parts
            cur += size
        return cur - pos, parts, idxs, types


class _ReaderFields(Mapping[str, ReaderField]):
    """The lazily built `fields` mapping of a MappedGGUF (see MappedGGUF.fields)."""

    def __init__(self, reader: MappedGGUF):
        self._reader = reader
        self._built: dict[str, ReaderField] = {}

    def __getitem__(self, key: str) -> ReaderField:
        f = self._built.get(key)
        if f is None:
            if key not in _PSEUDO_KEYS and key not in self._reader._entries:
                raise KeyError(key)
            f = self._built[key] = self._reader._reader_field(key)
        return f

    def __iter__(self) -> Iterator[str]:
        yield from _PSEUDO_KEYS
        yield from self._reader._entries

    def __len__(self) -> int:
        return len(_PSEUDO_KEYS) + len(self._reader._entries)

    def __contains__(self, key: object) -> bool:
        return key in _PSEUDO_KEYS or key in self._reader._entries


def open_reader(path: str | Path) -> MappedGGUF:
    """Memory-map a GGUF file and parse its header, every failure a ModelLoadError naming the file.

    Readers are cached per (path, size, mtime): loading a model again, or its tokenizer alone,
    reuses the parse and the mapping (a rewritten file has a new mtime, so it is parsed again).
    """
    p = Path(path).expanduser().resolve()
    try:
        st = p.stat()
    except OSError:
        st = None
    if st is not None:
        return _open_cached(p, st.st_size, st.st_mtime_ns)
    return _open_uncached(p)


@functools.lru_cache(maxsize=4)
def _open_cached(p: Path, size: int, mtime_ns: int) -> MappedGGUF:
    return _open_uncached(p)


def _open_uncached(p: Path) -> MappedGGUF:
    if not p.exists():
        raise ModelLoadError(p, "file does not exist")
    if not p.is_file():
        raise ModelLoadError(p, "not a regular file")
    try:
        with open(p, "rb") as fh:
            magic = fh.read(4)
    except OSError as exc:
        raise ModelLoadError(p, f"cannot read file: {exc}") from exc
    if magic != b"GGUF":  # checked before mapping: an empty file cannot be mapped, and says this better
        raise ModelLoadError(p, f"not a GGUF file (magic {magic!r}, expected b'GGUF')")
    return MappedGGUF(p)  # parses the header and checks the tensor table (check_tensor_layout)


def _alignment(path: Path, value: Any) -> int:
    if value is None:
        return DEFAULT_ALIGNMENT
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0 or value & (value - 1):
        raise ModelLoadError(path, f"general.alignment = {value!r} is not a power of two")
    return value


def check_tensor_layout(path: Path, file_size: int, data_start: int, alignment: int,
                        tensors: Iterable[tuple[str, tuple[int, ...], int, int]]) -> None:
    """Refuse a tensor table that does not describe the file: ModelLoadError naming the tensor.

    `tensors`: (name, dims in GGUF order, ggml type id, offset from `data_start`) in table order.
    What llama.cpp's gguf reader enforces, so a file it would refuse is refused here too: 1..4
    dimensions of at least one element, a known type whose block size divides the first
    dimension, each tensor starting where the previous one ended (padded to the alignment), and
    every byte inside the file. A type flipped to one of another size breaks the chain of offsets;
    a truncated file or a dimension that overflows ends past the end.
    """
    expected = 0
    for name, dims, type_id, offset in tensors:
        if not 1 <= len(dims) <= GGML_MAX_DIMS:
            raise ModelLoadError(path, f"tensor {name!r} has {len(dims)} dimensions (1 to {GGML_MAX_DIMS} allowed)")
        if any(d < 1 for d in dims):
            raise ModelLoadError(path, f"tensor {name!r} has an empty dimension: {list(dims)}")
        try:
            qtype = gguf.GGMLQuantizationType(type_id)
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise ModelLoadError(path, f"tensor {name!r} has unknown type id {type_id}") from None
        if dims[0] % block:
            raise ModelLoadError(path, f"tensor {name!r}: {qtype.name} needs rows of a multiple of {block} "
                                       f"values, got {dims[0]}")
        n_bytes = math.prod(dims) // block * type_size
        if offset != expected:
            raise ModelLoadError(path, f"tensor {name!r} starts at data offset {offset}, expected {expected} "
                                       "(a wrong type or size in the tensor table)")
        end = data_start + offset + n_bytes
        if end > file_size:
            raise ModelLoadError(path, f"truncated: tensor {name!r} ends at byte {end}, the file has {file_size}")
        expected = offset + -(-n_bytes // alignment) * alignment


def read_metadata(reader: MappedGGUF | gguf.GGUFReader, path: str | Path | None = None) -> dict[str, Any]:
    """All key/value pairs of the file, decoded (strings as str, arrays as lists), in file order.

    A descriptive `general.*` value that cannot be decoded (bad UTF-8 in a name or licence) is
    skipped; any other undecodable key fails with ModelLoadError naming it, since the model would
    otherwise be built from a silently missing value ("no tokenizer" for a damaged vocabulary).
    Works on a MappedGGUF (values decoded at parse time) and on a gguf.GGUFReader (decoded here),
    with the same result. Lists are fresh copies: a caller may change them without touching the
    cached reader.
    """
    where = path if path is not None else getattr(getattr(reader, "data", None), "filename", None) or "?"
    items = reader._values.items() if isinstance(reader, MappedGGUF) else _gguf_reader_values(reader)
    out: dict[str, Any] = {}
    for key, value in items:
        if key.startswith("GGUF."):
            continue
        if isinstance(value, _Undecodable):
            if key.startswith(_SKIPPABLE_PREFIXES) and key not in _NEEDED_GENERAL_KEYS:
                continue
            exc = value.exc
            raise ModelLoadError(where, f"metadata {key!r} cannot be decoded: {type(exc).__name__}: {exc}") from exc
        out[key] = list(value) if isinstance(value, list) else value
    return out


def _gguf_reader_values(reader: gguf.GGUFReader) -> Iterator[tuple[str, Any]]:
    """(key, contents() or _Undecodable) of every field of a gguf.GGUFReader."""
    for key, field in reader.fields.items():
        try:
            yield key, field.contents()
        except Exception as exc:
            yield key, _Undecodable(exc)
