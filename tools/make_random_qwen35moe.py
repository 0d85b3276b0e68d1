"""Write a random-weight `qwen35moe` (Qwen3.5 MoE hybrid) GGUF of any size, for benchmarks and tests.

The file mirrors the tiny oracle fixture (tests/fixtures/tiny/qwen35moe.gguf, made by llama.cpp's
convert_hf_to_gguf.py): the same metadata keys with the same GGUF value types, the same tensor
names, shapes (ggml order = numpy order reversed) and tensor order, only scaled up. Layers follow the
published pattern (Gated DeltaNet, DeltaNet, DeltaNet, full attention, ...), every layer has routed
experts plus a sigmoid-gated shared expert.

Tokenizer: the fixture's `tokenizer.*` keys are copied verbatim (a 512-token byte-level BPE), so
`pantheon.runtime.engine.load` builds a real tokenizer and chat template. A larger `vocab` appends unused
`<|extra_N|>` tokens; a smaller one is refused. Without the fixture (e.g. a bare GPU machine), a
self-contained byte-level tokenizer (256 byte tokens, ChatML specials) is synthesised instead.

Weights: matrices N(0, std) (std 0.02 by default); norms 1 + N(0, std) (GGUF stores RMSNorm weights
already shifted by +1); conv kernels N(0, 0.3); ssm_a = -U(1, 16) (= -exp(A_log)); ssm_dt.bias
1 + N(0, 0.1). `qtype="q8_0"` stores the matrices as Q8_0 like the converter (routers, norms, conv
and 1-D tensors stay F32); `f16` stores them as F16.

    python tools/make_random_qwen35moe.py /tmp/qwen35moe-mid.gguf                   # mid-size preset
    python tools/make_random_qwen35moe.py /tmp/small.gguf --hidden 64 --layers 4 --experts 8 --used 2 \
        --expert-ffn 32
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

ARCH = "qwen35moe"
TEMPLATE_NAME = "qwen35moe.gguf"

# The mid-size preset (the CLI defaults): ~115M parameters, ~460 MB in f32.
MID = dict(hidden=512, n_layers=8, n_experts=32, n_used=4, expert_ffn=256, vocab=512, seed=0)


# ---- tokenizer --------------------------------------------------------------------------------------
def find_template() -> Path | None:
    """The tiny qwen35moe fixture, if this checkout can see it."""
    here = Path(__file__).resolve().parent.parent  # repo root
    cands = []
    if os.environ.get("PANTHEON_FIXTURES"):
        cands.append(Path(os.environ["PANTHEON_FIXTURES"]) / "tiny" / TEMPLATE_NAME)
    cands.append(here / "tests" / "fixtures" / "tiny" / TEMPLATE_NAME)  # the repository's copy
    return next((p for p in cands if p.is_file()), None)


def _template_tokenizer(path: Path) -> list[tuple[str, Any, Any, Any]]:
    """(key, value, GGUFValueType, array sub-type) of every `tokenizer.*` key of a GGUF, in order."""
    import gguf

    r = gguf.GGUFReader(str(path), "r")
    out = []
    for key, f in r.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = f.types[0]
        sub = f.types[1] if vtype == gguf.GGUFValueType.ARRAY and len(f.types) > 1 else None
        out.append((key, f.contents(), vtype, sub))
    return out


_CHATML = ("{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + "
           "'<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}"
           "{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def _byte_level_alphabet() -> list[str]:
    """GPT-2's bytes -> printable unicode map, as the 256 byte tokens in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


def _synthetic_tokenizer() -> list[tuple[str, Any, Any, Any]]:
    """A minimal but complete byte-level BPE: 256 byte tokens, one merge, ChatML specials."""
    import gguf

    T = gguf.GGUFValueType
    toks = _byte_level_alphabet() + ["Ġt", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    types = [1] * 257 + [3, 3, 3]
    return [("tokenizer.ggml.model", "gpt2", T.STRING, None), ("tokenizer.ggml.pre", "qwen2", T.STRING, None),
            ("tokenizer.ggml.tokens", toks, T.ARRAY, T.STRING),
            ("tokenizer.ggml.token_type", types, T.ARRAY, T.INT32),
            ("tokenizer.ggml.merges", ["Ġ t"], T.ARRAY, T.STRING),
            ("tokenizer.ggml.eos_token_id", toks.index("<|im_end|>"), T.UINT32, None),
            ("tokenizer.ggml.padding_token_id", toks.index("<|endoftext|>"), T.UINT32, None),
            ("tokenizer.ggml.add_bos_token", False, T.BOOL, None),
            ("tokenizer.ggml.add_eos_token", False, T.BOOL, None),
            ("tokenizer.chat_template", _CHATML, T.STRING, None)]


def tokenizer_kv(vocab: int, template: str | Path | bool | None = None) -> list[tuple[str, Any, Any, Any]]:
    """The `tokenizer.*` key/values for a vocabulary of exactly `vocab` tokens (padded if needed).

    template: a GGUF to copy them from; None finds the tiny fixture (synthetic if absent); False
    forces the synthetic tokenizer.
    """
    if template is False:
        tpl = None
    else:
        tpl = Path(template) if template else find_template()
    kv = _template_tokenizer(tpl) if tpl is not None else _synthetic_tokenizer()
    kv = [list(e) for e in kv]
    by_key = {e[0]: e for e in kv}
    toks, types = list(by_key["tokenizer.ggml.tokens"][1]), list(by_key["tokenizer.ggml.token_type"][1])
    if vocab < len(toks):
        raise ValueError(f"vocab {vocab} is smaller than the tokenizer's {len(toks)} tokens")
    extra = vocab - len(toks)
    toks += [f"<|extra_{i}|>" for i in range(extra)]
    types += [5] * extra  # UNUSED: never produced by the encoder
    by_key["tokenizer.ggml.tokens"][1], by_key["tokenizer.ggml.token_type"][1] = toks, types
    return [tuple(e) for e in kv]


# ---- shapes -----------------------------------------------------------------------------------------
def _rope_sections(n_rot: int) -> list[int]:
    """M-RoPE sections (t, h, w, 0) summing to n_rot / 2, split like the published [11, 11, 10]."""
    s = n_rot // 2
    a = -(-s // 3)
    b = -(-(s - a) // 2)
    return [a, b, s - a - b, 0]


def derive_dims(hidden: int, *, n_heads: int | None = None, n_kv_heads: int = 2, head_dim: int | None = None,
                n_k_heads: int | None = None, n_v_heads: int | None = None,
                linear_head_dim: int | None = None) -> dict[str, int]:
    """Defaults scaled like the tiny fixture (H 64: 4 heads x 32, 2 KV; DeltaNet 2 k / 4 v heads x 16):
    attention n_h * hd = 2H with hd = H/4 clamped to [32, 256]; DeltaNet n_v * d = H, n_v = 2 n_k."""
    hd = head_dim or min(256, max(32, hidden // 4))
    nh = n_heads or max(1, 2 * hidden // hd)
    d = linear_head_dim or min(128, max(16, hidden // 8))
    nv = n_v_heads or max(1, hidden // d)
    nk = n_k_heads or max(1, nv // 2)
    if nv % nk:
        raise ValueError(f"n_v_heads {nv} must be a multiple of n_k_heads {nk}")
    if nh % n_kv_heads:
        raise ValueError(f"n_heads {nh} must be a multiple of n_kv_heads {n_kv_heads}")
    return dict(n_heads=nh, n_kv_heads=n_kv_heads, head_dim=hd, n_rot=max(2, hd // 4), n_k=nk, n_v=nv, d=d)


# ---- writer -----------------------------------------------------------------------------------------
def write_random_qwen35moe(path: str | Path, *, hidden: int = MID["hidden"], n_layers: int = MID["n_layers"],
                           n_experts: int = MID["n_experts"], n_used: int = MID["n_used"],
                           expert_ffn: int = MID["expert_ffn"], vocab: int = MID["vocab"], seed: int = MID["seed"],
                           shared_ffn: int | None = None, n_heads: int | None = None, n_kv_heads: int = 2,
                           head_dim: int | None = None, n_k_heads: int | None = None, n_v_heads: int | None = None,
                           linear_head_dim: int | None = None, conv_kernel: int = 4, attn_interval: int = 4,
                           context_length: int = 4096, std: float = 0.02, qtype: str = "f32",
                           template: str | Path | bool | None = None, name: str | None = None) -> Path:
    """Write a random `qwen35moe` GGUF to `path` and return it (see the module docstring)."""
    import gguf

    T, Q = gguf.GGUFValueType, gguf.GGMLQuantizationType
    qtype = qtype.lower()
    if qtype not in ("f32", "f16", "q8_0"):
        raise ValueError(f"qtype must be f32, f16 or q8_0, not {qtype!r}")
    if not 0 < n_used <= n_experts:
        raise ValueError(f"n_used {n_used} must be in [1, n_experts={n_experts}]")
    dm = derive_dims(hidden, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim, n_k_heads=n_k_heads,
                     n_v_heads=n_v_heads, linear_head_dim=linear_head_dim)
    H, E, F = hidden, n_experts, expert_ffn
    Fs = expert_ffn if shared_ffn is None else shared_ffn
    nh, nkv, hd = dm["n_heads"], dm["n_kv_heads"], dm["head_dim"]
    nk, nv, d = dm["n_k"], dm["n_v"], dm["d"]
    key_dim, value_dim = nk * d, nv * d
    conv_dim = 2 * key_dim + value_dim
    recurrent = [(i + 1) % attn_interval != 0 for i in range(n_layers)]
    tok_kv = tokenizer_kv(vocab, template)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)

    def normal(shape, s=std):
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(s)).astype(np.float32)

    def norm(n):
        return (1.0 + normal((n,))).astype(np.float32)

    w = gguf.GGUFWriter(str(path), ARCH)
    n_params = 0
    file_type = {"f32": 0, "f16": 1, "q8_0": 7}[qtype]

    def add(tname: str, arr: np.ndarray, quant: bool = True) -> None:
        """Add a tensor given in numpy order; matrices (not routers) in the chosen type."""
        nonlocal n_params
        n_params += arr.size
        if quant and arr.ndim >= 2 and qtype == "f16":
            w.add_tensor(tname, arr.astype(np.float16))
        elif quant and arr.ndim >= 2 and qtype == "q8_0" and arr.shape[-1] % 32 == 0:
            w.add_tensor(tname, gguf.quants.quantize(arr, Q.Q8_0), raw_dtype=Q.Q8_0)
        else:
            w.add_tensor(tname, arr)

    # metadata: the fixture's keys, types and order
    p = ARCH + "."
    meta: list[tuple[str, Any, Any, Any]] = [
        ("general.type", "model", T.STRING, None),
        ("general.name", name or f"random-qwen35moe-h{H}-l{n_layers}-e{E}", T.STRING, None),
        ("general.size_label", f"{E}x{F}", T.STRING, None),
        (p + "block_count", n_layers, T.UINT32, None),
        (p + "context_length", context_length, T.UINT32, None),
        (p + "embedding_length", H, T.UINT32, None),
        (p + "attention.head_count", nh, T.UINT32, None),
        (p + "attention.head_count_kv", nkv, T.UINT32, None),
        (p + "rope.dimension_sections", _rope_sections(dm["n_rot"]), T.ARRAY, T.INT32),
        (p + "rope.freq_base", 10000.0, T.FLOAT32, None),
        (p + "attention.layer_norm_rms_epsilon", 1e-6, T.FLOAT32, None),
        (p + "expert_count", E, T.UINT32, None),
        (p + "expert_used_count", n_used, T.UINT32, None),
        (p + "attention.key_length", hd, T.UINT32, None),
        (p + "attention.value_length", hd, T.UINT32, None),
        ("general.file_type", file_type, T.UINT32, None),
        (p + "expert_feed_forward_length", F, T.UINT32, None),
        (p + "expert_shared_feed_forward_length", Fs, T.UINT32, None),
        (p + "ssm.conv_kernel", conv_kernel, T.UINT32, None),
        (p + "ssm.state_size", d, T.UINT32, None),
        (p + "ssm.group_count", nk, T.UINT32, None),
        (p + "ssm.time_step_rank", nv, T.UINT32, None),
        (p + "ssm.inner_size", value_dim, T.UINT32, None),
        (p + "attention.recurrent_layers", recurrent, T.ARRAY, T.BOOL),
        (p + "full_attention_interval", attn_interval, T.UINT32, None),
        (p + "rope.dimension_count", dm["n_rot"], T.UINT32, None),
        ("general.quantization_version", 2, T.UINT32, None),
    ] + tok_kv
    for key, val, vtype, sub in meta:
        w.add_key_value(key, val, vtype, sub_type=sub)

    # tensors: the fixture's order (numpy shapes; ggml `ne` is the reverse)
    add("output.weight", normal((vocab, H)))
    add("token_embd.weight", normal((vocab, H)))
    for i in range(n_layers):
        b = f"blk.{i}."
        add(b + "attn_norm.weight", norm(H))
        if recurrent[i]:
            add(b + "ssm_a", -rng.uniform(1.0, 16.0, nv).astype(np.float32))
            add(b + "ssm_conv1d.weight", normal((conv_dim, conv_kernel), 0.3), quant=False)
            add(b + "ssm_dt.bias", (1.0 + normal((nv,), 0.1)).astype(np.float32))
            add(b + "ssm_alpha.weight", normal((nv, H)))
            add(b + "ssm_beta.weight", normal((nv, H)))
            add(b + "attn_qkv.weight", normal((conv_dim, H)))
            add(b + "attn_gate.weight", normal((value_dim, H)))
            add(b + "ssm_norm.weight", norm(d))
            add(b + "ssm_out.weight", normal((H, value_dim)))
        add(b + "ffn_down_exps.weight", normal((E, H, F)))
        add(b + "ffn_gate_exps.weight", normal((E, F, H)))
        add(b + "ffn_up_exps.weight", normal((E, F, H)))
        add(b + "ffn_gate_inp.weight", normal((E, H)), quant=False)
        add(b + "ffn_down_shexp.weight", normal((H, Fs)))
        add(b + "ffn_gate_shexp.weight", normal((Fs, H)))
        add(b + "ffn_up_shexp.weight", normal((Fs, H)))
        add(b + "ffn_gate_inp_shexp.weight", normal((1, H)), quant=False)
        add(b + "post_attention_norm.weight", norm(H))
        if not recurrent[i]:
            add(b + "attn_k_norm.weight", norm(hd))
            add(b + "attn_k.weight", normal((nkv * hd, H)))
            add(b + "attn_output.weight", normal((H, nh * hd)))
            add(b + "attn_q_norm.weight", norm(hd))
            add(b + "attn_q.weight", normal((2 * nh * hd, H)))
            add(b + "attn_v.weight", normal((nkv * hd, H)))
    add("output_norm.weight", norm(H))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("path", help="output .gguf")
    ap.add_argument("--hidden", type=int, default=MID["hidden"])
    ap.add_argument("--layers", type=int, default=MID["n_layers"])
    ap.add_argument("--experts", type=int, default=MID["n_experts"])
    ap.add_argument("--used", type=int, default=MID["n_used"], help="experts per token (top-k)")
    ap.add_argument("--expert-ffn", type=int, default=MID["expert_ffn"])
    ap.add_argument("--shared-ffn", type=int, default=None, help="shared expert width (default: --expert-ffn)")
    ap.add_argument("--vocab", type=int, default=MID["vocab"], help=">= the tokenizer's 512 tokens")
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=None)
    ap.add_argument("--k-heads", type=int, default=None, help="DeltaNet key heads")
    ap.add_argument("--v-heads", type=int, default=None, help="DeltaNet value heads")
    ap.add_argument("--linear-head-dim", type=int, default=None)
    ap.add_argument("--interval", type=int, default=4, help="full_attention_interval")
    ap.add_argument("--std", type=float, default=0.02)
    ap.add_argument("--type", dest="qtype", default="f32", choices=("f32", "f16", "q8_0"))
    ap.add_argument("--seed", type=int, default=MID["seed"])
    ap.add_argument("--template", default=None,
                    help="GGUF whose tokenizer.* keys are copied (default: the tiny fixture if found); "
                         "'synthetic' for the built-in byte-level tokenizer")
    a = ap.parse_args(argv)
    out = write_random_qwen35moe(
        a.path, hidden=a.hidden, n_layers=a.layers, n_experts=a.experts, n_used=a.used, expert_ffn=a.expert_ffn,
        shared_ffn=a.shared_ffn, vocab=a.vocab, n_heads=a.heads, n_kv_heads=a.kv_heads, head_dim=a.head_dim,
        n_k_heads=a.k_heads, n_v_heads=a.v_heads, linear_head_dim=a.linear_head_dim, attn_interval=a.interval,
        std=a.std, qtype=a.qtype, seed=a.seed, template=False if a.template == "synthetic" else a.template)
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
