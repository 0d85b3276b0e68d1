"""The llama family: llama (SmolLM2, Llama 2/3), mistral, qwen2 (q/k/v biases), qwen3 (q/k norm),
and the MoE variants mixtral / qwen3moe (router top-k over stacked experts).

Pure functions of (params, state, inputs) -> (outputs, state). Layer weights are stacked on a
leading axis and the layer loop is a `lax.scan` (fast to compile, one code path for any depth).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import native
from ..gguf_loader import ModelConfig, TensorSource
from . import common, moe_kernels

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "qwen3moe")


def load_params(src: TensorSource, cfg: ModelConfig, dtype=np.float32) -> dict[str, Any]:
    """Dequantize every tensor to `dtype` numpy arrays, layers stacked on axis 0."""
    H, nh, nkv, hd, L = cfg.hidden, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.n_layers
    emb = src.get("token_embd.weight", (cfg.vocab, H))
    params: dict[str, Any] = {
        "embed": emb.astype(dtype),
        "norm": src.get("output_norm.weight", (H,)),
        "head": None if cfg.tied_output else src.get("output.weight", (cfg.vocab, H)).astype(dtype),
    }
    if src.has("output.bias"):
        params["head_bias"] = src.get("output.bias", (cfg.vocab,))
    if src.has("rope_freqs.weight"):
        params["rope_freqs"] = src.get("rope_freqs.weight", (cfg.n_rot // 2,))

    def per_layer(fmt: str, shape: tuple[int, ...], wdtype=np.float32, optional: bool = False):
        arrs = []
        for i in range(L):
            name = fmt.format(i)
            if optional and not src.has(name):
                return None
            arrs.append(src.get(name, shape).astype(wdtype))
        return np.stack(arrs)

    layers: dict[str, Any] = {
        "attn_norm": per_layer("blk.{}.attn_norm.weight", (H,)),
        "wq": per_layer("blk.{}.attn_q.weight", (nh * hd, H), dtype),
        "wk": per_layer("blk.{}.attn_k.weight", (nkv * hd, H), dtype),
        "wv": per_layer("blk.{}.attn_v.weight", (nkv * hd, H), dtype),
        "wo": per_layer("blk.{}.attn_output.weight", (H, nh * hd), dtype),
        "ffn_norm": per_layer("blk.{}.ffn_norm.weight", (H,)),
    }
    for name, t, shape in (("bq", "attn_q", nh * hd), ("bk", "attn_k", nkv * hd), ("bv", "attn_v", nkv * hd),
                           ("bo", "attn_output", H)):
        b = per_layer("blk.{}." + t + ".bias", (shape,), optional=True)
        if b is not None:
            layers[name] = b
    if cfg.qk_norm:
        layers["q_norm"] = per_layer("blk.{}.attn_q_norm.weight", (hd,))
        layers["k_norm"] = per_layer("blk.{}.attn_k_norm.weight", (hd,))
    if cfg.n_experts:
        E, F = cfg.n_experts, cfg.expert_ffn or cfg.ffn
        layers["router"] = per_layer("blk.{}.ffn_gate_inp.weight", (E, H))
        layers["w_gate_e"] = per_layer("blk.{}.ffn_gate_exps.weight", (E, F, H), dtype)
        layers["w_up_e"] = per_layer("blk.{}.ffn_up_exps.weight", (E, F, H), dtype)
        layers["w_down_e"] = per_layer("blk.{}.ffn_down_exps.weight", (E, H, F), dtype)
    else:
        layers["w_gate"] = per_layer("blk.{}.ffn_gate.weight", (cfg.ffn, H), dtype)
        layers["w_up"] = per_layer("blk.{}.ffn_up.weight", (cfg.ffn, H), dtype)
        layers["w_down"] = per_layer("blk.{}.ffn_down.weight", (H, cfg.ffn), dtype)
    params["layers"] = layers
    return params


def fuse_projections(params: dict[str, Any]) -> dict[str, Any]:
    """Concatenate q/k/v into "wqkv" and gate/up into "w_gu" (their biases likewise), along the output axis.

    Why: matrices that read the same input become one larger matmul per layer, which XLA:CPU runs
    faster than two or three small ones (about 1.4x at 8 rows). Only for a single die: the tensor-
    parallel rules in pantheon.sharding split q, k and v by their own heads.
    """
    lay = dict(params["layers"])
    if all(k in lay for k in ("wq", "wk", "wv")):
        lay["wqkv"] = np.concatenate([lay.pop("wq"), lay.pop("wk"), lay.pop("wv")], axis=-2)
        if all(k in lay for k in ("bq", "bk", "bv")):
            lay["bqkv"] = np.concatenate([lay.pop("bq"), lay.pop("bk"), lay.pop("bv")], axis=-1)
    if "w_gate" in lay and "w_up" in lay:
        lay["w_gu"] = np.concatenate([lay.pop("w_gate"), lay.pop("w_up")], axis=-2)
    return {**params, "layers": lay}


_MATRICES = ("wqkv", "wq", "wk", "wv", "wo", "w_gu", "w_gate", "w_up", "w_down")


def unstack_matrices(params: dict[str, Any]) -> dict[str, Any]:
    """Each layer's projection matrices as their own arrays (a tuple over layers), not one [L, ...] stack.

    Why: inside the layer scan a stacked weight is read through a dynamic slice, and XLA:CPU
    materialises that slice: a copy of every weight matrix on every step (about half of a batch-1
    step). With one array per layer the scan body picks the layer's matmul with `lax.switch`
    (`matmul` below): no copy, and the program stays one loop body. Single die only, like fusion.
    """
    lay = dict(params["layers"])
    for k in _MATRICES:
        if k in lay:
            lay[k] = tuple(lay[k][i] for i in range(lay[k].shape[0]))
    return {**params, "layers": lay}


# Where each (fused) per-layer matrix comes from in a GGUF file, for its block-format twin.
GGUF_PARTS = {"wq": ("attn_q",), "wk": ("attn_k",), "wv": ("attn_v",), "wo": ("attn_output",),
              "wqkv": ("attn_q", "attn_k", "attn_v"), "w_gate": ("ffn_gate",), "w_up": ("ffn_up",),
              "w_gu": ("ffn_gate", "ffn_up"), "w_down": ("ffn_down",)}


def attach_blocks(params: dict[str, Any], src: Any, cfg: ModelConfig) -> dict[str, Any]:
    """Add "<matrix>_q" twins: each per-layer matrix (and the LM head) in its GGUF block format.

    Why: a decode step streams every weight once, and f32 weights are 4-7x the bytes of their
    Q4/Q5/Q8 blocks. pantheon.native's quantized product reads the blocks and expands them to exactly
    the f32 values `load_params` dequantized, so decode steps read a fraction of the bytes for the
    same results; prefill chunks (compute-bound) keep XLA's f32 GEMM. Only matrices stored whole in
    a format the kernel reads get a twin (a fused matrix needs all its parts in one format).
    """
    lay = dict(params["layers"])
    for name, parts in GGUF_PARTS.items():
        if not isinstance(lay.get(name), tuple):
            continue
        per_layer = []
        for i in range(cfg.n_layers):
            found = [src.blocks(f"blk.{i}.{part}.weight", native.QUANT_FORMATS) for part in parts]
            if any(f is None for f in found) or len({f[0] for f in found}) != 1:
                break
            per_layer.append(np.concatenate([f[1] for f in found]) if len(found) > 1 else np.asarray(found[0][1]))
        else:
            lay[name + "_q"] = tuple(per_layer)
    out = {**params, "layers": lay}
    head = src.blocks("token_embd.weight" if cfg.tied_output else "output.weight", native.QUANT_FORMATS)
    if head is not None:
        out["head_q"] = np.asarray(head[1])
    return out


def matmul(lp: dict[str, Any], name: str, h: jax.Array, li: jax.Array, bias: str | None = None,
           skip: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    """common.linear with layer li's weight `name`: stacked (already sliced by the scan) or per layer."""
    w, b = lp[name], lp.get(bias) if bias else None
    if isinstance(w, tuple):  # single die: the native kernels may take it (blocks: its GGUF twin)
        blocks = lp.get(name + "_q") or (None,) * len(w)
        return jax.lax.switch(li, [lambda x, wi=wi, qi=qi: common.linear(x, wi, b, native=True, blocks=qi, skip=skip)
                                   for wi, qi in zip(w, blocks)], h)
    return common.linear(h, w, b)


def init_state(cfg: ModelConfig, n_slots: int, capacity: int, dtype=jnp.float32) -> dict[str, jax.Array]:
    return common.init_kv(cfg.n_layers, n_slots, cfg.n_kv_heads, capacity, cfg.head_dim, dtype)


def state_bytes_per_token(cfg: ModelConfig) -> int:
    return cfg.kv_bytes_per_token


_EXPERT_KEYS = ("w_gate_e", "w_up_e", "w_down_e")


def moe(h: jax.Array, lp: dict[str, Any], cfg: ModelConfig) -> jax.Array:
    """Softmax router -> top-k -> renormalise -> weighted SwiGLU experts (the shared MoE kernels)."""
    return moe_kernels.moe_ffn(h, lp["router"], lp["w_gate_e"], lp["w_up_e"], lp["w_down_e"], cfg.n_experts_used)


Group = tuple[jax.Array, jax.Array, jax.Array, jax.Array]  # tokens [B, T], slots [B], start [B], n_new [B]


def forward(params: dict[str, Any], state: dict[str, jax.Array], tokens: jax.Array, slots: jax.Array,
            start: jax.Array, n_new: jax.Array, *, cfg: ModelConfig, span: int,
            all_logits: bool = False) -> tuple[jax.Array, dict[str, jax.Array]]:
    """One step over B rows of T tokens each.

    tokens [B, T] (row b holds n_new[b] real tokens, then padding), slots [B] cache slot of each row,
    start [B] position of tokens[b, 0]. `span` (static) bounds the cache positions attention reads:
    a bucket at least as large as every row's start + T. Returns logits [B, V] of each row's last
    real token (or [B, T, V] with all_logits) and the updated state.
    """
    return forward_groups(params, state, ((tokens, slots, start, n_new),), cfg=cfg, span=span, all_logits=all_logits)


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


def forward_groups(params: dict[str, Any], state: dict[str, jax.Array], groups: tuple[Group, ...], *,
                   cfg: ModelConfig, span: int, all_logits: bool = False) -> tuple[jax.Array, dict[str, jax.Array]]:
    """One step over several groups of rows, each group with its own tokens-per-row.

    Why groups: a prefill chunk ([1, T]) and the decode rows of every other slot ([B, 1]) can share
    one step. Every matmul sees all the step's tokens as one [N, H] block (the weights are read once
    for both), while RoPE, the cache writes and attention run per group in that group's own shape.
    Returns logits [sum of B, V] of each row's last real token, groups in order (all_logits: one
    group only, [B, T, V]).
    """
    if all_logits and len(groups) != 1:
        raise ValueError("all_logits takes exactly one group")
    nh, nkv, hd, H = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.hidden
    shapes = [g[0].shape for g in groups]
    sizes = [b * t for b, t in shapes]
    cuts = list(np.cumsum(sizes)[:-1])
    positions = [st[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :] for (_, _, st, _), (_, t) in zip(groups, shapes)]
    ropes = [common.rope_angles(p, cfg.n_rot, cfg.rope_base, cfg.rope_scale, params.get("rope_freqs"))
             for p in positions]
    x = jnp.concatenate([params["embed"][g[0].reshape(-1)] for g in groups]).astype(jnp.float32)  # [N, H]
    skip = _chunk_padding(groups, shapes)

    def per_group(a: jax.Array, heads: int) -> list[jax.Array]:
        return [p.reshape(b, t, heads, hd) for p, (b, t) in zip(jnp.split(a, cuts), shapes)]

    def layer(carry, inputs):
        x, kc, vc = carry
        lp, li = inputs
        h = common.rms_norm(x, lp["attn_norm"], cfg.rms_eps)
        if "wqkv" in lp:
            q, k, v = jnp.split(matmul(lp, "wqkv", h, li, "bqkv", skip), [nh * hd, (nh + nkv) * hd], axis=-1)
        else:
            q, k, v = (matmul(lp, w, h, li, "b" + w[1], skip) for w in ("wq", "wk", "wv"))
        qs, ks, vs = per_group(q, nh), per_group(k, nkv), per_group(v, nkv)
        if "q_norm" in lp:
            qs = [common.rms_norm(a, lp["q_norm"], cfg.rms_eps) for a in qs]
            ks = [common.rms_norm(a, lp["k_norm"], cfg.rms_eps) for a in ks]
        qs = [common.apply_rope(a, c, s, cfg.n_rot, cfg.rope_type) for a, (c, s) in zip(qs, ropes)]
        ks = [common.apply_rope(a, c, s, cfg.n_rot, cfg.rope_type) for a, (c, s) in zip(ks, ropes)]
        for (_, slots, start, _), kg, vg in zip(groups, ks, vs):  # every write before any read of the layer
            kc = common.write_kv(kc, li, kg, slots, start)
            vc = common.write_kv(vc, li, vg, slots, start)
        outs = []
        for (_, slots, start, _), qg, pos in zip(groups, qs, positions):
            if native.attention_applies(qg, kc):  # decode rows, one CPU die: read the slots in place
                o = native.decode_attention(qg, kc, vc, li, slots, start, cfg.attn_scale)
            else:
                kspan = common.gather_span(kc, li, slots, span)
                vspan = common.gather_span(vc, li, slots, span)
                o = common.attention(qg, kspan, vspan, pos, cfg.attn_scale)
            outs.append(o.reshape(-1, nh * hd))
        o = outs[0] if len(outs) == 1 else jnp.concatenate(outs)
        x = x + matmul(lp, "wo", o, li, "bo", skip)
        h = common.rms_norm(x, lp["ffn_norm"], cfg.rms_eps)
        if cfg.n_experts:
            x = x + moe(h, lp, cfg)
        else:
            if "w_gu" in lp:
                g, u = jnp.split(matmul(lp, "w_gu", h, li, skip=skip), 2, axis=-1)
            else:
                g, u = matmul(lp, "w_gate", h, li, skip=skip), matmul(lp, "w_up", h, li, skip=skip)
            x = x + matmul(lp, "w_down", jax.nn.silu(g) * u, li, skip=skip)
        return (x, kc, vc), None

    # Expert stacks stay out of the scan's inputs: the MoE tile loop reads (layer, expert) slices of
    # them directly instead of copying every expert of the layer each step.
    # Per-layer matrix tuples (unstack_matrices) likewise: the body switches over them by layer.
    stacked = {k: a for k, a in params["layers"].items() if k in _EXPERT_KEYS}
    listed = {k: a for k, a in params["layers"].items() if isinstance(a, tuple)}
    per_layer = {k: a for k, a in params["layers"].items() if k not in _EXPERT_KEYS and k not in listed}

    def scanned(carry, inputs):
        lp, li = inputs
        return layer(carry, ({**lp, **listed, **{k: (a, (li,)) for k, a in stacked.items()}}, li))

    layer_ids = jnp.arange(cfg.n_layers, dtype=jnp.int32)
    carry, _ = jax.lax.scan(scanned, (x, state["k"], state["v"]), (per_layer, layer_ids))
    x, kc, vc = carry
    xs = [p.reshape(b, t, H) for p, (b, t) in zip(jnp.split(x, cuts), shapes)]
    if all_logits:
        x = xs[0]
    else:
        x = jnp.concatenate([common.last_valid(xg, g[3]) for xg, g in zip(xs, groups)])
    x = common.rms_norm(x, params["norm"], cfg.rms_eps)
    head = params["embed"] if params["head"] is None else params["head"]
    whole = isinstance(params["layers"].get("wo"), tuple)  # unstacked: the model sits on one die
    logits = common.linear(x, head, params.get("head_bias"), native=whole,
                           blocks=params.get("head_q")).astype(jnp.float32)
    return logits, {"k": kc, "v": vc}
