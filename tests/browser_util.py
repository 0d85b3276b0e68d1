"""Headless Chromium for the browser tests of the pages (pantheon.web.page), driven by Selenium.

Chromium and its driver are Debian's packages (`apt-get install chromium chromium-driver`; .ci/run
installs them when they are missing). Where they are missing a test fails in CI (CI=true: a browser
test that skipped there would pass while testing nothing) and is skipped elsewhere, saying what to
install. Screenshots go to tests/output/page/ (git-ignored), one per page state a test looks at.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
from selenium.webdriver.common.by import By

OUTPUT = Path(__file__).resolve().parent / "output" / "page"
WINDOW = (1280, 960)


def _tools() -> tuple[str, str]:
    browser = next((p for p in map(shutil.which, ("chromium", "chromium-browser")) if p), None)
    driver = shutil.which("chromedriver")
    if browser and driver:
        return browser, driver
    missing = " and ".join(n for n, p in (("chromium", browser), ("chromedriver", driver)) if not p)
    message = (f"the browser tests need {missing} (Debian: apt-get install chromium chromium-driver; "
               ".ci/run installs them)")
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def start_browser():
    """A headless Chromium (a fresh profile: empty localStorage) with its console log kept."""
    browser, driver = _tools()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = browser
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                f"--window-size={WINDOW[0]},{WINDOW[1]}", "--force-device-scale-factor=1", "--lang=en-US"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    d = webdriver.Chrome(options=opts, service=Service(driver))  # the packaged driver: nothing is downloaded
    d.set_page_load_timeout(60)
    d.set_script_timeout(30)
    return d


def screenshot(driver, name: str) -> Path:
    """The page as it is now, into tests/output/page/NAME.png."""
    OUTPUT.mkdir(parents=True, exist_ok=True)
    path = OUTPUT / f"{name}.png"
    driver.save_screenshot(str(path))
    return path


def page_errors(driver) -> list[str]:
    """What the page logged as errors since the last call: script errors and Content-Security-Policy
    refusals (a failed request, such as an expected 401, is the test's own business)."""
    return [e["message"] for e in driver.get_log("browser")
            if e.get("level") == "SEVERE" and "Failed to load resource" not in e["message"]]


def wait_for(cond, timeout: float = 30.0, what: str = "the page", every: float = 0.1):
    """Poll `cond()` until it returns something true (returned); fail naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = cond()
            if value:
                return value
        except Exception as exc:  # noqa: BLE001 - the element may not be there yet
            last_exc = exc
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}" + (f" (last error: {last_exc})" if last_exc else ""))


def reset(driver, base: str, path: str = "/") -> None:
    """Open `base + path` with this origin's storage emptied (no conversations, no keys)."""
    driver.get(base + "/ui/style.css")  # any page of the origin, to reach its storage
    driver.execute_script("localStorage.clear(); sessionStorage.clear();")
    driver.get(base + path)


# ---- the chat page ---------------------------------------------------------------------------------------
def by_id(d, name):
    return d.find_element(By.ID, name)


def set_field(d, name: str, value: str) -> None:
    """Type into a settings field (opening its <details> first) and fire its change event."""
    field = by_id(d, name)
    d.execute_script("const f = arguments[0]; const det = f.closest('details'); if (det) det.open = true;", field)
    field.clear()
    if value:
        field.send_keys(value)
    d.execute_script("arguments[0].dispatchEvent(new Event('change'))", field)


def model_options(d) -> list[str]:
    """The model picker's values, read in one go (the page rebuilds the list when the models change)."""
    return d.execute_script("return [...document.getElementById('model').options].map(o => o.value)")


def pick_model(d, name: str) -> None:
    """Choose `name` in the model picker once it is listed (as a person's choice: a change event)."""
    wait_for(lambda: d.execute_script(
        "const s = document.getElementById('model');"
        "if (![...s.options].some(o => o.value === arguments[0])) return false;"
        "s.value = arguments[0]; s.dispatchEvent(new Event('change')); return true;", name), 30,
        f"model {name} in the list")


def send(d, text: str) -> None:
    box = by_id(d, "prompt")
    box.clear()
    box.send_keys(text)
    by_id(d, "send").click()


def answered(d, timeout: float = 60.0):
    """The last assistant message once its stream has ended."""
    wait_for(lambda: d.execute_script("return document.body.dataset.streaming") == "0" and
             d.find_elements(By.CSS_SELECTOR, ".msg.assistant"), timeout, "the answer to end")
    return d.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1]


def no_markup_ran(d) -> None:
    """Nothing the answers carried became an element or ran."""
    assert d.execute_script("return window.pwned") is None
    assert "pwned" not in d.title
    assert not d.find_elements(By.CSS_SELECTOR, "#messages script, #messages .content img, #messages .tool-call img, "
                                                "#messages .reasoning img, #messages b")
