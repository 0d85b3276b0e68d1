"""The die manager: every JAX device is a die with a memory budget, bytes bound to it, resident models.

Why a separate ledger rather than asking the devices: a load must be admitted *before* its weights
exist (a 507 in milliseconds, not an OOM after a minute of upload), two loads in flight must not both
take the last free bytes, and CPU "devices" report no memory at all. So placement works on estimates
(`estimate_load_bytes`: tensor headers only, nothing dequantized) against per-die budgets, and
`bind`/`reserve` commit a reservation atomically; the live readings of real memory are MemWatch's job
(pantheon.runtime.memory), which also reads this ledger for dies whose backend has no `memory_stats`.

Budget of a die: its `memory_stats()["bytes_limit"]` where the backend has one, else
PANTHEON_DIE_BUDGET_MB (Settings.die_budget_mb) when > 0, else the host's total memory (CPU devices
share the host's RAM). Dies whose memory is the host's are also checked together against the host
total, so four CPU "dies" cannot promise four times the RAM.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pantheon import osthread
from pantheon.errors import ModelLoadError, PantheonError, RequestError

log = logging.getLogger(__name__)

MiB = 1024 * 1024
SCRATCH_MIN_BYTES = 64 * MiB  # compile scratch + XLA temporaries a loaded model needs at least
SCRATCH_FRACTION = 0.10  # ... plus this share of weights + state (activations, transients)


class InsufficientMemoryError(PantheonError):
    """A model (or its share) does not fit the free budget of the dies asked for: HTTP 507."""

    status = 507
    code = "insufficient_memory"

    def __init__(self, message: str, need_bytes: int = 0, free_bytes: int = 0, die: int | None = None):
        super().__init__(message)
        self.need_bytes = need_bytes
        self.free_bytes = free_bytes
        self.die = die


# ---- load estimates ------------------------------------------------------------------------------
@dataclass(frozen=True)
class LoadEstimate:
    """What one loaded model will hold, split into the parts tensor parallelism divides and the rest.

    `per_die(n)` is the bytes each of `n` dies holds: replicated weights in full, split weights and a
    kv-head-split cache divided by n (mirrors pantheon.runtime.sharding's rules: a split only happens when the
    head count divides), recurrent state and scratch in full on every die.
    """

    weights_bytes: int  # all weights at the dtype they will have on the die
    replicated_weight_bytes: int = 0  # embeddings, head, norms, router, unsplittable matrices
    attn_weight_bytes: int = 0  # q/k/v/o: split by heads
    ffn_weight_bytes: int = 0  # dense and expert FFN matrices: split by columns / experts
    kv_bytes: int = 0  # the static KV cache (n_slots + 1 slots x capacity x bytes/token)
    recurrent_bytes: int = 0  # fixed per-sequence state (hybrid archs), never split
    snapshot_bytes: int = 0  # the most the prefix snapshots of that state may hold (pantheon.scheduler.snapshots)
    scratch_bytes: int = 0
    n_heads: int = 0
    n_kv_heads: int = 0

    @property
    def state_bytes(self) -> int:
        return self.kv_bytes + self.recurrent_bytes

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.state_bytes + self.snapshot_bytes + self.scratch_bytes

    def per_die(self, n: int = 1) -> int:
        if n <= 1:
            return self.total_bytes
        heads_ok = self.n_heads % n == 0 and self.n_kv_heads % n == 0 and self.n_heads > 0
        other = self.weights_bytes - self.replicated_weight_bytes - self.attn_weight_bytes - self.ffn_weight_bytes
        w = self.replicated_weight_bytes + max(0, other)
        w += math.ceil(self.attn_weight_bytes / n) if heads_ok else self.attn_weight_bytes
        w += math.ceil(self.ffn_weight_bytes / n)
        kv = math.ceil(self.kv_bytes / n) if self.n_kv_heads and self.n_kv_heads % n == 0 else self.kv_bytes
        return w + kv + self.recurrent_bytes + self.snapshot_bytes + self.scratch_bytes


def _as_estimate(estimate: LoadEstimate | int) -> LoadEstimate:
    if isinstance(estimate, LoadEstimate):
        return estimate
    return LoadEstimate(weights_bytes=int(estimate), replicated_weight_bytes=int(estimate))


_ATTN_PARTS = ("attn_q.", "attn_k.", "attn_v.", "attn_output.")
_FFN_PARTS = ("ffn_gate.", "ffn_up.", "ffn_down.", "ffn_gate_exps.", "ffn_up_exps.", "ffn_down_exps.",
              "ffn_gate_up_exps.", "ffn_gate_shexp.", "ffn_up_shexp.", "ffn_down_shexp.")


def _weight_groups(dims: dict[str, tuple[int, ...]], tensor_bytes: Any) -> tuple[int, int, int, int]:
    """(total, replicated, attention, ffn) bytes of the named tensors, `tensor_bytes(name, dims)` each."""
    total = rep = attn = ffn = 0
    for name, shape in dims.items():
        b = int(tensor_bytes(name, shape))
        total += b
        if len(shape) < 2:
            rep += b
        elif any(part in name for part in _ATTN_PARTS):
            attn += b
        elif any(part in name for part in _FFN_PARTS):
            ffn += b
        else:
            rep += b
    return total, rep, attn, ffn


def _gguf_tensor_bytes(types: dict[str, int], compute: str) -> Any:
    """Bytes on the die of a GGUF tensor from its header: weights.device_bytes, the loader's own rule."""
    import gguf

    from pantheon.ops.weights import device_bytes

    def size(name: str, dims: tuple[int, ...]) -> int:
        try:
            qtype = gguf.GGMLQuantizationType(types.get(name, 0)).name
        except ValueError:
            qtype = "?"
        return device_bytes(qtype, tuple(reversed(dims)), compute, matrix=len(dims) >= 2)

    return size


def _safetensors_dims(files: Sequence[Path]) -> dict[str, tuple[int, ...]]:
    out: dict[str, tuple[int, ...]] = {}
    for f in files:
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        for k, v in header.items():
            if k != "__metadata__":
                out[k] = tuple(int(d) for d in v.get("shape", ()))
    return out


def _is_model(source: Any) -> bool:
    return hasattr(source, "weight_bytes") and hasattr(source, "config")


_ATTN_LEAVES = ("wq", "wk", "wv", "wo", "bq", "bk", "bv")
_FFN_LEAVES = ("w_gate", "w_up", "w_down", "w_gate_e", "w_up_e", "w_down_e", "sh_gate", "sh_up", "sh_down")


def _param_groups(params: Any) -> tuple[int, int, int, int]:
    """(total, replicated, attention, ffn) bytes of a loaded params pytree, grouped by leaf name."""
    import jax

    from pantheon.ops.weights import MappedStack
    from pantheon.runtime.sharding import leaf_name
    total = rep = attn = ffn = 0
    # a MappedStack is one leaf of its members' bytes (the file it lies in is shared by all of them)
    for path, x in jax.tree_util.tree_leaves_with_path(params, is_leaf=lambda v: isinstance(v, MappedStack)):
        name, b = leaf_name(path), int(x.nbytes)
        total += b
        if len(getattr(x, "shape", ())) < 2 and name not in _ATTN_LEAVES:
            rep += b
        elif name in _ATTN_LEAVES:
            attn += b
        elif name in _FFN_LEAVES:
            ffn += b
        else:
            rep += b
    return total, rep, attn, ffn


def estimate_load_bytes(source: Any, opts: Any = None, platform: str = "cpu") -> LoadEstimate:
    """Bytes a model will hold once loaded with `opts` (engine.LoadOptions; defaults if None).

    `source`: a GGUF path, an HF checkpoint directory, or an already loaded Model. Weights are the
    tensors' bytes on the die (weights.device_bytes: what the loader keeps, a GGUF format as it is
    stored), from headers only; state is (n_slots + 1) slots x capacity x
    the arch's bytes/token (+ its per-sequence recurrent bytes and their prefix snapshots); scratch is SCRATCH_MIN_BYTES plus
    SCRATCH_FRACTION of the rest plus a prefill chunk's logits.

    This is the first thing an admin load does with a client-named file, so every failure of a
    damaged one (a header that lies, an arch's size helper choking on its values) is a ModelLoadError
    naming the file: a 500 `model_load_error`, not an `internal_error`.
    """
    try:
        return _estimate_load_bytes(source, opts, platform)
    except PantheonError:
        raise
    except Exception as exc:
        where = getattr(source, "path", source)
        raise ModelLoadError(where, f"cannot size the model from its headers: {type(exc).__name__}: {exc}") from exc


def _estimate_load_bytes(source: Any, opts: Any, platform: str) -> LoadEstimate:
    from pantheon.runtime.engine import LoadOptions, geometry, kv_bytes, resolve_kv_dtype
    from pantheon.jax_models import registry as arch_registry
    from pantheon.config import load_settings
    from pantheon.scheduler.snapshots import pool_bytes

    if _is_model(source):
        opts = opts or getattr(source, "opts", None)
    opts = opts or LoadOptions()
    if _is_model(source):
        cfg = source.config
        if getattr(source, "params", None) is not None:
            total, rep, attn, ffn = _param_groups(source.params)
        else:
            total = rep = int(source.weight_bytes)
            attn = ffn = 0
    else:
        p = Path(str(source)).expanduser()
        dtype = str(getattr(opts, "dtype", "auto")).lower()
        per = 4 if dtype in ("float32", "f32") or (dtype == "auto" and platform == "cpu") else 2
        compute = "float32" if per == 4 else "bfloat16"
        from pantheon.formats import hf_loader
        if hf_loader.is_hf_checkpoint(p, getattr(opts, "config_path", None)):
            ck = hf_loader.open_hf(p, getattr(opts, "config_path", None))
            cfg = ck.config
            dims = _safetensors_dims(hf_loader._weight_files(p))
            renamed = {}
            for k, v in dims.items():  # HF names -> the groups' GGUF-style markers
                k2 = (k.replace("q_proj", "attn_q.").replace("k_proj", "attn_k.").replace("v_proj", "attn_v.")
                      .replace("o_proj", "attn_output.").replace("gate_proj", "ffn_gate.")
                      .replace("up_proj", "ffn_up.").replace("down_proj", "ffn_down."))
                renamed[k2] = v
            total, rep, attn, ffn = _weight_groups(renamed, lambda _name, shape: math.prod(shape) * per)
        else:
            from pantheon.formats.gguf_loader import open_gguf
            f = open_gguf(p)  # the loader's own header parse and config (ModelLoadError naming the file)
            dims, types = f.tensors.gguf_dims(), f.tensors.type_ids()
            cfg = f.config
            total, rep, attn, ffn = _weight_groups(dims, _gguf_tensor_bytes(types, compute))
    arch = arch_registry.module_for(cfg.arch)
    bpt = int(arch.state_bytes_per_token(cfg)) if arch is not None else int(cfg.kv_bytes_per_token)
    bpt = kv_bytes(bpt, resolve_kv_dtype(opts, platform))
    per_seq = int(arch.state_bytes_per_sequence(cfg)) if arch is not None else 0
    n_slots = max(1, int(opts.n_slots))
    geo = geometry(cfg, opts)  # the engine's own max_seq / chunk / capacity
    kv = (n_slots + 1) * geo.capacity * bpt
    rec = (n_slots + 1) * per_seq
    snaps = pool_bytes(load_settings().prefix_snapshot_mb, per_seq, n_slots, geo.max_seq, geo.chunk)
    logits = 2 * max(geo.chunk, n_slots) * int(cfg.vocab) * 4
    scratch = SCRATCH_MIN_BYTES + int(SCRATCH_FRACTION * (total + kv + rec)) + logits
    return LoadEstimate(weights_bytes=int(total), replicated_weight_bytes=int(rep), attn_weight_bytes=int(attn),
                        ffn_weight_bytes=int(ffn), kv_bytes=int(kv), recurrent_bytes=int(rec),
                        snapshot_bytes=int(snaps),
                        scratch_bytes=int(scratch), n_heads=int(cfg.n_heads), n_kv_heads=int(cfg.n_kv_heads))


# ---- the manager ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Die:
    """One device as the manager sees it; `device` is the JAX device (None for a test's fake die)."""

    id: int
    budget_bytes: int
    platform: str = "cpu"
    kind: str = "cpu"
    budget_source: str = "host"  # "memory_stats" | "PANTHEON_DIE_BUDGET_MB" | "host" | "given"
    device: Any = field(default=None, compare=False)

    @property
    def host_backed(self) -> bool:
        """Its memory is the host's RAM (no memory_stats): counted against the host total too."""
        return self.budget_source != "memory_stats" and self.platform == "cpu"


@dataclass(frozen=True)
class Binding:
    instance_id: str
    name: str
    dies: tuple[int, ...]
    bytes_per_die: int


def _device_budget(device: Any, die_budget_mb: int, host_total: int) -> tuple[int, str]:
    try:
        stats = device.memory_stats() or {}
    except Exception:  # some backends raise instead of returning None
        stats = {}
    limit = int(stats.get("bytes_limit") or 0)
    if limit > 0:
        return limit, "memory_stats"
    if die_budget_mb > 0:
        return die_budget_mb * MiB, "PANTHEON_DIE_BUDGET_MB"
    return host_total, "host"


class DieManager:
    """Budgets, bound bytes and resident models of every die; thread-safe, never blocks for long."""

    def __init__(self, dies: Sequence[Die], host_limit_bytes: int | None = None):
        if not dies:
            raise ValueError("a die manager needs at least one die")
        self._dies: tuple[Die, ...] = tuple(sorted(dies, key=lambda d: d.id))
        self._by_id = {d.id: d for d in self._dies}
        if len(self._by_id) != len(self._dies):
            raise ValueError("die ids must be unique")
        # Host RAM shared by host-backed dies (None: no joint check, e.g. a test's fake dies).
        self.host_limit_bytes = host_limit_bytes
        # _lock guards _bindings (and so every die's used bytes, which are derived from it). Invariant:
        # for each die, the sum of bytes_per_die over bindings listing it is <= its budget, and over
        # host-backed dies together <= host_limit_bytes -- except after `resize` records a measured
        # size larger than the estimate (logged). Held for bookkeeping only, never across I/O.
        self._lock = osthread.Lock()
        self._bindings: dict[str, Binding] = {}

    @classmethod
    def from_jax(cls, settings: Any = None, devices: Sequence[Any] | None = None) -> "DieManager":
        """Every JAX device (or `devices`) as a die; budgets per the module docstring."""
        import jax
        import psutil
        devs = list(devices) if devices is not None else list(jax.devices())
        host_total = int(psutil.virtual_memory().total)
        mb = int(getattr(settings, "die_budget_mb", 0) or 0)
        dies = []
        for i, d in enumerate(devs):
            budget, source = _device_budget(d, mb, host_total)
            dies.append(Die(id=i, budget_bytes=budget, platform=d.platform,
                            kind=str(getattr(d, "device_kind", d.platform)), budget_source=source, device=d))
        host_limit = host_total if any(d.host_backed for d in dies) else None
        return cls(dies, host_limit_bytes=host_limit)

    # ---- reading (lock held briefly) --------------------------------------------------------------
    @property
    def dies(self) -> tuple[Die, ...]:
        return self._dies

    def __len__(self) -> int:
        return len(self._dies)

    def die(self, die_id: int) -> Die:
        return self._by_id[die_id]

    def die_ids_of(self, devices: Sequence[Any]) -> list[int]:
        """The die ids of JAX devices (a Model's `devices`)."""
        out = []
        for dev in devices:
            found = next((d.id for d in self._dies if d.device is dev or d.device == dev), None)
            out.append(found if found is not None else int(getattr(dev, "id", 0)))
        return out

    def _used_locked(self) -> dict[int, int]:
        used = {d.id: 0 for d in self._dies}
        for b in self._bindings.values():
            for d in b.dies:
                used[d] = used.get(d, 0) + b.bytes_per_die
        return used

    def used_bytes(self, die_id: int | None = None) -> int | dict[int, int]:
        """Bytes bound on one die, or {die id: bytes} for all."""
        with self._lock:
            used = self._used_locked()
        return used if die_id is None else used.get(die_id, 0)

    def usage(self) -> list[tuple[Die, int]]:
        """(die, used bytes) for every die, read in one go (MemWatch's fallback for stat-less dies)."""
        with self._lock:
            used = self._used_locked()
        return [(d, used[d.id]) for d in self._dies]

    def bindings(self) -> list[Binding]:
        with self._lock:
            return list(self._bindings.values())

    def snapshot(self) -> list[dict]:
        """One dict per die for GET /admin/dies."""
        with self._lock:
            used = self._used_locked()
            binds = list(self._bindings.values())
        out = []
        for d in self._dies:
            out.append({
                "id": d.id, "die": d.id,  # "die": the key docs/http-api.md and the registry already use
                "platform": d.platform, "kind": d.kind,
                "budget_bytes": d.budget_bytes, "budget_source": d.budget_source,
                "used_bytes": used[d.id], "free_bytes": max(0, d.budget_bytes - used[d.id]),
                "models": [{"name": b.name, "instance_id": b.instance_id, "bytes": b.bytes_per_die}
                           for b in binds if d.id in b.dies],
            })
        return out

    # ---- placement -------------------------------------------------------------------------------
    def estimate_load_bytes(self, source: Any, opts: Any = None) -> LoadEstimate:
        return estimate_load_bytes(source, opts, self._dies[0].platform)

    def _check_ids(self, dies: Sequence[int]) -> tuple[int, ...]:
        ids = tuple(int(d) for d in dies)
        bad = [d for d in ids if d not in self._by_id]
        if bad:
            raise RequestError(f"no such die(s) {bad}; this host has {len(self._dies)} "
                               f"({', '.join(str(d.id) for d in self._dies)})", param="dies", status=400,
                               code="invalid_dies")
        if len(set(ids)) != len(ids):
            raise RequestError(f"dies {list(ids)} lists a die twice", param="dies", status=400, code="invalid_dies")
        return ids

    def _fit_locked(self, ids: tuple[int, ...], per_die: int, used: dict[int, int]) -> None:
        """Raise InsufficientMemoryError unless `per_die` more bytes fit on every die in `ids`."""
        for d in ids:
            free = self._by_id[d].budget_bytes - used.get(d, 0)
            if per_die > free:
                raise InsufficientMemoryError(
                    f"model needs about {per_die / MiB:.1f} MiB on die {d}, which has {max(0, free) / MiB:.1f} "
                    f"MiB free of {self._by_id[d].budget_bytes / MiB:.1f} MiB", per_die, max(0, free), d)
        if self.host_limit_bytes is not None:
            host_ids = [d for d in ids if self._by_id[d].host_backed]
            if host_ids:
                host_used = sum(u for i, u in used.items() if self._by_id[i].host_backed)
                free = self.host_limit_bytes - host_used
                need = per_die * len(host_ids)
                if need > free:
                    raise InsufficientMemoryError(
                        f"model needs about {need / MiB:.1f} MiB of host memory (dies {host_ids} share it), "
                        f"{max(0, free) / MiB:.1f} MiB of {self.host_limit_bytes / MiB:.1f} MiB is free",
                        need, max(0, free), None)

    def _place_locked(self, est: LoadEstimate, dies: Sequence[int] | None, n_dies: int,
                      used: dict[int, int]) -> tuple[tuple[int, ...], int]:
        if dies:
            ids = self._check_ids(dies)
        else:
            n = max(1, int(n_dies))
            if n > len(self._dies):
                raise RequestError(f"{n} dies asked for; this host has {len(self._dies)}", param="dies",
                                   status=400, code="invalid_dies")
            # The emptiest dies first (most free budget; lower id on ties), so models spread out.
            order = sorted(self._dies, key=lambda d: (-(d.budget_bytes - used[d.id]), d.id))
            ids = tuple(sorted(d.id for d in order[:n]))
        per = est.per_die(len(ids))
        self._fit_locked(ids, per, used)
        return ids, per

    def place(self, estimate: LoadEstimate | int, dies: Sequence[int] | None = None, n_dies: int = 1) -> list[int]:
        """The dies a model of `estimate` should go on: `dies` checked against their free budget, or
        the `n_dies` emptiest ones. Reserves nothing (use `reserve` to place and bind atomically).

        Raises InsufficientMemoryError (507) when it does not fit, RequestError (400) for bad ids.
        """
        est = _as_estimate(estimate)
        with self._lock:
            ids, _ = self._place_locked(est, dies, n_dies, self._used_locked())
        return list(ids)

    def reserve(self, instance_id: str, name: str, estimate: LoadEstimate | int,
                dies: Sequence[int] | None = None, n_dies: int = 1) -> list[int]:
        """place + bind under one lock hold, so two concurrent loads cannot both take the last bytes."""
        est = _as_estimate(estimate)
        with self._lock:
            if instance_id in self._bindings:
                raise ValueError(f"instance {instance_id!r} is already bound")
            ids, per = self._place_locked(est, dies, n_dies, self._used_locked())
            self._bindings[instance_id] = Binding(instance_id, name, ids, per)
        log.info("dies %s reserved %.1f MiB each for %r (%s)", list(ids), per / MiB, name, instance_id)
        return list(ids)

    def bind(self, instance_id: str, name: str, dies: Sequence[int], bytes_per_die: int) -> None:
        """Record `bytes_per_die` on each of `dies` for an instance; 507 if it no longer fits (nothing
        is recorded then)."""
        with self._lock:
            if instance_id in self._bindings:
                raise ValueError(f"instance {instance_id!r} is already bound")
            ids = self._check_ids(dies)
            if not ids:
                raise RequestError("bind needs at least one die", param="dies", status=400, code="invalid_dies")
            self._fit_locked(ids, int(bytes_per_die), self._used_locked())
            self._bindings[instance_id] = Binding(instance_id, name, ids, int(bytes_per_die))

    def resize(self, instance_id: str, bytes_per_die: int) -> bool:
        """Replace an instance's estimate by its measured size after the load (never refused: the bytes
        already exist). False if the instance is not bound."""
        with self._lock:
            b = self._bindings.get(instance_id)
            if b is None:
                return False
            self._bindings[instance_id] = Binding(b.instance_id, b.name, b.dies, int(bytes_per_die))
            used = self._used_locked()
            over = [d for d in b.dies if used[d] > self._by_id[d].budget_bytes]
        if over:
            log.warning("instance %s measured %.1f MiB per die; dies %s are now over budget",
                        instance_id, bytes_per_die / MiB, over)
        return True

    def unbind(self, instance_id: str) -> bool:
        """Free an instance's bytes (call once its weights and state are really gone)."""
        with self._lock:
            return self._bindings.pop(instance_id, None) is not None
