"""pantheon.ops.quant_formats: XLA expansion of GGUF weight blocks, bit for bit gguf.quants.dequantize.

The reference is the gguf package's numpy dequantizer; results are compared as uint32 bit patterns,
so -0.0 vs 0.0 and any rounding difference (e.g. from an FMA contraction, which XLA:CPU does emit
for `a*b - c`) fail the test.
"""

from __future__ import annotations

import functools

import gguf
import gguf.quants as gq
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pantheon.ops import quant_formats as qf

# Byte offsets of the f16 scale fields (d, and dmin/m where the format has one) inside one block,
# per the ggml block structs. Everything else in a block is quant / sub-scale bits, any value valid.
SCALE_FIELDS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
    "IQ4_NL": (0,), "IQ4_XS": (0,),
}

# Edge f16 scales: zeros of both signs, the smallest subnormals, the subnormal/normal boundary,
# ordinary values of both signs, and the largest finite magnitudes.
EDGE_SCALES = np.array([0.0, -0.0, 2.0 ** -24, -(2.0 ** -24), 3 * 2.0 ** -24, 1e-6, -4.5e-6,
                        6.097e-5, 6.1035e-5, 1.0, -1.0, 0.0123, -3.75, 6e4, -6e4, 65504.0, -65504.0],
                       dtype=np.float16)


def random_f16(rng: np.random.Generator, n: int) -> np.ndarray:
    """n f16 values: half drawn from EDGE_SCALES, half uniformly random finite bit patterns."""
    bits = rng.integers(0, 1 << 16, n, dtype=np.uint32).astype(np.uint16)
    bits = np.where((bits & 0x7C00) == 0x7C00, bits & 0x83FF, bits)  # exponent 31 (inf/NaN) -> 0
    edge = rng.choice(EDGE_SCALES.view(np.uint16), n)
    return np.where(rng.random(n) < 0.5, edge, bits).astype(np.uint16).view(np.float16)


def random_blocks(name: str, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """uint8 storage for logical `shape`: random quant bits, scales from random_f16."""
    fmt = qf.FORMATS[name]
    stored = qf.storage_shape(name, shape)
    data = rng.integers(0, 256, stored, dtype=np.uint8)
    blocks = data.reshape(-1, fmt.block_bytes)
    for at in SCALE_FIELDS[name]:
        blocks[:, at:at + 2] = random_f16(rng, len(blocks)).view(np.uint8).reshape(-1, 2)
    return data


def reference(data: np.ndarray, name: str) -> np.ndarray:
    return gq.dequantize(data, gguf.GGMLQuantizationType[name])


def assert_bits_equal(got, want: np.ndarray) -> None:
    got = np.asarray(got)
    assert got.dtype == np.float32 and got.shape == want.shape
    diff = got.view(np.uint32) != want.view(np.uint32)
    assert not diff.any(), f"{diff.sum()} of {diff.size} weights differ, first at {np.argwhere(diff)[0]}: " \
                           f"{got[diff][0]!r} vs {want[diff][0]!r}"


@functools.cache
def jitted(name: str, cols: int, dtype=jnp.float32):
    return jax.jit(functools.partial(qf.expand, qtype=name, cols=cols, dtype=dtype))


def logical_shape(name: str) -> tuple[int, ...]:
    """Small but with two leading axes, several rows and more than one block per row."""
    return (2, 3, 2 * qf.FORMATS[name].block_weights)


# --- block formats ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", qf.BLOCK_FORMATS)
def test_block_expansion_is_bit_exact_eager_and_jitted(name):
    rng = np.random.default_rng(sum(map(ord, name)))
    shape = logical_shape(name)
    data = random_blocks(name, rng, shape)
    want = reference(data, name)
    assert np.isfinite(want).all()
    assert_bits_equal(qf.expand(jnp.asarray(data), name, shape[-1]), want)
    assert_bits_equal(jitted(name, shape[-1])(data), want)


@pytest.mark.parametrize("name", qf.BLOCK_FORMATS)
def test_every_scale_is_an_edge_case(name):
    """All scale fields set to each edge value in turn (incl. both zeros and subnormals), for the
    sign-of-zero and subnormal paths that random draws rarely hit together."""
    rng = np.random.default_rng(7)
    fmt = qf.FORMATS[name]
    cols = fmt.block_weights
    data = rng.integers(0, 256, (len(EDGE_SCALES) ** len(SCALE_FIELDS[name]), fmt.block_bytes), dtype=np.uint8)
    grids = np.meshgrid(*[EDGE_SCALES.view(np.uint16)] * len(SCALE_FIELDS[name]), indexing="ij")
    for at, vals in zip(SCALE_FIELDS[name], grids):
        data[:, at:at + 2] = vals.reshape(-1).view(np.uint8).reshape(-1, 2)
    assert_bits_equal(jitted(name, cols)(data), reference(data, name))


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_expansion_of_real_quantized_weights(name):
    """Weights quantized by gguf itself (realistic scales and quant distributions) expand exactly."""
    w = np.random.default_rng(3).standard_normal((4, 96)).astype(np.float32) * 0.05
    data = gq.quantize(w, gguf.GGMLQuantizationType[name])
    assert_bits_equal(jitted(name, 96)(data), reference(data, name))


@pytest.mark.parametrize("name", qf.BLOCK_FORMATS)
def test_expansion_is_elementwise_integer_work(name):
    """No gathers and no 64-bit integers in the traced expansion: it must fuse and partition like
    elementwise code on every backend."""
    cols = qf.FORMATS[name].block_weights
    jaxpr = jax.make_jaxpr(functools.partial(qf.expand, qtype=name, cols=cols))(
        jnp.zeros(qf.storage_shape(name, (2, cols)), jnp.uint8))
    prims = {str(e.primitive) for e in jaxpr.eqns}
    assert not prims & {"gather", "dynamic_slice", "scatter"}, prims
    dtypes = {str(v.aval.dtype) for e in jaxpr.eqns for v in [*e.invars, *e.outvars] if hasattr(v, "aval")}
    assert not dtypes & {"int64", "uint64", "float64"}, dtypes


def test_no_leading_axes_and_many_leading_axes():
    rng = np.random.default_rng(11)
    for shape in [(256,), (2, 1, 2, 256)]:
        data = random_blocks("Q4_K", rng, shape)
        assert_bits_equal(jitted("Q4_K", 256)(data), reference(data, "Q4_K"))


def test_wrong_storage_is_rejected():
    with pytest.raises(ValueError):
        qf.expand(jnp.zeros((2, 143), jnp.uint8), "Q4_K", 256)
    with pytest.raises(ValueError):
        qf.expand(jnp.zeros((2, 144), jnp.uint8), "Q4_K", 250)
    with pytest.raises(TypeError):
        qf.expand(jnp.zeros((2, 8), jnp.float32), "F16", 8)
    with pytest.raises(ValueError):
        qf.expand(jnp.zeros((2, 144), jnp.uint8), "Q9_Z", 256)


# --- float formats ----------------------------------------------------------------------------

def random_float_bits(rng: np.random.Generator, dtype, shape) -> np.ndarray:
    """Random finite bit patterns (every exponent incl. subnormals) plus +-inf and zeros."""
    bits_t = {2: np.uint16, 4: np.uint32}[np.dtype(dtype).itemsize]
    x = rng.integers(0, 1 << (8 * np.dtype(dtype).itemsize), shape, dtype=np.uint64).astype(bits_t).view(dtype)
    x = np.where(np.isnan(x.astype(np.float32)), np.asarray(0, dtype), x).astype(dtype)
    flat = x.reshape(-1)
    flat[:4] = np.array([np.inf, -np.inf, 0.0, -0.0], np.float32).astype(dtype)
    return x


@pytest.mark.parametrize("name", qf.FLOAT_FORMATS)
def test_float_formats_widen_exactly(name):
    dtype = qf.storage_dtype(name)
    data = random_float_bits(np.random.default_rng(5), dtype, (2, 3, 16))
    ref_in = data.view(np.uint8) if name == "BF16" else data
    want = reference(ref_in, name).reshape(data.shape)
    assert_bits_equal(qf.expand(jnp.asarray(data), name, 16), want)
    assert_bits_equal(jitted(name, 16)(data), want)


def test_bf16_nan_payload_survives_like_gguf():
    """gguf widens BF16 by a 16-bit shift, so NaN payloads (even signalling ones) are kept."""
    data = np.array([[0x7F81, 0xFFC1, 0x7FC0, 0x0001]], np.uint16).view(jnp.bfloat16)
    want = reference(data.view(np.uint8), "BF16")
    assert_bits_equal(jitted("BF16", 4)(data), want)


# --- output dtypes, embedding gather ----------------------------------------------------------

@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0", "IQ4_XS", "BF16", "F16"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_narrow_output_is_the_f32_result_rounded_once(name, dtype):
    rng = np.random.default_rng(9)
    cols = qf.FORMATS[name].block_weights * (1 if qf.FORMATS[name].is_block else 32)
    if qf.FORMATS[name].is_block:
        data = random_blocks(name, rng, (3, cols))
    else:
        data = random_float_bits(rng, qf.storage_dtype(name), (3, cols))
    f32 = np.asarray(jitted(name, cols)(data))
    got = jitted(name, cols, dtype)(data)
    assert got.dtype == dtype
    with np.errstate(over="ignore"):  # beyond the f16 range the single rounding gives inf
        want = f32.astype(dtype)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16), want.view(np.uint16))


@pytest.mark.parametrize("name", ["Q4_0", "Q5_K", "Q6_K", "IQ4_NL", "F32", "BF16"])
def test_expand_rows_is_the_gathered_full_expansion(name):
    rng = np.random.default_rng(13)
    fmt = qf.FORMATS[name]
    cols = fmt.block_weights * (2 if fmt.is_block else 64)
    if fmt.is_block:
        data = random_blocks(name, rng, (10, cols))
    else:
        data = random_float_bits(rng, qf.storage_dtype(name), (10, cols))
    ids = np.array([[3, 3, 0], [9, 1, -1]], np.int32)
    full = np.asarray(jitted(name, cols)(data))
    rows = jax.jit(functools.partial(qf.expand_rows, qtype=name, cols=cols))
    got = rows(data, ids)
    assert got.shape == (2, 3, cols)
    assert_bits_equal(got, full[ids])
    assert_bits_equal(rows(data, np.int32(4)), full[4])


def test_expand_rows_expands_only_the_gathered_rows():
    """The gather happens on stored bytes: the traced work after it is sized by the ids, not the table."""
    data = jnp.zeros(qf.storage_shape("Q4_K", (1000, 256)), jnp.uint8)
    jaxpr = jax.make_jaxpr(functools.partial(qf.expand_rows, qtype="Q4_K", cols=256))(data, jnp.zeros(2, jnp.int32))
    gathers = [e for e in jaxpr.eqns if str(e.primitive) == "gather"]
    assert len(gathers) == 1 and gathers[0].invars[0].aval.dtype == jnp.uint8
    assert all(v.aval.size <= 2 * 256 for e in jaxpr.eqns if e is not gathers[0]
               for v in e.outvars)


# --- storage geometry -------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(qf.FORMATS))
def test_geometry_matches_gguf_sizes(name):
    fmt = qf.FORMATS[name]
    assert (fmt.block_weights, fmt.block_bytes) == gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
    assert fmt.type_id == gguf.GGMLQuantizationType[name].value
    shape = (3, 5, 4 * fmt.block_weights)
    want = gq.quant_shape_to_byte_shape(shape, gguf.GGMLQuantizationType[name])
    assert qf.nbytes(name, shape) == int(np.prod(want))
    assert qf.storage_shape(name, shape) == (want if fmt.is_block else shape)
    assert qf.storage_dtype(name) == (np.uint8 if fmt.is_block else np.dtype({"F32": np.float32, "F16": np.float16,
                                                                              "BF16": jnp.bfloat16}[name]))
    if fmt.is_block:
        with pytest.raises(ValueError):
            qf.storage_shape(name, (3, fmt.block_weights + 1))


@pytest.mark.parametrize("name", ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_geometry_matches_what_gguf_quantize_produces(name):
    shape = (2, 3, 64)
    q = gq.quantize(np.ones(shape, np.float32), gguf.GGMLQuantizationType[name])
    if name == "BF16":  # gguf hands BF16 back as raw bytes; we store it as bfloat16
        q = q.view(qf.storage_dtype(name))
    assert q.shape == qf.storage_shape(name, shape) and q.dtype == qf.storage_dtype(name)
    assert q.nbytes == qf.nbytes(name, shape)
