"""The native kernels read every stored weight format, and f16/bf16 KV caches.

What the engine relies on, format by format: a product over weights as the file stores them has the
same bits as the f32 kernel's product over `gguf.quants.dequantize`d weights (so the storage format
never changes a result), whatever the row count (decode rows in registers, prefill chunks through
an L1 scratch, K cut into parts with carried partial sums) and whatever other rows share the call.
The decode attention over f16/bf16 caches equals XLA's gather-cast-attend form to f32 rounding, and
a row's attention does not depend on the other rows.
"""

from __future__ import annotations

from functools import partial

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pantheon.ops import native
from pantheon.config import load_settings
from pantheon.jax_models import common
from pantheon.ops.quant_formats import BLOCK_FORMATS, FORMATS

# Byte offsets of each block format's f16 scales (d, and dmin/m where it has one).
F16_SCALES = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "IQ4_NL": [0],
              "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "IQ4_XS": [0]}
# f16 scales at the edges of the format: largest, smallest subnormal and normal, signed zeros
EXTREME_SCALES = np.array([65504.0, -65504.0, 2.0 ** -24, -(2.0 ** -24), 2.0 ** -14, 0.0, -0.0, 1.0], np.float16)
ALL_FORMATS = sorted(FORMATS)
ROWS = (1, 3, 8, 9, 33, 128)  # register path up to 8 rows, then the L1 scratch (33: 8 tiles and a remainder)


@pytest.fixture(scope="module")
def f32_product():
    if not native.enable(load_settings().home / "native"):
        pytest.fail(f"the native kernels did not build on this machine: {native.unavailable_reason()}")
    return jax.jit(native.matmul)


def stored_weights(fmt: str, n: int, k: int, rng: np.random.Generator) -> tuple[jax.Array, np.ndarray]:
    """Random weights [n, k] in `fmt` as the engine stores them, and gguf's f32 expansion of them.

    Block formats: random bytes (every quant, scale and sign pattern), their f16 scales a mix of
    ordinary magnitudes and the extremes. F16: every finite bit pattern, subnormals included. BF16:
    finite patterns of moderate exponent (products and sums stay finite), zeros and subnormals.
    """
    f = FORMATS[fmt]
    if fmt == "F32":
        w = rng.standard_normal((n, k)).astype(np.float32)
        return jnp.asarray(w), w
    if fmt in ("F16", "BF16"):
        bits = rng.integers(0, 1 << 16, (n, k), dtype=np.uint16)
        if fmt == "F16":
            bits = np.where((bits & 0x7C00) == 0x7C00, bits & 0x83FF, bits).astype(np.uint16)  # no inf/nan
        else:
            exponent = rng.integers(127 - 40, 127 + 40, (n, k), dtype=np.uint16)
            exponent[rng.random((n, k)) < 0.05] = 0  # zeros and subnormals
            bits = ((bits & 0x807F) | (exponent << 7)).astype(np.uint16)
        raw = bits.view(np.uint8).reshape(n, 2 * k)
        want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[fmt]).astype(np.float32)
        return jnp.asarray(bits.view(jnp.float16 if fmt == "F16" else jnp.bfloat16)), want
    blocks = rng.integers(0, 256, (n, k // f.block_weights, f.block_bytes), dtype=np.uint8)
    for offset in F16_SCALES[fmt]:
        magnitude = 10.0 ** rng.uniform(-5, 3, blocks.shape[:2])
        scales = (rng.standard_normal(blocks.shape[:2]) * magnitude).astype(np.float16)
        edge = rng.random(blocks.shape[:2]) < 0.25
        scales[edge] = rng.choice(EXTREME_SCALES, int(edge.sum()))
        blocks[..., offset:offset + 2] = scales.view(np.uint8).reshape(*blocks.shape[:2], 2)
    data = blocks.reshape(n, -1)
    return jnp.asarray(data), gguf.quants.dequantize(data, gguf.GGMLQuantizationType[fmt]).astype(np.float32)


def product(fmt: str):
    return jax.jit(lambda x, data: native.weight_matmul(x, data, fmt))


def test_every_gguf_format_is_read():
    assert native.NATIVE_FORMATS == set(FORMATS)


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_the_product_over_stored_weights_equals_the_f32_product_over_ggufs_dequantized_weights(f32_product, fmt):
    """Bit for bit at every row count. K = 768 cuts 8 rows into two parts of K (partial sums carried),
    70 columns take two carry groups; K = 5632 cuts even one row into parts."""
    rng = np.random.default_rng(sorted(FORMATS).index(fmt))
    fn = product(fmt)
    for n, k, rows in ((70, 768, ROWS), (20, 5632, (1, 5))):
        data, weights = stored_weights(fmt, n, k, rng)
        x = jnp.asarray(rng.standard_normal((max(rows), k), np.float32))
        want = np.asarray(f32_product(x, jnp.asarray(weights)))
        assert np.isfinite(want).all()
        for m in rows:
            got = np.asarray(fn(x[:m], data))
            assert got.shape == (m, n)
            assert np.array_equal(got, want[:m]), (fmt, n, k, m, np.abs(got - want[:m]).max())


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_a_row_gives_the_same_bits_alone_and_batched(f32_product, fmt):
    rng = np.random.default_rng(7)
    data, _ = stored_weights(fmt, 70, 768, rng)
    x = jnp.asarray(rng.standard_normal((128, 768), np.float32))
    fn = product(fmt)
    full = np.asarray(fn(x, data))
    for r in (0, 5, 127):
        for lo, hi in ((r, r + 1), (max(r - 7, 0), r + 1), (max(r - 20, 0), r + 1)):  # alone, decode batch, chunk
            assert np.array_equal(np.asarray(fn(x[lo:hi], data))[-1], full[r]), (fmt, r, lo)


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_skipped_rows_are_zeros_and_the_others_keep_their_bits(f32_product, fmt):
    """[3, 37) of 40 leaves 6 live rows on both sides (register path); [10, 20) leaves 30, copied
    into one block for the scratch path; the others clamp or skip nothing."""
    rng = np.random.default_rng(11)
    data, _ = stored_weights(fmt, 70, 768, rng)
    x = jnp.asarray(rng.standard_normal((40, 768), np.float32))
    full = np.asarray(product(fmt)(x, data))
    fn = jax.jit(lambda x, data, a, b: native.weight_matmul(x, data, fmt, (a, b)))
    for first, end in ((3, 37), (10, 20), (0, 40), (38, 99), (5, 5), (0, 33)):
        got = np.asarray(fn(x, data, jnp.int32(first), jnp.int32(end)))
        dead = np.zeros(40, bool)
        dead[first:min(end, 40)] = True
        assert np.array_equal(got[~dead], full[~dead]), (fmt, first, end)
        assert not got[dead].any(), (fmt, first, end)


def test_leading_axes_are_kept_and_each_storage_has_its_target(f32_product):
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((2, 3, 256), np.float32))
    for fmt, target in (("F32", native.TARGET), ("BF16", native.QUANT_TARGET), ("Q4_K", native.QUANT_TARGET)):
        data, weights = stored_weights(fmt, 5, 256, rng)
        got = product(fmt)(x, data)
        assert got.shape == (2, 3, 5)
        want = f32_product(x.reshape(6, 256), jnp.asarray(weights))
        assert np.array_equal(np.asarray(got).reshape(6, 5), np.asarray(want))
        assert f"call @{target}(" in product(fmt).lower(x, data).as_text()


def test_weight_matmul_applies_only_to_data_that_holds_the_matrix(f32_product):
    def blocks(fmt, n, k):
        return jnp.zeros((n, FORMATS[fmt].row_bytes(k)), jnp.uint8)

    for fmt in BLOCK_FORMATS:
        k = 2 * FORMATS[fmt].block_weights
        assert native.weight_matmul_applies(1, k, blocks(fmt, 4, k), fmt)  # a decode row
        assert native.weight_matmul_applies(512, k, blocks(fmt, 4, k), fmt)  # a prefill chunk
        assert not native.weight_matmul_applies(0, k, blocks(fmt, 4, k), fmt)
        assert not native.weight_matmul_applies(1, k + 8, blocks(fmt, 4, k), fmt)  # bytes do not fit k
        assert not native.weight_matmul_applies(1, k, blocks(fmt, 4, k).astype(jnp.int8), fmt)
        assert not native.weight_matmul_applies(1, k, blocks(fmt, 4, k)[None], fmt)
    assert not native.weight_matmul_applies(1, 896, jnp.zeros((4, 896 // 32 * 18), jnp.uint8), "Q4_K")  # 896 % 256
    assert not native.weight_matmul_applies(1, 64, blocks("Q4_1", 4, 64), "Q4_0")  # another format's bytes
    for fmt, dtype in (("F32", jnp.float32), ("F16", jnp.float16), ("BF16", jnp.bfloat16)):
        assert native.weight_matmul_applies(8, 64, jnp.zeros((4, 64), dtype), fmt)
        assert not native.weight_matmul_applies(8, 60, jnp.zeros((4, 60), dtype), fmt)  # K not a multiple of 8
        assert not native.weight_matmul_applies(8, 64, jnp.zeros((4, 72), dtype), fmt)
        assert not native.weight_matmul_applies(0, 64, jnp.zeros((4, 64), dtype), fmt)
    assert not native.weight_matmul_applies(8, 64, jnp.zeros((4, 64), jnp.bfloat16), "F16")
    assert not native.weight_matmul_applies(8, 64, jnp.zeros((4, 128), jnp.uint8), "F16")  # floats are not bytes
    assert not native.weight_matmul_applies(8, 64, jnp.zeros((4, 64), jnp.float32), "Q1_X")
    with pytest.raises(ValueError):
        native.weight_matmul(jnp.zeros((1, 64), jnp.float32), blocks("Q4_1", 4, 64), "Q4_0")


def test_without_the_library_nothing_applies(f32_product, monkeypatch):
    monkeypatch.setattr(native, "_ready", False)
    assert not native.weight_matmul_applies(1, 256, jnp.zeros((4, 144), jnp.uint8), "Q4_K")
    assert not native.applies(1, jnp.zeros((4, 64), jnp.float32))
    assert not native.attention_applies(jnp.zeros((1, 1, 4, 64)), jnp.zeros((1, 1, 2, 8, 64), jnp.float16))


def _caches(seed: int, rows: int, dtype):
    rng = np.random.default_rng(seed)
    L, S, K, C, D, N = 3, 9, 2, 300, 64, 6  # 3 query heads per kv head
    kc, vc = (jnp.asarray(rng.standard_normal((L, S, K, C, D), np.float32)).astype(dtype) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((rows, 1, N, D), np.float32))
    return q, kc, vc


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_decode_attention_over_a_16_bit_cache_equals_the_gathered_cast_form(f32_product, dtype):
    q, kc, vc = _caches(0, 8, dtype)
    slots = jnp.asarray([3, 1, 0, 8, 5, 2, 7, 6], jnp.int32)
    pos = jnp.asarray([0, 5, 100, 299, 17, 3, 64, 200], jnp.int32)  # first and last position included
    layer = jnp.int32(2)
    assert native.attention_applies(q, kc)
    got = np.asarray(jax.jit(partial(native.decode_attention, scale=0.125))(q, kc, vc, layer, slots, pos))
    want = np.asarray(common.attention(q, common.gather_span(kc, layer, slots, 300),
                                       common.gather_span(vc, layer, slots, 300), pos[:, None], 0.125))
    assert got.shape == want.shape == (8, 1, 6 * 64) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_decode_attention_of_a_row_does_not_depend_on_the_other_rows(f32_product, dtype):
    q, kc, vc = _caches(1, 8, dtype)
    slots, pos = jnp.arange(8, dtype=jnp.int32), jnp.asarray([7, 70, 140, 210, 280, 9, 99, 199], jnp.int32)
    fn = jax.jit(partial(native.decode_attention, scale=0.125))
    full = np.asarray(fn(q, kc, vc, jnp.int32(1), slots, pos))
    for b in range(8):
        alone = np.asarray(fn(q[b:b + 1], kc, vc, jnp.int32(1), slots[b:b + 1], pos[b:b + 1]))
        assert np.array_equal(alone, full[b:b + 1]), b


def test_attention_takes_float_caches_only_and_both_of_one_dtype(f32_product):
    q, kc, vc = _caches(2, 1, jnp.float16)
    assert not native.attention_applies(q, kc.astype(jnp.int32))
    with pytest.raises(ValueError):
        native.decode_attention(q, kc, vc.astype(jnp.bfloat16), jnp.int32(0), jnp.zeros(1, jnp.int32),
                                jnp.zeros(1, jnp.int32), 0.125)


@pytest.mark.parametrize("fmt", ["Q4_K", "Q6_K", "Q8_0", "BF16", "F32"])
def test_a_matrix_of_a_stack_is_read_in_place_with_the_bits_of_the_matrix_alone(f32_product, fmt):
    """An MoE layer's experts [E, N, ...]: weight_matmul(index=e) equals the product with matrix e,
    for every e and with an index out of range clamped (as XLA clamps a dynamic index)."""
    rng = np.random.default_rng(7)
    mats = [stored_weights(fmt, 24, 512, rng)[0] for _ in range(3)]
    stack = jnp.stack(mats)
    x = jnp.asarray(rng.standard_normal((5, 512), np.float32))
    fn = jax.jit(lambda x, s, e: native.weight_matmul(x, s, fmt, index=e))
    for e, want in ((0, 0), (1, 1), (2, 2), (7, 2), (-3, 0)):
        got = np.asarray(fn(x, stack, jnp.int32(e)))
        assert np.array_equal(got, np.asarray(product(fmt)(x, mats[want]))), (fmt, e)
    assert native.stacked_matmul_applies(5, 512, stack, fmt)
    assert not native.stacked_matmul_applies(5, 512, mats[0], fmt)  # not a stack
