"""What the sampling step gives the OpenAI surface: logprobs from inside the step, a per-row logit
bias, a grammar's token mask, n > 1 choices forked from one prefilled prompt, and a prompt's own
logprobs -- each checked against a direct computation on the same model."""

from __future__ import annotations

import numpy as np

from conftest import tiny_fixture, tiny_model
from pantheon.runtime.decode_state import IDLE, RUNNING, slot_insert
from pantheon.runtime.engine import Chunk, StepPlan
from pantheon.types import GREEDY, MAX_TOP_LOGPROBS, SamplingParams


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _first_step(m, prompt, slot=0, **kw):
    """Insert a greedy request into `slot` and run its whole prompt as one chunk: (packed, logprobs,
    top ids, logits, state)."""
    state = m.insert(m.new_state(), slot_insert(slot, prompt, 0, kw.pop("params", GREEDY), 8, (), **kw))
    h, state = m.step(state, StepPlan(chunk=Chunk(slot, tuple(prompt), 0, True)), want_logits=True)
    lp, ids = m.read_logprobs(h)
    return m.read(h), lp, ids, np.asarray(h.logits)[:1], state


def test_greedy_token_logprob_is_the_top_logprob_and_matches_log_softmax_of_the_logits():
    _, j, _ = tiny_fixture("llama")
    m, prompt = tiny_model("llama"), j["prompt_ids"][:12]
    packed, lp, ids, logits, _ = _first_step(m, prompt, logprobs=True)
    want = _log_softmax(logits[0])
    tok = int(packed[0, 0])
    assert tok == int(np.argmax(logits[0]))
    assert lp[0, 0] == lp[0, 1]  # the greedy token's logprob is the largest one
    assert int(ids[0, 0]) == tok
    np.testing.assert_allclose(lp[0, 0], want[tok], atol=1e-5)
    order = np.argsort(-want, kind="stable")[:MAX_TOP_LOGPROBS]
    np.testing.assert_allclose(lp[0, 1:], want[order], atol=1e-5)
    assert np.all(np.diff(lp[0, 1:]) <= 0)


def test_rows_that_ask_no_logprobs_get_zeros_and_the_same_tokens():
    _, j, _ = tiny_fixture("llama")
    m, prompt = tiny_model("llama"), j["prompt_ids"][:12]
    with_lp = _first_step(m, prompt, logprobs=True)
    without = _first_step(m, prompt)
    assert with_lp[0].tolist() == without[0].tolist()
    assert not without[1].any() and not without[2].any()


def test_logit_bias_minus_100_bans_the_greedy_token_and_plus_100_forces_another():
    _, j, _ = tiny_fixture("llama")
    m, prompt = tiny_model("llama"), j["prompt_ids"][:12]
    packed, _, _, logits, _ = _first_step(m, prompt)
    greedy = int(packed[0, 0])
    second = int(np.argsort(-logits[0], kind="stable")[1])
    banned = _first_step(m, prompt, logit_bias=[(greedy, -100.0)])[0]
    assert int(banned[0, 0]) == second
    rare = int(np.argmin(logits[0]))
    forced = _first_step(m, prompt, logit_bias=[(rare, 100.0)])[0]
    assert int(forced[0, 0]) == rare
    # the logprobs are those of the biased distribution
    _, lp, ids, _, _ = _first_step(m, prompt, logit_bias=[(rare, 100.0)], logprobs=True)
    assert int(ids[0, 0]) == rare and lp[0, 0] == lp[0, 1]


def test_a_grammar_mask_limits_the_draw_and_is_built_while_the_forward_runs():
    _, j, _ = tiny_fixture("llama")
    m, prompt = tiny_model("llama"), j["prompt_ids"][:12]
    packed, _, _, logits, _ = _first_step(m, prompt)
    allowed = [int(t) for t in np.argsort(logits[0], kind="stable")[:3]]  # the three least likely tokens
    words = np.zeros((1, m.mask_words), np.int32)
    for t in allowed:
        words[0, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
    for params in (GREEDY, SamplingParams(temperature=1.0, seed=3).resolved()):
        state = m.insert(m.new_state(), slot_insert(0, prompt, 0, params, 8, (), logprobs=True))
        # the two phases: the forward is dispatched, the host builds the mask meanwhile, then the sampler
        fwd, state = m.forward(state, StepPlan(chunk=Chunk(0, tuple(prompt), 0, True)))
        h, state = m.sample(state, fwd, words)
        tok = int(m.read(h)[0, 0])
        assert tok in allowed
        lp, ids = m.read_logprobs(h)
        assert set(int(i) for i in ids[0, :3]) == set(allowed)  # masked tokens have -inf logprob
        assert np.isneginf(lp[0, 4])


def test_forked_choices_decode_like_the_prompt_prefilled_in_their_own_slot():
    """A choice forked from another slot's cache (prompt but its last token) and started at the last
    token gives, greedily, the tokens of a request prefilled normally."""
    _, j, _ = tiny_fixture("llama")
    m, prompt = tiny_model("llama"), j["prompt_ids"][:12]
    packed, _, _, _, state = _first_step(m, prompt)
    normal = [int(packed[0, 0])]
    for _ in range(3):
        h, state = m.step(state, StepPlan(decode=(0,), reach=len(prompt) + 4))
        normal.append(int(m.read(h)[0, 0]))

    state = m.new_state()
    state = m.insert(state, slot_insert(0, prompt, 0, GREEDY, 8, ()))
    h, state = m.step(state, StepPlan(chunk=Chunk(0, tuple(prompt[:-1]), 0, False)))
    assert m.read(h)[0, 1] == IDLE
    state = m.copy_slot(state, 0, 1)
    for s in (0, 1):
        state = m.insert(state, slot_insert(s, prompt, len(prompt) - 1, GREEDY, 8, (), last=prompt[-1]))
    got = {0: [], 1: []}
    for _ in range(4):
        h, state = m.step(state, StepPlan(decode=(0, 1), reach=len(prompt) + 4))
        for s, (tok, flag) in zip((0, 1), m.read(h).tolist()):
            assert flag == RUNNING
            got[s].append(tok)
    assert got[0] == normal and got[1] == normal


def test_prompt_logprobs_are_the_teacher_forced_log_softmax_of_the_prompt():
    _, j, _ = tiny_fixture("llama")
    m, prompt = tiny_model("llama"), j["prompt_ids"][:20]
    state = m.new_state()
    got, state = m.prompt_logprobs(state, prompt, 3)
    parts = []
    for i in range(0, len(prompt), m.chunk):  # the reference, chunk by chunk into slot 0
        every, state = m.forward_rows(state, [prompt[i:i + m.chunk]], [0], [i], all_logits=True)
        parts.append(every[0][: len(prompt[i:i + m.chunk])])
    want = _log_softmax(np.concatenate(parts))
    assert len(prompt) > m.chunk  # the prompt takes more than one chunk
    assert got[0] is None and len(got) == len(prompt)
    for i in range(1, len(prompt)):
        lp, top = got[i]
        np.testing.assert_allclose(lp, want[i - 1, prompt[i]], atol=1e-4)
        assert len(top) == 3 and top[0][0] == int(np.argmax(want[i - 1]))
        np.testing.assert_allclose(top[0][1], want[i - 1].max(), atol=1e-4)
