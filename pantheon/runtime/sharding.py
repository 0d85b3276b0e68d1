"""Tensor-parallel placement of one model over several dies: a 1-D mesh and a spec per parameter.

Why a table of rules keyed by the parameter's name rather than per-architecture code: the params
dataclasses of every arch file name their matrix fields the same way (wq/wk/wv/wo, w_gate/w_up/w_down,
the *_e expert stacks, the sh_* shared expert), always stored (out, in) on the last two axes after
any stacking axes (layers, or groups x per-group). So one rule set covers llama/mistral/qwen2/qwen3/
qwen3moe/mixtral/phi3/gemma3 and the attention + FFN parts of the qwen35 hybrids; anything it does
not name is replicated.

The layout is the classic Megatron split:
- column-parallel (rows of an (out, in) matrix split by head / FFN column): wq (by query head), wk and
  wv (by kv head), their biases, w_gate / w_up (and the shared expert's);
- row-parallel (the contracting `in` axis split): wo, w_down, sh_down; XLA inserts one all-reduce;
- MoE expert stacks [.., E, out, in] split over experts when E divides by the die count, else over
  their FFN columns like a dense FFN;
- the KV cache [L, S, K, C, D] split over kv heads (axis K) when K divides, else replicated;
- embeddings, head, norms, router, recurrent state: replicated.

A split that does not align with heads (heads not divisible by the die count) is not used: the
weight is replicated instead. Correctness never depends on the choice — the mesh uses Auto axes
(GSPMD), so any layout computes the same function; the rules only decide where the bytes live and
which collectives XLA inserts. jax 0.10's `make_mesh` defaults to Explicit axes, on which a
row-parallel matmul raises ShardingTypeError (jax-cpu-findings Q6), hence the explicit Auto.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from pantheon.ops.weights import MappedStack, QuantWeight, drop_file_pages, put_leaf

AXIS = "tp"

# Leaf name -> (axis to split, which count must divide by the die count for the split to be head-aligned)
_COLUMN = {"wq": "heads", "bq": "heads", "wk": "kv_heads", "bk": "kv_heads", "wv": "kv_heads", "bv": "kv_heads",
           "w_gate": "dim", "w_up": "dim", "sh_gate": "dim", "sh_up": "dim"}
_ROW = {"wo": "heads", "w_down": "dim", "sh_down": "dim"}
_EXPERTS = {"w_gate_e": -2, "w_up_e": -2, "w_down_e": -1}  # fallback FFN axis when E does not divide
_BIASES = ("bq", "bk", "bv")  # 1-D per layer: the output axis is the last one
KV_KEYS = ("k", "v")
# A QuantWeight's own array fields: a path into a weight is named after the weight, not "data".
# So are a LayerStack's groups: `.layers.wq.groups[1].data` is "wq" (its arrays carry a leading layer axis),
# and a MappedStack's (`.layers.wq.groups[0].file`, `.units`).
_WEIGHT_FIELDS = frozenset(f.name for cls in (QuantWeight, MappedStack) for f in dataclasses.fields(cls)
                           if f.metadata.get("pytree_node", True)) | {"groups"}


def make_mesh(devices: Sequence[Any]) -> Mesh:
    """A 1-D tensor-parallel mesh over `devices`, Auto-typed (GSPMD propagation)."""
    return Mesh(np.asarray(list(devices), dtype=object), (AXIS,), axis_types=(AxisType.Auto,))


def leaf_name(path: tuple) -> str:
    """The innermost field name on a tree path: the params and caches are flax.struct dataclasses, so
    a leaf's name is its `GetAttrKey` (a dict key is accepted too). Tuple indices (the per-layer
    weights) and stacking axes do not matter: `.layers.wq[3]` is "wq", and so is the path of that
    weight's own array, `.layers.wq[3].data`."""
    for k in reversed(path):
        if isinstance(k, jax.tree_util.GetAttrKey):
            if k.name in _WEIGHT_FIELDS:
                continue
            return k.name
        if isinstance(k, jax.tree_util.DictKey) and isinstance(k.key, str):
            return k.key
    return ""


def _spec(ndim: int, axis: int) -> PartitionSpec:
    parts: list[str | None] = [None] * ndim
    parts[axis] = AXIS
    return PartitionSpec(*parts)


def param_spec(name: str, shape: tuple[int, ...], cfg: Any, n: int) -> PartitionSpec:
    """The PartitionSpec of one parameter leaf called `name` with `shape`, for `n` dies."""
    ndim = len(shape)
    if n <= 1 or ndim == 0:
        return PartitionSpec()

    def aligned(kind: str, size: int) -> bool:
        if size % n:
            return False
        if kind == "heads":
            return int(getattr(cfg, "n_heads", 0) or 0) % n == 0
        if kind == "kv_heads":
            return int(getattr(cfg, "n_kv_heads", 0) or 0) % n == 0
        return True

    if name in _COLUMN:
        axis = -1 if name in _BIASES else -2
        if ndim >= (1 if name in _BIASES else 2) and aligned(_COLUMN[name], shape[axis]):
            return _spec(ndim, ndim + axis)
        return PartitionSpec()
    if name in _ROW:
        if ndim >= 2 and aligned(_ROW[name], shape[-1]):
            return _spec(ndim, ndim - 1)
        return PartitionSpec()
    if name in _EXPERTS and ndim >= 3:
        if shape[-3] % n == 0:
            return _spec(ndim, ndim - 3)
        ax = _EXPERTS[name]
        if shape[ax] % n == 0:
            return _spec(ndim, ndim + ax)
    return PartitionSpec()


def weight_spec(name: str, w: QuantWeight, cfg: Any, n: int) -> PartitionSpec:
    """The spec of a weight's stored array: its logical shape's rule, kept only where every shard
    holds whole blocks (a split of the inner axis must cut K into multiples of the block's weights)."""
    spec = param_spec(name, w.shape, cfg, n)
    parts = tuple(spec) + (None,) * (len(w.shape) - len(tuple(spec)))
    if parts and parts[-1] is not None and (w.cols // n) % w.fmt.block_weights:
        return PartitionSpec()
    return spec


def state_spec(name: str, shape: tuple[int, ...], n: int) -> PartitionSpec:
    """KV [L, S, K, C, D] split over K when divisible; every other state leaf replicated."""
    if n > 1 and name in KV_KEYS and len(shape) == 5 and shape[2] % n == 0:
        return _spec(5, 2)
    return PartitionSpec()


class ShardPlan:
    """Where each leaf of one model's params and state lives on a mesh of its dies.

    Built from the devices and the config only (cheap and deterministic), so the loader and the Model
    can each build one and get equal shardings.
    """

    def __init__(self, devices: Sequence[Any], cfg: Any):
        self.devices = list(devices)
        self.cfg = cfg
        self.n = len(self.devices)
        self.mesh = make_mesh(self.devices)
        self.replicated = NamedSharding(self.mesh, PartitionSpec())
        # Multi-process (pantheon.serving.distributed): some dies belong to other processes. Every array is then
        # a global one this process holds only its shards of; see put_params and wrap_forward.
        self.multiprocess = any(d.process_index != jax.process_index() for d in self.devices)

    def _named(self, spec: PartitionSpec) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    def param_shardings(self, params: Any) -> Any:
        """A NamedSharding per leaf of `params` (numpy, jax or ShapeDtypeStruct leaves; a quantized
        weight's blocks get the spec of its logical shape, when the split falls on block boundaries)."""
        def one(p: tuple, x: Any) -> Any:
            if isinstance(x, QuantWeight):
                return x.replace(data=self._named(weight_spec(leaf_name(p), x, self.cfg, self.n)))
            return self._named(param_spec(leaf_name(p), tuple(np.shape(x)), self.cfg, self.n))

        return jax.tree_util.tree_map_with_path(one, params, is_leaf=lambda x: isinstance(x, QuantWeight))

    def state_shardings(self, state: Any) -> Any:
        return jax.tree_util.tree_map_with_path(
            lambda p, x: self._named(state_spec(leaf_name(p), tuple(np.shape(x)), self.n)), state)

    def put_params(self, host_params: Any) -> Any:
        """device_put every host leaf straight into its shards (no full copy lands on one die first)."""
        shardings = self.param_shardings(host_params)
        put = _put_global if self.multiprocess else put_leaf
        return jax.tree.map(lambda x, s: None if x is None else put(x, s), host_params, shardings)

    def state_initializer(self, init: Callable[[], Any]) -> Callable[[], Any]:
        """A function building the state directly in its shards (`init` under jit with the state's
        out_shardings). Made once per model: a fresh jit per call would recompile every new state."""
        return jax.jit(init, out_shardings=self.state_shardings(jax.eval_shape(init)))

    def constrain_state(self, state: Any) -> Any:
        """Inside a jitted step: pin the returned state to the layout it came in with, so every step's
        output is a valid input of the same compiled program (a layout drift would recompile)."""
        return jax.tree.map(jax.lax.with_sharding_constraint, state, self.state_shardings(state))

    def wrap_forward(self, fn: Callable[..., tuple[Any, Any, Any]]) -> Callable[..., tuple[Any, Any, Any]]:
        """`fn(params, state, ...) -> (last, every, state)` with the new state's layout pinned."""

        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> tuple[Any, Any, Any]:
            last, every, state = fn(*args, **kwargs)
            if self.multiprocess:  # every process samples (and the leader reads) its own full copy of the logits
                last = jax.lax.with_sharding_constraint(last, self.replicated)
                every = None if every is None else jax.lax.with_sharding_constraint(every, self.replicated)
            return last, every, self.constrain_state(state)

        return wrapped

    def describe(self, params: Any) -> dict[str, str]:
        """Leaf path -> spec string: what an operator (or a test) sees of the split."""
        out: dict[str, str] = {}
        for path, x in jax.tree_util.tree_leaves_with_path(params, is_leaf=lambda v: isinstance(v, QuantWeight)):
            name = leaf_name(path)
            spec = (weight_spec(name, x, self.cfg, self.n) if isinstance(x, QuantWeight)
                    else param_spec(name, tuple(np.shape(x)), self.cfg, self.n))
            out[jax.tree_util.keystr(path)] = str(spec)
        return out


def _put_global(host: Any, sharding: NamedSharding) -> Any:
    """A global array over a multi-process mesh from a host leaf every process can read (the mmapped
    file): each process slices out only the shards of its own dies, so no process reads the rest."""
    a = host if isinstance(host, np.ndarray) else np.asarray(host)  # a memmap stays a view of the file
    out = jax.make_array_from_callback(tuple(a.shape), sharding, lambda idx: np.ascontiguousarray(a[idx]))
    if a.size:  # the shards are copies: once made, the file pages they read leave our RSS
        out.block_until_ready()
        drop_file_pages(a)
    return out


def shard_bytes(params: Any, cfg: Any, n: int) -> int:
    """Bytes one die holds of `params` when split over `n` dies (replicated leaves count in full)."""
    total = 0
    for path, x in jax.tree_util.tree_leaves_with_path(params, is_leaf=lambda v: isinstance(v, QuantWeight)):
        if isinstance(x, QuantWeight):
            size, spec = x.nbytes, weight_spec(leaf_name(path), x, cfg, n)
        else:
            shape = tuple(np.shape(x))
            size = int(np.prod(shape, dtype=np.int64)) * np.dtype(getattr(x, "dtype", np.float32)).itemsize
            spec = param_spec(leaf_name(path), shape, cfg, n)
        total += size // n if any(s is not None for s in spec) else size
    return total
