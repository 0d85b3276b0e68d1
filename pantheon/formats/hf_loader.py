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
* Qwen3.5 (dense / MoE): ``+1`` on the (1 + w) norms, ``ssm_a = -exp(A_log)``, the grouped→tiled V-head
  reordering of every V-head-indexed tensor, the conv kernel squeezed, per-expert tensors stacked,
  and the ``ssm.*`` metadata qwen35.py reads from ``cfg.extra``.

The test that keeps this honest compares every tensor with the converter's own GGUF of the same model.

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
from typing import Any, Callable

import numpy as np

from pantheon.errors import ModelLoadError
from pantheon.formats.gguf_loader import ROPE_NEOX, ModelConfig

Transform = Callable[[np.ndarray], np.ndarray]

# HF model_type -> GGUF arch string (the registry key of the arch file that runs it).
_ARCHS = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "phi3": "phi3",
    "qwen3_5_text": "qwen35",
    "qwen3_5_moe_text": "qwen35moe",
}


@dataclass(frozen=True)
class _From:
    """Where one GGUF tensor comes from: an HF name under the layer (or model) prefix, a transform
    standing in for the converter's, and whether `{e}` in the name stacks experts on a new axis 0.
    A leading "/" means a top-level name (``lm_head.weight``), not one under the model prefix."""

    hf: str
    fn: Transform | None = None
    experts: bool = False


def _plus_one(a: np.ndarray) -> np.ndarray:
    """HF (1 + w) norms: the converter stores w + 1, which the arch files use directly."""
    return a + 1.0


def _grouped_to_tiled(a: np.ndarray, n_k: int, r: int, axis: int = 0) -> np.ndarray:
    """Reorder n_k*r V-head blocks along `axis` from HF's grouped order (head g*r + s belongs to
    k-head g) to the qwen35 GGUF's tiled order (head s*n_k + g): the converter's permutation."""
    a = np.moveaxis(a, axis, 0)
    out = a.reshape((n_k, r, -1) + a.shape[1:]).swapaxes(0, 1).reshape(a.shape)
    return np.moveaxis(out, 0, axis)


def _llama_layer(hf: dict[str, Any]) -> dict[str, tuple[_From, ...]]:
    table: dict[str, tuple[_From, ...]] = {
        "attn_norm.weight": (_From("input_layernorm.weight"),),
        "attn_q_norm.weight": (_From("self_attn.q_norm.weight"),),
        "attn_k_norm.weight": (_From("self_attn.k_norm.weight"),),
        "ffn_norm.weight": (_From("post_attention_layernorm.weight"),),
    }
    for gguf, ours in (("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"), ("attn_v", "self_attn.v_proj"),
                       ("attn_output", "self_attn.o_proj"), ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"),
                       ("ffn_down", "mlp.down_proj")):
        table[gguf + ".weight"] = (_From(ours + ".weight"),)
        table[gguf + ".bias"] = (_From(ours + ".bias"),)
    return table


def _phi3_layer(hf: dict[str, Any]) -> dict[str, tuple[_From, ...]]:
    return {
        "attn_norm.weight": (_From("input_layernorm.weight"),),
        "attn_qkv.weight": (_From("self_attn.qkv_proj.weight"),),  # rows Q, K, V as in the GGUF
        "attn_output.weight": (_From("self_attn.o_proj.weight"),),
        "ffn_norm.weight": (_From("post_attention_layernorm.weight"),),
        "ffn_up.weight": (_From("mlp.gate_up_proj.weight"),),  # first half gate, second half up
        "ffn_down.weight": (_From("mlp.down_proj.weight"),),
    }


def _qwen35_layer(hf: dict[str, Any]) -> dict[str, tuple[_From, ...]]:
    """Qwen3.5 (dense and MoE): the converter's +1 norms, -exp(A_log) and V-head reordering."""
    n_k, n_v = int(hf["linear_num_key_heads"]), int(hf["linear_num_value_heads"])
    r, key_dim = n_v // n_k, n_k * int(hf["linear_key_head_dim"])
    F = int(hf.get("moe_intermediate_size") or 0)

    def tiled(axis: int = 0) -> Transform:
        return lambda a: _grouped_to_tiled(a, n_k, r, axis)

    def qkv(a: np.ndarray) -> np.ndarray:  # [q | k | v] rows or channels: only v is per V-head
        return np.concatenate([a[:2 * key_dim], _grouped_to_tiled(a[2 * key_dim:], n_k, r)], axis=0)

    table = {
        "attn_norm.weight": (_From("input_layernorm.weight", _plus_one),),
        "post_attention_norm.weight": (_From("post_attention_layernorm.weight", _plus_one),),
        "attn_qkv.weight": (_From("linear_attn.in_proj_qkv.weight", qkv),),
        "attn_gate.weight": (_From("linear_attn.in_proj_z.weight", tiled()),),
        "ssm_beta.weight": (_From("linear_attn.in_proj_b.weight", tiled()),),
        "ssm_alpha.weight": (_From("linear_attn.in_proj_a.weight", tiled()),),
        "ssm_a": (_From("linear_attn.A_log", lambda a: -np.exp(_grouped_to_tiled(a, n_k, r))),),
        "ssm_dt.bias": (_From("linear_attn.dt_bias", tiled()),),
        "ssm_conv1d.weight": (_From("linear_attn.conv1d.weight", lambda a: qkv(a.reshape(a.shape[0], -1))),),
        "ssm_norm.weight": (_From("linear_attn.norm.weight"),),  # the gated norm has no +1
        "ssm_out.weight": (_From("linear_attn.out_proj.weight", tiled(axis=1)),),
        "attn_q.weight": (_From("self_attn.q_proj.weight"),),
        "attn_k.weight": (_From("self_attn.k_proj.weight"),),
        "attn_v.weight": (_From("self_attn.v_proj.weight"),),
        "attn_output.weight": (_From("self_attn.o_proj.weight"),),
        "attn_q_norm.weight": (_From("self_attn.q_norm.weight", _plus_one),),
        "attn_k_norm.weight": (_From("self_attn.k_norm.weight", _plus_one),),
        "ffn_gate.weight": (_From("mlp.gate_proj.weight"),),
        "ffn_up.weight": (_From("mlp.up_proj.weight"),),
        "ffn_down.weight": (_From("mlp.down_proj.weight"),),
        "ffn_gate_inp.weight": (_From("mlp.gate.weight"),),
        # On disk experts are usually per expert; transformers 5 in-memory dumps are fused.
        "ffn_gate_exps.weight": (_From("mlp.experts.{e}.gate_proj.weight", experts=True),
                                 _From("mlp.experts.gate_up_proj", lambda a: a[:, :F])),
        "ffn_up_exps.weight": (_From("mlp.experts.{e}.up_proj.weight", experts=True),
                               _From("mlp.experts.gate_up_proj", lambda a: a[:, F:])),
        "ffn_down_exps.weight": (_From("mlp.experts.{e}.down_proj.weight", experts=True),
                                 _From("mlp.experts.down_proj")),
        "ffn_gate_shexp.weight": (_From("mlp.shared_expert.gate_proj.weight"),),
        "ffn_up_shexp.weight": (_From("mlp.shared_expert.up_proj.weight"),),
        "ffn_down_shexp.weight": (_From("mlp.shared_expert.down_proj.weight"),),
        "ffn_gate_inp_shexp.weight": (_From("mlp.shared_expert_gate.weight"),),
    }
    return table


_LAYER_TABLES: dict[str, Callable[[dict[str, Any]], dict[str, tuple[_From, ...]]]] = {
    "llama": _llama_layer, "qwen2": _llama_layer, "qwen3": _llama_layer, "phi3": _phi3_layer,
    "qwen35": _qwen35_layer, "qwen35moe": _qwen35_layer,
}


def _global_table(arch: str) -> dict[str, tuple[_From, ...]]:
    """Names under the model prefix (``model.`` or ``model.language_model.``); the head is top-level."""
    norm = _From("norm.weight", _plus_one if arch in ("qwen35", "qwen35moe") else None)
    return {"token_embd.weight": (_From("embed_tokens.weight"),), "output_norm.weight": (norm,),
            "output.weight": (_From("/lm_head.weight"),)}


_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


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

    def __init__(self, path: Path, files: list[Path], arch: str, hf: dict[str, Any]):
        self.path = path
        self._where: dict[str, _ShardFile] = {}
        for f in files:
            shard = _ShardFile(f)
            for k in shard.keys:
                self._where[k] = shard
        multimodal = "model.language_model.embed_tokens.weight" in self._where  # Qwen3.5 / Gemma 3 wrappers
        self._prefix = "model.language_model." if multimodal else "model."
        self._global = _global_table(arch)
        try:
            self._layer = _LAYER_TABLES[arch](hf)
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(path, f"config.json lacks {exc}") from exc
        self._n_experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
        self._synthetic: dict[str, np.ndarray] = {}  # tensors the converter computes (rope factors)

    def _candidates(self, name: str) -> list[tuple[str, _From]]:
        """(HF key, rule) pairs that could produce GGUF tensor `name`, in order of preference."""
        if name in self._global:
            return [(f.hf[1:] if f.hf.startswith("/") else self._prefix + f.hf, f) for f in self._global[name]]
        m = _BLOCK.fullmatch(name)
        if m is None or m.group(2) not in self._layer:
            return []
        return [(f"{self._prefix}layers.{m.group(1)}.{f.hf}", f) for f in self._layer[m.group(2)]]

    def _present(self, key: str, rule: _From) -> bool:
        return (key.format(e=0) if rule.experts else key) in self._where

    def hf_name(self, name: str) -> str | None:
        """The HF tensor behind GGUF name `name` (the first present candidate), else None."""
        return next((k for k, rule in self._candidates(name) if self._present(k, rule)), None)

    def has(self, name: str) -> bool:
        return name in self._synthetic or self.hf_name(name) is not None

    def names(self) -> list[str]:
        pattern = re.compile(re.escape(self._prefix) + r"layers\.(\d+)\.")
        layers = {int(m.group(1)) for k in self._where if (m := pattern.match(k))}
        cands = list(self._global) + [f"blk.{i}.{s}" for i in sorted(layers) for s in self._layer]
        return [n for n in cands if self.has(n)] + sorted(self._synthetic)

    def qtype(self, name: str) -> str:
        key = self.hf_name(name)
        if key is None:
            return "F32" if name in self._synthetic else "?"
        return self._where[key.format(e=0)].dtype(key.format(e=0))

    def _read(self, key: str) -> np.ndarray:
        try:
            return self._where[key].get(key)
        except Exception as exc:
            raise ModelLoadError(self.path, f"tensor {key!r} could not be read ({type(exc).__name__}: {exc})") from exc

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """float32 array in (out, in) order, the layout HF and GGUF-via-numpy share."""
        if name in self._synthetic:
            arr = self._synthetic[name]
        else:
            found = next(((k, rule) for k, rule in self._candidates(name) if self._present(k, rule)), None)
            if found is None:
                tried = [k for k, _ in self._candidates(name)]
                raise ModelLoadError(self.path, f"missing tensor {name!r}" + (f" (HF {tried[0]!r})" if tried else ""))
            key, rule = found
            if rule.experts:
                missing = [key.format(e=e) for e in range(self._n_experts) if key.format(e=e) not in self._where]
                if missing:
                    raise ModelLoadError(self.path, f"missing expert tensor {missing[0]!r}")
                arr = np.stack([self._read(key.format(e=e)) for e in range(self._n_experts)])
            else:
                arr = self._read(key)
            if rule.fn is not None:
                arr = np.ascontiguousarray(rule.fn(arr), dtype=np.float32)
        if shape is not None and tuple(arr.shape) != tuple(shape):
            raise ModelLoadError(self.path, f"tensor {name!r} has shape {arr.shape}, expected {tuple(shape)}")
        return arr

    def get_optional(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray | None:
        return self.get(name, shape) if self.has(name) else None

    def shape_of(self, name: str) -> tuple[int, ...] | None:
        key = self.hf_name(name)
        return self._where[key].shape(key) if key is not None and key in self._where else None


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
    arch = _ARCHS.get(hf.get("model_type"))
    if arch is None:
        raise ModelLoadError(path, f"unsupported HF model_type {hf.get('model_type')!r} "
                                   f"(supported: {', '.join(sorted(_ARCHS))})")
    emb = src.shape_of("token_embd.weight")
    if emb is None:
        raise ModelLoadError(path, "missing tensor 'model.embed_tokens.weight'")
    try:
        return _config(path, hf, src, arch, vocab=int(emb[0]))
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(path, f"config.json lacks or garbles {type(exc).__name__}: {exc}") from exc


def _config(path: Path, hf: dict[str, Any], src: SafetensorsSource, arch: str, vocab: int) -> ModelConfig:
    hidden, n_heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
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
        orig_ctx = int(rp.get("original_max_position_embeddings") or hf.get("original_max_position_embeddings")
                       or max_pos)
        src._synthetic["rope_factors_long.weight"] = np.asarray(rp["long_factor"], np.float32)
        src._synthetic["rope_factors_short.weight"] = np.asarray(rp["short_factor"], np.float32)
        scale = max_pos / orig_ctx
        attn_factor = float(rp.get("attention_factor") or
                            (math.sqrt(1 + math.log(scale) / math.log(orig_ctx)) if scale > 1 else 1.0))
    elif rope_kind != "default":
        raise ModelLoadError(path, f"rope type {rope_kind!r} is not supported yet")
    return ModelConfig(
        arch=arch,
        n_layers=int(hf["num_hidden_layers"]),
        hidden=hidden,
        n_heads=n_heads,
        n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
        head_dim=head_dim,
        ffn=int(hf.get("intermediate_size") or 0),
        vocab=vocab,
        rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_base=base,
        n_rot=n_rot,
        rope_type=ROPE_NEOX,  # HF checkpoints are rotate-half (no converter permutation)
        context_length=max_pos,
        attn_scale=head_dim ** -0.5,
        rope_scale=rope_scale,
        tied_output=not src.has("output.weight"),
        qk_norm=src.has("blk.0.attn_q_norm.weight") or arch in ("qwen35", "qwen35moe"),
        qkv_bias=src.has("blk.0.attn_q.bias"),
        n_experts=int(hf.get("num_experts") or hf.get("num_local_experts") or 0),
        n_experts_used=int(hf.get("num_experts_per_tok") or 0),
        expert_ffn=int(hf.get("moe_intermediate_size") or 0),
        name=path.name,
        rope_orig_context=orig_ctx,
        rope_attn_factor=attn_factor,
        extra=_hybrid_extra(hf) if arch in ("qwen35", "qwen35moe") else {},
    )


def _hybrid_extra(hf: dict[str, Any]) -> dict[str, Any]:
    """The ``{arch}.*`` GGUF keys (prefix stripped) that qwen35.py reads from cfg.extra."""
    n_v = int(hf["linear_num_value_heads"])
    extra = {
        "ssm.conv_kernel": int(hf["linear_conv_kernel_dim"]),
        "ssm.state_size": int(hf["linear_key_head_dim"]),
        "ssm.group_count": int(hf["linear_num_key_heads"]),
        "ssm.time_step_rank": n_v,
        "ssm.inner_size": n_v * int(hf["linear_value_head_dim"]),
        "expert_shared_feed_forward_length": int(hf.get("shared_expert_intermediate_size") or 0),
    }
    if hf.get("layer_types"):
        extra["attention.recurrent_layers"] = [t == "linear_attention" for t in hf["layer_types"]]
    if hf.get("full_attention_interval"):
        extra["full_attention_interval"] = int(hf["full_attention_interval"])
    return extra


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
    # Prefer HF's own file names: some repos also ship a differently named consolidated copy.
    files = sorted(path.glob("model*.safetensors")) or sorted(path.glob("*.safetensors"))
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
    if isinstance(hf.get("text_config"), dict):  # multimodal wrapper: the text backbone's config
        hf = hf["text_config"]
    arch = _ARCHS.get(hf.get("model_type"))
    if arch is None:
        raise ModelLoadError(p, f"unsupported HF model_type {hf.get('model_type')!r} "
                                f"(supported: {', '.join(sorted(_ARCHS))})")
    src = SafetensorsSource(p, _weight_files(p), arch, hf)
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
    from pantheon.text.chat_template import ChatTemplate
    from pantheon.text.tokenizer import Tokenizer
    if not meta.get("hf.tokenizer_json"):
        raise ModelLoadError(path, "no tokenizer.json beside the checkpoint or its config.json")
    cfg_json = meta.get("hf.tokenizer_config_json")
    tok = Tokenizer.from_hf_files(Path(meta["hf.tokenizer_json"]), Path(cfg_json) if cfg_json else None)
    return tok, ChatTemplate(tok.chat_template, tok.bos_token, tok.eos_token)
