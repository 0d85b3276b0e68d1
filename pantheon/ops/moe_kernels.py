"""Mixture-of-experts FFN shared by every MoE arch: router top-k, then SwiGLU experts.

Why several implementations of the same math: the best way to run "each token through its k of E
experts" depends on the backend and on how many tokens a step carries.

* `pallas` (GPU): tokens are sorted by expert into groups padded to a multiple of the row tile,
  and one grouped-matmul kernel walks the tiles, each tile reading only its own expert's weights.
  Pallas' Triton backend has no scalar prefetch, so the tile -> expert table is an ordinary input
  and the kernel indexes the whole-weight ref itself. `pallas_prefetch` is the same kernel with
  the table as scalar prefetch driving the weight BlockSpec (the TPU form). `pallas_interpret`
  / `pallas_prefetch_interpret` run either kernel in Pallas' interpreter on CPU: slow, but they
  prove the kernels right against the XLA paths (tests/test_moe_kernels.py).
* `tiles` (CPU default): the same sorted, tile-padded layout, walked by an XLA while loop over
  the *used* tiles only, each iteration two (out, in)-layout matmuls against one expert. Up to
  DECODE_ROWS_MAX tokens the tile is as tall as the token count (one tile per chosen expert: each
  active expert read once for all its rows, the padding rows skipped by the native kernels); above
  that it follows the mean group size. Measured fastest on CPU from 1 to 128 tokens (issue-5 report).
* `capacity`: the pairs are scattered into an [E, C, H] buffer and all experts run as one batched
  einsum. C is chosen inside the step by lax.switch among static buckets (the smallest that holds
  the fullest expert), so no token is ever dropped. With (out, in) weights XLA:CPU transposes
  every expert each call, which makes it 3-40x slower than `tiles`; kept for measurements.
* `dense` (reference): every expert on every token, weighted by the sparse routing weights.

`moe_ffn(h, router, w_gate, w_up, w_down, k)` is the one-call form an arch file uses; `route`
and `experts` are its halves for archs whose routers differ (sigmoid, bias, group routing).
Weights keep the GGUF/HF (out, in) layout: w_gate/w_up [E, F, H], w_down [E, H, F].
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pantheon.ops import weights
from pantheon.ops.weights import LayerView, QuantWeight

IMPLS = ("auto", "dense", "capacity", "tiles", "pallas", "pallas_interpret", "pallas_prefetch",
         "pallas_prefetch_interpret")

TILE_ROWS_MAX = 32  # the CPU `tiles` path sizes its row tile to the mean group, capped here
DECODE_ROWS_MAX = 8  # up to this many tokens the CPU `tiles` path gives each used expert one tile


# ---- routing -------------------------------------------------------------------------------------
def route(logits: jax.Array, k: int, *, renormalize: bool = True,
          scale: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """Softmax over all experts in f32, top-k, optional renormalisation of the k weights.

    Returns (weights [N, k] f32, expert ids [N, k] int32). `scale` multiplies the final weights
    (GGUF `expert_weights_scale`; 1.0 for the Qwen and Mixtral families).
    """
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    w, idx = jax.lax.top_k(probs, k)
    if renormalize:
        w = w / jnp.sum(w, axis=-1, keepdims=True)
    if scale != 1.0:
        w = w * scale
    return w, idx.astype(jnp.int32)


# ---- XLA paths -----------------------------------------------------------------------------------
def _dense(x, w, idx, wg, wu, wd):
    E = wg.shape[0]
    n = x.shape[0]
    dense_w = jnp.zeros((n, E), jnp.float32).at[jnp.arange(n)[:, None], idx].add(w)
    g = jnp.einsum("nh,efh->nef", x, wg, preferred_element_type=jnp.float32)
    u = jnp.einsum("nh,efh->nef", x, wu, preferred_element_type=jnp.float32)
    a = (jax.nn.silu(g) * u * dense_w[..., None]).astype(wd.dtype)
    return jnp.einsum("nef,ehf->nh", a, wd, preferred_element_type=jnp.float32)


def _group_ranks(e_flat: jax.Array, n_experts: int) -> tuple[jax.Array, jax.Array]:
    """(rank of each pair inside its expert's group in pair order, per-expert counts)."""
    P = e_flat.shape[0]
    order = jnp.argsort(e_flat, stable=True)
    counts = jnp.bincount(e_flat, length=n_experts).astype(jnp.int32)
    starts = jnp.cumsum(counts) - counts
    e_sorted = e_flat[order]
    rank_sorted = jnp.arange(P, dtype=jnp.int32) - starts[e_sorted]
    rank = jnp.zeros((P,), jnp.int32).at[order].set(rank_sorted)
    return rank, counts


def capacity_buckets(n_tokens: int, k: int, n_experts: int) -> tuple[int, ...]:
    """Static capacities lax.switch chooses from; the last (= n_tokens) can never overflow."""
    avg = -(-n_tokens * k // n_experts)
    cands = {min(n_tokens, max(1, m * avg)) for m in (2, 4)} | {n_tokens}
    return tuple(sorted(cands))


def _capacity(x, w, idx, wg, wu, wd):
    n, k = idx.shape
    E = wg.shape[0]
    e_flat = idx.reshape(-1)
    t_flat = jnp.repeat(jnp.arange(n, dtype=jnp.int32), k)
    rank, counts = _group_ranks(e_flat, E)
    buckets = capacity_buckets(n, k, E)

    def run(cap: int):
        def f(_):
            buf = jnp.zeros((E, cap, x.shape[1]), x.dtype).at[e_flat, rank].set(x[t_flat], mode="drop")
            g = jnp.einsum("ech,efh->ecf", buf, wg, preferred_element_type=jnp.float32)
            u = jnp.einsum("ech,efh->ecf", buf, wu, preferred_element_type=jnp.float32)
            out = jnp.einsum("ecf,ehf->ech", (jax.nn.silu(g) * u).astype(wd.dtype), wd,
                             preferred_element_type=jnp.float32)
            y = out[idx, rank.reshape(n, k)]  # [N, k, H]
            return jnp.einsum("nkh,nk->nh", y, w)
        return f

    which = jnp.searchsorted(jnp.asarray(buckets, jnp.int32), jnp.max(counts), side="left")
    return jax.lax.switch(which, [run(c) for c in buckets], None)


def _sorted_rows(x: jax.Array, idx: jax.Array, n_experts: int, tm: int):
    """x's rows, one per (token, expert) pair, sorted by expert into tm-padded groups.

    Returns (rows [n_tiles*tm, H], dest row of each pair [P], tile -> expert [n_tiles]).
    """
    n, k = idx.shape
    dest, te, n_tiles = tile_layout(idx.reshape(-1), n_experts, tm)
    tokens = jnp.repeat(jnp.arange(n, dtype=jnp.int32), k)
    rows = jnp.zeros((n_tiles * tm, x.shape[1]), x.dtype).at[dest].set(x[tokens])
    return rows, dest, te


def _combine(out_rows: jax.Array, dest: jax.Array, w: jax.Array) -> jax.Array:
    """Σ_j w[n, j] · out_rows[dest of pair (n, j)] -> [N, H]."""
    n, k = w.shape
    return jnp.einsum("nkh,nk->nh", out_rows[dest].reshape(n, k, -1), w)


# One layer's experts: a QuantWeight [E, out, in] in the file's format, one layer of the engine's
# stack of them over layers (a LayerView of [L, E, out, in]), or a plain [E, out, in] array (tests,
# benchmarks). The tile loop multiplies one expert at a time with weights.linear_at, so it reads
# quantized experts where they are stored; the other paths expand the layer.
Experts = QuantWeight | LayerView | jax.Array


def layer_experts(w: Experts) -> jax.Array:
    """The [E, out, in] weights of this layer as an array (expanded when quantized)."""
    return w.expand() if isinstance(w, (QuantWeight, LayerView)) else w


def _expert_linear(x: jax.Array, w: Experts, e: jax.Array,
                   skip: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    """x @ expert e's matrix.T: read in place from a quantized stack (weights.linear_at). skip: rows
    [first, end) of x that are padding (the native kernels leave them out)."""
    if isinstance(w, (QuantWeight, LayerView)):
        return weights.linear_at(x, w, e, skip)
    return weights.linear(x, w[e], None, skip)


def _n_experts(w: Experts) -> int:
    return int(w.shape[0])


def _tiles(x, w, idx, wg, wu, wd, *, tm: int):
    """XLA twin of the grouped-matmul kernel: a while loop over the used row tiles only.

    A group's rows fill its tiles from the top, so a tile's padding is one run at its end: it is
    passed to the products as `skip`, and the native kernels spend nothing on it. With tm >= the
    number of tokens (decode: `cpu_tile_rows`) every used expert is one tile, read once for all the
    rows that chose it."""
    rows, dest, te = _sorted_rows(x.astype(jnp.float32), idx, _n_experts(wg), tm)
    live = jnp.zeros((rows.shape[0],), jnp.int32).at[dest].set(1).reshape(-1, tm).sum(axis=1)

    def body(i, out):
        e = te[i]
        xt = jax.lax.dynamic_slice_in_dim(rows, i * tm, tm)
        skip = (live[i], jnp.int32(tm))
        g = _expert_linear(xt, wg, e, skip)
        u = _expert_linear(xt, wu, e, skip)
        y = _expert_linear(jax.nn.silu(g) * u, wd, e, skip)
        return jax.lax.dynamic_update_slice_in_dim(out, y, i * tm, axis=0)

    used = jnp.sum(te >= 0)  # unused tiles are all at the end: a dynamic trip count skips them
    out = jax.lax.fori_loop(0, used, body, jnp.zeros((rows.shape[0], x.shape[1]), jnp.float32))
    return _combine(out, dest, w)


# ---- Pallas grouped matmul -----------------------------------------------------------------------
def _pow2_divisor(n: int, cap: int) -> int:
    """Largest power of two <= cap dividing n (Triton tiles must be powers of two)."""
    d = 1
    while d * 2 <= cap and n % (d * 2) == 0:
        d *= 2
    return d


def tile_layout(e_flat: jax.Array, n_experts: int, tm: int) -> tuple[jax.Array, jax.Array, int]:
    """Place pairs sorted by expert into groups padded to multiples of tm rows.

    Returns (dest row of each pair [P], tile -> expert [n_tiles] with -1 for unused tiles,
    n_tiles). n_tiles is a static bound: each expert needs ceil(count/tm) tiles, which sums to at
    most P//tm + min(E, P), and never more than P (every used tile holds a real row).
    """
    P = e_flat.shape[0]
    n_tiles = min(P, P // tm + min(n_experts, P))
    rank, counts = _group_ranks(e_flat, n_experts)
    padded = (counts + tm - 1) // tm * tm
    pend = jnp.cumsum(padded)
    pstart = pend - padded
    dest = pstart[e_flat] + rank
    tile_row = jnp.arange(n_tiles, dtype=jnp.int32) * tm
    te = jnp.searchsorted(pend, tile_row, side="right").astype(jnp.int32)  # skips empty groups
    te = jnp.where(te < n_experts, te, -1)
    return dest, te, n_tiles


def _gmm_kernel(te_ref, x_ref, w_ref, o_ref, *, bk: int, precision):
    """One (row tile, column tile): o = x_tile @ w[te[tile]].T, zeros for an unused tile."""
    e = te_ref[pl.program_id(0)]
    tn = o_ref.shape[1]
    j = pl.program_id(1)

    @pl.when(e < 0)
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

    @pl.when(e >= 0)
    def _():
        def body(kk, acc):
            xb = x_ref[:, pl.ds(kk * bk, bk)]
            wb = w_ref[e, pl.ds(j * tn, tn), pl.ds(kk * bk, bk)]
            return acc + jax.lax.dot_general(xb, wb, (((1,), (1,)), ((), ())), precision=precision,
                                             preferred_element_type=jnp.float32)

        acc = jax.lax.fori_loop(0, x_ref.shape[1] // bk, body, jnp.zeros(o_ref.shape, jnp.float32))
        o_ref[...] = acc.astype(o_ref.dtype)


def _gmm_prefetch_kernel(te_ref, valid_ref, x_ref, w_ref, o_ref, *, precision):
    """Scalar-prefetch form: the BlockSpec already brought in this tile's expert slice."""
    acc = jax.lax.dot_general(x_ref[...], w_ref[...], (((1,), (1,)), ((), ())), precision=precision,
                              preferred_element_type=jnp.float32)
    o_ref[...] = jnp.where(valid_ref[pl.program_id(0)] > 0, acc, 0.0).astype(o_ref.dtype)


def gmm(x: jax.Array, w: jax.Array, te: jax.Array, *, tm: int, interpret: bool = False,
        prefetch: bool = False, out_dtype=jnp.float32) -> jax.Array:
    """Grouped matmul: rows [i*tm, (i+1)*tm) of x [M, K] times w[te[i]].T (w [E, N, K]) -> [M, N].

    te[i] = -1 marks an unused tile (zero output). M must be a multiple of tm.
    """
    x = x.astype(w.dtype)  # Triton dots need equal operand types (activations f32, weights maybe bf16)
    M, K = x.shape
    E, N, K2 = w.shape
    assert K == K2 and M % tm == 0, (x.shape, w.shape, tm)
    n_tiles = M // tm
    tn = _pow2_divisor(N, 128)
    precision = jax.lax.Precision.HIGHEST if w.dtype == jnp.float32 else None
    out_shape = jax.ShapeDtypeStruct((M, N), out_dtype)
    if prefetch:
        from jax.experimental.pallas import tpu as pltpu

        valid = (te >= 0).astype(jnp.int32)
        te_c = jnp.maximum(te, 0)  # an unused tile re-reads expert 0's slice; its output is masked
        grid_spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(n_tiles, N // tn),
            in_specs=[pl.BlockSpec((tm, K), lambda i, j, te, v: (i, 0)),
                      pl.BlockSpec((None, tn, K), lambda i, j, te, v: (te[i], j, 0))],
            out_specs=pl.BlockSpec((tm, tn), lambda i, j, te, v: (i, j)))
        kern = functools.partial(_gmm_prefetch_kernel, precision=precision)
        return pl.pallas_call(kern, out_shape=out_shape, grid_spec=grid_spec, interpret=interpret)(
            te_c, valid, x, w)
    bk = _pow2_divisor(K, 128)
    kern = functools.partial(_gmm_kernel, bk=bk, precision=precision)
    return pl.pallas_call(
        kern, out_shape=out_shape, grid=(n_tiles, N // tn),
        in_specs=[pl.BlockSpec((n_tiles,), lambda i, j: (0,)),
                  pl.BlockSpec((tm, K), lambda i, j: (i, 0)),
                  pl.BlockSpec((E, N, K), lambda i, j: (0, 0, 0))],
        out_specs=pl.BlockSpec((tm, tn), lambda i, j: (i, j)),
        interpret=interpret)(te, x, w)


def _pallas(x, w, idx, wg, wu, wd, *, interpret: bool, prefetch: bool):
    tm = _pallas_tm(idx.size, wg.shape[0])
    rows, dest, te = _sorted_rows(x, idx, wg.shape[0], tm)
    call = functools.partial(gmm, te=te, tm=tm, interpret=interpret, prefetch=prefetch)
    a = jax.nn.silu(call(rows, wg)) * call(rows, wu)
    return _combine(call(a.astype(wd.dtype), wd), dest, w)


def _pallas_fits(wg: jax.Array) -> bool:
    """Triton needs every loaded tile (rows x cols) to be >= 16 on each side and a power of two."""
    E, F, H = wg.shape
    return min(_pow2_divisor(F, 128), _pow2_divisor(H, 128)) >= 16


def _pallas_tm(n_pairs: int, n_experts: int) -> int:
    """Row tile of the kernels: Triton dots need >= 16 rows; taller once groups fill them."""
    return 16 if n_pairs <= 4 * n_experts else 64


@functools.lru_cache(maxsize=None)
def pallas_compiles(impl: str, dtype: str, E: int, F: int, H: int, tm: int) -> bool:
    """Whether the kernel compiles for these shapes on the default backend (probed once).

    The GPU/TPU lowerings were written against Pallas' documented constraints but a backend can
    still refuse a shape; a refusal makes `auto` fall back to the XLA `tiles` path with a warning
    instead of failing the model load.
    """
    import warnings

    te = jax.ShapeDtypeStruct((2,), jnp.int32)
    prefetch = "prefetch" in impl
    try:
        for n_in, n_out in ((H, F), (F, H)):
            jax.jit(functools.partial(gmm, tm=tm, prefetch=prefetch)).lower(
                jax.ShapeDtypeStruct((2 * tm, n_in), jnp.float32), jax.ShapeDtypeStruct((E, n_out, n_in), dtype),
                te).compile()
        return True
    except Exception as exc:  # any lowering/compile refusal
        warnings.warn(f"MoE Pallas kernel {impl!r} does not compile here ({type(exc).__name__}: {exc}); "
                      "using the XLA 'tiles' path", RuntimeWarning, stacklevel=2)
        return False


def pick_impl(n_pairs: int, wg: jax.Array) -> str:
    """The implementation `auto` resolves to for this step's size on the default backend."""
    backend = jax.default_backend()
    impl = {"gpu": "pallas", "tpu": "pallas_prefetch"}.get(backend)
    if impl and _pallas_fits(wg):
        E, F, H = wg.shape
        if pallas_compiles(impl, jnp.dtype(wg.dtype).name, E, F, H, _pallas_tm(n_pairs, E)):
            return impl
    return "tiles"


def cpu_tile_rows(n_pairs: int, n_experts: int, n_tokens: int | None = None) -> int:
    """Row tile of the CPU `tiles` path.

    Up to DECODE_ROWS_MAX tokens (a decode step): one tile per used expert, as tall as the token
    count (a token picks an expert at most once, so a group never has more rows), so each active
    expert is read once for every row that chose it; the padding rows cost nothing (`skip`). Above
    that: the mean group size rounded down to a power of two, since every tile's rows buffer is
    allocated and smaller tiles waste no rows but cost loop iterations.
    """
    if n_tokens is not None and n_tokens <= DECODE_ROWS_MAX:
        return n_tokens
    return min(TILE_ROWS_MAX, 1 << max(0, (n_pairs // n_experts).bit_length() - 1))


def experts(x: jax.Array, w: jax.Array, idx: jax.Array, w_gate: jax.Array, w_up: jax.Array,
            w_down: jax.Array, *, impl: str = "auto") -> jax.Array:
    """Σ_j w[n, j] · down_e(silu(gate_e x_n) ⊙ up_e x_n) over e = idx[n, j]; f32 [N, H].

    x [N, H]; w [N, k] routing weights; idx [N, k] expert ids; w_gate/w_up [E, F, H] and
    w_down [E, H, F] in the GGUF (out, in) layout.
    """
    if impl == "auto":
        quant = isinstance(w_gate, (QuantWeight, LayerView))
        spec = jax.ShapeDtypeStruct(w_gate.shape, jnp.dtype(w_gate.compute)) if quant else w_gate
        impl = "tiles" if jax.default_backend() == "cpu" else pick_impl(idx.size, spec)
    if not impl.startswith("tiles"):  # only the tile loop reads experts as they are stored
        w_gate, w_up, w_down = layer_experts(w_gate), layer_experts(w_up), layer_experts(w_down)
    w = w.astype(jnp.float32)
    if impl == "dense":
        return _dense(x, w, idx, w_gate, w_up, w_down)
    if impl.startswith("tiles"):
        tm = int(impl[5:]) if impl[5:] else cpu_tile_rows(idx.size, _n_experts(w_gate), idx.shape[0])
        return _tiles(x, w, idx, w_gate, w_up, w_down, tm=tm)
    if impl == "capacity":
        return _capacity(x, w, idx, w_gate, w_up, w_down)
    if impl.startswith("pallas"):
        return _pallas(x, w, idx, w_gate, w_up, w_down, interpret=impl.endswith("interpret"),
                       prefetch="prefetch" in impl)
    raise ValueError(f"unknown MoE implementation {impl!r} (known: {', '.join(IMPLS)})")


def moe_ffn(h: jax.Array, router: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
            k: int, *, renormalize: bool = True, scale: float = 1.0, impl: str = "auto") -> jax.Array:
    """Routed SwiGLU experts of h [..., H] (router [E, H]); returns [..., H] in h's dtype."""
    lead = h.shape[:-1]
    x = h.reshape(-1, h.shape[-1])
    logits = jnp.einsum("nh,eh->ne", x.astype(jnp.float32), router.astype(jnp.float32))
    w, idx = route(logits, k, renormalize=renormalize, scale=scale)
    y = experts(x, w, idx, w_gate, w_up, w_down, impl=impl)
    return y.reshape(lead + (h.shape[-1],)).astype(h.dtype)


# ---- timing (python -m pantheon.ops.moe_kernels) ------------------------------------------
def _bench(E: int, k: int, H: int, F: int, tokens: tuple[int, ...], impls: tuple[str, ...],
           reps: int = 5) -> None:
    import time

    kg = jax.random.split(jax.random.PRNGKey(0), 5)
    wg = jax.random.normal(kg[0], (E, F, H), jnp.float32) * 0.05
    wu = jax.random.normal(kg[1], (E, F, H), jnp.float32) * 0.05
    wd = jax.random.normal(kg[2], (E, H, F), jnp.float32) * 0.05
    router = jax.random.normal(kg[3], (E, H), jnp.float32)
    for n in tokens:
        h = jax.random.normal(kg[4], (n, H), jnp.float32)
        ref = None
        for impl in impls:
            f = jax.jit(functools.partial(moe_ffn, k=k, impl=impl))
            y = f(h, router, wg, wu, wd).block_until_ready()
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter()
                f(h, router, wg, wu, wd).block_until_ready()
                ts.append(time.perf_counter() - t0)
            ts.sort()
            err = 0.0 if ref is None else float(jnp.max(jnp.abs(y - ref)))
            ref = y if ref is None else ref
            print(f"E={E} k={k} H={H} F={F} tokens={n:4d} pairs={n * k:5d} {impl:9s} "
                  f"median {ts[len(ts) // 2] * 1e3:8.2f} ms  min {ts[0] * 1e3:8.2f} ms  maxdiff {err:.1e}",
                  flush=True)


if __name__ == "__main__":
    import sys

    shapes = [(64, 8, 1024, 512), (256, 8, 512, 256)]
    if len(sys.argv) > 1:
        shapes = [tuple(int(v) for v in sys.argv[1].split(","))]
    for E, k, H, F in shapes:
        _bench(E, k, H, F, tokens=(1, 8, 32, 128), impls=("dense", "capacity", "tiles"))
