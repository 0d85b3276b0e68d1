#!/usr/bin/env python3
"""Reliability benchmark for a Pantheon server (issues 22 and 31): hostile inputs, slow clients, huge bodies,
disconnect storms, queue overflow, unload under load, expensive inputs beside a running stream, a memory
soak and greedy identity.

The tool starts its own server (`python -m pantheon.cli serve --model M --host 127.0.0.1 --port P`),
attacks it phase by phase and reports what a client saw: answers by status, 5xx and hangs (with the
exact inputs, shortened), non-JSON error bodies, how long `GET /` waited while each attack ran, the
worker's RSS growth per 1000 requests, and whether greedy answers stayed identical.

    .venv/bin/python tools/reliability_bench.py --quick --model tests/fixtures/tiny/llama.gguf
    .venv/bin/python tools/reliability_bench.py --json out.json --markdown       # smollm2-135m, ~35 min

Phases (`--phases` picks a subset, in this order): fuzz, slow-body, large-body, disconnects, overflow,
unload, protocol, tokenizer, amplification, embeddings, grammar, truncation, generations, embed-many,
count-tokens, responses-store, images, soak, greedy. The greedy prompts are
answered once, alone, before the first phase.

The five phases of issue 31 send inputs that cost the server far more than the client, or test one
protocol rule, while a witness stream runs (a plain streaming chat, restarted back to back, plus a
small plain chat every 2 s): protocol (Transfer-Encoding gzip + chunked, forced tool calls cut by
max_tokens, cache-scope collisions), tokenizer (/tokenize past 16k characters, /detokenize with 1M
ids), amplification (a 2.4 MB tools list with tool_choice required; echo + logprobs 20 + n 8),
embeddings (one request sized to the body limit) and grammar (schemas of 2k/5k/10k optional
properties; clients that leave after 3 s). Each reports every attack's status and time to answer,
GET / p50/p99/max, the witness's largest and p99 gap between SSE chunks, and how long the worker kept
burning CPU after the phase's clients were done or gone.

Design choices, and why:

* Loopback only. Every connection is opened by `open_socket`, which refuses any host but 127.0.0.1
  before a socket exists. No `requests`: it honours HTTP(S)_PROXY, which could send "local" traffic
  elsewhere; raw sockets and `http.client` never do.
* Bounded. Every socket has a timeout, every loop a count and a deadline, every phase a budget, and a
  watchdog ends the process (server included) if the whole run overruns its total budget.
* The server is ours: its own process group (start_new_session), a random admin key, PANTHEON_MODEL_DIR
  set to the model's directory, and it is killed as a group on every way out (finally, atexit,
  SIGTERM/SIGHUP handlers, and PR_SET_PDEATHSIG should this tool be SIGKILLed).
* Defects are data. A 5xx, a hang (no complete answer within --hang-s), a non-JSON error body, a
  connection closed without an answer or a worker restart is counted and an example kept; the tool
  never asserts, so a broken server gives a report, not a traceback.
* Reproducible. Hypothesis draws the fuzz inputs from --seed (no example database, no shrinking);
  every other random choice comes from random.Random(--seed).
* Admin fuzzing cannot unload or load anything real: its bodies name files that do not exist, and
  any drawn body that mentions the served model, a catalog name or an existing file is skipped.
* Sized to the model. Issue 31's inputs were sized for SmolLM2's 2048-token context; a smaller model
  would refuse them as too long before doing the expensive work, so prompts and embedding inputs are
  scaled to the context (`GET /v1/loads`) and the tokenizer's characters per token (`POST /tokenize`).

The six phases of issue 43 (truncation, generations, embed-many, count-tokens, responses-store, images)
replay that run's table, rows 1-6, at the issue's own sizes, beside the same witness; besides issue 31's
findings they report the worker's RSS not back within 10 % of its start after the phase (images runs
on a second server of its own, on the tiny Idefics3 fixture). docs/benchmarks.md lists their inputs.

Exit status: 0 when every phase ran and found nothing, 1 when something was found (5xx, hang, greedy
mismatch, worker restart; in the issue 31 phases also GET / p99 >= 1 s, a witness gap >= 1 s or a
witness or plain chat refused, Transfer-Encoding gzip accepted, tool-call markup in content, a
cache-scope collision, or a worker still working 5 s after its phase's clients were gone), 2 on bad
arguments or a server that would not start, 3 from the watchdog.
"""

from __future__ import annotations

import argparse
import atexit
import gzip
import http.client
import json
import os
import random
import resource
import secrets
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from hypothesis import HealthCheck, Phase, Verbosity, assume, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from a checkout: use this checkout's pantheon
    sys.path.insert(0, str(REPO))

from pantheon.bench.serve import percentile  # noqa: E402
from pantheon.config import load_settings  # noqa: E402
from pantheon.formats.catalog import CATALOG, DEFAULT_MODEL, resolve_model  # noqa: E402

LOOPBACK = "127.0.0.1"
CHAT = "/v1/chat/completions"
LOAD = "/admin/models/load"
UNLOAD = "/admin/models/unload"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"
PHASES = ("fuzz", "slow-body", "large-body", "disconnects", "overflow", "unload", "protocol", "tokenizer",
          "amplification", "embeddings", "grammar", "truncation", "generations", "embed-many", "count-tokens",
          "responses-store", "images", "soak", "greedy")
CONNECT_S = 5.0
PROBE_INTERVAL_S = 0.1  # how often GET / is timed during a phase
PROBE_TIMEOUT_S = 5.0  # a GET / not answered by then counts as failed
MAX_READ = 1 << 20  # longest answer kept in memory
MAX_LINE = 1 << 20  # longest SSE line read
MAX_EXAMPLES = 6  # examples kept per kind of finding
BODY_LIMIT = 4 * 1024 * 1024  # the server's default PANTHEON_MAX_BODY_BYTES
SLOW_BODY_CL = 126  # slow-body: the Content-Length announced ...
SLOW_BODY_SENT = b'{"messages'  # ... and the 10 bytes actually sent
SETTLE_S = 30.0  # longest wait for running/queued requests to drain after a storm
GREEDY_PROMPTS = (
    "What is the capital of France?",
    "Write one sentence about rivers.",
    "List three prime numbers.",
    "Explain in one sentence what a CPU does.",
)
# Server settings the tool must not inherit from the caller's shell (a stray API key would 401 it all).
CLEARED_ENV = ("PANTHEON_API_KEY", "PANTHEON_ADMIN_KEY", "PANTHEON_MODEL_DIR", "PANTHEON_MODELS",
               "PANTHEON_CORS_ORIGINS", "PANTHEON_TEST_PRESSURE")


# ---- safety: loopback only ------------------------------------------------------------------------------
def require_loopback(host: str) -> str:
    """The only host this tool ever talks to is 127.0.0.1; anything else raises before a socket exists.

    Literal comparison on purpose: no name is resolved (a hosts file or DNS cannot redirect it), and
    other loopback spellings are refused too, so what the tool promises is simple to check.
    """
    if host != LOOPBACK:
        raise ValueError(f"refusing to connect to {host!r}: this tool only talks to {LOOPBACK}")
    return host


def open_socket(host: str, port: int, timeout: float) -> socket.socket:
    """A TCP connection to the (loopback) server; every connection of the tool is opened here."""
    require_loopback(host)
    if not 0 < port < 65536:
        raise ValueError(f"bad port {port}")
    return socket.create_connection((host, port), timeout=max(0.001, timeout))


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


# ---- one HTTP exchange on a raw socket ------------------------------------------------------------------
@dataclass
class Answer:
    """What came back for one request.

    outcome: "answered" (a status line and a complete body, or the server closed after it), "closed"
    (closed or reset before any status line), "hang" (nothing complete within the deadline),
    "connect_failed", or, set by the issue 31 phases, "left" (a client that left on purpose) and
    "still streaming" (an answer still arriving at our deadline: slow, not stuck).
    """

    status: int | None
    headers: dict[str, str]
    body: bytes
    elapsed: float
    outcome: str
    error: str | None = None

    @property
    def kind(self) -> str:
        """"2xx".."5xx" for an answer, else the outcome: the key every tally counts by."""
        return f"{self.status // 100}xx" if self.outcome == "answered" and self.status else self.outcome

    def json(self) -> Any:
        try:
            return json.loads(self.body)
        except ValueError:
            return None

    def json_error(self) -> bool:
        """An error body of the documented shape: JSON with an "error" object carrying a message."""
        if not self.headers.get("content-type", "").startswith("application/json"):
            return False
        obj = self.json()
        return isinstance(obj, dict) and isinstance(obj.get("error"), dict) and bool(obj["error"].get("message"))

    def message(self) -> str:
        obj = self.json()
        if isinstance(obj, dict) and isinstance(obj.get("error"), dict):
            return str(obj["error"].get("message"))[:200]
        return self.body[:200].decode("utf-8", "replace")


def http_request(method: str, path: str, port: int, body: bytes | None = None,
                 headers: dict[str, str] | list[tuple[str, str]] | None = None) -> bytes:
    """An HTTP/1.1 request as bytes, with Host, Connection: close and (with a body) Content-Length.
    `headers` may be a list of pairs, to send one header name twice."""
    lines = [f"{method} {path} HTTP/1.1", f"Host: {LOOPBACK}:{port}", "Connection: close"]
    pairs = headers.items() if isinstance(headers, dict) else headers or []
    lines += [f"{k}: {v}" for k, v in pairs]
    if body is not None:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1", "replace") + (body or b"")


def split_head(buf: bytes) -> tuple[int | None, dict[str, str], int] | None:
    """(status, lower-cased headers, offset of the body) of the first final response in `buf`, or None
    while the head is incomplete. 1xx interim responses (100 Continue) are skipped."""
    start = 0
    while True:
        end = buf.find(b"\r\n\r\n", start)
        if end < 0:
            return None
        lines = buf[start:end].split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        status = int(parts[1]) if len(parts) >= 2 and parts[0].startswith(b"HTTP/") and parts[1].isdigit() else None
        if status is not None and 100 <= status < 200:
            start = end + 4
            continue
        headers: dict[str, str] = {}
        for line in lines[1:]:
            k, _, v = line.partition(b":")
            headers[k.strip().lower().decode("latin-1")] = v.strip().decode("latin-1")
        return status, headers, end + 4


def _chunked(headers: dict[str, str]) -> bool:
    return "chunked" in headers.get("transfer-encoding", "").lower()


def body_complete(headers: dict[str, str], body: bytes) -> bool:
    """Whether the answer's body has fully arrived (else only the server closing tells)."""
    if _chunked(headers):
        return body.endswith(b"0\r\n\r\n")
    length = headers.get("content-length", "")
    return length.isdigit() and len(body) >= int(length)


def dechunk(body: bytes) -> bytes:
    """Decode a chunked body leniently (what arrived of it)."""
    out, i = bytearray(), 0
    while i < len(body):
        eol = body.find(b"\r\n", i)
        if eol < 0:
            break
        try:
            size = int(body[i:eol].split(b";")[0], 16)
        except ValueError:
            break
        if size == 0:
            break
        out += body[eol + 2:eol + 2 + size]
        i = eol + 2 + size + 2
    return bytes(out)


def _receive(sock: socket.socket, end: float, limit: int = MAX_READ) -> tuple[bytes, str]:
    """Read until the answer is complete, the server closes, `end`, or `limit` bytes: (bytes, how it stopped)."""
    buf = bytearray()
    while True:
        left = end - time.monotonic()
        if left <= 0:
            return bytes(buf), "timeout"
        sock.settimeout(left)
        try:
            data = sock.recv(65536)
        except socket.timeout:
            return bytes(buf), "timeout"
        except OSError:
            return bytes(buf), "reset"
        if not data:
            return bytes(buf), "eof"
        buf += data
        head = split_head(bytes(buf))
        if head is not None and body_complete(head[1], bytes(buf[head[2]:])):
            return bytes(buf), "complete"
        if len(buf) > limit:
            return bytes(buf), "complete"


def to_answer(buf: bytes, how: str, elapsed: float, send_error: str | None = None) -> Answer:
    head = split_head(buf)
    if head is None:
        outcome = "hang" if how == "timeout" else "closed"
        return Answer(None, {}, buf, elapsed, outcome, send_error or (buf[:80].decode("latin-1") or None))
    status, headers, at = head
    body = buf[at:]
    complete = how in ("complete", "eof") or body_complete(headers, body)
    if _chunked(headers):
        body = dechunk(body)
    return Answer(status, headers, body, elapsed, "answered" if complete else "hang", send_error)


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:200]


def exchange(port: int, raw: bytes | Callable[[], bytes], deadline_s: float, *, half_close: bool = False,
             gate: threading.Barrier | None = None, limit: int = MAX_READ) -> Answer:
    """Send `raw` on a new connection and read the answer; never raises, never outlives `deadline_s`.

    `half_close` shuts the sending side after the request, so a server waiting for more bytes (a
    truncated chunked body) sees the end of input instead of waiting for us. `gate` holds the send
    until every thread of a burst is connected. `raw` may be a function, so huge inputs exist only
    while they are sent. `limit`: the most answer bytes read (more ends the read as if complete).
    """
    t0 = time.monotonic()
    try:
        sock = open_socket(LOOPBACK, port, min(CONNECT_S, deadline_s))
    except OSError as exc:
        return Answer(None, {}, b"", time.monotonic() - t0, "connect_failed", _error_text(exc))
    with sock:
        if gate is not None:
            try:
                gate.wait(timeout=CONNECT_S * 2)
            except threading.BrokenBarrierError:
                pass
            t0 = time.monotonic()
        end = t0 + deadline_s
        data = raw() if callable(raw) else raw
        send_error = None
        try:
            sock.settimeout(max(0.001, end - time.monotonic()))
            sock.sendall(data)
            if half_close:
                sock.shutdown(socket.SHUT_WR)
        except OSError as exc:  # the server may answer (413) and close before reading everything
            send_error = "while sending: " + _error_text(exc)
        buf, how = _receive(sock, end, limit)
    return to_answer(buf, how, time.monotonic() - t0, send_error)


def preview(raw: bytes, limit: int = 240) -> str:
    """The request as it went on the wire, shortened for a report."""
    if len(raw) <= limit:
        return repr(raw)
    return repr(raw[:limit]) + f" ... ({len(raw)} bytes)"


# ---- streaming chat (http.client) ---------------------------------------------------------------------
@dataclass
class StreamResult:
    """One streamed chat request. outcome: "done" ([DONE] seen), "cancelled" (we closed it on purpose),
    "stopped" (the phase asked it to end), "capped" (we stopped reading at `max_bytes`), "closed" (EOF
    before [DONE]), "http_error" (not 200), "hang" (no line within the deadline) or "error" (connection-level).

    `times` holds when each SSE data line arrived (monotonic), so gaps between tokens can be read
    afterwards; `tool_calls` gathers the streamed tool-call deltas by index ({"name", "arguments"}).
    """

    status: int | None = None
    outcome: str = "error"
    text: str = ""
    chunks: int = 0
    max_gap: float = 0.0
    first_chunk_s: float | None = None
    elapsed: float = 0.0
    finish_reason: str | None = None
    error: str | None = None
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    times: list[float] = field(default_factory=list)
    nbytes: int = 0
    tool_calls: dict[int, dict[str, str]] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        if self.status is not None and self.status != 200:
            return f"{self.status // 100}xx"
        return self.outcome


def stream_answer(res: StreamResult) -> Answer:
    """A stream as an Answer, for tallies: one we cut on purpose after its 200 counts as answered."""
    if res.status is None and res.outcome == "cancelled":
        outcome = "cancelled"  # closed right after sending: there was nothing to answer yet
    elif res.status is not None and (res.status != 200 or res.outcome in ("done", "cancelled", "stopped", "capped")):
        outcome = "answered"
    else:
        outcome = "hang" if res.outcome == "hang" else "closed"
    return Answer(res.status, res.headers, res.body, res.elapsed, outcome, res.error)


def _abort(sock: socket.socket | None, rst: bool) -> None:
    """Close a connection the way a client that vanishes does: with a RST (rst) or a plain FIN."""
    if sock is None:
        return
    try:
        if rst:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        sock.close()
    except OSError:
        pass


def stream_chat(port: int, body: dict, deadline_s: float, *, cancel_after: int | None = None, rst: bool = False,
                stop: threading.Event | None = None, started: threading.Event | None = None, path: str = CHAT,
                max_bytes: int | None = None) -> StreamResult:
    """POST a streaming chat request and time its SSE chunks; never raises, never outlives `deadline_s`.

    `cancel_after=k` closes the connection after k data chunks (0: right after sending the request);
    `stop` ends the stream early when set (checked between chunks); `started` is set at the first chunk.
    `path` sends it elsewhere (/v1/completions streams the same way); `max_bytes` stops reading after
    that many bytes of SSE lines (outcome "capped"), so an answer that amplifies cannot fill our memory.
    """
    t0 = time.monotonic()
    end = t0 + deadline_s
    res = StreamResult()
    conn = http.client.HTTPConnection(require_loopback(LOOPBACK), port, timeout=min(CONNECT_S, deadline_s))
    sock = None
    try:
        conn.connect()
        sock = conn.sock
        sock.settimeout(max(0.001, end - time.monotonic()))
        conn.request("POST", path, body=json.dumps({**body, "stream": True}).encode(),
                     headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
        if cancel_after == 0:
            res.outcome = "cancelled"
            return res
        resp = conn.getresponse()
        res.status = resp.status
        res.headers = {k.lower(): v for k, v in resp.getheaders()}
        if resp.status != 200:
            res.body = resp.read(MAX_READ)
            res.outcome = "http_error"
            return res
        last = None
        while True:
            if stop is not None and stop.is_set():
                res.outcome = "stopped"
                return res
            left = end - time.monotonic()
            if left <= 0:
                res.outcome = "hang"
                return res
            sock.settimeout(left)
            line = resp.readline(MAX_LINE)
            if not line:
                res.outcome = "closed"
                return res
            res.nbytes += len(line)
            if max_bytes is not None and res.nbytes > max_bytes:
                res.outcome = "capped"
                return res
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            now = time.monotonic()
            if last is None:
                res.first_chunk_s = now - t0
                if started is not None:
                    started.set()
            else:
                res.max_gap = max(res.max_gap, now - last)
            last = now
            res.times.append(now)
            data = line[5:].strip()
            if data == b"[DONE]":
                res.outcome = "done"
                return res
            res.chunks += 1
            _read_chunk(data, res)
            if cancel_after is not None and res.chunks >= cancel_after:
                res.outcome = "cancelled"
                return res
    except socket.timeout:
        res.outcome = "hang"
    except (OSError, http.client.HTTPException) as exc:
        res.outcome, res.error = "error", _error_text(exc)
    finally:
        res.elapsed = time.monotonic() - t0
        if res.outcome in ("cancelled", "stopped", "capped"):
            _abort(sock, rst)
        conn.close()
    return res


def _read_chunk(data: bytes, res: StreamResult) -> None:
    try:
        obj = json.loads(data)
    except ValueError:
        res.error = "an SSE chunk is not JSON: " + data[:100].decode("utf-8", "replace")
        return
    if isinstance(obj, dict) and "error" in obj:
        res.error = "stream error: " + str(obj["error"])[:200]
    for choice in (obj.get("choices") or []) if isinstance(obj, dict) else []:
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
        res.text += _text(delta.get("content")) + _text(choice.get("text"))  # chat's delta; completions' text
        res.finish_reason = choice.get("finish_reason") or res.finish_reason
        for call in delta.get("tool_calls") or []:
            if not isinstance(call, dict):
                continue
            fn = call.get("function") if isinstance(call.get("function"), dict) else {}
            index = call.get("index") if isinstance(call.get("index"), int) else 0
            got = res.tool_calls.setdefault(index, {"name": "", "arguments": ""})
            got["name"] += _text(fn.get("name"))
            got["arguments"] += _text(fn.get("arguments"))


def _text(v: Any) -> str:
    return v if isinstance(v, str) else ""


# ---- figures -------------------------------------------------------------------------------------------
def stats_ms(values: Iterable[float]) -> dict[str, float | None]:
    """p50/p99/max of durations in seconds, as milliseconds."""
    vals = sorted(values)
    if not vals:
        return {"p50_ms": None, "p99_ms": None, "max_ms": None}
    return {"p50_ms": round(percentile(vals, 50) * 1e3, 1), "p99_ms": round(percentile(vals, 99) * 1e3, 1),
            "max_ms": round(vals[-1] * 1e3, 1)}


def slope(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope dy/dx, or None with fewer than 3 points or no spread in x."""
    if len(points) < 3:
        return None
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx <= 0:
        return None
    return sum((x - mx) * (y - my) for x, y in points) / sxx


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {sample name: value summed over its labels}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_part, _, value = line.rpartition(" ")
        name = name_part.split("{", 1)[0].strip()
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


class HealthProbe:
    """Times `GET /` every PROBE_INTERVAL_S in its own thread while a phase runs.

    The health probe is the figure every attack is judged by: an attack the server absorbs leaves it
    at a few milliseconds; one that starves the event loop shows in p99/max and in failures.
    """

    def __init__(self, port: int):
        self.port = port
        self.samples: list[tuple[float, float, bool]] = []  # (since start, seconds, answered 200)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="health-probe", daemon=True)
        self._t0 = 0.0

    def __enter__(self) -> "HealthProbe":
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(PROBE_TIMEOUT_S + 2)

    def _run(self) -> None:
        raw = http_request("GET", "/", self.port)
        while not self._stop.is_set():
            t = time.monotonic()
            ans = exchange(self.port, raw, PROBE_TIMEOUT_S)
            self.samples.append((t - self._t0, ans.elapsed, ans.status == 200 and ans.outcome == "answered"))
            self._stop.wait(max(0.0, PROBE_INTERVAL_S - (time.monotonic() - t)))

    def summary(self) -> dict[str, Any]:
        samples = list(self.samples)
        worst = max(samples, key=lambda smp: smp[1], default=None)
        return {"probes": len(samples), "failed": sum(1 for *_, ok in samples if not ok),
                **stats_ms(s for _, s, _ in samples),
                "worst_at_s": None if worst is None else round(worst[0], 1)}  # when, since the phase began


# ---- the server ------------------------------------------------------------------------------------------
def _die_with_parent() -> None:
    """preexec_fn: ask Linux to SIGKILL the server if this tool dies, even by SIGKILL. The gunicorn
    worker follows: it exits when its master goes away."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # 1 = PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - not Linux: the other guards still apply
        pass


SERVERS: list["ServerProcess"] = []  # every server started, stopped on every way out of main


class ServerProcess:
    """`pantheon serve` on 127.0.0.1 in its own process group; `stop()` kills the whole group."""

    def __init__(self, model_arg: str, port: int, env: dict[str, str], log_path: Path, extra: tuple[str, ...] = ()):
        self.cmd = [sys.executable, "-m", "pantheon.cli", "serve", "--model", model_arg,
                    "--host", require_loopback(LOOPBACK), "--port", str(port), *extra]
        self.port = port
        self.env = env
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def start(self) -> "ServerProcess":
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True,
                                         preexec_fn=_die_with_parent)
        SERVERS.append(self)
        atexit.register(self.stop)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, timeout_s: float) -> float:
        """Seconds until `GET /` answered 200; RuntimeError (with the log's tail) if it never does."""
        t0 = time.monotonic()
        raw = http_request("GET", "/", self.port)
        while time.monotonic() - t0 < timeout_s:
            if not self.alive():
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log_tail()}")
            if exchange(self.port, raw, 2.0).status == 200:
                return time.monotonic() - t0
            time.sleep(0.25)
        raise RuntimeError(f"the server was not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def worker(self) -> psutil.Process | None:
        """The gunicorn worker (the master's child) holds the models; its RSS is what leaks."""
        if not self.alive():
            return None
        try:
            kids = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            return None
        return kids[0] if kids else None

    def worker_rss(self) -> tuple[int | None, float | None]:
        """(worker pid, RSS in MiB), or (None, None) when there is no worker right now."""
        w = self.worker()
        try:
            return (w.pid, w.memory_info().rss / 2**20) if w is not None else (None, None)
        except psutil.Error:
            return None, None

    def nofile_limit(self) -> int | None:
        w = self.worker()
        try:
            return w.rlimit(psutil.RLIMIT_NOFILE)[0] if w is not None else None
        except (psutil.Error, AttributeError):
            return None

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def log_digest(self) -> dict[str, Any]:
        """Error lines of the server's log: each traceback's last line, counted, and ERROR/CRITICAL lines."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return {"path": str(self.log_path), "tracebacks": 0, "errors": {}}
        tracebacks = 0
        errors: Counter[str] = Counter()
        in_tb = False
        for i, line in enumerate(lines):
            if line.startswith("Traceback"):
                tracebacks += 1
                in_tb = True
            elif in_tb and line and not line.startswith((" ", "Traceback", "During handling", "The above")):
                errors[line[:160]] += 1
                in_tb = False
            elif "[ERROR]" in line or "[CRITICAL]" in line:
                errors[line.split("] ", 2)[-1][:160]] += 1
        return {"path": str(self.log_path), "tracebacks": tracebacks, "errors": dict(errors.most_common(12))}

    def stop(self) -> None:
        """SIGINT the group (gunicorn's quick shutdown), then SIGKILL whatever is left. Idempotent."""
        with self._lock:
            if self.proc is None:
                return
            pgid = self.proc.pid
            if self.proc.poll() is None:
                try:
                    os.killpg(pgid, signal.SIGINT)
                    self.proc.wait(timeout=10)
                except (subprocess.TimeoutExpired, ProcessLookupError, PermissionError):
                    pass
            try:
                os.killpg(pgid, signal.SIGKILL)  # the worker too, should it outlive its master
            except (ProcessLookupError, PermissionError):
                pass
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            self.proc = None


# ---- configuration ------------------------------------------------------------------------------------
@dataclass
class Config:
    """Every count and duration of a run (`--quick` shrinks the defaults; explicit flags win)."""

    model: str = DEFAULT_MODEL
    port: int | None = None
    seed: int = 22
    quick: bool = False
    phases: tuple[str, ...] = PHASES
    hang_s: float = 35.0
    startup_s: float = 900.0
    fuzz_n: int = 1500
    fuzz_s: float = 600.0
    fuzz_workers: int = 4
    slow_conns: int = 200
    slow_s: float = 60.0
    large_bytes: int = 3_900_000
    disconnects: int = 100
    wave: int = 16
    overflow_extra: int = 24
    unload_streams: int = 4
    load_timeout_s: float = 600.0
    soak_s: float = 600.0
    soak_workers: int = 4
    sample_s: float = 5.0
    greedy_tokens: int = 32
    grammar_sizes: tuple[int, ...] = (2000, 5000, 10_000)  # optional properties per schema (issue 31: 2k..10k)
    grammar_abandon: int = 4  # clients that send the largest schema and leave after ABANDON_S
    embed_s: float = 180.0  # longest wait for the one huge embeddings request (it is real work)
    tools_bytes: int = 2_400_000  # the tools list sent with tool_choice "required"
    amplify_s: float = 120.0  # longest wait for the echo + logprobs + n answer, streamed or not
    drain_s: float = 60.0  # after a phase, how long the worker may take to go quiet

    def budget_s(self) -> float:
        """The longest the whole run may take before the watchdog ends it."""
        per = {"fuzz": self.fuzz_s + 2 * self.hang_s, "slow-body": self.slow_s + 60,
               "large-body": 6 * self.hang_s + 60, "disconnects": 4 * self.hang_s + SETTLE_S + 60,
               "overflow": 2 * self.hang_s + 90, "unload": 3 * self.hang_s + self.load_timeout_s + 180,
               "soak": self.soak_s + 2 * self.hang_s + 30, "greedy": (len(GREEDY_PROMPTS) + 2) * self.hang_s + 30,
               "protocol": (len(TE_CASES) + 2 * len(TOOL_CUTS) + 2 * len(SCOPE_PAIRS) + 6) * self.hang_s,
               "tokenizer": 10 * self.hang_s, "amplification": 4 * self.hang_s + 2 * self.amplify_s,
               "embeddings": self.embed_s + 4 * self.hang_s,
               "grammar": (len(self.grammar_sizes) + 4) * self.hang_s,
               "truncation": 4 * self.hang_s, "generations": 2 * self.amplify_s, "embed-many": self.embed_s,
               "count-tokens": 7 * self.hang_s, "responses-store": (120 if self.quick else 220) * self.hang_s,
               "images": self.startup_s + 3 * self.hang_s}
        for name in ATTACK_PHASES:  # the witness's and the drain's share
            per[name] += 2 * self.hang_s + self.drain_s + ABANDON_S + WATCH_S + 60
        return self.startup_s + len(GREEDY_PROMPTS) * self.hang_s + sum(per[p] for p in self.phases) + 120


QUICK = {"hang_s": 15.0, "startup_s": 300.0, "fuzz_n": 150, "fuzz_s": 45.0, "slow_conns": 100, "slow_s": 15.0,
         "disconnects": 32, "overflow_extra": 8, "unload_streams": 3, "load_timeout_s": 300.0, "soak_s": 30.0,
         "sample_s": 2.0, "greedy_tokens": 16, "grammar_sizes": (2000, 10_000), "grammar_abandon": 2, "embed_s": 45.0,
         "amplify_s": 30.0, "drain_s": 15.0}


# ---- the run's shared state -------------------------------------------------------------------------------
@dataclass
class Bench:
    """What every phase needs: where the server is, how to reach the model, and the greedy baseline."""

    cfg: Config
    server: ServerProcess
    port: int
    admin_key: str
    name: str  # the served model name
    reload_body: dict  # what POST /admin/models/load sends to bring the model back after an unload
    model_dir: Path
    slots: int
    queue_depth: int
    queue_wait_s: float
    rng: random.Random
    baseline: list[str | None] = field(default_factory=list)
    worker_pids: list[int] = field(default_factory=list)  # every worker pid seen, in order
    context_tokens: int | None = None  # one slot's context, read once by `calibrate`
    chars_per_token: float | None = None  # of WORDS text under this model's tokenizer, read once by `calibrate`

    def request(self, method: str, path: str, obj: Any = None, *, timeout: float | None = None,
                admin: bool = False) -> Answer:
        headers = {"Content-Type": "application/json"} if obj is not None else {}
        if admin:
            headers["Authorization"] = f"Bearer {self.admin_key}"
        body = json.dumps(obj).encode() if obj is not None else None
        return exchange(self.port, http_request(method, path, self.port, body, headers),
                        timeout if timeout is not None else self.cfg.hang_s)

    def chat_body(self, content: str, max_tokens: int = 16, **extra: Any) -> dict:
        return {"model": self.name, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                **extra}

    def greedy_body(self, prompt: str) -> dict:
        return self.chat_body(prompt, self.cfg.greedy_tokens, temperature=0, ignore_eos=True)

    def greedy(self, prompt: str, tally: Tally | None = None) -> tuple[str | None, str]:
        """(text, "ok") of a greedy answer, or (None, what went wrong)."""
        ans = self.request("POST", CHAT, self.greedy_body(prompt))
        if tally is not None:
            tally.add(ans, f"greedy {prompt!r}", None, "greedy")
        obj = ans.json() if ans.status == 200 else None
        try:
            return obj["choices"][0]["message"]["content"], "ok"
        except (TypeError, KeyError, IndexError):
            return None, f"{ans.kind}: {ans.message()[:120]}"

    def metrics(self) -> dict[str, float] | None:
        ans = self.request("GET", "/metrics", timeout=10)
        return parse_metrics(ans.body.decode("utf-8", "replace")) if ans.status == 200 else None

    def serving(self, timeout_s: float) -> bool:
        """Wait (bounded) until `GET /` answers 200 and the model is listed."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end and self.server.alive():
            ans = self.request("GET", "/v1/models", timeout=5)
            obj = ans.json() if ans.status == 200 else None
            if isinstance(obj, dict) and any(m.get("id") == self.name for m in obj.get("data") or []):
                return True
            time.sleep(0.5)
        return False

    def note_worker(self) -> tuple[int | None, float | None]:
        pid, rss = self.server.worker_rss()
        if pid is not None and (not self.worker_pids or self.worker_pids[-1] != pid):
            self.worker_pids.append(pid)
        return pid, rss


def run_threads(fn: Callable[[int], Any], n: int, deadline_s: float) -> list[Any]:
    """fn(0..n-1) in n daemon threads; results in order (None for one still running at the deadline)."""
    out: list[Any] = [None] * n

    def one(i: int) -> None:
        out[i] = fn(i)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    end = time.monotonic() + deadline_s
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    return out


class Tally:
    """Answers by kind (2xx..5xx, closed, hang, connect_failed) plus non-JSON errors and examples.

    A status passed in `expected` (a 503 while the model is unloaded, the 501 RFC 9112 asks for an
    unknown transfer coding) is counted as "expected NNN" instead of as its class.
    """

    def __init__(self) -> None:
        self.tried = 0
        self.kinds: Counter[str] = Counter()
        self.statuses: Counter[int] = Counter()
        self.non_json_errors = 0
        self.examples: dict[str, list[dict]] = {}
        self._seen: set[tuple] = set()
        self.slowest: list[tuple[float, str]] = []
        self._lock = threading.Lock()

    def add(self, ans: Answer, label: str, raw: bytes | None = None, family: str = "",
            expected: tuple[int, ...] = ()) -> None:
        with self._lock:
            self.tried += 1
            kind = f"expected {ans.status}" if ans.outcome == "answered" and ans.status in expected else ans.kind
            self.kinds[kind] += 1
            if ans.status is not None:
                self.statuses[ans.status] += 1
            # 499 means the server saw the client go (a half-closed request): there is no one to read a body
            bad_body = ans.outcome == "answered" and ans.status is not None and ans.status >= 400 \
                and ans.status != 499 and not ans.json_error()
            self.non_json_errors += bad_body
            self.slowest = sorted(self.slowest + [(ans.elapsed, label)], reverse=True)[:3]
            for tag, hit in (("5xx", kind == "5xx"), ("hang", ans.outcome == "hang"),
                             ("closed", ans.outcome == "closed"), ("non_json", bad_body)):
                if hit:
                    self._example(tag, ans, label, raw, family)

    def _example(self, what: str, ans: Answer, label: str, raw: bytes | None, family: str) -> None:
        key = (what, family, label[:24], ans.status, ans.message()[:50])
        got = self.examples.setdefault(what, [])
        if key in self._seen or len(got) >= MAX_EXAMPLES:
            return
        self._seen.add(key)
        got.append({"family": family, "input": label, "request": preview(raw) if raw is not None else None,
                    "status": ans.status, "outcome": ans.outcome, "seconds": round(ans.elapsed, 2),
                    "answer": ans.message()[:200], "error": ans.error})

    def as_dict(self) -> dict[str, Any]:
        return {"tried": self.tried, "by_kind": dict(sorted(self.kinds.items())),
                "by_status": {str(k): v for k, v in sorted(self.statuses.items())},
                "non_json_errors": self.non_json_errors,
                "slowest": [{"seconds": round(s, 2), "input": lb} for s, lb in self.slowest],
                "examples": self.examples}


def phase_result(name: str, t0: float, tally: Tally, health: dict | None, key: str, findings: list[str],
                 **details: Any) -> dict[str, Any]:
    """The common shape of a phase's report: counts by kind, GET / figures, a one-line key, findings."""
    kinds = tally.kinds
    return {"phase": name, "seconds": round(time.monotonic() - t0, 1), "requests": tally.tried,
            "2xx": kinds["2xx"], "4xx": kinds["4xx"], "5xx": kinds["5xx"], "hangs": kinds["hang"],
            "closed_without_answer": kinds["closed"] + kinds["connect_failed"],
            "non_json_errors": tally.non_json_errors, "health": health, "key": key, "findings": findings,
            **details}


# ---- phase 1: fuzz ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FuzzCase:
    """One hostile request. `make` renders its exact bytes when it is sent (huge inputs stay lazy)."""

    family: str
    label: str  # what is broken, short: shown with any finding
    make: Callable[[], bytes]
    half_close: bool = False
    expected: tuple[int, ...] = ()  # a status that is the right answer although it is a 5xx


RAW = "@@raw@@"  # placeholder for a value that must go on the wire as raw text (1e400, "\ud800", [[[...)
CHAT_TOP = ("model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
            "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "stop", "stream",
            "stream_options", "tools", "tool_choice", "parallel_tool_calls", "session_id", "n", "user", "logprobs",
            "top_logprobs", "response_format", "chat_template_kwargs", "ignore_eos", "cache_salt")
# Where a mutation lands. Not max_completion_tokens: it caps every fuzzed generation at 2 tokens.
CHAT_TARGETS = tuple((f,) for f in CHAT_TOP if f != "max_completion_tokens") + (
    ("messages", 0), ("messages", 0, "role"), ("messages", 0, "content"), ("messages", 0, "name"))
NUMBER_LITERALS = ("1e400", "-1e400", "1e-400", "NaN", "Infinity", "-Infinity", "1" + "0" * 400, "-" + "9" * 400,
                   "1" + "0" * 5000, "0." + "0" * 400 + "1", "2147483648", "9223372036854775808",
                   "18446744073709551616", "-0", "1.0", "-1", "1E+2", "0x10", "01", "+1", ".5", "1.", "1e", "--1")
ESCAPED_SURROGATES = (b'"\\ud800"', b'"\\udfff"', b'"a\\ud800b"', b'"\\ud83d"', b'"\\ude00\\ud83d"',
                      b'"\\ud800\\ud800"')
BAD_UTF8 = (b"\xed\xa0\x80", b"\xed\xbf\xbf", b"\xff", b"\xc0\x80", b"\xf4\x90\x80\x80", b"\x80", b"\xe2\x82")
UNSUPPORTED_FIELDS = ("functions", "function_call", "logit_bias", "prompt", "best_of", "echo", "suffix", "metadata",
                      "store", "modalities", "audio", "prediction", "service_tier", "reasoning_effort")


def dumps(value: Any) -> bytes:
    """JSON as Python writes it: NaN/Infinity included (not JSON, so the server must refuse them)."""
    return json.dumps(value, allow_nan=True).encode()


def with_raw(body: Any, raw: bytes) -> bytes:
    """`body` as JSON with its RAW placeholder (a value or a key) replaced by raw bytes."""
    return dumps(body).replace(b'"' + RAW.encode() + b'"', raw, 1)


def put(body: Any, path: tuple, value: Any) -> Any:
    """A copy of `body` with the value at `path` replaced (created when missing)."""
    body = json.loads(json.dumps(body))
    node = body
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return body


def drop(body: Any, path: tuple) -> Any:
    body = json.loads(json.dumps(body))
    node = body
    for key in path[:-1]:
        node = node[key]
    del node[path[-1]]
    return body


def short(value: Any, limit: int = 60) -> str:
    text = json.dumps(value, allow_nan=True) if not isinstance(value, bytes) else repr(value)
    return text if len(text) <= limit else text[:limit] + f"...({len(text)} chars)"


def json_values() -> st.SearchStrategy:
    """Any JSON value: NaN/±Infinity floats, integers past 2**64, unicode text, nested lists and objects."""
    leaf = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(-(10**30), 10**30), st.floats(),
                     st.text(max_size=30))
    return st.recursive(leaf, lambda kids: st.one_of(st.lists(kids, max_size=5),
                                                     st.dictionaries(st.text(max_size=12), kids, max_size=5)),
                        max_leaves=25)


@st.composite
def mutation(draw: Callable, base: dict, targets: tuple[tuple, ...]) -> tuple[str, Callable[[], bytes]]:
    """(label, render) of `base` with exactly one thing broken."""
    kind = draw(st.sampled_from(("wrong_type", "number", "surrogate_escaped", "surrogate_raw", "deep", "huge_string",
                                 "unknown_field", "drop_field", "surrogate_key", "many_messages", "duplicate_key")))
    target = draw(st.sampled_from(targets))
    where = ".".join(str(p) for p in target)
    if kind == "wrong_type":
        value = draw(json_values())
        body = put(base, target, value)
        return f"wrong_type {where}={short(value)}", lambda: dumps(body)
    if kind == "number":
        lit = draw(st.sampled_from(NUMBER_LITERALS))
        body = put(base, target, RAW)
        return f"number {where}={short(lit.encode())}", lambda: with_raw(body, lit.encode())
    if kind == "surrogate_escaped":
        lit = draw(st.sampled_from(ESCAPED_SURROGATES))
        body = put(base, target, RAW)
        return f"surrogate_escaped {where}={lit.decode()}", lambda: with_raw(body, lit)
    if kind == "surrogate_raw":
        lit = b'"a' + draw(st.sampled_from(BAD_UTF8)) + b'"'
        body = put(base, target, RAW)
        return f"surrogate_raw {where}={lit!r} (raw bytes)", lambda: with_raw(body, lit)
    if kind == "deep":
        depth = draw(st.sampled_from((64, 1000, 10_000, 100_000, 1_000_000)))
        opener, closer = draw(st.sampled_from(((b"[", b"]"), (b'{"a":', b"}"))))
        body = put(base, target, RAW)
        return f"deep {where}={opener.decode()}x{depth}", lambda: with_raw(body, opener * depth + b"1" + closer * depth)
    if kind == "huge_string":
        size = draw(st.sampled_from((4096, 65536, 1 << 20)))
        body = put(base, target, RAW)
        return f"huge_string {where}=<{size} chars>", lambda: with_raw(body, b'"' + b"x" * size + b'"')
    if kind == "unknown_field":
        key = draw(st.one_of(st.sampled_from(UNSUPPORTED_FIELDS), st.text(min_size=1, max_size=20)))
        assume(key not in base and key not in CHAT_TOP)
        value = draw(json_values())
        body = put(base, (key,), value)
        return f"unknown_field {short(key)}={short(value)}", lambda: dumps(body)
    if kind == "drop_field":
        key = draw(st.sampled_from(sorted(base)))
        body = drop(base, (key,))
        return f"drop_field {key}", lambda: dumps(body)
    if kind == "surrogate_key":
        lit = draw(st.sampled_from(ESCAPED_SURROGATES + tuple(b'"' + b + b'"' for b in BAD_UTF8)))
        body = put(base, (RAW,), 1)
        return f"surrogate_key {lit!r}", lambda: with_raw(body, lit)
    if kind == "many_messages":
        n = draw(st.sampled_from((100, 1000, 5000)))
        msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": "a"} for i in range(n - 1)]
        body = put(base, ("messages",), msgs + [{"role": "user", "content": "hi"}])
        return f"many_messages n={n}", lambda: dumps(body)
    key = draw(st.sampled_from(sorted(base)))  # duplicate_key: the same key twice, the second one broken
    value = draw(json_values())
    body = dumps(base)
    return (f"duplicate_key {key} then {short(value)}",
            lambda: body[:-1] + b", " + json.dumps(key).encode() + b": " + dumps(value) + b"}")


class FuzzPlan:
    """Builds the hostile requests for one server: chat and admin bodies, content types, chunked
    framing and malformed HTTP. Needs the served name and model directory to keep admin bodies harmless."""

    def __init__(self, b: Bench):
        self.b = b
        self.port = b.port
        self.chat_base = {"model": b.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                          "max_completion_tokens": 2, "temperature": 0}
        self.forbidden = {b.name, *CATALOG, *(str(v) for v in b.reload_body.values())}

    # -- helpers
    def post(self, path: str, body: bytes, ctype: str | None = "application/json", admin: bool = False,
             extra: dict[str, str] | None = None) -> bytes:
        headers = dict(extra or {})
        if ctype is not None:
            headers["Content-Type"] = ctype
        if admin:
            headers["Authorization"] = f"Bearer {self.b.admin_key}"
        return http_request("POST", path, self.port, body, headers)

    def harmless(self, value: Any) -> bool:
        """No string in `value` names the served model, a catalog model or an existing file."""
        stack, seen = [value], 0
        while stack and seen < 10_000:
            v = stack.pop()
            seen += 1
            if isinstance(v, dict):
                stack.extend(v.keys())
                stack.extend(v.values())
            elif isinstance(v, list):
                stack.extend(v)
            elif isinstance(v, str):
                if v in self.forbidden:
                    return False
                try:
                    if v and ((self.b.model_dir / v).exists() or Path(v).exists()):
                        return False
                except (OSError, ValueError):
                    pass
        return True

    def harmless_request(self, raw: bytes) -> bool:
        """An admin request is sent only if its body, parsed as the server would, is harmless."""
        try:
            body = json.loads(raw.split(b"\r\n\r\n", 1)[1])
        except (ValueError, IndexError, RecursionError):
            return True  # not JSON: the server refuses it before it could touch a model
        return self.harmless(body)

    # -- families
    def random_json(self) -> st.SearchStrategy:
        @st.composite
        def case(draw: Callable) -> FuzzCase:
            value = draw(json_values())
            return FuzzCase("random_json", f"random_json {short(value)}", lambda: self.post(CHAT, dumps(value)))
        return case()

    def mutated_chat(self) -> st.SearchStrategy:
        @st.composite
        def case(draw: Callable) -> FuzzCase:
            label, render = draw(mutation(self.chat_base, CHAT_TARGETS))
            return FuzzCase("mutated_chat", label, lambda: self.post(CHAT, render()))
        return case()

    def admin(self) -> st.SearchStrategy:
        load_base = {"path": "no-such-model.gguf", "name": "fuzz-model"}
        unload_base = {"name": "no-such-model", "timeout_s": 1}
        paths = ("../../../../etc/passwd", "/etc/passwd", "a/../../x.gguf", "\x00", "x" * 5000, "~root/x.gguf",
                 "%2e%2e/x.gguf", "nul\x00.gguf", "/proc/self/environ", "\\..\\x.gguf", "no-such-model.gguf/")

        @st.composite
        def case(draw: Callable) -> FuzzCase:
            route = draw(st.sampled_from((LOAD, UNLOAD)))
            kind = draw(st.sampled_from(("random_json", "mutated", "path", "auth", "method")))
            if kind == "random_json":
                value = draw(json_values())
                assume(self.harmless(value))
                return FuzzCase("admin", f"admin_random {route} {short(value)}",
                                lambda: self.post(route, dumps(value), admin=True))
            if kind == "mutated":
                base = load_base if route == LOAD else unload_base
                targets = tuple((k,) for k in ("path", "model", "name", "dies", "instance_id", "timeout_s"))
                label, render = draw(mutation(base, targets))
                return FuzzCase("admin", f"admin_{label} on {route}", lambda: self.post(route, render(), admin=True))
            if kind == "path":
                p = draw(st.one_of(st.sampled_from(paths), st.text(min_size=1, max_size=40)))
                key = draw(st.sampled_from(("path", "model")))
                assume(self.harmless(p))
                return FuzzCase("admin", f"admin_path {key}={short(p)}",
                                lambda: self.post(LOAD, dumps({key: p}), admin=True))
            if kind == "auth":
                header = draw(st.sampled_from((None, "Bearer wrong", "Bearer ", "bearer " + "k" * 5000, "Basic Zm9v",
                                               "X-Api-Key", "Bearer \ud800")))
                if header == "X-Api-Key":
                    extra = {"X-Api-Key": "wrong"}
                elif header is None:
                    extra = {}
                else:
                    extra = {"Authorization": header}
                # "\ud800" is no latin-1 text: it goes as the raw bytes of its UTF-8 (surrogatepass) form.
                extra = {k: v.encode("utf-8", "surrogatepass").decode("latin-1") for k, v in extra.items()}
                body = dumps(unload_base)
                return FuzzCase("admin", f"admin_auth {route} {short(header)}",
                                lambda: self.post(route, body, extra=extra))
            method = draw(st.sampled_from(("GET", "PUT", "DELETE", "PATCH")))
            return FuzzCase("admin", f"admin_method {method} {route}",
                            lambda: http_request(method, route, self.port, None,
                                                 {"Authorization": f"Bearer {self.b.admin_key}"}))
        return case()

    def content_type(self) -> st.SearchStrategy:
        ctypes = ("", "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=zz",
                  "application/json; charset=utf-16", "application/json; charset=latin-1", "application/xml", "*/*",
                  "application/json" + ";" * 200, "APPLICATION/JSON", "application/jsonx", "application/json; x=\"",
                  "text/event-stream")
        encodings = ("utf8", "utf16", "utf32", "bom", "form", "multipart", "gzip", "empty", "latin1")
        printable = st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=60)

        def encode(enc: str) -> tuple[bytes, dict[str, str]]:
            text = json.dumps(self.chat_base)
            if enc == "utf16":
                return text.encode("utf-16"), {}
            if enc == "utf32":
                return text.encode("utf-32"), {}
            if enc == "bom":
                return b"\xef\xbb\xbf" + text.encode(), {}
            if enc == "form":
                return b"messages=hi&max_tokens=2", {}
            if enc == "multipart":
                return (b"--zz\r\nContent-Disposition: form-data; name=\"body\"\r\n\r\n" + text.encode() +
                        b"\r\n--zz--\r\n"), {}
            if enc == "gzip":
                return gzip.compress(text.encode()), {"Content-Encoding": "gzip"}
            if enc == "empty":
                return b"", {}
            if enc == "latin1":
                return json.dumps({**self.chat_base, "user": "caf\u00e9"}, ensure_ascii=False).encode("latin-1"), {}
            return text.encode(), {}

        @st.composite
        def case(draw: Callable) -> FuzzCase:
            ctype = draw(st.one_of(st.sampled_from(ctypes), printable))
            enc = draw(st.sampled_from(encodings))
            body, extra = encode(enc)
            return FuzzCase("content_type", f"content_type {ctype[:60]!r} body={enc}",
                            lambda: self.post(CHAT, body, ctype or None, extra=extra))
        return case()

    def chunked(self) -> st.SearchStrategy:
        bad_sizes = ("zz", "-1", "ffffffffffffffffffff", "0x10", " 5", "5 ", "", "1;", "5;ext=\x00", "+5", "0")
        terminators = (b"0\r\n\r\n", b"", b"0\r\n", b"0\r\nX-Trailer: a\r\n\r\n", b"00000\r\n\r\n", b"0\n\n")
        encodings = ("chunked", "Chunked", "chunked, gzip", "gzip, chunked", "xchunked", " chunked", "chunked\x0b",
                     "identity, chunked", "chunked, chunked")

        @st.composite
        def case(draw: Callable) -> FuzzCase:
            payload = json.dumps(self.chat_base).encode()
            cuts = sorted(draw(st.lists(st.integers(1, len(payload) - 1), max_size=3, unique=True)))
            pieces = [payload[a:b] for a, b in zip([0] + cuts, cuts + [len(payload)])]
            chunks, notes = [], []
            for piece in pieces:
                how = draw(st.sampled_from(("ok", "ok", "bad", "long", "ext")))
                if how == "bad":
                    size = draw(st.sampled_from(bad_sizes))
                elif how == "long":
                    size = format(len(piece) + draw(st.integers(1, 1000)), "x")
                elif how == "ext":
                    size = format(len(piece), "x") + ";" + draw(st.text(max_size=10))
                else:
                    size = format(len(piece), "x")
                if how != "ok":
                    notes.append(f"{how}:{size!r}")
                chunks.append(size.encode("utf-8", "replace") + b"\r\n" + piece + b"\r\n")
            term = draw(st.sampled_from(terminators))
            te = draw(st.sampled_from(encodings))
            cl = draw(st.one_of(st.none(), st.integers(0, 500)))
            extra = {"Transfer-Encoding": te, **({"Content-Length": str(cl)} if cl is not None else {})}
            head = http_request("POST", CHAT, self.port, None, {"Content-Type": "application/json", **extra})
            label = f"chunked TE={te!r} CL={cl} chunks={notes or 'ok'} end={term!r}"
            unknown_coding = te.strip().lower() != "chunked"  # RFC 9112: 501 for a coding it does not implement
            return FuzzCase("chunked", label, lambda: head + b"".join(chunks) + term, half_close=True,
                            expected=(501,) if unknown_coding else ())
        return case()

    def raw_http(self) -> st.SearchStrategy:
        templates = (
            b"GET / HTTP/9.9\r\n\r\n", b"GARBAGE\r\n\r\n", b"\r\n\r\n", b"GET /\r\n\r\n", b"GET / HTTP/1.1\r\n\r\n",
            b"GET  /  HTTP/1.1\r\nHost: x\r\n\r\n", b"GET http://example.invalid/ HTTP/1.1\r\nHost: x\r\n\r\n",
            b"GET /%00 HTTP/1.1\r\nHost: x\r\n\r\n", b"GET /\xff\xfe HTTP/1.1\r\nHost: x\r\n\r\n",
            b"GET /" + b"a" * 100_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
            b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * 1_000_000 + b"\r\n\r\n",
            b"GET / HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n", b"GET / HTTP/1.1\r\nHost: x\r\nX-A: \x00\r\n\r\n",
            b"GET / HTTP/1.1\r\nHost: x\r\nX-A: a\r\n folded\r\n\r\n",
            b"GET / HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(500)) + b"\r\n",
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1e400\r\n\r\n",
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999999999999\r\n\r\n",
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n"
            b"\r\n0\r\n\r\n",
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 50\r\n\r\n",
            b"GET / HTTP/1.1\nHost: x\n\n", b"GET / HTTP/1.1\rHost: x\r\r", b"get / HTTP/1.1\r\nHost: x\r\n\r\n",
            b"G\x00T / HTTP/1.1\r\nHost: x\r\n\r\n", b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + b"\x00" * 32,
            b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", b"GET / HTTP/1.1\r\nHost: x\r\n\r\nGET /v1/models HTTP/1.1\r\n"
            b"Host: x\r\n\r\n", b"OPTIONS * HTTP/1.1\r\nHost: x\r\n\r\n", b"CONNECT 127.0.0.1:1 HTTP/1.1\r\n\r\n",
            b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello",
            b"GET /../../etc/passwd HTTP/1.1\r\nHost: x\r\n\r\n",
        )
        methods = st.one_of(st.sampled_from(("GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS", "TRACE")),
                            st.text(max_size=10))
        paths = st.one_of(st.sampled_from(("/", CHAT, "/v1/models", "/metrics", LOAD, UNLOAD, "/admin/dies", "*")),
                          st.text(max_size=50))
        versions = st.sampled_from(("HTTP/1.1", "HTTP/1.0", "HTTP/2.0", "HTTP/9.9", "HTTP/1.1x", "", "HTTP/01.1",
                                    "http/1.1"))

        @st.composite
        def built(draw: Callable) -> bytes:
            eol = draw(st.sampled_from((b"\r\n", b"\n", b"\r")))
            line = f"{draw(methods)} {draw(paths)} {draw(versions)}".encode("utf-8", "surrogatepass")
            headers = draw(st.lists(st.binary(max_size=40), max_size=3))
            return eol.join([line, b"Host: x", *headers]) + eol + eol

        @st.composite
        def case(draw: Callable) -> FuzzCase:
            raw = draw(st.one_of(st.sampled_from(templates), built(), st.binary(max_size=400)))
            return FuzzCase("raw_http", f"raw_http {preview(raw, 70)}", lambda: raw, half_close=True)
        return case()

    def fixed(self) -> list[FuzzCase]:
        """Inputs every run sends, however small --fuzz-n is: the issue's named probes."""
        base = self.chat_base
        content = put(base, ("messages", 0, "content"), RAW)
        big = json.dumps(put(base, ("messages", 0, "content"), "x" * (BODY_LIMIT + (1 << 20)))).encode()

        def chunked_over_limit() -> bytes:
            head = http_request("POST", CHAT, self.port, None, {"Content-Type": "application/json",
                                                                "Transfer-Encoding": "chunked"})
            parts = [big[i:i + 65536] for i in range(0, len(big), 65536)]
            return head + b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"

        return [
            FuzzCase("fixed", "content=\"\\ud800\" (escaped lone surrogate)",
                     lambda: self.post(CHAT, with_raw(content, b'"\\ud800"'))),
            FuzzCase("fixed", "content=b'\\xed\\xa0\\x80' (lone surrogate as raw bytes)",
                     lambda: self.post(CHAT, with_raw(content, b'"\xed\xa0\x80"'))),
            FuzzCase("fixed", "temperature=1e400", lambda: self.post(CHAT, with_raw(put(base, ("temperature",), RAW),
                                                                                    b"1e400"))),
            FuzzCase("fixed", "max_tokens=10**400", lambda: self.post(CHAT, with_raw(put(base, ("max_tokens",), RAW),
                                                                                     b"1" + b"0" * 400))),
            FuzzCase("fixed", "messages nested 100000 deep",
                     lambda: self.post(CHAT, with_raw(put(base, ("messages",), RAW), b"[" * 100_000 + b"]" * 100_000))),
            FuzzCase("fixed", "Content-Length 5 MiB (over the limit)", lambda: self.post(CHAT, big)),
            FuzzCase("fixed", "chunked body of 5 MiB (over the 4 MiB limit)", chunked_over_limit, half_close=True),
            FuzzCase("fixed", "user=\"\\ud800\"", lambda: self.post(CHAT, with_raw(put(base, ("user",), RAW),
                                                                                   b'"\\ud800"'))),
        ]


def draw_cases(strategy: st.SearchStrategy, n: int, seed: int) -> list[FuzzCase]:
    """`n` examples of `strategy`, drawn by hypothesis from `seed` (generation only: nothing to shrink)."""
    out: list[FuzzCase] = []
    if n <= 0:
        return out

    @hypothesis_seed(seed)
    @settings(max_examples=n, database=None, deadline=None, phases=[Phase.generate], verbosity=Verbosity.quiet,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(case: FuzzCase) -> None:
        out.append(case)

    collect()
    return out[:n]


FUZZ_SHARES = (("random_json", 0.15), ("mutated_chat", 0.35), ("admin", 0.15), ("content_type", 0.10),
               ("chunked", 0.10), ("raw_http", 0.15))


def phase_fuzz(b: Bench) -> dict[str, Any]:
    """Hostile bodies and malformed HTTP: every answer should be a JSON 4xx (or a 2xx), none a 5xx,
    none missing, and the server should answer them all within --hang-s."""
    t0 = time.monotonic()
    cfg = b.cfg
    plan = FuzzPlan(b)
    cases = plan.fixed()
    for i, (family, share) in enumerate(FUZZ_SHARES):
        cases += draw_cases(getattr(plan, family)(), max(1, round(cfg.fuzz_n * share)), cfg.seed + i)
    b.rng.shuffle(cases)
    deadline = t0 + cfg.fuzz_s
    total, per_family = Tally(), {f: Tally() for f in ["fixed"] + [f for f, _ in FUZZ_SHARES]}
    skipped: Counter[str] = Counter()
    lock = threading.Lock()

    def send(case: FuzzCase) -> None:
        if time.monotonic() > deadline:
            why = "deadline"
        else:
            raw = case.make()
            if case.family != "admin" or plan.harmless_request(raw):
                ans = exchange(b.port, raw, cfg.hang_s, half_close=case.half_close)
                for t in (total, per_family[case.family]):
                    t.add(ans, case.label, raw, case.family, case.expected)
                return
            why = "unsafe"
        with lock:
            skipped[why] += 1

    with HealthProbe(b.port) as probe, ThreadPoolExecutor(cfg.fuzz_workers, thread_name_prefix="fuzz") as pool:
        for _ in pool.map(send, cases):
            pass
    findings = []
    if total.kinds["5xx"]:
        findings.append(f"fuzz: {total.kinds['5xx']} inputs got a 5xx")
    if total.kinds["hang"]:
        findings.append(f"fuzz: {total.kinds['hang']} inputs got no answer within {cfg.hang_s:.0f} s")
    if total.non_json_errors:
        findings.append(f"fuzz: {total.non_json_errors} error answers were not JSON")
    key = f"{total.tried} inputs: {counts(total.kinds)}"
    return phase_result("fuzz", t0, total, probe.summary(), key, findings, inputs_drawn=len(cases),
                        not_sent=skipped["deadline"], skipped_unsafe=skipped["unsafe"],
                        by_family={f: {k: v for k, v in t.as_dict().items() if k != "examples"}
                                   for f, t in per_family.items() if t.tried},
                        examples=total.examples, slowest=total.as_dict()["slowest"])


# ---- phase 2: slow bodies ---------------------------------------------------------------------------------
def _trickle(b: Bench, end: float, out: dict[str, Any]) -> None:
    """One client that sends a valid body at 1 byte/s until the phase ends or the server gives up on it."""
    body = json.dumps(b.chat_body("hi", 1)).encode()
    head = http_request("POST", CHAT, b.port, None, {"Content-Type": "application/json",
                                                      "Content-Length": str(len(body))})
    t0 = time.monotonic()
    out.update(sent=0, body_bytes=len(body), outcome="still sending at the end", status=None, seconds=None)
    try:
        sock = open_socket(LOOPBACK, b.port, CONNECT_S)
    except OSError as exc:
        out["outcome"] = "connect_failed: " + _error_text(exc)
        return
    with sock:
        try:
            sock.sendall(head)
            for i in range(len(body)):
                if time.monotonic() >= end:
                    return
                sock.sendall(body[i:i + 1])
                out["sent"] = i + 1
                ready = selectors.DefaultSelector()
                ready.register(sock, selectors.EVENT_READ)
                hit = ready.select(timeout=max(0.0, min(1.0, end - time.monotonic())))
                ready.close()
                if hit:
                    break
            buf, how = _receive(sock, min(end, time.monotonic() + 15))
        except OSError as exc:
            out.update(outcome="the server closed it: " + _error_text(exc), seconds=round(time.monotonic() - t0, 1))
            return
    ans = to_answer(buf, how, time.monotonic() - t0)
    out.update(outcome=ans.outcome, status=ans.status, seconds=round(ans.elapsed, 1), answer=ans.message()[:120])


def phase_slow_body(b: Bench) -> dict[str, Any]:
    """N connections that announce 126 body bytes and send 10, then hold; one client sends at 1 byte/s.

    A gevent server parks a greenlet per connection; what matters is whether it keeps answering
    others (GET / timing) and whether, and when, it closes the slow ones.
    """
    t0 = time.monotonic()
    cfg = b.cfg
    head = http_request("POST", CHAT, b.port, None, {"Content-Type": "application/json",
                                                      "Content-Length": str(SLOW_BODY_CL)}) + SLOW_BODY_SENT
    end = t0 + cfg.slow_s
    trickle: dict[str, Any] = {}
    sel = selectors.DefaultSelector()
    opened: dict[socket.socket, float] = {}
    open_failed: Counter[str] = Counter()
    closes: list[dict] = []  # one per slow connection the server ended: when and how
    tally = Tally()
    with HealthProbe(b.port) as probe:
        tr = threading.Thread(target=_trickle, args=(b, end, trickle), daemon=True)
        tr.start()
        for _ in range(cfg.slow_conns):
            if time.monotonic() >= end:
                break
            try:
                s = open_socket(LOOPBACK, b.port, CONNECT_S)
                s.sendall(head)
                s.setblocking(False)
            except OSError as exc:
                open_failed[type(exc).__name__] += 1
                continue
            opened[s] = time.monotonic()
            sel.register(s, selectors.EVENT_READ)
        open_s = time.monotonic() - t0
        while opened and time.monotonic() < end:
            for key, _ in sel.select(timeout=min(0.2, max(0.0, end - time.monotonic()))):
                s = key.fileobj
                try:
                    data = s.recv(65536)
                    how = "answered" if data else "closed"
                except BlockingIOError:
                    continue
                except OSError:
                    data, how = b"", "reset"
                if data:  # the rest of the answer (its body may trail the head): at most 2 s more
                    s.setblocking(True)
                    rest, _ = _receive(s, time.monotonic() + 2.0)
                    data += rest
                ans = to_answer(data, "eof", time.monotonic() - opened[s])
                tally.add(ans, "slow body (126 announced, 10 sent)", head, "slow-body")
                closes.append({"after_s": round(ans.elapsed, 1), "how": how, "status": ans.status,
                               "answer": ans.message()[:120]})
                sel.unregister(s)
                s.close()
                del opened[s]
        still_open = len(opened)
        for _ in range(still_open):
            tally.add(Answer(None, {}, b"", cfg.slow_s, "held_open"), "slow body", None, "slow-body")
        for s in list(opened):
            sel.unregister(s)
            s.close()
        sel.close()
        tr.join(20)
        after = exchange(b.port, http_request("GET", "/", b.port), PROBE_TIMEOUT_S)
    by_status = Counter(str(c["status"] or c["how"]) for c in closes)
    close_s = stats_ms(c["after_s"] for c in closes)
    health = probe.summary()
    findings = []
    if health["failed"]:
        findings.append(f"slow-body: {health['failed']} of {health['probes']} GET / probes failed "
                        f"(max {health['max_ms']} ms) with {len(opened) + len(closes)} slow connections")
    if any(c["status"] and c["status"] >= 500 for c in closes):
        findings.append("slow-body: a slow connection was answered with a 5xx")
    opened_n = still_open + len(closes)
    key = (f"{opened_n} slow conns (up to {cfg.slow_s:.0f} s): {still_open} still open at the end, ended by the "
           f"server: {counts(by_status)} (after p50 {close_s['p50_ms']} ms); 1 byte/s client: sent "
           f"{trickle.get('sent')}/{trickle.get('body_bytes')} B, then "
           f"{trickle.get('status') or trickle.get('outcome')} after {trickle.get('seconds')} s")
    return phase_result("slow-body", t0, tally, health, key, findings, connections=opened_n,
                        open_failed=dict(open_failed), seconds_to_open=round(open_s, 1), still_open_at_end=still_open,
                        closed_by_server=len(closes), closed_by_status=dict(by_status),
                        close_after=close_s, closes=closes[:20],
                        trickle=trickle, get_after={"status": after.status, "ms": round(after.elapsed * 1e3, 1)})


# ---- phase 3: large bodies ----------------------------------------------------------------------------------
class _StreamThreads:
    """The threads of a set of background streams: started on entering (returning once the first chunk
    arrived, or after hang_s), told to stop and joined (bounded) on leaving. Subclasses fill
    `_threads`, `stop`, `first_chunk` and `b`."""

    def __enter__(self) -> "_StreamThreads":
        self.t0 = time.monotonic()
        for t in self._threads:
            t.start()
        self.first_chunk.wait(self.b.cfg.hang_s)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        for t in self._threads:
            t.join(self.b.cfg.hang_s + 5)


class BackgroundStreams(_StreamThreads):
    """Streams started back to back in `n` threads until stopped: the longest gap between SSE chunks
    shows whether a big request stalls the generation of others."""

    def __init__(self, b: Bench, n: int, max_tokens: int = 256, temperature: float = 1.0):
        self.b, self.n, self.max_tokens, self.temperature = b, n, max_tokens, temperature
        self.stop = threading.Event()
        self.results: list[StreamResult] = []
        self.first_chunk = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(n)]

    def _run(self, i: int) -> None:
        k = 0
        while not self.stop.is_set():
            body = self.b.chat_body(f"Tell a long story, part {i}.{k}", self.max_tokens,
                                    temperature=self.temperature, ignore_eos=True, seed=1000 * i + k)
            res = stream_chat(self.b.port, body, self.b.cfg.hang_s + 120, stop=self.stop, started=self.first_chunk)
            self.results.append(res)
            k += 1
            if res.outcome not in ("done", "stopped"):
                self.stop.wait(0.5)  # a failing server: do not spin

    def summary(self) -> dict[str, Any]:
        rs = list(self.results)
        return {"streams": len(rs), "by_outcome": dict(Counter(r.kind for r in rs)),
                "max_gap_ms": round(max((r.max_gap for r in rs), default=0.0) * 1e3, 1),
                "chunks": sum(r.chunks for r in rs)}


def _large_body(b: Bench, size: int) -> bytes:
    """A chat body of exactly `size` bytes: one user message of common words."""
    shell = json.dumps(b.chat_body("", 1)).encode()
    words = b"the river runs past the old town and on to the sea "
    n = size - len(shell)
    text = (words * (n // len(words) + 1))[:n]
    return shell.replace(b'"content": ""', b'"content": "' + text + b'"', 1)[:size]


def phase_large_body(b: Bench) -> dict[str, Any]:
    """A ~3.9 MB message (under the 4 MiB limit), then two at once, while a stream runs and GET / is
    timed: the answer should be a quick 400 context_length_exceeded that stalls nobody."""
    t0 = time.monotonic()
    cfg = b.cfg
    raw = http_request("POST", CHAT, b.port, _large_body(b, cfg.large_bytes), {"Content-Type": "application/json"})
    tally = Tally()

    def one(_: int) -> dict[str, Any]:
        ans = exchange(b.port, raw, cfg.hang_s)
        tally.add(ans, f"large body {cfg.large_bytes} B", None, "large-body")
        obj = ans.json()
        code = obj["error"].get("code") if isinstance(obj, dict) and isinstance(obj.get("error"), dict) else None
        return {"status": ans.status, "outcome": ans.outcome, "code": code, "seconds": round(ans.elapsed, 2)}

    with HealthProbe(b.port) as probe, BackgroundStreams(b, 1) as streams:
        time.sleep(1.0)  # a baseline second of streaming before the big bodies arrive
        single = one(0)
        pair = run_threads(one, 2, cfg.hang_s + 10)
        time.sleep(1.0)
    answers = [single] + [p for p in pair if p is not None]
    health, stream = probe.summary(), streams.summary()
    findings = []
    if any(a["status"] != 400 or a["code"] != "context_length_exceeded" for a in answers):
        findings.append("large-body: not every large body got 400 context_length_exceeded: "
                        + ", ".join(f"{a['status'] or a['outcome']}/{a['code']}" for a in answers))
    if tally.kinds["hang"] or tally.kinds["5xx"]:
        findings.append(f"large-body: {tally.kinds['hang']} hangs, {tally.kinds['5xx']} 5xx")
    key = (f"1 body: {single['status'] or single['outcome']} in {single['seconds']} s; 2 at once: "
           + ", ".join(f"{p['status'] or p['outcome']} in {p['seconds']} s" for p in pair if p)
           + f"; stream max gap {stream['max_gap_ms']} ms")
    return phase_result("large-body", t0, tally, health, key, findings, body_bytes=cfg.large_bytes,
                        single=single, concurrent=pair, stream=stream)


# ---- phase 4: disconnects -----------------------------------------------------------------------------------
def settle(b: Bench, timeout_s: float = SETTLE_S) -> tuple[float | None, dict[str, float] | None]:
    """(seconds until /metrics shows no running or queued request, the last scrape); None: never."""
    t0 = time.monotonic()
    last = None
    while time.monotonic() - t0 < timeout_s:
        last = b.metrics()
        if last is not None and last.get("pantheon_running_requests", 1) == 0 \
                and last.get("pantheon_queued_requests", 1) == 0:
            return round(time.monotonic() - t0, 2), last
        time.sleep(0.2)
    return None, last


def greedy_check(b: Bench, i: int = 0, tally: Tally | None = None) -> dict[str, Any]:
    text, how = b.greedy(GREEDY_PROMPTS[i], tally)
    base = b.baseline[i] if i < len(b.baseline) else None
    return {"prompt": GREEDY_PROMPTS[i], "identical": text is not None and text == base, "answer": how,
            "text": text, "baseline": base}


def phase_disconnects(b: Bench) -> dict[str, Any]:
    """Streams closed mid-stream, in waves: every slot must come back (running_requests 0) and the
    server must answer a greedy request exactly as before."""
    t0 = time.monotonic()
    cfg = b.cfg
    before = b.metrics() or {}
    results: list[StreamResult] = []
    tally = Tally()
    plans = [(b.rng.randint(0, 4), b.rng.random() < 0.5) for _ in range(cfg.disconnects)]  # (chunks kept, RST)

    def one(i: int) -> StreamResult:
        keep, rst = plans[i]
        body = b.chat_body(f"Count slowly to one hundred, take {i}.", 128, temperature=1.0, seed=i, ignore_eos=True)
        return stream_chat(b.port, body, cfg.hang_s, cancel_after=keep, rst=rst)

    with HealthProbe(b.port) as probe:
        for start in range(0, cfg.disconnects, cfg.wave):
            n = min(cfg.wave, cfg.disconnects - start)
            wave = run_threads(lambda j, s=start: one(s + j), n, cfg.hang_s + 10)
            results += [r if r is not None else StreamResult(outcome="hang") for r in wave]
        for r in results:
            tally.add(stream_answer(r), "stream cut mid-stream", None, "disconnects")
        settled_s, after = settle(b)
        greedy = greedy_check(b)
    after = after or {}
    kinds = Counter(r.kind for r in results)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0)
             for k in ("pantheon_client_disconnects_total", "pantheon_scheduler_cancelled_total")}
    findings = []
    if settled_s is None:
        findings.append(f"disconnects: running/queued requests did not return to 0 within {SETTLE_S:.0f} s "
                        f"(running {after.get('pantheon_running_requests')}, "
                        f"queued {after.get('pantheon_queued_requests')})")
    if not greedy["identical"]:
        findings.append(f"disconnects: the greedy answer changed after the storm ({greedy['answer']})")
    if kinds["5xx"] or kinds["hang"]:
        findings.append(f"disconnects: {kinds['5xx']} 5xx and {kinds['hang']} hangs among the streams")
    key = (f"{len(results)} streams cut ({counts(kinds)}); running back to 0 in "
           f"{'-' if settled_s is None else settled_s} s; greedy identical: {yes_no(greedy['identical'])}")
    return phase_result("disconnects", t0, tally, probe.summary(), key, findings, by_outcome=dict(kinds),
                        settle_s=settled_s, metrics_delta=delta, running_after=after.get("pantheon_running_requests"),
                        greedy=greedy, examples=tally.examples)


# ---- phase 5: queue overflow ----------------------------------------------------------------------------------
def phase_overflow(b: Bench) -> dict[str, Any]:
    """More concurrent requests than slots + queue depth, sent at the same instant: the excess should
    get 429 with Retry-After at once, the rest complete, and every connection an answer."""
    t0 = time.monotonic()
    cfg = b.cfg
    n = b.slots + b.queue_depth + cfg.overflow_extra
    gate = threading.Barrier(n)
    tally = Tally()

    def one(i: int) -> Answer:
        body = json.dumps(b.chat_body(f"Overflow request {i}: say something long.", 64, temperature=0.8, seed=i,
                                      ignore_eos=True)).encode()
        raw = http_request("POST", CHAT, b.port, body, {"Content-Type": "application/json"})
        ans = exchange(b.port, raw, cfg.hang_s + b.queue_wait_s, gate=gate)
        tally.add(ans, f"overflow request {i}", None, "overflow")
        return ans

    with HealthProbe(b.port) as probe:
        answers = [a for a in run_threads(one, n, cfg.hang_s + b.queue_wait_s + 20) if a is not None]
        settled_s, _ = settle(b)
    busy = [a for a in answers if a.status == 429]
    with_retry = sum(1 for a in busy if a.headers.get("retry-after", "").isdigit())
    unanswered = n - sum(1 for a in answers if a.outcome == "answered")
    findings = []
    if unanswered:
        findings.append(f"overflow: {unanswered} of {n} connections got no answer")
    if tally.kinds["5xx"]:
        findings.append(f"overflow: {tally.kinds['5xx']} requests got a 5xx")
    if with_retry < len(busy):
        findings.append(f"overflow: {len(busy) - with_retry} of {len(busy)} 429s lacked Retry-After")
    if not busy:
        findings.append(f"overflow: no 429 although {n} requests exceeded {b.slots} slots + {b.queue_depth} queued")
    key = (f"{n} at once ({b.slots} slots + {b.queue_depth} queue + {cfg.overflow_extra}): "
           f"{counts(tally.statuses)}; 429 with Retry-After {with_retry}/{len(busy)}; "
           f"unanswered {unanswered}")
    lat = {str(s): stats_ms(a.elapsed for a in answers if a.status == s) for s in sorted(tally.statuses)}
    return phase_result("overflow", t0, tally, probe.summary(), key, findings, concurrent=n, slots=b.slots,
                        queue_depth=b.queue_depth, busy_429=len(busy), busy_with_retry_after=with_retry,
                        unanswered=unanswered, latency_by_status=lat, settle_s=settled_s,
                        retry_after_values=dict(Counter(a.headers.get("retry-after") for a in busy)),
                        examples=tally.examples)


# ---- phase 6: unload under load -----------------------------------------------------------------------------
class Pinger:
    """A small chat request every `interval` s while an admin call runs: which statuses do clients get?"""

    def __init__(self, b: Bench, interval: float, tally: Tally, label: str):
        self.b, self.interval, self.tally, self.label = b, interval, tally, label
        self.statuses: Counter[str] = Counter()
        self.stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            ans = self.b.request("POST", CHAT, self.b.chat_body("ping", 2))
            self.tally.add(ans, self.label, None, "unload", expected=(503,))
            self.statuses[str(ans.status or ans.outcome)] += 1
            self.stop.wait(self.interval)

    def __enter__(self) -> "Pinger":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self._thread.join(self.b.cfg.hang_s + 5)


def _brief(ans: Answer) -> dict[str, Any]:
    return {"status": ans.status, "outcome": ans.outcome, "seconds": round(ans.elapsed, 1),
            "answer": ans.message()[:200]}


def phase_unload(b: Bench) -> dict[str, Any]:
    """Unload the model while streams run, then load it back: in-flight streams should finish, new
    requests get 503 (documented; not a 500 or a hang), and the reloaded model serve the same greedy text."""
    t0 = time.monotonic()
    cfg = b.cfg
    tally = Tally()  # the admin calls and every chat request sent meanwhile
    streams: list[StreamResult | None] = [None] * cfg.unload_streams
    started = [threading.Event() for _ in range(cfg.unload_streams)]

    def run_stream(i: int) -> None:
        # Long enough to be still running when the unload arrives (the context caps it on small models).
        body = b.chat_body(f"Describe a long journey, {i}.", 1024, temperature=1.0, seed=i, ignore_eos=True)
        streams[i] = stream_chat(b.port, body, cfg.hang_s + 180, started=started[i])

    with HealthProbe(b.port) as probe:
        threads = [threading.Thread(target=run_stream, args=(i,), daemon=True) for i in range(cfg.unload_streams)]
        for t in threads:
            t.start()
        wait_until = time.monotonic() + cfg.hang_s
        for ev in started:
            ev.wait(max(0.0, wait_until - time.monotonic()))
        in_flight = sum(1 for s in streams if s is None)
        with Pinger(b, 0.5, tally, "chat during unload") as during_unload:
            unload = b.request("POST", UNLOAD, {"name": b.name, "timeout_s": 150}, timeout=180, admin=True)
        tally.add(unload, "POST /admin/models/unload", None, "unload")
        for t in threads:
            t.join(cfg.hang_s + 180)
        after_unload = b.request("POST", CHAT, b.chat_body("ping", 2))
        tally.add(after_unload, "chat after unload", None, "unload", expected=(503,))
        with Pinger(b, 1.0, tally, "chat during load") as during_load:
            load = b.request("POST", LOAD, b.reload_body, timeout=cfg.load_timeout_s, admin=True)
        tally.add(load, "POST /admin/models/load", None, "unload")
        back = b.serving(60.0)
        greedy = greedy_check(b, 0, tally) if back else {"identical": False, "answer": "the model did not come back"}
    kinds = Counter(s.kind if s is not None else "hang" for s in streams)
    findings = []
    for what, ans in (("unload", unload), ("load", load)):
        if ans.status != 200:
            findings.append(f"unload: POST /admin/models/{what} answered {ans.kind}: {ans.message()[:120]}")
    pings = during_unload.statuses + during_load.statuses
    if any(k != "200" and k != "503" for k in pings):
        findings.append(f"unload: chat requests during unload/load got {counts(pings)}")
    if kinds["done"] != cfg.unload_streams:
        findings.append(f"unload: in-flight streams did not all finish normally: {counts(kinds)}")
    if not greedy.get("identical"):
        findings.append(f"unload: greedy answer after reload not identical ({greedy.get('answer')})")
    key = (f"unload with {in_flight} streams in flight: {unload.status or unload.outcome} in {unload.elapsed:.1f} s, "
           f"load {load.status or load.outcome} in {load.elapsed:.1f} s; streams {counts(kinds)}; "
           f"chat meanwhile {counts(pings)}; greedy identical: {yes_no(greedy.get('identical'))}")
    return phase_result("unload", t0, tally, probe.summary(), key, findings, unload=_brief(unload),
                        load=_brief(load), streams=dict(kinds), streams_in_flight_at_unload=in_flight,
                        chat_during_unload=dict(during_unload.statuses), chat_during_load=dict(during_load.statuses),
                        after_unload=_brief(after_unload), serving_after=back, greedy=greedy,
                        expected_503=tally.kinds["expected 503"], examples=tally.examples)


# ---- phase 7: soak -------------------------------------------------------------------------------------------
BAD_BODIES = (b"{", b'{"messages": []}', b'{"messages": [{"role": "user", "content": "x"}], "temperature": 9}',
              b'{"messages": [{"role": "user", "content": "x"}], "frob": 1}', b"[]", b"")


def phase_soak(b: Bench) -> dict[str, Any]:
    """Bounded mixed traffic (normal, streamed, cancelled, bad) while the worker's RSS is sampled: memory
    that grows with the request count is a leak; the figure is MiB per 1000 requests."""
    t0 = time.monotonic()
    cfg = b.cfg
    end = t0 + cfg.soak_s
    tally = Tally()
    done = [0]
    lock = threading.Lock()
    samples: list[dict[str, Any]] = []

    def worker(i: int) -> None:
        rng = random.Random(cfg.seed * 1000 + i)
        k = 0
        while time.monotonic() < end:
            k += 1
            kind = rng.choices(("normal", "stream", "cancel", "bad"), (50, 20, 15, 15))[0]
            text = f"Soak {i}.{k}: " + rng.choice(GREEDY_PROMPTS)
            if kind == "normal":
                extra = {"session_id": f"soak-{i}"} if rng.random() < 0.3 else {}
                ans = b.request("POST", CHAT, b.chat_body(text, 16, temperature=0.7, seed=k, **extra))
            elif kind == "bad":
                raw = http_request("POST", CHAT, b.port, rng.choice(BAD_BODIES), {"Content-Type": "application/json"})
                ans = exchange(b.port, raw, cfg.hang_s)
            else:
                res = stream_chat(b.port, b.chat_body(text, 16, temperature=0.7, seed=k), cfg.hang_s,
                                  cancel_after=rng.randint(1, 3) if kind == "cancel" else None, rst=rng.random() < 0.5)
                ans = stream_answer(res)
            tally.add(ans, f"soak {kind}", None, "soak")
            with lock:
                done[0] += 1
            if ans.outcome != "answered":
                time.sleep(0.2)

    def sample() -> None:
        pid, rss = b.note_worker()
        with lock:
            n = done[0]
        samples.append({"t_s": round(time.monotonic() - t0, 1), "requests": n, "rss_mib": None if rss is None
                        else round(rss, 1), "pid": pid})

    with HealthProbe(b.port) as probe:
        threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(cfg.soak_workers)]
        sample()
        for t in threads:
            t.start()
        while time.monotonic() < end:
            time.sleep(min(cfg.sample_s, max(0.0, end - time.monotonic())))
            sample()
        for t in threads:
            t.join(cfg.hang_s + 5)
        settle(b, 10.0)
        sample()
    pts = [(s["requests"], s["rss_mib"]) for s in samples if s["rss_mib"] is not None]
    growth = slope(pts)
    pids = {s["pid"] for s in samples if s["pid"] is not None}
    rss = [p[1] for p in pts]
    findings = []
    if tally.kinds["5xx"] or tally.kinds["hang"]:
        findings.append(f"soak: {tally.kinds['5xx']} 5xx and {tally.kinds['hang']} hangs in {tally.tried} requests")
    if len(pids) > 1:
        findings.append(f"soak: the worker restarted (pids {sorted(pids)})")
    per_1k = None if growth is None else round(growth * 1000, 2)
    key = (f"{tally.tried} requests in {cfg.soak_s:.0f} s; RSS {rss[0] if rss else '-'} -> {rss[-1] if rss else '-'} "
           f"MiB; growth {'-' if per_1k is None else per_1k} MiB/1000 requests")
    return phase_result("soak", t0, tally, probe.summary(), key, findings, rss_growth_mib_per_1k_requests=per_1k,
                        rss_start_mib=rss[0] if rss else None, rss_end_mib=rss[-1] if rss else None,
                        rss_peak_mib=max(rss) if rss else None, samples=samples,
                        by_status={str(k): v for k, v in sorted(tally.statuses.items())}, examples=tally.examples)


# ---- phase 8: greedy identity -------------------------------------------------------------------------------
def phase_greedy(b: Bench) -> dict[str, Any]:
    """The baseline greedy prompts again, now beside sampled streams: batching must not change a row's
    result, so the text must be identical. One answer is also streamed and compared."""
    t0 = time.monotonic()
    tally = Tally()
    with HealthProbe(b.port) as probe, BackgroundStreams(b, 3, max_tokens=48) as load:
        checks = [greedy_check(b, i, tally) for i in range(len(GREEDY_PROMPTS))]
        streamed = stream_chat(b.port, b.greedy_body(GREEDY_PROMPTS[0]), b.cfg.hang_s)
        tally.add(stream_answer(streamed), "greedy streamed", None, "greedy")
    same_stream = streamed.outcome == "done" and streamed.text == (b.baseline[0] if b.baseline else None)
    identical = all(c["identical"] for c in checks) and bool(checks)
    findings = [] if identical else [f"greedy: {sum(not c['identical'] for c in checks)} of {len(checks)} greedy "
                                     "answers under load differ from the baseline"]
    if not same_stream:
        findings.append(f"greedy: the streamed greedy answer differs from the baseline ({streamed.outcome})")
    key = (f"{sum(c['identical'] for c in checks)}/{len(checks)} identical under load; streamed identical: "
           f"{yes_no(same_stream)}; background streams {counts(load.summary()['by_outcome'])}")
    return phase_result("greedy", t0, tally, probe.summary(), key, findings, identical=identical,
                        streamed_identical=same_stream, checks=checks, background=load.summary())


# ---- phases 9-13 (issue 31): expensive inputs beside a witness stream ------------------------------------
# Each of these phases sends inputs that cost the server far more than they cost the client (a big grammar,
# a huge embeddings batch, tokenizer work, an amplified answer) or that test one protocol rule, while a
# witness stream runs: a plain streaming chat whose gaps between SSE chunks show whether another request's
# work stalled generation. Issue 31's acceptance: no 5xx, no hang, GET / p99 under 1 s in every phase, no
# witness gap of 1 s caused by another request's grammar, embeddings or tokenizer work.
ATTACK_PHASES = ("protocol", "tokenizer", "amplification", "embeddings", "grammar", "truncation", "generations",
                 "embed-many", "count-tokens", "responses-store", "images")
GAP_LIMIT_MS = 1000.0  # a witness gap this long is a finding
ROOT_P99_LIMIT_MS = 1000.0  # so is a GET / p99 this long
SLOW_REFUSAL_MS = 1000.0  # a refusal slower than this is reported (a cheap 400/429 is the pass)
WITNESS_TOKENS = 1024  # what the witness asks for (the context caps it on small models)
WITNESS_STREAM_S = 300.0  # longest one witness stream may run (on top of --hang-s)
MAX_WITNESS_STREAMS = 500  # streams (and plain chats) one witness may start in a phase
NEWCOMER_S = 2.0  # beside the witness, a small plain chat this often: are new chats still admitted?
ABANDON_S = 3.0  # clients that leave close their connection after this long
WATCH_S = 5.0  # the witness keeps running this long after clients left
QUIET_CORES = 0.25  # the worker is quiet once it uses at most this many cores more than when idle ...
NEWBORN_CPU_S = 0.01  # ... and threads born during the phase used less CPU than this in a sample
CPU_SAMPLE_S = 0.5
LEFTOVER_S = 5.0  # work still running this long after the last client was done or gone is a finding
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
BIG_READ = 64 << 20  # answers that are big on purpose (token lists, amplified completions) are read up to this
ATTACK_BODY = BODY_LIMIT - 1024  # bodies sized "to the limit" stay this far under it
DETOKENIZE_IDS = 1 << 20  # the issue's "1M ids"
EMBED_INPUTS = 2048  # the issue's embeddings request: 2048 inputs ...
EMBED_ITEM_TOKENS = 450  # ... of ~450 tokens each (fewer where the context is smaller)
ECHO_PROMPT_CHARS = 4096  # the issue's completions case: a 4 kB prompt (less where the context is smaller)
ECHO_TOKENS = 256  # ... generating this much per choice (a quarter of the context at most)
WORDS = "the river runs past the old town and on to the sea "
SCHEMA_TYPES = ("string", "integer", "number", "boolean")


def words_text(n: int, lead: str = "") -> str:
    """`n` characters of plain words (ASCII, so also `n` bytes), starting with `lead`."""
    if n <= 0:
        return ""
    return (lead + WORDS * (n // len(WORDS) + 1))[:n]


def count_tokens(b: Bench, text: str) -> int | None:
    """Tokens `text` has under the served model's tokenizer (POST /tokenize); None when it fails."""
    ans = b.request("POST", "/tokenize", {"model": b.name, "content": text}, timeout=b.cfg.hang_s)
    obj = ans.json() if ans.status == 200 else None
    tokens = obj.get("tokens") if isinstance(obj, dict) else None
    return len(tokens) if isinstance(tokens, list) else None


def token_ids(b: Bench, text: str) -> list[int]:
    ans = b.request("POST", "/tokenize", {"model": b.name, "content": text}, timeout=b.cfg.hang_s)
    obj = ans.json() if ans.status == 200 else None
    tokens = obj.get("tokens") if isinstance(obj, dict) else None
    return [t for t in tokens if isinstance(t, int)] if isinstance(tokens, list) else []


def calibrate(b: Bench) -> tuple[int, float]:
    """(one slot's context in tokens, characters per token of WORDS text), read once per run.

    The issue's inputs are sized for SmolLM2 (2048-token context); a smaller model would refuse them as
    too long before doing the expensive work, so prompts and embedding inputs are scaled to what fits.
    The context comes from `GET /v1/loads` (tokens of all slots / slots); fallbacks: 2048 and 4.0.
    """
    if b.context_tokens is None:
        obj = b.request("GET", "/v1/loads", timeout=10).json()
        ctx = 2048
        try:
            load = obj["loads"][0]
            ctx = int(load["max_total_num_tokens"]) // max(1, int(load["max_running_requests"]))
        except (TypeError, KeyError, IndexError, ValueError, ZeroDivisionError):
            pass
        b.context_tokens = max(64, ctx)
    if b.chars_per_token is None:
        sample = words_text(2000)
        n = count_tokens(b, sample)
        b.chars_per_token = len(sample) / n if n else 4.0
    return b.context_tokens, b.chars_per_token


class Witness(_StreamThreads):
    """A plain streaming chat beside an attack, restarted back to back, and a small plain chat every
    NEWCOMER_S.

    Its figures are what issue 31 is judged by: the largest gap between two SSE chunks of one stream
    (another request's grammar, embeddings or tokenizer work stalling the batch shows here) and its
    p99, and whether new chats are still admitted (an embeddings job holding every slot shows as 429s).
    Gaps are taken within a stream; a new stream's wait for its first chunk is reported apart.
    """

    def __init__(self, b: Bench, newcomers: bool = True):
        self.b = b
        self.stop = threading.Event()
        self.first_chunk = threading.Event()
        self.streams: list[StreamResult] = []
        self.newcomers: list[Answer] = []
        self.t0 = 0.0
        self._threads = [threading.Thread(target=self._stream_loop, name="witness", daemon=True)]
        if newcomers:
            self._threads.append(threading.Thread(target=self._newcomer_loop, name="newcomers", daemon=True))

    def _stream_loop(self) -> None:
        for k in range(MAX_WITNESS_STREAMS):
            if self.stop.is_set():
                return
            body = self.b.chat_body(f"Witness {k}: tell a long and plain story about a river.", WITNESS_TOKENS,
                                    temperature=0.7, seed=k, ignore_eos=True)
            res = stream_chat(self.b.port, body, self.b.cfg.hang_s + WITNESS_STREAM_S, stop=self.stop,
                              started=self.first_chunk)
            self.streams.append(res)
            if res.outcome not in ("done", "stopped"):
                self.stop.wait(0.5)  # a failing server: do not spin

    def _newcomer_loop(self) -> None:
        for k in range(MAX_WITNESS_STREAMS):
            if self.stop.wait(NEWCOMER_S):
                return
            self.newcomers.append(self.b.request("POST", CHAT, self.b.chat_body(f"Newcomer {k}: say hello.", 4,
                                                                               temperature=0)))

    def summary(self) -> dict[str, Any]:
        return witness_summary(list(self.streams), list(self.newcomers), self.t0)


def witness_summary(streams: list[StreamResult], newcomers: list[Answer], t0: float) -> dict[str, Any]:
    """The witness's figures: gaps between chunks within each stream (p50/p99/max, and when the worst
    ended, in seconds since the witness began), streams by outcome, first-chunk waits, plain chats."""
    gaps = [(later - earlier, later - t0) for r in streams for earlier, later in zip(r.times, r.times[1:])]
    worst = max(gaps, default=None)
    g = stats_ms(gap for gap, _ in gaps)
    return {"streams": len(streams), "by_outcome": dict(Counter(r.kind for r in streams)),
            "chunks": sum(r.chunks for r in streams), "gaps": len(gaps),
            "p50_gap_ms": g["p50_ms"], "p99_gap_ms": g["p99_ms"], "max_gap_ms": g["max_ms"],
            "worst_gap_at_s": None if worst is None else round(worst[1], 1),
            "first_chunk": stats_ms(r.first_chunk_s for r in streams if r.first_chunk_s is not None),
            "newcomers": {"sent": len(newcomers),
                          "by_status": dict(Counter(str(a.status or a.outcome) for a in newcomers)),
                          **stats_ms(a.elapsed for a in newcomers)}}


def judge_attack(name: str, kinds: Mapping[str, int], health: Mapping[str, Any], witness: Mapping[str, Any],
                 hang_s: float) -> list[str]:
    """Issue 31's acceptance, as findings: a 5xx, a hang, GET / p99 >= 1 s or a failed probe, a witness
    gap >= 1 s, a witness stream that did not stream or ended badly, a plain chat refused meanwhile."""
    out = []
    if kinds.get("5xx"):
        out.append(f"{name}: {kinds['5xx']} requests got a 5xx")
    if kinds.get("hang"):
        out.append(f"{name}: {kinds['hang']} requests got no answer within {hang_s:.0f} s")
    p99 = health.get("p99_ms")
    if p99 is not None and p99 >= ROOT_P99_LIMIT_MS:
        out.append(f"{name}: GET / p99 {p99} ms (max {health.get('max_ms')} ms at {health.get('worst_at_s')} s)")
    if health.get("failed"):
        out.append(f"{name}: {health['failed']} of {health.get('probes')} GET / probes failed")
    gap = witness.get("max_gap_ms")
    if gap is not None and gap >= GAP_LIMIT_MS:
        out.append(f"{name}: the witness stream waited {gap} ms between two chunks (at "
                   f"{witness.get('worst_gap_at_s')} s; p99 gap {witness.get('p99_gap_ms')} ms)")
    if not witness.get("chunks"):
        out.append(f"{name}: the witness stream never streamed, so there is no gap to judge")
    bad = {k: v for k, v in (witness.get("by_outcome") or {}).items() if k not in ("done", "stopped")}
    if bad:
        out.append(f"{name}: witness streams ended badly: {counts(bad)}")
    refused = {k: v for k, v in ((witness.get("newcomers") or {}).get("by_status") or {}).items() if k != "200"}
    if refused:
        out.append(f"{name}: plain chats sent meanwhile got {counts(refused)}")
    return out


# -- the worker after the clients: is anything still burning CPU for nobody? -------------------------------
def worker_cpu_s(b: Bench) -> float | None:
    """CPU seconds (user + system, every thread) the worker has used so far; None without a worker."""
    w = b.server.worker()
    try:
        t = w.cpu_times() if w is not None else None
    except psutil.Error:
        return None
    return None if t is None else t.user + t.system


def parse_task_stat(text: str) -> tuple[str, float] | None:
    """(thread name, CPU seconds) from one /proc/PID/task/TID/stat line; None if it does not parse.
    The name sits in parentheses and may itself hold spaces or parentheses: fields follow the last ')'."""
    open_at, close_at = text.find("("), text.rfind(")")
    rest = text[close_at + 2:].split() if 0 <= open_at < close_at else []
    if len(rest) < 13 or not (rest[11].isdigit() and rest[12].isdigit()):
        return None
    return text[open_at + 1:close_at], (int(rest[11]) + int(rest[12])) / CLOCK_TICKS  # utime, stime


def task_cpu(pid: int | None) -> dict[int, tuple[str, float]]:
    """Each thread of `pid`: (name, CPU seconds so far). Pantheon names its OS threads (e.g.
    "pantheon-gramma" for a grammar compile), so work left running after its client is visible by name."""
    out: dict[int, tuple[str, float]] = {}
    if pid is None:
        return out
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids[:4096]:
        try:
            got = parse_task_stat(Path(f"/proc/{pid}/task/{tid}/stat").read_text())
        except OSError:  # the thread ended meanwhile
            continue
        if got is not None and tid.isdigit():
            out[int(tid)] = got
    return out


def thread_names(pid: int | None) -> Counter[str]:
    """The threads of `pid` by name."""
    return Counter(name for name, _ in task_cpu(pid).values())


def cpu_rate(b: Bench, window_s: float) -> float | None:
    """Cores the worker used over the next `window_s` seconds."""
    c0, t0 = worker_cpu_s(b), time.monotonic()
    time.sleep(window_s)
    c1, t1 = worker_cpu_s(b), time.monotonic()
    return None if c0 is None or c1 is None else max(0.0, (c1 - c0) / (t1 - t0))


def quiet_after(samples: list[tuple[float, bool]]) -> float | None:
    """Given (seconds since the clients were done, whether the worker was quiet over the sample ending
    then), when it went quiet: the start of the first two quiet samples in a row; None if it never did."""
    prev_end, run_start, run = 0.0, 0.0, 0
    for end, quiet in samples:
        if quiet:
            run_start = prev_end if run == 0 else run_start
            run += 1
            if run >= 2:
                return round(run_start, 1)
        else:
            run = 0
        prev_end = end
    return None


def drain(b: Bench, idle_cores: float | None, tasks_before: dict[int, tuple[str, float]],
          budget_s: float) -> dict[str, Any]:
    """After every client of a phase is done or gone: how long the worker still worked (a grammar
    compile or an embeddings job nobody waits for), bounded by `budget_s`. It also lets the next phase
    start on a quiet server, so its figures are its own.

    A sample is busy when the worker used more than QUIET_CORES above its idle rate, or when any thread
    born during the phase used CPU at all: on a shared machine a contended compile thread may get a
    fraction of a core, too little for the process rate alone to tell.
    """
    limit = QUIET_CORES + min(idle_cores or 0.0, QUIET_CORES)
    pid, _ = b.server.worker_rss()
    t0 = time.monotonic()
    first = prev = task_cpu(pid)
    last_c, last_t = worker_cpu_s(b), t0
    samples: list[tuple[float, bool]] = []
    peak = 0.0
    busy = None
    while last_c is not None and time.monotonic() - t0 < budget_s:
        time.sleep(CPU_SAMPLE_S)
        cur, c, t = task_cpu(pid), worker_cpu_s(b), time.monotonic()
        if c is None:
            break
        rate = max(0.0, (c - last_c) / max(1e-6, t - last_t))
        newborn = sum(cpu - prev.get(tid, ("", 0.0))[1] for tid, (_, cpu) in cur.items() if tid not in tasks_before)
        peak = max(peak, rate)
        samples.append((t - t0, rate <= limit and newborn < NEWBORN_CPU_S))
        prev, last_c, last_t = cur, c, t
        busy = quiet_after(samples)
        if busy is not None:
            break
    added: dict[str, dict[str, float]] = {}
    for tid, (name, cpu) in prev.items():
        if tid not in tasks_before:
            got = added.setdefault(name, {"threads": 0, "cpu_s_after_clients": 0.0})
            got["threads"] += 1
            got["cpu_s_after_clients"] = round(got["cpu_s_after_clients"] + cpu - first.get(tid, ("", 0.0))[1], 2)
    return {"measured": bool(samples), "budget_s": budget_s, "threshold_cores": round(limit, 2),
            "idle_cores_before": None if idle_cores is None else round(idle_cores, 2),
            "busy_s": busy, "peak_cores": round(peak, 2), "threads_added": added}


def judge_quiet(name: str, quiet: Mapping[str, Any]) -> list[str]:
    """Work that outlives its client: the worker still busy LEFTOVER_S after the phase's last client was
    done or gone (or past the drain's whole budget)."""
    if not quiet.get("measured"):
        return []
    busy = quiet.get("busy_s")
    if busy is not None and busy <= LEFTOVER_S:
        return []
    threads = ", ".join(f"{n} x{v['threads']} ({v['cpu_s_after_clients']} CPU s)"
                        for n, v in (quiet.get("threads_added") or {}).items()) or "none"
    when = f"for {busy} s" if busy is not None else f"for more than {quiet.get('budget_s'):.0f} s"
    return [f"{name}: the worker kept working {when} after every client was done or gone (threads born in "
            f"the phase: {threads})"]


def with_witness(b: Bench, attack: Callable[[], None]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Run `attack()` while GET / is timed and a witness streams, then wait (bounded) for the worker to
    go quiet: (GET / figures, witness figures, drain figures)."""
    pid, _ = b.server.worker_rss()
    tasks_before = task_cpu(pid)
    idle = cpu_rate(b, 1.0)
    with HealthProbe(b.port) as probe, Witness(b) as witness:
        attack()
    return probe.summary(), witness.summary(), drain(b, idle, tasks_before, b.cfg.drain_s)


def error_code(ans: Answer) -> str | None:
    obj = ans.json()
    err = obj.get("error") if isinstance(obj, dict) else None
    return err.get("code") if isinstance(err, dict) and isinstance(err.get("code"), str) else None


def left(ans: Answer) -> Answer:
    """A client that left on purpose (ABANDON_S) is not a hang: its unanswered request counts as "left"."""
    if ans.outcome == "hang":
        return Answer(ans.status, ans.headers, ans.body, ans.elapsed, "left", ans.error)
    return ans


def record(tally: Tally, attacks: list[dict], label: str, ans: Answer, family: str,
           expected: tuple[int, ...] = (), **extra: Any) -> dict[str, Any]:
    """Count one attack request and keep what a reader needs: status, how long it took, why refused."""
    tally.add(ans, label, None, family, expected)
    rec = {"input": label, "status": ans.status, "outcome": ans.outcome, "ms": round(ans.elapsed * 1e3, 1),
           "code": error_code(ans), "answer": ans.message()[:160] if (ans.status or 0) >= 400 else "",
           "answer_bytes": len(ans.body), **extra}
    attacks.append(rec)
    return rec


def attacks_line(attacks: list[dict]) -> str:
    """One line: each attack's status (or outcome) and time."""
    return "; ".join(f"{a['input']}: {a['status'] or a['outcome']} in {a['ms']:.0f} ms" for a in attacks)


def slow_refusals(attacks: list[dict]) -> list[dict]:
    """Refusals (4xx) that took longer than SLOW_REFUSAL_MS: the server did the expensive work first."""
    return [a for a in attacks if a["status"] and 400 <= a["status"] < 500 and a["ms"] > SLOW_REFUSAL_MS]


def attack_result(name: str, t0: float, tally: Tally, hang_s: float, health: dict, witness: dict, quiet: dict,
                  attacks: list[dict], findings: list[str], key: str, **details: Any) -> dict[str, Any]:
    """The common report of an attack phase: phase_result plus the witness, the drain and each attack.
    `hang_s`: how long the phase waited for an answer before calling it a hang."""
    findings = judge_attack(name, tally.kinds, health, witness, hang_s) + judge_quiet(name, quiet) + findings
    slow = slow_refusals(attacks)
    key += (f"; witness max gap {_v(witness['max_gap_ms'])} ms, p99 {_v(witness['p99_gap_ms'])} ms"
            + (f"; {len(slow)} refusals slower than {SLOW_REFUSAL_MS:.0f} ms" if slow else ""))
    return phase_result(name, t0, tally, health, key, findings, witness=witness, after_clients=quiet,
                        attacks=attacks, slow_refusals=[a["input"] for a in slow], examples=tally.examples,
                        **details)


# -- phase 9: protocol rules --------------------------------------------------------------------------------
TE_CASES: tuple[tuple[tuple[str, ...], str], ...] = (
    (("gzip, chunked",), "gzip"), (("gzip, chunked",), "identity"), (("deflate, chunked",), "deflate"),
    (("gzip", "chunked"), "gzip"),  # the same codings on two header lines
)
NOTE_TOOL = {"type": "function", "function": {
    "name": "record_note", "description": "Store a note for later.",
    "parameters": {"type": "object", "properties": {"text": {"type": "string", "minLength": 400}},
                   "required": ["text"], "additionalProperties": False}}}
TOOL_PREFIX = '<tool_call>\n{"name": "record_note", "arguments": {"text": "'  # what a forced call starts with
TOOL_CUTS = (("in the arguments", "required", False), ("in the arguments", "required", True),
             ("in the arguments", "named", False), ("in the arguments", "named", True),
             ("in the opening tag", "required", False), ("in the opening tag", "required", True))
# Pairs of (user, session_id, cache_salt) whose scope hash once collided: each part was written as
# 0x01 + text + 0x00 (0x00 for a missing one), so a NUL inside one part could fake a part boundary.
SCOPE_PAIRS: tuple[tuple[str, dict[str, str], dict[str, str]], ...] = (
    ("user 'x\\0\\1y' then user 'x' + session_id 'y\\0'", {"user": "x\u0000\u0001y"},
     {"user": "x", "session_id": "y\u0000"}),
    ("session_id 's\\0\\1t' then session_id 's' + cache_salt 't\\0'", {"session_id": "s\u0000\u0001t"},
     {"session_id": "s", "cache_salt": "t\u0000"}),
)
SCOPE_CONTROL = ("the same user twice (control)", {"user": "rbench-control"}, {"user": "rbench-control"})


def te_request(port: int, payload: bytes, codings: tuple[str, ...], body_coding: str) -> bytes:
    """A chat POST framed with `Transfer-Encoding` (one header line per item of `codings`), its body
    compressed as `body_coding` says and sent as one chunk."""
    data = gzip.compress(payload) if body_coding == "gzip" else zlib.compress(payload) \
        if body_coding == "deflate" else payload
    head = http_request("POST", CHAT, port, None,
                        [("Content-Type", "application/json")] + [("Transfer-Encoding", c) for c in codings])
    return head + b"%x\r\n" % len(data) + data + b"\r\n0\r\n\r\n"


def has_tool_markup(text: str) -> bool:
    """Whether `text` shows raw tool-call markup: a tag, or an opening tag cut short at its end."""
    if "<tool_call" in text or "</tool_call" in text:
        return True
    tail = text.rstrip()
    return any(tail.endswith("<tool_call>"[:k]) for k in range(2, len("<tool_call>")))


def tool_cut_problems(content: str, calls: list[dict], expect_calls: bool) -> list[str]:
    """What is wrong with a forced tool call cut by max_tokens: markup left in the content, or (cut
    inside the arguments, where the call's name is known) no tool_calls at all."""
    out = []
    if has_tool_markup(content):
        out.append(f"tool-call markup in content: {content[:80]!r}")
    if expect_calls and not calls:
        out.append("no tool_calls")
    return out


def cached_tokens(obj: Any) -> int | None:
    """usage.prompt_tokens_details.cached_tokens of a chat answer; None when absent."""
    try:
        v = obj["usage"]["prompt_tokens_details"]["cached_tokens"]
    except (TypeError, KeyError):
        return None
    return v if isinstance(v, int) else None


def chat_message(obj: Any) -> tuple[str, list[dict], str | None]:
    """(content, tool_calls as [{"name", "arguments"}], finish_reason) of a non-streamed chat answer."""
    try:
        choice = obj["choices"][0]
        msg = choice["message"]
    except (TypeError, KeyError, IndexError):
        return "", [], None
    if not isinstance(msg, dict):
        return "", [], None
    calls = []
    for call in msg.get("tool_calls") or []:
        fn = call.get("function") if isinstance(call, dict) and isinstance(call.get("function"), dict) else {}
        calls.append({"name": _text(fn.get("name")), "arguments": _text(fn.get("arguments"))})
    return _text(msg.get("content")), calls, choice.get("finish_reason")


def phase_protocol(b: Bench) -> dict[str, Any]:
    """Three rules (issue 31, 8/11/12): a body framed `Transfer-Encoding: gzip, chunked` must be refused
    (501, or 400), not decoded as if only chunked; a forced tool call cut by max_tokens must come back as
    tool_calls, never as raw `<tool_call>` markup in content; and two requests whose (user, session_id,
    cache_salt) differ must not share prefix-cache entries (the second's cached_tokens is 0), shown
    beside a control pair in one scope whose second request should reuse the first's prompt."""
    t0 = time.monotonic()
    cfg = b.cfg
    tally, attacks = Tally(), []
    ctx, cpt = calibrate(b)
    prefix = count_tokens(b, TOOL_PREFIX)
    cut_args = (prefix or 36) + 12  # past any indentation, into the "text" argument (400 characters long)
    findings: list[str] = []
    te_accepted: list[str] = []
    tool_checks: list[dict] = []
    scope_checks: list[dict] = []
    scope_prompt_chars = int(min(160, ctx // 3) * cpt)

    def attack() -> None:
        payload = json.dumps(b.chat_body("hi", 2)).encode()
        for codings, coding in TE_CASES:
            label = f"Transfer-Encoding {' + '.join(codings)!r}, body {coding}"
            ans = exchange(b.port, te_request(b.port, payload, codings, coding), cfg.hang_s)
            record(tally, attacks, label, ans, "protocol", expected=(501,))
            if ans.status is not None and 200 <= ans.status < 300:
                te_accepted.append(f"{label} -> {ans.status}")
        for i, (where, choice, stream) in enumerate(TOOL_CUTS):
            max_tokens = 2 if where == "in the opening tag" else cut_args
            tool_choice = "required" if choice == "required" else {"type": "function",
                                                                   "function": {"name": "record_note"}}
            body = b.chat_body("Write a long note about rivers.", max_tokens, tools=[NOTE_TOOL],
                               tool_choice=tool_choice, temperature=0.7, seed=cfg.seed + i)
            label = f"forced tool call ({choice}) cut {where} (max_tokens {max_tokens}, " \
                    f"{'streamed' if stream else 'not streamed'})"
            if stream:
                res = stream_chat(b.port, body, cfg.hang_s)
                ans = stream_answer(res)
                content, calls, finish = res.text, list(res.tool_calls.values()), res.finish_reason
            else:
                ans = b.request("POST", CHAT, body)
                content, calls, finish = chat_message(ans.json()) if ans.status == 200 else ("", [], None)
            rec = record(tally, attacks, label, ans, "protocol")
            problems = tool_cut_problems(content, calls, where == "in the arguments") if ans.status == 200 else []
            tool_checks.append({"input": label, "status": ans.status, "finish_reason": finish,
                                "content": content[:120], "tool_calls": [c["name"] for c in calls],
                                "problems": problems, "ms": rec["ms"]})
        for j, (label, first, second) in enumerate((SCOPE_CONTROL,) + SCOPE_PAIRS):
            prompt = words_text(scope_prompt_chars, lead=f"Scope probe {j}, seed {cfg.seed}: ")
            got = []
            for which, extra in (("first", first), ("second", second)):
                ans = b.request("POST", CHAT, b.chat_body(prompt, 1, temperature=0, **extra))
                record(tally, attacks, f"{label}: {which}", ans, "protocol")
                obj = ans.json() if ans.status == 200 else None
                got.append({"status": ans.status, "cached_tokens": cached_tokens(obj),
                            "prompt_tokens": (obj.get("usage") or {}).get("prompt_tokens") if isinstance(obj, dict)
                            else None})
            scope_checks.append({"pair": label, "control": j == 0, "first": got[0], "second": got[1]})

    health, witness, quiet = with_witness(b, attack)
    for a in te_accepted:
        findings.append(f"protocol: an unknown transfer coding was accepted: {a} (RFC 9112: 501)")
    leaks = [c for c in tool_checks if c["problems"]]
    for c in leaks:
        findings.append(f"protocol: {c['input']}: {'; '.join(c['problems'])}")
    control = scope_checks[0] if scope_checks else None
    collided = [c for c in scope_checks[1:] if (c["second"]["cached_tokens"] or 0) > 0]
    for c in collided:
        findings.append(f"protocol: cache scopes collide: {c['pair']}: the second reused "
                        f"{c['second']['cached_tokens']} of {c['second']['prompt_tokens']} prompt tokens")
    control_reused = control is not None and (control["second"]["cached_tokens"] or 0) > 0
    refused = sum(1 for c in tool_checks if c["status"] != 200)
    unjudged = f" ({refused} refused: inconclusive)" if refused else ""
    key = (f"TE gzip accepted {len(te_accepted)}/{len(TE_CASES)}; cut tool calls with markup or no tool_calls "
           f"{len(leaks)}/{len(tool_checks)}{unjudged}; scope collisions {len(collided)}/{len(SCOPE_PAIRS)} "
           f"(control reused {control['second']['cached_tokens'] if control else '-'} tokens"
           f"{'' if control_reused else ': no reuse at all, so the collision check is inconclusive'})")
    return attack_result("protocol", t0, tally, cfg.hang_s, health, witness, quiet, attacks, findings, key,
                         transfer_encoding_accepted=te_accepted, tool_cuts=tool_checks, scope_pairs=scope_checks,
                         scope_check_conclusive=control_reused)


# -- phase 10: tokenizer endpoints --------------------------------------------------------------------------
def id_list_body(pool: list[int], budget: int, cap: int | None = None, model: str | None = None) -> tuple[bytes, int]:
    """The largest `{"model": ..., "tokens": [...]}` body of at most `budget` bytes (and at most `cap`
    ids), cycling through `pool` (ids the model's tokenizer produced, so every one is valid): (body, ids)."""
    head = b'{"model":' + json.dumps(model).encode() + b',"tokens":['
    tail = b"]}"
    cycle = [str(i).encode() for i in pool] or [b"1"]
    per_cycle = sum(len(x) + 1 for x in cycle)  # each id and its comma
    room = budget - len(head) - len(tail) + 1  # the last id has no comma
    n = max(0, room // per_cycle) * len(cycle)
    rest = room - (n // len(cycle)) * per_cycle
    for x in cycle:
        if len(x) + 1 > rest:
            break
        n, rest = n + 1, rest - len(x) - 1
    if cap is not None:
        n = min(n, cap)
    full, part = divmod(n, len(cycle))
    pieces = [b",".join(cycle)] * full + ([b",".join(cycle[:part])] if part else [])
    return head + b",".join(pieces) + tail, n


def short_ids(ids: list[int], k: int = 8) -> list[int]:
    """The `k` distinct ids with the fewest digits: the most ids per body byte."""
    return sorted(set(ids), key=lambda i: (len(str(i)), i))[:k]


def phase_tokenizer(b: Bench) -> dict[str, Any]:
    """/tokenize past the 16,384-character mark where it used to always 500 (20k, 200k characters and a
    body at the limit) and /detokenize with 1M ids, alone and two at once, then with as many ids as the
    body limit holds: every answer a 200 (or a quick 4xx for the over-limit list), and GET / and the
    witness unaffected (issue 31, 5 and 6: 1M ids froze GET / and every stream for 3.6 s)."""
    t0 = time.monotonic()
    cfg = b.cfg
    tally, attacks = Tally(), []
    pool = short_ids(token_ids(b, words_text(2000))) or [5, 6, 7, 8, 9]
    wrapper = len(json.dumps({"model": b.name, "content": ""}))
    sizes = (20_000, 200_000, ATTACK_BODY - wrapper)

    def tokenize(n: int, pieces: bool = False) -> None:
        body = json.dumps({"model": b.name, "content": words_text(n, lead="Tokenize me: "),
                           **({"with_pieces": True} if pieces else {})}).encode()
        raw = http_request("POST", "/tokenize", b.port, body, {"Content-Type": "application/json"})
        ans = exchange(b.port, raw, cfg.hang_s, limit=BIG_READ)
        obj = ans.json() if ans.status == 200 else None
        tokens = obj.get("tokens") if isinstance(obj, dict) else None
        record(tally, attacks, f"/tokenize {n} characters{' with pieces' if pieces else ''}", ans, "tokenizer",
               request_bytes=len(body), tokens=len(tokens) if isinstance(tokens, list) else None)

    def detokenize(body: bytes, n: int, label: str) -> Answer:
        raw = http_request("POST", "/detokenize", b.port, body, {"Content-Type": "application/json"})
        ans = exchange(b.port, raw, cfg.hang_s, limit=BIG_READ)
        obj = ans.json() if ans.status == 200 else None
        content = obj.get("content") if isinstance(obj, dict) else None
        record(tally, attacks, label, ans, "tokenizer", request_bytes=len(body), ids=n,
               content_chars=len(content) if isinstance(content, str) else None)
        return ans

    def attack() -> None:
        for n in sizes:
            tokenize(n)
        tokenize(sizes[0], pieces=True)
        body, n = id_list_body(pool, ATTACK_BODY, DETOKENIZE_IDS, b.name)
        detokenize(body, n, f"/detokenize {n} ids")
        run_threads(lambda i: detokenize(body, n, f"/detokenize {n} ids (two at once, #{i + 1})"), 2,
                    cfg.hang_s + 10)
        full, m = id_list_body(pool, ATTACK_BODY, None, b.name)
        if m > n:
            detokenize(full, m, f"/detokenize {m} ids (the body limit)")

    health, witness, quiet = with_witness(b, attack)
    findings = [f"tokenizer: {a['input']} answered 200 without a token list" for a in attacks
                if a["status"] == 200 and a["input"].startswith("/tokenize") and not a.get("tokens")]
    key = attacks_line(attacks)
    return attack_result("tokenizer", t0, tally, cfg.hang_s, health, witness, quiet, attacks, findings, key,
                         id_pool=pool)


# -- phase 11: amplification: a huge tools list, echo + logprobs + n ------------------------------------------
def huge_tools(n_bytes: int) -> list[dict]:
    """About `n_bytes` of tool definitions (~1.2 kB each: a long description and one parameter)."""
    one = 1200
    return [{"type": "function", "function": {
        "name": f"tool_{i:05d}", "description": words_text(1000, lead=f"Tool {i}: "),
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}
        for i in range(max(1, n_bytes // one))]


def phase_amplification(b: Bench) -> dict[str, Any]:
    """Requests whose cost dwarfs their size (issue 31, 9 and 10): a ~2.4 MB tools list with tool_choice
    "required" (it used to be rendered and tokenized in full, then refused after 25 s: a quick 4xx is the
    pass), and a completion with echo, logprobs 20 and n 8 on a ~4 kB prompt, streamed and not (8.25 MB
    over 87 s, GET / up to 1.8 s). Reported: time to answer, bytes returned, and the witness."""
    t0 = time.monotonic()
    cfg = b.cfg
    tally, attacks = Tally(), []
    ctx, cpt = calibrate(b)
    max_tokens = max(8, min(ECHO_TOKENS, ctx // 4))
    prompt = words_text(max(64, min(ECHO_PROMPT_CHARS, int((ctx - max_tokens - 32) * cpt * 0.8))),
                        lead="Score this text: ")
    echo = {"model": b.name, "prompt": prompt, "echo": True, "logprobs": 20, "n": 8, "max_tokens": max_tokens,
            "temperature": 0.8, "seed": cfg.seed}
    streamed: dict[str, Any] = {}

    def attack() -> None:
        tools = huge_tools(cfg.tools_bytes)
        body = json.dumps(b.chat_body("Call one tool.", 16, tools=tools, tool_choice="required")).encode()
        del tools
        raw = http_request("POST", CHAT, b.port, body, {"Content-Type": "application/json"})
        record(tally, attacks, f"{len(body)} B tools list, tool_choice required", exchange(b.port, raw, cfg.hang_s),
               "amplification", request_bytes=len(body))
        res = stream_chat(b.port, echo, cfg.amplify_s, path=COMPLETIONS, max_bytes=BIG_READ)
        ans = stream_answer(res)
        flowing = res.outcome == "hang" and bool(res.times) and time.monotonic() - res.times[-1] < 2.0
        if flowing:  # still sending at our deadline: slow, not stuck
            ans = Answer(res.status, res.headers, b"", res.elapsed, "still streaming", None)
        streamed.update(outcome=res.outcome if not flowing else "still streaming at the deadline",
                        bytes=res.nbytes, chunks=res.chunks, seconds=round(res.elapsed, 1),
                        mb_per_s=round(res.nbytes / 2**20 / max(res.elapsed, 1e-3), 2))
        record(tally, attacks, f"completion echo+logprobs 20+n 8, {len(prompt)} chars, streamed", ans,
               "amplification", answer_bytes=res.nbytes, chunks=res.chunks)
        raw = http_request("POST", COMPLETIONS, b.port, json.dumps(echo).encode(), {"Content-Type": "application/json"})
        record(tally, attacks, f"completion echo+logprobs 20+n 8, {len(prompt)} chars, not streamed",
               exchange(b.port, raw, cfg.amplify_s, limit=BIG_READ), "amplification")

    health, witness, quiet = with_witness(b, attack)
    key = attacks_line(attacks) + f"; streamed {streamed.get('bytes', 0) / 2**20:.2f} MiB"
    return attack_result("amplification", t0, tally, max(cfg.hang_s, cfg.amplify_s), health, witness, quiet,
                         attacks, [], key,
                         echo_request={k: v for k, v in echo.items() if k != "prompt"}, prompt_chars=len(prompt),
                         streamed=streamed)


# -- phase 12: one huge embeddings request --------------------------------------------------------------------
def embeddings_body(model: str, n_inputs: int, item_chars: int, budget: int) -> tuple[bytes, int]:
    """An embeddings body of `n_inputs` distinct texts of `item_chars` characters, with fewer inputs
    if that would pass `budget` bytes: (body, inputs)."""
    n = n_inputs
    for _ in range(64):  # bounded: each round drops what overflowed
        texts = [words_text(item_chars, lead=f"{i}: ") for i in range(n)]
        body = json.dumps({"model": model, "input": texts}).encode()
        if len(body) <= budget or n <= 1:
            return body, n
        n = max(1, int(n * budget / len(body)) - 1)
    return body, n


def phase_embeddings(b: Bench) -> dict[str, Any]:
    """One embeddings request sized to the body limit (issue 31, 4: 2048 inputs of ~450 tokens held the
    slots for minutes, a running stream saw a 30.5 s gap and new chats got 429): waited for up to
    --embed-s, then sent again by a client that leaves after ABANDON_S. Its own time may be long (it is
    real work); the witness and the plain chats beside it must not starve."""
    t0 = time.monotonic()
    cfg = b.cfg
    tally, attacks = Tally(), []
    ctx, cpt = calibrate(b)
    item_tokens = min(EMBED_ITEM_TOKENS, ctx - 16)
    item_chars = max(16, int(item_tokens * cpt * 0.9))
    body, n = embeddings_body(b.name, EMBED_INPUTS, item_chars, ATTACK_BODY)
    raw = http_request("POST", EMBEDDINGS, b.port, body, {"Content-Type": "application/json"})
    label = f"{n} inputs of {item_chars} chars (~{item_tokens} tokens), {len(body)} B"

    def attack() -> None:
        ans = exchange(b.port, raw, cfg.embed_s, limit=BIG_READ)
        obj = ans.json() if ans.status == 200 else None
        record(tally, attacks, label, ans, "embeddings",
               vectors=len(obj.get("data") or []) if isinstance(obj, dict) else None)
        record(tally, attacks, f"the same, client gone after {ABANDON_S:.0f} s",
               left(exchange(b.port, raw, ABANDON_S)), "embeddings")
        time.sleep(WATCH_S)

    health, witness, quiet = with_witness(b, attack)
    key = attacks_line(attacks) + f"; worker busy {_v(quiet.get('busy_s'))} s after the clients"
    return attack_result("embeddings", t0, tally, cfg.embed_s, health, witness, quiet, attacks, [], key, inputs=n,
                         item_chars=item_chars, item_tokens=item_tokens, body_bytes=len(body))


# -- phase 13: grammar compilation -----------------------------------------------------------------------------
def optional_schema(n: int) -> dict:
    """A JSON schema of one object with `n` optional properties (~37 bytes each: 10k is ~370 kB)."""
    return {"type": "object", "additionalProperties": False,
            "properties": {f"field_{i:05d}": {"type": SCHEMA_TYPES[i % len(SCHEMA_TYPES)]} for i in range(n)}}


def schema_body(b: Bench, n: int, tag: str = "") -> bytes:
    rf = {"type": "json_schema", "json_schema": {"name": f"form_{n}{tag}", "schema": optional_schema(n)}}
    return json.dumps(b.chat_body("Fill in the form.", 32, response_format=rf, temperature=0.7)).encode()


def phase_grammar(b: Bench) -> dict[str, Any]:
    """JSON-schema grammars of 2k, 5k and 10k optional properties (issue 31, 2 and 3: compiling was
    unbounded, 108 s for 10k; one big grammar stretched every stream's token gap to 3 s), each waited
    for up to --hang-s; then clients that send the largest and leave after ABANDON_S, after which the
    worker should go quiet (no compile burning CPU for nobody). A quick 4xx is a pass."""
    t0 = time.monotonic()
    cfg = b.cfg
    tally, attacks = Tally(), []
    largest = max(cfg.grammar_sizes)

    def attack() -> None:
        for n in cfg.grammar_sizes:
            body = schema_body(b, n)
            raw = http_request("POST", CHAT, b.port, body, {"Content-Type": "application/json"})
            record(tally, attacks, f"schema of {n} optional properties ({len(body) // 1000} kB)",
                   exchange(b.port, raw, cfg.hang_s), "grammar", request_bytes=len(body))

        def leave(i: int) -> Answer:
            raw = http_request("POST", CHAT, b.port, schema_body(b, largest, f"_{i}"),
                               {"Content-Type": "application/json"})
            return left(exchange(b.port, raw, ABANDON_S))

        for i, ans in enumerate(run_threads(leave, cfg.grammar_abandon, ABANDON_S + CONNECT_S + 10)):
            if ans is not None:
                record(tally, attacks, f"schema of {largest}, client gone after {ABANDON_S:.0f} s (#{i + 1})", ans,
                       "grammar")
        time.sleep(WATCH_S)

    health, witness, quiet = with_witness(b, attack)
    key = attacks_line(attacks) + f"; worker busy {_v(quiet.get('busy_s'))} s after the clients"
    return attack_result("grammar", t0, tally, cfg.hang_s, health, witness, quiet, attacks, [], key,
                         sizes=list(cfg.grammar_sizes), abandoned=cfg.grammar_abandon)


# -- phases 14-19: the third adversarial run (issue 43, rows 1-6) ------------------------------------------------
RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"
COUNT_TOKENS = "/v1/messages/count_tokens"
RSS_RETURN = 0.10  # after an issue-43 phase the worker's RSS must be back within this share of its start
TRUNCATION_TURNS = (3000, 900)  # the issue's conversation: 3,000 messages of 900 characters (2.8 MB) ...
TRUNCATION_TINY = 60_000  # ... and 60,000 messages of one character
BATCH_PROMPTS, BATCH_N, BATCH_TOKENS = 64, 8, 16  # the issue's completions request: 512 generations
TINY_EMBED_INPUTS = 2048  # the issue's embeddings request: "text 0" ... "text 2047"
COUNT_CONTENT = "lorem ipsum dolor sit amet " * 140_000  # 3.8 MB of content
COUNT_MESSAGES = 100_001
COUNT_TOOLS = 1200
STORE_TURN_CHARS = 4000  # each chained Responses turn adds this much history (less where the context is small)
STORE_TINY_MESSAGES = 80_000  # one-character messages in one stored input (3.7 MB of compact JSON)
VLM_DIR = REPO / "tests" / "fixtures" / "tiny-vlm"
VLM_MODEL, VLM_MMPROJ = "idefics3-vlm.gguf", "idefics3-vlm.mmproj.gguf"  # the tiling family (the costly one)
IMAGE_SIDE = 3990  # 15.9 M pixels: just under the default PANTHEON_MAX_IMAGE_PIXELS
IMAGES_PER_CHAT, IMAGE_CHATS = 8, 4


def judge_rss(name: str, before: float | None, after: float | None) -> list[str]:
    """Issue 43's memory rule: the worker's RSS back within RSS_RETURN of its start once the phase (and the
    drain after its clients) is over."""
    if before is None or after is None or after <= before * (1 + RSS_RETURN):
        return []
    return [f"{name}: the worker's RSS went {before:.0f} -> {after:.0f} MiB and was not back within "
            f"{RSS_RETURN:.0%} of its start after the phase"]


def post_json(b: Bench, path: str, obj: Any, deadline_s: float) -> Answer:
    """POST `obj` (JSON, however big) and read the answer (up to BIG_READ) within `deadline_s`."""
    body = json.dumps(obj, separators=(",", ":")).encode()  # compact: the issue's sizes are compact JSON
    raw = http_request("POST", path, b.port, body, {"Content-Type": "application/json"})
    return exchange(b.port, raw, deadline_s, limit=BIG_READ)


def issue43_phase(b: Bench, name: str, attack: Callable[[Tally, list[dict]], None], hang_s: float,
                  **details: Any) -> dict[str, Any]:
    """Run `attack(tally, attacks)` beside the witness and GET / probe (as the issue 31 phases do), then judge
    it by issue 43's acceptance: no witness gap over 1 s, GET / p99 under 1 s, no 5xx (and no hang), and
    the worker's RSS back within 10 % of its start."""
    t0 = time.monotonic()
    tally, attacks = Tally(), []
    _, rss0 = b.server.worker_rss()
    health, witness, quiet = with_witness(b, lambda: attack(tally, attacks))
    _, rss1 = b.server.worker_rss()
    rss = {"start_mib": None if rss0 is None else round(rss0, 1), "end_mib": None if rss1 is None else round(rss1, 1)}
    key = attacks_line(attacks) + f"; RSS {_v(rss['start_mib'])} -> {_v(rss['end_mib'])} MiB"
    return attack_result(name, t0, tally, hang_s, health, witness, quiet, attacks, judge_rss(name, rss0, rss1), key,
                         rss=rss, **details)


def phase_truncation(b: Bench) -> dict[str, Any]:
    """Row 1: `truncation: "auto"` on a 2.8 MB conversation of 3,000 messages (and on 60,000 one-character
    messages), and chat's `"truncate": "oldest"` on the same: capping used to re-render and re-tokenize
    candidate conversations for 18-30 s of CPU while every stream stalled (a 19.3 s witness gap)."""
    turns, chars = TRUNCATION_TURNS
    text = ("lorem ipsum dolor " * 50)[:chars]
    items = [{"type": "message", "role": "user", "content": text}] * turns
    tiny = [{"type": "message", "role": "user", "content": "x"}] * TRUNCATION_TINY
    chat = [{"role": "user", "content": text}] * turns

    def attack(tally: Tally, attacks: list[dict]) -> None:
        for label, path, body in (
                (f"responses, {turns} x {chars} chars, truncation auto", RESPONSES,
                 {"model": b.name, "input": items, "max_output_tokens": 2, "truncation": "auto", "store": False}),
                (f"responses, {TRUNCATION_TINY} x 1 char, truncation auto", RESPONSES,
                 {"model": b.name, "input": tiny, "max_output_tokens": 2, "truncation": "auto", "store": False}),
                (f"chat, {turns} x {chars} chars, truncate oldest", CHAT,
                 {"model": b.name, "messages": chat, "max_tokens": 2, "truncate": "oldest"})):
            record(tally, attacks, label, post_json(b, path, body, b.cfg.hang_s), "truncation")
        time.sleep(WATCH_S)

    return issue43_phase(b, "truncation", attack, b.cfg.hang_s)


def phase_generations(b: Bench) -> dict[str, Any]:
    """Row 2: one completions request of 64 prompts x n 8 x 16 tokens (512 generations held every slot for
    226 s; a chat waited 5.6 s, embeddings > 10 s) -- now a 400 past PANTHEON_MAX_GENERATIONS_PER_REQUEST
    -- then the most one request may ask (16 prompts x n 1, ignore_eos) while plain chats and the witness
    must still be admitted (a request holds at most its share of the slots while others wait)."""
    cfg = b.cfg
    big = {"model": b.name, "prompt": [f"Prompt {i}: count slowly." for i in range(BATCH_PROMPTS)], "n": BATCH_N,
           "max_tokens": BATCH_TOKENS, "ignore_eos": True, "temperature": 0.8, "seed": cfg.seed}
    allowed = {**big, "prompt": big["prompt"][:16], "n": 1, "max_tokens": 4 * BATCH_TOKENS}

    def attack(tally: Tally, attacks: list[dict]) -> None:
        record(tally, attacks, f"completions {BATCH_PROMPTS} prompts x n {BATCH_N} x {BATCH_TOKENS} tokens",
               post_json(b, COMPLETIONS, big, cfg.amplify_s), "generations")
        record(tally, attacks, f"completions 16 prompts x n 1 x {4 * BATCH_TOKENS} tokens",
               post_json(b, COMPLETIONS, allowed, cfg.amplify_s), "generations")
        time.sleep(WATCH_S)

    return issue43_phase(b, "generations", attack, cfg.amplify_s)


def phase_embed_many(b: Bench) -> dict[str, Any]:
    """Row 3: one embeddings request of 2,048 tiny inputs (~8k tokens in all) did not finish in 120 s and a
    stream beside it saw a 5.2 s gap; it should finish in seconds and never starve generation."""
    body = {"model": b.name, "input": [f"text {i}" for i in range(TINY_EMBED_INPUTS)]}

    def attack(tally: Tally, attacks: list[dict]) -> None:
        ans = post_json(b, EMBEDDINGS, body, b.cfg.embed_s)
        obj = ans.json() if ans.status == 200 else None
        record(tally, attacks, f"embeddings, {TINY_EMBED_INPUTS} inputs \"text i\"", ans, "embed-many",
               vectors=len(obj.get("data") or []) if isinstance(obj, dict) else None)
        time.sleep(WATCH_S)

    return issue43_phase(b, "embed-many", attack, b.cfg.embed_s)


def phase_count_tokens(b: Bench) -> dict[str, Any]:
    """Row 4: `/v1/messages/count_tokens` on 3.8 MB of content, 100,001 messages and 1,200 tools (19-27 s of
    CPU each while `/v1/messages` refused the same bodies in 0.3 s): each body goes to both routes, which
    must answer alike (a finding otherwise), quickly and without stalling the witness."""
    tools = [{"name": f"tool_{i}", "description": words_text(1100), "input_schema": {
        "type": "object", "properties": {"text": {"type": "string"}}}} for i in range(COUNT_TOOLS)]
    bodies = {"3.8 MB content": {"messages": [{"role": "user", "content": COUNT_CONTENT}]},
              f"{COUNT_MESSAGES} messages": {"messages": [{"role": "user", "content": "x"}] * COUNT_MESSAGES},
              f"{COUNT_TOOLS} tools": {"messages": [{"role": "user", "content": "hi"}], "tools": tools}}
    differ: list[str] = []

    def attack(tally: Tally, attacks: list[dict]) -> None:
        for label, body in bodies.items():
            counted = post_json(b, COUNT_TOKENS, {"model": b.name, **body}, b.cfg.hang_s)
            record(tally, attacks, f"count_tokens, {label}", counted, "count-tokens")
            sent = post_json(b, MESSAGES, {"model": b.name, "max_tokens": 4, **body}, b.cfg.hang_s)
            record(tally, attacks, f"messages, {label}", sent, "count-tokens")
            if (counted.status == 200) != (sent.status == 200) or (sent.status != 200 and counted.status != sent.status):
                differ.append(f"count-tokens: {label}: count_tokens answered {counted.status}, /v1/messages "
                              f"{sent.status}")
        time.sleep(WATCH_S)

    res = issue43_phase(b, "count-tokens", attack, b.cfg.hang_s)
    res["findings"] += differ
    return res


def phase_responses_store(b: Bench) -> dict[str, Any]:
    """Row 5: the Responses store under many chained turns (`previous_response_id`, each adding
    STORE_TURN_CHARS) and big stored histories (80,000 one-character messages each): it counted JSON
    characters, not memory (5.7x more held), copied the whole history per turn and the worker's RSS went
    1.31 -> 2.18 GB and stayed. Every stored response is deleted at the end: RSS must come back."""
    cfg = b.cfg
    chain = 10 if cfg.quick else 100
    big = 2 if cfg.quick else 8
    ctx, cpt = calibrate(b)
    turn_chars = max(64, min(STORE_TURN_CHARS, int((ctx - 64) * cpt * 0.5)))  # one turn always fits the context
    stored: list[str] = []

    def attack(tally: Tally, attacks: list[dict]) -> None:
        prev = None
        for k in range(chain):
            body = {"model": b.name, "input": words_text(turn_chars, lead=f"Turn {k}: "), "max_output_tokens": 2,
                    "truncation": "auto", "store": True, **({"previous_response_id": prev} if prev else {})}
            ans = post_json(b, RESPONSES, body, cfg.hang_s)
            tally.add(ans, f"chained turn {k}", None, "responses-store")
            obj = ans.json() if ans.status == 200 else None
            prev = obj.get("id") if isinstance(obj, dict) else None
            if prev:
                stored.append(prev)
        attacks.append({"input": f"{chain} chained turns of {turn_chars} chars", "status": None,
                        "outcome": f"{len(stored)} stored", "ms": 0.0, "code": None, "answer": "", "answer_bytes": 0})
        tiny = [{"type": "message", "role": "user", "content": "x"}] * STORE_TINY_MESSAGES
        for k in range(big):
            ans = post_json(b, RESPONSES, {"model": b.name, "input": tiny, "max_output_tokens": 2,
                                           "truncation": "auto", "store": True}, cfg.hang_s)
            rec = record(tally, attacks, f"stored input of {STORE_TINY_MESSAGES} x 1 char ({k})", ans, "responses-store")
            obj = ans.json() if ans.status == 200 else None
            if isinstance(obj, dict) and obj.get("id"):
                stored.append(obj["id"])
                rec["stored"] = True
        gone = sum(b.request("DELETE", f"{RESPONSES}/{rid}").status == 200 for rid in stored)
        attacks.append({"input": f"DELETE each of {len(stored)} stored", "status": None, "outcome": f"{gone} deleted",
                        "ms": 0.0, "code": None, "answer": "", "answer_bytes": 0})
        time.sleep(WATCH_S)

    return issue43_phase(b, "responses-store", attack, cfg.hang_s, chained_turns=chain, big_inputs=big)


def big_png_url(side: int) -> str:
    """A data URL of a `side` x `side` PNG (a smooth gradient: at the pixel limit yet small to send)."""
    import base64
    import io

    from PIL import Image
    img = Image.linear_gradient("L").resize((side, side)).convert("RGB")
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=False)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def vlm_bench(b: Bench) -> Bench:
    """A second server of our own, on the tiny Idefics3 fixture with its projector (the phase's witness and
    probe run against it), started like the first; the caller stops it."""
    port = free_port()
    env = {**b.server.env, "PANTHEON_MODEL_DIR": str(VLM_DIR)}
    log_path = Path(tempfile.mkstemp(prefix=f"pantheon-reliability-vlm-{port}-", suffix=".log")[1])
    server = ServerProcess(str(VLM_DIR / VLM_MODEL), port, env, log_path,
                           extra=("--mmproj", str(VLM_DIR / VLM_MMPROJ))).start()
    server.wait_ready(b.cfg.startup_s)
    name = Path(VLM_MODEL).stem
    return Bench(cfg=b.cfg, server=server, port=port, admin_key=b.admin_key, name=name,
                 reload_body={"path": str(VLM_DIR / VLM_MODEL), "name": name}, model_dir=VLM_DIR, slots=b.slots,
                 queue_depth=b.queue_depth, queue_wait_s=b.queue_wait_s, rng=random.Random(b.cfg.seed))


def phase_images(b: Bench) -> dict[str, Any]:
    """Row 6: 4 concurrent chats x 8 PNGs at the pixel limit on a tiling VLM (Idefics3): each image was
    decoded and tiled (17-18 s, +890 MB) before the prompt was admitted, then refused 400
    context_length_exceeded. Now the headers give the image tokens first and decoding runs in a bounded
    pool: expected quick 400s (or 429s), then one small image answered 200. Runs on a second server of
    its own (the tiny Idefics3 fixture), the witness beside it."""
    url = big_png_url(IMAGE_SIDE)
    small = big_png_url(64)
    vb = vlm_bench(b)
    try:
        def content(u: str, k: int) -> list[dict]:
            return [{"type": "text", "text": "Describe these."}] + [{"type": "image_url", "image_url": {"url": u}}] * k

        def attack(tally: Tally, attacks: list[dict]) -> None:
            body = vb.chat_body("", 4, temperature=0)
            body["messages"][0]["content"] = content(url, IMAGES_PER_CHAT)
            answers = run_threads(lambda i: post_json(vb, CHAT, body, b.cfg.hang_s), IMAGE_CHATS, b.cfg.hang_s + 5)
            for i, ans in enumerate(answers):
                record(tally, attacks, f"chat {i}: {IMAGES_PER_CHAT} PNGs of {IMAGE_SIDE}^2",
                       ans or Answer(None, {}, b"", b.cfg.hang_s, "hang", None), "images")
            one = vb.chat_body("", 4, temperature=0)
            one["messages"][0]["content"] = content(small, 1)
            record(tally, attacks, "one 64^2 PNG", post_json(vb, CHAT, one, b.cfg.hang_s), "images")
            time.sleep(WATCH_S)

        res = issue43_phase(vb, "images", attack, b.cfg.hang_s, image_side=IMAGE_SIDE,
                            images_per_chat=IMAGES_PER_CHAT, chats=IMAGE_CHATS, model=VLM_MODEL)
        if vb.server.proc is not None and vb.server.proc.poll() is not None:
            res["findings"].append(f"images: the VLM server exited ({vb.server.log_tail(5)})")
        return res
    finally:
        vb.server.stop()


PHASE_FUNCS: dict[str, Callable[[Bench], dict[str, Any]]] = {
    "fuzz": phase_fuzz, "slow-body": phase_slow_body, "large-body": phase_large_body,
    "disconnects": phase_disconnects, "overflow": phase_overflow, "unload": phase_unload, "soak": phase_soak,
    "greedy": phase_greedy, "protocol": phase_protocol, "tokenizer": phase_tokenizer,
    "amplification": phase_amplification, "embeddings": phase_embeddings, "grammar": phase_grammar,
    "truncation": phase_truncation, "generations": phase_generations, "embed-many": phase_embed_many,
    "count-tokens": phase_count_tokens, "responses-store": phase_responses_store, "images": phase_images,
}


# ---- running everything ------------------------------------------------------------------------------------
def run_phase(b: Bench, name: str) -> dict[str, Any]:
    """One phase, with the worker's RSS around it; a phase that raises is reported, not fatal."""
    if not b.serving(min(120.0, b.cfg.hang_s * 4)):
        return {"phase": name, "skipped": "the server is not serving the model", "findings":
                [f"{name}: skipped, the server was not serving (alive: {b.server.alive()})"]}
    pid0, rss0 = b.note_worker()
    try:
        res = PHASE_FUNCS[name](b)
    except Exception as exc:  # noqa: BLE001 - a bug here must not hide the other phases' figures
        res = {"phase": name, "error": _error_text(exc), "findings": [f"{name}: the tool failed: {_error_text(exc)}"]}
    pid1, rss1 = b.note_worker()
    res["worker_rss_mib"] = {"before": None if rss0 is None else round(rss0, 1),
                             "after": None if rss1 is None else round(rss1, 1)}
    if pid0 is not None and pid1 != pid0:
        res.setdefault("findings", []).append(f"{name}: the worker changed from pid {pid0} to {pid1} (a crash?)")
    return res


def start_watchdog(limit_s: float, server: ServerProcess) -> None:
    """The last bound: past `limit_s` the server is stopped and the process exits, whatever is stuck."""
    def fire() -> None:
        print(f"reliability_bench: the run overran its {limit_s:.0f} s budget; stopping", file=sys.stderr, flush=True)
        server.stop()
        os._exit(3)

    t = threading.Timer(limit_s, fire)
    t.daemon = True
    t.start()


def install_signal_handlers() -> None:
    """SIGTERM and SIGHUP unwind like Ctrl-C, so the `finally` that stops the server runs."""
    def handler(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)


def raise_fd_limit(need: int) -> None:
    """Our own open-file limit (after the server started, so the server keeps the caller's)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, max(soft, need))
    if want > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def prepare(cfg: Config) -> tuple[ServerProcess, Bench, float]:
    """Resolve the model, start the server, wait for it, and read what the phases need to know."""
    path = resolve_model(cfg.model).resolve()
    catalog = cfg.model in CATALOG and not Path(cfg.model).expanduser().is_file()
    port = cfg.port or free_port()
    admin_key = secrets.token_hex(16)
    env = {k: v for k, v in os.environ.items() if k not in CLEARED_ENV}
    env.update(PANTHEON_ADMIN_KEY=admin_key, PANTHEON_MODEL_DIR=str(path.parent))
    log_path = Path(tempfile.mkstemp(prefix=f"pantheon-reliability-{port}-", suffix=".log")[1])
    server = ServerProcess(cfg.model if catalog else str(path), port, env, log_path).start()
    start_watchdog(cfg.budget_s(), server)
    ready_s = server.wait_ready(cfg.startup_s)
    raise_fd_limit(cfg.slow_conns + 256)
    name = cfg.model if catalog else path.stem
    reload_body = {"model": cfg.model, "name": name} if catalog else {"path": str(path), "name": name}
    served = load_settings(env)  # what the server will read from the same environment
    b = Bench(cfg=cfg, server=server, port=port, admin_key=admin_key, name=name, reload_body=reload_body,
              model_dir=path.parent, slots=8, queue_depth=served.queue_depth,
              queue_wait_s=served.queue_wait_s, rng=random.Random(cfg.seed))
    models = b.request("GET", "/v1/models").json() or {}
    ids = [m.get("id") for m in models.get("data") or []]
    if ids and name not in ids:
        b.name = ids[0]
        b.reload_body["name"] = ids[0]
    scrape = b.metrics() or {}
    b.slots = int(scrape.get("pantheon_batch_slots", 8)) or 1
    return server, b, ready_s


def run(cfg: Config) -> dict[str, Any]:
    t0 = time.monotonic()
    server, b, ready_s = prepare(cfg)
    b.note_worker()
    baseline = [b.greedy(p) for p in GREEDY_PROMPTS]  # alone: nothing else is running yet
    b.baseline = [text for text, _ in baseline]
    phases = [run_phase(b, name) for name in cfg.phases]
    findings = [f for p in phases for f in p.get("findings", [])]
    if any(text is None for text in b.baseline):
        findings.insert(0, "baseline: greedy prompts failed before any attack: "
                        + "; ".join(how for text, how in baseline if text is None))
    if len(b.worker_pids) > 1:
        findings.append(f"the worker pid changed during the run: {b.worker_pids}")
    report = {
        "bench": "reliability", "version": 1, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "config": {k: v for k, v in vars(cfg).items()},
        "server": {"model": cfg.model, "name": b.name, "port": b.port, "ready_s": round(ready_s, 1),
                   "slots": b.slots, "queue_depth": b.queue_depth, "worker_nofile_limit": server.nofile_limit(),
                   "worker_pids": b.worker_pids, "alive_at_end": server.alive()},
        "baseline": [{"prompt": p, "text": t, "answer": how} for p, (t, how) in zip(GREEDY_PROMPTS, baseline)],
        "phases": phases,
        "summary": summarize(phases),
        "findings": findings,
        "server_log": server.log_digest(),
        "seconds": round(time.monotonic() - t0, 1),
    }
    return report


def summarize(phases: list[dict[str, Any]]) -> dict[str, Any]:
    """The headline figures the issue asks for, in one flat object."""
    by = {p["phase"]: p for p in phases}

    def get(phase: str, *path: str) -> Any:
        v: Any = by.get(phase)
        for k in path:
            v = v.get(k) if isinstance(v, dict) else None
        return v

    return {
        "fuzz_inputs_tried": get("fuzz", "requests"),
        "total_4xx": sum(p.get("4xx", 0) for p in phases), "total_5xx": sum(p.get("5xx", 0) for p in phases),
        "total_hangs": sum(p.get("hangs", 0) for p in phases),
        "non_json_errors": sum(p.get("non_json_errors", 0) for p in phases),
        "get_root_p99_ms": {p["phase"]: get(p["phase"], "health", "p99_ms") for p in phases},
        "get_root_max_ms": {p["phase"]: get(p["phase"], "health", "max_ms") for p in phases},
        "rss_growth_mib_per_1k_requests": get("soak", "rss_growth_mib_per_1k_requests"),
        "greedy_identical": get("greedy", "identical"),
        "witness_max_gap_ms": {p["phase"]: get(p["phase"], "witness", "max_gap_ms") for p in phases if "witness" in p},
        "witness_p99_gap_ms": {p["phase"]: get(p["phase"], "witness", "p99_gap_ms") for p in phases if "witness" in p},
    }


# ---- output --------------------------------------------------------------------------------------------------
def counts(d: dict) -> str:
    """{429: 8, 200: 40} -> "200: 40, 429: 8" (for one-line keys)."""
    return ", ".join(f"{k}: {v}" for k, v in sorted(d.items(), key=lambda kv: str(kv[0]))) or "none"


def yes_no(x: bool | None) -> str:
    return "-" if x is None else "yes" if x else "no"


def _v(x: Any) -> str:
    return "-" if x is None else str(x)


def print_summary(r: dict[str, Any]) -> None:
    s = r["server"]
    print(f"Pantheon reliability run, {r['date']}: model {s['model']} (served as {s['name']}) on "
          f"127.0.0.1:{s['port']}, ready in {s['ready_s']} s, {s['slots']} slots, queue {s['queue_depth']}, "
          f"worker open-file limit {_v(s['worker_nofile_limit'])}; {r['seconds']} s in all")
    for p in r["phases"]:
        print(f"\n[{p['phase']}] " + (p.get("skipped") or p.get("error") or p.get("key", "")))
        h = p.get("health")
        if h:
            print(f"  GET / during it: p50 {_v(h['p50_ms'])} ms, p99 {_v(h['p99_ms'])} ms, max {_v(h['max_ms'])} ms "
                  f"(at {_v(h['worst_at_s'])} s), {h['failed']}/{h['probes']} failed")
        if "requests" in p:
            print(f"  requests {p['requests']}: 2xx {p.get('2xx', 0)}, 4xx {p.get('4xx', 0)}, 5xx {p.get('5xx', 0)}, "
                  f"hangs {p.get('hangs', 0)}, closed without answer {p.get('closed_without_answer', 0)}, "
                  f"non-JSON errors {p.get('non_json_errors', 0)}")
        rss = p.get("worker_rss_mib")
        if rss:
            print(f"  worker RSS {_v(rss['before'])} -> {_v(rss['after'])} MiB")
        w = p.get("witness")
        if w:
            nc = w["newcomers"]
            print(f"  witness stream: {w['streams']} streams ({counts(w['by_outcome'])}), {w['chunks']} chunks; gap "
                  f"p50 {_v(w['p50_gap_ms'])} ms, p99 {_v(w['p99_gap_ms'])} ms, max {_v(w['max_gap_ms'])} ms (at "
                  f"{_v(w['worst_gap_at_s'])} s); first chunk max {_v(w['first_chunk']['max_ms'])} ms; plain chats "
                  f"meanwhile {counts(nc['by_status'])} (p99 {_v(nc['p99_ms'])} ms)")
        q = p.get("after_clients")
        if q and q.get("measured"):
            born = ", ".join(f"{n} x{v['threads']} ({v['cpu_s_after_clients']} CPU s)"
                             for n, v in q["threads_added"].items()) or "none"
            print(f"  worker after the clients: quiet after {_v(q['busy_s'])} s (budget {q['budget_s']:.0f} s, peak "
                  f"{q['peak_cores']} cores, idle before {_v(q['idle_cores_before'])}); threads born in the phase, "
                  f"still there: {born}")
        for a in p.get("attacks") or []:
            why = f" {a['code'] or ''} {a['answer'][:80]!r}" if a.get("answer") else ""
            print(f"    {a['input']}: {a['status'] or a['outcome']} in {a['ms']:.0f} ms, {a['answer_bytes']} B{why}")
        if p["phase"] == "fuzz" and "by_family" in p:
            for fam, t in p["by_family"].items():
                other = {k: v for k, v in t["by_kind"].items() if not k.endswith("xx")}
                print(f"    {fam:<13} {t['tried']:>5} tried; status {counts(t['by_status'])}; other {counts(other)}; "
                      f"non-JSON errors {t['non_json_errors']}")
        for what, items in (p.get("examples") or {}).items():
            for ex in items[:4]:
                print(f"    {what}: [{ex['family']}] {ex['input']} -> {ex['status'] or ex['outcome']} "
                      f"in {ex['seconds']} s: {ex['answer'][:100]!r}")
        if p["phase"] == "soak" and p.get("samples"):
            print("    t_s  requests  rss_mib")
            samples = p["samples"]
            step = max(1, len(samples) // 12)
            for smp in samples[::step] + ([samples[-1]] if (len(samples) - 1) % step else []):
                print(f"  {smp['t_s']:>6} {smp['requests']:>9} {_v(smp['rss_mib']):>8}")
    sm = r["summary"]
    print(f"\nSummary: fuzz inputs {_v(sm['fuzz_inputs_tried'])}, 4xx {sm['total_4xx']}, 5xx {sm['total_5xx']}, "
          f"hangs {sm['total_hangs']}, non-JSON errors {sm['non_json_errors']}, RSS growth "
          f"{_v(sm['rss_growth_mib_per_1k_requests'])} MiB/1000 requests, greedy identical "
          f"{_v(sm['greedy_identical'])}")
    log = r["server_log"]
    print(f"Server log {log['path']}: {log['tracebacks']} tracebacks")
    for line, n in log["errors"].items():
        print(f"  x{n} {line}")
    print("Findings:" if r["findings"] else "Findings: none")
    for f in r["findings"]:
        print(f"  - {f}")


def markdown(r: dict[str, Any]) -> str:
    """The summary as tables for docs/benchmarks.md."""
    s = r["server"]
    out = [f"Reliability run ({r['date']}): `{s['model']}`, {s['slots']} slots, queue {s['queue_depth']}, "
           f"`tools/reliability_bench.py{' --quick' if r['config']['quick'] else ''} --model {s['model']}`.", "",
           "| phase | requests | 2xx | 4xx | 5xx | hangs | no answer | non-JSON errors | GET / p99 ms | GET / max ms "
           "| GET / failed | witness gap p99 / max ms | what happened |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in r["phases"]:
        h = p.get("health") or {}
        w = p.get("witness") or {}
        gap = f"{_v(w.get('p99_gap_ms'))} / {_v(w.get('max_gap_ms'))}" if w else "-"
        what = (p.get("skipped") or p.get("error") or p.get("key", "")).replace("|", "\\|")
        out.append(f"| {p['phase']} | {p.get('requests', '-')} | {p.get('2xx', '-')} | {p.get('4xx', '-')} | "
                   f"{p.get('5xx', '-')} | {p.get('hangs', '-')} | {p.get('closed_without_answer', '-')} | "
                   f"{p.get('non_json_errors', '-')} | {_v(h.get('p99_ms'))} | {_v(h.get('max_ms'))} | "
                   f"{_v(h.get('failed'))} | {gap} | {what} |")
    sm = r["summary"]
    out += ["", "| figure | value |", "|---|---|",
            f"| fuzz inputs tried | {_v(sm['fuzz_inputs_tried'])} |",
            f"| 4xx / 5xx | {sm['total_4xx']} / {sm['total_5xx']} |",
            f"| hangs | {sm['total_hangs']} |", f"| non-JSON error bodies | {sm['non_json_errors']} |",
            f"| worker RSS growth per 1000 requests | {_v(sm['rss_growth_mib_per_1k_requests'])} MiB |",
            f"| greedy identical under load | {yes_no(sm['greedy_identical'])} |"]
    return "\n".join(out)


# ---- entry point ---------------------------------------------------------------------------------------------
def _phases(text: str) -> tuple[str, ...]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in names if p not in PHASES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown phase(s) {bad}; choose from {', '.join(PHASES)}")
    return tuple(p for p in PHASES if p in names)  # always in the documented order


def _sizes(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tools/reliability_bench.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL, help=f"catalog name or GGUF path (default {DEFAULT_MODEL})")
    ap.add_argument("--host", default=LOOPBACK, help="must be 127.0.0.1 (any other host is refused)")
    ap.add_argument("--port", type=int, default=None, help="server port (default: a free one)")
    ap.add_argument("--phases", type=_phases, default=PHASES, help=f"comma-separated subset of {','.join(PHASES)}")
    ap.add_argument("--quick", action="store_true", help="small counts and durations: a smoke run of a few minutes")
    ap.add_argument("--seed", type=int, default=22, help="seed of the fuzz inputs and every random choice")
    ap.add_argument("--hang-s", type=float, help="a request not answered by then is a hang (default 35; quick 15)")
    ap.add_argument("--fuzz-n", type=int, help="fuzz inputs drawn (default 1500; quick 150)")
    ap.add_argument("--fuzz-s", type=float, help="fuzz phase budget, s (default 600; quick 45)")
    ap.add_argument("--slow-conns", type=int, help="slow-body connections (default 200; gunicorn's limit is 1000)")
    ap.add_argument("--slow-s", type=float, help="how long the slow connections are held, s (default 60; quick 15)")
    ap.add_argument("--disconnects", type=int, help="streams cut mid-stream (default 100; quick 32)")
    ap.add_argument("--soak-s", type=float, help="soak duration, s (default 600; quick 30)")
    ap.add_argument("--grammar-sizes", type=_sizes, help="optional properties per grammar schema, comma-separated "
                    "(default 2000,5000,10000; quick 2000,10000)")
    ap.add_argument("--embed-s", type=float, help="longest wait for the huge embeddings request, s "
                    "(default 180; quick 45)")
    ap.add_argument("--drain-s", type=float, help="after an attack phase, longest wait for the worker to go "
                    "quiet, s (default 60; quick 15)")
    ap.add_argument("--startup-s", type=float, help="longest wait for the server to come up, s (default 900)")
    ap.add_argument("--json", metavar="FILE", help="write every figure to FILE as JSON")
    ap.add_argument("--markdown", action="store_true", help="also print the summary as markdown tables")
    return ap


def config_from(a: argparse.Namespace) -> Config:
    cfg = Config(model=a.model, port=a.port, seed=a.seed, quick=a.quick, phases=a.phases)
    if a.quick:
        for k, v in QUICK.items():
            setattr(cfg, k, v)
    for k in ("hang_s", "fuzz_n", "fuzz_s", "slow_conns", "slow_s", "disconnects", "soak_s", "startup_s",
              "grammar_sizes", "embed_s", "drain_s"):
        if getattr(a, k) is not None:
            setattr(cfg, k, getattr(a, k))
    return cfg


def check(cfg: Config) -> str | None:
    if cfg.hang_s <= 0 or cfg.fuzz_s <= 0 or cfg.slow_s <= 0 or cfg.soak_s <= 0 or cfg.startup_s <= 0 \
            or cfg.embed_s <= 0 or cfg.drain_s <= 0:
        return "durations must be positive"
    if not 0 <= cfg.fuzz_n <= 100_000 or not 0 <= cfg.slow_conns <= 10_000 or not 0 <= cfg.disconnects <= 10_000:
        return "--fuzz-n must be in [0, 100000], --slow-conns and --disconnects in [0, 10000]"
    if cfg.port is not None and not 0 < cfg.port < 65536:
        return "--port must be in [1, 65535]"
    if not cfg.grammar_sizes or not all(1 <= n <= 100_000 for n in cfg.grammar_sizes):
        return "--grammar-sizes must be 1 to 100000 properties each"
    return None


def main(argv: list[str]) -> int:
    a = build_parser().parse_args(argv)
    try:
        require_loopback(a.host)
    except ValueError as exc:
        print(f"reliability_bench: {exc}", file=sys.stderr)
        return 2
    cfg = config_from(a)
    problem = check(cfg)
    if problem:
        print(f"reliability_bench: {problem}", file=sys.stderr)
        return 2
    install_signal_handlers()
    try:
        report = run(cfg)
    except Exception as exc:  # noqa: BLE001 - setup failed (model, server start): phases report their own
        print(f"reliability_bench: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    finally:
        for server in list(SERVERS):
            server.stop()
    print_summary(report)
    if a.markdown:
        print("\n" + markdown(report))
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1, default=str) + "\n")
        print(f"\nJSON written to {a.json}")
    return 1 if report["findings"] else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
