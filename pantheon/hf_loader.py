"""HF safetensors checkpoints → the same (ModelConfig, tensor source) the GGUF path produces.

A checkpoint is a directory (``config.json`` + ``model.safetensors`` or shards listed in
``model.safetensors.index.json`` + ``tokenizer.json`` / ``tokenizer_config.json``), or one
``.safetensors`` file with its ``config.json`` given separately (``LoadOptions.config_path``).

Rather than a second set of parameter builders, the loader *impersonates a GGUF*: `SafetensorsSource`
answers GGUF tensor names (``blk.3.attn_q.weight``) from the HF tensors (``model.layers.3.self_attn.
q_proj.weight``) through one name table per architecture, and `config_from_hf` builds the ModelConfig
the GGUF metadata would have given. Every arch file's ``load_params`` then works unchanged.

Where the GGUF converter transforms a tensor we do the equivalent here instead:

* llama / mistral: the converter permutes Q/K rows so NORM RoPE applies; HF rows are in rotate-half
  order, so an HF llama simply gets ``rope_type = neox`` (every HF model is rotate-half).
* Llama 3.x ``rope_scaling`` (``llama3``) becomes the ``rope_freqs`` divisors the converter would
  write; Phi-3 LongRoPE becomes ``rope_factors_long/short`` plus ``rope_attn_factor``.

Tensors are memory-mapped with ``safetensors.safe_open(framework="numpy")`` and converted to float32
one at a time (BF16, which numpy lacks, is widened from its raw bits). Every failure is a
`ModelLoadError` naming the path.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .errors import ModelLoadError
from .gguf_loader import ROPE_NEOX, ModelConfig

# HF model_type -> GGUF arch string (the registry key of the arch file that runs it).
_ARCHS = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "phi3": "phi3",
}

# Per-arch name tables: GGUF per-layer stem -> HF stem under ``model.layers.{i}.``. A GGUF name
# ``blk.{i}.{stem}.{weight|bias}`` maps to ``model.layers.{i}.{hf stem}.{weight|bias}``.
_LLAMA_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_PHI3_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_up": "mlp.gate_up_proj",  # fused: first half gate, second half up (as in the GGUF)
    "ffn_down": "mlp.down_proj",
}
_LAYER_TABLES = {"llama": _LLAMA_LAYER, "qwen2": _LLAMA_LAYER, "qwen3": _LLAMA_LAYER, "phi3": _PHI3_LAYER}
_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)\.(weight|bias)")


def is_hf_checkpoint(path: Path, config_path: str | None = None) -> bool:
    """A directory, a .safetensors file, or any non-GGUF file given with an explicit config.json."""
    return path.is_dir() or path.suffix == ".safetensors" or (config_path is not None and path.suffix != ".gguf")


# ---- tensors -------------------------------------------------------------------------------------
def _bf16_to_f32(raw: np.ndarray) -> np.ndarray:
    """bfloat16 is the top half of a float32: widen the raw uint16 bits."""
    return (raw.astype(np.uint32) << 16).view(np.float32)


class _ShardFile:
    """One open .safetensors file: numpy tensors via safe_open, BF16 via its header offsets."""

    def __init__(self, path: Path):
        from safetensors import safe_open
        self.path = path
        try:
            self._handle = safe_open(str(path), framework="numpy")
            self.keys = set(self._handle.keys())
        except Exception as exc:
            raise ModelLoadError(path, f"not a readable safetensors file ({type(exc).__name__}: {exc})") from exc
        self._header: dict[str, Any] | None = None

    def dtype(self, key: str) -> str:
        return self._handle.get_slice(key).get_dtype()

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._handle.get_slice(key).get_shape())

    def get(self, key: str) -> np.ndarray:
        if self.dtype(key) != "BF16":
            return np.asarray(self._handle.get_tensor(key), dtype=np.float32)
        if self._header is None:
            with open(self.path, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                self._header = {"base": 8 + n, **json.loads(fh.read(n))}
        begin, end = self._header[key]["data_offsets"]
        raw = np.memmap(self.path, dtype=np.uint16, mode="r", offset=self._header["base"] + begin,
                        shape=((end - begin) // 2,))
        return _bf16_to_f32(np.asarray(raw)).reshape(self.shape(key))


class SafetensorsSource:
    """The TensorSource interface (has / get / names / qtype) over HF tensors, by GGUF name."""

    def __init__(self, path: Path, files: list[Path], arch: str, synthetic: dict[str, np.ndarray] | None = None):
        self.path = path
        self._layer_table = _LAYER_TABLES[arch]
        self._where: dict[str, _ShardFile] = {}
        for f in files:
            shard = _ShardFile(f)
            for k in shard.keys:
                self._where[k] = shard
        self._synthetic = dict(synthetic or {})

    def hf_name(self, name: str) -> str | None:
        """The HF tensor behind GGUF name `name`, or None when the table has no entry for it."""
        if name in _GLOBAL:
            return _GLOBAL[name]
        m = _BLOCK.fullmatch(name)
        if m is None or m.group(2) not in self._layer_table:
            return None
        return f"model.layers.{m.group(1)}.{self._layer_table[m.group(2)]}.{m.group(3)}"

    def has(self, name: str) -> bool:
        return name in self._synthetic or self.hf_name(name) in self._where

    def names(self) -> list[str]:
        hf_to_gguf = {}
        for name in _GLOBAL:
            hf_to_gguf[_GLOBAL[name]] = name
        for key in self._where:
            m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", key)
            if m:
                for stem, hf in self._layer_table.items():
                    if hf == m.group(2):
                        hf_to_gguf[key] = f"blk.{m.group(1)}.{stem}.{m.group(3)}"
        return sorted({hf_to_gguf[k] for k in self._where if k in hf_to_gguf} | set(self._synthetic))

    def qtype(self, name: str) -> str:
        if name in self._synthetic:
            return "F32"
        key = self.hf_name(name)
        return self._where[key].dtype(key) if key in self._where else "?"

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """float32 array in (out, in) order, the layout HF and GGUF-via-numpy share."""
        if name in self._synthetic:
            arr = self._synthetic[name]
        else:
            key = self.hf_name(name)
            if key is None or key not in self._where:
                raise ModelLoadError(self.path, f"missing tensor {name!r}" + (f" (HF {key!r})" if key else ""))
            try:
                arr = self._where[key].get(key)
            except Exception as exc:
                raise ModelLoadError(self.path, f"tensor {key!r} could not be read ({type(exc).__name__}: {exc})") from exc
        if shape is not None and tuple(arr.shape) != tuple(shape):
            raise ModelLoadError(self.path, f"tensor {name!r} has shape {arr.shape}, expected {tuple(shape)}")
        return arr

    def get_optional(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray | None:
        return self.get(name, shape) if self.has(name) else None

    def shape_of(self, name: str) -> tuple[int, ...] | None:
        key = self.hf_name(name)
        return self._where[key].shape(key) if key in self._where else None


# ---- config --------------------------------------------------------------------------------------
def _llama3_divisors(rp: dict[str, Any], base: float, n_rot: int) -> np.ndarray:
    """The per-pair divisors convert_hf_to_gguf writes as rope_freqs for rope_type llama3."""
    factor = float(rp.get("factor", 8.0))
    low, high = float(rp.get("low_freq_factor", 1.0)), float(rp.get("high_freq_factor", 4.0))
    orig = float(rp.get("original_max_position_embeddings", 8192))
    out = []
    for i in range(0, n_rot, 2):
        wavelen = 2 * math.pi * base ** (i / n_rot)
        if wavelen < orig / high:
            out.append(1.0)
        elif wavelen > orig / low:
            out.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def config_from_hf(path: Path, hf: dict[str, Any], src: SafetensorsSource) -> ModelConfig:
    """The ModelConfig the GGUF converter's metadata would give, plus synthetic rope tensors in `src`."""
    model_type = hf.get("model_type")
    arch = _ARCHS.get(model_type)
    if arch is None:
        raise ModelLoadError(path, f"unsupported HF model_type {model_type!r} (supported: {', '.join(sorted(_ARCHS))})")
    try:
        hidden, n_heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        n_layers = int(hf["num_hidden_layers"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(path, f"config.json lacks {exc}") from exc
    head_dim = int(hf.get("head_dim") or hidden // n_heads)
    # transformers 5 puts every rope setting in rope_parameters; 4.x used rope_theta + rope_scaling.
    rp = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    base = float(rp.get("rope_theta", hf.get("rope_theta", 10000.0)))
    n_rot = int(head_dim * float(rp.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))))
    rope_kind = rp.get("rope_type", rp.get("type")) or "default"
    max_pos = int(hf.get("max_position_embeddings", 2048))
    rope_scale, orig_ctx, attn_factor = 1.0, 0, 1.0
    if rope_kind == "linear":
        rope_scale = float(rp.get("factor", 1.0))
    elif rope_kind == "llama3":
        src._synthetic["rope_freqs.weight"] = _llama3_divisors(rp, base, n_rot)
    elif rope_kind == "longrope":
        orig_ctx = int(rp.get("original_max_position_embeddings") or hf.get("original_max_position_embeddings") or max_pos)
        src._synthetic["rope_factors_long.weight"] = np.asarray(rp["long_factor"], np.float32)
        src._synthetic["rope_factors_short.weight"] = np.asarray(rp["short_factor"], np.float32)
        scale = max_pos / orig_ctx
        attn_factor = float(rp.get("attention_factor") or
                            (math.sqrt(1 + math.log(scale) / math.log(orig_ctx)) if scale > 1 else 1.0))
    elif rope_kind != "default":
        raise ModelLoadError(path, f"rope type {rope_kind!r} is not supported yet")
    emb = src.shape_of("token_embd.weight")
    if emb is None:
        raise ModelLoadError(path, "missing tensor 'model.embed_tokens.weight'")
    return ModelConfig(
        arch=arch,
        n_layers=n_layers,
        hidden=hidden,
        n_heads=n_heads,
        n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
        head_dim=head_dim,
        ffn=int(hf.get("intermediate_size", 0)),
        vocab=int(emb[0]),
        rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_base=base,
        n_rot=n_rot,
        rope_type=ROPE_NEOX,  # HF checkpoints are rotate-half (no converter permutation)
        context_length=max_pos,
        attn_scale=head_dim ** -0.5,
        rope_scale=rope_scale,
        tied_output=not src.has("output.weight"),
        qk_norm=src.has("blk.0.attn_q_norm.weight"),
        qkv_bias=src.has("blk.0.attn_q.bias"),
        name=path.name,
        rope_orig_context=orig_ctx,
        rope_attn_factor=attn_factor,
    )


# ---- opening a checkpoint ------------------------------------------------------------------------
@dataclass
class HFCheckpoint:
    """An opened HF checkpoint, shaped like gguf_loader.GGUFFile (path, meta, config, tensors)."""

    path: Path
    meta: dict[str, Any]
    config: ModelConfig
    tensors: SafetensorsSource


def _weight_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except Exception as exc:
            raise ModelLoadError(index, f"unreadable shard index ({type(exc).__name__}: {exc})") from exc
        files = [path / s for s in shards]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise ModelLoadError(path, f"missing shard(s) {missing}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(path, "no .safetensors files in the directory")
    return files


def open_hf(path: str | Path, config_path: str | Path | None = None) -> HFCheckpoint:
    """Open a checkpoint directory, or one .safetensors file with `config_path` (default: beside it)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelLoadError(p, "no such file or directory")
    folder = p if p.is_dir() else p.parent
    cfg_file = Path(config_path).expanduser() if config_path else folder / "config.json"
    try:
        hf = json.loads(cfg_file.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ModelLoadError(p, f"no HF config at {cfg_file} (give LoadOptions.config_path)") from exc
    except Exception as exc:
        raise ModelLoadError(cfg_file, f"unreadable config.json ({type(exc).__name__}: {exc})") from exc
    arch = _ARCHS.get(hf.get("model_type"))
    if arch is None:
        raise ModelLoadError(p, f"unsupported HF model_type {hf.get('model_type')!r} "
                                f"(supported: {', '.join(sorted(_ARCHS))})")
    src = SafetensorsSource(p, _weight_files(p), arch)
    cfg = config_from_hf(p, hf, src)
    tok_dir = next((d for d in (cfg_file.parent, folder) if (d / "tokenizer.json").exists()), None)
    meta = {
        "general.architecture": cfg.arch,
        "general.name": cfg.name,
        "hf.config": hf,
        "hf.tokenizer_json": str(tok_dir / "tokenizer.json") if tok_dir else None,
        "hf.tokenizer_config_json": str(tok_dir / "tokenizer_config.json") if tok_dir else None,
    }
    return HFCheckpoint(path=p, meta=meta, config=cfg, tensors=src)


def tokenizer_and_template(path: Path, meta: dict[str, Any]):
    """Tokenizer from tokenizer.json (+ tokenizer_config.json), template from its chat_template."""
    from .chat_template import ChatTemplate
    from .tokenizer import Tokenizer
    if not meta.get("hf.tokenizer_json"):
        raise ModelLoadError(path, "no tokenizer.json beside the checkpoint or its config.json")
    cfg_json = meta.get("hf.tokenizer_config_json")
    tok = Tokenizer.from_hf_files(Path(meta["hf.tokenizer_json"]), Path(cfg_json) if cfg_json else None)
    return tok, ChatTemplate(tok.chat_template, tok.bos_token, tok.eos_token)
