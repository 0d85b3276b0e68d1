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


# ---- issue 31's phases: the helpers that judge what came back ------------------------------------------------
def _stream(times, kind="done", status=200, first=0.2):
    res = rb.StreamResult(status=status, outcome=kind, times=list(times), chunks=max(0, len(times) - 1))
    res.first_chunk_s = first
    return res


def test_witness_gaps_are_taken_within_streams():
    # two streams; the 5 s between them is a new stream's wait, not a token gap
    streams = [_stream([10.0, 10.1, 10.2, 10.3]), _stream([15.0, 15.1, 16.6, 16.7])]
    ok = rb.to_answer(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}", "complete", 0.05)
    w = rb.witness_summary(streams, [ok, ok], t0=10.0)
    assert w["max_gap_ms"] == pytest.approx(1500.0) and w["worst_gap_at_s"] == 6.6
    assert w["gaps"] == 6 and w["streams"] == 2 and w["by_outcome"] == {"done": 2}
    assert w["newcomers"] == {"sent": 2, "by_status": {"200": 2}, "p50_ms": 50.0, "p99_ms": 50.0, "max_ms": 50.0}
    empty = rb.witness_summary([], [], 0.0)
    assert empty["max_gap_ms"] is None and empty["chunks"] == 0


def test_judge_attack_applies_issue_31_acceptance():
    calm = {"probes": 50, "failed": 0, "p99_ms": 40.0, "max_ms": 60.0, "worst_at_s": 1.0}
    steady = {"max_gap_ms": 300.0, "p99_gap_ms": 120.0, "chunks": 500, "by_outcome": {"done": 3, "stopped": 1},
              "newcomers": {"by_status": {"200": 10}}}
    assert rb.judge_attack("grammar", {"4xx": 3, "2xx": 1}, calm, steady, 35.0) == []
    stalled = {**steady, "max_gap_ms": 3000.0, "by_outcome": {"done": 1, "4xx": 1},
               "newcomers": {"by_status": {"200": 4, "429": 2}}}
    got = rb.judge_attack("embeddings", {"5xx": 1, "hang": 2}, {**calm, "p99_ms": 1800.0, "failed": 1}, stalled, 35.0)
    text = "\n".join(got)
    for want in ("1 requests got a 5xx", "2 requests got no answer", "GET / p99 1800.0 ms", "probes failed",
                 "waited 3000.0 ms", "witness streams ended badly: 4xx: 1", "plain chats sent meanwhile got 429: 2"):
        assert want in text
    assert any("never streamed" in f for f in rb.judge_attack("x", {}, calm, {"chunks": 0}, 35.0))
    assert rb.judge_attack("x", {}, {**calm, "p99_ms": 999.9}, {**steady, "max_gap_ms": 999.9}, 35.0) == []


def test_quiet_after_needs_two_quiet_samples_in_a_row():
    samples = [(0.5, False), (1.0, True), (1.5, False), (2.0, True), (2.5, True), (3.0, True)]
    assert rb.quiet_after(samples) == 1.5  # quiet from the end of the last busy sample
    assert rb.quiet_after([(0.5, True), (1.0, True)]) == 0.0
    assert rb.quiet_after([(0.5, False), (1.0, True)]) is None and rb.quiet_after([]) is None


def test_judge_quiet_flags_work_nobody_waits_for():
    compiling = {"pantheon-gramma": {"threads": 4, "cpu_s_after_clients": 12.5}}
    over = rb.judge_quiet("grammar", {"measured": True, "busy_s": None, "budget_s": 60.0, "threads_added": compiling})
    assert over == ["grammar: the worker kept working for more than 60 s after every client was done or gone "
                    "(threads born in the phase: pantheon-gramma x4 (12.5 CPU s))"]
    assert "for 9.5 s" in rb.judge_quiet("grammar", {"measured": True, "busy_s": 9.5, "threads_added": {}})[0]
    assert rb.judge_quiet("grammar", {"measured": True, "busy_s": 2.5}) == []
    assert rb.judge_quiet("grammar", {"measured": False}) == []


def test_task_stat_parsing():
    line = "4242 (pantheon-gramma) R 1 2 3 4 5 6 7 8 9 10 250 50 0 0 20 0 1 0 100 0 0"
    assert rb.parse_task_stat(line) == ("pantheon-gramma", 300 / rb.CLOCK_TICKS)
    assert rb.parse_task_stat("7 (a (b) c) S 1 2 3 4 5 6 7 8 9 10 1 2 0")[0] == "a (b) c"
    assert rb.parse_task_stat("garbage") is None and rb.parse_task_stat("1 (x) S 1 2") is None


def test_this_process_threads_are_read():
    import os
    tasks = rb.task_cpu(os.getpid())
    assert os.getpid() in tasks and all(cpu >= 0 for _, cpu in tasks.values())
    assert sum(rb.thread_names(os.getpid()).values()) == len(tasks) and rb.task_cpu(None) == {}


def test_tool_markup_detection():
    assert rb.has_tool_markup('<tool_call>\n{"name": "record_note", "arguments": {"text": "ab')
    assert rb.has_tool_markup("</tool_call>") and rb.has_tool_markup("<tool") and rb.has_tool_markup("<tool_call")
    assert not rb.has_tool_markup("") and not rb.has_tool_markup("a river runs <b>") and not rb.has_tool_markup("<")
    calls = [{"name": "record_note", "arguments": '{"text": "ab'}]
    assert rb.tool_cut_problems("", calls, expect_calls=True) == []
    assert rb.tool_cut_problems("<tool_", [], expect_calls=False) == ["tool-call markup in content: '<tool_'"]
    assert rb.tool_cut_problems("", [], expect_calls=True) == ["no tool_calls"]


def test_chat_message_and_cached_tokens():
    obj = {"choices": [{"message": {"content": None, "tool_calls": [
        {"type": "function", "function": {"name": "record_note", "arguments": "{\"te"}}]}, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 45, "prompt_tokens_details": {"cached_tokens": 44}}}
    assert rb.chat_message(obj) == ("", [{"name": "record_note", "arguments": "{\"te"}], "length")
    assert rb.chat_message({"choices": []}) == ("", [], None) and rb.chat_message(None) == ("", [], None)
    assert rb.cached_tokens(obj) == 44 and rb.cached_tokens({"usage": {}}) is None


def test_streamed_tool_call_deltas_are_gathered():
    res = rb.StreamResult()
    for chunk in ({"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"name": "record_note",
                                                                                   "arguments": ""}}]}}]},
                  {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{\"text\": "}}]}}]},
                  {"choices": [{"delta": {}, "finish_reason": "length"}]},
                  {"choices": [{"text": "echoed", "index": 0}]}):
        rb._read_chunk(json.dumps(chunk).encode(), res)
    assert res.tool_calls == {0: {"name": "record_note", "arguments": "{\"text\": "}}
    assert res.finish_reason == "length" and res.text == "echoed"


def test_scope_pairs_collide_under_the_old_framing():
    """Why these pairs: with each part written as 0x01 + text + 0x00 (0x00 when missing), a NUL inside
    one part fakes a boundary, so both requests of a pair hashed to one scope (cached_tokens 44 of 45)."""
    def framed(parts):
        return b"".join(b"\x00" if p is None else b"\x01" + p.encode() + b"\x00" for p in parts)

    def parts(extra):
        return [None, extra.get("user"), extra.get("session_id"), extra.get("cache_salt")]

    for _, first, second in rb.SCOPE_PAIRS:
        assert first != second and framed(parts(first)) == framed(parts(second))
    _, a, b = rb.SCOPE_CONTROL
    assert a == b


def test_transfer_encoding_requests():
    payload = b'{"messages": []}'
    raw = rb.te_request(8000, payload, ("gzip", "chunked"), "gzip")
    head, body = raw.split(b"\r\n\r\n", 1)
    assert head.count(b"Transfer-Encoding:") == 2 and b"Content-Length" not in head
    size, rest = body.split(b"\r\n", 1)
    assert rest.endswith(b"\r\n0\r\n\r\n")
    assert rb.gzip.decompress(rest[:int(size, 16)]) == payload
    plain = rb.te_request(8000, payload, ("gzip, chunked",), "identity")
    assert b"Transfer-Encoding: gzip, chunked\r\n" in plain and plain.endswith(b"10\r\n" + payload + b"\r\n0\r\n\r\n")


def test_id_list_body_fills_the_budget_exactly():
    for pool, budget, cap in (([5, 17, 301], 1000, None), ([9], 64, None), ([12, 3], 5000, 100), ([42], 27, None)):
        body, n = rb.id_list_body(pool, budget, cap, "m")
        obj = json.loads(body)
        assert len(obj["tokens"]) == n > 0 and len(body) <= budget and obj["model"] == "m"
        assert set(obj["tokens"]) <= set(pool)
        if cap is None:
            assert len(body) + len(str(pool[n % len(pool)])) + 1 > budget  # one more id would not fit
    assert rb.id_list_body([7], 1 << 22, rb.DETOKENIZE_IDS)[1] == rb.DETOKENIZE_IDS
    assert rb.short_ids([1234, 5, 77, 5, 9]) == [5, 9, 77, 1234]


def test_attack_inputs_have_the_issue_sizes():
    schema = rb.optional_schema(10_000)
    assert len(schema["properties"]) == 10_000 and "required" not in schema
    assert 250_000 < len(json.dumps(schema)) < 450_000  # the issue's 10k schema was 300 kB
    tools = rb.huge_tools(2_400_000)
    assert 2_200_000 < len(json.dumps(tools)) < 2_700_000
    body, n = rb.embeddings_body("m", 2048, 1900, rb.ATTACK_BODY)
    assert len(body) <= rb.ATTACK_BODY and 1900 < n <= 2048
    texts = json.loads(body)["input"]
    assert len(set(texts)) == n and all(len(t) == 1900 for t in texts)
    assert rb.words_text(0) == "" and len(rb.words_text(20_000, lead="x: ")) == 20_000


def test_slow_refusals_and_left_clients():
    attacks = [{"input": "a", "status": 400, "ms": 12.0}, {"input": "b", "status": 400, "ms": 25_000.0},
               {"input": "c", "status": 200, "ms": 9000.0}, {"input": "d", "status": None, "ms": 3000.0}]
    assert [a["input"] for a in rb.slow_refusals(attacks)] == ["b"]
    gone = rb.left(rb.to_answer(b"", "timeout", 3.0))
    assert gone.kind == "left"
    t = rb.Tally()
    t.add(gone, "client gone after 3 s")
    assert t.kinds == {"left": 1} and "hang" not in t.examples


def test_new_phases_are_selectable_and_bounded():
    cfg = rb.config_from(rb.build_parser().parse_args(["--quick", "--phases", "grammar,protocol",
                                                       "--grammar-sizes", "100,200"]))
    assert cfg.phases == ("protocol", "grammar") and cfg.grammar_sizes == (100, 200)
    assert rb.check(cfg) is None and cfg.budget_s() < 2000
    assert rb.check(rb.config_from(rb.build_parser().parse_args(["--grammar-sizes", "0"]))) is not None
    full = rb.Config()
    assert set(rb.ATTACK_PHASES) <= set(full.phases) and full.budget_s() > rb.Config(phases=("fuzz",)).budget_s()


def test_issue_43_phases_are_selectable_and_judge_the_rss():
    names = "images,truncation,generations,embed-many,count-tokens,responses-store"
    cfg = rb.config_from(rb.build_parser().parse_args(["--quick", "--phases", names]))
    assert cfg.phases == ("truncation", "generations", "embed-many", "count-tokens", "responses-store", "images")
    assert set(cfg.phases) <= set(rb.ATTACK_PHASES) and set(cfg.phases) <= set(rb.PHASE_FUNCS)
    assert rb.check(cfg) is None
    assert rb.judge_rss("x", 1000.0, 1100.0) == [] and rb.judge_rss("x", None, 5000.0) == []
    assert "1000 -> 1101 MiB" in rb.judge_rss("x", 1000.0, 1101.0)[0]


def test_the_images_phase_sends_pngs_at_the_pixel_limit_that_fit_the_body():
    import base64
    import io

    from PIL import Image
    url = rb.big_png_url(rb.IMAGE_SIDE)
    data = base64.b64decode(url.split(",", 1)[1])
    assert Image.open(io.BytesIO(data)).size == (rb.IMAGE_SIDE, rb.IMAGE_SIDE)
    assert rb.IMAGE_SIDE ** 2 <= rb.load_settings({}).max_image_pixels
    assert rb.IMAGES_PER_CHAT * len(url) < rb.ATTACK_BODY
