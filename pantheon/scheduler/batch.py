"""Continuous batching: N slots of one model share each jitted step, driven by one OS thread.

Lifecycle of a request:

1. `submit` (request greenlet, never blocks) appends it to the FIFO admission queue, or refuses it:
   queue full -> 429 Retry-After 5 (503 under CRITICAL memory pressure); shutting down or failed ->
   503. With `immediate=True` (the single-user setting, PANTHEON_BATCH_SLOTS=0: one slot, no queue) a
   request that finds no free slot is refused at once with 429 Retry-After 1. A request that must
   prepare first (compile its grammar) takes a place with `reserve` before it starts, so it is refused
   before that work rather than after, and its place counts in the queue's bound while it prepares.
2. The driver admits queued requests into IDLE slots -- in arrival order, except that while another
   request's job waits, one request's generations (a legacy completion's prompts are one job each) take
   at most PANTHEON_REQUEST_SLOT_SHARE of the slots (`_next_locked`) -- preferring the slot that holds the request's
   session, else the idle slot whose committed history shares the longest prefix with the prompt (its
   KV is reused: only the new suffix is prefilled). A model with recurrent state can only reuse a slot's
   whole committed history, so it also keeps snapshots of its slots' state where prompt chunks end
   (pantheon.scheduler.snapshots) and resumes a prompt from the longest one it starts with. Reuse
   never crosses a cache scope (`GenRequest.cache_scope`). Admission writes the request's data into its slot on the device once
   (`Model.insert`: knobs, seed, stop ids, budget, the prompt's tail for penalties). A request waiting
   longer than `queue_wait_s` is refused with 429 Retry-After 2. A cancelled queued request leaves at once.
3. Slot states (pantheon.scheduler.slot: an enum and its transition table; any other change raises):
   IDLE -> PREFILL (its prompt is fed in chunks of `prefill_chunk`) -> DECODE (one token per step,
   batched with every other DECODE slot) -> IDLE. While both kinds of work exist, each step
   carries the oldest prefiller's next chunk *and* every decoder in one mixed forward (models that
   declare mixed steps; PANTHEON_BS_MIXED=0 turns it off); otherwise the driver alternates a chunk and
   a decode step, so a long prompt stalls decoders by at most one chunk.
4. The driver is asynchronous: it dispatches step N+1 before it reads step N's ids (the next decode
   token is already in the decode state on the device), so planning, emitting and bookkeeping overlap
   the device. A step is dispatched in explicit phases (`_step`): the forward, then (with a grammar)
   the masks, built while the forward runs, then the sampler. The step samples, spends the budget and
   checks stop ids itself; a slot that finished in
   step N costs at most one dead row in step N+1 (the device sends it to the scratch slot). Two steps
   are read before the next is dispatched: one that carries a prompt's last chunk (so the first token
   is not a step late) and, while requests wait, one that ends a request by its budget.

Threads and locks (docs/architecture.md has the whole map):
- the driver thread `driver-<model>` is the only one that touches the device state (`_state`), the
  in-flight step and the slots' `hist` / `pending` / `pos` / `last_token` fields;
- `_mu` guards the queue, the slots' `state` / `job` fields, `_closed`, `_failed`, every job's
  `cancelled` flag and the stats. It is held only for bookkeeping, never across a device call or a
  wait on the device; `_work` (a condition on `_mu`) wakes the driver: new job, cancel or close.
- sinks are called outside `_mu` (they only hand the event to a greenlet).

Grammar masks (GenRequest.constraint) are built by `pantheon.scheduler.masks.MaskBuilder`'s threads
with a deadline (PANTHEON_GRAMMAR_MASK_MS): a request whose mask row is late, or whose grammar stops on
an error of its own, fails alone (400 `grammar_too_complex`); the step goes on for every other row.

Failure is loud: a failed step fails its requests (500) and rebuilds the state with every slot's
prefix history cleared (the cache it described is gone); an exception anywhere else in the driver
(admission, bookkeeping, or a rebuild that fails) fails every queued and active request, marks the
scheduler failed (`failure`: the registry and `GET /` report it, new requests get 503) and ends the
thread. The model can then be unloaded and loaded again.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from typing import Any

import numpy as np

from pantheon.runtime import compile_guard, decode_state, heap
from pantheon import osthread
from pantheon.config import Settings
from pantheon.runtime.engine import Chunk, Model, StepHandle, StepPlan
from pantheon.errors import BusyError, ModelFailed, RequestError
from pantheon.types import EmbedRequest, EmbedSink, Event, Finished, GenRequest, Sink, Started, TokenLogprob, Tokens
from pantheon.scheduler.embed import PRESSURE_CRITICAL, Embeddings, _EmbedHandle, new_job
from pantheon.scheduler.drafts import DraftBudget, DraftModel, PromptLookup, SpecGauge
from pantheon.scheduler.masks import MaskBuilder
from pantheon.scheduler.slot import DECODE, EMBED, FORK, FORKWAIT, IDLE, PREFILL, Slot
from pantheon.scheduler.snapshots import Snapshot, SnapshotPool, pool_bytes

class Reservation:
    """A place in the admission queue held by a request still preparing (`BatchScheduler.reserve`).

    Give it to `submit` (which takes it over) or `release` it; either is safe from any thread, and
    releasing a used or released one does nothing."""

    def __init__(self, sched: "BatchScheduler"):
        self._sched = sched
        self.held = True  # the scheduler's _mu

    def release(self) -> None:
        self._sched._unreserve(self)


class _Handle:
    """What `submit` returns: cancel() is safe from any thread or greenlet at any time."""

    def __init__(self, sched: "BatchScheduler", job: "_Job"):
        self._sched = sched
        self._job = job

    def cancel(self, choice: int | None = None) -> None:
        """Stop the request (every choice), or only choice `choice` of an n > 1 request."""
        self._sched._cancel(self._job, choice)


@dataclass(eq=False)
class _Job:
    req: GenRequest
    sink: Sink
    enqueued_at: float
    cancelled: bool = False  # guarded by the scheduler's _mu
    cancelled_choices: set[int] = field(default_factory=set)  # _mu: choices stopped alone (n > 1)
    error: Exception | None = None  # _mu: the job failed alone (its grammar); it leaves like a cancel, as "error"
    embd: Any = None  # driver-only: the images' embeddings [N, tokens, H] (host), encoded at insert


@dataclass(frozen=True)
class _Row:
    """One row of a dispatched step, as the driver must interpret it when the result comes back."""

    slot: Slot
    job: _Job
    part: tuple[int, ...] = ()  # the prompt chunk (empty: a decode row)
    final: bool = False  # the prompt's last chunk: the row emits the first token
    ends_prompt: bool = False  # the last chunk of an n > 1 prompt (no token: the choices fork after it)
    draft: tuple[int, ...] = ()  # a verify step's drafts for this decode row (it may emit len + 1 tokens)
    drafted_by: str = ""  # who proposed `draft`: "lookup" (prompt lookup) or "model" (the draft model)

    @property
    def emits(self) -> bool:
        return not self.part or self.final


@dataclass
class _Planned:
    """A step planned but not yet dispatched: the engine's input and how to read its rows back."""

    plan: StepPlan
    rows: list[_Row]
    kind: str


@dataclass
class _InFlight:
    handle: StepHandle
    rows: list[_Row]
    kind: str
    n_prompt: int
    t_dispatch: float
    host_ms: float  # host time spent planning and dispatching it


@dataclass
class SchedulerStats:
    steps: int = 0
    decode_steps: int = 0
    prefill_chunks: int = 0
    mixed_steps: int = 0  # steps that carried a prefill chunk and decode rows together
    decode_tokens: int = 0
    prefill_tokens: int = 0
    prefix_hits: int = 0
    prefix_misses: int = 0
    reused_tokens: int = 0
    spec_steps: int = 0  # verify steps (speculative decoding)
    spec_drafted: int = 0  # draft tokens verified (prompt lookup)
    spec_accepted: int = 0  # of them, accepted (each is a token that cost no step of its own)
    spec_model_drafted: int = 0  # draft tokens verified (the draft model)
    spec_model_accepted: int = 0  # of them, accepted
    snapshot_resumes: int = 0  # admissions that resumed a recurrent slot from a prefix snapshot
    snapshots_taken: int = 0
    snapshots_evicted: int = 0
    rejected_full: int = 0
    rejected_timeout: int = 0
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    step_ms_total: float = 0.0  # dispatch to result read, per step
    host_ms_total: float = 0.0  # host work per step (planning, dispatching, emitting), device waits excluded


class BatchScheduler:
    """One per loaded model: the driver of its slots (PANTHEON_BATCH_SLOTS=0 -> one slot, immediate 429)."""

    def __init__(self, model: Model, settings: Settings, pressure: Callable[[], int] | None = None,
                 warmup: bool | None = None):
        self.model = model
        self.immediate = settings.batch_slots == 0  # the single-user setting
        self.n_slots = 1 if self.immediate else min(model.n_slots, settings.batch_slots)
        self.chunk = min(settings.prefill_chunk, model.chunk)
        self.queue_depth = 0 if self.immediate else settings.queue_depth
        self.queue_wait_s = settings.queue_wait_s
        # the most slots one request's generations are admitted into while another request waits
        # (PANTHEON_REQUEST_SLOT_SHARE; at least one): `_next_locked`
        self.request_slots = max(1, int(self.n_slots * settings.request_slot_share))
        # (a vision model's image rows ride only in prefill steps: the mixed forward takes no override)
        self.mixed = settings.bs_mixed and model.supports_mixed and getattr(model, "vision", None) is None
        self.log_stats = settings.bs_stats
        self._t_origin = time.perf_counter()  # stats lines give each step's start from here: gaps show idle
        self.forbid_compile = settings.forbid_compile
        self.recurrent = model.caps.recurrent_state  # state that cannot roll back: reuse all of hist or nothing
        # speculative decoding (prompt-lookup drafts, verified in the step): where the model verifies
        # (attention-only text models), for every request that does not opt out
        self.speculative = settings.speculative
        self.spec_k = max(getattr(model, "verify_ks", ()) or (0,))
        self.spec_slots = max(getattr(model, "verify_rows", ()) or (0,))
        self._gauge = SpecGauge(enabled=settings.spec_gauge)  # driver-only: whether verify steps pay here
        # driver-only: the draft model loaded with this one (`--draft-model`), proposing where prompt
        # lookup finds nothing (DraftModel checks it can: same vocabulary, attention-only)
        draft = getattr(model, "draft", None)
        self._drafter = DraftModel(model, draft) if draft is not None and self.spec_k else None
        self._last_read: float | None = None  # driver-only: when the last step was read (None after idling)
        # driver-only: recurrent state at prompt chunk ends (pantheon.scheduler.snapshots); the snapshots
        # need their source slot's K/V rows unless the model has no per-token state (RWKV-7)
        entry = model.snapshot_bytes() if self.recurrent else 0
        self._snapshots = SnapshotPool(pool_bytes(settings.prefix_snapshot_mb, entry, model.n_slots, model.max_seq,
                                                  model.chunk) if entry else 0, entry)
        self._snap_needs_kv = self.recurrent and model.state_bytes_per_token() > 0
        self.pressure = pressure or (lambda: 0)
        self._mu = osthread.Lock()
        self._work = osthread.Condition(self._mu)
        self._slots = [Slot(i) for i in range(self.n_slots)]
        self._queue: deque[_Job] = deque()
        self._reserved = 0  # _mu: places held by Reservations (counted as queued by the admission rule)
        self._closed = False
        self.failure: str | None = None  # set once when the driver dies; the registry and health read it
        self.stats = SchedulerStats()
        self._turn_prefill = True  # driver-only: whose turn it is when both kinds of work exist
        self._inflight: _InFlight | None = None  # driver-only: the dispatched step not yet read
        self._state = model.new_state()  # driver-only after start: the donated device state
        self._embeds = Embeddings(self._mu, self._work, self._slots, self.chunk, self.stats,  # embeddings jobs (_mu)
                                  fresh_rows=int(getattr(model, "fresh_embed_rows", 0) or 0),
                                  fresh_shape=getattr(model, "embed_fresh_shape", None))
        # grammar mask rows: workers start with the first constrained step; up to n_slots more may be
        # held by abandoned (late) rows while n_slots stay free for new steps
        self._mask_builder = MaskBuilder(f"mask-{model.name}", settings.grammar_mask_ms / 1000.0,
                                         live=self.n_slots, spare=self.n_slots)
        if settings.warmup if warmup is None else warmup:
            # Returns once the programs any request fits are made (loaded or compiled); the rest compile
            # in the model's compile-<model> thread while this driver serves (load_info's "compiled").
            self._state = model.warmup(self._state, mixed=self.mixed, background=settings.warmup_background)
            if self._drafter is not None:
                self._drafter.warm(background=settings.warmup_background)
            # compiling leaves ~150 MB of freed compiler heap in glibc's arenas (SmolLM2, measured by
            # tools/rss_breakdown.py): hand it back before serving
            heap.release_freed_memory()
        self._thread = osthread.start_thread(self._drive, name=f"driver-{model.name}")

    # ---- called from request greenlets --------------------------------------------------------
    def reserve(self) -> Reservation:
        """Hold a place in the admission queue for a request that must prepare before it can be
        submitted (compile its grammar): refused now, by the same rule as `submit`, if it could not be
        queued, so no preparation is spent on a request that would get 429; while held, the place
        counts in the queue's bound. `submit(..., reservation=)` uses it, `Reservation.release` drops it."""
        with self._mu:
            self._admission_locked()
            self._reserved += 1
        return Reservation(self)

    def _unreserve(self, r: Reservation) -> None:
        with self._mu:
            if r.held:
                r.held = False
                self._reserved -= 1

    def submit(self, req: GenRequest, sink: Sink, reservation: Reservation | None = None) -> _Handle:
        """Queue `req`. With a held `reservation` its place is used (no capacity check: it was made when
        the place was taken); without one the admission rule decides now."""
        job = _Job(req=req, sink=sink, enqueued_at=time.monotonic())
        if req.images and getattr(self.model, "vision", None) is None:
            raise RequestError(f"model {self.model.name!r} does not take images (it was loaded without a vision "
                               "projector)", code="model_not_multimodal")
        if req.images and req.prompt_logprobs is not None:
            raise RequestError("prompt log probabilities are not computed for prompts with images",
                               param="logprobs")
        if req.n > self.n_slots:
            raise RequestError(f"n: at most {self.n_slots} choices (the model's slots), got {req.n}", param="n")
        with self._mu:
            self._take_place_locked(reservation)
            self._queue.append(job)
            self._work.notify_all()
        return _Handle(self, job)

    def submit_embed(self, req: EmbedRequest, sink: EmbedSink, reservation: Reservation | None = None) -> _EmbedHandle:
        """Queue an embeddings job (pantheon.scheduler.embed); its sink gets one `Embedded`, or
        `Finished("error" | "cancelled")`. Raises BusyError (429/503) or ModelFailed (503) when it cannot
        even be queued, by the same rule as `submit`; a held `reservation` is its place."""
        too_long = [len(ids) for ids in req.inputs if len(ids) > self.model.max_seq]
        if too_long:
            raise RequestError(f"input: an input has {too_long[0]} tokens; this model's maximum context length is "
                               f"{self.model.max_seq}", param="input", code="context_length_exceeded")
        job = new_job(req, sink)
        with self._mu:
            self._take_place_locked(reservation)
            self._embeds.enqueue_locked(job)
            self._work.notify_all()
        return _EmbedHandle(self._cancel, job)

    def _take_place_locked(self, reservation: Reservation | None) -> None:
        """A job's place in the queue: its held `reservation` (no capacity check: that was made when the
        place was taken), else the admission rule decides now."""
        if reservation is not None and reservation.held and reservation._sched is self:
            reservation.held = False
            self._reserved -= 1
            if self.failure is not None:
                raise ModelFailed(f"model {self.model.name!r} failed: {self.failure}")
            if self._closed:
                raise BusyError("server is shutting down", status=503)
        else:
            self._admission_locked()

    def _admission_locked(self) -> None:
        """The one rule for queueing a job of either kind (generation, embedding): raises when it
        cannot even be queued -- failed or closing (503), the single-user slot busy (429 at once),
        the queue full (429, or 503 under critical memory pressure)."""
        if self.failure is not None:
            raise ModelFailed(f"model {self.model.name!r} failed: {self.failure}")
        if self._closed:
            raise BusyError("server is shutting down", status=503)
        free = self._free_slots_locked()
        waiting = len(self._queue) + self._embeds.waiting + self._reserved
        if self.immediate and (free == 0 or waiting):
            raise BusyError("a request is already in progress on this model; retry shortly", status=429, retry_after=1)
        if waiting >= self.queue_depth + free:
            self.stats.rejected_full += 1
            if self.pressure() >= PRESSURE_CRITICAL:
                raise BusyError("memory pressure is critical; try again later", status=503)
            raise BusyError("all slots are busy and the queue is full", status=429, retry_after=5)

    def _cancel(self, job: _Job, choice: int | None = None) -> None:
        with self._mu:
            if choice is None:
                job.cancelled = True
            else:
                job.cancelled_choices.add(choice)
            self._work.notify_all()

    def load_info(self) -> dict:
        with self._mu:
            s = dataclasses.asdict(self.stats)
            s.update(mode="single" if self.immediate else "batch", slots=self.n_slots, queued=len(self._queue),
                     reserved=self._reserved,
                     running=sum(1 for sl in self._slots if sl.state != IDLE),
                     native_kernels=int(bool(getattr(self.model, "native_matmul", False))),
                     # positions held in the slots' caches (busy slots, and idle slots' reusable prefixes):
                     # `hist` is the driver's, but its length is read whole (a gauge, one step stale at most)
                     kv_tokens=sum(len(sl.hist) for sl in self._slots),
                     kv_capacity=self.n_slots * int(self.model.max_seq),
                     vision=int(getattr(self.model, "vision", None) is not None),
                     failure=self.failure)
        progress = getattr(self.model, "compile_progress", None)
        if callable(progress):  # (a test's fake model has none)
            s["compiled"], s["programs"] = progress()
        return s

    def close(self, timeout: float = 10.0) -> None:
        with self._mu:
            self._closed = True
            self._work.notify_all()
        self._thread.join(timeout)
        self._mask_builder.close()

    def _free_slots_locked(self) -> int:
        return sum(1 for sl in self._slots if sl.state == IDLE)

    # ---- the driver thread ---------------------------------------------------------------------
    def _drive(self) -> None:
        if self.forbid_compile:  # every bucket was compiled by warm-up; a new compile is a bug
            compile_guard.forbid_current_thread()
        try:
            self._drive_loop()
        except BaseException as exc:  # noqa: BLE001 - the driver never dies quietly
            self._die(exc)
        finally:  # thread idents are reused: a later thread must not inherit this one's guard
            compile_guard.forbid_current_thread(False)

    def _drive_loop(self) -> None:
        while True:
            if self._inflight is not None and self._read_first(self._inflight):
                self._collect_inflight()
            events: list[tuple[_Job, Event]] = []
            with self._mu:
                if self._closed:
                    break
                released = self._take_cancelled_locked(events)
                self._reap_queue_locked(events)
                admissible = self.pressure() < PRESSURE_CRITICAL  # (nothing starts under critical pressure)
                if self._queue and admissible:  # generation first: it may take slots back from embedding inputs
                    self._embeds.yield_locked(self._queue[self._next_locked()].req.n - self._free_slots_locked())
                admitted = self._admit_locked(events)
                gen_waits = bool(self._queue) and admissible
                busy = {r.slot.index for r in self._inflight.rows} if self._inflight is not None else set()
                embeds = self._embeds.admit_locked(
                    events, gen_waits=gen_waits, admissible=admissible, busy=busy, reap=self._reap_locked,
                    shared=gen_waits or any(sl.state not in (IDLE, EMBED) for sl in self._slots))
                work = any(sl.state not in (IDLE, EMBED) for sl in self._slots)
                if not work and not embeds and self._inflight is None and not events:
                    self._last_read = None  # idle: the next step's time is not one step's
                    self._work.wait(0.5 if self._queue or self._embeds.queue else None)
                    continue
            self._deliver(events)
            t0 = time.perf_counter()
            for sl in released:
                self._state = self.model.release(self._state, sl.index)
            for sl, job in admitted:
                self._insert(sl, job)
            self._fork_ready()
            if embeds:
                self._state, ev, failed = self._embeds.run(self.model, self._state, embeds)
                self._deliver(ev)
                if failed is not None:  # the device failed: like a failed step (every request fails, state rebuilt)
                    self._step_failed(failed)
                    continue
                t0 = time.perf_counter()  # the step's host time leaves the embed call out
            try:
                nxt = self._step(t0) if work else None
            except Exception as exc:  # a step that cannot even be dispatched fails like one that ran
                self._step_failed(exc)
                continue
            done, self._inflight = self._inflight, nxt  # (None when the masks' phase collected it already)
            if done is not None:
                self._collect(done)
        self._shutdown()

    def _collect_inflight(self) -> None:
        """Read and hand out the step in flight, if any (it is then no longer in flight)."""
        done, self._inflight = self._inflight, None
        if done is not None:
            self._collect(done)

    def _read_first(self, inflight: _InFlight) -> bool:
        """Whether to read the step in flight before dispatching the next one (giving up one step of
        overlap): when it carries a prompt's last chunk (its first token should reach the client now,
        not a step later: time to first token), or when requests wait and it will end a request by
        its budget (the freed slot is admitted a step sooner)."""
        if any(r.final or r.ends_prompt for r in inflight.rows):
            return True
        return bool(self._queue) and any(not r.part and r.slot.generated + 1 >= r.job.req.max_tokens
                                         for r in inflight.rows)

    # ---- bookkeeping (under _mu) ---------------------------------------------------------------
    def _take_cancelled_locked(self, events: list[tuple[_Job, Event]]) -> list[Slot]:
        """Running jobs whose owner cancelled: their slots go back to IDLE now (the device is told by
        `release` before the next step). A row of theirs in the step in flight still computes; for a
        model with recurrent state that moves the state past `hist`, so that history is dropped."""
        out = []
        inflight = {id(r.slot) for r in self._inflight.rows} if self._inflight is not None else set()
        for sl in self._slots:
            if sl.state != IDLE and sl.job is not None and (sl.job.cancelled or sl.choice in sl.job.cancelled_choices):
                if self.recurrent and id(sl) in inflight:
                    sl.hist, sl.scope = [], ""
                err = sl.job.error
                events.append(self._release_locked(sl, "error", err) if err is not None
                              else self._release_locked(sl, "cancelled"))
                out.append(sl)
        return out

    def _fail_job_locked(self, job: _Job, error: Exception) -> None:
        """`job` fails alone: its slots leave at the next turn of the loop, with Finished("error"), the
        way a cancelled job's do; until then none of its rows' tokens is handed out."""
        if job.error is None:
            job.error = error
        job.cancelled = True
        self._work.notify_all()

    def _reap_queue_locked(self, events: list[tuple[_Job, Event]]) -> None:
        self._queue = self._reap_locked(self._queue, events, lambda job: [
            Finished("cancelled", prompt_tokens=len(job.req.prompt_ids), choice=i) for i in range(job.req.n)])

    def _reap_locked(self, queue: deque, events: list, cancelled: Callable[[Any], list[Event]]) -> deque:
        """The jobs of `queue` (either kind) still waiting: a cancelled one leaves with the events
        `cancelled(job)` gives; one that waited longer than `queue_wait_s` is refused (429 Retry-After 2)."""
        now = time.monotonic()
        keep: deque = deque()
        for job in queue:
            if job.cancelled:
                self.stats.cancelled += 1
                events += [(job, ev) for ev in cancelled(job)]
            elif now - job.enqueued_at > self.queue_wait_s:
                self.stats.rejected_timeout += 1
                events.append((job, Finished("error", error=BusyError(
                    "timed out waiting for a free slot", status=429, retry_after=2))))
            else:
                keep.append(job)
        return keep

    def _admit_locked(self, events: list[tuple[_Job, Event]]) -> list[tuple[Slot, _Job]]:
        out = []
        while self._queue and self.pressure() < PRESSURE_CRITICAL:
            idle = [sl for sl in self._slots if sl.state == IDLE]
            k = self._next_locked()
            n = self._queue[k].req.n
            if len(idle) < n:  # an n > 1 request waits for n free slots (first come, first served)
                break
            job = self._queue[k]
            del self._queue[k]
            slot, reuse, resume = self._pick_slot(idle, job.req)
            prompt = job.req.prefix_key  # image positions keyed by their content hash
            slot.state = PREFILL
            slot.job = job
            slot.choice = 0
            slot.session_id = job.req.session_id
            slot.scope = job.req.cache_scope
            new_hist = list(prompt[:reuse]) if resume is not None else slot.hist[:reuse]
            if self._snap_needs_kv:  # its rows past what the old and new histories share get overwritten
                self._snapshots.overwritten(slot.index, self._common_prefix(slot.hist, new_hist))
            slot.hist = new_hist
            slot.resume = resume
            # n > 1: the prompt but its last token goes into one slot; the choices then fork from it,
            # each decoding the last token first (pantheon.runtime.engine.Model.copy_slot)
            slot.pending = list(prompt[reuse:] if n == 1 else prompt[reuse:-1])
            slot.pos = reuse
            slot.generated = 0
            slot.reused = reuse
            if n > 1 and not slot.pending:
                slot.state = FORK
            others = sorted((sl for sl in idle if sl is not slot), key=lambda sl: len(sl.hist))[: n - 1]
            for i, sl in enumerate(others, start=1):
                if self._snap_needs_kv:  # the fork overwrites its whole cache
                    self._snapshots.overwritten(sl.index, 0)
                sl.state, sl.job, sl.choice = FORKWAIT, job, i
                sl.session_id, sl.scope, sl.hist, sl.pending = None, job.req.cache_scope, [], []
                sl.generated, sl.reused = 0, 0
            if reuse:
                self.stats.prefix_hits += 1
                self.stats.reused_tokens += reuse
                if resume is not None:
                    self.stats.snapshot_resumes += 1
                    self._snapshots.touch(resume)
            else:
                self.stats.prefix_misses += 1
            if job.req.prompt_logprobs is None:  # else Started carries them, after _insert scores the prompt
                events.append((job, Started(reused_tokens=reuse)))
            out.append((slot, job))
        return out

    def _next_locked(self) -> int:
        """The queue index of the job to admit next: the oldest, unless its request already holds
        `request_slots` slots (with this job's `n`) while a job of another request waits -- then the
        oldest job of a request under that share, or of one holding none.

        Why: a legacy completion's prompts are one job each (prompts x n generations), all queued at
        once; in plain arrival order a 64-prompt, n 8 request held all 8 slots for minutes while a chat
        queued behind every one of its generations (issue 43). With the share, a request that arrives
        behind a big one takes the next slot that frees, so it waits at most for one generation already
        running to end, never for the rest of another request. A request alone still gets every slot
        (no slot idles for fairness), and a single job wider than the share runs when its request
        holds nothing else."""
        q = self._queue
        if len(q) < 2 or self.request_slots >= self.n_slots:
            return 0
        first = q[0].req.request_id
        if all(job.req.request_id == first for job in q):
            return 0
        held: dict[str, int] = {}
        for sl in self._slots:
            if sl.job is not None:
                held[sl.job.req.request_id] = held.get(sl.job.req.request_id, 0) + 1
        for k, job in enumerate(q):
            mine = held.get(job.req.request_id, 0)
            if mine == 0 or mine + job.req.n <= self.request_slots:
                return k
        return 0

    @staticmethod
    def _common_prefix(a: list[int], b: list[int]) -> int:
        n = min(len(a), len(b))
        i = 0
        while i < n and a[i] == b[i]:
            i += 1
        return i

    def _reusable(self, hist: list[int], prompt: list[int], limit: int) -> int:
        """How many leading prompt tokens this slot's cache already holds.

        Attention-only models can reuse any common prefix (K/V rows are per position). A model with
        recurrent state cannot roll it back: its state is only valid at the slot's committed
        boundary (everything in `hist`), so it reuses all of `hist` or nothing.
        """
        n = min(self._common_prefix(hist, prompt), limit)
        if self.recurrent and n != len(hist):
            return 0
        return n

    def _pick_slot(self, idle: list[Slot], req: GenRequest) -> tuple[Slot, int, Snapshot | None]:
        """Session slot first, else the longest common prefix, else the emptiest slot; with the prefix
        length it reuses and the snapshot it resumes from (None: the slot's own committed state).

        Only slots of the request's cache scope can be reused; any other slot reuses nothing. A
        recurrent model may also resume from the longest usable prefix snapshot of the request's
        scope (`_snapshot_for`): any idle slot can take it, the snapshot's own slot with no copy (it
        is preferred on a tie), another after a copy of that slot's cache.
        At least one prompt token is always prefilled (its logits give the first sampled token).
        """
        prompt = req.prefix_key
        limit = max(0, len(prompt) - 1)
        snap = self._snapshot_for(req.cache_scope, prompt, limit)

        def reuse(sl: Slot) -> tuple[int, Snapshot | None]:
            own = self._reusable(sl.hist, prompt, limit) if sl.scope == req.cache_scope else 0
            return (snap.n, snap) if snap is not None and snap.n > own else (own, None)

        if req.session_id:
            for sl in idle:
                if sl.session_id == req.session_id and sl.scope == req.cache_scope:
                    return sl, *reuse(sl)
        best, best_len, best_snap = None, -1, None
        for sl in idle:
            n, s = reuse(sl)
            better = n > best_len
            if n == best_len and best is not None:
                # a tie: no copy (the slot's own state, or the snapshot's source) beats a copy, then the emptiest
                cost = (s is not None and s.slot != sl.index and self._snap_needs_kv, len(sl.hist))
                best_cost = (best_snap is not None and best_snap.slot != best.index and self._snap_needs_kv,
                             len(best.hist))
                better = cost < best_cost
            if better:
                best, best_len, best_snap = sl, n, s
        assert best is not None
        return best, best_len, best_snap

    def _snapshot_for(self, scope: str, prompt: list[int], limit: int) -> Snapshot | None:
        """The longest prefix snapshot of `scope` that `prompt` starts with and that can be resumed now:
        its source slot still holds the prefix's K/V rows (its committed history starts with the
        prefix), unless the model has no per-token state. None: no pool, or none fits."""
        if not self._snapshots.enabled:
            return None

        def usable(e: Snapshot) -> bool:
            if not self._snap_needs_kv:
                return True
            src = self._slots[e.slot]
            return src.state not in (FORKWAIT, EMBED) and len(src.hist) >= e.n and src.hist[:e.n] == prompt[:e.n]

        return self._snapshots.best(scope, prompt, limit, usable)

    def _release_locked(self, sl: Slot, reason: str, error: Exception | None = None) -> tuple[_Job, Event]:
        """Slot back to IDLE, keeping its committed history for prefix reuse by the next request."""
        job = sl.job
        assert job is not None
        sl.state = IDLE
        sl.job = None
        sl.pending = []
        if reason == "cancelled":
            self.stats.cancelled += 1
        elif reason == "error":
            self.stats.failed += 1
        else:
            self.stats.completed += 1
        self._work.notify_all()
        sl.matcher = None
        return job, Finished(reason, error=error, prompt_tokens=len(job.req.prompt_ids),
                             completion_tokens=sl.generated, reused_tokens=sl.reused, choice=sl.choice)

    @staticmethod
    def _deliver(events: list[tuple[_Job, Event]]) -> None:
        for job, ev in events:
            try:
                job.sink(ev)
            except Exception:  # a sink only hands over; a broken one must not stop the driver
                pass
        events.clear()

    # ---- device work (driver thread, no lock held) ------------------------------------------------
    def _insert(self, sl: Slot, job: _Job) -> None:
        req = job.req
        snap, sl.resume = sl.resume, None
        if snap is not None:  # resume from a prefix snapshot: the source's K/V rows first, then the state
            if self._snap_needs_kv and snap.slot != sl.index:
                self._state = self.model.copy_slot(self._state, snap.slot, sl.index)
            self._state = self.model.restore(self._state, sl.index, snap.state)
        if req.prompt_logprobs is not None:  # legacy echo + logprobs: score the prompt first
            lps, self._state = self.model.prompt_logprobs(self._state, req.prompt_ids, req.prompt_logprobs)
            entries = tuple(None if e is None else TokenLogprob(t, e[0], tuple(e[1]))
                            for t, e in zip(req.prompt_ids, lps))
            self._deliver([(job, Started(reused_tokens=sl.reused, prompt_logprobs=entries))])
        self._state = self.model.insert(self._state, self._slot_insert(sl, req, sl.reused))
        sl.matcher = self._matcher(req)
        self._start_drafts(sl, req)
        if req.images and job.embd is None:  # images whose rows are still to prefill need their embeddings
            todo = [im for im in req.images if im.embd is None and im.offset + im.n_tokens > sl.reused]
            got = dict(zip((id(im) for im in todo), self.model.encode_images([im.pixels for im in todo])))
            job.embd = [im.embd if im.embd is not None else got.get(id(im)) for im in req.images]

    def _start_drafts(self, sl: Slot, req: GenRequest) -> None:
        """A new request's prompt lookup over its prompt (None where this model does not speculate)."""
        if self.spec_k and not req.images:
            sl.lookup, sl.budget = PromptLookup(req.prompt_ids), DraftBudget(self.spec_k)
            sl.model_budget = DraftBudget(self.spec_k) if self._drafter is not None else None
        else:
            sl.lookup, sl.budget, sl.model_budget = None, None, None

    def encode_images(self, pixels: list[Any]) -> Any:
        """Embeddings [N, tokens, H] (host) of preprocessed images, for a request to carry into `submit`.

        Any thread may call it (it reads only the params): the web layer encodes a request's images in
        its own OS thread, so the driver's steps for the other streams do not wait behind an encoder
        (a real SigLIP image costs seconds on a CPU)."""
        if getattr(self.model, "vision", None) is None:
            raise RequestError(f"model {self.model.name!r} does not take images", code="model_not_multimodal")
        return self.model.encode_images(pixels)

    def _chunk_part(self, sl: Slot) -> tuple[int, ...]:
        """The next prompt chunk of `sl`: at most `chunk` tokens, but never ending inside an image (whose
        tokens may attend to each other both ways, so they must share a forward): the chunk stops
        before an image it cannot hold whole, or is stretched over one it starts with, up to the
        model's chunk (which the engine sized to hold an image)."""
        pend = sl.pending
        n = min(self.chunk, len(pend))
        if n < len(pend) and pend[n - 1] < 0 and pend[n] == pend[n - 1]:  # would split an image's run
            a = n - 1
            while a > 0 and pend[a - 1] == pend[n - 1]:
                a -= 1
            if a > 0:
                n = a
            else:
                b = n
                while b < len(pend) and pend[b] == pend[n - 1]:
                    b += 1
                n = min(b, self.model.chunk)
        return tuple(pend[:n])

    def _chunk_embd(self, job: _Job, start: int, part: tuple[int, ...]) -> Any:
        """The image rows of a chunk at prompt positions start.. ([len(part), H]), or None (no image)."""
        if not job.req.images or not any(t < 0 for t in part):
            return None
        rows = np.zeros((len(part), self.model.config.hidden), np.float32)
        for im, e in zip(job.req.images, job.embd):
            lo, hi = max(im.offset, start), min(im.offset + im.n_tokens, start + len(part))
            if lo < hi:
                rows[lo - start:hi - start] = e[lo - im.offset:hi - im.offset]
        return rows

    def _slot_insert(self, sl: Slot, req: GenRequest, reused: int, last: int | None = None) -> Any:
        return decode_state.slot_insert(
            sl.index, req.prompt_ids, reused, req.choice_params(sl.choice), req.max_tokens, req.stop_ids,
            logit_bias=req.logit_bias, logprobs=req.logprobs is not None, last=last)

    def _matcher(self, req: GenRequest) -> Any:
        """A fresh grammar matcher for one choice of `req`, or None (no constraint)."""
        if req.constraint is None:
            return None
        return req.constraint.matcher(req.stop_ids, int(self.model.config.vocab))

    def _fork_ready(self) -> None:
        """n > 1: every job whose prompt (but its last token) is in its first slot and no longer in
        flight forks now: the other choices' slots get a copy of that cache, and every choice starts
        decoding from the prompt's last token with its own seed."""
        busy = {id(r.slot) for r in self._inflight.rows} if self._inflight is not None else set()
        for sl in self._slots:
            if sl.state != FORK or id(sl) in busy:
                continue
            job = sl.job
            assert job is not None
            req = job.req
            prompt = req.prompt_ids
            with self._mu:
                group = sorted((s for s in self._slots if s.job is job), key=lambda s: s.choice)
            for s in group:
                if s is not sl:
                    self._state = self.model.copy_slot(self._state, sl.index, s.index)
            for s in group:
                self._state = self.model.insert(self._state, self._slot_insert(s, req, len(prompt) - 1, prompt[-1]))
                s.hist, s.pos, s.last_token, s.pending = list(req.prefix_key[:-1]), len(prompt) - 1, prompt[-1], []
                s.matcher = self._matcher(req)
                self._start_drafts(s, req)
            with self._mu:
                for s in group:
                    if s.job is job and s.state in (FORK, FORKWAIT):
                        s.state = DECODE

    def _dispatch(self, t0: float) -> _Planned | None:
        """Plan the next step from the host's view of the slots (what `_step` dispatches)."""
        with self._mu:
            prefillers = [sl for sl in self._slots if sl.state == PREFILL and sl.pending]
            decoders = [sl for sl in self._slots if sl.state == DECODE]
            jobs = {id(sl): sl.job for sl in prefillers + decoders}
        pre = min(prefillers, key=lambda s: s.job.enqueued_at if s.job else 0.0) if prefillers else None
        if pre is not None and decoders and self.mixed:  # the chunk and every decode row in one forward
            kind = "mixed"
        elif pre is not None and (self._turn_prefill or not decoders):  # alternate: a chunk, then a decode
            kind, decoders = "prefill", []
            self._turn_prefill = False
        elif decoders:
            kind, pre = "decode", None
            self._turn_prefill = True
        else:
            return None
        if kind == "decode":
            verify = self._verify_plan(decoders, jobs)
            if verify is not None:
                return verify
        rows: list[_Row] = []
        chunk = None
        if pre is not None:
            job = jobs[id(pre)]
            part = self._chunk_part(pre)
            last = len(part) == len(pre.pending)
            final = last and job.req.n == 1  # an n > 1 prompt's last chunk samples nothing: the choices fork
            chunk = Chunk(pre.index, part, pre.pos, final, embd=self._chunk_embd(job, pre.pos, part))
            rows.append(_Row(pre, job, part, final, ends_prompt=last and not final))
            pre.pending = pre.pending[len(part):]
            pre.pos += len(part)
            if last:
                with self._mu:
                    if pre.state == PREFILL:  # its first token is on the device: the next step decodes it
                        pre.state = DECODE if final else FORK
        reach = max((sl.pos + 1 for sl in decoders), default=0)
        for sl in decoders:
            rows.append(_Row(sl, jobs[id(sl)]))
            sl.pos += 1
        plan = StepPlan(chunk=chunk, decode=tuple(sl.index for sl in decoders), reach=reach)
        return _Planned(plan, rows, kind)

    def _step(self, t0: float) -> _InFlight | None:
        """Plan the next step and dispatch it in its three explicit phases (each returns at once):

        1. the forward (`Model.forward`);
        2. while it runs, the grammar masks of its constrained rows, if any (`_masks`: which first reads
           the step still in flight, whose tokens advance the matchers);
        3. the sampler over the forward's logits with those masks (`Model.sample`).

        A step without a constrained row goes straight from 1 to 3 and keeps the step before it in
        flight (read after this one is dispatched: one step of overlap)."""
        if self._may_draft():  # a draft must follow the slot's latest token: read the step in flight first
            self._collect_inflight()
        planned = self._dispatch(t0)
        if planned is None:
            return None
        rows = planned.rows
        fwd, self._state = self.model.forward(self._state, planned.plan)
        chunk = planned.plan.chunk
        if chunk is not None and self._snapshots.enabled:  # the slot's state where this chunk ends
            self._take_snapshot(rows[0], chunk.start + len(chunk.tokens))
        masks = None
        if any(r.slot.matcher is not None and r.emits for r in rows):
            self._collect_inflight()
            masks = self._masks(rows)
        handle, self._state = self.model.sample(self._state, fwd, masks)
        now = time.perf_counter()
        n_prompt = len(planned.plan.chunk.tokens) if planned.plan.chunk is not None else 0
        return _InFlight(handle, rows, planned.kind, n_prompt, now, (now - t0) * 1000)

    def _speculates(self, sl: Slot) -> bool:
        """Whether slot `sl` may draft now: speculation on for its request, no grammar (its mask
        could not follow drafts), and not resting after a run of misses."""
        job = sl.job
        if job is None or sl.lookup is None or sl.matcher is not None or sl.budget is None:
            return False
        if sl.budget.resting and (sl.model_budget is None or sl.model_budget.resting):
            return False
        return job.req.speculative if job.req.speculative is not None else self.speculative

    def _may_draft(self) -> bool:
        """Whether the next step could be a verify step: only decoding slots, few enough of them, and
        one of them drafting."""
        if not self.spec_k:
            return False
        with self._mu:
            if any(sl.state == PREFILL and sl.pending for sl in self._slots):
                return False
            decoders = [sl for sl in self._slots if sl.state == DECODE]
        return (0 < len(decoders) <= self.spec_slots and any(self._speculates(sl) for sl in decoders)
                and self._gauge.pays(len(decoders)))

    def _verify_plan(self, decoders: list[Slot], jobs: dict[int, Any]) -> _Planned | None:
        """A verify step over `decoders` if one of them has drafts now (its prompt lookup matches) and the
        model has a program for it; else None (a plain decode step). Called with nothing in flight for
        these slots, so each slot's host position and last token are the device's."""
        if not self.spec_k:
            return None
        speculating = [self._speculates(sl) for sl in decoders]
        for sl in decoders:  # a resting source sits out this step
            for b in (sl.budget, sl.model_budget):
                if b is not None and b.resting:
                    b.rested()
        if not any(speculating) or len(decoders) > self.spec_slots:
            return None
        if any(sl.matcher is not None for sl in decoders):
            return None  # a constrained slot's row needs its mask, which a verify step does not take
        if not self._gauge.pays(len(decoders)):
            return None
        if self._inflight is not None and any(r.slot in decoders for r in self._inflight.rows):
            return None  # (the step before was kept in flight: its tokens are not known yet)
        drafts: list[tuple[int, ...]] = []
        sources: list[str] = []
        asks: list[tuple[int, int]] = []  # (index in decoders, k) for the draft model
        for i, (sl, on) in enumerate(zip(decoders, speculating)):
            d: tuple[int, ...] = ()
            if on:  # prompt lookup first (free); where it has nothing, the draft model
                req = jobs[id(sl)].req
                room = min(req.max_tokens - sl.generated - 1, self.model.max_seq - sl.pos - 2)
                if not sl.budget.resting:
                    d = sl.lookup.propose(min(sl.budget.k, room))
                model_on = sl.model_budget is not None and not sl.model_budget.resting
                if not d and model_on and room > 0:
                    asks.append((i, min(sl.model_budget.k, room)))
                elif not d and not sl.budget.resting:
                    sl.budget.missed()
            drafts.append(d)
            sources.append("lookup")
        if asks:  # (its steps are spent only on a verify step that can run now)
            most = max([k for _, k in asks] + [len(d) for d in drafts])
            if not self.model.verify_fits(len(decoders), most, max(sl.pos for sl in decoders) + 1 + most):
                asks = []
        if asks:
            assert self._drafter is not None
            got = self._drafter.propose([(decoders[i].index, decoders[i].lookup.seq, k) for i, k in asks])
            for (i, _), d in zip(asks, got):
                drafts[i], sources[i] = d, "model"
                if not d:
                    decoders[i].model_budget.missed()
        k = max(len(d) for d in drafts)
        reach = max(sl.pos + 1 + len(d) for sl, d in zip(decoders, drafts))
        if not k or not self.model.verify_fits(len(decoders), k, reach):
            return None
        rows = []
        for sl, d, src in zip(decoders, drafts, sources):
            rows.append(_Row(sl, jobs[id(sl)], draft=d, drafted_by=src if d else ""))
            sl.pos += 1 + len(d)  # an upper bound until read: the tokens it accepted set it back
        plan = StepPlan(decode=tuple(sl.index for sl in decoders), drafts=tuple(drafts), reach=reach)
        return _Planned(plan, rows, "verify")
    def _take_snapshot(self, row: _Row, end: int) -> None:
        """Keep a copy of the prefilling slot's recurrent state after its prompt's first `end` tokens (the
        chunk just dispatched). It becomes usable once the slot's history holds that prefix, i.e. once
        the step is read: a step that fails, or a job cancelled meanwhile, never commits it."""
        before = self._snapshots.evicted
        self._snapshots.add(row.job.req.cache_scope, row.job.req.prefix_key[:end], row.slot.index,
                            self.model.snapshot(self._state, row.slot.index))
        with self._mu:
            self.stats.snapshots_taken += 1
            self.stats.snapshots_evicted += self._snapshots.evicted - before

    def _masks(self, rows: list[_Row]) -> np.ndarray:
        """The grammar masks of a step's rows, built while its forward runs (the caller has read the
        step before it: its tokens advance the matchers): each constrained row's allowed tokens (all
        ones for the others).

        The rows are built by the mask workers (`pantheon.scheduler.masks`), and the driver waits for
        them at most PANTHEON_GRAMMAR_MASK_MS: a row that is late (or whose `fill_mask` raised) fails
        its request alone -- its matcher is dropped at once (a worker may still be inside it), its row
        stays all ones (the token it samples is never handed out) and the job leaves as "error" at the
        next turn of the loop -- while every other row of the step keeps its mask."""
        words = np.full((len(rows), self.model.mask_words), -1, np.int32)
        todo = [(i, r) for i, r in enumerate(rows)  # (job.error is written by this thread only)
                if r.emits and r.slot.matcher is not None and r.slot.job is r.job and r.job.error is None]
        if not todo:
            return words
        built = self._mask_builder.build([r.slot.matcher for _, r in todo], self.model.mask_words)
        failed: list[tuple[_Job, Exception]] = []
        for (i, r), row in zip(todo, built):
            if isinstance(row, np.ndarray):
                words[i] = row  # (a finished or failed matcher allows only the stop ids)
                continue
            r.slot.matcher = None  # late: a worker may still be inside it; never touched again
            failed.append((r.job, self._mask_error(r.job, row)))
        if failed:
            with self._mu:
                for job, err in failed:
                    self._fail_job_locked(job, err)
        return words

    def _mask_error(self, job: _Job, raised: BaseException | None) -> Exception:
        """The error a request fails with when its mask row was late (`raised` None) or raised."""
        param = getattr(job.req.constraint, "param", None)
        if raised is None:
            ms = self._mask_builder.bound_s * 1000
            return RequestError(f"structured outputs: computing the tokens the grammar allows next took longer "
                                f"than {ms:g} ms (PANTHEON_GRAMMAR_MASK_MS); the grammar is too complex to follow",
                                param=param, code="grammar_too_complex")
        if isinstance(raised, Exception):
            return raised
        return RuntimeError(f"grammar mask failed: {type(raised).__name__}: {raised}")

    def _logprobs(self, done: _InFlight) -> tuple[np.ndarray, np.ndarray] | None:
        if not any(r.job.req.logprobs is not None and r.emits for r in done.rows):
            return None
        return self.model.read_logprobs(done.handle)

    def _collect(self, done: _InFlight) -> None:
        """Read a step's ids (waits for the device if it is not done) and hand them to their owners."""
        try:
            packed = self.model.read(done.handle)
            lps = self._logprobs(done)
        except Exception as exc:  # a failed step fails its requests, not the server
            self._step_failed(exc)
            return
        t_read = time.perf_counter()
        events: list[tuple[_Job, Event]] = []
        flat = packed.tolist()
        group = len(flat) // max(1, len(done.rows)) if done.kind == "verify" else 1  # a verify row's K + 1 outputs
        with self._mu:
            for at, r in enumerate(done.rows):
                sl = r.slot
                if sl.job is not r.job or sl.state == IDLE or r.job.error is not None:
                    continue  # finished, cancelled or failed since: a dead row
                if r.part:
                    sl.hist.extend(r.part)
                    if not r.final:
                        continue
                outputs = [(i, *flat[i]) for i in range(at * group, (at + 1) * group)]
                if done.kind == "verify":
                    outputs = [o for o in outputs if o[2] != decode_state.IDLE]  # (the emitted ones lead)
                    accepted = max(0, len(outputs) - 1)
                    sl.pos -= len(r.draft) - accepted  # the step's upper bound, set back to what it kept
                    if r.drafted_by == "model":
                        self.stats.spec_model_drafted += len(r.draft)
                        self.stats.spec_model_accepted += accepted
                        sl.model_budget.verified(len(r.draft), accepted)
                    elif r.draft:
                        self.stats.spec_drafted += len(r.draft)
                        self.stats.spec_accepted += accepted
                        sl.budget.verified(len(r.draft), accepted)
                for i, tok, flag in outputs:
                    if not r.part:
                        sl.hist.append(sl.last_token)
                    if self._emit_locked(r, sl, i, tok, flag, lps, events):
                        break
            st = self.stats
            st.steps += 1
            n_dec = sum(1 for r in done.rows if not r.part)
            if done.kind == "verify":
                st.spec_steps += 1
                n_dec = sum(1 for tok_flag in flat if tok_flag[1] != decode_state.IDLE)
            if done.n_prompt:
                st.prefill_chunks += 1
                st.prefill_tokens += done.n_prompt
            if n_dec:
                st.decode_steps += 1
                st.decode_tokens += n_dec
            if done.n_prompt and n_dec:
                st.mixed_steps += 1
            st.step_ms_total += (t_read - done.t_dispatch) * 1000
        if self._last_read is not None and not done.n_prompt:  # the time this step added, driver busy throughout
            if done.kind == "verify":
                self._gauge.verify(len(done.rows), t_read - self._last_read, n_dec)
            elif done.kind == "decode":
                self._gauge.plain(len(done.rows), t_read - self._last_read)
        self._last_read = t_read
        self._gauge.tick()
        self._deliver(events)
        host_ms = done.host_ms + (time.perf_counter() - t_read) * 1000
        with self._mu:
            self.stats.host_ms_total += host_ms
        if self.log_stats:
            print(f"[bs] {done.kind} width={len(done.rows)} tokens={done.n_prompt + n_dec} "
                  f"ms={(t_read - done.t_dispatch) * 1000:.1f} host_ms={host_ms:.2f} "
                  f"at={done.t_dispatch - self._t_origin:.4f}", file=sys.stderr, flush=True)

    def _emit_locked(self, r: _Row, sl: Slot, i: int, tok: int, flag: int, lps: Any,
                     events: list[tuple[_Job, Event]]) -> bool:
        """Hand out token `tok` of output row `i` (flag `flag`) of slot `sl`; True when the slot stops
        emitting (its request finished or failed). Under _mu."""
        if flag == decode_state.IDLE:
            return False
        sl.generated += 1
        sl.last_token = tok
        k = r.job.req.logprobs
        entry = None
        if k is not None and lps is not None:
            lp, top = lps
            entry = (TokenLogprob(tok, float(lp[i, 0]),
                                  tuple((int(top[i, j]), float(lp[i, 1 + j])) for j in range(k))),)
        if sl.matcher is not None and not sl.matcher.consume(tok):
            # the token was under the mask, so the grammar stopped on an error of its own (one of
            # llguidance's limits): the request fails with that error rather than ending silently
            why = getattr(sl.matcher, "error", None) or f"token {tok} was not accepted"
            self._fail_job_locked(r.job, RequestError(
                f"structured outputs could not follow the grammar: {why}",
                param=getattr(r.job.req.constraint, "param", None), code="grammar_too_complex"))
            return True
        if sl.lookup is not None:
            sl.lookup.append(tok)
        events.append((r.job, Tokens((tok,), choice=sl.choice, logprobs=entry, stop=flag == decode_state.STOP)))
        if flag in decode_state.FINISH_REASONS:
            events.append(self._release_locked(sl, decode_state.FINISH_REASONS[flag]))
            return True
        return False

    def _step_failed(self, exc: Exception) -> None:
        """A step raised: its requests (every active one) fail, and the state is rebuilt from zeros --
        so every slot's prefix history goes too, since the cache it described is gone."""
        events: list[tuple[_Job, Event]] = []
        with self._mu:
            self._embeds.fail_locked(events, exc)
            for sl in self._slots:
                if sl.state != IDLE:
                    events.append(self._release_locked(sl, "error", exc))
                sl.hist, sl.scope, sl.session_id, sl.pending, sl.resume = [], "", None, [], None
        self._snapshots.clear()
        self._deliver(events)
        self._inflight = None
        self._state = self.model.new_state()  # raising here ends the driver loudly (_die)

    def _die(self, exc: BaseException) -> None:
        """The driver is ending on an unexpected error: fail every request, refuse new ones, say why."""
        message = f"{type(exc).__name__}: {exc}"
        print(f"[bs] driver of {self.model.name} failed: {message}", file=sys.stderr, flush=True)
        err = ModelFailed(f"model {self.model.name!r} failed: {message}", status=500)
        self._mask_builder.close()
        events: list[tuple[_Job, Event]] = []
        with self._mu:
            self.failure = message
            self._embeds.fail_locked(events, err)
            for sl in self._slots:
                if sl.state != IDLE and sl.job is not None:
                    events.append(self._release_locked(sl, "error", err))
                sl.hist, sl.scope = [], ""
            while self._queue:
                events.append((self._queue.popleft(), Finished("error", error=err)))
        self._snapshots.clear()
        self._deliver(events)

    def _shutdown(self) -> None:
        self._mask_builder.close()
        self._snapshots.clear()  # their device buffers go now, not with the scheduler
        events: list[tuple[_Job, Event]] = []
        err = BusyError("server is shutting down", status=503)
        with self._mu:
            self._embeds.fail_locked(events, err)
            for sl in self._slots:
                if sl.state != IDLE and sl.job is not None:
                    events.append(self._release_locked(sl, "error", err))
            while self._queue:
                events.append((self._queue.popleft(), Finished("error", error=err)))
        self._deliver(events)
