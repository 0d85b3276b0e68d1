"""Grammar mask rows built in OS threads with a deadline, so one slow grammar never stalls a step.

Why: the driver builds a step's masks while the step's forward runs, and dispatches the sampler only
once every constrained row has its mask. Built in the driver itself, one grammar whose mask takes
seconds (a pathological schema, a lexer blow-up llguidance's fuel does not catch) holds every other
stream's step for those seconds. Here each constrained row's mask is computed by a worker thread into
a buffer of its own, and the driver waits at most `bound_s` for all of them: a row not done by then
is abandoned (its request fails alone, see `BatchScheduler._masks`), the others go on at once.

An abandoned computation cannot be stopped (llguidance has no cancel point): its worker finishes it
into the job's own buffer, which nothing reads any more, and only then takes new work. So the pool
keeps up to `live` workers free for new steps while at most `spare` more are still busy with
abandoned rows; past that a new row may wait behind one and miss its deadline too (each such
request then fails with the same clear error; the driver is never held longer than `bound_s`).

Threads `<name>-<i>` start on demand and live until `close()` (the scheduler's end). Lock: `_mu`
guards `_todo`, every job's `state`, `_threads`, `_busy` and `_closed`; held for bookkeeping only,
never while a mask is computed. `_wake` (on `_mu`) wakes idle workers; `_done` (on `_mu`) wakes the
driver waiting for its rows.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from pantheon import osthread

_QUEUED, _RUNNING, _DONE, _ABANDONED = "queued", "running", "done", "abandoned"


@dataclass(eq=False)
class _Job:
    matcher: Any
    row: np.ndarray  # the job's own buffer: an abandoned computation may still write into it
    state: str = _QUEUED  # _mu
    error: BaseException | None = None  # what fill_mask raised (set before state turns DONE)


@dataclass
class MaskStats:
    rows: int = 0  # rows built in time
    abandoned: int = 0  # rows not built within the bound
    failed: int = 0  # rows whose fill_mask raised
    threads: int = 0  # workers alive
    busy: int = 0  # workers computing a row now (abandoned ones included)
    abandoned_running: int = 0  # abandoned rows whose computation has not returned yet


class MaskBuilder:
    """The mask workers of one scheduler. `build` is called by the driver thread only."""

    def __init__(self, name: str, bound_s: float, live: int, spare: int):
        self.name = name
        self.bound_s = bound_s
        self.max_threads = max(1, live) + max(0, spare)
        self._mu = osthread.Lock()
        self._wake = osthread.Condition(self._mu)
        self._done = osthread.Condition(self._mu)
        self._todo: deque[_Job] = deque()  # _mu
        self._threads = 0  # _mu: workers started and not ended
        self._busy = 0  # _mu: workers inside fill_mask
        self._abandoned_running = 0  # _mu
        self._closed = False  # _mu
        self._started = 0  # driver only: workers ever started (their names' numbers)
        # set once if a worker's own loop fails (a bug): every later `build` raises it, so each
        # constrained step fails loudly with it (unconstrained steps go on)
        self.failure: str | None = None
        self._stats = MaskStats()  # _mu

    def stats(self) -> MaskStats:
        with self._mu:
            return MaskStats(self._stats.rows, self._stats.abandoned, self._stats.failed, self._threads,
                             self._busy, self._abandoned_running)

    def build(self, matchers: list[Any], words: int) -> list[np.ndarray | BaseException | None]:
        """One result per matcher: its row (int32[words]), the exception its `fill_mask` raised, or None
        when it was not done within `bound_s` -- that matcher is then abandoned: a worker may still be
        inside it, so the caller must never touch it again."""
        if self.failure is not None:
            raise RuntimeError(f"{self.name}: a mask worker failed: {self.failure}")
        jobs = [_Job(m, np.empty(words, np.int32)) for m in matchers]
        deadline = time.monotonic() + self.bound_s
        with self._mu:
            self._todo.extend(jobs)
            idle = self._threads - self._busy
            start = max(0, min(len(self._todo) - idle, self.max_threads - self._threads))
            self._threads += start
            self._wake.notify(len(jobs))
        for _ in range(start):
            self._started += 1
            osthread.start_thread(self._work, name=f"{self.name}-{self._started}")
        out: list[np.ndarray | BaseException | None] = []
        with self._mu:
            while any(j.state in (_QUEUED, _RUNNING) for j in jobs):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._done.wait(left)
            for j in jobs:
                if j.state == _DONE:
                    if j.error is not None:
                        self._stats.failed += 1
                        out.append(j.error)
                    else:
                        self._stats.rows += 1
                        out.append(j.row)
                    continue
                if j.state == _QUEUED:
                    self._todo.remove(j)
                else:
                    self._abandoned_running += 1
                j.state = _ABANDONED
                self._stats.abandoned += 1
                out.append(None)
        return out

    def close(self) -> None:
        """Workers end once their current row (if any) returns; waits for none of them."""
        with self._mu:
            self._closed = True
            self._todo.clear()
            self._wake.notify_all()

    def _work(self) -> None:
        try:
            while True:
                with self._mu:
                    while not self._todo and not self._closed:
                        self._wake.wait()
                    if self._closed:
                        self._threads -= 1
                        return
                    job = self._todo.popleft()
                    job.state = _RUNNING
                    self._busy += 1
                try:
                    job.matcher.fill_mask(job.row)
                except Exception as exc:  # noqa: BLE001 - the request fails with it, not the worker
                    job.error = exc
                with self._mu:
                    self._busy -= 1
                    if job.state == _ABANDONED:
                        self._abandoned_running -= 1
                    else:
                        job.state = _DONE
                        self._done.notify_all()
        except BaseException as exc:  # noqa: BLE001 - never die quietly: the driver sees `failure` and dies loudly
            self.failure = f"{type(exc).__name__}: {exc}"
            print(f"[bs] {self.name}: mask worker failed: {self.failure}", file=sys.stderr, flush=True)
            with self._mu:
                self._threads -= 1
                self._done.notify_all()
