"""RWKV-7 ("Goose"): a purely recurrent language model, GGUF arch `rwkv7` as llama.cpp's converter
writes it (from fla-hub's `RWKV7ForCausalLM` or BlinkDL's checkpoints).

Each layer is a time mix (the generalised delta rule over a per-head matrix state) and a channel
mix (a squared-ReLU FFN), both fed by a token shift (the previous token's normed input). Facts
used, per layer l, with LN a LayerNorm with bias and x the residual stream:

* x0 = LN0(embedding) once; xa = LN1(x); prev = xa of the previous token (the shift state at t=0).
* x_c = xa + (prev - xa) * mu_c for c in r, w, k, v, a, g (the file's `time_mix_lerp_fused`).
* r = W_r x_r; k = W_k x_k; v = W_v x_v;
  decay w = exp(-e^-0.5 * sigmoid(w0 + W2 tanh(W1 x_w)));
  a = sigmoid(a0 + A2 A1 x_a) (the in-context learning rate); g = G2 sigmoid(G1 x_g);
  layer 0 keeps its v as v_first, later layers mix v += (v_first - v) * sigmoid(v0 + V2 V1 x_v).
* kk = l2norm(k * k_k) per head; k = k * (1 + (a - 1) * k_a).
* Per head, S (d_v x d_k): S_t = S_{t-1} diag(w_t) - (S_{t-1} kk_t) (kk_t a_t)^T + v_t k_t^T;
  o_t = S_t r_t.
* o = GroupNorm(o, heads, eps 64e-5) * ln_x + b  +  v * sum_head(r * k * r_k); y = W_o (o * g).
* Channel mix: xf = LN2(x + y), shifted the same way; y2 = W_v relu(W_k x_k)^2.
* Output: LN_out, then the head.

Why the code is shaped this way:
* Everything a sequence carries is per slot and fixed-size: the two shift vectors and the WKV
  matrices of every layer. The rows of a step gather their slots' state once, the layer scan
  threads it through, and it is scattered back once, as qwen35 does for its DeltaNet layers.
  There is no KV cache, so prefix reuse is all or nothing (`recurrent_state`).
* Padding (t >= n_new[b]) must not move the state: its decay is forced to 1 and its k, kk to 0,
  so its update is the identity; the shift state is the row's last real token. A row starting at
  position 0 begins a new sequence: its gathered state is zeroed.
* Layer matrices are tuples over the layers as loaded (a `weights.LayerStack` once the engine
  stacks them), multiplied only through `weights.pick_linear`, which reads layer l in place. Layer 0 has no value-residual LoRA of its own
  rank (the file's v1/v2 there are dummies of another shape): it borrows layer 1's, whose
  product it then ignores (at layer 0 v_first == v, so the mix is the identity).
* Decode runs the recurrence for its one token. A prompt chunk runs it token by token in a scan on
  CPU (measured fastest there) and chunked on accelerators (`wkv_chunked`: 16 tokens per sequential
  step, everything else batched); the tests hold the two forms equal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from pantheon.errors import ModelLoadError
from pantheon.formats.gguf_loader import ModelConfig, TensorSource
from pantheon.jax_models import common
from pantheon.jax_models.interface import Capabilities
from pantheon.ops import weights
from pantheon.ops.weights import XLA, Kernels, QuantWeight

ARCHS = ("rwkv7",)
# No forward_groups: as for qwen35, a mixed step would gather and scatter the state of two row
# groups of different T; prefill and decode run as separate steps.
CAPABILITIES = Capabilities(recurrent_state=True)
GROUP_NORM_EPS = 64e-5  # llama.cpp's ln_x epsilon (fla: head_size * 1e-5, the same for head size 64)
DECAY_SCALE = math.exp(-0.5)  # w = exp(-e^-0.5 sigmoid(.)): every decay lies in (0.545, 1)
L2_EPS = 1e-12
WKV_CHUNK = 16  # tokens per sequential step of the chunked prefill (fla's RWKV-7 kernels use 16 too)
HIGHEST = jax.lax.Precision.HIGHEST  # the state products must not drop to TF32/bf16 passes on GPU


# ---- dimensions ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RwkvDims:
    n_heads: int
    head_size: int
    ln_eps: float


def rwkv_dims(cfg: ModelConfig) -> RwkvDims:
    """The RWKV sizes from the GGUF `rwkv7.*` keys (the loader set head_dim to wkv.head_size)."""
    ex = cfg.extra
    hs = int(ex.get("wkv.head_size", cfg.head_dim) or cfg.head_dim)
    if hs <= 0 or cfg.hidden % hs:
        raise ValueError(f"rwkv7: wkv.head_size {hs} does not divide embedding_length {cfg.hidden}")
    eps = float(ex.get("attention.layer_norm_epsilon", 1e-5) or 1e-5)
    return RwkvDims(n_heads=cfg.hidden // hs, head_size=hs, ln_eps=eps)


# ---- parameters ------------------------------------------------------------------------------------
Matrices = tuple[QuantWeight, ...] | weights.LayerStack  # per layer as loaded; a LayerStack once the engine stacks them
Stacked = Any  # [L, ...] f32 (numpy on the host, jax on the device)


@struct.dataclass
class Rwkv7Layers:
    """Every layer's tensors: vectors stacked [L, ...] for the layer scan, matrices as tuples."""

    ln1_w: Stacked  # [L, H] attn_norm
    ln1_b: Stacked
    ln2_w: Stacked  # [L, H] attn_norm_2 (before the channel mix)
    ln2_b: Stacked
    lerp: Stacked  # [L, 5 or 6, H] token-shift mixes for r, w, k, v, a(, g)
    w0: Stacked  # [L, H]
    a0: Stacked
    v0: Stacked
    k_k: Stacked
    k_a: Stacked
    r_k: Stacked  # [L, H] (heads x head_size)
    lnx_w: Stacked  # [L, H] per-head group norm
    lnx_b: Stacked
    ffn_lerp: Stacked  # [L, H]
    w_r: Matrices  # [H, H]
    w_k: Matrices
    w_v: Matrices
    w_o: Matrices
    w1: Matrices  # [rank_w, H] decay LoRA
    w2: Matrices  # [H, rank_w]
    a1: Matrices  # [rank_a, H] in-context learning rate LoRA
    a2: Matrices
    ffn_k: Matrices  # [F, H]
    ffn_v: Matrices  # [H, F]
    v1: Optional[Matrices] = None  # [rank_v, H] value residual LoRA (None with one layer)
    v2: Optional[Matrices] = None
    g1: Optional[Matrices] = None  # [rank_g, H] output gate LoRA (None: ungated)
    g2: Optional[Matrices] = None


@struct.dataclass
class Rwkv7Params:
    embed: QuantWeight  # [V, H]
    ln0_w: Any  # [H] token_embd_norm
    ln0_b: Any
    norm_w: Any  # [H] output_norm
    norm_b: Any
    head: QuantWeight  # [V, H]
    layer: Rwkv7Layers


def _vec(src: TensorSource, name: str, n: int) -> np.ndarray:
    """A vector stored with any unit axes ({n}, {n,1,1}, {1,1,n}) as [n]."""
    a = src.get(name)
    if a.size != n:
        raise ModelLoadError(src.path, f"tensor {name!r} has {a.size} values, expected {n}")
    return a.reshape(n)


def _layer(src: TensorSource, i: int, cfg: ModelConfig) -> dict[str, Any]:
    H, p = cfg.hidden, f"blk.{i}."
    gated = src.has(p + "time_mix_g1.weight")  # as in llama.cpp: the gate exists when its LoRA does
    n_lerp = 6 if gated else 5
    lerp = src.get(p + "time_mix_lerp_fused.weight")
    if lerp.size != n_lerp * H:
        raise ModelLoadError(src.path, f"{p}time_mix_lerp_fused.weight has {lerp.size} values, "
                                       f"expected {n_lerp} x {H}")
    out: dict[str, Any] = {
        "ln1_w": _vec(src, p + "attn_norm.weight", H), "ln1_b": _vec(src, p + "attn_norm.bias", H),
        "ln2_w": _vec(src, p + "attn_norm_2.weight", H), "ln2_b": _vec(src, p + "attn_norm_2.bias", H),
        "lerp": lerp.reshape(n_lerp, H),
        "w0": _vec(src, p + "time_mix_w0.weight", H), "a0": _vec(src, p + "time_mix_a0.weight", H),
        "v0": _vec(src, p + "time_mix_v0.weight", H) if src.has(p + "time_mix_v0.weight") else np.zeros(H, np.float32),
        "k_k": _vec(src, p + "time_mix_k_k.weight", H), "k_a": _vec(src, p + "time_mix_k_a.weight", H),
        "r_k": _vec(src, p + "time_mix_r_k.weight", H),
        "lnx_w": _vec(src, p + "time_mix_ln.weight", H), "lnx_b": _vec(src, p + "time_mix_ln.bias", H),
        "ffn_lerp": _vec(src, p + "channel_mix_lerp_k.weight", H),
        "w_r": src.matrix(p + "time_mix_receptance.weight", (H, H)),
        "w_k": src.matrix(p + "time_mix_key.weight", (H, H)),
        "w_v": src.matrix(p + "time_mix_value.weight", (H, H)),
        "w_o": src.matrix(p + "time_mix_output.weight", (H, H)),
        "w1": src.matrix(p + "time_mix_w1.weight"), "w2": src.matrix(p + "time_mix_w2.weight"),
        "a1": src.matrix(p + "time_mix_a1.weight"), "a2": src.matrix(p + "time_mix_a2.weight"),
        "ffn_k": src.matrix(p + "channel_mix_key.weight", (cfg.ffn, H)),
        "ffn_v": src.matrix(p + "channel_mix_value.weight", (H, cfg.ffn)),
    }
    if i > 0:
        out["v1"] = src.matrix(p + "time_mix_v1.weight")
        out["v2"] = src.matrix(p + "time_mix_v2.weight")
    if gated:
        out["g1"] = src.matrix(p + "time_mix_g1.weight")
        out["g2"] = src.matrix(p + "time_mix_g2.weight")
    for lo, hi in (("w1", "w2"), ("a1", "a2"), ("v1", "v2"), ("g1", "g2")):
        if lo in out and (out[lo].cols != H or out[hi].rows != H or out[hi].cols != out[lo].rows):
            raise ModelLoadError(src.path, f"{p}time_mix_{lo}/{hi} shapes {out[lo].shape} / {out[hi].shape} "
                                           f"do not form a LoRA of width {H}")
    return out


def load_params(src: TensorSource, cfg: ModelConfig) -> Rwkv7Params:
    """Host params: matrices as the file stores them (QuantWeight), vectors as f32 stacks [L, ...]."""
    try:
        rwkv_dims(cfg)
    except ValueError as exc:
        raise ModelLoadError(src.path, str(exc)) from exc
    H = cfg.hidden
    per = [_layer(src, i, cfg) for i in range(cfg.n_layers)]
    if len({"g1" in lp for lp in per}) > 1:
        raise ModelLoadError(src.path, "rwkv7: some layers have the output gate (time_mix_g1) and some do not")
    if len(per) > 1:  # layer 0 borrows layer 1's value LoRA (see the module docstring)
        per[0]["v1"], per[0]["v2"] = per[1]["v1"], per[1]["v2"]
    fields: dict[str, Any] = {}
    for k in per[0]:
        if isinstance(per[0][k], QuantWeight):
            fields[k] = tuple(lp[k] for lp in per)
        else:
            fields[k] = np.stack([lp[k] for lp in per])
    return Rwkv7Params(
        embed=src.matrix("token_embd.weight", (cfg.vocab, H)),
        ln0_w=_vec(src, "token_embd_norm.weight", H), ln0_b=_vec(src, "token_embd_norm.bias", H),
        norm_w=_vec(src, "output_norm.weight", H), norm_b=_vec(src, "output_norm.bias", H),
        head=src.matrix("output.weight", (cfg.vocab, H)) if src.has("output.weight")
        else src.matrix("token_embd.weight", (cfg.vocab, H)),
        layer=Rwkv7Layers(**fields))


# ---- state -----------------------------------------------------------------------------------------
@struct.dataclass
class RwkvState:
    """Per slot, f32: shift [L, (S,) 2, H] (the last token's LN1 and LN2 outputs) and wkv
    [L, (S,) heads, d_v, d_k]. With the slot axis it is the whole cache; without it, one slot's copy
    (`snapshot_slot`). It cannot be rewound: it is valid only at the position it last reached."""

    shift: jax.Array
    wkv: jax.Array


def init_state(cfg: ModelConfig, n_slots: int, capacity: int, dtype: Any = jnp.float32) -> RwkvState:
    """Zeroed state for `n_slots` slots; `capacity` and `dtype` (the KV dtype) do not apply: there is
    no KV cache and the recurrent state stays f32."""
    d = rwkv_dims(cfg)
    return RwkvState(shift=jnp.zeros((cfg.n_layers, n_slots, 2, cfg.hidden), jnp.float32),
                     wkv=jnp.zeros((cfg.n_layers, n_slots, d.n_heads, d.head_size, d.head_size), jnp.float32))


def state_bytes_per_token(cfg: ModelConfig) -> int:
    """Nothing grows with the sequence."""
    return 0


def state_bytes_per_sequence(cfg: ModelConfig) -> int:
    """The fixed f32 shift vectors and WKV matrices one sequence holds."""
    d = rwkv_dims(cfg)
    return cfg.n_layers * (2 * cfg.hidden + d.n_heads * d.head_size * d.head_size) * 4


@jax.jit
def snapshot_slot(state: RwkvState, slot: jax.Array | int) -> RwkvState:
    """Copies of one slot's shift and WKV state (what a prefix cache keeps at a committed boundary)."""
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, slot, axis=1, keepdims=False), state)


def _set_slot(state: RwkvState, slot: jax.Array | int, values: RwkvState | None) -> RwkvState:
    def one(a: jax.Array, v: jax.Array | None) -> jax.Array:
        v = jnp.zeros_like(a[:, 0]) if v is None else v.astype(a.dtype)
        return jax.lax.dynamic_update_index_in_dim(a, v, slot, axis=1)

    if values is None:
        return jax.tree.map(lambda a: one(a, None), state)
    return jax.tree.map(one, state, values)


_restore = jax.jit(_set_slot, donate_argnums=0)
_reset = jax.jit(lambda state, slot: _set_slot(state, slot, None), donate_argnums=0)


def restore_slot(state: RwkvState, slot: jax.Array | int, snap: RwkvState) -> RwkvState:
    """The state with one slot replaced by `snap` (from snapshot_slot); `state` is donated."""
    return _restore(state, jnp.asarray(slot, jnp.int32), snap)


def reset_slot(state: RwkvState, slot: jax.Array | int) -> RwkvState:
    """The state with one slot zeroed (forward already does this for a row at position 0); donated."""
    return _reset(state, jnp.asarray(slot, jnp.int32))


# ---- the layer -------------------------------------------------------------------------------------
def layer_norm(x: jax.Array, w: jax.Array, b: jax.Array, eps: float) -> jax.Array:
    """LayerNorm over the last axis with weight and bias, in f32."""
    x = x.astype(jnp.float32)
    mu = jnp.mean(x, axis=-1, keepdims=True)
    xc = x - mu
    return xc * jax.lax.rsqrt(jnp.mean(xc * xc, axis=-1, keepdims=True) + eps) * w + b


def wkv_step(S: jax.Array, r: jax.Array, w: jax.Array, k: jax.Array, v: jax.Array, kk: jax.Array,
             b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One token of the generalised delta rule for every row and head. S [B, N, dv, dk]; the rest
    [B, N, d]. S' = S diag(w) - (S kk) b^T + v k^T (b = kk * a); returns (S', S' r)."""
    sk = jnp.einsum("bnij,bnj->bni", S, kk, precision=HIGHEST)
    S = S * w[:, :, None, :] - sk[..., None] * b[:, :, None, :] + v[..., None] * k[:, :, None, :]
    return S, jnp.einsum("bnij,bnj->bni", S, r, precision=HIGHEST)


def wkv_recurrent(S: jax.Array, r: jax.Array, w: jax.Array, k: jax.Array, v: jax.Array, kk: jax.Array,
                  b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The recurrence token by token: inputs [B, T, N, d], S [B, N, dv, dk] -> (out [B, T, N, dv], S)."""
    if r.shape[1] == 1:
        S, o = wkv_step(S, r[:, 0], w[:, 0], k[:, 0], v[:, 0], kk[:, 0], b[:, 0])
        return o[:, None], S

    def step(S, xs):
        return wkv_step(S, *xs)

    S, o = jax.lax.scan(step, S, tuple(jnp.moveaxis(a, 1, 0) for a in (r, w, k, v, kk, b)))
    return jnp.moveaxis(o, 0, 1), S


def wkv_chunked(S: jax.Array, r: jax.Array, w: jax.Array, k: jax.Array, v: jax.Array, kk: jax.Array,
                b: jax.Array, chunk: int = WKV_CHUNK) -> tuple[jax.Array, jax.Array]:
    """The same recurrence, `chunk` tokens per sequential step (shapes as `wkv_recurrent`).

    Each value row s of a head's state evolves alone: s_t = s_{t-1} diag(w_t) + u_t b_t + v_t k_t with
    the scalar u_t = -s_{t-1}.kk_t. Inside a chunk, with L_t the cumulative log-decay, s_t is s_0 decayed
    plus a sum over the chunk's writes decayed by exp(L_t - L_tau), so the u's of a chunk solve one
    unit-triangular C x C system: u (I - M_b) = s_0 A0 + v M_k. Every matrix that does not involve s_0
    (M_b, M_k, the solve's inverse, the output and end-of-chunk weights) is built for all chunks at
    once as products of per-token factors exp(L_t) and exp(-L_tau); the scan over the chunks only does
    small matrix products with the carried state. Padding (decay 1, k = kk = 0) is an
    identity step, so the last chunk is padded with it.
    """
    B, T, N, dk = r.shape
    dv = v.shape[-1]
    C = min(chunk, T)
    nc = -(-T // C)
    pad = nc * C - T

    def blocks(x: jax.Array, fill: float = 0.0) -> jax.Array:  # [B, T, N, d] -> [B, N, nc, C, d]
        if pad:
            x = jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0)), constant_values=fill)
        return jnp.moveaxis(x, 1, 2).reshape(B, N, nc, C, x.shape[-1])

    r, k, v, kk, b = (blocks(x) for x in (r, k, v, kk, b))
    logw = jnp.log(blocks(w, 1.0))
    L = jnp.cumsum(logw, axis=-2)  # through token t
    Lp = L - logw  # through token t - 1
    tau = jnp.arange(C)
    strict = tau[:, None] < tau[None, :]  # [tau, t]
    incl = tau[:, None] <= tau[None, :]
    # exp(L_t - L_tau) factorised as exp(L_t) * exp(-L_tau): every RWKV-7 decay is >= e^-e^-0.5 (0.545),
    # so within a chunk of 16 no factor exceeds 0.545^-16 (1.6e4); the masked-out (tau > t) products
    # are the only large ones and are dropped.
    inv = jnp.exp(-L)
    bq, kq = b * inv, k * inv
    a = -kk
    ap, rq = a * jnp.exp(Lp), r * jnp.exp(L)

    def tri(x: jax.Array, y: jax.Array, mask: jax.Array) -> jax.Array:  # [.., tau, t] = x_tau . y_t
        return jnp.where(mask, jnp.einsum("...sj,...tj->...st", x, y, precision=HIGHEST), 0.0)

    Mb, Mk, Rb, Rk = tri(bq, ap, strict), tri(kq, ap, strict), tri(bq, rq, incl), tri(kq, rq, incl)
    eye = jnp.eye(C, dtype=Mb.dtype)
    P = jax.lax.linalg.triangular_solve(eye - Mb, jnp.broadcast_to(eye, Mb.shape), left_side=False,
                                        lower=False, unit_diagonal=True)  # (I - Mb)^-1, upper triangular
    A0, Rr = ap, rq  # [.., t, dk]: s_0 decayed to t - 1 meets the removal key; decayed to t, r
    g_end = jnp.exp(L[..., -1, :])  # [.., dk]
    end = jnp.exp(L[..., -1:, :] - L)  # [.., tau, dk]
    vT = jnp.swapaxes(v, -1, -2)  # [.., dv, C]
    VMk = jnp.einsum("...is,...st->...it", vT, Mk, precision=HIGHEST)
    VRk = jnp.einsum("...is,...st->...it", vT, Rk, precision=HIGHEST)
    VK = jnp.einsum("...is,...sj->...ij", vT, k * end, precision=HIGHEST)
    Bend = b * end

    def step(S, xs):
        A0, Rr, P, Rb, VMk, VRk, VK, Bend, g_end = xs
        U = jnp.einsum("bnij,bntj->bnit", S, A0, precision=HIGHEST) + VMk
        U = jnp.einsum("bnis,bnst->bnit", U, P, precision=HIGHEST)
        O = (jnp.einsum("bnij,bntj->bnit", S, Rr, precision=HIGHEST)
             + jnp.einsum("bnis,bnst->bnit", U, Rb, precision=HIGHEST) + VRk)
        S = S * g_end[:, :, None, :] + jnp.einsum("bnis,bnsj->bnij", U, Bend, precision=HIGHEST) + VK
        return S, O

    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (A0, Rr, P, Rb, VMk, VRk, VK, Bend, g_end))
    S, O = jax.lax.scan(step, S, xs)  # O: [nc, B, N, dv, C]
    O = jnp.moveaxis(O, 0, 2)  # [B, N, nc, dv, C]
    O = jnp.swapaxes(O, -1, -2).reshape(B, N, nc * C, dv)[:, :, :T]
    return jnp.swapaxes(O, 1, 2), S


def chunked_prefill() -> bool:
    """Whether a prompt chunk runs `wkv_chunked` (decided when a step is traced).

    On CPU, no: the token loop measured 1.6-3.5x faster than the chunked form at 64-512 tokens and
    12-32 heads (XLA:CPU runs the per-token 64 x 64 products well; the chunked form's batched
    C x C products and triangular solves cost more), and the loop itself is about 6% of a prefill
    there. On an accelerator, yes: the loop is T sequential steps per layer of tiny kernels, the
    chunked form T / 16 (not measured: no accelerator was at hand). CHUNKED_PREFILL overrides.
    """
    return jax.default_backend() != "cpu" if CHUNKED_PREFILL is None else CHUNKED_PREFILL


CHUNKED_PREFILL: Optional[bool] = None  # None: chunked_prefill() decides by the backend


def wkv(S: jax.Array, r: jax.Array, w: jax.Array, k: jax.Array, v: jax.Array, kk: jax.Array,
        b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The recurrence over T tokens: token by token (always for a decode step), or chunked."""
    if r.shape[1] > 1 and chunked_prefill():
        return wkv_chunked(S, r, w, k, v, kk, b)
    return wkv_recurrent(S, r, w, k, v, kk, b)


def _time_mix(xa: jax.Array, prev: jax.Array, lv: Rwkv7Layers, mats: dict[str, Matrices], li: jax.Array,
              S: jax.Array, v_first: jax.Array, valid: jax.Array,
              d: RwkvDims) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The time mix of xa [B, T, H]; returns (output, new WKV state, v_first)."""
    B, T, H = xa.shape
    N, hs = d.n_heads, d.head_size

    def lin(name: str, x: jax.Array) -> jax.Array:
        return weights.pick_linear(mats[name], li, x).astype(jnp.float32)

    sx = prev - xa
    mixed = xa[:, :, None, :] + sx[:, :, None, :] * lv.lerp  # [B, T, 5|6, H]
    xr, xw, xk, xv, xa_ = (mixed[:, :, i] for i in range(5))
    r = lin("w_r", xr)
    logw = -DECAY_SCALE * jax.nn.sigmoid(lv.w0 + lin("w2", jnp.tanh(lin("w1", xw))))
    k = lin("w_k", xk)
    v = lin("w_v", xv)
    v_first = jnp.where(li == 0, v, v_first)
    if "v1" in mats:  # identity at layer 0, where v_first == v
        v = v + (v_first - v) * jax.nn.sigmoid(lv.v0 + lin("v2", lin("v1", xv)))
    a = jax.nn.sigmoid(lv.a0 + lin("a2", lin("a1", xa_)))

    kk = (k * lv.k_k).reshape(B, T, N, hs)
    kk = kk / jnp.maximum(jnp.sqrt(jnp.sum(kk * kk, axis=-1, keepdims=True)), L2_EPS)
    k = k * (1.0 + (a - 1.0) * lv.k_a)

    heads = (B, T, N, hs)
    m = valid[:, :, None, None]  # padding: decay 1, no write, no removal
    w_h = jnp.where(m, jnp.exp(logw).reshape(heads), 1.0)
    k_h = jnp.where(m, k.reshape(heads), 0.0)
    kk = jnp.where(m, kk, 0.0)
    v_h, r_h = v.reshape(heads), r.reshape(heads)
    o, S = wkv(S, r_h, w_h, k_h, v_h, kk, kk * a.reshape(heads))

    mu = jnp.mean(o, axis=-1, keepdims=True)
    oc = o - mu
    o = oc * jax.lax.rsqrt(jnp.mean(oc * oc, axis=-1, keepdims=True) + GROUP_NORM_EPS)
    o = o.reshape(B, T, H) * lv.lnx_w + lv.lnx_b
    bonus = jnp.sum(r_h * k_h * lv.r_k.reshape(N, hs), axis=-1, keepdims=True) * v_h
    o = o + bonus.reshape(B, T, H)
    if "g1" in mats:
        o = o * lin("g2", jax.nn.sigmoid(lin("g1", mixed[:, :, 5])))
    return lin("w_o", o), S, v_first


def _channel_mix(xf: jax.Array, prev: jax.Array, lv: Rwkv7Layers, mats: dict[str, Matrices],
                 li: jax.Array) -> jax.Array:
    xk = xf + (prev - xf) * lv.ffn_lerp
    h = jnp.square(jax.nn.relu(weights.pick_linear(mats["ffn_k"], li, xk).astype(jnp.float32)))
    return weights.pick_linear(mats["ffn_v"], li, h).astype(jnp.float32)


def _shifted(x: jax.Array, first: jax.Array) -> jax.Array:
    """x [B, T, H] delayed by one token, `first` [B, H] in front."""
    return jnp.concatenate([first[:, None, :], x[:, :-1]], axis=1)


# ---- forward ---------------------------------------------------------------------------------------
def _body(params: Rwkv7Params, state: RwkvState, tokens: jax.Array, slots: jax.Array, start: jax.Array,
          n_new: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, RwkvState]:
    """The layer stack: the residual stream [B, T, H] after the last layer and the updated state."""
    d = rwkv_dims(cfg)
    B, T = tokens.shape
    valid = jnp.arange(T, dtype=jnp.int32)[None, :] < n_new[:, None]
    x = layer_norm(weights.embed(params.embed, tokens), params.ln0_w, params.ln0_b, d.ln_eps)

    keep = (start != 0).astype(jnp.float32)  # start 0 = a new sequence: forget the slot's old state
    shift0 = state.shift[:, slots] * keep[None, :, None, None]
    wkv0 = state.wkv[:, slots] * keep[None, :, None, None, None]
    last = jnp.clip(n_new - 1, 0, T - 1)
    has = (n_new > 0)[:, None]

    mats = {k: a for k, a in common.present(params.layer).items() if isinstance(a, (tuple, weights.LayerStack))}
    vecs = params.layer.replace(**{k: None for k in mats})

    def last_of(h: jax.Array, old: jax.Array) -> jax.Array:
        return jnp.where(has, jnp.take_along_axis(h, last[:, None, None], axis=1)[:, 0], old)

    def layer(carry, xs):
        x, v_first = carry
        lv, sh, S, li = xs
        xa = layer_norm(x, lv.ln1_w, lv.ln1_b, d.ln_eps)
        y, S, v_first = _time_mix(xa, _shifted(xa, sh[:, 0]), lv, mats, li, S, v_first, valid, d)
        x = x + y
        xf = layer_norm(x, lv.ln2_w, lv.ln2_b, d.ln_eps)
        x = x + _channel_mix(xf, _shifted(xf, sh[:, 1]), lv, mats, li)
        new_sh = jnp.stack([last_of(xa, sh[:, 0]), last_of(xf, sh[:, 1])], axis=1)
        return (x, v_first), (new_sh, S)

    xs = (vecs, shift0, wkv0, jnp.arange(cfg.n_layers, dtype=jnp.int32))
    (x, _), (shift1, wkv1) = jax.lax.scan(layer, (x, jnp.zeros_like(x)), xs)
    new_state = RwkvState(shift=state.shift.at[:, slots].set(shift1), wkv=state.wkv.at[:, slots].set(wkv1))
    return x, new_state


def forward(params: Rwkv7Params, state: RwkvState, tokens: jax.Array, slots: jax.Array, start: jax.Array,
            n_new: jax.Array, *, cfg: ModelConfig, span: int, all_logits: bool = False,
            kernels: Kernels = XLA) -> tuple[jax.Array, RwkvState]:
    """One step over B rows of T tokens (the contract of `interface.ArchModule.forward`); `span` does
    not apply (nothing is attended). The state kept is the one after each row's last real token."""
    x, new_state = _body(params, state, tokens, slots, start, n_new, cfg)
    if not all_logits:
        x = common.last_valid(x, n_new)
    x = layer_norm(x, params.norm_w, params.norm_b, rwkv_dims(cfg).ln_eps)
    return weights.linear(x, params.head).astype(jnp.float32), new_state


def hidden_states(params: Rwkv7Params, state: RwkvState, tokens: jax.Array, slots: jax.Array, start: jax.Array,
                  n_new: jax.Array, *, cfg: ModelConfig, span: int,
                  kernels: Kernels = XLA) -> tuple[jax.Array, RwkvState]:
    """The final hidden states [B, T, H] (after the output LayerNorm) and the new state."""
    x, new_state = _body(params, state, tokens, slots, start, n_new, cfg)
    return layer_norm(x, params.norm_w, params.norm_b, rwkv_dims(cfg).ln_eps), new_state
