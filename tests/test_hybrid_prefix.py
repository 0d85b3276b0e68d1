"""Prefix snapshots of recurrent slots (pantheon.scheduler.snapshots): a hybrid model's second turn, or a
request sharing a system prompt, resumes from the longest snapshotted prefix instead of prefilling it
again -- and generates exactly what a full recompute does.

The tiny fixtures are prefilled in chunks of 16, so a 20-token prompt leaves snapshots at 16 and 20."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import Collector, tiny_fixture, wait_until
from pantheon.config import Settings
from pantheon.runtime import engine, reference
from pantheon.runtime.sampler import SamplingParams
from pantheon.scheduler import GenRequest
from pantheon.scheduler.batch import BatchScheduler
from pantheon.scheduler.snapshots import SnapshotPool, pool_bytes, prefix_digest

GREEDY = SamplingParams(temperature=0.0)
CHUNK = 16


def settings(**kw) -> Settings:
    base = dict(home=Path("/tmp"), batch_slots=4, queue_depth=8, queue_wait_s=60.0, prefill_chunk=CHUNK)
    base.update(kw)
    return Settings(**base)


def load(name: str) -> engine.Model:
    path, _, _ = tiny_fixture(name)
    return engine.load(path, engine.LoadOptions(n_slots=4, max_seq=96, prefill_chunk=CHUNK))


def run(sched: BatchScheduler, prompt: list[int], n: int = 6, **kw) -> Collector:
    c = Collector()
    sched.submit(GenRequest(prompt_ids=prompt, params=GREEDY, max_tokens=n, **kw), c)
    assert c.done.wait(300), "request did not finish"
    assert c.finished.reason in ("length", "stop"), c.finished
    return c


def full_recompute(model: engine.Model, prompt: list[int], n: int = 6) -> list[int]:
    return list(reference.generate(model, prompt, GREEDY, max_tokens=n, stop_ids=[]))


@pytest.fixture(scope="module")
def qwen35moe():
    return load("qwen35moe")


# qwen35 loads and warms a model of its own (over 10 s on 2 cores): not in make test-quick.
@pytest.mark.parametrize("name", ["qwen35moe", pytest.param("qwen35", marks=pytest.mark.slow)])
def test_turn_two_resumes_from_a_snapshot_and_equals_a_full_recompute(name, qwen35moe, monkeypatch):
    """Turn 2 re-sends turn 1's prompt and an answer that differs from what the slot generated (as a
    template that strips a reasoning block does): the slot's own state is past the divergence, so it
    cannot serve it; the snapshot at turn 1's prompt end can. The compiled programs are the warm-up's
    (no compile while serving: the snapshot and restore verbs are among the first programs)."""
    monkeypatch.setenv("PANTHEON_EXEC_STORE", "0")  # programs compiled here (the store has tests of its own)
    m = qwen35moe if name == "qwen35moe" else load(name)
    base = tiny_fixture(name)[1]["prompt_ids"]
    s = BatchScheduler(m, settings(forbid_compile=True, warmup=True, warmup_background=True))
    try:
        turn1 = base[:20]
        a = run(s, turn1, session_id="chat")
        assert a.started.reused_tokens == 0
        turn2 = turn1 + a.ids[:3] + [9, 9] + base[20:24]  # the answer as re-rendered, then the next user turn
        b = run(s, turn2, session_id="chat")
        assert b.started.reused_tokens == len(turn1) == b.finished.reused_tokens  # cached_tokens
        assert b.ids == full_recompute(m, turn2)
        assert s.load_info()["snapshot_resumes"] == 1
    finally:
        s.close()


def test_a_request_sharing_a_system_prompt_resumes_in_another_slot(qwen35moe):
    """While a request that began with a system prompt still decodes in its slot, a second one with the
    same system prompt goes to another slot: the source slot's K/V rows are copied and the snapshot at
    the last chunk boundary inside the system prompt is restored over them."""
    m = qwen35moe
    base = tiny_fixture("qwen35moe")[1]["prompt_ids"]
    system = base[:18]
    s = BatchScheduler(m, settings(), warmup=False)
    try:
        first = Collector()
        s.submit(GenRequest(prompt_ids=system + [3, 4, 5], params=GREEDY, max_tokens=70), first)
        wait_until(lambda: len(first.ids) > 0, timeout=300, what="the first request's first token")
        second_prompt = system + [7, 8, 9, 10]
        second = run(s, second_prompt)
        assert not first.done.is_set()  # it held its slot the whole time: the second resumed elsewhere
        assert second.started.reused_tokens == CHUNK
        assert second.ids == full_recompute(m, second_prompt)
        first_alone = full_recompute(m, system + [3, 4, 5], 70)
        assert first.done.wait(300) and first.ids == first_alone[:len(first.ids)]
    finally:
        s.close()


def test_a_snapshot_is_never_used_across_cache_scopes(qwen35moe):
    m = qwen35moe
    base = tiny_fixture("qwen35moe")[1]["prompt_ids"]
    s = BatchScheduler(m, settings(), warmup=False)
    try:
        p = base[:20]
        run(s, p, cache_scope="tenant-a")
        other = p + [11, 12]
        b = run(s, other, cache_scope="tenant-b")
        assert b.started.reused_tokens == 0 and b.ids == full_recompute(m, other)
        c = run(s, p[:17] + [13, 14], cache_scope="tenant-a")  # diverges inside the slot's history
        assert c.started.reused_tokens == CHUNK
    finally:
        s.close()


def test_eviction_keeps_the_pool_within_its_byte_budget(qwen35moe):
    """A pool of two snapshots: a 40-token prompt leaves three (16, 32, 40); the least recently used (16)
    goes, and the next turn still resumes from the prompt's end."""
    m = qwen35moe
    base = tiny_fixture("qwen35moe")[1]["prompt_ids"]
    s = BatchScheduler(m, settings(), warmup=False)
    one = m.snapshot_bytes()
    s._snapshots = SnapshotPool(2 * one, one)  # before any request: the driver has not touched it
    try:
        p = (base * 2)[:40]
        a = run(s, p)
        assert sorted(e.n for e in s._snapshots.entries()) == [32, 40]
        assert s._snapshots.bytes == 2 * one and s.load_info()["snapshots_evicted"] == 1
        nxt = p + a.ids[:1] + [9, 9]
        b = run(s, nxt)
        assert b.started.reused_tokens == 40 and b.ids == full_recompute(m, nxt)
    finally:
        s.close()


def test_pool_evicts_least_recently_used_and_matches_whole_prefixes():
    pool = SnapshotPool(budget_bytes=250, entry_bytes=100)
    assert pool.enabled
    pool.add("", [1, 2, 3], slot=0, state="s3")
    pool.add("", [1, 2, 3, 4, 5], slot=0, state="s5")
    first = pool.best("", [1, 2, 3, 9], limit=3, usable=lambda e: True)
    assert first is not None and first.state == "s3"
    pool.touch(first)  # now the most recently used: the next add evicts s5
    pool.add("", [7, 7], slot=1, state="s7")
    assert sorted(e.state for e in pool.entries()) == ["s3", "s7"] and pool.bytes == 200 and pool.evicted == 1
    assert pool.best("", [1, 2, 3, 4, 5, 6], limit=5, usable=lambda e: True).state == "s3"
    assert pool.best("", [1, 2, 4], limit=2, usable=lambda e: True) is None  # no whole-prefix match
    assert pool.best("x", [1, 2, 3, 4], limit=3, usable=lambda e: True) is None  # another scope
    assert pool.best("", [1, 2, 3, 4], limit=3, usable=lambda e: e.slot != 0) is None  # its source is gone
    pool.overwritten(slot=0, keep=2)
    assert [e.state for e in pool.entries()] == ["s7"] and pool.bytes == 100
    assert prefix_digest([1, 2]) != prefix_digest([1, 2, 0])
    assert not SnapshotPool(99, 100).enabled and not SnapshotPool(100, 0).enabled


def test_the_load_estimate_charges_the_pool_it_can_fill():
    assert pool_bytes(0, 1000, 4, 96, 16) == 0 and pool_bytes(1024, 0, 4, 96, 16) == 0
    assert pool_bytes(1024, 1000, 4, 96, 16) == 5 * 6 * 1000  # every boundary of every slot
    assert pool_bytes(1, 65_863_680, 8, 8192, 512) == 1 << 20  # the budget binds a large hybrid
    from pantheon.serving.dies import estimate_load_bytes
    from pantheon.jax_models import qwen35
    opts = engine.LoadOptions(n_slots=4, max_seq=96, prefill_chunk=CHUNK)
    path = tiny_fixture("qwen35")[0]
    est = estimate_load_bytes(path, opts)
    per_seq = qwen35.state_bytes_per_sequence(engine.load(path, opts).config)
    assert est.snapshot_bytes == 5 * 6 * per_seq > 0
    assert est.total_bytes > est.weights_bytes + est.state_bytes + est.snapshot_bytes


@pytest.mark.slow  # a model of its own and its steps compiled, over 10 s on 2 cores: left out of make test-quick
def test_rwkv7_snapshots_need_no_source_slot():
    """RWKV-7 has no per-token state: its snapshot is the whole cache of the prefix, so it resumes
    into any slot with no copy, even after the source slot was given to another prompt."""
    m = engine.load(tiny_fixture("rwkv7")[0], engine.LoadOptions(n_slots=2, max_seq=96, prefill_chunk=CHUNK))
    base = tiny_fixture("rwkv7")[1]["prompt_ids"]
    s = BatchScheduler(m, settings(batch_slots=1), warmup=False)
    try:
        p = base[:20]
        run(s, p)
        run(s, [5] * 18)  # the only slot now holds another prompt
        nxt = p + [9, 9, 9]
        b = run(s, nxt)
        assert b.started.reused_tokens == 20 and b.ids == full_recompute(m, nxt)
        assert s.load_info()["snapshot_resumes"] == 1
    finally:
        s.close()
