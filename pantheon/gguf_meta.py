"""GGUF metadata as plain Python values.

Kept apart from the tensor loader so the tokenizer and chat-template code can read a file's
vocabulary without touching its weights.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import gguf

from .errors import ModelLoadError


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
        return gguf.GGUFReader(str(p), "r")
    except Exception as exc:  # the reader raises ValueError/IndexError/struct errors on damage
        raise ModelLoadError(p, f"corrupt or truncated GGUF: {type(exc).__name__}: {exc}") from exc


def read_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """All key/value pairs of the file, decoded (strings as str, arrays as lists)."""
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            out[key] = field.contents()
        except Exception:  # an undecodable value is skipped rather than failing the whole load
            continue
    return out
