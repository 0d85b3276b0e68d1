"""The MoE implementations agree: Pallas grouped matmul (interpreted on CPU) vs the XLA paths.

Routing is forced to be skewed, with experts that receive no token, so the padded groups are
uneven and some are empty; that is where a grouped kernel's offsets and tile table go wrong.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pantheon.ops import moe_kernels as mk

E, K, H, F = 8, 2, 64, 32


def _weights(seed: int = 0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    return (jax.random.normal(ks[0], (E, F, H)) * 0.1, jax.random.normal(ks[1], (E, F, H)) * 0.1,
            jax.random.normal(ks[2], (E, H, F)) * 0.1, jax.random.normal(ks[3], (E, H)))


def _skewed_routing(n: int, seed: int = 0):
    """Experts 0-4 only (5, 6, 7 empty), expert 0 far more often than the others."""
    rng = np.random.RandomState(seed)
    first = rng.choice(5, n, p=[0.6, 0.1, 0.1, 0.1, 0.1])
    second = (first + 1 + rng.randint(0, 4, n)) % 5
    idx = jnp.asarray(np.stack([first, second], 1), jnp.int32)
    w = jax.nn.softmax(jnp.asarray(rng.randn(n, K), jnp.float32), axis=-1)
    x = jnp.asarray(rng.randn(n, H), jnp.float32)
    return x, w, idx


def _run(impl: str, *args):
    return np.asarray(jax.jit(functools.partial(mk.experts, impl=impl))(*args))


@pytest.mark.parametrize("n", [1, 3, 29])
@pytest.mark.parametrize("impl", ["pallas_interpret", "pallas_prefetch_interpret"])
def test_pallas_kernel_equals_xla_paths(impl, n):
    wg, wu, wd, _ = _weights()
    x, w, idx = _skewed_routing(n)
    ref = _run("dense", x, w, idx, wg, wu, wd)
    np.testing.assert_allclose(_run(impl, x, w, idx, wg, wu, wd), ref, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(_run("tiles", x, w, idx, wg, wu, wd), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ["tiles", "tiles1", "tiles8", "capacity"])
def test_xla_paths_equal_dense(impl):
    wg, wu, wd, _ = _weights(1)
    x, w, idx = _skewed_routing(29, seed=1)
    ref = _run("dense", x, w, idx, wg, wu, wd)
    np.testing.assert_allclose(_run(impl, x, w, idx, wg, wu, wd), ref, atol=1e-5, rtol=1e-5)


def test_grouped_matmul_tiles_and_empty_groups():
    """gmm alone: each tile multiplies by its own expert; unused tiles (-1) come out zero."""
    tm = 16
    ks = jax.random.split(jax.random.PRNGKey(2), 2)
    x = jax.random.normal(ks[0], (4 * tm, H))
    w = jax.random.normal(ks[1], (E, F, H))
    te = jnp.asarray([3, 3, 0, -1], jnp.int32)
    for prefetch in (False, True):
        got = np.asarray(mk.gmm(x, w, te, tm=tm, interpret=True, prefetch=prefetch))
        for i, e in enumerate([3, 3, 0]):
            np.testing.assert_allclose(got[i * tm:(i + 1) * tm], np.asarray(x[i * tm:(i + 1) * tm] @ w[e].T),
                                       atol=1e-4, rtol=1e-5)
        assert not got[3 * tm:].any()


def test_tile_layout_places_every_pair_in_its_experts_tiles():
    tm = 4
    e_flat = jnp.asarray([2, 0, 2, 2, 5, 2, 2, 0, 2], jnp.int32)  # expert 2: 6 pairs, 0: 2, 5: 1
    dest, te, n_tiles = mk.tile_layout(e_flat, 8, tm)
    dest, te = np.asarray(dest), np.asarray(te)
    assert len(set(dest.tolist())) == len(dest)  # no two pairs share a row
    assert [te[r // tm] for r in dest] == np.asarray(e_flat).tolist()
    assert sorted(t for t in te.tolist() if t >= 0) == [0, 2, 2, 5]  # ceil(2/4) + ceil(6/4) + ceil(1/4)
    assert n_tiles >= 4


def test_moe_ffn_routes_softmax_top_k_renormalised():
    wg, wu, wd, router = _weights(3)
    h = jax.random.normal(jax.random.PRNGKey(4), (2, 5, H))
    got = np.asarray(mk.moe_ffn(h, router, wg, wu, wd, K, impl="tiles"))
    x = np.asarray(h, np.float64).reshape(-1, H)
    p = np.exp(x @ np.asarray(router, np.float64).T)
    p /= p.sum(-1, keepdims=True)
    want = np.zeros_like(x)
    for n in range(x.shape[0]):
        top = np.argsort(-p[n])[:K]
        for e in top:
            a = x[n] @ np.asarray(wg[e], np.float64).T
            u = x[n] @ np.asarray(wu[e], np.float64).T
            want[n] += p[n, e] / p[n, top].sum() * (np.asarray(wd[e], np.float64) @ (a / (1 + np.exp(-a)) * u))
    np.testing.assert_allclose(got.reshape(-1, H), want, atol=1e-4, rtol=1e-4)


def test_auto_picks_tiles_on_cpu():
    wg = _weights()[0]
    if jax.default_backend() == "cpu":
        assert mk.pick_impl(16, wg) == "tiles"
    assert mk.cpu_tile_rows(16, 256) == 1 and mk.cpu_tile_rows(1024, 64) == 16 and mk.cpu_tile_rows(10**6, 8) == 32


def test_a_kernel_that_does_not_compile_falls_back_with_a_warning():
    """Compiled (not interpreted) Pallas cannot run on CPU: the probe must say so, not raise."""
    if jax.default_backend() != "cpu":
        pytest.skip("the probe only fails on CPU")
    mk.pallas_compiles.cache_clear()
    with pytest.warns(RuntimeWarning, match="tiles"):
        assert not mk.pallas_compiles("pallas", "float32", E, F, H, 16)


@pytest.mark.parametrize("impl", ["pallas_interpret", "tiles", "capacity"])
def test_experts_stored_as_gguf_blocks_give_what_their_expansion_gives(impl):
    """Quantized experts (QuantWeight [E, out, in] in Q8_0): every path reads them as stored (the
    tile loop one expert at a time, the kernels after the in-step expansion) and equals the dense
    product over gguf's dequantized experts."""
    import gguf

    from pantheon.ops import weights

    wg, wu, wd, _ = _weights(2)
    q8 = gguf.GGMLQuantizationType.Q8_0
    stored = [weights.QuantWeight(data=jnp.asarray(gguf.quants.quantize(np.asarray(a), q8)), qtype="Q8_0",
                                  cols=int(a.shape[-1])) for a in (wg, wu, wd)]
    plain = [jnp.asarray(gguf.quants.dequantize(np.asarray(s.data), q8).reshape(s.shape)) for s in stored]
    x, w, idx = _skewed_routing(29, seed=2)
    ref = _run("dense", x, w, idx, *plain)
    got = np.asarray(jax.jit(functools.partial(mk.experts, impl=impl))(x, w, idx, *stored))
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=1e-5)


def test_a_decode_step_gives_each_active_expert_one_tile():
    """Up to DECODE_ROWS_MAX tokens the CPU tile is as tall as the token count, so the loop runs once
    per distinct chosen expert (each read once for all its rows), however the choices overlap."""
    n, k, e = 8, 8, 128
    rng = np.random.RandomState(5)
    idx = np.stack([rng.choice(24, k, replace=False) for _ in range(n)])  # heavy overlap across rows
    tm = mk.cpu_tile_rows(idx.size, e, n)
    assert tm == n and mk.cpu_tile_rows(idx.size, e, 1) == 1
    _, te, _ = mk.tile_layout(jnp.asarray(idx.reshape(-1), jnp.int32), e, tm)
    used = np.asarray(te)[np.asarray(te) >= 0]
    assert sorted(used.tolist()) == sorted(set(idx.reshape(-1).tolist()))


@pytest.mark.parametrize("kernel", ["native", "native-int8"])
def test_a_row_through_stored_experts_does_not_depend_on_its_batch(kernel):
    """Batched decode groups the rows that chose an expert into one product (padding rows skipped):
    each row's result must have the bits it has alone."""
    import gguf

    from pantheon.config import load_settings
    from pantheon.ops import native, weights

    if not native.enable(load_settings().home / "native"):
        pytest.skip("the native kernels are not available here")
    wg, wu, wd, router = _weights(6)
    q8 = gguf.GGMLQuantizationType.Q8_0
    stored = [weights.QuantWeight(data=jnp.asarray(gguf.quants.quantize(np.asarray(a), q8)), qtype="Q8_0",
                                  cols=int(a.shape[-1]), kernel=kernel) for a in (wg, wu, wd)]
    h = jax.random.normal(jax.random.PRNGKey(7), (8, H))
    w, idx = mk.route(jnp.einsum("nh,eh->ne", h, router), K)
    assert mk.cpu_tile_rows(idx.size, E, 8) == 8  # the batched call groups rows per expert
    f = jax.jit(lambda h, w, idx: mk.experts(h, w, idx, *stored, impl="tiles"))
    batched = np.asarray(f(h, w, idx))
    for r in range(8):
        np.testing.assert_array_equal(np.asarray(f(h[r:r + 1], w[r:r + 1], idx[r:r + 1]))[0], batched[r])
