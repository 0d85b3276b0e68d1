"""Speculative decoding: drafts verified inside the step give the very tokens plain decoding gives.

The engine's verify step (every attention-only tiny fixture): right, wrong and half-right drafts,
greedy and seeded sampling, stop ids and budgets inside a draft; architectures with recurrent state
refuse drafts. The scheduler with prompt-lookup drafts: alone == batched == joined mid-way == prefix
hit, with drafts accepted; logprobs, n > 1 and grammar requests unchanged; the `speculative` opt-out.
And the sampling rule, measured: a draft is accepted as often as the target gives it probability."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from conftest import TINY, Collector, tiny_fixture, tiny_model
from pantheon.config import Settings
from pantheon.jax_models.registry import capabilities_of
from pantheon.runtime import decode_state, engine, reference
from pantheon.runtime.engine import Chunk, StepPlan
from pantheon.scheduler import GenRequest
from pantheon.scheduler.batch import BatchScheduler
from pantheon.scheduler.drafts import DraftBudget, PromptLookup
from pantheon.types import SamplingParams, Tokens

GREEDY = SamplingParams(temperature=0.0)
SEEDED = (SamplingParams(temperature=0.9, seed=7),
          SamplingParams(temperature=1.0, top_p=0.9, top_k=40, seed=3, repetition_penalty=1.3))
FIXTURES = sorted(json.loads(p.read_text())["gguf_file"].removesuffix(".gguf") for p in TINY.glob("*.json"))


def _drafters(base: list[int], prompt_len: int, vocab: int) -> dict:
    """Draft functions over a known plain output `base`: all right, all wrong, right then wrong."""
    def ahead(seq, k):
        n = len(seq) - prompt_len
        return base[n:n + k]
    return {
        "right": lambda seq: ahead(seq, 6),
        "wrong": lambda seq: [(t + 1) % vocab for t in ahead(seq, 3)],
        "half": lambda seq: (lambda d: d[:2] + [(t + 5) % vocab for t in d[2:]])(ahead(seq, 5)),
    }


@pytest.mark.parametrize("name", FIXTURES)
def test_verified_drafts_give_the_tokens_of_plain_decoding(name):
    m = tiny_model(name)
    _, j, _ = tiny_fixture(name)
    prompt = j["prompt_ids"][:12]
    if not m.supports_verify:  # recurrent state cannot be rewound past a rejected draft: no drafts taken
        assert capabilities_of(m.arch).recurrent_state
        state = m.insert(m.new_state(), decode_state.slot_insert(0, [1], 1, GREEDY.resolved(), 4, ()))
        with pytest.raises(ValueError, match="does not verify"):
            m.step(state, StepPlan(decode=(0,), drafts=((1, 2),), reach=4))
        return
    for params in (GREEDY, *SEEDED):
        base = list(reference.generate(m, prompt, params, max_tokens=30, stop_ids=[]))
        for how, draft in _drafters(base, len(prompt), m.config.vocab).items():
            got = list(reference.generate(m, prompt, params, max_tokens=30, stop_ids=[], draft=draft))
            assert got == base, (name, params, how)


def test_a_stop_id_or_the_budget_inside_the_drafts_ends_the_output_there():
    m = tiny_model("llama")
    prompt = tiny_fixture("llama")[1]["prompt_ids"][:10]
    base = list(reference.generate(m, prompt, GREEDY, max_tokens=24, stop_ids=[]))
    k = next(i for i in range(3, len(base)) if base[i] not in base[:i])
    stop = base[k]
    right = _drafters(base, len(prompt), m.config.vocab)["right"]
    with_stop = list(reference.generate(m, prompt, GREEDY, max_tokens=24, stop_ids=[stop], draft=right))
    assert with_stop == base[:k + 1]  # the stop id is the last token: nothing drafted after it leaks
    for budget in (1, 2, 5, 7):
        assert list(reference.generate(m, prompt, GREEDY, max_tokens=budget, stop_ids=[], draft=right)) == base[:budget]


def test_a_verify_step_reports_only_the_emitted_rows_and_rewinds_the_position():
    m = tiny_model("llama")
    prompt = tiny_fixture("llama")[1]["prompt_ids"][:10]
    base = list(reference.generate(m, prompt, GREEDY, max_tokens=8, stop_ids=[]))
    state = m.insert(m.new_state(), decode_state.slot_insert(0, prompt, 0, GREEDY.resolved(), 8, ()))
    h, state = m.step(state, StepPlan(chunk=Chunk(0, tuple(prompt), 0, True)))
    assert int(m.read(h)[0, 0]) == base[0]
    wrong = (base[1], base[2], (base[3] + 1) % m.config.vocab)  # two right, then one wrong
    h, state = m.step(state, StepPlan(decode=(0,), drafts=(wrong,), reach=len(prompt) + 4))
    out = m.read(h)
    K = m.verify_ks[0]
    assert out.shape == (K + 1, 2)
    assert [int(t) for t, f in out if f != decode_state.IDLE] == base[1:4]  # two accepted + the corrected one
    assert [int(f) for f in out[:, 1]] == [decode_state.RUNNING] * 3 + [decode_state.IDLE] * (K - 2)
    assert int(state.slots.pos[0]) == len(prompt) + 3 and int(state.slots.last[0]) == base[3]
    h, state = m.step(state, StepPlan(decode=(0,), reach=len(prompt) + 4))  # a plain step goes on from there
    assert int(m.read(h)[0, 0]) == base[4]


def test_acceptance_happens_as_often_as_the_target_gives_the_draft_probability():
    """Rejection sampling with a deterministic draft accepts it with probability p(draft) and otherwise
    draws from p without it. The verify step accepts a draft iff it equals the seeded sample at its
    position -- the same law. Measured: over 240 seeds the accepted count stays within 4 standard
    deviations of the sum of p(draft); and each seed's tokens equal plain decoding's."""
    m = tiny_model("llama")
    prompt = tiny_fixture("llama")[1]["prompt_ids"][:6]
    temp = 0.3  # (this random model's distribution is flat at 1: the top token would hold ~5%)
    cond: dict[int, np.ndarray] = {}

    def next_probs(t0: int) -> np.ndarray:  # p(. | prompt + t0) at temperature `temp`, teacher-forced
        if t0 not in cond:
            lg = reference.logits(m, prompt + [t0])[-1].astype(np.float64) / temp
            e = np.exp(lg - lg.max())
            cond[t0] = e / e.sum()
        return cond[t0]

    accepted, expected, var = 0, 0.0, 0.0
    for seed in range(240):
        params = SamplingParams(temperature=temp, seed=seed)
        plain = list(reference.generate(m, prompt, params, max_tokens=3, stop_ids=[]))
        p = next_probs(plain[0])
        d = int(np.argmax(p))
        spec = list(reference.generate(m, prompt, params, max_tokens=3, stop_ids=[],
                                       draft=lambda seq: [d] if len(seq) == len(prompt) + 1 else []))
        assert spec == plain
        accepted += plain[1] == d
        expected += p[d]
        var += p[d] * (1 - p[d])
    print(f"accepted {accepted} of 240, expected {expected:.1f} +- {math.sqrt(var):.1f}")
    assert 0.05 < expected / 240 < 0.95, "the draft should be neither certain nor hopeless for this check"
    assert abs(accepted - expected) < 4 * math.sqrt(var), (accepted, expected, var)


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    lk = PromptLookup([1, 2, 3, 4, 5, 9, 2, 3])
    assert lk.propose(3) == (4, 5, 9)  # [2, 3] occurred before, followed by 4 5 9
    lk.append(4)
    assert lk.propose(2) == (5, 9)  # [2, 3, 4] -> 5 9
    assert PromptLookup([1, 2, 3]).propose(4) == ()  # no earlier occurrence
    assert PromptLookup([7, 7, 7, 7]).propose(4) == (7,)  # the latest match's continuation, clipped to the end


def test_the_draft_count_follows_the_acceptance():
    b = DraftBudget(8)
    assert b.k == 4
    b.verified(4, 4)
    assert b.k == 8
    b.verified(8, 2)
    assert b.k == 3
    b.verified(3, 0)
    assert b.k == 1
    for _ in range(DraftBudget.MISSES_BEFORE_REST - 1):
        b.missed()
    assert b.resting
    for _ in range(DraftBudget.REST_STEPS):
        b.rested()
    assert not b.resting


# ---- the scheduler --------------------------------------------------------------------------------
def settings(**kw) -> Settings:
    # (spec_gauge off: whether verify steps pay on this machine is a wall-clock measurement, and these
    # tests count the drafts; tests/test_speculative.py checks the gauge's rule on given timings)
    base = dict(home=Path("/tmp"), batch_slots=8, queue_depth=32, queue_wait_s=30.0, prefill_chunk=16, warmup=False,
                spec_gauge=False)
    base.update(kw)
    return Settings(**base)


@pytest.fixture(scope="module")
def model():
    path, _, _ = tiny_fixture("llama")
    return engine.load(path, engine.LoadOptions(n_slots=8, max_seq=128, prefill_chunk=16))


@pytest.fixture(scope="module")
def sched(model):
    s = BatchScheduler(model, settings())
    yield s
    s.close()


def spec_prompts() -> list[list[int]]:
    """Prompts on which this tiny model repeats itself (prompt lookup then drafts right tokens)."""
    base = tiny_fixture("llama")[1]["prompt_ids"]
    return [[7 + i] * (10 + i) if i % 2 else base[:5 + i] * 3 for i in range(6)]


def submit(sched, prompt, params=GREEDY, n=24, **kw) -> Collector:
    c = Collector()
    sched.submit(GenRequest(prompt_ids=prompt, params=params, max_tokens=n, **kw), c)
    return c


def alone(model, prompt, params=GREEDY, n=24) -> list[int]:
    return list(reference.generate(model, prompt, params, max_tokens=n, stop_ids=[]))


def batched_joined_and_alone(model, sched) -> None:
    """Three streams batched, then one joined by another mid-way, greedy and seeded: each equals the same
    request decoded alone without drafts."""
    ps = spec_prompts()
    params = [GREEDY if i % 2 else SamplingParams(temperature=0.8, seed=11 + i) for i in range(len(ps))]
    cs = [submit(sched, p, prm) for p, prm in zip(ps[:3], params)]
    for c in cs:
        assert c.done.wait(120)
    first = submit(sched, ps[3], params[3], n=40)
    while len(first.ids) < 5 and not first.done.is_set():
        first.done.wait(0.01)
    late = submit(sched, ps[4], params[4], n=20)
    for c in (first, late):
        assert c.done.wait(120)
    assert [c.ids for c in cs] == [alone(model, p, prm) for p, prm in zip(ps[:3], params)]
    assert first.ids == alone(model, ps[3], params[3], 40)
    assert late.ids == alone(model, ps[4], params[4], 20)


def test_batched_and_joined_streams_with_speculation_equal_plain_decoding_alone(model, sched):
    before = sched.load_info()
    batched_joined_and_alone(model, sched)
    after = sched.load_info()
    assert after["spec_accepted"] > before["spec_accepted"]  # drafts were verified and kept
    assert after["spec_steps"] > before["spec_steps"]


def test_a_prefix_hit_with_speculation_equals_a_cold_prefill(model, sched):
    p = spec_prompts()[1]
    first = submit(sched, p, n=10, session_id="spec")
    assert first.done.wait(120)
    follow = p + first.ids + [7, 8, 7, 8]
    hits = sched.load_info()["prefix_hits"]
    second = submit(sched, follow, n=12, session_id="spec")
    assert second.done.wait(120)
    assert sched.load_info()["prefix_hits"] == hits + 1
    assert second.ids == alone(model, follow, n=12)


def test_opting_out_drafts_nothing_and_gives_the_same_tokens(model, sched):
    p = spec_prompts()[1]
    before = sched.load_info()["spec_drafted"]
    off = submit(sched, p, speculative=False)
    assert off.done.wait(120)
    assert sched.load_info()["spec_drafted"] == before
    on = submit(sched, p)
    assert on.done.wait(120)
    assert sched.load_info()["spec_drafted"] > before
    assert off.ids == on.ids == alone(model, p)


def test_logprobs_and_stops_keep_their_meaning_under_speculation(model, sched):
    p = spec_prompts()[5]
    plain = alone(model, p, n=24)
    stop = plain[12]
    runs = []
    for spec in (False, True):
        # (scopes apart: no prefix hit, so both prefill the whole prompt the same way)
        c = submit(sched, p, logprobs=4, speculative=spec, stop_ids=frozenset({stop}), cache_scope=f"lp{spec}")
        assert c.done.wait(120)
        runs.append(c)
    off, on = runs
    assert on.ids == off.ids == plain[:plain.index(stop) + 1]
    assert on.finished.reason == off.finished.reason == "stop"
    lp = [[ev.logprobs for ev in c.events if isinstance(ev, Tokens)] for c in runs]
    assert lp[0] == lp[1]  # the same values, bit for bit: each row is computed as plain decoding's


def test_n_choices_and_grammar_requests_are_unchanged(model, sched):
    from test_scheduler_surface import Events, OnlyTokens
    p = spec_prompts()[1]
    params = SamplingParams(temperature=0.9, seed=5)
    got = []
    for spec in (False, True):
        ev = Events(3)
        sched.submit(GenRequest(prompt_ids=p, params=params, max_tokens=16, n=3, speculative=spec), ev)
        got.append([ev.wait().ids(i) for i in range(3)])
    assert got[0] == got[1]
    before = sched.load_info()["spec_drafted"]
    g = [OnlyTokens({11, 29, 301}, 5) for _ in range(2)]
    outs = []
    for spec, gram in zip((False, True), g):
        ev = Events(1)
        sched.submit(GenRequest(prompt_ids=p, params=GREEDY, max_tokens=20, constraint=gram,
                                stop_ids=frozenset({2}), speculative=spec), ev)
        outs.append(ev.wait().ids())
    assert outs[0] == outs[1] and set(outs[0][:5]) <= {11, 29, 301}
    assert sched.load_info()["spec_drafted"] == before  # a constrained slot never drafts

    # a constrained stream beside a drafting one: both go on (plain steps while the grammar decodes)
    free, bound = Events(1), Events(1)
    sched.submit(GenRequest(prompt_ids=spec_prompts()[1], params=GREEDY, max_tokens=24), free)
    sched.submit(GenRequest(prompt_ids=p, params=GREEDY, max_tokens=20, constraint=OnlyTokens({11, 29, 301}, 5),
                            stop_ids=frozenset({2})), bound)
    assert free.wait().ids() == alone(model, spec_prompts()[1])
    assert bound.wait().ids() == outs[0] and bound.finished[0].reason == "stop"


@pytest.mark.slow  # every program compiled in the test, over 10 s on 2 cores: left out of make test-quick
def test_verify_programs_are_made_by_warm_up_and_nothing_compiles_after(model):
    s = BatchScheduler(model, settings(warmup=True, forbid_compile=True))
    try:
        assert model.wait_compiled(600)
        assert any(k[0] == "accept" for k in model._programs) and not model.compile_errors
        ps = spec_prompts()
        before = s.load_info()["spec_accepted"]
        cs = [submit(s, p) for p in ps[:2]]
        for c in cs:
            assert c.done.wait(120)
        assert s.failure is None
        assert s.load_info()["spec_accepted"] > before
        assert [c.ids for c in cs] == [alone(model, p) for p in ps[:2]]
    finally:
        s.close()


# ---- real models ----------------------------------------------------------------------------------
DOCUMENT = ("def area(width, height):\n    return width * height\n\n\ndef perimeter(width, height):\n"
            "    return 2 * (width + height)\n")


@pytest.mark.real
@pytest.mark.parametrize("name", ["smollm2-135m", "qwen-0.5b"])
def test_real_models_give_the_same_tokens_with_prompt_lookup_drafts(name, load_real):
    """A quoting prompt (prompt lookup drafts well) and a free-form one: greedy with drafts == without."""
    from conftest import real_fixture
    model = load_real(name)
    stops = list(real_fixture(name)["stop_ids"])
    asks = [f"Repeat this code exactly, then stop:\n\n{DOCUMENT}", "Write a short poem about the sea."]
    accepted = 0
    for ask in asks:
        text = model.card.template.render([{"role": "user", "content": ask}], add_generation_prompt=True)
        prompt = model.tokenizer.encode(text)
        plain = list(reference.generate(model, prompt, GREEDY, max_tokens=48, stop_ids=stops))
        lookup = PromptLookup(prompt)
        proposed: list[tuple[int, ...]] = []

        def draft(seq: list[int]) -> tuple[int, ...]:
            while len(lookup.seq) < len(seq):
                lookup.append(seq[len(lookup.seq)])
            d = lookup.propose(model.verify_ks[-1])
            proposed.append(d)
            return d

        spec = list(reference.generate(model, prompt, GREEDY, max_tokens=48, stop_ids=stops, draft=draft))
        assert spec == plain, (name, ask)
        accepted += len(plain) - 1 - len(proposed)  # tokens that needed no step of their own
    assert accepted > 0


def test_speculation_rests_where_verify_steps_give_fewer_tokens_per_second():
    from pantheon.scheduler.drafts import SpecGauge
    g = SpecGauge()
    for _ in range(SpecGauge.MIN_SAMPLES):
        g.plain(1, 0.010)  # 100 tokens/s plainly
        g.verify(1, 0.030, 2)  # 67 tokens/s verifying: slower
        g.tick()
    assert not g.pays(1)  # measured slower: rest
    assert g.pays(2)  # (another slot count has its own measurements)
    for _ in range(SpecGauge.REST_STEPS - 1):
        g.tick()
    assert not g.pays(1)
    g.tick()
    assert g.pays(1)  # rested: probe again from fresh samples
    for _ in range(SpecGauge.MIN_SAMPLES):
        g.verify(1, 0.015, 3)  # 200 tokens/s: pays
    assert g.pays(1)


@pytest.mark.real
def test_a_real_model_through_the_scheduler_drafts_and_keeps_its_tokens(load_real):
    """SmolLM2 quoting its prompt, two streams at once through the scheduler: drafts accepted, and each
    stream's tokens are its greedy tokens alone."""
    from conftest import real_fixture
    model = load_real("smollm2-135m")
    stops = frozenset(real_fixture("smollm2-135m")["stop_ids"])
    asks = [f"Repeat this code exactly, then stop:\n\n{DOCUMENT}", "Write a short poem about the sea."]
    prompts = [model.tokenizer.encode(model.card.template.render([{"role": "user", "content": a}],
                                                                 add_generation_prompt=True)) for a in asks]
    want = [list(reference.generate(model, p, GREEDY, max_tokens=40, stop_ids=stops)) for p in prompts]
    sched = BatchScheduler(model, settings(prefill_chunk=128))
    try:
        cs = [submit(sched, p, n=40, stop_ids=stops) for p in prompts]
        for c in cs:
            assert c.done.wait(600)
        assert [c.ids for c in cs] == want
        assert sched.load_info()["spec_accepted"] > 0
    finally:
        sched.close()


@pytest.mark.slow  # a model of its own in the int8 form, its steps and verify steps compiled, over 10 s on 2 cores: left out of make test-quick
def test_the_int8_products_keep_batching_and_speculation_invisible():
    """The serving default on a quantized file: the int8 products give a row the same bits whatever rows
    share the call (a verify step of K + 1 rows, a prefill chunk, 8 decode rows), so streams batched,
    joined mid-way and speculated equal each request decoded alone without drafts."""
    path, _, _ = tiny_fixture("llama.q8_0")
    m = engine.load(path, engine.LoadOptions(n_slots=8, max_seq=128, prefill_chunk=16, native_dot="int8"))
    assert m.kernels.dot == "int8" and m.kernels.matmul
    s = BatchScheduler(m, settings())
    try:
        batched_joined_and_alone(m, s)
        assert s.load_info()["spec_steps"] > 0
    finally:
        s.close()
