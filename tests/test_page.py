"""The browser pages (pantheon.web.page) as HTTP answers, on the Flask test client: `/` negotiated
between the chat page and the JSON status (the JSON byte for byte what API clients got before), the
pages and their files open without a key and nothing else with them, the security headers, the files
themselves (no inline script, no HTML sinks, all shipped as package data), and the figures the
dashboard reads that /metrics gained for it. The pages in a real browser: tests/test_page_browser.py
and tests/test_page_real.py."""

from __future__ import annotations

import fnmatch
import json
import re
import tomllib
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pantheon.config import Settings
from pantheon.runtime.memory import MemSnapshot, PoolSample
from pantheon.serving import registration
from pantheon.serving.metrics import Metrics
from pantheon.web import page
from pantheon.web.security import is_page
from test_web_app import FakeModel, ScriptBackend, registry_app

ROOT = Path(__file__).resolve().parents[1]
BROWSER_ACCEPT = "text/html,application/xhtml+xml,application/xml;q=0.9,image/avif,image/webp,*/*;q=0.8"
KEY = "page-key"
STATUS_JSON = b'{"service":"pantheon","status":"ok"}\n'  # what `/` answered every API client before the pages


@pytest.fixture()
def client(tmp_path):
    app, _ = registry_app(Settings(home=tmp_path), lambda p, n, d, s: FakeModel(n), lambda m, s: ScriptBackend(m))
    return app.test_client()


@pytest.fixture()
def keyed(tmp_path):
    app, _ = registry_app(Settings(home=tmp_path, api_key=KEY), lambda p, n, d, s: FakeModel(n),
                          lambda m, s: ScriptBackend(m))
    return app.test_client()


# ---- `/`: the page for a browser, the same JSON for everyone else -------------------------------------------
@pytest.mark.parametrize("accept", [None, "*/*", "application/json", "application/json, text/plain, */*",
                                    "text/html, application/json", "text/*;q=0.5, application/json"],
                         ids=["no Accept", "curl", "json", "SDKs", "html=json", "text/*"])
def test_api_clients_get_the_json_status_byte_for_byte(client, accept):
    headers = {"Accept": accept} if accept is not None else {}
    r = client.get("/", headers=headers)
    assert r.status_code == 200 and r.mimetype == "application/json"
    assert r.data == STATUS_JSON
    assert r.data == client.get("/health", headers=headers).data
    assert "Content-Security-Policy" not in r.headers
    assert "Accept" in r.headers.get("Vary", "")  # the same URL answers a browser with the page


@pytest.mark.parametrize("accept", [BROWSER_ACCEPT, "text/html", "text/html;q=0.9, application/json;q=0.5"])
def test_a_browser_gets_the_chat_page(client, accept):
    r = client.get("/", headers={"Accept": accept})
    assert r.status_code == 200 and r.mimetype == "text/html"
    assert r.data == (ROOT / "pantheon/web/ui/chat.html").read_bytes()
    assert r.headers["Content-Security-Policy"] == page.CONTENT_SECURITY_POLICY
    assert "Accept" in r.headers["Vary"]
    # /health stays JSON whatever the client asks for (routers probe it)
    h = client.get("/health", headers={"Accept": accept})
    assert h.mimetype == "application/json" and h.data == STATUS_JSON


def test_the_page_is_served_while_the_server_is_still_loading(tmp_path):
    from pantheon.web import create_app
    app = create_app(Settings(home=tmp_path), exit_on_failure=False)
    state = app.extensions["pantheon"]
    state.startup.join(10)
    state.status, state.error = "loading", None
    c = app.test_client()
    assert c.get("/").status_code == 503  # the JSON status says so ...
    r = c.get("/", headers={"Accept": BROWSER_ACCEPT})
    assert r.status_code == 200 and r.mimetype == "text/html"  # ... and the page shows it


def test_wants_page_rule():
    from werkzeug.datastructures import MIMEAccept
    from werkzeug.http import parse_accept_header

    def wants(value):
        return page.wants_page(parse_accept_header(value, MIMEAccept))
    assert wants(BROWSER_ACCEPT) and wants("text/html") and wants("TEXT/HTML")
    assert not wants("") and not wants("*/*") and not wants("text/*") and not wants("application/json")
    assert not wants("text/html, application/json") and not wants("text/html;q=0")
    assert not wants("text/html;q=0.5, application/json")


# ---- access -----------------------------------------------------------------------------------------------
def test_pages_open_without_the_key_and_nothing_else_does(keyed):
    for path in ["/dashboard", *(f"/ui/{name}" for name in page.ASSETS)]:
        r = keyed.get(path)
        assert r.status_code == 200, (path, r.status_code)
        assert r.headers["Content-Security-Policy"] == page.CONTENT_SECURITY_POLICY
        assert r.headers["X-Content-Type-Options"] == "nosniff"
        assert r.headers["X-Frame-Options"] == "DENY" and r.headers["Referrer-Policy"] == "no-referrer"
        assert r.content_type == page.ASSETS.get(path.rsplit("/", 1)[-1], page.ASSETS["dashboard.html"])
        assert keyed.head(path).status_code == 200
    assert keyed.get("/", headers={"Accept": BROWSER_ACCEPT}).status_code == 200
    # the data the pages show is the API's, behind the key as before
    for path in ("/v1/models", "/metrics", "/v1/loads"):
        assert keyed.get(path).status_code == 401, path
        assert keyed.get(path, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200, path
    # only reads are open: a POST to a page path is checked like any other route
    assert keyed.post("/ui/chat.js").status_code == 401
    assert is_page("/dashboard", "GET") and is_page("/ui/x", "HEAD")
    assert not is_page("/dashboard", "POST") and not is_page("/uix", "GET") and not is_page("/v1/models", "GET")


@pytest.mark.parametrize("path", ["/ui/", "/ui/nope.js", "/ui/../page.py", "/ui/..%2fpage.py", "/ui/%2e%2e/routes.py",
                                  "/ui/ui/chat.js", "/ui/CHAT.JS", "/ui/chat.js/", "/ui/.hidden"])
def test_only_the_listed_files_are_served(keyed, path):
    r = keyed.get(path)
    assert r.status_code == 404, (path, r.status_code)
    assert r.get_json()["error"]["code"] == "not_found"


def test_files_revalidate_with_an_etag(client):
    r = client.get("/ui/chat.js")
    assert r.headers["Cache-Control"] == "no-cache" and r.headers["ETag"]
    again = client.get("/ui/chat.js", headers={"If-None-Match": r.headers["ETag"]})
    assert again.status_code == 304 and again.data == b""


def test_the_policy_allows_no_inline_script_and_no_eval():
    csp = dict(part.split(" ", 1) for part in page.CONTENT_SECURITY_POLICY.split("; "))
    assert csp["default-src"] == "'none'" and csp["script-src"] == "'self'" and csp["connect-src"] == "'self'"
    assert csp["style-src"] == "'self'" and csp["frame-ancestors"] == "'none'"
    assert csp["require-trusted-types-for"] == "'script'"
    assert "unsafe" not in page.CONTENT_SECURITY_POLICY


def test_the_openapi_document_does_not_list_the_pages(client):
    doc = client.get("/openapi.json").get_json()
    assert not any(p == "/dashboard" or p.startswith("/ui") for p in doc["paths"])


# ---- the files ------------------------------------------------------------------------------------------
UI = ROOT / "pantheon" / "web" / "ui"


def test_every_file_is_listed_and_shipped_as_package_data():
    files = sorted(p.name for p in UI.iterdir() if p.is_file())
    assert files == sorted(page.ASSETS)
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())
    globs = conf["tool"]["setuptools"]["package-data"]["pantheon"]
    for name in files:
        assert any(fnmatch.fnmatch(f"web/ui/{name}", g) for g in globs), f"{name} is not in the package data"


@pytest.mark.parametrize("name", [n for n in page.ASSETS if n.endswith(".html")])
def test_html_has_no_inline_script_style_or_handler(name):
    html = (UI / name).read_text()
    scripts = re.findall(r"<script\b([^>]*)>(.*?)</script>", html, re.S)
    assert scripts and all('src="/ui/' in attrs and not body.strip() for attrs, body in scripts)
    for src in re.findall(r'(?:src|href)="/ui/([^"]+)"', html):
        assert src in page.ASSETS, src
    assert not re.search(r"\son\w+\s*=", html), "an inline event handler"
    assert not re.search(r"\sstyle\s*=", html), "an inline style (the policy refuses it)"
    assert "http://" not in html and "https://" not in html  # nothing from elsewhere


@pytest.mark.parametrize("name", [n for n in page.ASSETS if n.endswith(".js")])
def test_scripts_never_parse_html_or_evaluate_strings(name):
    code = re.sub(r"^\s*//.*$", "", (UI / name).read_text(), flags=re.M)  # the code, not its comments
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function",
                 "DOMParser", "createContextualFragment", "srcdoc"):
        assert sink not in code, f"{name} uses {sink}"
    assert not re.search(r"setTimeout\(\s*['\"`]", code) and not re.search(r"setInterval\(\s*['\"`]", code)
    for imp in re.findall(r'from "\./([^"]+)"', code):
        assert imp in page.ASSETS, imp
    assert "http://" not in code.replace('"http://www.w3.org/2000/svg"', "") and "https://" not in code


# ---- what /metrics gained for the dashboard ------------------------------------------------------------
def _families(metrics: Metrics) -> dict[str, dict]:
    body, _ = metrics.render()
    out: dict[str, dict] = {}
    for fam in text_string_to_metric_families(body.decode() if isinstance(body, bytes) else body):
        for s in fam.samples:
            out.setdefault(s.name, {})[json.dumps(s.labels, sort_keys=True)] = s.value
    return out


def test_metrics_export_kv_use_vision_and_measured_memory():
    m = Metrics()
    m.set_backend_source(lambda: [("a", {"kv_tokens": 40, "kv_capacity": 1024, "vision": 1, "slots": 4}),
                                  ("a", {"kv_tokens": 2, "kv_capacity": 1024, "vision": 1, "slots": 4}),
                                  ("b", {"kv_tokens": 0, "kv_capacity": 512, "vision": 0})])
    snap = MemSnapshot(host=PoolSample("host", 1000, 250, "psutil"),
                       dies=(PoolSample("die:0", 500, 100, "memory_stats", True, 0),
                             PoolSample("die:1", 500, 7, "ledger", False, 1)))
    m.set_memory_source(lambda: snap)
    f = _families(m)
    assert f["pantheon_kv_cache_tokens"] == {'{"model": "a"}': 42.0, '{"model": "b"}': 0.0}
    assert f["pantheon_kv_cache_capacity_tokens"]['{"model": "a"}'] == 2048.0
    assert f["pantheon_model_vision"] == {'{"model": "a"}': 1.0, '{"model": "b"}': 0.0}  # a flag: the max
    assert f["pantheon_memory_total_bytes"] == {'{"pool": "host"}': 1000.0, '{"pool": "die:0"}': 500.0}
    assert f["pantheon_memory_used_bytes"] == {'{"pool": "host"}': 250.0, '{"pool": "die:0"}': 100.0}
    m.set_memory_source(lambda: None)  # no reading (the watch not started, or stale): no samples
    assert "pantheon_memory_used_bytes" not in _families(m)

    def broken():
        raise RuntimeError("boom")
    m.set_memory_source(broken)
    assert _families(m)["pantheon_scrape_errors_total"]["{}"] == 1.0


def test_local_base_is_where_a_browser_on_this_machine_opens_the_pages(monkeypatch):
    monkeypatch.setattr(registration, "_bound", [])
    assert registration.local_base() is None
    for bound, url in ((("0.0.0.0", 8000), "http://127.0.0.1:8000"), (("127.0.0.1", 9), "http://127.0.0.1:9"),
                       (("::", 80), "http://[::1]:80"), (("10.1.2.3", 8000), "http://10.1.2.3:8000")):
        monkeypatch.setattr(registration, "_bound", [bound])
        assert registration.local_base() == url
