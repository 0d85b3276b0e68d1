"""What a router (SMG) needs from a worker: its load, and one root per model.

* `GET /v1/loads`: live load in SMG's shape (the SGLang scheduler-load document the router polls for
  its load-aware policies, overload protection and metrics): one entry per served model name, then
  the aggregate. `GET /m/<model>/v1/loads`: the same for that model alone, as one entry.
* `/m/<model>/...`: a root that serves one model, so a process serving several models registers
  each as its own worker (the router keeps one worker per URL and routes by the request's
  `model`): `health` (200 ready, 503 loading or unloading, 404 not served here), `v1/models` (that
  model only), `v1/chat/completions` and `v1/completions` (that model only), `v1/loads`; the Responses
  and Messages APIs' roots (`v1/responses`, `v1/messages`, `v1/messages/count_tokens`) are registered by
  pantheon.web.responses and pantheon.web.messages.

What the load figures mean, from what the backends count (`load_info`):
`num_running_reqs` requests holding a slot, `num_waiting_reqs` queued ones, `max_running_requests`
the batch slots (summed over a name's replicas); `max_total_num_tokens` the KV rows the slots own
(slots x context length: Pantheon's cache is allocated per slot up front) and `num_used_tokens` the
rows of the busy slots, so `token_usage` is the busy share of the cache; `gen_throughput` generated
tokens per second since the previous poll; `cache_hit_rate` prefix-cache hits over admissions since
the start.
"""

from __future__ import annotations

import time
from typing import Any

from flask import Blueprint, Response, jsonify

from pantheon import osthread
from pantheon.errors import RequestError
from pantheon.web.routes import handle_chat, handle_completion, server

bp = Blueprint("router_api", __name__)

RATE_MIN_WINDOW_S = 1.0  # polls closer together than this reuse the last throughput figure


class _Throughput:
    """Tokens per second per model between successive polls (any thread; the lock is held briefly)."""

    def __init__(self) -> None:
        self._lock = osthread.Lock()
        self._last: dict[str, tuple[float, float, float]] = {}  # model -> (time, tokens, rate)

    def rate(self, model: str, tokens: float) -> float:
        now = time.monotonic()
        with self._lock:
            prev = self._last.get(model)
            if prev is None or tokens < prev[1]:  # first poll, or the model was reloaded
                self._last[model] = (now, tokens, 0.0)
                return 0.0
            t, seen, rate = prev
            if now - t >= RATE_MIN_WINDOW_S:
                rate = (tokens - seen) / (now - t)
                self._last[model] = (now, tokens, rate)
            return rate


def _throughput() -> _Throughput:
    st = server()
    tp = getattr(st, "_throughput", None)
    if tp is None:
        tp = st._throughput = _Throughput()
    return tp


def _num(info: dict, key: str) -> float:
    v = info.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0.0


def model_load(name: str, rank: int = 0) -> dict | None:
    """SMG's per-rank load entry for model `name` (its replicas summed); None when it is not ready."""
    st = server()
    entries = st.registry.ready_entries(name)
    if not entries:
        return None
    running = waiting = slots = used = capacity = hits = misses = decoded = 0.0
    for e in entries:
        info = e.backend.load_info() or {}
        ctx = int(getattr(e.card, "context_length", 0) or st.settings.max_seq)
        n_slots = _num(info, "slots") or 1.0
        n_running = _num(info, "running")
        running += n_running
        waiting += _num(info, "queued")
        slots += n_slots
        used += n_running * ctx
        capacity += n_slots * ctx
        hits += _num(info, "prefix_hits")
        misses += _num(info, "prefix_misses")
        decoded += _num(info, "decode_tokens")
    return {
        "dp_rank": rank,
        "num_running_reqs": int(running),
        "num_waiting_reqs": int(waiting),
        "num_total_reqs": int(running + waiting),
        "num_used_tokens": int(used),
        "max_total_num_tokens": int(capacity),
        "token_usage": used / capacity if capacity else 0.0,
        "gen_throughput": round(_throughput().rate(name, decoded), 3),
        "cache_hit_rate": hits / (hits + misses) if hits + misses else 0.0,
        "utilization": running / slots if slots else 0.0,
        "max_running_requests": int(slots),
    }


def loads_document(loads: list[dict]) -> dict:
    """The whole `/v1/loads` answer around per-rank entries."""
    n = len(loads)
    running = sum(x["num_running_reqs"] for x in loads)
    waiting = sum(x["num_waiting_reqs"] for x in loads)
    return {
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "version": "pantheon",
        "dp_rank_count": n,
        "loads": loads,
        "aggregate": {
            "total_running_reqs": running,
            "total_waiting_reqs": waiting,
            "total_reqs": running + waiting,
            "avg_token_usage": sum(x["token_usage"] for x in loads) / n if n else 0.0,
            "avg_throughput": sum(x["gen_throughput"] for x in loads) / n if n else 0.0,
            "avg_utilization": sum(x["utilization"] for x in loads) / n if n else 0.0,
        },
    }


def _not_served(model: str) -> RequestError:
    return RequestError(f"model {model!r} is not served here", param="model", status=404, code="model_not_found")


@bp.get("/v1/loads")
def loads() -> Response:
    names = [m["id"] for m in server().registry.models()]
    entries = [x for x in (model_load(n, i) for i, n in enumerate(names)) if x is not None]
    return jsonify(loads_document(entries))


@bp.get("/m/<path:model>/health")
def model_health(model: str) -> Response:
    st = server()
    ready = st.registry.ready_entries(model)
    failed = st.registry.failures(model)
    if ready and len(failed) < len(ready):
        return jsonify(service="pantheon", status="ok", model=model)
    if failed:  # every instance of it has a failed driver: the router should stop sending it work
        resp = jsonify(service="pantheon", status="failed", error="; ".join(failed), model=model)
        resp.status_code = 503
        return resp
    if st.registry.has_name(model) or st.status == "loading":
        resp = jsonify(service="pantheon", status="loading" if st.status == "loading" else "not_ready", model=model)
        resp.status_code = 503
        return resp
    if st.status == "failed":
        resp = jsonify(service="pantheon", status="failed", error=st.error, model=model)
        resp.status_code = 503
        return resp
    raise _not_served(model)


@bp.get("/m/<path:model>/v1/models")
def model_models(model: str) -> Response:
    return jsonify(object="list", data=[m for m in server().registry.models() if m["id"] == model])


@bp.get("/m/<path:model>/v1/loads")
def model_loads(model: str) -> Response:
    entry = model_load(model)
    if entry is None:
        if not server().registry.has_name(model):
            raise _not_served(model)
        return jsonify(loads_document([]))
    return jsonify(loads_document([entry]))


@bp.post("/m/<path:model>/v1/chat/completions")
def model_chat(model: str) -> Any:
    return handle_chat(root_model=model)


@bp.post("/m/<path:model>/v1/completions")
def model_completion(model: str) -> Any:
    return handle_completion(root_model=model)
