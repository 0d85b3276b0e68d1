"""Embeddings jobs in the continuous-batching scheduler: `BatchScheduler` inherits `EmbedDriver`.

Why through the scheduler and not beside it: the model's device state (every slot's cache) belongs to
the driver thread, and an embedding is a forward over a slot's cache like a prompt chunk. So the
driver runs embedding work between generation steps, in slots that generation is not using:

1. `submit_embed` (request greenlet, never blocks) queues the job or refuses it like `submit`: queue
   full -> 429 Retry-After 5 (503 under CRITICAL memory pressure); shutting down or failed -> 503; the
   single-user setting refuses at once (429 Retry-After 1) when its slot is busy. A job waiting longer
   than `queue_wait_s` for its first slot gets 429 Retry-After 2; a cancelled one leaves at once.
2. Each driver iteration, before generation is admitted, `_embed_yield_locked` lets generation go
   first: when the oldest queued generation job needs more slots than are idle, embedding inputs give
   theirs back (those that have fed the fewest tokens first: the least work lost); such an input
   starts over from its first token later. A queued chat therefore waits for embeddings at most one
   driver iteration, never for an input's remaining chunks.
3. After generation has been admitted, `_embed_admit_locked` picks this iteration's embed rows under a
   budget: while any slot generates (or a generation job waits), one embed call feeds at most one
   prefill chunk's worth of tokens (`chunk`), inputs already holding a slot first; so a decode step
   waits behind at most one chunk of embedding work, as it would behind a long prompt. With no
   generation the call feeds every input it can. New inputs take the IDLE slots that no row of the
   step in flight references (those with the shortest prefix history first: the least useful to
   generation), started jobs first, then queued jobs in order, and never while a generation job
   waits. A slot given to an input turns EMBED (generation does not admit into it) and forgets its
   prefix history, session and scope: its cache is about to be overwritten, so nothing may reuse it.
4. `_embed_round` (driver thread, no lock) feeds the next chunk of every chosen input in one
   `Model.embed` call: inputs of one or several jobs are batched. An input keeps its slot for all its
   chunks unless generation takes it back (starts increase; the first is 0, which also restarts
   recurrent state) and gives it back (IDLE, empty history) when its last chunk is in; the pooled
   vector is finished on the host (`pantheon.runtime.pooling.EmbedRun`). When every input of a job is
   done the job's sink gets `Embedded`.

A device failure in an embed call fails like a step (`_step_failed`: every request fails, the state is
rebuilt); a refusal before anything ran (a compile forbidden after warm-up, a bad shape) fails only the
embeddings jobs in that call. Embedding calls are not part of warm-up: with PANTHEON_FORBID_COMPILE=1
an embeddings request whose shape was never compiled fails with 500 compile_forbidden.

The mixin uses the scheduler's fields (`_mu`, `_work`, `_slots`, `_queue`, `_state`, `_inflight`,
`model`, `chunk`, `immediate`, `queue_depth`, `queue_wait_s`, `pressure`, `stats`, `failure`,
`_closed`) and methods (`_admission_locked`, `_reap_locked`, `_deliver`, `_step_failed`, `_cancel`)
under the same lock rules: every `_locked` method runs under `_mu`; a job's `todo`, `rows` and `runs`
change only under it, on the driver thread.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pantheon.errors import CompileForbiddenError, RequestError
from pantheon.types import EmbedRequest, EmbedSink, Embedded, Event, Finished
from pantheon.runtime.pooling import EmbedRun

IDLE = "IDLE"  # the value of batch.IDLE (batch imports this module, so it cannot be imported from there)
EMBED = "EMBED"  # a slot an embeddings input is being fed into
PRESSURE_CRITICAL = 3  # memory pressure level (pantheon.runtime.memory) at which no job is admitted


@dataclass(eq=False)
class _EmbedJob:
    req: EmbedRequest
    sink: EmbedSink
    enqueued_at: float
    runs: list[EmbedRun]
    todo: list[int] = field(init=False)  # a heap: the inputs waiting for a slot, lowest index first; _mu
    rows: dict[int, int] = field(default_factory=dict)  # slot index -> the input (its index) fed there; _mu
    cancelled: bool = False  # _mu

    def __post_init__(self) -> None:
        self.todo = list(range(len(self.runs)))  # (sorted: already a heap)


class _EmbedHandle:
    """What `submit_embed` returns: cancel() is safe from any thread or greenlet at any time."""

    def __init__(self, sched: Any, job: _EmbedJob):
        self._sched = sched
        self._job = job

    def cancel(self) -> None:
        self._sched._cancel(self._job)


class EmbedDriver:
    """The embeddings half of `BatchScheduler` (see the module docstring)."""

    _embed_queue: deque[_EmbedJob]
    _embed_jobs: list[_EmbedJob]

    # ---- called from request greenlets --------------------------------------------------------
    def submit_embed(self, req: EmbedRequest, sink: EmbedSink, reservation: Any = None) -> _EmbedHandle:
        """Queue an embeddings job; its sink gets one `Embedded`, or `Finished("error" | "cancelled")`.
        Raises BusyError (429/503) or ModelFailed (503) when it cannot even be queued. A held
        `reservation` (`reserve`) is its place, as for `submit`."""
        too_long = [len(ids) for ids in req.inputs if len(ids) > self.model.max_seq]
        if too_long:
            raise RequestError(f"input: an input has {too_long[0]} tokens; this model's maximum context length is "
                               f"{self.model.max_seq}", param="input", code="context_length_exceeded")
        job = _EmbedJob(req=req, sink=sink, enqueued_at=time.monotonic(),
                        runs=[EmbedRun(ids, req.pooling) for ids in req.inputs])
        with self._mu:
            self._take_place_locked(reservation)  # (BatchScheduler's: one rule for both kinds of job)
            self._embed_queue.append(job)
            self._work.notify_all()
        return _EmbedHandle(self, job)

    # ---- the driver thread, under _mu ----------------------------------------------------------
    def _embed_yield_locked(self) -> None:
        """Generation first (called before generation is admitted): when the oldest queued generation
        job needs more slots than are idle, take the missing ones back from embedding inputs, those
        that have fed the fewest tokens first. Such an input loses what it fed (its earlier chunks'
        cache is gone) and waits at the front of its job's inputs to start over. Why take slots back
        instead of waiting for inputs to finish: an input of a full context holds its slot for
        max_seq / chunk embed calls, and a large request refills every slot as soon as it frees."""
        if not self._queue or not self._embed_jobs or self.pressure() >= PRESSURE_CRITICAL:
            return
        short = self._queue[0].req.n - sum(1 for sl in self._slots if sl.state == IDLE)
        if short <= 0:
            return
        held = sorted(((job.runs[i].fed, s, job) for job in self._embed_jobs for s, i in job.rows.items()),
                      key=lambda t: t[0])
        for _, s, job in held[:short]:
            i = job.rows.pop(s)
            run = job.runs[i]
            job.runs[i] = EmbedRun(run.tokens, run.pooling)
            heapq.heappush(job.todo, i)
            self._slots[s].state = IDLE  # its history was cleared when the input took it

    def _embed_admit_locked(self, events: list[tuple[Any, Event]]) -> list[tuple[Any, _EmbedJob, EmbedRun]]:
        """Reap cancelled and timed-out jobs, give idle slots to waiting inputs; returns the rows of
        this iteration's embed call, (slot, job, input), at most a chunk's worth of tokens while
        generation runs or waits (see the module docstring)."""
        if not self._embed_queue and not self._embed_jobs:
            return []  # the common case, once per driver iteration
        self._embed_queue = self._reap_locked(  # (BatchScheduler's, shared with generation)
            self._embed_queue, events, lambda job: [Finished("cancelled", prompt_tokens=job.req.prompt_tokens)])
        for job in [j for j in self._embed_jobs if j.cancelled]:
            self._embed_drop_locked(job)
            self.stats.cancelled += 1
            events.append((job, Finished("cancelled", prompt_tokens=job.req.prompt_tokens)))
        admissible = self.pressure() < PRESSURE_CRITICAL
        gen_waits = bool(self._queue) and admissible  # (generation is not admitted under critical pressure)
        shared = gen_waits or any(sl.state not in (IDLE, EMBED) for sl in self._slots)
        rows: list[tuple[Any, _EmbedJob, EmbedRun]] = []
        spent = 0

        def take(run: EmbedRun) -> bool:
            """Whether `run`'s next chunk fits this call (the first row always does); counts it if so."""
            nonlocal spent
            n = min(self.chunk, len(run.tokens) - run.fed)
            if shared and rows and spent + n > self.chunk:
                return False
            spent += n
            return True

        for job in self._embed_jobs:
            for s, i in job.rows.items():
                if take(job.runs[i]):
                    rows.append((self._slots[s], job, job.runs[i]))
        if gen_waits:
            return rows  # the idle slots are generation's
        busy = {r.slot.index for r in self._inflight.rows} if self._inflight is not None else set()
        idle = sorted((sl for sl in self._slots if sl.state == IDLE and sl.index not in busy),
                      key=lambda sl: len(sl.hist))
        waiting = list(self._embed_jobs) + (list(self._embed_queue) if admissible else [])
        for job in waiting:
            while idle and job.todo and take(job.runs[job.todo[0]]):
                sl = idle.pop(0)
                sl.state = EMBED
                sl.hist, sl.scope, sl.session_id = [], "", None  # its cache is about to be overwritten
                i = heapq.heappop(job.todo)
                job.rows[sl.index] = i
                rows.append((sl, job, job.runs[i]))
            if job.rows and job not in self._embed_jobs:
                self._embed_queue.remove(job)
                self._embed_jobs.append(job)
            if not idle or (shared and spent >= self.chunk):
                break
        return rows

    def _embed_drop_locked(self, job: _EmbedJob) -> None:
        """The job leaves: its slots go back to IDLE with no history (their caches hold its inputs)."""
        for i in job.rows:
            sl = self._slots[i]
            sl.state = IDLE
            sl.hist, sl.scope, sl.session_id = [], "", None
        job.rows.clear()
        if job in self._embed_jobs:
            self._embed_jobs.remove(job)
        self._work.notify_all()

    def _embed_fail_locked(self, events: list[tuple[Any, Event]], error: BaseException) -> None:
        """Every embeddings job, queued or started, fails with `error` (a failed step, the driver
        dying, shutdown); their slots go back to IDLE."""
        for job in list(self._embed_jobs):
            self._embed_drop_locked(job)
            events.append((job, Finished("error", error=error)))
        while self._embed_queue:
            events.append((self._embed_queue.popleft(), Finished("error", error=error)))

    # ---- the driver thread, device work (no lock held) ------------------------------------------
    def _embed_round(self, rows: list[tuple[Any, _EmbedJob, EmbedRun]]) -> None:
        """One `Model.embed` call: the next chunk of every input holding a slot, batched."""
        parts = [(sl, job, run, *run.next_chunk(self.chunk)) for sl, job, run in rows]
        try:
            out, self._state = self.model.embed(self._state, [p[3] for p in parts], [p[0].index for p in parts],
                                                [p[4] for p in parts], [p[2].pooling for p in parts])
        except (CompileForbiddenError, ValueError) as exc:  # refused before anything ran: the state is intact
            events: list[tuple[Any, Event]] = []
            with self._mu:
                for job in {id(p[1]): p[1] for p in parts}.values():
                    if job in self._embed_jobs:
                        self._embed_drop_locked(job)
                        events.append((job, Finished("error", error=exc)))
            self._deliver(events)
            return
        except Exception as exc:  # the device failed: like a failed step (every request fails, state rebuilt)
            self._step_failed(exc)
            return
        events = []
        with self._mu:
            for (sl, job, run, toks, _), vec in zip(parts, out):
                if job.cancelled or job not in self._embed_jobs:
                    continue  # cancelled meanwhile: _embed_admit_locked drops it next iteration
                run.add(len(toks), vec)
                if not run.done:
                    continue
                del job.rows[sl.index]
                sl.state = IDLE  # its history was cleared when the input took it
                if not job.todo and not job.rows:
                    self._embed_jobs.remove(job)
                    vectors = np.stack([r.vector() for r in job.runs])
                    events.append((job, Embedded(vectors=vectors, prompt_tokens=job.req.prompt_tokens)))
        self._deliver(events)
