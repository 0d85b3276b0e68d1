"""One model over several hosts: jax.distributed, a global mesh, and a verb broadcast that keeps every
process stepping in lock step.

Why this shape. Under jax.distributed every process is a full JAX controller: a jitted program over a
mesh that spans processes runs only if *every* process launches the same program with the same host
inputs in the same order (its collectives meet across processes). Only process 0 (the leader) serves
HTTP and runs the scheduler, so the others (followers) must be told what to run. Rather than teaching
them the scheduler, the leader wraps each `engine.Model` in a `LeaderModel` proxy: every call of a
*verb* -- a method that changes device state or runs a compiled step (`VERBS`) -- first sends
(verb name, host arguments) to every follower, then runs locally. Each follower runs the same method
on its own `Model`, whose params and state are its shards of the same global arrays. Device-state
arguments are not sent: each process holds its own shard, so the leader sends a `StateRef` (a small
integer naming "the state you got back from call k") and the follower substitutes its own. Methods
built on verbs (`pantheon.runtime.reference`'s `prefill`, `logits`, `generate`, or a method of the model) run on
the leader with the proxy as the model, so the verbs they call are broadcast one by one. Nothing here knows a verb's argument
list: when the engine's seam changes (`insert` / `step` / `release(slot)`), only `VERBS` changes.

The control channel is a plain TCP connection from each follower to the leader, carrying
length-prefixed pickle frames. The leader listens on an ephemeral port on the coordinator's host and
publishes "host:port" in jax.distributed's key-value store; followers read it from there. Pickle is
acceptable because the only sender is the leader, on the same trusted network as the coordinator
(which is itself unauthenticated); never expose the coordinator or the control port beyond it.

Failure detection, both ways, with deadlines:
* follower gone -> each follower sends a beat every `BEAT_S`; the leader's reader thread for it
  marks the cluster failed on EOF, a socket error, a `fail` frame, or `DEAD_AFTER_S` of silence. From
  then on every verb raises `ClusterFailed` (503), `GET /` answers 503 naming the models, and chat
  requests are refused with 503. A step already inside a collective fails by itself: gloo reports the
  closed peer connection at once ("Connection reset by peer").
* leader gone -> the follower's reader thread sees EOF (or the `stop` frame the leader sends at exit)
  and ends the process with status 0 at once, even while its main thread is inside a step.

Two jax settings make this work on CPU (jax 0.10): cross-process collectives use gloo
(`jax_cpu_collectives_implementation`, already the default there), and `jax_enable_recoverability`
is turned on, because without it the coordination service *aborts the leader process* (a C++ check
failure, SIGABRT) a heartbeat timeout after any follower dies -- the opposite of answering 503.
"""

from __future__ import annotations

import atexit
import dataclasses
import inspect
import logging
import os
import pickle
import struct
import sys
import time
import types
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pantheon import osthread
from pantheon.errors import PantheonError

log = logging.getLogger(__name__)

# The engine seam's verbs: calls that change device state or run a compiled step. Every one of them
# is broadcast to the followers before it runs on the leader. The future seam's names are listed too
# (a name the Model does not have is simply never called).
VERBS: tuple[str, ...] = ("new_state", "warmup", "insert", "step", "release", "copy_slot", "prompt_logprobs",
                          "forward_rows", "free", "embed")

BEAT_S = 0.5  # a follower's heartbeat period on the control channel
DEAD_AFTER_S = 5.0  # a follower silent this long is declared dead
# Calls that block until a step's device arrays are ready (reading the sampled ids). On the leader they
# first wait for those arrays while watching the cluster: a step whose collective lost its peer may
# never finish, and the driver thread must come back with ClusterFailed instead of hanging with it.
WAITS: tuple[str, ...] = ("read", "read_logprobs")
# Verbs that still run locally once the cluster has failed: freeing this process's memory needs no follower.
LOCAL_ON_FAILURE: tuple[str, ...] = ("free",)
VERDICT_WAIT_S = 2.0  # how long a failed step waits for the reader threads to name a lost process
KV_KEY = "pantheon/control"  # where the leader publishes its control address in jax's key-value store
_LEN = struct.Struct("!Q")
MAX_FRAME = 1 << 30


class ClusterFailed(PantheonError):
    """A process of the multi-host cluster is gone: the models spread over it cannot step."""

    status = 503
    code = "cluster_failed"


@dataclass(frozen=True)
class ClusterSpec:
    """Where this process sits in a multi-process cluster (`--coordinator/--num-processes/--process-id`)."""

    coordinator: str  # HOST:PORT of process 0's coordination service
    num_processes: int
    process_id: int
    timeout_s: float = 120.0  # how long start-up waits for every process (and the control channel)

    @property
    def is_leader(self) -> bool:
        return self.process_id == 0

    @property
    def host(self) -> str:
        return self.coordinator.rsplit(":", 1)[0].strip("[]")


def spec_from_settings(settings: Any) -> ClusterSpec | None:
    """The cluster this process belongs to, or None for an ordinary single-process server."""
    coordinator = getattr(settings, "coordinator", None)
    n = int(getattr(settings, "num_processes", 1) or 1)
    if not coordinator or n <= 1:
        return None
    pid = int(getattr(settings, "process_id", 0) or 0)
    if not 0 <= pid < n:
        raise ValueError(f"process id {pid} is outside 0..{n - 1}")
    return ClusterSpec(coordinator, n, pid, float(getattr(settings, "cluster_timeout_s", 120.0)))


_init_lock = osthread.Lock()  # guards _initialized: jax.distributed.initialize runs once per process
_initialized: ClusterSpec | None = None


def initialize(spec: ClusterSpec) -> None:
    """Join the cluster: jax.distributed over every process, gloo collectives on CPU. Must run before
    anything touches a JAX device in this process; idempotent."""
    global _initialized
    with _init_lock:
        if _initialized is not None:
            return
        import jax
        jax.config.update("jax_enable_recoverability", True)  # see the module docstring: no abort on a dead peer
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        timeout = max(1, int(spec.timeout_s))
        jax.distributed.initialize(coordinator_address=spec.coordinator, num_processes=spec.num_processes,
                                   process_id=spec.process_id, initialization_timeout=timeout,
                                   heartbeat_timeout_seconds=10, shutdown_timeout_seconds=5)
        _initialized = spec
        log.info("joined the cluster as process %d of %d: %d devices, %d local", spec.process_id,
                 spec.num_processes, len(jax.devices()), len(jax.local_devices()))


def all_dies() -> tuple[int, ...]:
    """Every die of the cluster's global device list (the default placement of a multi-host model);
    () outside a cluster."""
    if _initialized is None:
        return ()
    import jax
    return tuple(range(len(jax.devices())))


def _kv_client() -> Any:
    from jax._src import distributed as jd  # the key-value store jax's own multihost helpers use
    client = jd.global_state.client
    if client is None:
        raise RuntimeError("jax.distributed is not initialized")
    return client


# ---- frames ------------------------------------------------------------------------------------
def _socket_module() -> Any:
    """The socket module with its original socket class. The leader's channel lives in real OS threads
    of the gevent worker, where a patched (cooperative) socket must not block; constants are shared."""
    import socket
    try:
        from gevent import monkey
    except ImportError:
        return socket
    if not monkey.is_module_patched("socket"):
        return socket
    names = ("AF_INET", "AF_INET6", "SOCK_STREAM", "SOL_SOCKET", "SO_REUSEADDR", "IPPROTO_TCP", "TCP_NODELAY",
             "timeout")
    return types.SimpleNamespace(socket=monkey.get_original("socket", "socket"),
                                 **{n: getattr(socket, n) for n in names})


def send_frame(sock: Any, obj: Any) -> None:
    """One length-prefixed pickle frame."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv_exact(sock: Any, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise EOFError("connection closed")
        buf += chunk
    return bytes(buf)


def recv_frame(sock: Any) -> Any:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > MAX_FRAME:
        raise ValueError(f"control frame of {n} bytes is larger than {MAX_FRAME}")
    return pickle.loads(_recv_exact(sock, n))


# ---- device state markers ------------------------------------------------------------------------
@dataclass(frozen=True)
class StateRef:
    """Stands for a device state in a broadcast call: "the state numbered `sid`"; each process
    substitutes its own shard of it."""

    sid: int


def _holds_device_arrays(x: Any) -> bool:
    import jax
    if isinstance(x, (str, bytes, int, float, bool, type(None))):
        return False
    return any(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(x))


def _first_array(x: Any) -> Any:
    import jax
    return next(leaf for leaf in jax.tree.leaves(x) if isinstance(leaf, jax.Array))


def _arrays_in(x: Any) -> list[Any]:
    """Every jax.Array in `x`: pytree leaves, and the fields of plain dataclasses such as a StepHandle."""
    import jax
    out = []
    for leaf in jax.tree.leaves(x):
        if isinstance(leaf, jax.Array):
            out.append(leaf)
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            out.extend(_arrays_in([getattr(leaf, f.name) for f in dataclasses.fields(leaf)]))
    return out


def states_in(result: Any) -> list[Any]:
    """The device values a verb returned, in order: the result itself when it holds device arrays and
    is not a tuple, else the tuple's elements that do. A step's output (StepHandle) is numbered like a
    state; each follower holds its own, and it is dropped with the leader's."""
    if isinstance(result, tuple):
        return [r for r in result if _holds_device_arrays(r)]
    return [result] if _holds_device_arrays(result) else []


# ---- the leader ----------------------------------------------------------------------------------
class _Follower:
    def __init__(self, process_id: int, sock: Any):
        self.process_id = process_id
        self.sock = sock
        self.acks: dict[int, str | None] = {}  # load seq -> error text (None: ok); guarded by Leader._cond


class Leader:
    """Process 0's end of the control channel: sends every verb to the followers and watches them.

    Threads: one reader per follower (`pantheon-ctl-<i>`) receiving beats, acks and failures.
    Locks: `_dispatch` is held across sending a call, running it locally and waiting until its device
    work is done, so programs run one at a time in the cluster and in the order the followers receive
    them (two models' collectives must meet in the same order everywhere); `_cond` guards `failure`,
    the acks, `_models` and the id counters, and is notified by `fail()`.
    """

    def __init__(self, spec: ClusterSpec):
        self.spec = spec
        self._dispatch = osthread.Lock()  # invariant: frames go out in the order calls run; one call at a time
        self._cond = osthread.Condition()  # guards failure, every follower's acks, _models, _seq
        self.failure: str | None = None  # first failure seen; never cleared (a broken mesh stays broken)
        self.followers: list[_Follower] = []
        self._models: dict[int, str] = {}  # model id -> served name (for the failure message)
        self._seq = 0
        self._next_mid = 0
        self._stopped = False
        self._listener: Any = None

    # -- start-up --
    def start(self) -> "Leader":
        """Listen, publish the address, and wait (spec.timeout_s) until every follower has connected."""
        sk = _socket_module()
        family = sk.AF_INET6 if ":" in self.spec.host else sk.AF_INET
        lis = sk.socket(family, sk.SOCK_STREAM)
        lis.setsockopt(sk.SOL_SOCKET, sk.SO_REUSEADDR, 1)
        lis.bind((self.spec.host, 0))
        lis.listen(self.spec.num_processes)
        lis.settimeout(1.0)
        self._listener = lis
        port = lis.getsockname()[1]
        _kv_client().key_value_set(KV_KEY, f"{self.spec.host}:{port}")
        deadline = time.monotonic() + self.spec.timeout_s
        want = self.spec.num_processes - 1
        while len(self.followers) < want:
            if time.monotonic() > deadline:
                raise ClusterFailed(f"only {len(self.followers)} of {want} follower(s) connected to the control "
                                    f"channel within {self.spec.timeout_s:.0f} s")
            try:
                # _accept + the original class: socket.accept would wrap the fd in the module-level
                # (gevent-patched) class, whose blocking calls are not for real OS threads.
                fd, _addr = lis._accept()
            except sk.timeout:
                continue
            conn = sk.socket(lis.family, lis.type, lis.proto, fileno=fd)
            try:
                conn.settimeout(min(self.spec.timeout_s, 30.0))
                conn.setsockopt(sk.IPPROTO_TCP, sk.TCP_NODELAY, 1)
                hello = recv_frame(conn)
                if not (isinstance(hello, tuple) and hello[:1] == ("hello",)):
                    raise ValueError("not a pantheon follower")
            except Exception as exc:  # noqa: BLE001 - a stray connection: drop it, keep waiting
                log.warning("dropped a control connection that did not say hello: %s", exc)
                conn.close()
                continue
            conn.settimeout(DEAD_AFTER_S)
            self.followers.append(_Follower(int(hello[1]), conn))
        lis.close()
        for f in self.followers:
            osthread.start_thread(lambda f=f: self._read(f), name=f"pantheon-ctl-{f.process_id}")
        atexit.register(self.stop)
        log.info("control channel up: %d follower(s) on %s:%d", want, self.spec.host, port)
        return self

    # -- watching --
    def _read(self, f: _Follower) -> None:
        """Reader thread of one follower: beats keep it alive; EOF, silence or a `fail` frame end it."""
        sk = _socket_module()
        while True:
            try:
                msg = recv_frame(f.sock)
            except sk.timeout:
                self.fail(f"follower process {f.process_id} sent nothing for {DEAD_AFTER_S:.0f} s")
                return
            except (EOFError, OSError, ValueError, pickle.UnpicklingError) as exc:
                if not self._stopped:
                    self.fail(f"follower process {f.process_id} is gone ({type(exc).__name__}: {exc})")
                return
            kind = msg[0] if isinstance(msg, tuple) and msg else None
            if kind == "ack":
                with self._cond:
                    f.acks[int(msg[1])] = msg[2]
                    self._cond.notify_all()
            elif kind == "fail":
                self.fail(f"follower process {f.process_id} failed: {msg[1]}")
                return
            elif kind == "raised":
                log.warning("follower %d: %s raised %s", f.process_id, msg[1], msg[2])

    def fail(self, reason: str) -> None:
        """Mark the cluster failed (first reason wins); every later verb raises ClusterFailed."""
        with self._cond:
            if self.failure is not None or self._stopped:
                return
            names = sorted(set(self._models.values()))
            self.failure = (reason + (f"; model(s) {', '.join(repr(n) for n in names)} unavailable"
                                      if names else ""))
            self._cond.notify_all()
        log.critical("multi-host cluster failed: %s", self.failure)

    def check(self) -> None:
        if self.failure is not None:
            raise ClusterFailed(self.failure)

    def wait_ready(self, arrays: list[Any]) -> None:
        """Return once every array is ready; raise ClusterFailed as soon as the cluster fails meanwhile
        (a program whose collective lost its peer may never finish)."""
        pause = 0.0001
        while not all(a.is_ready() for a in arrays):
            with self._cond:  # fail() notifies: a failure ends the wait at once
                if self.failure is None:
                    self._cond.wait(pause)
            self.check()
            pause = min(pause * 2, 0.002)  # a short step is seen at once, a long one costs <= 2 ms

    # -- sending --
    def _send_locked(self, msg: Any) -> None:
        """Send `msg` to every follower; caller holds `_dispatch`. A send error fails the cluster."""
        self.check()
        for f in self.followers:
            try:
                send_frame(f.sock, msg)
            except OSError as exc:
                self.fail(f"follower process {f.process_id} is unreachable ({type(exc).__name__}: {exc})")
                self.check()

    def load(self, path: Path, opts: Any, dies: Sequence[int]) -> "LeaderModel":
        """Load a model over `dies` (global die ids) here, then on every follower; waits for their acks."""
        import jax

        from pantheon.runtime.engine import load_on
        self.check()
        # Reading and placing the weights runs no program (no collective): it needs no lock, so the
        # other models keep stepping meanwhile. (The followers load in their one main thread: their
        # steps of other models wait until they are done.)
        model = load_on(path, opts, list(dies) or list(all_dies()))
        if all(d.process_index == jax.process_index() for d in model.devices):
            return model  # only this process's dies: an ordinary local model, nothing to mirror
        # The followers must build exactly this model: pin what the leader resolved from its env.
        fopts = dataclasses.replace(opts, kv_dtype=model.kv_dtype.name)
        with self._dispatch:
            with self._cond:
                mid, self._next_mid = self._next_mid, self._next_mid + 1
                seq, self._seq = self._seq, self._seq + 1
                self._models[mid] = model.name
            try:
                self._send_locked(("load", seq, mid, str(path), fopts, tuple(model_dies(model))))
            except BaseException:
                model.free()
                raise
        deadline = time.monotonic() + max(self.spec.timeout_s, 600.0)
        with self._cond:
            done = self._cond.wait_for(lambda: self.failure is not None or all(seq in f.acks for f in self.followers),
                                       max(0.0, deadline - time.monotonic()))
            errors = [f"process {f.process_id}: {f.acks[seq]}" for f in self.followers if f.acks.get(seq)]
        if self.failure is not None or not done or errors:
            model.free()
            self.check()
            with self._dispatch:  # the followers that did load it free theirs
                self._send_locked(("call", mid, "free", (), {}, 0, []))
            from pantheon.errors import ModelLoadError
            raise ModelLoadError(path, "the followers could not load it: " + ("; ".join(errors) or "timed out"))
        return LeaderModel(self, mid, model)

    def stop(self) -> None:
        """Tell every follower to exit and close the channel (idempotent; runs at exit)."""
        with self._cond:
            if self._stopped:
                return
            self._stopped = True
        got = self._dispatch.acquire(True, 5.0)  # a step stuck in a collective must not block exit
        try:
            for f in self.followers:
                try:
                    f.sock.settimeout(1.0)
                    send_frame(f.sock, ("stop",))
                except OSError:
                    pass
                try:
                    f.sock.close()
                except OSError:
                    pass
        finally:
            if got:
                self._dispatch.release()


def model_dies(model: Any) -> list[int]:
    """The global die ids of a model's devices."""
    import jax
    index = {d: i for i, d in enumerate(jax.devices())}
    return [index[d] for d in model.devices]


class LeaderModel:
    """An `engine.Model` whose verbs are first broadcast to the followers (see the module docstring).

    Everything else reads through to the model. A method that is not a verb runs with this proxy as
    `self`, so the verbs it calls are broadcast; a static method or a data attribute is the model's.
    """

    _OWN = ("_leader", "_mid", "_model", "_sid_of", "_next_sid", "_dropped")

    def __init__(self, leader: Leader, mid: int, model: Any):
        object.__setattr__(self, "_leader", leader)
        object.__setattr__(self, "_mid", mid)
        object.__setattr__(self, "_model", model)
        # id(first array of a state) -> its sid; an entry goes when that array dies (weakref.finalize).
        # Written under leader._dispatch; the finalizers only append to _dropped (atomic under the GIL).
        object.__setattr__(self, "_sid_of", {})
        object.__setattr__(self, "_next_sid", 0)
        object.__setattr__(self, "_dropped", [])  # sids whose state died here: the followers drop theirs

    @property
    def inner(self) -> Any:
        return self._model

    def __getattr__(self, name: str) -> Any:
        if name in VERBS:
            if not callable(getattr(self._model, name, None)):
                raise AttributeError(name)
            return self._translated(lambda *args, **kwargs: self._call(name, args, kwargs))
        raw = inspect.getattr_static(type(self._model), name, None)
        if isinstance(raw, types.FunctionType):  # a method built on the verbs: run it with self = proxy
            return raw.__get__(self)
        value = getattr(self._model, name)
        if name in WAITS and callable(value):
            return self._translated(self._watched(value))
        return self._translated(value) if callable(value) else value

    def _watched(self, fn: Any) -> Any:
        """`fn` called only once the device arrays in its arguments are ready, or ClusterFailed as soon
        as the cluster fails while waiting (the arrays may then never become ready)."""
        leader = self._leader

        def call(*args: Any, **kwargs: Any) -> Any:
            leader.wait_ready(_arrays_in((args, kwargs)))
            return fn(*args, **kwargs)

        return call

    def _translated(self, fn: Any) -> Any:
        """`fn` whose device errors become ClusterFailed (503) when they come from a lost process.

        A step in flight when a follower dies fails inside gloo ("Connection reset by peer"), often
        before the reader thread has seen the EOF: wait briefly for its verdict before deciding."""
        leader = self._leader

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except ClusterFailed:
                raise
            except Exception as exc:
                import jax
                if isinstance(exc, jax.errors.JaxRuntimeError):
                    with leader._cond:
                        leader._cond.wait_for(lambda: leader.failure is not None, VERDICT_WAIT_S)
                    if leader.failure is not None:
                        raise ClusterFailed(leader.failure) from exc
                raise

        return call

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self._model, name, value)

    def _ref(self, x: Any) -> Any:
        if not _holds_device_arrays(x):
            return x
        sid = self._sid_of.get(id(_first_array(x)))
        if sid is None:
            raise TypeError("a device value this model did not hand out cannot be sent to the followers")
        return StateRef(sid)

    def _register(self, result: Any) -> int:
        """Number the states `result` holds (the followers number theirs the same way); returns the count."""
        found = states_in(result)
        for st in found:
            sid = self._next_sid
            object.__setattr__(self, "_next_sid", sid + 1)
            leaf = _first_array(st)
            self._sid_of[id(leaf)] = sid
            weakref.finalize(leaf, self._forget, id(leaf), sid)
        return len(found)

    def _forget(self, key: int, sid: int) -> None:
        self._sid_of.pop(key, None)
        self._dropped.append(sid)

    def _call(self, verb: str, args: tuple, kwargs: dict) -> Any:
        leader = self._leader
        if leader.failure is not None and verb in LOCAL_ON_FAILURE:
            return getattr(self._model, verb)(*args, **kwargs)
        # A host callback argument (step's grammar `mask` builder) cannot travel: run it here first
        # and send what it returned (across hosts the mask is built before the forward, not during).
        kwargs = {k: (v() if callable(v) else v) for k, v in kwargs.items()}
        with leader._dispatch:
            leader.check()
            sargs = tuple(self._ref(a) for a in args)
            skw = {k: self._ref(v) for k, v in kwargs.items()}
            dropped = [self._dropped.pop() for _ in range(len(self._dropped))]  # pop: a finalizer may append
            leader._send_locked(("call", self._mid, verb, sargs, skw, self._next_sid, dropped))
            result = getattr(self._model, verb)(*args, **kwargs)
            self._register(result)
            # One program at a time in the cluster: two models' steps overlapping on shared dies would
            # rely on XLA keeping their cross-process collectives apart, which nothing documents. So
            # the dispatch lock is held until this call's device work has finished. (It costs no
            # overlap: the scheduler reads each step's ids right after starting it.)
            leader.wait_ready(_arrays_in(result))
        return result


_leader: Leader | None = None


def start_leader(spec: ClusterSpec) -> Leader:
    """Process 0: join the cluster and bring the control channel up (blocks until every follower is in)."""
    global _leader
    initialize(spec)
    if _leader is None:
        _leader = Leader(spec).start()
    return _leader


def leader() -> Leader | None:
    """This process's control channel when it leads a cluster, else None."""
    return _leader


def failure() -> str | None:
    """Why the cluster cannot step (for `GET /`), or None when healthy or not clustered."""
    return _leader.failure if _leader is not None else None


def check_healthy() -> None:
    """Raise ClusterFailed (503) when this process leads a broken cluster."""
    if _leader is not None:
        _leader.check()


# ---- a follower ------------------------------------------------------------------------------------
class Follower:
    """A process other than 0: no HTTP, just the loop that mirrors the leader's verbs.

    Threads: the main thread executes calls in arrival order; `pantheon-recv` reads frames into the
    queue and ends the process on `stop` or EOF (the leader is gone: nothing left to serve);
    `pantheon-beat` sends a beat every BEAT_S. `_send_lock` serialises frames to the leader.
    """

    def __init__(self, spec: ClusterSpec):
        self.spec = spec
        self.models: dict[int, Any] = {}  # main thread only
        self.states: dict[tuple[int, int], Any] = {}  # (model id, sid) -> this process's state; main thread only
        self._next_sid: dict[int, int] = {}  # model id -> next sid; main thread only
        self._send_lock = osthread.Lock()  # invariant: one frame at a time on the socket
        self._queue = osthread.original("queue", "SimpleQueue")()
        self.sock: Any = None

    def connect(self) -> None:
        client = _kv_client()
        addr = client.blocking_key_value_get(KV_KEY, int(self.spec.timeout_s * 1000))
        host, port = addr.rsplit(":", 1)
        sk = _socket_module()
        self.sock = sk.create_connection((host, int(port)), timeout=self.spec.timeout_s)
        self.sock.setsockopt(sk.IPPROTO_TCP, sk.TCP_NODELAY, 1)
        self.sock.settimeout(None)
        self._send(("hello", self.spec.process_id))
        log.info("follower %d connected to the leader's control channel at %s", self.spec.process_id, addr)

    def _send(self, msg: Any) -> None:
        with self._send_lock:
            send_frame(self.sock, msg)

    def _recv_loop(self) -> None:
        while True:
            try:
                msg = recv_frame(self.sock)
            except (EOFError, OSError, ValueError, pickle.UnpicklingError) as exc:
                _exit(0, f"the leader closed the control channel ({type(exc).__name__}); exiting")
            if isinstance(msg, tuple) and msg[:1] == ("stop",):
                _exit(0, "the leader stopped; exiting")
            self._queue.put(msg)

    def _beat_loop(self) -> None:
        while True:
            try:
                self._send(("beat",))
            except OSError:
                _exit(0, "the leader is unreachable; exiting")
            time.sleep(BEAT_S)

    def run(self) -> int:
        """Mirror the leader until it stops (the process then exits 0 from the reader thread)."""
        self.connect()
        osthread.start_thread(self._recv_loop, name="pantheon-recv")
        osthread.start_thread(self._beat_loop, name="pantheon-beat")
        while True:
            msg = self._queue.get()
            kind = msg[0]
            if kind == "load":
                self._load(*msg[1:])
            elif kind == "call":
                self._call(*msg[1:])

    def _load(self, seq: int, mid: int, path: str, opts: Any, dies: tuple[int, ...]) -> None:
        from pantheon.runtime.engine import load_on
        try:
            self.models[mid] = load_on(path, opts, list(dies))
            self._next_sid[mid] = 0
            err = None
        except Exception as exc:  # noqa: BLE001 - reported to the leader, which fails the load
            log.exception("loading %s failed", path)
            err = f"{type(exc).__name__}: {exc}"
        self._send(("ack", seq, err))

    def _call(self, mid: int, verb: str, args: tuple, kwargs: dict, base_sid: int, dropped: list[int]) -> None:
        for sid in dropped:
            self.states.pop((mid, sid), None)
        model = self.models.get(mid)
        if model is None:
            return
        sub = lambda x: self.states[(mid, x.sid)] if isinstance(x, StateRef) else x  # noqa: E731
        try:
            result = getattr(model, verb)(*(sub(a) for a in args), **{k: sub(v) for k, v in kwargs.items()})
        except Exception as exc:  # noqa: BLE001
            import jax
            if isinstance(exc, jax.errors.JaxRuntimeError):  # a device or collective failure: out of step
                self._send(("fail", f"{verb}: {type(exc).__name__}: {exc}"))
                _exit(1, f"{verb} failed on the device: {exc}")
            # A host-side refusal (bad bucket, released model...): the leader raised the same.
            self._send(("raised", verb, f"{type(exc).__name__}: {exc}"))
            return
        for i, st in enumerate(states_in(result)):
            self.states[(mid, base_sid + i)] = st
        if getattr(model, "released", False):
            self.models.pop(mid, None)
            for key in [k for k in self.states if k[0] == mid]:
                del self.states[key]


def _exit(code: int, why: str) -> None:
    """End a follower now: os._exit skips jax's exit-time shutdown barrier, which would wait on the
    (gone) leader."""
    log.info("follower: %s", why)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_follower(spec: ClusterSpec) -> int:
    """`pantheon serve --process-id I` for I > 0: join, then mirror the leader until it stops."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                            format="%(asctime)s [%(process)d] [%(levelname)s] %(name)s: %(message)s")
    initialize(spec)
    try:
        return Follower(spec).run()
    except BaseException as exc:  # noqa: BLE001 - never fall into jax's exit barrier
        log.critical("follower failed: %s: %s", type(exc).__name__, exc)
        _exit(1, "exiting after a failure")
        return 1
