"""The int8 form of the native products (dot="int8", the serving default) on the real catalog models.

The int8 form rounds every activation row to 8 bits per block (with power-of-two finer steps for
sub-blocks of smaller values), as llama.cpp rounds them to 8 bits per block, so its logits are not the
f32 oracle's. Issue 40 made it the default and judges it against llama.cpp on the same file, not
against f32 arithmetic: its first-step top-20 log-probabilities are on average no further from HF's
than 1.2x llama.cpp's, and wherever HF's choice is clear (top-1 margin >= 0.5) its greedy token is
HF's or llama.cpp's.

Why only up to the first departure: rounding an activation to 8 bits is discontinuous, so an
ulp-level difference upstream (another fusion of the same f32 graph) moves the int8 form's logits
by ~0.05-0.1 here and there, and a near tie can go either way; after a departure the contexts differ.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import REAL, real_fixture
from pantheon.runtime import reference
from pantheon.types import GREEDY

MODELS = ["smollm2-135m", "qwen-0.5b", "gemma3-270m"]
# A top-1 choice of HF's is robust to 8-bit activations only where HF's top-2 logit gap exceeds this:
# the first-step log-prob error of llama.cpp's products on these files reaches 0.33 and ours 0.23.
MARGIN = 0.5


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def leading(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def departure(out: list[int], ref: list[int]) -> int | None:
    """The first step where `out` leaves `ref` (a different token, or one of them ended), else None."""
    lead = leading(out, ref)
    return None if lead == len(out) == len(ref) else lead


@pytest.mark.real
@pytest.mark.parametrize("name", MODELS)
def test_int8_greedy_follows_hf_or_llamacpp_wherever_hfs_choice_is_clear(name, load_real):
    """The serving default's criterion (issue 40): on HF's trajectory, at every step where HF's top-1
    margin is >= MARGIN our token is HF's, or llama.cpp's where llama.cpp is still on that trajectory.
    After the first step where we leave HF's tokens the contexts differ, so nothing later is compared."""
    fx = real_fixture(name)
    model = load_real(name, dot="int8")
    assert model.kernels.dot == "int8"
    agree_hf = agree_lcpp = total = 0
    for case in fx["chat_cases"]:
        ref, margins, lcpp = case["greedy_ids_hf"], case["greedy_top1_margins_hf"], case["greedy_ids_llamacpp"]
        out = list(reference.generate(model, case["prompt_ids"], GREEDY, max_tokens=len(lcpp), stop_ids=fx["stop_ids"]))
        k = departure(out, ref)
        if k is not None and k < len(margins) and margins[k] >= MARGIN:
            theirs = lcpp[k] if leading(lcpp, ref) >= k and k < len(lcpp) else None
            mine = out[k] if k < len(out) else None
            assert mine is not None and mine == theirs, (
                f"step {k}: {mine} where HF says {ref[k]} with margin {margins[k]:.2f} and llama.cpp {theirs}: "
                f"{out} vs {ref}")
        agree_hf, total = agree_hf + leading(out, ref), total + len(ref)
        agree_lcpp += leading(out, lcpp)
    print(f"{name} int8: {agree_hf}/{total} greedy tokens agree with HF, {agree_lcpp} with llama.cpp")


@pytest.mark.real
@pytest.mark.parametrize("name", MODELS)
def test_int8_first_step_logprobs_are_about_as_close_to_hf_as_llamacpps(name, load_real):
    """At the last prompt position, over HF's top 20 tokens, |our log-prob - HF's| against llama.cpp's
    (same f32 KV cache as its run): the serving default's criterion (issue 40) is at most 1.2x
    llama.cpp's on average over the cases, and no case over 3x. Measured (2026-12-07, sub-block steps):
    gemma3 mean 0.15 (llama.cpp 0.20), SmolLM2 0.18 (0.26), Qwen2.5 0.12 (0.19); with one step per
    256-value block the K-quant files were 1.4x (gemma3), with one per 32-value block SmolLM2 1.25x.
    The exact form's is below 1e-3."""
    fx = real_fixture(name)
    model = load_real(name, "float32", dot="int8")
    lcpp = {c["case"]: c["first_step_logprob_maxabs"] for c in fx["llamacpp_summary"]["chat"]}
    ours, theirs = [], []
    for i, case in enumerate(fx["chat_cases"]):
        got = log_softmax(reference.logits(model, case["prompt_ids"])[-1].astype(np.float64))
        ref = log_softmax(np.load(REAL / case["last_logits_file"]).astype(np.float64))
        top = np.argsort(ref)[::-1][:20]
        ours.append(float(np.abs(got[top] - ref[top]).max()))
        theirs.append(lcpp[i])
        assert ours[-1] <= 3 * theirs[-1], (name, i, ours[-1], theirs[-1])
    assert np.mean(ours) <= 1.2 * np.mean(theirs), (name, ours, theirs)
    print(f"{name} int8 first-step top-20 log-prob error: {ours} (llama.cpp {theirs})")
