"""tools/make_sized_gguf.py: random-block GGUFs shaped like real-size models, in Q4_K_M layouts.

Every profile is written at small dims (2-4 layers, hidden 256, 8 experts, the synthetic 512-token
vocabulary) and read back with gguf.GGUFReader: the planned tensor names, types and shapes, block
data that dequantizes to finite values of the planned magnitude, q/k/v and gate/up adjacent in the
file, and `--dry-run`'s size equal to the written file's. The full-size plans are sized without
writing anything, and a small qwen2 / qwen3moe file loads in the engine and generates.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from pantheon.runtime import reference

ROOT = Path(__file__).resolve().parents[1]

# Small dims: every matrix input width a multiple of 256 (K-quant rows are whole 256-blocks).
SMALL = {
    "qwen2-7b": dict(layers=2, hidden=256, n_heads=4, n_kv_heads=2, head_dim=64, ffn=512, vocab=512),
    "llama-7b": dict(layers=2, hidden=256, n_heads=4, n_kv_heads=2, head_dim=64, ffn=512, vocab=512),
    "qwen3moe-30b-a3b": dict(layers=2, hidden=256, n_heads=4, n_kv_heads=2, head_dim=128, n_experts=8, n_used=2,
                             expert_ffn=256, vocab=512),
    "qwen35moe-30b-a3b": dict(layers=4, hidden=256, n_heads=2, n_kv_heads=1, head_dim=128, n_experts=8, n_used=2,
                              expert_ffn=256, shared_ffn=256, n_k_heads=2, n_v_heads=4, linear_head_dim=64,
                              vocab=512),
}


def _tool():
    name = "make_sized_gguf"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def _write(tmp: Path, profile: str, **kw) -> Path:
    return _tool().write_sized_gguf(tmp / f"{profile}.gguf", profile, template=False, **{**SMALL[profile], **kw})


@pytest.fixture(scope="module")
def small_files(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("sized")
    return {p: _write(tmp, p) for p in SMALL}


def _tensors(path: Path) -> dict[str, gguf.ReaderTensor]:
    return {t.name: t for t in gguf.GGUFReader(str(path)).tensors}


@pytest.mark.parametrize("profile", list(SMALL))
def test_small_file_reads_back_as_planned(small_files, profile):
    m = _tool()
    path = small_files[profile]
    b = m.prepare(profile, template=False, **SMALL[profile])
    r = gguf.GGUFReader(str(path))
    got = [(t.name, t.tensor_type.name, tuple(int(x) for x in t.shape)) for t in r.tensors]
    assert got == [(t.name, t.fmt, tuple(reversed(t.shape))) for t in b.specs]  # GGUF ne = numpy shape reversed
    assert r.fields["general.architecture"].contents() == m.PROFILES[profile].arch
    assert r.fields["general.name"].contents() == f"random {profile} Q4_K_M-layout"
    assert r.fields["general.file_type"].contents() == 15
    assert len(r.fields["tokenizer.ggml.tokens"].contents()) == 512
    # --dry-run's size is the written file's
    assert path.stat().st_size == m.file_bytes(b) == m.dry_run_bytes(profile, template=False, **SMALL[profile])
    assert m.header_bytes(b) == m.header_bytes(b, exact=True)
    for t in r.tensors:
        vals = gguf.quants.dequantize(t.data, t.tensor_type)
        assert np.isfinite(vals).all(), t.name
        role = m.role_of(t.name)
        if t.name.endswith("norm.weight"):
            assert abs(float(vals.mean()) - 1.0) < 0.02 and float(vals.std()) < 0.05, t.name
        elif role == "ssm_a":
            assert (vals <= -1.0).all() and (vals >= -16.0).all()
        elif len(t.shape) >= 2 and role != "ssm_conv1d" and vals.size >= 4096:  # weight matrices, routers
            assert 0.016 < float(vals.std()) < 0.024, (t.name, float(vals.std()))
            assert abs(float(vals.mean())) < 2e-3, t.name
            assert float(np.abs(vals).max()) < 0.2, t.name


def test_q4_k_m_layout_and_order(small_files):
    m = _tool()
    for profile, path in small_files.items():
        ts = _tensors(path)
        fmt = {n: t.tensor_type.name for n, t in ts.items()}
        assert fmt["token_embd.weight"] == "Q4_K" and fmt["output.weight"] == "Q6_K"
        assert fmt["output_norm.weight"] == "F32"
        for n, f in fmt.items():
            role = m.role_of(n)
            if role in ("attn_v", "ffn_down", "ffn_down_exps", "ffn_down_shexp"):
                assert f == "Q6_K", n
            elif (n.endswith(".bias") or "norm" in role or role.startswith("ffn_gate_inp")
                  or role in ("ssm_a", "ssm_conv1d")):
                assert f == "F32", n
            elif role not in ("token_embd", "output"):
                assert f == "Q4_K", n
        # the projections that read one input are neighbours, their data contiguous when the formats agree
        names = list(ts)
        for group in (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up"), ("ffn_gate_exps", "ffn_up_exps"),
                      ("attn_qkv", "attn_gate"), ("ssm_alpha", "ssm_beta"), ("ffn_gate_shexp", "ffn_up_shexp")):
            for layer in range(SMALL[profile]["layers"]):
                full = [f"blk.{layer}.{g}.weight" for g in group]
                if full[0] not in ts:
                    continue
                idx = [names.index(n) for n in full]
                assert idx == list(range(idx[0], idx[0] + len(idx))), (profile, full)
                for a, c in zip(full, full[1:]):
                    if fmt[a] == fmt[c]:
                        assert ts[a].data_offset + ts[a].n_bytes == ts[c].data_offset, (a, c)
    moe = _tensors(small_files["qwen3moe-30b-a3b"])
    assert tuple(int(x) for x in moe["blk.0.ffn_down_exps.weight"].shape) == (256, 256, 8)
    assert tuple(int(x) for x in moe["blk.0.attn_q.weight"].shape) == (256, 512)  # 4 heads x 128 > hidden
    hyb = _tensors(small_files["qwen35moe-30b-a3b"])
    assert "blk.0.ssm_a" in hyb and "blk.3.attn_q.weight" in hyb and "blk.3.ssm_a" not in hyb
    assert tuple(int(x) for x in hyb["blk.3.attn_q.weight"].shape) == (256, 2 * 2 * 128)  # q + its gate
    assert "blk.0.attn_q.bias" in _tensors(small_files["qwen2-7b"])
    assert "blk.0.attn_q.bias" not in _tensors(small_files["llama-7b"])


def test_format_overrides_and_every_block_format(tmp_path):
    m = _tool()
    from pantheon.ops.quant_formats import BLOCK_FORMATS

    fmts = {"*": "Q8_0", "attn_v": "Q5_0", "ffn_down": "BF16", "blk.1.ffn_up.weight": "F16", "attn_q.bias": "F16",
            "token_embd": "IQ4_XS"}
    path = _write(tmp_path, "qwen2-7b", formats=fmts)
    ts = _tensors(path)
    got = {n: t.tensor_type.name for n, t in ts.items()}
    assert got["blk.0.attn_q.weight"] == got["output.weight"] == got["blk.0.ffn_up.weight"] == "Q8_0"
    assert got["blk.0.attn_v.weight"] == "Q5_0" and got["blk.0.ffn_down.weight"] == "BF16"
    assert got["blk.1.ffn_up.weight"] == "F16" and got["blk.0.attn_q.bias"] == "F16"
    assert got["token_embd.weight"] == "IQ4_XS" and got["blk.0.attn_norm.weight"] == "F32"
    for n in ("blk.0.ffn_down.weight", "blk.1.ffn_up.weight", "token_embd.weight", "blk.0.attn_v.weight"):
        vals = gguf.quants.dequantize(ts[n].data, ts[n].tensor_type)
        assert np.isfinite(vals).all() and 0.016 < float(vals.std()) < 0.024, n
    r = gguf.GGUFReader(str(path))
    assert r.fields["general.name"].contents() == "random qwen2-7b Q8_0-layout"
    assert path.stat().st_size == m.dry_run_bytes("qwen2-7b", template=False, formats=fmts, **SMALL["qwen2-7b"])
    # every block format's random blocks: the planned std, centred, finite
    for f in BLOCK_FORMATS:
        blk = m._random_blocks(np.random.default_rng(7), f, 2048, 0.02 / m.unit_std(f))
        vals = gguf.quants.dequantize(blk, gguf.GGMLQuantizationType[f])
        assert np.isfinite(vals).all() and 0.018 < float(vals.std()) < 0.022, f
        assert abs(float(vals.mean())) < 1e-3, f
    with pytest.raises(ValueError, match="no tensor or role"):
        m.prepare("qwen2-7b", template=False, formats={"attn_vv": "Q8_0"}, **SMALL["qwen2-7b"])
    with pytest.raises(ValueError, match="not one of"):
        m.prepare("qwen2-7b", template=False, formats={"attn_v": "Q9_K"}, **SMALL["qwen2-7b"])


def test_llama_cpp_mix_uses_more_bits_layers():
    m = _tool()
    b = m.prepare("qwen2-7b", template=False, mix="llama.cpp")
    v = [t.fmt for t in b.specs if t.role == "attn_v"]
    assert len(v) == 28 and v.count("Q6_K") == 14 and v[0] == v[27] == "Q6_K" and v[4] == "Q4_K"
    assert 4.6e9 < m.file_bytes(b) < 4.75e9  # llama.cpp's Qwen2.5-7B Q4_K_M is 4.68 GB


def test_full_size_plans():
    """The full profiles are sized from the plan alone (nothing written)."""
    m = _tool()
    expect = {"qwen2-7b": (7.6e9, 4.9e9, 5.0e9), "llama-7b": (7.6e9, 4.9e9, 5.0e9),
              "qwen3moe-30b-a3b": (30.5e9, 19.7e9, 19.9e9), "qwen35moe-30b-a3b": (31.3e9, 20.2e9, 20.4e9)}
    for profile, (params, lo, hi) in expect.items():
        b = m.prepare(profile, template=False)
        assert abs(b.n_params - params) / params < 0.01, (profile, b.n_params)
        assert lo < m.file_bytes(b) < hi, (profile, m.file_bytes(b))
    q = m.prepare("qwen3moe-30b-a3b", template=False)
    shapes = {t.name: t.shape for t in q.specs}
    assert shapes["blk.47.ffn_gate_exps.weight"] == (128, 768, 2048)
    assert shapes["blk.0.attn_q.weight"] == (4096, 2048) and shapes["blk.0.attn_k.weight"] == (512, 2048)
    h = m.prepare("qwen35moe-30b-a3b", template=False)
    assert sum(h.profile.recurrent()) == 36
    shapes = {t.name: t.shape for t in h.specs}
    assert shapes["blk.0.attn_qkv.weight"] == (2 * 16 * 128 + 32 * 128, 2048)
    assert shapes["blk.3.attn_q.weight"] == (2 * 16 * 256, 2048) and shapes["blk.3.attn_k.weight"] == (512, 2048)
    assert shapes["blk.0.ffn_gate_shexp.weight"] == (512, 2048)


def test_cli_dry_run_and_write(tmp_path, capsys):
    m = _tool()
    args = ["--layers", "2", "--hidden", "256", "--heads", "4", "--kv-heads", "2", "--head-dim", "64", "--ffn", "512",
            "--vocab", "512", "--tokenizer", "synthetic", "--no-progress"]
    assert m.main(["qwen2-7b", "--dry-run", "--qtype-map", "attn_v=Q4_K", *args]) == 0
    size = int(capsys.readouterr().out.split("file size: ")[1].split()[0])
    out = tmp_path / "cli.gguf"
    assert m.main(["qwen2-7b", str(out), "--qtype-map", "attn_v=Q4_K", *args]) == 0
    assert "peak RSS" in capsys.readouterr().out
    assert _tensors(out)["blk.0.attn_v.weight"].tensor_type.name == "Q4_K"
    assert out.stat().st_size == size


def test_fast_tokenizer_reader_matches_gguf_reader(small_files):
    m = _tool()
    path = small_files["qwen35moe-30b-a3b"]
    r = gguf.GGUFReader(str(path))
    want = [(k, f.contents(), f.types[0]) for k, f in r.fields.items() if k.startswith("tokenizer.")]
    got = [(k, v, t) for k, v, t, _ in m.read_tokenizer_kv(path)]
    assert got == want and len(got) >= 8


@pytest.mark.real
def test_real_qwen_tokenizer_padded_to_profile_vocab(tmp_path, real_model_path):
    """The catalog's Qwen2.5 BPE and chat template are copied, padded to qwen2-7b's 152064 tokens."""
    m = _tool()
    qwen = real_model_path("qwen-0.5b")  # downloaded once into PANTHEON_HOME, where the tool looks
    assert m.default_tokenizer_gguf().resolve() == qwen.resolve()
    src = {k: v for k, v, _, _ in m.read_tokenizer_kv(qwen)}
    dims = {**SMALL["qwen2-7b"], "vocab": 152064}
    path = m.write_sized_gguf(tmp_path / "qwen2-real-tok.gguf", "qwen2-7b", **dims)
    got = {k: v for k, v, _, _ in m.read_tokenizer_kv(path)}
    assert set(got) == set(src)
    toks, n = got["tokenizer.ggml.tokens"], len(src["tokenizer.ggml.tokens"])
    assert len(toks) == 152064 and toks[:n] == src["tokenizer.ggml.tokens"] and toks[n] == "<|extra_0|>"
    assert got["tokenizer.ggml.token_type"][n:] == [5] * (152064 - n)
    assert got["tokenizer.chat_template"] == src["tokenizer.chat_template"]
    assert got["tokenizer.ggml.merges"] == src["tokenizer.ggml.merges"]
    assert path.stat().st_size == m.dry_run_bytes("qwen2-7b", **dims)


@pytest.mark.parametrize("profile", ["qwen2-7b", "qwen3moe-30b-a3b"])
def test_engine_loads_and_generates(small_files, profile):
    from pantheon.runtime import engine
    from pantheon.runtime.sampler import SamplingParams

    model = engine.load(small_files[profile], engine.LoadOptions(n_slots=2, max_seq=64, prefill_chunk=32))
    try:
        assert (model.config.arch, model.config.n_layers, model.config.vocab) == (
            _tool().PROFILES[profile].arch, SMALL[profile]["layers"], 512)
        ids = model.tokenizer.encode("hello world, the cat")
        lg = reference.logits(model, ids)
        assert lg.shape == (len(ids), 512) and np.isfinite(lg).all() and 0.05 < float(lg.std()) < 10
        out = list(reference.generate(model, ids, SamplingParams(temperature=0.0), max_tokens=4, stop_ids=[]))
        assert len(out) == 4 and all(0 <= t < 512 for t in out)
    finally:
        model.free()
