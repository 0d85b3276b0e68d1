"""`pantheon bench serve`: a streaming load generator for any OpenAI-compatible chat server.

It measures what a user of the server sees (time to first token, time per output token, gaps between
chunks, whole-request latency, throughput, goodput under SLOs) at one or more concurrency levels,
against Pantheon or any other server that speaks `/v1/chat/completions` with SSE (llama.cpp's
`llama-server`, vLLM, ...). `--compare URL2` alternates two servers (A B A B ...) so slow drift of the
machine (thermal, other load) hits both alike, and reports B/A ratios of medians across rounds.

Design choices, and why:

* Each request is one `http.client` connection in a worker thread. The standard library never
  follows redirects, and it lets the socket timeout be re-armed before every read, so the overall
  `--timeout` deadline holds even when a server stalls mid-stream. SSE lines are parsed here.
* Only loopback URLs are accepted unless `--allow-remote` is given; either way, nothing but the host
  and port of the given URL(s) is ever contacted (a 3xx answer is a failed request, not followed).
* Token counts come from the server's `usage` (requested with `stream_options.include_usage`); a
  server that sends none gets an estimate (content chunks, ~4 prompt characters per token), flagged
  in the output. Prefix-cache reuse is read from `usage.prompt_tokens_details.cached_tokens` (or
  llama-server's `timings.cache_n`) and, when the server exposes Pantheon's `/metrics`, from the
  deltas of its counters around each run.
* Synthetic prompts are deterministic (common English words, about one token each), so two servers
  and two runs see exactly the same requests.
"""

from __future__ import annotations

import argparse
import http.client
import ipaddress
import json
import math
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

CONNECT_TIMEOUT_S = 10.0
MAX_LINE = 1 << 20  # longest SSE line read (bytes)
MAX_ERROR_BODY = 4096
METRICS_SETTLE_S = 2.0  # longest wait for /metrics to count the last requests of a run
CHAT_PATH = "/v1/chat/completions"
STAT_KEYS = ("mean", "median", "p90", "p99", "max")
# (name in the comparison, path into a run's result)
KEY_FIGURES = (
    ("request_throughput", ("request_throughput",)),
    ("output_tok_s", ("output_tok_s",)),
    ("total_tok_s", ("total_tok_s",)),
    ("ttft_ms.median", ("ttft_ms", "median")),
    ("ttft_ms.p99", ("ttft_ms", "p99")),
    ("tpot_ms.median", ("tpot_ms", "median")),
    ("itl_ms.median", ("itl_ms", "median")),
    ("e2e_ms.median", ("e2e_ms", "median")),
    ("goodput_req_s", ("goodput", "req_s")),
)
WORDS = ("the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by", "on",
         "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an", "had", "they",
         "you", "were", "their", "one", "all", "we", "can", "her", "has", "there", "been", "if", "more", "when",
         "will", "would", "who", "so", "no", "time", "day", "water", "light", "house", "road", "river", "town",
         "green", "small", "old", "new", "long", "first", "last", "good")


# ---- targets and safety --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Target:
    """One server: where its chat endpoint and its /metrics live (same scheme, host and port)."""

    url: str
    scheme: str
    host: str
    port: int
    chat_path: str

    @property
    def origin(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"


def is_loopback(host: str) -> bool:
    h = host.strip("[]").lower().rstrip(".")
    if h == "localhost" or h.endswith(".localhost"):
        return True
    try:
        ip = ipaddress.ip_address(h)
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or bool(mapped and mapped.is_loopback)


def parse_target(url: str, allow_remote: bool) -> Target:
    """Validate a server URL (base, `/v1`, or the full chat path); ValueError says what is wrong."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"{url!r}: only http:// and https:// URLs are supported")
    if parts.username or parts.password:
        raise ValueError(f"{url!r}: put credentials in --api-key, not in the URL")
    if parts.query or parts.fragment:
        raise ValueError(f"{url!r}: a query string or fragment is not supported")
    host = parts.hostname
    if not host:
        raise ValueError(f"{url!r}: no host")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise ValueError(f"{url!r}: bad port") from None
    if not allow_remote and not is_loopback(host):
        raise ValueError(f"{url!r} is not a loopback address; pass --allow-remote to benchmark another host")
    path = parts.path.rstrip("/")
    if path.endswith("/chat/completions"):
        chat = path
    elif path.endswith("/v1"):
        chat = path + "/chat/completions"
    else:
        chat = path + CHAT_PATH
    return Target(url=url, scheme=parts.scheme, host=host, port=port, chat_path=chat)


def _connection(t: Target, timeout: float) -> http.client.HTTPConnection:
    if t.scheme == "https":
        return http.client.HTTPSConnection(t.host, t.port, timeout=timeout)
    return http.client.HTTPConnection(t.host, t.port, timeout=timeout)


# ---- workload ---------------------------------------------------------------------------------------------
def synth_text(n_tokens: int, seed: int) -> str:
    """~n_tokens common words, the same for the same seed on every machine."""
    x = (seed * 2654435761 + 97) % (1 << 31)
    out = []
    for _ in range(max(0, n_tokens)):
        x = (1103515245 * x + 12345) % (1 << 31)
        out.append(WORDS[(x >> 8) % len(WORDS)])
    return " ".join(out)


@dataclass
class Conversation:
    """First-turn messages, then the follow-up user texts sent one by one with the history."""

    messages: list[dict]
    followups: list[str] = field(default_factory=list)

    @property
    def turns(self) -> int:
        return 1 + len(self.followups)


def _with_system(messages: list[dict], system: str | None) -> list[dict]:
    if not system:
        return [dict(m) for m in messages]
    msgs = [dict(m) for m in messages]
    if msgs and msgs[0].get("role") == "system" and isinstance(msgs[0].get("content"), str):
        msgs[0]["content"] = system + "\n\n" + msgs[0]["content"]
        return msgs
    return [{"role": "system", "content": system}] + msgs


def load_dataset(path: str) -> list[list[dict]]:
    """JSONL: each line {"messages": [...]} or {"prompt": "..."}; ValueError names a bad line."""
    out: list[list[dict]] = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"{path}:{n}: not JSON ({exc})") from None
            if isinstance(obj, dict) and isinstance(obj.get("messages"), list) and obj["messages"]:
                out.append(obj["messages"])
            elif isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
                out.append([{"role": "user", "content": obj["prompt"]}])
            else:
                raise ValueError(f"{path}:{n}: expected {{\"messages\": [...]}} or {{\"prompt\": \"...\"}}")
    if not out:
        raise ValueError(f"{path}: no requests in the dataset")
    return out


def shared_system(shared_prefix: int) -> str | None:
    """The system prompt every request starts with (`--shared-prefix`), or None."""
    return synth_text(shared_prefix, seed=-1) if shared_prefix > 0 else None


def build_workload(n_requests: int, prompt_len: int, multi_turn: int, turn_len: int, system: str | None,
                   dataset: list[list[dict]] | None) -> list[Conversation]:
    """Conversations whose turns add up to exactly n_requests HTTP requests."""
    convs: list[Conversation] = []
    left, i = n_requests, 0
    while left > 0:
        if dataset is not None:
            first = _with_system(dataset[i % len(dataset)], system)
        else:
            text = f"Request {i}: " + synth_text(max(1, prompt_len - 3), seed=i)
            first = _with_system([{"role": "user", "content": text}], system)
        k = min(multi_turn, left - 1)
        follow = [f"Turn {t + 1}: " + synth_text(max(1, turn_len - 3), seed=1_000_003 * (t + 1) + i)
                  for t in range(k)]
        convs.append(Conversation(first, follow))
        left -= 1 + k
        i += 1
    return convs


# ---- one streamed request ------------------------------------------------------------------------------
@dataclass
class Record:
    """What one request did; times are time.perf_counter() seconds."""

    start: float
    end: float = 0.0
    ok: bool = False
    status: int | None = None
    error: str | None = None
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    chunks: int = 0
    text: str = ""
    prompt_chars: int = 0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    turn: int = 1  # which turn of its conversation it was (1: the first; later ones re-send the history)

    @property
    def e2e(self) -> float:
        return self.end - self.start

    def out_tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else self.chunks

    def in_tokens(self) -> int:
        return self.prompt_tokens if self.prompt_tokens is not None else max(1, round(self.prompt_chars / 4))

    def tpot(self) -> float | None:
        """Seconds per output token after the first (undefined for a single token)."""
        n = self.out_tokens()
        if not self.ok or self.ttft is None or n <= 1:
            return None
        return max(0.0, self.e2e - self.ttft) / (n - 1)


def _error_text(status: int, body: bytes, location: str | None) -> str:
    if 300 <= status < 400:
        return f"HTTP {status} redirect to {location!r} (not followed)"
    try:
        err = json.loads(body)
        msg = err["error"]["message"] if isinstance(err.get("error"), dict) else err.get("error") or err
    except Exception:
        msg = body.decode("utf-8", "replace")
    return f"HTTP {status}: {str(msg)[:200]}"


def _read_usage(obj: dict, rec: Record) -> None:
    usage = obj.get("usage")
    if isinstance(usage, dict):
        if isinstance(usage.get("prompt_tokens"), int):
            rec.prompt_tokens = usage["prompt_tokens"]
        if isinstance(usage.get("completion_tokens"), int):
            rec.completion_tokens = usage["completion_tokens"]
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            rec.cached_tokens = details["cached_tokens"]
    timings = obj.get("timings")  # llama-server: prompt tokens taken from its cache
    if rec.cached_tokens is None and isinstance(timings, dict) and isinstance(timings.get("cache_n"), int):
        rec.cached_tokens = timings["cache_n"]


def stream_chat(target: Target, body: dict, headers: dict[str, str], deadline: float) -> Record:
    """POST one streaming chat request and time its chunks. Never raises; never outlives `deadline`."""
    payload = json.dumps(body).encode("utf-8")
    rec = Record(start=time.perf_counter(), prompt_chars=sum(len(str(m.get("content") or ""))
                                                             for m in body.get("messages", [])))
    conn = None
    try:
        remaining = deadline - rec.start
        if remaining <= 0:
            raise TimeoutError("the --timeout deadline passed before the request was sent")
        conn = _connection(target, min(CONNECT_TIMEOUT_S, remaining))
        conn.connect()
        sock = conn.sock
        sock.settimeout(max(0.001, deadline - time.perf_counter()))
        conn.request("POST", target.chat_path, body=payload, headers={
            **headers, "Content-Type": "application/json", "Accept": "text/event-stream"})
        resp = conn.getresponse()
        rec.status = resp.status
        if resp.status != 200:
            rec.error = _error_text(resp.status, resp.read(MAX_ERROR_BODY), resp.getheader("Location"))
            return rec
        last = None
        done = finished = False
        while True:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                raise TimeoutError("the --timeout deadline passed mid-stream")
            sock.settimeout(remaining)
            line = resp.readline(MAX_LINE)
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue  # blank separators, comments (":"), event names
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                break
            now = time.perf_counter()
            obj = json.loads(data)
            if not isinstance(obj, dict):
                continue
            if "error" in obj:
                err = obj["error"]
                rec.error = "in-stream error: " + str(err.get("message") if isinstance(err, dict) else err)[:200]
                break
            _read_usage(obj, rec)
            for choice in obj.get("choices") or []:
                delta = choice.get("delta") or {}
                content = delta.get("content") or ""
                if content or delta.get("reasoning_content") or delta.get("reasoning") or delta.get("tool_calls"):
                    if last is None:
                        rec.ttft = now - rec.start
                    else:
                        rec.itl.append(now - last)
                    last = now
                    rec.chunks += 1
                    rec.text += content
                if choice.get("finish_reason"):
                    finished = True
        rec.end = time.perf_counter()
        if rec.error is None:
            if done or finished:
                rec.ok = True
                if rec.ttft is None:  # nothing visible came (e.g. EOS first): the first token was the end
                    rec.ttft = rec.e2e
            else:
                rec.error = "stream ended without [DONE] or a finish_reason"
    except Exception as exc:  # noqa: BLE001 - every failure is a failed request, reported by kind
        if isinstance(exc, TimeoutError) and time.perf_counter() >= deadline - 0.01:
            msg = str(exc)
            rec.error = msg if msg.startswith("the --timeout") else \
                "the --timeout deadline passed before the response ended"
        else:
            rec.error = f"{type(exc).__name__}: {str(exc)[:200]}"
    finally:
        if not rec.end:
            rec.end = time.perf_counter()
        if conn is not None:
            conn.close()
    return rec


# ---- statistics ----------------------------------------------------------------------------------------
def percentile(sorted_vals: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if len(sorted_vals) == 1:
        return sorted_vals[0]
    k = (len(sorted_vals) - 1) * p / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (k - lo)


def stats_ms(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {k: None for k in STAT_KEYS}
    v = sorted(values)
    ms = lambda x: round(1000.0 * x, 3)  # noqa: E731
    return {"mean": ms(sum(v) / len(v)), "median": ms(percentile(v, 50)), "p90": ms(percentile(v, 90)),
            "p99": ms(percentile(v, 99)), "max": ms(v[-1])}


def peak_overlap(records: list[Record]) -> int:
    events = sorted([(r.start, 1) for r in records] + [(r.end, -1) for r in records], key=lambda e: (e[0], e[1]))
    cur = peak = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    return peak


def summarize(records: list[Record], requested: int, not_sent: int, t0: float, slo_ttft: float | None,
              slo_tpot: float | None) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    end = max((r.end for r in records), default=time.perf_counter())
    duration = max(1e-9, end - t0)
    tin = sum(r.in_tokens() for r in ok)
    tout = sum(r.out_tokens() for r in ok)
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            errors[r.error or "unknown"] = errors.get(r.error or "unknown", 0) + 1
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    out: dict[str, Any] = {
        "requests": requested, "completed": len(ok), "failed": requested - len(ok) - not_sent, "not_sent": not_sent,
        "errors": dict(sorted(errors.items(), key=lambda kv: -kv[1])[:10]),
        "duration_s": round(duration, 6),
        "request_throughput": round(len(ok) / duration, 4),
        "input_tokens": tin, "output_tokens": tout,
        "input_tok_s": round(tin / duration, 3), "output_tok_s": round(tout / duration, 3),
        "total_tok_s": round((tin + tout) / duration, 3),
        "usage_reported": sum(1 for r in ok if r.completion_tokens is not None and r.prompt_tokens is not None),
        "ttft_ms": stats_ms([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": stats_ms([t for t in (r.tpot() for r in ok) if t is not None]),
        "itl_ms": stats_ms([x for r in ok for x in r.itl]),
        "e2e_ms": stats_ms([r.e2e for r in ok]),
        "peak_concurrency": peak_overlap(records),
        "cached_tokens": sum(cached) if cached else None,
        "cached_fraction": round(sum(cached) / tin, 4) if cached and tin else None,
    }
    out["tokens_estimated"] = out["usage_reported"] < len(ok)
    out["by_turn"] = by_turn(ok)
    if slo_ttft is None and slo_tpot is None:
        out["goodput"] = None
    else:
        good = 0
        for r in ok:
            tpot = r.tpot()
            if (slo_ttft is None or (r.ttft is not None and r.ttft <= slo_ttft)) and \
                    (slo_tpot is None or tpot is None or tpot <= slo_tpot):
                good += 1
        out["goodput"] = {"slo_ttft_s": slo_ttft, "slo_tpot_s": slo_tpot, "requests": good,
                          "fraction": round(good / requested, 4) if requested else None,
                          "req_s": round(good / duration, 4)}
    return out


def by_turn(ok: list[Record]) -> list[dict[str, Any]] | None:
    """Multi-turn runs: per turn number, the requests, their TTFT and their prompt and cached tokens.

    Why apart: a later turn re-sends the whole history, so its time to first token says how much of that
    history the server reuses (a server that re-processes it shows TTFT growing with the turn); the
    run's overall TTFT mixes the cold first turns in. None for single-turn runs."""
    turns = sorted({r.turn for r in ok})
    if len(turns) < 2:
        return None
    out = []
    for t in turns:
        rs = [r for r in ok if r.turn == t]
        cached = [r.cached_tokens for r in rs if r.cached_tokens is not None]
        out.append({"turn": t, "requests": len(rs), "ttft_ms": stats_ms([r.ttft for r in rs if r.ttft is not None]),
                    "prompt_tokens": round(sum(r.in_tokens() for r in rs) / len(rs), 1),
                    "cached_tokens": round(sum(cached) / len(cached), 1) if cached else None})
    return out


# ---- /metrics (Pantheon, optional) ------------------------------------------------------------------------
def scrape_metrics(target: Target, headers: dict[str, str], model: str, deadline: float) -> dict[str, float] | None:
    """Pantheon's counters for `model` from the same host's /metrics, or None when there are none."""
    from pantheon.serving.metrics import (
        GENERATION_TOKENS_TOTAL,
        PREFIX_HITS_TOTAL,
        PREFIX_MISSES_TOTAL,
        PREFIX_REUSED_TOKENS_TOTAL,
        PROMPT_TOKENS_TOTAL,
        REQUESTS_TOTAL,
    )
    names = {REQUESTS_TOTAL: "requests", PROMPT_TOKENS_TOTAL: "prompt_tokens",
             GENERATION_TOKENS_TOTAL: "generation_tokens", PREFIX_HITS_TOTAL: "prefix_hits",
             PREFIX_MISSES_TOTAL: "prefix_misses", PREFIX_REUSED_TOKENS_TOTAL: "reused_tokens"}
    timeout = min(5.0, deadline - time.perf_counter())
    if timeout <= 0:
        return None
    conn = _connection(target, timeout)
    try:
        conn.request("GET", "/metrics", headers=headers)
        resp = conn.getresponse()
        if resp.status != 200:
            return None
        text = resp.read(16 << 20).decode("utf-8", "replace")
        from prometheus_client.parser import text_string_to_metric_families
        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                key = names.get(s.name)
                if key is None:
                    continue
                if "model" in s.labels and s.labels["model"] != model:
                    continue
                if key == "requests" and (s.labels.get("route") != CHAT_PATH or s.labels.get("status") != "200"):
                    continue
                out[key] = out.get(key, 0.0) + s.value
        return out or None
    except Exception:  # noqa: BLE001 - /metrics is optional; a server without it is still benchmarked
        return None
    finally:
        conn.close()


# ---- one run: one server, one concurrency level ---------------------------------------------------------
@dataclass
class Plan:
    model: str
    gen: int
    ignore_eos: bool
    headers: dict[str, str]
    system: str | None
    convs: list[Conversation]
    requests: int
    slo_ttft: float | None
    slo_tpot: float | None
    progress: bool
    scrape: bool
    extra: dict[str, Any] = field(default_factory=dict)  # --extra-body: merged into every request


def _body(plan: Plan, messages: list[dict], max_tokens: int) -> dict:
    body: dict[str, Any] = {"model": plan.model, "messages": messages, "max_tokens": max_tokens,
                            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    if plan.ignore_eos:
        body["ignore_eos"] = True
    body.update(plan.extra)
    return body


def run_level(target: Target, plan: Plan, concurrency: int, deadline: float, label: str) -> dict[str, Any]:
    """Send every conversation of the plan with `concurrency` workers; summarize what came back."""
    todo: queue.SimpleQueue[Conversation] = queue.SimpleQueue()
    for c in plan.convs:
        todo.put(c)
    records: list[Record] = []
    not_sent = [0]
    lock = threading.Lock()
    bar = None
    if plan.progress:
        from tqdm import tqdm
        bar = tqdm(total=plan.requests, desc=label, unit="req", file=sys.stderr, leave=False, mininterval=0.5)

    def worker() -> None:
        while True:
            try:
                conv = todo.get_nowait()
            except queue.Empty:
                return
            messages = [dict(m) for m in conv.messages]
            for turn in range(conv.turns):
                if time.perf_counter() >= deadline:
                    with lock:
                        not_sent[0] += conv.turns - turn
                    break
                rec = stream_chat(target, _body(plan, messages, plan.gen), plan.headers, deadline)
                rec.turn = turn + 1
                with lock:
                    records.append(rec)
                    if bar is not None:
                        bar.update(1)
                if not rec.ok:
                    with lock:
                        not_sent[0] += conv.turns - turn - 1
                    break
                if turn < len(conv.followups):
                    messages += [{"role": "assistant", "content": rec.text},
                                 {"role": "user", "content": conv.followups[turn]}]

    before = scrape_metrics(target, plan.headers, plan.model, deadline) if plan.scrape else None
    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, name=f"bench-{i}", daemon=True)
               for i in range(min(concurrency, len(plan.convs)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.perf_counter()) + 5.0)
    if bar is not None:
        bar.close()
    with lock:
        recs = list(records)
        skipped = not_sent[0]
    out = {"server": None, "url": target.url, "concurrency": concurrency, "round": 0,
           **summarize(recs, plan.requests, skipped, t0, plan.slo_ttft, plan.slo_tpot)}
    want = {"requests": float(sum(1 for r in recs if r.status == 200)),
            "generation_tokens": float(sum(r.completion_tokens or 0 for r in recs if r.ok))}
    after = _settled_scrape(target, plan, before, want, deadline) if before is not None else None
    out["server_metrics"] = {k: after[k] - before.get(k, 0.0) for k in after} if before and after else None
    return out


def _settled_scrape(target: Target, plan: Plan, before: dict[str, float], want: dict[str, float],
                    deadline: float) -> dict[str, float] | None:
    """Scrape again until the counters have grown by at least `want` (a server may count a request
    only once its stream is closed, just after the client saw [DONE]); at most METRICS_SETTLE_S."""
    until = min(deadline, time.perf_counter() + METRICS_SETTLE_S)
    while True:
        after = scrape_metrics(target, plan.headers, plan.model, deadline)
        if after is None or time.perf_counter() >= until or \
                all(after.get(k, 0.0) - before.get(k, 0.0) >= v for k, v in want.items()):
            return after
        time.sleep(0.05)


def warm_up(target: Target, plan: Plan, n: int, deadline: float) -> None:
    """Requests that are not measured: first-call costs (connections, lazy init) stay out of the figures."""
    for i in range(n):
        msgs = _with_system([{"role": "user", "content": "Warm-up " + synth_text(16, seed=-2 - i)}], plan.system)
        stream_chat(target, _body(plan, msgs, min(plan.gen, 8)), plan.headers, deadline)


# ---- comparison ---------------------------------------------------------------------------------------
def _figure(run: dict, path: tuple[str, ...]) -> float | None:
    v: Any = run
    for k in path:
        if not isinstance(v, dict):
            return None
        v = v.get(k)
    return float(v) if isinstance(v, (int, float)) else None


def _median(vals: list[float]) -> float | None:
    return percentile(sorted(vals), 50) if vals else None


def compare(runs: list[dict], levels: list[int]) -> list[dict]:
    """Per level: each key figure's median across rounds for A and B, and the ratio B/A."""
    out = []
    for c in levels:
        entry: dict[str, Any] = {"concurrency": c, "a": {}, "b": {}, "ratio": {}}
        for name, path in KEY_FIGURES:
            for side in ("a", "b"):
                vals = [v for r in runs if r["concurrency"] == c and r["server"] == side
                        for v in [_figure(r, path)] if v is not None]
                entry[side][name] = None if (m := _median(vals)) is None else round(m, 4)
            a, b = entry["a"][name], entry["b"][name]
            entry["ratio"][name] = round(b / a, 4) if a and b is not None else None
        out.append(entry)
    return out


def scaling(runs: list[dict], levels: list[int], rounds: int) -> list[dict]:
    """Per server and level: output tok/s against the first level's in the same round.

    The figure a batching server is judged by ("8 streams give N times one stream's tokens"). Each
    round's ratio divides runs made minutes apart, not a fast round by a slow one; the median of
    those ratios is the headline, with its spread across rounds beside it.
    """
    out = []
    tok_s = {(r["server"], r["concurrency"], r["round"]): r["output_tok_s"] for r in runs if r["completed"] > 0}
    for side in sorted({r["server"] for r in runs}):
        base = [tok_s.get((side, levels[0], rnd)) for rnd in range(rounds)]
        for c in levels:
            per_round = [tok_s.get((side, c, rnd)) for rnd in range(rounds)]
            ratios = [v / b for v, b in zip(per_round, base) if v is not None and b]
            vals = [v for v in per_round if v is not None]
            out.append({"server": side, "concurrency": c, "output_tok_s": per_round,
                        "output_tok_s.median": None if not vals else round(_median(vals), 3),
                        "vs_first_level": [round(x, 4) for x in ratios],
                        "vs_first_level.median": None if not ratios else round(_median(ratios), 4)})
    return out


# ---- output --------------------------------------------------------------------------------------------
def _fmt(v: Any) -> str:
    return "-" if v is None else f"{v:.1f}" if isinstance(v, float) else str(v)


def print_run(r: dict) -> None:
    print(f"server {r['server'].upper()} {r['url']}  concurrency {r['concurrency']}  round {r['round'] + 1}")
    print(f"  requests {r['requests']}: completed {r['completed']}, failed {r['failed']}, not sent {r['not_sent']} "
          f"in {r['duration_s']:.2f} s (peak concurrency {r['peak_concurrency']})")
    est = " (estimated: the server sent no usage)" if r["tokens_estimated"] else ""
    print(f"  throughput {r['request_throughput']:.3f} req/s; tok/s in {r['input_tok_s']:.1f} out "
          f"{r['output_tok_s']:.1f} total {r['total_tok_s']:.1f}; tokens in {r['input_tokens']} "
          f"out {r['output_tokens']}{est}")
    print(f"  {'ms':<6}" + "".join(f"{k:>10}" for k in STAT_KEYS))
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        print(f"  {key[:-3].upper():<6}" + "".join(f"{_fmt(r[key][k]):>10}" for k in STAT_KEYS))
    if r["cached_tokens"] is not None:
        print(f"  prefix cache: {r['cached_tokens']} of {r['input_tokens']} prompt tokens cached "
              f"({100 * (r['cached_fraction'] or 0):.1f}%)")
    for t in r.get("by_turn") or ():
        print(f"  turn {t['turn']}: {t['requests']} requests, TTFT median {_fmt(t['ttft_ms']['median'])} ms "
              f"p90 {_fmt(t['ttft_ms']['p90'])} ms, prompt {_fmt(t['prompt_tokens'])} tokens "
              f"(cached {_fmt(t['cached_tokens'])})")
    sm = r.get("server_metrics")
    if sm:
        print("  server /metrics deltas: " + ", ".join(f"{k} {v:g}" for k, v in sorted(sm.items())))
    g = r.get("goodput")
    if g:
        print(f"  goodput: {g['requests']}/{r['requests']} requests met TTFT<={g['slo_ttft_s']} s "
              f"TPOT<={g['slo_tpot_s']} s ({g['req_s']:.3f} req/s)")
    for msg, n in r["errors"].items():
        print(f"  error x{n}: {msg}")


def print_scaling(scale: list[dict], rounds: int) -> None:
    first = scale[0]["concurrency"]
    print(f"\noutput tok/s by concurrency, and against concurrency {first} in the same round "
          f"(median over {rounds} round{'s' if rounds > 1 else ''})")
    for e in scale:
        per = " ".join(_fmt(v) for v in e["output_tok_s"])
        ratios = " ".join(f"{x:.2f}" for x in e["vs_first_level"])
        med = e["vs_first_level.median"]
        print(f"  {e['server'].upper()} c={e['concurrency']:<5} tok/s {per:<24} x{first}: "
              f"{'-' if med is None else format(med, '.2f')} ({ratios})")


def print_comparison(comp: list[dict], url_a: str, url_b: str, rounds: int) -> None:
    print(f"\nB/A ratios, medians over {rounds} rounds (A = {url_a}, B = {url_b}); "
          "above 1 is better for B in req/s, tok/s and goodput, worse in latencies")
    names = [n for n, _ in KEY_FIGURES]
    print(f"{'conc':>5}" + "".join(f"{n:>20}" for n in names))
    for e in comp:
        print(f"{e['concurrency']:>5}" + "".join(
            f"{'-' if e['ratio'][n] is None else format(e['ratio'][n], '.3f'):>20}" for n in names))


# ---- entry point ---------------------------------------------------------------------------------------
def _levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers") from None
    if not levels or any(c < 1 or c > 4096 for c in levels):
        raise argparse.ArgumentTypeError("concurrency levels must be in [1, 4096]")
    return levels


def _json_object(text: str) -> dict[str, Any]:
    try:
        obj = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return obj


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pantheon bench serve",
                                 description="Streaming load generator for OpenAI-compatible chat servers.")
    ap.add_argument("--url", required=True, help="server base URL (or .../v1, or the full chat path)")
    ap.add_argument("--model", required=True, help="model name sent in each request")
    ap.add_argument("--concurrency", type=_levels, default=[1, 8], help="comma-separated levels (default 1,8)")
    ap.add_argument("--requests", type=int, default=32, help="requests per level and round (default 32)")
    ap.add_argument("--prompt-len", type=int, default=None, help="synthetic prompt tokens (default 256)")
    ap.add_argument("--gen", type=int, default=64, help="max_tokens per request (default 64)")
    ap.add_argument("--dataset", help="JSONL of {\"messages\": [...]} or {\"prompt\": \"...\"}")
    ap.add_argument("--shared-prefix", type=int, default=0, help="tokens of a system prompt common to all requests")
    ap.add_argument("--multi-turn", type=int, default=0, help="follow-up turns per conversation (history re-sent)")
    ap.add_argument("--turn-len", type=int, default=None, help="tokens per follow-up (default prompt-len/4)")
    ap.add_argument("--compare", metavar="URL2", help="second server: alternate A B A B and print B/A ratios")
    ap.add_argument("--rounds", type=int, default=None, help="rounds per level (default 1; 2 with --compare)")
    ap.add_argument("--slo-ttft", type=float, default=None, help="goodput SLO: time to first token, seconds")
    ap.add_argument("--slo-tpot", type=float, default=None, help="goodput SLO: time per output token, seconds")
    ap.add_argument("--api-key", default=None, help="sent as Authorization: Bearer KEY")
    ap.add_argument("--timeout", type=float, default=1800.0, help="overall deadline for the whole run, s")
    ap.add_argument("--warmup", type=int, default=1, help="unmeasured requests per server first (default 1)")
    ap.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (servers that support it)")
    ap.add_argument("--extra-body", type=_json_object, default={},
                    help="a JSON object merged into every request body (e.g. '{\"logprobs\": true, \"top_logprobs\": 5}')")
    ap.add_argument("--allow-remote", action="store_true", help="allow a non-loopback URL")
    ap.add_argument("--no-metrics", action="store_true", help="do not read the server's /metrics")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    return ap


def _check(a: argparse.Namespace) -> str | None:
    if a.requests < 1 or a.requests > 1_000_000:
        return "--requests must be in [1, 1000000]"
    if a.gen < 1:
        return "--gen must be at least 1"
    if a.dataset and a.prompt_len is not None:
        return "--prompt-len and --dataset are exclusive"
    if a.prompt_len is not None and a.prompt_len < 1:
        return "--prompt-len must be at least 1"
    if a.shared_prefix < 0 or a.multi_turn < 0 or (a.turn_len is not None and a.turn_len < 1):
        return "--shared-prefix and --multi-turn must be >= 0, --turn-len >= 1"
    if a.rounds is not None and (a.rounds < 1 or (a.compare and a.rounds < 2)):
        return "--rounds must be at least 1 (2 with --compare)"
    if a.timeout <= 0 or a.warmup < 0:
        return "--timeout must be positive and --warmup >= 0"
    for slo in (a.slo_ttft, a.slo_tpot):
        if slo is not None and slo <= 0:
            return "SLOs are positive numbers of seconds"
    return None


def main(argv: list[str]) -> int:
    """`pantheon bench serve ...`: 0 when every run completed a request, 1 otherwise, 2 on bad arguments."""
    argv = list(argv)
    if argv[:1] == ["--"]:  # `pantheon bench serve -- --url ...` hands the separator through
        argv = argv[1:]
    a = build_parser().parse_args(argv)
    problem = _check(a)
    targets: list[Target] = []
    if problem is None:
        try:
            targets.append(parse_target(a.url, a.allow_remote))
            if a.compare:
                targets.append(parse_target(a.compare, a.allow_remote))
        except ValueError as exc:
            problem = str(exc)
    dataset = None
    if problem is None and a.dataset:
        try:
            dataset = load_dataset(a.dataset)
        except (OSError, ValueError) as exc:
            problem = str(exc)
    if problem is not None:
        print(f"pantheon bench serve: {problem}", file=sys.stderr)
        return 2

    prompt_len = a.prompt_len if a.prompt_len is not None else 256
    turn_len = a.turn_len if a.turn_len is not None else max(4, prompt_len // 4)
    rounds = a.rounds or (2 if a.compare else 1)
    headers = {"User-Agent": "pantheon-bench"}
    if a.api_key:
        headers["Authorization"] = f"Bearer {a.api_key}"
    system = shared_system(a.shared_prefix)
    plan = Plan(model=a.model, gen=a.gen, ignore_eos=a.ignore_eos, headers=headers, system=system,
                convs=build_workload(a.requests, prompt_len, a.multi_turn, turn_len, system, dataset),
                requests=a.requests, slo_ttft=a.slo_ttft, slo_tpot=a.slo_tpot, progress=not a.no_progress,
                scrape=not a.no_metrics, extra=a.extra_body)
    deadline = time.perf_counter() + a.timeout
    sides = list(zip("ab", targets))
    for _, t in sides:
        warm_up(t, plan, a.warmup, deadline)
    runs: list[dict] = []
    # Rounds outermost: each round visits every level (and every server), so drift of the machine
    # between the first and last round hits the levels alike and each round gives its own ratios.
    for r in range(rounds):
        for c in a.concurrency:
            for side, t in sides:
                label = f"{side.upper()} c={c} r{r + 1}" if a.compare else f"c={c}"
                run = run_level(t, plan, c, deadline, label)
                run["server"], run["round"] = side, r
                runs.append(run)
                if not a.json:
                    print_run(run)
    comparison = compare(runs, a.concurrency) if a.compare else None
    scale = scaling(runs, a.concurrency, rounds) if len(a.concurrency) > 1 else None
    if a.json:
        config = {"url": a.url, "compare_url": a.compare, "model": a.model, "concurrency": a.concurrency,
                  "requests": a.requests, "rounds": rounds, "prompt_len": None if dataset else prompt_len,
                  "dataset": a.dataset, "gen": a.gen, "shared_prefix": a.shared_prefix, "multi_turn": a.multi_turn,
                  "turn_len": turn_len if a.multi_turn else None, "slo_ttft_s": a.slo_ttft,
                  "slo_tpot_s": a.slo_tpot, "ignore_eos": a.ignore_eos, "timeout_s": a.timeout,
                  "warmup": a.warmup, "extra_body": a.extra_body}
        print(json.dumps({"bench": "serve", "version": 1, "config": config, "results": runs,
                          "comparison": comparison, "scaling": scale}))
    else:
        if scale is not None:
            print_scaling(scale, rounds)
        if comparison is not None:
            print_comparison(comparison, a.url, a.compare, rounds)
    return 0 if all(r["completed"] > 0 for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
