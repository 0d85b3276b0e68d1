"""Many streams at once on the continuous-batching backend: cheap routes stay fast, nothing is lost.

One tiny model with 8 batch slots (the default path). While 8 streams generate, `GET /` and
`GET /v1/models` must answer in under 50 ms: they never wait on a generation, and the driver runs in
a real OS thread, so the gevent hub stays free.
"""

from __future__ import annotations

import statistics
import threading
import time

import pytest
import requests

from server_util import LLAMA, sse_events, start_server

HELLO = [{"role": "user", "content": "Tell me a story"}]
N_STREAMS = 8
TOKENS = 60


def counts(usage: dict) -> tuple[int, int, int]:
    """Token counts of a usage object (cached_tokens legitimately differs when a prefix is reused)."""
    return usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]


@pytest.fixture(scope="module")
def srv():
    s = start_server([f"tiny={LLAMA}"], env={"PANTHEON_BATCH_SLOTS": "8"})
    yield s
    s.stop()


def stream_once(srv) -> tuple[int, list]:
    body = {"model": "tiny", "messages": HELLO, "max_tokens": TOKENS, "stream": True, "temperature": 0,
            "stream_options": {"include_usage": True}}
    r = requests.post(srv.url + "/v1/chat/completions", json=body, stream=True, timeout=120)
    return r.status_code, sse_events(r)


def text_of(events) -> str:
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events if isinstance(e, dict)
                   and e.get("choices"))


def test_cheap_routes_stay_fast_while_8_streams_run(srv):
    # one greedy non-streamed reference (also compiles what the streams need)
    ref = requests.post(srv.url + "/v1/chat/completions", timeout=120, json={
        "model": "tiny", "messages": HELLO, "max_tokens": TOKENS, "temperature": 0}).json()
    results: list[tuple[int, list]] = []
    stop = threading.Event()
    barrier = threading.Barrier(N_STREAMS + 1)

    def worker():
        barrier.wait(60)
        while not stop.is_set():  # keep 8 streams going for the whole probe
            results.append(stream_once(srv))

    threads = [threading.Thread(target=worker) for _ in range(N_STREAMS)]
    for t in threads:
        t.start()
    barrier.wait(60)
    time.sleep(0.3)  # let all 8 reach decoding
    lat: dict[str, list[float]] = {"/": [], "/v1/models": []}
    try:
        with requests.Session() as s:
            for _ in range(20):
                for path in lat:
                    t0 = time.perf_counter()
                    r = s.get(srv.url + path, timeout=10)
                    lat[path].append(time.perf_counter() - t0)
                    assert r.status_code == 200
                time.sleep(0.01)
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    print({p: [round(x * 1000, 1) for x in sorted(xs)] for p, xs in lat.items()}, len(results), "streams")
    for path, xs in lat.items():
        xs.sort()
        assert statistics.median(xs) < 0.05 and xs[-2] < 0.05, (path, [round(x * 1000, 1) for x in xs])
    assert len(results) >= N_STREAMS * 2
    expected = ref["choices"][0]["message"]["content"]
    for status, events in results:
        assert status == 200 and events[-1] == "[DONE]"
        assert counts(events[-2]["usage"]) == counts(ref["usage"])  # every token of every stream arrived
        assert text_of(events[:-2]) == expected


def test_disconnect_frees_the_slot(srv):
    import json
    import socket
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
    deadline = time.monotonic() + 10
    while srv.log_tail(400).count("cancelling after") < N_STREAMS and time.monotonic() < deadline:
        time.sleep(0.05)
    assert srv.log_tail(400).count("cancelling after") >= N_STREAMS  # every hang-up cancelled its generation
    out = requests.post(srv.url + "/v1/chat/completions", timeout=60,
                        json={"model": "tiny", "messages": HELLO, "max_tokens": 2}).json()
    assert out["usage"]["completion_tokens"] >= 1
