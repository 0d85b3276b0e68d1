"""Router registration: tell a router (SMG, the `smg` gateway) which models this server serves.

Off unless PANTHEON_REGISTRY_URL is set; then, and only then, this module talks to the router. Each
served model *name* is one worker at the router, reached at its own root `ADVERTISE/m/<name>` (the
per-model routes in pantheon.web.router_api), because the router routes by the request's `model`
and keeps one worker per URL. Replicas of a name inside this process stay one worker: the registry
already spreads a name's requests over its replicas, the router spreads them over processes.

What is registered for a model (SMG's `POST /workers` body): the worker URL, the model id, the
context length and the labels `instance_id` = `host:port:model`, `node_id`, `transport`, `capacity`
(= batch slots, also given as `max_running_requests`) and `context_length`; plus `api_key`, the key
the router presents on its calls to this worker, only when PANTHEON_REGISTRY_WORKER_KEY is set. Live
load is not pushed: SMG pulls it from the worker's `GET /v1/loads`, which keeps the router's view as
fresh as its poll interval.

Keys. The control-plane calls carry PANTHEON_REGISTRY_KEY as their bearer token, or no token at all.
The server's own PANTHEON_API_KEY never goes to the router from here, in a header or a body: the
router is another program, often on another machine, and turning registration on must not hand it
the key that opens this whole server. A server that wants a key gives the router its own one,
PANTHEON_REGISTRY_WORKER_KEY, which it accepts on its model roots only (pantheon.web.security).

Bounds on every call to the router (a router that misbehaves must cost this server neither memory
nor its admin path's time):

* one overall deadline per call, PANTHEON_REGISTRY_TIMEOUT_S, from the connect to the reply's last
  byte: each socket operation gets only what is left of it, so a router sending a byte every few
  seconds cannot stretch a call past it (a per-read timeout alone never fires on such a router);
* a reply over PANTHEON_REGISTRY_MAX_REPLY_BYTES is refused: one announcing a larger Content-Length
  before a byte of its body is read, any other as soon as it passes the cap (the status line and
  headers count too), so a reply is never held in memory past the cap.

One `Registration` object owns everything, with these invariants:

* `reconcile()` makes the router's table match what the server serves *now*: every ready model has
  a worker at its URL with the current labels (a replica loaded or unloaded changes the name's
  capacity: the labels are patched in place, the worker stays), and no worker under this server's
  `/m/` prefix names a model that is gone (so a restart that serves fewer models cleans up after the
  previous process). It is idempotent and serialised by `_sync_lock`.
* While the keep-alive thread (`pantheon-registry`, the design's heartbeat) runs, it is the only
  thread that talks to the router: every PANTHEON_REGISTRY_INTERVAL_S, and at once when `sync()` asks.
  So a router that restarted (and forgot its workers) gets them back within one interval, and a stuck
  router holds up no one but this thread. It never dies quietly: every failure is logged (a router
  outage once when it starts and once when it ends) and retried on the next tick.
* `sync()` (the startup thread after each load, the admin threads after a load or unload) asks the
  keep-alive for a reconcile and waits for it at most PANTHEON_REGISTRY_TIMEOUT_S; past that it
  returns and the keep-alive finishes the job. It takes no lock the keep-alive holds across a call.
* `close()` stops the keep-alive, ending its call in flight at once (`RouterClient.interrupt`), and the
  thread then deletes this server's workers (graceful shutdown) within close's timeout; nothing can
  register them again behind its back, and close() returns within that timeout whatever the router does.

HTTP goes through the *original* socket module (see `_Connection`): these calls run in real OS
threads, where gevent's cooperative sockets would need a hub of their own.
"""

from __future__ import annotations

import _socket
import http.client
import io
import json
import logging
import math
import socket as _socket_mod
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from pantheon import osthread
from pantheon.config import Settings

log = logging.getLogger(__name__)

MODEL_ROOT = "/m/"  # a model's own root on this server: /m/<name>/health, /v1/models, /v1/loads, ...
HTTP_TIMEOUT_S = 5.0  # one call's deadline when no Settings say otherwise (PANTHEON_REGISTRY_TIMEOUT_S)
MAX_REPLY_BYTES = 4 * 1024 * 1024  # likewise for PANTHEON_REGISTRY_MAX_REPLY_BYTES
HEADER_ALLOWANCE = 64 * 1024  # status line and headers, received on top of the body's cap
READ_CHUNK = 64 * 1024
JOIN_GRACE_S = 0.25  # close(): the deregistration's calls end at its deadline; this covers the thread's exit
THREAD_NAME = "pantheon-registry"

_bound: list[tuple[str, int]] = []  # the listening address(es) the gunicorn worker noted (note_bound_address)


def note_bound_address(host: str, port: int) -> None:
    """Record where this process listens (called by the gunicorn worker before the app loads)."""
    _bound.append((host, int(port)))


def _left(deadline: float) -> float:
    """Seconds until `deadline` (time.monotonic()); TimeoutError once it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the call's deadline passed")
    return left


class RouterError(Exception):
    """The router answered a control-plane call with an unexpected status, or a reply over the cap."""


class _Interrupted(OSError):
    """RouterClient.interrupt ended this call (or it was asked to stop before it started)."""


class _Call:
    """One request in flight: its deadline, the event that lets `RouterClient.interrupt` end it, and the
    socket carrying it (swapped for its TLS wrapper once wrapped: the one that owns the descriptor)."""

    def __init__(self, deadline: float, cancel: Any):
        self.deadline = deadline
        self.cancel = cancel  # an osthread.Event, or None: not interruptible
        self.sock: Any = None


class _BoundedSocket:
    """A connected socket as http.client uses it (sendall, makefile, close), every operation bounded by
    what is left of the call's deadline and every byte received counted against a budget."""

    def __init__(self, sock: Any, deadline: float, budget: int):
        self._sock = sock
        self._deadline = deadline
        self._budget = budget
        self._received = 0

    def sendall(self, data: bytes) -> None:
        self._sock.settimeout(_left(self._deadline))
        self._sock.sendall(data)  # its timeout bounds the whole sendall, not each send

    def recv_into(self, buf: Any) -> int:
        self._sock.settimeout(_left(self._deadline))
        n = self._sock.recv_into(buf)
        self._received += n
        if self._received > self._budget:
            raise RouterError(f"the router sent more than {self._budget} bytes for one reply")
        return n

    def makefile(self, mode: str = "rb") -> io.BufferedReader:
        return io.BufferedReader(_BoundedReader(self))

    def close(self) -> None:
        """Nothing: the call closes the socket when it is done (RouterClient._detach). http.client closes
        its connection as soon as a reply says it will close, before the reply's body is read."""


class _BoundedReader(io.RawIOBase):
    """The raw stream under http.client's buffered reader: every read goes through _BoundedSocket."""

    def __init__(self, sock: _BoundedSocket):
        super().__init__()
        self._bsock = sock

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        return self._bsock.recv_into(buf)


class _Connection(http.client.HTTPConnection):
    """http.client over the original (blocking) socket, whatever gevent has patched, inside one call's
    deadline; the socket is tracked by the client from before its connect, so it can be interrupted."""

    def __init__(self, client: "RouterClient", call: _Call):
        super().__init__(client._host, client._port)
        self._client = client
        self._call = call

    def connect(self) -> None:
        client, call = self._client, self._call
        getaddrinfo = osthread.original("socket", "getaddrinfo")
        sock_cls = osthread.original("socket", "socket")
        err: OSError | None = None
        for family, kind, proto, _, addr in getaddrinfo(self.host, self.port, 0, _socket_mod.SOCK_STREAM):
            sock = sock_cls(family, kind, proto)
            try:
                client._attach(call, sock)
                sock.settimeout(_left(call.deadline))
                sock.connect(addr)
                client._attach(call, sock)  # again: an interrupt during the connect may have found it unconnected
                if client._tls:
                    ctx = osthread.original("ssl", "create_default_context")()
                    sock = ctx.wrap_socket(sock, server_hostname=self.host, do_handshake_on_connect=False)
                    client._attach(call, sock)
                    sock.settimeout(_left(call.deadline))
                    sock.do_handshake()  # its timeout bounds the whole handshake
            except OSError as exc:
                client._detach(call)
                sock.close()  # also when it never was attached
                if isinstance(exc, (TimeoutError, _Interrupted)):
                    raise  # no time left, or told to stop: not a reason to try the next address
                err = exc
                continue
            self.sock = _BoundedSocket(sock, call.deadline, client.max_reply_bytes + HEADER_ALLOWANCE)
            return
        raise err or OSError(f"cannot resolve {self.host}")


@dataclass(frozen=True)
class Served:
    """One model name this server serves, as the router should see it."""

    name: str
    capacity: int  # requests it runs at once: the batch slots (over all of its replicas' smallest)
    context_length: int


class RouterClient:
    """SMG's worker control plane: `GET /workers`, `POST /workers`, `PATCH` and `DELETE /workers/{id}`.

    Each call opens its own connection, must complete within `timeout` seconds (or the caller's earlier
    deadline) and may read at most `max_reply_bytes` of reply; see the module docstring for why."""

    def __init__(self, base_url: str, key: str | None = None, timeout: float = HTTP_TIMEOUT_S,
                 max_reply_bytes: int = MAX_REPLY_BYTES):
        parts = urlsplit(base_url)
        self.base_url = base_url.rstrip("/")
        self._tls = parts.scheme == "https"
        self._host = parts.hostname or "127.0.0.1"
        self._port = parts.port or (443 if self._tls else 80)
        self._prefix = parts.path.rstrip("/")
        self._key = key  # the control plane's bearer token (PANTHEON_REGISTRY_KEY), or None: no token
        self.timeout = timeout  # seconds one call may take, start to last byte
        self.max_reply_bytes = max_reply_bytes
        # Guards _open (call -> the socket that carries it). Held for bookkeeping and, in interrupt(),
        # for the shutdown() syscalls, so a socket is never shut down after its call has closed it.
        self._lock = osthread.Lock()
        self._open: dict[_Call, Any] = {}

    # ---- calls in flight --------------------------------------------------------------------------
    def _attach(self, call: _Call, sock: Any) -> None:
        with self._lock:
            if call.cancel is not None and call.cancel.is_set():
                raise _Interrupted("interrupted: the registration is stopping")
            call.sock = sock
            self._open[call] = sock

    def _detach(self, call: _Call) -> None:
        """The call is over: forget its socket and close it (under the lock, so interrupt() never shuts
        down a descriptor that has been closed and perhaps reused)."""
        with self._lock:
            self._open.pop(call, None)
            if call.sock is not None:
                call.sock.close()
                call.sock = None

    def interrupt(self) -> int:
        """End, from any thread, every call in flight whose `cancel` event is set, and return how many.

        Its socket is shut down, so a read, write or connect blocked on it returns at once (the call
        raises OSError); a call whose event was set before it attached its socket fails without
        connecting. The shutdown is the plain socket's, also under a TLS wrapper: it touches no TLS state
        another thread may be using."""
        with self._lock:
            doomed = [sock for call, sock in self._open.items() if call.cancel is not None and call.cancel.is_set()]
            for sock in doomed:
                try:
                    _socket.socket.shutdown(sock, _socket_mod.SHUT_RDWR)
                except OSError:
                    pass  # not connected yet (the re-check after its connect stops it) or already closed
        return len(doomed)

    # ---- one call ---------------------------------------------------------------------------------
    def request(self, method: str, path: str, body: Any = None, *, deadline: float | None = None,
                cancel: Any = None) -> tuple[int, Any]:
        """(status, parsed JSON or None) of one call, finished by `deadline` (time.monotonic()) or within
        `timeout` seconds, whichever is first. `cancel`: an event that makes the call interruptible.
        Raises OSError when the router cannot be reached, or does not answer in time (TimeoutError),
        RouterError when its reply is larger than `max_reply_bytes`."""
        end = time.monotonic() + self.timeout
        call = _Call(min(end, deadline if deadline is not None else math.inf), cancel)
        conn = _Connection(self, call)
        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode("utf-8")
            headers["Content-Type"] = "application/json"
        if self._key:
            headers["Authorization"] = f"Bearer {self._key}"
        try:
            conn.request(method, self._prefix + path, body=data, headers=headers)
            resp = conn.getresponse()
            raw = self._read_capped(resp, method, path)
        except (OSError, http.client.HTTPException) as exc:
            if cancel is not None and cancel.is_set():  # interrupt(): the error is only the shutdown's echo
                raise _Interrupted(f"{method} {path}: ended, the registration is stopping") from None
            if isinstance(exc, TimeoutError):
                raise TimeoutError(f"{method} {path}: no complete reply within the call's deadline "
                                   f"({self.timeout:g} s at most)") from None
            if isinstance(exc, http.client.HTTPException):
                raise OSError(f"{method} {path}: {exc}") from exc
            raise
        finally:
            conn.close()
            self._detach(call)
        try:
            parsed = json.loads(raw) if raw else None
        except ValueError:
            parsed = raw.decode("utf-8", "replace")[:200]
        return resp.status, parsed

    def _read_capped(self, resp: http.client.HTTPResponse, method: str, path: str) -> bytes:
        cap = self.max_reply_bytes
        announced = (resp.getheader("Content-Length") or "").strip()
        if announced.isdigit() and int(announced) > cap:
            raise RouterError(f"{method} {path}: the reply announces {int(announced)} bytes, over the "
                              f"{cap}-byte cap (PANTHEON_REGISTRY_MAX_REPLY_BYTES)")
        parts: list[bytes] = []
        size = 0
        while True:
            piece = resp.read(min(READ_CHUNK, cap + 1 - size))
            if not piece:
                return b"".join(parts)
            size += len(piece)
            if size > cap:
                raise RouterError(f"{method} {path}: the reply is larger than the {cap}-byte cap "
                                  f"(PANTHEON_REGISTRY_MAX_REPLY_BYTES)")
            parts.append(piece)

    # ---- the control plane ------------------------------------------------------------------------
    def workers(self, **call: Any) -> dict[str, tuple[str, dict]]:
        """url -> (worker id, labels) of every worker the router knows."""
        status, body = self.request("GET", "/workers", **call)
        if status != 200 or not isinstance(body, dict):
            raise RouterError(f"GET /workers answered {status}: {body}")
        return {str(w.get("url")): (str(w.get("id")), w.get("labels") if isinstance(w.get("labels"), dict) else {})
                for w in body.get("workers") or [] if isinstance(w, dict)}

    def add(self, spec: dict, **call: Any) -> None:
        """Register a worker; one that already exists at that URL (409) counts as registered."""
        status, body = self.request("POST", "/workers", spec, **call)
        if status not in (200, 201, 202, 409):
            raise RouterError(f"POST /workers for {spec.get('url')} answered {status}: {body}")

    def relabel(self, worker_id: str, labels: dict, **call: Any) -> None:
        """Update a registered worker's labels in place (SMG merges them into the ones it holds)."""
        status, body = self.request("PATCH", f"/workers/{worker_id}", {"labels": labels}, **call)
        if status not in (200, 202, 204):
            raise RouterError(f"PATCH /workers/{worker_id} answered {status}: {body}")

    def remove(self, worker_id: str, **call: Any) -> None:
        status, body = self.request("DELETE", f"/workers/{worker_id}", **call)
        if status not in (200, 202, 204, 404):
            raise RouterError(f"DELETE /workers/{worker_id} answered {status}: {body}")


def local_base() -> str | None:
    """The URL a browser on this machine opens this server at (a wildcard bind is reached through the
    loopback address); None while nothing is bound (an app outside gunicorn)."""
    if not _bound:
        return None
    host, port = _bound[0]
    host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


def advertised_base(settings: Settings) -> str | None:
    """The URL the router reaches this server at: PANTHEON_ADVERTISE_URL, else the bound address
    (a wildcard bind is advertised under this machine's host name). None while nothing is bound."""
    if settings.advertise_url:
        return settings.advertise_url
    if not _bound:
        return None
    host, port = _bound[0]
    if host in ("", "0.0.0.0", "::"):
        host = _socket_mod.getfqdn()
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


class Registration:
    """Keeps the router's worker table in step with the models this server serves (see the module
    docstring for the invariants). `served()` lists the ready models; `base()` the advertised URL."""

    def __init__(self, settings: Settings, served: Callable[[], list[Served]],
                 base: Callable[[], str | None] | None = None, client: RouterClient | None = None):
        if not settings.registry_url:
            raise ValueError("router registration needs PANTHEON_REGISTRY_URL")
        self.settings = settings
        self._served = served
        self._base = base or (lambda: advertised_base(settings))
        # The control plane's bearer token is PANTHEON_REGISTRY_KEY or nothing: never the API key.
        self.client = client or RouterClient(settings.registry_url, settings.registry_key,
                                             settings.registry_timeout_s, settings.registry_max_reply_bytes)
        # One reconcile at a time. Held across its HTTP calls, so taken only by the keep-alive thread
        # (or, when none runs, by the caller of sync() / close()): never by a thread serving a request.
        self._sync_lock = osthread.Lock()
        # Guards _asked, _finished, _finished_ok, _deregister, _close_deadline; bookkeeping only, never
        # held across a call to the router. Notified when a reconcile ends, a sync() asks, close() stops.
        self._cond = osthread.Condition()
        self._asked = 0  # sync() requests so far (each takes the next number)
        self._finished = 0  # the _asked value the last finished reconcile covers
        self._finished_ok = False  # ... and whether it succeeded
        self._deregister = True  # close(): delete our workers once the keep-alive stops
        self._close_deadline = math.inf
        self._stop = osthread.Event()  # set by close(): the keep-alive ends, reconcile registers nothing
        self._thread: osthread.OSThread | None = None
        self._failing = False  # the last reconcile failed (log an outage once, and its end once)
        self.reconciles = 0  # completed reconciles (tests and debugging)
        if settings.api_key and not settings.registry_worker_key:
            log.warning("PANTHEON_API_KEY is set and PANTHEON_REGISTRY_WORKER_KEY is not: the router %s will "
                        "be refused on this server's model roots (the API key is never sent to it); set "
                        "PANTHEON_REGISTRY_WORKER_KEY to a key for the router", settings.registry_url)

    # ---- what the router should hold ------------------------------------------------------------
    def worker_url(self, base: str, name: str) -> str:
        return f"{base}{MODEL_ROOT}{name}"

    def spec(self, base: str, model: Served) -> dict:
        """The `POST /workers` body for one model."""
        netloc = urlsplit(base).netloc
        labels = {"instance_id": f"{netloc}:{model.name}", "node_id": self.settings.node_id,
                  "transport": self.settings.registry_transport, "capacity": str(model.capacity),
                  "max_running_requests": str(model.capacity), "context_length": str(model.context_length)}
        body: dict[str, Any] = {"url": self.worker_url(base, model.name), "model_id": model.name,
                                "context_length": model.context_length, "labels": labels}
        if self.settings.registry_worker_key:
            body["api_key"] = self.settings.registry_worker_key  # the router presents it to this worker
        return body

    # ---- reconciling ------------------------------------------------------------------------------
    def reconcile(self, deadline: float | None = None, cancel: Any = None) -> None:
        """Register every ready model the router lacks and delete this server's workers whose model is
        gone (all of them once close() was called). Each call to the router ends by `deadline` (if given)
        and `cancel` makes them interruptible. Raises OSError/RouterError when the router cannot be
        reached, refuses, or does not answer in time."""
        call: dict[str, Any] = {"deadline": deadline, "cancel": cancel}
        with self._sync_lock:
            base = self._base()
            if base is None:
                return  # not listening yet: nothing the router could reach
            want = {} if self._stop.is_set() else {self.worker_url(base, m.name): m for m in self._served()}
            known = self.client.workers(**call)
            for url, model in want.items():
                spec = self.spec(base, model)
                if url not in known:
                    self.client.add(spec, **call)
                    log.info("registered %r with the router %s as %s", model.name, self.settings.registry_url, url)
                elif any(known[url][1].get(k) != v for k, v in spec["labels"].items()):
                    # e.g. a replica loaded or unloaded: the name's capacity changed
                    self.client.relabel(known[url][0], spec["labels"], **call)
                    log.info("updated the labels of %s at the router %s", url, self.settings.registry_url)
            ours = base + MODEL_ROOT
            for url, (worker_id, _) in known.items():
                if url.startswith(ours) and url not in want:
                    self.client.remove(worker_id, **call)
                    log.info("deregistered %s from the router %s", url, self.settings.registry_url)
            self.reconciles += 1

    def sync(self) -> bool:
        """Bring the router's table in line with what is served now, as seen from the caller (a load or
        unload that just returned); True once it is. The keep-alive does the work; this waits for it at
        most PANTHEON_REGISTRY_TIMEOUT_S (then it is still done, later) and holds no lock meanwhile, so a
        stuck router delays an admin reply by that much at most. Without a keep-alive thread it
        reconciles in the calling thread, each call bounded the same way. Never raises: the router
        being away must not fail a load or unload; failures are logged."""
        if self._thread is None:
            return self._attempt()
        with self._cond:
            if self._stop.is_set():
                return False
            self._asked += 1
            ticket = self._asked
            self._cond.notify_all()
            covered = self._cond.wait_for(lambda: self._finished >= ticket or self._stop.is_set(),
                                          self.settings.registry_timeout_s)
            ok = covered and self._finished >= ticket and self._finished_ok
        if not covered:
            log.info("router %s: not confirmed within %g s; the keep-alive carries on",
                     self.settings.registry_url, self.settings.registry_timeout_s)
        return ok

    def _attempt(self, deadline: float | None = None, cancel: Any = None) -> bool:
        """One reconcile; a failure is logged (once per outage) and left to the next one."""
        try:
            self.reconcile(deadline, cancel)
        except Exception as exc:  # noqa: BLE001 - the router being away must not fail a load or unload
            self._failed(exc)
            return False
        self._recovered()
        return True

    def _failed(self, exc: BaseException) -> None:
        if isinstance(exc, (OSError, RouterError)):
            if self._stop.is_set():
                log.info("router %s: call ended by the shutdown (%s)", self.settings.registry_url, exc)
            elif not self._failing:
                log.warning("router %s: registration failed (%s); retrying every %.0f s",
                            self.settings.registry_url, exc, self.settings.registry_interval_s)
        else:
            log.exception("router registration: unexpected error; retrying")
        self._failing = True

    def _recovered(self) -> None:
        if self._failing:
            log.info("router %s: registration restored", self.settings.registry_url)
        self._failing = False

    # ---- the keep-alive thread -----------------------------------------------------------------
    def start(self) -> "Registration":
        if self._thread is None:
            self._thread = osthread.start_thread(self._run, name=THREAD_NAME)
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._cond:
                ticket = self._asked  # read before the reconcile reads what is served: it covers every ask so far
            try:
                ok = self._attempt(cancel=self._stop)
            except Exception:  # noqa: BLE001 - _attempt already catches; this is the last line of defence
                log.exception("router registration: keep-alive iteration failed; retrying")
                ok = False
            with self._cond:
                self._finished, self._finished_ok = ticket, ok
                self._cond.notify_all()
                self._cond.wait_for(lambda: self._stop.is_set() or self._asked > self._finished,
                                    self.settings.registry_interval_s)
        with self._cond:
            deregister, deadline = self._deregister, self._close_deadline
        if deregister:
            self._deregister_now(deadline)
        log.info("router registration: keep-alive stopped")

    def _deregister_now(self, deadline: float) -> None:
        try:
            self.reconcile(deadline)  # with _stop set, "want" is empty: every worker of ours is deleted
        except Exception as exc:  # noqa: BLE001 - shutting down: say so, and go on
            log.warning("router %s: deregistration failed: %s", self.settings.registry_url, exc)

    def close(self, deregister: bool = True, timeout: float | None = None) -> None:
        """Stop the keep-alive (its call in flight ends at once), then, by default, delete this server's
        workers at the router. Returns within `timeout` seconds (default PANTHEON_REGISTRY_TIMEOUT_S)
        whatever the router does: the deregistration's calls share that deadline."""
        timeout = self.settings.registry_timeout_s if timeout is None else timeout
        with self._cond:
            first = not self._stop.is_set()
            if first:
                self._deregister = deregister
                self._close_deadline = time.monotonic() + timeout
                self._stop.set()
            deadline = self._close_deadline
            self._cond.notify_all()
        self.client.interrupt()  # the keep-alive's call in flight (its cancel is _stop) ends now
        if self._thread is not None:
            if not self._thread.join(timeout + JOIN_GRACE_S):
                log.warning("router %s: the keep-alive did not stop within %g s; leaving it",
                            self.settings.registry_url, timeout)
        elif first and deregister:
            self._deregister_now(deadline)
