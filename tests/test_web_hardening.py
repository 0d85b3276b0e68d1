"""What an adversarial run found (issue 22), each as a specification the server now meets.

One real server (pantheon's gunicorn worker, the tiny llama fixture, batching on) with short client
deadlines so slow-client cases finish in seconds: headers within 2 s, a body within 6 s and at
least 1 KiB/s after the first 5 s, at most 24 connections. Every answer is checked for the OpenAI
error shape, and the server must still serve afterwards.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import requests

from server_util import LLAMA, assert_error, sse_events, start_server

pytestmark = pytest.mark.slow  # a real server process (make test-quick leaves it out)

KEY = "hardening-key"
ADMIN = "hardening-admin"
MAX_CONNS = 24
HEADER_S = 2.0
BODY_S = 6.0
HELLO = [{"role": "user", "content": "Hello there"}]
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("models")
    s = start_server([f"llama={LLAMA}"], env={
        "PANTHEON_API_KEY": KEY, "PANTHEON_ADMIN_KEY": ADMIN, "PANTHEON_MODEL_DIR": str(model_dir),
        "PANTHEON_WARMUP": "0", "PANTHEON_HEADER_TIMEOUT_S": str(HEADER_S),
        "PANTHEON_BODY_TIMEOUT_S": str(BODY_S), "PANTHEON_MAX_CONNECTIONS": str(MAX_CONNS),
        "PANTHEON_CORS_ORIGINS": "http://ok.example"})
    yield s
    s.stop()


def auth(key: str = KEY) -> dict:
    return {**JSON, "Authorization": f"Bearer {key}"}


def post_raw(srv, data: bytes, path: str = "/v1/chat/completions", headers: dict | None = None):
    return requests.post(srv.url + path, data=data, headers=auth() if headers is None else headers, timeout=30)


def connect(srv, timeout: float = 30.0) -> socket.socket:
    return socket.create_connection(("127.0.0.1", srv.port), timeout=timeout)


def read_until_closed(sock: socket.socket, deadline_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and when it closed (s from now)."""
    t0 = time.monotonic()
    sock.settimeout(deadline_s)
    out = b""
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                break
            out += data
    except (socket.timeout, ConnectionResetError):
        pass
    return out, time.monotonic() - t0


def json_error(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    assert b"application/json" in head.lower(), head
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    return status, err


def partial_body_request(n_sent: int = 10, length: int = 126) -> bytes:
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n").encode() + b"{" * n_sent


def health_ms(srv) -> float:
    t0 = time.monotonic()
    r = requests.get(srv.url + "/", timeout=10)
    assert r.status_code == 200
    return (time.monotonic() - t0) * 1000


# ---- 1. slow clients ---------------------------------------------------------------------------------------
def test_a_body_that_stops_arriving_is_answered_408_and_closed(srv):
    with connect(srv) as s:
        s.sendall(partial_body_request())
        raw, took = read_until_closed(s, 30)
    status, err = json_error(raw)
    assert status == 408 and err["code"] == "request_timeout"
    assert took < BODY_S + 2  # the minimum rate cuts it after the grace, the whole-body deadline at the latest


def test_a_body_sent_at_one_byte_a_second_is_cut_off(srv):
    with connect(srv) as s:
        s.sendall(partial_body_request(n_sent=0, length=4000))
        t0 = time.monotonic()
        status = None
        while time.monotonic() - t0 < 20:
            try:
                s.sendall(b" ")
            except OSError:
                break
            s.settimeout(1.0)
            try:
                data = s.recv(65536)
            except socket.timeout:
                continue
            if data:
                status, _ = json_error(data + read_until_closed(s, 5)[0])
            break
        took = time.monotonic() - t0
    assert status == 408
    assert took < BODY_S + 2


def test_headers_that_never_finish_are_closed_at_the_header_deadline(srv):
    with connect(srv) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        raw, took = read_until_closed(s, 30)
    assert raw == b"" and took < HEADER_S + 2


def test_stalled_connections_past_the_cap_cannot_lock_out_health(srv):
    """Three times the cap of half-sent requests: each new one evicts the longest-stalled, GET / stays fast."""
    socks = []
    try:
        for _ in range(3 * MAX_CONNS):
            s = connect(srv, timeout=5)
            s.sendall(partial_body_request())
            socks.append(s)
        times = [health_ms(srv) for _ in range(10)]
        assert max(times) < 1000, times
        r = requests.post(srv.url + "/v1/chat/completions", headers=auth(), timeout=60,
                          json={"messages": HELLO, "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200
    finally:
        for s in socks:
            s.close()


def test_a_large_body_is_refused_quickly_and_never_stalls_other_requests(srv):
    """A 3.9 MB message (under the 4 MiB limit): 400 context_length_exceeded, while a running stream
    runs to its end and GET / answers."""
    big = json.dumps({"messages": [{"role": "user", "content": "a" * 3_900_000}]}).encode()
    stream = requests.post(srv.url + "/v1/chat/completions", headers=auth(), stream=True, timeout=120,
                           json={"messages": HELLO, "max_tokens": 60, "temperature": 0, "stream": True,
                                 "ignore_eos": True})
    assert stream.status_code == 200
    gaps: list[float] = []
    lines: list[bytes] = []

    def read_stream() -> None:
        last = time.monotonic()
        for line in stream.iter_lines():
            if line:
                now = time.monotonic()
                gaps.append(now - last)
                lines.append(line)
                last = now

    reader = threading.Thread(target=read_stream)
    reader.start()
    answers: list[tuple[int, float, str]] = []

    def send_big() -> None:
        t0 = time.monotonic()
        r = post_raw(srv, big)
        answers.append((r.status_code, time.monotonic() - t0, r.json()["error"]["code"]))

    senders = [threading.Thread(target=send_big) for _ in range(2)]
    for t in senders:
        t.start()
    health = [health_ms(srv) for _ in range(5)]
    for t in senders:
        t.join(60)
    reader.join(120)
    assert [a[0] for a in answers] == [400, 400] and {a[2] for a in answers} == {"context_length_exceeded"}
    assert not reader.is_alive() and lines[-1] == b"data: [DONE]"  # the stream ran to its end
    assert json.loads(lines[-2][len(b"data: "):])["choices"][0]["finish_reason"] == "length"
    # Figures, not criteria (a wall-clock bound fails on a loaded machine and proves nothing on a quiet
    # one); what keeps the hub free is held structurally in test_web_bounds.py (long texts
    # tokenized in OS threads, over-long prompts refused before tokenizing).
    print(f"big bodies answered in {[round(a[1], 3) for a in answers]} s; GET / {[round(h) for h in health]} ms; "
          f"largest gap between stream frames {max(gaps[1:] or [0]):.3f} s")


# ---- 4. validation that never raises ---------------------------------------------------------------------
@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                                   "frequency_penalty", "max_tokens", "seed", "top_k"])
def test_an_integer_literal_past_1e308_is_a_400(srv, field):
    body = b'{"messages": [{"role": "user", "content": "hi"}], "%s": 1%s}' % (field.encode(), b"0" * 400)
    err = assert_error(post_raw(srv, body), 400)
    assert err["param"] == field


@pytest.mark.parametrize("raw", [b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
                                 b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}]}',
                                 b'{"messages": [{"role": "user", "content": "ok"}], "\\udfff": 1}',
                                 b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00x"}]}]}'])
def test_a_lone_surrogate_anywhere_is_a_400(srv, raw):
    assert_error(post_raw(srv, raw), 400)


def test_arguments_nested_500_deep_are_a_400(srv):
    args = "[" * 500 + "]" * 500
    raw = ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": null, '
           '"tool_calls": [{"type": "function", "function": {"name": "f", "arguments": %s}}]}, '
           '{"role": "user", "content": "again"}]}' % args).encode()
    err = assert_error(post_raw(srv, raw), 400)
    assert "nested" in err["message"]


def test_a_million_character_field_name_is_not_echoed_back(srv):
    r = post_raw(srv, json.dumps({"messages": HELLO, "x" * 1_000_000: 1}).encode())
    assert_error(r, 400)
    assert len(r.content) < 2000


@pytest.mark.parametrize("path", ["\ud800.gguf", "a" * 300 + ".gguf", "dir/" + "b" * 256 + "/m.gguf"])
def test_admin_paths_that_the_file_system_refuses_are_a_400(srv, path):
    body = json.dumps({"path": path}, ensure_ascii=True).encode()
    err = assert_error(post_raw(srv, body, "/admin/models/load", headers=auth(ADMIN)), 400)
    assert err["param"] == "path" or "surrogate" in err["message"]


def test_a_chunked_body_with_a_bad_size_line_is_a_400(srv):
    with connect(srv) as s:
        s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                  "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n".encode())
        raw, _ = read_until_closed(s, 10)
    status, _ = json_error(raw)
    assert status == 400



def test_a_gzip_then_chunked_body_is_refused_not_read_as_json(srv):
    """gunicorn un-chunks `gzip, chunked` and would hand the app compressed bytes (issue 31, item 11)."""
    body = b'{"messages": [{"role": "user", "content": "hi"}]}'
    with connect(srv) as s:
        s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                  "Content-Type: application/json\r\nTransfer-Encoding: gzip, chunked\r\n\r\n".encode()
                  + f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n")
        raw, _ = read_until_closed(s, 10)
    status, err = json_error(raw)
    assert status == 501 and err["code"] == "unsupported_transfer_coding"

# ---- 5. the right status ---------------------------------------------------------------------------------
def test_a_chunked_body_over_the_limit_is_413_not_malformed_json(srv):
    def chunks():
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(80):
            yield b"x" * 65536  # 5 MiB in all, over the default 4 MiB
        yield b'"}]}'

    r = requests.post(srv.url + "/v1/chat/completions", data=chunks(), headers=auth(), timeout=60)
    assert_error(r, 413)


@pytest.mark.parametrize("request_bytes,status", [
    (b"GARBAGE\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nBad Header Name: x\r\n\r\n", 400),
    (b"GET / HTTP/7.9\r\nHost: x\r\n\r\n", 400),
    (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414),
    (b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n", 431),
])
def test_malformed_http_gets_the_openai_error_shape(srv, request_bytes, status):
    with connect(srv) as s:
        s.sendall(request_bytes)
        raw, _ = read_until_closed(s, 10)
    got, _ = json_error(raw)
    assert got == status


@pytest.mark.parametrize("ctype", [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data"])
def test_a_body_that_is_not_json_typed_is_415(srv, ctype):
    headers = {"Authorization": f"Bearer {KEY}", "Origin": "http://ok.example"}
    if ctype:
        headers["Content-Type"] = ctype
    body = json.dumps({"messages": HELLO, "max_tokens": 1}).encode()
    r = requests.post(srv.url + "/v1/chat/completions", data=body, headers=headers, timeout=30)
    assert_error(r, 415)


def test_json_with_a_charset_is_accepted(srv):
    r = post_raw(srv, json.dumps({"messages": HELLO, "max_tokens": 1}).encode(),
                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 200


# ---- 3. prefix reuse is scoped per tenant ------------------------------------------------------------------
SECRET = [{"role": "system", "content": "The vault code is 4-7-1-9-3-3-8. Never say it."},
          {"role": "user", "content": "What is the code?"}]


def cached(srv, key: str = KEY, **extra) -> int:
    headers = auth(key)
    if "session" in extra:
        headers["X-Session-Id"] = extra.pop("session")
    r = requests.post(srv.url + "/v1/chat/completions", headers=headers, timeout=60,
                      json={"messages": SECRET, "max_tokens": 1, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_cached_tokens_never_reveal_another_sessions_prompt(srv):
    cached(srv, session="victim")
    assert cached(srv, session="attacker") == 0
    assert cached(srv, session="victim") > 0  # a session still reuses its own prefix


def test_user_and_cache_salt_scope_reuse_too(srv):
    cached(srv, user="alice")
    assert cached(srv, user="bob") == 0
    assert cached(srv, user="alice") > 0
    cached(srv, cache_salt="s1")
    assert cached(srv, cache_salt="s2") == 0
    assert cached(srv, cache_salt="s1") > 0


def test_the_server_still_serves_identically_after_all_of_it(srv):
    r = requests.post(srv.url + "/v1/chat/completions", headers=auth(), timeout=60,
                      json={"messages": HELLO, "max_tokens": 8, "temperature": 0, "stream": True})
    events = sse_events(r)
    assert events[-1] == "[DONE]" and all(not isinstance(e, dict) or "error" not in e for e in events)
    metrics = requests.get(srv.url + "/metrics", headers=auth(), timeout=10).text
    running = [line for line in metrics.splitlines() if line.startswith("pantheon_running_requests{")]
    assert running and all(line.endswith(" 0.0") for line in running), running
    assert srv.proc.poll() is None
