"""One model over several hosts: jax.distributed, a global mesh, and a verb broadcast that keeps every
process stepping in lock step.

Why this shape. Under jax.distributed every process is a full JAX controller: a jitted program over a
mesh that spans processes runs only if *every* process launches the same program with the same host
inputs in the same order (its collectives meet across processes). Only process 0 (the leader) serves
HTTP and runs the scheduler, so the others (followers) must be told what to run. Rather than teaching
them the scheduler, the leader wraps each `engine.Model` in a `LeaderModel`, which implements the
engine's declared interface (pantheon.runtime.verbs.Engine) member by member: every call of a
*verb* -- a method the interface marks @verb: it changes device state or runs a compiled program --
first sends (verb name, host arguments) to every follower, then runs locally. Each follower runs the same method
on its own `Model`, whose params and state are its shards of the same global arrays. Device-state
arguments are not sent: each process holds its own shard, so the leader sends a `StateRef` (a small
integer naming "the state you got back from call k") and the follower substitutes its own. Functions
built on verbs (`pantheon.runtime.reference`'s `prefill`, `logits`, `generate`) take the LeaderModel as
their model, so the verbs they call are broadcast one by one. Nothing here knows a verb's argument
list, nor keeps a list of verbs: the broadcast set is the interface's @verb methods, so a new
state-changing method of the engine is broadcast once it is declared, and a test fails until it is
(`verbs.uncovered`). A member the interface does not declare is not on the LeaderModel at all (no
read-through proxy): an undeclared method cannot run on the leader alone.

The control channel is a plain TCP connection from each follower to the leader. The leader listens on
an ephemeral port of the coordinator's host address and publishes "host:port" in jax.distributed's
key-value store; followers read it from there. Neither the port nor the key-value store can be kept
from strangers (jax's store is unauthenticated), so the channel authenticates before it reads
anything: every process holds the cluster's shared secret, and a connection first runs a fixed-format
mutual challenge (`follower_handshake` and `Leader._advance`: each side proves the secret with an
HMAC over both sides' fresh nonces; nothing is unpickled). Only then do frames flow, each carrying an HMAC of the session key (derived
from the secret and both nonces), its direction and its sequence number, checked before the payload
is unpickled: a frame from anyone else, or replayed, reordered or altered, is refused. The leader
runs every handshake concurrently under a deadline (one poll loop), so a silent or malicious
connection never keeps a real follower out; a follower checks the leader's proof before taking a
single instruction, so an address planted in the key-value store gets it nowhere.

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
import hashlib
import hmac
import logging
import os
import pickle
import struct
import sys
import time
import types
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pantheon import osthread
from pantheon.errors import PantheonError
from pantheon.runtime import verbs

log = logging.getLogger(__name__)

# The engine's verbs (calls that change device state or run a compiled program) and its reads: derived
# from the one declared interface, pantheon.runtime.verbs.Engine, never listed here. Every verb is
# broadcast to the followers before it runs on the leader.
VERBS: frozenset[str] = verbs.VERBS

BEAT_S = 0.5  # a follower's heartbeat period on the control channel
DEAD_AFTER_S = 5.0  # a follower silent this long is declared dead
# Calls that block until a step's device arrays are ready (reading the sampled ids: the interface's
# @wait methods). On the leader they first wait for those arrays while watching the cluster: a step whose
# collective lost its peer may never finish, and the driver thread must come back with ClusterFailed
# instead of hanging with it.
WAITS: frozenset[str] = verbs.WAITS
# Verbs that still run locally once the cluster has failed: freeing this process's memory needs no follower.
LOCAL_ON_FAILURE: tuple[str, ...] = ("free",)
VERDICT_WAIT_S = 2.0  # how long a failed step waits for the reader threads to name a lost process
KV_KEY = "pantheon/control"  # where the leader publishes its control address in jax's key-value store
_LEN = struct.Struct("!Q")
MAX_FRAME = 1 << 30
# The handshake (fixed layouts, never unpickled): follower -> leader HELLO = MAGIC | process id | nonce;
# leader -> follower CHALLENGE = MAGIC | nonce; follower -> leader its proof; leader -> follower its proof.
MAGIC = b"PNTHCTL1"  # the protocol and its version
_PID = struct.Struct("!I")
NONCE_LEN = 32
TAG_LEN = 32  # HMAC-SHA256
HELLO_LEN = len(MAGIC) + _PID.size + NONCE_LEN
CHALLENGE_LEN = len(MAGIC) + NONCE_LEN
HANDSHAKE_S = 10.0  # a connection must complete its handshake within this, else it is dropped
MAX_PENDING = 64  # handshakes in progress at once; past it the oldest is dropped (a flood cannot pin them all)


class ClusterFailed(PantheonError):
    """A process of the multi-host cluster is gone: the models spread over it cannot step."""

    status = 503
    code = "cluster_failed"


class ChannelRefused(Exception):
    """The other end of a control connection did not prove the cluster secret (or broke the protocol)."""


class FrameRejected(ValueError):
    """A control frame whose HMAC does not verify: forged, replayed, reordered or altered. Never unpickled."""


@dataclass(frozen=True)
class ClusterSpec:
    """Where this process sits in a multi-process cluster (`--coordinator/--num-processes/--process-id`)."""

    coordinator: str  # HOST:PORT of process 0's coordination service
    num_processes: int
    process_id: int
    timeout_s: float = 120.0  # how long start-up waits for every process (and the control channel)
    secret: bytes | None = field(default=None, repr=False)  # the cluster's shared secret (never printed)
    trusted_network: bool = False  # no secret needed: the operator says only the cluster can reach its ports

    @property
    def is_leader(self) -> bool:
        return self.process_id == 0

    @property
    def host(self) -> str:
        return self.coordinator.rsplit(":", 1)[0].strip("[]")

    def channel_key(self) -> bytes:
        """The key the control channel authenticates with. Without a secret only an explicitly trusted
        network may run a cluster: the key is then empty, and anyone reaching the port gets in."""
        if self.secret:
            return self.secret
        if not self.trusted_network:
            raise ValueError(NO_SECRET)
        return b""


NO_SECRET = ("a multi-host cluster needs a shared secret: give every process the same random value in "
             "PANTHEON_CLUSTER_SECRET_FILE (a file) or PANTHEON_CLUSTER_SECRET (for example `openssl rand -hex 32`), "
             "or set PANTHEON_CLUSTER_TRUSTED_NETWORK=1 if only the cluster's hosts can reach its ports (the "
             "control channel is then unauthenticated)")
UNAUTHENTICATED = ("PANTHEON_CLUSTER_TRUSTED_NETWORK without a cluster secret: the control channel is not "
                   "authenticated; any process that reaches %s can run code in every process of this cluster")


def spec_from_settings(settings: Any) -> ClusterSpec | None:
    """The cluster this process belongs to, or None for an ordinary single-process server."""
    coordinator = getattr(settings, "coordinator", None)
    n = int(getattr(settings, "num_processes", 1) or 1)
    if not coordinator or n <= 1:
        return None
    pid = int(getattr(settings, "process_id", 0) or 0)
    if not 0 <= pid < n:
        raise ValueError(f"process id {pid} is outside 0..{n - 1}")
    spec = ClusterSpec(coordinator, n, pid, float(getattr(settings, "cluster_timeout_s", 120.0)),
                       secret=getattr(settings, "cluster_secret", None),
                       trusted_network=bool(getattr(settings, "cluster_trusted_network", False)))
    spec.channel_key()  # refuse a cluster without a secret before anything starts
    return spec


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
        # The coordination service (process 0) binds the address it was given: by default jax binds
        # every interface ("[::]:PORT") even for --coordinator 127.0.0.1:PORT.
        jax.distributed.initialize(coordinator_address=spec.coordinator, num_processes=spec.num_processes,
                                   process_id=spec.process_id, initialization_timeout=timeout,
                                   heartbeat_timeout_seconds=10, shutdown_timeout_seconds=5,
                                   coordinator_bind_address=spec.coordinator)
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


def _recv_exact(sock: Any, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise EOFError("connection closed")
        buf += chunk
    return bytes(buf)


def _transcript(label: bytes, process_id: int, follower_nonce: bytes, leader_nonce: bytes) -> bytes:
    """What a handshake MAC covers: its purpose, the follower's claimed id and both fresh nonces, so a
    proof is good for this one connection and one purpose only (never replayed, never reflected)."""
    return MAGIC + b" " + label + b"\0" + _PID.pack(process_id) + follower_nonce + leader_nonce


def _proof(key: bytes, label: bytes, process_id: int, follower_nonce: bytes, leader_nonce: bytes) -> bytes:
    return hmac.new(key, _transcript(label, process_id, follower_nonce, leader_nonce), hashlib.sha256).digest()


class Channel:
    """One authenticated control connection: pickle frames, each under an HMAC of the session key.

    A frame is length (8 bytes) | tag (32) | pickle payload, the tag an HMAC over the sender's direction,
    the frame's sequence number and the payload. The receiver checks the tag (and so the order) before
    unpickling: only a holder of this session's key can make it run anything.
    """

    def __init__(self, sock: Any, key: bytes, role: str):
        if role not in ("leader", "follower"):
            raise ValueError(f"role {role!r}")
        self.sock = sock
        self._key = key
        self._out = role[:1].encode()  # the direction byte of what this end sends: b"l" or b"f"
        self._in = b"f" if role == "leader" else b"l"
        self._send_lock = osthread.Lock()  # invariant: one frame at a time on the socket; guards _sent
        self._sent = 0  # sequence number of the next frame sent
        self._received = 0  # ... and received; only the channel's one reading thread touches it

    def _tag(self, direction: bytes, seq: int, payload: bytes) -> bytes:
        mac = hmac.new(self._key, direction + _LEN.pack(seq), hashlib.sha256)
        mac.update(payload)
        return mac.digest()

    def send(self, obj: Any, lock_timeout: float = -1) -> None:
        """Send one frame. `lock_timeout` bounds the wait for a send in progress (OSError past it)."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        if not self._send_lock.acquire(True, lock_timeout):
            raise OSError("the control channel is busy sending")
        try:
            tag = self._tag(self._out, self._sent, data)
            self._sent += 1
            self.sock.sendall(_LEN.pack(len(data)) + tag + data)
        finally:
            self._send_lock.release()

    def recv(self) -> Any:
        """The next frame's object; FrameRejected (before unpickling) when its tag does not verify."""
        (n,) = _LEN.unpack(_recv_exact(self.sock, _LEN.size))
        if n > MAX_FRAME:
            raise FrameRejected(f"control frame of {n} bytes is larger than {MAX_FRAME}")
        tag = _recv_exact(self.sock, TAG_LEN)
        data = _recv_exact(self.sock, n)
        if not hmac.compare_digest(tag, self._tag(self._in, self._received, data)):
            raise FrameRejected(f"control frame {self._received} failed its authentication check "
                                "(forged, replayed or altered)")
        self._received += 1
        return pickle.loads(data)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def follower_handshake(sock: Any, key: bytes, process_id: int) -> Channel:
    """The follower's side of the handshake on a connected, blocking socket; returns the channel.

    Raises ChannelRefused when the other end is not a leader that holds the secret (nothing it sent
    has been deserialised), EOFError or OSError when the connection broke before this process's proof
    was sent (worth another try)."""
    follower_nonce = os.urandom(NONCE_LEN)
    sock.sendall(MAGIC + _PID.pack(process_id) + follower_nonce)
    challenge = _recv_exact(sock, CHALLENGE_LEN)
    if challenge[:len(MAGIC)] != MAGIC:
        raise ChannelRefused("the control address did not answer with the leader's greeting (not a pantheon leader)")
    leader_nonce = challenge[len(MAGIC):]
    sock.sendall(_proof(key, b"follower", process_id, follower_nonce, leader_nonce))
    try:
        theirs = _recv_exact(sock, TAG_LEN)
    except EOFError:
        raise ChannelRefused("the leader closed the connection on this process's proof: it holds a different "
                             f"cluster secret, or process {process_id} has joined already (see the leader's log)") from None
    if not hmac.compare_digest(theirs, _proof(key, b"leader", process_id, follower_nonce, leader_nonce)):
        raise ChannelRefused("the control address did not prove the cluster secret: refusing to take instructions "
                             "from it (a different PANTHEON_CLUSTER_SECRET, or not this cluster's leader)")
    return Channel(sock, _proof(key, b"session", process_id, follower_nonce, leader_nonce), "follower")


class _Handshake:
    """The leader's side of one connection's handshake, driven by `Leader._admit` as bytes arrive."""

    def __init__(self, sock: Any, peer: str, deadline: float):
        self.sock = sock
        self.peer = peer
        self.deadline = deadline
        self.buf = bytearray()
        self.stage = "hello"  # then "proof"
        self.process_id = -1
        self.follower_nonce = b""
        self.leader_nonce = b""


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
    def __init__(self, process_id: int, channel: Channel):
        self.process_id = process_id
        self.channel = channel
        self.acks: dict[int, str | None] = {}  # load seq -> error text (None: ok); guarded by Leader._cond


class Leader:
    """Process 0's end of the control channel: sends every verb to the followers and watches them.

    Threads: one reader per follower (`pantheon-ctl-<i>`) receiving beats, acks and failures. Admission
    (`admit`) runs in the calling thread: one poll loop over the port and every handshake in progress.
    Locks: `_dispatch` is held across sending a call and running it locally, so every process launches
    the programs in the order the followers receive them (collectives must meet in the same order
    everywhere). With one mirrored model it is released once the call is dispatched (its programs chain
    through its state: `chained`); with several it is held until the call's device work is done, so
    programs run one at a time in the cluster. `_cond` guards `failure`, the acks, `_models` and the
    id counters, and is notified by `fail()`.
    """

    def __init__(self, spec: ClusterSpec):
        self.spec = spec
        self._dispatch = osthread.Lock()  # invariant: frames go out in the order calls run; one call at a time
        self._cond = osthread.Condition()  # guards failure, every follower's acks, _models, _seq
        self.failure: str | None = None  # first failure seen; never cleared (a broken mesh stays broken)
        self.followers: list[_Follower] = []
        self._models: dict[int, str] = {}  # model id -> served name (for the failure message)
        self._in_flight: list[Any] = []  # weak refs: the last call's arrays when it let go at dispatch (_dispatch)
        self._seq = 0
        self._next_mid = 0
        self._stopped = False
        self._listener: Any = None  # the control port while followers are being admitted (start-up thread only)
        self.handshake_s = HANDSHAKE_S  # how long one connection may take to prove the secret

    # -- start-up --
    def start(self) -> "Leader":
        """Listen, publish the address, and wait (spec.timeout_s) until every follower has joined."""
        key = self.spec.channel_key()
        if not key:
            log.warning(UNAUTHENTICATED, self.spec.host)
        port = self.listen()
        _kv_client().key_value_set(KV_KEY, f"{self.spec.host}:{port}")
        self.admit()
        for f in self.followers:
            osthread.start_thread(lambda f=f: self._read(f), name=f"pantheon-ctl-{f.process_id}")
        atexit.register(self.stop)
        log.info("control channel up: %d follower(s) on %s:%d", len(self.followers), self.spec.host, port)
        return self

    def listen(self) -> int:
        """Bind the control port on the coordinator's host address (that address only); returns the port."""
        sk = _socket_module()
        family = sk.AF_INET6 if ":" in self.spec.host else sk.AF_INET
        lis = sk.socket(family, sk.SOCK_STREAM)
        lis.setsockopt(sk.SOL_SOCKET, sk.SO_REUSEADDR, 1)
        lis.bind((self.spec.host, 0))
        lis.listen(max(16, self.spec.num_processes))
        lis.setblocking(False)
        self._listener = lis
        port = lis.getsockname()[1]
        log.info("control channel listening on %s:%d; waiting up to %.0f s for %d follower(s)", self.spec.host,
                 port, self.spec.timeout_s, self.spec.num_processes - 1)
        return port

    def admit(self) -> None:
        """Accept connections until every follower has proved the secret, then close the port.

        Every connection's handshake runs at once in this one poll loop, each under `handshake_s`: a
        silent, slow or hostile connection is dropped at its deadline (or when MAX_PENDING newer ones
        arrive) and never delays another. A refusal is logged with the peer's address; nothing a peer
        sends before it has proved the secret is deserialised."""
        key = self.spec.channel_key()
        sk = _socket_module()
        pollin = osthread.original("select", "POLLIN")
        poller = osthread.original("select", "poll")()
        lis = self._listener
        poller.register(lis.fileno(), pollin)
        pending: dict[int, _Handshake] = {}  # fd -> handshake in progress (in arrival order)
        want = self.spec.num_processes - 1
        deadline = time.monotonic() + self.spec.timeout_s

        def drop(fd: int, why: str) -> None:
            hs = pending.pop(fd)
            poller.unregister(fd)
            # logged before the close: by the time the peer sees the connection end, the refusal is on record
            log.warning("control channel: refused the connection from %s: %s", hs.peer, why)
            hs.sock.close()

        try:
            while len(self.followers) < want:
                now = time.monotonic()
                if now > deadline:
                    raise ClusterFailed(f"only {len(self.followers)} of {want} follower(s) joined the control "
                                        f"channel within {self.spec.timeout_s:.0f} s")
                wake = min([deadline] + [hs.deadline for hs in pending.values()])
                for fd, _events in poller.poll(max(0.0, min(wake - now, 1.0)) * 1000):
                    if fd == lis.fileno():
                        while True:
                            try:
                                # _accept + the original class: socket.accept would wrap the fd in the
                                # module-level (gevent-patched) class, not for real OS threads.
                                cfd, addr = lis._accept()
                            except BlockingIOError:
                                break
                            except OSError as exc:  # out of descriptors: make room, keep serving
                                log.warning("control channel: accept failed: %s", exc)
                                if pending:
                                    drop(next(iter(pending)), "dropped to make room (accept failed)")
                                break
                            conn = sk.socket(lis.family, lis.type, lis.proto, fileno=cfd)
                            conn.setblocking(False)
                            peer = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)
                            pending[cfd] = _Handshake(conn, peer, time.monotonic() + self.handshake_s)
                            poller.register(cfd, pollin)
                            if len(pending) > MAX_PENDING:
                                drop(next(iter(pending)), f"dropped: more than {MAX_PENDING} handshakes at once")
                        continue
                    hs = pending.get(fd)
                    if hs is None:
                        continue
                    try:
                        joined = self._advance(hs, key)
                    except ChannelRefused as exc:
                        drop(fd, str(exc))
                        continue
                    except OSError as exc:
                        drop(fd, f"{type(exc).__name__}: {exc}")
                        continue
                    if joined is not None:
                        pending.pop(fd)
                        poller.unregister(fd)
                        self.followers.append(joined)
                        log.info("control channel: process %d joined from %s", joined.process_id, hs.peer)
                now = time.monotonic()
                for fd in [fd for fd, hs in pending.items() if now > hs.deadline]:
                    drop(fd, f"no complete handshake within {self.handshake_s:g} s")
        except BaseException:
            for f in self.followers:
                f.channel.close()
            self.followers.clear()
            raise
        finally:
            for fd in list(pending):
                drop(fd, "the cluster is complete" if len(self.followers) == want else "start-up failed")
            lis.close()
            self._listener = None

    def _advance(self, hs: _Handshake, key: bytes) -> _Follower | None:
        """Read what `hs`'s peer has sent (never more than its current message) and answer it. Returns
        the follower once it has proved the secret; raises ChannelRefused on any deviation."""
        need = HELLO_LEN if hs.stage == "hello" else TAG_LEN
        try:
            chunk = hs.sock.recv(need - len(hs.buf))
        except BlockingIOError:
            return None
        if not chunk:
            raise ChannelRefused("closed the connection before completing the handshake")
        hs.buf += chunk
        if len(hs.buf) < need:
            return None
        msg, hs.buf = bytes(hs.buf), bytearray()
        if hs.stage == "hello":
            if msg[:len(MAGIC)] != MAGIC:
                raise ChannelRefused("did not open with the control channel's greeting (not a pantheon follower)")
            (pid,) = _PID.unpack_from(msg, len(MAGIC))
            if not 1 <= pid < self.spec.num_processes:
                raise ChannelRefused(f"claimed process id {pid}, outside 1..{self.spec.num_processes - 1}")
            hs.process_id, hs.follower_nonce, hs.leader_nonce = pid, msg[-NONCE_LEN:], os.urandom(NONCE_LEN)
            self._reply(hs, MAGIC + hs.leader_nonce)
            hs.stage = "proof"
            return None
        args = (hs.process_id, hs.follower_nonce, hs.leader_nonce)
        if not hmac.compare_digest(msg, _proof(key, b"follower", *args)):
            raise ChannelRefused(f"claimed process id {hs.process_id} but did not prove the cluster secret "
                                 "(a different PANTHEON_CLUSTER_SECRET, or not a member)")
        if any(f.process_id == hs.process_id for f in self.followers):
            raise ChannelRefused(f"process {hs.process_id} has joined already")
        self._reply(hs, _proof(key, b"leader", *args))
        sk = _socket_module()
        hs.sock.setblocking(True)
        hs.sock.settimeout(DEAD_AFTER_S)
        hs.sock.setsockopt(sk.IPPROTO_TCP, sk.TCP_NODELAY, 1)
        return _Follower(hs.process_id, Channel(hs.sock, _proof(key, b"session", *args), "leader"))

    @staticmethod
    def _reply(hs: _Handshake, data: bytes) -> None:
        """A handshake answer on the non-blocking socket: a few dozen bytes always fit an empty send buffer,
        so a short write means the peer is not reading (refused)."""
        if hs.sock.send(data) != len(data):
            raise ChannelRefused("did not take the handshake's answer")

    # -- watching --
    def _read(self, f: _Follower) -> None:
        """Reader thread of one follower: beats keep it alive; EOF, silence or a `fail` frame end it."""
        sk = _socket_module()
        while True:
            try:
                msg = f.channel.recv()
            except sk.timeout:
                self.fail(f"follower process {f.process_id} sent nothing for {DEAD_AFTER_S:.0f} s")
                return
            except FrameRejected as exc:
                self.fail(f"follower process {f.process_id}'s channel is compromised: {exc}")
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

    def note_in_flight(self, arrays: list[Any]) -> None:
        """Remember (weakly) the arrays of a call that released the lock at dispatch; caller holds `_dispatch`."""
        self._in_flight = [weakref.ref(a) for a in arrays]

    def take_in_flight(self) -> list[Any]:
        """The arrays of the last call released at dispatch that are still alive (a donated or dropped
        one was consumed by a later program, which is then what is waited for); caller holds `_dispatch`."""
        alive = [a for a in (r() for r in self._in_flight) if a is not None and not a.is_deleted()]
        self._in_flight = []
        return alive

    def forget_model(self, mid: int) -> None:
        """A mirrored model was freed: it no longer counts (for `chained`) nor is named in a failure."""
        with self._cond:
            self._models.pop(mid, None)

    def chained(self) -> bool:
        """Whether every program the cluster runs takes the output of the one before it: at most one
        mirrored model is loaded (a model's verbs chain through its state). Then a call may release the
        dispatch lock once dispatched; otherwise it holds it until its device work is done."""
        with self._cond:
            return len(self._models) <= 1

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
                f.channel.send(msg)
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
                self.forget_model(mid)
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
                    f.channel.sock.settimeout(1.0)
                    f.channel.send(("stop",), lock_timeout=1.0)
                except OSError:
                    pass
                f.channel.close()
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

    Its members are the interface's (pantheon.runtime.verbs.Engine), made below from it: each @verb
    broadcasts, then runs on the model; each @wait waits for its arrays while watching the cluster,
    then reads; each @host method and data attribute reads through to the model. Nothing else is
    reachable: `inner` is the model itself, for what only this process should touch.
    """

    def __init__(self, leader: Leader, mid: int, model: Any):
        self._leader = leader
        self._mid = mid
        self._model = model
        # id(first array of a state) -> its sid; an entry goes when that array dies (weakref.finalize).
        # Written under leader._dispatch; the finalizers only append to _dropped (atomic under the GIL).
        self._sid_of: dict[int, int] = {}
        self._next_sid = 0
        self._dropped: list[int] = []  # sids whose state died here: the followers drop theirs

    @property
    def inner(self) -> Any:
        return self._model

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
            self._next_sid = sid + 1
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
        with leader._dispatch:
            leader.check()
            chained = leader.chained()
            if not chained:  # programs dispatched while the calls were chained must be done first
                leader.wait_ready(leader.take_in_flight())
            sargs = tuple(self._ref(a) for a in args)
            skw = {k: self._ref(v) for k, v in kwargs.items()}
            dropped = [self._dropped.pop() for _ in range(len(self._dropped))]  # pop: a finalizer may append
            leader._send_locked(("call", self._mid, verb, sargs, skw, self._next_sid, dropped))
            result = getattr(self._model, verb)(*args, **kwargs)
            self._register(result)
            if chained:
                # One mirrored model: each of its programs takes the state (or the forward) the one
                # before it returned, so every process runs them in the order they were launched -- the
                # order this lock gave the frames -- and the lock goes at dispatch: the driver plans
                # step N+1 while step N runs, as on one host. Its reads wait for the arrays, watched.
                leader.note_in_flight(_arrays_in(result))
            else:
                # Several mirrored models: their programs share no data, so a process could run two of
                # them at once, and their cross-process collectives would then rely on XLA keeping them
                # apart (XLA:CPU's client launches its collective programs one at a time, in the order
                # they were enqueued, but nothing documents it). So the lock is held until this call's
                # device work has finished: one program at a time in the cluster.
                leader.wait_ready(_arrays_in(result))
            if verb == "free":
                leader.forget_model(self._mid)
        return result


def _broadcast(name: str) -> Any:
    def method(self: LeaderModel, *args: Any, **kwargs: Any) -> Any:
        return self._translated(lambda *a, **k: self._call(name, a, k))(*args, **kwargs)
    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"The verb `{name}`: sent to every follower, then run here (pantheon.runtime.verbs)."
    return method


def _waiting(name: str) -> Any:
    def method(self: LeaderModel, *args: Any, **kwargs: Any) -> Any:
        return self._translated(self._watched(getattr(self._model, name)))(*args, **kwargs)
    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"The read `{name}`, once its arrays are ready (ClusterFailed if the cluster fails first)."
    return method


def _local(name: str) -> Any:
    def method(self: LeaderModel, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._model, name)(*args, **kwargs)
    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"The host method `{name}` of the model (no device state: not broadcast)."
    return method


def _attribute(name: str) -> property:
    return property(lambda self: getattr(self._model, name), doc=f"The model's `{name}` (read-only).")


for _name in verbs.VERBS:
    setattr(LeaderModel, _name, _broadcast(_name))
for _name in verbs.WAITS:
    setattr(LeaderModel, _name, _waiting(_name))
for _name in verbs.HOSTS:
    setattr(LeaderModel, _name, _local(_name))
for _name in verbs.ATTRIBUTES:
    setattr(LeaderModel, _name, _attribute(_name))
del _name


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
    `pantheon-beat` sends a beat every BEAT_S. The channel's send lock serialises frames to the leader.
    """

    def __init__(self, spec: ClusterSpec):
        self.spec = spec
        self.models: dict[int, Any] = {}  # main thread only
        self.states: dict[tuple[int, int], Any] = {}  # (model id, sid) -> this process's state; main thread only
        self._next_sid: dict[int, int] = {}  # model id -> next sid; main thread only
        self._queue = osthread.original("queue", "SimpleQueue")()
        self.channel: Channel | None = None

    def connect(self) -> None:
        """Find the leader's address in the key-value store and join its channel (see `join`)."""
        addr = _kv_client().blocking_key_value_get(KV_KEY, int(self.spec.timeout_s * 1000))
        host, port = addr.rsplit(":", 1)
        self.join(host, int(port))
        log.info("follower %d joined the leader's control channel at %s", self.spec.process_id, addr)

    def join(self, host: str, port: int) -> None:
        """Connect to the control port and run the handshake, retrying a broken connection until
        spec.timeout_s; a leader that does not prove the secret ends it at once (ChannelRefused)."""
        key = self.spec.channel_key()
        if not key:
            log.warning(UNAUTHENTICATED, host)
        sk = _socket_module()
        deadline = time.monotonic() + self.spec.timeout_s
        pause = 0.1
        while True:
            sock = None
            try:
                sock = sk.create_connection((host, port), timeout=min(HANDSHAKE_S, self.spec.timeout_s))
                sock.setsockopt(sk.IPPROTO_TCP, sk.TCP_NODELAY, 1)
                channel = follower_handshake(sock, key, self.spec.process_id)
            except (EOFError, OSError) as exc:
                if sock is not None:
                    sock.close()
                if time.monotonic() + pause > deadline:
                    raise ClusterFailed(f"could not join the control channel at {host}:{port}: "
                                        f"{type(exc).__name__}: {exc}") from exc
                log.warning("joining the control channel at %s:%d failed (%s: %s); retrying", host, port,
                            type(exc).__name__, exc)
                osthread.sleep(pause)
                pause = min(pause * 2, 2.0)
                continue
            except BaseException:
                if sock is not None:
                    sock.close()
                raise
            sock.settimeout(None)
            self.channel = channel
            return

    def _send(self, msg: Any) -> None:
        assert self.channel is not None
        self.channel.send(msg)

    def _recv_loop(self) -> None:
        assert self.channel is not None
        while True:
            try:
                msg = self.channel.recv()
            except FrameRejected as exc:
                _exit(1, f"the control channel is compromised ({exc}); exiting")
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
