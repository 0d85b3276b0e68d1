"""Hand-offs between real OS threads (backends, loaders) and request greenlets, without blocking the hub.

A backend's driver thread calls a request's `sink` with each event. Under gevent the request greenlet
must wait for those events cooperatively: the sink appends to a deque and pokes one `loop.async_()`
watcher of the hub (libev's thread-safe wake-up); the watcher's callback runs in the hub and moves the
items into per-request gevent queues. Nothing on the OS-thread side ever blocks on the hub, and
nothing on the hub blocks on an OS lock for longer than a deque append.

Without gevent (tests with Flask's client, `flask run`) the same API is backed by `queue.SimpleQueue`.

`call_in_thread` runs a blocking function (model load, unload drain) in a fresh OS thread and waits
for its result the same way, so an admin request never freezes the other requests. `WorkPool` does the
same for request work that must be bounded (grammar compiles): a fixed number of named threads, a
bounded queue (past it a 429 at once), cancellation of a waiting call, a deadline.

`client_gone` tells whether the peer closed its connection, by polling the socket gunicorn puts in
the WSGI environ (no read, so it never consumes or waits for data).
"""

from __future__ import annotations

import importlib
import logging
import select
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pantheon import osthread
from pantheon.errors import BusyError

log = logging.getLogger(__name__)


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


_QUEUED, _RUNNING, _DROPPED, _ENDED = "queued", "running", "dropped", "ended"


class Ticket:
    """One call submitted to a `WorkPool`; `cancel()` is safe from any thread or greenlet, any time."""

    def __init__(self, pool: "WorkPool", fn: Callable[[], Any], done: Callable[[bool, Any], None]):
        self._pool = pool
        self.fn = fn
        self.done = done  # called once, in the pool's thread, with (True, result) or (False, exception)
        self.state = _QUEUED  # the pool's _mu: queued -> running -> ended | dropped (cancelled)

    def cancel(self) -> None:
        """A waiting call never runs; a running one's result is dropped when it ends (it cannot be
        stopped). Nothing once it ended."""
        self._pool._cancel(self)


@dataclass
class PoolStats:
    running: int = 0  # calls running now (a cancelled call still runs until it returns)
    queued: int = 0  # calls waiting for a thread
    threads: int = 0  # pool threads alive
    completed: int = 0  # results handed to their caller
    rejected: int = 0  # submits refused: the pool was full (429)
    cancelled: int = 0  # waiting calls cancelled before they ran
    discarded: int = 0  # running calls whose caller had left: their result was dropped
    timed_out: int = 0  # callers that stopped waiting at their deadline


class WorkPool:
    """At most `threads` named OS threads run submitted calls, at most `queue` more wait; past that a
    submit is refused at once with 429, so a flood of expensive requests costs at most `threads` cores.

    Why not `call_in_thread`: that starts a thread per call, unbounded, and a call whose caller left
    still runs to its end. Here a caller that leaves (client gone, deadline) cancels its call: one that
    is still waiting never runs; one that runs cannot be interrupted (llguidance compiles hold no
    cancel point), so it keeps its thread and its place in the bound until it returns, and its result
    is dropped. Threads start on demand and end when nothing waits: an idle pool holds none.

    Lock: `_mu` guards `_waiting`, every ticket's `state`, `_names` and the stats; it is held for
    bookkeeping only, never while a call runs or a result is handed over. `_changed` (a condition on
    `_mu`) tells `wait_idle` that a call ended.
    """

    def __init__(self, name: str, threads: int, queue: int, busy_message: str):
        self.name = name
        self.threads = max(1, threads)
        self.queue = max(0, queue)
        self.busy_message = busy_message
        self._mu = osthread.Lock()
        self._changed = osthread.Condition(self._mu)
        self._waiting: deque[Ticket] = deque()  # _mu
        self._names: set[int] = set()  # _mu: indexes of the live threads (named f"{name}-{i}")
        self._stats = PoolStats()  # _mu

    def stats(self) -> PoolStats:
        with self._mu:
            return PoolStats(**{**vars(self._stats), "queued": len(self._waiting), "threads": len(self._names)})

    def submit(self, fn: Callable[[], Any], done: Callable[[bool, Any], None]) -> Ticket:
        """Queue `fn()`; `done(ok, value)` gets its result (or exception) in the pool's thread, unless the
        ticket was cancelled first. Raises BusyError (429) when `threads` run and `queue` wait already."""
        ticket = Ticket(self, fn, done)
        start = None
        with self._mu:
            if self._stats.running + len(self._waiting) >= self.threads + self.queue:
                self._stats.rejected += 1
                raise BusyError(self.busy_message, status=429, retry_after=1)
            self._waiting.append(ticket)
            if len(self._names) < self.threads and len(self._waiting) > len(self._names) - self._stats.running:
                start = min(set(range(self.threads)) - self._names)
                self._names.add(start)
        if start is not None:
            osthread.start_thread(lambda: self._work(start), name=f"{self.name}-{start}")
        return ticket

    def call(self, fn: Callable[[], Any], timeout: float, check: Callable[[], None] | None = None,
             poll: float = 0.1) -> Any:
        """`fn()` run in the pool; the caller waits cooperatively (a greenlet does not block the hub).

        Raises what `fn` raised; BusyError (429) when the pool is full; `Timeout` when `timeout` seconds
        pass first. `check` runs every `poll` seconds while waiting: what it raises (the client is gone)
        propagates. Leaving by any of these cancels the call.
        """
        ch = Channel()
        ticket = self.submit(fn, lambda ok, value: ch.put((ok, value)))
        deadline = time.monotonic() + timeout
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    with self._mu:
                        self._stats.timed_out += 1
                    raise Timeout()
                try:
                    ok, value = ch.get(timeout=min(poll, left))
                    break
                except Timeout:
                    if check is not None:
                        check()
        except BaseException:
            ticket.cancel()
            raise
        if ok:
            return value
        raise value

    def wait_idle(self, timeout: float) -> bool:
        """Whether, within `timeout`, nothing runs or waits (an OS-thread wait: tests and shutdown)."""
        with self._changed:
            return self._changed.wait_for(lambda: not self._stats.running and not self._waiting, timeout)

    def _cancel(self, ticket: Ticket) -> None:
        with self._mu:
            if ticket.state == _QUEUED:
                self._waiting.remove(ticket)
                ticket.state = _DROPPED
                self._stats.cancelled += 1
                self._changed.notify_all()
            elif ticket.state == _RUNNING:
                ticket.state = _DROPPED  # counted as discarded when it returns

    def _work(self, index: int) -> None:
        """One pool thread: run waiting calls until none waits, then end."""
        try:
            while True:
                with self._mu:
                    if not self._waiting:
                        self._names.discard(index)
                        return
                    ticket = self._waiting.popleft()
                    ticket.state = _RUNNING
                    self._stats.running += 1
                try:
                    ok, value = True, ticket.fn()
                except BaseException as exc:  # noqa: BLE001 - handed to the caller, who re-raises it
                    ok, value = False, exc
                with self._mu:
                    self._stats.running -= 1
                    deliver = ticket.state == _RUNNING
                    ticket.state = _ENDED
                    if deliver:
                        self._stats.completed += 1
                    else:
                        self._stats.discarded += 1
                    self._changed.notify_all()
                if deliver:
                    ticket.done(ok, value)  # outside the lock: it only hands the result over
        except BaseException:  # noqa: BLE001 - never die quietly: say so, and leave the pool consistent
            log.exception("%s-%d: pool thread failed", self.name, index)
            with self._mu:
                self._names.discard(index)
                self._changed.notify_all()


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
