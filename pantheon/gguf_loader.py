"""GGUF → (ModelConfig, dequantized numpy tensors).

The loader reads a memory-mapped GGUF with `gguf.GGUFReader`, turns its metadata into a frozen
`ModelConfig`, and hands architecture files a `TensorSource` that dequantizes on demand with
`gguf.quants.dequantize`. Every failure (unknown arch, missing tensor, wrong shape, truncated file)
becomes a `ModelLoadError` naming the file, so callers never see a raw traceback or keep a
half-built model.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from .errors import ModelLoadError
from .gguf_meta import open_reader, read_metadata

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
}


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
        """f32 K and V for every layer: what one more token of context costs."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * 4


class TensorSource:
    """Named tensors of an open GGUF, dequantized to float32 on request with shape checks."""

    def __init__(self, path: Path, reader: gguf.GGUFReader):
        self.path = path
        self._tensors = {t.name: t for t in reader.tensors}

    def has(self, name: str) -> bool:
        return name in self._tensors

    def names(self) -> list[str]:
        return list(self._tensors)

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

    def blocks(self, name: str, formats: Collection[str]) -> tuple[str, np.ndarray] | None:
        """(format, raw blocks [rows, bytes per row]) of a matrix stored in one of `formats`, else None.

        For kernels that read GGUF's block formats directly (pantheon.native); a view of the file.
        """
        t = self._tensors.get(name)
        if t is None or t.tensor_type.name not in formats or len(t.shape) != 2 or t.data.ndim != 2:
            return None
        return t.tensor_type.name, t.data

    def get_optional(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray | None:
        return self.get(name, shape) if self.has(name) else None


def _check_data_extent(path: Path, reader: gguf.GGUFReader) -> None:
    """A truncated file still parses its header; make sure every tensor's bytes are really there."""
    size = path.stat().st_size
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise ModelLoadError(path, f"truncated: tensor {t.name!r} ends at byte {end}, file has {size}")


def _scalar(meta: dict[str, Any], key: str, default: Any = None, required: bool = False, path: Path | None = None) -> Any:
    if key not in meta:
        if required:
            raise ModelLoadError(path or "?", f"missing metadata key {key!r}")
        return default
    val = meta[key]
    if isinstance(val, list):  # per-layer arrays: the llama family uses one value for all layers
        if not val:
            return default
        if len(set(val)) != 1:
            raise ModelLoadError(path or "?", f"per-layer values for {key!r} are not supported: {val[:8]}...")
        return val[0]
    return val


def config_from_metadata(path: Path, meta: dict[str, Any], tensors: TensorSource) -> ModelConfig:
    """ModelConfig for an arch the engine knows; ModelLoadError otherwise."""
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelLoadError(path, "missing general.architecture")
    if arch not in _ROPE_TYPES:
        raise ModelLoadError(path, f"unsupported architecture {arch!r} (known: {', '.join(sorted(_ROPE_TYPES))})")
    p = f"{arch}."
    n_layers = int(_scalar(meta, p + "block_count", required=True, path=path))
    hidden = int(_scalar(meta, p + "embedding_length", required=True, path=path))
    n_heads = int(_scalar(meta, p + "attention.head_count", required=True, path=path))
    n_kv = int(_scalar(meta, p + "attention.head_count_kv", n_heads, path=path))
    head_dim = int(_scalar(meta, p + "attention.key_length", hidden // n_heads, path=path))
    ffn = int(_scalar(meta, p + "feed_forward_length", 0, path=path))
    vocab = meta.get(p + "vocab_size")
    if vocab is None:
        toks = meta.get("tokenizer.ggml.tokens")
        if toks:
            vocab = len(toks)
        elif tensors.has("token_embd.weight"):
            vocab = int(tensors._tensors["token_embd.weight"].shape[-1])
        else:
            raise ModelLoadError(path, "cannot determine vocabulary size")
    if tensors.has("token_embd.weight"):
        # The converter may truncate the embedding to the tokenizer's real size; trust the tensor.
        vocab = int(tensors._tensors["token_embd.weight"].shape[-1])
    eps = float(_scalar(meta, p + "attention.layer_norm_rms_epsilon", 1e-5, path=path))
    scale_type = meta.get(p + "rope.scaling.type", "none")
    scale = float(meta.get(p + "rope.scaling.factor", 1.0) or 1.0)
    if scale_type not in ("none", "linear") and scale != 1.0:
        raise ModelLoadError(path, f"rope scaling type {scale_type!r} is not supported yet")
    attn_scale = meta.get(p + "attention.scale")
    n_experts = int(_scalar(meta, p + "expert_count", 0, path=path))
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
        rope_base=float(_scalar(meta, p + "rope.freq_base", 10000.0, path=path)),
        n_rot=int(_scalar(meta, p + "rope.dimension_count", head_dim, path=path)),
        rope_type=_ROPE_TYPES[arch],
        context_length=int(_scalar(meta, p + "context_length", 2048, path=path)),
        attn_scale=float(attn_scale) if attn_scale else head_dim ** -0.5,
        rope_scale=scale if scale_type == "linear" else 1.0,
        tied_output=not tensors.has("output.weight"),
        qk_norm=tensors.has("blk.0.attn_q_norm.weight"),
        qkv_bias=tensors.has("blk.0.attn_q.bias"),
        n_experts=n_experts,
        n_experts_used=int(_scalar(meta, p + "expert_used_count", 0, path=path)),
        expert_ffn=int(_scalar(meta, p + "expert_feed_forward_length", 0, path=path)),
        sliding_window=int(_scalar(meta, p + "attention.sliding_window", 0, path=path)),
        name=str(meta.get("general.name", path.stem)),
        rope_base_swa=float(_scalar(meta, p + "rope.freq_base_swa", 0.0, path=path)),
        rope_orig_context=int(_scalar(meta, p + "rope.scaling.original_context_length", 0, path=path)),
        rope_attn_factor=float(_scalar(meta, p + "rope.scaling.attn_factor", 1.0, path=path) or 1.0),
        attn_softcap=float(_scalar(meta, p + "attn_logit_softcapping", 0.0, path=path) or 0.0),
        final_softcap=float(_scalar(meta, p + "final_logit_softcapping", 0.0, path=path) or 0.0),
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
    reader = open_reader(p)
    _check_data_extent(p, reader)
    meta = read_metadata(reader)
    tensors = TensorSource(p, reader)
    cfg = config_from_metadata(p, meta, tensors)
    return GGUFFile(path=p, meta=meta, config=cfg, tensors=tensors)
