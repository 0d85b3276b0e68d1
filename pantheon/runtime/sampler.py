"""Token sampling that runs inside the jitted model step, one set of knobs per batch row.

Why on the device: the step's logits are ``f32[B, V]`` with V up to ~152k (Qwen); copying them to the host
every step costs more than the sampling itself.  So the step calls :func:`sample` and only ``i32[B]`` token
ids cross to the host.  Every knob is a per-row *value* in :class:`SamplerRows`, never a static argument, so
changing a request's temperature or seed never recompiles the step; only the shapes (B, V and the width W of
the ``recent`` window) are static.

Pipeline for one row (the order llama.cpp / vLLM users expect):

1. penalties over the distinct tokens of the row's recent window (the last ``penalty_window`` tokens of its
   history, prompt included): repetition (a positive logit is divided by the penalty, any other logit is
   multiplied by it), then ``count * frequency_penalty`` and ``presence_penalty`` (once) are subtracted;
2. temperature (``temperature == 0`` or ``top_k == 1`` means greedy: ``argmax`` of the penalised logits,
   lowest id on ties, with no random draw at all);
3. top-k, then top-p (nucleus, over the top-k-renormalised distribution, always keeping at least the most
   likely token), then min-p (relative to the most likely token's probability);
4. one draw from the surviving tokens with a key ``fold_in(key(seed), step)`` of the row's own seed and the
   index of the token being generated, so a seeded request gives the same tokens whatever batch row or
   batch size it runs in.  (Same JAX version and backend: a CPU and a GPU may round ``exp`` differently.)

All three filters reduce to a single *logit threshold* per row: a token survives iff its penalised logit is
``>= thr``.  That makes ties explicit (tokens with equal logits are kept or dropped together, as vLLM's
top-k does) and lets the same rule be evaluated on a short candidate list or on the whole vocabulary with
identical results:

* top-k keeps logits ``>=`` the k-th largest logit;
* top-p keeps logits ``>=`` the logit of the token at which the descending cumulative probability first
  reaches ``top_p`` (ties at that boundary are all kept);
* min-p keeps logits ``>= max + T * ln(min_p)``, i.e. ``p >= min_p * p_max`` evaluated in logit space the way
  llama.cpp does it (so it never depends on how ``exp`` rounds).

Cost: a full sort of 8 x 152k logits is ~390 ms on a CPU, so nothing here sorts the vocabulary.  The
thresholds are first computed exactly from the ``CANDIDATES`` largest logits (``lax.top_k``); a row whose
k exceeds that, or whose nucleus does not fit in the candidates, gets its threshold from an exact 32-step
bisection over the float bit patterns of the whole row instead.  Likewise a row whose surviving tokens are
all candidates draws among them; the others draw from the whole vocabulary (inverse CDF over 1024-token
blocks).  Which path a row takes depends only on that row, so results never depend on its neighbours;
batch-wide ``lax.cond`` only skips work no row needs (an all-greedy batch costs one ``argmax``, a batch
without filters skips the ``top_k``).  There is no approximation: the candidate list is an optimisation,
never a cap.

Measured (jit, B=8, median of 20 calls, 2 shared CPU cores, ms;
"flat" = N(0,1) logits, the worst case for the nucleus fast path):

=====================================  ==========  ==========
rows (all 8 alike)                      V=49152     V=151936
=====================================  ==========  ==========
greedy (fast path)                        0.6-1.5     1.4-1.9
greedy + penalties                        0.6-1.2     1.2-2.1
temperature only                          0.6-0.9     2.0-3.0
top_k=40 top_p=0.95 T=0.7                 2.5-3.0     4.5-5.9
min_p=0.05 T=0.7                          2.5-3.2     4.3-7.1
all filters + penalties                   2.5-3.1     5.6-6.5
top_p=0.9 T=0.7, flat (bisection)         5.9         17-22
top_k=1000 (bisection)                    5.2-12      14-18
full sort alone (what we avoid)           127         393
=====================================  ==========  ==========
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pantheon.types import GREEDY, SamplingParams

# How many largest logits the fast path looks at.  lax.top_k(256) over 152k logits is ~5 ms on a CPU;
# every threshold it can decide is exact, the rest fall back to bisection (see module docstring).
CANDIDATES = 256
# Block width of the whole-vocabulary inverse-CDF draw: a cumulative sum over blocks, then within one block.
_DRAW_BLOCK = 1024


class SamplerRows(NamedTuple):
    """Per-row sampling knobs as arrays, one row per batch row (a pytree, so it passes through ``jit``).

    ``seed`` holds the request's 64-bit seed as two 32-bit words ``(hi, lo)``, which is exactly the key data
    threefry derives from that seed (``jax.random.key(seed)`` for any seed below 2**32, and for any 64-bit
    seed when x64 is on).  ``penalty_window`` lets each row look at fewer than the W tokens in ``recent``.
    Build with :func:`make_rows`.
    """

    temperature: jax.Array  # f32[B]
    top_k: jax.Array  # i32[B]
    top_p: jax.Array  # f32[B]
    min_p: jax.Array  # f32[B]
    repetition_penalty: jax.Array  # f32[B]
    presence_penalty: jax.Array  # f32[B]
    frequency_penalty: jax.Array  # f32[B]
    seed: jax.Array  # u32[B, 2]  (hi, lo) words of the 64-bit seed
    penalty_window: jax.Array  # i32[B]


def make_rows_np(params: Sequence[SamplingParams | None], bucket: int) -> SamplerRows:
    """Host-side (numpy) :class:`SamplerRows` for ``params``, padded to ``bucket`` rows.

    ``None`` and padding rows are idle: greedy with neutral penalties, so an all-idle batch takes the
    argmax-only fast path.  ``None`` seeds are resolved here (a fresh random seed per call).
    """
    if len(params) > bucket:
        raise ValueError(f"{len(params)} rows do not fit in a bucket of {bucket}")
    rows = [GREEDY if p is None else p for p in params] + [GREEDY] * (bucket - len(params))
    seeds = np.array([p.resolved_seed() for p in rows], dtype=np.uint64)
    top_k = np.array([min(p.top_k, np.iinfo(np.int32).max) for p in rows], dtype=np.int32)
    window = np.array([min(p.penalty_window, np.iinfo(np.int32).max) for p in rows], dtype=np.int32)
    return SamplerRows(
        temperature=np.array([p.temperature for p in rows], dtype=np.float32),
        top_k=top_k,
        top_p=np.array([p.top_p for p in rows], dtype=np.float32),
        min_p=np.array([p.min_p for p in rows], dtype=np.float32),
        repetition_penalty=np.array([p.repetition_penalty for p in rows], dtype=np.float32),
        presence_penalty=np.array([p.presence_penalty for p in rows], dtype=np.float32),
        frequency_penalty=np.array([p.frequency_penalty for p in rows], dtype=np.float32),
        seed=np.stack([(seeds >> np.uint64(32)).astype(np.uint32), seeds.astype(np.uint32)], axis=1),  # (hi, lo)
        penalty_window=window,
    )


def make_rows(params: Sequence[SamplingParams | None], bucket: int) -> SamplerRows:
    """:func:`make_rows_np` moved to the default device in one transfer (see there for the row rules)."""
    return jax.device_put(make_rows_np(params, bucket))


def recent_window(history: Sequence[int], width: int) -> np.ndarray:
    """The last ``width`` tokens of ``history`` as ``i32[width]``, oldest first, left-padded with -1.

    This is the row layout :func:`sample` expects in ``recent``: the newest token is the last column, so a
    row's ``penalty_window`` selects the last columns.
    """
    out = np.full(width, -1, dtype=np.int32)
    tail = list(history)[-width:] if width > 0 else []
    if tail:
        out[width - len(tail) :] = tail
    return out


# ----------------------------------------------------------------------------------------------------------
# device side


def _ordered_key(x: jax.Array) -> jax.Array:
    """Map f32 to u32 so that unsigned order equals float order (non-NaN values).

    -0.0 is first turned into +0.0: float comparison treats them as equal, and the keys must agree with it so
    that a threshold found by bisection over keys means the same thing as ``x >= thr``.
    """
    u = jax.lax.bitcast_convert_type(jnp.where(x == 0, 0.0, x), jnp.uint32)
    return jnp.where(u >> 31 != 0, ~u, u | jnp.uint32(0x80000000))


def _from_ordered_key(k: jax.Array) -> jax.Array:
    u = jnp.where(k >> 31 != 0, k & jnp.uint32(0x7FFFFFFF), ~k)
    return jax.lax.bitcast_convert_type(u, jnp.float32)


def _bisect_max_key(keys: jax.Array, ok: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """Per row, the largest u32 ``t`` with ``ok(keys >= t)`` true, for an ``ok`` that is monotone and true at 0.

    32 halvings of the u32 range pin ``t`` exactly; each costs one pass over ``keys``.  The result is the key
    of a value present in the row, so thresholds found this way are real logits.
    """
    b = keys.shape[0]

    def body(_, carry):
        lo, hi = carry
        span = hi - lo
        mid = lo + (span >> 1) + (span & 1)  # ceil midpoint without u32 overflow
        good = ok(keys >= mid[:, None])
        return jnp.where(good, mid, lo), jnp.where(good, hi, mid - 1)

    lo = jnp.zeros((b,), jnp.uint32)
    hi = jnp.full((b,), 0xFFFFFFFF, jnp.uint32)
    lo, _ = jax.lax.fori_loop(0, 32, body, (lo, hi))
    return lo


def apply_penalties(logits: jax.Array, rows: SamplerRows, recent: jax.Array) -> jax.Array:
    """Repetition / frequency / presence penalties on the tokens of each row's recent window (f32[B, V]).

    For each distinct token t among the last ``penalty_window`` valid entries of ``recent`` (ids outside
    [0, V) are ignored), with c = its count there:
    ``l = l / rp if l > 0 else l * rp``, then ``l -= c * frequency_penalty + presence_penalty``.
    Work is O(W^2) per row plus a scatter of W values, never O(V) beyond the copy of the logits.  With
    neutral penalties every touched logit is rewritten with its own value, so greedy stays exact.
    """
    logits = jnp.asarray(logits, jnp.float32)
    recent = jnp.asarray(recent, jnp.int32)
    b, v = logits.shape
    w = recent.shape[1]
    if w == 0:
        return logits
    pos = jnp.arange(w, dtype=jnp.int32)
    valid = (recent >= 0) & (recent < v) & (pos[None, :] >= w - rows.penalty_window[:, None])
    tok = jnp.where(valid, recent, 0)
    same = (tok[:, :, None] == tok[:, None, :]) & valid[:, None, :]
    count = jnp.sum(same, axis=-1).astype(jnp.float32)  # occurrences of tok[j] in the window
    vals = jnp.take_along_axis(logits, tok, axis=1)
    rp = rows.repetition_penalty[:, None]
    vals = jnp.where(vals > 0, vals / rp, vals * rp)
    vals = vals - rows.frequency_penalty[:, None] * count - rows.presence_penalty[:, None]
    idx = jnp.where(valid, tok, v)  # out of range => dropped by the scatter
    # Duplicate tokens in the window write the same value, so the scatter order does not matter.
    return logits.at[jnp.arange(b)[:, None], idx].set(vals, mode="drop")


def _first_above(cum: jax.Array, target: jax.Array, npos: jax.Array) -> jax.Array:
    """Inverse CDF: first index whose cumulative weight exceeds ``target``, clamped to ``npos - 1``.

    The first index where ``cum`` exceeds a value below the total always carries positive weight; the clamp
    (``npos`` = 1 + the last index with positive weight) only catches ``u * total`` rounding up to the total.
    """
    return jnp.minimum(jnp.sum(cum <= target[:, None], axis=-1), npos - 1).astype(jnp.int32)


def _draw_full(x: jax.Array, p: jax.Array, thr: jax.Array, u1: jax.Array, u2: jax.Array) -> jax.Array:
    """Draw from all tokens with ``x >= thr`` (weights ``p``): pick a 1024-token block by its mass, then a
    token within it.  Two passes over V and no sort; exact up to float rounding of the sums."""
    b, v = x.shape
    nblk = -(-v // _DRAW_BLOCK)
    w = jnp.where(x >= thr[:, None], p, 0.0)
    w = jnp.pad(w, ((0, 0), (0, nblk * _DRAW_BLOCK - v))).reshape(b, nblk, _DRAW_BLOCK)
    mass = jnp.sum(w, axis=-1)
    cum = jnp.cumsum(mass, axis=-1)
    last = nblk - jnp.argmax((mass > 0)[:, ::-1], axis=-1)  # 1 + index of the last block with mass
    blk = _first_above(cum, u1 * cum[:, -1], last)
    inner = jnp.take_along_axis(w, blk[:, None, None], axis=1)[:, 0, :]
    icum = jnp.cumsum(inner, axis=-1)
    ilast = _DRAW_BLOCK - jnp.argmax((inner > 0)[:, ::-1], axis=-1)
    j = _first_above(icum, u2 * icum[:, -1], ilast)
    return blk * _DRAW_BLOCK + j


class _Filtered(NamedTuple):
    greedy: jax.Array  # bool[B]
    p: jax.Array  # f32[B, V] unnormalised probabilities after temperature (max token = 1)
    cand_x: jax.Array  # f32[B, K] the K largest logits, descending
    cand_i: jax.Array  # i32[B, K] their ids
    cand_p: jax.Array  # f32[B, K] their entries of p
    thr: jax.Array  # f32[B] a token may be drawn iff its logit >= thr (for non-greedy rows)


def _filter(x: jax.Array, rows: SamplerRows, kc: int, barrier: bool = True) -> _Filtered:
    """Temperature, then the top-k / top-p / min-p threshold of every row, on penalised logits ``x``."""
    b, v = x.shape
    greedy = (rows.temperature <= 0) | (rows.top_k == 1)
    temp = jnp.where(greedy, 1.0, rows.temperature)

    # Candidates are only needed by rows with a filter on (rows without one draw from the whole vocabulary
    # unless the candidates are the whole vocabulary), so a temperature-only batch skips the top_k.
    filtered = ~greedy & (((rows.top_k > 1) & (rows.top_k < v)) | (rows.top_p < 1.0) | (rows.min_p > 0.0))

    def top() -> tuple[jax.Array, jax.Array]:
        # The barrier keeps XLA from folding later slices (e.g. [:, -1]) into the top_k: CPU XLA only uses its
        # fast top-k kernel when the sort is followed by plain [:k] slices, otherwise it sorts whole rows (~60x).
        vals, ids = jax.lax.top_k(x, kc)  # descending
        if barrier:  # (XLA:CPU's SPMD partitioner cannot take the barrier: sharded steps go without)
            vals, ids = jax.lax.optimization_barrier((vals, ids))
        return vals, ids

    if kc == v:
        cand_x, cand_i = top()
    else:
        cand_x, cand_i = jax.lax.cond(
            jnp.any(filtered),
            top,
            lambda: (jnp.full((b, kc), jnp.inf, jnp.float32), jnp.zeros((b, kc), jnp.int32)),
        )
    xmax = jnp.max(x, axis=-1)
    p = jnp.exp((x - xmax[:, None]) / temp[:, None])  # unnormalised, most likely token has weight 1
    cand_p = jnp.take_along_axis(p, cand_i, axis=1)  # the very same values as in p
    neg_inf = jnp.full((b,), -jnp.inf, jnp.float32)

    # top-k: the k-th largest logit (from the candidates if k <= kc, else bisection over the whole row).
    k = rows.top_k
    topk_on = (k > 1) & (k < v) & ~greedy
    big_k = topk_on & (k > kc)
    tk_cand = jnp.take_along_axis(cand_x, (jnp.clip(k, 1, kc) - 1)[:, None], axis=1)[:, 0]
    tk_big = jax.lax.cond(
        jnp.any(big_k),
        lambda: _from_ordered_key(_bisect_max_key(_ordered_key(x), lambda m: jnp.sum(m, axis=-1) >= k)),
        lambda: neg_inf,
    )
    tk = jnp.where(topk_on, jnp.where(big_k, tk_big, tk_cand), -jnp.inf)

    # top-p over the top-k-renormalised distribution: the logit where the descending cumulative mass first
    # reaches top_p * Z.  Exact from the candidates when their total reaches it, else by bisection.
    topp_on = (rows.top_p < 1.0) & ~greedy

    def nucleus() -> jax.Array:
        pk = jnp.where(x >= tk[:, None], p, 0.0)
        target = rows.top_p * jnp.sum(pk, axis=-1)
        cum = jnp.cumsum(jnp.where(cand_x >= tk[:, None], cand_p, 0.0), axis=-1)
        fits = cum[:, -1] >= target
        m = jnp.minimum(jnp.sum(cum < target[:, None], axis=-1), kc - 1)
        tp_cand = jnp.take_along_axis(cand_x, m[:, None], axis=1)[:, 0]
        tp_big = jax.lax.cond(
            jnp.any(topp_on & ~fits),
            lambda: _from_ordered_key(
                _bisect_max_key(_ordered_key(x), lambda keep: jnp.sum(jnp.where(keep, pk, 0.0), axis=-1) >= target)
            ),
            lambda: neg_inf,
        )
        return jnp.where(topp_on, jnp.where(fits, tp_cand, tp_big), -jnp.inf)

    tp = jax.lax.cond(jnp.any(topp_on), nucleus, lambda: neg_inf)

    # min-p: p >= min_p * p_max  <=>  x >= xmax + T * ln(min_p)   (ln 0 = -inf switches it off)
    tm = jnp.where(greedy, -jnp.inf, xmax + temp * jnp.log(rows.min_p))
    thr = jnp.maximum(jnp.maximum(tk, tp), tm)
    return _Filtered(greedy, p, cand_x, cand_i, cand_p, thr)


def _draw(x: jax.Array, f: _Filtered, rows: SamplerRows, step: jax.Array) -> jax.Array:
    """Greedy rows: argmax.  Others: one inverse-CDF draw among tokens with ``x >= thr``, keyed by
    ``fold_in(key(seed), step)`` of the row alone (vmapped, so no draw depends on the batch)."""
    b, v = x.shape
    kc = f.cand_x.shape[1]
    keys = jax.random.wrap_key_data(rows.seed, impl="threefry2x32")
    u = jax.vmap(lambda key, s: jax.random.uniform(jax.random.fold_in(key, s), (3,)))(keys, step)

    # Survivors all among the candidates (every non-candidate logit <= cand_x[-1] < thr): draw there.
    in_cand = (kc == v) | (f.cand_x[:, -1] < f.thr)
    cw = jnp.where(f.cand_x >= f.thr[:, None], f.cand_p, 0.0)  # a prefix of the descending candidates
    ccum = jnp.cumsum(cw, axis=-1)
    cpick = _first_above(ccum, u[:, 0] * ccum[:, -1], jnp.sum(cw > 0, axis=-1))
    drawn = jnp.take_along_axis(f.cand_i, cpick[:, None], axis=1)[:, 0]
    full = jax.lax.cond(
        jnp.any(~f.greedy & ~in_cand),
        lambda: _draw_full(x, f.p, f.thr, u[:, 1], u[:, 2]),
        lambda: jnp.zeros((b,), jnp.int32),
    )
    drawn = jnp.where(in_cand, drawn, full)
    greedy_ids = jax.lax.cond(
        jnp.any(f.greedy), lambda: jnp.argmax(x, axis=-1).astype(jnp.int32), lambda: jnp.zeros((b,), jnp.int32)
    )
    return jnp.where(f.greedy, greedy_ids, drawn)


def _candidates(v: int, candidates: int | None) -> int:
    return max(1, min(CANDIDATES if candidates is None else candidates, v))


def sample(
    logits: jax.Array, rows: SamplerRows, recent: jax.Array, step: jax.Array, *, candidates: int | None = None,
    barrier: bool = True,
) -> jax.Array:
    """Pick one token id per row: ``i32[B]``.  Pure and jittable; call it inside the model step.

    ``logits`` f32[B, V] (any float dtype; computed in f32); ``rows`` from :func:`make_rows`; ``recent``
    i32[B, W] the last W tokens of each row's history (prompt + generated), oldest first, -1 = empty (see
    :func:`recent_window`), W >= the largest ``penalty_window`` in use; ``step`` i32[B] the index of the token
    being generated within its request (0 for the first).  Only shapes are static.  ``candidates`` (static,
    default :data:`CANDIDATES`) sizes the fast path; it changes speed and which random number a row uses,
    never which tokens may be drawn (tests shrink it to exercise the whole-vocabulary paths).  ``barrier``
    (static) keeps XLA:CPU on its fast top-k kernel; a step partitioned over several dies turns it off.
    """
    return pick(apply_penalties(logits, rows, recent), rows, step, candidates=candidates, barrier=barrier)


def pick(
    x: jax.Array, rows: SamplerRows, step: jax.Array, *, candidates: int | None = None, barrier: bool = True,
) -> jax.Array:
    """:func:`sample` after the penalties: temperature, the filters and the draw on logits ``x`` that
    are already processed (penalties, logit bias, a grammar mask of ``-inf``), ``i32[B]``."""
    greedy = (rows.temperature <= 0) | (rows.top_k == 1)
    kc = _candidates(x.shape[1], candidates)
    return jax.lax.cond(
        jnp.all(greedy),
        lambda: jnp.argmax(x, axis=-1).astype(jnp.int32),  # all-greedy fast path: no top_k, no exp
        lambda: _draw(x, _filter(x, rows, kc, barrier), rows, step.astype(jnp.int32)),
    )


def apply_bias(logits: jax.Array, ids: jax.Array, values: jax.Array) -> jax.Array:
    """``logits`` f32[B, V] plus a sparse per-row bias: ``values[b, j]`` added at ``ids[b, j]`` (ids
    outside [0, V), e.g. -1 for an unused entry, are dropped). O(B * entries), never O(V) beyond the copy."""
    b, v = logits.shape
    at = jnp.where((ids >= 0) & (ids < v), ids, v)
    return logits.at[jnp.arange(b)[:, None], at].add(values, mode="drop")


def apply_mask(logits: jax.Array, words: jax.Array) -> jax.Array:
    """``logits`` with every token whose bit is clear in ``words`` (i32[B, ceil(V / 32)], bit t % 32 of
    word t // 32) set to -inf: a grammar's allowed next tokens."""
    b, v = logits.shape
    t = jnp.arange(v, dtype=jnp.int32)
    bits = jax.lax.shift_right_logical(words[:, t // 32], jnp.broadcast_to(t % 32, (b, v))) & 1
    return jnp.where(bits != 0, logits, -jnp.inf)


def token_logprobs(x: jax.Array, ids: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The log probability of each row's token ``ids`` under ``log_softmax(x)`` and the ``k`` most
    likely tokens: (f32[B, 1 + k] = chosen, then the top k descending; i32[B, k] their ids).

    Why this distribution: it is the one the sampler draws from before temperature and the filters
    (logit bias, penalties and a grammar mask applied: a masked token has -inf), so a greedy token's
    logprob is the top one, and the values do not depend on the request's temperature or top-p.
    """
    lp = jax.nn.log_softmax(x.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(lp, ids[:, None], axis=1)
    top, top_ids = jax.lax.top_k(lp, k)
    return jnp.concatenate([chosen, top], axis=1), top_ids.astype(jnp.int32)


def kept_mask(
    logits: jax.Array, rows: SamplerRows, recent: jax.Array, *, candidates: int | None = None
) -> jax.Array:
    """bool[B, V]: the tokens :func:`sample` may return for each row (after penalties and all filters).

    Greedy rows allow exactly their argmax.  For checks and debugging, not for the hot path.
    """
    x = apply_penalties(logits, rows, recent)
    f = _filter(x, rows, _candidates(x.shape[1], candidates))
    greedy_mask = jnp.arange(x.shape[1])[None, :] == jnp.argmax(x, axis=-1)[:, None]
    return jnp.where(f.greedy[:, None], greedy_mask, x >= f.thr[:, None])


sample_jit = jax.jit(sample, static_argnames="candidates")
