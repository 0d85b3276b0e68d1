"""Compiled step programs kept on disk, so a restart of the same model on the same machine skips tracing,
lowering and compiling.

Why not only JAX's persistent compilation cache: it is keyed by the lowered module, so a restart still
traces and lowers every bucket (seconds per program at depth) before it can look the module up. An
executable serialised here (`jax.experimental.serialize_executable`) is loaded straight into the
runtime: no Python function runs, nothing is traced, the compile guard counts nothing.

Soundness rests on the key. A program is a function of everything that shapes it, and the key holds
all of it (`Model._identity`): the model file's identity (size, mtime and a hash of its header and tensor
table), the architecture and its config (constants such as rope theta are baked into the program),
the abstract signature of the params, cache and slot table (tree structure with every static field,
shapes, dtypes, shardings), the engine's geometry and buckets, the kernels and the native library they
call (FFI targets are called by name), the device kind, the CPU's feature flags, jax / jaxlib, and a
hash of the Pantheon source that is traced (`TRACED`). Any difference is another directory; a
program that fails its checksum or fails to load is deleted and compiled again. Nothing here ever
guesses: a miss compiles.

Layout: `$PANTHEON_HOME/executables/<key>/key.json` (the identity, checked on open) and one file per
program, written to a temporary name and renamed into place (a reader never sees half a file; two
processes writing the same program write the same bytes). The store is bounded: past `max_bytes` the
least recently used key directories go first (the open one is kept).

The files are pickles (the serialised executable and its argument trees), and unpickling runs code,
so a file is authenticated before a byte of it is unpickled: each carries an HMAC-SHA256 under a
per-install key (`KEY_FILE`, 32 random bytes beside the key directories, created 0600 once and never
rewritten), over the key directory's name, the program's name and the body. A SHA-256 digest alone is
a checksum anyone who can write the directory can recompute; the MAC needs the key. A file without a
valid MAC (the old checksummed format, a damaged file, a file planted by someone else) is dropped with
a log line and compiled again, never unpickled. A key file readable or writable by another user is
not trusted: the store is not used at all. The rest of $PANTHEON_HOME (the compilation cache, the
native library) is still trusted as it is, so it must not be writable by others either.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import pickle
import platform
import secrets
import shutil
import stat
import tempfile
import threading
import time
from functools import lru_cache
from pathlib import Path
from typing import Any

import jax

from pantheon import osthread

log = logging.getLogger(__name__)

STORE_VERSION = 1  # bump when the file layout or the key's meaning changes
# version 2 of the file: MAGIC, HMAC-SHA256 (32 bytes), pickle. Version 1 (b"PNTHXLA1": a plain SHA-256
# where the MAC is) is never read: a program from before the change compiles again.
MAGIC = b"PNTHXLA2"
KEY_FILE = ".mac-key"  # in the store's root, beside the key directories (prune() only removes directories)
_KEY_BYTES = 32
# _LOAD_LOCK: held around each `deserialize_and_load`, by whichever thread loads (the compile-<model>
# workers, a warm-up). Invariant: at most one executable is being deserialised in the process at a
# time. Two at once were never shown safe in XLA:CPU (jax 0.10); the crash first blamed on them was the
# test process running out of memory mappings. A load takes milliseconds, so the lock costs nothing.
_LOAD_LOCK = osthread.Lock()  # an OS lock: under gevent, threading.Lock is a greenlet lock
_DIGEST = 32
HEAD_BYTES = 16 << 20  # a GGUF's header, metadata and tensor table sit in its first bytes; hash at most this


def _prepare_runtime_libraries() -> None:
    """Initialise what a program's custom calls need before a program is loaded without lowering.

    jaxlib binds its CPU LAPACK kernels (`lapack_strsm_ffi`, the triangular solve of qwen35's chunked
    delta rule, and the rest) to scipy's LAPACK only when a linalg op is *lowered*
    (`jaxlib.lapack.prepare_lapack_call`). A program read back from the store is never lowered, so in a
    fresh process its first call jumped through an unset function pointer: the segfault that made
    qwen35 compile at every start. Initialising is idempotent and cheap."""
    from jax._src.lax import linalg
    linalg.initialize_lapack()


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class UntrustedKey(Exception):
    """The store's MAC key cannot be trusted (another user may read or change it) or read."""


def install_key(root: Path) -> bytes:
    """The store's per-install MAC key, `root/KEY_FILE`, created on first use.

    Created whole or not at all: the bytes go to a private (0600) temporary file which is then
    hard-linked to the final name, so a reader never sees a short key and two processes creating it
    at once agree (the link of the second fails, and it reads the first's). A key another user could
    read (and forge with) or replace is refused, and so is a short one."""
    root = Path(root)
    path = root / KEY_FILE
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not path.exists():
        fd, tmp = tempfile.mkstemp(prefix=".tmp-key-", dir=root)  # mkstemp creates it 0600
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(_KEY_BYTES))
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)
            except FileExistsError:  # another process made it first: use theirs
                pass
        finally:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise UntrustedKey(f"cannot open {path}: {exc}") from exc
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise UntrustedKey(f"{path} is not a regular file")
        if st.st_uid != os.getuid():
            raise UntrustedKey(f"{path} belongs to another user (uid {st.st_uid})")
        if st.st_mode & 0o077:
            raise UntrustedKey(f"{path} is open to other users (mode {stat.S_IMODE(st.st_mode):o}; want 600)")
        key = f.read(_KEY_BYTES + 1)
    if len(key) != _KEY_BYTES:
        raise UntrustedKey(f"{path} holds {len(key)} bytes, not {_KEY_BYTES}")
    return key


def _mac(key: bytes, key_dir: str, name: str, body: bytes) -> bytes:
    """The MAC of one program file: bound to its key directory and program name, so a valid file
    copied under another name or key is refused as well."""
    h = hmac.new(key, digestmod=hashlib.sha256)
    for part in (key_dir.encode(), name.encode()):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    h.update(body)
    return h.digest()


def file_identity(path: Path) -> dict[str, Any]:
    """A cheap, sound identity of a checkpoint: its size and mtime, and a hash of its head (the
    header, metadata and tensor table of a GGUF; the whole file when it is small). A directory (an HF
    checkpoint) is identified by each of its files' size and mtime. Editing a file in place changes
    its mtime, so at worst a touched file compiles again; it never reuses another file's programs."""
    p = Path(path).resolve()
    if p.is_dir():
        entries = sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in p.iterdir() if f.is_file())
        return {"path": str(p), "dir": _sha(json.dumps(entries).encode())}
    st = p.stat()
    with open(p, "rb") as f:
        head = f.read(HEAD_BYTES)
    return {"path": str(p), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "head": _sha(head)}


# The parts of the package whose code is traced into a step program (the engine, the sampler and slot
# table, the architectures, the weight formats and kernels, the request-side constants). The server,
# scheduler, text and file-reading rooms are not traced (what the file reader builds is in the key as
# the params' signature and the config), so editing them keeps the stored programs.
TRACED = ("runtime", "jax_models", "ops", "types.py")


@lru_cache(maxsize=1)
def source_identity() -> str:
    """A hash of the traced Python source (TRACED): an upgrade, or a local edit, of that code never
    runs a program compiled from other code."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    files = [f for t in TRACED for f in ((root / t).rglob("*.py") if (root / t).is_dir() else [root / t])]
    for f in sorted(files):
        h.update(str(f.relative_to(root)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


@lru_cache(maxsize=1)
def _cpu_flags() -> str:
    """The host CPU's feature flags: XLA:CPU compiles for the features it finds, so an executable built on
    one CPU may not run on another that shares the same $PANTHEON_HOME."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return _sha(" ".join(sorted(line.split(":", 1)[1].split())).encode())
    except OSError:
        pass
    return platform.processor() or "unknown"


def runtime_identity(devices: list[Any]) -> dict[str, Any]:
    """What of this process and machine an executable depends on."""
    import jaxlib
    d0 = devices[0]
    return {"store": STORE_VERSION, "jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "platform": d0.platform, "device_kind": d0.device_kind, "devices": [int(d.id) for d in devices],
            "platform_version": str(getattr(d0.client, "platform_version", "")),
            "machine": platform.machine(), "cpu": _cpu_flags(), "source": source_identity()}


def signature(tree: Any) -> str:
    """The abstract signature of a pytree of arrays: its structure (with every static field) and each
    leaf's shape, dtype and sharding. Two trees with one signature feed one program."""
    leaves, treedef = jax.tree.flatten(tree)
    parts = [str(treedef)]
    for x in leaves:
        sharding = getattr(x, "sharding", None)
        parts.append(f"{getattr(x, 'shape', ())}|{getattr(x, 'dtype', type(x).__name__)}|{sharding}")
    return _sha("\n".join(parts).encode())


def key_of(identity: dict[str, Any]) -> str:
    return _sha(json.dumps(identity, sort_keys=True, default=str).encode())[:40]


def _program_file(name: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    return f"{safe}.xla"


class ExecStore:
    """The executables of one key (one model file, engine config and machine) under `root/<key>/`."""

    def __init__(self, root: Path, identity: dict[str, Any], max_bytes: int):
        self.root = Path(root)
        self.identity = identity
        self.key = key_of(identity)
        self.dir = self.root / self.key
        self.max_bytes = max(0, int(max_bytes))
        self.loaded = 0  # programs loaded / saved by this process (for logs and tests)
        self.saved = 0
        self.skipped = 0  # files refused before unpickling (no or a wrong MAC)
        self._opened = False
        self._mac_key: bytes | None = None

    def _open(self) -> bool:
        """Read the install's MAC key and create the key directory (with its key.json) or check the
        one there; False if unusable (logged)."""
        if self._opened:
            return True
        try:
            self._mac_key = install_key(self.root)
        except (UntrustedKey, OSError) as exc:
            log.warning("executable store %s not used: %s", self.root, exc)
            return False
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            kj = self.dir / "key.json"
            text = json.dumps(self.identity, sort_keys=True, indent=1, default=str)
            if kj.exists():
                if kj.read_text() != text:  # a hash collision or a damaged directory: start it over
                    log.warning("executable store %s: key.json differs from this model's key; clearing it", self.dir)
                    shutil.rmtree(self.dir, ignore_errors=True)
                    self.dir.mkdir(parents=True, exist_ok=True)
                    _atomic_write(kj, text.encode())
            else:
                _atomic_write(kj, text.encode())
            os.utime(self.dir)  # the LRU order of prune()
            self._opened = True
        except OSError as exc:
            log.warning("executable store %s unusable: %s", self.dir, exc)
            return False
        return True

    def has(self, name: str) -> bool:
        """Whether program `name` has a file here (it may still fail to load)."""
        return self._open() and (self.dir / _program_file(name)).exists()

    def load(self, name: str, devices: list[Any]) -> Any | None:
        """The program `name` loaded onto `devices`, or None (absent, damaged, or refused by the runtime:
        a damaged file is deleted so it is compiled and written again)."""
        if not self._open():
            return None
        f = self.dir / _program_file(name)
        try:
            blob = f.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("executable store: cannot read %s: %s", f, exc)
            return None
        # Authenticate before anything is unpickled: unpickling a file is running it.
        mac, body = blob[len(MAGIC):len(MAGIC) + _DIGEST], blob[len(MAGIC) + _DIGEST:]
        if blob[:len(MAGIC)] != MAGIC or len(mac) != _DIGEST:
            why = "no MAC (an older or foreign format)"
        elif not hmac.compare_digest(mac, _mac(self._mac_key, self.key, name, body)):
            why = "MAC mismatch (damaged, or not written by this install)"
        else:
            why = None
        if why is not None:
            log.warning("executable store: skipping %s, not unpickled: %s", f, why)
            self.skipped += 1
            self.discard(name)
            return None
        try:
            payload, in_tree, out_tree = pickle.loads(body)
            from jax.experimental.serialize_executable import deserialize_and_load
            _prepare_runtime_libraries()
            with _LOAD_LOCK:
                compiled = deserialize_and_load(payload, in_tree, out_tree, execution_devices=devices)
        except Exception as exc:  # any doubt about the file: compile instead, and rewrite it
            log.warning("executable store: dropping %s (%s: %s)", f, type(exc).__name__, exc)
            self.discard(name)
            return None
        self.loaded += 1
        return compiled

    def save(self, name: str, compiled: Any) -> bool:
        """Serialise `compiled` as program `name`; False (logged) when the backend cannot serialise it
        or the disk refuses. Never raises: a program not stored is compiled again next start."""
        if not self._open():
            return False
        try:
            from jax.experimental.serialize_executable import serialize
            payload, in_tree, out_tree = serialize(compiled)
            body = pickle.dumps((payload, in_tree, out_tree), protocol=pickle.HIGHEST_PROTOCOL)
            _atomic_write(self.dir / _program_file(name), MAGIC + _mac(self._mac_key, self.key, name, body) + body)
        except Exception as exc:
            log.warning("executable store: cannot save %s: %s: %s", name, type(exc).__name__, exc)
            return False
        self.saved += 1
        return True

    def discard(self, name: str) -> None:
        try:
            (self.dir / _program_file(name)).unlink()
        except OSError:
            pass

    def prune(self) -> None:
        """Keep the store under max_bytes: remove whole key directories, least recently used first,
        never this store's own."""
        prune(self.root, self.max_bytes, keep=self.key)


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _dir_bytes(d: Path) -> int:
    total = 0
    for f in d.iterdir():
        try:
            total += f.stat().st_size
        except OSError:
            pass
    return total


def prune(root: Path, max_bytes: int, keep: str | None = None) -> list[Path]:
    """Remove key directories under `root`, least recently used first, until the rest fits `max_bytes`
    (`keep` is never removed). Returns what was removed. Stale temporary files (a writer that died
    mid-write) older than an hour go too."""
    root = Path(root)
    if not root.is_dir():
        return []
    dirs = []
    now = time.time()
    for d in root.iterdir():
        if not d.is_dir():
            continue
        for tmp in d.glob(".tmp-*"):
            try:
                if now - tmp.stat().st_mtime > 3600:
                    tmp.unlink()
            except OSError:
                pass
        try:
            dirs.append((d.stat().st_mtime, d, _dir_bytes(d)))
        except OSError:
            continue
    total = sum(b for _, _, b in dirs)
    removed = []
    for _, d, b in sorted(dirs, key=lambda t: t[0]):
        if total <= max_bytes:
            break
        if d.name == keep:
            continue
        shutil.rmtree(d, ignore_errors=True)
        total -= b
        removed.append(d)
    return removed
