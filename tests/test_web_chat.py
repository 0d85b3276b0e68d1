"""End-to-end chat completions against a real gunicorn+gevent server with two tiny random-weight models.

The server runs the single-user path (PANTHEON_BATCH_SLOTS=0), so it also covers 429 + Retry-After and
that a client disconnect frees the model's lock at once. An API key is set (401 checks); the admin API
is left off (403). Bodies are capped at 64 KiB (413).
"""

from __future__ import annotations

import json
import socket
import threading
import time

import openai
import pytest
import requests

from server_util import LLAMA, QWEN2, assert_error, sse_events, start_server

pytestmark = pytest.mark.slow  # a real server process (make test-quick leaves it out)

KEY = "test-key-123"
MAX_BODY = 65536
HELLO = [{"role": "user", "content": "Hello there, how are you?"}]


# Its own server: no other module runs this configuration (the single-user path, an API key, a body
# cap, CORS and no admin API), so conftest.shared_server would save no start.
@pytest.fixture(scope="module")
def srv():
    s = start_server([f"llama={LLAMA}", f"qwen2={QWEN2}"],
                     env={"PANTHEON_BATCH_SLOTS": "0", "PANTHEON_API_KEY": KEY,
                          "PANTHEON_MAX_BODY_BYTES": str(MAX_BODY), "PANTHEON_CORS_ORIGINS": "http://ok.example"})
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def chat(srv, **body):
    body.setdefault("model", "llama")
    body.setdefault("messages", HELLO)
    return srv.post("/v1/chat/completions", body, key=KEY)


def greedy(srv, max_tokens=16, **kw) -> dict:
    r = chat(srv, temperature=0, max_tokens=max_tokens, **kw)
    assert r.status_code == 200, r.text
    return r.json()


# ---- health, models, auth -------------------------------------------------------------------------------
def without_progress(body: dict) -> dict:
    """A health body less the background compile's progress, which a ready server shows while the
    rest of its step programs compile (tested in test_exec_store)."""
    return {k: v for k, v in body.items() if k not in ("progress", "compiling")}


def test_loading_then_ok(srv):
    status, body = srv.seen_statuses[-1]
    assert (status, without_progress(body)) == (200, {"service": "pantheon", "status": "ok"})
    for status, body in srv.seen_statuses[:-1]:
        assert (status, body) == (503, {"service": "pantheon", "status": "loading"})


def test_health_needs_no_key(srv):
    r = srv.get("/")
    assert r.status_code == 200 and without_progress(r.json()) == {"service": "pantheon", "status": "ok"}


def test_models_list(srv, client):
    r = srv.get("/v1/models", key=KEY)
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list"
    assert sorted(m["id"] for m in body["data"]) == ["llama", "qwen2"]
    assert all(m["object"] == "model" and isinstance(m["created"], int) for m in body["data"])
    assert sorted(m.id for m in client.models.list()) == ["llama", "qwen2"]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"X-Api-Key": "wrong"},
                                     {"Authorization": "Basic " + KEY}])
def test_401_without_valid_key(srv, headers):
    assert_error(requests.get(srv.url + "/v1/models", headers=headers, timeout=10), 401)
    assert_error(requests.post(srv.url + "/v1/chat/completions", json={"messages": HELLO}, headers=headers,
                               timeout=10), 401)


def test_x_api_key_header(srv):
    assert requests.get(srv.url + "/v1/models", headers={"X-Api-Key": KEY}, timeout=10).status_code == 200


def test_admin_off_without_admin_key(srv):
    for path, method in (("/admin/dies", "GET"), ("/admin/models/load", "POST"), ("/admin/models/unload", "POST")):
        r = requests.request(method, srv.url + path, json={}, headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
        assert_error(r, 403)


def test_404_and_405_are_json(srv):
    err = assert_error(srv.get("/v2/nothing", key=KEY), 404)
    assert "/v2/nothing" in err["message"]
    r = srv.get("/v1/chat/completions", key=KEY)
    assert_error(r, 405)
    assert "POST" in r.headers["Allow"]
    assert_error(requests.delete(srv.url + "/v1/models", headers={"X-Api-Key": KEY}, timeout=10), 405)


def test_cors(srv):
    r = requests.options(srv.url + "/v1/chat/completions", timeout=10,
                         headers={"Origin": "http://ok.example", "Access-Control-Request-Method": "POST"})
    assert r.status_code == 200
    assert r.headers["Access-Control-Allow-Origin"] == "http://ok.example"
    assert "Authorization" in r.headers["Access-Control-Allow-Headers"]
    r = requests.options(srv.url + "/v1/models", headers={"Origin": "http://evil.example"}, timeout=10)
    assert r.status_code == 200 and "Access-Control-Allow-Origin" not in r.headers
    r = requests.get(srv.url + "/v1/models", headers={"Origin": "http://ok.example", "X-Api-Key": KEY}, timeout=10)
    assert r.headers["Access-Control-Allow-Origin"] == "http://ok.example"


# ---- chat -------------------------------------------------------------------------------------------------
def test_nonstreaming_schema(srv, client):
    body = greedy(srv, max_tokens=8)
    assert body["id"].startswith("chatcmpl-") and len(body["id"]) > 20
    assert body["object"] == "chat.completion" and body["model"] == "llama"
    assert isinstance(body["created"], int)
    (choice,) = body["choices"]
    msg = choice["message"]
    assert msg["role"] == "assistant" and isinstance(msg["content"], str)
    assert {"reasoning_content", "reasoning", "tool_calls"} <= set(msg)
    assert choice["finish_reason"] in ("length", "stop")
    u = body["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    assert 1 <= u["completion_tokens"] <= 8 and u["prompt_tokens"] > 5
    # the official client parses it
    resp = client.chat.completions.create(model="qwen2", messages=HELLO, max_tokens=4, temperature=0)
    assert resp.choices[0].message.role == "assistant" and resp.model == "qwen2"
    assert resp.usage.completion_tokens <= 4
    assert body["id"] != resp.id


def test_stream_concatenates_to_nonstream(srv, client):
    full = greedy(srv, max_tokens=20)
    r = requests.post(srv.url + "/v1/chat/completions", stream=True, timeout=60, headers={"X-Api-Key": KEY},
                      json={"model": "llama", "messages": HELLO, "temperature": 0, "max_tokens": 20, "stream": True,
                            "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"] == full["usage"]
    final = chunks[-2]["choices"][0]
    assert final["finish_reason"] == full["choices"][0]["finish_reason"]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-2])
    assert len({c["id"] for c in chunks}) == 1 and all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[:-1])
    reasoning = "".join(c["choices"][0]["delta"].get("reasoning_content") or "" for c in chunks[:-1])
    assert text == full["choices"][0]["message"]["content"]
    assert (reasoning or None) == full["choices"][0]["message"]["reasoning_content"]
    # and through the official client
    got = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
        model="llama", messages=HELLO, temperature=0, max_tokens=20, stream=True) if ch.choices)
    assert got == text


def test_no_usage_chunk_unless_asked(srv):
    r = srv.post("/v1/chat/completions", {"model": "llama", "messages": HELLO, "max_tokens": 3, "stream": True},
                 key=KEY, stream=True)
    events = sse_events(r)
    assert events[-1] == "[DONE]" and all(e["choices"] for e in events[:-1])


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string(srv, stream):
    content = greedy(srv, max_tokens=24)["choices"][0]["message"]["content"]
    assert len(content) >= 4, "the fixture model's greedy reply is long enough to hold a stop string"
    stop = content[len(content) // 2: len(content) // 2 + 2]
    expected = content[: content.find(stop)]
    body = {"model": "llama", "messages": HELLO, "temperature": 0, "max_tokens": 24, "stop": ["\x00never", stop]}
    if stream:
        r = srv.post("/v1/chat/completions", {**body, "stream": True}, key=KEY, stream=True)
        chunks = sse_events(r)[:-1]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        finish = chunks[-1]["choices"][0]["finish_reason"]
    else:
        out = chat(srv, **body).json()
        text, finish = out["choices"][0]["message"]["content"], out["choices"][0]["finish_reason"]
    assert text == expected and finish == "stop"
    # the cancelled generation released the single-user lock: the next request runs at once
    assert chat(srv, max_tokens=2).status_code == 200


def test_seeded_sampling_is_reproducible(srv):
    a = chat(srv, temperature=0.9, top_p=0.9, top_k=40, min_p=0.01, seed=1234, max_tokens=12,
             repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.2).json()
    b = chat(srv, temperature=0.9, top_p=0.9, top_k=40, min_p=0.01, seed=1234, max_tokens=12,
             repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.2).json()
    assert a["choices"][0]["message"] == b["choices"][0]["message"]


def test_max_tokens_defaults_and_clamps_to_context(srv):
    out = greedy(srv, max_tokens=100000)
    assert out["context_capped"] is True
    u = out["usage"]
    assert u["prompt_tokens"] + u["completion_tokens"] <= 128
    out = chat(srv, temperature=0, max_completion_tokens=3).json()
    assert out["usage"]["completion_tokens"] <= 3 and "context_capped" not in out


def test_context_length_exceeded(srv):
    err = assert_error(chat(srv, messages=[{"role": "user", "content": "word " * 400}]), 400, "messages")
    assert err["code"] == "context_length_exceeded"


def test_unknown_model_404_when_two_are_loaded(srv, client):
    err = assert_error(chat(srv, model="no-such-model"), 404, "model")
    assert err["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=HELLO)


def test_full_conversation_shapes(srv):
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "2+2?"}]},
            {"role": "assistant", "content": None, "refusal": None,
             "tool_calls": [{"id": "call_1", "type": "function",
                             "function": {"name": "add", "arguments": "{\"a\": 2, \"b\": 2}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "4"},
            {"role": "user", "content": "Thanks"}]
    tools = [{"type": "function", "function": {"name": "add", "description": "add two numbers",
                                               "parameters": {"type": "object", "properties": {}}}}]
    # tool_choice "none" renders without the tool preamble (too long for the tiny model's 256-token context;
    # tests/test_web_real.py runs tool calls on a real model)
    r = chat(srv, model="qwen2", messages=msgs, tools=tools, tool_choice="none", max_tokens=6, temperature=0,
             session_id="s-1", user="u", n=1, logprobs=False, parallel_tool_calls=True)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    for tc in ("auto", "required", {"type": "function", "function": {"name": "add"}}):
        r = chat(srv, model="qwen2", messages=msgs, tools=tools, tool_choice=tc, max_tokens=6)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    r = requests.post(srv.url + "/v1/chat/completions", timeout=60,
                      headers={"X-Api-Key": KEY, "X-Session-Id": "abc"},
                      json={"model": "qwen2", "messages": HELLO, "max_tokens": 2})
    assert r.status_code == 200


BAD = [
    ({"messages": HELLO, "foo": 1}, "foo"),
    ({"messages": HELLO, "functions": []}, "functions"),
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    # an image part for a model loaded without a vision projector (tests/test_vision_server.py: with one)
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": "x", "weird": 1}]}, "messages[0].weird"),
    ({"messages": HELLO, "temperature": 3}, "temperature"),
    ({"messages": HELLO, "temperature": "hot"}, "temperature"),
    ({"messages": HELLO, "top_p": 0}, "top_p"),
    ({"messages": HELLO, "top_p": 1.5}, "top_p"),
    ({"messages": HELLO, "top_k": 1.5}, "top_k"),
    ({"messages": HELLO, "min_p": -0.1}, "min_p"),
    ({"messages": HELLO, "repetition_penalty": 0}, "repetition_penalty"),
    ({"messages": HELLO, "presence_penalty": 2.5}, "presence_penalty"),
    ({"messages": HELLO, "frequency_penalty": -3}, "frequency_penalty"),
    ({"messages": HELLO, "seed": "x"}, "seed"),
    ({"messages": HELLO, "seed": True}, "seed"),
    ({"messages": HELLO, "max_tokens": 0}, "max_tokens"),
    ({"messages": HELLO, "max_completion_tokens": -5}, "max_completion_tokens"),
    ({"messages": HELLO, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"messages": HELLO, "stop": 7}, "stop"),
    ({"messages": HELLO, "stream": "yes"}, "stream"),
    ({"messages": HELLO, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": HELLO, "stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ({"messages": HELLO, "n": 2}, "n"),  # the single-user server has one slot: one choice at a time
    ({"messages": HELLO, "logprobs": "yes"}, "logprobs"),
    ({"messages": HELLO, "top_logprobs": 3}, "top_logprobs"),
    ({"messages": HELLO, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": HELLO, "logit_bias": {"x": 1}}, "logit_bias"),
    ({"messages": HELLO, "logit_bias": {"1000000": 1}}, "logit_bias"),
    ({"messages": HELLO, "response_format": {"type": "xml"}}, "response_format.type"),
    ({"messages": HELLO, "tools": {}}, "tools"),
    ({"messages": HELLO, "tools": [{"type": "function"}]}, "tools[0].function"),
    ({"messages": HELLO, "tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
    ({"messages": HELLO, "tool_choice": "required"}, "tool_choice"),
    ({"messages": HELLO, "tool_choice": "sometimes"}, "tool_choice"),
    ({"messages": HELLO, "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice.function.name"),
    ({"messages": HELLO, "model": 5}, "model"),
    ({"messages": HELLO, "session_id": 5}, "session_id"),
    ({"messages": HELLO, "user": ["x"]}, "user"),
    ({"messages": HELLO, "chat_template_kwargs": {"foo": 1}}, "chat_template_kwargs.foo"),
]


@pytest.mark.parametrize("body,param", BAD, ids=[p for _, p in BAD])
def test_400_names_the_field(srv, body, param):
    assert_error(srv.post("/v1/chat/completions", body, key=KEY), 400, param)


def test_client_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="llama", messages=HELLO, temperature=5)
    assert "temperature" in str(info.value)


@pytest.mark.parametrize("raw", [b"{bad json", b"", b"[1, 2]", b"null", b'{"messages": NaN}',
                                 b"\xff\xfe\x00garbage", b"[" * 50000])
def test_malformed_json_400(srv, raw):
    r = requests.post(srv.url + "/v1/chat/completions", data=raw, timeout=30,
                      headers={"X-Api-Key": KEY, "Content-Type": "application/json"})
    assert_error(r, 400)


def test_413_body_too_large(srv):
    big = json.dumps({"messages": [{"role": "user", "content": "x" * (MAX_BODY + 10)}]})
    assert_error(requests.post(srv.url + "/v1/chat/completions", data=big, timeout=30,
                               headers={"X-Api-Key": KEY, "Content-Type": "application/json"}), 413)
    assert srv.get("/").status_code == 200


# ---- single-user path: busy, disconnect ------------------------------------------------------------------
def _open_stream(srv, max_tokens=90, ignore_eos=False):
    r = requests.post(srv.url + "/v1/chat/completions", stream=True, timeout=60, headers={"X-Api-Key": KEY},
                      json={"model": "llama", "messages": HELLO, "max_tokens": max_tokens, "stream": True,
                            "temperature": 0, "ignore_eos": ignore_eos})
    assert r.status_code == 200
    lines = r.iter_lines()
    next(line for line in lines if line)  # the role chunk: the generation has started
    return r, lines


def _until_ok(srv, hang_guard_s: float = 60.0) -> None:
    """Poll until a short chat on llama succeeds (it meets 429 while the lock is still held); fail after
    `hang_guard_s`. How long it took is printed, not asserted: the cancel count says the lock was freed
    by a cancel rather than by the generation running to its end."""
    t0 = time.monotonic()
    while True:
        r = chat(srv, max_tokens=2)
        if r.status_code == 200:
            print(f"lock free after {time.monotonic() - t0:.3f} s")
            return
        assert r.status_code == 429, r.text
        assert time.monotonic() - t0 < hang_guard_s, "the model's lock was not freed"
        time.sleep(0.02)  # poll interval


def test_429_when_single_user_model_is_busy(srv):
    # ignore_eos and the whole context: the slot stays busy long after the next request lands
    r, lines = _open_stream(srv, max_tokens=100_000, ignore_eos=True)
    try:
        busy = chat(srv, max_tokens=2)
        err = assert_error(busy, 429)
        assert err["code"] == "server_busy"
        assert int(busy.headers["Retry-After"]) >= 1
        # another model is not blocked by llama's lock
        assert chat(srv, model="qwen2", max_tokens=2).status_code == 200
    finally:
        list(lines)
        r.close()
    assert chat(srv, max_tokens=2).status_code == 200


def _raw_post(srv, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", srv.port))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"X-Api-Key: " + KEY.encode() + b"\r\nContent-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    return s


def _cancels(srv) -> int:
    return srv.log_tail(1000).count("cancelling after")


def test_stream_disconnect_frees_the_lock(srv):
    before = _cancels(srv)
    s = _raw_post(srv, {"model": "llama", "messages": HELLO, "max_tokens": 100_000, "temperature": 0, "stream": True,
                         "ignore_eos": True})  # the whole context: still running when the hang-up is seen
    got = b""
    while b"data: " not in got:  # the role chunk: the generation has started (tiny models finish in ~0.1 s)
        got += s.recv(65536)
    s.close()  # hang up mid-stream
    _until_ok(srv)
    assert _cancels(srv) == before + 1  # the generation was cancelled, not run to its end


def test_nonstream_disconnect_frees_the_lock(srv):
    before = _cancels(srv)
    s = _raw_post(srv, {"model": "llama", "messages": HELLO, "max_tokens": 100, "temperature": 0})
    s.close()  # gone at once: the server still reads the request, starts it, and must notice
    _until_ok(srv)
    assert _cancels(srv) == before + 1
    assert srv.get("/").status_code == 200


def test_concurrent_requests_to_two_models(srv):
    results = {}

    def run(name):
        results[name] = chat(srv, model=name, max_tokens=30).status_code

    threads = [threading.Thread(target=run, args=(n,)) for n in ("llama", "qwen2")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {"llama": 200, "qwen2": 200}


# ---- /metrics ----------------------------------------------------------------------------------------------
def _scrape(srv) -> dict[tuple, float]:
    from prometheus_client.parser import text_string_to_metric_families

    r = srv.get("/metrics", key=KEY)
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/plain")
    out: dict[tuple, float] = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _delta(before: dict, after: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_metrics_move_when_requests_are_served_rejected_and_disconnected(srv):
    assert srv.get("/metrics").status_code == 401  # guarded by the API key like the other routes
    before = _scrape(srv)
    served = greedy(srv, max_tokens=4)
    r, lines = _open_stream(srv)
    try:
        busy = chat(srv, max_tokens=2)
    finally:
        list(lines)
        r.close()
    s = _raw_post(srv, {"model": "llama", "messages": HELLO, "max_tokens": 100_000, "temperature": 0, "stream": True,
                         "ignore_eos": True})  # the whole context: still running when the hang-up is seen
    got = b""
    while b"data: " not in got:
        got += s.recv(65536)
    s.close()
    _until_ok(srv)
    after = _scrape(srv)
    route = "/v1/chat/completions"
    assert _delta(before, after, "pantheon_http_requests_total", route=route, status="200") >= 2
    assert _delta(before, after, "pantheon_generation_tokens_total", model="llama") >= \
        served["usage"]["completion_tokens"]
    assert _delta(before, after, "pantheon_client_disconnects_total", model="llama") >= 1
    if busy.status_code == 429:
        assert _delta(before, after, "pantheon_rejections_total", status="429") >= 1
        assert _delta(before, after, "pantheon_http_requests_total", route=route, status="429") >= 1
