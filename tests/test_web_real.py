"""End to end on real catalog models: smollm2-135m at startup, qwen-0.5b loaded at runtime for tools.

Real models generate slowly enough on a CPU to test what the tiny ones finish too fast for: a load
(tens of seconds) running while another model streams and the cheap routes keep answering, a
duplicate load refused while the first is in progress, and unload meeting a request in flight
(409 with a timeout, or waiting for it) without the request losing anything.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import openai
import pytest

from conftest import wait_until
from server_util import assert_error, start_server

pytestmark = pytest.mark.real

ADMIN = "real-admin"
QUESTION = [{"role": "user", "content": "Name three colours of the rainbow."}]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"}},
                   "required": ["city"]}}}


def counts(usage: dict) -> tuple[int, int, int]:
    """Token counts of a usage object (cached_tokens legitimately differs when a prefix is reused)."""
    return usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]


# Its own server, not server_util.SMOL: these tests watch its start-up (503 "loading" first), load a
# second model into a memory budget, and finally unload smol itself.
@pytest.fixture(scope="module")
def srv():
    s = start_server(["smol=smollm2-135m"], timeout=400,
                     env={"PANTHEON_BATCH_SLOTS": "0", "PANTHEON_MAX_SEQ": "512", "PANTHEON_ADMIN_KEY": ADMIN,
                          # smol (~0.2 GB) and one qwen-0.5b (~0.65 GB: its blocks + f16 caches) fit, two do not
                          "PANTHEON_DIE_BUDGET_MB": "1300"})
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def admin(srv, path, body):
    return srv.post("/admin" + path, body, key=ADMIN, timeout=600)


def stream_text(events) -> str:
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events
                   if isinstance(e, dict) and e.get("choices"))


@pytest.fixture(scope="module")
def qwen_load(srv):
    """Start loading qwen-0.5b (tens of seconds) at once; the smollm2 tests below run during the upload."""
    result: dict = {}

    def run():
        result["r"] = admin(srv, "/models/load", {"model": "qwen-0.5b", "name": "qwen"})

    t = threading.Thread(target=run)
    t.start()
    wait_until(lambda: not t.is_alive() or any(m["name"] == "qwen" for d in srv.get("/admin/dies", key=ADMIN).json()["data"]
                                               for m in d["models"]), 120, "the registry to list the load")
    yield t, result
    t.join(600)


def test_startup_answered_loading_first(srv):
    assert (503, {"service": "pantheon", "status": "loading"}) in srv.seen_statuses
    assert srv.seen_statuses[-1][0] == 200


def test_duplicate_load_is_409_while_loading(srv, qwen_load):
    thread, _ = qwen_load
    assert thread.is_alive(), "the load finished before it could be observed"
    err = assert_error(admin(srv, "/models/load", {"model": "qwen-0.5b", "name": "qwen"}), 409)
    assert err["code"] == "model_busy"
    # serviceable during the upload: cheap routes answer while it runs and list only what is ready
    for _ in range(5):
        t0 = time.perf_counter()
        assert srv.get("/").status_code == 200
        assert [m["id"] for m in srv.get("/v1/models").json()["data"]] == ["smol"]
        print(f"/ and /v1/models during the load: {1000 * (time.perf_counter() - t0):.1f} ms")  # a figure
    assert thread.is_alive(), "the load ended before the cheap routes answered: they may have waited for it"


def test_real_chat_while_another_model_loads(srv, client, qwen_load):
    loading = qwen_load[0].is_alive()
    out = client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=24, temperature=0)
    text = out.choices[0].message.content
    assert isinstance(text, str) and text.strip()
    assert out.choices[0].finish_reason in ("stop", "length")
    assert 0 < out.usage.completion_tokens <= 24
    chunks = list(client.chat.completions.create(model="smol", messages=QUESTION, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == out.usage.completion_tokens
    assert loading, "qwen finished loading before the smollm2 requests: the load/stream overlap was not tested"


def test_tokenize_round_trip_on_the_real_model(srv):
    text = "The capital of France is Paris."
    r = srv.post("/tokenize", {"content": text, "model": "smol", "with_pieces": True})
    assert r.status_code == 200, r.text
    toks = r.json()["tokens"]
    assert "".join(t["piece"] for t in toks) == text and len(toks) < len(text)
    back = srv.post("/detokenize", {"tokens": [t["id"] for t in toks], "model": "smol"})
    assert back.status_code == 200 and back.json() == {"content": text}
    assert srv.get("/v1/models/smol").json()["id"] == "smol"


def test_tool_call_on_the_runtime_loaded_model(srv, client, qwen_load):
    thread, result = qwen_load
    thread.join(600)
    r = result["r"]
    assert r.status_code == 200, r.text
    assert r.json()["name"] == "qwen" and r.json()["instance_id"].startswith("inst-")
    assert sorted(m["id"] for m in srv.get("/v1/models").json()["data"]) == ["qwen", "smol"]
    # the model may or may not decide to call the tool; either way the response must be well formed
    out = client.chat.completions.create(
        model="qwen", max_tokens=24, temperature=0, tools=[WEATHER_TOOL], tool_choice="auto",
        messages=[{"role": "user", "content": "What is the weather like in Paris right now?"}])
    choice = out.choices[0]
    assert choice.finish_reason in ("tool_calls", "stop", "length")
    if choice.finish_reason == "tool_calls":
        call = choice.message.tool_calls[0]
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
        assert isinstance(json.loads(call.function.arguments), dict)
    else:
        assert isinstance(choice.message.content, str)
    # a second copy does not fit the 1300 MiB budget next to the first: 507, nothing reserved
    err = assert_error(admin(srv, "/models/load", {"model": "qwen-0.5b", "name": "qwen-b"}), 507)
    assert err["code"] == "insufficient_memory"
    # unloading qwen does not wait for (or disturb) a stream on smol
    result: dict = {}

    def smol_stream():
        # long enough (ignore_eos) to be still streaming when qwen's unload returns
        r = srv.post("/v1/chat/completions", {"model": "smol", "messages": QUESTION, "max_tokens": 600,
                                              "ignore_eos": True, "stream": True}, stream=True, timeout=300)
        lines = r.iter_lines()
        result["first"] = next(line for line in lines if line)
        result["events"] = sse_events_from([result["first"], *lines])

    t = threading.Thread(target=smol_stream)
    t.start()
    wait_until(lambda: "first" in result or not t.is_alive(), 120, "the smol stream's first event")
    assert admin(srv, "/models/unload", {"name": "qwen", "timeout_s": 10}).status_code == 200
    streaming_during_unload = t.is_alive()
    t.join(300)
    assert result["events"][-1] == "[DONE]"
    assert result["events"][-2]["choices"][0]["finish_reason"] in ("stop", "length")
    assert [m["id"] for m in srv.get("/v1/models").json()["data"]] == ["smol"]
    assert streaming_during_unload, "the smol stream ended before the unload returned (overlap not observed)"


def test_unload_meets_a_request_in_flight(srv):
    body = {"model": "smol", "messages": QUESTION, "max_tokens": 24, "temperature": 0}
    reference = srv.post("/v1/chat/completions", body).json()
    results = {}

    def streamer(key):
        r = srv.post("/v1/chat/completions", {**body, "stream": True, "stream_options": {"include_usage": True}},
                     stream=True, timeout=300)
        lines = r.iter_lines()
        first = next(line for line in lines if line)
        results[key + "-started"] = time.monotonic()
        events = sse_events_from([first, *lines])
        results[key] = (time.monotonic(), events)

    # 1) with a timeout shorter than the generation: 409, nothing unloaded, the stream is complete
    t = threading.Thread(target=streamer, args=("a",))
    t.start()
    wait_until(lambda: "a-started" in results or not t.is_alive(), 120, "stream a to start")
    err = assert_error(admin(srv, "/models/unload", {"name": "smol", "timeout_s": 0.2}), 409)
    assert err["code"] == "unload_timeout"
    t.join(300)
    _, events = results["a"]
    assert events[-1] == "[DONE]"
    assert stream_text(events) == reference["choices"][0]["message"]["content"]
    assert counts(events[-2]["usage"]) == counts(reference["usage"])
    assert srv.post("/v1/chat/completions", {**body, "max_tokens": 2}).status_code == 200  # still routable

    # 2) without a timeout: the unload waits for the stream to finish, which loses nothing. The stream is
    # read on a raw socket, and not at all while the unload runs: when the unload's answer is in, the
    # stream's end must already be waiting in that socket (on loopback, bytes sent before the unload's
    # answer arrive before it), which shows the order on the server without a clock.
    raw = _raw_stream(srv, {**body, "stream": True})
    got = b""
    while b"data: " not in got:  # the role chunk: the generation has started
        got += raw.recv(65536)
    r = admin(srv, "/models/unload", {"name": "smol"})
    assert r.status_code == 200, r.text
    raw.setblocking(False)
    while True:  # what had arrived by then, without waiting for more
        try:
            part = raw.recv(65536)
        except BlockingIOError:
            break
        if not part:
            break
        got += part
    raw.close()
    assert b"data: [DONE]" in got, "the unload returned before the stream had ended"
    events = sse_events_from(got.split(b"\r\n\r\n", 1)[1].splitlines())
    assert events[-1] == "[DONE]" and stream_text(events) == reference["choices"][0]["message"]["content"]
    assert_error(srv.post("/v1/chat/completions", body), 503)


def _raw_stream(srv, body: dict) -> socket.socket:
    """POST a chat body as HTTP/1.0 on a plain socket: the answer is the bare SSE body, ended by a close."""
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=300)
    s.sendall(b"POST /v1/chat/completions HTTP/1.0\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    return s


def sse_events_from(lines) -> list:
    out = []
    for line in lines:
        line = line.decode() if isinstance(line, bytes) else line
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out
