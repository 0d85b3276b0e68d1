"""The web layer on a scripted fake backend (Flask test client, no gunicorn, no JAX).

A fake model turns every character into one token; its backend replays a script of events. That makes
paths reachable that a real model cannot be steered into: a refusal before the first event (429 with
Retry-After, even for stream=true), a backend error after the stream started (SSE error object, then
[DONE]), reasoning and tool-call channels, stop strings cancelling the backend, admin path rules.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

import pantheon.text
from pantheon import osthread
from pantheon.config import Settings
from pantheon.errors import BusyError
from pantheon.types import ModelCard
from pantheon.serving.registry import Registry
from pantheon.scheduler.api import Finished, Started, Tokens
from pantheon.web import create_app
from pantheon.web.chat import new_completion_id

ADMIN = "admin-secret"
HELLO = [{"role": "user", "content": "hi"}]


class CharTokenizer:
    eot_ids = frozenset({0})
    add_bos = False

    vocab_size = 0x110000
    bos_id = None

    def encode(self, text: str, add_special: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids) -> str:
        return "".join(chr(i) for i in ids)

    def is_control(self, tid: int) -> bool:
        return tid < 32 and chr(tid) not in "\n\t"

    def token_text(self, tid: int) -> str:
        return chr(tid)

    def token_bytes(self, tid: int) -> bytes:
        return chr(tid).encode("utf-8", "surrogatepass")

    def stream(self, skip_special: bool = False, at_start: bool = True):
        class Dec:
            def push(self, tid: int) -> str:
                return chr(tid)

            def flush(self) -> str:
                return ""
        return Dec()


class Template:
    def __init__(self, think: bool = False):
        self.think = think

    def render(self, messages, tools=None, add_generation_prompt=True, enable_thinking=None,
               tool_choice="auto") -> str:
        return "".join(str(m.get("content") or "") for m in messages) + ("<think>" if self.think else "")

    def prompt_ends_in_think(self, rendered: str) -> bool:
        return rendered.endswith("<think>")


class FakeModel:
    max_seq = 64
    weight_bytes = 1000

    def __init__(self, name: str, think: bool = False, n_slots: int = 1):
        self.name = name
        self.tokenizer = CharTokenizer()
        self.template = Template(think)
        self.card = ModelCard(name=name, path="", arch="fake", context_length=self.max_seq, n_slots=n_slots,
                              tokenizer=self.tokenizer, template=self.template)


class Handle:
    def __init__(self):
        self.cancelled = osthread.Event()  # the whole request
        self.cancelled_choices: set[int] = set()  # choices of an n > 1 request stopped alone

    def cancel(self, choice: int | None = None) -> None:
        if choice is None:
            self.cancelled.set()
        else:
            self.cancelled_choices.add(choice)


class ScriptBackend:
    """Replays `script` (text, then a finish reason) or `events` (explicit list) from an OS thread."""

    def __init__(self, model):
        self.model = model
        self.script: tuple[str, str] = ("hello", "length")
        self.events: list | None = None
        self.refuse: BusyError | None = None
        self.last_request = None
        self.last_handle: Handle | None = None

    def submit(self, req, sink):
        if self.refuse:
            raise self.refuse
        self.last_request = req
        handle = self.last_handle = Handle()
        events = self.events
        text, reason = self.script

        def run():
            if events is not None:
                for ev in events:
                    sink(ev)
                return
            sink(Started())
            n = 0
            for ch in text:
                if handle.cancelled.wait(0.001):
                    sink(Finished("cancelled", completion_tokens=n))
                    return
                n += 1
                stop = ord(ch) in req.stop_ids  # as the device flags a stop id: on the event, STOP
                sink(Tokens((ord(ch),), stop=stop))
                if stop:
                    sink(Finished("stop", completion_tokens=n))
                    return
            sink(Finished(reason, completion_tokens=n))

        osthread.start_thread(run, name="script")
        return handle

    def load_info(self):
        return {}

    def close(self, timeout: float = 10.0):
        pass


def registry_app(settings: Settings, load_model, make_backend) -> tuple:
    """(app, registry) on one fake die, with model "m" loaded through `load_model` / `make_backend`."""
    reg = Registry(settings, load_model=load_model, make_backend=make_backend,
                   devices=lambda s: [{"die": 0, "platform": "cpu", "kind": "cpu", "budget_bytes": 10**9}],
                   estimate=lambda p, s, pl: 1000)
    app = create_app(settings, registry=reg, exit_on_failure=False)
    app.extensions["pantheon"].startup.join(10)
    reg.load("fake", "m", None, resolve=lambda s: Path(s))
    return app, reg


@pytest.fixture()
def app_and_reg(tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "ok.gguf").write_bytes(b"GGUF")
    (tmp_path / "secret.gguf").write_bytes(b"GGUF")
    settings = Settings(home=tmp_path, admin_key=ADMIN, model_dir=(tmp_path / "models").resolve())
    return registry_app(settings, lambda p, n, d, s: FakeModel(n, think=n.startswith("think")),
                        lambda m, s: ScriptBackend(m))


@pytest.fixture()
def client(app_and_reg):
    return app_and_reg[0].test_client()


@pytest.fixture()
def stub_grammar(monkeypatch):
    """pantheon.text.structured replaced by a stand-in that records what the web layer asks of it (a real
    grammar needs a real tokenizer; tests/test_structured.py covers those)."""
    calls = []

    class Grammar:
        @staticmethod
        def from_response_format(rf, tokenizer, limits=None):
            calls.append(("response_format", rf))
            return None if rf.get("type") == "text" else ("grammar", rf["type"])

        @staticmethod
        def for_tools(tools, choice, tokenizer, parallel=True, limits=None):
            calls.append(("tools", [t["function"]["name"] for t in tools], choice, parallel))
            return ("grammar", "tools")

    mod = types.SimpleNamespace(Grammar=Grammar, SchemaLimits=lambda **kw: kw)
    monkeypatch.setitem(sys.modules, "pantheon.text.structured", mod)
    # `from pantheon.text import structured` reads the package's attribute once the real module was imported
    monkeypatch.setattr(pantheon.text, "structured", mod, raising=False)
    return calls


def backend(reg, name="m") -> ScriptBackend:
    e = reg.acquire(name)
    reg.release(e)
    return e.backend


def chat(client, **body):
    body.setdefault("messages", HELLO)
    return client.post("/v1/chat/completions", json=body)


def sse(resp) -> list:
    """The SSE events of a streamed response; closes it, as a WSGI server does after the last byte."""
    out = []
    text = resp.get_data(as_text=True)
    resp.close()
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            data = block[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def in_flight(reg) -> int:
    return sum(i["in_flight"] for i in reg.snapshot())


def test_completion_ids_are_random():
    ids = {new_completion_id() for _ in range(1000)}
    assert len(ids) == 1000 and all(i.startswith("chatcmpl-") and len(i) == 33 for i in ids)


def test_plain_completion(client, app_and_reg):
    r = chat(client)
    assert r.status_code == 200
    body = r.get_json()
    assert body["choices"][0]["message"]["content"] == "hello"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    req = backend(app_and_reg[1]).last_request
    assert req.prompt_ids == [ord("h"), ord("i")] and req.max_tokens == 62 and req.stop_ids == frozenset({0})
    assert in_flight(app_and_reg[1]) == 0


def test_max_tokens_clamped_and_session(client, app_and_reg):
    r = client.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 500},
                    headers={"X-Session-Id": "sess-9"})
    assert r.get_json()["context_capped"] is True
    req = backend(app_and_reg[1]).last_request
    assert req.max_tokens == 62 and req.session_id == "sess-9"
    chat(client, session_id="body-wins", max_tokens=3)
    assert backend(app_and_reg[1]).last_request.session_id == "body-wins"


def test_eos_is_stop_and_not_shown(client, app_and_reg):
    backend(app_and_reg[1]).script = ("ok\0ignored", "stop")
    body = chat(client).get_json()
    assert body["choices"][0]["message"]["content"] == "ok"
    assert body["choices"][0]["finish_reason"] == "stop"


def test_control_tokens_are_not_shown(client, app_and_reg):
    backend(app_and_reg[1]).script = ("a\x01b\nc", "length")
    assert chat(client).get_json()["choices"][0]["message"]["content"] == "ab\nc"


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cancels_the_backend(client, app_and_reg, stream):
    b = backend(app_and_reg[1])
    b.script = ("hello STOP and much more text that should never be generated" * 3, "length")
    r = chat(client, stop="STOP", stream=stream)
    if stream:
        chunks = sse(r)[:-1]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        finish = chunks[-1]["choices"][0]["finish_reason"]
    else:
        body = r.get_json()
        text, finish = body["choices"][0]["message"]["content"], body["choices"][0]["finish_reason"]
    assert text == "hello " and finish == "stop"
    assert b.last_handle.cancelled.is_set()
    assert in_flight(app_and_reg[1]) == 0


@pytest.mark.parametrize("stream", [False, True])
def test_refused_before_start_is_a_real_status(client, app_and_reg, stream):
    b = backend(app_and_reg[1])
    b.events = [Finished("error", error=BusyError("queue wait timed out", status=429, retry_after=2))]
    r = chat(client, stream=stream)
    r.close()
    assert r.status_code == 429 and r.headers["Retry-After"] == "2"
    assert r.get_json()["error"]["code"] == "server_busy"
    b.events = None
    b.refuse = BusyError("a generation is already in progress", status=429, retry_after=1)
    r = chat(client, stream=stream)
    assert r.status_code == 429 and r.headers["Retry-After"] == "1"
    b.refuse = BusyError("shutting down", status=503)
    assert chat(client, stream=stream).status_code == 503
    assert in_flight(app_and_reg[1]) == 0


def test_the_finish_reason_is_the_devices_flag_not_a_lookup_of_the_id(client, app_and_reg):
    """The backend's events say how a choice ended (Tokens.stop, Finished's reason: the device's STOP /
    LENGTH flag); the web layer maps them and never looks the ids up in the stop set again."""
    b = backend(app_and_reg[1])
    eot = 0  # CharTokenizer's end of turn, in the request's stop ids
    # a stop id the device did not stop on (not flagged): not text (a control token), and the choice ends
    # as its Finished says
    b.events = [Started(), Tokens((ord("a"), eot, ord("b"))), Finished("length", completion_tokens=3)]
    r = chat(client)
    assert r.status_code == 200, r.get_data()
    choice = r.get_json()["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"]) == ("ab", "length")
    # the flag on the last id: that id is a stop id, whatever it is, and not text
    b.events = [Started(), Tokens((ord("a"), ord("z")), stop=True), Finished("stop", completion_tokens=2)]
    choice = chat(client).get_json()["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"]) == ("a", "stop")
    # the same, streamed: the flag ends the text, the Finished's reason is the finish reason
    b.events = [Started(), Tokens((ord("o"),)), Tokens((ord("k"),)), Tokens((eot,), stop=True),
                Finished("stop", completion_tokens=3)]
    events = sse(chat(client, stream=True))
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"]) == "ok"
    assert [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"]][-1] == "stop"
    b.events = None


def test_error_after_start(client, app_and_reg):
    b = backend(app_and_reg[1])
    b.events = [Started(), Tokens((ord("a"), ord("b"))), Finished("error", error=RuntimeError("device lost"))]
    r = chat(client, stream=True)
    assert r.status_code == 200
    events = sse(r)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["type"] == "server_error" and set(events[-2]["error"]) == {
        "message", "type", "param", "code"}
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-2]) == "ab"
    r = chat(client)
    assert r.status_code == 500 and r.get_json()["error"]["type"] == "server_error"
    assert in_flight(app_and_reg[1]) == 0


def test_reasoning_channel(app_and_reg):
    app, reg = app_and_reg
    reg.load("fake", "think-model", None, resolve=lambda s: Path(s))
    client = app.test_client()
    backend(reg, "think-model").script = ("let me see</think>\n\nanswer", "stop")
    msg = chat(client, model="think-model").get_json()["choices"][0]["message"]
    assert msg["reasoning_content"] == msg["reasoning"] == "let me see"
    assert msg["content"] == "answer"
    chunks = sse(chat(client, model="think-model", stream=True))[:-1]
    reasoning = "".join(c["choices"][0]["delta"].get("reasoning_content") or "" for c in chunks)
    assert reasoning == "let me see"
    assert all(c["choices"][0]["delta"].get("reasoning") == c["choices"][0]["delta"].get("reasoning_content")
               for c in chunks)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def test_tool_calls(client, app_and_reg):
    backend(app_and_reg[1]).script = (CALL, "stop")
    body = chat(client, tools=TOOLS).get_json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert choice["message"]["content"] is None
    chunks = sse(chat(client, tools=TOOLS, stream=True))[:-1]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"][0]["delta"].get("tool_calls")]
    assert deltas[0]["tool_calls"][0]["index"] == 0
    assert deltas[0]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # tool_choice none: the same text is plain content
    body = chat(client, tools=TOOLS, tool_choice="none").get_json()
    assert body["choices"][0]["message"]["content"] == CALL and body["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("answer", ['{"name": "get_weather", "arguments": {"city": "Paris"}}',
                                    '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```'])
def test_a_bare_json_call_of_a_declared_tool_is_a_tool_call(client, app_and_reg, answer):
    backend(app_and_reg[1]).script = (answer, "stop")
    choice = chat(client, tools=TOOLS).get_json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    chunks = sse(chat(client, tools=TOOLS, stream=True))[:-1]
    assert [c["choices"][0]["delta"]["tool_calls"][0]["function"]["name"] for c in chunks
            if c["choices"][0]["delta"].get("tool_calls")] == ["get_weather"]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == ""
    # a tool that was not declared (or no tools at all): the JSON is the answer's content
    other = [{"type": "function", "function": {"name": "get_time"}}]
    assert chat(client, tools=other).get_json()["choices"][0]["message"]["content"] == answer
    assert chat(client).get_json()["choices"][0]["message"]["content"] == answer


def test_deprecated_functions_answer_in_the_tool_calls_shape(client, app_and_reg, stub_grammar):
    backend(app_and_reg[1]).script = (CALL, "stop")
    body = chat(client, functions=[TOOLS[0]["function"]], function_call={"name": "get_weather"}).get_json()
    assert body["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert body["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("size", [64, 40000])  # the large one is rendered and tokenized in an OS thread
def test_prompt_too_long(client, app_and_reg, size):
    r = chat(client, messages=[{"role": "user", "content": "x" * size}])
    assert r.status_code == 400 and r.get_json()["error"]["code"] == "context_length_exceeded"
    assert in_flight(app_and_reg[1]) == 0


# ---- admin on the fake registry ----------------------------------------------------------------------------
def admin(client, path, body=None, key=ADMIN, method="POST"):
    return client.open("/admin" + path, method=method, json=body, headers={"Authorization": f"Bearer {key}"})


def test_admin_needs_the_admin_key(client):
    assert admin(client, "/dies", method="GET", key="wrong").status_code == 401
    assert client.get("/admin/dies").status_code == 401
    assert admin(client, "/dies", method="GET").status_code == 200


@pytest.mark.parametrize("body,status", [
    ({"path": "../secret.gguf"}, 403),
    ({"path": "/etc/passwd"}, 403),
    ({"path": "sub/../../secret.gguf"}, 403),
    ({"path": "missing.gguf"}, 404),
    ({"model": "not-in-catalog-or-dir"}, 404),
    ({"path": "ok.gguf", "model": "smollm2-135m"}, 400),
    ({}, 400),
    ({"path": "ok.gguf", "dies": "0"}, 400),
    ({"path": "ok.gguf", "dies": [True]}, 400),
    ({"path": "ok.gguf", "quantize": True}, 400),
    ({"path": 5}, 400),
    ([1], 400),
])
def test_admin_load_rules(client, body, status):
    r = admin(client, "/models/load", body)
    assert r.status_code == status, r.get_data(as_text=True)
    assert set(r.get_json()["error"]) == {"message", "type", "param", "code"}


def test_admin_symlink_out_of_the_dir_is_refused(client, tmp_path):
    (tmp_path / "models" / "link.gguf").symlink_to(tmp_path / "secret.gguf")
    assert admin(client, "/models/load", {"path": "link.gguf"}).status_code == 403


def test_admin_load_unload_cycle(client, app_and_reg):
    r = admin(client, "/models/load", {"path": "ok.gguf", "name": "second", "dies": [0]})
    assert r.status_code == 200, r.get_data(as_text=True)
    info = r.get_json()
    assert info["status"] == "loaded" and info["name"] == "second" and info["dies"] == [0]
    dies = admin(client, "/dies", method="GET").get_json()["data"]
    assert {m["instance_id"] for m in dies[0]["models"]} >= {info["instance_id"]}
    assert sorted(m["id"] for m in client.get("/v1/models").get_json()["data"]) == ["m", "second"]
    assert admin(client, "/models/unload", {"instance_id": info["instance_id"]}).status_code == 200
    assert admin(client, "/models/unload", {"name": "second"}).status_code == 404
    assert admin(client, "/models/unload", {"name": "m", "instance_id": "x"}).status_code == 400
    assert admin(client, "/models/unload", {"name": "m", "timeout_s": -1}).status_code == 400
    assert admin(client, "/models/unload", {"name": "m", "timeout_s": 5}).status_code == 200
    r = chat(client)
    assert r.status_code == 503 and r.get_json()["error"]["code"] == "model_not_loaded"


# ---- OpenAI fields clients send that change nothing here (issue 20, item 8) ----------------------------
COMPAT = {"store": False, "metadata": {"trace": "abc"}, "service_tier": "auto", "prompt_cache_key": "k1",
          "safety_identifier": "u-hash", "user": "me", "parallel_tool_calls": True, "verbosity": "low",
          "modalities": ["text"]}


def test_compatibility_fields_are_accepted_and_change_nothing(client, app_and_reg):
    plain = chat(client, temperature=0)
    compat = chat(client, temperature=0, **COMPAT)
    assert plain.status_code == compat.status_code == 200
    assert compat.get_json()["choices"] == plain.get_json()["choices"]


@pytest.mark.parametrize("field, value", [
    ("store", "yes"), ("metadata", {"k": 1}), ("metadata", {f"k{i}": "v" for i in range(17)}),
    ("service_tier", "fastest"), ("verbosity", "loud"), ("modalities", ["text", "audio"]),
    ("reasoning_effort", "extreme"), ("seed", 1 << 63), ("seed", -(1 << 63) - 1),
    ("tool_choice", "auto"), ("tool_choice", {"type": "function", "function": {"name": "f"}}),
])
def test_compatibility_fields_are_still_checked(client, field, value):
    r = chat(client, **{field: value})
    assert r.status_code == 400, r.get_data(as_text=True)
    assert r.get_json()["error"]["param"].startswith(field)


def test_seed_takes_the_whole_signed_64_bit_range(client):
    for seed in (-(1 << 63), (1 << 63) - 1):
        assert chat(client, seed=seed).status_code == 200


def test_reasoning_effort_maps_onto_the_templates_thinking_switch():
    from pantheon.web.chat import parse_chat_request
    base = {"messages": HELLO}
    assert parse_chat_request({**base, "reasoning_effort": "high"}, {}).enable_thinking is True
    assert parse_chat_request({**base, "reasoning_effort": "minimal"}, {}).enable_thinking is False
    assert parse_chat_request(base, {}).enable_thinking is None
    explicit = {**base, "reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": False}}
    assert parse_chat_request(explicit, {}).enable_thinking is False  # the explicit switch wins


# ---- small routes (issue 20, item 6) ----------------------------------------------------------------------
def test_a_model_by_id(client):
    r = client.get("/v1/models/m")
    assert r.status_code == 200 and r.get_json()["id"] == "m" and r.get_json()["object"] == "model"
    r = client.get("/v1/models/nope")
    assert r.status_code == 404 and r.get_json()["error"]["code"] == "model_not_found"


def test_tokenize_and_detokenize_in_llama_cpp_shapes(client, app_and_reg):
    r = client.post("/tokenize", json={"content": "hi"})
    assert r.status_code == 200 and r.get_json() == {"tokens": [104, 105]}
    r = client.post("/tokenize", json={"content": "hi", "with_pieces": True, "model": "m"})
    assert r.get_json() == {"tokens": [{"id": 104, "piece": "h"}, {"id": 105, "piece": "i"}]}
    r = client.post("/detokenize", json={"tokens": [104, 105]})
    assert r.status_code == 200 and r.get_json() == {"content": "hi"}
    assert in_flight(app_and_reg[1]) == 0  # the reference taken for the call is given back


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"content": 5}, "content"), ("/tokenize", {"content": "x", "add_special": "yes"}, "add_special"),
    ("/tokenize", {"content": "x", "extra": 1}, "extra"), ("/detokenize", {"tokens": "104"}, "tokens"),
    ("/detokenize", {"tokens": [True]}, "tokens"), ("/detokenize", {"tokens": [-1]}, "tokens"),
])
def test_tokenize_routes_refuse_bad_bodies(client, path, body, param):
    r = client.post(path, json=body)
    assert r.status_code == 400 and r.get_json()["error"]["param"] == param
