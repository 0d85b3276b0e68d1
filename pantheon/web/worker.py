"""Pantheon's gunicorn worker: the gevent worker, hardened against slow and malformed clients.

`pantheon serve` runs gunicorn with `-k pantheon.web.worker.PantheonWorker`. Over the stock gevent
worker it adds:

* **A header deadline.** The request line and headers (and a kept-alive connection's wait for its
  next request) must arrive within PANTHEON_HEADER_TIMEOUT_S; then the connection is closed. The body
  has its own deadline and minimum rate (pantheon.web.body).
* **A connection cap that keeps the server answerable.** At most PANTHEON_MAX_CONNECTIONS connections
  are open per worker. A connection past the cap first evicts the oldest one that is only *waiting*
  for a client (reading a request line, headers or body, or idle between requests); connections whose
  request the app is serving are never evicted. Only when every connection is being served does the
  newcomer get a 503. So a thousand clients that each send half a request cannot lock out `GET /`:
  the newest real request pushes out the longest-stalled attacker. gunicorn's own pool is sized above
  the cap so accepting never stops.
* **Errors in the OpenAI JSON shape** for what gunicorn's parser refuses (malformed request line or
  headers, oversized headers), instead of its HTML page.
* **Router deregistration after a graceful stop.** It notes where it listens (the address
  pantheon.serving.registration advertises unless PANTHEON_ADVERTISE_URL says otherwise); with
  PANTHEON_REGISTRY_URL set, a SIGTERM first drains in-flight requests (a few seconds less than
  gunicorn's graceful timeout, so the arbiter's SIGKILL cannot come first), then deletes this
  server's workers at the router.
* **Death with the arbiter.** The worker asks the kernel for SIGKILL when its parent dies
  (PR_SET_PDEATHSIG), so a killed `pantheon serve` (or a killed test run) never leaves a worker
  holding gigabytes of model behind.

The table of open connections and their phases is pantheon.web.connections.
"""

from __future__ import annotations

import ctypes
import http
import json
import signal
import sys
from typing import Any

import gevent
from gunicorn import util
from gunicorn.http import errors as http_errors
from gunicorn.workers.ggevent import GeventWorker

from pantheon.config import load_settings
from pantheon.web.connections import APP, CONNECTIONS, HEAD
from pantheon.web.errors import error_body

POOL_HEADROOM = 64  # gunicorn's pool is this much larger than the cap, so the cap is ours to enforce
PR_SET_PDEATHSIG = 1
DEREGISTER_RESERVE_S = 4.0  # of the graceful timeout, kept back for deleting our workers at the router

def _die_with_parent() -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


_STATUS_BY_ERROR: tuple[tuple[type, int], ...] = (
    (http_errors.LimitRequestLine, 414),
    (http_errors.LimitRequestHeaders, 431),
    (http_errors.ExpectationFailed, 417),
    (http_errors.UnsupportedTransferCoding, 501),
    (http_errors.ForbiddenProxyRequest, 403),
    (http_errors.ConfigurationProblem, 500),
    (http_errors.ParseException, 400),
)


def http_error_status(exc: BaseException) -> int:
    """The status for an error gunicorn raised while reading a request (500: not the client's fault)."""
    if isinstance(exc, (http_errors.InvalidResponseHeader, http_errors.InvalidResponseHeaderName)):
        return 500  # a header the app sent: ours
    for cls, status in _STATUS_BY_ERROR:
        if isinstance(exc, cls):
            return status
    return 500


def json_error_response(status: int, message: str, code: str) -> bytes:
    """A complete HTTP/1.1 response carrying the OpenAI error object; the connection closes after it."""
    body = json.dumps(error_body(status, message, code)).encode("utf-8")
    reason = http.HTTPStatus(status).phrase if status in http.HTTPStatus._value2member_map_ else "Error"
    head = (f"HTTP/1.1 {status} {reason}\r\nConnection: close\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")
    return head.encode("latin-1") + body


class PantheonWorker(GeventWorker):
    """gunicorn's gevent worker with the deadlines, the connection cap and JSON errors above."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.settings = load_settings()
        self.worker_connections = self.settings.max_connections + POOL_HEADROOM

    def init_process(self) -> None:
        _die_with_parent()
        from pantheon.serving import registration
        for sock in self.sockets:  # where the router can reach us (unless PANTHEON_ADVERTISE_URL says)
            try:
                addr = sock.getsockname()
            except OSError:
                continue
            if isinstance(addr, tuple) and len(addr) >= 2:
                registration.note_bound_address(str(addr[0]), int(addr[1]))
        if self.settings.registry_url:
            # This process's copy of the config only: drain a little shorter than the arbiter waits, so
            # the deregistration after the drain runs before the arbiter's SIGKILL.
            self.cfg.set("graceful_timeout", max(1, int(self.cfg.graceful_timeout - DEREGISTER_RESERVE_S)))
        super().init_process()

    def run(self) -> None:
        """Serve until told to stop; a graceful stop (SIGTERM) drains in-flight requests first. Then the
        models are deregistered from the router (when PANTHEON_REGISTRY_URL is set)."""
        try:
            super().run()
        finally:
            state = getattr(getattr(self, "wsgi", None), "extensions", {}).get("pantheon")
            reg = getattr(state, "registration", None)
            if reg is not None:
                reg.close(deregister=True, timeout=DEREGISTER_RESERVE_S / 2)

    def timeout_ctx(self) -> Any:
        """Bounds reading each request line + headers, and the idle wait before a kept-alive request."""
        return gevent.Timeout(self.settings.header_timeout_s, False)

    def handle(self, listener: Any, client: Any, addr: Any) -> None:
        if len(CONNECTIONS) >= self.settings.max_connections and not CONNECTIONS.evict_one():
            try:
                client.setblocking(1)
                util.write_nonblock(client, json_error_response(
                    503, "too many open connections; retry shortly", "server_busy"))
            except OSError:
                pass
            util.close(client)
            return
        CONNECTIONS.opened(client)
        try:
            super().handle(listener, client, addr)
        finally:
            CONNECTIONS.closed(client)

    def handle_request(self, listener_name: Any, req: Any, sock: Any, addr: Any) -> Any:
        CONNECTIONS.set_phase(sock, APP)
        try:
            return super().handle_request(listener_name, req, sock, addr)
        finally:
            CONNECTIONS.set_phase(sock, HEAD)  # kept alive: waiting for the next request line

    def handle_error(self, req: Any, client: Any, addr: Any, exc: BaseException) -> None:
        status = http_error_status(exc)
        if status == 500:
            self.log.exception("error handling a request")
            message, code = "internal error while reading the request", "internal_error"
        else:
            self.log.warning("invalid request from %s: %s", (addr or ("",))[0], exc)
            detail = str(exc)[:200] or type(exc).__name__
            message = f"malformed HTTP request: {type(exc).__name__}: {detail}"
            code = "unsupported_transfer_coding" if status == 501 else "invalid_request_error"
        try:
            util.write_nonblock(client, json_error_response(status, message, code))
        except Exception:  # noqa: BLE001 - the client may be gone; nothing left to tell it
            self.log.debug("failed to send the error response")
