"""The OpenAI surface of issue 20 on a scripted backend (no JAX, no server): n choices, logprobs,
logit_bias, response_format / forced tool calls, and the legacy /v1/completions route.

The backend (tests/fake_backend.py) writes one character per token, gives every token a logprob that
is a fixed function of (choice, position), and interleaves the choices' Tokens events in uneven
batches, so these tests pin down the web layer's side of the contract: which entries a client sees,
where, and exactly once.
"""

from __future__ import annotations

import pytest

from fake_backend import SLOTS, entry, prompt_entry, surface_app, token_logprob  # noqa: F401 (fixture)
from test_web_app import HELLO, backend, in_flight, sse, stub_grammar  # noqa: F401 (fixture)

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]


@pytest.fixture()
def client(surface_app):
    return surface_app[0].test_client()


@pytest.fixture()
def fake(surface_app):
    return backend(surface_app[1])


def chat(client, **body):
    body.setdefault("messages", HELLO)
    return client.post("/v1/chat/completions", json=body)


def complete(client, **body):
    body.setdefault("prompt", "hi")
    return client.post("/v1/completions", json=body)


def chat_entry(choice: int, pos: int, ch: str, k: int) -> dict:
    """The chat logprob entry the fake's token `ch` at `pos` of `choice` must show as."""
    e = entry(choice, pos, ord(ch), k)
    return {"token": ch, "logprob": e.logprob, "bytes": list(ch.encode()),
            "top_logprobs": [{"token": chr(i), "logprob": v, "bytes": list(chr(i).encode())} for i, v in e.top]}


def by_choice(chunks: list, n: int, key: str) -> list[list]:
    """Per choice, the chunks' values of `key` in `choice` (dropping the [DONE] and usage chunks)."""
    out: list[list] = [[] for _ in range(n)]
    for c in chunks:
        if isinstance(c, dict) and c.get("choices"):
            (ch,) = c["choices"]
            out[ch["index"]].append(ch.get(key))
    return out


# ---- chat: request validation -----------------------------------------------------------------------------
BAD_CHAT = [
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": False, "top_logprobs": 0}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": "yes"}, "logprobs"),
    ({"n": 0}, "n"),
    ({"n": SLOTS + 1}, "n"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"5": "1"}}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ({"logit_bias": {"5": 1, "05": 2}}, "logit_bias"),
    ({"logit_bias": {str(0x110000): 1}}, "logit_bias"),  # past the vocabulary: checked at start
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "text", "extra": 1}}, "response_format.extra"),

    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "x": 1}}},
     "response_format.json_schema.x"),
    # issue 32: a tool call in the history whose arguments are not a JSON object names its message
    ({"messages": HELLO + [{"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": "}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"messages": HELLO + [{"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "[1]"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
]


@pytest.mark.parametrize("body, param", BAD_CHAT, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD_CHAT)])
def test_chat_fields_are_checked(client, surface_app, body, param):
    r = chat(client, **body)
    assert r.status_code == 400, r.get_data(as_text=True)
    assert r.get_json()["error"]["param"] == param
    assert in_flight(surface_app[1]) == 0


def test_request_fields_reach_the_backend(client, fake):
    r = chat(client, n=SLOTS, logprobs=True, top_logprobs=3, logit_bias={"7": -100, "9": 2.5}, seed=11)
    assert r.status_code == 200
    req = fake.last_request
    assert req.n == SLOTS and req.logprobs == 3 and req.logit_bias == ((7, -100.0), (9, 2.5))
    assert req.params.seed == 11 and req.constraint is None and req.prompt_logprobs is None
    assert chat(client, logprobs=True).status_code == 200 and fake.last_request.logprobs == 0
    assert chat(client, logprobs=False).status_code == 200 and fake.last_request.logprobs is None


def test_response_format_and_forced_tools_become_the_constraint(client, fake, stub_grammar):
    grammar = stub_grammar
    schema = {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "object"}, "strict": True}}
    assert chat(client, response_format=schema).status_code == 200
    assert fake.last_request.constraint == ("grammar", "json_schema") and grammar[-1] == ("response_format", schema)
    assert chat(client, response_format={"type": "json_object"}).status_code == 200
    assert fake.last_request.constraint == ("grammar", "json_object")
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice in ("required", named):
        assert chat(client, tools=TOOLS, tool_choice=choice).status_code == 200
        assert fake.last_request.constraint == ("grammar", "tools")
        assert grammar[-1] == ("tools", ["get_weather", "get_time"], choice, True)
    assert chat(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False).status_code == 200
    assert grammar[-1] == ("tools", ["get_weather", "get_time"], "required", False)
    # both: the forced call constrains the turn; the format is compiled too, so a bad one is refused now
    assert chat(client, response_format=schema, tools=TOOLS, tool_choice="required").status_code == 200
    assert fake.last_request.constraint == ("grammar", "tools")
    assert grammar[-2:] == [("response_format", schema), ("tools", ["get_weather", "get_time"], "required", True)]
    calls = len(grammar)
    for plain in ({"response_format": {"type": "text"}}, {"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "none"}):
        assert chat(client, **plain).status_code == 200 and fake.last_request.constraint is None
    assert len(grammar) == calls  # text and unforced tools build no grammar


# ---- chat: n choices ----------------------------------------------------------------------------------------
def test_n_choices_each_with_its_own_text_finish_and_count(client, fake):
    fake.texts = ["abc", "ok\0never", "defgh"]
    body = chat(client, n=3).get_json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["message"]["content"] for c in body["choices"]] == ["abc", "ok", "defgh"]
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "stop", "length"]
    assert all(c["logprobs"] is None for c in body["choices"])
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 3 + 3 + 5, "total_tokens": 13,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_n_choices_streamed(client, fake):
    fake.texts = ["abc", "ok\0never", "defgh"]
    chunks = sse(chat(client, n=3, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1] == "[DONE]" and chunks[-2]["choices"] == [] and chunks[-2]["usage"]["completion_tokens"] == 11
    deltas = by_choice(chunks, 3, "delta")
    assert [d[0] for d in deltas] == [{"role": "assistant", "content": ""}] * 3
    assert ["".join(x.get("content") or "" for x in d) for d in deltas] == ["abc", "ok", "defgh"]
    finishes = by_choice(chunks, 3, "finish_reason")
    assert [[f for f in fs if f] for fs in finishes] == [["length"], ["stop"], ["length"]]
    assert all(fs[-1] for fs in finishes)  # each choice's finish chunk is its last


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_ends_only_its_own_choice(client, fake, surface_app, stream):
    fake.texts = ["ab STOP cd ef", "0123456789"]
    fake.endless = {0}  # choice 0 only ends when the web layer cancels it
    r = chat(client, n=2, stop="STOP", stream=stream, logprobs=True)
    if stream:
        chunks = sse(r)
        texts = ["".join(d.get("content") or "" for d in ds) for ds in by_choice(chunks, 2, "delta")]
        finish = [[f for f in fs if f][0] for fs in by_choice(chunks, 2, "finish_reason")]
        tokens = [[e["token"] for lp in lps if lp for e in lp["content"]] for lps in by_choice(chunks, 2, "logprobs")]
    else:
        body = r.get_json()
        texts = [c["message"]["content"] for c in body["choices"]]
        finish = [c["finish_reason"] for c in body["choices"]]
        tokens = [[e["token"] for e in c["logprobs"]["content"]] for c in body["choices"]]
        assert body["usage"]["completion_tokens"] == len("ab STOP") + 10  # discarded tokens are not counted
    assert texts == ["ab ", "0123456789"] and finish == ["stop", "length"]
    assert tokens == [list("ab STOP"), list("0123456789")]  # the token that completed the stop string is listed
    assert fake.emitted[1] == 10  # the other choice was not cut short: choice 0 alone was cancelled
    assert fake.last_handle.cancelled_choices == {0} and not fake.last_handle.cancelled.is_set()
    assert in_flight(surface_app[1]) == 0


def test_the_last_choice_to_stop_cancels_the_request(client, fake, surface_app):
    fake.texts = ["ab STOP x", "cd STOP y"]
    fake.endless = {0, 1}  # neither ends unless cancelled
    body = chat(client, n=2, stop="STOP").get_json()
    assert [c["message"]["content"] for c in body["choices"]] == ["ab ", "cd "]
    h = fake.last_handle
    assert len(h.cancelled_choices) == 1 and h.cancelled.is_set()  # the first stopped alone, the last all
    assert in_flight(surface_app[1]) == 0


@pytest.mark.parametrize("stream", [False, True])
def test_an_error_in_one_choice_fails_the_request(client, fake, surface_app, stream):
    fake.texts = ["abcdefgh"]
    fake.fail_choice = 1
    r = chat(client, n=2, stream=stream)
    if stream:
        events = sse(r)
        assert events[-1] == "[DONE]" and events[-2]["error"]["type"] == "server_error"
    else:
        assert r.status_code == 500
    assert in_flight(surface_app[1]) == 0


# ---- chat: logprobs -----------------------------------------------------------------------------------------
def test_logprobs_shape(client, fake):
    fake.texts = ["ab\0", "xyz"]
    body = chat(client, n=2, logprobs=True, top_logprobs=2).get_json()
    c0, c1 = body["choices"]
    assert c0["logprobs"] == {"content": [chat_entry(0, 0, "a", 2), chat_entry(0, 1, "b", 2)], "refusal": None}
    assert c1["logprobs"]["content"] == [chat_entry(1, j, ch, 2) for j, ch in enumerate("xyz")]
    assert c0["logprobs"]["content"][0]["top_logprobs"][0]["logprob"] == c0["logprobs"]["content"][0]["logprob"]
    assert body["usage"]["completion_tokens"] == 6  # the stop token counts, but has no entry
    body = chat(client, logprobs=True).get_json()  # top_logprobs absent: the sampled token alone
    assert all(e["top_logprobs"] == [] for e in body["choices"][0]["logprobs"]["content"])


SCRIPTS = [
    ("held stop prefix", "ab ST cd S", {"stop": ["STOP"]}),
    ("tool call", 'ok <tool_call>{"name": "get_time"}</tool_call> done', {"tools": TOOLS}),
    ("reasoning", "<think>hmm</think>\n\nyes", {}),
    ("hidden control token last", "ab\x01", {}),
]


@pytest.mark.parametrize("text, extra", [s[1:] for s in SCRIPTS], ids=[s[0] for s in SCRIPTS])
def test_streamed_logprobs_come_once_each_in_order(client, fake, text, extra):
    fake.texts = [text, text[::-1]]
    full = chat(client, n=2, logprobs=True, top_logprobs=1, **extra).get_json()
    chunks = sse(chat(client, n=2, logprobs=True, top_logprobs=1, stream=True, **extra))
    for i, lps in enumerate(by_choice(chunks, 2, "logprobs")):
        want = [chat_entry(i, j, ch, 1) for j, ch in enumerate(fake.texts[i])]
        assert [e for lp in lps if lp for e in lp["content"]] == want
        assert full["choices"][i]["logprobs"]["content"] == want
        assert all(lp is None or lp["content"] for lp in lps)  # a chunk carries entries or null
    if "tools" in extra:
        assert full["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_time"
    # never late: by the time a chunk shows text, the entries of the tokens it was made of have gone out
    entries, shown = [0, 0], [0, 0]
    for c in chunks[:-1]:
        ch = c["choices"][0]
        entries[ch["index"]] += len(ch["logprobs"]["content"]) if ch["logprobs"] else 0
        shown[ch["index"]] += len(ch["delta"].get("content") or "") + len(ch["delta"].get("reasoning") or "")
        assert shown[ch["index"]] <= entries[ch["index"]]


def test_hidden_tokens_entries_ride_on_the_finish_chunk(client, fake):
    fake.texts = ["ab\x01\x02"]
    chunks = sse(chat(client, logprobs=True, stream=True))
    final = [c for c in chunks[:-1] if c["choices"][0]["finish_reason"]][0]["choices"][0]
    assert final["delta"] == {} and [e["token"] for e in final["logprobs"]["content"]] == ["\x01", "\x02"]


# ---- legacy completions -------------------------------------------------------------------------------------
def test_completion_basic_shape(client, fake):
    fake.script = ("hello", "length")
    body = complete(client).get_json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion" and body["model"] == "m"
    assert body["choices"] == [{"text": "hello", "index": 0, "logprobs": None, "finish_reason": "length"}]
    assert body["usage"]["prompt_tokens"] == 2 and body["usage"]["completion_tokens"] == 5
    req = fake.last_request
    assert req.prompt_ids == [104, 105] and req.max_tokens == 16 and req.n == 1 and req.prompt_logprobs is None


@pytest.mark.parametrize("prompt", ["hi", [104, 105], ["hi"], [[104, 105]]])
def test_completion_prompt_forms(client, fake, prompt):
    assert complete(client, prompt=prompt).status_code == 200
    assert fake.last_request.prompt_ids == [104, 105]


def legacy_top(ids_lps) -> dict:
    return {chr(i): v for i, v in ids_lps}


def test_completion_echo_and_logprobs(client, fake):
    fake.script = ("ok", "length")
    body = complete(client, echo=True, logprobs=2, max_tokens=5).get_json()
    (c,) = body["choices"]
    assert c["text"] == "hiok"
    req = fake.last_request
    assert req.logprobs == 2 and req.prompt_logprobs == 2
    p1, g0, g1 = prompt_entry(1, ord("i"), 2), entry(0, 0, ord("o"), 2), entry(0, 1, ord("k"), 2)
    assert c["logprobs"] == {
        "tokens": ["h", "i", "o", "k"],
        "token_logprobs": [None, p1.logprob, g0.logprob, g1.logprob],
        "top_logprobs": [None, legacy_top(p1.top), legacy_top(g0.top), legacy_top(g1.top)],
        "text_offset": [0, 1, 2, 3],
    }
    # logprobs 0: the token itself only; without echo, offsets start in the generated text
    c = complete(client, logprobs=0).get_json()["choices"][0]
    assert c["text"] == "ok" and fake.last_request.prompt_logprobs is None
    assert c["logprobs"] == {"tokens": ["o", "k"], "token_logprobs": [token_logprob(0, 0), token_logprob(0, 1)],
                             "top_logprobs": [{"o": token_logprob(0, 0)}, {"k": token_logprob(0, 1)}],
                             "text_offset": [0, 1]}
    assert complete(client, echo=True).get_json()["choices"][0] == {"text": "hiok", "index": 0, "logprobs": None,
                                                                   "finish_reason": "length"}


def test_completion_streamed_with_echo_logprobs_and_n(client, fake):
    fake.texts = ["okay", "no\0"]
    whole = complete(client, echo=True, logprobs=1, n=2).get_json()
    chunks = sse(complete(client, echo=True, logprobs=1, n=2, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1] == "[DONE]" and chunks[-2]["choices"] == [] and chunks[-2]["usage"] == whole["usage"]
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks[:-1])
    texts = by_choice(chunks, 2, "text")
    lps = by_choice(chunks, 2, "logprobs")
    for i in range(2):
        assert texts[i][0] == "hi" and "".join(texts[i]) == whole["choices"][i]["text"]
        merged = {k: [v for lp in lps[i] if lp for v in lp[k]] for k in ("tokens", "token_logprobs", "text_offset")}
        assert merged == {k: whole["choices"][i]["logprobs"][k] for k in merged}
    assert [c["text"] for c in whole["choices"]] == ["hiokay", "hino"]
    assert [c["finish_reason"] for c in whole["choices"]] == ["length", "stop"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_list_of_prompts_is_one_choice_per_prompt_and_n(client, fake, stream):
    """Issue 32: prompt p's choice i is at index p * n + i, each prompt generated from its own ids."""
    fake.texts = ["ab", "cde"]
    seen = []
    submit = fake.submit
    fake.submit = lambda req, sink: (seen.append(list(req.prompt_ids)), submit(req, sink))[1]
    r = complete(client, prompt=["hi", "yo", "ok"], n=2, max_tokens=8, stream=stream,
                 **({"stream_options": {"include_usage": True}} if stream else {}))
    assert r.status_code == 200
    assert seen == [[104, 105], [121, 111], [111, 107]]
    if stream:
        chunks = sse(r)
        usage = chunks[-2]["usage"]
        texts = ["".join(t) for t in by_choice(chunks, 6, "text")]
    else:
        body = r.get_json()
        usage = body["usage"]
        assert [c["index"] for c in body["choices"]] == list(range(6))
        texts = [c["text"] for c in body["choices"]]
    assert texts == ["ab", "cde"] * 3
    assert usage["prompt_tokens"] == 6 and usage["completion_tokens"] == 3 * (2 + 3)


def test_completion_stop_string(client, fake):
    fake.script = ("one, two. three", "length")
    c = complete(client, stop=[". "], max_tokens=40).get_json()["choices"][0]
    assert c["text"] == "one, two" and c["finish_reason"] == "stop"


def test_completion_via_a_models_root(client, fake):
    r = client.post("/m/m/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 200 and r.get_json()["model"] == "m"


BAD_COMPLETIONS = [
    ({"prompt": None}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["a", [1]]}, "prompt"),  # texts and token lists are not mixed
    ({"prompt": [[1], []]}, "prompt[1]"),
    ({"prompt": ["a"] * 65}, "prompt"),  # at most 64 prompts
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": [True]}, "prompt"),
    ({"prompt": [0x110000]}, "prompt"),
    ({"prompt": "x" * 100}, "prompt"),  # longer than the fake's 64-token context
    ({"suffix": "end"}, "suffix"),
    ({"best_of": 3, "n": 2}, "best_of"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"echo": "yes"}, "echo"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"messages": HELLO}, "messages"),
    ({"n": SLOTS + 1}, "n"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"temperature": 3}, "temperature"),
]


@pytest.mark.parametrize("body, param", BAD_COMPLETIONS, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD_COMPLETIONS)])
def test_completion_fields_are_checked(client, surface_app, body, param):
    r = client.post("/v1/completions", json={"prompt": "hi", **body})
    assert r.status_code == 400, r.get_data(as_text=True)
    err = r.get_json()["error"]
    assert err["param"] == param
    if param == "suffix":
        assert "suffix is not supported" in err["message"]
    assert in_flight(surface_app[1]) == 0


def test_completion_context_overflow_is_context_length_exceeded(client):
    err = complete(client, prompt="x" * 100).get_json()["error"]
    assert err["code"] == "context_length_exceeded" and "64" in err["message"] and "100" in err["message"]


def test_best_of_equal_to_n_or_one_is_accepted(client):
    assert complete(client, n=2, best_of=2).status_code == 200
    assert complete(client, best_of=1).status_code == 200
