"""The llama family matches HF transformers' float64 oracle on the tiny random-weight fixtures.

Teacher-forced logits within 1e-3 (f32), greedy continuations equal, and the same rows whether the
prompt is prefilled whole, in chunks of 1 or 5, or prefilled in part and then decoded step by step.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import centered, tiny_fixture
from pantheon import engine
from pantheon.sampler import SamplingParams

ARCHS = ["llama", "llama.q8_0", "qwen2", "qwen3", "qwen3moe", "mixtral"]
TOL = 1e-3
_models: dict[str, engine.Model] = {}


def tiny_model(name: str) -> engine.Model:
    if name not in _models:
        path, _, _ = tiny_fixture(name)
        _models[name] = engine.load(path, engine.LoadOptions(n_slots=2, max_seq=64, prefill_chunk=16))
    return _models[name]


@pytest.mark.parametrize("name", ARCHS)
@pytest.mark.parametrize("chunk", [None, 1, 5])
def test_teacher_forced_logits_match_oracle(name, chunk):
    _, j, ref = tiny_fixture(name)
    got = tiny_model(name).logits(j["prompt_ids"], chunk=chunk)
    assert got.shape == ref.shape
    assert np.abs(centered(got) - centered(ref)).max() < TOL


@pytest.mark.parametrize("name", ARCHS)
def test_greedy_continuation_matches_oracle(name):
    _, j, _ = tiny_fixture(name)
    out = list(tiny_model(name).generate(j["prompt_ids"], SamplingParams(temperature=0.0), max_tokens=16,
                                         stop_ids=[]))
    assert out == j["greedy_ids"]


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_prefill_then_stepwise_decode_matches_oracle(name):
    _, j, _ = tiny_fixture(name)
    m = tiny_model(name)
    out = list(m.generate(j["prompt_ids"], SamplingParams(temperature=0.0), max_tokens=16, stop_ids=[],
                          decode_from=7, chunk=5))
    assert out == j["greedy_ids"]


def test_two_slots_do_not_disturb_each_other():
    """A second sequence in another slot leaves the first one's continuation unchanged."""
    _, j, _ = tiny_fixture("llama")
    m = tiny_model("llama")
    state = m.new_state()
    _, _, state = m.prefill(state, 1, j["prompt_ids"][::-1])
    out = list(m.generate(j["prompt_ids"], SamplingParams(temperature=0.0), max_tokens=16, stop_ids=[],
                          state=state, slot=0))
    assert out == j["greedy_ids"]
