"""Qwen3.5 / Qwen3.5-MoE / Qwen3-Next: hybrids of Gated DeltaNet and gated full attention.

GGUF archs `qwen35` (dense SwiGLU FFN), `qwen35moe` and `qwen3next` (routed experts plus a
sigmoid-gated shared expert). Spec: shared/specs/qwen35moe.md (section numbers below refer to it).

Why the code is shaped this way:
* Layers are heterogeneous (three DeltaNet layers, then one attention layer, ...). The layer
  pattern is periodic, so the stack is a `lax.scan` over *periods* whose body unrolls one period:
  compile time stays that of one period whatever the depth (a non-periodic pattern is one period).
* Each slot carries, per DeltaNet layer, a conv state (the last K-1 pre-conv inputs) and a f32
  delta-rule state S (n_v x d_k x d_v); attention layers use the common slot KV cache. The whole
  state stacks ride in the layer scan's carry and each DeltaNet layer reads its rows' slots and
  writes them back in place (the engine donates the state): no step copies a per-layer stack.
* Padding tokens (t >= n_new[b]) must not move the recurrent state: their decay g and write
  strength beta are forced to 0 (an identity update) and the conv state is cut after the row's
  last real input. A row starting at position 0 begins a new sequence: its gathered state is
  zeroed, so a reused slot never sees its previous occupant.
* Decode (T == 1) uses the recurrent update; prefill uses the chunked (WY / triangular-solve)
  form, whose per-chunk work is batched and only the state hand-off between chunks is a scan.
* V-head j reads q/k head j mod n_k in qwen35* GGUFs (the converter tiled the V heads) and
  j // r in qwen3next (grouped): the wrong mapping silently wrecks the output (section 5.4).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from pantheon.errors import ModelLoadError
from pantheon.ops import weights
from pantheon.formats.gguf_loader import ModelConfig, TensorSource
from pantheon.ops.weights import XLA, Kernels, QuantWeight
from pantheon.jax_models import common
from pantheon.ops import moe_kernels
from pantheon.jax_models.interface import Capabilities

ARCHS = ("qwen35", "qwen35moe", "qwen3next")
# No forward_groups: a mixed step would have to gather and scatter the recurrent state of two row
# groups of different T; the engine runs prefill and decode as separate steps instead.
CAPABILITIES = Capabilities(recurrent_state=True)
DELTA_CHUNK = 64  # chunk length of the prefill delta rule (llama.cpp and HF use 64 too)
HIGHEST = jax.lax.Precision.HIGHEST  # delta-rule matmuls must not drop to TF32/bf16 passes on GPU


# ---- dimensions ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HybridDims:
    """The hybrid-specific sizes, derived from the GGUF `{arch}.*` keys in cfg.extra."""

    recurrent: tuple[bool, ...]  # per main layer: Gated DeltaNet (True) or full attention
    period: int  # the layer pattern repeats every `period` layers
    conv_k: int
    n_k: int
    n_v: int
    d_k: int
    d_v: int
    grouped: bool  # qwen3next: v-head j uses q/k head j // r; qwen35*: j % n_k
    shared_ffn: int

    @property
    def n_main(self) -> int:
        return len(self.recurrent)

    @property
    def n_lin(self) -> int:
        return sum(self.recurrent)

    @property
    def n_attn(self) -> int:
        return self.n_main - self.n_lin

    @property
    def groups(self) -> int:
        return self.n_main // self.period

    @property
    def key_dim(self) -> int:
        return self.n_k * self.d_k

    @property
    def value_dim(self) -> int:
        return self.n_v * self.d_v

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim


def _period(pattern: tuple[bool, ...]) -> int:
    n = len(pattern)
    for p in range(1, n + 1):
        if n % p == 0 and all(pattern[i] == pattern[i % p] for i in range(n)):
            return p
    return n


def hybrid_dims(cfg: ModelConfig) -> HybridDims:
    """Read the Gated DeltaNet sizes and the layer pattern (section 3's layer type rule)."""
    ex = cfg.extra
    missing = [key for key in ("ssm.conv_kernel", "ssm.state_size", "ssm.group_count", "ssm.time_step_rank",
                               "ssm.inner_size") if key not in ex]
    if missing:
        raise ValueError(f"{cfg.arch}: GGUF metadata lacks {', '.join(cfg.arch + '.' + m for m in missing)}")
    n_main = cfg.n_layers - int(ex.get("nextn_predict_layers", 0) or 0)  # MTP blocks are not run
    rec = ex.get("attention.recurrent_layers")
    if rec is not None and len(rec) >= n_main:
        recurrent = tuple(bool(r) for r in rec[:n_main])
    else:
        interval = int(ex.get("full_attention_interval", 4) or 4)
        recurrent = tuple((i + 1) % interval != 0 for i in range(n_main))
    n_v = int(ex["ssm.time_step_rank"])
    return HybridDims(
        recurrent=recurrent, period=_period(recurrent), conv_k=int(ex["ssm.conv_kernel"]),
        n_k=int(ex["ssm.group_count"]), n_v=n_v, d_k=int(ex["ssm.state_size"]),
        d_v=int(ex["ssm.inner_size"]) // n_v, grouped=cfg.arch == "qwen3next",
        shared_ffn=int(ex.get("expert_shared_feed_forward_length", 0) or 0))


# ---- parameters ------------------------------------------------------------------------------------
# Vectors of a layer kind are stacked [G, per, ...] (G periods of `per` layers of that kind) for the
# period scan; matrices are a tuple over that kind's layers in layer order as loaded, a
# weights.LayerStack once the engine stacks them (the scan body reads its period's layer in place).
Matrices = tuple[QuantWeight, ...] | weights.LayerStack
Stacked = Any  # [G, per, ...] f32 (numpy on the host, jax on the device)


@struct.dataclass
class DeltaNetLayers:
    """The Gated DeltaNet token mixers (qwen3next's packed ssm_in / ssm_ba already unpacked)."""

    w_qkv: Matrices  # [conv_dim, H]: rows [all q | all k | all v]
    w_z: Matrices  # [value_dim, H] output gate
    w_beta: Matrices  # [n_v, H] write strength
    w_alpha: Matrices  # [n_v, H] decay input
    a: Stacked  # [.., n_v] decay rate (negative)
    dt_bias: Stacked  # [.., n_v]
    conv: Stacked  # [.., conv_dim, conv_k] depthwise causal conv taps
    ssm_norm: Stacked  # [.., d_v]
    w_out: Matrices  # [H, value_dim]


@struct.dataclass
class GatedAttentionLayers:
    """The full-attention token mixers: q rows interleave [q | gate] per head (a sigmoid output gate)."""

    wq: Matrices  # [2*nh*hd, H]
    wk: Matrices  # [nkv*hd, H]
    wv: Matrices  # [nkv*hd, H]
    wo: Matrices  # [H, nh*hd]
    q_norm: Stacked  # [.., hd]
    k_norm: Stacked  # [.., hd]


@struct.dataclass
class BlockLayers:
    """What every main layer has whatever its mixer: the two norms and the FFN, either a dense
    SwiGLU (qwen35) or routed experts with an optional sigmoid-gated shared expert."""

    attn_norm: Stacked  # [.., H]
    post_norm: Stacked  # [.., H]
    w_gate: Optional[Matrices] = None  # dense [F, H], [F, H], [H, F]
    w_up: Optional[Matrices] = None
    w_down: Optional[Matrices] = None
    router: Optional[Stacked] = None  # [.., E, H]
    w_gate_e: Optional[Matrices] = None  # [E, F, H]
    w_up_e: Optional[Matrices] = None  # [E, F, H]
    w_down_e: Optional[Matrices] = None  # [E, H, F]
    sh_gate_inp: Optional[Stacked] = None  # [.., H]
    sh_gate: Optional[Matrices] = None  # [Fs, H], [Fs, H], [H, Fs]
    sh_up: Optional[Matrices] = None
    sh_down: Optional[Matrices] = None


@struct.dataclass
class Qwen35Params:
    """A hybrid model. `lin` / `attn` are None when the model has no layer of that kind; `head`
    None means the LM head is tied to the embedding."""

    embed: QuantWeight  # [V, H]
    norm: Any  # [H]
    layer: BlockLayers
    lin: Optional[DeltaNetLayers] = None
    attn: Optional[GatedAttentionLayers] = None
    head: Optional[QuantWeight] = None


def _split_ssm_in(w: QuantWeight, d: HybridDims) -> tuple[QuantWeight, QuantWeight]:
    """Legacy qwen3next `ssm_in` [(2 key + 2 value dims), H] packed per k-head group as
    [q, k, v (r heads), z (r heads)] -> (attn_qkv rows [all q | all k | all v], attn_gate rows).
    A row permutation, so it works on the file's blocks as they are."""
    r = d.n_v // d.n_k
    rows = np.arange(w.rows).reshape(d.n_k, 2 * d.d_k + 2 * r * d.d_v)
    q, k = rows[:, : d.d_k], rows[:, d.d_k: 2 * d.d_k]
    v, z = rows[:, 2 * d.d_k: 2 * d.d_k + r * d.d_v], rows[:, 2 * d.d_k + r * d.d_v:]
    return weights.take_rows(w, np.concatenate([q.ravel(), k.ravel(), v.ravel()])), weights.take_rows(w, z.ravel())


def _linear_layer(src: TensorSource, i: int, cfg: ModelConfig, d: HybridDims) -> dict[str, Any]:
    """One Gated DeltaNet block's tensors, with qwen3next's packed forms unpacked (section 9)."""
    H, p = cfg.hidden, f"blk.{i}."
    if src.has(p + "attn_qkv.weight"):
        w_qkv = src.matrix(p + "attn_qkv.weight", (d.conv_dim, H))
        w_z = src.matrix(p + "attn_gate.weight", (d.value_dim, H))
    else:
        w_qkv, w_z = _split_ssm_in(src.matrix(p + "ssm_in.weight", (d.conv_dim + d.value_dim, H)), d)
    if src.has(p + "ssm_ba.weight"):  # per k-head group [b (r), a (r)]
        r = d.n_v // d.n_k
        ba = src.matrix(p + "ssm_ba.weight", (2 * d.n_v, H))
        rows = np.arange(2 * d.n_v).reshape(d.n_k, 2 * r)
        w_beta, w_alpha = weights.take_rows(ba, rows[:, :r].ravel()), weights.take_rows(ba, rows[:, r:].ravel())
    else:
        w_beta = src.matrix(p + "ssm_beta.weight", (d.n_v, H))
        w_alpha = src.matrix(p + "ssm_alpha.weight", (d.n_v, H))
    return {
        "w_qkv": w_qkv, "w_z": w_z, "w_beta": w_beta, "w_alpha": w_alpha,
        "a": src.get(p + "ssm_a", (d.n_v,)), "dt_bias": src.get(p + "ssm_dt.bias", (d.n_v,)),
        "conv": src.get(p + "ssm_conv1d.weight", (d.conv_dim, d.conv_k)),
        "ssm_norm": src.get(p + "ssm_norm.weight", (d.d_v,)),
        "w_out": src.matrix(p + "ssm_out.weight", (H, d.value_dim)),
    }


def _attn_layer(src: TensorSource, i: int, cfg: ModelConfig) -> dict[str, Any]:
    H, nh, nkv, hd, p = cfg.hidden, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, f"blk.{i}."
    if src.has(p + "attn_q.weight"):
        wq = src.matrix(p + "attn_q.weight", (2 * nh * hd, H))
        wk = src.matrix(p + "attn_k.weight", (nkv * hd, H))
        wv = src.matrix(p + "attn_v.weight", (nkv * hd, H))
    else:  # fused Q(+gate)/K/V rows
        fused = src.matrix(p + "attn_qkv.weight", (2 * nh * hd + 2 * nkv * hd, H))
        q_end, k_end = 2 * nh * hd, 2 * nh * hd + nkv * hd
        wq, wk, wv = (weights.row_slice(fused, lo, hi) for lo, hi in ((0, q_end), (q_end, k_end),
                                                                     (k_end, fused.rows)))
    return {
        "wq": wq, "wk": wk, "wv": wv,
        "wo": src.matrix(p + "attn_output.weight", (H, nh * hd)),
        "q_norm": src.get(p + "attn_q_norm.weight", (hd,)),
        "k_norm": src.get(p + "attn_k_norm.weight", (hd,)),
    }


def _ffn_layer(src: TensorSource, i: int, cfg: ModelConfig, d: HybridDims) -> dict[str, Any]:
    H, p = cfg.hidden, f"blk.{i}."
    out: dict[str, Any] = {"attn_norm": src.get(p + "attn_norm.weight", (H,)),
                           "post_norm": src.get(p + "post_attention_norm.weight", (H,))}
    if not cfg.n_experts:
        out.update(w_gate=src.matrix(p + "ffn_gate.weight", (cfg.ffn, H)),
                   w_up=src.matrix(p + "ffn_up.weight", (cfg.ffn, H)),
                   w_down=src.matrix(p + "ffn_down.weight", (H, cfg.ffn)))
        return out
    E, F = cfg.n_experts, cfg.expert_ffn or cfg.ffn
    if src.has(p + "ffn_gate_up_exps.weight"):  # merged: rows [0, F) gate, [F, 2F) up
        gu = src.matrix(p + "ffn_gate_up_exps.weight", (E, 2 * F, H))
        wg, wu = weights.row_slice(gu, 0, F), weights.row_slice(gu, F, 2 * F)
    else:
        wg = src.matrix(p + "ffn_gate_exps.weight", (E, F, H))
        wu = src.matrix(p + "ffn_up_exps.weight", (E, F, H))
    out.update(router=src.get(p + "ffn_gate_inp.weight", (E, H)), w_gate_e=wg, w_up_e=wu,
               w_down_e=src.matrix(p + "ffn_down_exps.weight", (E, H, F)))
    if src.has(p + "ffn_gate_shexp.weight"):
        gate = src.matrix(p + "ffn_gate_shexp.weight")
        Fs = d.shared_ffn or gate.rows
        out.update(sh_gate_inp=src.get(p + "ffn_gate_inp_shexp.weight").reshape(H),  # {H} or {H, 1}
                   sh_gate=src.matrix(p + "ffn_gate_shexp.weight", (Fs, H)),
                   sh_up=src.matrix(p + "ffn_up_shexp.weight", (Fs, H)),
                   sh_down=src.matrix(p + "ffn_down_shexp.weight", (H, Fs)))
    return out


def _stack_groups(layers: list[dict[str, Any]], groups: int, cls: type) -> Any:
    """Per-layer dicts (in layer order) -> a `cls` of vectors stacked [groups, per_group, ...] for the
    period scan and matrices as a tuple over the layers in order; None when there are no layers."""
    if not layers:
        return None
    out: dict[str, Any] = {}
    for k in layers[0]:
        if isinstance(layers[0][k], QuantWeight):
            out[k] = tuple(lp[k] for lp in layers)
        else:
            out[k] = np.stack([lp[k] for lp in layers]).reshape((groups, len(layers) // groups) + layers[0][k].shape)
    return cls(**out)


def load_params(src: TensorSource, cfg: ModelConfig) -> Qwen35Params:
    """Host params: embedding/head and matrices as the file stores them (QuantWeight), vectors in
    per-type f32 stacks shaped [G, per, ...]."""
    try:
        d = hybrid_dims(cfg)
    except ValueError as exc:
        raise ModelLoadError(src.path, str(exc)) from exc
    if d.n_v % d.n_k:
        raise ModelLoadError(src.path, f"ssm.time_step_rank {d.n_v} is not a multiple of ssm.group_count {d.n_k}")
    H = cfg.hidden
    lin = [_linear_layer(src, i, cfg, d) for i in range(d.n_main) if d.recurrent[i]]
    attn = [_attn_layer(src, i, cfg) for i in range(d.n_main) if not d.recurrent[i]]
    per_layer = [_ffn_layer(src, i, cfg, d) for i in range(d.n_main)]
    return Qwen35Params(
        embed=src.matrix("token_embd.weight", (cfg.vocab, H)),
        norm=src.get("output_norm.weight", (H,)),
        head=None if cfg.tied_output else src.matrix("output.weight", (cfg.vocab, H)),
        lin=_stack_groups(lin, d.groups, DeltaNetLayers),
        attn=_stack_groups(attn, d.groups, GatedAttentionLayers),
        layer=_stack_groups(per_layer, d.groups, BlockLayers),
    )


# ---- state -----------------------------------------------------------------------------------------
@struct.dataclass
class RecurrentState:
    """The DeltaNet layers' per-slot state, f32: conv [L_lin, (S,) K-1, conv_dim] (the last K-1
    pre-conv inputs) and ssm [L_lin, (S,) n_v, d_k, d_v] (the delta-rule matrix). Unlike KV rows it
    cannot be rewound: it is only valid at the position it was last advanced to. With the slot
    axis it is part of the cache; without it, one slot's copy (`snapshot_slot`)."""

    conv: jax.Array
    ssm: jax.Array


@struct.dataclass
class HybridCache:
    """KV [L_attn, S, K, C, D] of the attention layers, and the DeltaNet layers' recurrent state."""

    k: jax.Array
    v: jax.Array
    recurrent: RecurrentState


def init_state(cfg: ModelConfig, n_slots: int, capacity: int, dtype=jnp.float32) -> HybridCache:
    """KV [L_attn, S, K, C, D] for attention layers; f32 conv [L_lin, S, K-1, conv_dim] and
    delta-rule state [L_lin, S, n_v, d_k, d_v] for DeltaNet layers."""
    d = hybrid_dims(cfg)
    kv = common.init_kv(d.n_attn, n_slots, cfg.n_kv_heads, capacity, cfg.head_dim, dtype)
    return HybridCache(k=kv.k, v=kv.v, recurrent=RecurrentState(
        conv=jnp.zeros((d.n_lin, n_slots, d.conv_k - 1, d.conv_dim), jnp.float32),
        ssm=jnp.zeros((d.n_lin, n_slots, d.n_v, d.d_k, d.d_v), jnp.float32)))


def state_bytes_per_token(cfg: ModelConfig) -> int:
    """f32 K and V of the attention layers only: DeltaNet layers cost nothing per token."""
    return 2 * hybrid_dims(cfg).n_attn * cfg.n_kv_heads * cfg.head_dim * 4


def state_bytes_per_sequence(cfg: ModelConfig) -> int:
    """The fixed f32 conv + recurrent state one sequence holds, whatever its length (section 6)."""
    d = hybrid_dims(cfg)
    return d.n_lin * ((d.conv_k - 1) * d.conv_dim + d.n_v * d.d_k * d.d_v) * 4


@jax.jit
def snapshot_slot(state: HybridCache, slot: jax.Array | int) -> RecurrentState:
    """Copies of one slot's conv and delta-rule state (what a KV prefix cache must store with the
    KV rows at a committed boundary: the recurrent state cannot be recomputed from KV)."""
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, slot, axis=1, keepdims=False), state.recurrent)


def _set_slot(state: HybridCache, slot: jax.Array | int, values: RecurrentState | None) -> HybridCache:
    def one(a: jax.Array, v: jax.Array | None) -> jax.Array:
        v = jnp.zeros_like(a[:, 0]) if v is None else v.astype(a.dtype)
        return jax.lax.dynamic_update_index_in_dim(a, v, slot, axis=1)

    rec = state.recurrent
    if values is None:
        new = jax.tree.map(lambda a: one(a, None), rec)
    else:
        new = jax.tree.map(one, rec, values)
    return state.replace(recurrent=new)


_restore = jax.jit(_set_slot, donate_argnums=0)  # donated like every engine step: use the result
_reset = jax.jit(lambda state, slot: _set_slot(state, slot, None), donate_argnums=0)


def restore_slot(state: HybridCache, slot: jax.Array | int, snap: RecurrentState) -> HybridCache:
    """The state with one slot's conv/recurrent state replaced by `snap` (from snapshot_slot).

    `state` is donated (as in every engine step): only the returned state may be used after.
    """
    return _restore(state, jnp.asarray(slot, jnp.int32), snap)


def reset_slot(state: HybridCache, slot: jax.Array | int) -> HybridCache:
    """The state with one slot's conv/recurrent state zeroed. forward already does this for any
    row starting at position 0; this is for callers that recycle a slot outside a step. `state`
    is donated."""
    return _reset(state, jnp.asarray(slot, jnp.int32))


# ---- Gated DeltaNet --------------------------------------------------------------------------------
def _l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """HF's x * rsqrt(sum x^2 + 1e-6) (llama.cpp's max(|x|, eps) differs negligibly)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def delta_recurrent(q: jax.Array, k: jax.Array, v: jax.Array, beta: jax.Array, g: jax.Array,
                    S: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Token-by-token delta rule. q, k [B, N, T, dk], v [B, N, T, dv], beta, g [B, N, T],
    S [B, N, dk, dv] -> (outputs [B, N, T, dv], final S). S_t = e^g (I - b k k^T) S + b k v^T."""
    def step(S, xs):
        qt, kt, vt, bt, gt = xs
        S = jnp.exp(gt)[..., None, None] * S
        u = jnp.einsum("bnkv,bnk->bnv", S, kt, precision=HIGHEST)
        S = S + kt[..., :, None] * (bt[..., None] * (vt - u))[..., None, :]
        return S, jnp.einsum("bnkv,bnk->bnv", S, qt, precision=HIGHEST)

    xs = tuple(jnp.moveaxis(a, 2, 0) for a in (q, k, v, beta, g))
    S, o = jax.lax.scan(step, S, xs)
    return jnp.moveaxis(o, 0, 2), S


def delta_step(q: jax.Array, k: jax.Array, v: jax.Array, beta: jax.Array, g: jax.Array,
               S: jax.Array) -> tuple[jax.Array, jax.Array]:
    """delta_recurrent for T == 1 in two passes over S instead of four: both products with the old
    state (S^T k and S^T q) come from one read, then one elementwise pass writes the new state.
    Uses o = S'^T q = e^g S^T q + (k . q) delta, where delta = b (v - e^g S^T k)."""
    q1, k1, v1, b1, g1 = q[:, :, 0], k[:, :, 0], v[:, :, 0], beta[:, :, 0], g[:, :, 0]
    decay = jnp.exp(g1)[..., None]  # [B, N, 1]
    sk = jnp.einsum("bnkv,bnk->bnv", S, k1, precision=HIGHEST)
    sq = jnp.einsum("bnkv,bnk->bnv", S, q1, precision=HIGHEST)
    delta = b1[..., None] * (v1 - decay * sk)  # [B, N, dv]
    o = decay * sq + jnp.sum(k1 * q1, axis=-1, keepdims=True) * delta
    S = decay[..., None] * S + k1[..., :, None] * delta[..., None, :]
    return o[:, :, None], S


def delta_chunked(q: jax.Array, k: jax.Array, v: jax.Array, beta: jax.Array, g: jax.Array,
                  S: jax.Array, chunk: int = DELTA_CHUNK) -> tuple[jax.Array, jax.Array]:
    """The same recurrence in chunked (WY) form, section 5.4. Shapes as delta_recurrent.

    Inside a chunk everything that does not depend on the incoming state (decay matrix, the unit
    lower-triangular solve, q k^T) is computed for all chunks at once; only the state hand-off is
    a scan. Exponents are masked before exp so every exponent taken is <= 0 (no overflow).
    """
    B, N, T, dk = k.shape
    dv = v.shape[-1]
    C = min(chunk, T)
    nc = -(-T // C)
    pad = nc * C - T
    if pad:  # zero q/k/v/beta and g = 0: identity steps whose outputs are dropped
        q, k, v = (jnp.pad(a, ((0, 0), (0, 0), (0, pad), (0, 0))) for a in (q, k, v))
        beta, g = (jnp.pad(a, ((0, 0), (0, 0), (0, pad))) for a in (beta, g))
    q, k, v = (a.reshape(B, N, nc, C, -1) for a in (q, k, v))
    beta, g = (a.reshape(B, N, nc, C) for a in (beta, g))
    gam = jnp.cumsum(g, axis=-1)  # cumulative log-decay inside each chunk
    ii = jnp.arange(C)
    incl = ii[:, None] >= ii[None, :]
    diff = gam[..., :, None] - gam[..., None, :]
    D = jnp.where(incl, jnp.exp(jnp.where(incl, diff, 0.0)), 0.0)  # e^(γi-γj), i >= j
    kk = jnp.einsum("...id,...jd->...ij", k, k, precision=HIGHEST)
    A = jnp.where(ii[:, None] > ii[None, :], beta[..., :, None] * kk * D, 0.0)
    rhs = jnp.concatenate([beta[..., None] * v, (beta * jnp.exp(gam))[..., None] * k], axis=-1)
    eye = jnp.eye(C, dtype=A.dtype)
    sol = jax.lax.linalg.triangular_solve(eye + A, rhs, left_side=True, lower=True, unit_diagonal=True)
    U, W = sol[..., :dv], sol[..., dv:]
    qk = jnp.einsum("...id,...jd->...ij", q, k, precision=HIGHEST) * D
    eq = jnp.exp(gam)[..., None] * q
    g_end = gam[..., -1]
    k_end = jnp.exp(g_end[..., None] - gam)[..., None] * k

    def step(S, xs):
        U, W, eq, qk, k_end, g_end = xs
        Vp = U - jnp.einsum("bncd,bnde->bnce", W, S, precision=HIGHEST)
        O = (jnp.einsum("bncd,bnde->bnce", eq, S, precision=HIGHEST)
             + jnp.einsum("bnij,bnje->bnie", qk, Vp, precision=HIGHEST))
        S = (jnp.exp(g_end)[..., None, None] * S
             + jnp.einsum("bncd,bnce->bnde", k_end, Vp, precision=HIGHEST))
        return S, O

    xs = tuple(jnp.moveaxis(a, 2, 0) for a in (U, W, eq, qk, k_end, g_end))
    S, O = jax.lax.scan(step, S, xs)
    O = jnp.moveaxis(O, 0, 2).reshape(B, N, nc * C, dv)[:, :, :T]
    return O, S


def _read_rows(stack: jax.Array, layer: jax.Array, slots: jax.Array, keep: jax.Array) -> jax.Array:
    """Rows `slots` of layer `layer` of a state stack [L, S, ...], zeroed where keep is 0 (a row
    starting a new sequence): a copy of those rows only.

    A loop over the rows with a data-dependent trip count, so the copy is complete before anything
    reads it: a slice or gather fused into the rows' consumers can run after the in-place write of
    the same stack, and XLA then copies the whole stack to keep the old values (measured: every
    layer's conv stack, every step). XLA:CPU's general gather is also several times slower."""
    n_rows = jnp.sum(slots >= 0).astype(jnp.int32)

    def row(b, out):
        return jax.lax.dynamic_update_index_in_dim(out, _row(stack, layer, slots[b]) * keep[b], b, 0)

    return jax.lax.fori_loop(0, n_rows, row, jnp.zeros((slots.shape[0],) + stack.shape[2:], stack.dtype))


def _row(stack: jax.Array, layer: jax.Array, slot: jax.Array) -> jax.Array:
    """[1, ...]: slot `slot` of layer `layer` of a state stack [L, S, ...], sliced where it lies."""
    zeros = (0,) * (stack.ndim - 2)
    return jax.lax.dynamic_slice(stack, (layer, slot) + zeros, (1, 1) + stack.shape[2:])[0]


def _delta_step_rows(ssm_all: jax.Array, layer: jax.Array, slots: jax.Array, keep: jax.Array, q: jax.Array,
                     k: jax.Array, v: jax.Array, beta: jax.Array, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    """delta_step for every row (q, k [B, N, 1, dk], v [B, N, 1, dv], beta, g [B, N, 1]) against its
    slot's state in the stack [L, S, N, dk, dv], read where it lies and written back in place.

    A loop over the rows: its body sees q/k/v as materialized inputs, so XLA cannot fuse the conv
    and norm arithmetic that made them into the pass over the state (it did, recomputing them per
    state element and copying whole stacks to order the reads before the in-place write). The trip
    count is data-dependent (rows with slot >= 0: all of them) so XLA keeps the loop."""
    zeros = (0,) * (ssm_all.ndim - 2)
    n_rows = jnp.sum(slots >= 0).astype(jnp.int32)

    def row(b, carry):
        stack, out = carry
        pick = lambda a: jax.lax.dynamic_index_in_dim(a, b, 0, keepdims=True)  # noqa: E731
        S = _row(stack, layer, slots[b]) * keep[b]
        o, S = delta_step(pick(q), pick(k), pick(v), pick(beta), pick(g), S)
        stack = jax.lax.dynamic_update_slice(stack, S.astype(stack.dtype)[None], (layer, slots[b]) + zeros)
        return stack, jax.lax.dynamic_update_index_in_dim(out, o[0], b, 0)

    out = jnp.zeros(v.shape, jnp.float32)
    return jax.lax.fori_loop(0, n_rows, row, (ssm_all, out))[::-1]


def _write_rows(stack: jax.Array, layer: jax.Array, slots: jax.Array, rows: jax.Array) -> jax.Array:
    """`stack` with rows `slots` of layer `layer` replaced, in place (the stack is carried, donated).

    A loop over the rows with a data-dependent trip count, so `rows` reaches it materialized: fused
    into the write, their producer would read the same stack (the conv state is a shifted window of
    itself) and XLA would copy the whole stack to order that read before the in-place write."""
    zeros = (0,) * (stack.ndim - 2)
    n_rows = jnp.sum(slots >= 0).astype(jnp.int32)

    def row(b, st):
        r = jax.lax.dynamic_index_in_dim(rows, b, 0, keepdims=True).astype(st.dtype)
        return jax.lax.dynamic_update_slice(st, r[None], (layer, slots[b]) + zeros)

    return jax.lax.fori_loop(0, n_rows, row, stack)


def _delta_mixer(h: jax.Array, mp: DeltaNetLayers, period: jax.Array, conv_all: jax.Array, ssm_all: jax.Array,
                 layer: jax.Array, slots: jax.Array, keep: jax.Array, valid: jax.Array, n_new: jax.Array,
                 d: HybridDims, eps: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Gated DeltaNet token mixer of h [B, T, H]; returns (output, conv stack, ssm stack) with the
    rows' slots of DeltaNet layer `layer` advanced in the stacks [L_lin, S, ...] (read and written
    in place). mp's matrices are this layer position's weights over the periods, picked by `period`."""
    B, T, _ = h.shape
    conv_state = _read_rows(conv_all, layer, slots, keep)
    mix = weights.pick_linear(mp.w_qkv, period, h).astype(jnp.float32)  # [B, T, conv_dim]
    z = weights.pick_linear(mp.w_z, period, h).astype(jnp.float32)
    b = weights.pick_linear(mp.w_beta, period, h).astype(jnp.float32)
    a = weights.pick_linear(mp.w_alpha, period, h).astype(jnp.float32)
    beta = jnp.where(valid[..., None], jax.nn.sigmoid(b), 0.0)
    g = jnp.where(valid[..., None], mp.a * jax.nn.softplus(a + mp.dt_bias), 0.0)

    # Causal depthwise conv over [last K-1 inputs | this step's inputs]; newest tap is w[:, K-1].
    K = d.conv_k
    buf = jnp.concatenate([conv_state, mix], axis=1)  # [B, K-1+T, conv_dim]
    w = mp.conv.astype(jnp.float32)
    c = sum(w[:, j] * buf[:, j: j + T] for j in range(K))
    new_conv = jax.vmap(lambda bb, n: jax.lax.dynamic_slice_in_dim(bb, n, K - 1, axis=0))(buf, n_new)
    c = jax.nn.silu(c)

    q = _l2norm(c[..., : d.key_dim].reshape(B, T, d.n_k, d.d_k)) * (d.d_k ** -0.5)
    k = _l2norm(c[..., d.key_dim: 2 * d.key_dim].reshape(B, T, d.n_k, d.d_k))
    v = c[..., 2 * d.key_dim:].reshape(B, T, d.n_v, d.d_v)
    r = d.n_v // d.n_k
    if d.grouped:
        q, k = jnp.repeat(q, r, axis=2), jnp.repeat(k, r, axis=2)
    else:
        q, k = jnp.tile(q, (1, 1, r, 1)), jnp.tile(k, (1, 1, r, 1))
    k = jnp.where(valid[..., None, None], k, 0.0)
    v = jnp.where(valid[..., None, None], v, 0.0)

    qh, kh, vh = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))  # [B, N, T, d]
    bh, gh = jnp.swapaxes(beta, 1, 2), jnp.swapaxes(g, 1, 2)
    if T == 1:
        o, ssm_all = _delta_step_rows(ssm_all, layer, slots, keep, qh, kh, vh, bh, gh)
    else:  # prefill (compute-bound): the rows' states gathered, advanced chunk-wise, written back
        o, S = delta_chunked(qh, kh, vh, bh, gh, _read_rows(ssm_all, layer, slots, keep))
        ssm_all = _write_rows(ssm_all, layer, slots, S)
    o = jnp.swapaxes(o, 1, 2)  # [B, T, n_v, d_v]
    o = common.rms_norm(o, mp.ssm_norm, eps) * jax.nn.silu(z.reshape(B, T, d.n_v, d.d_v))
    y = weights.pick_linear(mp.w_out, period, o.reshape(B, T, d.value_dim).astype(h.dtype))
    return y, _write_rows(conv_all, layer, slots, new_conv), ssm_all


# ---- gated attention -------------------------------------------------------------------------------
def _attn_mixer(h: jax.Array, mp: GatedAttentionLayers, g: jax.Array, kc: jax.Array, vc: jax.Array, layer: jax.Array,
                slots: jax.Array, start: jax.Array, positions: jax.Array, cos: jax.Array, sin: jax.Array,
                span: int, cfg: ModelConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Full attention with per-head q/k RMSNorm, partial NEOX RoPE and a sigmoid output gate."""
    B, T, _ = h.shape
    nh, nkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    qg = weights.pick_linear(mp.wq, g, h).reshape(B, T, nh, 2 * hd)  # per head [q | gate]
    q, gate = qg[..., :hd], qg[..., hd:].reshape(B, T, nh * hd)
    k = weights.pick_linear(mp.wk, g, h).reshape(B, T, nkv, hd)
    v = weights.pick_linear(mp.wv, g, h).reshape(B, T, nkv, hd)
    q = common.apply_rope(common.rms_norm(q, mp.q_norm, cfg.rms_eps), cos, sin, cfg.n_rot, cfg.rope_type)
    k = common.apply_rope(common.rms_norm(k, mp.k_norm, cfg.rms_eps), cos, sin, cfg.n_rot, cfg.rope_type)
    kc = common.write_kv(kc, layer, k, slots, start)
    vc = common.write_kv(vc, layer, v, slots, start)
    o = common.attention(q, common.gather_span(kc, layer, slots, span), common.gather_span(vc, layer, slots, span),
                         positions, cfg.attn_scale)
    o = o * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(o.dtype)
    return weights.pick_linear(mp.wo, g, o), kc, vc


# ---- FFN -------------------------------------------------------------------------------------------
def _swiglu(h: jax.Array, wg: Any, wu: Any, wd: Any, g: jax.Array) -> jax.Array:
    gate, up = weights.pick_linear(wg, g, h), weights.pick_linear(wu, g, h)
    return weights.pick_linear(wd, g, jax.nn.silu(gate) * up)


def _ffn(h: jax.Array, lp: BlockLayers, g: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Dense SwiGLU (qwen35) or routed experts + sigmoid-gated shared expert (section 5.6).
    The experts of this layer position over the periods are read in place from their stacks."""
    if lp.router is None:
        return _swiglu(h, lp.w_gate, lp.w_up, lp.w_down, g)
    scale = float(cfg.extra.get("expert_weights_scale", 0.0) or 0.0)
    scale = scale if scale not in (0.0, 1.0) else 1.0

    def routed(v: jax.Array, wg: Any, wu: Any, wd: Any) -> jax.Array:
        return moe_kernels.moe_ffn(v, lp.router, wg, wu, wd, cfg.n_experts_used, scale=scale)

    y = weights.with_layer((lp.w_gate_e, lp.w_up_e, lp.w_down_e), g, routed, h)
    if lp.sh_gate is not None:
        s = jax.nn.sigmoid(jnp.einsum("...h,h->...", h.astype(jnp.float32), lp.sh_gate_inp.astype(jnp.float32)))
        y = y + (s[..., None] * _swiglu(h, lp.sh_gate, lp.sh_up, lp.sh_down, g)).astype(y.dtype)
    return y


# ---- forward ---------------------------------------------------------------------------------------
def forward(params: Qwen35Params, state: HybridCache, tokens: jax.Array, slots: jax.Array,
            start: jax.Array, n_new: jax.Array, *, cfg: ModelConfig, span: int,
            all_logits: bool = False, kernels: Kernels = XLA) -> tuple[jax.Array, HybridCache]:
    """One step over B rows of T tokens each; the contract of llama.forward.

    Row b feeds n_new[b] real tokens (then padding) into slot slots[b] at positions start[b]...;
    the recurrent state kept is the one after the row's last real token, and start[b] == 0 starts
    the row from a zero recurrent state. Returns logits [B, V] (or [B, T, V]) and the new state.
    """
    x, new_state = _body(params, state, tokens, slots, start, n_new, cfg=cfg, span=span)
    if not all_logits:
        x = common.last_valid(x, n_new)
    x = common.rms_norm(x, params.norm, cfg.rms_eps)
    head = params.embed if params.head is None else params.head
    return weights.linear(x, head).astype(jnp.float32), new_state


def hidden_states(params: Qwen35Params, state: HybridCache, tokens: jax.Array, slots: jax.Array,
                  start: jax.Array, n_new: jax.Array, *, cfg: ModelConfig, span: int,
                  kernels: Kernels = XLA) -> tuple[jax.Array, HybridCache]:
    """The final hidden states [B, T, H] (after the final norm, before the LM head), every position.
    As in `forward`, a row starting at position 0 starts from a zero recurrent state."""
    x, new_state = _body(params, state, tokens, slots, start, n_new, cfg=cfg, span=span)
    return common.rms_norm(x, params.norm, cfg.rms_eps), new_state


def _body(params: Qwen35Params, state: HybridCache, tokens: jax.Array, slots: jax.Array, start: jax.Array,
          n_new: jax.Array, *, cfg: ModelConfig, span: int) -> tuple[jax.Array, HybridCache]:
    """The layer stack shared by the logits and the hidden-state outputs: the residual stream
    [B, T, H] after the last layer (before the final norm) and the updated state."""
    d = hybrid_dims(cfg)
    B, T = tokens.shape
    P, G = d.period, d.groups
    pattern = d.recurrent[:P]
    attn_per = P - sum(pattern)
    positions = start[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    valid = jnp.arange(T, dtype=jnp.int32)[None, :] < n_new[:, None]
    cos, sin = common.rope_angles(positions, cfg.n_rot, cfg.rope_base, cfg.rope_scale)
    x = weights.embed(params.embed, tokens)

    keep = (start != 0).astype(jnp.float32)  # start 0 = a new sequence: forget the slot's old state
    rec = state.recurrent

    # Matrices (stacks over the layers of a kind, in layer order) stay outside the scan's inputs
    # (their fields set to None there): position j of a period reads entries j, j + per, ... of the
    # stack, layer `period` of them in place (weights.pick_linear), so no step copies a weight.
    def split(group: Any) -> tuple[Any, dict[str, tuple]]:
        if group is None:
            return None, {}
        ws = {k: a for k, a in common.present(group).items() if isinstance(a, (tuple, weights.LayerStack))}
        return group.replace(**{k: None for k in ws}), ws

    per_layer, layer_w = split(params.layer)
    lin_v, lin_w = split(params.lin)
    attn_v, attn_w = split(params.attn)
    n_lin_per, n_attn_per = sum(pattern), attn_per

    def position(ws: dict[str, Any], j: int, per: int) -> dict[str, Any]:
        return {k: a.every(j, per) if isinstance(a, weights.LayerStack) else a[j::per] for k, a in ws.items()}

    def period(carry, xs):
        x, kc, vc, conv, ssm = carry
        lyr, lin, attn, g = xs
        n_done = 0
        for p in range(P):
            lp = jax.tree.map(lambda a: a[p], lyr).replace(**position(layer_w, p, P))
            h = common.rms_norm(x, lp.attn_norm, cfg.rms_eps)
            if pattern[p]:
                j = n_done
                n_done += 1
                mp = jax.tree.map(lambda a: a[j], lin).replace(**position(lin_w, j, n_lin_per))
                li = g * n_lin_per + j  # this DeltaNet layer's index in the state stacks
                y, conv, ssm = _delta_mixer(h, mp, g, conv, ssm, li, slots, keep, valid, n_new, d, cfg.rms_eps)
            else:
                j = p - n_done
                mp = jax.tree.map(lambda a: a[j], attn).replace(**position(attn_w, j, n_attn_per))
                y, kc, vc = _attn_mixer(h, mp, g, kc, vc, g * attn_per + j, slots, start, positions, cos, sin,
                                        span, cfg)
            x = x + y
            x = x + _ffn(common.rms_norm(x, lp.post_norm, cfg.rms_eps), lp, g, cfg)
        return (x, kc, vc, conv, ssm), None

    # The whole state stacks ride in the carry: each DeltaNet layer reads its rows' slots and writes
    # them back in place (the engine donates the state), so no step copies a per-layer stack.
    xs = (per_layer, lin_v, attn_v, jnp.arange(G, dtype=jnp.int32))
    (x, kc, vc, conv, ssm), _ = jax.lax.scan(period, (x, state.k, state.v, rec.conv, rec.ssm), xs)
    new_state = state.replace(k=kc, v=vc, recurrent=RecurrentState(conv=conv, ssm=ssm))
    return x, new_state

