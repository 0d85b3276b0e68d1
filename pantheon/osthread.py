"""Real OS threads and locks, even inside a gevent-monkey-patched process.

gunicorn's gevent worker patches `threading`, so `threading.Thread` becomes a greenlet and
`threading.Lock` a cooperative lock. The JAX driver threads must be real OS threads (a greenlet
blocked in XLA would freeze the hub), and the primitives they share with other OS threads must be
the original ones. Greenlets only ever hold these locks for a few microseconds.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import importlib
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

_PR_SET_NAME = 15  # prctl option: the calling thread's name, 15 bytes at most


def original(module: str, name: str) -> Any:
    """`module.name` as it was before gevent patched it (the plain object when nothing is patched):
    real locks, threads and sockets for code that runs in OS threads of the gevent worker."""
    try:
        from gevent import monkey
        if monkey.is_module_patched(module):
            return monkey.get_original(module, name)
    except ImportError:
        pass
    return getattr(importlib.import_module(module), name)


def Lock() -> Any:
    return original("threading", "Lock")()


def RLock() -> Any:
    return original("threading", "RLock")()


class Condition:
    """A condition variable built only from original locks.

    The stdlib class allocates its per-waiter locks through the (patched) threading module, so
    under gevent it would hand OS threads cooperative locks. Waiters here are original locks.
    """

    def __init__(self, lock: Any = None):
        self._lock = lock if lock is not None else Lock()
        self._waiters: list[Any] = []  # locks held by waiting threads; guarded by self._lock

    def __enter__(self) -> "Condition":
        self._lock.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    def acquire(self, *args: Any) -> bool:
        return self._lock.acquire(*args)

    def release(self) -> None:
        self._lock.release()

    def wait(self, timeout: float | None = None) -> bool:
        """Release the lock, sleep until notified or timeout, re-acquire. Call with the lock held."""
        waiter = Lock()
        waiter.acquire()
        self._waiters.append(waiter)
        self._lock.release()
        try:
            got = waiter.acquire(True, -1 if timeout is None else max(0.0, timeout))
        finally:
            self._lock.acquire()
        if not got:
            try:
                self._waiters.remove(waiter)
            except ValueError:
                got = True  # notified between the timeout and re-acquiring
        return got

    def wait_for(self, predicate: Callable[[], bool], timeout: float | None = None) -> bool:
        import time
        end = None if timeout is None else time.monotonic() + timeout
        result = predicate()
        while not result:
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                break
            self.wait(left)
            result = predicate()
        return result

    def notify(self, n: int = 1) -> None:
        for w in self._waiters[:n]:
            w.release()
        del self._waiters[:n]

    def notify_all(self) -> None:
        self.notify(len(self._waiters))


class Event:
    """threading.Event semantics over original locks (the stdlib class would use patched ones)."""

    def __init__(self) -> None:
        self._cond = Condition()
        self._flag = False  # guarded by self._cond

    def is_set(self) -> bool:
        return self._flag

    def set(self) -> None:
        with self._cond:
            self._flag = True
            self._cond.notify_all()

    def clear(self) -> None:
        with self._cond:
            self._flag = False

    def wait(self, timeout: float | None = None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._flag, timeout)


class OSThread:
    """Handle of a thread started with the original `_thread.start_new_thread`.

    The original `threading.Thread` class still uses the patched module's internals (its start()
    waits on a cooperative event), so the raw primitive is used and joining is done with an
    original lock released when the target returns.
    """

    def __init__(self, name: str):
        self.name = name
        self._done = Lock()
        self._done.acquire()

    def join(self, timeout: float | None = None) -> bool:
        if self._done.acquire(True, -1 if timeout is None else max(0.0, timeout)):
            self._done.release()
            return True
        return False

    def is_alive(self) -> bool:
        if self._done.acquire(False):
            self._done.release()
            return False
        return True


def name_os_thread(name: str) -> None:
    """Give the calling OS thread `name` (its first 15 bytes) where the kernel shows it.

    Python before 3.14 leaves the OS-level name as the process's, so top, perf and py-spy list every
    driver and loader thread as "python3"; named, a profile says which model's driver spent the time.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None).prctl(_PR_SET_NAME, name.encode("utf-8", "replace")[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


def start_thread(target: Callable[[], None], name: str) -> OSThread:
    """Run `target` in a real OS thread named `name`; returns a handle that can be joined."""
    handle = OSThread(name)

    def run() -> None:
        try:
            name_os_thread(name)
            target()
        finally:
            handle._done.release()

    original("_thread", "start_new_thread")(run, ())
    return handle


def map_threads(fn: Callable[[Any], Any], items: list[Any], workers: int, name: str) -> list[Any]:
    """[fn(x) for x in items] over `workers` real OS threads (a stdlib pool would spawn greenlets
    under gevent); results in order, and the first exception is raised after every thread ends."""
    results: list[Any] = [None] * len(items)
    errors: list[BaseException] = []
    lock = Lock()  # guards `taken` and `errors`
    taken = [0]

    def worker() -> None:
        while True:
            with lock:
                i = taken[0]
                taken[0] += 1
                if i >= len(items) or errors:
                    return
            try:
                results[i] = fn(items[i])
            except BaseException as exc:  # noqa: BLE001 - re-raised by the caller below
                with lock:
                    errors.append(exc)

    threads = [start_thread(worker, f"{name}-{k}") for k in range(max(1, min(workers, len(items))))]
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def sleep(seconds: float) -> None:
    """time.sleep that really sleeps this OS thread (the patched one would switch greenlets)."""
    original("time", "sleep")(seconds)


def run_process(cmd: Sequence[str], timeout: float, show_stdout: bool = False) -> tuple[int | None, str]:
    """Run cmd[0] (an absolute path) to completion; (exit status or None when unknown, its output).

    Why not `subprocess`: under gunicorn's gevent worker the patched `subprocess` works only in the
    hub's thread (it needs the default loop's child watcher: "TypeError: child watchers are only
    available on the default loop"), and the stdlib one is disabled there; model loads run in OS
    threads. The unpatched `posix_spawn` and `waitpid` work anywhere. stdout (unless `show_stdout`)
    and stderr go to one unnamed temp file rather than a pipe, so nothing has to be read concurrently
    and no cooperative I/O is involved. The child gets its own process group so a timeout kills it
    with its own children (g++ with cc1plus, as and ld). On timeout (or any exception while waiting)
    the group is killed and the child reaped. Once gevent's child watcher has been used in the
    process it may reap our child first: the status is then None and the caller judges by results.
    """
    spawn, waitpid = original("os", "posix_spawn"), original("os", "waitpid")
    with tempfile.TemporaryFile() as log_file:
        fd = log_file.fileno()
        actions = [(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0), (os.POSIX_SPAWN_DUP2, fd, 2)]
        if not show_stdout:  # else the child writes to our stdout (pip's progress bars in a terminal)
            actions.append((os.POSIX_SPAWN_DUP2, fd, 1))
        pid = spawn(cmd[0], list(cmd), dict(os.environ), file_actions=actions, setpgroup=0)
        status: int | None = None
        reaped = False
        try:
            deadline = time.monotonic() + timeout
            delay = 0.005
            while True:
                try:
                    done, raw = waitpid(pid, os.WNOHANG)
                except ChildProcessError:  # another SIGCHLD handler reaped it: exited, status unknown
                    reaped = True
                    break
                if done:
                    reaped = True
                    status = os.waitstatus_to_exitcode(raw)
                    break
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"{os.path.basename(cmd[0])} ran past {timeout:g} s")
                sleep(delay)
                delay = min(delay * 2, 0.1)
        finally:
            if not reaped:
                with contextlib.suppress(OSError):
                    os.killpg(pid, signal.SIGKILL)
                with contextlib.suppress(ChildProcessError):
                    waitpid(pid, 0)
        log_file.seek(0)
        return status, log_file.read().decode(errors="replace")
