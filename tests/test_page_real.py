"""The pages in headless Chromium against the real SmolLM2 (the run's shared server, server_util.SMOL:
8 slots, an API key): a wrong key is a clear message; a message streams in with its speed line, and a
second turn reports its cached prompt tokens; Stop ends a stream mid-way (and the server cancels it); a
forced tool call is shown as a call; markup the model writes is shown as text; the dashboard's plots
move while `pantheon bench serve` runs. Also: `/` still answers API clients the JSON status, and the
server's log gives the pages' address once it is ready.

Screenshots of each page go to tests/output/page/ (docs/chat.png and docs/dashboard.png, shown in the
README, are copies of chat.png and dashboard.png).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest
import requests
from selenium.webdriver.common.by import By

from browser_util import answered, by_id, model_options, no_markup_ran, page_errors, pick_model, reset, screenshot, send, set_field, \
    start_browser, wait_for
from server_util import ROOT, SMOL_KEY

pytestmark = [pytest.mark.real, pytest.mark.slow]

MODEL = "smol"
BROWSER_ACCEPT = "text/html,application/xhtml+xml,application/xml;q=0.9,image/avif,image/webp,*/*;q=0.8"
STATS = re.compile(r"(\d+) tokens · TTFT ([\d.]+) s · ([\d.]+) tok/s · prompt (\d+) · (\d+) cached")


@pytest.fixture(scope="module")
def srv(smol_server):
    return smol_server  # shared (server_util.SMOL); nothing here changes what it holds


@pytest.fixture(scope="module")
def browser():
    d = start_browser()
    yield d
    d.quit()


def with_key(d, url: str, path: str = "/") -> None:
    """Open a page with empty storage but for the API key, as a person who typed it once."""
    reset(d, url, path)
    d.execute_script("localStorage.setItem('pantheon.apiKey', arguments[0])", SMOL_KEY)
    d.get(url + path)


def disconnects(srv) -> float:
    text = srv.get("/metrics", key=SMOL_KEY).text
    m = re.search(r'^pantheon_client_disconnects_total\{model="smol"\} ([\d.e+]+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def test_api_clients_still_get_the_json_status_and_the_log_gives_the_pages(srv):
    plain = requests.get(srv.url + "/", timeout=10)
    health = requests.get(srv.url + "/health", timeout=10)
    assert plain.status_code == 200 and plain.headers["Content-Type"] == "application/json"
    assert plain.json()["status"] == "ok" and plain.content == health.content
    for accept in ("*/*", "application/json"):
        assert requests.get(srv.url + "/", headers={"Accept": accept}, timeout=10).content == health.content
    page = requests.get(srv.url + "/", headers={"Accept": BROWSER_ACCEPT}, timeout=10)
    assert page.status_code == 200 and page.headers["Content-Type"].startswith("text/html")
    assert "script-src 'self'" in page.headers["Content-Security-Policy"]
    log = srv.log_path.read_text(errors="replace")
    assert f"chat page: {srv.url}/  dashboard: {srv.url}/dashboard" in log


def test_a_wrong_api_key_is_a_clear_message(srv, browser):
    d = browser
    reset(d, srv.url)
    notice = by_id(d, "notice")
    wait_for(lambda: notice.is_displayed(), 20, "the missing key's message")  # none typed yet: 401
    by_id(d, "api-key").send_keys("not-the-key")
    by_id(d, "key-form").find_element(By.TAG_NAME, "button").click()
    wait_for(lambda: "not-the-key" == d.execute_script("return localStorage.getItem('pantheon.apiKey')"), 5,
             "the key to be kept")
    wait_for(lambda: notice.is_displayed() and "refused the API key" in notice.text, 20, "the refusal")
    assert "401" in notice.text
    assert model_options(d) == [""]
    screenshot(d, "chat-wrong-key")
    key = by_id(d, "api-key")
    key.clear()
    key.send_keys(SMOL_KEY)
    by_id(d, "key-form").find_element(By.TAG_NAME, "button").click()
    wait_for(lambda: not notice.is_displayed(), 20, "the message to go with the right key")
    pick_model(d, MODEL)
    assert not page_errors(d)


def test_a_message_streams_in_with_its_speed_line(srv, browser):
    d = browser
    with_key(d, srv.url)
    pick_model(d, MODEL)
    set_field(d, "max_tokens", "48")
    set_field(d, "temperature", "0")
    send(d, "What is the capital of France? Answer in two sentences.")
    seen = set()  # the answer's length at each look while it streams: it grows in steps

    def done():
        if d.execute_script("return document.body.dataset.streaming") == "1":
            seen.add(len(d.execute_script("const m = document.querySelector('.msg.assistant:last-child .content');"
                                          "return m ? m.textContent : ''")))
            return False
        return True
    wait_for(done, 120, "the answer", every=0.02)
    msg = answered(d)
    text = msg.find_element(By.CSS_SELECTOR, ".content").text
    assert "Paris" in text, text
    assert len({n for n in seen if n > 0}) >= 2, f"no partial answer was seen while streaming: {seen}"
    m = STATS.search(msg.find_element(By.CSS_SELECTOR, ".stats").text)
    assert m, msg.find_element(By.CSS_SELECTOR, ".stats").text
    tokens, ttft, tps, prompt = int(m.group(1)), float(m.group(2)), float(m.group(3)), int(m.group(4))
    assert 1 < tokens <= 48 and ttft > 0 and tps > 0 and prompt > 10
    # a second turn re-sends the first: its prompt is served from the cached prefix
    send(d, "And of Italy?")
    msg = answered(d, 120)
    m = STATS.search(msg.find_element(By.CSS_SELECTOR, ".stats").text)
    assert m and int(m.group(5)) > 0, msg.find_element(By.CSS_SELECTOR, ".stats").text
    screenshot(d, "chat")
    assert not page_errors(d)


def test_stop_ends_a_stream_mid_way(srv, browser):
    d = browser
    with_key(d, srv.url)
    pick_model(d, MODEL)
    set_field(d, "extra", json.dumps({"ignore_eos": True}))  # it would run to the end of the context
    before = disconnects(srv)
    send(d, "Write a very long story about a lighthouse keeper.")
    wait_for(lambda: len(d.execute_script("const m = document.querySelector('.msg.assistant:last-child .content');"
                                          "return m ? m.textContent : ''")) > 40, 120, "the story to start")
    assert by_id(d, "stop").is_displayed() and not by_id(d, "send").is_enabled()
    by_id(d, "stop").click()
    msg = answered(d, 10)
    assert msg.find_element(By.CSS_SELECTOR, ".stopped").text == "stopped"
    assert len(msg.find_element(By.CSS_SELECTOR, ".content").text) > 40  # what came is kept
    assert msg.find_element(By.CSS_SELECTOR, ".stats").text.startswith("~")  # no usage: counted pieces
    assert not by_id(d, "stop").is_displayed() and by_id(d, "send").is_enabled()
    # the server saw the client go and cancelled the generation
    wait_for(lambda: disconnects(srv) > before, 30, "the server to cancel the stream")
    assert not page_errors(d)


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_a_forced_tool_call_is_shown_as_a_call(srv, browser):
    d = browser
    with_key(d, srv.url)
    pick_model(d, MODEL)
    set_field(d, "tools", json.dumps([WEATHER_TOOL]))
    set_field(d, "tool_choice", "get_weather")
    set_field(d, "temperature", "0")
    send(d, "What is the weather like in Paris?")
    msg = answered(d, 120)
    call = msg.find_element(By.CSS_SELECTOR, ".tool-call")
    assert call.find_element(By.CSS_SELECTOR, ".tool-name").text == "get_weather"
    args = json.loads(d.execute_script("return arguments[0].querySelector('.tool-args').textContent", call))
    assert isinstance(args.get("city"), str)
    stats = msg.find_element(By.CSS_SELECTOR, ".stats").text  # the call came whole: its total time and rate
    assert re.search(r"\d+ tokens · answer after [\d.]+ s · [\d.]+ tok/s overall · prompt \d+ · \d+ cached · tool_calls",
                     stats), stats
    screenshot(d, "chat-tool-call")
    assert not page_errors(d)


PAYLOAD = "<script>window.pwned = 1; document.title = 'pwned'</script><img src=x onerror=\"window.pwned = 1\">"


def test_markup_the_model_writes_is_shown_as_text(srv, browser):
    """The answer is held to one JSON string by a grammar (response_format), so the real model streams
    exactly this markup; the page shows it as characters and nothing of it runs."""
    d = browser
    with_key(d, srv.url)
    pick_model(d, MODEL)
    schema = {"type": "json_schema", "json_schema": {"name": "markup", "schema": {"const": PAYLOAD}}}
    set_field(d, "extra", json.dumps({"response_format": schema}))
    send(d, "Say something in HTML.")
    msg = answered(d, 120)
    shown = d.execute_script("return arguments[0].querySelector('.content').textContent", msg)
    assert shown == json.dumps(PAYLOAD), shown
    assert "<script>" in msg.find_element(By.CSS_SELECTOR, ".content").text  # visible as characters
    no_markup_ran(d)
    assert not page_errors(d)


def test_the_dashboards_plots_move_while_bench_serve_runs(srv, browser):
    d = browser
    with_key(d, srv.url, "/dashboard")
    card = wait_for(lambda: d.find_element(By.CSS_SELECTOR, f".model-card[data-model='{MODEL}']"), 30, "smol's card")

    def chart(name):
        return card.find_element(By.CSS_SELECTOR, f"figure.chart[data-chart='{name}']")

    def last(name) -> float:
        v = chart(name).get_attribute("data-last")
        return float(v) if v else 0.0

    wait_for(lambda: int(chart("tokens_per_s").get_attribute("data-samples")) >= 2, 30, "the first samples")
    path_before = chart("tokens_per_s").find_element(By.CSS_SELECTOR, "path.s0").get_attribute("d")
    bench = subprocess.Popen([sys.executable, "-m", "pantheon.cli", "bench", "serve", "--url", srv.url, "--model", MODEL,
                              "--api-key", SMOL_KEY, "--concurrency", "4", "--requests", "12", "--prompt-len", "64",
                              "--gen", "32", "--ignore-eos", "--warmup", "0", "--no-progress", "--json", "--timeout", "300"],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = {"tokens_per_s": 0.0, "slots": 0.0, "kv": 0.0}
    shot = False
    try:
        while bench.poll() is None:
            for name in peak:
                peak[name] = max(peak[name], last(name))
            if not shot and peak["tokens_per_s"] > 0 and last("ttft") > 0:
                screenshot(d, "dashboard-during")
                shot = True
            time.sleep(0.25)
        out, err = bench.communicate(timeout=30)
    finally:
        if bench.poll() is None:
            bench.kill()
    time.sleep(1.5)
    screenshot(d, "dashboard")  # the whole run on the plots
    result = json.loads(out)["results"][0]
    assert result["completed"] == 12, err[-2000:]
    assert peak["tokens_per_s"] > 0, "the tokens/s plot never rose during the run"
    assert peak["slots"] >= 1, "no slot was ever shown busy during the run"
    assert peak["kv"] > 0
    assert shot, "the run ended before its figures reached the plots"
    wait_for(lambda: last("ttft") > 0 and last("time_per_token") > 0, 10, "the latency percentiles")
    assert chart("tokens_per_s").find_element(By.CSS_SELECTOR, "path.s0").get_attribute("d") != path_before
    assert not page_errors(d)
