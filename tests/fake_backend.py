"""A scripted backend that speaks the whole request-side contract of pantheon.types: n choices whose
Tokens interleave (several ids per event), per-token logprobs with their top alternatives, the prompt's
logprobs in Started, one Finished per choice, and cancel.

Tokens are characters (the fake model of test_web_app: one character, one id), so a test states what
each choice writes as a string. Log probabilities are a fixed function of (choice, position), so a test
can recompute every entry it expects to see.
"""

from __future__ import annotations

import itertools
import time

import pytest

from pantheon import osthread
from pantheon.config import Settings
from pantheon.types import Finished, Started, TokenLogprob, Tokens
from test_web_app import FakeModel, Handle, ScriptBackend, registry_app

SLOTS = 4


def osthread_wait(cond, timeout: float) -> None:
    """Wait (in the backend's OS thread) until `cond()` or `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.001)


def token_logprob(choice: int, pos: int) -> float:
    """The logprob the fake gives the token at position `pos` of choice `choice`."""
    return -(0.01 * (pos + 1) + 0.001 * choice)


def entry(choice: int, pos: int, tid: int, k: int) -> TokenLogprob:
    """The fake's record of one sampled token: it is the most likely, then tid + 1, tid + 2, ..."""
    lp = token_logprob(choice, pos)
    return TokenLogprob(tid, lp, tuple((tid + j, lp - j) for j in range(k)))


def prompt_entry(pos: int, tid: int, k: int) -> TokenLogprob:
    lp = -0.5 * pos
    return TokenLogprob(tid, lp, tuple((tid + j, lp - j) for j in range(k)))


class ChoicesBackend(ScriptBackend):
    """Choice i writes `texts[i % len(texts)]` (default: the script's text) and then finishes with the
    script's reason; a "\\0" (the fake tokenizer's end of turn, in the request's stop ids) is the stop
    token, flagged on its Tokens and then Finished "stop" as the device does. Each Tokens event carries the next
    `chunks` count of ids (cycling), choices taking turns."""

    def __init__(self, model):
        super().__init__(model)
        self.texts: list[str] | None = None
        self.chunks: tuple[int, ...] = (1, 3, 2)
        self.fail_choice: int | None = None  # this choice sends Finished("error") instead of its end
        self.endless: set[int] = set()  # these choices, their text written, run on until cancelled (10 s)
        self.emitted: dict[int, int] = {}  # choice -> ids sent (what the backend generated)
        self.choice_cancels: list[int] = []  # choices it stopped alone, on Handle.cancel(choice)

    def submit(self, req, sink):
        if self.refuse:
            raise self.refuse
        if self.events is not None:
            return super().submit(req, sink)
        self.last_request = req
        handle = self.last_handle = Handle()
        texts = self.texts or [self.script[0]]
        reason = self.script[1]
        k = req.logprobs
        emitted = self.emitted = {i: 0 for i in range(req.n)}
        self.choice_cancels = []

        def run():
            plp = None
            if req.prompt_logprobs is not None:
                plp = (None,) + tuple(prompt_entry(j, t, req.prompt_logprobs) for j, t in enumerate(req.prompt_ids)
                                      if j > 0)
            sink(Started(prompt_logprobs=plp))
            todo = {i: [ord(ch) for ch in texts[i % len(texts)]][: req.max_tokens] for i in range(req.n)}
            sizes = itertools.cycle(self.chunks)
            parked: list[int] = []
            while todo:
                for i in list(todo):
                    if handle.cancelled.wait(0.001):
                        for j in [*todo, *parked]:
                            sink(Finished("cancelled", completion_tokens=emitted[j], choice=j))
                        return
                    if i in handle.cancelled_choices:
                        self.choice_cancels.append(i)
                        sink(Finished("cancelled", completion_tokens=emitted[i], choice=i))
                        del todo[i]
                        continue
                    if i == self.fail_choice:
                        sink(Finished("error", error=RuntimeError("device lost"), choice=i))
                        return
                    ids = todo[i][: next(sizes)]
                    ends = [j for j, t in enumerate(ids) if t in req.stop_ids]
                    if ends:
                        ids = ids[: ends[0] + 1]
                    del todo[i][: len(ids)]
                    pos = emitted[i]
                    lps = tuple(entry(i, pos + j, t, k) for j, t in enumerate(ids)) if k is not None else None
                    emitted[i] += len(ids)
                    sink(Tokens(tuple(ids), choice=i, logprobs=lps, stop=bool(ends)))
                    if ends:
                        sink(Finished("stop", completion_tokens=emitted[i], choice=i))
                        del todo[i]
                    elif not todo[i]:
                        if i in self.endless:
                            parked.append(i)
                        else:
                            sink(Finished(reason, completion_tokens=emitted[i], choice=i))
                        del todo[i]
            for j in parked:  # run on until this choice, or the request, is cancelled (at most 10 s)
                osthread_wait(lambda: handle.cancelled.is_set() or j in handle.cancelled_choices, 10)
                end = "cancelled" if handle.cancelled.is_set() or j in handle.cancelled_choices else reason
                sink(Finished(end, completion_tokens=emitted[j], choice=j))

        osthread.start_thread(run, name="choices")
        return handle


@pytest.fixture()
def surface_app(tmp_path):
    """(app, registry) serving model "m" (4 slots) on a ChoicesBackend."""
    (tmp_path / "models").mkdir()
    settings = Settings(home=tmp_path, model_dir=(tmp_path / "models").resolve())
    return registry_app(settings, lambda p, n, d, s: FakeModel(n, n_slots=SLOTS), lambda m, s: ChoicesBackend(m))
