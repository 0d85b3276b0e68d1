"""Specification of issue 31 items 2 and 3: a structured-output grammar is bounded where it is compiled
(a bounded pool, counted against the model's admission, cancelled when its client leaves, a deadline)
and where its masks are built (one late mask fails its own request, never the other streams' steps).

The compile is replaced by one the test holds (a real llguidance compile cannot be paused at a chosen
moment; tests/test_structured.py covers the real compiles and their size caps), and the model is
tests/fake_engine.py's, driven by the real BatchScheduler and the real HTTP app. Nothing sleeps: every
wait is on an event or a counter, with a generous hang guard.
"""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import numpy as np
import pytest

from conftest import Collector, wait_until
from fake_engine import FakeModel as EngineFake
from pantheon.config import Settings
from pantheon.errors import BusyError, RequestError
from pantheon.scheduler.batch import BatchScheduler
from pantheon.types import GenRequest, ModelCard, SamplingParams
from pantheon.web import bridge
from pantheon.web.chat import Generation
from test_web_app import CharTokenizer, Template, registry_app

HANG = 30.0  # hang guard of every wait: far above anything the tests wait for
GREEDY = SamplingParams(temperature=0.0)
JSON_RF = {"type": "json_object"}


# ---- the pool -------------------------------------------------------------------------------------------------
class Held:
    """A callable that blocks until `release()`; counts the calls that entered and returned."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.entered = 0
        self.returned = 0
        self._lock = threading.Lock()

    def __call__(self, value: object = "done") -> object:
        with self._lock:
            self.entered += 1
        assert self.go.wait(HANG), "never released"
        with self._lock:
            self.returned += 1
        return value

    def release(self) -> None:
        self.go.set()


def pool(threads: int = 1, queue: int = 1) -> bridge.WorkPool:
    return bridge.WorkPool("test-pool", threads, queue, "pool full")


def test_a_full_pool_refuses_at_once_with_429():
    held, p = Held(), pool(threads=1, queue=1)
    got: list = []
    try:
        p.submit(held, lambda ok, v: got.append(v))
        p.submit(held, lambda ok, v: got.append(v))
        wait_until(lambda: held.entered == 1, HANG, "the first call running")
        assert p.stats().running == 1 and p.stats().queued == 1
        with pytest.raises(BusyError) as e:
            p.submit(held, lambda ok, v: got.append(v))
        assert e.value.status == 429 and e.value.retry_after == 1 and str(e.value) == "pool full"
    finally:
        held.release()
    assert p.wait_idle(HANG)
    st = p.stats()
    assert got == ["done", "done"] and (st.completed, st.rejected, st.running, st.queued) == (2, 1, 0, 0)
    wait_until(lambda: p.stats().threads == 0, HANG, "the idle pool thread to end")


def test_a_cancelled_waiting_call_never_runs_and_a_running_ones_result_is_dropped():
    held, p = Held(), pool(threads=1, queue=4)
    got: list = []
    try:
        running = p.submit(held, lambda ok, v: got.append(("first", v)))
        waiting = p.submit(lambda: got.append("second ran"), lambda ok, v: got.append(("second", v)))
        wait_until(lambda: held.entered == 1, HANG, "the first call running")
        waiting.cancel()
        running.cancel()
        assert p.stats().cancelled == 1 and p.stats().queued == 0 and p.stats().running == 1
    finally:
        held.release()
    assert p.wait_idle(HANG)
    st = p.stats()
    assert got == [] and held.returned == 1
    assert (st.discarded, st.cancelled, st.completed, st.running) == (1, 1, 0, 0)


def test_call_leaves_at_its_deadline_or_when_its_check_raises_and_cancels():
    held, p = Held(), pool(threads=1, queue=4)

    class Gone(Exception):
        pass

    def gone() -> None:
        raise Gone()

    ran: list[str] = []
    try:
        p.submit(held, lambda ok, v: None)  # holds the only thread: the calls below wait
        wait_until(lambda: held.entered == 1, HANG, "the pool's thread busy")
        with pytest.raises(bridge.Timeout):
            p.call(lambda: ran.append("late"), timeout=0.05, poll=0.01)
        with pytest.raises(Gone):
            p.call(lambda: ran.append("gone"), timeout=HANG, check=gone, poll=0.01)
        st = p.stats()
        assert (st.cancelled, st.timed_out, st.queued) == (2, 1, 0)
    finally:
        held.release()
    assert p.wait_idle(HANG) and ran == []
    assert p.call(lambda: 7, timeout=HANG) == 7
    with pytest.raises(ZeroDivisionError):
        p.call(lambda: 1 // 0, timeout=HANG)


# ---- the chat route: compile pool, admission, disconnect ---------------------------------------------------------
class ChatFake(EngineFake):
    """tests/fake_engine.py's model with what the web layer needs of a model (a card)."""

    weight_bytes = 1000

    def __init__(self, name: str = "m", n_slots: int = 4):
        super().__init__(n_slots=n_slots, chunk=8, max_seq=64, name=name)
        self.card = ModelCard(name=name, path="", arch="fake", context_length=64, n_slots=n_slots,
                              tokenizer=CharTokenizer(), template=Template())


class AnyToken:
    """A grammar that allows every token (what the compile returns here: the tests are about when and
    whether it compiles, not about what the grammar says)."""

    param = "response_format"

    def matcher(self, stop_ids, vocab):
        return self

    def fill_mask(self, out: np.ndarray) -> None:
        out.fill(-1)

    def consume(self, tok: int) -> bool:
        return True


class HeldCompile(Held):
    """`Generation._constraint` replaced: each compile blocks until `release()` (or returns at once when
    already released) and gives an `AnyToken` grammar."""

    def __call__(self, gen: Generation, tok: object) -> AnyToken:
        return super().__call__(AnyToken())


@pytest.fixture()
def compile_(monkeypatch):
    held = HeldCompile()
    monkeypatch.setattr(Generation, "_constraint", lambda self, tok: held(self, tok))
    yield held
    held.release()


def chat_app(tmp_path: Path, **settings_kw):
    (tmp_path / "models").mkdir(exist_ok=True)
    settings_kw.setdefault("batch_slots", 4)
    settings = Settings(home=tmp_path, model_dir=(tmp_path / "models").resolve(), prefill_chunk=8, **settings_kw)
    holder: dict = {}

    def backend(model, s):
        holder["sched"] = BatchScheduler(model, s, warmup=False)
        return holder["sched"]

    app, reg = registry_app(settings, lambda p, n, d, s: holder.setdefault("model", ChatFake(n)), backend)
    return app, reg, holder["sched"], holder["model"]


@pytest.fixture()
def serve(tmp_path):
    """serve(**settings) -> (app, registry, scheduler, fake model); closed at the end of the test."""
    made: list = []

    def make(**settings_kw):
        made.append(chat_app(tmp_path, **settings_kw))
        return made[-1]

    yield make
    for _, reg, _, _ in made:
        reg.close()


def post(app, environ: dict | None = None, **body):
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    body.setdefault("max_tokens", 4)
    return app.test_client().post("/v1/chat/completions", json=body, environ_base=environ or {})


class InThread:
    """A request run in its own thread (the test client blocks until the answer)."""

    def __init__(self, fn, *args, **kw):
        self.response = None
        self._t = threading.Thread(target=lambda: setattr(self, "response", fn(*args, **kw)), daemon=True)
        self._t.start()

    def result(self):
        self._t.join(HANG)
        assert not self._t.is_alive(), "the request did not end"
        return self.response


class Peer:
    """A connection whose client can hang up: the socket gunicorn would put in the environ."""

    def __init__(self) -> None:
        self.server_side, self.client_side = socket.socketpair()
        self.environ = {"gunicorn.socket": self.server_side}

    def hang_up(self) -> None:
        self.client_side.close()

    def close(self) -> None:
        self.server_side.close()
        self.client_side.close()


def pool_of(app) -> bridge.WorkPool:
    return app.extensions["pantheon"].grammars


def test_structured_requests_past_the_compile_pool_get_429(serve, compile_):
    served = serve(grammar_threads=1, grammar_queue=1)
    app = served[0]
    first = InThread(post, app, response_format=JSON_RF)
    wait_until(lambda: compile_.entered == 1, HANG, "the first compile running")
    second = InThread(post, app, response_format=JSON_RF)
    wait_until(lambda: pool_of(app).stats().queued == 1, HANG, "the second compile waiting")
    r = post(app, response_format=JSON_RF)
    assert r.status_code == 429 and r.headers["Retry-After"] == "1"
    assert r.get_json()["error"]["code"] == "server_busy" and "grammars" in r.get_json()["error"]["message"]
    assert post(app).status_code == 200  # a request without a grammar does not queue for the pool
    compile_.release()
    assert first.result().status_code == 200 and second.result().status_code == 200
    st = pool_of(app).stats()
    assert (st.completed, st.rejected) == (2, 1) and compile_.entered == 2
    assert served[2].load_info()["reserved"] == 0


def test_a_request_the_model_cannot_take_is_refused_before_it_compiles(serve, compile_):
    served = serve(batch_slots=1, queue_depth=0)
    app, _, sched, model = served
    compile_.release()  # compiles return at once here
    model.gate = threading.Event()  # the plain request's steps wait: it holds the only slot
    plain = InThread(post, app)
    wait_until(lambda: sched.load_info()["running"] == 1, HANG, "the plain request in the slot")
    r = post(app, response_format=JSON_RF)
    assert r.status_code == 429 and compile_.entered == 0
    model.gate.set()
    assert plain.result().status_code == 200
    assert post(app, response_format=JSON_RF).status_code == 200 and compile_.entered == 1


def test_a_compiling_request_holds_its_place_in_the_queue(serve, compile_):
    """While its grammar compiles, the request counts in the queue's bound: the place it will take is
    not given to a request that arrived after it."""
    served = serve(batch_slots=1, queue_depth=0)
    app, _, sched, _ = served
    structured = InThread(post, app, response_format=JSON_RF)
    wait_until(lambda: compile_.entered == 1, HANG, "the compile running")
    assert sched.load_info()["reserved"] == 1
    r = post(app)
    assert r.status_code == 429 and r.get_json()["error"]["code"] == "server_busy"
    compile_.release()
    assert structured.result().status_code == 200
    assert sched.load_info()["reserved"] == 0 and post(app).status_code == 200


def test_a_client_that_leaves_cancels_its_compile(serve, compile_):
    """A waiting compile never runs; a running one cannot be stopped, but its client is answered at
    once and its result is dropped; either way its queue place in the model is given back."""
    served = serve(grammar_threads=1, grammar_queue=4)
    app, _, sched, _ = served
    running, waiting = Peer(), Peer()
    try:
        first = InThread(post, app, running.environ, response_format=JSON_RF)
        wait_until(lambda: compile_.entered == 1, HANG, "the first compile running")
        second = InThread(post, app, waiting.environ, response_format=JSON_RF)
        wait_until(lambda: pool_of(app).stats().queued == 1, HANG, "the second compile waiting")
        waiting.hang_up()
        assert second.result().status_code == 499
        assert pool_of(app).stats().cancelled == 1 and pool_of(app).stats().queued == 0
        running.hang_up()
        assert first.result().status_code == 499
        assert compile_.returned == 0 and pool_of(app).stats().running == 1  # still compiling
        assert sched.load_info()["reserved"] == 0
        compile_.release()
        assert pool_of(app).wait_idle(HANG)
        st = pool_of(app).stats()
        assert (st.running, st.discarded, st.completed, compile_.entered) == (0, 1, 0, 1)
    finally:
        running.close()
        waiting.close()


def test_a_compile_past_its_deadline_is_a_503_and_is_dropped(serve, compile_):
    served = serve(grammar_timeout_s=0.2)
    app, _, sched, _ = served
    r = post(app, response_format=JSON_RF)
    assert r.status_code == 503 and "PANTHEON_GRAMMAR_TIMEOUT_S" in r.get_json()["error"]["message"]
    assert r.headers["Retry-After"] == "5" and sched.load_info()["reserved"] == 0
    compile_.release()
    assert pool_of(app).wait_idle(HANG)
    st = pool_of(app).stats()  # it never ran (still waiting at the deadline) or its result was dropped
    assert st.cancelled + st.discarded == 1 and st.completed == 0 and st.timed_out == 1


# ---- the scheduler: mask rows ------------------------------------------------------------------------------------
class SlowMask:
    """A grammar whose mask computation blocks until released (a pathological schema, in effect)."""

    param = "response_format"

    def __init__(self) -> None:
        self.go, self.entered, self.returned = threading.Event(), threading.Event(), threading.Event()

    def matcher(self, stop_ids, vocab):
        return self

    def fill_mask(self, out: np.ndarray) -> None:
        self.entered.set()
        self.go.wait(HANG)
        out.fill(-1)
        self.returned.set()

    def consume(self, tok: int) -> bool:
        return True


class FailsAfter:
    """A grammar that accepts `n` tokens, then stops on an error of its own, as llguidance does when a
    limit is hit (`Matcher.consume` False, `Matcher.error` the reason)."""

    param = "tools"

    def __init__(self, n: int) -> None:
        self.n, self.seen, self.error = n, 0, None

    def matcher(self, stop_ids, vocab):
        return self

    def fill_mask(self, out: np.ndarray) -> None:
        out.fill(-1)

    def consume(self, tok: int) -> bool:
        self.seen += 1
        if self.seen > self.n:
            self.error = "Parser Error: Current row has 2003 items; max is 2000"
            return False
        return True


def sched_with(model: EngineFake, **kw) -> BatchScheduler:
    base = dict(home=Path("/tmp"), batch_slots=4, queue_depth=4, queue_wait_s=30.0, prefill_chunk=8)
    return BatchScheduler(model, Settings(**{**base, **kw}), warmup=False)


def submit(sched: BatchScheduler, prompt: list[int], max_tokens: int, constraint=None) -> Collector:
    c = Collector()
    sched.submit(GenRequest(prompt_ids=prompt, params=GREEDY, max_tokens=max_tokens, constraint=constraint), c)
    return c


def test_a_late_mask_fails_its_request_alone_while_the_other_streams_go_on():
    model = EngineFake(n_slots=4)
    sched = sched_with(model, grammar_mask_ms=100)
    slow = SlowMask()
    try:
        bad = submit(sched, [5, 6, 7], 20, constraint=slow)
        plain = submit(sched, [9, 10, 11], 30)
        assert bad.done.wait(HANG) and plain.done.wait(HANG)
        err = bad.finished.error
        assert bad.finished.reason == "error" and isinstance(err, RequestError) and bad.ids == []
        assert err.status == 400 and err.code == "grammar_too_complex" and err.param == "response_format"
        assert "PANTHEON_GRAMMAR_MASK_MS" in str(err) and "100 ms" in str(err)
        assert plain.finished.reason == "length" and plain.ids == model.generate_alone([9, 10, 11], 30)
        assert slow.entered.is_set() and not slow.returned.is_set()  # all of it while the mask was stuck
        # the stuck worker does not hold up later constrained requests either
        ok = submit(sched, [3, 4], 5, constraint=AnyToken())
        assert ok.done.wait(HANG) and ok.finished.reason == "length" and len(ok.ids) == 5
    finally:
        slow.go.set()
    wait_until(lambda: sched._mask_builder.stats().abandoned_running == 0, HANG, "the late mask to return")
    st = sched._mask_builder.stats()
    assert st.abandoned == 1 and sched.load_info()["failed"] == 1
    sched.close()
    wait_until(lambda: sched._mask_builder.stats().threads == 0, HANG, "the mask workers to end")


def test_a_grammar_that_stops_on_its_own_error_fails_its_request_with_the_reason():
    """Before, the rejected token left only the stop ids: the request ended "stop" with cut JSON."""
    model = EngineFake(n_slots=4)
    sched = sched_with(model)
    try:
        bad = submit(sched, [5, 6, 7], 20, constraint=FailsAfter(3))
        plain = submit(sched, [9, 10, 11], 12)
        assert bad.done.wait(HANG) and plain.done.wait(HANG)
        err = bad.finished.error
        assert bad.finished.reason == "error" and isinstance(err, RequestError) and err.param == "tools"
        assert "max is 2000" in str(err) and err.code == "grammar_too_complex"
        assert len(bad.ids) == 3  # the tokens the grammar accepted, not the one it refused
        assert plain.finished.reason == "length" and plain.ids == model.generate_alone([9, 10, 11], 12)
    finally:
        sched.close()


def test_a_reserved_place_is_used_by_submit_and_a_released_one_is_free_again():
    sched = sched_with(EngineFake(n_slots=1), batch_slots=1, queue_depth=0)
    try:
        r = sched.reserve()
        with pytest.raises(BusyError):
            sched.reserve()
        with pytest.raises(BusyError):
            submit(sched, [1, 2], 2)
        c = Collector()
        sched.submit(GenRequest(prompt_ids=[1, 2], params=GREEDY, max_tokens=2), c, reservation=r)
        assert c.done.wait(HANG) and c.finished.reason == "length"
        r.release()  # used: nothing to give back
        r2 = sched.reserve()
        r2.release()
        r2.release()
        assert sched.load_info()["reserved"] == 0
        assert submit(sched, [1, 2], 2).done.wait(HANG)
    finally:
        sched.close()
