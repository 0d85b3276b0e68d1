"""`pantheon bench serve` against tiny fake OpenAI-compatible SSE servers (stdlib, loopback), plus one
run against a real Pantheon server on the tiny llama fixture."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from conftest import wait_until
from pantheon.bench import serve as bench_serve
from pantheon.serving.metrics import Metrics

CHUNK_DELAY_S = 0.004


class FakeServer:
    """Streams `min(max_tokens, n_chunks)` one-token chunks, then a usage chunk and [DONE].

    prompt_tokens is the number of words in the messages, so the bench's totals can be checked
    against what this server reported (kept in `reported`)."""

    def __init__(self, n_chunks: int = 5, delay: float = CHUNK_DELAY_S, usage: bool = True,
                 metrics: Metrics | None = None):
        self.n_chunks, self.delay, self.usage = n_chunks, delay, usage
        self.metrics = metrics  # when set, GET /metrics serves it and each request is counted in it
        self.on_request = None  # called after each streamed request (a stand-in scheduler's counters)
        self.reported: list[tuple[int, int]] = []
        self.bodies: list[dict] = []
        self.streaming = self.peak_streaming = 0  # streams open now, and the most ever open at once
        self.cut_short = 0  # streams whose client hung up before the end
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> "FakeServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def _handler(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"  # the body ends when the connection closes

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                if self.path != "/metrics" or fake.metrics is None:
                    self.send_error(404)
                    return
                body, ctype = fake.metrics.render()
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:
                try:
                    self._post()
                except (BrokenPipeError, ConnectionResetError):
                    with fake.lock:
                        fake.cut_short += 1  # the bench gave up on this request (deadline tests)

            def _post(self) -> None:
                if self.path == "/redirect/v1/chat/completions":
                    self.send_response(302)
                    self.send_header("Location", "http://203.0.113.9/v1/chat/completions")
                    self.end_headers()
                    return
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                prompt = sum(len(str(m.get("content", "")).split()) for m in body["messages"])
                completion = min(body["max_tokens"], fake.n_chunks)
                with fake.lock:
                    fake.bodies.append(body)
                    fake.reported.append((prompt, completion))
                    fake.streaming += 1
                    fake.peak_streaming = max(fake.peak_streaming, fake.streaming)
                self.counted = True
                try:
                    self._stream(body, prompt, completion)
                finally:
                    self._closed()
                # after [DONE], like a server that counts a request once its stream is closed: the
                # bench must wait for the request count to settle before trusting the deltas
                time.sleep(0.05)
                if fake.on_request is not None:
                    fake.on_request()
                if fake.metrics is not None:
                    fake.metrics.add_tokens(body["model"], prompt, completion)
                    fake.metrics.add_tokens("other-model", 1000, 1000)
                    fake.metrics.observe_request("/v1/chat/completions", 200)

            def _closed(self) -> None:
                # Called before the last frame goes out (and again, harmlessly, when the handler ends):
                # a client starts its next request only after reading [DONE], so the count never sees
                # one stream's tail overlap the next stream, however slowly this thread is scheduled.
                with fake.lock:
                    if self.counted:
                        self.counted = False
                        fake.streaming -= 1

            def _stream(self, body: dict, prompt: int, completion: int) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()

                def send(obj) -> None:
                    data = obj if isinstance(obj, str) else json.dumps(obj)
                    self.wfile.write(f"data: {data}\n\n".encode())
                    self.wfile.flush()

                base = {"id": "x", "object": "chat.completion.chunk", "model": body["model"]}
                send({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
                for i in range(completion):
                    time.sleep(fake.delay)  # the test's input: a server that takes this long per token
                    send({**base, "choices": [{"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}]})
                send({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
                if fake.usage and body.get("stream_options", {}).get("include_usage"):
                    send({**base, "choices": [], "usage": {
                        "prompt_tokens": prompt, "completion_tokens": completion,
                        "total_tokens": prompt + completion, "prompt_tokens_details": {"cached_tokens": 1}}})
                self._closed()
                send("[DONE]")

        return Handler


def run_json(capsys, *args: str) -> tuple[int, dict]:
    rc = bench_serve.main([*args, "--json", "--no-progress", "--warmup", "0", "--timeout", "60"])
    out = capsys.readouterr().out
    return rc, json.loads(out)


def check_stats(s: dict) -> None:
    assert set(s) == {"mean", "median", "p90", "p99", "max"}
    assert all(v is not None and v > 0 for v in s.values()), s
    assert s["median"] <= s["p90"] <= s["p99"] <= s["max"]


def test_levels_counts_tokens_and_latencies(capsys):
    with FakeServer() as srv:
        rc, out = run_json(capsys, "--url", srv.url, "--model", "fake", "--concurrency", "1,2", "--requests", "4",
                           "--prompt-len", "20", "--gen", "3", "--slo-ttft", "10", "--slo-tpot", "10")
        reported = list(srv.reported)
    assert rc == 0
    assert out["bench"] == "serve" and out["comparison"] is None
    assert out["config"]["concurrency"] == [1, 2] and "api_key" not in json.dumps(out["config"])
    runs = out["results"]
    assert [r["concurrency"] for r in runs] == [1, 2]
    assert len(reported) == 8
    for r, rep in zip(runs, (reported[:4], reported[4:])):
        assert r["server"] == "a" and r["url"] == srv.url
        assert (r["requests"], r["completed"], r["failed"], r["not_sent"]) == (4, 4, 0, 0)
        assert r["input_tokens"] == sum(p for p, _ in rep) and r["output_tokens"] == sum(c for _, c in rep) == 12
        assert r["usage_reported"] == 4 and not r["tokens_estimated"]
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            check_stats(r[key])
        assert r["ttft_ms"]["median"] < r["e2e_ms"]["median"]
        assert r["duration_s"] > 0 and r["request_throughput"] > 0
        assert r["output_tok_s"] == pytest.approx(12 / r["duration_s"], rel=5e-3)
        assert r["total_tok_s"] == pytest.approx(r["input_tok_s"] + r["output_tok_s"], rel=1e-3)
        assert r["cached_tokens"] == 4
        assert r["goodput"]["requests"] == 4 and r["goodput"]["fraction"] == 1.0
        assert r["server_metrics"] is None  # the fake has no /metrics
    assert runs[0]["peak_concurrency"] == 1
    assert 1 <= runs[1]["peak_concurrency"] <= 2
    # every request was greedy, streamed, asked for usage, and its prompt was ~20 words
    assert all(b["temperature"] == 0 and b["stream"] and b["stream_options"] == {"include_usage": True}
               and b["max_tokens"] == 3 and "ignore_eos" not in b for b in srv.bodies)
    assert all(18 <= p <= 22 for p, _ in reported)


def test_tight_slo_and_missing_usage(capsys):
    with FakeServer(usage=False, delay=0.02) as srv:
        rc, out = run_json(capsys, "--url", srv.url + "/v1", "--model", "fake", "--concurrency", "1",
                           "--requests", "2", "--prompt-len", "8", "--gen", "4", "--slo-tpot", "0.001")
    r = out["results"][0]
    assert rc == 0 and r["completed"] == 2
    assert r["tokens_estimated"] and r["usage_reported"] == 0 and r["output_tokens"] == 8  # counted chunks
    assert r["goodput"]["requests"] == 0 and r["goodput"]["slo_ttft_s"] is None
    assert r["cached_tokens"] is None


def test_shared_prefix_and_multi_turn(capsys):
    with FakeServer(n_chunks=2) as srv:
        rc, out = run_json(capsys, "--url", srv.url, "--model", "fake", "--concurrency", "2", "--requests", "5",
                           "--prompt-len", "12", "--gen", "2", "--shared-prefix", "30", "--multi-turn", "2",
                           "--ignore-eos")
        bodies = list(srv.bodies)
    assert rc == 0 and out["results"][0]["completed"] == 5 and len(bodies) == 5
    systems = {b["messages"][0]["content"] for b in bodies}
    assert len(systems) == 1 and all(b["messages"][0]["role"] == "system" for b in bodies)
    assert len(next(iter(systems)).split()) == 30
    assert all(b["ignore_eos"] is True for b in bodies)
    # 5 requests = one 3-turn conversation + one 2-turn one; later turns re-send the history
    lengths = sorted(len(b["messages"]) for b in bodies)
    assert lengths == [2, 2, 4, 4, 6]
    longest = max(bodies, key=lambda b: len(b["messages"]))
    assert [m["role"] for m in longest["messages"]] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert longest["messages"][2]["content"] == "t0 t1 "
    # time to first token by turn: what a later turn's re-sent history costs
    turns = out["results"][0]["by_turn"]
    assert [(t["turn"], t["requests"]) for t in turns] == [(1, 2), (2, 2), (3, 1)]
    assert all(t["ttft_ms"]["median"] is not None for t in turns)
    assert turns[0]["prompt_tokens"] < turns[2]["prompt_tokens"]


def test_dataset(tmp_path, capsys):
    ds = tmp_path / "d.jsonl"
    ds.write_text(json.dumps({"prompt": "one two three"}) + "\n\n" +
                  json.dumps({"messages": [{"role": "user", "content": "four five"}]}) + "\n")
    with FakeServer() as srv:
        rc, out = run_json(capsys, "--url", srv.url, "--model", "fake", "--concurrency", "1", "--requests", "3",
                           "--dataset", str(ds), "--gen", "1")
        contents = [b["messages"][-1]["content"] for b in srv.bodies]
    assert rc == 0 and contents == ["one two three", "four five", "one two three"]
    assert out["results"][0]["input_tokens"] == 8 and out["config"]["prompt_len"] is None


def test_compare_gives_ratios(capsys):
    with FakeServer(delay=0.005) as a, FakeServer(delay=0.1) as b:
        rc, out = run_json(capsys, "--url", a.url, "--compare", b.url, "--model", "fake", "--concurrency", "1",
                           "--requests", "2", "--prompt-len", "8", "--gen", "3")
        order = (len(a.bodies), len(b.bodies))
    assert rc == 0 and order == (4, 4)  # two rounds each
    runs = out["results"]
    assert [(r["server"], r["round"]) for r in runs] == [("a", 0), ("b", 0), ("a", 1), ("b", 1)]
    (comp,) = out["comparison"]
    assert comp["concurrency"] == 1
    ratio = comp["ratio"]
    for key in ("request_throughput", "output_tok_s", "ttft_ms.median", "itl_ms.median", "e2e_ms.median"):
        assert ratio[key] is not None and ratio[key] > 0, key
    # b sleeps 20x longer per chunk (300 ms a request, above a loaded machine's hiccups): it is the
    # slower one (an ordering; the sizes are figures, not criteria)
    print("b / a:", {k: ratio[k] for k in ("itl_ms.median", "e2e_ms.median", "output_tok_s")})
    assert ratio["itl_ms.median"] > 1 and ratio["e2e_ms.median"] > 1 and ratio["output_tok_s"] < 1
    assert ratio["goodput_req_s"] is None  # no SLO given
    med = sorted(r["e2e_ms"]["median"] for r in runs if r["server"] == "a")
    assert comp["a"]["e2e_ms.median"] == pytest.approx((med[0] + med[1]) / 2, abs=1e-3)


def test_reads_pantheon_metrics_deltas(capsys):
    """The names bench serve reads from /metrics are the ones pantheon.serving.metrics exposes."""
    m = Metrics()
    sched = {"prefix_hits": 0, "prefix_misses": 0, "reused_tokens": 0}
    m.set_backend_source(lambda: [("fake", dict(sched)), ("other-model", {"prefix_hits": 99})])
    m.add_tokens("fake", 500, 500)  # earlier traffic: only the delta of the run counts
    with FakeServer(metrics=m) as srv:
        srv.on_request = lambda: sched.update(prefix_hits=sched["prefix_hits"] + 1,
                                              reused_tokens=sched["reused_tokens"] + 5)
        rc, out = run_json(capsys, "--url", srv.url, "--model", "fake", "--concurrency", "1,2", "--requests", "3",
                           "--prompt-len", "8", "--gen", "2")
    assert rc == 0
    first, second = out["results"]
    assert first["server_metrics"] == {"requests": 3, "prompt_tokens": first["input_tokens"],
                                       "generation_tokens": first["output_tokens"], "prefix_hits": 3,
                                       "prefix_misses": 0, "reused_tokens": 15}
    assert second["server_metrics"]["requests"] == 3
    assert second["server_metrics"]["generation_tokens"] == second["output_tokens"] == 6


def test_text_output(capsys):
    with FakeServer() as srv:
        rc = bench_serve.main(["--url", srv.url, "--model", "fake", "--concurrency", "1", "--requests", "2",
                               "--prompt-len", "8", "--gen", "2", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0 and "concurrency 1" in out and "TTFT" in out and "completed 2" in out


@pytest.mark.parametrize("url", ["http://10.1.2.3:8000", "http://example.com", "https://8.8.8.8/v1",
                                 "ftp://127.0.0.1/", "http://user:pw@127.0.0.1:1/"])
def test_refuses_non_loopback_and_odd_urls(url, capsys):
    assert bench_serve.main(["--url", url, "--model", "m", "--requests", "1", "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "pantheon bench serve:" in captured.err


def test_loopback_detection():
    assert all(bench_serve.is_loopback(h) for h in ("127.0.0.1", "127.9.9.9", "::1", "[::1]", "localhost",
                                                   "LOCALHOST.", "::ffff:127.0.0.1"))
    assert not any(bench_serve.is_loopback(h) for h in ("10.0.0.1", "0.0.0.0", "example.com", "localhost.evil.com"))
    t = bench_serve.parse_target("http://example.com:81/v1/", allow_remote=True)
    assert (t.host, t.port, t.chat_path) == ("example.com", 81, "/v1/chat/completions")


def test_redirect_is_not_followed_and_failures_are_counted(capsys):
    with FakeServer() as srv:
        rc, out = run_json(capsys, "--url", srv.url + "/redirect", "--model", "fake", "--concurrency", "1",
                           "--requests", "2", "--prompt-len", "4", "--gen", "1")
    r = out["results"][0]
    assert rc == 1 and (r["completed"], r["failed"], r["not_sent"]) == (0, 2, 0)
    (msg,) = r["errors"]
    assert "302" in msg and "not followed" in msg
    assert r["ttft_ms"]["median"] is None


def test_unreachable_server_and_deadline(capsys):
    from server_util import free_port

    rc, out = run_json(capsys, "--url", f"http://127.0.0.1:{free_port()}", "--model", "m", "--concurrency", "1",
                       "--requests", "2", "--prompt-len", "4", "--gen", "1")
    r = out["results"][0]
    assert rc == 1 and r["failed"] == 2 and r["completed"] == 0
    with FakeServer(delay=0.5) as srv:  # 5 chunks of 0.5 s cannot finish within a 1 s deadline
        t0 = time.monotonic()
        rc = bench_serve.main(["--url", srv.url, "--model", "fake", "--concurrency", "1", "--requests", "3",
                               "--prompt-len", "4", "--gen", "5", "--json", "--no-progress", "--warmup", "0",
                               "--timeout", "1"])
        elapsed = time.monotonic() - t0
        # the bench hung up mid-stream at its deadline rather than reading the 2.5 s stream to its end
        wait_until(lambda: srv.cut_short == 1, 30, "the fake server to see the bench hang up")
    r = json.loads(capsys.readouterr().out)["results"][0]
    print(f"bench returned after {elapsed:.2f} s")  # a figure; the hang-up count is the criterion
    assert rc == 1 and r["completed"] == 0 and r["failed"] == 1 and r["not_sent"] == 2
    assert "deadline" in next(iter(r["errors"]))


# ---- a real Pantheon server -------------------------------------------------------------------------------
@pytest.mark.slow
def test_against_real_pantheon(capsys, tiny_batched_server):
    """4 short requests on the tiny llama through gunicorn; /metrics deltas agree when the route exists."""
    srv = tiny_batched_server  # shared with test_web_concurrency (server_util.TINY_BATCHED)
    rc, out = run_json(capsys, "--url", srv.url, "--model", "tiny", "--concurrency", "2", "--requests", "4",
                       "--prompt-len", "16", "--gen", "4", "--shared-prefix", "8")
    metrics = srv.get("/metrics")
    r = out["results"][0]
    assert rc == 0, r["errors"]
    assert (r["completed"], r["failed"]) == (4, 0) and r["usage_reported"] == 4
    assert 4 <= r["output_tokens"] <= 16 and r["input_tokens"] >= 4 * 16
    check_stats(r["e2e_ms"])
    assert r["ttft_ms"]["max"] <= r["e2e_ms"]["max"]
    if metrics.status_code == 200:
        sm = r["server_metrics"]
        assert sm is not None, "GET /metrics answers but bench serve read nothing from it"
        assert sm.get("requests") == 4
        assert sm.get("prompt_tokens") == r["input_tokens"]
        assert sm.get("generation_tokens") == r["output_tokens"]
        assert sm.get("prefix_hits", 0) + sm.get("prefix_misses", 0) == 4
        from prometheus_client.parser import text_string_to_metric_families
        names = {s.name for f in text_string_to_metric_families(metrics.text) for s in f.samples}
        assert {"pantheon_running_requests", "pantheon_time_to_first_token_seconds_count",
                "pantheon_jax_compilations_total"} <= names


def test_several_levels_give_each_rounds_scaling_against_the_first_level(capsys):
    """Rounds run outermost (c=1, c=2, then c=1, c=2 again); each round's c=2 tok/s is divided by the
    same round's c=1 tok/s, and the headline is the median of those ratios."""
    with FakeServer(n_chunks=4, delay=0.02) as srv:
        rc, out = run_json(capsys, "--url", srv.url, "--model", "fake", "--concurrency", "1,2", "--rounds", "2",
                           "--requests", "4", "--prompt-len", "8", "--gen", "4")
    assert rc == 0
    assert [(r["concurrency"], r["round"]) for r in out["results"]] == [(1, 0), (2, 0), (1, 1), (2, 1)]
    one, two = out["scaling"]
    assert (one["concurrency"], two["concurrency"]) == (1, 2)
    assert one["vs_first_level"] == [1.0, 1.0]
    tok = {(r["concurrency"], r["round"]): r["output_tok_s"] for r in out["results"]}
    assert two["vs_first_level"] == [pytest.approx(tok[2, k] / tok[1, k], abs=1e-4) for k in (0, 1)]
    assert two["vs_first_level.median"] == pytest.approx(sum(two["vs_first_level"]) / 2, abs=1e-4)
    print("c=2 vs c=1 output tok/s by round:", two["vs_first_level"])  # a figure, not a criterion
    assert srv.peak_streaming == 2  # the c=2 level really kept two streams open at once, never more


def test_extra_body_is_merged_into_every_request(capsys):
    """--extra-body measures a feature's cost (logprobs, a JSON schema) with the same load generator."""
    with FakeServer() as srv:
        rc, out = run_json(capsys, "--url", srv.url, "--model", "fake", "--concurrency", "2", "--requests", "3",
                           "--prompt-len", "8", "--gen", "2", "--extra-body", '{"logprobs": true, "top_logprobs": 5}')
    assert rc == 0 and out["config"]["extra_body"] == {"logprobs": True, "top_logprobs": 5}
    assert len(srv.bodies) == 3 and all(b["logprobs"] is True and b["top_logprobs"] == 5 for b in srv.bodies)
    with pytest.raises(SystemExit):
        bench_serve.main(["--url", srv.url, "--model", "fake", "--extra-body", "[1]"])
