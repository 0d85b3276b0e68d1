"""The pages in headless Chromium (tests/browser_util.py), on two servers that cost little:

* the app on test_web_app's scripted backend, in this process (werkzeug on a loopback port): answers
  are exactly what a test scripts, so the page's rendering is checked on chosen text: reasoning folded
  apart, tool calls shown as calls, `<script>` and `<img onerror>` in every model-written field shown
  as text (nothing runs), code fences, edit-and-resend, copy, sampling settings reaching the request,
  conversations kept in localStorage across a reload;
* the tiny vision fixtures served by gunicorn (tests/fixtures/tiny-vlm, as tests/test_vision_server.py
  serves them): an image attached on the page reaches the model, the attach button only where the
  model has a projector, and the dashboard's admin panel loading and unloading a model.

The real SmolLM2 in the browser (streaming, speed line, stop, forced tool call, markup from the model,
wrong key, the dashboard under load): tests/test_page_real.py.
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import pytest
from selenium.webdriver.common.by import By

from browser_util import answered, by_id, no_markup_ran, page_errors, pick_model, reset, screenshot, send, set_field, \
    start_browser, wait_for
from conftest import FIXTURES, TINY
from pantheon.config import Settings
from server_util import start_server
from test_web_app import FakeModel, ScriptBackend, registry_app

pytestmark = pytest.mark.slow  # a browser (and, below, a server process)

VLM = FIXTURES / "tiny-vlm"
ADMIN = "page-admin"
# What a hostile answer could carry: each would run script if it were parsed as HTML.
SCRIPT = "<script>window.pwned = 1; document.title = 'pwned'</script>"
IMG = "<img src=x onerror=\"window.pwned = 1; document.title = 'pwned'\">"


@pytest.fixture(scope="module")
def browser():
    d = start_browser()
    yield d
    d.quit()


# ---- the scripted app ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    from werkzeug.serving import make_server
    app, reg = registry_app(Settings(home=tmp_path_factory.mktemp("page")), lambda p, n, d, s: FakeModel(n, think=n.startswith("think")),
                            lambda m, s: ScriptBackend(m))
    reg.load("fake", "think-m", None, resolve=lambda s: Path(s))
    srv = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=srv.serve_forever, name="page-test-server", daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_port}", reg
    srv.shutdown()
    thread.join(10)


def backend(reg, name: str) -> ScriptBackend:
    (entry,) = [e for e in reg.ready_entries() if e.name == name]
    return entry.backend


def test_reasoning_folded_markup_as_text_and_code_blocks(scripted, browser):
    url, reg = scripted
    d = browser
    reset(d, url)
    pick_model(d, "think-m")
    reasoning = f"Let me think. {IMG} {SCRIPT}"
    content = f"Here it is: {SCRIPT} and {IMG} and `inline <b>code</b>`.\n```html\n<b>bold</b>{IMG}\n```\nDone."
    backend(reg, "think-m").script = (f"{reasoning}</think>\n\n{content}", "stop")
    send(d, "Show me some HTML")
    msg = answered(d)
    details = msg.find_element(By.CSS_SELECTOR, "details.reasoning")
    assert details.get_attribute("open") is None  # folded apart from the answer
    assert "Reasoning" in details.find_element(By.TAG_NAME, "summary").text
    assert d.execute_script("return arguments[0].querySelector('.reasoning-text').textContent", details) == reasoning
    body = d.execute_script("return arguments[0].querySelector('.content').textContent", msg)
    assert body.startswith(f"Here it is: {SCRIPT} and {IMG} and inline <b>code</b>.") and body.endswith("Done.")
    code = msg.find_element(By.CSS_SELECTOR, ".content pre.code code")
    assert d.execute_script("return arguments[0].textContent", code) == f"<b>bold</b>{IMG}"
    inline = msg.find_element(By.CSS_SELECTOR, ".content .text code")
    assert d.execute_script("return arguments[0].textContent", inline) == "inline <b>code</b>"
    details.find_element(By.TAG_NAME, "summary").click()
    assert details.get_attribute("open") is not None
    stats = msg.find_element(By.CSS_SELECTOR, ".stats").text
    assert re.search(r"\d+ tokens · TTFT [\d.]+ s · [\d.]+ tok/s", stats), stats
    no_markup_ran(d)
    screenshot(d, "chat-scripted-markup")
    assert not page_errors(d)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def test_a_tool_call_is_shown_as_a_call_and_its_arguments_as_text(scripted, browser):
    url, reg = scripted
    d = browser
    reset(d, url)
    pick_model(d, "m")
    set_field(d, "tools", '{"type": "function"}')  # not a list: said so, and nothing is sent
    before = backend(reg, "m").last_request
    send(d, "Weather?")
    wait_for(lambda: "Tools: must be a JSON list" in by_id(d, "notice").text, 5, "the tools box's error")
    assert backend(reg, "m").last_request is before and not d.find_elements(By.CSS_SELECTOR, ".msg")
    assert by_id(d, "prompt").get_attribute("value") == "Weather?"  # the message is kept to send again
    set_field(d, "tools", json.dumps(TOOLS))
    args = {"city": f"Paris {IMG}"}
    backend(reg, "m").script = ('<tool_call>{"name": "get_weather", "arguments": ' + json.dumps(args) + "}</tool_call>",
                                "stop")
    send(d, "Weather?")
    msg = answered(d)
    call = msg.find_element(By.CSS_SELECTOR, ".tool-call")
    assert call.find_element(By.CSS_SELECTOR, ".tool-name").text == "get_weather"
    shown = d.execute_script("return arguments[0].querySelector('.tool-args').textContent", call)
    assert json.loads(shown) == args
    stats = msg.find_element(By.CSS_SELECTOR, ".stats").text
    assert re.search(r"\d+ tokens · answer after [\d.]+ s · [\d.]+ tok/s overall · prompt \d+ · 0 cached · tool_calls",
                     stats), stats  # the call came in one piece: its total time; the finish reason
    assert backend(reg, "m").last_request is not before  # this time it went out
    no_markup_ran(d)
    assert not page_errors(d)


def prompt_of(reg, name: str) -> str:
    return "".join(map(chr, backend(reg, name).last_request.prompt_ids))


def test_settings_edit_and_resend_copy_and_conversations_in_local_storage(scripted, browser):
    url, reg = scripted
    d = browser
    reset(d, url)
    d.execute_cdp_cmd("Browser.grantPermissions", {"origin": url, "permissions": ["clipboardReadWrite",
                                                                                   "clipboardSanitizedWrite"]})
    pick_model(d, "m")
    for name, value in (("temperature", "0.3"), ("top_p", "0.9"), ("max_tokens", "20"), ("seed", "42"),
                        ("system", "Be brief.")):
        set_field(d, name, value)
    backend(reg, "m").script = ("first answer", "stop")
    send(d, "first question")
    answered(d)
    req = backend(reg, "m").last_request
    assert (req.params.temperature, req.params.top_p, req.params.seed, req.max_tokens) == (0.3, 0.9, 42, 20)
    assert prompt_of(reg, "m") == "Be brief.first question"  # the fake template: the contents joined
    # edit the question and send it again: the old answer goes, a new one comes for the new text
    backend(reg, "m").script = ("second answer", "stop")
    user = d.find_element(By.CSS_SELECTOR, ".msg.user")
    user.find_element(By.XPATH, ".//button[text()='Edit']").click()
    area = d.find_element(By.CSS_SELECTOR, ".msg.user textarea.edit")
    area.clear()
    area.send_keys("edited question")
    d.find_element(By.CSS_SELECTOR, ".msg.user .editing button.primary").click()
    answered(d)
    assert prompt_of(reg, "m") == "Be brief.edited question"
    texts = [e.text for e in d.find_elements(By.CSS_SELECTOR, ".msg .content")]
    assert texts == ["edited question", "second answer"]
    # copy an answer
    d.find_element(By.CSS_SELECTOR, ".msg.assistant").find_element(By.XPATH, ".//button[text()='Copy']").click()
    wait_for(lambda: d.find_element(By.CSS_SELECTOR, ".msg.assistant").find_element(
        By.XPATH, ".//button[text()='Copied']"), 5, "the copy to be confirmed")
    assert d.execute_async_script("navigator.clipboard.readText().then(arguments[0])") == "second answer"
    # the conversation is in this browser's storage, not the server's: a reload shows it again
    stored = json.loads(d.execute_script("return localStorage.getItem('pantheon.conversations')"))
    assert [m.get("text") or m.get("content") for m in stored[0]["messages"]] == ["edited question", "second answer"]
    d.refresh()
    wait_for(lambda: [e.text for e in d.find_elements(By.CSS_SELECTOR, ".msg .content")] ==
             ["edited question", "second answer"], 10, "the stored conversation")
    assert by_id(d, "temperature").get_attribute("value") == "0.3"  # settings too
    by_id(d, "new-chat").click()
    assert not d.find_elements(By.CSS_SELECTOR, ".msg")
    assert len(d.find_elements(By.CSS_SELECTOR, "#conversations li")) == 2
    d.find_elements(By.CSS_SELECTOR, "#conversations li button.conv")[1].click()
    wait_for(lambda: len(d.find_elements(By.CSS_SELECTOR, ".msg")) == 2, 5, "the earlier conversation")
    assert not page_errors(d)


def test_stored_markup_is_rendered_as_text_after_a_reload(scripted, browser):
    """A conversation read back from localStorage goes through the same rendering: nothing in it runs."""
    url, _ = scripted
    d = browser
    reset(d, url)
    conv = {"id": "x", "title": f"title {IMG}", "model": "m", "updated": 0, "messages": [
        {"role": "user", "text": f"user {SCRIPT}", "images": ["javascript:window.pwned = 1", "http://127.0.0.1:9/x.png"]},
        {"role": "assistant", "model": f"m{IMG}", "content": f"answer {IMG}", "reasoning": f"why {SCRIPT}",
         "tool_calls": [{"id": "c1", "name": f"f{IMG}", "arguments": f"{{\"a\": \"{SCRIPT}\"}}"}],
         "error": f"err {IMG}", "stats": None}]}
    d.execute_script("localStorage.setItem('pantheon.conversations', arguments[0]);"
                     "localStorage.setItem('pantheon.current', 'x');", json.dumps([conv]))
    d.refresh()
    wait_for(lambda: d.find_elements(By.CSS_SELECTOR, ".msg.assistant .tool-call"), 10, "the stored messages")
    text = d.execute_script("return document.getElementById('messages').textContent")
    for piece in (SCRIPT, IMG, f"f{IMG}"):
        assert piece in text
    assert f"title {IMG}" in d.execute_script("return document.getElementById('conversations').textContent")
    no_markup_ran(d)
    assert not d.find_elements(By.CSS_SELECTOR, "#conversations img, #messages img")  # only data:image/ URLs are shown
    assert not page_errors(d)


# ---- the tiny vision models under gunicorn -------------------------------------------------------------------
# Its own server: the vision fixtures are served by no shared configuration, and the admin test loads
# and unloads a model on it.
@pytest.fixture(scope="module")
def vlm_server():
    models = [f"vlm={VLM / 'gemma3-vlm.gguf'}?mmproj={VLM / 'gemma3-vlm.mmproj.gguf'}", f"text={TINY / 'llama.gguf'}"]
    s = start_server(models, env={"PANTHEON_BATCH_SLOTS": "4", "PANTHEON_MAX_SEQ": "192", "PANTHEON_ADMIN_KEY": ADMIN,
                                  "PANTHEON_MODEL_DIR": str(FIXTURES)}, timeout=400)
    yield s
    s.stop()


def test_an_image_is_attached_where_the_model_takes_images(vlm_server, browser):
    d = browser
    reset(d, vlm_server.url)
    pick_model(d, "text")
    assert not by_id(d, "attach-label").is_displayed()  # no projector: no attachments offered
    pick_model(d, "vlm")
    wait_for(lambda: by_id(d, "attach-label").is_displayed(), 5, "the attach button")
    assert "(vision)" in d.execute_script("const s = document.getElementById('model'); return s.options[s.selectedIndex].text")
    set_field(d, "max_tokens", "8")
    set_field(d, "temperature", "0")
    by_id(d, "attach").send_keys(str(VLM / "image-a.png"))
    wait_for(lambda: d.find_elements(By.CSS_SELECTOR, "#attachments .chip img"), 10, "the attachment chip")
    send(d, "What is in this image?")
    msg = answered(d, 120)
    assert not msg.find_elements(By.CSS_SELECTOR, ".error"), msg.text
    stats = msg.find_element(By.CSS_SELECTOR, ".stats").text
    assert re.search(r"8 tokens · TTFT [\d.]+ s · [\d.]+ tok/s · prompt \d+", stats), stats
    prompt = int(re.search(r"prompt (\d+)", stats).group(1))
    text_only = vlm_server.post("/v1/chat/completions", {"model": "vlm", "max_tokens": 1, "messages": [
        {"role": "user", "content": "What is in this image?"}]}).json()["usage"]["prompt_tokens"]
    assert prompt > text_only, stats  # the image's tokens are in the prompt
    img = d.find_element(By.CSS_SELECTOR, ".msg.user .images img")
    assert img.get_attribute("src").startswith("data:image/png;base64,")
    assert d.execute_script("return arguments[0].naturalWidth", img) > 0
    assert not d.find_elements(By.CSS_SELECTOR, "#attachments .chip")  # sent: the composer is empty again
    screenshot(d, "chat-vision")
    assert not page_errors(d)


def test_dashboard_admin_loads_and_unloads_a_model(vlm_server, browser):
    d = browser
    reset(d, vlm_server.url, "/dashboard")
    wait_for(lambda: {c.get_attribute("data-model") for c in d.find_elements(By.CSS_SELECTOR, ".model-card")} ==
             {"vlm", "text"}, 30, "a card per model")
    vlm_card = d.find_element(By.CSS_SELECTOR, ".model-card[data-model='vlm']")
    assert "vision" in vlm_card.find_element(By.CSS_SELECTOR, ".badges").text
    assert len(vlm_card.find_elements(By.CSS_SELECTOR, "figure.chart")) == 8
    assert not by_id(d, "admin-body").is_displayed()
    # a wrong admin key says so
    by_id(d, "admin-key").send_keys("wrong")
    d.find_element(By.CSS_SELECTOR, "#admin-form button").click()
    wait_for(lambda: "refused the admin key" in by_id(d, "admin-message").text, 10, "the refusal")
    key = by_id(d, "admin-key")
    key.clear()
    key.send_keys(ADMIN)
    d.find_element(By.CSS_SELECTOR, "#admin-form button").click()
    wait_for(lambda: len(d.find_elements(By.CSS_SELECTOR, "#admin-models tr[data-model]")) == 2, 10, "the model table")
    by_id(d, "load-model").send_keys("tiny/llama.gguf")
    by_id(d, "load-name").send_keys("extra")
    by_id(d, "load-button").click()
    wait_for(lambda: "loaded extra" in by_id(d, "admin-message").text, 180, "the load")
    wait_for(lambda: d.find_elements(By.CSS_SELECTOR, ".model-card[data-model='extra']"), 10, "the new model's card")
    wait_for(lambda: d.find_elements(By.CSS_SELECTOR, "#admin-models tr[data-model='extra']"), 10, "its row")
    d.execute_script("document.querySelector('.admin-card').scrollIntoView({block: 'end'})")
    screenshot(d, "dashboard-admin")
    unload = d.find_element(By.CSS_SELECTOR, "#admin-models tr[data-model='extra'] button")
    unload.click()
    assert unload.text == "Confirm unload"  # two clicks: nothing unloads by accident
    unload.click()
    wait_for(lambda: "unloaded extra" in by_id(d, "admin-message").text, 60, "the unload")
    wait_for(lambda: not d.find_elements(By.CSS_SELECTOR, ".model-card[data-model='extra']"), 10, "its card to go")
    assert [m["id"] for m in vlm_server.get("/v1/models").json()["data"]] == ["vlm", "text"]
    assert not page_errors(d)
