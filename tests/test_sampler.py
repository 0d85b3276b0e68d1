"""Specification of the in-step sampler (pantheon.runtime.sampler).

The sampler runs inside the jitted model step with per-row knobs.  What users rely on:

* a seeded request is reproducible: the id depends only on (logits, params, recent tokens, seed, step),
  never on the batch size, the batch row, or what the neighbouring rows ask for;
* greedy (temperature 0 or top_k 1) is exactly ``argmax`` of the penalised logits, lowest id on ties;
* top-k / top-p / min-p never let an excluded token through, and the survivors are drawn in proportion to
  their probability;
* penalties push the tokens of the recent window down (repetition, presence, frequency);
* host-side sampling gives the same ids as in-step sampling;
* bad knob values are rejected up front, naming the field.

Most checks run twice: with the default candidate list (the fast path; with a small vocabulary it covers
every token) and with ``candidates=4``, which forces the whole-vocabulary bisection and block draw.
Vocabularies are small and shapes are few, so every jitted shape compiles once.
"""

from __future__ import annotations

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pantheon.runtime import compile_guard
from pantheon.runtime.sampler import (
    SamplerRows,
    SamplingParams,
    apply_penalties,
    kept_mask,
    make_rows,
    make_rows_np,
    recent_window,
    sample,
    sample_jit,
)

V = 64
W = 8
PATHS = [None, 4]  # default candidates (fast path) / tiny candidate list (whole-vocabulary fallbacks)

_kept = jax.jit(kept_mask, static_argnames="candidates")


def run(logits, params, recent=None, step=0, candidates=None) -> np.ndarray:
    """Sample one id per row of ``logits`` for the given per-row params (a thin test harness)."""
    logits = np.asarray(logits, np.float32)
    b = logits.shape[0]
    rec = np.full((b, W), -1, np.int32) if recent is None else np.asarray(recent, np.int32)
    steps = np.broadcast_to(np.asarray(step, np.int32), (b,)).copy()
    return np.asarray(sample_jit(logits, make_rows(params, b), rec, steps, candidates=candidates))


def kept(logits, params, recent=None, candidates=None) -> np.ndarray:
    logits = np.asarray(logits, np.float32)
    b = logits.shape[0]
    rec = np.full((b, W), -1, np.int32) if recent is None else np.asarray(recent, np.int32)
    return np.asarray(_kept(logits, make_rows(params, b), rec, candidates=candidates))


def reference_kept(x: np.ndarray, p: SamplingParams) -> np.ndarray:
    """The documented filter semantics, written the obvious way (full sort, float64) for one row."""
    x = x.astype(np.float64)
    if p.is_greedy:
        out = np.zeros(x.shape, bool)
        out[np.argmax(x)] = True
        return out
    keep = np.ones(x.shape, bool)
    if 1 < p.top_k < x.size:
        keep &= x >= np.sort(x)[::-1][p.top_k - 1]
    if p.top_p < 1:
        q = np.where(keep, np.exp((x - x.max()) / p.temperature), 0.0)
        q /= q.sum()
        order = np.argsort(-x, kind="stable")
        m = int(np.argmax(np.cumsum(q[order]) >= p.top_p))
        keep &= x >= x[order[m]]
    if p.min_p > 0:
        keep &= x >= x.max() + p.temperature * np.log(p.min_p)
    return keep


def logits_batch(seed: int, b: int = 8, v: int = V, scale: float = 2.0) -> np.ndarray:
    return (np.random.default_rng(seed).normal(size=(b, v)) * scale).astype(np.float32)


MIXED = [
    SamplingParams(seed=11),
    SamplingParams(seed=12, temperature=0.7, top_k=5),
    SamplingParams(seed=13, top_p=0.8),
    SamplingParams(seed=14, temperature=1.3, min_p=0.1),
    SamplingParams(temperature=0.0),
    SamplingParams(seed=15, top_k=20, top_p=0.9, min_p=0.02, repetition_penalty=1.3, frequency_penalty=0.4),
    SamplingParams(seed=2**40 + 3, temperature=0.5, top_k=1000),  # top_k beyond V: off
    SamplingParams(seed=17, top_k=10, presence_penalty=-1.5),
]


# ---------------------------------------------------------------------------------------------- seeds


@pytest.mark.parametrize("candidates", PATHS)
def test_seeded_rows_do_not_depend_on_batch_size_position_or_neighbours(candidates):
    lg = logits_batch(0)
    rec = np.stack([recent_window(list(range(b, b + 2 * b + 1, 2)), W) for b in range(8)])
    for step in (0, 1, 7):
        batch = run(lg, MIXED, rec, step, candidates)
        for b in range(8):
            alone = run(lg[b : b + 1], [MIXED[b]], rec[b : b + 1], step, candidates)
            assert alone[0] == batch[b], (b, step)
        perm = np.array([3, 7, 0, 5, 1, 6, 2, 4])
        shuffled = run(lg[perm], [MIXED[i] for i in perm], rec[perm], step, candidates)
        np.testing.assert_array_equal(shuffled, batch[perm])
        # Neighbours that are all greedy take the batch-wide fast path; the sampled row must not notice.
        neighbours = [SamplingParams(temperature=0.0)] * 8
        neighbours[5] = MIXED[2]
        lg_same = lg.copy()
        lg_same[5] = lg[2]
        rec_same = rec.copy()
        rec_same[5] = rec[2]
        assert run(lg_same, neighbours, rec_same, step, candidates)[5] == batch[2]


def test_same_seed_and_step_repeat_and_the_step_changes_the_draw():
    lg = np.zeros((8, V), np.float32)  # uniform: every id equally likely
    p = [SamplingParams(seed=1234)] * 8
    first = run(lg, p, step=np.arange(8))
    np.testing.assert_array_equal(run(lg, p, step=np.arange(8)), first)
    assert len(set(first.tolist())) > 1, "the step must be folded into the key"


def test_different_seeds_give_different_streams():
    lg = np.zeros((8, V), np.float32)
    streams = []
    for seed in (1, 2):
        rows = [SamplingParams(seed=seed)] * 8
        streams.append(np.concatenate([run(lg, rows, step=np.arange(8) + 8 * s) for s in range(4)]))
    assert np.mean(streams[0] == streams[1]) < 0.2  # 32 draws from 64 ids: ~1/64 coincide by chance


def test_unseeded_requests_draw_a_fresh_seed_and_resolved_pins_it():
    p = SamplingParams()
    assert p.resolved_seed() != p.resolved_seed()
    fixed = p.resolved()
    assert fixed.seed is not None and fixed.resolved_seed() == fixed.resolved_seed()
    assert SamplingParams(seed=-1).resolved_seed() == 2**64 - 1


def test_seed_words_are_the_threefry_key_of_the_seed():
    """rows.seed holds (hi, lo): the key data of jax.random.key(seed), so key(seed) semantics hold."""
    rows = make_rows_np([SamplingParams(seed=5), SamplingParams(seed=2**40 + 7)], 2)
    np.testing.assert_array_equal(rows.seed[0], np.asarray(jax.random.key_data(jax.random.key(5))))
    np.testing.assert_array_equal(rows.seed[1], [2**8, 7])


# ---------------------------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("candidates", PATHS)
def test_temperature_zero_and_top_k_one_are_argmax(candidates):
    lg = logits_batch(3)
    lg[1, [9, 40]] = lg[1].max() + 1.0  # a tie: the lowest id wins
    greedy = [SamplingParams(temperature=0.0, seed=s) for s in range(4)] + [
        SamplingParams(top_k=1, seed=s, temperature=2.0, top_p=0.5) for s in range(4)
    ]
    for step in (0, 5):
        np.testing.assert_array_equal(run(lg, greedy, step=step, candidates=candidates), np.argmax(lg, -1))
    assert run(lg, greedy)[1] == 9
    mixed = list(MIXED)  # greedy rows among sampled ones give the same argmax
    assert run(lg, mixed, candidates=candidates)[4] == np.argmax(lg[4])


def test_idle_rows_and_padding_are_greedy():
    rows = make_rows_np([None, SamplingParams(seed=3)], 4)
    assert rows.temperature.tolist() == [0.0, 1.0, 0.0, 0.0]
    assert rows.penalty_window.tolist() == [0, 64, 0, 0]
    assert isinstance(make_rows([None], 2), SamplerRows)
    with pytest.raises(ValueError):
        make_rows([None] * 3, 2)


# ---------------------------------------------------------------------------------------------- filters


def _violations(x: np.ndarray, p: SamplingParams, tok: int) -> list[str]:
    """Why ``tok`` should not have been drawn from penalised logits ``x`` (tolerant only of f32 rounding)."""
    x = x.astype(np.float64)
    bad = []
    if p.is_greedy:
        return [] if tok == int(np.argmax(x)) else ["not argmax"]
    if 1 < p.top_k < x.size and np.sum(x > x[tok]) >= p.top_k:
        bad.append("top_k")
    in_k = x >= np.sort(x)[::-1][p.top_k - 1] if 1 < p.top_k < x.size else np.ones(x.shape, bool)
    q = np.where(in_k, np.exp((x - x.max()) / p.temperature), 0.0)
    q /= q.sum()
    if p.top_p < 1 and q[x > x[tok]].sum() >= p.top_p + 1e-5:
        bad.append("top_p")
    if p.min_p > 0 and x[tok] < x.max() + p.temperature * np.log(p.min_p) - 1e-4:
        bad.append("min_p")
    if q[tok] == 0:
        bad.append("zero probability")
    return bad


knobs = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.05, 0.5, 1.0, 2.0]),  # 2: the contract's ceiling
    top_k=st.sampled_from([0, 1, 2, 3, 5, 10, 63, 64, 100]),
    top_p=st.sampled_from([1.0, 0.99, 0.9, 0.5, 0.2, 1e-3]),
    min_p=st.sampled_from([0.0, 0.01, 0.1, 0.5, 1.0]),
    seed=st.integers(0, 2**64 - 1),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(params=st.lists(knobs, min_size=8, max_size=8), data_seed=st.integers(0, 2**32 - 1),
       ties=st.booleans(), step=st.integers(0, 2**31 - 1), candidates=st.sampled_from(PATHS))
def test_filters_never_emit_an_excluded_token(params, data_seed, ties, step, candidates):
    rng = np.random.default_rng(data_seed)
    lg = rng.normal(size=(8, V)) * rng.uniform(0.1, 6.0, size=(8, 1))
    if ties:  # integer logits: many exact ties at every boundary
        lg = np.round(lg)
    lg = lg.astype(np.float32)
    out = run(lg, params, step=step, candidates=candidates)
    allowed = kept(lg, params, candidates=candidates)
    for b in range(8):
        assert 0 <= out[b] < V
        assert allowed[b, out[b]], (b, params[b])
        why = _violations(lg[b], params[b], int(out[b]))
        assert not why, (b, params[b], why)


@pytest.mark.parametrize("candidates", PATHS)
def test_kept_set_matches_the_reference_semantics(candidates):
    """Continuous logits (no ties near a boundary): the kept set is exactly the documented one."""
    grid = [
        SamplingParams(top_k=k, top_p=tp, min_p=mp, temperature=t)
        for k in (0, 3, 17)
        for tp in (1.0, 0.95, 0.6)
        for mp in (0.0, 0.05)
        for t in (0.4, 1.0, 2.0)
    ]
    for i in range(0, len(grid), 8):
        chunk = (grid[i : i + 8] * 8)[:8]
        lg = logits_batch(100 + i, scale=1.5)
        got = kept(lg, chunk, candidates=candidates)
        for b in range(8):
            np.testing.assert_array_equal(got[b], reference_kept(lg[b], chunk[b]), err_msg=str(chunk[b]))


def test_tokens_tied_at_a_boundary_are_kept_together():
    lg = np.full((8, V), -5.0, np.float32)
    lg[:, 10] = 3.0
    lg[:, [20, 30, 40]] = 2.0  # tied second place
    got = kept(lg, [SamplingParams(top_k=2)] * 4 + [SamplingParams(top_p=0.75)] * 4)
    assert sorted(np.flatnonzero(got[0])) == [10, 20, 30, 40]
    assert sorted(np.flatnonzero(got[4])) == [10, 20, 30, 40]


@pytest.mark.parametrize("candidates", PATHS)
def test_draws_follow_the_filtered_distribution(candidates):
    """2048 seeded draws of one row match softmax(x / T) restricted to the kept set, renormalised."""
    n = 2048
    x = np.linspace(0.0, 3.0, V).astype(np.float32)[::-1].copy()
    for p in (SamplingParams(temperature=0.7), SamplingParams(top_p=0.9, top_k=40, temperature=1.5)):
        params = [replace(p, seed=s) for s in range(n)]
        out = run(np.tile(x, (n, 1)), params, np.full((n, W), -1), 0, candidates)
        keep = reference_kept(x, p)
        q = np.where(keep, np.exp((x - x.max()) / p.temperature), 0.0)
        q /= q.sum()
        freq = np.bincount(out, minlength=V) / n
        assert np.all(freq[~keep] == 0)
        assert np.abs(freq - q).max() < 0.04, (p, np.abs(freq - q).max())


def test_whole_vocabulary_draw_crosses_block_boundaries():
    """The fallback draw picks a 1024-token block, then a token: ids on both sides of block edges."""
    v, n = 2500, 1024
    x = np.full(v, -np.inf, np.float32)
    ids = np.array([0, 1023, 1024, 2047, 2048, 2499])
    x[ids] = np.log(np.array([1.0, 2.0, 3.0, 1.0, 2.0, 1.0]))
    params = [SamplingParams(seed=s) for s in range(n)]
    out = run(np.tile(x, (n, 1)), params, np.full((n, W), -1), 0)
    assert set(out.tolist()) <= set(ids.tolist())
    freq = np.array([(out == i).mean() for i in ids])
    np.testing.assert_allclose(freq, np.array([1, 2, 3, 1, 2, 1]) / 10, atol=0.05)


# ---------------------------------------------------------------------------------------------- penalties


def reference_penalties(x: np.ndarray, p: SamplingParams, history: list[int]) -> np.ndarray:
    x = x.astype(np.float64).copy()
    window = history[-p.penalty_window :] if p.penalty_window else []
    for t in set(window):
        c = window.count(t)
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        x[t] -= c * p.frequency_penalty + p.presence_penalty
    return x


def test_penalties_follow_the_documented_formula():
    lg = logits_batch(7)
    hist = [[3, 3, 5, 9, 9, 9, 60, 3], [1, 2], [], [7] * 8, [0, 63, 64, -1, 5], [4, 4, 4, 8, 8, 2, 2, 2], [10], [11]]
    ps = [
        SamplingParams(repetition_penalty=1.5),
        SamplingParams(presence_penalty=1.0),
        SamplingParams(frequency_penalty=2.0),
        SamplingParams(repetition_penalty=0.5, frequency_penalty=-0.5),
        SamplingParams(repetition_penalty=2.0, presence_penalty=0.5),
        SamplingParams(frequency_penalty=1.0, penalty_window=3),  # only the last 3 tokens count
        SamplingParams(),
        SamplingParams(repetition_penalty=1.2, penalty_window=0),  # window 0: no penalty
    ]
    rec = np.stack([recent_window(h, W) for h in hist])
    got = np.asarray(apply_penalties(jnp.asarray(lg), make_rows(ps, 8), jnp.asarray(rec)))
    for b in range(8):
        valid = [t for t in hist[b] if 0 <= t < V]  # -1 padding and out-of-range ids are ignored
        np.testing.assert_allclose(got[b], reference_penalties(lg[b], ps[b], valid), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got[6], lg[6])  # neutral knobs leave the logits bit-identical


def test_a_recent_token_loses_probability():
    lg = np.zeros((8, V), np.float32)
    lg[:, 5] = 4.0  # token 5 is the favourite (~40% of the mass)...
    lg[:, 6] = 3.9
    rec = np.tile(recent_window([5], W), (8, 1))  # ...and was just generated
    for p in (SamplingParams(repetition_penalty=1.2), SamplingParams(presence_penalty=0.5),
              SamplingParams(frequency_penalty=0.5)):
        greedy = replace(p, temperature=0.0)
        assert run(lg, [greedy] * 8, rec)[0] == 6  # greedy moves off the penalised token
        params = [replace(p, seed=s) for s in range(8)]
        hits = sum(int(np.sum(run(lg, params, rec, step=s) == 5)) for s in range(32))
        base = sum(int(np.sum(run(lg, params, None, step=s) == 5)) for s in range(32))
        assert hits < base - 20  # ~100 of 256 draws without penalty, ~60 with


def test_frequency_penalty_grows_with_the_count():
    lg = np.zeros((1, V), np.float32)
    p = SamplingParams(frequency_penalty=0.5)
    once = np.asarray(apply_penalties(lg, make_rows([p], 1), recent_window([4], W)[None]))[0, 4]
    thrice = np.asarray(apply_penalties(lg, make_rows([p], 1), recent_window([4, 1, 4, 4], W)[None]))[0, 4]
    assert once == pytest.approx(-0.5) and thrice == pytest.approx(-1.5)


# ---------------------------------------------------------------------------------------------- host side


def test_changing_knob_values_never_recompiles():
    compile_guard.install()
    lg = logits_batch(5)
    run(lg, MIXED)
    before = compile_guard.compile_count()
    for i in range(4):
        params = [SamplingParams(temperature=0.1 + 0.5 * i, top_k=i, top_p=0.5 + 0.1 * i, min_p=0.01 * i, seed=i,
                                 repetition_penalty=1 + i, presence_penalty=0.1 * i, penalty_window=i)] * 8
        run(lg, params, step=i)
    assert compile_guard.compile_count() == before


def test_sample_is_jittable_inside_a_larger_step():
    """The engine calls ``sample`` inside its own jit; ids are the only output."""

    @jax.jit
    def step_fn(h, rows, rec, steps):
        return sample(h @ jnp.eye(V, dtype=jnp.float32), rows, rec, steps)

    lg = logits_batch(8)
    out = step_fn(lg, make_rows(MIXED, 8), np.full((8, W), -1, np.int32), np.zeros(8, np.int32))
    assert out.dtype == jnp.int32 and out.shape == (8,)
    np.testing.assert_array_equal(np.asarray(out), run(lg, MIXED))


# ---------------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_k", -2),  # -1 is the contract's other "off"
        ("temperature", 2.01),  # past the contract's ceiling (pantheon.contract.SAMPLING)
        ("repetition_penalty", 10.5),
        ("top_k", 2.5),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("presence_penalty", 2.5),
        ("presence_penalty", -2.01),
        ("frequency_penalty", 3.0),
        ("frequency_penalty", -2.5),
        ("penalty_window", -1),
        ("seed", 1.5),
        ("temperature", True),
    ],
)
def test_out_of_range_knobs_are_rejected_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_boundary_values_are_accepted():
    SamplingParams(temperature=0, top_p=1, min_p=1, top_k=0, presence_penalty=-2, frequency_penalty=2,
                   repetition_penalty=0.01, penalty_window=0, seed=0)
    assert SamplingParams(temperature=0).is_greedy and SamplingParams(top_k=1).is_greedy
    assert not SamplingParams().is_greedy
    assert isinstance(SamplingParams(temperature=1).temperature, float)
