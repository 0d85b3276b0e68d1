"""Shape buckets and load-time fusion: what the engine compiles, and that fusing changes no result."""

from __future__ import annotations

import numpy as np

from conftest import tiny_fixture
from pantheon import engine


def test_prefill_chunks_come_in_quarters_so_short_prompts_pad_little():
    assert engine._chunk_buckets(128) == (32, 64, 96, 128)
    assert engine._chunk_buckets(512) == (32, 128, 256, 384, 512)
    assert engine._chunk_buckets(16) == (16,)
    assert engine._bucket(71, engine._chunk_buckets(128)) == 96


def test_attention_spans_double_from_128_to_the_capacity():
    path, _, _ = tiny_fixture("llama")
    model = engine.load(path, engine.LoadOptions(n_slots=1, max_seq=1000, prefill_chunk=24))
    spans = model.span_buckets
    assert spans[0] == 128 and spans[-1] == model.capacity
    assert all(b <= 2 * a for a, b in zip(spans, spans[1:]))  # a bucket is never > 2x the filled part


def test_fused_projections_compute_what_the_separate_ones_do():
    path, _, _ = tiny_fixture("qwen2")  # has q/k/v biases, so the fused bias is exercised too
    model = engine.load(path, engine.LoadOptions(n_slots=1, max_seq=64, prefill_chunk=16))
    lay = model.params["layers"]
    assert "wqkv" in lay and "bqkv" in lay and "w_gu" in lay and "wq" not in lay
    ids = list(range(3, 20))
    fused = model.logits(ids)
    cfg = model.config
    nq, nk = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    sep = {k: np.asarray(v) for k, v in lay.items()}
    w, b = sep.pop("wqkv"), sep.pop("bqkv")
    sep.update(wq=w[:, :nq], wk=w[:, nq:nq + nk], wv=w[:, nq + nk:], bq=b[:, :nq], bk=b[:, nq:nq + nk], bv=b[:, nq + nk:])
    gu = sep.pop("w_gu")
    sep.update(w_gate=gu[:, : gu.shape[1] // 2], w_up=gu[:, gu.shape[1] // 2:])
    model.params = {**model.params, "layers": sep}
    separate = model.logits(ids)
    assert np.abs(fused - separate).max() < 1e-4
