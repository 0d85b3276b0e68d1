"""The llama family: llama (SmolLM2, Llama 2/3), mistral, qwen2 (q/k/v biases), qwen3 (q/k norm),
and the MoE variants mixtral / qwen3moe (router top-k over stacked experts).

Pure functions of (params, state, inputs) -> (outputs, state). The layer loop is a `lax.scan` (fast
to compile, one code path for any depth) over the stacked vectors (norms, biases); each kind of matrix
is one weights.LayerStack over the layers (per-layer QuantWeights as loaded, stacked by the engine),
which the scan body reads layer li of in place (weights.pick_linear).
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from pantheon.ops import native, weights
from pantheon.formats.gguf_loader import ModelConfig, TensorSource
from pantheon.ops.weights import XLA, Kernels, QuantWeight
from pantheon.jax_models import common
from pantheon.ops import moe_kernels
from pantheon.jax_models.interface import Capabilities, Group

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "qwen3moe")
# image_inputs: the text tower of Idefics3 / SmolVLM (a llama) takes a projector's image rows
CAPABILITIES = Capabilities(mixed_steps=True, fused_projections=True, image_inputs=True)

Matrices = tuple[QuantWeight, ...] | weights.LayerStack  # one weight per layer, in layer order
Vectors = Any  # a stacked [L, ...] array (numpy on the host, jax on the device)


@struct.dataclass
class LlamaLayers:
    """Every layer's parameters. Matrices are a tuple of per-layer QuantWeights as loaded, then a
    weights.LayerStack once the engine stacks them (the scan body reads layer li of it in place, so
    the program has no branch per layer); vectors are stacked [L, ...] and sliced by the scan. Exactly one form of each projection is set: the separate q/k/v and
    gate/up as loaded, or the fused `wqkv` / `w_gu` after `fuse_projections`; a dense FFN or the
    MoE experts. Absent parts are None."""

    attn_norm: Vectors  # [L, H]
    wo: Matrices  # [H, nh*hd]
    ffn_norm: Vectors  # [L, H]
    wq: Optional[Matrices] = None  # [nh*hd, H]
    wk: Optional[Matrices] = None  # [nkv*hd, H]
    wv: Optional[Matrices] = None  # [nkv*hd, H]
    wqkv: Optional[Matrices] = None  # rows [q | k | v]
    bq: Optional[Vectors] = None  # qwen2's biases [L, out]
    bk: Optional[Vectors] = None
    bv: Optional[Vectors] = None
    bqkv: Optional[Vectors] = None
    bo: Optional[Vectors] = None
    q_norm: Optional[Vectors] = None  # qwen3's per-head RMSNorm [L, hd]
    k_norm: Optional[Vectors] = None
    w_gate: Optional[Matrices] = None  # dense SwiGLU [F, H], [F, H], [H, F]
    w_up: Optional[Matrices] = None
    w_gu: Optional[Matrices] = None  # rows [gate | up]
    w_down: Optional[Matrices] = None
    router: Optional[Vectors] = None  # MoE: [L, E, H] and experts [E, F, H] / [E, H, F] per layer
    w_gate_e: Optional[Matrices] = None
    w_up_e: Optional[Matrices] = None
    w_down_e: Optional[Matrices] = None


@struct.dataclass
class LlamaParams:
    """A llama-family model. `head` is None when the LM head is tied to the embedding."""

    embed: QuantWeight  # [V, H]
    norm: Vectors  # [H]
    layers: LlamaLayers
    head: Optional[QuantWeight] = None  # [V, H]
    head_bias: Optional[Vectors] = None  # [V]
    rope_freqs: Optional[Vectors] = None  # [n_rot/2] per-pair frequency divisors (llama 3.1 scaling)


def load_params(src: TensorSource, cfg: ModelConfig) -> LlamaParams:
    """Host params: every matrix as the file stores it (a tuple of per-layer QuantWeights, views of
    the mapped file), vectors (norms, biases) as f32 stacks [L, ...] for the layer scan."""
    H, nh, nkv, hd, L = cfg.hidden, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.n_layers
    params: dict[str, Any] = {
        "embed": src.matrix("token_embd.weight", (cfg.vocab, H)),
        "norm": src.get("output_norm.weight", (H,)),
        "head": None if cfg.tied_output else src.matrix("output.weight", (cfg.vocab, H)),
    }
    if src.has("output.bias"):
        params["head_bias"] = src.get("output.bias", (cfg.vocab,))
    if src.has("rope_freqs.weight"):
        params["rope_freqs"] = src.get("rope_freqs.weight", (cfg.n_rot // 2,))

    def vectors(fmt: str, shape: tuple[int, ...], optional: bool = False) -> np.ndarray | None:
        if optional and not src.has(fmt.format(0)):
            return None
        return np.stack([src.get(fmt.format(i), shape) for i in range(L)])

    def matrices(fmt: str, shape: tuple[int, ...]) -> tuple[QuantWeight, ...]:
        return tuple(src.matrix(fmt.format(i), shape) for i in range(L))

    layers: dict[str, Any] = {
        "attn_norm": vectors("blk.{}.attn_norm.weight", (H,)),
        "wq": matrices("blk.{}.attn_q.weight", (nh * hd, H)),
        "wk": matrices("blk.{}.attn_k.weight", (nkv * hd, H)),
        "wv": matrices("blk.{}.attn_v.weight", (nkv * hd, H)),
        "wo": matrices("blk.{}.attn_output.weight", (H, nh * hd)),
        "ffn_norm": vectors("blk.{}.ffn_norm.weight", (H,)),
    }
    for name, t, shape in (("bq", "attn_q", nh * hd), ("bk", "attn_k", nkv * hd), ("bv", "attn_v", nkv * hd),
                           ("bo", "attn_output", H)):
        b = vectors("blk.{}." + t + ".bias", (shape,), optional=True)
        if b is not None:
            layers[name] = b
    if cfg.qk_norm:
        layers["q_norm"] = vectors("blk.{}.attn_q_norm.weight", (hd,))
        layers["k_norm"] = vectors("blk.{}.attn_k_norm.weight", (hd,))
    if cfg.n_experts:
        E, F = cfg.n_experts, cfg.expert_ffn or cfg.ffn
        layers["router"] = vectors("blk.{}.ffn_gate_inp.weight", (E, H))
        layers["w_gate_e"] = matrices("blk.{}.ffn_gate_exps.weight", (E, F, H))
        layers["w_up_e"] = matrices("blk.{}.ffn_up_exps.weight", (E, F, H))
        layers["w_down_e"] = matrices("blk.{}.ffn_down_exps.weight", (E, H, F))
    else:
        layers["w_gate"] = matrices("blk.{}.ffn_gate.weight", (cfg.ffn, H))
        layers["w_up"] = matrices("blk.{}.ffn_up.weight", (cfg.ffn, H))
        layers["w_down"] = matrices("blk.{}.ffn_down.weight", (H, cfg.ffn))
    return LlamaParams(layers=LlamaLayers(**layers), **params)


def _fused(parts: list[tuple[QuantWeight, ...]]) -> tuple[QuantWeight, ...] | None:
    """Per layer, the parts' rows in one weight; None unless every layer's parts share a format."""
    out = tuple(weights.concat_rows([p[i] for p in parts]) for i in range(len(parts[0])))
    return None if any(w is None for w in out) else out


def fuse_projections(params: LlamaParams) -> LlamaParams:
    """Concatenate q/k/v into `wqkv` and gate/up into `w_gu` (their biases likewise), along the output axis.

    Why: matrices that read the same input become one larger product per layer, which runs faster
    than two or three small ones (the input is read once, one kernel call). Only when every layer's
    parts share a format (a Q4_K_M file's Q6_K attn_v keeps q, k, v apart), and only for a single
    die: the tensor-parallel rules in pantheon.runtime.sharding split q, k and v by their own heads.
    """
    lay = common.present(params.layers)
    qkv = _fused([lay["wq"], lay["wk"], lay["wv"]]) if all(k in lay for k in ("wq", "wk", "wv")) else None
    if qkv is not None:
        lay["wqkv"] = qkv
        del lay["wq"], lay["wk"], lay["wv"]
        if all(k in lay for k in ("bq", "bk", "bv")):
            lay["bqkv"] = np.concatenate([lay.pop("bq"), lay.pop("bk"), lay.pop("bv")], axis=-1)
    gu = _fused([lay["w_gate"], lay["w_up"]]) if "w_gate" in lay and "w_up" in lay else None
    if gu is not None:
        lay["w_gu"] = gu
        del lay["w_gate"], lay["w_up"]
    return params.replace(layers=LlamaLayers(**lay))


def matmul(lp: LlamaLayers, name: str, h: jax.Array, li: jax.Array, bias: str | None = None,
           skip: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    """weights.linear with layer li's weight `name` (read in place from its stack over layers) and,
    when the file has it, this layer's bias `bias`."""
    return weights.pick_linear(getattr(lp, name), li, h, getattr(lp, bias) if bias else None, skip)


def init_state(cfg: ModelConfig, n_slots: int, capacity: int, dtype=jnp.float32) -> common.KVCache:
    """K and V [L, S, K, C, D] for every layer."""
    return common.init_kv(cfg.n_layers, n_slots, cfg.n_kv_heads, capacity, cfg.head_dim, dtype)


def state_bytes_per_token(cfg: ModelConfig) -> int:
    return cfg.kv_bytes_per_token


def state_bytes_per_sequence(cfg: ModelConfig) -> int:
    """Nothing: a KV cache only grows with the sequence's length."""
    return 0


def moe(h: jax.Array, lp: LlamaLayers, li: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Softmax router -> top-k -> renormalise -> weighted SwiGLU experts (the shared MoE kernels),
    with layer li's experts, read in place from their stacks over layers (weights.with_layer)."""
    def run(h: jax.Array, wg: Any, wu: Any, wd: Any) -> jax.Array:
        return moe_kernels.moe_ffn(h, lp.router, wg, wu, wd, cfg.n_experts_used)

    return weights.with_layer((lp.w_gate_e, lp.w_up_e, lp.w_down_e), li, run, h)


def forward(params: LlamaParams, state: common.KVCache, tokens: jax.Array, slots: jax.Array,
            start: jax.Array, n_new: jax.Array, *, cfg: ModelConfig, span: int,
            all_logits: bool = False, kernels: Kernels = XLA) -> tuple[jax.Array, common.KVCache]:
    """One step over B rows of T tokens each.

    tokens [B, T] (row b holds n_new[b] real tokens, then padding), slots [B] cache slot of each row,
    start [B] position of tokens[b, 0]. `span` (static) bounds the cache positions attention reads:
    a bucket at least as large as every row's start + T. Returns logits [B, V] of each row's last
    real token (or [B, T, V] with all_logits) and the updated state.
    """
    return forward_groups(params, state, ((tokens, slots, start, n_new),), cfg=cfg, span=span, all_logits=all_logits,
                          kernels=kernels)


def forward_images(params: LlamaParams, state: common.KVCache, tokens: jax.Array, slots: jax.Array,
                   start: jax.Array, n_new: jax.Array, override: common.EmbdOverride | None, *, cfg: ModelConfig,
                   span: int, all_logits: bool = False, kernels: Kernels = XLA) -> tuple[jax.Array, common.KVCache]:
    """`forward` with image embeddings at some positions (`override`), as HF's Idefics3 `inputs_merger`
    puts them (the unscaled token embeddings replaced). Attention stays causal: HF's Llama text model
    masks image tokens like any other, so `override.lo/hi` are not read."""
    xs, state = _body(params, state, ((tokens, slots, start, n_new),), cfg=cfg, span=span, kernels=kernels,
                      override=override)
    x = xs[0] if all_logits else common.last_valid(xs[0], n_new)
    x = common.rms_norm(x, params.norm, cfg.rms_eps)
    head = params.embed if params.head is None else params.head
    return weights.linear(x, head, params.head_bias).astype(jnp.float32), state


def _chunk_padding(groups: tuple[Group, ...], shapes: list[tuple[int, int]]) -> tuple[jax.Array, jax.Array] | None:
    """The flattened rows [first, end) holding the padding of the step's one-row prefill chunk, if any.

    A chunk is padded to its length bucket (a 45-token prompt runs as 64 rows). The padding rows'
    keys and values land in cache positions past the chunk that no real query reads before the next
    tokens overwrite them, so the native matmuls skip those rows.
    """
    offset = 0
    for (_, _, _, n_new), (b, t) in zip(groups, shapes):
        if b == 1 and t > 1:
            return offset + n_new[0], jnp.int32(offset + t)
        offset += b * t
    return None


def forward_groups(params: LlamaParams, state: common.KVCache, groups: tuple[Group, ...], *,
                   cfg: ModelConfig, span: int, all_logits: bool = False,
                   kernels: Kernels = XLA) -> tuple[jax.Array, common.KVCache]:
    """One step over several groups of rows, each group with its own tokens-per-row.

    Why groups: a prefill chunk ([1, T]) and the decode rows of every other slot ([B, 1]) can share
    one step. Every matmul sees all the step's tokens as one [N, H] block (the weights are read once
    for both), while RoPE, the cache writes and attention run per group in that group's own shape.
    Returns logits [sum of B, V] of each row's last real token, groups in order (all_logits: one
    group only, [B, T, V]).
    """
    if all_logits and len(groups) != 1:
        raise ValueError("all_logits takes exactly one group")
    xs, state = _body(params, state, groups, cfg=cfg, span=span, kernels=kernels)
    if all_logits:
        x = xs[0]
    else:
        x = jnp.concatenate([common.last_valid(xg, g[3]) for xg, g in zip(xs, groups)])
    x = common.rms_norm(x, params.norm, cfg.rms_eps)
    head = params.embed if params.head is None else params.head
    logits = weights.linear(x, head, params.head_bias).astype(jnp.float32)
    return logits, state


def hidden_states(params: LlamaParams, state: common.KVCache, tokens: jax.Array, slots: jax.Array,
                  start: jax.Array, n_new: jax.Array, *, cfg: ModelConfig, span: int,
                  kernels: Kernels = XLA) -> tuple[jax.Array, common.KVCache]:
    """`forward`'s final hidden states [B, T, H] (after the final norm, before the LM head), every
    position: what embeddings pool. Positions past n_new[b] are padding and hold no meaning."""
    xs, state = _body(params, state, ((tokens, slots, start, n_new),), cfg=cfg, span=span, kernels=kernels)
    return common.rms_norm(xs[0], params.norm, cfg.rms_eps), state


def _body(params: LlamaParams, state: common.KVCache, groups: tuple[Group, ...], *, cfg: ModelConfig,
          span: int, kernels: Kernels, override: common.EmbdOverride | None = None
          ) -> tuple[list[jax.Array], common.KVCache]:
    """The layer stack shared by the logits and the hidden-state outputs: each group's residual
    stream [B, T, H] after the last layer (before the final norm), and the updated state.
    `override` (one group only): image rows in place of those positions' token embeddings."""
    nh, nkv, hd, H = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.hidden
    shapes = [g[0].shape for g in groups]
    sizes = [b * t for b, t in shapes]
    cuts = list(np.cumsum(sizes)[:-1])
    positions = [st[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :] for (_, _, st, _), (_, t) in zip(groups, shapes)]
    ropes = [common.rope_angles(p, cfg.n_rot, cfg.rope_base, cfg.rope_scale, params.rope_freqs)
             for p in positions]
    if cfg.arch == "phi3" and cfg.rope_attn_factor != 1.0:  # LongRoPE: q and k's rotated dims scaled
        f = np.float32(cfg.rope_attn_factor)
        ropes = [(c * f, s * f) for c, s in ropes]
    x = weights.embed(params.embed, jnp.concatenate([g[0].reshape(-1) for g in groups]))  # [N, H] f32
    if override is not None:
        x = common.override_embeddings(x.reshape(shapes[0] + (H,)), override).reshape(-1, H)
    skip = _chunk_padding(groups, shapes)

    def per_group(a: jax.Array, heads: int) -> list[jax.Array]:
        return [p.reshape(b, t, heads, hd) for p, (b, t) in zip(jnp.split(a, cuts), shapes)]

    def layer(carry, inputs):
        x, kc, vc = carry
        lp, li = inputs
        h = common.rms_norm(x, lp.attn_norm, cfg.rms_eps)
        if lp.wqkv is not None:
            q, k, v = jnp.split(matmul(lp, "wqkv", h, li, "bqkv", skip), [nh * hd, (nh + nkv) * hd], axis=-1)
        else:
            q, k, v = (matmul(lp, w, h, li, "b" + w[1], skip) for w in ("wq", "wk", "wv"))
        qs, ks, vs = per_group(q, nh), per_group(k, nkv), per_group(v, nkv)
        if lp.q_norm is not None:
            qs = [common.rms_norm(a, lp.q_norm, cfg.rms_eps) for a in qs]
            ks = [common.rms_norm(a, lp.k_norm, cfg.rms_eps) for a in ks]
        qs = [common.apply_rope(a, c, s, cfg.n_rot, cfg.rope_type) for a, (c, s) in zip(qs, ropes)]
        ks = [common.apply_rope(a, c, s, cfg.n_rot, cfg.rope_type) for a, (c, s) in zip(ks, ropes)]
        for (_, slots, start, _), kg, vg in zip(groups, ks, vs):  # every write before any read of the layer
            kc = common.write_kv(kc, li, kg, slots, start)
            vc = common.write_kv(vc, li, vg, slots, start)
        outs = []
        for (_, slots, start, _), qg, pos in zip(groups, qs, positions):
            if kernels.attention and native.attention_applies(qg, kc):  # decode rows, one CPU die: in place
                o = native.decode_attention(qg, kc, vc, li, slots, start, cfg.attn_scale)
            else:
                kspan = common.gather_span(kc, li, slots, span)
                vspan = common.gather_span(vc, li, slots, span)
                o = common.attention(qg, kspan, vspan, pos, cfg.attn_scale)
            outs.append(o.reshape(-1, nh * hd))
        o = outs[0] if len(outs) == 1 else jnp.concatenate(outs)
        x = x + matmul(lp, "wo", o, li, "bo", skip)
        h = common.rms_norm(x, lp.ffn_norm, cfg.rms_eps)
        if cfg.n_experts:
            x = x + moe(h, lp, li, cfg)
        else:
            if lp.w_gu is not None:
                g, u = jnp.split(matmul(lp, "w_gu", h, li, skip=skip), 2, axis=-1)
            else:
                g, u = matmul(lp, "w_gate", h, li, skip=skip), matmul(lp, "w_up", h, li, skip=skip)
            x = x + matmul(lp, "w_down", jax.nn.silu(g) * u, li, skip=skip)
        return (x, kc, vc), None

    # The matrices' stacks stay out of the scan's inputs: the body reads layer li of each in place
    # (weights.pick_linear) instead of letting the scan slice it, which would copy every matrix each
    # step. The scan slices the stacked vectors (the matrices' fields set to None there) and the body
    # puts the matrix stacks back, whole.
    listed = {k: a for k, a in common.present(params.layers).items() if isinstance(a, (tuple, weights.LayerStack))}
    per_layer = params.layers.replace(**{k: None for k in listed})

    def scanned(carry, inputs):
        lp, li = inputs
        return layer(carry, (lp.replace(**listed), li))

    layer_ids = jnp.arange(cfg.n_layers, dtype=jnp.int32)
    carry, _ = jax.lax.scan(scanned, (x, state.k, state.v), (per_layer, layer_ids))
    x, kc, vc = carry
    xs = [p.reshape(b, t, H) for p, (b, t) in zip(jnp.split(x, cuts), shapes)]
    return xs, state.replace(k=kc, v=vc)
