"""Router registration and the routes a router needs, against a fake router and fake models (no JAX).

Specification:
* with PANTHEON_REGISTRY_URL unset nothing is built that could talk to a router;
* every ready model name is registered once, at `ADVERTISE/m/<name>`, with its labels
  (`instance_id` = host:port:model, node, transport, capacity = slots) and the control-plane key as
  a bearer token; replicas of a name stay one worker;
* the server's own API key never reaches the router, as a token or in a body; the router gets a key
  for this server only when PANTHEON_REGISTRY_WORKER_KEY gives one, and that key opens the model roots
  only;
* a call to the router ends by its deadline however slowly the router sends, a reply past the byte
  cap is refused without being read to its end, and a stuck router holds up neither an admin load's
  reply nor the deregistration at shutdown;
* the keep-alive registers again after the router forgot its workers (a router restart), and keeps
  retrying while the router is away; admin load registers, admin unload and close() deregister;
* `/health`, `/m/<model>/health` answer without the API key; `/v1/loads` has SMG's shape;
  `/m/<model>/...` serves that model only; `X-SMG-Routing-Key` is a session id.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from fake_router import FakeRouter
from test_web_app import ADMIN, HELLO, FakeModel, ScriptBackend, admin

from pantheon.config import Settings, load_settings
from pantheon.serving.registration import RouterClient, RouterError, Registration, Served
from pantheon.serving.registry import Registry
from pantheon.web import create_app

ADVERTISE = "http://127.0.0.1:18555"


def wait_for(pred, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def guarded(fn, guard: float = 60.0, what: str = "the call"):
    """fn() in a thread; its result, or the exception it raised. Fails the test (instead of hanging it)
    if fn is still running after `guard` seconds, a bound far above what a passing run takes."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(guard)
    assert not t.is_alive(), f"{what} still running after {guard} s"
    return out.get("error", out.get("value"))


def make_app(tmp_path: Path, router: FakeRouter | None, models=("m",), **extra):
    (tmp_path / "models").mkdir(exist_ok=True)
    (tmp_path / "models" / "ok.gguf").write_bytes(b"GGUF")
    extra.setdefault("advertise_url", ADVERTISE)
    settings = Settings(home=tmp_path, admin_key=ADMIN, model_dir=(tmp_path / "models").resolve(),
                        batch_slots=4, registry_url=router.url if router else None, registry_interval_s=0.3,
                        **extra)

    class Backend(ScriptBackend):
        def load_info(self):
            return {"slots": 4, "running": 1, "queued": 2, "prefix_hits": 3, "prefix_misses": 1,
                    "decode_tokens": 10}

    reg = Registry(settings, load_model=lambda p, n, d, s: FakeModel(n), make_backend=lambda m, s: Backend(m),
                   devices=lambda s: [{"die": 0, "platform": "cpu", "kind": "cpu", "budget_bytes": 10**9}],
                   estimate=lambda p, s, pl: 1000)
    app = create_app(settings, registry=reg, exit_on_failure=False)
    app.extensions["pantheon"].startup.join(10)
    for name in models:
        reg.load("fake", name, None, resolve=lambda s: Path(s))
    return app, reg


@pytest.fixture()
def router():
    r = FakeRouter()
    yield r
    r.close()


def close_app(app) -> None:
    reg = app.extensions["pantheon"].registration
    if reg is not None:
        reg.close()


def test_settings_parse_registration_variables():
    s = load_settings({"PANTHEON_REGISTRY_URL": "http://10.0.0.1:30000/", "PANTHEON_REGISTRY_KEY": "k",
                       "PANTHEON_NODE_ID": "n7", "PANTHEON_REGISTRY_TRANSPORT": "rdma",
                       "PANTHEON_ADVERTISE_URL": "http://10.0.0.2:8000", "PANTHEON_REGISTRY_INTERVAL_S": "2",
                       "PANTHEON_REGISTRY_WORKER_KEY": "wk", "PANTHEON_REGISTRY_TIMEOUT_S": "3",
                       "PANTHEON_REGISTRY_MAX_REPLY_BYTES": "1000000", "PANTHEON_API_KEY": "api"})
    assert (s.registry_url, s.registry_key, s.node_id, s.registry_transport, s.advertise_url,
            s.registry_interval_s) == ("http://10.0.0.1:30000", "k", "n7", "rdma", "http://10.0.0.2:8000", 2.0)
    assert (s.registry_worker_key, s.registry_timeout_s, s.registry_max_reply_bytes) == ("wk", 3.0, 1000000)
    d = load_settings({"PANTHEON_API_KEY": "api"})
    assert (d.registry_url, d.node_id, d.registry_transport) == (None, "node0", "local")
    assert (d.registry_key, d.registry_worker_key) == (None, None)  # neither falls back to the API key
    assert (d.registry_timeout_s, d.registry_max_reply_bytes) == (5.0, 4 << 20)
    with pytest.raises(ValueError):
        load_settings({"PANTHEON_REGISTRY_URL": "10.0.0.1:30000"})


def test_unset_registry_url_builds_no_client(tmp_path):
    app, _ = make_app(tmp_path, None)
    assert app.extensions["pantheon"].registration is None
    with pytest.raises(ValueError):
        Registration(Settings(home=tmp_path), served=lambda: [])


def test_each_model_registers_once_with_labels_and_key(tmp_path, router):
    router.key = "cp-secret"
    app, reg = make_app(tmp_path, router, models=("m", "m", "other"), registry_key="cp-secret",
                        node_id="node3", registry_transport="tcp", api_key="api-k",
                        registry_worker_key="router-k")
    try:
        urls = wait_for(lambda: len(router.urls()) == 2 and router.urls(), what="two registrations")
        assert set(urls) == {ADVERTISE + "/m/m", ADVERTISE + "/m/other"}
        body = urls[ADVERTISE + "/m/m"]
        assert body["model_id"] == "m" and body["context_length"] == FakeModel.max_seq
        assert body["api_key"] == "router-k"  # the router presents it to this worker
        assert body["labels"] == {"instance_id": "127.0.0.1:18555:m", "node_id": "node3", "transport": "tcp",
                                  "capacity": "8", "max_running_requests": "8",  # two replicas of 4 slots
                                  "context_length": str(FakeModel.max_seq)}
        assert all(h.get("Authorization") == "Bearer cp-secret" for _, _, h, _ in router.requests)
        n_posts = router.count("POST")
        wait_for(lambda: app.extensions["pantheon"].registration.reconciles >= 4, what="keep-alive ticks")
        assert router.count("POST") == n_posts  # registered stays registered: no re-POST while present
    finally:
        close_app(app)
    assert router.urls() == {}  # close() deregistered both


def test_the_servers_api_key_never_reaches_the_router(tmp_path, router):
    """PANTHEON_API_KEY set, no registry key, no worker key: the router gets no token and no key."""
    app, _ = make_app(tmp_path, router, api_key="api-secret")
    try:
        body = wait_for(lambda: router.urls().get(ADVERTISE + "/m/m"), what="registration")
        assert "api_key" not in body
        with router.lock:
            seen = list(router.requests)
        assert seen and all("Authorization" not in h for _, _, h, _ in seen)
        assert not any("api-secret" in json.dumps([h, b]) for _, _, h, b in seen)
    finally:
        close_app(app)


def test_the_router_key_opens_the_model_roots_only(tmp_path, router):
    """The key registered for the router is a second key on /m/<model>/..., not a copy of the API key."""
    app, _ = make_app(tmp_path, router, api_key="api-secret", registry_worker_key="router-k")
    c = app.test_client()
    try:
        body = wait_for(lambda: router.urls().get(ADVERTISE + "/m/m"), what="registration")
        assert body["api_key"] == "router-k"
        router_key = {"Authorization": "Bearer router-k"}
        assert c.get("/m/m/v1/loads", headers=router_key).status_code == 200
        assert c.post("/m/m/v1/chat/completions", json={"messages": HELLO}, headers=router_key).status_code == 200
        assert c.get("/v1/loads", headers=router_key).status_code == 401
        assert c.post("/v1/chat/completions", json={"messages": HELLO}, headers=router_key).status_code == 401
        assert c.post("/admin/models/unload", json={"name": "m"}, headers=router_key).status_code == 401
        assert c.get("/m/m/v1/loads", headers={"Authorization": "Bearer api-secret"}).status_code == 200
    finally:
        close_app(app)


def test_a_router_reply_past_the_cap_is_refused_before_its_end(tmp_path, router):
    """A 64 MB worker table (valid JSON, no Content-Length) against a 256 KiB cap: the reconcile fails
    with RouterError and the server hangs up instead of reading (and holding) the rest; a reply that
    announces more than the cap is refused on its headers."""
    total = 64 << 20
    settings = Settings(home=tmp_path, registry_url=router.url, advertise_url=ADVERTISE,
                        registry_max_reply_bytes=256 << 10)
    registration = Registration(settings, served=lambda: [Served("m", 2, 64)])
    router.script("GET", "/workers", router.huge_workers(total), times=1)
    err = guarded(registration.reconcile, what="the reconcile against a huge reply")
    assert isinstance(err, RouterError) and "cap" in str(err), err
    assert router.hung_up.wait(60) and router.sent < total

    router.hung_up.clear()
    router.script("GET", "/workers", router.trickling(announce=200 << 20), times=1)
    err = guarded(registration.reconcile, what="the reconcile against an announced 200 MB reply")
    assert isinstance(err, RouterError) and "announces" in str(err), err
    assert router.hung_up.wait(60)
    assert router.count("POST") == 0  # nothing was registered on the strength of a refused table


def test_a_trickling_router_reply_ends_at_the_calls_deadline(tmp_path, router):
    """A router that keeps every read fed (a byte every 0.1 s) still cannot hold a call past
    PANTHEON_REGISTRY_TIMEOUT_S: the reconcile raises TimeoutError and hangs up."""
    settings = Settings(home=tmp_path, registry_url=router.url, advertise_url=ADVERTISE, registry_timeout_s=1.0)
    registration = Registration(settings, served=lambda: [Served("m", 2, 64)])
    router.script("GET", "/workers", router.trickling(every=0.1))
    err = guarded(registration.reconcile, what="the reconcile against a trickling router")
    assert isinstance(err, TimeoutError), err
    assert router.hung_up.wait(60)


def test_admin_load_answers_while_the_router_is_stuck(tmp_path, router):
    """Every `GET /workers` trickles forever: the admin load still answers (the registration is the
    keep-alive's to finish), and once the router recovers the new model is registered."""
    app, _ = make_app(tmp_path, router, registry_timeout_s=1.0)
    client = app.test_client()
    try:
        wait_for(lambda: ADVERTISE + "/m/m" in router.urls(), what="startup registration")
        router.script("GET", "/workers", router.trickling(every=0.1))
        assert router.stalled.wait(60)  # the keep-alive is inside a stuck call
        r = guarded(lambda: admin(client, "/models/load", {"path": "ok.gguf", "name": "second"}),
                    what="the admin load")  # the router is released only after this answer
        assert r.status_code == 200, r
        router.release()
        wait_for(lambda: ADVERTISE + "/m/second" in router.urls(), 30, "registration once the router recovers")
    finally:
        router.release()
        close_app(app)


def test_close_deregisters_while_a_keepalive_call_is_stuck(tmp_path, router):
    """close() ends the keep-alive's stuck call at once, so the deregistration happens within close's
    own timeout although that call's deadline (60 s) lies far beyond it."""
    settings = Settings(home=tmp_path, registry_url=router.url, advertise_url=ADVERTISE,
                        registry_interval_s=0.2, registry_timeout_s=60.0)
    registration = Registration(settings, served=lambda: [Served("m", 2, 64)]).start()
    try:
        wait_for(lambda: ADVERTISE + "/m/m" in router.urls(), what="registration")
        router.script("GET", "/workers", router.trickling(every=0.1), times=1)
        assert router.stalled.wait(60)  # the keep-alive is inside the stuck call
        guarded(lambda: registration.close(timeout=20), what="close()")
        assert router.urls() == {}
        assert router.hung_up.wait(60)  # the stuck call was ended by this side
    finally:
        router.release()
        registration.close(deregister=False)


def test_keepalive_reregisters_after_router_restart(tmp_path, router):
    app, _ = make_app(tmp_path, router)
    try:
        wait_for(lambda: ADVERTISE + "/m/m" in router.urls(), what="registration")
        router.forget_all()
        wait_for(lambda: ADVERTISE + "/m/m" in router.urls(), what="registration after the router restart")
    finally:
        close_app(app)


def test_keepalive_retries_until_the_router_comes_up(tmp_path):
    probe = FakeRouter()
    port = probe.port
    probe.close()  # nothing listens there now
    settings = Settings(home=tmp_path, registry_url=f"http://127.0.0.1:{port}", advertise_url=ADVERTISE,
                        registry_interval_s=0.2)
    client = RouterClient(settings.registry_url)
    tries: list[int] = []
    ask = client.workers
    client.workers = lambda **call: (tries.append(1), ask(**call))[1]  # each tick asks the router first: count them
    registration = Registration(settings, served=lambda: [Served("m", 2, 64)], client=client).start()
    try:
        wait_for(lambda: len(tries) >= 3, what="three failed ticks")  # the thread must survive them
        late = FakeRouter(port=port)
        try:
            wait_for(lambda: ADVERTISE + "/m/m" in late.urls(), what="registration once the router is up")
        finally:
            registration.close()
            late.close()
    finally:
        registration.close(deregister=False)


def test_admin_load_registers_and_unload_deregisters(tmp_path, router):
    app, reg = make_app(tmp_path, router)
    client = app.test_client()
    try:
        wait_for(lambda: ADVERTISE + "/m/m" in router.urls(), what="startup registration")
        r = admin(client, "/models/load", {"path": "ok.gguf", "name": "second"})
        assert r.status_code == 200, r.get_data(as_text=True)
        assert ADVERTISE + "/m/second" in router.urls()  # registered before the admin call returned
        assert admin(client, "/models/unload", {"name": "second"}).status_code == 200
        assert ADVERTISE + "/m/second" not in router.urls() and ADVERTISE + "/m/m" in router.urls()
        # a second replica of "m": still one worker, whose capacity now counts both replicas' slots
        r = admin(client, "/models/load", {"path": "ok.gguf", "name": "m"})
        assert r.status_code == 200, r.get_data(as_text=True)
        assert router.urls()[ADVERTISE + "/m/m"]["labels"]["capacity"] == "8" and len(router.urls()) == 1
        assert router.count("PATCH") == 1
        assert admin(client, "/models/unload", {"instance_id": r.get_json()["instance_id"]}).status_code == 200
        assert router.urls()[ADVERTISE + "/m/m"]["labels"]["capacity"] == "4"
    finally:
        close_app(app)


def test_stale_workers_of_this_address_are_removed(tmp_path, router):
    """A previous process at this address registered a model this one does not serve: it goes."""
    RouterClient(router.url).add({"url": ADVERTISE + "/m/gone", "model_id": "gone"})
    RouterClient(router.url).add({"url": "http://elsewhere:1/m/gone", "model_id": "gone"})
    app, _ = make_app(tmp_path, router)
    try:
        wait_for(lambda: set(router.urls()) == {ADVERTISE + "/m/m", "http://elsewhere:1/m/gone"},
                 what="the stale worker replaced, the other server's kept")
    finally:
        close_app(app)


# ---- the routes a router uses --------------------------------------------------------------------
def test_health_probes_answer_without_the_api_key(tmp_path):
    app, _ = make_app(tmp_path, None, api_key="k")
    c = app.test_client()
    assert c.get("/health").status_code == 200
    assert c.get("/m/m/health").get_json()["status"] == "ok"
    assert c.get("/m/nope/health").status_code == 404
    assert c.get("/v1/loads").status_code == 401
    assert c.get("/m/m/v1/models").status_code == 401


def test_loads_have_smg_shape(tmp_path):
    app, _ = make_app(tmp_path, None, models=("m", "m", "other"))
    c = app.test_client()
    doc = c.get("/v1/loads").get_json()
    assert doc["dp_rank_count"] == 2 and len(doc["loads"]) == 2
    m = doc["loads"][0]
    assert m["num_running_reqs"] == 2 and m["num_waiting_reqs"] == 4 and m["max_running_requests"] == 8
    assert m["max_total_num_tokens"] == 8 * FakeModel.max_seq and m["num_used_tokens"] == 2 * FakeModel.max_seq
    assert m["cache_hit_rate"] == 0.75 and m["utilization"] == 0.25 and m["token_usage"] == 0.25
    assert doc["aggregate"]["total_running_reqs"] == 3 and doc["aggregate"]["total_waiting_reqs"] == 6
    one = c.get("/m/other/v1/loads").get_json()
    assert one["dp_rank_count"] == 1 and one["loads"][0]["max_running_requests"] == 4
    assert c.get("/m/nope/v1/loads").status_code == 404


def test_model_root_serves_its_model_only(tmp_path):
    app, reg = make_app(tmp_path, None, models=("m", "other"))
    c = app.test_client()
    assert [m["id"] for m in c.get("/m/other/v1/models").get_json()["data"]] == ["other"]
    r = c.post("/m/other/v1/chat/completions", json={"messages": HELLO})
    assert r.status_code == 200 and r.get_json()["model"] == "other"
    r = c.post("/m/other/v1/chat/completions", json={"model": "other", "messages": HELLO})
    assert r.status_code == 200
    r = c.post("/m/other/v1/chat/completions", json={"model": "m", "messages": HELLO})
    assert r.status_code == 404 and r.get_json()["error"]["code"] == "model_not_found"


def test_smg_routing_key_is_a_session_id(tmp_path):
    app, reg = make_app(tmp_path, None, models=("m", "m"))
    c = app.test_client()
    r = c.post("/v1/chat/completions", json={"messages": HELLO}, headers={"X-SMG-Routing-Key": "conv-1"})
    assert r.status_code == 200
    assert reg.session_instance("conv-1") == r.headers["X-Pantheon-Instance"]
    # the body's session_id wins over the headers, X-Session-Id over X-SMG-Routing-Key
    c.post("/v1/chat/completions", json={"messages": HELLO, "session_id": "body"},
           headers={"X-Session-Id": "hdr", "X-SMG-Routing-Key": "key"})
    assert reg.session_instance("body") and not reg.session_instance("hdr") and not reg.session_instance("key")
    c.post("/v1/chat/completions", json={"messages": HELLO}, headers={"X-Session-Id": "hdr2", "X-SMG-Routing-Key": "k2"})
    assert reg.session_instance("hdr2") and not reg.session_instance("k2")


def test_unset_registry_url_opens_no_connection(tmp_path, monkeypatch):
    """Loading, serving and idling with PANTHEON_REGISTRY_URL unset: not one socket is connected."""
    import socket
    attempts: list = []
    real_connect = socket.socket.connect
    monkeypatch.setattr(socket.socket, "connect", lambda self, addr: (attempts.append(addr), real_connect(self, addr))[1])
    monkeypatch.setattr(socket, "create_connection", lambda *a, **k: attempts.append(a) or None)
    app, _ = make_app(tmp_path, None, advertise_url=None)
    c = app.test_client()
    assert c.post("/v1/chat/completions", json={"messages": HELLO}).status_code == 200
    assert admin(c, "/models/load", {"path": "ok.gguf", "name": "second"}).status_code == 200
    assert admin(c, "/models/unload", {"name": "second"}).status_code == 200
    assert app.extensions["pantheon"].registration is None  # no keep-alive exists that could tick later
    assert attempts == []


@pytest.mark.slow
def test_sigterm_drains_then_deregisters(router):
    """A real server: registered once ready; on SIGTERM its in-flight stream completes, then its
    worker is deleted at the router and the process exits."""
    from server_util import LLAMA, Server, sse_events
    import os
    import signal
    import threading
    import requests

    srv = Server([f"tiny={LLAMA}"], {"PANTHEON_REGISTRY_URL": router.url, "PANTHEON_WARMUP": "0",
                                     "PANTHEON_BATCH_SLOTS": "2", "PANTHEON_REGISTRY_INTERVAL_S": "1"})
    try:
        srv.start().wait_ready(240)
        url = srv.url + "/m/tiny"
        body = wait_for(lambda: router.urls().get(url), 30, "registration")
        assert body["labels"]["instance_id"] == f"127.0.0.1:{srv.port}:tiny"
        events: list = []
        resp = requests.post(srv.url + "/m/tiny/v1/chat/completions", stream=True, timeout=60,
                             json={"messages": HELLO, "max_tokens": 100, "ignore_eos": True, "stream": True})
        assert resp.status_code == 200
        reader = threading.Thread(target=lambda: events.extend(sse_events(resp)))
        reader.start()
        os.kill(srv.proc.pid, signal.SIGTERM)  # the arbiter: a graceful stop of its worker
        reader.join(60)
        assert events and events[-1] == "[DONE]"  # drained: the stream ran to its end
        assert sum(1 for e in events[:-1] for c in e["choices"] if c["delta"].get("content")) > 0
        wait_for(lambda: url not in router.urls(), 30, "deregistration")
        assert srv.proc.wait(timeout=30) == 0
        assert router.count("DELETE") == 1
    finally:
        srv.stop()


def test_router_command_defaults():
    """`pantheon router`: loopback for both of SMG's ports, session affinity keyed by the two session
    headers, probes every few seconds, the control-plane key from the environment, extras last."""
    from pantheon.cli import build_parser
    from pantheon.serving.router_cmd import smg_argv
    argv = smg_argv(build_parser().parse_args(["router", "--", "--disable-retries"]), "cp-key", "api-key")
    flag = lambda name: argv[argv.index(name) + 1]  # noqa: E731
    assert argv[1:4] == ["-m", "smg", "launch"]
    assert flag("--host") == "127.0.0.1" and flag("--prometheus-host") == "127.0.0.1"
    assert flag("--policy") == "consistent_hashing"
    i = argv.index("--routing-key-headers")
    assert argv[i + 1:i + 3] == ["x-session-id", "x-smg-routing-key"]
    assert int(flag("--health-check-interval-secs")) <= 5 and int(flag("--load-monitor-interval")) <= 5
    assert flag("--control-plane-api-keys").endswith(":admin:cp-key")
    assert flag("--api-key") == "api-key"  # the router's clients present the servers' key
    assert argv[-1] == "--disable-retries"
    bare = smg_argv(build_parser().parse_args(["router"]), None)
    assert "--control-plane-api-keys" not in bare and "--api-key" not in bare


def test_router_command_without_smg_says_how_to_install_it(monkeypatch, capsys):
    import importlib.util
    from pantheon.serving import router_cmd
    from pantheon.cli import main
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "smg" else real(name, *a))
    monkeypatch.setattr(router_cmd.os, "execv", lambda *a: pytest.fail("must not start anything"))
    assert main(["router"]) == 1
    assert "pip install 'pantheon[router]'" in capsys.readouterr().err
