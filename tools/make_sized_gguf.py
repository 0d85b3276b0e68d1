"""Write random-weight GGUF files shaped like real-size models, in Q4_K_M block layouts.

For benchmarks of loading, memory and decode speed at the sizes people actually run (7B dense,
30B-A3B MoE) without downloading those models. The files carry the real tensor names, shapes and
metadata of the engine's archs and the block formats a llama.cpp Q4_K_M file uses; the weights are
random *blocks*, not quantized floats (quantizing 7-30B floats in Python would take hours).

Profiles (`PROFILES`; any field can be overridden):
    qwen2-7b           Qwen2.5-7B dims: hidden 3584, 28 layers, 28 / 4 heads x 128, FFN 18944,
                       vocab 152064, q/k/v biases, untied output
    llama-7b           the same dims as arch `llama`, no biases
    qwen3moe-30b-a3b   Qwen3-30B-A3B: hidden 2048, 48 layers, 32 / 4 heads x 128 (q 4096 wide),
                       q/k norms, 128 experts top-8 x 768, vocab 151936
    qwen35moe-30b-a3b  a Qwen3.5-MoE hybrid of that size: hidden 2048, 48 layers (every 4th full
                       attention: 16 / 2 heads x 256, gated q), Gated DeltaNet 16 k / 32 v heads
                       x 128, 128 experts top-8 x 768 plus a shared expert x 512, vocab 151936

Block layout (the default, `mix="q4_k_m"`): token_embd Q4_K, output Q6_K, attn_v and ffn_down /
ffn_down_exps / ffn_down_shexp Q6_K, every other 2-D weight matrix Q4_K; norms, biases, routers
(ffn_gate_inp*), ssm_a / ssm_dt / ssm_conv1d F32. `mix="llama.cpp"` follows llama.cpp's
Q4_K_M rule more closely (attn_v / ffn_down Q6_K only in its `use_more_bits` layers, Q4_K in the
rest; attn_qkv Q5_K). `formats={...}` (CLI `--qtype-map`) overrides per role (`attn_v`,
`ffn_up_exps`, `attn_q.bias`, ...), per full tensor name, or `*` for every weight matrix, in any
format of pantheon.ops.quant_formats. A matrix whose rows are not whole blocks falls back to Q8_0
(or F16).

Tensor order: per layer the projections that read the same input are adjacent (attn_q, attn_k,
attn_v; ffn_gate, ffn_up; attn_qkv, attn_gate; ssm_alpha, ssm_beta; the expert gate/up stacks), so
the engine can fuse same-format neighbours in place.

Weights: each block is random bytes with its scale fields set so the block dequantizes to values
of std `std` (0.02) and mean ~0: the f16 d (x U(0.75, 1.25) per block) is calibrated per format by
dequantizing sample blocks; for formats with a min (Q4_1, Q5_1, Q2_K, Q4_K, Q5_K) each sub-block's
min equals its scale and dmin = d x the mean quant, which centres every sub-block; K-quant
sub-scales are random in a narrowed range (so d stays a normal f16). Norms 1 + N(0, 0.02), biases
and routers N(0, std), ssm_a -U(1, 16), ssm_dt.bias 1 + N(0, 0.1), conv N(0, 0.3) like
tools/make_random_qwen35moe.py.

Streaming: the header, metadata and tensor infos go first (gguf.GGUFWriter), then each tensor's
bytes are generated and written in chunks of `chunk_bytes` (64 MiB), so RAM holds one chunk, not
one tensor, whatever the file size. `--dry-run` writes nothing and prints the exact file size
(header included) from the tensor plan.

Tokenizer: the `tokenizer.*` keys of the catalog's Qwen2.5 GGUF ($PANTHEON_HOME/models/qwen-0.5b.gguf,
a real 151,936-token BPE with its chat template), padded with unused `<|extra_N|>` tokens up to the
profile's vocab; without that file (or with `template=False` / `--tokenizer synthetic`), the byte-level
tokenizer of tools/make_random_qwen35moe.py, padded likewise.

    python tools/make_sized_gguf.py qwen2-7b /tmp/sized/qwen2-7b.gguf
    python tools/make_sized_gguf.py qwen3moe-30b-a3b --dry-run
    python tools/make_sized_gguf.py qwen35moe-30b-a3b /tmp/q35.gguf --layers 4 --qtype-map '*=Q8_0'
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import math
import mmap
import re
import struct
import sys
import time
from dataclasses import dataclass, fields, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator

import numpy as np

_HERE = Path(__file__).resolve().parent
if str(_HERE.parent) not in sys.path:  # the repo root, for pantheon.ops.quant_formats when run as a script
    sys.path.insert(0, str(_HERE.parent))

from pantheon.config import load_settings  # noqa: E402
from pantheon.ops.quant_formats import FORMATS  # noqa: E402


def _sibling(name: str):
    """tools/<name>.py as a module, whether or not tools/ is on sys.path."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, _HERE / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


rq = _sibling("make_random_qwen35moe")  # tokenizer helpers, M-RoPE sections


# ---- profiles -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Profile:
    """The dimensions of one model shape. Widths that are a matrix's input (hidden, ffn, expert_ffn,
    shared_ffn, n_heads x head_dim, the DeltaNet value dim) must be multiples of 256 for K-quants."""

    arch: str
    hidden: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab: int
    ffn: int = 0  # dense SwiGLU width (0: none)
    meta_ffn: int | None = None  # feed_forward_length to record if not `ffn` (qwen3moe: the unused dense width)
    n_experts: int = 0
    n_used: int = 0
    expert_ffn: int = 0
    shared_ffn: int = 0  # shared expert width (qwen35moe)
    qkv_bias: bool = False
    qk_norm: bool = False
    tied: bool = False
    rope_base: float = 1e6
    rms_eps: float = 1e-6
    context_length: int = 32768
    n_rot: int = 0  # rotary dims (0: head_dim)
    # Gated DeltaNet (qwen35moe)
    n_k_heads: int = 0
    n_v_heads: int = 0
    linear_head_dim: int = 0
    conv_kernel: int = 4
    attn_interval: int = 4

    @property
    def hybrid(self) -> bool:
        return self.arch == "qwen35moe"

    def recurrent(self) -> list[bool]:
        return [self.hybrid and (i + 1) % self.attn_interval != 0 for i in range(self.n_layers)]


_QWEN2_7B = Profile(arch="qwen2", hidden=3584, n_layers=28, n_heads=28, n_kv_heads=4, head_dim=128, vocab=152064,
                    ffn=18944, qkv_bias=True, rope_base=1e6, rms_eps=1e-6, context_length=32768)
PROFILES: dict[str, Profile] = {
    "qwen2-7b": _QWEN2_7B,
    "llama-7b": replace(_QWEN2_7B, arch="llama", qkv_bias=False, rms_eps=1e-5),
    "qwen3moe-30b-a3b": Profile(arch="qwen3moe", hidden=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128,
                                vocab=151936, meta_ffn=6144, n_experts=128, n_used=8, expert_ffn=768, qk_norm=True,
                                rope_base=1e6, rms_eps=1e-6, context_length=40960),
    "qwen35moe-30b-a3b": Profile(arch="qwen35moe", hidden=2048, n_layers=48, n_heads=16, n_kv_heads=2, head_dim=256,
                                 vocab=151936, n_experts=128, n_used=8, expert_ffn=768, shared_ffn=512, qk_norm=True,
                                 rope_base=1e7, rms_eps=1e-6, context_length=262144, n_rot=64, n_k_heads=16,
                                 n_v_heads=32, linear_head_dim=128, conv_kernel=4, attn_interval=4),
}
_ALIASES = {"layers": "n_layers", "experts": "n_experts", "used": "n_used", "heads": "n_heads",
            "kv_heads": "n_kv_heads"}


# ---- tensor plan ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]  # numpy order (out, in); GGUF's ne is the reverse
    kind: str  # matrix | norm | bias | router | ssm_a | dt_bias | conv
    fmt: str = "F32"

    @property
    def n(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        rows = self.n // self.shape[-1]
        return rows * FORMATS[self.fmt].row_bytes(self.shape[-1])

    @property
    def role(self) -> str:
        return role_of(self.name)

    @property
    def layer(self) -> int | None:
        m = re.match(r"blk\.(\d+)\.", self.name)
        return int(m.group(1)) if m else None


def role_of(name: str) -> str:
    """`blk.3.attn_q.weight` -> `attn_q`, `blk.3.attn_q.bias` -> `attn_q.bias`, `token_embd.weight` -> `token_embd`."""
    r = re.sub(r"^blk\.\d+\.", "", name)
    return r[: -len(".weight")] if r.endswith(".weight") else r


def _tensor_list(p: Profile) -> list[TensorSpec]:
    """Every tensor of the profile in file order, formats not yet assigned."""
    H, nh, nkv, hd = p.hidden, p.n_heads, p.n_kv_heads, p.head_dim
    out: list[TensorSpec] = []

    def add(name: str, shape: tuple[int, ...], kind: str = "matrix") -> None:
        out.append(TensorSpec(name, tuple(int(s) for s in shape), kind))

    rec = p.recurrent()
    nk, nv, d = p.n_k_heads, p.n_v_heads, p.linear_head_dim
    key_dim, value_dim = nk * d, nv * d
    conv_dim = 2 * key_dim + value_dim
    add("token_embd.weight", (p.vocab, H))
    for i in range(p.n_layers):
        b = f"blk.{i}."
        add(b + "attn_norm.weight", (H,), "norm")
        if rec[i]:  # Gated DeltaNet
            add(b + "attn_qkv.weight", (conv_dim, H))
            add(b + "attn_gate.weight", (value_dim, H))
            add(b + "ssm_alpha.weight", (nv, H))
            add(b + "ssm_beta.weight", (nv, H))
            add(b + "ssm_conv1d.weight", (conv_dim, p.conv_kernel), "conv")
            add(b + "ssm_a", (nv,), "ssm_a")
            add(b + "ssm_dt.bias", (nv,), "dt_bias")
            add(b + "ssm_norm.weight", (d,), "norm")
            add(b + "ssm_out.weight", (H, value_dim))
        else:  # attention (the hybrid's q carries its output gate: 2 x nh x hd rows)
            add(b + "attn_q.weight", ((2 if p.hybrid else 1) * nh * hd, H))
            add(b + "attn_k.weight", (nkv * hd, H))
            add(b + "attn_v.weight", (nkv * hd, H))
            if p.qkv_bias:
                add(b + "attn_q.bias", (nh * hd,), "bias")
                add(b + "attn_k.bias", (nkv * hd,), "bias")
                add(b + "attn_v.bias", (nkv * hd,), "bias")
            if p.qk_norm:
                add(b + "attn_q_norm.weight", (hd,), "norm")
                add(b + "attn_k_norm.weight", (hd,), "norm")
            add(b + "attn_output.weight", (H, nh * hd))
        add(b + ("post_attention_norm.weight" if p.hybrid else "ffn_norm.weight"), (H,), "norm")
        if p.n_experts:
            E, F = p.n_experts, p.expert_ffn
            add(b + "ffn_gate_inp.weight", (E, H), "router")
            add(b + "ffn_gate_exps.weight", (E, F, H))
            add(b + "ffn_up_exps.weight", (E, F, H))
            add(b + "ffn_down_exps.weight", (E, H, F))
            if p.shared_ffn:
                Fs = p.shared_ffn
                add(b + "ffn_gate_inp_shexp.weight", (1, H), "router")
                add(b + "ffn_gate_shexp.weight", (Fs, H))
                add(b + "ffn_up_shexp.weight", (Fs, H))
                add(b + "ffn_down_shexp.weight", (H, Fs))
        else:
            add(b + "ffn_gate.weight", (p.ffn, H))
            add(b + "ffn_up.weight", (p.ffn, H))
            add(b + "ffn_down.weight", (H, p.ffn))
    add("output_norm.weight", (H,), "norm")
    if not p.tied:
        add("output.weight", (p.vocab, H))
    return out


_Q6_ROLES = ("output", "attn_v", "ffn_down", "ffn_down_exps", "ffn_down_shexp")
MIXES = ("q4_k_m", "llama.cpp")


def _use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's layer rule for the Q4_K_M / Q5_K_M upgrades of attn_v and ffn_down."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _default_format(t: TensorSpec, mix: str, counters: dict[str, tuple[int, int]]) -> str:
    if t.kind != "matrix":
        return "F32"
    role = t.role
    if mix == "llama.cpp":
        if role == "output":
            return "Q6_K"
        if role == "attn_qkv":
            return "Q5_K"
        if role in _Q6_ROLES:
            i, n = counters[t.name]
            return "Q6_K" if _use_more_bits(i, n) else "Q4_K"
        return "Q4_K"
    return "Q6_K" if role in _Q6_ROLES else "Q4_K"


def _fits(fmt: str, cols: int) -> bool:
    return cols % FORMATS[fmt].block_weights == 0


def plan_tensors(p: Profile, formats: dict[str, str] | None = None, mix: str = "q4_k_m") -> list[TensorSpec]:
    """The tensors of profile `p` with their formats (see the module docstring for the rules)."""
    if mix not in MIXES:
        raise ValueError(f"mix must be one of {MIXES}, not {mix!r}")
    formats = {k: v.upper() for k, v in (formats or {}).items()}
    for k, v in formats.items():
        if v not in FORMATS:
            raise ValueError(f"format {v!r} for {k!r} is not one of {', '.join(FORMATS)}")
    specs = _tensor_list(p)
    names = {t.name for t in specs}
    roles = {t.role for t in specs}
    unknown = [k for k in formats if k != "*" and k not in names and k not in roles]
    if unknown:
        raise ValueError(f"no tensor or role named {unknown} in this profile (roles: {', '.join(sorted(roles))})")
    # llama.cpp's per-role counters (i-th attn_v among all attn_v, layer index for ffn_down*)
    counters: dict[str, tuple[int, int]] = {}
    wv = [t.name for t in specs if t.role == "attn_v"]
    counters.update({n: (j, len(wv)) for j, n in enumerate(wv)})
    counters.update({t.name: (t.layer, p.n_layers) for t in specs if t.role.startswith("ffn_down")})
    out = []
    for t in specs:
        fmt = formats.get(t.name) or formats.get(t.role)
        if fmt is None and t.kind == "matrix":
            fmt = formats.get("*")
        if fmt is None:
            fmt = _default_format(t, mix, counters)
        cols = t.shape[-1]
        if not _fits(fmt, cols):
            if t.kind == "matrix" or (t.name not in formats and t.role not in formats):
                fmt = "Q8_0" if _fits("Q8_0", cols) else "F16"
            else:
                raise ValueError(f"{t.name}: {cols} columns are not whole {fmt} blocks "
                                 f"of {FORMATS[fmt].block_weights}")
        if t.kind != "matrix" and FORMATS[fmt].is_block and fmt not in _QUANTIZABLE:
            raise ValueError(f"{t.name} ({t.kind}) can be stored as F32/F16/BF16 or {', '.join(_QUANTIZABLE)}, "
                             f"not {fmt}")
        out.append(replace(t, fmt=fmt))
    return out


_QUANTIZABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")  # formats gguf.quants can quantize floats into


# ---- random blocks --------------------------------------------------------------------------------
def _put_f16(blk: np.ndarray, off: int, vals: np.ndarray) -> None:
    blk[:, off:off + 2] = vals.astype(np.float16).view(np.uint8).reshape(-1, 2)


def _k_scales(raw: np.ndarray, lo: int = 32) -> np.ndarray:
    """12 packed bytes of Q4_K/Q5_K scales with each sub-block's min equal to its scale, both in
    [lo, 63]: bytes 0-3 and 4-7 hold the low 6 bits of sc/min 0-3 and the high 2 bits of 4-7,
    bytes 8-11 the low nibbles of sc/min 4-7."""
    v = (lo + raw[:, :8] % (64 - lo)).astype(np.uint8)
    first = v[:, :4] | ((v[:, 4:] >> 4) << 6)
    last = (v[:, 4:] & 0x0F) * np.uint8(0x11)
    return np.concatenate([first, first, last], axis=1)


def _shape_blocks(fmt: str, blk: np.ndarray, d: np.ndarray) -> None:
    """Set the scale fields of random blocks (in place): d per block, mins that centre each block."""
    df = d.astype(np.float16).astype(np.float32)
    if fmt in ("Q4_0", "Q5_0", "Q8_0", "IQ4_NL", "IQ4_XS"):
        _put_f16(blk, 0, df)
    elif fmt == "Q4_1":  # w = d q + m, q in 0..15
        _put_f16(blk, 0, df)
        _put_f16(blk, 2, -7.5 * df)
    elif fmt == "Q5_1":  # q in 0..31
        _put_f16(blk, 0, df)
        _put_f16(blk, 2, -15.5 * df)
    elif fmt == "Q2_K":  # scales[16] (lo nibble scale, hi nibble min) | qs[64] | d | dmin; q in 0..3
        v = (8 + (blk[:, :16] & 0x07)).astype(np.uint8)
        blk[:, :16] = v | (v << 4)
        _put_f16(blk, 80, df)
        _put_f16(blk, 82, 1.5 * df)
    elif fmt == "Q3_K":  # hmask[32] | qs[64] | scales[12] (6-bit, -32) | d
        _put_f16(blk, 108, df)
    elif fmt in ("Q4_K", "Q5_K"):  # d | dmin | scales[12] | (qh[32]) | qs
        blk[:, 4:16] = _k_scales(blk[:, 4:16].copy())
        _put_f16(blk, 0, df)
        _put_f16(blk, 2, (7.5 if fmt == "Q4_K" else 15.5) * df)
    elif fmt == "Q6_K":  # ql[128] | qh[64] | int8 scales[16] | d; q in -32..31
        s = blk[:, 192:208]
        mag = (8 + (s & 0x07)).astype(np.int16)
        signed = np.where(s & 0x80, -mag, mag).astype(np.int8)
        blk[:, 192:208] = signed.view(np.uint8)
        _put_f16(blk, 208, df)
    else:
        raise ValueError(f"no random-block recipe for {fmt}")


_SIGNED_D = ("Q4_0", "Q5_0", "Q8_0", "IQ4_NL", "IQ4_XS")


def _random_blocks(rng: np.random.Generator, fmt: str, nb: int, d0: float) -> np.ndarray:
    """nb random blocks of `fmt` ([nb, block_bytes] uint8) whose d is d0 x U(0.75, 1.25)."""
    blk = rng.integers(0, 256, size=(nb, FORMATS[fmt].block_bytes), dtype=np.uint8)
    d = (d0 * rng.uniform(0.75, 1.25, nb)).astype(np.float32)
    if fmt in _SIGNED_D:  # quants not centred on 0 (Q4_0's q - 8 has mean -0.5): a random sign of d
        d *= np.where(rng.random(nb) < 0.5, np.float32(-1), np.float32(1))  # (as real files have) centres them
    _shape_blocks(fmt, blk, d)
    return blk


@lru_cache(maxsize=None)
def unit_std(fmt: str) -> float:
    """The std of values that blocks of `fmt` made with d0 = 1 dequantize to (a fixed sample)."""
    import gguf

    blk = _random_blocks(np.random.default_rng(12345), fmt, 4096, 1.0)
    vals = gguf.quants.dequantize(blk, gguf.GGMLQuantizationType[fmt])
    return float(np.std(vals))


def _to_float_bytes(arr: np.ndarray, fmt: str) -> np.ndarray:
    a = np.ascontiguousarray(arr, dtype=np.float32)
    if fmt == "F32":
        return a
    if fmt == "F16":
        return a.astype(np.float16)
    if fmt == "BF16":  # round to nearest even on the top 16 bits
        u = a.view(np.uint32)
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    import gguf

    return gguf.quants.quantize(a, gguf.GGMLQuantizationType[fmt])


def _small_values(rng: np.random.Generator, t: TensorSpec, std: float) -> np.ndarray:
    """The float values of a non-matrix tensor (norm, bias, router, DeltaNet parameters)."""
    def normal(s: float) -> np.ndarray:
        return rng.standard_normal(t.shape, dtype=np.float32) * np.float32(s)

    if t.kind == "norm":
        return 1.0 + normal(0.02)
    if t.kind in ("bias", "router"):
        return normal(std)
    if t.kind == "ssm_a":
        return -rng.uniform(1.0, 16.0, t.shape).astype(np.float32)
    if t.kind == "dt_bias":
        return 1.0 + normal(0.1)
    if t.kind == "conv":
        return normal(0.3)
    raise ValueError(f"unknown tensor kind {t.kind!r}")


def tensor_chunks(t: TensorSpec, rng: np.random.Generator, std: float,
                  chunk_bytes: int = 64 << 20) -> Iterator[np.ndarray]:
    """The bytes of tensor `t` as consecutive arrays of at most ~chunk_bytes (whole rows each)."""
    if t.kind != "matrix":
        yield _to_float_bytes(_small_values(rng, t, std), t.fmt)
        return
    cols = t.shape[-1]
    rows = t.n // cols
    f = FORMATS[t.fmt]
    row_bytes = f.row_bytes(cols)
    step = max(1, chunk_bytes // row_bytes)
    d0 = std / unit_std(t.fmt) if f.is_block else 0.0
    for r0 in range(0, rows, step):
        n = min(step, rows - r0)
        if f.is_block:
            yield _random_blocks(rng, t.fmt, n * cols // f.block_weights, d0)
        else:
            yield _to_float_bytes(rng.standard_normal((n, cols), dtype=np.float32) * np.float32(std), t.fmt)


# ---- tokenizer ------------------------------------------------------------------------------------
def default_tokenizer_gguf() -> Path:
    return load_settings().home / "models" / "qwen-0.5b.gguf"


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NP = {0: "u1", 1: "i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}


def read_tokenizer_kv(path: str | Path) -> list[tuple[str, Any, Any, Any]]:
    """(key, value, GGUFValueType, array sub-type) of every `tokenizer.*` key of a GGUF, in order.

    The same as make_random_qwen35moe's reader, but parses the KV section directly: GGUFReader
    takes ~17 s on a 150k-token vocabulary (it maps every string), this ~0.3 s.
    """
    import gguf

    T = gguf.GGUFValueType
    out = []
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        magic, version, _, n_kv = struct.unpack_from("<IIQQ", mm, 0)
        if magic != gguf.GGUF_MAGIC or version < 2:
            raise ValueError(f"{path}: not a little-endian GGUF v2+ file")
        off = 24

        def string(off: int) -> tuple[str, int]:
            (n,) = struct.unpack_from("<Q", mm, off)
            return mm[off + 8: off + 8 + n].decode("utf-8"), off + 8 + n

        def value(vtype: int, off: int) -> tuple[Any, int]:
            if vtype == T.STRING:
                return string(off)
            if vtype in _SCALARS:
                return struct.unpack_from(_SCALARS[vtype], mm, off)[0], off + struct.calcsize(_SCALARS[vtype])
            raise ValueError(f"{path}: unsupported GGUF value type {vtype}")

        for _ in range(n_kv):
            key, off = string(off)
            (vtype,) = struct.unpack_from("<I", mm, off)
            off += 4
            sub = None
            if vtype == T.ARRAY:
                sub, count = struct.unpack_from("<IQ", mm, off)
                off += 12
                if sub in _NP:
                    dt = np.dtype(_NP[sub])
                    val = np.frombuffer(mm, dt, count, off).tolist()
                    off += count * dt.itemsize
                else:
                    val = []
                    for _ in range(count):
                        v, off = value(sub, off)
                        val.append(v)
                sub = T(sub)
            else:
                val, off = value(vtype, off)
            if key.startswith("tokenizer."):
                out.append((key, val, T(vtype), sub))
    return out


def sized_tokenizer_kv(vocab: int, template: str | Path | bool | None = None) -> list[tuple[str, Any, Any, Any]]:
    """`tokenizer.*` key/values for exactly `vocab` tokens: the Qwen GGUF's (template None: the
    catalog's if present; a path: that file's) or, with template False or no file, the synthetic
    byte-level tokenizer of make_random_qwen35moe; padded with unused tokens like its tokenizer_kv."""
    path = None
    if template is not False:
        path = Path(template) if template else default_tokenizer_gguf()
        if template is None and not path.is_file():
            path = None
    if path is None:
        return rq.tokenizer_kv(vocab, template=False)
    kv = [list(e) for e in read_tokenizer_kv(path)]
    by_key = {e[0]: e for e in kv}
    toks, types = list(by_key["tokenizer.ggml.tokens"][1]), list(by_key["tokenizer.ggml.token_type"][1])
    if vocab < len(toks):
        raise ValueError(f"vocab {vocab} is smaller than the tokenizer's {len(toks)} tokens ({path})")
    extra = vocab - len(toks)
    by_key["tokenizer.ggml.tokens"][1] = toks + [f"<|extra_{i}|>" for i in range(extra)]
    by_key["tokenizer.ggml.token_type"][1] = types + [5] * extra  # UNUSED
    return [tuple(e) for e in kv]


# ---- metadata -------------------------------------------------------------------------------------
_FILE_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10, "Q3_K": 12,
               "Q4_K": 15, "Q5_K": 17, "Q6_K": 18, "IQ4_NL": 25, "IQ4_XS": 30, "BF16": 32}
_FILE_TYPE_NAMES = {"Q3_K": "Q3_K_M", "Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M"}


def layout_name(specs: list[TensorSpec], default: bool) -> tuple[str, int]:
    """("Q4_K_M", 15) for the default layout, else the format holding most matrix bytes."""
    if default:
        return "Q4_K_M", 15
    by_fmt: dict[str, int] = {}
    for t in specs:
        if t.kind == "matrix":
            by_fmt[t.fmt] = by_fmt.get(t.fmt, 0) + t.nbytes
    top = max(by_fmt, key=by_fmt.get) if by_fmt else "F32"
    return _FILE_TYPE_NAMES.get(top, top), _FILE_TYPES.get(top, 0)


def _metadata(p: Profile, profile_name: str, specs: list[TensorSpec], tok_kv: list, layout: str, file_type: int,
              name: str | None) -> list[tuple[str, Any, Any, Any]]:
    import gguf

    T = gguf.GGUFValueType
    a = p.arch + "."
    n_params = sum(t.n for t in specs)
    meta: list[tuple[str, Any, Any, Any]] = [
        ("general.type", "model", T.STRING, None),
        ("general.name", name or f"random {profile_name} {layout}-layout", T.STRING, None),
        ("general.size_label", f"{n_params / 1e9:.1f}B", T.STRING, None),
        (a + "block_count", p.n_layers, T.UINT32, None),
        (a + "context_length", p.context_length, T.UINT32, None),
        (a + "embedding_length", p.hidden, T.UINT32, None),
    ]
    ffn = p.meta_ffn if p.meta_ffn is not None else p.ffn
    if ffn:
        meta.append((a + "feed_forward_length", ffn, T.UINT32, None))
    meta += [
        (a + "attention.head_count", p.n_heads, T.UINT32, None),
        (a + "attention.head_count_kv", p.n_kv_heads, T.UINT32, None),
        (a + "rope.freq_base", float(p.rope_base), T.FLOAT32, None),
        (a + "attention.layer_norm_rms_epsilon", float(p.rms_eps), T.FLOAT32, None),
    ]
    if p.n_experts:
        meta += [(a + "expert_count", p.n_experts, T.UINT32, None),
                 (a + "expert_used_count", p.n_used, T.UINT32, None)]
    if p.hybrid or p.qk_norm or p.head_dim != p.hidden // p.n_heads:
        meta += [(a + "attention.key_length", p.head_dim, T.UINT32, None),
                 (a + "attention.value_length", p.head_dim, T.UINT32, None)]
    if p.n_experts:
        meta.append((a + "expert_feed_forward_length", p.expert_ffn, T.UINT32, None))
    n_rot = p.n_rot or p.head_dim
    if p.hybrid:
        meta += [
            (a + "rope.dimension_sections", rq._rope_sections(n_rot), T.ARRAY, T.INT32),
            (a + "expert_shared_feed_forward_length", p.shared_ffn, T.UINT32, None),
            (a + "ssm.conv_kernel", p.conv_kernel, T.UINT32, None),
            (a + "ssm.state_size", p.linear_head_dim, T.UINT32, None),
            (a + "ssm.group_count", p.n_k_heads, T.UINT32, None),
            (a + "ssm.time_step_rank", p.n_v_heads, T.UINT32, None),
            (a + "ssm.inner_size", p.n_v_heads * p.linear_head_dim, T.UINT32, None),
            (a + "attention.recurrent_layers", p.recurrent(), T.ARRAY, T.BOOL),
            (a + "full_attention_interval", p.attn_interval, T.UINT32, None),
        ]
    if p.hybrid or p.arch == "llama" or n_rot != p.head_dim:
        meta.append((a + "rope.dimension_count", n_rot, T.UINT32, None))
    if p.arch == "llama":
        meta.append((a + "vocab_size", p.vocab, T.UINT32, None))
    meta += [("general.file_type", file_type, T.UINT32, None),
             ("general.quantization_version", 2, T.UINT32, None)]
    return meta + list(tok_kv)


# ---- the build -------------------------------------------------------------------------------------
@dataclass
class Build:
    """Everything a write needs, decided before any byte is written."""

    profile_name: str
    profile: Profile
    specs: list[TensorSpec]
    meta: list[tuple[str, Any, Any, Any]]
    layout: str
    seed: int
    std: float

    @property
    def tensor_bytes(self) -> int:
        return sum(_pad(t.nbytes) for t in self.specs)

    @property
    def n_params(self) -> int:
        return sum(t.n for t in self.specs)

    def bytes_by_format(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self.specs:
            out[t.fmt] = out.get(t.fmt, 0) + t.nbytes
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))


_ALIGN = 32  # gguf.GGUF_DEFAULT_ALIGNMENT


def _pad(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _check(p: Profile) -> None:
    if p.arch not in ("llama", "qwen2", "qwen3moe", "qwen35moe"):
        raise ValueError(f"unsupported arch {p.arch!r}")
    if p.n_heads % p.n_kv_heads:
        raise ValueError(f"n_heads {p.n_heads} must be a multiple of n_kv_heads {p.n_kv_heads}")
    if p.n_experts and not 0 < p.n_used <= p.n_experts:
        raise ValueError(f"n_used {p.n_used} must be in [1, n_experts={p.n_experts}]")
    if not p.n_experts and not p.ffn:
        raise ValueError("a dense profile needs ffn > 0")
    if p.hybrid:
        if p.n_v_heads % p.n_k_heads:
            raise ValueError(f"n_v_heads {p.n_v_heads} must be a multiple of n_k_heads {p.n_k_heads}")
        if p.n_layers % p.attn_interval:
            raise ValueError(f"n_layers {p.n_layers} must be a multiple of attn_interval {p.attn_interval}")


def prepare(profile: str | Profile = "qwen2-7b", *, formats: dict[str, str] | None = None, mix: str = "q4_k_m",
            seed: int = 0, std: float = 0.02, template: str | Path | bool | None = None, name: str | None = None,
            **dims: Any) -> Build:
    """Resolve a profile (a PROFILES name or a Profile) with dimension overrides (`layers=2`,
    `hidden=256`, `n_experts=8`, any Profile field) into a Build."""
    if isinstance(profile, Profile):
        pname, prof = f"{profile.arch}-custom", profile
    else:
        if profile not in PROFILES:
            raise ValueError(f"unknown profile {profile!r} (known: {', '.join(PROFILES)})")
        pname, prof = profile, PROFILES[profile]
    known = {f.name for f in fields(Profile)}
    dims = {_ALIASES.get(k, k): v for k, v in dims.items() if v is not None}
    bad = sorted(set(dims) - known)
    if bad:
        raise TypeError(f"unknown override(s) {bad}; Profile fields: {sorted(known)}")
    prof = replace(prof, **dims)
    _check(prof)
    specs = plan_tensors(prof, formats, mix)
    layout, file_type = layout_name(specs, default=not formats and mix == "q4_k_m")
    if mix == "llama.cpp" and not formats:
        layout = "Q4_K_M(llama.cpp)"
    tok = sized_tokenizer_kv(prof.vocab, template)
    meta = _metadata(prof, pname, specs, tok, layout, file_type, name)
    return Build(pname, prof, specs, meta, layout, seed, std)


def _writer(b: Build, path: Path | None):
    """A GGUFWriter holding b's metadata and tensor infos; to `path`, or to memory when None."""
    import gguf

    w = gguf.GGUFWriter(str(path) if path is not None else None, b.profile.arch)
    for key, val, vtype, sub in b.meta:
        w.add_key_value(key, val, vtype, sub_type=sub)
    for t in b.specs:
        w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=gguf.GGMLQuantizationType[t.fmt])
    if path is None:  # the header's exact size without a file: write it to memory
        w.fout = [io.BytesIO()]
        w.state = gguf.gguf_writer.WriterState.EMPTY
    return w


_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUFValueType -> bytes


def _value_nbytes(val: Any, vtype: int, sub: int | None) -> int:
    if vtype == 8:  # STRING: u64 length + utf-8
        return 8 + len(str(val).encode("utf-8"))
    if vtype == 9:  # ARRAY: u32 item type, u64 count, items
        if sub == 8:
            return 12 + sum(8 + len(v.encode("utf-8")) for v in val)
        return 12 + _FIXED[int(sub)] * len(val)
    return _FIXED[int(vtype)]


def header_bytes(b: Build, exact: bool = False) -> int:
    """Bytes before the first tensor: header, metadata, tensor infos and the alignment padding.

    Counted from the GGUF v3 layout (packing a 150k-token vocabulary through GGUFWriter takes
    seconds); exact=True packs it with GGUFWriter into memory instead (the tests compare the two).
    """
    if exact:
        w = _writer(b, None)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        return _pad(w.fout[0].tell())
    n = 24  # magic, version, tensor count, kv count
    n += 8 + len("general.architecture") + 4 + 8 + len(b.profile.arch.encode())  # GGUFWriter adds it first
    for key, val, vtype, sub in b.meta:
        n += 8 + len(key.encode("utf-8")) + 4 + _value_nbytes(val, int(vtype), None if sub is None else int(sub))
    for t in b.specs:
        n += 8 + len(t.name.encode("utf-8")) + 4 + 8 * len(t.shape) + 4 + 8
    return _pad(n)


def file_bytes(b: Build) -> int:
    return header_bytes(b) + b.tensor_bytes


def write_build(b: Build, path: str | Path, *, progress: bool = True, chunk_bytes: int = 64 << 20) -> Path:
    """Stream b to `path`: header and tensor infos first, then each tensor in bounded chunks."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = _writer(b, path)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    fout = w.fout[0]
    w.write_padding(fout, fout.tell())
    total = fout.tell() + b.tensor_bytes
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=b.tensor_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc=path.name,
                   file=sys.stderr, mininterval=1.0)
    try:
        for idx, t in enumerate(b.specs):
            rng = np.random.default_rng([b.seed, idx])
            written = 0
            for chunk in tensor_chunks(t, rng, b.std, chunk_bytes):
                fout.write(memoryview(np.ascontiguousarray(chunk)).cast("B"))
                written += chunk.nbytes
                if bar is not None:
                    bar.update(chunk.nbytes)
            if written != t.nbytes:
                raise AssertionError(f"{t.name}: wrote {written} bytes, planned {t.nbytes}")
            w.write_padding(fout, t.nbytes)
            if bar is not None:
                bar.update(_pad(t.nbytes) - t.nbytes)
    finally:
        if bar is not None:
            bar.close()
        w.close()
    size = path.stat().st_size
    if size != total:
        raise AssertionError(f"{path}: {size} bytes written, planned {total}")
    return path


def write_sized_gguf(path: str | Path, profile: str | Profile = "qwen2-7b", *, progress: bool = False,
                     chunk_bytes: int = 64 << 20, **overrides: Any) -> Path:
    """Write a random GGUF of `profile` (with overrides, see `prepare`) to `path` and return it."""
    return write_build(prepare(profile, **overrides), path, progress=progress, chunk_bytes=chunk_bytes)


def dry_run_bytes(profile: str | Profile = "qwen2-7b", **overrides: Any) -> int:
    """The exact size of the file write_sized_gguf would write, without writing it."""
    return file_bytes(prepare(profile, **overrides))


# ---- CLI ------------------------------------------------------------------------------------------
def parse_qtype_map(text: str | None) -> dict[str, str]:
    """'attn_v=Q4_K,ffn_down_exps=Q8_0,*=Q4_K' -> dict."""
    out: dict[str, str] = {}
    for part in (text or "").split(","):
        part = part.strip()
        if not part:
            continue
        if "=" not in part:
            raise ValueError(f"--qtype-map entry {part!r} is not ROLE=FORMAT")
        k, v = part.split("=", 1)
        out[k.strip()] = v.strip().upper()
    return out


def _summary(b: Build, total: int) -> str:
    p = b.profile
    lines = [f"profile {b.profile_name} (arch {p.arch}): {p.n_layers} layers, hidden {p.hidden}, "
             f"{len(b.specs)} tensors, {b.n_params / 1e9:.3f}B params, layout {b.layout}",
             f"file size: {total} bytes ({total / 1e9:.3f} GB, {total / 2**30:.3f} GiB)"]
    lines += [f"  {fmt:>6}: {n:>14} bytes" for fmt, n in b.bytes_by_format().items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profile", choices=list(PROFILES))
    ap.add_argument("path", nargs="?", help="output .gguf (not needed with --dry-run)")
    for flag, field_name in (("--layers", "n_layers"), ("--hidden", "hidden"), ("--heads", "n_heads"),
                             ("--kv-heads", "n_kv_heads"), ("--head-dim", "head_dim"), ("--ffn", "ffn"),
                             ("--vocab", "vocab"), ("--experts", "n_experts"), ("--used", "n_used"),
                             ("--expert-ffn", "expert_ffn"), ("--shared-ffn", "shared_ffn"),
                             ("--k-heads", "n_k_heads"), ("--v-heads", "n_v_heads"),
                             ("--linear-head-dim", "linear_head_dim"), ("--interval", "attn_interval"),
                             ("--context", "context_length")):
        ap.add_argument(flag, dest=field_name, type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--std", type=float, default=0.02, help="std of the dequantized matrix weights")
    ap.add_argument("--qtype-map", default=None,
                    help="ROLE=FORMAT,... overrides, e.g. 'attn_v=Q4_K,*=Q8_0' ('*': every weight matrix)")
    ap.add_argument("--mix", choices=MIXES, default="q4_k_m",
                    help="q4_k_m: attn_v/ffn_down Q6_K everywhere; llama.cpp: only in its use_more_bits layers")
    ap.add_argument("--tokenizer", default=None,
                    help="GGUF whose tokenizer.* keys are copied (default: the catalog's qwen-0.5b.gguf if "
                         "present); 'synthetic' for the built-in byte-level tokenizer")
    ap.add_argument("--name", default=None, help="general.name")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and the exact file size; write nothing")
    ap.add_argument("--list", action="store_true", help="print every tensor: name, format, shape, bytes")
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    if not a.dry_run and not a.path:
        ap.error("an output path is needed unless --dry-run")
    dims = {f.name: getattr(a, f.name) for f in fields(Profile) if getattr(a, f.name, None) is not None}
    template = False if a.tokenizer == "synthetic" else a.tokenizer
    b = prepare(a.profile, formats=parse_qtype_map(a.qtype_map), mix=a.mix, seed=a.seed, std=a.std,
                template=template, name=a.name, **dims)
    total = file_bytes(b)
    if a.list:
        for t in b.specs:
            print(f"{t.name:40} {t.fmt:>6} {str(list(t.shape)):>22} {t.nbytes:>12}")
    print(_summary(b, total), flush=True)
    if a.dry_run:
        return 0
    t0 = time.perf_counter()
    out = write_build(b, a.path, progress=not a.no_progress)
    dt = time.perf_counter() - t0
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    size = out.stat().st_size
    print(f"wrote {out}: {size} bytes in {dt:.1f} s ({size / dt / 1e6:.0f} MB/s), peak RSS {rss:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
