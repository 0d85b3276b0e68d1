"""Phi-3 / Phi-3.5 / Phi-4(-mini): a llama with fused weights, so it *is* llama.forward after a split.

The GGUF keeps HF's fused tensors: ``attn_qkv`` (rows Q, then K, then V) and ``ffn_up`` (first half the
gate, second half the up projection). Splitting them at load time gives exactly llama.py's params, and
everything else (NEOX RoPE with partial rotary ``n_rot``, no biases, untied or tied head) is already
what llama.forward does. Only LongRoPE needs two more facts:

* the per-pair frequency divisors: ``rope_factors_long`` when the context this state was built for
  exceeds ``rope.scaling.original_context_length`` (llama.cpp's choice, fixed per context so cached keys
  and new queries always agree), else ``rope_factors_short``;
* the cos/sin multiplier ``attn_factor``: llama.forward scales cos and sin by
  ``cfg.rope_attn_factor`` (the weights stay in their blocks, so it cannot be folded into W_q, W_k).

llama.cpp disables sliding-window attention for phi3, and so do we.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from pantheon.errors import ModelLoadError
from pantheon.ops import weights
from pantheon.formats.gguf_loader import ModelConfig, TensorSource
from pantheon.ops.weights import XLA, Kernels, QuantWeight
from pantheon.jax_models import common, llama
from pantheon.jax_models.interface import Capabilities, Group

ARCHS = ("phi3",)
CAPABILITIES = Capabilities(mixed_steps=True, fused_projections=True)


@struct.dataclass
class Phi3Params:
    """llama's params (q/k/v and gate/up already split) plus LongRoPE's two divisor sets [n_rot/2],
    both None for a file without LongRoPE."""

    llama: llama.LlamaParams
    rope_factors_long: Optional[Any] = None
    rope_factors_short: Optional[Any] = None


class _SplitFused:
    """A TensorSource view that serves llama's separate names by slicing phi3's fused tensors."""

    def __init__(self, src: TensorSource, cfg: ModelConfig):
        self._src = src
        self.path = src.path
        nq, nkv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        self._parts = {  # llama suffix -> (fused suffix, row range)
            "attn_q.weight": ("attn_qkv.weight", 0, nq),
            "attn_k.weight": ("attn_qkv.weight", nq, nq + nkv),
            "attn_v.weight": ("attn_qkv.weight", nq + nkv, nq + 2 * nkv),
            "ffn_gate.weight": ("ffn_up.weight", 0, cfg.ffn),
            "ffn_up.weight": ("ffn_up.weight", cfg.ffn, 2 * cfg.ffn),
        }

    def _fused(self, name: str) -> str | None:
        """The fused tensor that holds llama-name `name`, when the file is fused for that layer."""
        blk, _, suffix = name.partition(".")
        layer, _, suffix = suffix.partition(".")
        if blk != "blk" or suffix not in self._parts:
            return None
        fused = f"blk.{layer}.{self._parts[suffix][0]}"
        if suffix == "ffn_up.weight" and not self._src.has(f"blk.{layer}.ffn_gate.weight"):
            return fused  # fused gate/up: "ffn_up" itself is the fused tensor
        if suffix != "ffn_up.weight" and self._src.has(fused) and not self._src.has(name):
            return fused
        return None

    def has(self, name: str) -> bool:
        return self._fused(name) is not None or self._src.has(name)

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        if self._fused(name) is not None:
            raise ModelLoadError(self.path, f"{name!r} is part of a fused matrix; read it with matrix()")
        return self._src.get(name, shape)

    def matrix(self, name: str, shape: tuple[int, ...] | None = None) -> QuantWeight:
        """The matrix `name`, as a row range of its fused tensor when the file fuses it (a view:
        rows are runs of whole blocks)."""
        fused = self._fused(name)
        if fused is None:
            return self._src.matrix(name, shape)
        _, lo, hi = self._parts[name.split(".", 2)[2]]
        part = weights.row_slice(self._src.matrix(fused), lo, hi)
        if shape is not None and part.shape != tuple(shape):
            raise ModelLoadError(self.path, f"fused tensor {fused!r} gives {name!r} shape {part.shape}, "
                                            f"expected {tuple(shape)}")
        return part


def load_params(src: TensorSource, cfg: ModelConfig) -> Phi3Params:
    params = Phi3Params(llama=llama.load_params(_SplitFused(src, cfg), cfg))
    if src.has("rope_factors_long.weight"):
        params = params.replace(rope_factors_long=src.get("rope_factors_long.weight", (cfg.n_rot // 2,)),
                                rope_factors_short=src.get("rope_factors_short.weight", (cfg.n_rot // 2,)))
    return params


def fuse_projections(params: Phi3Params) -> Phi3Params:
    """llama.fuse_projections on the llama part (the forward is llama.forward)."""
    return params.replace(llama=llama.fuse_projections(params.llama))


def init_state(cfg: ModelConfig, n_slots: int, capacity: int, dtype=jnp.float32) -> common.KVCache:
    return llama.init_state(cfg, n_slots, capacity, dtype)


def state_bytes_per_token(cfg: ModelConfig) -> int:
    return llama.state_bytes_per_token(cfg)


def state_bytes_per_sequence(cfg: ModelConfig) -> int:
    return llama.state_bytes_per_sequence(cfg)


def _long_or_short(params: Phi3Params, state: common.KVCache, cfg: ModelConfig) -> llama.LlamaParams:
    """llama's params with LongRoPE's divisors, chosen by the cache capacity (a static shape)."""
    if params.rope_factors_long is None:
        return params.llama
    capacity = state.k.shape[3]
    use_long = cfg.rope_orig_context > 0 and capacity > cfg.rope_orig_context
    return params.llama.replace(rope_freqs=params.rope_factors_long if use_long else params.rope_factors_short)


def forward(params: Phi3Params, state: common.KVCache, tokens: jax.Array, slots: jax.Array,
            start: jax.Array, n_new: jax.Array, *, cfg: ModelConfig, span: int,
            all_logits: bool = False, kernels: Kernels = XLA) -> tuple[jax.Array, common.KVCache]:
    """llama.forward with LongRoPE's divisors."""
    return llama.forward(_long_or_short(params, state, cfg), state, tokens, slots, start, n_new, cfg=cfg,
                         span=span, all_logits=all_logits, kernels=kernels)


def forward_groups(params: Phi3Params, state: common.KVCache, groups: tuple[Group, ...], *,
                   cfg: ModelConfig, span: int, all_logits: bool = False,
                   kernels: Kernels = XLA) -> tuple[jax.Array, common.KVCache]:
    """llama.forward_groups with LongRoPE's divisors."""
    return llama.forward_groups(_long_or_short(params, state, cfg), state, groups, cfg=cfg, span=span,
                                all_logits=all_logits, kernels=kernels)


def hidden_states(params: Phi3Params, state: common.KVCache, tokens: jax.Array, slots: jax.Array,
                  start: jax.Array, n_new: jax.Array, *, cfg: ModelConfig, span: int,
                  kernels: Kernels = XLA) -> tuple[jax.Array, common.KVCache]:
    """llama.hidden_states with LongRoPE's divisors."""
    return llama.hidden_states(_long_or_short(params, state, cfg), state, tokens, slots, start, n_new, cfg=cfg,
                               span=span, kernels=kernels)
