"""The engine's verbs (insert / step / release over a donated decode state) and the scheduler's loud
failure: what a request's data does on the device, what crosses the seam each step, and what a failed
step or a failed admission leaves behind."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import Collector, tiny_fixture, tiny_model, wait_until
from pantheon.runtime import engine
from pantheon.config import Settings
from pantheon.runtime.decode_state import IDLE, LENGTH, RUNNING, STOP, slot_insert
from pantheon.runtime.engine import Chunk, StepPlan
from pantheon.errors import ModelFailed
from pantheon.types import GREEDY, GenRequest, SamplingParams
from pantheon.scheduler.batch import BatchScheduler


def _prefill(m, state, slot, prompt):
    """Feed `prompt` into `slot` chunk by chunk; returns (the last step's packed rows, state)."""
    for i in range(0, len(prompt), m.chunk):
        part = tuple(prompt[i: i + m.chunk])
        h, state = m.step(state, StepPlan(chunk=Chunk(slot, part, i, i + m.chunk >= len(prompt))))
    return m.read(h), state


# ---- the verbs, on the engine directly ---------------------------------------------------------------
def test_insert_then_steps_generate_the_oracle_and_stop_on_the_budget():
    _, j, _ = tiny_fixture("llama")
    m, prompt, want = tiny_model("llama"), j["prompt_ids"], j["greedy_ids"]
    state = m.insert(m.new_state(), slot_insert(0, prompt, 0, GREEDY, 3, ()))
    out, state = _prefill(m, state, 0, prompt)
    assert out.tolist() == [[want[0], RUNNING]]
    got = []
    for _ in range(2):  # decode rows take their token and position from the state
        h, state = m.step(state, StepPlan(decode=(0,), reach=len(prompt) + 3))
        got.append(m.read(h)[0].tolist())
    assert got == [[want[1], RUNNING], [want[2], LENGTH]]
    h, state = m.step(state, StepPlan(decode=(0,), reach=len(prompt) + 4))  # a finished slot's row is dead
    assert int(m.read(h)[0, 1]) == IDLE
    assert int(np.asarray(state.slots.pos)[0]) == len(prompt) + 2  # the dead row moved nothing


def test_a_stop_id_finishes_the_slot_inside_the_step():
    _, j, _ = tiny_fixture("llama")
    m, prompt, want = tiny_model("llama"), j["prompt_ids"], j["greedy_ids"]
    state = m.insert(m.new_state(), slot_insert(1, prompt, 0, GREEDY, 50, (want[2], 10_000)))
    out, state = _prefill(m, state, 1, prompt)
    flags = [int(out[0, 1])]
    for _ in range(2):
        h, state = m.step(state, StepPlan(decode=(1,), reach=len(prompt) + 3))
        flags.append(int(m.read(h)[0, 1]))
    assert flags == [RUNNING, RUNNING, STOP]


def test_release_sends_a_slots_rows_to_scratch_and_leaves_the_others_alone():
    _, j, _ = tiny_fixture("llama")
    m, prompt, want = tiny_model("llama"), j["prompt_ids"], j["greedy_ids"]
    state = m.new_state()
    for s in (0, 1):
        state = m.insert(state, slot_insert(s, prompt, 0, GREEDY, 50, ()))
        _, state = _prefill(m, state, s, prompt)
    state = m.release(state, 1)
    h, state = m.step(state, StepPlan(decode=(1, 0), reach=len(prompt) + 1))
    out = m.read(h)
    assert int(out[0, 1]) == IDLE and out[1].tolist() == [want[1], RUNNING]
    assert np.asarray(state.slots.pos)[:2].tolist() == [len(prompt) + 1, len(prompt)]


def test_a_steps_host_input_carries_no_per_request_parameters():
    """Whatever the requests' knobs, seeds, stop ids and budgets, a decode step hands the device only
    slot indices (and a chunk's tokens): the same host arrays for two very different requests."""
    _, j, _ = tiny_fixture("llama")
    m, prompt = tiny_model("llama"), j["prompt_ids"][:8]
    seen: list[tuple] = []
    real = m._serve

    def spy(params, cache, table, *host, **static):
        seen.append((host, static))
        return real(params, cache, table, *host, **static)

    knobs = [SamplingParams(temperature=0.0, seed=1), SamplingParams(temperature=0.9, top_k=7, top_p=0.8,
                                                                     repetition_penalty=1.3, seed=99)]
    m._serve = spy
    try:
        for prm, stops, budget in zip(knobs, [(), (5, 6)], [4, 40]):
            state = m.insert(m.new_state(), slot_insert(0, prompt, 0, prm.resolved(), budget, stops))
            _, state = _prefill(m, state, 0, prompt)
            h, state = m.step(state, StepPlan(decode=(0,), reach=len(prompt) + 1))
            m.read(h)
    finally:
        m._serve = real
    decode = [(host, static) for host, static in seen if static["kind"] == "decode"]
    assert len(decode) == 2
    (a, sa), (b, sb) = decode
    assert sa == sb
    assert all(x.dtype == np.int32 for x in a)  # token ids and slot indices only: no float knob, no seed
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert a[2].tolist() == [0]  # the decoding slot


def test_the_web_package_and_the_request_types_import_no_jax():
    code = ("import sys; import pantheon.types, pantheon.scheduler.api, pantheon.web, pantheon.web.chat, "
            "pantheon.web.routes, pantheon.web.admin, pantheon.web.worker, pantheon.web.launch; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax')); "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0, r.stdout + r.stderr


# ---- loud failure ---------------------------------------------------------------------------------------
class Faulty:
    """A model whose `step` or `insert` raises once when armed; everything else is the real model."""

    def __init__(self, model, fail: str):
        self._m = model
        self.fail = fail
        self.armed = False

    def __getattr__(self, name):
        return getattr(self._m, name)

    def forward(self, *a, **kw):
        if self.armed and self.fail == "step":
            self.armed = False
            raise RuntimeError("injected step failure")
        return self._m.forward(*a, **kw)

    def insert(self, *a, **kw):
        if self.armed and self.fail == "insert":
            self.armed = False
            raise RuntimeError("injected admission failure")
        return self._m.insert(*a, **kw)


def _settings(**kw) -> Settings:
    return Settings(**{"home": Path("/tmp"), "batch_slots": 2, "prefill_chunk": 16, **kw})


@pytest.fixture(scope="module")
def model():
    path, _, _ = tiny_fixture("llama")
    return engine.load(path, engine.LoadOptions(n_slots=2, max_seq=96, prefill_chunk=16))


def _submit(s, prompt, n=6) -> Collector:
    c = Collector()
    s.submit(GenRequest(prompt_ids=list(prompt), params=GREEDY, max_tokens=n), c)
    return c


def test_a_failed_step_fails_its_requests_and_forgets_every_slots_history(model):
    _, j, _ = tiny_fixture("llama")
    prompt = j["prompt_ids"][:20]
    fm = Faulty(model, "step")
    s = BatchScheduler(fm, _settings(), warmup=False)
    try:
        first = _submit(s, prompt)
        assert first.done.wait(60) and first.finished.reason == "length"
        fm.armed = True
        failed = _submit(s, prompt + [3, 4])
        assert failed.done.wait(60)
        assert failed.finished.reason == "error" and "injected step failure" in str(failed.finished.error)
        # the state was rebuilt: no slot may claim the cached prefix any more, and serving goes on
        again = _submit(s, prompt)
        assert again.done.wait(60) and again.started.reused_tokens == 0
        assert again.ids == first.ids
        assert s.failure is None and s.load_info()["failed"] == 1
    finally:
        s.close()


def test_a_failed_admission_fails_everything_and_marks_the_model_failed(model):
    _, j, _ = tiny_fixture("llama")
    prompt = j["prompt_ids"][:20]
    fm = Faulty(model, "insert")
    s = BatchScheduler(fm, _settings(batch_slots=1, queue_wait_s=60.0), warmup=False)
    try:
        running = _submit(s, prompt, n=400)
        wait_until(lambda: len(running.ids) >= 1, 60, "the first request's first token")
        fm.armed = True
        queued = _submit(s, prompt + [5])  # its admission raises once the slot frees
        assert running.done.wait(120) and queued.done.wait(60)
        assert queued.finished.reason == "error" and isinstance(queued.finished.error, ModelFailed)
        assert queued.finished.error.status == 500
        assert "injected admission failure" in s.failure
        with pytest.raises(ModelFailed) as exc:
            _submit(s, prompt)
        assert exc.value.status == 503 and "injected admission failure" in str(exc.value)
    finally:
        s.close()


def test_a_failed_driver_turns_health_503_naming_the_model_until_unloaded(model):
    """Through the registry and the app: GET / answers 503 naming the failed instance; chat gets 503;
    after an admin unload the server is healthy again, and the model loads and serves again."""
    from pantheon.serving.registry import Registry
    from pantheon.web import create_app

    _, j, _ = tiny_fixture("llama")
    fm = Faulty(model, "insert")
    fm.free = lambda: None  # the module's model is shared with other tests: unload must not free it
    settings = _settings(admin_key="k", batch_slots=1)
    reg = Registry(settings, load_model=lambda path, name, dies, st: fm,
                   make_backend=lambda m, st: BatchScheduler(m, st, warmup=False),
                   devices=lambda st: [{"die": 0, "platform": "cpu", "kind": "cpu", "budget_bytes": 1 << 40}],
                   estimate=lambda path, st, platform: 1000)
    app = create_app(settings, registry=reg, exit_on_failure=False)
    app.extensions["pantheon"].startup.join(30)
    client = app.test_client()
    reg.load("tiny.gguf", "tiny", None, resolve=lambda src: Path(src))
    assert client.get("/").status_code == 200
    fm.armed = True
    c = Collector()
    entry = reg.acquire("tiny")
    try:
        entry.backend.submit(GenRequest(prompt_ids=j["prompt_ids"][:8], params=GREEDY, max_tokens=2), c)
    finally:
        reg.release(entry)
    assert c.done.wait(60) and c.finished.reason == "error"
    r = client.get("/")
    assert r.status_code == 503 and r.json["status"] == "failed" and "injected admission failure" in r.json["error"]
    assert "tiny" in r.json["error"]
    chat = client.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]})
    assert chat.status_code == 503 and chat.json["error"]["code"] == "model_failed"
    un = client.post("/admin/models/unload", json={"name": "tiny"}, headers={"Authorization": "Bearer k"})
    assert un.status_code == 200
    assert client.get("/").status_code == 200
    reg.load("tiny.gguf", "tiny", None, resolve=lambda src: Path(src))  # and it can be loaded again
    again = client.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 2,
                                                       "messages": [{"role": "user", "content": "x"}]})
    assert again.status_code == 200 and again.json["usage"]["completion_tokens"] == 2
    reg.unload("tiny")
