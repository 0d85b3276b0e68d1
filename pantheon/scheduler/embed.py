"""Embeddings jobs in the continuous-batching scheduler: `BatchScheduler` inherits `EmbedDriver`.

Why through the scheduler and not beside it: the model's device state (every slot's cache) belongs to
the driver thread, and an embedding is a forward over a slot's cache like a prompt chunk. So the
driver runs embedding work between generation steps, in slots that generation is not using:

1. `submit_embed` (request greenlet, never blocks) queues the job or refuses it like `submit`: queue
   full -> 429 Retry-After 5 (503 under CRITICAL memory pressure); shutting down or failed -> 503; the
   single-user setting refuses at once (429 Retry-After 1) when its slot is busy. A job waiting longer
   than `queue_wait_s` for its first slot gets 429 Retry-After 2; a cancelled one leaves at once.
2. Each driver iteration, after generation has been admitted, `_embed_admit_locked` gives the IDLE
   slots that no row of the step in flight references (those with the shortest prefix history first:
   the least useful to generation) to waiting inputs, started jobs first, then queued jobs in order. A
   slot given to an input turns EMBED (generation does not admit into it) and forgets its prefix
   history, session and scope: its cache is about to be overwritten, so nothing may reuse it.
3. `_embed_round` (driver thread, no lock) feeds the next chunk of every input holding a slot in one
   `Model.embed` call: inputs of one or several jobs are batched. An input keeps its slot for all its
   chunks (starts increase; the first is 0, which also restarts recurrent state) and gives it back
   (IDLE, empty history) when its last chunk is in; the pooled vector is finished on the host
   (`pantheon.runtime.pooling.EmbedRun`). When every input of a job is done the job's sink gets `Embedded`.

A device failure in an embed call fails like a step (`_step_failed`: every request fails, the state is
rebuilt); a refusal before anything ran (a compile forbidden after warm-up, a bad shape) fails only the
embeddings jobs in that call. Embedding calls are not part of warm-up: with PANTHEON_FORBID_COMPILE=1
an embeddings request whose shape was never compiled fails with 500 compile_forbidden.

The mixin uses the scheduler's fields (`_mu`, `_work`, `_slots`, `_state`, `_inflight`, `model`,
`chunk`, `immediate`, `queue_depth`, `queue_wait_s`, `pressure`, `stats`, `failure`, `_closed`) and
methods (`_free_slots_locked`, `_deliver`, `_step_failed`, `_cancel`) under the same lock rules.
"""

from __future__ import annotations

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
    next_input: int = 0  # inputs given a slot so far (in order); _mu
    rows: dict[int, EmbedRun] = field(default_factory=dict)  # slot index -> the input fed there; _mu
    cancelled: bool = False  # _mu


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
    def submit_embed(self, req: EmbedRequest, sink: EmbedSink) -> _EmbedHandle:
        """Queue an embeddings job; its sink gets one `Embedded`, or `Finished("error" | "cancelled")`.
        Raises BusyError (429/503) or ModelFailed (503) when it cannot even be queued."""
        too_long = [len(ids) for ids in req.inputs if len(ids) > self.model.max_seq]
        if too_long:
            raise RequestError(f"input: an input has {too_long[0]} tokens; this model's maximum context length is "
                               f"{self.model.max_seq}", param="input", code="context_length_exceeded")
        job = _EmbedJob(req=req, sink=sink, enqueued_at=time.monotonic(),
                        runs=[EmbedRun(ids, req.pooling) for ids in req.inputs])
        with self._mu:
            self._admission_locked()  # (BatchScheduler's: one rule for both kinds of job)
            self._embed_queue.append(job)
            self._work.notify_all()
        return _EmbedHandle(self, job)

    # ---- the driver thread, under _mu ----------------------------------------------------------
    def _embed_admit_locked(self, events: list[tuple[Any, Event]]) -> list[tuple[Any, _EmbedJob, EmbedRun]]:
        """Reap cancelled and timed-out jobs, give idle slots to waiting inputs; returns the rows of
        this iteration's embed call: (slot, job, input) for every input holding a slot."""
        if not self._embed_queue and not self._embed_jobs:
            return []  # the common case, once per driver iteration
        self._embed_queue = self._reap_locked(  # (BatchScheduler's, shared with generation)
            self._embed_queue, events, lambda job: [Finished("cancelled", prompt_tokens=job.req.prompt_tokens)])
        for job in [j for j in self._embed_jobs if j.cancelled]:
            self._embed_drop_locked(job)
            self.stats.cancelled += 1
            events.append((job, Finished("cancelled", prompt_tokens=job.req.prompt_tokens)))
        busy = {r.slot.index for r in self._inflight.rows} if self._inflight is not None else set()
        idle = sorted((sl for sl in self._slots if sl.state == IDLE and sl.index not in busy),
                      key=lambda sl: len(sl.hist))
        waiting = list(self._embed_jobs)
        if self.pressure() < PRESSURE_CRITICAL:
            waiting += list(self._embed_queue)
        for job in waiting:
            if not idle:
                break
            while idle and job.next_input < len(job.runs):
                sl = idle.pop(0)
                sl.state = EMBED
                sl.hist, sl.scope, sl.session_id = [], "", None  # its cache is about to be overwritten
                job.rows[sl.index] = job.runs[job.next_input]
                job.next_input += 1
            if job not in self._embed_jobs:
                self._embed_queue.remove(job)
                self._embed_jobs.append(job)
        return [(self._slots[i], job, run) for job in self._embed_jobs for i, run in job.rows.items()]

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
                if job.next_input == len(job.runs) and not job.rows:
                    self._embed_jobs.remove(job)
                    vectors = np.stack([r.vector() for r in job.runs])
                    events.append((job, Embedded(vectors=vectors, prompt_tokens=job.req.prompt_tokens)))
        self._deliver(events)
