"""The native kernels' int8 form (dot="int8"): llama.cpp's arithmetic, replayed bit for bit in numpy.

What the engine relies on when a model is served with PANTHEON_NATIVE_DOT=int8:
* the kernel computes exactly the arithmetic its comment in cpu_kernels.cc states (each activation
  row quantized to 8 bits per weight block, integer block dots in 8 lanes, f32 scaling per block in
  a fixed order): `int8_reference` below does the same in numpy, and the bits agree, every format;
* so it differs from the exact product only by the activation's rounding: within the bound that
  rounding allows (half a quantization step of each block times the weights' magnitudes);
* a row's result does not depend on the rows beside it or on how many threads split the columns;
* rows [skip0, skip1) are zeros, as in the exact form; F16/BF16 keep the exact form.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pantheon.config import load_settings
from pantheon.ops import native
from pantheon.ops.quant_formats import FORMATS
from test_native_formats import stored_weights

F32 = np.float32
INT8 = sorted(native.INT8_FORMATS)
IQ4_GRID = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int64)


@pytest.fixture(scope="module")
def built():
    if not native.enable(load_settings().home / "native"):
        pytest.fail(f"the native kernels did not build on this machine: {native.unavailable_reason()}")


def product(fmt: str, dot: str = "int8"):
    return jax.jit(lambda x, data: native.weight_matmul(x, data, fmt, dot=dot))


# ---- the reference: the kernel's arithmetic in numpy ---------------------------------------------
def quantize(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows x [m, K] -> q int64 [m, K/block, block] in units u, u f32 [m, K/block], each value's step
    f32 [m, K/block, block]: the block's step amax/127, made 2^e finer (e <= 3) for a sub-block (16 of a
    32-block, 32 of a 256-block) whose largest |x| times 2^e is still <= amax; q = rint(x * (127/amax)
    * 2^e), counted in units u = amax/127/8 (q * 2^(3-e))."""
    sub = 16 if block == 32 else 32
    xb = x.astype(F32).reshape(x.shape[0], -1, block)
    xs = xb.reshape(x.shape[0], -1, block // sub, sub)
    amax = np.abs(xb).max(-1)
    smax = np.abs(xs).max(-1)
    e = np.zeros(smax.shape, np.int64)
    for t in (1, 2, 3):
        e += (smax * F32(2 ** t) <= amax[..., None]) & (e == t - 1)
    inv = np.where(amax > 0, F32(127) / np.where(amax > 0, amax, F32(1)), F32(0)).astype(F32)
    mul = (inv[..., None] * np.exp2(e).astype(F32)).astype(F32)
    q = np.rint(xs * mul[..., None]).astype(np.int64)
    d = (amax / F32(127)).astype(F32)
    step = (d[..., None] / np.exp2(e).astype(F32)).astype(F32)
    units = (q << (3 - e)[..., None]).reshape(xb.shape)
    return units, (d * F32(0.125)).astype(F32), np.repeat(step, sub, -1).reshape(xb.shape)


def _half(raw: np.ndarray, at: int) -> np.ndarray:
    return raw[..., at:at + 2].copy().view(np.float16)[..., 0].astype(F32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32]: the low nibbles, then the high ones."""
    return np.concatenate([qs & 15, qs >> 4], -1).astype(np.int64)


def _bits(raw: np.ndarray, count: int) -> np.ndarray:
    """[..., count / 8] bytes -> [..., count] bits, little-endian."""
    return np.unpackbits(raw, axis=-1, bitorder="little")[..., :count].astype(np.int64)


def decode(fmt: str, data: np.ndarray, k: int) -> dict:
    """The integers and scales the kernel multiplies, per weight in natural order.

    w [n, nb, B]: the weight bytes (signed where the kernel uses the sign trick); scale [n, nb, B]:
    the integer sub-block scale (1 for the 32-formats); d [n, nb]; and by format `dmin` with `min16`
    [n, nb, 16] (K-quant minimums per 16-sum), `m` [n, nb] (Q4_1/Q5_1), or `offset` with `scale16`
    [n, nb, 16] (Q3_K/Q6_K's unsigned q).
    """
    f = FORMATS[fmt]
    n, nb = data.shape[0], k // f.block_weights
    r = data.reshape(n, nb, f.block_bytes)
    out: dict = {}
    if fmt in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL"):
        out["d"] = _half(r, 0)
        if fmt == "Q8_0":
            w = r[..., 2:34].view(np.int8).astype(np.int64)
        elif fmt == "IQ4_NL":
            w = IQ4_GRID[_nibbles(r[..., 2:18])]
        else:
            has_min, fifth = fmt in ("Q4_1", "Q5_1"), fmt in ("Q5_0", "Q5_1")
            at = 2 + 2 * has_min
            if has_min:
                out["m"] = _half(r, 2)
            w = _nibbles(r[..., at + 4 * fifth:at + 4 * fifth + 16])
            if fifth:
                w = w | (_bits(r[..., at:at + 4], 32) << 4)
            if not has_min:
                w = w - (8 if fmt == "Q4_0" else 16)
        out["w"], out["scale"] = w, np.ones_like(w)
        return out
    if fmt in ("Q4_K", "Q5_K"):
        out["d"], out["dmin"] = _half(r, 0), _half(r, 2)
        s = r[..., 4:16].astype(np.int64)
        sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], -1)
        mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
        qs = r[..., (48 if fmt == "Q5_K" else 16):][..., :128].reshape(n, nb, 4, 32).astype(np.int64)
        w = np.stack([qs & 15, qs >> 4], 3).reshape(n, nb, 8, 32)  # sub-blocks 2g, 2g + 1
        if fmt == "Q5_K":
            w = w | (_bits(r[..., 16:48, None], 8).transpose(0, 1, 3, 2) << 4)  # bit j of byte i
        out["w"] = w.reshape(n, nb, 256)
        out["scale"] = np.repeat(sc, 32, -1)
        out["min16"] = np.repeat(mn, 2, -1)
        return out
    if fmt == "Q6_K":
        out["d"] = _half(r, 208)
        ql, qh = r[..., :128].astype(np.int64), r[..., 128:192].astype(np.int64)
        subs = []
        for j in range(8):
            g, rr = divmod(j, 4)
            lo = ql[..., 64 * g + 32 * (rr % 2):][..., :32] >> (4 * (rr // 2))
            subs.append((lo & 15) | (((qh[..., 32 * g:32 * g + 32] >> (2 * rr)) & 3) << 4))
        sc = r[..., 192:208].view(np.int8).astype(np.int64)
        out["w"], out["scale"] = np.concatenate(subs, -1), np.repeat(sc, 16, -1)
        out["offset"], out["scale16"] = 32, sc
        return out
    if fmt == "Q2_K":
        out["d"], out["dmin"] = _half(r, 80), _half(r, 82)
        qs = r[..., 16:80].astype(np.int64)
        out["w"] = np.concatenate([(qs[..., 32 * (j // 4):32 * (j // 4) + 32] >> (2 * (j % 4))) & 3 for j in range(8)], -1)
        sc = r[..., :16].astype(np.int64)
        out["scale"], out["min16"] = np.repeat(sc & 15, 16, -1), sc >> 4
        return out
    if fmt == "Q3_K":
        out["d"] = _half(r, 108)
        qs, hm = r[..., 32:96].astype(np.int64), r[..., :32].astype(np.int64)
        raw = r[..., 96:108].astype(np.int64)
        sc = np.stack([(((raw[..., s] if s < 8 else raw[..., s - 8] >> 4) & 15)
                        | (((raw[..., 8 + s % 4] >> (2 * (s // 4))) & 3) << 4)) - 32 for s in range(16)], -1)
        out["w"] = np.concatenate([((qs[..., 32 * (j // 4):32 * (j // 4) + 32] >> (2 * (j % 4))) & 3)
                                   | (((hm >> j) & 1) << 2) for j in range(8)], -1)
        out["scale"], out["offset"], out["scale16"] = np.repeat(sc, 16, -1), 4, sc
        return out
    if fmt == "IQ4_XS":
        out["d"] = _half(r, 0)
        high = r[..., 2:4].copy().view(np.uint16)[..., 0].astype(np.int64)
        low = r[..., 4:8].astype(np.int64)
        sc = np.stack([((low[..., j // 2] >> (4 * (j % 2))) & 15) | (((high >> (2 * j)) & 3) << 4) for j in range(8)],
                      -1) - 32
        out["w"] = IQ4_GRID[np.concatenate([_nibbles(r[..., 8 + 16 * j:24 + 16 * j]) for j in range(8)], -1)]
        out["scale"] = np.repeat(sc, 32, -1)
        return out
    raise ValueError(fmt)


def hsum(a: np.ndarray) -> np.ndarray:
    """cpu_kernels.cc's HorizontalSum of 8 f32 lanes (the last axis), in its order."""
    s = a[..., :4] + a[..., 4:]
    return (s[..., 0] + s[..., 2]) + (s[..., 1] + s[..., 3])


def int8_reference(fmt: str, data: np.ndarray, x: np.ndarray) -> np.ndarray:
    """y [m, n] as the int8 kernel computes it (see the header of cpu_kernels.cc's int8 section)."""
    m, k = x.shape
    f = FORMATS[fmt]
    block = f.block_weights
    nb = k // block
    q, dx, _ = quantize(x, block)  # [m, nb, B] in units dx [m, nb]
    wd = decode(fmt, np.asarray(data), k)
    n = wd["w"].shape[0]
    # lane l of a 32-weight run: weights 4l .. 4l + 3; integer sums exact (int64 here)
    prod = (wd["w"] * wd["scale"]).reshape(n, nb, block // 32, 8, 4)
    lanes = np.einsum("nbsla,mbsla->mnbl", prod, q.reshape(m, nb, block // 32, 8, 4))
    bs = q.reshape(m, nb, -1, 16).sum(-1)  # 16-sums (256-blocks)
    if "offset" in wd:  # lane l: offset * (scale_2l * bsum_2l + scale_2l+1 * bsum_2l+1)
        corr = (wd["scale16"][None] * bs[:, None]).reshape(m, n, nb, 8, 2).sum(-1)
        lanes = lanes - wd["offset"] * corr
    mins = None
    if "min16" in wd:
        mins = (wd["min16"][None] * bs[:, None]).reshape(m, n, nb, 8, 2).sum(-1)
    acc = np.zeros((m, n, 8), F32)
    macc = np.zeros((m, n, 8), F32)
    facc = np.zeros((m, n), F32)
    for b in range(nb):
        scale = (wd["d"][None, :, b] * dx[:, None, b])[..., None]
        acc = acc + lanes[:, :, b].astype(F32) * scale
        if mins is not None:
            macc = macc + mins[:, :, b].astype(F32) * (wd["dmin"][None, :, b] * dx[:, None, b])[..., None]
        if "m" in wd:
            sx = q[:, b].sum(-1).astype(F32)[:, None]
            facc = facc + sx * (wd["m"][None, :, b] * dx[:, None, b])
    y = hsum(acc)
    if mins is not None:
        y = y - hsum(macc)
    if "m" in wd:
        y = y + facc
    return y.astype(F32)


# ---- the tests ------------------------------------------------------------------------------------
def test_every_block_format_has_an_int8_form():
    assert native.INT8_FORMATS == {f for f in FORMATS if FORMATS[f].is_block}


@pytest.mark.parametrize("fmt", INT8)
def test_the_int8_product_is_the_stated_arithmetic_bit_for_bit(built, fmt):
    """Random bytes (every quant and scale pattern, f16 scales from subnormal to 65504) against the numpy
    replay, at the register path's row counts and past them (9, 17 rows: groups of 8 and a remainder)."""
    rng = np.random.default_rng(100 + INT8.index(fmt))
    fn = product(fmt)
    for n, k, rows in ((37, 768, (1, 3, 8, 9, 17)), (6, 2048, (1, 5))):
        data, _ = stored_weights(fmt, n, k, rng)
        x = rng.standard_normal((max(rows), k)).astype(F32)
        x[0, : k // 2] *= 1e-3  # blocks of very different magnitudes in one row
        if max(rows) > 2:
            x[2, 32:64] = 0.0  # an all-zero block: d = 0, q = 0
        want = int8_reference(fmt, np.asarray(data), x)
        for m in rows:
            got = np.asarray(fn(jnp.asarray(x[:m]), data))
            assert got.shape == (m, n)
            same = (got == want[:m]) | (np.isnan(got) & np.isnan(want[:m]))
            assert same.all(), (fmt, n, k, m, np.argwhere(~same)[:3], got[~same][:3], want[:m][~same][:3])


def _ordinary_weights(fmt: str, n: int, k: int, rng: np.random.Generator) -> tuple[jax.Array, np.ndarray]:
    """A matrix quantized from Gaussian values by gguf (ordinary scales, as a model file has)."""
    w = rng.standard_normal((n, k)).astype(F32)
    try:
        data = gguf.quants.quantize(w, gguf.GGMLQuantizationType[fmt])
    except NotImplementedError:  # gguf-py cannot quantize to every format: random blocks, tame scales
        data, _ = stored_weights(fmt, n, k, rng)
        f = FORMATS[fmt]
        blocks = np.asarray(data).reshape(n, -1, f.block_bytes).copy()
        from test_native_formats import F16_SCALES
        for off in F16_SCALES[fmt]:
            blocks[..., off:off + 2] = (rng.uniform(0.5, 1.0, blocks.shape[:2]) / 64).astype(np.float16).view(
                np.uint8).reshape(*blocks.shape[:2], 2)
        data = blocks.reshape(n, -1)
    data = np.asarray(data)
    return jnp.asarray(data), gguf.quants.dequantize(data, gguf.GGMLQuantizationType[fmt]).astype(F32)


@pytest.mark.parametrize("fmt", INT8)
def test_the_int8_product_is_within_the_activation_rounding_of_the_exact_product(built, fmt):
    """|int8 - exact| <= sum_k |w_k| * d_x(k) / 2 (each activation moves by at most half its block's
    step), plus f32 rounding; and the error is not zero (it is a different product)."""
    rng = np.random.default_rng(200 + INT8.index(fmt))
    k = 1024
    data, w = _ordinary_weights(fmt, 48, k, rng)
    x = rng.standard_normal((4, k)).astype(F32) * rng.uniform(0.01, 3.0, (4, 1)).astype(F32)
    fast = np.asarray(product(fmt)(jnp.asarray(x), data))
    exact = np.asarray(product(fmt, "exact")(jnp.asarray(x), data))
    _, _, step = quantize(x, FORMATS[fmt].block_weights)
    step = step.reshape(x.shape)  # [m, K]: each activation's step
    bound = 0.5 * np.abs(w)[None] @ step[..., None]  # [m, n, 1]
    bound = bound[..., 0] * 1.001 + 1e-5 * (np.abs(x) @ np.abs(w).T)
    err = np.abs(fast - exact)
    assert (err <= bound).all(), (fmt, (err / bound).max())
    assert err.max() > 0
    # typical size: llama.cpp's ~1/254 per block, far inside the worst case
    assert np.median(err / bound) < 0.25


@pytest.mark.parametrize("fmt", INT8)
def test_a_row_gives_the_same_bits_alone_and_among_7_companions(built, fmt):
    rng = np.random.default_rng(300 + INT8.index(fmt))
    data, _ = stored_weights(fmt, 70, 768, rng)
    x = jnp.asarray(rng.standard_normal((40, 768)).astype(F32))
    fn = product(fmt)
    full = np.asarray(fn(x, data))
    for r in (0, 7, 39):
        for lo, hi in ((r, r + 1), (max(r - 7, 0), r + 1), (max(r - 20, 0), r + 1), (r, min(r + 8, 40))):
            got = np.asarray(fn(x[lo:hi], data))
            assert np.array_equal(got[r - lo], full[r]), (fmt, r, lo, hi)


_THREADS_SCRIPT = """
import os, sys
os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[:int(sys.argv[2])]))  # before XLA sizes its pool
import numpy as np, jax, jax.numpy as jnp
from pantheon.config import load_settings
from pantheon.ops import native
from test_native_formats import stored_weights
assert native.enable(load_settings().home / "native")
rng = np.random.default_rng(5)
out = []
for fmt in ("Q4_K", "Q6_K", "Q4_0", "Q8_0"):
    data, _ = stored_weights(fmt, 1536, 2048, rng)
    x = jnp.asarray(rng.standard_normal((3, 2048)).astype(np.float32))
    out.append(np.asarray(jax.jit(lambda x, d: native.weight_matmul(x, d, fmt, dot="int8"))(x, data)))
np.save(sys.argv[1], np.concatenate(out, 1))
"""


def test_the_thread_count_does_not_change_a_bit(built, tmp_path):
    """The same products (big enough to be split over the pool) in a process whose XLA pool has one
    thread and in one with every core: the column chunks differ, the bits do not."""
    cores = len(os.sched_getaffinity(0))
    if cores < 2:
        pytest.skip("one core: one pool size only")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    results = []
    for threads in (1, cores):
        out = tmp_path / f"y{threads}.npy"
        subprocess.run([sys.executable, "-c", _THREADS_SCRIPT, str(out), str(threads)], env=env, check=True,
                       timeout=600)
        results.append(np.load(out))
    assert np.array_equal(results[0], results[1])


@pytest.mark.parametrize("fmt", ["Q4_K", "Q4_1", "Q6_K"])
def test_skipped_rows_are_zeros_and_the_others_keep_their_bits(built, fmt):
    rng = np.random.default_rng(11)
    data, _ = stored_weights(fmt, 70, 768, rng)
    x = jnp.asarray(rng.standard_normal((40, 768)).astype(F32))
    full = np.asarray(product(fmt)(x, data))
    fn = jax.jit(lambda x, data, a, b: native.weight_matmul(x, data, fmt, (a, b), dot="int8"))
    for first, end in ((3, 37), (10, 20), (0, 40), (38, 99), (5, 5)):
        got = np.asarray(fn(x, data, jnp.int32(first), jnp.int32(end)))
        dead = np.zeros(40, bool)
        dead[first:min(end, 40)] = True
        assert np.array_equal(got[~dead], full[~dead]), (fmt, first, end)
        assert not got[dead].any(), (fmt, first, end)


def test_float_formats_and_stacks_under_int8(built):
    """F16/BF16 have no int8 form: dot="int8" gives their exact product. A stack [E, N, cols] picks its
    matrix in place, as the exact form does."""
    rng = np.random.default_rng(13)
    x = jnp.asarray(rng.standard_normal((2, 256)).astype(F32))
    for fmt in ("F16", "BF16"):
        data, _ = stored_weights(fmt, 9, 256, rng)
        assert np.array_equal(np.asarray(product(fmt)(x, data)), np.asarray(product(fmt, "exact")(x, data)))
    mats = [stored_weights("Q4_K", 9, 256, rng)[0] for _ in range(3)]
    stack = jnp.stack(mats)
    fn = jax.jit(lambda x, s, e: native.weight_matmul(x, s, "Q4_K", index=e, dot="int8"))
    for e in range(3):
        assert np.array_equal(np.asarray(fn(x, stack, jnp.int32(e))), np.asarray(product("Q4_K")(x, mats[e])))
    with pytest.raises(ValueError):
        native.weight_matmul(x, mats[0], "Q4_K", dot="int4")
