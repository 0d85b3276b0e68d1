"""Shape buckets, load-time fusion and mixed steps: what the engine compiles, and that none changes a result."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import tiny_fixture
from pantheon.runtime import engine
from pantheon.ops import weights
from pantheon.runtime.decode_state import slot_insert
from pantheon.runtime.engine import Chunk, StepPlan
from pantheon.types import GREEDY
from pantheon.runtime.sampler import SamplingParams
from pantheon.runtime import reference


def test_prefill_chunks_come_in_quarters_so_short_prompts_pad_little():
    assert engine._chunk_buckets(128) == (32, 64, 96, 128)
    assert engine._chunk_buckets(512) == (32, 128, 256, 384, 512)
    assert engine._chunk_buckets(16) == (16,)
    assert engine._bucket(71, engine._chunk_buckets(128)) == 96


def test_attention_spans_double_from_128_to_the_capacity():
    path, _, _ = tiny_fixture("llama")
    model = engine.load(path, engine.LoadOptions(n_slots=1, max_seq=1000, prefill_chunk=24))
    spans = model.span_buckets
    assert spans[0] == 128 and spans[-1] == model.capacity == model.max_seq + model.chunk
    assert model.max_seq not in spans  # the top bucket covers max_seq and the slack in one program
    # a bucket is never more than twice the filled part, plus the chunk's padding slack at the top
    assert all(b <= 2 * a + model.chunk for a, b in zip(spans, spans[1:]))


def test_fused_projections_compute_what_the_separate_ones_do():
    path, _, _ = tiny_fixture("qwen2")  # has q/k/v biases, so the fused bias is exercised too
    model = engine.load(path, engine.LoadOptions(n_slots=1, max_seq=64, prefill_chunk=16))
    lay = model.params.layers
    assert lay.wqkv is not None and lay.bqkv is not None and lay.w_gu is not None and lay.wq is None
    ids = list(range(3, 20))
    fused = reference.logits(model, ids)
    cfg = model.config
    nq, nk = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    w, b = lay.wqkv, lay.bqkv  # per layer: rows [q | k | v] of one weight

    def rows(ws, lo, hi):  # rows [lo, hi) of every layer's matrix, still one stack over the layers
        return ws.replace(groups=tuple(weights.row_slice(g, lo, hi) for g in ws.groups))

    gu = lay.w_gu
    half = gu.groups[0].rows // 2
    sep = lay.replace(wqkv=None, bqkv=None, w_gu=None,
                      wq=rows(w, 0, nq), wk=rows(w, nq, nq + nk), wv=rows(w, nq + nk, nq + 2 * nk),
                      bq=b[:, :nq], bk=b[:, nq:nq + nk], bv=b[:, nq + nk:],
                      w_gate=rows(gu, 0, half), w_up=rows(gu, half, 2 * half))
    model.params = model.params.replace(layers=sep)
    separate = reference.logits(model, ids)
    assert np.abs(fused - separate).max() < 1e-4


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3moe", "phi3"])
def test_a_prefill_chunk_riding_with_decode_rows_computes_what_separate_steps_do(arch):
    """Mixed step: one row of a prompt chunk and single-token rows of other slots in one forward.

    Its logits and sampled ids equal a prefill step followed by a decode step, whatever position the
    prefill row has in the caller's order, and it compiles as its own (tokens, span) program.
    """
    path, j, _ = tiny_fixture(arch)
    model = engine.load(path, engine.LoadOptions(n_slots=4, max_seq=96, prefill_chunk=16))
    assert model.supports_mixed and model.mixed_rows == 3
    ids = j["prompt_ids"]
    prompts = {1: ids[:9], 2: ids[3:14], 3: ids[5:10]}  # slots 1..3 decode, slot 0 prefills
    chunk = ids[2:15]
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, top_k=5, seed=3),
              SamplingParams(temperature=0.0, repetition_penalty=1.2)]

    def run(mixed: bool, decoders: list[int]):
        """Slots in `decoders` decode one token while slot 0 takes `chunk` as its whole prompt: in one
        mixed step, or as separate plain prefill and decode steps."""
        state = model.new_state()
        for s in decoders:
            state = model.insert(state, slot_insert(s, prompts[s], 0, params[s - 1].resolved(), 8, ()))
            _, state = model.step(state, StepPlan(chunk=Chunk(s, tuple(prompts[s]), 0, True)))
        state = model.insert(state, slot_insert(0, chunk, 0, GREEDY, 8, ()))
        c = Chunk(0, tuple(chunk), 0, True)
        reach = 1 + max(len(prompts[s]) for s in decoders)
        if mixed:
            h, state = model.step(state, StepPlan(chunk=c, decode=tuple(decoders), reach=reach), want_logits=True)
            return np.asarray(h.logits)[: 1 + len(decoders)], model.read(h)[:, 0]
        plans = [StepPlan(chunk=c)] + [StepPlan(decode=(s,), reach=reach) for s in decoders]
        out_l, out_i = [], []
        for plan in plans:  # one row at a time: plain prefill and decode programs
            h, state = model.step(state, plan, want_logits=True)
            out_l.append(np.asarray(h.logits)[0])
            out_i.append(model.read(h)[0, 0])
        return np.stack(out_l), np.array(out_i)

    for decoders in ([1, 2, 3], [2]):  # a full decode group and a padded one
        mixed_logits, mixed_ids = run(True, decoders)
        sep_logits, sep_ids = run(False, decoders)
        assert np.abs(mixed_logits - sep_logits).max() < 1e-4
        assert list(mixed_ids) == list(sep_ids)
    assert any(k[0] == "mixed" for k in model.compiled_shapes())
