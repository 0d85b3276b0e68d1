"""GGUF metadata as plain Python values, and the checks every reader of a GGUF's layout shares.

Kept apart from the tensor loader so the tokenizer and chat-template code can read a file's
vocabulary without touching its weights. `check_tensor_layout` lives here because two readers walk
a file's tensor table -- gguf's reader on the load path and pantheon.dies' header scan for the load
estimate -- and a damaged table must be refused by both the same way (a ModelLoadError naming the
tensor), never turned into an absurd estimate, a huge allocation or a raw exception.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import gguf

from .errors import ModelLoadError

GGML_MAX_DIMS = 4  # ggml tensors have at most four dimensions (ggml.h)
DEFAULT_ALIGNMENT = 32  # GGUF's data alignment when general.alignment is absent
# Keys whose value may be skipped when it cannot be decoded: descriptive only, nothing reads them to
# build the model. Any other undecodable key (architecture, tokenizer, hyper-parameters) fails the load.
_SKIPPABLE_PREFIXES = ("general.",)
_NEEDED_GENERAL_KEYS = ("general.architecture", "general.alignment")


def open_reader(path: str | Path) -> gguf.GGUFReader:
    """Memory-map a GGUF file, turning every parse failure into a ModelLoadError naming the file.

    Parsing a large vocabulary takes gguf's reader seconds, so readers are cached per
    (path, size, mtime): loading a model again, or its tokenizer alone, reuses the parse.
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
def _open_cached(p: Path, size: int, mtime_ns: int) -> gguf.GGUFReader:
    return _open_uncached(p)


def _open_uncached(p: Path) -> gguf.GGUFReader:
    if not p.exists():
        raise ModelLoadError(p, "file does not exist")
    if not p.is_file():
        raise ModelLoadError(p, "not a regular file")
    try:
        with open(p, "rb") as fh:
            magic = fh.read(4)
    except OSError as exc:
        raise ModelLoadError(p, f"cannot read file: {exc}") from exc
    if magic != b"GGUF":
        raise ModelLoadError(p, f"not a GGUF file (magic {magic!r}, expected b'GGUF')")
    try:
        reader = gguf.GGUFReader(str(p), "r")
    except Exception as exc:  # the reader raises ValueError/IndexError/struct errors/MemoryError on damage
        raise ModelLoadError(p, f"corrupt or truncated GGUF: {type(exc).__name__}: {exc}") from exc
    alignment = _alignment(p, reader.fields["general.alignment"].contents()
                           if "general.alignment" in reader.fields else None)
    check_tensor_layout(p, p.stat().st_size, int(reader.data_offset), alignment,
                        ((t.name, tuple(int(d) for d in t.shape), int(t.tensor_type), int(t.data_offset)
                          - int(reader.data_offset)) for t in reader.tensors))
    return reader


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


def read_metadata(reader: gguf.GGUFReader, path: str | Path | None = None) -> dict[str, Any]:
    """All key/value pairs of the file, decoded (strings as str, arrays as lists).

    A descriptive `general.*` value that cannot be decoded (bad UTF-8 in a name or licence) is
    skipped; any other undecodable key fails with ModelLoadError naming it, since the model would
    otherwise be built from a silently missing value ("no tokenizer" for a damaged vocabulary).
    """
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            out[key] = field.contents()
        except Exception as exc:
            if key.startswith(_SKIPPABLE_PREFIXES) and key not in _NEEDED_GENERAL_KEYS:
                continue
            where = path if path is not None else getattr(getattr(reader, "data", None), "filename", None) or "?"
            raise ModelLoadError(where, f"metadata {key!r} cannot be decoded: {type(exc).__name__}: {exc}") from exc
    return out
