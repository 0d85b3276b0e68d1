"""Memory watch and request admission: decide, before any prefill, whether a request fits.

Why: a long prompt that does not fit in memory fails late and badly (an OOM mid-prefill takes the
whole process, and every stream with it). So every request is admitted first against the latest
memory reading: FIT (go), CAPPED (go with the oldest context dropped to `fit_tokens`; the web layer
sets `context_capped` and skips prefix reuse for the turn) or DENIED (503, retry later).

`MemWatch` is a background OS thread (pantheon.osthread: real even under gevent) that samples host
memory (psutil) and each die (its `memory_stats()` where the backend has one, else the die manager's
budget ledger) every ~0.5 s into an immutable `MemSnapshot`. The snapshot is published by a single
attribute assignment, so readers (every request, the batch scheduler's pressure callback) never take
a lock. When no watch runs, admission fails open (FIT), as in the seed: memory awareness is an
optimisation, never a reason to refuse work on a host where it cannot measure.

Pressure levels (`level_for`), from the used fraction of the tightest measured pool:

    OK 0: < 0.80    ELEVATED 1: >= 0.80    HIGH 2: >= 0.90    CRITICAL 3: >= 0.97

HIGH triggers the ladder (the allowed context window is halved, logged); CRITICAL makes the batch
scheduler stop starting work (PRESSURE_CRITICAL = 3). Admission keeps a reserve of the last
(1 - 0.97) of each pool free, so admitting never pushes a pool into CRITICAL by itself.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pantheon import osthread
from pantheon.errors import BusyError
from pantheon.types import ModelGeometry

log = logging.getLogger(__name__)

OK, ELEVATED, HIGH, CRITICAL = 0, 1, 2, 3
LEVEL_NAMES = ("OK", "ELEVATED", "HIGH", "CRITICAL")
THRESHOLDS = (0.80, 0.90, 0.97)  # used fraction at which ELEVATED / HIGH / CRITICAL start
DEFAULT_INTERVAL_S = 0.5
STALE_AFTER_S = 10.0  # a snapshot this old means the sampler is stuck: fail open rather than trust it
MIN_CAPPED_TOKENS = 256  # a capped window smaller than this (or a quarter of the window) is a denial

FIT, CAPPED, DENIED = "FIT", "CAPPED", "DENIED"


def level_for(used_fraction: float, thresholds: Sequence[float] = THRESHOLDS) -> int:
    """0..3: how many of the ELEVATED / HIGH / CRITICAL thresholds `used_fraction` has reached."""
    return sum(1 for t in thresholds if used_fraction >= t)


# ---- snapshots -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class PoolSample:
    """One memory pool at one instant: the host, or a die.

    `measured` is True for live readings (psutil, memory_stats). A die without memory_stats is
    sampled from the die manager's ledger (budget, bound bytes) with measured=False: that ledger
    already includes every model's full static state, so it is shown but neither raises pressure
    nor is charged again by admission (its real memory is the host's, which is measured).
    """

    name: str  # "host" or "die:N"
    total_bytes: int
    used_bytes: int
    source: str  # "psutil" | "memory_stats" | "budget" | "given"
    measured: bool = True
    die: int | None = None

    @property
    def free_bytes(self) -> int:
        return max(0, self.total_bytes - self.used_bytes)

    @property
    def used_fraction(self) -> float:
        return self.used_bytes / self.total_bytes if self.total_bytes > 0 else 0.0

    def level(self, thresholds: Sequence[float] = THRESHOLDS) -> int:
        return level_for(self.used_fraction, thresholds) if self.measured else OK

    def reserve_bytes(self, thresholds: Sequence[float] = THRESHOLDS) -> int:
        """Bytes admission leaves untouched: the slice above the CRITICAL threshold."""
        return int(math.ceil((1.0 - thresholds[-1]) * self.total_bytes))

    def as_dict(self) -> dict:
        return {"name": self.name, "die": self.die, "total_bytes": self.total_bytes, "used_bytes": self.used_bytes,
                "free_bytes": self.free_bytes, "source": self.source, "measured": self.measured,
                "pressure": LEVEL_NAMES[self.level()]}


@dataclass(frozen=True)
class MemSnapshot:
    """Host + dies at one instant. Immutable: MemWatch swaps whole snapshots, readers need no lock."""

    host: PoolSample
    dies: tuple[PoolSample, ...] = ()
    taken_at: float = 0.0  # time.monotonic()
    thresholds: tuple[float, float, float] = THRESHOLDS

    def die(self, die_id: int) -> PoolSample | None:
        return next((d for d in self.dies if d.die == die_id), None)

    def pools(self, dies: Sequence[int] | None = None) -> list[PoolSample]:
        """The host and the measured dies (only `dies` when given): what pressure and admission use."""
        picked = [d for d in self.dies if d.measured and (dies is None or d.die in dies)]
        return [self.host] + picked

    def pressure(self, dies: Sequence[int] | None = None) -> int:
        return max(p.level(self.thresholds) for p in self.pools(dies))

    def age_s(self) -> float:
        return time.monotonic() - self.taken_at

    def as_dict(self) -> dict:
        return {"pressure": LEVEL_NAMES[self.pressure()], "host": self.host.as_dict(),
                "dies": [d.as_dict() for d in self.dies], "age_s": round(self.age_s(), 3)}


def read_host() -> PoolSample:
    import psutil
    vm = psutil.virtual_memory()
    total = int(vm.total)
    return PoolSample("host", total, total - int(vm.available), "psutil")


def read_dies(dies: Any) -> tuple[PoolSample, ...]:
    """Each die of a DieManager: memory_stats where the backend has them, else its budget ledger."""
    out = []
    for die, used in dies.usage():
        stats: dict = {}
        if die.device is not None:
            try:
                stats = die.device.memory_stats() or {}
            except Exception:  # some backends raise instead of returning None
                stats = {}
        limit = int(stats.get("bytes_limit") or 0)
        if limit > 0:
            out.append(PoolSample(f"die:{die.id}", limit, int(stats.get("bytes_in_use") or 0), "memory_stats",
                                  True, die.id))
        else:
            out.append(PoolSample(f"die:{die.id}", die.budget_bytes, used, "budget", False, die.id))
    return tuple(out)


# ---- the watch -------------------------------------------------------------------------------------
class MemWatch:
    """Samples memory every `interval_s` in a background OS thread; `snapshot()` / `pressure()` read
    the latest sample without locking. `host_reader` / `die_reader` exist for tests."""

    def __init__(self, dies: Any = None, interval_s: float = DEFAULT_INTERVAL_S,
                 host_reader: Callable[[], PoolSample] = read_host,
                 die_reader: Callable[[Any], tuple[PoolSample, ...]] | None = read_dies,
                 thresholds: Sequence[float] = THRESHOLDS):
        self.dies = dies  # a pantheon.serving.dies.DieManager, or None: host only
        self.interval_s = max(0.01, float(interval_s))
        self._host_reader = host_reader
        self._die_reader = die_reader
        self.thresholds = tuple(thresholds)
        if len(self.thresholds) != 3 or list(self.thresholds) != sorted(self.thresholds):
            raise ValueError(f"thresholds must be three increasing fractions, got {thresholds}")
        # _snap: replaced whole by one assignment (atomic in CPython) from the sampler thread; read
        # without a lock. _lock guards only _thread/_stop (start/stop), never a read of _snap.
        self._snap: MemSnapshot | None = None
        self._lock = osthread.Lock()
        self._stop: osthread.Event | None = None
        self._thread: osthread.OSThread | None = None
        self._errors = 0

    def sample(self) -> MemSnapshot:
        """Take one reading now (what the thread does each tick)."""
        host = self._host_reader()
        dies = self._die_reader(self.dies) if self.dies is not None and self._die_reader is not None else ()
        return MemSnapshot(host=host, dies=tuple(dies), taken_at=time.monotonic(),
                           thresholds=self.thresholds)  # type: ignore[arg-type]

    def _tick(self) -> None:
        try:
            snap = self.sample()
        except Exception:
            self._errors += 1
            if self._errors in (1, 10, 100):
                log.exception("memwatch sample failed (%d so far); keeping the last snapshot", self._errors)
            return
        prev = self._snap
        self._snap = snap
        if prev is not None and prev.pressure() != snap.pressure():
            log.info("memory pressure %s -> %s (host %.1f%% used)", LEVEL_NAMES[prev.pressure()],
                     LEVEL_NAMES[snap.pressure()], 100 * snap.host.used_fraction)

    def start(self) -> "MemWatch":
        """Idempotent. Samples once synchronously (so the first request already sees a reading)."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return self
            self._tick()
            stop = osthread.Event()
            self._stop = stop

            def run() -> None:
                while not stop.wait(self.interval_s):
                    self._tick()

            self._thread = osthread.start_thread(run, "pantheon-memwatch")
        return self

    def stop(self, timeout: float = 5.0) -> None:
        with self._lock:
            stop, thread = self._stop, self._thread
            self._stop = self._thread = None
        if stop is not None:
            stop.set()
        if thread is not None:
            thread.join(timeout)

    @property
    def running(self) -> bool:
        t = self._thread
        return t is not None and t.is_alive()

    def snapshot(self) -> MemSnapshot | None:
        """The latest reading, or None when not running or the sampler is stuck (fail open)."""
        snap = self._snap
        if snap is None or not self.running:
            return None
        if snap.age_s() > max(STALE_AFTER_S, 10 * self.interval_s):
            return None
        return snap

    def pressure(self, dies: Sequence[int] | None = None) -> int:
        """0..3 over the host and the measured dies (only `dies` when given); 0 when not running."""
        snap = self.snapshot()
        return snap.pressure(dies) if snap is not None else OK

    def pressure_fn(self, dies: Sequence[int] | None = None) -> Callable[[], int]:
        """A zero-argument callback for BatchScheduler(pressure=...), scoped to a model's dies."""
        ids = tuple(dies) if dies is not None else None
        return lambda: self.pressure(ids)


# The process-wide watch (the seed's pn_memwatch_*): set by start_memwatch, read by admit.
_watch: MemWatch | None = None
_watch_lock = osthread.Lock()  # guards start/stop of _watch (reads of _watch need no lock)


def start_memwatch(dies: Any = None, interval_s: float = DEFAULT_INTERVAL_S) -> MemWatch:
    """Start (or return the running) process-wide watch."""
    global _watch
    with _watch_lock:
        if _watch is None or not _watch.running:
            _watch = MemWatch(dies, interval_s).start()
        return _watch


def stop_memwatch() -> None:
    global _watch
    with _watch_lock:
        w, _watch = _watch, None
    if w is not None:
        w.stop()


def memwatch() -> MemWatch | None:
    return _watch


def memwatch_running() -> bool:
    w = _watch
    return w is not None and w.running


# ---- admission -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Admission:
    """The answer for one request. `fit_tokens`: the prompt tokens allowed (== n_tokens when FIT)."""

    outcome: str  # FIT | CAPPED | DENIED
    fit_tokens: int
    reason: str
    window: int = 0  # the context window admission applied (after the ladder)
    pressure: int = OK

    @property
    def fit(self) -> bool:
        return self.outcome == FIT

    @property
    def capped(self) -> bool:
        return self.outcome == CAPPED

    @property
    def denied(self) -> bool:
        return self.outcome == DENIED

    def raise_if_denied(self, retry_after: int = 5) -> None:
        """DENIED -> BusyError 503 with Retry-After (the seed's SG_ADMIT_DENIED)."""
        if self.denied:
            raise BusyError(f"not enough memory for this request now: {self.reason}", status=503,
                            retry_after=retry_after)


_ladder_logged_at = 0.0  # monotonic time of the last ladder line (racy by design: it only thins logs)


def _log_ladder(pressure: int, window: int, clamped: int) -> None:
    """The seed's "[ladder] TIGHT -> prefill window clamped A -> B", at most every 10 s (not per request)."""
    global _ladder_logged_at
    now = time.monotonic()
    if now - _ladder_logged_at >= 10.0:
        _ladder_logged_at = now
        log.warning("[ladder] %s -> prefill window clamped %d -> %d", LEVEL_NAMES[pressure], window, clamped)


def _model_dies(geo: ModelGeometry) -> list[int]:
    return [int(d) for d in geo.dies]


def _per_sequence_bytes(geo: ModelGeometry) -> int:
    return int(geo.state_bytes_per_sequence)


# What one prompt (or answer) token costs on the host while its request lives: the request body
# and its parsed messages, the rendered prompt, the prompt id list the request carries, the slot's
# history and pending lists. Measured with tracemalloc for a 100k-token prompt through JSON, the
# chat template, the tokenizer and GenRequest (SmolLM2): 75 bytes a token at the peak. The
# tokenizer's own encoding (Rust, not traced) is transient; 1 KiB a token bounds it all generously.
HOST_BYTES_PER_TOKEN = 1024
ACT_BYTES = 4  # activations are f32 on CPU; a bf16 device's are smaller, so this bounds both


def _bucket_up(n: int, buckets: Any, top: int) -> int:
    """The smallest bucket >= n (the engine pads a step to it), or `top` when none is known."""
    for b in buckets or ():
        if n <= b:
            return int(b)
    return top


def activation_bytes(geo: ModelGeometry, n_tokens: int) -> int | None:
    """Bytes of the temporaries the prefill of an `n_tokens` prompt adds to a step, or None when
    the geometry `geo` is unsized (no widths, chunk or capacity).

    The prompt is fed in chunks, so only its last (widest) chunk counts: T = its padded length (the
    chunk bucket >= min(n, chunk)) attending over span = the span bucket of its end (capacity at
    most). Per chunk token: the residual stream and norms (4 H), q/k/v/attention output
    ((2 n_heads + 2 n_kv) D), the FFN's gate/up/act (3 F, F = max(ffn, experts used x expert ffn)
    + the router's logits), and attention scores and probabilities (2 n_heads x span); plus the
    request's row of logits with the sampler's buffers (4 x vocab). All at ACT_BYTES. A hybrid adds
    twice one sequence's recurrent state: a step gathers its rows' conv/delta-rule state before the
    layer scan and scatters the scan's new copy back after it (qwen35.forward_groups).

    Checked against XLA's buffer assignment (`memory_analysis().temp_size_in_bytes`) for SmolLM2-135M
    with 8 slots and capacity 2176: a 20-token prefill step 0.5 MiB (this gives 2.1), a 128-token
    chunk at position 1900 21.3 MiB (24.0). When the chunk rides in a mixed step beside decode rows
    at position 1900 it attends over their span too: 9 MiB for 20 tokens and 31 for 128. That
    excess, like the sampler's 7.5 MiB for 8 rows, is the model's one step in flight, shared by all
    its requests and not growing with them: it falls in the reserve every pool keeps (3 %).
    """
    if not geo.sized:
        return None
    H, D, V = geo.hidden, geo.head_dim, geo.vocab
    nh, nkv, ffn = geo.n_heads, geo.n_kv_heads, geo.ffn
    chunk, capacity = geo.chunk, geo.capacity
    n = max(1, int(n_tokens))
    T = _bucket_up(min(n, chunk), geo.chunk_buckets, min(n, chunk))
    span = _bucket_up(min(n + T, capacity), geo.span_buckets, min(n + T, capacity))
    per_token = 4 * H + (2 * nh + 2 * nkv) * D + 3 * ffn + 2 * nh * span
    return ACT_BYTES * (T * per_token + 4 * V) + 2 * _per_sequence_bytes(geo)


def request_bytes(geo: ModelGeometry, n_prompt: int, n_answer: int = 0, *, on_host: bool = True,
                  share: int = 1) -> int:
    """What admitting a request of `n_prompt` prompt and `n_answer` answer tokens adds to one pool.

    Not the KV/recurrent cache of its tokens: the slot caches are allocated for every slot at load
    (and reserved then by the die manager), so a request only fills memory the process already
    holds; and the batch scheduler keeps reusable prefixes in their slots (a hybrid reuses a slot's
    whole history or nothing), so no request takes a prefix snapshot copy. What a request does add
    is its prefill's activations (`activation_bytes`, bounded by the chunk, not the prompt) and, on
    the host, HOST_BYTES_PER_TOKEN of copies per prompt and answer token. `share`: the number of
    dies a sharded model's activations are split over.

    An unsized geometry (a test fake that only knows `state_bytes_per_token`) is
    charged its whole state per token (+ a hybrid's per-sequence state): the conservative bound
    admission used before.
    """
    share = max(1, share)
    act = activation_bytes(geo, n_prompt)
    if act is None:
        bpt = int(geo.state_bytes_per_token)
        return math.ceil(_per_sequence_bytes(geo) / share) + (n_prompt + n_answer) * math.ceil(bpt / share)
    host = (n_prompt + n_answer) * HOST_BYTES_PER_TOKEN if on_host else 0
    return math.ceil(act / share) + host


def admit(geo: ModelGeometry, n_tokens: int, snapshot: MemSnapshot | None = None, *,
          watch: MemWatch | None = None, reserve_tokens: int = 0, min_tokens: int | None = None) -> Admission:
    """The memory arithmetic of admitting `n_tokens` prompt tokens (+ `reserve_tokens` it will
    generate) on a model of geometry `geo` (the value its engine published). The decision around it
    (window, capping, queue, `n`) is pantheon.serving.admission's.

    Memory: a request is charged what it *adds*, not what the process already holds. The slot
    caches (KV, a hybrid's recurrent state) are preallocated for every slot at load and are in the
    memory reading already, so charging every prompt token its KV bytes again refused short prompts
    whenever other processes had taken the host's slack (issue 22: "only 0 of 20 prompt tokens
    fit"). A prompt of n tokens with r answer tokens reserved adds (`request_bytes`):

        added(n, r) = activations(n) + (n + r) x HOST_BYTES_PER_TOKEN
        activations(n) = ACT_BYTES x (T x (4 H + (2 n_heads + 2 n_kv) D + 3 F + 2 n_heads span) + 4 V)
                         (+ twice a hybrid's per-sequence recurrent state)

    with T the padded last prefill chunk and span its attention span (`activation_bytes`). On
    SmolLM2-135M with r = 256, a 20-token prompt adds about 2.3 MiB and a 2000-token one 26 MiB,
    where their KV would be 12 and 99 MiB. It is charged against the free bytes minus the reserve
    of every pool the model's memory lives in: the host for a CPU model; each measured die for a
    device model (activations split over a sharded model's dies; its host copies are negligible
    there). A model without a config is charged `state_bytes_per_token` per token instead (the old
    conservative bound).

    Window: the model's max_seq (PANTHEON_MAX_SEQ clamped to the file's context length), halved under
    HIGH pressure (the ladder). A charged pool at CRITICAL admits nothing (DENIED, 503), whatever
    the request would add.

    FIT when everything fits; CAPPED with fit_tokens (the largest prompt that fits) when at least
    `min_tokens` do; DENIED otherwise. Without a snapshot and no running watch: FIT (fail open).
    """
    n_tokens = max(0, int(n_tokens))
    reserve_tokens = max(0, int(reserve_tokens))
    if snapshot is None:
        w = watch if watch is not None else _watch
        snapshot = w.snapshot() if w is not None else None
        if snapshot is None:
            return Admission(FIT, n_tokens, "memwatch not running: admission fails open")
    dies = _model_dies(geo)
    th = snapshot.thresholds
    pools = snapshot.pools(dies or None)
    pressure = max(p.level(th) for p in pools)

    window = int(geo.max_seq or 0) or (n_tokens + reserve_tokens)
    if pressure >= HIGH:
        clamped = max(1, window // 2)
        _log_ladder(pressure, window, clamped)
        window = clamped

    on_cpu = geo.platform == "cpu"
    n_dies = max(1, len(dies))
    charged = []  # (pool, bytes it can give, share of the model's memory it holds)
    for p in pools:
        if p.die is None and not on_cpu:
            continue  # a device model's state and activations are not in host RAM
        room = p.free_bytes - p.reserve_bytes(th)
        if p.level(th) >= CRITICAL:
            room = -1  # the ladder's top rung: no new work on a pool past CRITICAL
        charged.append((p, room, 1 if p.die is None else n_dies))

    def tightest(n: int) -> str | None:
        """The first charged pool a prompt of n tokens (+ the answer reserve) does not fit, or None."""
        for p, room, share in charged:
            if request_bytes(geo, n, reserve_tokens, on_host=p.die is None, share=share) > room:
                return p.name
        return None

    top = window - reserve_tokens
    if n_tokens <= top and tightest(n_tokens) is None:
        return Admission(FIT, n_tokens, "fits", window, pressure)
    # It does not fit as sent: the largest prompt that fits memory and the window (what a request
    # adds grows with its length, so bisect).
    limit = "the context window"
    if top < 0:
        prompt_fit = top
    elif tightest(top) is None:
        prompt_fit = top
    else:
        limit = f"free memory on {tightest(top)}"
        if tightest(0) is not None:
            prompt_fit = -1
        else:
            lo, hi = 0, top  # invariant: lo fits, hi does not
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if tightest(mid) is None else (lo, mid)
            prompt_fit = lo
    if n_tokens <= prompt_fit:
        return Admission(FIT, n_tokens, "fits", window, pressure)
    floor = min(MIN_CAPPED_TOKENS, max(1, window // 4)) if min_tokens is None else max(1, int(min_tokens))
    if prompt_fit >= floor:
        return Admission(CAPPED, prompt_fit, f"{n_tokens} prompt tokens capped to {prompt_fit} by {limit}",
                         window, pressure)
    return Admission(DENIED, max(0, prompt_fit),
                     f"only {max(0, prompt_fit)} of {n_tokens} prompt tokens fit ({limit}); need at least {floor}",
                     window, pressure)


# ---- capping a conversation --------------------------------------------------------------------
def _count(tokenize_fn: Callable[[list[dict]], Any], messages: list[dict]) -> int:
    out = tokenize_fn(messages)
    return int(out) if isinstance(out, int) else len(out)


def _with_content(msg: dict, text: str) -> dict:
    m = dict(msg)
    m["content"] = text
    return m


def _shrink_text(messages: list[dict], idx: int, keep_tail: bool, tokenize_fn: Callable, fit: int) -> list[dict] | None:
    """Cut message `idx`'s string content (keeping its head or tail) to the most that fits; None if
    even an empty content does not fit or the content is not a string."""
    text = messages[idx].get("content")
    if not isinstance(text, str) or not text:
        return None

    def build(n: int) -> list[dict]:
        part = text[len(text) - n:] if keep_tail else text[:n]
        return messages[:idx] + [_with_content(messages[idx], part)] + messages[idx + 1:]

    if _count(tokenize_fn, build(0)) > fit:
        return None
    lo, hi = 0, len(text)  # invariant: build(lo) fits, build(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _count(tokenize_fn, build(mid)) <= fit:
            lo = mid
        else:
            hi = mid
    return build(lo)


def cap_messages(messages: Sequence[dict], tokenize_fn: Callable[[list[dict]], Any],
                 fit_tokens: int, *, over: bool = False) -> tuple[list[dict], bool]:
    """Keep the most recent conversation that fits in `fit_tokens` (the seed's sliding window).

    `tokenize_fn(messages)` renders the prompt (chat template + tokenizer) and returns its ids (or
    their count). In order, until it fits: drop the oldest turns between the leading system
    message(s) and the last user message (cutting only at a user message, so the kept history stays
    well-formed for strict templates, and never leaving a tool result without its call); then cut the
    system prompt's end; then cut the last user message's beginning. The system prompt and the last
    user message are kept whole whenever dropping history suffices. Returns (messages, capped); the
    result can still exceed `fit_tokens` only when the last turn alone cannot be made to fit.
    `over`: the caller already knows the whole conversation does not fit (it is not counted again).

    Why the search gallops from the newest turn: each count renders and tokenizes a candidate, which
    costs its size. A binary search over all cut points starts from half the conversation, so a 2.8 MB
    conversation of 3,000 turns cost a dozen multi-megabyte renders (18-30 s of CPU on one request,
    issue 43). Keeping 1, 2, 4, ... of the newest turns until a candidate no longer fits, then bisecting
    between the last two, counts O(log n) candidates, each at most about twice the size of what is
    finally kept (itself about the window's worth): the work is bounded by the window, not the body.
    """
    msgs = [dict(m) for m in messages]
    if not over and _count(tokenize_fn, msgs) <= fit_tokens:
        return msgs, False
    n_sys = 0
    while n_sys < len(msgs) and msgs[n_sys].get("role") in ("system", "developer"):
        n_sys += 1
    last_user = max((i for i, m in enumerate(msgs) if m.get("role") == "user"), default=len(msgs))
    head, middle, tail = msgs[:n_sys], msgs[n_sys:last_user], msgs[last_user:]
    # Cut points k: keep middle[k:]. Prefer starting at a user message; else anything but a tool result.
    cuts = [k for k, m in enumerate(middle) if m.get("role") == "user" and k > 0]
    if not cuts:
        cuts = [k for k, m in enumerate(middle) if m.get("role") != "tool" and k > 0]
    cuts.append(len(middle))

    def fits(i: int) -> bool:  # tokens only shrink as i grows (a later cut keeps less)
        return _count(tokenize_fn, head + middle[cuts[i]:] + tail) <= fit_tokens

    good = len(cuts) - 1
    if fits(good):
        bad, step = -1, 1  # -1: the conversation as sent, known not to fit
        while good - bad > 1:  # gallop from the newest turn: invariant cuts[good] fits, bad does not
            probe = max(good - step, bad + 1)
            if not fits(probe):
                bad = probe
                break
            good, step = probe, step * 2
        while good - bad > 1:
            mid = (good + bad) // 2
            if fits(mid):
                good = mid
            else:
                bad = mid
        return head + middle[cuts[good]:] + tail, True
    kept = head + tail
    # History alone was not enough: shorten the system prompt (its start usually matters most) ...
    for i in range(len(head) - 1, -1, -1):
        shrunk = _shrink_text(kept, i, keep_tail=False, tokenize_fn=tokenize_fn, fit=fit_tokens)
        if shrunk is not None:
            return shrunk, True
        kept = kept[:i] + kept[i + 1:]  # even empty it does not fit: drop it
        if _count(tokenize_fn, kept) <= fit_tokens:
            return kept, True
    # ... then the last user message, keeping its most recent text.
    idx = next((i for i, m in enumerate(kept) if m.get("role") == "user"), None)
    if idx is not None:
        shrunk = _shrink_text(kept, idx, keep_tail=True, tokenize_fn=tokenize_fn, fit=fit_tokens)
        if shrunk is not None:
            return shrunk, True
    return kept, True
