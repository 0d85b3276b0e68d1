"""tools/make_random_qwen35moe.py writes what the engine reads.

A small random qwen35moe GGUF (hidden 64, 4 layers: 3 DeltaNet + 1 attention, 8 experts top-2) is
written into tmp_path with the tool and loaded by `pantheon.runtime.engine.load`: the logits are finite,
chunked prefill equals whole-prompt prefill (the recurrent state hand-off between chunks), and
greedy generation runs and agrees with token-by-token decode.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import TINY
from pantheon.runtime import engine
from pantheon.runtime.sampler import SamplingParams
from pantheon.runtime import reference

ROOT = Path(__file__).resolve().parents[1]
# std 0.15 (the tiny fixture's scale) gives logits of std ~1.2, so the 1e-4 checks below are not
# trivially met by near-zero logits (the tool's default 0.02 gives std ~0.16).
SMALL = dict(hidden=64, n_layers=4, n_experts=8, n_used=2, expert_ffn=32, vocab=512, seed=3, std=0.15)
PROMPT = [170, 109, 40, 199, 240, 234, 293, 416, 197, 106, 65, 354, 343, 135, 414, 50, 53, 254, 455, 256]
GREEDY = SamplingParams(temperature=0.0)


def _tool():
    spec = importlib.util.spec_from_file_location("make_random_qwen35moe", ROOT / "tools" / "make_random_qwen35moe.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def write_small(path: Path, **overrides) -> Path:
    """The test helper: a small random qwen35moe GGUF at `path`, written by the tool."""
    return _tool().write_random_qwen35moe(path, **{**SMALL, **overrides})


def _load(path: Path) -> engine.Model:
    return engine.load(path, engine.LoadOptions(n_slots=2, max_seq=64, prefill_chunk=32))


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> tuple[Path, engine.Model]:
    path = write_small(tmp_path_factory.mktemp("rq") / "small-qwen35moe.gguf")
    return path, _load(path)


def test_config_read_back(small):
    _, m = small
    c = m.config
    assert (c.arch, c.hidden, c.n_layers, c.vocab) == ("qwen35moe", 64, 4, 512)
    assert (c.n_experts, c.n_experts_used, c.expert_ffn) == (8, 2, 32)
    assert c.extra["attention.recurrent_layers"] == [True, True, True, False]
    assert m.tokenizer is not None and m.tokenizer.decode(m.tokenizer.encode("hello world")) == "hello world"


def test_logits_finite_and_chunked_prefill_equals_whole(small):
    _, m = small
    whole = reference.logits(m, PROMPT, chunk=len(PROMPT))
    assert whole.shape == (len(PROMPT), 512)
    assert np.isfinite(whole).all() and float(whole.std()) > 0.5
    chunked = reference.logits(m, PROMPT, chunk=3)
    assert float(np.abs(chunked - whole).max()) < 1e-4


@pytest.mark.slow  # one of the few in-process tests over 10 s on 2 cores: left out of make test-quick
def test_greedy_generation(small):
    _, m = small
    out = list(reference.generate(m, PROMPT, GREEDY, max_tokens=8, stop_ids=[]))
    assert len(out) == 8 and all(0 <= t < 512 for t in out)
    stepwise = list(reference.generate(m, PROMPT, GREEDY, max_tokens=8, stop_ids=[], decode_from=5, chunk=3))
    assert stepwise == out


def test_tensor_set_mirrors_the_tiny_fixture(small):
    fixture = TINY / "qwen35moe.json"
    assert fixture.is_file(), f"oracle fixture missing: {fixture}"
    import gguf

    path, _ = small
    r = gguf.GGUFReader(str(path))
    mine = [[t.name, t.tensor_type.name, [int(x) for x in t.shape]] for t in r.tensors]
    j = json.loads(fixture.read_text())
    assert mine == j["gguf_tensors"]
    keys = [k for k in r.fields if not k.startswith("GGUF.")]
    assert set(j["gguf_metadata"]) <= set(keys)


def test_q8_0_synthetic_tokenizer_and_padded_vocab(tmp_path):
    """Q8_0 matrices, the built-in tokenizer (no fixture needed) and a vocabulary padded past it."""
    path = write_small(tmp_path / "q8.gguf", qtype="q8_0", template=False, vocab=320, n_layers=2,
                       attn_interval=2, hidden=64)
    m = _load(path)
    assert m.config.vocab == 320 and m.config.extra["attention.recurrent_layers"] == [True, False]
    ids = m.tokenizer.encode("the cat")
    assert m.tokenizer.decode(ids) == "the cat"
    lg = reference.logits(m, ids + [5, 6, 7])
    assert lg.shape == (len(ids) + 3, 320) and np.isfinite(lg).all()
