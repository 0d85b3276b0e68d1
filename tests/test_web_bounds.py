"""What the second adversarial run found (issue 31), each as a specification the web layer now meets.

In-process (Flask's test client on the fake backend of test_web_app: one character, one token), so
each rule is checked without a model: the tokenizer routes, the cache scope's encoding, what is
size-checked before tokenizing, the bound on echoed prompt log probabilities, transfer codings, and
forced tool calls cut by `max_tokens`. Work that must leave the event loop is recognised by the name
of the OS thread it runs in (`pantheon.web.bridge.call_in_thread` names each one).
"""

from __future__ import annotations

import itertools
import threading

import pytest

from fake_backend import ChoicesBackend
from pantheon.config import Settings
from pantheon.web.chat import cache_scope, parse_chat_request
from test_web_app import HELLO, FakeModel, backend, chat, in_flight, registry_app, sse  # noqa: F401
from test_web_app import app_and_reg, client, stub_grammar  # noqa: F401  (pytest fixtures)


# ---- item 8: the cache scope is an unambiguous encoding of its parts ------------------------------------------
def _scope(key: str | None = None, **fields: str) -> str:
    return cache_scope(key, parse_chat_request({"messages": HELLO, **fields}, {}))


def test_cache_scopes_of_different_parts_never_coincide():
    # The pair: with separator bytes these two hashed the same bytes and shared a prefix cache.
    assert _scope(user="x\u0000\u0001y") != _scope(user="x", session_id="y\u0000")
    # And any other split of the same characters over the four parts.
    texts = [None, "", "x", "\u0000", "\u0001", "x\u0000", "\u0000\u0001y", "y\u0000", "x\u0000\u0001y"]
    seen: dict[str, tuple] = {}
    for key, user, session, salt in itertools.product(texts, repeat=4):
        fields = {k: v for k, v in (("user", user), ("session_id", session), ("cache_salt", salt)) if v is not None}
        scope = _scope(key, **fields)
        assert seen.setdefault(scope, (key, user, session, salt)) == (key, user, session, salt)


# ---- item 11: a transfer coding other than plain chunked is refused --------------------------------------------
@pytest.mark.parametrize("coding", ["gzip, chunked", "deflate,chunked", "chunked, chunked", "identity"])
def test_a_body_in_another_transfer_coding_is_501_and_never_read(client, app_and_reg, coding):
    before = backend(app_and_reg[1]).last_request
    r = client.post("/v1/chat/completions", data=b'{"messages": [{"role": "user", "content": "hi"}]}',
                    headers={"Content-Type": "application/json", "Transfer-Encoding": coding})
    assert r.status_code == 501, r.get_data(as_text=True)
    err = r.get_json()["error"]
    assert err["code"] == "unsupported_transfer_coding" and err["type"] == "invalid_request_error"
    assert backend(app_and_reg[1]).last_request is before  # nothing ran


def test_a_plainly_chunked_body_is_still_taken(client):
    r = client.post("/v1/chat/completions", data=b'{"messages": [{"role": "user", "content": "hi"}]}',
                    headers={"Content-Type": "application/json", "Transfer-Encoding": "Chunked"})
    assert r.status_code == 200, r.get_data(as_text=True)


# ---- items 5 and 6: the tokenizer routes are bounded and do their large work off the event loop ------------------
def os_thread_name() -> str:
    """The kernel's name of the calling OS thread (pantheon.osthread names the threads it starts)."""
    with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
        return f.read().strip()


@pytest.fixture()
def tok_threads(app_and_reg, monkeypatch):
    """The fake model's tokenizer, recording the OS thread each encode/decode ran in."""
    e = app_and_reg[1].acquire("m")
    app_and_reg[1].release(e)
    tok, seen = e.card.tokenizer, []
    for name in ("encode", "decode"):
        def recorded(*args, _fn=getattr(tok, name), _name=name, **kwargs):
            seen.append((_name, os_thread_name()))
            return _fn(*args, **kwargs)
        monkeypatch.setattr(tok, name, recorded)
    return tok, seen


@pytest.mark.parametrize("with_pieces", [False, True])
def test_a_long_text_is_tokenized_in_an_os_thread(client, app_and_reg, tok_threads, with_pieces):
    text = "ab" * 10000  # over 16 KiB: the size that used to be a 500 ("working outside of application context")
    r = client.post("/tokenize", json={"content": text, "with_pieces": with_pieces})
    assert r.status_code == 200, r.get_data(as_text=True)[:300]
    tokens = r.get_json()["tokens"]
    assert tokens[:2] == ([{"id": 97, "piece": "a"}, {"id": 98, "piece": "b"}] if with_pieces else [97, 98])
    assert len(tokens) == len(text)
    assert tok_threads[1] == [("encode", "pantheon-tokeni")]  # the kernel keeps 15 bytes of the name
    assert in_flight(app_and_reg[1]) == 0


def test_tokenize_returns_at_most_tokens_max_ids(client, app_and_reg, tok_threads, monkeypatch):
    from pantheon.web.schema import TOKENS_MAX
    r = client.post("/tokenize", json={"content": "x" * (TOKENS_MAX + 1)})
    assert r.status_code == 400 and r.get_json()["error"]["param"] == "content"
    assert client.post("/tokenize", json={"content": "x" * TOKENS_MAX}).status_code == 200
    # A tokenizer that can bound a text's count from its length refuses it without tokenizing it.
    tok, seen = tok_threads
    monkeypatch.setattr(tok, "min_tokens", len, raising=False)
    seen.clear()
    r = client.post("/tokenize", json={"content": "x" * (TOKENS_MAX + 1)})
    assert r.status_code == 400 and "at least" in r.get_json()["error"]["message"] and seen == []
    assert in_flight(app_and_reg[1]) == 0


def test_detokenize_takes_at_most_tokens_max_ids_and_decodes_many_in_an_os_thread(client, app_and_reg, tok_threads):
    from pantheon.web.schema import TOKENS_MAX
    r = client.post("/detokenize", json={"tokens": [104] * (TOKENS_MAX + 1)})
    assert r.status_code == 400 and r.get_json()["error"]["param"] == "tokens"
    assert str(TOKENS_MAX) in r.get_json()["error"]["message"]
    assert tok_threads[1] == []  # refused before anything was decoded
    r = client.post("/detokenize", json={"tokens": [104] * TOKENS_MAX})
    assert r.status_code == 200 and r.get_json() == {"content": "h" * TOKENS_MAX}
    assert tok_threads[1] == [("decode", "pantheon-detoke")]
    assert in_flight(app_and_reg[1]) == 0


def test_a_short_id_list_is_decoded_in_place(client, tok_threads):
    assert client.post("/detokenize", json={"tokens": [104, 105]}).get_json() == {"content": "hi"}
    assert tok_threads[1] == [("decode", os_thread_name())]


# ---- item 9: every part of a chat prompt is size-checked before anything is tokenized -------------------------
@pytest.fixture()
def bounded_model(app_and_reg, tok_threads, monkeypatch):
    """The fake model with a template that renders the tools too (as real ones do), and a tokenizer that
    bounds a text's token count from its length (one character, one token: the bound is exact)."""
    e = app_and_reg[1].acquire("m")
    app_and_reg[1].release(e)
    tok, seen = tok_threads
    monkeypatch.setattr(tok, "min_tokens", len, raising=False)

    def render(messages, tools=None, **kwargs):
        shown = "".join(t["function"].get("description", "") for t in tools or [])
        return shown + "".join(str(m.get("content") or "") for m in messages)
    monkeypatch.setattr(e.card.template, "render", render)
    return e.card, seen


def big_tools(chars: int) -> list[dict]:
    return [{"type": "function", "function": {"name": "get_weather", "description": "w" * chars,
                                              "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("tool_choice", ["required", "auto"])
@pytest.mark.parametrize("truncate", [None, "oldest"])
def test_a_tools_list_longer_than_the_window_is_refused_before_tokenizing(client, app_and_reg, bounded_model,
                                                                          stub_grammar, tool_choice, truncate):
    card, seen = bounded_model
    body = {"tools": big_tools(40 * card.context_length), "tool_choice": tool_choice}
    if truncate:
        body["truncate"] = truncate
    r = chat(client, **body)
    assert r.status_code == 400 and r.get_json()["error"]["code"] == "context_length_exceeded"
    assert "at least" in r.get_json()["error"]["message"]
    assert seen == [] and stub_grammar == []  # nothing tokenized, no grammar compiled
    assert in_flight(app_and_reg[1]) == 0


def test_an_earlier_assistant_turn_counts_before_tokenizing(client, app_and_reg, bounded_model):
    card, seen = bounded_model
    long_turn = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a" * (40 * card.context_length)},
                 {"role": "user", "content": "and?"}]
    r = chat(client, messages=long_turn)
    assert r.status_code == 400 and r.get_json()["error"]["code"] == "context_length_exceeded"
    assert seen == []
    # With truncation the long turn is dropped from the text alone; only what is kept is tokenized.
    r = chat(client, messages=long_turn, truncate="oldest")
    assert r.status_code == 200 and r.get_json()["context_capped"] is True
    assert len(seen) == 1 and backend(app_and_reg[1]).last_request.prompt_ids == [ord(c) for c in "and?"]


def test_tools_that_fit_are_rendered_and_tokenized_once(client, bounded_model, stub_grammar):
    card, seen = bounded_model
    r = chat(client, tools=big_tools(8), tool_choice="required")
    assert r.status_code == 200 and len(seen) == 1 and stub_grammar


def test_a_completion_prompt_longer_than_the_window_is_refused_before_tokenizing(client, bounded_model):
    card, seen = bounded_model
    r = client.post("/v1/completions", json={"prompt": "x" * (40 * card.context_length)})
    assert r.status_code == 400 and r.get_json()["error"]["code"] == "context_length_exceeded"
    assert "at least" in r.get_json()["error"]["message"] and seen == []


# ---- item 12: a tool call cut by max_tokens comes back as a partial call, never as content --------------------
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
CUT_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}},
                                         "auto"])
def test_a_tool_call_cut_by_max_tokens_is_a_partial_call_with_finish_length(client, app_and_reg, stub_grammar,
                                                                            tool_choice):
    backend(app_and_reg[1]).script = (CUT_CALL, "length")
    body = chat(client, tools=TOOLS, tool_choice=tool_choice, max_tokens=len(CUT_CALL)).get_json()
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"] is None
    (got,) = choice["message"]["tool_calls"]
    assert got["type"] == "function" and got["id"].startswith("call_")
    assert got["function"] == {"name": "get_weather", "arguments": '{"city": "Pa'}

    chunks = [c for c in sse(chat(client, tools=TOOLS, tool_choice=tool_choice, max_tokens=len(CUT_CALL),
                                  stream=True)) if c != "[DONE]"]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == ""
    calls = [t for c in chunks for t in c["choices"][0]["delta"].get("tool_calls") or []]
    assert [(t["index"], t["function"]) for t in calls] == [(0, {"name": "get_weather", "arguments": '{"city": "Pa'})]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_a_forced_call_cut_inside_its_opening_tag_shows_no_markup(client, app_and_reg, stub_grammar):
    backend(app_and_reg[1]).script = ("<tool_c", "length")
    choice = chat(client, tools=TOOLS, tool_choice="required", max_tokens=7).get_json()["choices"][0]
    assert choice["message"]["content"] == "" and choice["message"]["tool_calls"] is None
    assert choice["finish_reason"] == "length"


# ---- item 10: echoed prompt log probabilities are bounded, and a large answer is built off the event loop ------
class WideModel(FakeModel):
    max_seq = 4096  # room for the 4 kB prompt


def wide_app(tmp_path, **settings) -> tuple:
    return registry_app(Settings(home=tmp_path, **settings), lambda p, n, d, s: WideModel(n, n_slots=8),
                        lambda m, s: ChoicesBackend(m))


def echo(client, prompt: str, **body):
    return client.post("/v1/completions", json={"prompt": prompt, "echo": True, "max_tokens": 4, **body})


def test_echo_logprobs_past_the_cap_are_a_400_before_anything_runs(tmp_path):
    app, reg = wide_app(tmp_path)  # the default cap
    prompt = "x" * 4000
    r = echo(app.test_client(), prompt, logprobs=20, n=8, stream=True)  # the request: 8 MB, 87 s
    assert r.status_code == 400 and r.get_json()["error"]["param"] == "logprobs"
    assert "672000" in r.get_json()["error"]["message"]  # 8 x 4000 x 21
    assert backend(reg).last_request is None and in_flight(reg) == 0
    # Under the cap it is served: n x tokens x (k + 1) = 1 x 3000 x 21 = 63000 entries.
    r = echo(app.test_client(), "x" * 3000, logprobs=20, n=1)
    assert r.status_code == 200 and len(r.get_json()["choices"][0]["logprobs"]["tokens"]) == 3000 + 4


def test_the_echo_cap_is_a_setting(tmp_path, monkeypatch):
    from pantheon.config import load_settings
    assert load_settings({"PANTHEON_MAX_ECHO_LOGPROBS": "120"}).max_echo_logprobs == 120
    app, _ = wide_app(tmp_path, max_echo_logprobs=120)
    assert echo(app.test_client(), "abcdefghij", logprobs=5, n=2).status_code == 200  # 2 x 10 x 6 = 120
    r = echo(app.test_client(), "abcdefghij", logprobs=5, n=2, stream=True, max_tokens=1)
    assert r.status_code == 200
    r.close()
    assert echo(app.test_client(), "abcdefghijk", logprobs=5, n=2).status_code == 400  # 132
    assert echo(app.test_client(), "abcdefghijk", n=8).status_code == 200  # echo alone is not scored


@pytest.mark.parametrize("stream", [False, True])
def test_a_large_echo_is_scored_and_serialised_in_os_threads(tmp_path, monkeypatch, stream):
    import pantheon.web.generation as generation
    import pantheon.web.routes as routes
    app, reg = wide_app(tmp_path)
    e = reg.acquire("m")
    reg.release(e)
    tok, where = e.card.tokenizer, []
    monkeypatch.setattr(tok, "token_text", lambda tid, _f=tok.token_text: where.append(os_thread_name()) or _f(tid))
    for mod in (generation, routes):
        monkeypatch.setattr(mod, "json_text", lambda obj, _f=mod.json_text, **kw: where.append(
            "json:" + os_thread_name()) or _f(obj, **kw))
    prompt = "ab" * 1000
    r = echo(app.test_client(), prompt, logprobs=5, n=4, stream=stream)  # 4 x 2000 x 6 = 48000 entries
    assert r.status_code == 200
    if stream:
        firsts = [c for c in sse(r) if c != "[DONE]" and c["choices"] and c["choices"][0]["text"] == prompt]
        columns = [c["choices"][0]["logprobs"] for c in firsts]
    else:
        columns = [c["logprobs"] for c in r.get_json()["choices"]]
    assert len(columns) == 4
    for lp in columns:
        assert lp["tokens"][:2000] == list(prompt) and lp["token_logprobs"][0] is None
        assert lp["token_logprobs"][1:2000] == [-0.5 * j for j in range(1, 2000)]
        assert lp["text_offset"][:2000] == list(range(2000))
    prompt_texts = where[:2000]  # the prompt's entries are built first, once for all the choices
    assert set(prompt_texts) == {"pantheon-logpro"}
    assert ("json:pantheon-logpro" if stream else "json:pantheon-json") in where
