"""What the third adversarial run found (issue 43, scope items 1 and 2), each as a specification.

In-process (Flask's test client on the fake backend of test_web_app: one character, one token, a
64-token window), so each rule is checked by counting what ran -- tokenizer passes, renders, decodes,
submits -- never by timing: `/v1/messages/count_tokens` refuses what `/v1/messages` refuses, with the same
error and without tokenizing; a request's generations (prompts x n) are bounded by a setting.
"""

from __future__ import annotations

import pytest

from test_web_app import ADMIN, FakeModel, ScriptBackend, backend, in_flight, registry_app  # noqa: F401
from test_web_app import app_and_reg, client  # noqa: F401  (pytest fixtures)
from test_web_bounds import bounded_model, os_thread_name, tok_threads  # noqa: F401  (pytest fixtures)


# ---- row 4: count_tokens is bounded as /v1/messages is ------------------------------------------------------------
def _big_bodies(window: int) -> dict[str, dict]:
    """The issue's three shapes, scaled to the fake model's window: one huge message, very many
    messages, very many tools (the template renders tool descriptions)."""
    tools = [{"name": f"t{i}", "description": "d" * 40, "input_schema": {"type": "object"}} for i in range(1200)]
    return {"huge message": {"messages": [{"role": "user", "content": "lorem ipsum " * (40 * window)}]},
            "many messages": {"messages": [{"role": "user", "content": "x"}] * (40 * window + 1)},
            "many tools": {"messages": [{"role": "user", "content": "hi"}], "tools": tools}}


@pytest.mark.parametrize("shape", ["huge message", "many messages", "many tools"])
def test_count_tokens_refuses_what_messages_refuses_without_tokenizing(client, app_and_reg, bounded_model, shape):
    card, seen = bounded_model
    body = _big_bodies(card.context_length)[shape]
    sent = client.post("/v1/messages", json={**body, "max_tokens": 4})
    assert sent.status_code == 400, sent.get_data(as_text=True)[:300]
    counted = client.post("/v1/messages/count_tokens", json=body)
    assert counted.status_code == sent.status_code, counted.get_data(as_text=True)[:300]
    assert counted.get_json() == sent.get_json()  # the same Anthropic error, word for word
    assert "at least" in counted.get_json()["error"]["message"]
    assert seen == []  # neither route tokenized anything
    assert in_flight(app_and_reg[1]) == 0


def test_count_tokens_counts_what_fits_and_refuses_a_count_past_the_window(client, bounded_model, monkeypatch):
    card, seen = bounded_model
    r = client.post("/v1/messages/count_tokens", json={"messages": [{"role": "user", "content": "hello"}]})
    assert r.status_code == 200 and r.get_json() == {"input_tokens": 5} and len(seen) == 1
    # A tokenizer whose length bound is weaker than its count: refused after counting, as /v1/messages refuses.
    monkeypatch.setattr(card.tokenizer, "min_tokens", lambda text: 0, raising=False)
    body = {"messages": [{"role": "user", "content": "y" * card.context_length}]}
    sent = client.post("/v1/messages", json={**body, "max_tokens": 4})
    counted = client.post("/v1/messages/count_tokens", json=body)
    assert sent.status_code == counted.status_code == 400 and counted.get_json() == sent.get_json()


def test_a_big_count_is_rendered_off_the_event_loop_and_long_messages_never_rendered(client, bounded_model, monkeypatch):
    card, seen = bounded_model
    rendered_in = []
    render = card.template.render

    def recorded(*args, **kwargs):
        rendered_in.append(os_thread_name())
        return render(*args, **kwargs)
    monkeypatch.setattr(card.template, "render", recorded)
    bodies = _big_bodies(card.context_length)
    # the tools are only seen in the rendering: rendered, in an OS thread, then refused from its length
    r = client.post("/v1/messages/count_tokens", json=bodies["many tools"])
    assert r.status_code == 400 and rendered_in == ["pantheon-tokeni"]  # the kernel keeps 15 bytes of the name
    # messages whose text alone is past the window are refused before anything is rendered, on both routes
    rendered_in.clear()
    for shape in ("huge message", "many messages"):
        assert client.post("/v1/messages/count_tokens", json=bodies[shape]).status_code == 400
        assert client.post("/v1/messages", json={**bodies[shape], "max_tokens": 4}).status_code == 400
    assert rendered_in == []


# ---- row 2: a request's generations are bounded by a setting ------------------------------------------------------
@pytest.fixture()
def wide_app(tmp_path):
    """The fake model with 64 slots (so the slot bound on `n` is not what refuses) and the default settings."""
    from pantheon.config import Settings
    settings = Settings(home=tmp_path, admin_key=ADMIN)
    app, reg = registry_app(settings, lambda p, n, d, s: FakeModel(n, n_slots=64), lambda m, s: ScriptBackend(m))
    return app.test_client(), reg, settings


def test_a_completion_of_more_generations_than_the_setting_is_a_400_naming_the_field(wide_app):
    client, reg, settings = wide_app
    assert settings.max_generations == 16
    r = client.post("/v1/completions", json={"prompt": ["p"] * 64, "n": 8, "max_tokens": 16})  # the 512
    err = r.get_json()["error"]
    assert r.status_code == 400 and err["param"] == "n" and "512" in err["message"], err
    assert "PANTHEON_MAX_GENERATIONS_PER_REQUEST" in err["message"]
    r = client.post("/v1/completions", json={"prompt": ["p"] * 17, "max_tokens": 2})
    assert r.status_code == 400 and r.get_json()["error"]["param"] == "prompt"
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "n": 17})
    assert r.status_code == 400 and r.get_json()["error"]["param"] == "n"
    assert backend(reg).last_request is None and in_flight(reg) == 0  # nothing was submitted
    r = client.post("/v1/completions", json={"prompt": ["p"] * 16, "max_tokens": 2})  # 16: taken
    assert r.status_code == 200 and len(r.get_json()["choices"]) == 16


# ---- row 6: images are counted from their headers before any pixel is decoded, and decoded in a bounded pool ------
def _png(width: int, height: int) -> str:
    import base64
    import io

    from PIL import Image
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


class VisionTemplate:
    """Renders text parts as they are and image parts as the model's marker (as a VLM's template does)."""

    def render(self, messages, **kwargs) -> str:
        out = []
        for m in messages:
            c = m.get("content")
            parts = c if isinstance(c, list) else [{"type": "text", "text": c or ""}]
            out += [p.get("text", "") if p.get("type") == "text" else p["marker"] for p in parts]
        return "".join(out)


class TilingModel(FakeModel):
    """The fake model with a tiling vision card (Idefics3's kind): tiles of 8 pixels, the longer side
    resized to 16, 12 image tokens ("@") per tile -- so a square image is 2 x 2 tiles plus the whole image,
    60 image tokens (with their tile marks, more than the 64-token window), and a 64 x 8 one 1 x 2 tiles plus
    the whole image, 36."""

    def __init__(self, name: str):
        import dataclasses

        from pantheon.types import VisionCard
        super().__init__(name)
        vision = VisionCard(image_size=8, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5), n_tokens=12, image_id=ord("@"),
                            marker="<img>", expansion="@" * 12, tiling=16, tile_prefix="<{row}{col}>",
                            image_text="@")
        self.template = VisionTemplate()
        self.card = dataclasses.replace(self.card, template=self.template, vision=vision)


@pytest.fixture()
def vision_app(tmp_path, monkeypatch):
    """(client, registry, server state, decodes): the tiling fake model, one image-decoding thread and no
    queue; `decodes` counts the images whose pixels were decoded."""
    from pantheon.config import Settings
    from pantheon.formats import images
    settings = Settings(home=tmp_path, admin_key=ADMIN, image_threads=1, image_queue=0)
    app, reg = registry_app(settings, lambda p, n, d, s: TilingModel(n), lambda m, s: ScriptBackend(m))
    decodes = []
    real = images.decode
    monkeypatch.setattr(images, "decode", lambda *a, **k: decodes.append(1) or real(*a, **k))
    return app.test_client(), reg, app.extensions["pantheon"], decodes


def _with_image(url: str) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "text", "text": "see "},
                                                      {"type": "image_url", "image_url": {"url": url}}]}],
            "max_tokens": 2}


def test_an_image_whose_tokens_overflow_the_context_is_refused_before_any_pixel_is_decoded(vision_app):
    client, reg, _, decodes = vision_app
    r = client.post("/v1/chat/completions", json=_with_image(_png(64, 64)))
    assert r.status_code == 400 and r.get_json()["error"]["code"] == "context_length_exceeded", r.get_json()
    assert decodes == [] and backend(reg).last_request is None
    r = client.post("/v1/chat/completions", json=_with_image(_png(64, 8)))  # fits: admitted, then decoded
    assert r.status_code == 200, r.get_json()
    assert decodes == [1] and len(backend(reg).last_request.images) == 3  # two tiles and the whole image
    assert in_flight(reg) == 0


def test_image_decoding_is_a_bounded_pool_that_answers_429_when_full(vision_app):
    import threading
    client, reg, state, decodes = vision_app
    hold, started = threading.Event(), threading.Event()
    state.images.submit(lambda: started.set() or hold.wait(30), lambda ok, value: None)  # the one thread, busy
    try:
        assert started.wait(30)
        r = client.post("/v1/chat/completions", json=_with_image(_png(64, 8)))
        assert r.status_code == 429 and r.headers.get("Retry-After"), r.get_json()
        assert decodes == [] and backend(reg).last_request is None and in_flight(reg) == 0
    finally:
        hold.set()
    assert state.images.wait_idle(30)
    assert client.post("/v1/chat/completions", json=_with_image(_png(64, 8))).status_code == 200


def test_an_image_in_a_turn_that_capping_drops_is_never_decoded(vision_app):
    client, reg, _, decodes = vision_app
    body = _with_image(_png(64, 8))  # 50 tokens with its text
    body["messages"] += [{"role": "assistant", "content": "a" * 20}, {"role": "user", "content": "and now?"}]
    r = client.post("/v1/chat/completions", json={**body, "truncate": "oldest"})
    assert r.status_code == 200 and r.get_json()["context_capped"] is True, r.get_json()
    assert decodes == [] and backend(reg).last_request.images == ()
