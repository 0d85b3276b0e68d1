"""Many streams at once on the continuous-batching backend: cheap routes keep answering, nothing is lost.

One tiny model with 8 batch slots (the default path). While 8 streams generate, `GET /` and
`GET /v1/models` answer: they never wait on a generation, and the driver runs in a real OS thread, so
the gevent hub stays free. Their latencies are printed (a figure on a shared machine, not a criterion);
each probe has a hang guard.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import requests

from conftest import wait_until

pytestmark = pytest.mark.slow  # a real server process (make test-quick leaves it out)

HELLO = [{"role": "user", "content": "Tell me a story"}]
N_STREAMS = 8
TOKENS = 60


def counts(usage: dict) -> tuple[int, int, int]:
    """Token counts of a usage object (cached_tokens legitimately differs when a prefix is reused)."""
    return usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]


@pytest.fixture(scope="module")
def srv(tiny_batched_server):
    return tiny_batched_server  # test_bench_serve's real-server test uses the same one


def stream_once(srv, chunks: list | None = None) -> tuple[int, list]:
    """One greedy stream; each event is also counted in `chunks` (shared by the streams) as it arrives."""
    body = {"model": "tiny", "messages": HELLO, "max_tokens": TOKENS, "stream": True, "temperature": 0,
            "stream_options": {"include_usage": True}}
    r = requests.post(srv.url + "/v1/chat/completions", json=body, stream=True, timeout=120)
    events = []
    for line in r.iter_lines(decode_unicode=True):
        if line and line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
            if chunks is not None:
                chunks.append(1)
    return r.status_code, events


def text_of(events) -> str:
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events if isinstance(e, dict)
                   and e.get("choices"))


def test_cheap_routes_answer_while_8_streams_run(srv):
    # one greedy non-streamed reference (also compiles what the streams need)
    ref = requests.post(srv.url + "/v1/chat/completions", timeout=120, json={
        "model": "tiny", "messages": HELLO, "max_tokens": TOKENS, "temperature": 0}).json()
    results: list[tuple[int, list]] = []
    chunks: list[int] = []  # every SSE event any stream has received so far
    stop = threading.Event()
    barrier = threading.Barrier(N_STREAMS + 1)

    def worker():
        barrier.wait(60)
        while not stop.is_set():  # keep 8 streams going for the whole probe
            results.append(stream_once(srv, chunks))

    threads = [threading.Thread(target=worker) for _ in range(N_STREAMS)]
    for t in threads:
        t.start()
    barrier.wait(60)
    # every stream has sent its role chunk and a token: all 8 are decoding
    wait_until(lambda: len(chunks) >= 2 * N_STREAMS, 120, "the 8 streams to reach decoding")
    lat: dict[str, list[float]] = {"/": [], "/v1/models": []}
    try:
        with requests.Session() as s:
            flowing_before = len(chunks)
            for _ in range(20):
                for path in lat:
                    t0 = time.perf_counter()
                    r = s.get(srv.url + path, timeout=10)  # the hang guard
                    lat[path].append(time.perf_counter() - t0)
                    assert r.status_code == 200
            flowed_during = len(chunks) - flowing_before
        # the streams go on until each slot has been freed by a finished stream and taken by a new one
        wait_until(lambda: len(results) >= N_STREAMS * 2, 300, "a second round of streams to finish")
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    print({p: [round(x * 1000, 1) for x in sorted(xs)] for p, xs in lat.items()}, "ms;", len(results), "streams;",
          flowed_during, "stream events during the probes")
    assert flowed_during > 0  # the probes really met streams in flight, not a pause between them
    assert len(results) >= N_STREAMS * 2  # slots freed by finished streams were taken by new ones
    expected = ref["choices"][0]["message"]["content"]
    for status, events in results:
        assert status == 200 and events[-1] == "[DONE]"
        assert counts(events[-2]["usage"]) == counts(ref["usage"])  # every token of every stream arrived
        assert text_of(events[:-2]) == expected


def test_disconnect_frees_the_slot(srv):
    import socket
    before = srv.log_tail(1000).count("cancelling after")
    data = json.dumps({"model": "tiny", "messages": HELLO, "max_tokens": 90, "stream": True}).encode()
    socks = []
    for _ in range(N_STREAMS):
        s = socket.create_connection(("127.0.0.1", srv.port))
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
        socks.append(s)
    for s in socks:
        got = b""
        while b"data: " not in got:
            got += s.recv(65536)
        s.close()
    # every hang-up cancelled its generation
    wait_until(lambda: srv.log_tail(1000).count("cancelling after") >= before + N_STREAMS, 60, "8 cancels in the log")
    out = requests.post(srv.url + "/v1/chat/completions", timeout=60,
                        json={"model": "tiny", "messages": HELLO, "max_tokens": 2}).json()
    assert out["usage"]["completion_tokens"] >= 1
