"""The resident models of one server: a table of up to 16 entries, each a loaded model and its backend.

Why a table with states rather than a dict of models: loading takes seconds to minutes, and the server
must keep answering (other models keep generating, /v1/models keeps listing) while it runs. A load
therefore goes through four phases and holds the table lock only for the bookkeeping moments:

1. reserve (under `_lock`): take a free slot with the entry in LOADING state, so the name is claimed
   (a second load of the same name in progress is refused with 409) but nothing can route to it;
2. place (the die manager's lock, pantheon.serving.dies): estimate what the model will hold (weights, KV
   cache, scratch: `estimate_load_bytes`, headers only) and reserve it on the given dies, or on the
   emptiest one, atomically (507 when it does not fit); two concurrent loads cannot both take the last
   free bytes, and a failed load gives its reservation back;
3. upload (under `_upload_lock`, not `_lock`): read and place the weights; one upload at a time, so
   two multi-GB host transients never stack;
4. publish (backend built outside any lock, then `_lock`): the entry becomes READY and routable.

Requests `acquire` an entry (refs += 1) and must `release` it exactly once. Replicas sharing a name
split the requests by fewest references; a request with a `session_id` sticks to the replica that
served that session before (a bounded LRU map), so its prefix cache is reused. `unload` marks the
entries UNLOADING (no new acquires), waits until their refs drain (optionally with a timeout: then
nothing is freed, the entries become READY again and the caller gets 409), then closes the backend,
frees the model (engine.Model.free: its params, caches and compiled programs are freed at once,
not whenever the last reference happens to go), trims the C heap so the freed bytes leave the
process (heap.release_freed_memory), and gives its dies' reservation back, outside the lock. A
failed load is cleaned up the same way.

Thread affinity: `acquire`, `release`, `snapshot`, `models`, `dies` are brief and non-blocking, safe
from greenlets. `load` and `unload` block (upload, drain, backend close) and must run in a real OS
thread (the web layer uses `bridge.call_in_thread`). All primitives come from `pantheon.osthread`, so
they are real locks even under gevent monkey-patching.
"""

from __future__ import annotations

import dataclasses

import logging
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pantheon import osthread
from pantheon.config import Settings
from pantheon.errors import RequestError
from pantheon.errors import clear_exception_frames
from pantheon.runtime.heap import release_freed_memory

log = logging.getLogger(__name__)

MAX_ENTRIES = 16
MAX_SESSIONS = 4096  # session_id -> instance affinity entries kept (least recently used dropped first)
LOADING, READY, UNLOADING, CLOSING = "loading", "ready", "unloading", "closing"

# A served model name: what clients put in "model". No "=", "@", ",", ";" (they delimit specs).
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/+-]{0,127}")
_DIES_RE = re.compile(r"\d+(,\d+)*")


@dataclass(frozen=True)
class ModelSpec:
    """One `[NAME=]MODEL[?mmproj=PROJECTOR][@DIE,DIE]` item of `--model` / PANTHEON_MODELS."""

    source: str  # catalog name or file path
    name: str | None = None
    dies: tuple[int, ...] = ()
    mmproj: str | None = None  # a vision projector GGUF (the model then takes images)


def valid_name(name: str) -> bool:
    return bool(_NAME_RE.fullmatch(name))


def parse_spec(text: str) -> ModelSpec:
    """Parse `[NAME=]MODEL[?mmproj=PROJ][@DIE,DIE]`; raises ValueError saying what is wrong.

    A trailing `@digits[,digits]` is the die list; before it, `?mmproj=PROJ` names a vision projector;
    a leading `NAME=` is the served name unless the whole text is an existing file (so a path
    containing "=" still works).
    """
    s = text.strip()
    dies: tuple[int, ...] = ()
    head, at, tail = s.rpartition("@")
    if at and _DIES_RE.fullmatch(tail.strip()):
        s, dies = head.strip(), tuple(int(x) for x in tail.split(","))
        if len(set(dies)) != len(dies):
            raise ValueError(f"model spec {text!r} lists a die twice")
    mmproj = None
    base, q, proj = s.rpartition("?mmproj=")
    if q:
        s, mmproj = base.strip(), proj.strip()
        if not mmproj:
            raise ValueError(f"model spec {text!r}: ?mmproj= names no projector file")
    name = None
    left, eq, right = s.partition("=")
    if eq and not Path(s).expanduser().exists():
        if not valid_name(left.strip()):
            raise ValueError(f"model spec {text!r}: {left.strip()!r} is not a valid model name "
                             "(letters, digits and ._:/+- ; at most 128 characters)")
        name, s = left.strip(), right.strip()
    if not s:
        raise ValueError(f"model spec {text!r} names no model")
    return ModelSpec(source=s, name=name, dies=dies, mmproj=mmproj)


def default_name(source: str) -> str:
    """The served name when none is given: the catalog name, else the file's stem made name-safe."""
    from pantheon.formats.catalog import CATALOG
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
    bytes: int = 0  # bytes reserved on each of `dies` (the load estimate: weights + cache + scratch)
    weight_bytes: int = 0  # the model's weight bytes once READY
    refs: int = 0
    model: Any = None
    card: Any = None  # the model's pantheon.types.ModelCard: all the web layer reads of it
    backend: Any = None
    created: int = field(default_factory=lambda: int(time.time()))

    def info(self) -> dict:
        return {"instance_id": self.instance_id, "name": self.name, "source": self.source, "state": self.state,
                "dies": list(self.dies), "bytes": self.bytes, "weight_bytes": self.weight_bytes,
                "in_flight": self.refs, "created": self.created}


def _status_error(message: str, status: int, code: str, param: str | None = None) -> RequestError:
    return RequestError(message, param=param, status=status, code=code)


def _load_options(name: str, settings: Settings, mmproj: str | None = None) -> Any:
    """The LoadOptions a model is loaded with: the estimate must see exactly what the load will do."""
    from pantheon.runtime.engine import LoadOptions
    return LoadOptions(name=name, dtype=settings.dtype, n_slots=max(1, settings.batch_slots),
                       max_seq=settings.max_seq, prefill_chunk=settings.prefill_chunk,
                       native_matmul=settings.native_matmul, native_dot=settings.native_dot,
                       native_dir=str(settings.home / "native"), mmproj=mmproj,
                       spec_k=settings.spec_k if settings.speculative else 0)


def estimate_load(path: Path, settings: Settings, platform: str) -> Any:
    """What a model will hold on its dies (pantheon.serving.dies.LoadEstimate), from the file's headers only."""
    from pantheon.serving.dies import estimate_load_bytes
    return estimate_load_bytes(path, _load_options(Path(path).stem, settings), platform)


def _manager_from_table(table: list[dict]) -> Any:
    """A DieManager over a given device table (the `devices` test hook): budgets as given."""
    from pantheon.serving.dies import Die, DieManager
    return DieManager([Die(id=int(t["die"]), budget_bytes=int(t["budget_bytes"]), platform=t.get("platform", "cpu"),
                           kind=t.get("kind", "cpu"), budget_source="given") for t in table])


def _load_model(path: Path, name: str, dies: Sequence[int], settings: Settings, mmproj: str | None = None) -> Any:
    from pantheon.serving import distributed
    from pantheon.runtime.engine import load_on
    cluster = distributed.leader()
    if cluster is not None:  # multi-host: the followers load their shards too (pantheon.serving.distributed)
        if mmproj:
            raise _status_error("a vision projector (mmproj) is not supported on a multi-host cluster", 400,
                                "unsupported", "mmproj")
        return cluster.load(path, _load_options(name, settings), dies)
    return load_on(path, _load_options(name, settings, mmproj), list(dies) or None)


def _attach_draft(model: Any, path: Path, name: str, dies: Sequence[int], settings: Settings) -> None:
    """Load the draft model at `path` beside `model` (its slots and sequence length, no verify programs
    of its own) on the model's first die, check it can draft for it, and attach it (`model.draft`,
    freed with the model). A draft that cannot serve -- another vocabulary, recurrent state, or a
    target that verifies no drafts -- is a 400 naming both models."""
    from pantheon.serving import distributed
    from pantheon.runtime.engine import load_on
    from pantheon.scheduler.drafts import DraftMismatch, check_draft
    if distributed.leader() is not None:
        raise _status_error("a draft model is not supported on a multi-host cluster", 400, "unsupported",
                            "draft_model")
    if not getattr(model, "supports_verify", False):
        raise _status_error(f"model {name!r} cannot use draft model {path.name!r}: it verifies no drafts (recurrent "
                            "state, an image model, or speculative decoding off / spec_k 0)", 400,
                            "draft_model_unsupported", "draft_model")
    opts = dataclasses.replace(_load_options(default_name(str(path)), settings), spec_k=0)
    draft = load_on(path, opts, list(dies[:1]) or None)
    try:
        check_draft(model, draft)
    except DraftMismatch as exc:
        _release_model(draft)
        raise _status_error(str(exc), 400, "draft_model_mismatch", "draft_model") from None
    model.draft = draft


def _holds_memory(model: Any) -> bool:
    """Whether `model` holds device memory of its own (an engine.Model; test fakes do not)."""
    return callable(getattr(model, "free", None))


def _release_model(model: Any) -> bool:
    """Free a model's device memory at once (engine.Model.free); True if it held any to free."""
    if not _holds_memory(model):
        return False
    try:
        model.free()
    except Exception:  # releasing is best effort: the references are dropped either way
        log.exception("releasing the model's memory failed")
    return True


def _resolve(source: str) -> Path:
    from pantheon.formats.catalog import resolve_model
    return resolve_model(source, progress=False)


class Registry:
    """The model table. Hooks (`load_model`, `make_backend`, `estimate`, and the die manager `dies` or
    a `devices` table to build one from) default to the real engine and exist so tests can drive the
    table with fakes. `estimate(path, settings, platform)` returns a pantheon.serving.dies.LoadEstimate, or
    plain bytes (then treated as one replicated block: the same bytes on every die)."""

    def __init__(self, settings: Settings,
                 load_model: Callable[[Path, str, Sequence[int], Settings], Any] = _load_model,
                 make_backend: Callable[[Any, Settings], Any] | None = None,
                 devices: Callable[[Settings], list[dict]] | None = None,
                 estimate: Callable[[Path, Settings, str], Any] = estimate_load,
                 dies: Any = None):
        self.settings = settings
        self._load_model = load_model
        self._make_backend = make_backend if make_backend is not None else self._default_backend
        self._devices_fn = devices
        self._estimate = estimate
        # The die manager (pantheon.serving.dies.DieManager): given, built from `devices`, or from JAX's devices
        # on first use (`die_manager`). It has its own lock; set once under _lock.
        self._dies: Any = dies
        # The memory watch the schedulers' pressure callbacks read (attach_memwatch); None: the global one.
        self.memwatch: Any = None
        # _lock: guards _entries, every Entry's state/refs/dies/bytes, and _sessions/_session_counts.
        # Held only for table bookkeeping (microseconds): never across a file read, an upload, a drain
        # or a backend close. The die manager's lock is never taken while holding it.
        self._lock = osthread.Lock()
        # _drained (on _lock): notified by every release(); unload waits on it until its entries' refs == 0.
        self._drained = osthread.Condition(self._lock)
        # _upload_lock: held for phase 3 only; at most one weight upload in flight per process.
        self._upload_lock = osthread.Lock()
        self._entries: list[Entry | None] = [None] * MAX_ENTRIES
        # Session affinity: session_id -> instance_id, least recently used first, at most MAX_SESSIONS;
        # _session_counts: instance_id -> sessions mapped to it (spreads new sessions over replicas).
        self._sessions: OrderedDict[str, str] = OrderedDict()
        self._session_counts: dict[str, int] = {}

    # ---- dies and memory ---------------------------------------------------------------------------
    def die_manager(self) -> Any:
        """The die manager, built on first use (from JAX's devices unless a table or manager was given).
        Building it imports JAX: call only in the worker, after the fork."""
        if self._dies is None:
            if self._devices_fn is not None:
                mgr = _manager_from_table(self._devices_fn(self.settings))
            else:
                from pantheon.serving.dies import DieManager
                mgr = DieManager.from_jax(self.settings)
            with self._lock:
                if self._dies is None:
                    self._dies = mgr
        return self._dies

    def attach_memwatch(self, watch: Any) -> None:
        """Backends built from now on take their memory-pressure callback from `watch`."""
        self.memwatch = watch

    def _default_backend(self, model: Any, settings: Settings) -> Any:
        from pantheon.scheduler import make_backend
        return make_backend(model, settings, watch=self.memwatch, dies=self._dies)

    # ---- loading (OS thread only) --------------------------------------------------------------------
    def load(self, source: str, name: str | None = None, dies: Sequence[int] | None = None,
             resolve: Callable[[str], Path] = _resolve, mmproj: str | None = None,
             overrides: dict[str, Any] | None = None) -> dict:
        """Load `source` (catalog name or path, turned into a file by `resolve`) as `name`; blocks.

        Raises RequestError (400 bad dies/name, 409 same name loading/unloading, 507 table full),
        InsufficientMemoryError (507: does not fit the dies), CatalogError (404) or ModelLoadError
        (500). On failure nothing stays reserved: neither the slot nor the dies' bytes.
        `overrides`: Settings fields this model is loaded and served with instead of the server's (the
        admin load's per-model `speculative`, `spec_k` and `draft_model`).
        """
        settings = dataclasses.replace(self.settings, **overrides) if overrides else self.settings
        name = name or default_name(source)
        if not valid_name(name):
            raise _status_error(f"{name!r} is not a valid model name (letters, digits and ._:/+-, at most "
                                "128 characters, starting with a letter or digit)", 400, "invalid_name", "name")
        dies = tuple(dies or ())
        if len(set(dies)) != len(dies):
            raise _status_error(f"dies {list(dies)} lists a die twice", 400, "invalid_dies", "dies")
        entry = self._reserve(source, name)
        model: Any = None
        uploading = False  # past placement: a failure may leave freed gigabytes in malloc's arenas
        try:
            path = resolve(source)
            # a draft model (PANTHEON_DRAFT_MODEL, or the admin load's `draft_model`): a catalog name or a file
            draft = _resolve(settings.draft_model) if settings.draft_model else None
            # A damaged file fails in the estimate (pantheon.serving.dies) or the load (engine.load_on), each
            # of which turns whatever it trips over into a ModelLoadError naming the file.
            self._place(entry, path, dies, mmproj, draft)
            with self._upload_lock:
                uploading = True
                extra = {"mmproj": mmproj} if mmproj else {}
                model = self._load_model(path, name, entry.dies, settings, **extra)
                if draft is not None:
                    _attach_draft(model, Path(draft), name, entry.dies, settings)
            backend = self._make_backend(model, settings)
            with self._lock:
                entry.model, entry.card, entry.backend = model, getattr(model, "card", None), backend
                entry.weight_bytes = int(getattr(model, "weight_bytes", 0) or 0)
                entry.state = READY
                info = entry.info()
        except BaseException as exc:
            if model is not None:  # built, but its backend failed: free it now, not at some later gc
                _release_model(model)
                model = None
            if self._dies is not None:
                self._dies.unbind(entry.instance_id)  # no-op when placement never bound it
            with self._lock:
                self._entries[entry.slot] = None
            clear_exception_frames(exc)  # the failed build's frames may hold its arrays
            if uploading:  # not for a 400/404/507 answered before any weight was read: those stay fast
                release_freed_memory()
            raise
        # The upload's host transients (copies of misaligned tensors, the warm-up's compile scratch) are
        # freed by now but sit in malloc's arenas: give them back, or every reload grows the process.
        # (A full gc and trim cost up to seconds in a large process: only for a model that uploaded.)
        if _holds_memory(model):
            release_freed_memory()
        log.info("loaded %s as %r (instance %s) on dies %s: %d weight bytes, %d bytes reserved per die", source,
                 name, entry.instance_id, list(entry.dies), entry.weight_bytes, entry.bytes)
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

    def _place(self, entry: Entry, path: Path, dies: tuple[int, ...], mmproj: str | None = None,
               draft: Path | None = None) -> None:
        """Phase 2: estimate the model's bytes and reserve them on `dies` (or the emptiest die).
        A vision projector adds its file's size, held in full on the die (it is never split); a draft
        model adds its whole estimate (weights, cache, scratch), counted on every die (it sits on the
        first: an over-count on several dies, exact on one)."""
        from pantheon.serving.dies import LoadEstimate
        mgr = self.die_manager()
        known = {d.id: d for d in mgr.dies}
        first = known.get(dies[0]) if dies else mgr.dies[0]
        est = self._estimate(path, self.settings, first.platform if first is not None else mgr.dies[0].platform)
        if not isinstance(est, LoadEstimate):
            est = LoadEstimate(weights_bytes=int(est), replicated_weight_bytes=int(est))
        if mmproj:
            try:
                extra = Path(mmproj).expanduser().stat().st_size
            except OSError as exc:
                raise _status_error(f"the projector file {mmproj!r} cannot be read ({exc.strerror})", 404,
                                    "model_not_found", "mmproj") from None
            # Its header and config read now, before the text model uploads: a file that is no projector
            # fails in milliseconds with nothing placed (ModelLoadError naming it), not after the upload.
            from pantheon.formats.mmproj import open_mmproj
            open_mmproj(mmproj)
            est = dataclasses.replace(est, weights_bytes=est.weights_bytes + extra,
                                      replicated_weight_bytes=est.replicated_weight_bytes + extra)
        if draft is not None:
            d = self._estimate(draft, self.settings, first.platform if first is not None else mgr.dies[0].platform)
            extra = d.total_bytes if isinstance(d, LoadEstimate) else int(d)
            est = dataclasses.replace(est, weights_bytes=est.weights_bytes + extra,
                                      replicated_weight_bytes=est.replicated_weight_bytes + extra)
        placed = tuple(mgr.reserve(entry.instance_id, entry.name, est, dies=list(dies) or None))
        with self._lock:
            entry.dies, entry.bytes = placed, est.per_die(len(placed))

    # ---- routing (any thread, non-blocking) -------------------------------------------------------
    def acquire(self, name: str | None, session_id: str | None = None) -> Entry:
        """The entry a request for `name` runs on, with its refcount taken; pair with `release`.

        An exact name match wins. Otherwise: a name that is loading/unloading -> 503; one resident model
        name -> everything routes to it; an empty name -> the first resident entry; several resident and
        an unknown name -> 404. None -> 503. Replicas sharing a name: a `session_id` seen before goes
        to the replica that served it (while that replica is routable); otherwise the one with fewest
        in-flight refs, then (for a new session) fewest sessions, then the lowest slot.
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
            entry = None
            if session_id is not None:
                sticky = self._sessions.get(session_id)
                entry = next((e for e in candidates if e.instance_id == sticky), None)
            if entry is None:
                if session_id is not None:
                    entry = min(candidates, key=lambda e: (e.refs, self._session_counts.get(e.instance_id, 0), e.slot))
                else:
                    entry = min(candidates, key=lambda e: (e.refs, e.slot))
            if session_id is not None:
                self._remember_session_locked(session_id, entry.instance_id)
            entry.refs += 1
            return entry

    def _remember_session_locked(self, session_id: str, instance_id: str) -> None:
        prev = self._sessions.pop(session_id, None)
        if prev is not None:
            self._drop_count_locked(prev)
        self._sessions[session_id] = instance_id
        self._session_counts[instance_id] = self._session_counts.get(instance_id, 0) + 1
        while len(self._sessions) > MAX_SESSIONS:
            _, old = self._sessions.popitem(last=False)
            self._drop_count_locked(old)

    def _drop_count_locked(self, instance_id: str) -> None:
        n = self._session_counts.get(instance_id, 0) - 1
        if n > 0:
            self._session_counts[instance_id] = n
        else:
            self._session_counts.pop(instance_id, None)

    def _forget_instance_locked(self, instance_id: str) -> None:
        """Drop the sessions of an instance that is gone (their next turn goes to another replica)."""
        for sid in [k for k, v in self._sessions.items() if v == instance_id]:
            del self._sessions[sid]
        self._session_counts.pop(instance_id, None)

    def session_instance(self, session_id: str) -> str | None:
        """The instance a session sticks to, or None (for tests and debugging)."""
        with self._lock:
            return self._sessions.get(session_id)

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
        freed = False
        for e in targets:
            try:
                if e.backend is not None:
                    e.backend.close()
            except Exception:  # a failing close must not keep the slot forever
                log.exception("closing the backend of %s failed", e.instance_id)
            model, e.backend, e.model = e.model, None, None
            freed = _release_model(model) or freed  # its params, caches and compiled programs, now
            del model
            self.die_manager().unbind(e.instance_id)  # the weights and state are gone: give the bytes back
            with self._lock:
                self._entries[e.slot] = None
                self._forget_instance_locked(e.instance_id)
            log.info("unloaded %r (instance %s)", e.name, e.instance_id)
        if freed:
            release_freed_memory()  # the freed gigabytes back to the OS, not kept in malloc's arenas
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

    def ready_entries(self, name: str | None = None) -> list[Entry]:
        """The READY entries (of `name`, or all), for views that read their `model`/`backend` (set once
        at publish, so safe to read after the lock is dropped)."""
        with self._lock:
            return [e for e in self._entries if e is not None and e.state == READY and (name is None or e.name == name)]

    def has_name(self, name: str) -> bool:
        """Whether any entry (loading, ready or unloading) carries `name`."""
        with self._lock:
            return any(e is not None and e.name == name for e in self._entries)

    def ready_count(self) -> int:
        with self._lock:
            return sum(1 for e in self._entries if e is not None and e.state == READY)

    def failures(self, name: str | None = None) -> list[str]:
        """One line per resident instance (of `name`, or of any) whose backend has failed (its driver
        died): what the health routes report with 503 until it is unloaded (and maybe loaded again)."""
        with self._lock:
            backends = [(e.name, e.instance_id, e.backend) for e in self._entries
                        if e is not None and e.state == READY and e.backend is not None
                        and (name is None or e.name == name)]
        return [f"model {name!r} (instance {iid}) failed: {b.failure}" for name, iid, b in backends
                if getattr(b, "failure", None) is not None]

    def models(self) -> list[dict]:
        """Resident model names, one per name however many replicas serve it (OpenAI list items)."""
        seen: dict[str, dict] = {}
        with self._lock:
            for e in self._entries:
                if e is not None and e.state == READY and e.name not in seen:
                    seen[e.name] = {"id": e.name, "object": "model", "created": e.created, "owned_by": "pantheon"}
        return list(seen.values())

    def dies(self) -> list[dict]:
        """Each die's budget, bytes reserved on it, and the instances placed there (the die manager's
        snapshot, each model with its registry state)."""
        table = self.die_manager().snapshot()
        with self._lock:
            states = {e.instance_id: e.state for e in self._entries if e is not None}
        for d in table:
            for m in d["models"]:
                m["state"] = states.get(m["instance_id"], CLOSING)
        return table
