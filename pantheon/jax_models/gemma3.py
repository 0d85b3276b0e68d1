"""Gemma 3 (text): the llama skeleton plus Gemma's differences, exactly as llama.cpp runs a GGUF.

What differs from llama.py, and why each is done the way it is:

* the embedding is multiplied by sqrt(hidden) in float32 (llama.cpp's exact value; HF rounds it to the
  weight dtype, which only matters for bf16 checkpoints), while the tied LM head uses the unscaled table;
* norm weights are used as stored: the GGUF converter already folded Gemma's ``(1 + w)`` into them;
* sandwich norms: the attention and FFN outputs are RMS-normed again before each residual add;
* per-head q/k RMSNorm before RoPE, GeGLU with tanh-approximate GELU;
* layers interleave 5 sliding-window ("local") layers with 1 global one. Local layers rotate with base
  10000 (or ``rope.freq_base_swa``) and no scaling, and a key is visible only when
  ``q_pos - k_pos < sliding_window``; global layers use ``rope.freq_base`` with linear scaling;
* the attention scale is llama.cpp's rule (1/sqrt(head_dim), except the 62-layer 27B), because the
  GGUF does not carry HF's ``query_pre_attn_scalar``;
* optional final logit soft-capping.

KV cache: every layer keeps full-capacity K/V in the same ``[L, S, K, C, D]`` slot cache as llama.py, so
prefix reuse by the scheduler (rewinding a slot to any earlier length) stays valid. Local layers only
*read* the last ``sliding_window + T - 1`` positions of each row, so their attention cost is bounded by the
window, not the context. A window-sized ring would also bound their memory, but it overwrites positions
the batch scheduler's prefix reuse may rewind to (a slot reused at length P needs keys P-W..P-1 that a
longer previous occupant has already overwritten), so it needs a scheduler-side cap first.

The layer loop is a ``lax.scan`` like llama.py's, so a step's program does not grow with depth: each
kind of matrix is one weights.LayerStack read in place by layer, and local and global layers, which
read different key lengths, are the two branches of one ``lax.cond`` on the layer's kind.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from pantheon.ops import weights
from pantheon.formats.gguf_loader import ModelConfig, TensorSource
from pantheon.ops.weights import XLA, Kernels, QuantWeight
from pantheon.jax_models import common
from pantheon.jax_models.interface import Capabilities

ARCHS = ("gemma3",)
CAPABILITIES = Capabilities(image_inputs=True)
SWA_PATTERN = 6  # llama.cpp's gemma3 loader: every 6th layer is global (no GGUF key carries this)
LOCAL_ROPE_BASE = 10000.0  # hard-coded in llama.cpp for gemma3's local layers


def is_global(cfg: ModelConfig, layer: int) -> bool:
    """Layer `layer` attends to the whole context (else to the last `sliding_window` positions)."""
    return cfg.sliding_window <= 0 or (layer + 1) % SWA_PATTERN == 0


def attn_scale(cfg: ModelConfig) -> float:
    """llama.cpp's gemma3 rule: 1/sqrt(hidden/heads) for the 62-layer 27B (query_pre_attn_scalar 168),
    otherwise the file's scale (1/sqrt(head_dim) unless `attention.scale` says otherwise)."""
    if cfg.n_layers == 62 and math.isclose(cfg.attn_scale, cfg.head_dim ** -0.5):
        return (cfg.hidden / cfg.n_heads) ** -0.5
    return cfg.attn_scale


_MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


@struct.dataclass
class Gemma3Layers:
    """Every layer's parameters: each matrix kind a tuple of per-layer QuantWeights as loaded (a
    weights.LayerStack once the engine stacks them), vectors f32 stacked [L, ...] (norms as stored:
    the GGUF converter already folded Gemma's (1 + w))."""

    attn_norm: Any  # [L, H]
    wq: Any  # [nh*hd, H] per layer
    wk: Any  # [nkv*hd, H]
    wv: Any  # [nkv*hd, H]
    wo: Any  # [H, nh*hd]
    q_norm: Any  # [L, hd]
    k_norm: Any  # [L, hd]
    post_attn_norm: Any  # [L, H]
    ffn_norm: Any  # [L, H]
    w_gate: Any  # [F, H]
    w_up: Any  # [F, H]
    w_down: Any  # [H, F]
    post_ffw_norm: Any  # [L, H]


@struct.dataclass
class Gemma3Params:
    """The embedding, final norm, the layers and an untied head (None: tied)."""

    embed: QuantWeight  # [V, H]
    norm: Any  # [H]
    layers: Gemma3Layers
    head: Optional[QuantWeight] = None


def load_params(src: TensorSource, cfg: ModelConfig) -> Gemma3Params:
    """Matrices as the file stores them (QuantWeight views of the mapped file), vectors f32."""
    H, nh, nkv, hd, F = cfg.hidden, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn
    shapes = {  # our name -> (GGUF name, shape)
        "attn_norm": ("attn_norm", (H,)),
        "wq": ("attn_q", (nh * hd, H)),
        "wk": ("attn_k", (nkv * hd, H)),
        "wv": ("attn_v", (nkv * hd, H)),
        "wo": ("attn_output", (H, nh * hd)),
        "q_norm": ("attn_q_norm", (hd,)),
        "k_norm": ("attn_k_norm", (hd,)),
        "post_attn_norm": ("post_attention_norm", (H,)),
        "ffn_norm": ("ffn_norm", (H,)),
        "w_gate": ("ffn_gate", (F, H)),
        "w_up": ("ffn_up", (F, H)),
        "w_down": ("ffn_down", (H, F)),
        "post_ffw_norm": ("post_ffw_norm", (H,)),
    }
    layers: dict[str, Any] = {}
    for ours, (name, shape) in shapes.items():
        names = [f"blk.{i}.{name}.weight" for i in range(cfg.n_layers)]
        if ours in _MATRICES:
            layers[ours] = tuple(src.matrix(n, shape) for n in names)
        else:
            layers[ours] = np.stack([src.get(n, shape) for n in names])
    return Gemma3Params(embed=src.matrix("token_embd.weight", (cfg.vocab, H)),
                        norm=src.get("output_norm.weight", (H,)), layers=Gemma3Layers(**layers),
                        head=None if cfg.tied_output else src.matrix("output.weight", (cfg.vocab, H)))


def init_state(cfg: ModelConfig, n_slots: int, capacity: int, dtype=jnp.float32) -> common.KVCache:
    """Full-capacity K and V [L, S, K, C, D] for every layer, local ones included (see the module doc)."""
    return common.init_kv(cfg.n_layers, n_slots, cfg.n_kv_heads, capacity, cfg.head_dim, dtype)


def state_bytes_per_token(cfg: ModelConfig) -> int:
    return cfg.kv_bytes_per_token


def state_bytes_per_sequence(cfg: ModelConfig) -> int:
    """Nothing: a KV cache only grows with the sequence's length."""
    return 0


def _gather_recent(cache: jax.Array, layer: int, slots: jax.Array, first: jax.Array, length: int) -> jax.Array:
    """[B, K, length, D]: positions first[b] .. first[b]+length-1 of each row's slot."""
    lay = cache[layer]  # [S, K, C, D]
    zero = jnp.zeros((), jnp.int32)

    def one(slot, off):
        return jax.lax.dynamic_slice(lay, (slot, zero, off, zero), (1,) + lay.shape[1:2] + (length,) + lay.shape[3:])[0]

    return jax.vmap(one)(slots, first)


def forward(params: Gemma3Params, state: common.KVCache, tokens: jax.Array, slots: jax.Array,
            start: jax.Array, n_new: jax.Array, *, cfg: ModelConfig, span: int,
            all_logits: bool = False, kernels: Kernels = XLA) -> tuple[jax.Array, common.KVCache]:
    """Same contract as llama.forward: B rows of T tokens; logits [B, V] (or [B, T, V]) and new state."""
    return forward_images(params, state, tokens, slots, start, n_new, None, cfg=cfg, span=span,
                          all_logits=all_logits, kernels=kernels)


def forward_images(params: Gemma3Params, state: common.KVCache, tokens: jax.Array, slots: jax.Array,
                   start: jax.Array, n_new: jax.Array, override: common.EmbdOverride | None, *, cfg: ModelConfig,
                   span: int, all_logits: bool = False, kernels: Kernels = XLA) -> tuple[jax.Array, common.KVCache]:
    """`forward` with image embeddings at some positions (`override`); an image's tokens attend to each
    other both ways, as HF's Gemma 3 mask (token_type_ids) and llama.cpp's non-causal image batch do."""
    x, state = _body(params, state, tokens, slots, start, cfg=cfg, span=span, override=override)
    if not all_logits:
        x = common.last_valid(x, n_new)
    x = common.rms_norm(x, params.norm, cfg.rms_eps)
    head = params.embed if params.head is None else params.head
    logits = weights.linear(x, head).astype(jnp.float32)
    if cfg.final_softcap:
        logits = cfg.final_softcap * jnp.tanh(logits / cfg.final_softcap)
    return logits, state


def hidden_states(params: Gemma3Params, state: common.KVCache, tokens: jax.Array, slots: jax.Array,
                  start: jax.Array, n_new: jax.Array, *, cfg: ModelConfig, span: int,
                  kernels: Kernels = XLA) -> tuple[jax.Array, common.KVCache]:
    """The final hidden states [B, T, H] (after the final norm, before the LM head), every position."""
    x, state = _body(params, state, tokens, slots, start, cfg=cfg, span=span)
    return common.rms_norm(x, params.norm, cfg.rms_eps), state


def _body(params: Gemma3Params, state: common.KVCache, tokens: jax.Array, slots: jax.Array, start: jax.Array, *,
          cfg: ModelConfig, span: int, override: common.EmbdOverride | None = None
          ) -> tuple[jax.Array, common.KVCache]:
    """The layer stack shared by the logits and the hidden-state outputs: the residual stream
    [B, T, H] after the last layer (before the final norm) and the updated state."""
    B, T = tokens.shape
    nh, nkv, hd, W = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.sliding_window
    positions = start[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]  # [B, T]
    rope = {
        True: common.rope_angles(positions, cfg.n_rot, cfg.rope_base, cfg.rope_scale),
        False: common.rope_angles(positions, cfg.n_rot, cfg.rope_base_swa or LOCAL_ROPE_BASE),
    }
    scale = attn_scale(cfg)
    # Local layers read only what a window can see: the last W + T - 1 positions up to start + T.
    local_len = min(span, W + T - 1) if W > 0 else span
    local_first = jnp.maximum(start + T - local_len, 0)  # [B]; first + local_len <= start + T <= span
    x = weights.embed(params.embed, tokens) * np.float32(math.sqrt(cfg.hidden))
    x = common.override_embeddings(x, override)  # image rows replace the *scaled* embeddings (as HF)
    block = None if override is None else (start[:, None] + override.lo, start[:, None] + override.hi)
    kinds = [is_global(cfg, i) for i in range(cfg.n_layers)]
    mixed = len(set(kinds)) > 1

    def attend(q: jax.Array, kc: jax.Array, vc: jax.Array, li: jax.Array, glob: bool) -> jax.Array:
        if glob or local_len == span:
            ks, vs = common.gather_span(kc, li, slots, span), common.gather_span(vc, li, slots, span)
            q_pos, blk = positions, block
        else:  # keys j of the slice sit at positions first + j: shift the queries to match
            ks = _gather_recent(kc, li, slots, local_first, local_len)
            vs = _gather_recent(vc, li, slots, local_first, local_len)
            q_pos = positions - local_first[:, None]
            blk = None if block is None else (block[0] - local_first[:, None], block[1] - local_first[:, None])
        return common.attention(q, ks, vs, q_pos, scale, window=0 if glob else W, softcap=cfg.attn_softcap,
                                block=blk)

    def mm(lp: Gemma3Layers, name: str, h: jax.Array, li: jax.Array) -> jax.Array:
        return weights.pick_linear(getattr(lp, name), li, h)

    def layer(carry, inputs):
        x, kc, vc = carry
        lp, li, glob = inputs
        lp = lp.replace(**listed)
        if mixed:  # the layer's RoPE: elementwise choice between the two tables (no branch)
            cos = jnp.where(glob, rope[True][0], rope[False][0])
            sin = jnp.where(glob, rope[True][1], rope[False][1])
        else:
            cos, sin = rope[kinds[0]]
        h = common.rms_norm(x, lp.attn_norm, cfg.rms_eps)
        q = common.rms_norm(mm(lp, "wq", h, li).reshape(B, T, nh, hd), lp.q_norm, cfg.rms_eps)
        k = common.rms_norm(mm(lp, "wk", h, li).reshape(B, T, nkv, hd), lp.k_norm, cfg.rms_eps)
        v = mm(lp, "wv", h, li).reshape(B, T, nkv, hd)
        q = common.apply_rope(q, cos, sin, cfg.n_rot, cfg.rope_type)
        k = common.apply_rope(k, cos, sin, cfg.n_rot, cfg.rope_type)
        kc = common.write_kv(kc, li, k, slots, start)  # write before any read of the cache
        vc = common.write_kv(vc, li, v, slots, start)
        if mixed:
            o = jax.lax.cond(glob, lambda *a: attend(*a, True), lambda *a: attend(*a, False), q, kc, vc, li)
        else:
            o = attend(q, kc, vc, li, kinds[0])
        x = x + common.rms_norm(mm(lp, "wo", o, li), lp.post_attn_norm, cfg.rms_eps)
        h = common.rms_norm(x, lp.ffn_norm, cfg.rms_eps)
        f = jax.nn.gelu(mm(lp, "w_gate", h, li), approximate=True) * mm(lp, "w_up", h, li)
        x = x + common.rms_norm(mm(lp, "w_down", f, li), lp.post_ffw_norm, cfg.rms_eps)
        return (x, kc, vc), None

    # As in llama.py: the matrices' stacks stay out of the scan's inputs (the body reads layer li in
    # place); the scan slices the stacked vectors.
    listed = {k: getattr(params.layers, k) for k in _MATRICES}
    per_layer = params.layers.replace(**{k: None for k in _MATRICES})
    xs = (per_layer, jnp.arange(cfg.n_layers, dtype=jnp.int32), jnp.asarray(kinds))
    (x, kc, vc), _ = jax.lax.scan(layer, (x, state.k, state.v), xs)
    return x, state.replace(k=kc, v=vc)
