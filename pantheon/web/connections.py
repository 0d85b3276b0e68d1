"""The worker's open connections and what each is doing, so the connection cap can evict the right one.

A connection is in one phase at a time: HEAD (waiting for a request line and headers, or idle
between kept-alive requests), BODY (the app is reading its body) or APP (the app is serving it).
The worker (pantheon.web.worker) opens and closes entries and sets HEAD/APP around each request;
pantheon.web.body sets BODY while it reads. HEAD and BODY connections are *waiting* on their client
and may be evicted when the cap is reached; APP ones never are.

Concurrency: the table is touched only from greenlets of the worker's one hub thread (no OS thread
reads it), so it needs no lock. Outside pantheon's worker (Flask's test client, another server) no
entry is ever opened and `set_phase` does nothing.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from typing import Any

HEAD, BODY, APP = "head", "body", "app"
WAITING = (HEAD, BODY)


@dataclass
class _Conn:
    sock: Any
    phase: str
    since: float  # monotonic time the current phase began


class ConnectionTable:
    """Open connections keyed by socket object."""

    def __init__(self) -> None:
        self._conns: dict[int, _Conn] = {}  # id(sock) -> entry

    def __len__(self) -> int:
        return len(self._conns)

    def opened(self, sock: Any) -> None:
        self._conns[id(sock)] = _Conn(sock, HEAD, time.monotonic())

    def closed(self, sock: Any) -> None:
        self._conns.pop(id(sock), None)

    def set_phase(self, sock: Any, phase: str) -> None:
        c = self._conns.get(id(sock))
        if c is not None and c.phase != phase:
            c.phase, c.since = phase, time.monotonic()

    def phases(self) -> dict[str, int]:
        """How many connections are in each phase (for tests and metrics)."""
        out = {HEAD: 0, BODY: 0, APP: 0}
        for c in self._conns.values():
            out[c.phase] += 1
        return out

    def evict_one(self) -> bool:
        """Shut the connection that has waited longest on its client; False when none is waiting."""
        waiting = [c for c in self._conns.values() if c.phase in WAITING]
        if not waiting:
            return False
        victim = min(waiting, key=lambda c: c.since)
        self._conns.pop(id(victim.sock), None)
        try:
            victim.sock.shutdown(socket.SHUT_RDWR)  # its greenlet's pending read returns at once
        except OSError:
            pass
        return True


CONNECTIONS = ConnectionTable()  # this process's table (gunicorn runs one worker per process here)


def set_phase(environ: dict, phase: str) -> None:
    """What the connection of this WSGI request is doing now."""
    sock = environ.get("gunicorn.socket")
    if sock is not None:
        CONNECTIONS.set_phase(sock, phase)
