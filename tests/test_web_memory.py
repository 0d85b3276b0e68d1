"""Memory-aware admission and die placement (issue 6), end to end and at the seams.

Unit level (no server): the admission service's chat decision (FIT / CAPPED / 400 / 503 on a fake model and given memory
snapshots), and `make_backend` wiring the memory watch's pressure into the batch scheduler, which turns
queue-full answers from 429 into 503 under CRITICAL pressure.

Server level: a gunicorn server with four CPU dies (XLA_FLAGS=--xla_force_host_platform_device_count=4,
150 MiB each): automatic placement on the emptiest die, a 507 that leaks nothing, a model sharded over
two dies answering exactly like the same model on one, two replicas under one name splitting sessions
while each session stays on its replica (`X-Pantheon-Instance`), an over-long conversation CAPPED with
`context_capped: true` and the answer the kept conversation gets, and /admin/dies agreeing with the loads
throughout. A second server with PANTHEON_TEST_PRESSURE=3 (forced CRITICAL) denies chat with 503.
"""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from pantheon.runtime import memory
from pantheon.config import Settings
from pantheon.serving.dies import Die, DieManager, estimate_load_bytes
from pantheon.runtime.engine import LoadOptions
from pantheon.errors import BusyError, RequestError
from pantheon.serving.admission import AdmissionService
from pantheon.types import ModelCard, ModelGeometry
from pantheon.jax_models.interface import Capabilities
from pantheon.runtime.memory import MemSnapshot, MemWatch, PoolSample
from pantheon.scheduler import GenRequest, make_backend
from pantheon.runtime.sampler import SamplingParams
from server_util import LLAMA, QWEN2, TINY, assert_error, sse_events, start_server

GiB = 1024 ** 3
MiB = 1024 ** 2
ADMIN = "mem-admin"
INSTANCE = "X-Pantheon-Instance"


# ---- admission on a fake model (one token per word) ---------------------------------------------------
class WordModel:
    """Just what admission reads: max_seq, state bytes per token, one CPU die."""

    def __init__(self, max_seq: int = 64, bpt: int = 1024):
        self.max_seq = max_seq
        self.geometry = ModelGeometry(max_seq=max_seq, state_bytes_per_token=bpt, dies=(0,), platform="cpu")


def card(m: WordModel) -> ModelCard:
    """The card the web layer sees: the window and the geometry the engine published."""
    return ModelCard(name="words", path="", arch="llama", context_length=m.max_seq, n_slots=1, tokenizer=None,
                     template=None, geometry=m.geometry)


def text(msgs: list[dict]) -> str:
    return " ".join(f"{m['role']}: {m.get('content') or ''}" for m in msgs)


def tokenize(rendered: str) -> list[int]:
    return [1] * len(rendered.split())


def render(msgs: list[dict]) -> tuple[str, list[int]]:
    return text(msgs), tokenize(text(msgs))


def admit_prompt(card: ModelCard, msgs: list[dict], max_tokens: int | None = None, watch=None,
                 truncate: bool = False) -> tuple[str, list[int], bool]:
    """The admission service's chat decision, as (rendered, ids, capped)."""
    got = AdmissionService(watch).chat(card, msgs, text, tokenize, max_tokens, truncate)
    return got.rendered, got.ids, got.capped


def watch_at(used_frac: float, total: int = 100 * GiB) -> SimpleNamespace:
    """A stand-in MemWatch whose snapshot shows the host at `used_frac`."""
    snap = MemSnapshot(host=PoolSample("host", total, int(total * used_frac), "given"), taken_at=time.monotonic())
    return SimpleNamespace(snapshot=lambda: snap)


def conversation(turns: int, words: int = 6) -> list[dict]:
    msgs = [{"role": "system", "content": "be brief"}]
    for i in range(turns):
        msgs += [{"role": "user", "content": " ".join([f"q{i}"] * words)},
                 {"role": "assistant", "content": " ".join([f"a{i}"] * words)}]
    return msgs + [{"role": "user", "content": "last question"}]


def test_admit_prompt_fit_and_capped():
    m = WordModel(max_seq=64)  # reserve for the answer: 64 // 8 = 8 tokens
    msgs = conversation(2)
    _, ids, capped = admit_prompt(card(m), msgs, watch=watch_at(0.2))
    assert not capped and ids == render(msgs)[1]
    long = conversation(10)  # 152 words: longer than the window
    # as OpenAI answers it: 400 naming both sizes, unless the request asks for the oldest turns to go
    with pytest.raises(RequestError) as e:
        admit_prompt(card(m), long, max_tokens=4, watch=watch_at(0.2))
    assert e.value.status == 400 and e.value.code == "context_length_exceeded"
    assert "64 tokens" in str(e.value) and "146 tokens" in str(e.value) and '"truncate": "oldest"' in str(e.value)
    rendered, ids, capped = admit_prompt(card(m), long, max_tokens=4, watch=watch_at(0.2), truncate=True)
    assert capped and len(ids) <= 64 - 4
    assert rendered.startswith("system: be brief") and rendered.endswith("user: last question")
    assert "q9" in rendered and "q0" not in rendered
    # no running watch: the context window alone caps the same way when asked to
    _, ids2, capped2 = admit_prompt(card(m), long, max_tokens=4, watch=SimpleNamespace(snapshot=lambda: None),
                                    truncate=True)
    assert capped2 and ids2 == ids
    # a prompt inside the window but into the answer's reserve is taken whole without truncate
    near = conversation(4)  # 62 words: 2 tokens left to generate, fewer than the 8 reserved
    _, ids3, capped3 = admit_prompt(card(m), near, watch=watch_at(0.2))
    assert not capped3 and ids3 == render(near)[1]


def test_admit_prompt_refusals():
    m = WordModel(max_seq=64)
    huge_last = [{"role": "user", "content": "w " * 100}]
    with pytest.raises(RequestError) as e:  # the last message alone exceeds the context: 400, never cut
        admit_prompt(card(m), huge_last, watch=watch_at(0.2))
    assert e.value.status == 400 and e.value.code == "context_length_exceeded"
    # a last message that only fits without the answer reserve still runs (one token of room at least)
    _, ids, capped = admit_prompt(card(m), [{"role": "user", "content": "w " * 60}], watch=watch_at(0.2))
    assert not capped and len(ids) == 61
    with pytest.raises(BusyError) as e:  # CRITICAL pressure: denied, retry later
        admit_prompt(card(m), conversation(1), watch=watch_at(0.99))
    assert e.value.status == 503 and e.value.retry_after
    # memory, not the window, is what the last message does not fit: 503 (retry later), not 400
    tight = WordModel(max_seq=64, bpt=12 * GiB // 40)  # 15% free - 3% reserve = 12 GiB: 40 tokens
    with pytest.raises(BusyError) as e:
        admit_prompt(card(tight), [{"role": "user", "content": "w " * 50}], watch=watch_at(0.85))
    assert e.value.status == 503
    _, ids, capped = admit_prompt(card(tight), [{"role": "user", "content": "w " * 30}], watch=watch_at(0.85))
    assert not capped and len(ids) == 31


# ---- the scheduler's pressure callback ----------------------------------------------------------------
class BlockingModel:
    """Enough of a Model for BatchScheduler: one slot; a step blocks until unblocked, then fails."""

    n_slots, chunk, max_seq, name, supports_mixed = 1, 16, 64, "blocking", False
    caps = Capabilities()

    def __init__(self, die: int):
        self.devices = [SimpleNamespace(id=die, platform="cpu")]
        self.entered = threading.Event()
        self.unblock = threading.Event()

    def new_state(self):
        return None

    def insert(self, state, new):
        return state

    def release(self, state, slot):
        return state

    def forward(self, state, plan):
        self.entered.set()
        self.unblock.wait(10)
        raise RuntimeError("fake step")


def test_make_backend_pressure_turns_queue_full_into_503(tmp_path):
    level = [memory.CRITICAL]
    fractions = {memory.OK: 0.5, memory.CRITICAL: 0.99}
    dies = DieManager([Die(0, GiB), Die(1, GiB)])
    watch = MemWatch(dies, interval_s=0.02,
                     host_reader=lambda: PoolSample("host", 100 * GiB, int(100 * GiB * fractions[level[0]]), "given"))
    watch.start()
    model = BlockingModel(die=1)
    sched = make_backend(model, Settings(home=tmp_path, batch_slots=1, queue_depth=0, warmup=False),
                         watch=watch, dies=dies)
    events: list = []
    req = GenRequest(prompt_ids=[1, 2, 3], params=SamplingParams(temperature=0.0), max_tokens=4)
    try:
        assert sched.pressure() == memory.CRITICAL
        sched.submit(req, events.append)  # queued: nothing starts under CRITICAL pressure
        with pytest.raises(BusyError) as e:
            sched.submit(req, events.append)
        assert e.value.status == 503
        assert not model.entered.is_set()
        level[0] = memory.OK
        assert model.entered.wait(10)  # the queued request started once the pressure dropped
        with pytest.raises(BusyError) as e:
            sched.submit(req, events.append)  # the one slot busy, no queue: plain backpressure
        assert e.value.status == 429 and e.value.retry_after == 5
    finally:
        model.unblock.set()
        sched.close()
        watch.stop()


# ---- a server with four dies -------------------------------------------------------------------------
SLOTS = 2  # PANTHEON_BATCH_SLOTS: two rows per model keep the compiled programs (and the test's time) few
OPTS = LoadOptions(n_slots=SLOTS, max_seq=128, prefill_chunk=32)  # the server's (see server_util.BASE_ENV)
EST_LLAMA = estimate_load_bytes(LLAMA, OPTS)
EST_QWEN2 = estimate_load_bytes(QWEN2, OPTS)
BUDGET = 150 * MiB  # two tiny models (about 66 MiB each, mostly scratch) fit a die, three do not


# Its own server: four forced CPU dies (XLA_FLAGS) and admin loads placed on them, which change what
# the server holds.
@pytest.fixture(scope="module")
def srv():
    s = start_server([f"base={LLAMA}@0"],
                     env={"XLA_FLAGS": "--xla_force_host_platform_device_count=4", "PANTHEON_DIE_BUDGET_MB": "150",
                          "PANTHEON_BATCH_SLOTS": str(SLOTS),
                          "PANTHEON_WARMUP": "0", "PANTHEON_ADMIN_KEY": ADMIN, "PANTHEON_MODEL_DIR": str(TINY),
                          # without warm-up a new replica compiles inside its first requests; on a loaded
                          # machine that outlasts the default 30 s a queued request waits for a slot
                          "PANTHEON_QUEUE_WAIT_S": "600"})
    yield s
    s.stop()


@pytest.fixture(scope="module")
def start_dies(srv):
    return dies(srv)


def dies(srv) -> list[dict]:
    r = srv.get("/admin/dies", key=ADMIN)
    assert r.status_code == 200, r.text
    return r.json()["data"]


def load(srv, path: str, name: str, on: list[int] | None = None, status: int = 200) -> dict:
    body = {"path": path, "name": name, **({"dies": on} if on is not None else {})}
    r = srv.post("/admin/models/load", body, key=ADMIN)
    assert r.status_code == status, r.text
    return r.json()


def unload(srv, **body) -> None:
    r = srv.post("/admin/models/unload", body, key=ADMIN)
    assert r.status_code == 200, r.text


def chat(srv, model: str, messages: list[dict], **kw):
    return srv.post("/v1/chat/completions", {"model": model, "messages": messages, "temperature": 0, **kw})


def assert_ledger(table: list[dict], loads: list[dict]) -> None:
    """Every die's used bytes are what the loads on it reserved, and its models are exactly those loads."""
    for d in table:
        mine = [x for x in loads if d["die"] in x["dies"]]
        assert d["used_bytes"] == sum(x["bytes"] for x in mine) == sum(m["bytes"] for m in d["models"])
        assert d["free_bytes"] == d["budget_bytes"] - d["used_bytes"]
        assert sorted(m["instance_id"] for m in d["models"]) == sorted(x["instance_id"] for x in mine)


@pytest.mark.slow
def test_startup_reservation(srv, start_dies):
    assert [d["die"] for d in start_dies] == [0, 1, 2, 3]
    assert all(d["budget_bytes"] == BUDGET and d["platform"] == "cpu" for d in start_dies)
    assert start_dies[0]["used_bytes"] == EST_LLAMA.total_bytes  # weights + KV cache + scratch
    assert [m["name"] for m in start_dies[0]["models"]] == ["base"] and start_dies[0]["models"][0]["state"] == "ready"
    assert [d["used_bytes"] for d in start_dies[1:]] == [0, 0, 0]
    body = srv.get("/admin/dies", key=ADMIN).json()
    assert body["memory"]["host"]["total_bytes"] > 0 and body["memory"]["pressure"] in memory.LEVEL_NAMES


@pytest.mark.slow
def test_auto_placement_picks_the_emptiest_die(srv, start_dies):
    base = {"instance_id": start_dies[0]["models"][0]["instance_id"], "dies": [0],
            "bytes": start_dies[0]["used_bytes"]}
    loads = []
    for i, want in enumerate([1, 2, 3, 1]):  # the 4th: every die holds one model, die 0 the larger one
        before = dies(srv)
        most_free = max(d["free_bytes"] for d in before)
        info = load(srv, "qwen2.gguf", f"q{i}")
        assert info["dies"] == [want] and info["bytes"] == EST_QWEN2.total_bytes
        assert before[want]["free_bytes"] == most_free
        loads.append(info)
        assert_ledger(dies(srv), [base] + loads)
    for info in loads:
        unload(srv, instance_id=info["instance_id"])
    assert dies(srv) == start_dies


@pytest.mark.slow
def test_oversize_load_is_507_and_leaks_nothing(srv, start_dies):
    extra = load(srv, "llama.gguf", "extra", on=[0])  # die 0: 2 x 66.6 of 150 MiB
    before = dies(srv)
    for on in ([0], [0, 1]):  # neither alone nor as a half on die 0 does a third model fit
        err = assert_error(srv.post("/admin/models/load", {"path": "qwen2.gguf", "name": "big", "dies": on},
                                    key=ADMIN), 507)
        assert err["code"] == "insufficient_memory" and "die 0" in err["message"]
        assert dies(srv) == before
    assert "big" not in [m["id"] for m in srv.get("/v1/models").json()["data"]]
    unload(srv, instance_id=extra["instance_id"])
    assert dies(srv) == start_dies


HELLO = [{"role": "user", "content": "Tell me a story about a cat."}]


@pytest.mark.slow
def test_two_die_sharded_model_answers_like_one_die(srv):
    info = load(srv, "llama.gguf", "shard", on=[1, 2])
    assert info["dies"] == [1, 2] and info["bytes"] == EST_LLAMA.per_die(2) < EST_LLAMA.total_bytes
    table = dies(srv)
    assert [m["bytes"] for m in table[1]["models"]] == [m["bytes"] for m in table[2]["models"]] == [info["bytes"]]
    one = chat(srv, "base", HELLO, max_tokens=16, ignore_eos=True)
    two = chat(srv, "shard", HELLO, max_tokens=16, ignore_eos=True)
    assert one.status_code == two.status_code == 200, (one.text, two.text)
    assert two.headers[INSTANCE] == info["instance_id"]
    a, b = one.json(), two.json()
    assert a["usage"]["completion_tokens"] == b["usage"]["completion_tokens"] == 16
    assert b["choices"][0]["message"]["content"] == a["choices"][0]["message"]["content"]
    unload(srv, name="shard")


@pytest.mark.slow
def test_replicas_split_sessions_and_sessions_stick(srv, start_dies):
    # "base" (die 0, already compiled) gets a second replica on die 1: two replicas on disjoint dies
    r1 = {"instance_id": start_dies[0]["models"][0]["instance_id"], "dies": [0], "bytes": start_dies[0]["used_bytes"]}
    r2 = load(srv, "llama.gguf", "base", on=[1])
    assert_ledger(dies(srv), [r1, r2])
    assert [m["id"] for m in srv.get("/v1/models").json()["data"]] == ["base"]
    sessions = [f"sess-{i}" for i in range(8)]
    first_msgs = {s: [{"role": "user", "content": f"Hello number {i}"}] for i, s in enumerate(sessions)}

    def turn(sid: str, msgs: list[dict]):
        r = chat(srv, "base", msgs, max_tokens=4, session_id=sid)
        assert r.status_code == 200, r.text
        return r.headers[INSTANCE], r.json()["choices"][0]["message"]["content"]

    try:
        with ThreadPoolExecutor(8) as pool:
            first = dict(zip(sessions, pool.map(lambda s: turn(s, first_msgs[s]), sessions)))
            assert {inst for inst, _ in first.values()} == {r1["instance_id"], r2["instance_id"]}  # both used
            second_msgs = {s: first_msgs[s] + [{"role": "assistant", "content": first[s][1]},
                                               {"role": "user", "content": "And then?"}] for s in sessions}
            second = dict(zip(sessions, pool.map(lambda s: turn(s, second_msgs[s]), sessions)))
        assert {s: second[s][0] for s in sessions} == {s: first[s][0] for s in sessions}  # each session stuck
    finally:  # the module's later tests read the ledger: the replica goes whatever happened here
        unload(srv, instance_id=r2["instance_id"])


def long_conversation() -> list[dict]:
    msgs = [{"role": "system", "content": "You are a helpful assistant."}]
    for i in range(8):
        msgs += [{"role": "user", "content": f"Question {i}: what happened in chapter {i} of the long story?"},
                 {"role": "assistant", "content": f"In chapter {i} the cat walked to the river and back home."}]
    return msgs + [{"role": "user", "content": "What is two plus two?"}]


@pytest.mark.slow
def test_overlong_prompt_is_capped_with_the_kept_conversations_answer(srv):
    msgs = long_conversation()
    # by default a conversation longer than the context is refused, as OpenAI refuses it
    r = chat(srv, "base", msgs, max_tokens=8)
    err = assert_error(r, 400)
    assert err["code"] == "context_length_exceeded" and "128 tokens" in err["message"]
    # asked to, the oldest turns go
    r = chat(srv, "base", msgs, max_tokens=8, ignore_eos=True, session_id="capped-1", truncate="oldest")
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["context_capped"] is True
    kept = out["usage"]["prompt_tokens"]
    assert kept <= 128 - 8 and out["usage"]["completion_tokens"] == 8
    answer = out["choices"][0]["message"]["content"]
    assert isinstance(answer, str) and answer and out["choices"][0]["finish_reason"] == "length"
    # the answer is the one the kept conversation (system + the latest turns) gets on its own
    suffixes = [msgs[:1] + msgs[k:] for k in range(1, len(msgs)) if msgs[k]["role"] == "user"]
    sizes = {}
    for cand in suffixes[::-1]:  # shortest first; stop once past the kept size
        r = chat(srv, "base", cand, max_tokens=1)
        if r.status_code != 200 or r.json().get("context_capped"):
            break
        sizes[r.json()["usage"]["prompt_tokens"]] = cand
        if r.json()["usage"]["prompt_tokens"] >= kept:
            break
    assert kept in sizes, (kept, sorted(sizes))
    alone = chat(srv, "base", sizes[kept], max_tokens=8, ignore_eos=True).json()
    assert "context_capped" not in alone
    assert alone["choices"][0]["message"]["content"] == answer
    # streamed: the finish chunk says so too
    r = chat(srv, "base", msgs, max_tokens=8, stream=True, stream_options={"include_usage": True}, truncate="oldest")
    events = sse_events(r)
    finish = [e for e in events if isinstance(e, dict) and e.get("choices") and e["choices"][0]["finish_reason"]]
    assert finish and finish[-1]["context_capped"] is True
    assert events[-2]["usage"]["prompt_tokens"] == kept and events[-1] == "[DONE]"
    # a last message that alone exceeds the context is still a 400
    err = assert_error(chat(srv, "base", [{"role": "user", "content": "word " * 400}]), 400, "messages")
    assert err["code"] == "context_length_exceeded"


@pytest.mark.slow
def test_dies_unchanged_after_everything(srv, start_dies):
    assert dies(srv) == start_dies


# ---- a server under forced CRITICAL memory pressure --------------------------------------------------
@pytest.mark.slow
def test_critical_pressure_denies_chat_and_embeddings_with_503():
    # its own server: the forced pressure (PANTHEON_TEST_PRESSURE) refuses every other module's requests
    s = start_server([f"base={LLAMA}"], env={"PANTHEON_TEST_PRESSURE": "3", "PANTHEON_WARMUP": "0",
                                              "PANTHEON_ADMIN_KEY": ADMIN})
    try:
        r = chat(s, "base", HELLO, max_tokens=4)
        err = assert_error(r, 503)
        assert err["code"] == "server_busy" and "memory" in err["message"] and r.headers.get("Retry-After")
        r = chat(s, "base", HELLO, max_tokens=4, stream=True)  # refused before the stream starts
        assert_error(r, 503)
        assert s.get("/admin/dies", key=ADMIN).json()["memory"]["pressure"] == "CRITICAL"
        # embeddings are admitted by the same service: refused under the same pressure, the same way
        r = s.post("/v1/embeddings", {"model": "base", "input": "hello there"})
        err = assert_error(r, 503)
        assert err["code"] == "server_busy" and "memory" in err["message"] and r.headers.get("Retry-After")
        denied = re.search(r'^pantheon_admissions_total\{outcome="denied"\} (\S+)$', s.get("/metrics").text, re.M)
        assert denied and float(denied.group(1)) == 3
    finally:
        s.stop()
