"""Pantheon behind the SMG router, on loopback: `pantheon router` + three `pantheon serve` instances.

The instances (tiny random-weight models, two slots each) register themselves through
PANTHEON_REGISTRY_URL: A and B serve `tiny`, C serves `tiny` and `qwen2`, so the router holds four
workers. One router and the three instances are shared by the module (starting them is most of the
cost); the tests that kill something run last and leave the fleet whole again.

Specification:
* every model of every instance is a worker at the router with Pantheon's labels; the instances
  want an API key, and the router presents its own key instead (PANTHEON_REGISTRY_WORKER_KEY,
  registered with each worker: the instances' API key never goes to the router); clients of the
  router send none;
* requests are routed by `model` (only C gets `qwen2`; an unknown model is the router's 404);
* a session (`X-SMG-Routing-Key`) stays on one instance for three turns, and that instance's
  `/metrics` counts the prefix-cache hits of turns two and three;
* SSE through the router is the SSE of a direct request (same deltas, same finish);
* a saturated instance gets no new requests from the router while the others have room;
* the router restarted empty gets every worker back from the instances' keep-alive;
* an instance killed: traffic goes to the others; restarted: it is admitted again.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import requests

from server_util import LLAMA, QWEN2, ROOT, Server, die_with_parent, free_port, sse_events

pytestmark = pytest.mark.slow  # a router and three server processes (make test-quick leaves it out)

KEY = "router-control-key"
API_KEY = "instance-api-key"  # the instances want it (or the router's key) on every call
ROUTER_KEY = "key-for-the-router"  # what the router presents to the instances (registered with each worker)
SLOTS = 2
ENV = {"PANTHEON_WARMUP": "0", "PANTHEON_BATCH_SLOTS": str(SLOTS), "PANTHEON_REGISTRY_INTERVAL_S": "1",
       "PANTHEON_REGISTRY_KEY": KEY, "PANTHEON_API_KEY": API_KEY, "PANTHEON_REGISTRY_WORKER_KEY": ROUTER_KEY}
DIRECT = {"Authorization": f"Bearer {API_KEY}"}  # for requests that bypass the router
CHAT = "/v1/chat/completions"
ROUTED_HEADER = "x-smg-routed-worker-id"  # SMG names the worker (its URL) that served a response


def wait_for(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = pred()
        except requests.RequestException as exc:
            last = exc
        if last and not isinstance(last, Exception):
            return last
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for {what} (last: {last!r})")


class Router:
    """`pantheon router` on free loopback ports, fast probes for the tests."""

    def __init__(self, port: int | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(tempfile.mkstemp(prefix="smg-", suffix=".log")[1])
        env = {k: v for k, v in os.environ.items() if k != "PANTHEON_API_KEY"}  # clients need no key here
        env["PANTHEON_REGISTRY_KEY"] = KEY
        cmd = [sys.executable, "-m", "pantheon.cli", "router", "--port", str(self.port),
               "--metrics-port", str(free_port()), "--health-interval", "1", "--load-interval", "1",
               "--log-level", "warn"]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True, preexec_fn=die_with_parent)
        wait_for(lambda: self.workers() is not None, 60, "the router to answer")

    def workers(self) -> list[dict] | None:
        try:
            r = requests.get(self.url + "/workers", headers={"Authorization": f"Bearer {KEY}"}, timeout=5)
        except requests.RequestException:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited:\n{self.log_path.read_text(errors='replace')[-3000:]}")
            return None
        return r.json()["workers"] if r.status_code == 200 else None

    def ready_urls(self) -> set[str]:
        return {w["url"] for w in self.workers() or [] if w.get("is_healthy") and w.get("status") == "ready"}

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        try:
            self.log_path.unlink()
        except OSError:
            pass


def chat(base: str, model: str = "tiny", content: str = "hello there", max_tokens: int = 6, **kw) -> requests.Response:
    headers = kw.pop("headers", {})
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, **kw}
    return requests.post(base + CHAT, json=body, headers=headers, timeout=120, stream=bool(kw.get("stream")))


def metric(server: Server, name: str, labels: str = "") -> float:
    """The sum of the samples of `name` whose label set contains `labels`."""
    text = requests.get(server.url + "/metrics", headers=DIRECT, timeout=10).text
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"{re.escape(name)}(\{{[^}}]*\}})? ([0-9.e+-]+)$", line)
        if m and labels in (m.group(1) or ""):
            total += float(m.group(2))
    return total


def routed_chats(server: Server) -> float:
    """Chat requests this instance answered on its model roots (what the router sends it)."""
    return metric(server, "pantheon_http_requests_total", 'route="/m/<path:model>/v1/chat/completions"')


# Their own servers: three instances registered with one router (two of them alike on purpose: the
# router must spread requests over distinct processes).
@pytest.fixture(scope="module")
def fleet():
    router = Router()
    env = dict(ENV, PANTHEON_REGISTRY_URL=router.url)
    servers = {"A": Server([f"tiny={LLAMA}"], env), "B": Server([f"tiny={LLAMA}"], env),
               "C": Server([f"tiny={LLAMA}", f"qwen2={QWEN2}"], env)}
    try:
        for s in servers.values():
            s.start()
        for s in servers.values():
            s.wait_ready(240)
        yield router, servers
    finally:
        for s in servers.values():
            s.stop()
        router.stop()


def worker_urls(servers: dict[str, Server]) -> set[str]:
    return {s.url + "/m/" + m.split("=")[0] for s in servers.values() for m in s.models}


def test_every_model_registers_with_its_labels(fleet):
    router, servers = fleet
    want = worker_urls(servers)
    assert len(want) == 4
    wait_for(lambda: router.ready_urls() == want, 60, "four healthy workers")
    by_url = {w["url"]: w for w in router.workers()}
    c = servers["C"]
    w = by_url[c.url + "/m/qwen2"]
    assert w["model_id"] == "qwen2"
    port = c.url.rsplit(":", 1)[1]
    assert {k: w["labels"][k] for k in ("instance_id", "node_id", "transport", "capacity")} == {
        "instance_id": f"127.0.0.1:{port}:qwen2", "node_id": "node0", "transport": "local", "capacity": str(SLOTS)}
    # the router's control plane wants the key the instances present
    assert requests.get(router.url + "/workers", timeout=5).status_code == 401


def test_requests_are_routed_by_model(fleet):
    router, servers = fleet
    wait_for(lambda: router.ready_urls() == worker_urls(servers), 60, "four healthy workers")
    r = chat(router.url, model="qwen2")
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "qwen2" and r.headers[ROUTED_HEADER] == servers["C"].url + "/m/qwen2"
    tiny_urls = set()
    for i in range(12):
        r = chat(router.url, headers={"X-SMG-Routing-Key": f"spread-{i}"})
        assert r.status_code == 200, r.text
        tiny_urls.add(r.headers[ROUTED_HEADER])
    assert tiny_urls <= {s.url + "/m/tiny" for s in servers.values()} and len(tiny_urls) >= 2
    r = chat(router.url, model="no-such-model")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_a_session_stays_on_one_instance_and_hits_its_prefix_cache(fleet):
    router, servers = fleet
    wait_for(lambda: router.ready_urls() == worker_urls(servers), 60, "four healthy workers")
    hits_before = {k: metric(s, "pantheon_prefix_cache_hits_total") for k, s in servers.items()}
    # three turns that stay inside the tiny model's 128-token context (a longer one is a 400 now)
    messages = [{"role": "user", "content": "tell me a story"}]
    served = []
    for turn in range(3):
        r = requests.post(router.url + CHAT, json={"model": "tiny", "messages": messages, "max_tokens": 4,
                                                   "temperature": 0},
                          headers={"X-SMG-Routing-Key": "conversation-7"}, timeout=120)
        assert r.status_code == 200, r.text
        served.append(r.headers[ROUTED_HEADER])
        messages += [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
                     {"role": "user", "content": f"part {turn + 2}?"}]
    assert len(set(served)) == 1, served
    home = next(k for k, s in servers.items() if served[0].startswith(s.url + "/"))
    wait_for(lambda: metric(servers[home], "pantheon_prefix_cache_hits_total") >= hits_before[home] + 2, 10,
             "prefix-cache hits of turns 2 and 3 on the session's instance")


def test_sse_through_the_router_equals_sse_direct(fleet):
    router, servers = fleet
    body = dict(model="qwen2", content="count to five", max_tokens=12, stream=True)
    direct = sse_events(chat(servers["C"].url, headers=DIRECT, **body))
    routed_resp = chat(router.url, **body)
    assert routed_resp.headers["content-type"].startswith("text/event-stream")
    routed = sse_events(routed_resp)
    strip = lambda evs: [e if e == "[DONE]" else  # noqa: E731 - ids and timestamps differ per request
                         [(c["delta"], c["finish_reason"]) for c in e["choices"]] for e in evs]
    assert strip(routed) == strip(direct) and routed[-1] == "[DONE]" and len(routed) > 3


def test_responses_and_messages_through_the_router(fleet):
    """Issue 32: the router forwards both agent APIs to a worker's model root, which answers in its shape."""
    router, servers = fleet
    r = requests.post(router.url + "/v1/responses", timeout=120,
                      json={"model": "qwen2", "input": "hello", "max_output_tokens": 4, "store": False})
    assert r.status_code == 200, r.text[:300]
    assert r.json()["object"] == "response" and r.json()["model"] == "qwen2"
    r = requests.post(router.url + "/v1/messages", timeout=120,
                      json={"model": "qwen2", "max_tokens": 4, "messages": [{"role": "user", "content": "hello"}]})
    assert r.status_code == 200, r.text[:300]
    assert r.json()["type"] == "message" and r.json()["model"] == "qwen2"


def test_a_saturated_instance_gets_no_new_requests(fleet):
    router, servers = fleet
    wait_for(lambda: router.ready_urls() == worker_urls(servers), 60, "four healthy workers")
    busy = servers["A"]
    stop = threading.Event()

    def flood() -> None:  # keep A's slots full (and a queue behind them) with direct requests
        while not stop.is_set():
            try:
                chat(busy.url, max_tokens=100, ignore_eos=True, headers=DIRECT)
            except requests.RequestException:
                pass

    threads = [threading.Thread(target=flood, daemon=True) for _ in range(2 * SLOTS + 2)]
    for t in threads:
        t.start()
    try:
        a_url = busy.url + "/m/tiny"
        wait_for(lambda: next((w for w in router.workers() if w["url"] == a_url), {}).get("engine_load", {})
                 .get("aggregate", {}).get("total_running_reqs", 0) >= SLOTS, 30, "the router to see A saturated")
        before = routed_chats(busy)
        for i in range(10):
            r = chat(router.url, headers={"X-SMG-Routing-Key": f"spill-{i}"})
            assert r.status_code == 200, r.text
            assert r.headers[ROUTED_HEADER] != a_url
        assert routed_chats(busy) == before
    finally:
        stop.set()
        for t in threads:
            t.join(130)


def test_a_restarted_router_gets_every_worker_back(fleet):
    router, servers = fleet
    port = router.port
    router.stop()
    fresh = Router(port)
    router.proc, router.log_path = fresh.proc, fresh.log_path  # the fixture stops the new one
    wait_for(lambda: router.ready_urls() == worker_urls(servers), 60, "every worker re-registered")
    assert chat(router.url, model="qwen2").status_code == 200


def test_a_killed_instance_leaves_the_rotation_and_a_restarted_one_returns(fleet):
    router, servers = fleet
    victim = servers["B"]
    b_url = victim.url + "/m/tiny"
    wait_for(lambda: b_url in router.ready_urls(), 60, "B healthy")
    os.killpg(victim.proc.pid, signal.SIGKILL)
    victim.proc.wait(timeout=10)
    wait_for(lambda: b_url not in router.ready_urls(), 30, "the router to mark B unhealthy")
    for i in range(8):
        r = chat(router.url, headers={"X-SMG-Routing-Key": f"moved-{i}"})
        assert r.status_code == 200, r.text
        assert r.headers[ROUTED_HEADER] != b_url
    victim.start().wait_ready(240)  # same port: same worker URL and instance id
    wait_for(lambda: b_url in router.ready_urls(), 60, "B admitted again")

    def lands_on_b() -> bool:
        return any(chat(router.url, headers={"X-SMG-Routing-Key": f"back-{time.monotonic()}-{i}"})
                   .headers.get(ROUTED_HEADER) == b_url for i in range(6))
    wait_for(lands_on_b, 60, "a routed request served by B again")
