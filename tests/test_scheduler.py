"""The scheduler over a real (tiny) model: tokens alone == batched == joined mid-way == prefix hit, mixed steps,
hybrid state, no recompiles. Scheduling policy on a fake engine is in test_scheduler_policy.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import Collector, tiny_fixture, wait_until
from pantheon.runtime import compile_guard, engine
from pantheon.config import Settings
from pantheon.runtime.sampler import SamplingParams
from pantheon.scheduler import GenRequest
from pantheon.scheduler.batch import BatchScheduler
from pantheon.runtime import reference

GREEDY = SamplingParams(temperature=0.0)


def settings(**kw) -> Settings:
    base = dict(home=Path("/tmp"), batch_slots=8, queue_depth=32, queue_wait_s=30.0, prefill_chunk=16)
    base.update(kw)
    return Settings(**base)


@pytest.fixture(scope="module")
def model():
    path, _, _ = tiny_fixture("llama")
    return engine.load(path, engine.LoadOptions(n_slots=8, max_seq=128, prefill_chunk=16))


@pytest.fixture(scope="module")
def sched(model):
    s = BatchScheduler(model, settings(forbid_compile=True))
    yield s
    s.close()


def prompts() -> list[list[int]]:
    _, j, _ = tiny_fixture("llama")
    base = j["prompt_ids"]
    return [base[: 3 + 3 * i] + [7 + i] * i for i in range(8)]


def run_alone(model, prompt, params, n) -> list[int]:
    return list(reference.generate(model, prompt, params, max_tokens=n, stop_ids=[]))


def submit(sched, prompt, params=GREEDY, n=12, session=None) -> Collector:
    c = Collector()
    sched.submit(GenRequest(prompt_ids=prompt, params=params, max_tokens=n, session_id=session), c)
    return c


def test_tiny_oracle_through_the_scheduler(sched):
    _, j, _ = tiny_fixture("llama")
    c = submit(sched, j["prompt_ids"], n=16)
    assert c.done.wait(60)
    assert c.ids == j["greedy_ids"]
    assert c.finished.reason == "length" and c.finished.completion_tokens == 16


def test_eight_concurrent_streams_equal_their_single_request_outputs(model, sched):
    """Different lengths and sampling parameters, all in flight at once, each equal to running alone."""
    ps = prompts()
    params = [GREEDY, SamplingParams(temperature=0.8, seed=1), GREEDY, SamplingParams(temperature=1.0, top_k=5, seed=7),
              SamplingParams(temperature=0.7, top_p=0.9, seed=3), GREEDY, SamplingParams(min_p=0.1, seed=11),
              SamplingParams(temperature=0.0, repetition_penalty=1.3)]
    lengths = [5, 9, 13, 17, 7, 11, 15, 19]
    alone = [run_alone(model, p, prm, n) for p, prm, n in zip(ps, params, lengths)]
    cs = [submit(sched, p, prm, n) for p, prm, n in zip(ps, params, lengths)]
    for c in cs:
        assert c.done.wait(120)
    assert [c.ids for c in cs] == alone


def join_midway(model, sched, late_prompt) -> None:
    """A 30-token stream runs; a second request joins after 5 tokens; both equal running alone."""
    ps = prompts()
    first = submit(sched, ps[7], n=30)
    wait_until(lambda: len(first.ids) >= 5, 60, "5 tokens of the first stream")
    late = submit(sched, late_prompt, n=10)
    assert first.done.wait(60) and late.done.wait(60)
    assert first.ids == run_alone(model, ps[7], GREEDY, 30)
    assert late.ids == run_alone(model, late_prompt, GREEDY, 10)


def test_request_joining_midway_is_unaffected(model, sched):
    """The late prompt's chunk rides in one mixed step with the running stream's decode row."""
    mixed_before = sched.load_info()["mixed_steps"]
    join_midway(model, sched, prompts()[2])
    assert sched.load_info()["mixed_steps"] > mixed_before


def test_without_mixed_steps_prefill_and_decode_alternate_with_the_same_outputs(model):
    """PANTHEON_BS_MIXED=0: a chunk step, then a decode step (the seed's yield windows); same tokens."""
    s = BatchScheduler(model, settings(bs_mixed=False), warmup=False)
    try:
        join_midway(model, s, prompts()[4])
        info = s.load_info()
        assert info["mixed_steps"] == 0 and info["prefill_chunks"] >= 2
    finally:
        s.close()


def test_eos_finishes_with_stop(sched, model):
    _, j, _ = tiny_fixture("llama")
    eos = j["greedy_ids"][3]
    c = Collector()
    sched.submit(GenRequest(prompt_ids=j["prompt_ids"], params=GREEDY, max_tokens=16, stop_ids=frozenset({eos})), c)
    assert c.done.wait(60)
    assert c.ids == j["greedy_ids"][:4] and c.finished.reason == "stop"


def test_prefix_reuse_automatic_and_by_session(model):
    """A follow-up sharing a prefix prefills only the suffix and produces the cold-prefill output."""
    s = BatchScheduler(model, settings(batch_slots=2), warmup=False)
    try:
        _, j, _ = tiny_fixture("llama")
        base = j["prompt_ids"]
        first = submit(s, base[:20], n=6)
        assert first.done.wait(30)
        before = s.load_info()
        follow = base[:20] + first.ids[:5] + [9, 10, 11]
        second = submit(s, follow, n=6)
        assert second.done.wait(30)
        after = s.load_info()
        assert second.started.reused_tokens >= 20
        assert after["prefix_hits"] == before["prefix_hits"] + 1
        assert after["prefill_tokens"] - before["prefill_tokens"] == len(follow) - second.started.reused_tokens
        assert second.ids == run_alone(model, follow, GREEDY, 6)
        # by session: the slot holding the session is preferred even when another slot shares more
        third = submit(s, base[:10] + [5, 6], n=4, session="abc")
        assert third.done.wait(30)
        fourth = submit(s, base[:10] + [5, 6, 7, 8], n=4, session="abc")
        assert fourth.done.wait(30)
        assert fourth.started.reused_tokens == 12
        assert fourth.ids == run_alone(model, base[:10] + [5, 6, 7, 8], GREEDY, 4)
    finally:
        s.close()


@pytest.mark.slow  # waits for the whole catalog to compile, over 10 s on 2 cores: left out of make test-quick
def test_no_compilation_after_warmup(model, sched):
    """Every bucket compiled at start-up (the first ones before the scheduler serves, the rest in the
    background): serving mixed traffic afterwards compiles nothing."""
    assert model.wait_compiled(300) and model.compile_progress()[0] == model.compile_progress()[1]
    n0 = compile_guard.compile_count()
    ps = prompts()
    cs = [submit(sched, p + p, SamplingParams(temperature=0.5, seed=i), 9) for i, p in enumerate(ps)]
    for c in cs:
        assert c.done.wait(120)
    assert compile_guard.compile_count() == n0


def test_compile_after_warmup_is_an_error_under_the_guard():
    """PANTHEON_FORBID_COMPILE=1: a shape that warm-up did not compile fails its request, not the server."""
    path, j, _ = tiny_fixture("llama")
    fresh = engine.load(path, engine.LoadOptions(n_slots=2, max_seq=96, prefill_chunk=16))
    s = BatchScheduler(fresh, settings(batch_slots=2, forbid_compile=True), warmup=False)
    try:
        c = submit(s, j["prompt_ids"], n=3)
        assert c.done.wait(30)
        assert c.finished.reason == "error" and "compil" in str(c.finished.error)
    finally:
        s.close()


@pytest.mark.slow  # one of the few in-process tests over 10 s on 2 cores: left out of make test-quick
def test_hybrid_model_batches_and_reuses_only_its_committed_state():
    """qwen35moe (recurrent DeltaNet state): 8 concurrent greedy requests equal their single-request
    outputs; a session's second turn resumes from the slot's committed state and equals a cold run;
    a prompt diverging inside a slot's history is prefilled cold (the state cannot roll back). Prefix
    snapshots are off here: resuming from one is test_hybrid_prefix.py's subject."""
    path, j, _ = tiny_fixture("qwen35moe")
    m = engine.load(path, engine.LoadOptions(n_slots=8, max_seq=96, prefill_chunk=16))
    base = j["prompt_ids"]
    ps = [base[: 3 + 3 * i] for i in range(8)]
    alone = [run_alone(m, p, GREEDY, 8) for p in ps]
    s = BatchScheduler(m, settings(batch_slots=8, prefix_snapshot_mb=0), warmup=False)
    try:
        cs = [submit(s, p, n=8, session=f"s{i}") for i, p in enumerate(ps)]
        for c in cs:
            assert c.done.wait(120)
        assert [c.ids for c in cs] == alone
        turn2 = ps[5] + cs[5].ids[:7] + [5, 6]  # history the slot committed, then the next user turn
        t2 = submit(s, turn2, n=5, session="s5")
        assert t2.done.wait(60) and t2.started.reused_tokens == len(ps[5]) + 7
        assert t2.ids == run_alone(m, turn2, GREEDY, 5)
        div = submit(s, ps[7][:-2] + [9, 9, 9], n=5, session="s7")
        assert div.done.wait(60) and div.started.reused_tokens == 0
        assert div.ids == run_alone(m, ps[7][:-2] + [9, 9, 9], GREEDY, 5)
    finally:
        s.close()
