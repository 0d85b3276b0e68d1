"""POST /v1/embeddings: pooling and normalisation, the request's validation, the scheduler's batching of
embedding inputs between generation steps, and the real default model (alone == batched, chunked ==
one pass, an embedding does not disturb a generation).

Scheduling and the HTTP shapes run on a fake engine whose "hidden state" of token t at position p is a
fixed random vector f(t, p): the expected embedding of any input is known without running a model, so
a chunk fed at the wrong start, into the wrong slot or pooled wrongly shows up as a wrong vector.
"""

from __future__ import annotations

import base64
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from conftest import Collector, tiny_model, wait_until
from fake_engine import FakeModel
from pantheon.config import Settings, load_settings
from pantheon.errors import BusyError, RequestError
from pantheon.types import EmbedRequest, Embedded, Finished, GenRequest, ModelCard, SamplingParams, Tokens
from pantheon.runtime.pooling import EmbedRun, normalize
from pantheon.web.embeddings import encode_vector, parse_embeddings_request

D = 16
GREEDY = SamplingParams(temperature=0.0)


# ---- the fake engine -------------------------------------------------------------------------------
def feature(token: int, pos: int) -> np.ndarray:
    """The fake model's final hidden state of `token` at position `pos`."""
    return np.random.default_rng(token * 100003 + pos).standard_normal(D)


def expected(ids: list[int], pooling: str = "mean") -> np.ndarray:
    if pooling == "last":
        return normalize(feature(ids[-1], len(ids) - 1))
    return normalize(np.mean([feature(t, p) for p, t in enumerate(ids)], axis=0))


class CharTokenizer:
    """One token per character (what the web layer's fake needs of a tokenizer); records what it encoded."""

    add_bos, bos_id, vocab_size = False, None, 0x110000
    eot_ids = frozenset({0})

    def __init__(self) -> None:
        self.encoded: list[str] = []

    def encode(self, text: str, add_special: bool = False) -> list[int]:
        self.encoded.append(text)
        return [ord(c) for c in text]


class EmbedFake(FakeModel):
    """fake_engine's model plus `embed`: a row's chunk overwrites the slot's history from its start (as
    a cache would be), so a prefix reused from it afterwards would change the generated tokens."""

    def __init__(self, n_slots: int = 4, chunk: int = 8, max_seq: int = 64, name: str = "fake"):
        super().__init__(n_slots=n_slots, chunk=chunk, max_seq=max_seq, name=name)
        self.calls: list[tuple[list[list[int]], list[int], list[int]]] = []
        self.fail: Exception | None = None
        self.config = SimpleNamespace(hidden=D)
        self.weight_bytes = 1000
        self.card = ModelCard(name=name, path="", arch="fake", context_length=max_seq, n_slots=n_slots,
                              tokenizer=CharTokenizer(), template=None)
        self.log: list[tuple[str, Any]] = []  # ("step", plan) and ("embed", tokens fed), in the driver's order
        self.on_embed: Callable[[int], None] | None = None  # called with the call's number (1, 2, ...) first

    def forward(self, state, plan):
        out = super().forward(state, plan)
        self.log.append(("step", plan))
        return out

    def embed(self, state, rows, slots, starts, pooling="mean"):
        if self.on_embed is not None:
            self.on_embed(len(self.calls) + 1)
        if self.fail is not None:
            raise self.fail
        kinds = [pooling] * len(rows) if isinstance(pooling, str) else list(pooling)
        assert len(set(slots)) == len(slots) and all(len(r) <= self.chunk for r in rows)
        self.calls.append(([list(r) for r in rows], list(slots), list(starts)))
        self.log.append(("embed", sum(len(r) for r in rows)))
        out = []
        for toks, s, start, kind in zip(rows, slots, starts, kinds):
            state[s].hist = state[s].hist[:start] + list(toks)
            vecs = [feature(t, start + i) for i, t in enumerate(toks)]
            out.append(np.sum(vecs, axis=0) if kind == "mean" else vecs[-1])
        return np.asarray(out, np.float32), state


def sched_settings(**kw) -> Settings:
    base = dict(home=Path("/tmp"), batch_slots=4, queue_depth=4, queue_wait_s=30.0, prefill_chunk=8)
    base.update(kw)
    return Settings(**base)


@pytest.fixture()
def fake():
    return EmbedFake()


@pytest.fixture()
def sched(fake):
    from pantheon.scheduler.batch import BatchScheduler
    s = BatchScheduler(fake, sched_settings(), warmup=False)
    yield s
    s.close()


class EmbedCollector(Collector):
    def __call__(self, ev) -> None:
        self.events.append(ev)
        if isinstance(ev, (Embedded, Finished)):
            self.done.set()

    @property
    def result(self):
        assert self.done.wait(30), "no result within 30 s"
        return self.events[-1]


def submit_embed(sched, inputs, pooling="mean") -> EmbedCollector:
    c = EmbedCollector()
    sched.submit_embed(EmbedRequest(inputs=inputs, pooling=pooling), c)
    return c


# ---- pooling on the host ---------------------------------------------------------------------------
def test_mean_over_chunks_is_the_mean_over_the_tokens():
    ids = list(range(1, 21))
    run = EmbedRun(ids, "mean")
    while not run.done:
        part, start = run.next_chunk(6)
        run.add(len(part), np.sum([feature(t, start + i) for i, t in enumerate(part)], axis=0))
    np.testing.assert_allclose(run.vector(), expected(ids), atol=1e-6)


def test_last_pooling_takes_the_last_token_of_the_last_chunk():
    ids = list(range(5, 18))
    run = EmbedRun(ids, "last")
    while not run.done:
        part, start = run.next_chunk(4)
        run.add(len(part), feature(part[-1], start + len(part) - 1))
    np.testing.assert_allclose(run.vector(), expected(ids, "last"), atol=1e-6)


def test_normalize_gives_unit_rows_and_keeps_zero():
    v = normalize(np.array([[3.0, 4.0], [0.0, 0.0]]))
    assert v.dtype == np.float32
    np.testing.assert_allclose(v, [[0.6, 0.8], [0.0, 0.0]])


def test_an_unfinished_run_has_no_vector_and_bad_runs_are_refused():
    with pytest.raises(ValueError):
        EmbedRun([1, 2], "mean").vector()
    with pytest.raises(ValueError):
        EmbedRun([], "mean")
    with pytest.raises(ValueError):
        EmbedRun([1], "max")
    with pytest.raises(ValueError):
        EmbedRequest(inputs=[])
    with pytest.raises(ValueError):
        EmbedRequest(inputs=[[1], []])
    assert EmbedRequest(inputs=[[1, 2], [3]]).prompt_tokens == 3


def test_base64_is_little_endian_float32_and_round_trips():
    v = normalize(np.arange(1, 9, dtype=np.float64))
    text = encode_vector(v, "base64")
    back = np.frombuffer(base64.b64decode(text), dtype="<f4")
    assert back.tolist() == v.tolist()
    assert encode_vector(v, "float") == v.tolist()


# ---- validation --------------------------------------------------------------------------------------
@pytest.mark.parametrize("raw,texts,tokens", [
    ("hi", ["hi"], None),
    (["a", "b"], ["a", "b"], None),
    ([1, 2, 3], None, [[1, 2, 3]]),
    ([[1, 2], [3]], None, [[1, 2], [3]]),
])
def test_every_openai_input_shape_is_accepted(raw, texts, tokens):
    req = parse_embeddings_request({"input": raw, "model": "m", "user": "u"})
    assert (req.texts, req.token_inputs, req.encoding_format, req.pooling) == (texts, tokens, "float", "mean")


@pytest.mark.parametrize("body,param", [
    ({}, "input"),
    ({"input": ""}, "input[0]"),
    ({"input": []}, "input"),
    ({"input": [[]]}, "input[0]"),
    ({"input": ["a", ""]}, "input[1]"),
    ({"input": ["a", [1]]}, "input"),
    ({"input": [[1, -2]]}, "input[0]"),
    ({"input": [[1, True]]}, "input[0]"),
    ({"input": 5}, "input"),
    ({"input": ["x"] * 2049}, "input"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": "x", "dimensions": "8"}, "dimensions"),
    ({"input": "x", "pooling": "max"}, "pooling"),
    ({"input": "x", "model": 3}, "model"),
    ({"input": "x", "temperature": 1}, "temperature"),
])
def test_invalid_bodies_are_400_naming_the_field(body, param):
    with pytest.raises(RequestError) as err:
        parse_embeddings_request(body)
    assert err.value.status == 400 and err.value.param == param


def test_2048_inputs_are_allowed():
    assert parse_embeddings_request({"input": ["x"] * 2048}).count == 2048


# ---- the scheduler (fake engine) ----------------------------------------------------------------------
def test_inputs_of_several_jobs_share_one_call(fake, sched):
    fake.gate = threading.Event()  # hold the driver inside a generation step while both jobs queue
    gen = Collector()
    sched.submit(GenRequest(prompt_ids=[1, 2, 3], params=GREEDY, max_tokens=2), gen)
    wait_until(lambda: sched.load_info()["running"] == 1, 10, "the generation to be admitted")  # next: its step
    a = submit_embed(sched, [[10, 11], [12]])
    b = submit_embed(sched, [[13, 14, 15]], pooling="last")
    fake.gate.set()
    ra, rb = a.result, b.result
    assert isinstance(ra, Embedded) and isinstance(rb, Embedded)
    np.testing.assert_allclose(ra.vectors, [expected([10, 11]), expected([12])], atol=1e-6)
    np.testing.assert_allclose(rb.vectors, [expected([13, 14, 15], "last")], atol=1e-6)
    assert ra.prompt_tokens == 3 and rb.prompt_tokens == 3
    assert [len(rows) for rows, _, _ in fake.calls] == [3]  # both jobs' inputs in one call
    assert gen.done.wait(10) and gen.finished.reason == "length"


def test_a_long_input_is_fed_in_chunks_into_one_slot(fake, sched):
    ids = list(range(100, 130))  # 30 tokens, chunks of 8
    r = submit_embed(sched, [ids]).result
    np.testing.assert_allclose(r.vectors[0], expected(ids), atol=1e-6)
    assert [starts for _, _, starts in fake.calls] == [[0], [8], [16], [24]]
    assert len({tuple(slots) for _, slots, _ in fake.calls}) == 1


def test_more_inputs_than_slots_run_in_waves_in_input_order(fake, sched):
    inputs = [[i, i + 1] for i in range(1, 11)]  # 10 inputs, 4 slots
    r = submit_embed(sched, inputs).result
    np.testing.assert_allclose(r.vectors, [expected(x) for x in inputs], atol=1e-6)
    assert max(len(rows) for rows, _, _ in fake.calls) == 4


def test_a_slot_used_for_an_embedding_is_not_reused_as_a_prefix():
    from pantheon.scheduler.batch import BatchScheduler
    fake = EmbedFake(n_slots=1)
    s = BatchScheduler(fake, sched_settings(batch_slots=1), warmup=False)
    try:
        prompt = [5, 6, 7, 8, 9]
        first = Collector()
        s.submit(GenRequest(prompt_ids=prompt, params=GREEDY, max_tokens=4), first)
        assert first.done.wait(10)
        assert isinstance(submit_embed(s, [prompt[:3] + [42, 43]]).result, Embedded)  # overwrites the slot
        again = Collector()
        s.submit(GenRequest(prompt_ids=prompt, params=GREEDY, max_tokens=4), again)
        assert again.done.wait(10)
        assert again.started.reused_tokens == 0
        assert again.ids == first.ids == fake.generate_alone(prompt, 4)
    finally:
        s.close()


def test_generation_and_embeddings_interleave_without_disturbing_each_other(fake, sched):
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [2, 7, 1, 8]]
    gens = []
    for p in prompts:
        c = Collector()
        sched.submit(GenRequest(prompt_ids=p, params=GREEDY, max_tokens=12), c)
        gens.append(c)
    embeds = [submit_embed(sched, [list(range(200 + i, 220 + i))]) for i in range(3)]
    for i, e in enumerate(embeds):
        np.testing.assert_allclose(e.result.vectors[0], expected(list(range(200 + i, 220 + i))), atol=1e-6)
    for p, c in zip(prompts, gens):
        assert c.done.wait(10) and c.ids == fake.generate_alone(p, 12)


def choice_ids(c: Collector, choice: int) -> list[int]:
    return [i for ev in c.events if isinstance(ev, Tokens) and ev.choice == choice for i in ev.ids]


@pytest.mark.parametrize("n", [1, 2])
def test_a_chat_arriving_while_embeddings_hold_every_slot_waits_at_most_one_embed_call(fake, sched, n):
    """Every slot holds an input of a large request (eight chunks each) when a chat (n choices) arrives:
    it takes slots back at the next driver iteration, after at most one more embed call, instead of
    waiting for the inputs' remaining chunks (issue 31: chats timed out behind one embeddings request).
    The inputs it took start over, so every vector is still exact."""
    inputs = [list(range(100 + 60 * k, 160 + 60 * k)) for k in range(8)]  # 60 tokens: 8 chunks of 8
    inside, release = threading.Event(), threading.Event()

    def hold(call: int) -> None:
        if call == 2:  # the driver is inside the request's second call: every slot is an input's
            inside.set()
            assert release.wait(30)

    fake.on_embed = hold
    big = submit_embed(sched, inputs)
    assert inside.wait(10)
    assert sched.load_info()["running"] == 4
    chat = Collector()
    sched.submit(GenRequest(prompt_ids=[1, 2, 3], params=GREEDY, max_tokens=3, n=n), chat)
    release.set()
    assert chat.done.wait(10)
    for c in range(n):
        assert choice_ids(chat, c) == fake.generate_alone([1, 2, 3], 3)
    np.testing.assert_allclose(big.result.vectors, [expected(x) for x in inputs], atol=1e-6)
    embeds = [i for i, (kind, _) in enumerate(fake.log) if kind == "embed"]
    first_step = next(i for i, (kind, _) in enumerate(fake.log) if kind == "step")  # the chat's prompt
    assert sum(1 for i in embeds if embeds[1] < i < first_step) <= 1


def test_a_running_stream_decodes_every_step_behind_at_most_one_chunk_of_embedding_work(fake, sched):
    """While a chat streams, each embed call feeds at most one prefill chunk's worth of tokens (here
    8), so a decode step never waits behind more embedding work than behind a long prompt's chunk;
    the embeddings still make progress between the chat's steps and finish exact."""
    fake.gate = threading.Event()  # hold the driver in the chat's first step while the embeddings queue
    prompt = [7, 8, 9, 10]
    chat = Collector()
    sched.submit(GenRequest(prompt_ids=prompt, params=GREEDY, max_tokens=40), chat)
    wait_until(lambda: sched.load_info()["running"] == 1, 10, "the chat to be admitted")
    inputs = [list(range(300 + 40 * k, 340 + 40 * k)) for k in range(6)]  # 40 tokens: 5 chunks of 8
    big = submit_embed(sched, inputs)
    fake.gate.set()
    assert chat.done.wait(10) and chat.ids == fake.generate_alone(prompt, 40)
    np.testing.assert_allclose(big.result.vectors, [expected(x) for x in inputs], atol=1e-6)
    steps = [i for i, (kind, _) in enumerate(fake.log) if kind == "step"]
    plans = [fake.log[i][1] for i in steps]
    slot = plans[0].chunk.slot
    assert all(p.decode == (slot,) and p.chunk is None for p in plans[1:])  # a token every step
    between = [sum(x for kind, x in fake.log[a + 1:b] if kind == "embed") for a, b in zip(steps, steps[1:])]
    assert max(between) <= fake.chunk, between
    assert sum(between) > 0  # embedding work ran while the chat streamed


def test_a_full_queue_is_429_and_a_busy_single_user_model_refuses_at_once(fake):
    from pantheon.scheduler.batch import BatchScheduler
    fake.gate = threading.Event()
    s = BatchScheduler(fake, sched_settings(batch_slots=1, queue_depth=1), warmup=False)
    try:
        gen = Collector()
        s.submit(GenRequest(prompt_ids=[1, 2], params=GREEDY, max_tokens=3), gen)
        wait_until(lambda: s.load_info()["running"] == 1, 10, "the generation to hold the slot")
        waiting = submit_embed(s, [[1]])
        with pytest.raises(BusyError) as err:
            s.submit_embed(EmbedRequest(inputs=[[2]]), EmbedCollector())
        assert err.value.status == 429 and err.value.retry_after == 5
        fake.gate.set()
        assert isinstance(waiting.result, Embedded)
    finally:
        fake.gate.set()
        s.close()
    single = EmbedFake()
    single.gate = threading.Event()
    s = BatchScheduler(single, sched_settings(batch_slots=0), warmup=False)
    try:
        s.submit(GenRequest(prompt_ids=[1, 2], params=GREEDY, max_tokens=3), Collector())
        wait_until(lambda: s.load_info()["running"] == 1, 10, "the generation to hold the slot")
        with pytest.raises(BusyError) as err:
            s.submit_embed(EmbedRequest(inputs=[[2]]), EmbedCollector())
        assert err.value.status == 429 and err.value.retry_after == 1
    finally:
        single.gate.set()
        s.close()


def test_an_input_longer_than_the_context_is_refused(sched):
    with pytest.raises(RequestError) as err:
        sched.submit_embed(EmbedRequest(inputs=[[1] * 65]), EmbedCollector())
    assert err.value.code == "context_length_exceeded"


def test_a_cancelled_job_gives_its_slots_back(fake, sched):
    fake.gate = threading.Event()
    gen = Collector()
    sched.submit(GenRequest(prompt_ids=[1, 2], params=GREEDY, max_tokens=2), gen)
    c = EmbedCollector()
    handle = sched.submit_embed(EmbedRequest(inputs=[list(range(1, 60))] * 3), c)
    handle.cancel()
    fake.gate.set()
    assert isinstance(c.result, Finished) and c.result.reason == "cancelled"
    wait_until(lambda: sched.load_info()["running"] == 0, 10, "the slots to go back")
    assert isinstance(submit_embed(sched, [[1, 2]]).result, Embedded)


def test_a_refused_embed_call_fails_only_the_embeddings(fake, sched):
    fake.fail = ValueError("no such bucket")
    r = submit_embed(sched, [[1, 2, 3]]).result
    assert isinstance(r, Finished) and r.reason == "error" and "bucket" in str(r.error)
    fake.fail = None
    gen = Collector()
    sched.submit(GenRequest(prompt_ids=[4, 5], params=GREEDY, max_tokens=3), gen)
    assert gen.done.wait(10) and gen.ids == fake.generate_alone([4, 5], 3)
    assert sched.failure is None


def test_a_device_failure_in_an_embed_call_fails_like_a_step(fake, sched):
    fake.fail = RuntimeError("device lost")
    r = submit_embed(sched, [[1, 2, 3]]).result
    assert isinstance(r, Finished) and r.reason == "error"
    fake.fail = None
    assert isinstance(submit_embed(sched, [[1, 2, 3]]).result, Embedded)  # the state was rebuilt, it serves on
    assert sched.failure is None


def test_shutdown_fails_queued_embeddings(fake):
    from pantheon.scheduler.batch import BatchScheduler
    fake.gate = threading.Event()
    s = BatchScheduler(fake, sched_settings(batch_slots=1), warmup=False)
    s.submit(GenRequest(prompt_ids=[1, 2], params=GREEDY, max_tokens=50), Collector())
    wait_until(lambda: s.load_info()["running"] == 1, 10, "the generation to hold the slot")
    c = submit_embed(s, [[1]])
    threading.Timer(0.2, fake.gate.set).start()
    s.close()
    assert isinstance(c.result, Finished) and c.result.reason == "error" and c.result.error.status == 503


def test_an_embedding_shape_compiled_after_warm_up_fails_only_its_request():
    """PANTHEON_FORBID_COMPILE=1: embedding programs are not part of warm-up, so a new shape is refused
    before it runs (500 compile_forbidden); the state is intact and the driver goes on."""
    from conftest import tiny_fixture
    from pantheon.runtime import engine
    from pantheon.scheduler.batch import BatchScheduler
    path, _, _ = tiny_fixture("llama")
    m = engine.load(path, engine.LoadOptions(n_slots=2, max_seq=64, prefill_chunk=16, kv_dtype="float32"))
    s = BatchScheduler(m, sched_settings(batch_slots=2, forbid_compile=True), warmup=False)
    try:
        r = submit_embed(s, [[1, 2, 3]]).result
        assert isinstance(r, Finished) and r.reason == "error" and r.error.code == "compile_forbidden"
        wait_until(lambda: s.load_info()["running"] == 0, 10, "the slot to go back")
        assert s.failure is None
    finally:
        s.close()


# ---- the HTTP route (fake engine, Flask test client) --------------------------------------------------
def make_app(tmp_path, **settings_kw):
    from pantheon.scheduler.batch import BatchScheduler
    from test_web_app import registry_app
    (tmp_path / "models").mkdir(exist_ok=True)
    settings = Settings(home=tmp_path, model_dir=(tmp_path / "models").resolve(), batch_slots=4, prefill_chunk=8,
                        **settings_kw)
    return registry_app(settings, lambda p, n, d, s: EmbedFake(name=n), lambda m, s: BatchScheduler(m, s, warmup=False))


@pytest.fixture()
def client(tmp_path):
    app, reg = make_app(tmp_path)
    yield app.test_client()
    reg.close()


def test_route_answers_in_openai_shape(client):
    r = client.post("/v1/embeddings", json={"input": ["hi", "there"], "model": "m"})
    assert r.status_code == 200, r.get_data(as_text=True)
    body = r.get_json()
    assert body["object"] == "list" and body["model"] == "m"
    assert body["usage"] == {"prompt_tokens": 7, "total_tokens": 7}
    assert [d["index"] for d in body["data"]] == [0, 1] and all(d["object"] == "embedding" for d in body["data"])
    np.testing.assert_allclose(body["data"][1]["embedding"], expected([ord(c) for c in "there"]), atol=1e-6)
    assert r.headers["X-Pantheon-Instance"]


def test_route_base64_and_token_inputs_and_last_pooling(client):
    ids = [ord(c) for c in "tokens"]
    r = client.post("/v1/embeddings", json={"input": ids, "encoding_format": "base64", "pooling": "last",
                                            "dimensions": D})
    assert r.status_code == 200, r.get_data(as_text=True)
    (item,) = r.get_json()["data"]
    vec = np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4")
    np.testing.assert_allclose(vec, expected(ids, "last"), atol=1e-6)
    assert client.post("/m/m/v1/embeddings", json={"input": "x"}).status_code == 200
    assert client.post("/m/other/v1/embeddings", json={"input": "x", "model": "m"}).status_code == 404


def test_route_takes_2048_inputs_in_a_large_body(client):
    inputs = [[100000 + 8 * i + j for j in range(8)] for i in range(2048)]  # a body over 64 KiB: parsed off the hub
    r = client.post("/v1/embeddings", json={"input": inputs, "encoding_format": "base64"})
    assert r.status_code == 200, r.get_data(as_text=True)[:300]
    data = r.get_json()["data"]
    assert [d["index"] for d in data] == list(range(2048))
    for i in (0, 777, 2047):
        vec = np.frombuffer(base64.b64decode(data[i]["embedding"]), dtype="<f4")
        np.testing.assert_allclose(vec, expected(inputs[i]), atol=1e-6)


def test_route_encodes_a_large_answer_off_the_hub(client, monkeypatch):
    """An answer of more than BIG_ANSWER_FLOATS floats is built in an OS thread (`pantheon-encode`), a
    vector at a time, so the hub's other streams go on meanwhile (one json.dumps of 2048 x 576 floats
    held the GIL for over a second); a small one is built in place. Both are OpenAI's shape."""
    from pantheon.web import embeddings
    threads: list[str] = []
    real = embeddings.bridge.call_in_thread
    monkeypatch.setattr(embeddings.bridge, "call_in_thread",
                        lambda fn, *a, name="": (threads.append(name), real(fn, *a, name=name))[1])
    monkeypatch.setattr(embeddings, "BIG_ANSWER_FLOATS", 4 * D)
    for inputs, fmt, off_hub in (([[1, 2]] * 4, "float", []), ([[1, 2]] * 5, "float", ["pantheon-encode"]),
                                 ([[3]] * 5, "base64", ["pantheon-encode"])):
        threads.clear()
        r = client.post("/v1/embeddings", json={"input": inputs, "encoding_format": fmt, "model": "m"})
        assert r.status_code == 200 and r.mimetype == "application/json"
        assert threads == off_hub
        body = r.get_json()
        n = sum(map(len, inputs))
        assert (body["object"], body["model"], body["usage"]) == ("list", "m", {"prompt_tokens": n, "total_tokens": n})
        assert [d["index"] for d in body["data"]] == list(range(len(inputs)))
        got = [np.frombuffer(base64.b64decode(d["embedding"]), "<f4") if fmt == "base64" else d["embedding"]
               for d in body["data"]]
        np.testing.assert_allclose(got, [expected(x) for x in inputs], atol=1e-6)


def test_route_400s_share_the_error_shape(client):
    for body, param, code in (({"input": "x", "dimensions": 8}, "dimensions", "invalid_request_error"),
                              ({"input": "x" * 65}, "input", "context_length_exceeded"),
                              ({"input": [[0x110000]]}, "input[0]", "invalid_request_error"),
                              ({"input": []}, "input", "invalid_request_error")):
        r = client.post("/v1/embeddings", json=body)
        assert r.status_code == 400, (body, r.get_data(as_text=True))
        err = r.get_json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert (err["param"], err["code"], err["type"]) == (param, code, "invalid_request_error")


def test_route_refuses_more_tokens_than_the_per_request_budget_naming_it(tmp_path):
    """PANTHEON_EMBED_MAX_TOKENS caps a request's tokens, its inputs summed: at the cap it is served,
    past it a 400 naming both figures; texts stop being tokenized at the input that passes it."""
    from pantheon.scheduler.batch import BatchScheduler
    from test_web_app import registry_app
    assert Settings(home=tmp_path).embed_max_tokens == 65536
    assert load_settings({"PANTHEON_EMBED_MAX_TOKENS": "20"}).embed_max_tokens == 20
    (tmp_path / "models").mkdir()
    settings = Settings(home=tmp_path, model_dir=(tmp_path / "models").resolve(), batch_slots=4, prefill_chunk=8,
                        embed_max_tokens=20)
    model = EmbedFake(name="m")
    app, reg = registry_app(settings, lambda p, n, d, s: model, lambda m, s: BatchScheduler(m, s, warmup=False))
    client = app.test_client()
    try:
        r = client.post("/v1/embeddings", json={"input": ["a" * 10, "b" * 10]})
        assert r.status_code == 200 and r.get_json()["usage"]["prompt_tokens"] == 20
        for body, figure in (({"input": ["a" * 10, "b" * 11]}, "21 tokens"),
                             ({"input": [[5] * 21]}, "21 tokens"),
                             ({"input": ["a" * 15, "b" * 15, "c" * 15, "d" * 15]}, "at least 30 tokens")):
            model.card.tokenizer.encoded.clear()
            r = client.post("/v1/embeddings", json=body)
            assert r.status_code == 400, r.get_data(as_text=True)
            err = r.get_json()["error"]
            assert (err["param"], err["type"]) == ("input", "invalid_request_error")
            assert figure in err["message"] and "at most 20" in err["message"], err["message"]
        assert model.card.tokenizer.encoded == ["a" * 15, "b" * 15]  # the last request stopped at its 2nd input
        assert len(model.calls) == 2  # only the request within the budget reached the model (one call, two rows)
    finally:
        reg.close()


def test_route_cancels_the_job_when_its_client_goes_away(tmp_path):
    """A client that leaves while its inputs are being fed cancels the job: the route answers 499
    (for the log), no further chunk of its inputs is fed, and the slots go back to serve others."""
    import socket
    from pantheon.scheduler.batch import BatchScheduler
    from test_web_app import registry_app
    (tmp_path / "models").mkdir()
    settings = Settings(home=tmp_path, model_dir=(tmp_path / "models").resolve(), batch_slots=4, prefill_chunk=8)
    model = EmbedFake(name="m")
    app, reg = registry_app(settings, lambda p, n, d, s: model, lambda m, s: BatchScheduler(m, s, warmup=False))
    entry = reg.acquire("m")
    sched = entry.backend
    reg.release(entry)
    inside, cancelled = threading.Event(), threading.Event()
    cancel = sched._cancel
    sched._cancel = lambda job, *a: (cancel(job, *a), cancelled.set())

    def hold(call: int) -> None:
        if call == 1:
            inside.set()
            assert cancelled.wait(30)

    model.on_embed = hold
    ours, peer = socket.socketpair()
    out: dict = {}
    inputs = [[1 + k] * 60 for k in range(8)]  # 8 chunks each: far more calls than the one held
    t = threading.Thread(target=lambda: out.update(r=app.test_client().post(
        "/v1/embeddings", json={"input": inputs}, environ_base={"gunicorn.socket": ours})))
    try:
        t.start()
        assert inside.wait(10)
        peer.close()  # the client goes away while the first call runs
        t.join(30)
        assert not t.is_alive(), "the request did not end"
        assert out["r"].status_code == 499
        wait_until(lambda: sched.load_info()["running"] == 0, 10, "the slots to go back")
        assert len(model.calls) == 1
        model.on_embed = None
        r = app.test_client().post("/v1/embeddings", json={"input": "again"})
        assert r.status_code == 200
    finally:
        cancelled.set()
        ours.close()
        reg.close()


def test_route_needs_the_api_key(tmp_path):
    app, reg = make_app(tmp_path, api_key="k")
    c = app.test_client()
    try:
        assert c.post("/v1/embeddings", json={"input": "x"}).status_code == 401
        assert c.post("/v1/embeddings", json={"input": "x"}, headers={"Authorization": "Bearer k"}).status_code == 200
    finally:
        reg.close()


def test_the_embeddings_modules_import_no_jax():
    code = ("import sys; import pantheon.web.embeddings, pantheon.runtime.pooling, pantheon.types; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax')); "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0, r.stdout + r.stderr


# ---- architectures (tiny fixtures) ---------------------------------------------------------------------
@pytest.mark.parametrize("name", ["llama", "gemma3", "phi3", "qwen35", "rwkv7"])
def test_chunked_embedding_equals_one_pass_and_a_reused_slot_starts_clean(name):
    """Every architecture: an input fed in chunks (into a slot whose cache held another input, which a
    row at start 0 must forget, recurrent state included) pools to the one-pass hidden states."""
    import jax
    import jax.numpy as jnp
    from pantheon.runtime import pooling
    m = tiny_model(name)  # chunk 16, max_seq 64
    ids = [(7 * i + 3) % 200 + 1 for i in range(40)]
    state = m.new_state()
    _, state = pooling.embed_inputs(m, state, [list(range(1, 30))], [0])  # leave another input in slot 0
    mean, state = pooling.embed_inputs(m, state, [ids], [0], "mean")
    last, state = pooling.embed_inputs(m, state, [ids], [0], "last")
    h, _ = jax.jit(lambda p, c: m.arch.hidden_states(
        p, c, jnp.asarray([ids], jnp.int32), jnp.asarray([1], jnp.int32), jnp.zeros(1, jnp.int32),
        jnp.asarray([len(ids)], jnp.int32), cfg=m.config, span=m._span_for(len(ids)), kernels=m.kernels))(
        m.params, state.cache)
    h = np.asarray(h[0], np.float64)
    np.testing.assert_allclose(mean[0], normalize(h.mean(0)), atol=1e-4)
    np.testing.assert_allclose(last[0], normalize(h[-1]), atol=1e-4)


def test_hidden_states_through_the_head_are_the_logits():
    """hidden_states is forward without its head: the same body, no copy that could drift."""
    import jax
    import jax.numpy as jnp
    from pantheon.ops import weights
    m = tiny_model("llama")
    ids = [5, 9, 2, 7, 1]
    args = (jnp.asarray([ids], jnp.int32), jnp.asarray([1], jnp.int32), jnp.zeros(1, jnp.int32),
            jnp.asarray([5], jnp.int32))
    kw = dict(cfg=m.config, span=m._span_for(5), kernels=m.kernels)
    state = m.new_state()
    h, _ = jax.jit(lambda p, c: m.arch.hidden_states(p, c, *args, **kw))(m.params, state.cache)
    logits, _ = jax.jit(lambda p, c: m.arch.forward(p, c, *args, all_logits=True, **kw))(m.params, m.new_state().cache)
    head = m.params.embed if m.params.head is None else m.params.head
    np.testing.assert_allclose(np.asarray(weights.linear(h, head, m.params.head_bias)), np.asarray(logits),
                               atol=1e-4)


# ---- the real default model ------------------------------------------------------------------------------
TEXTS = ["The cat sat on the mat.", "Paris is the capital of France.", "I like pizza with extra cheese.",
         "Quantum mechanics describes very small particles.", "The stock market fell sharply today.",
         "Dogs are loyal and friendly animals.", "Water boils at one hundred degrees Celsius.",
         "She plays the violin beautifully every evening."]


@pytest.fixture(scope="module")
def smol(load_real):
    return load_real("smollm2-135m")


@pytest.fixture(scope="module")
def smol_sched(smol):
    from pantheon.scheduler.batch import BatchScheduler
    s = BatchScheduler(smol, Settings(home=Path("/tmp"), prefill_chunk=128), warmup=False)
    yield s
    s.close()


def real_ids(model, text: str) -> list[int]:
    return model.tokenizer.encode(text, add_special=True)


@pytest.mark.real
def test_same_text_alone_and_batched_with_seven_others_is_equal(smol, smol_sched):
    ids = [real_ids(smol, t) for t in TEXTS]
    alone = submit_embed(smol_sched, [ids[3]]).result.vectors[0]
    batched = submit_embed(smol_sched, ids).result.vectors
    np.testing.assert_allclose(batched[3], alone, atol=1e-5)
    concurrent = [submit_embed(smol_sched, [x]) for x in ids]  # eight jobs at once: batched across jobs
    np.testing.assert_allclose(concurrent[3].result.vectors[0], alone, atol=1e-5)
    for c, b in zip(concurrent, batched):
        np.testing.assert_allclose(c.result.vectors[0], b, atol=1e-5)
    assert np.allclose(np.linalg.norm(batched, axis=1), 1.0, atol=1e-5)
    # Beside a much longer input the batch runs in a longer token bucket: equal to float rounding.
    long = real_ids(smol, "word " * 100)
    np.testing.assert_allclose(submit_embed(smol_sched, [long, ids[3]]).result.vectors[1], alone, atol=1e-4)


@pytest.mark.real
def test_long_input_in_chunks_equals_one_pass(smol):
    import jax
    import jax.numpy as jnp
    from pantheon.runtime import pooling
    text = " ".join(f"Sentence {i} is about a different topic: weather, music, sport or food." for i in range(16))
    ids = real_ids(smol, text)
    assert len(ids) > 2 * smol.chunk  # three chunks at least
    state = smol.new_state()
    mean, state = pooling.embed_inputs(smol, state, [ids], [2], "mean")
    last, state = pooling.embed_inputs(smol, state, [ids], [2], "last")
    h, _ = jax.jit(lambda p, c: smol.arch.hidden_states(
        p, c, jnp.asarray([ids], jnp.int32), jnp.asarray([5], jnp.int32), jnp.zeros(1, jnp.int32),
        jnp.asarray([len(ids)], jnp.int32), cfg=smol.config, span=smol._span_for(len(ids)),
        kernels=smol.kernels))(smol.params, state.cache)
    h = np.asarray(h[0], np.float64)
    np.testing.assert_allclose(mean[0], normalize(h.mean(0)), atol=1e-4)
    np.testing.assert_allclose(last[0], normalize(h[-1]), atol=1e-4)


@pytest.mark.real
def test_different_texts_differ_and_related_texts_are_closer(smol, smol_sched):
    texts = ["The cat sat on the mat.", "A cat was sitting on the rug.",
             "Interest rates rose as inflation climbed."]
    v = submit_embed(smol_sched, [real_ids(smol, t) for t in texts]).result.vectors
    assert np.abs(v[0] - v[1]).max() > 1e-3 and np.abs(v[0] - v[2]).max() > 1e-3
    assert float(v[0] @ v[1]) > float(v[0] @ v[2])


@pytest.mark.real
def test_embeddings_do_not_disturb_a_concurrent_generation(smol, smol_sched):
    from pantheon.runtime import reference
    prompt = smol.tokenizer.encode(smol.card.template.render(
        [{"role": "user", "content": "Name three colours."}], add_generation_prompt=True))
    alone = list(reference.generate(smol, prompt, GREEDY, max_tokens=12, stop_ids=[]))
    gen = Collector()
    smol_sched.submit(GenRequest(prompt_ids=prompt, params=GREEDY, max_tokens=12), gen)
    jobs = [submit_embed(smol_sched, [real_ids(smol, t) for t in TEXTS]) for _ in range(2)]
    assert all(isinstance(j.result, Embedded) for j in jobs)
    assert gen.done.wait(120) and gen.ids == alone


@pytest.mark.real
def test_openai_client_against_a_live_server(smol_server):
    import openai
    from server_util import SMOL_KEY
    srv = smol_server  # the run's shared SmolLM2 server (server_util.SMOL: its API key is set)
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key=SMOL_KEY, max_retries=0, timeout=300)
    out = client.embeddings.create(model="smol", input=TEXTS[:3])  # the client asks for base64 by default
    floats = client.embeddings.create(model="smol", input=TEXTS[:3], encoding_format="float")
    assert [d.index for d in out.data] == [0, 1, 2] and out.model == "smol"
    a, b = np.array([d.embedding for d in out.data]), np.array([d.embedding for d in floats.data])
    assert a.shape == (3, 576)
    np.testing.assert_allclose(a, b, atol=1e-6)
    assert out.usage.prompt_tokens == out.usage.total_tokens > 3
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model="smol", input="x", dimensions=8)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0).embeddings.create(
            model="smol", input="x")



# ---- short inputs ride many to a forward, in no slot (issue 43 row 3) -------------------------------------------
class FreshFake(EmbedFake):
    """EmbedFake plus `embed_fresh`: whole short inputs, no slot touched, at most `fresh_embed_rows` a call."""

    fresh_embed_rows = 16

    def __init__(self, **kw):
        super().__init__(**kw)
        self.fresh_calls: list[list[list[int]]] = []

    def embed_fresh(self, rows, pooling="mean"):
        kinds = [pooling] * len(rows) if isinstance(pooling, str) else list(pooling)
        assert 0 < len(rows) <= self.fresh_embed_rows and all(0 < len(r) <= self.chunk for r in rows)
        self.fresh_calls.append([list(r) for r in rows])
        self.log.append(("embed", sum(len(r) for r in rows)))
        out = []
        for toks, kind in zip(rows, kinds):
            vecs = [feature(t, i) for i, t in enumerate(toks)]
            out.append(np.sum(vecs, axis=0) if kind == "mean" else vecs[-1])
        return np.asarray(out, np.float32)


@pytest.fixture()
def fresh():
    from pantheon.scheduler.batch import BatchScheduler
    fake = FreshFake()
    s = BatchScheduler(fake, sched_settings(), warmup=False)
    yield fake, s
    s.close()


def test_2048_tiny_inputs_take_few_forwards_and_no_slot(fresh):
    # The request ("text 0" ... "text 2047"): one input per slot per forward was 2048 / 4 = 512
    # forwards here (on SmolLM2, over 120 s beside a stream).
    fake, s = fresh
    inputs = [[1 + i % 500, 2 + i % 7] for i in range(2048)]  # 16 a call: 32 tokens, a chunk (8) per slot (4)
    r = submit_embed(s, inputs).result
    assert isinstance(r, Embedded), r
    np.testing.assert_allclose(r.vectors, [expected(x) for x in inputs], atol=1e-6)
    assert fake.calls == []  # no input took a slot
    assert len(fake.fresh_calls) == 2048 // fake.fresh_embed_rows


def test_a_long_input_still_takes_a_slot_beside_short_ones(fresh):
    fake, s = fresh
    inputs = [[5, 6], list(range(10, 30)), [7]]  # 20 tokens: three chunks of 8, in one slot
    r = submit_embed(s, inputs, pooling="last").result
    np.testing.assert_allclose(r.vectors, [expected(x, "last") for x in inputs], atol=1e-6)
    assert [len(rows) for rows in fake.fresh_calls] == [2] and len(fake.calls) == 3


def test_short_inputs_run_beside_a_stream_at_most_a_chunk_a_call_and_neither_starves(fresh):
    """While a chat streams (and while more chats wait for slots), the slot-free calls go on, each at most
    one prefill chunk's worth of tokens between two decode steps; every chat is answered exactly."""
    fake, s = fresh
    fake.gate = threading.Event()
    chats = []
    for k in range(6):  # more chats than slots: some wait for a slot the whole time
        c = Collector()
        s.submit(GenRequest(prompt_ids=[7 + k, 8, 9], params=GREEDY, max_tokens=20), c)
        chats.append(c)
    wait_until(lambda: s.load_info()["running"] >= 1, 10, "a chat to be admitted")
    inputs = [[1 + i % 300, 4] for i in range(256)]
    big = submit_embed(s, inputs)
    fake.gate.set()
    np.testing.assert_allclose(big.result.vectors, [expected(x) for x in inputs], atol=1e-6)
    for k, c in enumerate(chats):
        assert c.done.wait(10) and c.ids == fake.generate_alone([7 + k, 8, 9], 20)
    assert fake.calls == []
    steps = [i for i, (kind, _) in enumerate(fake.log) if kind == "step"]
    between = [sum(x for kind, x in fake.log[a + 1:b] if kind == "embed") for a, b in zip(steps, steps[1:])]
    assert max(between) <= fake.chunk, between  # a decode step waits behind at most one chunk of it
    assert sum(between) > 0  # and it went on while the chats streamed and waited


class PaddedFreshFake(FreshFake):
    """FreshFake whose slot-free forward is padded as the engine's is (`Model.embed_fresh_shape`): rows to
    a power of two, tokens to its smallest prefill bucket (here the chunk)."""

    def embed_fresh_shape(self, rows, longest):
        b = 1
        while b < rows:
            b *= 2
        return b, self.chunk


def test_a_slot_free_call_costs_no_more_than_a_slot_fed_one_once_padded():
    # 64 inputs of 4 tokens are, padded, a 64 x 32 forward: ~10 s on SmolLM2, every stream stalled behind
    # it (issue 43's bench). A call is budgeted by its padded shape: alone a chunk per slot at most.
    from pantheon.scheduler.batch import BatchScheduler
    fake = PaddedFreshFake()
    s = BatchScheduler(fake, sched_settings(), warmup=False)
    try:
        inputs = [[1 + i % 500, 2] for i in range(64)]
        r = submit_embed(s, inputs).result
        np.testing.assert_allclose(r.vectors, [expected(x) for x in inputs], atol=1e-6)
        shapes = [fake.embed_fresh_shape(len(c), max(map(len, c))) for c in fake.fresh_calls]
        assert fake.calls == [] and len(fake.fresh_calls) > 1
        assert all(b * t <= fake.chunk * 4 for b, t in shapes), shapes  # 4 slots of one chunk
    finally:
        s.close()


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen35", "rwkv7"])
def test_a_slot_free_embedding_is_the_slot_fed_one(arch):
    """`Model.embed_fresh` (a cache made for the call, many inputs a forward) pools what `Model.embed`
    pools through a serving slot, and leaves the serving state alone."""
    from conftest import TINY
    from pantheon.runtime import engine
    m = engine.load(TINY / f"{arch}.gguf", engine.LoadOptions(n_slots=2, max_seq=128, prefill_chunk=16))
    try:
        rows, kinds = [[1, 5, 9], [7, 8], [3, 4, 5, 6, 7, 8, 9, 10, 11]], ["mean", "last", "mean"]
        fresh = m.embed_fresh(rows, kinds)
        state = m.new_state()
        slotted = []
        for r, k in zip(rows, kinds):
            out, state = m.embed(state, [r], [0], [0], k)
            slotted.append(out[0])
        np.testing.assert_allclose(fresh, np.stack(slotted), rtol=1e-4, atol=1e-4)
        with pytest.raises(ValueError):
            m.embed_fresh([list(range(1, m.chunk + 2))])  # longer than a chunk: that input needs a slot
    finally:
        m.free()
