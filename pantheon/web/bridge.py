"""Hand-offs between real OS threads (backends, loaders) and request greenlets, without blocking the hub.

A backend's driver thread calls a request's `sink` with each event. Under gevent the request greenlet
must wait for those events cooperatively: the sink appends to a deque and pokes one `loop.async_()`
watcher of the hub (libev's thread-safe wake-up); the watcher's callback runs in the hub and moves the
items into per-request gevent queues. Nothing on the OS-thread side ever blocks on the hub, and
nothing on the hub blocks on an OS lock for longer than a deque append.

Without gevent (tests with Flask's client, `flask run`) the same API is backed by `queue.SimpleQueue`.

`call_in_thread` runs a blocking function (model load, unload drain) in a fresh OS thread and waits
for its result the same way, so an admin request never freezes the other requests.

`client_gone` tells whether the peer closed its connection, by polling the socket gunicorn puts in
the WSGI environ (no read, so it never consumes or waits for data).
"""

from __future__ import annotations

import importlib
import select
from collections import deque
from collections.abc import Callable
from typing import Any

from pantheon import osthread


def gevent_active() -> bool:
    """True in a gevent-patched process (gunicorn's gevent worker): waits must then be cooperative."""
    try:
        from gevent import monkey
    except ImportError:
        return False
    return bool(monkey.is_module_patched("threading"))


class Timeout(Exception):
    """`Channel.get` saw nothing within its timeout."""


class _HubWaker:
    """One per hub: the thread-safe door from OS threads into the hub's loop."""

    def __init__(self, hub: Any):
        self._pending: deque[tuple[Any, Any]] = deque()  # (gevent queue, item); OS threads append, hub pops
        self._watcher = hub.loop.async_()
        self._watcher.start(self._drain)

    def post(self, q: Any, item: Any) -> None:
        """Any thread: queue `item` for `q` and wake the hub (never blocks)."""
        self._pending.append((q, item))
        self._watcher.send()

    def _drain(self) -> None:
        """Hub only: deliver everything posted so far."""
        while True:
            try:
                q, item = self._pending.popleft()
            except IndexError:
                return
            q.put_nowait(item)


_wakers: dict[int, _HubWaker] = {}  # id(hub) -> waker; created from that hub's own thread


def _waker() -> _HubWaker:
    from gevent import get_hub
    hub = get_hub()
    w = _wakers.get(id(hub))
    if w is None:
        w = _wakers[id(hub)] = _HubWaker(hub)
    return w


class Channel:
    """An unbounded mailbox: any thread `put`s, the owning greenlet (or thread) `get`s.

    Create it in the consumer (the request greenlet): under gevent it binds to that greenlet's hub.
    """

    def __init__(self) -> None:
        self._gevent = gevent_active()
        if self._gevent:
            from gevent.queue import Queue
            self._q: Any = Queue()
            self._waker = _waker()
        else:
            import queue
            self._q = queue.SimpleQueue()

    def put(self, item: Any) -> None:
        """Any thread, never blocks. Usable directly as a backend `sink`."""
        if self._gevent:
            self._waker.post(self._q, item)
        else:
            self._q.put(item)

    def get(self, timeout: float | None = None) -> Any:
        """Next item; waits cooperatively under gevent. Raises Timeout when `timeout` passes first."""
        if self._gevent:
            from gevent.queue import Empty
        else:
            from queue import Empty
        try:
            return self._q.get(timeout=timeout)
        except Empty:
            raise Timeout() from None


def call_in_thread(fn: Callable[..., Any], *args: Any, name: str = "pantheon-call") -> Any:
    """Run `fn(*args)` in a new OS thread and return its result (or raise its exception).

    The caller waits cooperatively, so a greenlet can start a minutes-long model load without stalling
    the hub. If the caller is killed meanwhile, the thread still runs to completion.
    """
    ch = Channel()

    def run() -> None:
        try:
            ch.put((True, fn(*args)))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, who re-raises it
            ch.put((False, exc))

    osthread.start_thread(run, name=name)
    ok, value = ch.get()
    if ok:
        return value
    raise value


def _unpatched(module: str, name: str) -> Any:
    try:
        from gevent import monkey
    except ImportError:
        return getattr(importlib.import_module(module), name)
    return monkey.get_original(module, name)


_poll = _unpatched("select", "poll")  # with a 0 timeout it never waits, patched or not


def client_gone(environ: dict) -> bool:
    """True when the client's side of the connection is closed (or broken).

    Uses the socket gunicorn stores in the environ; without one (test client) it always says False.
    """
    sock = environ.get("gunicorn.socket")
    if sock is None:
        return False
    try:
        fd = sock.fileno()
    except OSError:
        return True
    if fd < 0:
        return True
    p = _poll()
    rdhup = getattr(select, "POLLRDHUP", 0)
    p.register(fd, select.POLLIN | rdhup)
    events = p.poll(0)
    if not events:
        return False
    return bool(events[0][1] & (rdhup | select.POLLHUP | select.POLLERR | select.POLLNVAL))
