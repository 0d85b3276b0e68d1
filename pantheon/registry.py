"""The resident models of one server: a table of up to 16 entries, each a loaded model and its backend.

Why a table with states rather than a dict of models: loading takes seconds to minutes, and the server
must keep answering (other models keep generating, /v1/models keeps listing) while it runs. A load
therefore goes through four phases and holds the table lock only for the bookkeeping moments:

1. reserve (under `_lock`): take a free slot with the entry in LOADING state, so the name is claimed
   (a second load of the same name in progress is refused with 409) but nothing can route to it;
2. place (under `_lock`): pick the dies (given, or the one with most free budget) and admit the
   estimated weight bytes against each die's budget (507 when they do not fit); the estimate is
   recorded on the entry, so two concurrent loads cannot both take the last free bytes;
3. upload (under `_upload_lock`, not `_lock`): read and place the weights; one upload at a time, so
   two multi-GB host transients never stack;
4. publish (backend built outside any lock, then `_lock`): the entry becomes READY and routable.

Requests `acquire` an entry (refs += 1) and must `release` it exactly once. `unload` marks the entries
UNLOADING (no new acquires), waits until their refs drain (optionally with a timeout: then nothing is
freed, the entries become READY again and the caller gets 409), then closes the backend and drops the
model outside the lock.

Thread affinity: `acquire`, `release`, `snapshot`, `models`, `dies` are brief and non-blocking, safe
from greenlets. `load` and `unload` block (upload, drain, backend close) and must run in a real OS
thread (the web layer uses `bridge.call_in_thread`). All primitives come from `pantheon.osthread`, so
they are real locks even under gevent monkey-patching.
"""

from __future__ import annotations

import logging
import re
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import osthread
from .config import Settings
from .errors import RequestError

log = logging.getLogger(__name__)

MAX_ENTRIES = 16
LOADING, READY, UNLOADING, CLOSING = "loading", "ready", "unloading", "closing"

# A served model name: what clients put in "model". No "=", "@", ",", ";" (they delimit specs).
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/+-]{0,127}")
_DIES_RE = re.compile(r"\d+(,\d+)*")


@dataclass(frozen=True)
class ModelSpec:
    """One `[NAME=]MODEL[@DIE,DIE]` item of `--model` / PANTHEON_MODELS."""

    source: str  # catalog name or file path
    name: str | None = None
    dies: tuple[int, ...] = ()


def valid_name(name: str) -> bool:
    return bool(_NAME_RE.fullmatch(name))


def parse_spec(text: str) -> ModelSpec:
    """Parse `[NAME=]MODEL[@DIE,DIE]`; raises ValueError saying what is wrong.

    A trailing `@digits[,digits]` is the die list; a leading `NAME=` is the served name unless the
    whole text is an existing file (so a path containing "=" still works).
    """
    s = text.strip()
    dies: tuple[int, ...] = ()
    head, at, tail = s.rpartition("@")
    if at and _DIES_RE.fullmatch(tail.strip()):
        s, dies = head.strip(), tuple(int(x) for x in tail.split(","))
        if len(set(dies)) != len(dies):
            raise ValueError(f"model spec {text!r} lists a die twice")
    name = None
    left, eq, right = s.partition("=")
    if eq and not Path(s).expanduser().exists():
        if not valid_name(left.strip()):
            raise ValueError(f"model spec {text!r}: {left.strip()!r} is not a valid model name "
                             "(letters, digits and ._:/+- ; at most 128 characters)")
        name, s = left.strip(), right.strip()
    if not s:
        raise ValueError(f"model spec {text!r} names no model")
    return ModelSpec(source=s, name=name, dies=dies)


def default_name(source: str) -> str:
    """The served name when none is given: the catalog name, else the file's stem made name-safe."""
    from .catalog import CATALOG
    if source in CATALOG:
        return source
    stem = Path(source).name
    if stem.endswith(".gguf"):
        stem = stem[: -len(".gguf")]
    stem = re.sub(r"[^A-Za-z0-9._:/+-]", "-", stem).lstrip("._:/+-") or "model"
    return stem[:128]


@dataclass(eq=False)
class Entry:
    """One resident (or loading/unloading) model. Fields other than `model`/`backend` are guarded by
    the registry's `_lock`; `model` and `backend` are set once at publish and read without it."""

    slot: int
    name: str
    source: str
    instance_id: str
    state: str = LOADING
    dies: tuple[int, ...] = ()
    bytes: int = 0  # the estimate while loading, the model's weight_bytes once READY
    refs: int = 0
    model: Any = None
    backend: Any = None
    created: int = field(default_factory=lambda: int(time.time()))

    def info(self) -> dict:
        return {"instance_id": self.instance_id, "name": self.name, "source": self.source, "state": self.state,
                "dies": list(self.dies), "bytes": self.bytes, "in_flight": self.refs, "created": self.created}


def _status_error(message: str, status: int, code: str, param: str | None = None) -> RequestError:
    return RequestError(message, param=param, status=status, code=code)


def device_table(settings: Settings) -> list[dict]:
    """Every JAX device with its memory budget in bytes. Imports JAX: call only after the worker forked.

    Budget: the device's own `bytes_limit` (memory_stats), else PANTHEON_DIE_BUDGET_MB, else the host's
    total memory (CPU devices report none and share the host's RAM).
    """
    import jax
    import psutil
    out = []
    for i, d in enumerate(jax.devices()):
        try:
            stats = d.memory_stats() or {}
        except Exception:  # some backends raise instead of returning None
            stats = {}
        budget = int(stats.get("bytes_limit") or 0)
        if not budget and settings.die_budget_mb > 0:
            budget = settings.die_budget_mb * 1024 * 1024
        if not budget:
            budget = int(psutil.virtual_memory().total)
        out.append({"die": i, "platform": d.platform, "kind": getattr(d, "device_kind", d.platform),
                    "budget_bytes": budget})
    return out


_GGUF_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def gguf_element_count(path: Path) -> int:
    """Total number of weight elements in a GGUF, read from its header only.

    Why not `gguf.GGUFReader`: it decodes every metadata value, which takes ~25 s for a 150k-token
    vocabulary; admission must answer in milliseconds. This walks the key/value section (skipping
    values by their sizes) and sums the tensor-info shapes.
    """
    import struct

    with open(path, "rb") as f:
        def read(fmt: str) -> tuple:
            size = struct.calcsize(fmt)
            data = f.read(size)
            if len(data) != size:
                raise ValueError("truncated GGUF header")
            return struct.unpack(fmt, data)

        def skip_string() -> None:
            (n,) = read("<Q")
            f.seek(n, 1)

        def skip_value(vtype: int) -> None:
            if vtype == _GGUF_STRING:
                skip_string()
            elif vtype == _GGUF_ARRAY:
                itype, count = read("<IQ")
                if itype in _GGUF_SCALAR_SIZES:
                    f.seek(_GGUF_SCALAR_SIZES[itype] * count, 1)
                else:
                    for _ in range(count):
                        skip_value(itype)
            elif vtype in _GGUF_SCALAR_SIZES:
                f.seek(_GGUF_SCALAR_SIZES[vtype], 1)
            else:
                raise ValueError(f"unknown GGUF value type {vtype}")

        magic, version = read("<4sI")
        if magic != b"GGUF" or version < 2:
            raise ValueError("not a GGUF v2+ file")
        n_tensors, n_kv = read("<QQ")
        for _ in range(n_kv):
            skip_string()
            (vtype,) = read("<I")
            skip_value(vtype)
        total = 0
        for _ in range(n_tensors):
            skip_string()
            (n_dims,) = read("<I")
            count = 1
            for d in read(f"<{n_dims}Q"):
                count *= d
            total += count
            f.seek(12, 1)  # ggml type (u32) + data offset (u64)
        return total


def estimate_weight_bytes(path: Path, settings: Settings, platform: str) -> int:
    """Bytes the weights will take on a die, from the file's tensor shapes (no weights are read).

    The engine dequantizes to f32 on CPU and to bf16 matrices elsewhere (PANTHEON_DTYPE overrides).
    A file that cannot be scanned (not GGUF: a safetensors directory) is estimated from its size.
    """
    dtype = settings.dtype.lower()
    per = 4 if dtype in ("float32", "f32") or (dtype == "auto" and platform == "cpu") else 2
    p = Path(path)
    try:
        return per * gguf_element_count(p)
    except (OSError, ValueError):
        files = [p] if p.is_file() else [q for q in p.rglob("*") if q.is_file()] if p.is_dir() else []
        return sum(q.stat().st_size for q in files) * per // 2


def _load_model(path: Path, name: str, dies: Sequence[int], settings: Settings) -> Any:
    from .engine import LoadOptions, load_on
    opts = LoadOptions(name=name, dtype=settings.dtype, n_slots=max(1, settings.batch_slots),
                       max_seq=settings.max_seq, prefill_chunk=settings.prefill_chunk)
    return load_on(path, opts, list(dies) or None)


def _make_backend(model: Any, settings: Settings) -> Any:
    from .scheduler import make_backend
    return make_backend(model, settings)


def _resolve(source: str) -> Path:
    from .catalog import resolve_model
    return resolve_model(source, progress=False)


class Registry:
    """The model table. Hooks (`load_model`, `make_backend`, `devices`, `estimate`) default to the
    real engine and exist so tests can drive the table with fakes."""

    def __init__(self, settings: Settings,
                 load_model: Callable[[Path, str, Sequence[int], Settings], Any] = _load_model,
                 make_backend: Callable[[Any, Settings], Any] = _make_backend,
                 devices: Callable[[Settings], list[dict]] = device_table,
                 estimate: Callable[[Path, Settings, str], int] = estimate_weight_bytes):
        self.settings = settings
        self._load_model = load_model
        self._make_backend = make_backend
        self._devices_fn = devices
        self._estimate = estimate
        self._devices: list[dict] | None = None  # cached device_table(); set once under _lock
        # _lock: guards _entries and every Entry's state/refs/dies/bytes. Held only for table
        # bookkeeping (microseconds): never across a file read, an upload, a drain or a backend close.
        self._lock = osthread.Lock()
        # _drained (on _lock): notified by every release(); unload waits on it until its entries' refs == 0.
        self._drained = osthread.Condition(self._lock)
        # _upload_lock: held for phase 3 only; at most one weight upload in flight per process.
        self._upload_lock = osthread.Lock()
        self._entries: list[Entry | None] = [None] * MAX_ENTRIES

    # ---- loading (OS thread only) --------------------------------------------------------------------
    def load(self, source: str, name: str | None = None, dies: Sequence[int] | None = None,
             resolve: Callable[[str], Path] = _resolve) -> dict:
        """Load `source` (catalog name or path, turned into a file by `resolve`) as `name`; blocks.

        Raises RequestError (400 bad dies/name, 409 same name loading/unloading, 507 table full or
        does not fit), CatalogError (404) or ModelLoadError (500). On failure nothing stays reserved.
        """
        name = name or default_name(source)
        if not valid_name(name):
            raise _status_error(f"{name!r} is not a valid model name (letters, digits and ._:/+-, at most "
                                "128 characters, starting with a letter or digit)", 400, "invalid_name", "name")
        dies = tuple(dies or ())
        if len(set(dies)) != len(dies):
            raise _status_error(f"dies {list(dies)} lists a die twice", 400, "invalid_dies", "dies")
        entry = self._reserve(source, name)
        try:
            path = resolve(source)
            self._place(entry, path, dies)
            with self._upload_lock:
                model = self._load_model(path, name, entry.dies, self.settings)
            try:
                backend = self._make_backend(model, self.settings)
            except BaseException:
                del model
                raise
            with self._lock:
                entry.model, entry.backend = model, backend
                entry.bytes = int(getattr(model, "weight_bytes", entry.bytes) or entry.bytes)
                entry.state = READY
                info = entry.info()
        except BaseException:
            with self._lock:
                self._entries[entry.slot] = None
            raise
        log.info("loaded %s as %r (instance %s) on dies %s, %d weight bytes", source, name, entry.instance_id,
                 list(entry.dies), entry.bytes)
        return info

    def _reserve(self, source: str, name: str) -> Entry:
        """Phase 1: claim a slot and the name."""
        with self._lock:
            for e in self._entries:
                if e is not None and e.name == name and e.state in (LOADING, UNLOADING, CLOSING):
                    doing = "loaded" if e.state == LOADING else "unloaded"
                    raise _status_error(f"model {name!r} is already being {doing}", 409, "model_busy", "name")
            free = [i for i, e in enumerate(self._entries) if e is None]
            if not free:
                raise _status_error(f"the model table is full ({MAX_ENTRIES} entries); unload one first",
                                    507, "model_table_full")
            entry = Entry(slot=free[0], name=name, source=source, instance_id="inst-" + secrets.token_hex(6))
            self._entries[entry.slot] = entry
            return entry

    def _device_table(self) -> list[dict]:
        if self._devices is None:
            table = self._devices_fn(self.settings)
            with self._lock:
                if self._devices is None:
                    self._devices = table
        return self._devices

    def _used_locked(self) -> dict[int, int]:
        """Bytes reserved on each die by every entry in the table (loading ones by their estimate)."""
        used: dict[int, int] = {}
        for e in self._entries:
            if e is not None and e.dies:
                share = e.bytes // len(e.dies)
                for d in e.dies:
                    used[d] = used.get(d, 0) + share
        return used

    def _place(self, entry: Entry, path: Path, dies: tuple[int, ...]) -> None:
        """Phase 2: choose dies and admit the estimated bytes against their budgets."""
        table = self._device_table()
        bad = [d for d in dies if d < 0 or d >= len(table)]
        if bad:
            raise _status_error(f"no such die(s) {bad}; this host has {len(table)} (0..{len(table) - 1})",
                                400, "invalid_dies", "dies")
        platform = table[dies[0] if dies else 0]["platform"]
        need = int(self._estimate(path, self.settings, platform))
        with self._lock:
            used = self._used_locked()
            if not dies:
                best = max(table, key=lambda t: (t["budget_bytes"] - used.get(t["die"], 0), -t["die"]))
                dies = (best["die"],)
            share = need // len(dies)
            for d in dies:
                free = table[d]["budget_bytes"] - used.get(d, 0)
                if share > free:
                    raise _status_error(
                        f"model needs about {share / 2**20:.1f} MiB on die {d}, which has {max(0, free) / 2**20:.1f} "
                        f"MiB free of {table[d]['budget_bytes'] / 2**20:.1f} MiB", 507, "insufficient_memory", "dies")
            entry.dies, entry.bytes = dies, need

    # ---- routing (any thread, non-blocking) -------------------------------------------------------
    def acquire(self, name: str | None) -> Entry:
        """The entry a request for `name` runs on, with its refcount taken; pair with `release`.

        An exact name match wins. Otherwise: a name that is loading/unloading -> 503; one resident model
        name -> everything routes to it; an empty name -> the first resident entry; several resident and
        an unknown name -> 404. Replicas sharing a name: the one with fewest in-flight refs. None -> 503.
        """
        with self._lock:
            ready = [e for e in self._entries if e is not None and e.state == READY]
            if not ready:
                busy = any(e is not None for e in self._entries)
                raise _status_error("no model is loaded" + (" yet; one is loading or unloading" if busy else ""),
                                    503, "model_not_loaded")
            names = {e.name for e in ready}
            candidates = [e for e in ready if name and e.name == name]
            if not candidates:
                if name and any(e is not None and e.name == name for e in self._entries):
                    raise _status_error(f"model {name!r} is loading or being unloaded", 503, "model_not_ready",
                                        "model")
                if len(names) == 1 or not name:
                    candidates = [e for e in ready if e.name == ready[0].name]
                else:
                    raise _status_error(f"model {name!r} is not loaded; loaded models: {', '.join(sorted(names))}",
                                        404, "model_not_found", "model")
            entry = min(candidates, key=lambda e: (e.refs, e.slot))
            entry.refs += 1
            return entry

    def release(self, entry: Entry) -> None:
        """Give back a reference taken by `acquire` (exactly once per acquire)."""
        with self._lock:
            if entry.refs <= 0:
                raise RuntimeError(f"release of {entry.instance_id} without a matching acquire")
            entry.refs -= 1
            self._drained.notify_all()

    # ---- unloading (OS thread only) --------------------------------------------------------------------
    def unload(self, name: str | None = None, instance_id: str | None = None,
               timeout_s: float | None = None) -> list[dict]:
        """Unload one instance (`instance_id`) or every replica of `name`; blocks until drained.

        New acquires are refused at once; in-flight requests finish normally. With `timeout_s`, if refs
        have not drained in time the entries become READY again, nothing is freed, and 409 is raised.
        """
        with self._lock:
            if instance_id:
                targets = [e for e in self._entries if e is not None and e.instance_id == instance_id]
                what = f"instance_id {instance_id!r}"
            else:
                targets = [e for e in self._entries if e is not None and e.name == name]
                what = f"model {name!r}"
            if not targets:
                raise _status_error(f"{what} is not loaded", 404, "model_not_found",
                                    "instance_id" if instance_id else "name")
            if any(e.state == LOADING for e in targets):
                raise _status_error(f"{what} is still loading", 409, "model_busy")
            if any(e.state != READY for e in targets):
                raise _status_error(f"{what} is already being unloaded", 409, "model_busy")
            for e in targets:
                e.state = UNLOADING
            drained = self._drained.wait_for(lambda: all(e.refs == 0 for e in targets), timeout_s)
            if not drained:
                busy = sum(e.refs for e in targets)
                for e in targets:
                    e.state = READY
                raise _status_error(f"{what} still has {busy} request(s) in flight after {timeout_s} s; "
                                    "nothing was unloaded", 409, "unload_timeout")
            for e in targets:
                e.state = CLOSING  # not routable, but its bytes still count until freed below
            infos = [e.info() for e in targets]
        for e in targets:
            try:
                if e.backend is not None:
                    e.backend.close()
            except Exception:  # a failing close must not keep the slot forever
                log.exception("closing the backend of %s failed", e.instance_id)
            e.backend = e.model = None
            with self._lock:
                self._entries[e.slot] = None
            log.info("unloaded %r (instance %s)", e.name, e.instance_id)
        for i in infos:
            i["state"] = "unloaded"
        return infos

    def close(self) -> None:
        """Shut every backend down (process exit); in-flight requests are cancelled by the backends."""
        with self._lock:
            entries = [e for e in self._entries if e is not None and e.backend is not None]
            for e in entries:
                e.state = CLOSING
        for e in entries:
            try:
                e.backend.close()
            except Exception:
                log.exception("closing the backend of %s failed", e.instance_id)

    # ---- views (any thread, non-blocking) -----------------------------------------------------------
    def snapshot(self) -> list[dict]:
        with self._lock:
            return [e.info() for e in self._entries if e is not None]

    def load_infos(self) -> list[tuple[str, dict]]:
        """(name, backend.load_info()) of every READY instance, for /metrics. load_info runs outside _lock."""
        with self._lock:
            ready = [(e.name, e.backend) for e in self._entries
                     if e is not None and e.state == READY and e.backend is not None]
        return [(name, backend.load_info()) for name, backend in ready]

    def ready_count(self) -> int:
        with self._lock:
            return sum(1 for e in self._entries if e is not None and e.state == READY)

    def models(self) -> list[dict]:
        """Resident model names, one per name however many replicas serve it (OpenAI list items)."""
        seen: dict[str, dict] = {}
        with self._lock:
            for e in self._entries:
                if e is not None and e.state == READY and e.name not in seen:
                    seen[e.name] = {"id": e.name, "object": "model", "created": e.created, "owned_by": "pantheon"}
        return list(seen.values())

    def dies(self) -> list[dict]:
        """Each die's budget, bytes reserved on it, and the instances placed there."""
        table = self._device_table()
        with self._lock:
            used = self._used_locked()
            out = []
            for t in table:
                residents = [{"name": e.name, "instance_id": e.instance_id, "state": e.state,
                              "bytes": e.bytes // len(e.dies)}
                             for e in self._entries if e is not None and t["die"] in e.dies]
                out.append({**t, "used_bytes": used.get(t["die"], 0),
                            "free_bytes": t["budget_bytes"] - used.get(t["die"], 0), "models": residents})
            return out
