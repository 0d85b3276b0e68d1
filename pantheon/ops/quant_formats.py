"""GGUF weight formats: the one table of what the engine can hold and multiply without widening.

Every format a weight may stay in on the device is listed here with its ggml type id and block
geometry (weights per block, bytes per block). The loader (pantheon.ops.weights), the native CPU kernels
(pantheon.ops.native) and the XLA expansion below all read this table; nothing else spells a block size.

Block formats are stored as `uint8 [..., rows, cols / block_weights * block_bytes]` (one matrix row
is a run of whole blocks, so rows can be sliced, gathered and split over dies freely). Float formats
(F32, F16, BF16) are stored as `[..., rows, cols]` in their own dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from numpy.typing import DTypeLike


@dataclass(frozen=True)
class Format:
    """One GGUF tensor type: its name, ggml type id, and how many weights / bytes a block holds."""

    name: str
    type_id: int
    block_weights: int
    block_bytes: int

    @property
    def is_block(self) -> bool:
        """Stored as raw uint8 blocks (else as an array of its own float dtype)."""
        return self.name not in FLOAT_FORMATS

    def row_bytes(self, cols: int) -> int:
        """Bytes of one row of `cols` weights (cols must be a multiple of block_weights)."""
        return cols // self.block_weights * self.block_bytes


FLOAT_FORMATS = ("F32", "F16", "BF16")

FORMATS: dict[str, Format] = {f.name: f for f in (
    Format("F32", 0, 1, 4),
    Format("F16", 1, 1, 2),
    Format("BF16", 30, 1, 2),
    Format("Q4_0", 2, 32, 18),
    Format("Q4_1", 3, 32, 20),
    Format("Q5_0", 6, 32, 22),
    Format("Q5_1", 7, 32, 24),
    Format("Q8_0", 8, 32, 34),
    Format("Q2_K", 10, 256, 84),
    Format("Q3_K", 11, 256, 110),
    Format("Q4_K", 12, 256, 144),
    Format("Q5_K", 13, 256, 176),
    Format("Q6_K", 14, 256, 210),
    Format("IQ4_NL", 20, 32, 18),
    Format("IQ4_XS", 23, 256, 136),
)}

BLOCK_FORMATS = tuple(n for n in FORMATS if n not in FLOAT_FORMATS)


# ---------------------------------------------------------------------------------------------
# Storage geometry
# ---------------------------------------------------------------------------------------------

def _format(qtype: str) -> Format:
    try:
        return FORMATS[qtype]
    except KeyError:
        raise ValueError(f"unknown weight format {qtype!r} (known: {', '.join(FORMATS)})") from None


def _check_cols(fmt: Format, cols: int) -> None:
    if cols <= 0 or cols % fmt.block_weights:
        raise ValueError(f"{fmt.name}: a row of {cols} weights is not a whole number of "
                         f"{fmt.block_weights}-weight blocks")


def storage_shape(qtype: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The array shape a tensor of logical shape (..., cols) is held in: (..., row_bytes) uint8 for a
    block format (a row stays one run of whole blocks), the logical shape itself for a float format."""
    fmt = _format(qtype)
    shape = tuple(int(n) for n in shape)
    if not shape:
        raise ValueError("a weight tensor needs at least one axis")
    if not fmt.is_block:
        return shape
    _check_cols(fmt, shape[-1])
    return (*shape[:-1], fmt.row_bytes(shape[-1]))


def nbytes(qtype: str, shape: tuple[int, ...]) -> int:
    """Bytes a tensor of logical shape (..., cols) takes in format `qtype` (what the loader reads and
    the memory planner budgets)."""
    fmt = _format(qtype)
    stored = storage_shape(qtype, shape)
    return math.prod(stored) * (1 if fmt.is_block else fmt.block_bytes)


def storage_dtype(qtype: str) -> np.dtype:
    """Element dtype of the stored array: uint8 for block formats, the float dtype otherwise."""
    fmt = _format(qtype)
    return {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
            "BF16": np.dtype(jnp.bfloat16)}.get(fmt.name, np.dtype(np.uint8))


# ---------------------------------------------------------------------------------------------
# Expansion (dequantization) as XLA ops
#
# Each expander maps uint8 blocks [..., block_bytes] to f32 weights [..., block_weights] with
# broadcast shifts/masks only (no gathers, no int64), so XLA fuses the whole expansion into
# whatever consumes the weights and it partitions like any elementwise op.
#
# Exactness against gguf.quants.dequantize: every product here is of an f16 scale (11 significant
# bits), small integer sub-scales and quants whose significant bits add up to at most 23, so each
# product is exact in f32 (and no f16 value is small enough to underflow it). The only rounding is
# therefore the one final add/subtract of the min formats, so the result depends neither on
# association nor on XLA/LLVM contracting `a*b - c` into an FMA (XLA:CPU does contract it): an FMA
# rounds the same exact value once. Worst cases: Q6_K 11 + 7 (|int8 scale| <= 128) + 5 (|q| <= 32)
# = 23; IQ4_XS 11 + 5 (scale in -32..31) + 7 (codebook |v| <= 127) = 23; Q5_K 11 + 6 + 5 = 22.
# ---------------------------------------------------------------------------------------------

_Expander = Callable[[jax.Array], jax.Array]
_EXPANDERS: dict[str, _Expander] = {}


def _expander(name: str) -> Callable[[_Expander], _Expander]:
    def register(fn: _Expander) -> _Expander:
        _EXPANDERS[name] = fn
        return fn
    return register


def _f16(blocks: jax.Array, at: int) -> jax.Array:
    """The little-endian f16 at byte `at` of each block, widened (exactly) to f32, as [..., 1] so it
    broadcasts over the block. Assembled with shifts so the byte order never depends on the host."""
    bits = blocks[..., at].astype(jnp.uint16) | (blocks[..., at + 1].astype(jnp.uint16) << 8)
    return lax.bitcast_convert_type(bits, jnp.float16).astype(jnp.float32)[..., None]


def _fields(x: jax.Array, shifts: tuple[int, ...], mask: int, run: int) -> jax.Array:
    """Unpack bit fields: x [..., n] uint8, taken in runs of `run` bytes; each run yields its field at
    every shift in turn: out[..., (r * len(shifts) + s) * run + i] = (x[..., r*run + i] >> shifts[s]) & mask.
    This is the interleaving ggml uses for nibbles, 2-bit pairs and high-bit planes."""
    lead = x.shape[:-1]
    x = x.reshape(*lead, -1, 1, run)
    s = np.asarray(shifts, np.uint8).reshape(-1, 1)
    return ((x >> s) & np.uint8(mask)).reshape(*lead, -1)


_NIBBLES = (0, 4)
_PAIRS = (0, 2, 4, 6)
_BITS = tuple(range(8))


def _f32(q: jax.Array, offset: int = 0) -> jax.Array:
    """Small unsigned quants (< 128) minus `offset`, as exact f32."""
    if offset:
        q = q.astype(jnp.int8) - jnp.int8(offset)
    return q.astype(jnp.float32)


def _i8(x: jax.Array) -> jax.Array:
    """Bytes reinterpreted as int8, as exact f32."""
    return lax.bitcast_convert_type(x, jnp.int8).astype(jnp.float32)


def _per_group(q: jax.Array, scale: jax.Array) -> jax.Array:
    """q [..., G*W] times a scale per group of W consecutive weights (scale [..., G])."""
    lead = q.shape[:-1]
    return (scale[..., :, None] * q.reshape(*lead, scale.shape[-1], -1)).reshape(*lead, -1)


def _sub_per_group(x: jax.Array, sub: jax.Array) -> jax.Array:
    """x [..., G*W] minus a value per group of W weights (sub [..., G])."""
    lead = x.shape[:-1]
    return (x.reshape(*lead, sub.shape[-1], -1) - sub[..., :, None]).reshape(*lead, -1)


# Legacy 32-weight formats: one f16 scale d (and min m) per block; 4-bit quants as nibbles
# (low nibbles are weights 0..15, high nibbles 16..31), Q5 adds a 32-bit plane of 5th bits.

@_expander("Q4_0")
def _q4_0(b: jax.Array) -> jax.Array:
    return _f16(b, 0) * _f32(_fields(b[..., 2:], _NIBBLES, 0xF, 16), 8)


@_expander("Q4_1")
def _q4_1(b: jax.Array) -> jax.Array:
    return (_f16(b, 0) * _f32(_fields(b[..., 4:], _NIBBLES, 0xF, 16))) + _f16(b, 2)


def _q5(low: jax.Array, high: jax.Array) -> jax.Array:
    """5-bit quants: nibbles of `low` (16 bytes) plus bit j of the 4-byte little-endian `high`."""
    return _fields(low, _NIBBLES, 0xF, 16) | (_fields(high, _BITS, 1, 1) << 4)


@_expander("Q5_0")
def _q5_0(b: jax.Array) -> jax.Array:
    return _f16(b, 0) * _f32(_q5(b[..., 6:], b[..., 2:6]), 16)


@_expander("Q5_1")
def _q5_1(b: jax.Array) -> jax.Array:
    return (_f16(b, 0) * _f32(_q5(b[..., 8:], b[..., 4:8]))) + _f16(b, 2)


@_expander("Q8_0")
def _q8_0(b: jax.Array) -> jax.Array:
    return _i8(b[..., 2:]) * _f16(b, 0)


# K-quants: 256-weight super-blocks with f16 d (and dmin), and per-16- or per-32-weight integer
# sub-scales; each sub-block scale is d * sc (exact), then weight = (d*sc) * q [- dmin*m].

@_expander("Q2_K")
def _q2_k(b: jax.Array) -> jax.Array:
    sc = b[..., :16]
    q = _f32(_fields(b[..., 16:80], _PAIRS, 3, 32))
    d, dmin = _f16(b, 80), _f16(b, 82)
    return _sub_per_group(_per_group(q, d * _f32(sc & 0xF)), dmin * _f32(sc >> 4))


@_expander("Q3_K")
def _q3_k(b: jax.Array) -> jax.Array:
    # 16 6-bit scales: low nibbles from bytes 96..103, top two bits from 2-bit pairs of 104..107.
    low = _fields(b[..., 96:104], _NIBBLES, 0xF, 8)
    high = _fields(b[..., 104:108], _PAIRS, 3, 4)
    scale = _f16(b, 108) * _f32(low | (high << 4), 32)
    # 3-bit quants: 2 low bits, minus 4 where the hmask bit is *clear*.
    ql = _fields(b[..., 32:96], _PAIRS, 3, 32).astype(jnp.int8)
    hclear = (_fields(b[..., :32], _BITS, 1, 32) ^ 1).astype(jnp.int8)
    return _per_group((ql - (hclear << 2)).astype(jnp.float32), scale)


def _k_scale_min(s: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The 8 6-bit (scale, min) pairs packed in 12 bytes (Q4_K/Q5_K): sub-blocks 0..3 are the low
    6 bits of bytes 0..3 (scales) / 4..7 (mins); sub-blocks 4..7 are the low / high nibbles of bytes
    8..11 plus, as bits 4..5, the top 2 bits of bytes 0..3 / 4..7.

    Both halves are one broadcast formula with per-half shifts and masks (a concatenate here would
    become per-weight selects inside the fused loop, several times slower on CPU)."""
    lead = s.shape[:-1]
    sc, mn, low = (s[..., i:i + 4].reshape(*lead, 1, 4) for i in (0, 4, 8))
    shift = np.array([[0], [2]], np.uint8)
    top = np.array([[0x3F], [0x30]], np.uint8)
    nib = np.array([[0x00], [0x0F]], np.uint8)
    sc = ((sc >> shift) & top) | (low & nib)
    mn = ((mn >> shift) & top) | ((low >> 4) & nib)
    return _f32(sc.reshape(*lead, 8)), _f32(mn.reshape(*lead, 8))


def _with_min(b: jax.Array, q: jax.Array) -> jax.Array:
    """(d*sc) * q - (dmin*m) over the 8 32-weight sub-blocks of a Q4_K/Q5_K block."""
    sc, mn = _k_scale_min(b[..., 4:16])
    return _sub_per_group(_per_group(_f32(q), _f16(b, 0) * sc), _f16(b, 2) * mn)


@_expander("Q4_K")
def _q4_k(b: jax.Array) -> jax.Array:
    return _with_min(b, _fields(b[..., 16:], _NIBBLES, 0xF, 32))


@_expander("Q5_K")
def _q5_k(b: jax.Array) -> jax.Array:
    q = _fields(b[..., 48:], _NIBBLES, 0xF, 32) | (_fields(b[..., 16:48], _BITS, 1, 32) << 4)
    return _with_min(b, q)


@_expander("Q6_K")
def _q6_k(b: jax.Array) -> jax.Array:
    q = _fields(b[..., :128], _NIBBLES, 0xF, 64) | (_fields(b[..., 128:192], _PAIRS, 3, 32) << 4)
    return _per_group(_f32(q, 32), _f16(b, 208) * _i8(b[..., 192:208]))


# Non-linear 4-bit: each nibble indexes a fixed 16-entry int8 codebook.

_IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
# The codebook as four little-endian uint32 words of four int8 entries each.
_IQ4_WORDS = tuple(int.from_bytes(np.asarray(_IQ4_VALUES[i:i + 4], np.int8).tobytes(), "little")
                   for i in range(0, 16, 4))


def _iq4_lookup(q: jax.Array) -> jax.Array:
    """Codebook value of each nibble as f32. Two selects pick the word, a shift the byte: pure
    elementwise integer ops where a table gather would break fusion/partitioning."""
    w = [np.uint32(x) for x in _IQ4_WORDS]
    word = jnp.where(q < 8, jnp.where(q < 4, w[0], w[1]), jnp.where(q < 12, w[2], w[3]))
    byte = (word >> ((q & 3) * 8).astype(jnp.uint32)).astype(jnp.uint8)
    return _i8(byte)


@_expander("IQ4_NL")
def _iq4_nl(b: jax.Array) -> jax.Array:
    return _f16(b, 0) * _iq4_lookup(_fields(b[..., 2:], _NIBBLES, 0xF, 16))


@_expander("IQ4_XS")
def _iq4_xs(b: jax.Array) -> jax.Array:
    # 8 6-bit scales: low nibbles from bytes 4..7 (byte-major), top 2 bits from the u16 at 2..3.
    sc = _fields(b[..., 4:8], _NIBBLES, 0xF, 1) | (_fields(b[..., 2:4], _PAIRS, 3, 1) << 4)
    q = _iq4_lookup(_fields(b[..., 8:], _NIBBLES, 0xF, 16))
    return _per_group(q, _f16(b, 0) * _f32(sc, 32))


def _expand_float(data: jax.Array, fmt: Format) -> jax.Array:
    """Float formats widen to f32; BF16 by the 16-bit shift (keeps NaN payloads, as gguf does)."""
    want = storage_dtype(fmt.name)
    if data.dtype != want:
        raise TypeError(f"{fmt.name} weights must be stored as {want}, got {data.dtype}")
    if fmt.name == "BF16":
        bits = lax.bitcast_convert_type(data, jnp.uint16).astype(jnp.uint32) << 16
        return lax.bitcast_convert_type(bits, jnp.float32)
    return data.astype(jnp.float32)


def expand(data: jax.Array, qtype: str, cols: int, dtype: DTypeLike = jnp.float32) -> jax.Array:
    """data: uint8 [..., rows, cols/bw*bb] blocks of format `qtype` (or for F32/F16/BF16 an array
    [..., rows, cols] of that dtype) -> [..., rows, cols] weights in `dtype`.

    Traceable (qtype and cols are static), any leading axes. The f32 result is bit-for-bit
    gguf.quants.dequantize; other dtypes are that f32 value rounded once."""
    fmt = _format(qtype)
    _check_cols(fmt, cols)
    data = jnp.asarray(data)
    if not fmt.is_block:
        if data.shape[-1:] != (cols,):
            raise ValueError(f"{qtype}: expected rows of {cols} weights, got shape {data.shape}")
        out = _expand_float(data, fmt)
    else:
        if data.dtype != jnp.uint8 or data.shape[-1:] != (fmt.row_bytes(cols),):
            raise ValueError(f"{qtype}: expected uint8 rows of {fmt.row_bytes(cols)} bytes for {cols} "
                             f"weights, got {data.dtype} {data.shape}")
        lead = data.shape[:-1]
        blocks = data.reshape(*lead, cols // fmt.block_weights, fmt.block_bytes)
        out = _EXPANDERS[qtype](blocks).reshape(*lead, cols)
    return out if out.dtype == jnp.dtype(dtype) else out.astype(dtype)


def expand_rows(data: jax.Array, ids: jax.Array, qtype: str, cols: int,
                dtype: DTypeLike = jnp.float32) -> jax.Array:
    """Rows `ids` (any int shape) of a [rows, bytes] matrix, expanded: [*ids.shape, cols]. The
    embedding gather: only the gathered rows are expanded (rows are whole runs of blocks, so
    gathering stored bytes first is exact). Indices follow jnp indexing: negative ones count from
    the end, out-of-range ones clamp."""
    data = jnp.asarray(data)
    if data.ndim != 2:
        raise ValueError(f"expand_rows wants a [rows, bytes] matrix, got shape {data.shape}")
    return expand(data[jnp.asarray(ids)], qtype, cols, dtype)
