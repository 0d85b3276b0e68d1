"""Prometheus metrics for the server, in a registry of their own (`GET /metrics`).

Why a dedicated `CollectorRegistry`: tests create many apps in one process, and the global registry
refuses a second metric of the same name. Each `Metrics` owns its registry, so apps never collide.

Two kinds of figures:

* events the web layer sees (requests by route and status, TTFT, inter-token latency, end-to-end and
  queue time, tokens, admissions, rejections, disconnects) are counted as they happen, through the
  `observe_*` methods;
* state the scheduler or registry owns (running/queued requests, prefix-cache hits and reused tokens,
  per-die memory, JAX compilations) is read at scrape time through callbacks, so there is one source
  of truth and nothing has to be mirrored. Scheduler counters are summed over a model's replicas; when
  a replica unloads its counts leave the sum, which Prometheus reads as a counter reset. Flags
  (`pantheon_native_kernels`, which path a model's steps run) take the maximum instead.

Importing this module never imports JAX: the compile count is read only if `pantheon.runtime.compile_guard`
is already loaded (when it is not, no compilation can have been counted).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pantheon import osthread

log = logging.getLogger(__name__)

PREFIX = "pantheon"
# 5 ms .. 120 s: CPU serving spans fast decode steps (ms) to long prefills behind a queue (minutes).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 7.5,
                   10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0)
ADMISSION_OUTCOMES = ("fit", "capped", "denied")
MAX_ROUTES = 64  # distinct route labels kept; further ones count as "other" (no unbounded cardinality)

# Sample names other tools (pantheon bench serve) read from a scrape.
REQUESTS_TOTAL = f"{PREFIX}_http_requests_total"
PROMPT_TOKENS_TOTAL = f"{PREFIX}_prompt_tokens_total"
GENERATION_TOKENS_TOTAL = f"{PREFIX}_generation_tokens_total"
PREFIX_HITS_TOTAL = f"{PREFIX}_prefix_cache_hits_total"
PREFIX_MISSES_TOTAL = f"{PREFIX}_prefix_cache_misses_total"
PREFIX_REUSED_TOKENS_TOTAL = f"{PREFIX}_prefix_cache_reused_tokens_total"

BackendSource = Callable[[], Iterable[tuple[str, dict]]]
DieSource = Callable[[], Iterable[dict]]
MemorySource = Callable[[], Any]  # -> the memory watch's latest snapshot (pantheon.runtime.memory.MemSnapshot) or None

# load_info key -> (metric suffix, help) for the scheduler's monotonic counters.
_SCHED_COUNTERS = (
    ("prefix_hits", "prefix_cache_hits", "Requests admitted into a slot whose cached prefix was reused."),
    ("prefix_misses", "prefix_cache_misses", "Requests admitted with no reusable cached prefix."),
    ("reused_tokens", "prefix_cache_reused_tokens", "Prompt tokens served from a cached prefix (not prefilled)."),
    ("prefill_tokens", "scheduler_prefill_tokens", "Prompt tokens prefilled by the scheduler."),
    ("decode_tokens", "scheduler_decode_tokens", "Tokens produced by batched decode steps."),
    ("steps", "scheduler_steps", "Device steps (prefill chunks and decode steps) run by the scheduler."),
    ("completed", "scheduler_completed", "Requests the scheduler finished (stop, length or error)."),
    ("cancelled", "scheduler_cancelled", "Requests cancelled while running or queued."),
    ("spec_steps", "speculative_verify_steps", "Verify steps run (speculative decoding: drafts checked in the step)."),
    ("spec_drafted", "speculative_prompt_lookup_drafted_tokens",
     "Draft tokens proposed by prompt lookup and verified; the acceptance rate is accepted / drafted."),
    ("spec_accepted", "speculative_prompt_lookup_accepted_tokens",
     "Prompt-lookup draft tokens accepted (each one a token that cost no step of its own)."),
    ("spec_model_drafted", "speculative_draft_model_drafted_tokens",
     "Draft tokens proposed by the draft model (--draft-model) and verified."),
    ("spec_model_accepted", "speculative_draft_model_accepted_tokens",
     "Draft-model tokens accepted (each one a token that cost no step of its own)."),
)
_SCHED_GAUGES = (
    ("running", "running_requests", "Requests holding a slot (prefilling or decoding)."),
    ("queued", "queued_requests", "Requests waiting for a free slot."),
    ("slots", "batch_slots", "Slots the backend can run at once."),
    ("compiled", "compiled_programs", "Step programs made so far (loaded from the executable store or compiled)."),
    ("programs", "planned_programs", "Step programs warm-up makes in all (the rest compile in the background)."),
    ("native_kernels", "native_kernels", "1 when the model's steps use pantheon.ops.native's CPU kernels, "
                                         "0 on XLA's dot and attention (the maximum over its replicas)."),
    ("kv_tokens", "kv_cache_tokens", "Positions held in the slots' KV caches (busy slots and idle slots' "
                                     "reusable prefixes)."),
    ("kv_capacity", "kv_cache_capacity_tokens", "Positions the slots' KV caches hold in all (slots x context)."),
    ("vision", "model_vision", "1 when the model takes images (loaded with a vision projector), else 0."),
)
# load_info keys whose per-model figure is the maximum over the replicas, not their sum: flags, where
# a sum of 2 would read as nonsense. Replicas of a model usually agree; where they differ (one spans
# several dies, where XLA's forms run) 1 says the kernels serve at least one of them.
_SCHED_MAX = frozenset({"native_kernels", "vision"})


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _gauge_pair(rows: list[tuple[str, float | None, float | None]], label: str, first: tuple[str, str],
                second: tuple[str, str]) -> Iterable[Any]:
    """Two gauge families (name suffix, help) over `rows` of (label value, first value, second value); a
    None value leaves its sample out."""
    fams = [GaugeMetricFamily(f"{PREFIX}_{suffix}", doc, labels=[label]) for suffix, doc in (first, second)]
    for key, *values in rows:
        for fam, v in zip(fams, values):
            if v is not None:
                fam.add_metric([key], v)
    yield from fams


class _ScrapeCollector:
    """Reads the callbacks' state once per scrape. A failing callback drops its families, not the scrape."""

    def __init__(self, owner: "Metrics"):
        self._owner = owner

    def describe(self) -> list:
        return []  # families vary with the callbacks; describing none keeps registration side-effect free

    def collect(self) -> Iterable[Any]:
        yield from self._backend_families()
        yield from self._die_families()
        yield from self._memory_families()
        yield self._compile_family()
        errors = CounterMetricFamily(f"{PREFIX}_scrape_errors", "Scrape-time callbacks that raised.")
        errors.add_metric([], self._owner._scrape_errors)
        yield errors

    def _failed(self, what: str) -> None:
        log.exception("metrics: the %s source failed", what)
        with self._owner._lock:
            self._owner._scrape_errors += 1

    def _backend_families(self) -> Iterable[Any]:
        fn = self._owner._backend_source
        if fn is None:
            return
        try:
            per_model: dict[str, dict[str, float]] = {}
            rejected: dict[tuple[str, str], float] = {}
            for name, info in fn():
                acc = per_model.setdefault(str(name), {})
                for key, value in (info or {}).items():
                    v = _num(value)
                    if v is not None:
                        acc[key] = max(acc.get(key, v), v) if key in _SCHED_MAX else acc.get(key, 0.0) + v
                for key, reason in (("rejected_full", "queue_full"), ("rejected_timeout", "queue_timeout")):
                    v = _num((info or {}).get(key))
                    if v is not None:
                        rejected[(str(name), reason)] = rejected.get((str(name), reason), 0.0) + v
        except Exception:
            self._failed("backend")
            return
        for family, table in ((GaugeMetricFamily, _SCHED_GAUGES), (CounterMetricFamily, _SCHED_COUNTERS)):
            for key, suffix, doc in table:
                fam = family(f"{PREFIX}_{suffix}", doc, labels=["model"])
                for name, acc in sorted(per_model.items()):
                    if key in acc:
                        fam.add_metric([name], acc[key])
                yield fam
        fam = CounterMetricFamily(f"{PREFIX}_scheduler_rejections", "Requests the scheduler refused, by reason.",
                                  labels=["model", "reason"])
        for (name, reason), v in sorted(rejected.items()):
            fam.add_metric([name, reason], v)
        yield fam

    def _die_families(self) -> Iterable[Any]:
        fn = self._owner._die_source
        if fn is None:
            return
        try:
            rows = []
            for d in fn():
                die = d.get("id", d.get("die"))
                rows.append((str(die), _num(d.get("budget_bytes")), _num(d.get("used_bytes"))))
        except Exception:
            self._failed("die")
            return
        yield from _gauge_pair(rows, "die", ("die_budget_bytes", "Memory budget of each die."),
                               ("die_used_bytes", "Bytes reserved on each die by resident models."))

    def _memory_families(self) -> Iterable[Any]:
        fn = self._owner._memory_source
        if fn is None:
            return
        try:
            snap = fn()
            rows = [] if snap is None else [(p.name, _num(p.total_bytes), _num(p.used_bytes)) for p in snap.pools()]
        except Exception:
            self._failed("memory")
            return
        yield from _gauge_pair(rows, "pool", ("memory_total_bytes", "Size of each memory pool the memory watch "
                                              "measures (the host, each die with memory statistics)."),
                               ("memory_used_bytes", "Bytes in use in each memory pool, as the memory watch last "
                                                     "read them."))

    def _compile_family(self) -> Any:
        fam = CounterMetricFamily(f"{PREFIX}_jax_compilations", "JAX lowerings counted by the compile guard.")
        guard = sys.modules.get("pantheon.runtime.compile_guard")
        fam.add_metric([], float(guard.compile_count()) if guard is not None else 0.0)
        return fam


class Metrics:
    """All of one server's metrics. Every method is thread- and greenlet-safe and never blocks."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self._lock = osthread.Lock()  # guards _routes and _scrape_errors; held for a set update, never across a yield
        self._routes: set[str] = set()
        self._scrape_errors = 0
        self._backend_source: BackendSource | None = None
        self._die_source: DieSource | None = None
        self._memory_source: MemorySource | None = None
        self.requests = Counter(f"{PREFIX}_http_requests", "HTTP requests answered, by route and status.",
                                ["route", "status"], registry=reg)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds",
                              "From request arrival to the first generated token.", ["model"],
                              buckets=LATENCY_BUCKETS, registry=reg)
        self.itl = Histogram(f"{PREFIX}_inter_token_latency_seconds",
                             "Gap between successive token deliveries of one request.", ["model"],
                             buckets=LATENCY_BUCKETS, registry=reg)
        self.e2e = Histogram(f"{PREFIX}_e2e_request_latency_seconds",
                             "From request arrival to its last token (whole generation).", ["model"],
                             buckets=LATENCY_BUCKETS, registry=reg)
        self.queue = Histogram(f"{PREFIX}_queue_time_seconds",
                               "From submission to the backend until the request got a slot.", ["model"],
                               buckets=LATENCY_BUCKETS, registry=reg)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of answered requests.", ["model"],
                                     registry=reg)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "Tokens generated.", ["model"],
                                         registry=reg)
        self.admissions = Counter(f"{PREFIX}_admissions",
                                  "Context admission: fit, capped (prompt context or max_tokens cut to fit) or denied.",
                                  ["outcome"], registry=reg)
        self.rejections = Counter(f"{PREFIX}_rejections", "Requests refused as busy, by HTTP status (429/503).",
                                  ["status"], registry=reg)
        self.disconnects = Counter(f"{PREFIX}_client_disconnects",
                                   "Generations cancelled because the client went away.", ["model"], registry=reg)
        reg.register(_ScrapeCollector(self))

    # ---- scrape-time sources ----------------------------------------------------------------------
    def set_backend_source(self, fn: BackendSource | None) -> None:
        """`fn()` -> iterable of (model name, backend.load_info()); called once per scrape."""
        self._backend_source = fn

    def set_die_source(self, fn: DieSource | None) -> None:
        """`fn()` -> iterable of {"id" (or "die"), "budget_bytes", "used_bytes"}; called once per scrape."""
        self._die_source = fn

    def set_memory_source(self, fn: MemorySource | None) -> None:
        """`fn()` -> the memory watch's latest snapshot, or None; once per scrape. Its measured pools
        (the host, and each die whose backend reports memory statistics) are exported; a die without
        them is already in pantheon_die_used_bytes."""
        self._memory_source = fn

    # ---- events from the web layer ------------------------------------------------------------------
    def _route_label(self, route: str | None) -> str:
        route = route or "other"
        with self._lock:
            if route in self._routes:
                return route
            if len(self._routes) >= MAX_ROUTES:
                return "other"
            self._routes.add(route)
            return route

    def observe_request(self, route: str | None, status: int | str) -> None:
        """One answered HTTP request. Pass the URL rule (`/v1/chat/completions`), not the raw path."""
        self.requests.labels(route=self._route_label(route), status=str(int(status))).inc()

    def observe_ttft(self, model: str, seconds: float) -> None:
        self.ttft.labels(model=model).observe(max(0.0, seconds))

    def observe_itl(self, model: str, seconds: float) -> None:
        self.itl.labels(model=model).observe(max(0.0, seconds))

    def observe_e2e(self, model: str, seconds: float) -> None:
        self.e2e.labels(model=model).observe(max(0.0, seconds))

    def observe_queue(self, model: str, seconds: float) -> None:
        self.queue.labels(model=model).observe(max(0.0, seconds))

    def add_tokens(self, model: str, prompt: int, completion: int) -> None:
        if prompt > 0:
            self.prompt_tokens.labels(model=model).inc(prompt)
        if completion > 0:
            self.generation_tokens.labels(model=model).inc(completion)

    def observe_admission(self, outcome: str) -> None:
        """"fit" (prompt + max_tokens fit), "capped" (max_tokens cut to the room) or "denied" (no room)."""
        self.admissions.labels(outcome=outcome if outcome in ADMISSION_OUTCOMES else "other").inc()

    def observe_rejection(self, status: int | str) -> None:
        self.rejections.labels(status=str(int(status))).inc()

    def disconnect(self, model: str) -> None:
        self.disconnects.labels(model=model).inc()

    # ---- exposition ------------------------------------------------------------------------------
    def render(self) -> tuple[bytes, str]:
        """(body, Content-Type) in the Prometheus text format, for `GET /metrics`."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
