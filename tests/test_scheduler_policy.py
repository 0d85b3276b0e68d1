"""Scheduling on a fake engine (tests/fake_engine.py): admission, backpressure, cancellation, reuse
scopes, the single-user setting and the asynchronous driver's bookkeeping. No JAX step runs here;
numerics through the scheduler are in test_scheduler.py."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest

from conftest import Collector, wait_until
from fake_engine import FakeModel
from pantheon.config import Settings
from pantheon.errors import BusyError
from pantheon.types import GREEDY, GenRequest
from pantheon.scheduler.batch import BatchScheduler


def settings(**kw) -> Settings:
    return Settings(**{"home": Path("/tmp"), "batch_slots": 4, "queue_depth": 32, "queue_wait_s": 30.0,
                       "prefill_chunk": 8, **kw})


def prompt(i: int, n: int = 12) -> list[int]:
    return [100 + i] + list(range(1, n))


@pytest.fixture()
def run():
    """Build schedulers on fake models; every one is closed at the end of the test."""
    made: list[BatchScheduler] = []

    def make(model: FakeModel | None = None, **kw) -> tuple[BatchScheduler, FakeModel]:
        m = model or FakeModel()
        s = BatchScheduler(m, settings(**kw), warmup=False)
        made.append(s)
        return s, m

    yield make
    for s in made:
        s.close()


def submit(s, p, n=6, **kw) -> Collector:
    c = Collector()
    s.submit(GenRequest(prompt_ids=p, params=GREEDY, max_tokens=n, **kw), c)
    return c


def test_concurrent_requests_each_get_what_they_would_alone(run):
    s, m = run()
    cs = [submit(s, prompt(i, 5 + 3 * i), n=4 + i) for i in range(6)]  # more requests than slots: some queue
    for i, c in enumerate(cs):
        assert c.done.wait(30)
        assert c.ids == m.generate_alone(prompt(i, 5 + 3 * i), 4 + i)
        assert c.finished.reason == "length" and c.finished.completion_tokens == 4 + i


def test_a_stop_id_ends_the_request_with_stop(run):
    s, m = run()
    ref = m.generate_alone(prompt(0), 10)
    c = submit(s, prompt(0), n=10, stop_ids=frozenset({ref[3]}))
    assert c.done.wait(30) and c.ids == ref[:4] and c.finished.reason == "stop"


def test_a_finished_slot_costs_at_most_one_dead_row(run):
    """The driver dispatches step N+1 before reading N: a slot that finished in N may ride in N+1 as a
    dead row, never in N+2."""
    s, m = run()
    long, short = submit(s, prompt(0), n=30), submit(s, prompt(1), n=3)
    assert long.done.wait(30) and short.done.wait(30)
    decoded = [plan.decode for plan in m.steps]
    finished_at = None  # the step whose read finished the short request: its third token
    tokens = 0
    for i, plan in enumerate(m.steps):
        tokens += (1 in plan.decode) + (plan.chunk is not None and plan.chunk.slot == 1 and plan.chunk.final)
        if tokens == 3:
            finished_at = i
            break
    assert finished_at is not None
    later = [i for i, d in enumerate(decoded) if i > finished_at and 1 in d]
    assert later in ([], [finished_at + 1])


def test_queue_then_429_with_retry_after(run):
    s, m = run(queue_depth=2)
    m.gate = threading.Event()  # hold the driver: nothing finishes until the gate opens
    running = [submit(s, prompt(i), n=5) for i in range(4)]
    queued = [submit(s, prompt(i), n=2) for i in range(2)]
    with pytest.raises(BusyError) as exc:
        s.submit(GenRequest(prompt_ids=prompt(9), params=GREEDY, max_tokens=2), Collector())
    assert exc.value.status == 429 and exc.value.retry_after == 5
    m.gate.set()
    for c in running + queued:
        assert c.done.wait(30) and c.finished.reason == "length"


def test_queue_wait_timeout_is_429_retry_after_2(run):
    s, m = run(FakeModel(max_seq=10**7), batch_slots=1, queue_wait_s=0.05)
    hog = Collector()
    h = s.submit(GenRequest(prompt_ids=prompt(0), params=GREEDY, max_tokens=10**7), hog)  # runs until cancelled
    waiter = submit(s, prompt(1), n=2)
    assert waiter.done.wait(30)
    fin = waiter.finished
    assert fin.reason == "error" and isinstance(fin.error, BusyError)
    assert fin.error.status == 429 and fin.error.retry_after == 2 and waiter.started is None
    h.cancel()
    assert hog.done.wait(30)


def test_cancel_frees_the_slot_and_a_cancelled_queued_request_leaves_at_once(run):
    s, m = run(FakeModel(max_seq=10**7), batch_slots=1)
    a = Collector()
    h = s.submit(GenRequest(prompt_ids=prompt(0), params=GREEDY, max_tokens=10_000), a)
    wait_until(lambda: len(a.ids) >= 2, 30, "two tokens")
    q = Collector()
    hq = s.submit(GenRequest(prompt_ids=prompt(1), params=GREEDY, max_tokens=2), q)
    hq.cancel()
    assert q.done.wait(10) and q.finished.reason == "cancelled" and not q.ids
    h.cancel()
    assert a.done.wait(10) and a.finished.reason == "cancelled"
    b = submit(s, prompt(2), n=3)
    assert b.done.wait(10) and b.ids == m.generate_alone(prompt(2), 3)
    info = s.load_info()
    assert info["queued"] == 0 and info["running"] == 0 and info["cancelled"] == 2


def test_prefix_reuse_stays_inside_its_cache_scope_and_prefills_only_the_suffix(run):
    s, m = run(batch_slots=2)
    secret = prompt(0, 20)
    victim = submit(s, secret, n=3, cache_scope="a")
    assert victim.done.wait(30) and victim.started.reused_tokens == 0
    guesser = submit(s, secret, n=3, cache_scope="b")
    assert guesser.done.wait(30) and guesser.started.reused_tokens == 0 and guesser.ids == victim.ids
    follow = secret + victim.ids[:2] + [7, 8]
    again = submit(s, follow, n=3, cache_scope="a")
    assert again.done.wait(30) and again.started.reused_tokens == len(secret) + 2
    assert again.ids == m.generate_alone(follow, 3)
    fed = sum(len(p.chunk.tokens) for p in m.steps if p.chunk is not None and p.chunk.slot == 0)
    assert fed == len(secret) + (len(follow) - again.started.reused_tokens)


def test_single_user_setting_is_one_slot_that_refuses_a_second_request_at_once(run):
    s, m = run(batch_slots=0)
    assert s.n_slots == 1 and s.load_info()["mode"] == "single"
    m.gate = threading.Event()
    first = submit(s, prompt(0), n=3)
    with pytest.raises(BusyError) as exc:
        submit(s, prompt(1), n=3)
    assert exc.value.status == 429 and exc.value.retry_after == 1
    m.gate.set()
    assert first.done.wait(30) and first.ids == m.generate_alone(prompt(0), 3)
    wait_until(lambda: s.load_info()["running"] == 0, 10, "the slot to free")
    second = submit(s, prompt(1), n=3)
    assert second.done.wait(30) and second.ids == m.generate_alone(prompt(1), 3)


def test_stats_log_one_line_per_step_with_device_and_host_time(run, capsys):
    s, m = run(bs_stats=True)
    cs = [submit(s, prompt(i, 10), n=5) for i in range(3)]
    for c in cs:
        assert c.done.wait(30)
    info = s.load_info()
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("[bs] ")]
    steps = [re.fullmatch(r"\[bs\] (prefill|decode|mixed) width=(\d+) tokens=(\d+) ms=([\d.]+) "
                          r"host_ms=([\d.]+) at=([\d.]+)", ln) for ln in lines]
    assert all(steps) and len(steps) == info["steps"] == len(m.steps)
    assert sum(int(x[2]) - (x[1] != "decode") for x in steps if x[1] != "prefill") == info["decode_tokens"]
    starts = [float(x[6]) for x in steps]
    assert starts == sorted(starts)


def test_one_request_takes_at_most_its_share_of_the_slots_while_another_waits(run):
    """Issue 43: a legacy completion's prompts are one job each; queued in plain arrival order, a big
    request held every slot while a later chat waited behind all of its generations. With the share
    (PANTHEON_REQUEST_SLOT_SHARE, half the slots here), the later request takes the next slot that frees."""
    from pantheon.types import Started
    s, m = run(request_slot_share=0.5)
    assert s.request_slots == 2
    order: list[str] = []

    class Recording(Collector):
        def __init__(self, name: str):
            super().__init__()
            self.name = name

        def __call__(self, ev) -> None:
            if isinstance(ev, Started):
                order.append(self.name)
            super().__call__(ev)

    m.gate = threading.Event()  # hold the driver: whatever it admitted first stays in its slots
    big = []
    for i in range(8):  # one request, eight generations (its parts share the request id, as a batch's do)
        c = Recording("big")
        s.submit(GenRequest(prompt_ids=prompt(i), params=GREEDY, max_tokens=6, request_id="big"), c)
        big.append(c)
    chat = Recording("chat")
    s.submit(GenRequest(prompt_ids=prompt(9), params=GREEDY, max_tokens=6, request_id="chat"), chat)
    m.gate.set()
    assert chat.done.wait(30) and all(c.done.wait(30) for c in big)
    # the big request had every slot while it was alone (at most 4) and at most its share after that
    assert order.index("chat") <= s.n_slots, order
    assert sorted(order) == ["big"] * 8 + ["chat"]


def test_a_request_alone_still_gets_every_slot(run):
    s, m = run(request_slot_share=0.25)
    m.gate = threading.Event()
    cs = []
    for i in range(4):
        c = Collector()
        s.submit(GenRequest(prompt_ids=prompt(i), params=GREEDY, max_tokens=6, request_id="only"), c)
        cs.append(c)
    wait_until(lambda: s.load_info()["running"] == 4, what="all four slots taken by the one request")
    m.gate.set()
    assert all(c.done.wait(30) for c in cs)
