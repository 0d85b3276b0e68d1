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

Per-layer matrices are stacked over the layers (`LayerStack`, so a step's program does not grow with
depth). Where the native kernels multiply them on one CPU die, a stack is not a copy: it is the whole
file's mapping (aliased: the mapping starts on a page) plus where each layer's tensor starts
(`MappedStack`), so a load copies none of its layers and a served weight is a page-cache page.
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
    if isinstance(w, MappedStack):
        return w.linear(x, index, skip)
    if (w.kernel in NATIVE_KERNELS and w.qtype != "F32"
            and native.stacked_matmul_applies(rows, w.cols, w.data, w.qtype)):
        return native.weight_matmul(x, w.data, w.qtype, skip, index=index, dot=NATIVE_KERNELS[w.kernel])
    return linear(x, LayerView(stack=w, index=index).matrix(), None, skip).astype(jnp.float32)


def linear_at(x: jax.Array, w: "QuantWeight | LayerView", index: Any,
              skip: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    """`linear(x, w.at(index))` for a stack of matrices w [E, out, in] (an MoE layer's experts).

    The native kernels read matrix `index` of the stack in place; any other path slices it out
    (a copy of one matrix's bytes, which a dynamic slice costs in XLA). `w` may be one layer of a
    stack of expert stacks (a `LayerView` of [L, E, out, in]): expert `index` of that layer.
    """
    if isinstance(w, LayerView) and isinstance(w.stack, MappedStack):
        return w.stack.linear(x, w.index, skip, matrix=index).astype(x.dtype)
    if isinstance(w, LayerView):
        w, index = w.flat_experts(index)
    return _stacked_linear(x, w, index, skip).astype(x.dtype)


# ---- weights stacked over layers ---------------------------------------------------------------------
@struct.dataclass
class MappedStack:
    """n same-shaped tensors of one format that stay where they lie in the mapped model file.

    Why: stacking a kind of matrix over the layers (what a depth-independent layer loop needs) by
    copying the layers into one buffer costs a copy of the whole file at every start (8.6 of a 7B
    file's 9.6 s load) and makes the weights anonymous memory instead of the page cache's (a 20 GB
    file then barely fits a 24 GB machine). The native kernels need neither: they are handed the whole
    file (`file`, uint8 [units, native.FILE_UNIT], aliased from the mapping, one buffer for every
    stack of the model) and where member i starts (`units[i]`, in FILE_UNIT bytes; traced, so the
    program is the same whatever the layout or depth). Only block formats multiplied by the native
    kernels on one CPU die take this form (`layer_stack` decides); XLA's paths keep copied stacks.
    """

    file: Any
    units: Any
    qtype: str = struct.field(pytree_node=False)
    cols: int = struct.field(pytree_node=False)
    member: tuple[int, ...] = struct.field(pytree_node=False)  # one member's data shape: [..., rows, row_bytes]
    kernel: str = struct.field(pytree_node=False, default="native")
    compute: str = struct.field(pytree_node=False, default="float32")

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape: members, then one member's leading axes, rows, cols."""
        return (int(self.units.shape[0]),) + tuple(self.member[:-1]) + (self.cols,)

    @property
    def member_bytes(self) -> int:
        return int(np.prod(self.member, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        """The members' bytes (the file they lie in is shared and counted by none)."""
        return int(self.units.shape[0]) * self.member_bytes

    def linear(self, x: jax.Array, index: jax.Array, skip: tuple[jax.Array, jax.Array] | None = None,
               matrix: Any = 0) -> jax.Array:
        """f32 x @ W.T for W matrix `matrix` (an expert; 0 for a layer's one matrix) of member `index`."""
        return native.mapped_matmul(x, self.file, self.qtype, int(self.member[-2]),
                                    jnp.asarray(self.units)[index], matrix, skip, dot=NATIVE_KERNELS[self.kernel])

    def at(self, index: Any) -> QuantWeight:
        """Member `index` as a weight of its own (host tests, XLA's fallbacks: a copy of its bytes)."""
        n = self.member_bytes
        if isinstance(self.file, np.ndarray) and isinstance(index, (int, np.integer)):
            start = int(np.asarray(self.units)[index]) * native.FILE_UNIT
            data = self.file.reshape(-1)[start: start + n].reshape(self.member)
        else:
            rows = -(-n // native.FILE_UNIT)
            u = jnp.asarray(self.units)[index]
            data = jax.lax.dynamic_slice_in_dim(self.file, u, rows, 0).reshape(-1)[:n].reshape(self.member)
        return QuantWeight(data=data, qtype=self.qtype, cols=self.cols, kernel=self.kernel, compute=self.compute)


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
        if isinstance(self.stack, MappedStack):
            return self.stack.at(self.index)
        return self.stack.replace(data=jax.lax.dynamic_index_in_dim(self.stack.data, self.index, 0, keepdims=False))

    def expand(self, dtype: Any = None) -> jax.Array:
        return self.matrix().expand(dtype)

    def flat_experts(self, expert: jax.Array) -> tuple[QuantWeight, jax.Array]:
        """The stack [n, E, out, in] seen as [n * E, out, in] (a reshape, no copy) and the flat index
        of expert `expert` of this layer (a mapped stack: this layer's experts, sliced out)."""
        if isinstance(self.stack, MappedStack):
            return self.matrix(), jnp.asarray(expert, jnp.int32)
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

    groups: tuple["QuantWeight | MappedStack", ...]
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


def layer_stack(parts: Sequence[QuantWeight], files: dict[int, np.ndarray] | None = None) -> LayerStack:
    """Per-layer weights (views of the file) as a LayerStack: a format's layers stay in the file
    (`MappedStack`) where the native kernels read them, else are copied once into one aligned buffer
    (the file pages read are dropped from this process as they are copied). `files`: the file views
    made so far (one per mapped file, shared by every stack of a model)."""
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
        members_ = [parts[i] for i in members[key]]
        groups.append(mapped_stack(members_, files if files is not None else {}) or stack(members_))
    return LayerStack(groups=tuple(groups), group_of=tuple(group_of), index_in=tuple(index_in))


def _is_layer_tuple(x: Any) -> bool:
    return isinstance(x, tuple) and len(x) > 0 and all(isinstance(w, QuantWeight) for w in x)


def stack_layers(params: Any) -> Any:
    """Every per-layer tuple of weights in `params` as a LayerStack (the engine's form of a model)."""
    files: dict[int, np.ndarray] = {}
    return jax.tree.map(lambda x: layer_stack(x, files) if _is_layer_tuple(x) else x, params,
                        is_leaf=lambda x: _is_layer_tuple(x) or isinstance(x, QuantWeight))


def mapped_stack(parts: Sequence[QuantWeight], files: dict[int, np.ndarray]) -> MappedStack | None:
    """`parts` as a MappedStack, or None where they cannot stay in the file: not multiplied by the
    native kernels, not a block format, not views of one mapped file whose mapping the device can
    alias (64-byte aligned), or a member not on a FILE_UNIT boundary or past the file's last whole unit."""
    first = parts[0]
    fmt = FORMATS.get(first.qtype)
    if first.kernel not in NATIVE_KERNELS or fmt is None or not fmt.is_block or first.data.ndim not in (2, 3):
        return None
    arrays = [p.data for p in parts]
    if not all(isinstance(a, np.ndarray) and a.dtype == np.uint8 and a.flags.c_contiguous for a in arrays):
        return None
    root = _root(arrays[0])
    if (getattr(root, "_mmap", None) is None or root.ndim != 1 or root.dtype != np.uint8
            or root.ctypes.data % _ALIGN or any(_root(a) is not root for a in arrays)):
        return None
    unit = native.FILE_UNIT
    view = files.get(id(root))
    if view is None:
        view = files[id(root)] = root[: root.size // unit * unit].reshape(-1, unit)
    starts = [a.ctypes.data - root.ctypes.data for a in arrays]
    if any(s % unit or s + a.nbytes > view.size for s, a in zip(starts, arrays)):
        return None
    return MappedStack(file=view, units=np.asarray([s // unit for s in starts], np.int32), qtype=first.qtype,
                       cols=first.cols, member=tuple(int(d) for d in first.data.shape), kernel=first.kernel,
                       compute=first.compute)


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
    """Every leaf of host `params` onto its device (`target_for(path, leaf)` -> device or sharding).
    A host array that is several leaves (a mapped file, shared by every MappedStack) goes once."""
    placed: dict[tuple[int, int], Any] = {}

    def one(path: tuple, a: Any) -> Any:
        target = target_for(path, a)
        if not isinstance(a, np.ndarray):
            return put_leaf(a, target)
        key = (id(a), id(target))
        if key not in placed:
            placed[key] = (a, put_leaf(a, target))  # the host array is kept so its id is not reused
        return placed[key][1]
    return jax.tree_util.tree_map_with_path(one, params)


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
    """Bytes of every array in `params` (weights at their storage size; a mapped stack counts its
    members' bytes, not the file they share)."""
    leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, MappedStack))
    return int(sum(int(x.nbytes) for x in leaves if hasattr(x, "nbytes")))


def pick_linear(ws: Any, index: jax.Array | int, x: jax.Array, b: jax.Array | None = None,
                skip: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    """`linear(x, ws[index], b)` for per-layer weights inside a layer loop (see `with_layer`)."""
    return with_layer((ws,), index, lambda v, w: linear(v, w, b, skip), x)
