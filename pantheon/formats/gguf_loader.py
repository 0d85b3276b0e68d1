"""GGUF → (ModelConfig, tensors as the file stores them).

The loader reads a memory-mapped GGUF with `gguf_reader.open_reader` (a header parser of our own:
gguf's reader takes 20-45 s over a 150k-token vocabulary), turns its metadata into a frozen
`ModelConfig`, and hands architecture files a `TensorSource`: matrices come out as views of the
mapped file in their own format (`matrix`, a pantheon.ops.weights.QuantWeight), small vectors as f32
(`get`, via `gguf.quants.dequantize`). Every failure (unknown arch, missing tensor, wrong shape, truncated file)
becomes a `ModelLoadError` naming the file, so callers never see a raw traceback or keep a
half-built model.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gguf
import jax.numpy as jnp
import numpy as np

from pantheon.ops import quant_formats
from pantheon.errors import ModelLoadError
from pantheon.formats.gguf_reader import open_reader, read_metadata
from pantheon.ops.quant_formats import FORMATS

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from pantheon.ops.weights import QuantWeight

ROPE_NORM = "norm"  # adjacent pairs (x[2i], x[2i+1]); GGUF llama after the converter's Q/K permute
ROPE_NEOX = "neox"  # rotate-half pairs (x[i], x[i + n_rot/2])

# GGUF arch string -> RoPE pairing. Every arch the engine knows must appear here.
_ROPE_TYPES = {
    "llama": ROPE_NORM,
    "mistral": ROPE_NORM,
    "qwen2": ROPE_NEOX,
    "qwen3": ROPE_NEOX,
    "qwen3moe": ROPE_NEOX,
    "phi3": ROPE_NEOX,
    "gemma3": ROPE_NEOX,
    "qwen35": ROPE_NEOX,
    "qwen35moe": ROPE_NEOX,
    "qwen3next": ROPE_NEOX,
    "rwkv7": ROPE_NORM,  # no RoPE: recurrent (the entry only marks the arch as known)
}
# Archs without attention heads (head_count 0 in the file): their WKV heads stand in for them.
_WKV_ARCHS = frozenset({"rwkv7"})


@dataclass(frozen=True)
class ModelConfig:
    """Dimensions and hyper-parameters of one model, read once from the file."""

    arch: str
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    rms_eps: float
    rope_base: float
    n_rot: int
    rope_type: str
    context_length: int
    attn_scale: float
    rope_scale: float = 1.0  # linear position scaling factor (positions / rope_scale)
    tied_output: bool = False
    qk_norm: bool = False
    qkv_bias: bool = False
    n_experts: int = 0
    n_experts_used: int = 0
    expert_ffn: int = 0
    sliding_window: int = 0
    name: str = ""
    rope_base_swa: float = 0.0  # RoPE base of sliding-window layers (gemma3); 0 = the arch's own default
    rope_orig_context: int = 0  # pre-extension context: LongRoPE uses its long factors beyond it
    rope_attn_factor: float = 1.0  # LongRoPE multiplier of cos/sin
    attn_softcap: float = 0.0  # scores -> c*tanh(scores/c) when > 0 (Gemma 2 style)
    final_softcap: float = 0.0  # logits -> c*tanh(logits/c) when > 0
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def kv_bytes_per_token(self) -> int:
        """f32 K and V for every layer (the cache's own dtype scales it: engine.kv_itemsize)."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * 4


class TensorSource:
    """Named tensors of an open GGUF with shape checks: matrices as stored, vectors as float32."""

    def __init__(self, path: Path, reader: Any):  # gguf_reader.MappedGGUF (or a gguf.GGUFReader)
        self.path = path
        self._tensors = {t.name: t for t in reader.tensors}

    def has(self, name: str) -> bool:
        return name in self._tensors

    def names(self) -> list[str]:
        return list(self._tensors)

    def gguf_dims(self) -> dict[str, tuple[int, ...]]:
        """Tensor name -> dims in GGUF order (ne0 first), from the header: what a size estimate reads."""
        return {name: tuple(int(d) for d in t.shape) for name, t in self._tensors.items()}

    def type_ids(self) -> dict[str, int]:
        """Tensor name -> ggml type id, from the header."""
        return {name: int(t.tensor_type) for name, t in self._tensors.items()}

    def qtype(self, name: str) -> str:
        return self._tensors[name].tensor_type.name

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """Dequantized float32 array in numpy order ((out, in) for matrices)."""
        t = self._tensors.get(name)
        if t is None:
            raise ModelLoadError(self.path, f"missing tensor {name!r}")
        try:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as exc:
            raise ModelLoadError(self.path, f"tensor {name!r} has unsupported type {t.tensor_type.name}") from exc
        except Exception as exc:
            raise ModelLoadError(self.path, f"tensor {name!r} could not be read ({type(exc).__name__}: {exc}); "
                                            "the file may be truncated") from exc
        arr = np.asarray(arr, dtype=np.float32)
        logical = tuple(int(d) for d in reversed(t.shape))
        if arr.shape != logical:
            try:
                arr = arr.reshape(logical)
            except ValueError as exc:
                raise ModelLoadError(self.path, f"tensor {name!r} has {arr.size} values, header says {logical}") from exc
        if shape is not None and tuple(arr.shape) != tuple(shape):
            raise ModelLoadError(self.path, f"tensor {name!r} has shape {arr.shape}, expected {tuple(shape)}")
        return arr

    def matrix(self, name: str, shape: tuple[int, ...] | None = None) -> "QuantWeight":
        """A matrix (or expert stack) as the file stores it: a view of the mapped file, never widened.

        A type the engine cannot hold as it is (outside quant_formats.FORMATS, or rows that are no
        whole number of blocks) is dequantized to F32 here, with one log line naming it: that
        tensor costs 4 bytes a weight, the rest of the model is unaffected.
        """
        from pantheon.ops.weights import host_weight
        t = self._tensors.get(name)
        if t is None:
            raise ModelLoadError(self.path, f"missing tensor {name!r}")
        logical = tuple(int(d) for d in reversed(t.shape))
        if shape is not None and logical != tuple(shape):
            raise ModelLoadError(self.path, f"tensor {name!r} has shape {logical}, expected {tuple(shape)}")
        qtype = t.tensor_type.name
        fmt = FORMATS.get(qtype)
        if fmt is None or len(logical) < 2 or logical[-1] % fmt.block_weights:
            log.info("%s: tensor %s of type %s has no kernel; it is dequantized to F32 at load", self.path.name,
                     name, qtype)
            return host_weight(self.get(name, shape), "F32", logical[-1])
        want = quant_formats.storage_shape(qtype, logical)
        data = t.data
        if qtype == "BF16":
            data = data.view(np.uint16).view(jnp.bfloat16)
        if tuple(data.shape) != tuple(want):
            try:
                data = data.reshape(want)
            except ValueError as exc:
                raise ModelLoadError(self.path, f"tensor {name!r} holds {data.nbytes} bytes, its header needs "
                                                f"{quant_formats.nbytes(qtype, logical)}") from exc
        return host_weight(data, qtype, logical[-1])

    def qtype_and_dims(self, name: str) -> tuple[str, tuple[int, ...]] | None:
        """(type name, logical shape) of a tensor from its header, or None when absent."""
        t = self._tensors.get(name)
        if t is None:
            return None
        return t.tensor_type.name, tuple(int(d) for d in reversed(t.shape))

    def get_optional(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray | None:
        return self.get(name, shape) if self.has(name) else None


def _scalar(meta: dict[str, Any], key: str, default: Any = None, required: bool = False, path: Path | None = None) -> Any:
    if key not in meta:
        if required:
            raise ModelLoadError(path or "?", f"missing metadata key {key!r}")
        return default
    val = meta[key]
    if isinstance(val, list):  # per-layer arrays: the llama family uses one value for all layers
        if not val:
            return default
        try:
            distinct = len(set(val))
        except TypeError:  # unhashable items (nested arrays): not a per-layer value list
            distinct = 2
        if distinct != 1:
            raise ModelLoadError(path or "?", f"per-layer values for {key!r} are not supported: {val[:8]}...")
        return val[0]
    return val


def _int(meta: dict[str, Any], key: str, default: int | None = None, *, path: Path, lo: int = 0,
         hi: int = 1 << 32, required: bool = False) -> int:
    """An integer hyper-parameter in [lo, hi]; ModelLoadError naming the key otherwise.

    Why bounds at all: these values size the KV cache and the load estimate before any tensor is
    read, so a crafted 2**31 layers or heads would otherwise become a 507 for terabytes, a
    ZeroDivisionError or a MemoryError instead of saying the file is wrong.
    """
    val = _scalar(meta, key, default, required=required, path=path)
    if isinstance(val, bool) or not isinstance(val, int):
        if isinstance(val, float) and val.is_integer():
            val = int(val)
        else:
            raise ModelLoadError(path, f"metadata {key!r} = {val!r} is not an integer")
    if not lo <= val <= hi:
        raise ModelLoadError(path, f"metadata {key!r} = {val} is out of range [{lo}, {hi}]")
    return val


def _float(meta: dict[str, Any], key: str, default: float, *, path: Path, positive: bool = False) -> float:
    """A finite float hyper-parameter (strictly positive when `positive`); ModelLoadError otherwise."""
    val = _scalar(meta, key, default, path=path)
    if isinstance(val, bool) or not isinstance(val, (int, float)) or not math.isfinite(val):
        raise ModelLoadError(path, f"metadata {key!r} = {val!r} is not a finite number")
    if positive and val <= 0:
        raise ModelLoadError(path, f"metadata {key!r} = {val} must be positive")
    return float(val)


_MAX_LAYERS = 1 << 12
_MAX_WIDTH = 1 << 20  # hidden / ffn widths
_MAX_HEADS = 1 << 12
_MAX_HEAD_DIM = 1 << 14
_MAX_VOCAB = 1 << 24
_MAX_EXPERTS = 1 << 12
_BLOCK_RE = re.compile(r"blk\.(\d+)\.")


def _tensor_dims(tensors: TensorSource, name: str) -> tuple[int, ...] | None:
    """A tensor's dims in GGUF order (ne0 first), or None when absent."""
    if not tensors.has(name):
        return None
    return tuple(int(d) for d in tensors._tensors[name].shape)


def _check_against_tensors(path: Path, tensors: TensorSource, n_layers: int, hidden: int, n_heads: int,
                           n_kv: int, head_dim: int, fused_qkv: bool) -> None:
    """The metadata must describe the tensors: every layer present, the embedding as wide as the
    model, K projections (and phi3's fused QKV; the hybrids' attn_qkv is their DeltaNet input) as
    wide as the heads say. Checked from the tensor table alone (no data read), so the load estimate,
    which runs first, never sizes a cache from values the weights deny."""
    present = {int(m.group(1)) for n in tensors._tensors if (m := _BLOCK_RE.match(n))}
    missing = [i for i in range(min(n_layers, _MAX_LAYERS)) if i not in present]
    if missing:
        raise ModelLoadError(path, f"block_count is {n_layers} but the file has no tensors for layer(s) "
                                   f"{missing[:8]}{'...' if len(missing) > 8 else ''}")
    emb = _tensor_dims(tensors, "token_embd.weight")
    if emb is not None and (len(emb) != 2 or emb[0] != hidden):
        raise ModelLoadError(path, f"token_embd.weight has dims {list(emb)}, but embedding_length is {hidden}")
    for i in sorted(present):
        k = _tensor_dims(tensors, f"blk.{i}.attn_k.weight")
        if k is not None and (len(k) != 2 or k[1] != n_kv * head_dim):
            raise ModelLoadError(path, f"blk.{i}.attn_k.weight has dims {list(k)}, but {n_kv} KV heads of "
                                       f"{head_dim} need {n_kv * head_dim} outputs")
        qkv = _tensor_dims(tensors, f"blk.{i}.attn_qkv.weight") if fused_qkv else None
        if qkv is not None and (len(qkv) != 2 or qkv[1] != (n_heads + 2 * n_kv) * head_dim):
            raise ModelLoadError(path, f"blk.{i}.attn_qkv.weight has dims {list(qkv)}, but {n_heads} + 2 x {n_kv} "
                                       f"heads of {head_dim} need {(n_heads + 2 * n_kv) * head_dim} outputs")


def config_from_metadata(path: Path, meta: dict[str, Any], tensors: TensorSource) -> ModelConfig:
    """ModelConfig for an arch the engine knows; ModelLoadError otherwise.

    Every hyper-parameter is type- and range-checked and the shapes that size the cache are checked
    against the tensor table, so a lying file fails here with the key named, on the estimate's path
    (pantheon.serving.dies, header only) and the load's alike.
    """
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelLoadError(path, "missing general.architecture" if arch is None
                             else f"general.architecture is {type(arch).__name__}, not a string")
    if arch not in _ROPE_TYPES:
        raise ModelLoadError(path, f"unsupported architecture {arch!r} (known: {', '.join(sorted(_ROPE_TYPES))})")
    p = f"{arch}."
    n_layers = _int(meta, p + "block_count", required=True, path=path, lo=1, hi=_MAX_LAYERS)
    hidden = _int(meta, p + "embedding_length", required=True, path=path, lo=1, hi=_MAX_WIDTH)
    if arch in _WKV_ARCHS:  # head_count is 0 in these files: the WKV heads size the state
        head_dim = _int(meta, p + "wkv.head_size", required=True, path=path, lo=1, hi=_MAX_HEAD_DIM)
        if hidden % head_dim:
            raise ModelLoadError(path, f"{p}wkv.head_size {head_dim} does not divide embedding_length {hidden}")
        n_heads = n_kv = hidden // head_dim
    else:
        n_heads = _int(meta, p + "attention.head_count", required=True, path=path, lo=1, hi=_MAX_HEADS)
        n_kv = _int(meta, p + "attention.head_count_kv", n_heads, path=path, lo=1, hi=n_heads)
        if n_heads % n_kv:
            raise ModelLoadError(path, f"{n_heads} attention heads cannot share {n_kv} KV heads evenly "
                                       f"({p}attention.head_count_kv)")
        head_dim = _int(meta, p + "attention.key_length", max(1, hidden // n_heads), path=path, lo=1,
                        hi=_MAX_HEAD_DIM)
    ffn = _int(meta, p + "feed_forward_length", 0, path=path, hi=_MAX_WIDTH)
    vocab: Any = meta.get(p + "vocab_size")
    if vocab is None:
        toks = meta.get("tokenizer.ggml.tokens")
        if isinstance(toks, list) and toks:
            vocab = len(toks)
        elif tensors.has("token_embd.weight"):
            vocab = int(tensors._tensors["token_embd.weight"].shape[-1])
        else:
            raise ModelLoadError(path, "cannot determine vocabulary size")
    if tensors.has("token_embd.weight"):
        # The converter may truncate the embedding to the tokenizer's real size; trust the tensor.
        vocab = int(tensors._tensors["token_embd.weight"].shape[-1])
    if isinstance(vocab, bool) or not isinstance(vocab, int) or not 1 <= vocab <= _MAX_VOCAB:
        raise ModelLoadError(path, f"vocabulary size {vocab!r} is not in [1, {_MAX_VOCAB}]")
    _check_against_tensors(path, tensors, n_layers, hidden, n_heads, n_kv, head_dim, fused_qkv=arch == "phi3")
    eps = _float(meta, p + "attention.layer_norm_rms_epsilon", 1e-5, path=path, positive=True)
    scale_type = meta.get(p + "rope.scaling.type", "none")
    scale = _float(meta, p + "rope.scaling.factor", 1.0, path=path) or 1.0
    if scale_type not in ("none", "linear") and scale != 1.0:
        raise ModelLoadError(path, f"rope scaling type {scale_type!r} is not supported yet")
    if scale <= 0:
        raise ModelLoadError(path, f"metadata {p + 'rope.scaling.factor'!r} = {scale} must be positive")
    attn_scale = _float(meta, p + "attention.scale", 0.0, path=path)
    n_experts = _int(meta, p + "expert_count", 0, path=path, hi=_MAX_EXPERTS)
    n_experts_used = _int(meta, p + "expert_used_count", 0, path=path, hi=n_experts)
    if n_experts and not n_experts_used:
        raise ModelLoadError(path, f"{n_experts} experts but {p}expert_used_count is 0")
    n_rot = _int(meta, p + "rope.dimension_count", head_dim, path=path, lo=2, hi=head_dim)
    if n_rot % 2:
        raise ModelLoadError(path, f"metadata {p + 'rope.dimension_count'!r} = {n_rot} must be even "
                                   "(RoPE rotates pairs)")
    return ModelConfig(
        arch=arch,
        n_layers=n_layers,
        hidden=hidden,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        ffn=ffn,
        vocab=int(vocab),
        rms_eps=eps,
        rope_base=_float(meta, p + "rope.freq_base", 10000.0, path=path, positive=True),
        n_rot=n_rot,
        rope_type=_ROPE_TYPES[arch],
        context_length=_int(meta, p + "context_length", 2048, path=path),
        attn_scale=attn_scale if attn_scale else head_dim ** -0.5,
        rope_scale=scale if scale_type == "linear" else 1.0,
        tied_output=not tensors.has("output.weight"),
        qk_norm=tensors.has("blk.0.attn_q_norm.weight"),
        qkv_bias=tensors.has("blk.0.attn_q.bias"),
        n_experts=n_experts,
        n_experts_used=n_experts_used,
        expert_ffn=_int(meta, p + "expert_feed_forward_length", 0, path=path, hi=_MAX_WIDTH),
        sliding_window=_int(meta, p + "attention.sliding_window", 0, path=path),
        name=str(meta.get("general.name", path.stem)),
        rope_base_swa=_float(meta, p + "rope.freq_base_swa", 0.0, path=path),
        rope_orig_context=_int(meta, p + "rope.scaling.original_context_length", 0, path=path),
        rope_attn_factor=_float(meta, p + "rope.scaling.attn_factor", 1.0, path=path) or 1.0,
        attn_softcap=_float(meta, p + "attn_logit_softcapping", 0.0, path=path),
        final_softcap=_float(meta, p + "final_logit_softcapping", 0.0, path=path),
        # Every "{arch}.*" key with the prefix stripped, for arch files that need more than the
        # common fields (e.g. the hybrids' ssm.* sizes and attention.recurrent_layers).
        extra={k[len(p):]: v for k, v in meta.items() if k.startswith(p)},
    )


@dataclass
class GGUFFile:
    """An opened GGUF: its path, decoded metadata, config and tensor source."""

    path: Path
    meta: dict[str, Any]
    config: ModelConfig
    tensors: TensorSource


def open_gguf(path: str | Path) -> GGUFFile:
    p = Path(path).expanduser()
    reader = open_reader(p)  # also checks the tensor table against the file (gguf_reader.check_tensor_layout)
    meta = read_metadata(reader, p)
    tensors = TensorSource(p, reader)
    cfg = config_from_metadata(p, meta, tensors)
    return GGUFFile(path=p, meta=meta, config=cfg, tensors=tensors)
