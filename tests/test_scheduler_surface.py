"""The scheduler's side of the OpenAI surface, on a real (tiny) model: logprobs ride on the token events
and do not depend on the batch, n > 1 choices fork from one prefilled prompt with derived seeds, a
grammar's mask constrains a choice, one choice can be stopped alone, a logit bias is per request, and
a prompt's own logprobs come with Started."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from conftest import wait_until
from test_scheduler import model, prompts, sched  # noqa: F401 (the tiny llama, 8 slots; its scheduler)
from pantheon.runtime import reference
from pantheon.config import Settings
from pantheon.errors import RequestError
from pantheon.types import Finished, GenRequest, SamplingParams, Started, Tokens
from pantheon.scheduler.batch import BatchScheduler

GREEDY = SamplingParams(temperature=0.0)


class Events:
    """A sink that records events and knows when all of a request's choices finished."""

    def __init__(self, n: int = 1) -> None:
        self.n, self.events, self.done = n, [], threading.Event()

    def __call__(self, ev) -> None:
        self.events.append(ev)
        if isinstance(ev, Finished) and (ev.reason == "error" or len(self.finished) >= self.n):
            self.done.set()

    @property
    def finished(self) -> list[Finished]:
        return [e for e in self.events if isinstance(e, Finished)]

    def ids(self, choice: int = 0) -> list[int]:
        return [i for e in self.events if isinstance(e, Tokens) and e.choice == choice for i in e.ids]

    def logprobs(self, choice: int = 0) -> list:
        return [lp for e in self.events if isinstance(e, Tokens) and e.choice == choice for lp in e.logprobs]

    def wait(self) -> "Events":
        assert self.done.wait(120), "the request did not finish"
        return self


def run(sched, prompt, n_choices=1, **kw) -> Events:
    ev = Events(n_choices)
    sched.submit(GenRequest(prompt_ids=prompt, params=kw.pop("params", GREEDY), max_tokens=kw.pop("max_tokens", 8),
                            n=n_choices, **kw), ev)
    return ev


def test_logprobs_of_a_request_alone_equal_those_batched_with_seven_others(sched):
    ps = prompts()
    alone = run(sched, ps[3], logprobs=5).wait()
    batch = [run(sched, p, logprobs=5) for p in ps]
    together = [b.wait() for b in batch][3]
    assert together.ids() == alone.ids()
    a, b = alone.logprobs(), together.logprobs()
    assert len(a) == len(alone.ids()) == 8
    for x, y in zip(a, b):
        assert x.id == y.id and len(x.top) == 5
        np.testing.assert_allclose(x.logprob, y.logprob, atol=1e-5)
        np.testing.assert_allclose([t[1] for t in x.top], [t[1] for t in y.top], atol=1e-5)
        assert x.logprob == pytest.approx(x.top[0][1], abs=1e-6) and x.top[0][0] == x.id  # greedy = top-1


def test_n_choices_share_one_prefill_and_greedy_choices_equal_the_single_answer(model, sched):
    p = prompts()[5]
    want = list(reference.generate(model, p, GREEDY, max_tokens=8, stop_ids=[]))
    ev = run(sched, p, n_choices=3).wait()
    assert [e for e in ev.events if isinstance(e, Started)] and sum(isinstance(e, Started) for e in ev.events) == 1
    assert sorted(f.choice for f in ev.finished) == [0, 1, 2]
    assert all(f.reason == "length" and f.completion_tokens == 8 for f in ev.finished)
    for c in range(3):
        assert ev.ids(c) == want


def test_seeded_n_choices_are_reproducible_and_differ(sched):
    p = prompts()[4]
    params = SamplingParams(temperature=1.5, seed=1234)
    a = run(sched, p, n_choices=4, params=params, max_tokens=12).wait()
    b = run(sched, p, n_choices=4, params=params, max_tokens=12).wait()
    choices = [tuple(a.ids(c)) for c in range(4)]
    assert choices == [tuple(b.ids(c)) for c in range(4)]
    assert len(set(choices)) > 1
    single = run(sched, p, params=params, max_tokens=12).wait()  # choice 0 keeps the request's seed
    assert len(single.ids()) == 12


def test_n_larger_than_the_slots_is_refused(sched):
    with pytest.raises(RequestError):
        run(sched, prompts()[0], n_choices=9)


class OnlyTokens:
    """A grammar for tests: `length` tokens from `allowed`, then a stop id."""

    def __init__(self, allowed, length):
        self.allowed, self.length, self.made = sorted(allowed), length, []

    def matcher(self, stop_ids, vocab):
        m = _Matcher(self, sorted(stop_ids), vocab)
        self.made.append(m)
        return m


class _Matcher:
    def __init__(self, g, stops, vocab):
        self.g, self.stops, self.vocab, self.seen, self.done = g, stops, vocab, [], False

    def fill_mask(self, out):
        out[:] = 0
        for t in (self.g.allowed if len(self.seen) < self.g.length and not self.done else self.stops):
            out[t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))

    def consume(self, tok):
        ok = tok in (self.g.allowed if len(self.seen) < self.g.length else self.stops)
        self.seen.append(tok)
        self.done = tok in self.stops
        return ok


def test_a_grammar_mask_constrains_every_token_and_ends_on_a_stop_id(sched):
    g = OnlyTokens({11, 29, 301}, 5)
    ev = run(sched, prompts()[2], constraint=g, stop_ids=frozenset({2}), max_tokens=20,
             params=SamplingParams(temperature=1.0, seed=7)).wait()
    ids = ev.ids()
    assert ids[:5] and set(ids[:5]) <= {11, 29, 301} and ids[5:] == [2]
    assert ev.finished[0].reason == "stop"
    assert g.made[0].seen == ids and g.made[0].done


def test_constrained_and_free_requests_batched_keep_the_free_ones_unchanged(sched):
    ps = prompts()
    alone = run(sched, ps[1]).wait().ids()
    free = run(sched, ps[1])
    bound = [run(sched, p, constraint=OnlyTokens({5, 6}, 3), stop_ids=frozenset({2}), max_tokens=10) for p in ps[2:5]]
    assert free.wait().ids() == alone
    for b in bound:
        assert set(b.wait().ids()[:3]) <= {5, 6}


def test_one_choice_can_be_stopped_while_the_others_go_on(sched):
    ev = Events(2)
    h = sched.submit(GenRequest(prompt_ids=prompts()[6], params=GREEDY, max_tokens=40, n=2), ev)
    wait_until(lambda: len(ev.ids(1)) >= 2, what="choice 1 generating")
    h.cancel(choice=1)
    ev.wait()
    by = {f.choice: f for f in ev.finished}
    assert by[1].reason == "cancelled" and by[0].reason == "length" and len(ev.ids(0)) == 40


def test_a_logit_bias_applies_to_its_request_only(sched):
    p = prompts()[3]
    plain = run(sched, p).wait().ids()
    banned = run(sched, p, logit_bias=((plain[0], -100.0),))
    other = run(sched, p)
    assert banned.wait().ids()[0] != plain[0]
    assert other.wait().ids() == plain


def test_prompt_logprobs_come_with_started(model):
    s = BatchScheduler(model, Settings(home=Path("/tmp"), batch_slots=2, queue_depth=4, queue_wait_s=30.0,
                                       prefill_chunk=16), warmup=False)
    try:
        p = prompts()[7]
        ev = run(s, p, prompt_logprobs=2, max_tokens=2).wait()
        started = next(e for e in ev.events if isinstance(e, Started))
        lps = started.prompt_logprobs
        assert len(lps) == len(p) and lps[0] is None
        direct, _ = model.prompt_logprobs(model.new_state(), p, 2)
        for e, d in zip(lps[1:], direct[1:]):
            assert e.logprob == pytest.approx(d[0], abs=1e-5) and len(e.top) == 2
        assert len(ev.ids()) == 2
    finally:
        s.close()
