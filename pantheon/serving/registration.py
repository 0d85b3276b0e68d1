"""Router registration: tell a router (SMG, the `smg` gateway) which models this server serves.

Off unless PANTHEON_REGISTRY_URL is set; then, and only then, this module talks to the router. Each
served model *name* is one worker at the router, reached at its own root `ADVERTISE/m/<name>` (the
per-model routes in pantheon.web.router_api), because the router routes by the request's `model`
and keeps one worker per URL. Replicas of a name inside this process stay one worker: the registry
already spreads a name's requests over its replicas, the router spreads them over processes.

What is registered for a model (SMG's `POST /workers` body): the worker URL, the model id, the
context length, the API key the router must present (PANTHEON_API_KEY, when set) and the labels
`instance_id` = `host:port:model`, `node_id`, `transport`, `capacity` (= batch slots, also given as
`max_running_requests`) and `context_length`. Live load is not pushed: SMG pulls it from the worker's
`GET /v1/loads`, which keeps the router's view as fresh as its poll interval.

One `Registration` object owns everything, with these invariants:

* `reconcile()` makes the router's table match what the server serves *now*: every ready model has
  a worker at its URL with the current labels (a replica loaded or unloaded changes the name's
  capacity: the labels are patched in place, the worker stays), and no worker under this server's `/m/` prefix names a model that is gone
  (so a restart that serves fewer models cleans up after the previous process). It is idempotent,
  serialised by `_sync_lock`, and safe to call from any OS thread (the startup thread after each
  load, the admin threads after a load or unload, the keep-alive thread).
* The keep-alive thread (`pantheon-registry`, the design's heartbeat) calls `reconcile()` every
  PANTHEON_REGISTRY_INTERVAL_S seconds, so a router that restarted (and forgot its workers) gets
  them back within one interval. It never dies quietly: every failure is logged (a router outage
  once when it starts and once when it ends) and retried on the next tick.
* `close()` stops the keep-alive thread first, then deletes this server's workers (graceful
  shutdown), so nothing can register them again behind its back.

HTTP goes through the *original* socket module (see `_Connection`): these calls run in real OS
threads, where gevent's cooperative sockets would need a hub of their own.
"""

from __future__ import annotations

import http.client
import json
import logging
import socket as _socket_mod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from pantheon import osthread
from pantheon.config import Settings

log = logging.getLogger(__name__)

MODEL_ROOT = "/m/"  # a model's own root on this server: /m/<name>/health, /v1/models, /v1/loads, ...
HTTP_TIMEOUT_S = 5.0  # one control-plane call; a router that does not answer in time is retried later
THREAD_NAME = "pantheon-registry"

_bound: list[tuple[str, int]] = []  # the listening address(es) the gunicorn worker noted (note_bound_address)


def note_bound_address(host: str, port: int) -> None:
    """Record where this process listens (called by the gunicorn worker before the app loads)."""
    _bound.append((host, int(port)))


class _Connection(http.client.HTTPConnection):
    """http.client over the original (blocking) socket, whatever gevent has patched."""

    def connect(self) -> None:
        getaddrinfo = osthread.original("socket", "getaddrinfo")
        sock_cls = osthread.original("socket", "socket")
        err: OSError | None = None
        for family, kind, proto, _, addr in getaddrinfo(self.host, self.port, 0, _socket_mod.SOCK_STREAM):
            sock = sock_cls(family, kind, proto)
            try:
                sock.settimeout(self.timeout)
                sock.connect(addr)
            except OSError as exc:
                sock.close()
                err = exc
                continue
            self.sock = self._wrap(sock)
            return
        raise err or OSError(f"cannot resolve {self.host}")

    def _wrap(self, sock: Any) -> Any:
        return sock


class _TLSConnection(_Connection):
    default_port = 443

    def _wrap(self, sock: Any) -> Any:
        ctx = osthread.original("ssl", "create_default_context")()
        return ctx.wrap_socket(sock, server_hostname=self.host)


class RouterError(Exception):
    """The router answered a control-plane call with an unexpected status."""


@dataclass(frozen=True)
class Served:
    """One model name this server serves, as the router should see it."""

    name: str
    capacity: int  # requests it runs at once: the batch slots (over all of its replicas' smallest)
    context_length: int


class RouterClient:
    """SMG's worker control plane: `GET /workers`, `POST /workers`, `PATCH` and `DELETE /workers/{id}`."""

    def __init__(self, base_url: str, key: str | None = None, timeout: float = HTTP_TIMEOUT_S):
        parts = urlsplit(base_url)
        self.base_url = base_url.rstrip("/")
        self._tls = parts.scheme == "https"
        self._host = parts.hostname or "127.0.0.1"
        self._port = parts.port or (443 if self._tls else 80)
        self._prefix = parts.path.rstrip("/")
        self._key = key
        self.timeout = timeout  # seconds per call (connect, then each read)

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        """(status, parsed JSON or None). Raises OSError when the router cannot be reached."""
        cls = _TLSConnection if self._tls else _Connection
        conn = cls(self._host, self._port, timeout=self.timeout)
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
            raw = resp.read()
        except http.client.HTTPException as exc:
            raise OSError(f"{method} {path}: {exc}") from exc
        finally:
            conn.close()
        try:
            parsed = json.loads(raw) if raw else None
        except ValueError:
            parsed = raw.decode("utf-8", "replace")[:200]
        return resp.status, parsed

    def workers(self) -> dict[str, tuple[str, dict]]:
        """url -> (worker id, labels) of every worker the router knows."""
        status, body = self.request("GET", "/workers")
        if status != 200 or not isinstance(body, dict):
            raise RouterError(f"GET /workers answered {status}: {body}")
        return {str(w.get("url")): (str(w.get("id")), w.get("labels") if isinstance(w.get("labels"), dict) else {})
                for w in body.get("workers") or [] if isinstance(w, dict)}

    def add(self, spec: dict) -> None:
        """Register a worker; one that already exists at that URL (409) counts as registered."""
        status, body = self.request("POST", "/workers", spec)
        if status not in (200, 201, 202, 409):
            raise RouterError(f"POST /workers for {spec.get('url')} answered {status}: {body}")

    def relabel(self, worker_id: str, labels: dict) -> None:
        """Update a registered worker's labels in place (SMG merges them into the ones it holds)."""
        status, body = self.request("PATCH", f"/workers/{worker_id}", {"labels": labels})
        if status not in (200, 202, 204):
            raise RouterError(f"PATCH /workers/{worker_id} answered {status}: {body}")

    def remove(self, worker_id: str) -> None:
        status, body = self.request("DELETE", f"/workers/{worker_id}")
        if status not in (200, 202, 204, 404):
            raise RouterError(f"DELETE /workers/{worker_id} answered {status}: {body}")


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
        # The control plane's bearer token: PANTHEON_REGISTRY_KEY; without one, the API key (a router
        # started by `pantheon router` with only PANTHEON_API_KEY guards its control plane with that).
        self.client = client or RouterClient(settings.registry_url, settings.registry_key or settings.api_key)
        self._sync_lock = osthread.Lock()  # one reconcile at a time; held across its HTTP calls
        self._stop = osthread.Event()  # set by close(): the keep-alive loop ends, reconcile registers nothing
        self._wake = osthread.Event()  # set by close(): the keep-alive's wait ends at once
        self._thread: osthread.OSThread | None = None
        self._failing = False  # the last reconcile failed (log an outage once, and its end once)
        self.reconciles = 0  # completed reconciles (tests and debugging)

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
        if self.settings.api_key:
            body["api_key"] = self.settings.api_key  # the router presents it on every call to this worker
        return body

    # ---- reconciling ------------------------------------------------------------------------------
    def reconcile(self) -> None:
        """Register every ready model the router lacks and delete this server's workers whose model is
        gone. Raises OSError/RouterError when the router cannot be reached or refuses."""
        with self._sync_lock:
            base = self._base()
            if base is None:
                return  # not listening yet: nothing the router could reach
            want = {} if self._stop.is_set() else {self.worker_url(base, m.name): m for m in self._served()}
            known = self.client.workers()
            for url, model in want.items():
                spec = self.spec(base, model)
                if url not in known:
                    self.client.add(spec)
                    log.info("registered %r with the router %s as %s", model.name, self.settings.registry_url, url)
                elif any(known[url][1].get(k) != v for k, v in spec["labels"].items()):
                    # e.g. a replica loaded or unloaded: the name's capacity changed
                    self.client.relabel(known[url][0], spec["labels"])
                    log.info("updated the labels of %s at the router %s", url, self.settings.registry_url)
            ours = base + MODEL_ROOT
            for url, (worker_id, _) in known.items():
                if url.startswith(ours) and url not in want:
                    self.client.remove(worker_id)
                    log.info("deregistered %s from the router %s", url, self.settings.registry_url)
            self.reconciles += 1

    def sync(self) -> None:
        """Reconcile now, from the calling OS thread; a failure is logged and left to the keep-alive."""
        try:
            self.reconcile()
            self._recovered()
        except Exception as exc:  # noqa: BLE001 - the router being away must not fail a load or unload
            self._failed(exc)

    def _failed(self, exc: BaseException) -> None:
        if isinstance(exc, (OSError, RouterError)):
            if not self._failing:
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
            try:
                self.sync()
            except Exception:  # noqa: BLE001 - sync already catches; this is the last line of defence
                log.exception("router registration: keep-alive iteration failed; retrying")
            self._wait(self.settings.registry_interval_s)
        log.info("router registration: keep-alive stopped")

    def _wait(self, seconds: float) -> None:
        """Sleep until the next tick or close(), whichever comes first."""
        if self._wake.wait(seconds):
            self._wake.clear()

    def close(self, deregister: bool = True, timeout: float = HTTP_TIMEOUT_S * 2) -> None:
        """Stop the keep-alive thread, then (by default) delete this server's workers at the router;
        `timeout` bounds the thread's join and each HTTP call of the deregistration."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if deregister:
            self.client.timeout = min(self.client.timeout, timeout)  # a graceful stop has seconds, not minutes
            try:
                self.reconcile()  # with _stop set, "want" is empty: every worker of ours is deleted
            except Exception as exc:  # noqa: BLE001 - shutting down: say so, and go on
                log.warning("router %s: deregistration failed: %s", self.settings.registry_url, exc)
