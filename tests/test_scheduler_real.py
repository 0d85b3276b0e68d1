"""Real models under the batch scheduler: 8 concurrent greedy streams equal their single-request outputs."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import Collector, real_fixture
from pantheon.config import Settings
from pantheon.runtime.sampler import SamplingParams
from pantheon.scheduler import GenRequest
from pantheon.scheduler.batch import BatchScheduler
from pantheon.runtime import reference

GREEDY = SamplingParams(temperature=0.0)
QUESTIONS = ["What is the capital of France?", "Name three primary colours.", "Write a haiku about rain.",
             "What is 12 times 12?", "Say hello in Spanish.", "Explain gravity in one sentence.",
             "List two fruits.", "What day comes after Monday?"]


def chat_prompt(model, question: str) -> list[int]:
    text = model.card.template.render([{"role": "user", "content": question}], add_generation_prompt=True)
    return model.tokenizer.encode(text)


@pytest.mark.real
@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_eight_concurrent_greedy_streams_equal_single_requests(name, load_real):
    model = load_real(name)
    stops = frozenset(real_fixture(name)["stop_ids"])
    prompts = [chat_prompt(model, q) for q in QUESTIONS]
    n = 16
    alone = [list(reference.generate(model, p, GREEDY, max_tokens=n, stop_ids=stops)) for p in prompts]
    sched = BatchScheduler(model, Settings(home=Path("/tmp"), prefill_chunk=128), warmup=False)
    try:
        cs = []
        for p in prompts:
            c = Collector()
            sched.submit(GenRequest(prompt_ids=p, params=GREEDY, max_tokens=n, stop_ids=stops), c)
            cs.append(c)
        for c in cs:
            assert c.done.wait(600)
        assert [c.ids for c in cs] == alone
        text = model.tokenizer.decode(cs[0].ids)
        assert text.strip(), "the model produced no text"
        info = sched.load_info()
        assert info["completed"] == 8 and info["decode_steps"] < 8 * n  # rows really shared steps
    finally:
        sched.close()
