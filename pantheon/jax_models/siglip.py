"""The SigLIP vision encoder and its two projectors (Gemma 3's, Idefics3 / SmolVLM's), as pure functions
over an mmproj GGUF.

What an image becomes, exactly as HF's `Gemma3ForConditionalGeneration.get_image_features` computes it
(and llama.cpp's clip graph for `projector_type = gemma3`):

1. patches: the [3, S, S] normalised image is cut into (S/P)^2 non-overlapping P x P patches, row-major;
   the patch "convolution" (kernel = stride = P, no padding) is one matrix product per patch, with bias;
   a learned position embedding per patch is added (no interpolation: the image is always S x S);
2. the ViT: pre-LayerNorm blocks (LayerNorm with bias), full bidirectional multi-head attention with
   q/k/v/out biases, an MLP with tanh-approximate GELU; a final LayerNorm (`v.post_ln`);
3. the projector: the patch grid is average-pooled `merge` x `merge` (Gemma 3: 64 x 64 -> 16 x 16 = 256
   tokens), RMS-normed with `mm.soft_emb_norm` (the converter already folded Gemma's 1 + w into it) and
   multiplied into the text width by `mm.input_projection`.

   Idefics3 (`projector_type = idefics3`, SmolVLM) instead: the pixel shuffle (HF's `pixel_shuffle`:
   each `merge` x `merge` block of neighbouring patches becomes one vector of merge^2 * D, in HF's order)
   and one matrix without bias (`mm.model.fc`) into the text width. Idefics3 tiles an image; each tile
   and the downscaled whole image are encoded as separate images here.

The result replaces the text model's token embeddings (Gemma 3: already scaled) at the image's token positions.

Why a Python loop over layers: the encoder runs once per image (not per token), its layers are few
and small next to the text model, and each layer's matrices are separate weights multiplied in place
(`weights.linear`), never a stacked array sliced per layer.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from pantheon.errors import ModelLoadError
from pantheon.formats.gguf_loader import TensorSource
from pantheon.formats.mmproj import VisionConfig
from pantheon.ops import weights
from pantheon.ops.weights import QuantWeight

PROJECTORS = ("gemma3", "idefics3")


@struct.dataclass
class VitLayer:
    ln1_w: Any
    ln1_b: Any
    wq: QuantWeight
    bq: Any
    wk: QuantWeight
    bk: Any
    wv: QuantWeight
    bv: Any
    wo: QuantWeight
    bo: Any
    ln2_w: Any
    ln2_b: Any
    w_up: QuantWeight  # fc1 [F, D]
    b_up: Any
    w_down: QuantWeight  # fc2 [D, F]
    b_down: Any


@struct.dataclass
class VisionParams:
    patch_w: QuantWeight  # [D, 3 * P * P]: the patch convolution as a matrix (c, y, x order)
    patch_b: Any  # [D]
    pos: Any  # [n_patches, D]
    layers: tuple[VitLayer, ...]
    post_w: Any
    post_b: Any
    soft_norm: Any  # Gemma 3: [D] (1 + w already folded in by the converter); Idefics3: None
    proj: QuantWeight  # Gemma 3: [text_hidden, D]; Idefics3: [text_hidden, merge^2 * D]


def load_params(src: TensorSource, vc: VisionConfig) -> VisionParams:
    """The encoder's tensors from an mmproj file: matrices as the file stores them (the patch kernel and
    the projector, which the file keeps in other layouts, rewritten as plain f32 matrices)."""
    if vc.projector not in PROJECTORS:
        raise ModelLoadError(src.path, f"projector type {vc.projector!r} is not implemented")
    D, F, P = vc.hidden, vc.ffn, vc.patch_size
    n_patches = vc.patches_per_side ** 2
    patch = src.get("v.patch_embd.weight", (D, 3, P, P)).reshape(D, 3 * P * P)

    def layer(i: int) -> VitLayer:
        b = f"v.blk.{i}."
        return VitLayer(
            ln1_w=src.get(b + "ln1.weight", (D,)), ln1_b=src.get(b + "ln1.bias", (D,)),
            wq=src.matrix(b + "attn_q.weight", (D, D)), bq=src.get(b + "attn_q.bias", (D,)),
            wk=src.matrix(b + "attn_k.weight", (D, D)), bk=src.get(b + "attn_k.bias", (D,)),
            wv=src.matrix(b + "attn_v.weight", (D, D)), bv=src.get(b + "attn_v.bias", (D,)),
            wo=src.matrix(b + "attn_out.weight", (D, D)), bo=src.get(b + "attn_out.bias", (D,)),
            ln2_w=src.get(b + "ln2.weight", (D,)), ln2_b=src.get(b + "ln2.bias", (D,)),
            w_up=src.matrix(b + "ffn_up.weight", (F, D)), b_up=src.get(b + "ffn_up.bias", (F,)),
            w_down=src.matrix(b + "ffn_down.weight", (D, F)), b_down=src.get(b + "ffn_down.bias", (D,)))

    if vc.projector == "idefics3":  # HF's nn.Linear, stored (out, in) as any matrix
        proj, soft_norm = src.matrix("mm.model.fc.weight", (vc.text_hidden, D * vc.merge * vc.merge)), None
    else:  # mm.input_projection is stored [D, text_hidden] (HF's x @ W); as a weight it is (out, in)
        proj = weights.dense(np.ascontiguousarray(src.get("mm.input_projection.weight", (D, vc.text_hidden)).T))
        soft_norm = src.get("mm.soft_emb_norm.weight", (D,))
    return VisionParams(
        patch_w=weights.dense(np.ascontiguousarray(patch)), patch_b=src.get("v.patch_embd.bias", (D,)),
        pos=src.get("v.position_embd.weight", (n_patches, D)), layers=tuple(layer(i) for i in range(vc.n_layers)),
        post_w=src.get("v.post_ln.weight", (D,)), post_b=src.get("v.post_ln.bias", (D,)),
        soft_norm=soft_norm, proj=proj)


def _layer_norm(x: jax.Array, w: jax.Array, b: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    mu = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mu), axis=-1, keepdims=True)
    return ((xf - mu) * jax.lax.rsqrt(var + eps) * w + b).astype(x.dtype)


def encode(params: VisionParams, pixels: jax.Array, *, vc: VisionConfig) -> jax.Array:
    """Images [N, 3, S, S] (preprocessed: resized, rescaled, normalised) -> embeddings
    [N, tokens_per_image, text_hidden] f32, in the order the image's tokens appear in the prompt."""
    N = pixels.shape[0]
    P, p, D, nh = vc.patch_size, vc.patches_per_side, vc.hidden, vc.n_heads
    hd = D // nh
    x = pixels.astype(jnp.float32).reshape(N, 3, p, P, p, P).transpose(0, 2, 4, 1, 3, 5).reshape(N, p * p, 3 * P * P)
    x = weights.linear(x, params.patch_w, params.patch_b) + params.pos[None]
    for lp in params.layers:
        h = _layer_norm(x, lp.ln1_w, lp.ln1_b, vc.eps)
        q = weights.linear(h, lp.wq, lp.bq).reshape(N, p * p, nh, hd)
        k = weights.linear(h, lp.wk, lp.bk).reshape(N, p * p, nh, hd)
        v = weights.linear(h, lp.wv, lp.bv).reshape(N, p * p, nh, hd)
        s = jnp.einsum("nqhd,nkhd->nhqk", q, k, preferred_element_type=jnp.float32) * (hd ** -0.5)
        o = jnp.einsum("nhqk,nkhd->nqhd", jax.nn.softmax(s, axis=-1), v.astype(jnp.float32))
        x = x + weights.linear(o.reshape(N, p * p, D).astype(x.dtype), lp.wo, lp.bo)
        h = _layer_norm(x, lp.ln2_w, lp.ln2_b, vc.eps)
        x = x + weights.linear(jax.nn.gelu(weights.linear(h, lp.w_up, lp.b_up), approximate=True), lp.w_down,
                               lp.b_down)
    x = _layer_norm(x, params.post_w, params.post_b, vc.eps)
    m = vc.merge
    if vc.projector == "idefics3":
        # HF's pixel_shuffle, step for step: rows of m patches side by side, then m such rows stacked
        q = p // m
        g = x.reshape(N, p, q, m * D).transpose(0, 2, 1, 3).reshape(N, q, q, m * m * D).transpose(0, 2, 1, 3)
        return weights.linear(g.reshape(N, q * q, m * m * D), params.proj).astype(jnp.float32)
    # Gemma 3's projector: average-pool the patch grid merge x merge, RMS-norm, project
    g = x.astype(jnp.float32).reshape(N, p // m, m, p // m, m, D).mean(axis=(2, 4)).reshape(N, (p // m) ** 2, D)
    g = g * jax.lax.rsqrt(jnp.mean(g * g, axis=-1, keepdims=True) + vc.eps) * params.soft_norm
    return weights.linear(g, params.proj).astype(jnp.float32)
