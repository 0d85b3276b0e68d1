"""Fast checks of tools/reliability_bench.py's helpers: no server, no model, under a second or two.

The loopback guard is what makes the tool safe to run anywhere, so it is tested against the
spellings that could slip past a looser check; the HTTP framing and parsing helpers decide what
counts as an answer, a hang or a non-JSON error, so they are tested on hand-made bytes.
"""

from __future__ import annotations

import importlib.util
import json
import socket
import sys
import threading
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("reliability_bench", ROOT / "tools" / "reliability_bench.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["reliability_bench"] = mod
    spec.loader.exec_module(mod)
    return mod


rb = _load()


@pytest.mark.parametrize("host", ["localhost", "127.0.0.2", "::1", "[::1]", "0.0.0.0", "10.0.0.1", "example.com",
                                  "127.0.0.1.", " 127.0.0.1", "2130706433", "127.1", "::ffff:127.0.0.1"])
def test_only_127_0_0_1_is_allowed(host):
    with pytest.raises(ValueError, match="only talks to 127.0.0.1"):
        rb.require_loopback(host)
    with pytest.raises(ValueError):
        rb.open_socket(host, 80, 0.1)


def test_loopback_is_allowed():
    assert rb.require_loopback("127.0.0.1") == "127.0.0.1"


def test_cli_refuses_another_host(capsys):
    assert rb.main(["--host", "10.0.0.1"]) == 2
    assert "refusing" in capsys.readouterr().err


def test_request_framing():
    raw = rb.http_request("POST", "/v1/chat/completions", 8000, b'{"a": 1}', {"Content-Type": "application/json"})
    head, body = raw.split(b"\r\n\r\n", 1)
    assert head.startswith(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:8000\r\nConnection: close")
    assert b"Content-Length: 8" in head and body == b'{"a": 1}'


def test_answer_parsing():
    buf = (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 400 BAD REQUEST\r\nContent-Type: application/json\r\n"
           b"Content-Length: 30\r\n\r\n" + b'{"error": {"message": "nope"}}')
    ans = rb.to_answer(buf, "complete", 0.1)
    assert (ans.status, ans.outcome, ans.kind) == (400, "answered", "4xx")
    assert ans.json_error() and ans.message() == "nope"
    html = rb.to_answer(b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/html\r\n\r\n<h1>Bad</h1>", "eof", 0.1)
    assert html.status == 400 and not html.json_error()
    assert rb.to_answer(b"", "timeout", 35.0).kind == "hang"
    assert rb.to_answer(b"", "eof", 0.01).kind == "closed"
    partial = b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc"
    assert rb.to_answer(partial, "timeout", 35.0).outcome == "hang"  # a head but the body never ended


def test_chunked_answers():
    body = b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
    assert rb.body_complete({"transfer-encoding": "chunked"}, body)
    assert not rb.body_complete({"transfer-encoding": "chunked"}, body[:-5])
    assert rb.dechunk(body) == b"hello world"


def test_raw_placeholders_reach_the_wire():
    body = rb.put({"messages": [{"role": "user", "content": "hi"}]}, ("messages", 0, "content"), rb.RAW)
    assert rb.with_raw(body, b'"\xed\xa0\x80"') == b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}]}'
    assert rb.with_raw(rb.put({}, ("t",), rb.RAW), b"1e400") == b'{"t": 1e400}'


def test_stats_and_slope():
    assert rb.stats_ms([0.001, 0.002, 0.003])["max_ms"] == 3.0
    assert rb.stats_ms([])["p99_ms"] is None
    assert rb.slope([(0, 100.0), (1000, 110.0), (2000, 120.0)]) == pytest.approx(0.01)
    assert rb.slope([(5, 1.0), (5, 2.0), (5, 3.0)]) is None


def test_metrics_parsing():
    text = ("# HELP x\npantheon_running_requests{model=\"a\"} 1.0\npantheon_running_requests{model=\"b\"} 2.0\n"
            "pantheon_batch_slots{model=\"a\"} 8.0\n")
    assert rb.parse_metrics(text) == {"pantheon_running_requests": 3.0, "pantheon_batch_slots": 8.0}


def _plan(tmp_path):
    (tmp_path / "other.gguf").write_bytes(b"x")
    b = types.SimpleNamespace(name="served", reload_body={"path": str(tmp_path / "m.gguf"), "name": "served"},
                              admin_key="k", port=8000, model_dir=tmp_path)
    return rb.FuzzPlan(b)


def test_admin_fuzz_never_names_a_real_model(tmp_path):
    plan = _plan(tmp_path)
    assert not plan.harmless({"name": "served"})
    assert not plan.harmless({"path": "other.gguf"})
    assert not plan.harmless([{"model": "smollm2-135m"}])
    assert plan.harmless({"path": "no-such-model.gguf", "dies": [0]})
    unload = rb.http_request("POST", rb.UNLOAD, 8000, json.dumps({"name": "served"}).encode())
    assert not plan.harmless_request(unload)
    assert plan.harmless_request(rb.http_request("POST", rb.UNLOAD, 8000, b"[" * 5000 + b"]" * 5000))


def test_fuzz_cases_are_reproducible_requests(tmp_path):
    plan = _plan(tmp_path)
    first = [c.make() for c in rb.draw_cases(plan.mutated_chat(), 20, seed=3)]
    again = [c.make() for c in rb.draw_cases(plan.mutated_chat(), 20, seed=3)]
    assert first == again and len(first) == 20
    for raw in first + [c.make() for c in rb.draw_cases(plan.chunked(), 10, seed=1)]:
        assert raw.startswith(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:8000\r\n")


def test_exchange_against_a_local_listener():
    """One real exchange: a tiny server on 127.0.0.1 that answers once, and one that never answers."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(2)
    port = srv.getsockname()[1]
    release = threading.Event()

    def serve():
        conn, _ = srv.accept()
        conn.recv(1024)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        conn.close()
        silent, _ = srv.accept()  # the second client gets nothing: a hang
        silent.recv(1024)
        release.wait(30)  # silent until the client has given up (30 s: a hang guard)
        silent.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    ok = rb.exchange(port, rb.http_request("GET", "/", port), 5.0)
    assert (ok.status, ok.body, ok.outcome) == (200, b"ok", "answered")
    hung = rb.exchange(port, rb.http_request("GET", "/", port), 0.3)
    release.set()
    print(f"gave up after {hung.elapsed:.2f} s")  # a figure; the outcome is the criterion
    assert hung.outcome == "hang"  # it gave up at its timeout: the server was still silent then
    t.join(30)
    srv.close()


def test_expected_statuses_are_not_5xx():
    t = rb.Tally()
    busy = rb.to_answer(b'HTTP/1.1 503 X\r\nContent-Type: application/json\r\nContent-Length: 24\r\n\r\n'
                        b'{"error": {"message": 1}}', "eof", 0.1)
    t.add(busy, "during unload", expected=(503,))
    t.add(busy, "anything else")
    assert t.kinds == {"expected 503": 1, "5xx": 1}
    assert [e["input"] for e in t.examples["5xx"]] == ["anything else"]
