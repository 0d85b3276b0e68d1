"""Images through the official `openai` client on a running server: the two tiny VLM families of
tests/fixtures/tiny-vlm (Gemma 3 as `vlm`, Idefics3 / SmolVLM as `smol`) served with their projectors
(`?mmproj=` in the model spec, what `--mmproj` writes), next to a text-only model. A chat with one and
with two images answers each family's float64 oracle's greedy tokens, streamed and not, alone and batched
with 7 text-only streams; the refusals are 400s naming the part."""

from __future__ import annotations

import base64
import io
import json
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from PIL import Image

from conftest import FIXTURES, TINY
from server_util import start_server

pytestmark = pytest.mark.slow

VLM = FIXTURES / "tiny-vlm"
ADMIN = "vision-admin"


@pytest.fixture(scope="module")
def srv():
    models = [f"vlm={VLM / 'gemma3-vlm.gguf'}?mmproj={VLM / 'gemma3-vlm.mmproj.gguf'}",
              f"smol={VLM / 'idefics3-vlm.gguf'}?mmproj={VLM / 'idefics3-vlm.mmproj.gguf'}",
              f"text={TINY / 'gemma3.gguf'}"]
    s = start_server(models, env={"PANTHEON_BATCH_SLOTS": "8", "PANTHEON_KV_DTYPE": "float32",
                                  "PANTHEON_MODEL_DIR": str(VLM), "PANTHEON_ADMIN_KEY": ADMIN,
                                  "PANTHEON_PREFILL_CHUNK": "32", "PANTHEON_MAX_IMAGES": "2", "PANTHEON_MAX_SEQ": "192",
                                  "PANTHEON_MAX_IMAGE_PIXELS": "10000"}, timeout=400)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300)


FILES = {"vlm": "gemma3-vlm", "smol": "idefics3-vlm"}  # served name -> the family's fixture files


def fixture(model: str = "vlm") -> dict:
    return json.loads((VLM / f"{FILES[model]}.json").read_text())


def data_url(name: str, fmt: str = "PNG") -> str:
    """The fixture image as a data URL (re-encoded losslessly for WebP, so the pixels are the PNG's)."""
    raw = (VLM / name).read_bytes()
    if fmt != "PNG":
        buf = io.BytesIO()
        Image.open(io.BytesIO(raw)).save(buf, format=fmt, lossless=True)
        raw = buf.getvalue()
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(raw).decode()


def big_png(w: int, h: int) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (200, 30, 30)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def one_image(url: str) -> list[dict]:
    """The oracle's "one" prompt as chat messages (the server's rendering tokenizes to its ids)."""
    return [{"role": "user", "content": [{"type": "text", "text": "What is in this image?"}, image(url),
                                         {"type": "text", "text": "Describe it."}]}]


def two_images(a: str, b: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "Compare"}, image(a), {"type": "text", "text": "and"},
                                         image(b), {"type": "text", "text": "which one is brighter?"}]}]


def token_bytes(resp) -> list[bytes]:
    """The answer's tokens as the bytes its logprobs entries carry."""
    return [bytes(t.bytes) for t in resp.choices[0].logprobs.content]


def case_messages(model: str, case: str) -> list[dict]:
    """The oracle's prompt of `case` as chat messages with the fixture's images as data URLs (the server's
    rendering tokenizes to the oracle's ids)."""
    j = fixture(model)
    urls = [data_url(n) for n in j["image_files"]]
    if model == "vlm":
        return one_image(urls[0]) if case == "one" else two_images(*urls)
    it = iter(urls)  # the Idefics3 fixture records its chat, {"type": "image"} where each image goes
    return [{"role": m["role"], "content": [image(next(it)) if p["type"] == "image" else p for p in m["content"]]}
            for m in j["cases"][case]["chat"]]


def oracle_bytes(ids: list[int], model: str = "vlm") -> list[bytes]:
    """The oracle's greedy ids as bytes, by the model file's own vocabulary."""
    from pantheon.formats.gguf_loader import open_gguf
    from pantheon.text.tokenizer import Tokenizer
    f = open_gguf(VLM / f"{FILES[model]}.gguf")
    tok = Tokenizer.from_gguf_metadata(f.meta, str(f.path))
    return [tok.token_bytes(i) for i in ids]


def chat(client, messages, model="vlm", n=8, **kw):
    return client.chat.completions.create(model=model, messages=messages, max_tokens=n, temperature=0,
                                          logprobs=True, extra_body={"ignore_eos": True}, **kw)


def streamed(client, messages, model="vlm", n=8) -> str:
    s = client.chat.completions.create(model=model, messages=messages, max_tokens=n, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    return "".join(c.choices[0].delta.content or "" for c in s if c.choices)


@pytest.mark.parametrize("model", ["vlm", "smol"])
@pytest.mark.parametrize("case", ["one", "two"])
def test_chat_with_images_answers_the_oracle_streamed_and_not(client, model, case):
    c = fixture(model)["cases"][case]
    msgs = case_messages(model, case)
    r = chat(client, msgs, model=model)
    assert r.usage.prompt_tokens == len(c["prompt_ids"])  # the image tokens are counted
    assert token_bytes(r) == oracle_bytes(c["greedy_ids"], model)
    assert r.choices[0].message.content == streamed(client, msgs, model=model)


def test_webp_and_png_of_the_same_pixels_answer_alike(client):
    j = fixture()
    png, webp = data_url(j["image_files"][0]), data_url(j["image_files"][0], "WEBP")
    assert chat(client, one_image(png)).choices[0].message.content == \
        chat(client, one_image(webp)).choices[0].message.content


def test_image_chats_batched_with_seven_text_streams_equal_alone(client):
    j = fixture()
    a, b = (data_url(n) for n in j["image_files"])
    texts = [[{"role": "user", "content": w}] for w in
             ("hello there", "the cat sat", "compare the colours", "a red square", "which is brighter",
              "the sun went down", "describe the light")]
    jobs = [("vlm", one_image(a)), ("vlm", two_images(a, b))] + [("text", m) for m in texts]
    jobs += [("smol", case_messages("smol", "one")), ("smol", case_messages("smol", "two"))]
    alone = [chat(client, m, model=mod).choices[0].message.content for mod, m in jobs]
    with ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(lambda job: chat(client, job[1], model=job[0]).choices[0].message.content, jobs))
    assert together == alone


def error_of(exc_info) -> dict:
    return exc_info.value.response.json()["error"]


def test_refusals_are_400s_naming_the_part(client):
    j = fixture()
    a = data_url(j["image_files"][0])
    cases = [
        (one_image("data:image/png;base64,iVBORw0KGgoAAAANSUhEUg=="), "invalid_image"),  # truncated PNG
        (one_image("data:image/png;base64,@@not base64@@"), None),
        (one_image("https://example.com/cat.png"), "image_url_not_allowed"),
        (one_image("file:///etc/passwd"), None),
        (one_image(big_png(120, 100)), "image_too_large"),  # over PANTHEON_MAX_IMAGE_PIXELS (10000)
        ([{"role": "user", "content": [image(a), image(a), image(a)]}], "too_many_images"),
    ]
    for msgs, code in cases:
        with pytest.raises(openai.BadRequestError) as e:
            chat(client, msgs)
        err = error_of(e)
        if code is not None:
            assert err["code"] == code, err
        assert err["param"].startswith("messages"), err
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, one_image(a), model="text")
    assert error_of(e)["code"] == "model_not_multimodal"
    assert "does not take images" in error_of(e)["message"]


def test_admin_load_with_a_projector(srv, client):
    """The admin load takes `mmproj` (a file in the model directory); the loaded copy answers the oracle."""
    r = srv.post("/admin/models/load", {"path": "gemma3-vlm.gguf", "mmproj": "gemma3-vlm.mmproj.gguf",
                                        "name": "vlm2"}, key=ADMIN, timeout=600)
    assert r.status_code == 200, r.text
    try:
        j = fixture()
        got = chat(client, one_image(data_url(j["image_files"][0])), model="vlm2")
        assert token_bytes(got) == oracle_bytes(j["cases"]["one"]["greedy_ids"])
        bad = srv.post("/admin/models/load", {"path": "gemma3-vlm.gguf", "mmproj": "missing.gguf", "name": "vlm3"},
                       key=ADMIN)
        assert bad.status_code == 404 and bad.json()["error"]["param"] == "mmproj"
    finally:
        assert srv.post("/admin/models/unload", {"name": "vlm2"}, key=ADMIN, timeout=120).status_code == 200


def test_anthropic_and_responses_image_blocks(srv, client):
    """The Anthropic Messages `image` block (base64 source) and the Responses `input_image` part carry
    the image as a chat image part does: the same answer as the chat route's."""
    j = fixture()
    url = data_url(j["image_files"][0])
    want = chat(client, one_image(url)).choices[0].message.content
    b64 = url.split(",", 1)[1]
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is in this image?"},
                                             {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                          "data": b64}},
                                             {"type": "text", "text": "Describe it."}]}]
    r = srv.post("/v1/messages", {"model": "vlm", "max_tokens": 8, "temperature": 0, "messages": messages})
    assert r.status_code == 200, r.text
    assert "".join(b["text"] for b in r.json()["content"] if b["type"] == "text") == want
    # count_tokens takes the same image block and counts the prompt the answer ran (issue 43, row 10)
    count = srv.post("/v1/messages/count_tokens", {"model": "vlm", "messages": messages})
    usage = r.json()["usage"]
    assert count.status_code == 200, count.text
    assert count.json() == {"input_tokens": usage["input_tokens"] + usage["cache_read_input_tokens"]}
    r = srv.post("/v1/responses", {"model": "vlm", "max_output_tokens": 8, "temperature": 0, "input": [{
        "role": "user", "content": [{"type": "input_text", "text": "What is in this image?"},
                                    {"type": "input_image", "image_url": url},
                                    {"type": "input_text", "text": "Describe it."}]}]})
    assert r.status_code == 200, r.text
    out = r.json()["output"]
    assert "".join(c["text"] for item in out if item["type"] == "message" for c in item["content"]
                   if c["type"] == "output_text") == want
    bad = srv.post("/v1/messages", {"model": "text", "max_tokens": 8, "messages": [{
        "role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                   "data": b64}}]}]})
    assert bad.status_code == 400 and "does not take images" in bad.text
