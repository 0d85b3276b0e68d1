"""Continuous batching: N slots of one model share each jitted forward, driven by one OS thread.

Lifecycle of a request:

1. `submit` (request greenlet, never blocks) appends it to the FIFO admission queue, or refuses it:
   queue full -> 429 Retry-After 5 (503 under CRITICAL memory pressure); shutting down -> 503.
2. The driver thread admits queued requests into IDLE slots, preferring the slot that holds the
   request's session, else the idle slot whose committed history shares the longest prefix with the
   prompt (its KV is reused: only the new suffix is prefilled). Reuse never crosses a cache scope
   (`GenRequest.cache_scope`): a slot last used by another tenant counts as empty. A request waiting longer than
   `queue_wait_s` is refused with 429 Retry-After 2. A cancelled queued request leaves at once.
3. Slot states: IDLE -> PREFILL (its prompt is fed in chunks of `prefill_chunk`) -> DECODE (one token
   per step, batched with every other DECODE slot) -> IDLE. While both kinds of work exist, each
   step carries the oldest prefiller's next chunk *and* every decoder's token in one mixed forward
   (models with `forward_groups`; PANTHEON_BS_MIXED=0 turns it off), so a new prompt costs the
   decoders almost nothing. Otherwise the driver alternates a prefill chunk and a decode step (FIFO
   among prefillers): a long prompt stalls decoders by at most one chunk and a waiting prefiller is
   never starved.
4. Each step samples inside the jitted function with every row's own parameters; only ids come back.
   The driver hands ids to the owner through `sink` (a non-blocking hand-off), so a slow client never
   slows the batch. EOS, budget or cancel finishes the request and frees the slot within one step.

Only the driver thread touches the device state; `_mu` guards everything shared with other threads.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from .. import compile_guard, osthread
from ..config import Settings
from ..engine import PENALTY_WINDOW, Model
from ..errors import BusyError
from ..jax_models.registry import capabilities_of
from ..sampler import sample_host
from .api import Finished, GenRequest, Sink, Started, Tokens

IDLE, PREFILL, DECODE = "IDLE", "PREFILL", "DECODE"
PRESSURE_CRITICAL = 3


class _Handle:
    """What `submit` returns: cancel() is safe from any thread or greenlet at any time."""

    def __init__(self, sched: "BatchScheduler", job: "_Job"):
        self._sched = sched
        self._job = job

    def cancel(self) -> None:
        self._job.cancelled = True
        self._sched._wake()


@dataclass
class _Job:
    req: GenRequest
    sink: Sink
    enqueued_at: float
    cancelled: bool = False


@dataclass
class _Slot:
    index: int
    state: str = IDLE
    job: _Job | None = None
    hist: list[int] = field(default_factory=list)  # tokens whose K/V sit in this slot's cache rows
    session_id: str | None = None
    scope: str = ""  # cache_scope of the request whose tokens `hist` holds
    pending: list[int] = field(default_factory=list)  # prompt tokens still to prefill
    generated: int = 0
    reused: int = 0
    next_token: int = -1  # sampled but not yet fed back


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
    rejected_full: int = 0
    rejected_timeout: int = 0
    completed: int = 0
    cancelled: int = 0
    step_ms_total: float = 0.0


class BatchScheduler:
    """One per loaded model when batching is on (the default)."""

    def __init__(self, model: Model, settings: Settings, pressure: Callable[[], int] | None = None,
                 warmup: bool | None = None):
        self.model = model
        self.n_slots = min(model.n_slots, settings.batch_slots) if settings.batch_slots > 0 else model.n_slots
        self.chunk = min(settings.prefill_chunk, model.chunk)
        self.queue_depth = settings.queue_depth
        self.queue_wait_s = settings.queue_wait_s
        self.driver_sample = settings.driver_sample
        self.mixed = settings.bs_mixed and model.supports_mixed
        self.log_stats = settings.bs_stats
        self._t_origin = time.perf_counter()  # stats lines give each step's start from here: gaps show idle
        self.forbid_compile = settings.forbid_compile
        self.recurrent = capabilities_of(model.arch).recurrent_state  # state that cannot be rolled back
        self.pressure = pressure or (lambda: 0)
        # _mu guards _slots' state/job fields, _queue, _closed and stats; held only for bookkeeping,
        # never across a device step. _work (on _mu) wakes the driver: new job, cancel or close.
        self._mu = osthread.Lock()
        self._work = osthread.Condition(self._mu)
        self._slots = [_Slot(i) for i in range(self.n_slots)]
        self._queue: deque[_Job] = deque()
        self._closed = False
        self.stats = SchedulerStats()
        self._turn_prefill = True  # driver-only: whose turn it is when both kinds of work exist
        self._state = model.new_state()  # driver-only after start: the donated device state
        if settings.warmup if warmup is None else warmup:
            self._state = model.warmup(self._state, mixed=self.mixed)
        self._thread = osthread.start_thread(self._drive, name=f"driver-{model.name}")

    # ---- called from request greenlets --------------------------------------------------------
    def submit(self, req: GenRequest, sink: Sink) -> _Handle:
        job = _Job(req=req, sink=sink, enqueued_at=time.monotonic())
        with self._mu:
            if self._closed:
                raise BusyError("server is shutting down", status=503)
            if len(self._queue) >= self.queue_depth + self._free_slots_locked():
                self.stats.rejected_full += 1
                if self.pressure() >= PRESSURE_CRITICAL:
                    raise BusyError("memory pressure is critical; try again later", status=503)
                raise BusyError("all slots are busy and the queue is full", status=429, retry_after=5)
            self._queue.append(job)
            self._work.notify_all()
        return _Handle(self, job)

    def load_info(self) -> dict:
        with self._mu:
            s = dataclasses.asdict(self.stats)
            s.update(mode="batch", slots=self.n_slots, queued=len(self._queue),
                     running=sum(1 for sl in self._slots if sl.state != IDLE),
                     native_kernels=int(bool(getattr(self.model, "native_matmul", False))))
            return s

    def close(self, timeout: float = 10.0) -> None:
        with self._mu:
            self._closed = True
            self._work.notify_all()
        self._thread.join(timeout)

    def _wake(self) -> None:
        with self._mu:
            self._work.notify_all()

    def _free_slots_locked(self) -> int:
        return sum(1 for sl in self._slots if sl.state == IDLE)

    # ---- the driver thread ---------------------------------------------------------------------
    def _drive(self) -> None:
        if self.forbid_compile:  # every bucket was compiled by warm-up; a new compile is a bug
            compile_guard.forbid_current_thread()
        try:
            self._drive_loop()
        finally:  # thread idents are reused: a later thread must not inherit this one's guard
            compile_guard.forbid_current_thread(False)

    def _drive_loop(self) -> None:
        while True:
            with self._mu:
                if self._closed:
                    break
                self._reap_queue_locked()
                self._admit_locked()
                active = [sl for sl in self._slots if sl.state != IDLE]
                if not active:
                    self._work.wait(0.5 if self._queue else None)
                    continue
            try:
                self._one_step()
            except Exception as exc:  # a failed step fails its requests, not the server
                self._fail_active(exc)
        self._shutdown()

    def _reap_queue_locked(self) -> None:
        now = time.monotonic()
        keep: deque[_Job] = deque()
        for job in self._queue:
            if job.cancelled:
                self._finish_job(job, Finished("cancelled", prompt_tokens=len(job.req.prompt_ids)))
            elif now - job.enqueued_at > self.queue_wait_s:
                self.stats.rejected_timeout += 1
                self._finish_job(job, Finished("error", error=BusyError(
                    "timed out waiting for a free slot", status=429, retry_after=2)))
            else:
                keep.append(job)
        self._queue = keep

    def _admit_locked(self) -> None:
        while self._queue and self.pressure() < PRESSURE_CRITICAL:
            idle = [sl for sl in self._slots if sl.state == IDLE]
            if not idle:
                return
            job = self._queue.popleft()
            slot, reuse = self._pick_slot(idle, job.req)
            prompt = job.req.prompt_ids
            slot.state = PREFILL
            slot.job = job
            slot.session_id = job.req.session_id
            slot.scope = job.req.cache_scope
            slot.hist = slot.hist[:reuse]
            slot.pending = list(prompt[reuse:])
            slot.generated = 0
            slot.reused = reuse
            if reuse:
                self.stats.prefix_hits += 1
                self.stats.reused_tokens += reuse
            else:
                self.stats.prefix_misses += 1
            job.sink(Started(reused_tokens=reuse))

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

    def _pick_slot(self, idle: list[_Slot], req: GenRequest) -> tuple[_Slot, int]:
        """Session slot first, else the longest common prefix, else the emptiest slot.

        Only slots of the request's cache scope can be reused; any other slot reuses nothing.
        At least one prompt token is always prefilled (its logits give the first sampled token).
        """
        prompt = req.prompt_ids
        limit = max(0, len(prompt) - 1)

        def reuse(sl: _Slot) -> int:
            return self._reusable(sl.hist, prompt, limit) if sl.scope == req.cache_scope else 0

        if req.session_id:
            for sl in idle:
                if sl.session_id == req.session_id and sl.scope == req.cache_scope:
                    return sl, reuse(sl)
        best, best_len = None, -1
        for sl in idle:
            n = reuse(sl)
            if n > best_len or (n == best_len and best is not None and len(sl.hist) < len(best.hist)):
                best, best_len = sl, n
        assert best is not None
        return best, best_len

    def _one_step(self) -> None:
        with self._mu:
            prefillers = [sl for sl in self._slots if sl.state == PREFILL]
            decoders = [sl for sl in self._slots if sl.state == DECODE]
            for sl in prefillers + decoders:
                if sl.job is not None and sl.job.cancelled:
                    self._release_locked(sl, Finished("cancelled", prompt_tokens=len(sl.job.req.prompt_ids),
                                                      completion_tokens=sl.generated, reused_tokens=sl.reused))
            prefillers = [sl for sl in prefillers if sl.state == PREFILL]
            decoders = [sl for sl in decoders if sl.state == DECODE]
        pre = min(prefillers, key=lambda s: s.job.enqueued_at if s.job else 0.0) if prefillers else None
        t0 = time.perf_counter()
        if pre is not None and decoders and self.mixed:  # the chunk and every decode row in one forward
            n = self._step(pre, decoders)
            kind, width, ntok = "mixed", 1 + len(decoders), n + len(decoders)
        elif pre is not None and (self._turn_prefill or not decoders):  # alternate: a chunk, then a decode
            n = self._step(pre, [])
            kind, width, ntok = "prefill", 1, n
            self._turn_prefill = False
        elif decoders:
            self._step(None, decoders)
            kind, width, ntok = "decode", len(decoders), len(decoders)
            self._turn_prefill = True
        else:
            return
        ms = (time.perf_counter() - t0) * 1000
        with self._mu:
            self.stats.steps += 1
            self.stats.step_ms_total += ms
        if self.log_stats:
            print(f"[bs] {kind} width={width} tokens={ntok} ms={ms:.1f} at={t0 - self._t_origin:.4f}",
                  file=sys.stderr, flush=True)

    def _recent(self, sl: _Slot) -> list[int]:
        return sl.hist[-PENALTY_WINDOW:]

    def _step(self, pre: _Slot | None, decoders: list[_Slot]) -> int:
        """One device step: the next prompt chunk of `pre` (if any), then one token of every decoder.

        Returns how many prompt tokens it prefilled. Rows go to the engine in that order; the engine
        packs a chunk and decode rows into one mixed forward when the model has one.
        """
        tokens, slots, starts, params, recent, steps = [], [], [], [], [], []
        part: list[int] = []
        final = False
        if pre is not None:
            assert pre.job is not None
            part = pre.pending[: self.chunk]
            final = len(part) == len(pre.pending)
            tokens.append(part)
            slots.append(pre.index)
            starts.append(len(pre.hist))
            params.append(pre.job.req.params)
            recent.append((self._recent(pre) + part)[-PENALTY_WINDOW:])  # the window, not the whole history
            steps.append(0)
        for sl in decoders:
            tokens.append([sl.next_token])
            slots.append(sl.index)
            starts.append(len(sl.hist))
            params.append(sl.job.req.params if sl.job else None)
            recent.append((self._recent(sl) + [sl.next_token])[-PENALTY_WINDOW:])
            steps.append(sl.generated)
        want = not self.driver_sample and (bool(decoders) or final)
        handle, self._state = self.model.step_begin(self._state, tokens, slots, starts, params, recent, steps,
                                                    want_logits=want)
        ids = self.model.step_wait(handle)
        with self._mu:
            if pre is not None:
                self.stats.prefill_chunks += 1
                self.stats.prefill_tokens += len(part)
            if decoders:
                self.stats.decode_steps += 1
                self.stats.decode_tokens += len(decoders)
            if pre is not None and decoders:
                self.stats.mixed_steps += 1
        row = 0
        if pre is not None:
            pre.hist.extend(part)
            pre.pending = pre.pending[len(part):]
            if final:
                tok = int(ids[0]) if self.driver_sample else self._owner_sample(handle, 0, pre)
                with self._mu:
                    pre.state = DECODE
                self._emit(pre, tok)
            row = 1
        for sl in decoders:
            sl.hist.append(sl.next_token)
            tok = int(ids[row]) if self.driver_sample else self._owner_sample(handle, row, sl)
            self._emit(sl, tok)
            row += 1
        return len(part)

    def _owner_sample(self, handle: Any, row: int, sl: _Slot) -> int:
        """QWEN35_BS_DRIVER_SAMPLE=0: logits come back and the same sampler runs on the host."""
        logits = np.asarray(handle.logits)[row]
        return sample_host(logits, sl.job.req.params, self._recent(sl), sl.generated)

    def _emit(self, sl: _Slot, tok: int) -> None:
        """Hand one sampled token to its owner; finish the request on EOS or budget."""
        job = sl.job
        assert job is not None
        sl.generated += 1
        sl.next_token = tok
        job.sink(Tokens((tok,)))
        reason = None
        if tok in job.req.stop_ids:
            reason = "stop"
        elif sl.generated >= job.req.max_tokens or len(sl.hist) + 1 >= self.model.max_seq:
            reason = "length"
        if reason:
            with self._mu:
                self._release_locked(sl, Finished(reason, prompt_tokens=len(job.req.prompt_ids),
                                                  completion_tokens=sl.generated, reused_tokens=sl.reused))

    def _release_locked(self, sl: _Slot, fin: Finished) -> None:
        """Slot back to IDLE, keeping its committed history for prefix reuse by the next request."""
        job = sl.job
        sl.state = IDLE
        sl.job = None
        sl.pending = []
        if fin.reason == "cancelled":
            self.stats.cancelled += 1
        else:
            self.stats.completed += 1
        if job is not None:
            self._finish_job(job, fin)
        self._work.notify_all()

    @staticmethod
    def _finish_job(job: _Job, fin: Finished) -> None:
        try:
            job.sink(fin)
        except Exception:
            pass

    def _fail_active(self, exc: Exception) -> None:
        with self._mu:
            for sl in self._slots:
                if sl.state != IDLE:
                    sl.hist = []  # the device state may be gone; never reuse it
                    self._release_locked(sl, Finished("error", error=exc))
        try:  # the old state may have been donated to the failed call: start from a fresh one
            self._state = self.model.new_state()
        except Exception as exc2:
            print(f"[bs] cannot rebuild state after a failed step: {exc2}", file=sys.stderr, flush=True)

    def _shutdown(self) -> None:
        with self._mu:
            for sl in self._slots:
                if sl.state != IDLE and sl.job is not None:
                    self._release_locked(sl, Finished("error", error=BusyError("server is shutting down", status=503)))
            while self._queue:
                self._finish_job(self._queue.popleft(),
                                 Finished("error", error=BusyError("server is shutting down", status=503)))
