"""Weights as the file stores them: the quantized weight type, the one matmul, and their placement.

Why weights stay in their GGUF blocks: a decode step streams every weight once, so its cost is the
weights' bytes, and a Q4_K matrix is 1/7 of its f32 expansion. A 7B Q4_K_M file (4.7 GB) must load
in about 5 GB, not 30. So a matrix lives on its die as `QuantWeight`: the file's bytes (uint8 blocks
[..., rows, row_bytes], or an F16/BF16/F32 array) plus its format, and it is only ever multiplied
by `linear` (rows of an embedding by `embed`). Those two functions are the one place that decides
how a weight meets an activation:

* the native CPU kernels (pantheon.ops.native) read the blocks directly, every format, when the weight
  sits whole on one CPU die and the kernels are built;
* anywhere else (several dies, GPU, no compiler) the blocks are expanded inside the jitted step
  with integer ops and the scale (`quant_formats.expand`), which XLA fuses with the dot, in the
  step's compute dtype (bf16 on GPU).

Which of the two a weight takes is decided once, at placement (`place`, from the `Kernels` the
engine chose), and recorded in the weight's static fields: it is part of the parameters' pytree
structure, hence of every jit cache key. No context variable, no name sniffing.

Placement never widens a block: a tensor goes from the memory-mapped file to the device as its
bytes. On CPU `jax.device_put` aliases a 64-byte-aligned host array instead of copying it, so an
aligned tensor is served straight from the file mapping (its pages are the page cache's, as with
llama.cpp's mmap); a misaligned one (GGUF aligns tensors to 32 bytes, so in a file whose data
section starts at 32 mod 64 every tensor is) is copied once, the copy awaited, and the file pages
it read dropped from this process (`MADV_DONTNEED`), so the load's peak stays at about the file's
size plus one tensor.
"""

from __future__ import annotations

import logging
import math
import mmap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from pantheon.ops import native, quant_formats
from pantheon.ops.quant_formats import FORMATS

log = logging.getLogger(__name__)

# A weight's `kernel` when the native kernels multiply it -> the form of its product (native.DOTS).
NATIVE_KERNELS = {"native": "exact", "native-int8": "int8"}
WEIGHT_MAJOR_ROWS = 8  # from this many rows XLA's product is formed weight-major (see linear)
_ALIGN = 64  # XLA:CPU aliases host buffers aligned to this many bytes (and copies the others)


@struct.dataclass
class QuantWeight:
    """A matrix (or a stack of matrices on leading axes) in its file format.

    `data` is the only leaf: uint8 blocks [..., rows, row_bytes] for block formats, or an array
    [..., rows, cols] of the float format's dtype. The rest is static (part of the treedef):
    `qtype` the GGUF type name, `cols` the logical inner dimension, `kernel` "native" when the
    CPU kernels multiply it (one die, kernels built; "native-int8" in their int8 form), else "xla", and `compute` the dtype name
    XLA expands it to.
    """

    data: Any
    qtype: str = struct.field(pytree_node=False)
    cols: int = struct.field(pytree_node=False)
    kernel: str = struct.field(pytree_node=False, default="xla")
    compute: str = struct.field(pytree_node=False, default="float32")

    @property
    def fmt(self) -> quant_formats.Format:
        return FORMATS[self.qtype]

    @property
    def rows(self) -> int:
        return int(self.data.shape[-2])

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape: leading axes, rows, cols."""
        return tuple(int(d) for d in self.data.shape[:-1]) + (self.cols,)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.data.shape, dtype=np.int64)) * np.dtype(self.data.dtype).itemsize

    def expand(self, dtype: Any = None) -> jax.Array:
        """The weights as an array [..., rows, cols] (inside a step: XLA's path)."""
        return quant_formats.expand(self.data, self.qtype, self.cols, dtype or jnp.dtype(self.compute))

    def at(self, index: Any) -> "QuantWeight":
        """The matrices at `index` of the leading axes (a layer of a stack, an expert)."""
        return self.replace(data=self.data[index])


Weight = QuantWeight | jax.Array


def linear(x: jax.Array, w: "Weight | LayerView", b: jax.Array | None = None,
           skip: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    """y = x @ W.T (+ b) for W stored (out, in): the one place a weight meets an activation.

    `w` is a weight, a plain array, or one layer of a `LayerStack` (a `LayerView`: the stack and a
    traced layer index), which the native kernels read in place.
    `skip`: flattened rows [first, end) of x whose products nobody reads (a prefill chunk's padding);
    the native kernels leave them out (zeros), XLA's forms compute them anyway.
    XLA's path: from WEIGHT_MAJOR_ROWS rows on the product is formed weight-major (w @ x.T, then
    transposed): XLA:CPU's GEMM runs 1.3-1.9x faster that way at 8 rows for the SmolLM2 FFN and
    fused QKV shapes (measured), while one row stays a plain matrix-vector product.
    """
    if isinstance(w, LayerView):
        y = _stacked_linear(x, w.stack, w.index, skip)
        if b is not None:
            y = y + b.astype(jnp.float32)
        return y.astype(x.dtype)
    if not isinstance(w, QuantWeight):  # a plain array (tests, small heads): stored f32/bf16
        w = QuantWeight(data=w, qtype=_float_name(w.dtype), cols=int(w.shape[-1]))
    rows = math.prod(x.shape[:-1])
    if w.kernel in NATIVE_KERNELS and native.weight_matmul_applies(rows, w.cols, w.data, w.qtype):
        y = native.weight_matmul(x, w.data, w.qtype, skip, dot=NATIVE_KERNELS[w.kernel])
    else:
        wf = w.expand()
        if rows >= WEIGHT_MAJOR_ROWS:
            y = jnp.moveaxis(jnp.einsum("oi,...i->o...", wf, x.astype(wf.dtype), preferred_element_type=jnp.float32),
                             0, -1)
        else:
            y = jnp.einsum("...i,oi->...o", x.astype(wf.dtype), wf, preferred_element_type=jnp.float32)
    if b is not None:
        y = y + b.astype(jnp.float32)
    return y.astype(x.dtype)


def _stacked_linear(x: jax.Array, w: QuantWeight, index: jax.Array,
                    skip: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    """f32 x @ w[index].T for a stack w [E, out, in]: in place where the native kernels serve it.

    Any other path slices matrix `index` out: on a GPU the slice fuses into the expansion that feeds
    the dot (the matrix is read once); on XLA:CPU it is a copy of one matrix.
    """
    rows = math.prod(x.shape[:-1])
    if (w.kernel in NATIVE_KERNELS and w.qtype != "F32"
            and native.stacked_matmul_applies(rows, w.cols, w.data, w.qtype)):
        return native.weight_matmul(x, w.data, w.qtype, skip, index=index, dot=NATIVE_KERNELS[w.kernel])
    return linear(x, LayerView(stack=w, index=index).matrix(), None, skip).astype(jnp.float32)


def linear_at(x: jax.Array, w: "QuantWeight | LayerView", index: jax.Array,
              skip: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    """`linear(x, w.at(index))` for a stack of matrices w [E, out, in] (an MoE layer's experts).

    The native kernels read matrix `index` of the stack in place; any other path slices it out
    (a copy of one matrix's bytes, which a dynamic slice costs in XLA). `w` may be one layer of a
    stack of expert stacks (a `LayerView` of [L, E, out, in]): expert `index` of that layer.
    """
    if isinstance(w, LayerView):
        w, index = w.flat_experts(index)
    return _stacked_linear(x, w, index, skip).astype(x.dtype)


# ---- weights stacked over layers ---------------------------------------------------------------------
@struct.dataclass
class LayerView:
    """Layer `index` (traced) of a stack [n, ...] of one format: what a layer's body multiplies with.

    Nothing is sliced when the view is made: `linear` passes the stack and the index to the native
    kernels, which read the layer where it lies. It answers the questions a QuantWeight does
    (`shape`, `qtype`, `compute`, `expand`, `at`) for the layer's matrix (or stack of experts).
    """

    stack: QuantWeight
    index: Any

    @property
    def qtype(self) -> str:
        return self.stack.qtype

    @property
    def compute(self) -> str:
        return self.stack.compute

    @property
    def kernel(self) -> str:
        return self.stack.kernel

    @property
    def cols(self) -> int:
        return self.stack.cols

    @property
    def shape(self) -> tuple[int, ...]:
        return self.stack.shape[1:]

    def matrix(self) -> QuantWeight:
        """The layer's weight sliced out of the stack (XLA's paths: a copy on CPU, fused on GPU)."""
        return self.stack.replace(data=jax.lax.dynamic_index_in_dim(self.stack.data, self.index, 0, keepdims=False))

    def expand(self, dtype: Any = None) -> jax.Array:
        return self.matrix().expand(dtype)

    def flat_experts(self, expert: jax.Array) -> tuple[QuantWeight, jax.Array]:
        """The stack [n, E, out, in] seen as [n * E, out, in] (a reshape, no copy) and the flat index
        of expert `expert` of this layer."""
        data = self.stack.data
        n_e = int(data.shape[1])
        flat = self.stack.replace(data=data.reshape((data.shape[0] * n_e,) + tuple(data.shape[2:])))
        return flat, jnp.asarray(self.index, jnp.int32) * n_e + jnp.asarray(expert, jnp.int32)

    def at(self, index: Any) -> QuantWeight:
        """Matrix `index` of this layer's stack of experts (sliced out: XLA's paths)."""
        flat, i = self.flat_experts(index)
        return flat.at(i)


@struct.dataclass
class LayerStack:
    """One kind of matrix (wq, w_down, an MoE layer's experts...) of every layer, stacked by format.

    Why: a layer loop (`lax.scan`) must reach layer l's matrix without a branch per layer, or every
    step program grows with depth (trace, lowering, compile time and the programs' memory all did:
    a 28-layer file compiled 14x what a 2-layer one did). Layers of one file need not share a format
    (a Q4_K_M file keeps some ffn_down / attn_v in Q6_K), so the layers are grouped by format:
    `groups[g]` is a stack [n_g, ...] of the layers stored in that format, and layer l is entry
    `index_in[l]` of group `group_of[l]` (both static). A body picks its layer with `layer(li)`:
    one branch per *format*, never per layer.
    """

    groups: tuple[QuantWeight, ...]
    group_of: tuple[int, ...] = struct.field(pytree_node=False)
    index_in: tuple[int, ...] = struct.field(pytree_node=False)

    def __len__(self) -> int:
        return len(self.group_of)

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape of one layer's weight."""
        return self.groups[0].shape[1:]

    def every(self, first: int, step: int) -> "LayerStack":
        """Layers first, first + step, ... (a hybrid's layers of one kind): the same buffers, re-indexed."""
        return self.replace(group_of=self.group_of[first::step], index_in=self.index_in[first::step])

    def host_layer(self, layer: int) -> QuantWeight:
        """Layer `layer`'s weight, sliced on the host (tests, load-time checks)."""
        return self.groups[self.group_of[layer]].at(self.index_in[layer])


def layer_stack(parts: Sequence[QuantWeight]) -> LayerStack:
    """Per-layer weights (views of the file) as a LayerStack, each format's layers copied once into
    one aligned buffer (the file pages read are dropped from this process as they are copied)."""
    keys: list[tuple] = []
    members: dict[tuple, list[int]] = {}
    for i, p in enumerate(parts):
        key = (p.qtype, tuple(p.data.shape), str(p.data.dtype), p.kernel, p.compute)
        if key not in members:
            keys.append(key)
            members[key] = []
        members[key].append(i)
    group_of = [0] * len(parts)
    index_in = [0] * len(parts)
    groups = []
    for g, key in enumerate(keys):
        for j, i in enumerate(members[key]):
            group_of[i], index_in[i] = g, j
        groups.append(stack([parts[i] for i in members[key]]))
    return LayerStack(groups=tuple(groups), group_of=tuple(group_of), index_in=tuple(index_in))


def _is_layer_tuple(x: Any) -> bool:
    return isinstance(x, tuple) and len(x) > 0 and all(isinstance(w, QuantWeight) for w in x)


def stack_layers(params: Any) -> Any:
    """Every per-layer tuple of weights in `params` as a LayerStack (the engine's form of a model)."""
    return jax.tree.map(lambda x: layer_stack(x) if _is_layer_tuple(x) else x, params,
                        is_leaf=lambda x: _is_layer_tuple(x) or isinstance(x, QuantWeight))


PerLayer = "LayerStack | Sequence[QuantWeight] | QuantWeight | jax.Array"


def with_layer(stacks: Sequence[Any], index: jax.Array | int, fn: Callable[..., Any], *operands: Any) -> Any:
    """fn(*operands, *views): views[i] is layer `index` of stacks[i], read in place.

    stacks[i] is a LayerStack (one branch per combination of the stacks' formats: at most a few,
    whatever the depth), a tuple of per-layer weights (one branch per layer: host params built by
    hand, kept for tests), or one weight used by every layer.
    """
    stacks = tuple(stacks)
    if any(isinstance(s, (tuple, list)) for s in stacks):
        n = max(len(s) for s in stacks if isinstance(s, (tuple, list)))
        pick = [lambda *ops, i=i: fn(*ops, *(s[i] if isinstance(s, (tuple, list)) else s for s in stacks))
                for i in range(n)]
        return pick[0](*operands) if n == 1 else jax.lax.switch(index, pick, *operands)
    if not any(isinstance(s, LayerStack) for s in stacks):
        return fn(*operands, *stacks)
    combos: list[tuple[int, ...]] = []
    per_layer: list[int] = []
    layered = [s for s in stacks if isinstance(s, LayerStack)]
    for t in zip(*(s.group_of for s in layered)):
        if t not in combos:
            combos.append(t)
        per_layer.append(combos.index(t))
    index = jnp.asarray(index, jnp.int32)

    def branch(combo: tuple[int, ...]) -> Callable[..., Any]:
        def run(*ops: Any) -> Any:
            it = iter(combo)
            views = []
            for s in stacks:
                if isinstance(s, LayerStack):
                    g = next(it)
                    views.append(LayerView(stack=s.groups[g], index=jnp.asarray(s.index_in, jnp.int32)[index]))
                else:
                    views.append(s)
            return fn(*ops, *views)
        return run

    if len(combos) == 1:
        return branch(combos[0])(*operands)
    return jax.lax.switch(jnp.asarray(per_layer, jnp.int32)[index], [branch(c) for c in combos], *operands)


def embed(w: Weight, ids: jax.Array) -> jax.Array:
    """Rows `ids` of an embedding table, expanded to f32: only the gathered rows are widened."""
    if not isinstance(w, QuantWeight):
        return w[ids].astype(jnp.float32)
    return quant_formats.expand_rows(w.data, ids, w.qtype, w.cols, jnp.float32)


def _float_name(dtype: Any) -> str:
    return {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}[jnp.dtype(dtype).name]


# ---- host side: building weights from the file ---------------------------------------------------
def host_weight(data: np.ndarray, qtype: str, cols: int) -> QuantWeight:
    """A weight whose data is a host array in storage form (a view of the file where possible)."""
    return QuantWeight(data=data, qtype=qtype, cols=int(cols))


def dense(a: np.ndarray) -> QuantWeight:
    """A float matrix (an HF checkpoint's, a test's) as a weight of its own float format."""
    a = np.asarray(a)
    if a.dtype not in (np.float32, np.float16, jnp.bfloat16):
        a = a.astype(np.float32)
    return host_weight(a, _float_name(a.dtype), a.shape[-1])


def _root(a: np.ndarray) -> np.ndarray:
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def row_slice(w: QuantWeight, lo: int, hi: int) -> QuantWeight:
    """Rows [lo, hi) of a 2-D weight: a view (rows are runs of whole blocks)."""
    return w.replace(data=w.data[..., lo:hi, :])


def take_rows(w: QuantWeight, idx: Sequence[int] | np.ndarray) -> QuantWeight:
    """The rows `idx` of a 2-D weight, in that order (a copy of their bytes)."""
    return w.replace(data=np.ascontiguousarray(np.asarray(w.data)[np.asarray(idx, np.int64)]))


def concat_rows(parts: Sequence[QuantWeight]) -> QuantWeight | None:
    """One weight whose rows are the parts' rows in order, or None when the parts' formats differ.

    Why fuse at all: matrices that read the same input run as one product (one kernel call, the
    input read once). When the parts lie back to back in the file (ffn_gate then ffn_up in most
    GGUFs) the result is a view of the file, not a copy.
    """
    first = parts[0]
    if any(p.qtype != first.qtype or p.cols != first.cols or p.data.ndim != 2 for p in parts):
        return None
    arrays = [np.asarray(p.data) for p in parts]
    root = _root(arrays[0])
    contiguous = all(a.flags.c_contiguous and _root(a) is root for a in arrays) and all(
        arrays[i].ctypes.data + arrays[i].nbytes == arrays[i + 1].ctypes.data for i in range(len(arrays) - 1))
    if contiguous and root.ndim == 1 and root.dtype == np.uint8:
        start = arrays[0].ctypes.data - root.ctypes.data
        total = sum(a.nbytes for a in arrays)
        view = root[start: start + total].view(arrays[0].dtype).reshape(-1, arrays[0].shape[1])
        return first.replace(data=view)
    return first.replace(data=_copy_into(aligned_empty((sum(a.shape[0] for a in arrays),) + arrays[0].shape[1:],
                                                       arrays[0].dtype), arrays, axis=0))


def stack(parts: Sequence[QuantWeight]) -> QuantWeight:
    """The parts stacked on a new leading axis (layers), copied once into one aligned buffer."""
    first = parts[0]
    bad = [p.qtype for p in parts if p.qtype != first.qtype or p.data.shape != first.data.shape]
    if bad:
        raise ValueError(f"cannot stack weights of formats {sorted({first.qtype, *bad})} / differing shapes")
    arrays = [np.asarray(p.data) for p in parts]
    out = aligned_empty((len(arrays),) + arrays[0].shape, arrays[0].dtype)
    for i, a in enumerate(arrays):
        out[i] = a
        drop_file_pages(a)
    return first.replace(data=out)


def aligned_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialised host array whose data is 64-byte aligned, so the device can alias it."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(n + _ALIGN, np.uint8)
    off = (-raw.ctypes.data) % _ALIGN
    return raw[off: off + n].view(dtype).reshape(shape)


def _copy_into(out: np.ndarray, arrays: Sequence[np.ndarray], axis: int) -> np.ndarray:
    pos = 0
    for a in arrays:
        out[pos: pos + a.shape[axis]] = a
        pos += a.shape[axis]
        drop_file_pages(a)
    return out


def drop_file_pages(a: Any) -> None:
    """Tell the kernel this process no longer needs the file pages under `a` (when `a` is a view of
    a memory-mapped file): they stay in the page cache but leave this process's RSS. Harmless for
    other views of the same pages (they fault back in from the cache when read)."""
    if not isinstance(a, np.ndarray):
        return
    root = _root(a)
    mm = getattr(root, "_mmap", None)
    if mm is None or not hasattr(mm, "madvise"):
        return
    page = mmap.PAGESIZE
    start = a.ctypes.data - root.ctypes.data + int(getattr(root, "offset", 0) or 0)
    lo = -(-start // page) * page
    hi = (start + a.nbytes) // page * page
    if hi > lo:
        try:
            mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
        except (OSError, ValueError):
            pass


# ---- placement -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Kernels:
    """Which kernels a model's steps use: decided once at load (engine), static in every step.

    matmul: the native CPU weight products (one CPU die, library built); attention: the native
    decode attention over the slot cache; compute: the dtype XLA expands weights to; dot: which form
    of the native products a quantized weight takes (recorded in its `kernel`: NATIVE_KERNELS).
    """

    matmul: bool = False
    attention: bool = False
    compute: str = "float32"
    dot: str = "exact"  # the native quantized products' form: "exact" or "int8" (pantheon.ops.native.DOTS)


XLA = Kernels()  # XLA's forms only: the default of every forward


def is_weight(x: Any) -> bool:
    return isinstance(x, QuantWeight)


def stamp(params: Any, kernels: Kernels) -> Any:
    """Every weight of `params` marked with the kernel that multiplies it and XLA's compute dtype.

    A float F32 matrix is narrowed to BF16 when the step computes in bf16 (GPU), as the f32 loader
    did: otherwise every step would re-cast it.
    """
    def one(w: Any) -> Any:
        if not is_weight(w):
            return w
        if kernels.compute == "bfloat16" and w.qtype == "F32" and w.data.ndim >= 2:
            w = w.replace(data=np.asarray(w.data).astype(jnp.bfloat16), qtype="BF16")
        kernel = "xla"
        if kernels.matmul and w.qtype in native.NATIVE_FORMATS:
            kernel = "native-int8" if kernels.dot == "int8" and w.qtype in native.INT8_FORMATS else "native"
        return w.replace(kernel=kernel, compute=kernels.compute)

    return jax.tree.map(one, params, is_leaf=is_weight)


def put_leaf(a: Any, target: Any) -> Any:
    """One host leaf onto `target` (a device or a sharding); a file page it copied leaves our RSS."""
    if a is None:
        return None
    host = np.asarray(a)
    out = jax.device_put(host, target)
    if isinstance(host, np.ndarray) and host.size:
        try:
            aliased = out.unsafe_buffer_pointer() == host.ctypes.data
        except Exception:  # sharded or non-CPU: always a copy
            aliased = False
        if not aliased:  # a copy, made asynchronously: wait for it, then drop the pages it read
            out.block_until_ready()
            drop_file_pages(host)
    return out


def place(params: Any, target_for: Callable[[tuple, Any], Any]) -> Any:
    """Every leaf of host `params` onto its device (`target_for(path, leaf)` -> device or sharding)."""
    return jax.tree_util.tree_map_with_path(lambda p, a: put_leaf(a, target_for(p, a)), params)


def device_bytes(qtype: str, shape: Sequence[int], compute: str = "float32", matrix: bool = True) -> int:
    """Bytes a tensor of logical `shape` stored as `qtype` in the file takes on its die.

    The one rule the loader follows and the load estimate (pantheon.serving.dies) reads: a format of
    quant_formats.FORMATS stays as it is (F32 matrices narrow to BF16 on a bf16 die); any other type
    is expanded to F32 at load; vectors are F32.
    """
    n = int(np.prod(shape, dtype=np.int64)) if len(shape) else 1
    if not matrix or len(shape) < 2:
        return n * 4
    if qtype == "F32" and compute == "bfloat16":
        return n * 2
    if qtype in FORMATS and int(shape[-1]) % FORMATS[qtype].block_weights == 0:
        return quant_formats.nbytes(qtype, tuple(int(d) for d in shape))
    return n * 4


def tree_bytes(params: Any) -> int:
    """Bytes of every array in `params` (weights at their storage size)."""
    return int(sum(int(x.nbytes) for x in jax.tree.leaves(params) if hasattr(x, "nbytes")))


def pick_linear(ws: Any, index: jax.Array | int, x: jax.Array, b: jax.Array | None = None,
                skip: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    """`linear(x, ws[index], b)` for per-layer weights inside a layer loop (see `with_layer`)."""
    return with_layer((ws,), index, lambda v, w: linear(v, w, b, skip), x)
