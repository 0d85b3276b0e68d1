"""Embeddings jobs in the continuous-batching scheduler: a component (`Embeddings`) the scheduler holds.

Why through the scheduler and not beside it: the model's device state (every slot's cache) belongs to
the driver thread, and an embedding is a forward over a slot's cache like a prompt chunk. So the
driver runs embedding work between generation steps, in slots that generation is not using:

1. `BatchScheduler.submit_embed` (request greenlet, never blocks) queues the job here or refuses it
   like `submit` (one rule, the scheduler's, for both kinds of job; a held reservation is used): queue
   full -> 429 Retry-After 5 (503 under CRITICAL memory pressure); shutting down or failed -> 503; the
   single-user setting refuses at once (429 Retry-After 1) when its slot is busy. A job waiting longer
   than `queue_wait_s` for its first slot gets 429 Retry-After 2; a cancelled one leaves at once.
2. Each driver iteration, before generation is admitted, `Embeddings.yield_locked` lets generation go
   first: when the oldest queued generation job needs more slots than are idle, embedding inputs give
   theirs back (those that have fed the fewest tokens first: the least work lost); such an input
   starts over from its first token later. A queued chat therefore waits for embeddings at most one
   driver iteration, never for an input's remaining chunks.
3. After generation has been admitted, `Embeddings.admit_locked` picks this iteration's embed rows under a
   budget: while any slot generates (or a generation job waits), one embed call feeds at most one
   prefill chunk's worth of tokens (`chunk`), inputs already holding a slot first; so a decode step
   waits behind at most one chunk of embedding work, as it would behind a long prompt. With no
   generation the call feeds every input it can. New inputs take the IDLE slots that no row of the
   step in flight references (those with the shortest prefix history first: the least useful to
   generation), started jobs first, then queued jobs in order, and never while a generation job
   waits. A slot given to an input turns EMBED (generation does not admit into it) and forgets its
   prefix history, session and scope: its cache is about to be overwritten, so nothing may reuse it.
   An input that fits one chunk whole takes no slot when the model offers `Model.embed_fresh`: up to
   `fresh_rows` such inputs ride in one slot-free call per iteration (a cache made for the call), under
   the same budget, and also while a generation job waits (they hold nothing generation needs); so
   2,048 tiny inputs are 2,048 / `fresh_rows` forwards, not 2,048 / slots (issue 43).
4. `Embeddings.run` (driver thread, no lock) feeds the next chunk of every chosen input in one
   `Model.embed` call, and the slot-free inputs in one `Model.embed_fresh` call: inputs of one or
   several jobs are batched. An input keeps its slot for all its
   chunks unless generation takes it back (starts increase; the first is 0, which also restarts
   recurrent state) and gives it back (IDLE, empty history) when its last chunk is in; the pooled
   vector is finished on the host (`pantheon.runtime.pooling.EmbedRun`). When every input of a job is
   done the job's sink gets `Embedded`.

A device failure in an embed call fails like a step (`_step_failed`: every request fails, the state is
rebuilt); a refusal before anything ran (a compile forbidden after warm-up, a bad shape) fails only the
embeddings jobs in that call. Embedding calls are not part of warm-up: with PANTHEON_FORBID_COMPILE=1
an embeddings request whose shape was never compiled fails with 500 compile_forbidden.

The component's dependencies are explicit: the scheduler's lock and condition (`mu`, `work`: every
`_locked` method runs under `mu`; a job's `todo`, `rows` and `runs` change only under it, on the
driver thread), its slots (the host mirrors, pantheon.scheduler.slot: an input's slot turns EMBED and
back to IDLE through the slot-state table), the chunk and the stats. What it needs of generation (is a
job waiting, how many slots it is short of, which slots the step in flight uses, the queue's reaping
rule) the scheduler passes in per call; it never reads the scheduler.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pantheon import osthread
from pantheon.errors import CompileForbiddenError
from pantheon.types import EmbedRequest, EmbedSink, Embedded, Event, Finished
from pantheon.runtime.pooling import EmbedRun
from pantheon.scheduler.slot import EMBED, IDLE, Slot

PRESSURE_CRITICAL = 3  # memory pressure level (pantheon.runtime.memory) at which no job is admitted


@dataclass(eq=False)
class _EmbedJob:
    req: EmbedRequest
    sink: EmbedSink
    enqueued_at: float
    runs: list[EmbedRun]
    todo: list[int] = field(init=False)  # a heap: the inputs waiting for a slot, lowest index first; _mu
    rows: dict[int, int] = field(default_factory=dict)  # slot index -> the input (its index) fed there; _mu
    fresh: set[int] = field(default_factory=set)  # inputs in this iteration's slot-free call; _mu
    cancelled: bool = False  # _mu

    def __post_init__(self) -> None:
        self.todo = list(range(len(self.runs)))  # (sorted: already a heap)


def new_job(req: EmbedRequest, sink: EmbedSink) -> _EmbedJob:
    return _EmbedJob(req=req, sink=sink, enqueued_at=time.monotonic(),
                     runs=[EmbedRun(ids, req.pooling) for ids in req.inputs])


class _EmbedHandle:
    """What `submit_embed` returns: cancel() is safe from any thread or greenlet at any time."""

    def __init__(self, cancel: Callable[[Any], None], job: _EmbedJob):
        self._cancel = cancel
        self._job = job

    def cancel(self) -> None:
        self._cancel(self._job)


Rows = list[tuple[Slot | None, _EmbedJob, EmbedRun]]  # slot None: the input rides in the slot-free call


class Embeddings:
    """The embeddings work of one scheduler: its queue, its started jobs and the slots they hold (see the
    module docstring)."""

    def __init__(self, mu: osthread.Lock, work: Any, slots: list[Slot], chunk: int, stats: Any, fresh_rows: int = 0,
                 fresh_shape: Callable[[int, int], tuple[int, int]] | None = None):
        self.mu = mu
        self.fresh_rows = fresh_rows  # short inputs one slot-free call (`Model.embed_fresh`) takes; 0: none
        # (rows, longest) -> the slot-free call's padded (rows, tokens): `Model.embed_fresh_shape`
        self.fresh_shape = fresh_shape or (lambda rows, longest: (rows, longest))
        self.work = work  # a condition on `mu`: notified when a slot comes back
        self.slots = slots
        self.chunk = chunk
        self.stats = stats  # the scheduler's SchedulerStats (cancelled), under mu
        self.queue: deque[_EmbedJob] = deque()  # mu: jobs waiting for their first slot
        self.jobs: list[_EmbedJob] = []  # mu: jobs holding at least one slot

    @property
    def waiting(self) -> int:
        """Jobs queued for a first slot (they count in the scheduler's queue bound)."""
        return len(self.queue)

    # ---- under mu ----------------------------------------------------------------------------------
    def enqueue_locked(self, job: _EmbedJob) -> None:
        self.queue.append(job)

    def yield_locked(self, short: int) -> None:
        """Generation first (called before generation is admitted): generation's oldest job is `short`
        slots short of what it needs; take them back from embedding inputs, those that have fed the
        fewest tokens first. Such an input loses what it fed (its earlier chunks' cache is gone) and
        waits at the front of its job's inputs to start over. Why take slots back instead of waiting for
        inputs to finish: an input of a full context holds its slot for max_seq / chunk embed calls, and
        a large request refills every slot as soon as it frees."""
        if short <= 0 or not self.jobs:
            return
        held = sorted(((job.runs[i].fed, s, job) for job in self.jobs for s, i in job.rows.items()),
                      key=lambda t: t[0])
        for _, s, job in held[:short]:
            i = job.rows.pop(s)
            run = job.runs[i]
            job.runs[i] = EmbedRun(run.tokens, run.pooling)
            heapq.heappush(job.todo, i)
            self.slots[s].state = IDLE  # its history was cleared when the input took it

    def admit_locked(self, events: list[tuple[Any, Event]], *, gen_waits: bool, shared: bool, admissible: bool,
                     busy: set[int], reap: Callable[..., deque]) -> Rows:
        """Reap cancelled and timed-out jobs, give idle slots to waiting inputs; returns the rows of this
        iteration's embed call, (slot, job, input), at most a chunk's worth of tokens when `shared` (a
        slot generates or a generation job waits). `gen_waits`: a generation job waits (the idle slots
        are its); `admissible`: new jobs may start (no critical memory pressure); `busy`: the slots the
        step in flight uses; `reap`: the scheduler's queue rule (cancelled, waited too long)."""
        if not self.queue and not self.jobs:
            return []  # the common case, once per driver iteration
        self.queue = reap(self.queue, events, lambda job: [Finished("cancelled", prompt_tokens=job.req.prompt_tokens)])
        for job in [j for j in self.jobs if j.cancelled]:
            self.drop_locked(job)
            self.stats.cancelled += 1
            events.append((job, Finished("cancelled", prompt_tokens=job.req.prompt_tokens)))
        rows: Rows = []
        spent = 0

        def take(run: EmbedRun) -> bool:
            """Whether `run`'s next chunk fits this call (the first row always does); counts it if so."""
            nonlocal spent
            n = min(self.chunk, len(run.tokens) - run.fed)
            if shared and rows and spent + n > self.chunk:
                return False
            spent += n
            return True

        for job in self.jobs:
            for s, i in job.rows.items():
                if take(job.runs[i]):
                    rows.append((self.slots[s], job, job.runs[i]))
        self._take_short_locked(rows, take, admissible, self.chunk if shared else self.chunk * len(self.slots))
        if gen_waits:
            return rows  # the idle slots are generation's
        idle = sorted((sl for sl in self.slots if sl.state == IDLE and sl.index not in busy),
                      key=lambda sl: len(sl.hist))
        waiting = list(self.jobs) + (list(self.queue) if admissible else [])
        for job in waiting:
            while idle:
                i = self._next_for_a_slot(job)
                if i is None or not take(job.runs[i]):
                    break
                sl = idle.pop(0)
                sl.state = EMBED
                sl.forget_history()  # its cache is about to be overwritten
                job.todo.remove(i)
                heapq.heapify(job.todo)
                job.rows[sl.index] = i
                rows.append((sl, job, job.runs[i]))
            self._started_locked(job)
            if not idle or (shared and spent >= self.chunk):
                break
        return rows

    def _next_for_a_slot(self, job: _EmbedJob) -> int | None:
        """The job's first waiting input that needs a slot: any, or with the slot-free call, only one longer
        than a chunk (the short ones wait for that call, however many it is behind: it is cheaper)."""
        if not self.fresh_rows:
            return job.todo[0] if job.todo else None
        return min((i for i in job.todo if len(job.runs[i].tokens) > self.chunk), default=None)

    def _started_locked(self, job: _EmbedJob) -> None:
        """A queued job that now has inputs running (in slots or in the slot-free call) joins the started."""
        if (job.rows or job.fresh) and job not in self.jobs:
            self.queue.remove(job)
            self.jobs.append(job)

    def _take_short_locked(self, rows: Rows, take: Callable[[EmbedRun], bool], admissible: bool, padded: int) -> None:
        """Give this iteration's slot-free call (`Model.embed_fresh`) the waiting inputs that fit one chunk
        whole, in job and input order, up to `fresh_rows` of them and the call's token budget (`take`;
        with no generation, a chunk per slot: a chat that arrives waits no longer than behind a
        slot-fed call). `padded`: the token-rows the call's forward may cost once padded to its program's
        shape (`fresh_shape`): a chunk beside generation, a chunk per slot alone -- what a slot-fed call
        costs -- so a driver iteration with the call stalls a stream no longer than one without it.

        Why: an input fed through a slot holds it, so a request of 2,048 tiny inputs took 2,048 / slots
        forwards, one driver iteration each (over 120 s beside a stream, issue 43). A short input needs no
        slot (nothing of it outlives the call), so up to `fresh_rows` ride in one forward; and since they
        take no slot they run even while a generation job waits, under the same one-chunk budget as any
        embedding work beside generation: neither kind of work starves the other."""
        if not self.fresh_rows:
            return
        taken = longest = 0
        full = False
        for job in list(self.jobs) + (list(self.queue) if admissible else []):
            for i in [i for i in sorted(job.todo) if len(job.runs[i].tokens) <= self.chunk]:
                n = len(job.runs[i].tokens)
                b, t = self.fresh_shape(taken + 1, max(longest, n)) if taken < self.fresh_rows else (0, 0)
                full = taken >= self.fresh_rows or (taken > 0 and b * t > padded) or not take(job.runs[i])
                if full:
                    break
                longest = max(longest, n)
                taken += 1
                job.fresh.add(i)
                rows.append((None, job, job.runs[i]))
            if job.fresh:
                job.todo = [i for i in job.todo if i not in job.fresh]
                heapq.heapify(job.todo)
                self._started_locked(job)
            if full:
                return

    def drop_locked(self, job: _EmbedJob) -> None:
        """The job leaves: its slots go back to IDLE with no history (their caches hold its inputs)."""
        for i in job.rows:
            sl = self.slots[i]
            sl.state = IDLE
            sl.forget_history()
        job.rows.clear()
        job.fresh.clear()
        if job in self.jobs:
            self.jobs.remove(job)
        self.work.notify_all()

    def fail_locked(self, events: list[tuple[Any, Event]], error: BaseException) -> None:
        """Every embeddings job, queued or started, fails with `error` (a failed step, the driver dying,
        shutdown); their slots go back to IDLE."""
        for job in list(self.jobs):
            self.drop_locked(job)
            events.append((job, Finished("error", error=error)))
        while self.queue:
            events.append((self.queue.popleft(), Finished("error", error=error)))

    # ---- the driver thread, device work (no lock held) ---------------------------------------------
    def run(self, model: Any, state: Any, rows: Rows) -> tuple[Any, list[tuple[Any, Event]], Exception | None]:
        """This iteration's embedding forwards: the next chunk of every input holding a slot, batched in
        one `model.embed` call, and the short inputs of the slot-free call in one `model.embed_fresh`.
        Returns (the state, the events to deliver, a device failure or None): a failure of the device is
        the scheduler's to handle like a failed step (the state is then gone); a refusal before anything
        ran (a compile forbidden after warm-up, a bad shape) fails only the jobs in the call."""
        events: list[tuple[Any, Event]] = []
        slotted = [(sl, job, run, *run.next_chunk(self.chunk)) for sl, job, run in rows if sl is not None]
        fresh = [(None, job, run, list(run.tokens), next(i for i in job.fresh if job.runs[i] is run))
                 for sl, job, run in rows if sl is None]  # (the input's index where a slot row has its start)
        for parts in (slotted, fresh):
            if not parts:
                continue
            try:
                if parts is slotted:
                    out, state = model.embed(state, [p[3] for p in parts], [p[0].index for p in parts],
                                             [p[4] for p in parts], [p[2].pooling for p in parts])
                else:
                    out = model.embed_fresh([p[3] for p in parts], [p[2].pooling for p in parts])
            except (CompileForbiddenError, ValueError) as exc:  # refused before anything ran: the state is intact
                with self.mu:
                    for job in {id(p[1]): p[1] for p in parts}.values():
                        if job in self.jobs:
                            self.drop_locked(job)
                            events.append((job, Finished("error", error=exc)))
                continue
            except Exception as exc:  # the device failed
                return state, events, exc
            with self.mu:
                self._took_locked(parts, out, events)
        return state, events, None

    def _took_locked(self, parts: list[tuple], out: Any, events: list[tuple[Any, Event]]) -> None:
        """One call's vectors into their inputs; a job whose every input is done gets `Embedded`."""
        for (sl, job, run, toks, where), vec in zip(parts, out):
            if job.cancelled or job not in self.jobs:
                continue  # cancelled meanwhile: admit_locked drops it next iteration
            run.add(len(toks), vec)
            if not run.done:
                continue
            if sl is None:
                job.fresh.discard(where)
            else:
                del job.rows[sl.index]
                sl.state = IDLE  # its history was cleared when the input took it
            if not job.todo and not job.rows and not job.fresh:
                self.jobs.remove(job)
                vectors = np.stack([r.vector() for r in job.runs])
                events.append((job, Embedded(vectors=vectors, prompt_tokens=job.req.prompt_tokens)))
