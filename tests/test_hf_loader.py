"""HF safetensors checkpoints load into the same model as their GGUF conversions.

The tiny-hf directories are the sources the tiny GGUFs were converted from, so loading one must give the
GGUF's oracle logits and greedy ids, and every tensor must equal the converter's output. That proves the
name tables, the fused phi3 tensors, Qwen3.5's converter transforms (+1 norms, -exp(A_log), V-head
reordering, expert stacking) and the rotate-half RoPE of an HF llama (the converter permutes Q/K instead).
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from conftest import FIXTURES, centered, tiny_fixture
from pantheon.runtime import engine
from pantheon.errors import ModelLoadError
from pantheon.formats.hf_loader import _llama3_divisors, open_hf
from pantheon.runtime.sampler import SamplingParams
from pantheon.runtime import reference

HF = FIXTURES / "tiny-hf"
ARCHS = ["llama", "qwen2", "qwen3", "phi3", "qwen35moe"]
TOL = 1e-3
OPTS = engine.LoadOptions(n_slots=2, max_seq=64, prefill_chunk=16, kv_dtype="float32")  # oracle parity: f32 KV
_models: dict[str, engine.Model] = {}


def hf_model(name: str) -> engine.Model:
    if name not in _models:
        _models[name] = engine.load(HF / name, OPTS)
    return _models[name]


@pytest.mark.parametrize("name", ARCHS)
def test_hf_checkpoint_matches_gguf_oracle(name):
    _, j, ref = tiny_fixture(name)
    m = hf_model(name)
    assert np.abs(centered(reference.logits(m, j["prompt_ids"])) - centered(ref)).max() < TOL
    out = list(reference.generate(m, j["prompt_ids"], SamplingParams(temperature=0.0), max_tokens=16, stop_ids=[]))
    assert out == j["greedy_ids"]


def _norm_rope_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """convert_hf_to_gguf's llama Q/K permutation: GGUF row 2i+j of a head = HF row j*d/2 + i."""
    return w.reshape(n_heads, 2, -1, w.shape[-1]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("name", ARCHS)
def test_every_gguf_tensor_equals_the_converted_hf_tensor(name):
    from pantheon.formats.gguf_loader import open_gguf
    path, _, _ = tiny_fixture(name)
    gguf = open_gguf(path)
    hf = open_hf(HF / name).tensors
    assert sorted(hf.names()) == sorted(gguf.tensors.names())
    cfg = gguf.config
    for t in gguf.tensors.names():
        want, got = gguf.tensors.get(t), hf.get(t)
        if name == "llama" and t.endswith(("attn_q.weight", "attn_k.weight")):
            got = _norm_rope_permute(got, cfg.n_heads if "attn_q" in t else cfg.n_kv_heads)
        assert got.shape == want.shape, t
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7, err_msg=t)  # -exp(A_log): 1 ulp


def test_hf_tokenizer_and_chat_template_come_from_the_directory():
    m = hf_model("llama")
    text = m.card.template.render([{"role": "user", "content": "hello there"}])
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    ids = m.tokenizer.encode(text)
    assert m.tokenizer.decode(ids) == text
    assert m.tokenizer.eos_id in m.tokenizer.eot_ids


def test_single_file_with_config_path(tmp_path):
    """A lone .safetensors file plus LoadOptions.config_path loads the same weights."""
    _, j, ref = tiny_fixture("qwen2")
    weights = tmp_path / "weights.safetensors"
    shutil.copy(HF / "qwen2" / "model.safetensors", weights)
    m = engine.load(weights, engine.LoadOptions(n_slots=2, max_seq=64, prefill_chunk=16, kv_dtype="float32",
                                                config_path=str(HF / "qwen2" / "config.json")))
    assert np.abs(centered(reference.logits(m, j["prompt_ids"])) - centered(ref)).max() < TOL


def _write_sharded(src_dir, dst_dir, dtype=None) -> dict[str, np.ndarray]:
    """Re-save a checkpoint as two shards with an index (optionally cast); returns the tensors written."""
    from safetensors import safe_open
    with safe_open(str(src_dir / "model.safetensors"), framework="numpy") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if dtype is not None:
        tensors = {k: v.astype(dtype) for k, v in tensors.items()}
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for fname, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, str(dst_dir / fname))
    index = {"weight_map": {k: fname for fname, keys in halves.items() for k in keys}}
    (dst_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    for extra in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src_dir / extra, dst_dir / extra)
    return tensors


def test_sharded_checkpoint_with_index(tmp_path):
    _write_sharded(HF / "phi3", tmp_path)
    f = open_hf(tmp_path)
    ref = open_hf(HF / "phi3")
    assert f.config == dataclasses.replace(ref.config, name=f.config.name)
    for name in ("blk.2.attn_qkv.weight", "blk.3.ffn_up.weight", "output.weight", "token_embd.weight"):
        np.testing.assert_array_equal(f.tensors.get(name), ref.tensors.get(name))


def test_bf16_tensors_widen_exactly(tmp_path):
    """numpy has no bfloat16: the loader widens raw bits, which must equal the bf16 values."""
    written = _write_sharded(HF / "qwen3", tmp_path, dtype=ml_dtypes.bfloat16)
    src = open_hf(tmp_path).tensors
    for name, hf in (("blk.1.attn_q.weight", "model.layers.1.self_attn.q_proj.weight"),
                     ("blk.0.attn_k_norm.weight", "model.layers.0.self_attn.k_norm.weight")):
        got = src.get(name)
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, written[hf].astype(np.float32))


def test_load_errors_name_the_problem(tmp_path):
    with pytest.raises(ModelLoadError, match="no HF config"):
        engine.load(tmp_path, OPTS)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ModelLoadError, match="unsupported HF model_type 'bert'"):
        engine.load(tmp_path, OPTS)
    cfg = json.loads((HF / "llama" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="no .safetensors"):
        engine.load(tmp_path, OPTS)
    save_file({"model.embed_tokens.weight": np.zeros((512, 64), np.float32)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="missing tensor"):
        engine.load(tmp_path, OPTS)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelLoadError, match="safetensors"):
        engine.load(tmp_path, OPTS)


def _phi3_with_rope(tmp_path, rope: dict, max_seq: int) -> engine.Model:
    """The tiny phi3 checkpoint with its rope_parameters replaced (in a new directory under tmp_path)."""
    tmp_path = tmp_path / rope["rope_type"] / str(max_seq)
    tmp_path.mkdir(parents=True)
    for f in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(HF / "phi3" / f, tmp_path / f)
    cfg = json.loads((HF / "phi3" / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_theta": 10000.0, "partial_rotary_factor": 1.0, **rope}
    cfg["max_position_embeddings"] = 512  # twice original_max_position_embeddings (256)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return engine.load(tmp_path, engine.LoadOptions(n_slots=1, max_seq=max_seq, prefill_chunk=16, kv_dtype="float32"))


def test_phi3_longrope_picks_factors_by_context(tmp_path):
    """Short factors (all 1) while the cache fits the original context: the plain model's logits.
    Long factors (all 2) once it does not: the same as linear RoPE scaling by 2."""
    _, j, ref = tiny_fixture("phi3")
    ids = j["prompt_ids"]
    rope = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8, "attention_factor": 1.0,
            "original_max_position_embeddings": 256}
    short = _phi3_with_rope(tmp_path, rope, max_seq=64)
    assert short.config.rope_orig_context == 256 and short.config.rope_attn_factor == 1.0
    assert np.abs(centered(reference.logits(short, ids)) - centered(ref)).max() < TOL
    long = _phi3_with_rope(tmp_path, rope, max_seq=300)
    linear = _phi3_with_rope(tmp_path, {"rope_type": "linear", "factor": 2.0}, max_seq=300)
    got, want = reference.logits(long, ids), reference.logits(linear, ids)
    assert np.abs(got - want).max() < 1e-4
    assert np.abs(centered(got) - centered(ref)).max() > 1e-2  # the factors really changed the model


def test_phi3_longrope_attention_factor_scales_cos_and_sin(tmp_path):
    """cos/sin times m on q and k multiplies every score by m^2 (all dims rotate in the tiny phi3)."""
    _, j, _ = tiny_fixture("phi3")
    m = 1.5
    rope = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 8, "attention_factor": m,
            "original_max_position_embeddings": 256}
    scaled = _phi3_with_rope(tmp_path, rope, max_seq=64)
    plain = engine.load(HF / "phi3", engine.LoadOptions(n_slots=1, max_seq=64, prefill_chunk=16, kv_dtype="float32"))
    plain.config = dataclasses.replace(plain.config, attn_scale=plain.config.attn_scale * m * m)  # before tracing
    assert np.abs(reference.logits(scaled, j["prompt_ids"]) - reference.logits(plain, j["prompt_ids"])).max() < 1e-4


def test_llama3_rope_divisors_follow_the_converter():
    """High frequencies untouched, low ones divided by `factor`, a smooth ramp between (Llama 3.1 values)."""
    rp = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    d = _llama3_divisors(rp, 500000.0, 128)
    assert d.shape == (64,)
    assert d[0] == 1.0 and d[-1] == 8.0
    assert np.all(np.diff(d) >= 0)
    wavelen = 2 * np.pi * 500000.0 ** (np.arange(0, 128, 2) / 128)
    mid = (wavelen >= 8192 / 4) & (wavelen <= 8192)
    smooth = (8192 / wavelen[mid] - 1) / 3
    np.testing.assert_allclose(d[mid], 1 / ((1 - smooth) / 8 + smooth), rtol=1e-6)
