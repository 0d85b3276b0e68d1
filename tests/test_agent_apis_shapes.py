"""Issue 32 on a scripted backend: the Responses and Messages answer shapes, their event streams, the
response store (scope isolation, bounds) and the validators' refusals. The same routes through the
official SDKs on the real model are tests/test_agent_apis.py."""

from __future__ import annotations

import base64
import contextlib
import gc
import json
import tracemalloc
from pathlib import Path

import pytest

from conftest import FIXTURES
from fake_backend import SLOTS, ChoicesBackend
from pantheon.config import Settings
from pantheon.web.responses import ResponseStore, Stored, key_hash, parse_responses_request
from test_web_app import FakeModel, backend, in_flight, registry_app

CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
FN = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}
A_FN = {"name": "get_weather", "input_schema": {"type": "object"}}


class RoomyModel(FakeModel):
    max_seq = 1024  # room for a text and a whole tool call after it


@pytest.fixture()
def surface_app(tmp_path):
    """(app, registry) serving model "m" on fake_backend's scripted n-choice backend."""
    (tmp_path / "models").mkdir()
    settings = Settings(home=tmp_path, model_dir=(tmp_path / "models").resolve())
    return registry_app(settings, lambda p, n, d, s: RoomyModel(n, n_slots=SLOTS), lambda m, s: ChoicesBackend(m))


@pytest.fixture()
def client(surface_app):
    return surface_app[0].test_client()


@pytest.fixture()
def fake(surface_app):
    return backend(surface_app[1])


def events(resp) -> list[tuple[str, dict]]:
    """(event name, data) of a named-event SSE body; a trailing [DONE] is left out."""
    out = []
    for block in resp.get_data(as_text=True).split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if lines.get("data") and lines["data"] != "[DONE]":
            out.append((lines.get("event", ""), json.loads(lines["data"])))
    resp.close()
    return out


def respond(client, key: str | None = None, **body):
    body.setdefault("input", "hi")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return client.post("/v1/responses", json=body, headers=headers)


def message(client, **body):
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    body.setdefault("max_tokens", 20)
    return client.post("/v1/messages", json=body)


# ---- Responses ---------------------------------------------------------------------------------------------------
def test_a_response_object_holds_reasoning_text_and_calls_as_items_in_order(client, fake):
    fake.texts, fake.script = ["<think>hmm</think>Sure. " + CALL], ("", "stop")
    body = respond(client, tools=[FN], max_output_tokens=200).get_json()
    assert body["object"] == "response" and body["status"] == "completed" and body["id"].startswith("resp_")
    assert [o["type"] for o in body["output"]] == ["reasoning", "message", "function_call"]
    assert body["output"][0]["content"] == [{"type": "reasoning_text", "text": "hmm"}]
    assert body["output"][1]["content"][0]["text"] == "Sure. "
    call = body["output"][2]
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}
    assert call["call_id"] and call["status"] == "completed"
    assert body["usage"]["output_tokens"] == len(fake.texts[0])
    assert body["tools"] == [FN] and body["tool_choice"] == "auto"


def test_the_stream_is_the_typed_event_sequence_and_ends_as_the_object(client, fake):
    fake.texts, fake.script = ["Hello there. " + CALL], ("", "stop")
    evs = events(respond(client, tools=[FN], stream=True, max_output_tokens=200))
    names = [n for n, _ in evs]
    assert names[:2] == ["response.created", "response.in_progress"] and names[-1] == "response.completed"
    assert [d["sequence_number"] for _, d in evs] == list(range(len(evs)))
    assert all(n == d["type"] for n, d in evs)
    assert names[2:] == ["response.output_item.added", "response.content_part.added"] + \
        ["response.output_text.delta"] * names.count("response.output_text.delta") + \
        ["response.output_text.done", "response.content_part.done", "response.output_item.done",
         "response.output_item.added", "response.function_call_arguments.delta",
         "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    final = evs[-1][1]["response"]
    text = "".join(d["delta"] for n, d in evs if n == "response.output_text.delta")
    assert text == final["output"][0]["content"][0]["text"] == "Hello there. "
    assert {d["item_id"] for n, d in evs if n == "response.output_text.delta"} == {final["output"][0]["id"]}
    assert [d["item"]["id"] for n, d in evs if n == "response.output_item.done"] == [o["id"] for o in final["output"]]


def test_max_output_tokens_makes_an_incomplete_response(client, fake):
    fake.script = ("abcdefgh", "length")
    body = respond(client, max_output_tokens=3).get_json()
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert fake.last_request.max_tokens == 3


def test_input_items_become_the_conversation(client, fake):
    items = [{"role": "developer", "content": "D."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "U."}]},
             {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "R."}]},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "Sunny."}]
    assert respond(client, input=items, instructions="I.", tools=[FN]).status_code == 200
    # the scripted template concatenates the turns' contents
    assert "".join(chr(i) for i in fake.last_request.prompt_ids) == "I.D.U.Sunny."


def test_previous_response_id_prepends_the_stored_conversation_and_needs_its_scope(client, fake):
    fake.script = ("A1.", "stop")
    first = respond(client, key="alice", input="Q1.").get_json()
    fake.script = ("A2.", "stop")
    second = respond(client, key="alice", input="Q2.", previous_response_id=first["id"]).get_json()
    assert second["previous_response_id"] == first["id"]
    assert "".join(chr(i) for i in fake.last_request.prompt_ids) == "Q1.A1.Q2."
    respond(client, key="alice", input="Q3.", previous_response_id=second["id"])
    assert "".join(chr(i) for i in fake.last_request.prompt_ids) == "Q1.A1.Q2.A2.Q3."
    for key, extra in (("bob", {}), (None, {}), ("alice", {"user": "someone-else"})):
        r = respond(client, key=key, input="Q.", previous_response_id=first["id"], **extra)
        assert r.status_code == 404 and r.get_json()["error"]["param"] == "previous_response_id", (key, extra)


ASK = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"}
USER = {"role": "user", "content": "Weather?"}


def answer(call_id: str) -> dict:
    return {"type": "function_call_output", "call_id": call_id, "output": "Sunny."}


@pytest.mark.parametrize("items, index", [
    ([USER, answer("call_9")], 1),  # no call at all
    ([USER, ASK, answer("call_9")], 2),  # a call with another id
    ([USER, answer("call_1"), ASK], 1),  # the answer before its call
], ids=["no-call", "other-id", "answer-first"])
def test_a_function_call_output_must_answer_a_call_in_the_input(client, surface_app, items, index):
    r = respond(client, input=items)
    assert r.status_code == 400, r.get_data(as_text=True)
    err = r.get_json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == f"input[{index}].call_id", err
    assert err["message"].startswith(f"input[{index}].call_id: no function_call with call_id 'call_")
    assert in_flight(surface_app[1]) == 0


def test_a_function_call_output_may_answer_a_call_of_the_previous_response(client, fake):
    fake.texts, fake.script = [CALL], ("", "stop")
    first = respond(client, key="alice", tools=[FN], max_output_tokens=200).get_json()
    (call,) = [o for o in first["output"] if o["type"] == "function_call"]
    fake.texts, fake.script = None, ("Sunny it is.", "stop")
    assert respond(client, key="alice", input=[USER, ASK, answer("call_1")]).status_code == 200
    ok = respond(client, key="alice", tools=[FN], input=[answer(call["call_id"])], previous_response_id=first["id"])
    assert ok.status_code == 200, ok.get_data(as_text=True)
    r = respond(client, key="alice", tools=[FN], input=[answer("call_other")], previous_response_id=first["id"])
    assert r.status_code == 400 and r.get_json()["error"]["param"] == "input[0].call_id"


def test_get_and_delete_only_with_the_key_that_stored_it(client, fake):
    rid = respond(client, key="alice").get_json()["id"]
    assert client.get(f"/v1/responses/{rid}", headers={"Authorization": "Bearer bob"}).status_code == 404
    assert client.delete(f"/v1/responses/{rid}", headers={"Authorization": "Bearer bob"}).status_code == 404
    got = client.get(f"/v1/responses/{rid}", headers={"X-Api-Key": "alice"})
    assert got.status_code == 200 and got.get_json()["id"] == rid
    assert client.delete(f"/v1/responses/{rid}", headers={"X-Api-Key": "alice"}).get_json() == {
        "id": rid, "object": "response", "deleted": True}
    assert client.get(f"/v1/responses/{rid}", headers={"X-Api-Key": "alice"}).status_code == 404
    unstored = respond(client, key="alice", store=False).get_json()["id"]
    assert client.get(f"/v1/responses/{unstored}", headers={"X-Api-Key": "alice"}).status_code == 404


def test_the_store_is_bounded_in_entries_and_size():
    store = ResponseStore(max_entries=2, max_bytes=20_000)
    for i in range(3):
        store.put(f"r{i}", Stored("k", "s", {"id": f"r{i}"}, [{"role": "user", "content": "x"}]))
    assert len(store) == 2 and store.get("r0", "k") is None and store.get("r2", "k") is not None
    store.put("big", Stored("k", "s", {}, [{"role": "user", "content": "y" * 12_000}]))
    store.put("big2", Stored("k", "s", {}, [{"role": "user", "content": "z" * 12_000}]))
    assert store.get("big", "k") is None and store.get("big2", "k") is not None and len(store) == 1


# ---- the store holds what it counts (issue 43, row 5) ------------------------------------------------------------
def one_char_conversation(n: int) -> list[dict]:
    """A conversation of `n` one-character user messages, as a request's parse leaves it: the case where
    the JSON text says least about the memory (3.4 M characters, 18 MB of objects at 100,000)."""
    body = json.loads(json.dumps({"input": [{"type": "message", "role": "user", "content": "x"}] * n}))
    return parse_responses_request(body, {}).messages


@contextlib.contextmanager
def traced():
    """tracemalloc running; yields a function giving the bytes allocated since the start and still held
    (by the whole process: other tests' idle threads may add a few kilobytes, which the bounds allow)."""
    tracemalloc.start()
    try:
        gc.collect()
        base = tracemalloc.get_traced_memory()[0]

        def held() -> int:
            gc.collect()
            return tracemalloc.get_traced_memory()[0] - base
        yield held
    finally:
        tracemalloc.stop()


def test_the_store_counts_the_memory_its_objects_hold_not_their_json_characters():
    """What the store counts for an entry is what the entry's objects hold, as tracemalloc measures it
    (within 5 %), where the JSON text is less than a fifth of it."""
    with traced() as held:
        store = ResponseStore()
        store.put("r", Stored("k", "s", {"id": "r"}, one_char_conversation(20_000)))
        measured = held()
        assert abs(store.nbytes - measured) <= 0.05 * measured, (store.nbytes, measured)
        assert len(json.dumps(store.get("r", "k").messages)) < measured / 5


def test_the_bound_bounds_the_memory_held_and_eviction_gives_it_back():
    """Filled past its bound with the worst case (one-character messages), a store holds no more memory
    than the bound, as tracemalloc measures it; once its entries go, the memory is back. The bound
    the settings give is PANTHEON_RESPONSES_STORE_MB in MiB, 64 by default."""
    bound = 2 << 20
    with traced() as held:
        store = ResponseStore(max_bytes=bound)
        for i in range(8):  # each ~0.96 MB: the store keeps the newest two
            store.put(f"r{i}", Stored("k", "s", {"id": f"r{i}"}, one_char_conversation(5_000)))
        assert held() <= 1.05 * bound and store.nbytes <= bound and len(store) == 2
        assert store.get("r7", "k") is not None and store.get("r5", "k") is None
        for rid in ("r6", "r7"):
            assert store.delete(rid, "k")
        assert store.nbytes == 0 and held() < 256 << 10
    assert ResponseStore().max_bytes == int(Settings(home=Path("/")).responses_store_mb * (1 << 20)) == 64 << 20


@pytest.mark.slow  # ~80 MB of small objects made under tracemalloc: several seconds on 2 cores
def test_the_default_bound_holds_the_store_to_64_mib():
    """The default store (PANTHEON_RESPONSES_STORE_MB's 64) filled past its bound with small messages
    holds at most 64 MiB, as tracemalloc measures it, and gives it all back when its entries go."""
    with traced() as held:
        store = ResponseStore()
        for i in range(7):  # each ~11.6 MB of dicts
            store.put(f"r{i}", Stored("k", "s", {"id": f"r{i}"}, [{"role": "user", "content": "x"}
                                                                  for _ in range(50_000)]))
        assert store.max_bytes == 64 << 20 and len(store) < 7
        assert held() <= 1.05 * store.max_bytes
        for i in range(7):
            store.delete(f"r{i}", "k")
        assert len(store) == 0 and store.nbytes == 0 and held() < 256 << 10


def test_a_continued_conversation_holds_its_history_once():
    """A turn stored with `previous` holds its own messages and points at the turns before it: the
    store grows by the new turn only, the conversation reads whole (the same message objects), and the
    earlier turns are kept while a stored response needs them, then given back."""
    with traced() as held:
        store = ResponseStore()
        first = Stored("k", "s", {"id": "r1"}, one_char_conversation(5_000))
        store.put("r1", first)
        after_first, counted = held(), store.nbytes
        new = [{"role": "user", "content": "and?"}, {"role": "assistant", "content": "more"}]
        second = Stored("k", "s", {"id": "r2"}, new, previous=first)
        store.put("r2", second)
        assert held() - after_first < 64 << 10 and store.nbytes - counted < 4096  # a copy: +960 kB
        history = store.get("r2", "k").messages
        assert history == first.messages + new and all(a is b for a, b in zip(history, first.messages))
        assert store.delete("r1", "k")  # r2 still needs r1's turn: its conversation stays whole
        assert store.get("r2", "k").messages == history and store.nbytes > 0.95 * counted
        del first, second, history
        assert store.delete("r2", "k") and store.nbytes == 0 and held() < 256 << 10


def test_previous_response_id_stores_a_link_to_the_turns_before_not_a_copy(surface_app, client, fake):
    fake.script = ("A1.", "stop")
    first = respond(client, key="alice", input="Q1.").get_json()["id"]
    fake.script = ("A2.", "stop")
    second = respond(client, key="alice", input="Q2.", previous_response_id=first).get_json()["id"]
    store = surface_app[0].extensions["pantheon"].responses
    one, two = store.get(first, key_hash("alice")), store.get(second, key_hash("alice"))
    assert two.turns.parent is one.turns
    assert [m["content"] for m in two.turns.own] == ["Q2.", "A2."]
    assert [m["content"] for m in two.messages] == ["Q1.", "A1.", "Q2.", "A2."]


BAD_RESPONSES = [
    ({"input": None}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    # an image for a model without a vision projector: refused where the chat path checks images, which
    # names the part by the chat message it became (tests/test_vision_server.py: a model with one)
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "messages[0].content[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "x"}]}]}, "input[0].content[0].type"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{oops"}]}, "input[0].arguments"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [FN], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"background": True}, "background"),
    ({"temperature": 2.5}, "temperature"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"conversation": "c1"}, "conversation"),
]


@pytest.mark.parametrize("body, param", BAD_RESPONSES, ids=[p for _, p in BAD_RESPONSES])
def test_responses_fields_are_checked(client, surface_app, body, param):
    r = respond(client, **body)
    assert r.status_code == 400, r.get_data(as_text=True)
    assert r.get_json()["error"]["param"] == param
    assert in_flight(surface_app[1]) == 0


# ---- Messages ----------------------------------------------------------------------------------------------------
def test_a_message_holds_thinking_text_and_tool_use_blocks(client, fake):
    fake.texts, fake.script = ["<think>hmm</think>Sure. " + CALL], ("", "stop")
    body = message(client, tools=[A_FN], max_tokens=200).get_json()
    assert body["type"] == "message" and body["role"] == "assistant" and body["id"].startswith("msg_")
    assert [b["type"] for b in body["content"]] == ["thinking", "text", "tool_use"]
    assert body["content"][2]["input"] == {"city": "Paris"} and body["content"][2]["name"] == "get_weather"
    assert body["stop_reason"] == "tool_use" and body["stop_sequence"] is None
    assert body["usage"] == {"input_tokens": 2, "output_tokens": len(fake.texts[0]), "cache_read_input_tokens": 0,
                             "cache_creation_input_tokens": 0}


def test_the_message_stream_is_anthropics_event_sequence(client, fake):
    fake.texts, fake.script = ["Hi. " + CALL], ("", "stop")
    evs = events(message(client, tools=[A_FN], stream=True, max_tokens=200))
    names = [n for n, _ in evs]
    assert all(n == d["type"] for n, d in evs)
    deltas = names.count("content_block_delta") - 1  # the text's deltas; the tool_use has one
    assert names == ["message_start", "content_block_start"] + ["content_block_delta"] * deltas + \
        ["content_block_stop", "content_block_start", "content_block_delta", "content_block_stop",
         "message_delta", "message_stop"]
    assert evs[0][1]["message"]["content"] == [] and evs[0][1]["message"]["stop_reason"] is None
    use = [d for n, d in evs if n == "content_block_start"][1]["content_block"]
    assert use["type"] == "tool_use" and use["input"] == {}
    partial = [d["delta"] for n, d in evs if n == "content_block_delta" and d["index"] == 1][0]
    assert partial["type"] == "input_json_delta" and json.loads(partial["partial_json"]) == {"city": "Paris"}
    assert evs[-2][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}


@pytest.mark.parametrize("stream", [False, True])
def test_stop_reasons(client, fake, stream):
    def reason(**body):
        if not stream:
            b = message(client, **body).get_json()
            return b["stop_reason"], b["stop_sequence"]
        d = [d for n, d in events(message(client, stream=True, **body)) if n == "message_delta"][0]["delta"]
        return d["stop_reason"], d["stop_sequence"]

    fake.script = ("one two END three", "length")
    assert reason(stop_sequences=["END"]) == ("stop_sequence", "END")
    assert reason(max_tokens=3) == ("max_tokens", None)
    fake.script = ("done\0", "stop")
    assert reason() == ("end_turn", None)


def test_messages_map_onto_the_chat_turns(client, fake):
    msgs = [{"role": "user", "content": "U1."},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "T.", "signature": "s"},
                                              {"type": "text", "text": "A1."},
                                              {"type": "tool_use", "id": "t1", "name": "get_weather",
                                               "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "Sunny."},
                                         {"type": "text", "text": "U2."}]}]
    r = message(client, system=[{"type": "text", "text": "S."}], messages=msgs, tools=[A_FN])
    assert r.status_code == 200
    assert "".join(chr(i) for i in fake.last_request.prompt_ids) == "S.U1.A1.Sunny.U2."
    count = client.post("/v1/messages/count_tokens", json={"system": "S.", "messages": msgs, "tools": [A_FN]})
    assert count.get_json() == {"input_tokens": len("S.U1.A1.Sunny.U2.")}


ASKED = {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}]}
BAD_MESSAGES = [
    ({"max_tokens": None}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages[0].content[0].source.type"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": "x"}]}]},
     "messages[0].content[0].input"),
    ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"tools": [A_FN], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"temperature": 1.5}, "temperature"),
    ({"top_k": -1}, "top_k"),
    ({"stop_sequences": ["a"] * 5}, "stop_sequences"),
    ({"thinking": {"type": "sometimes"}}, "thinking.type"),
    ({"output_config": {"effort": "high"}}, "output_config.effort"),
    # issue 43 row 9: a tool_result answers a tool_use of the message just before it; max_tokens within reach
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "x"}]}]},
     "messages[0].content[0].tool_use_id"),
    ({"messages": [{"role": "user", "content": "Weather?"}, ASKED,
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t2", "content": "x"}]}]},
     "messages[2].content[0].tool_use_id"),
    ({"messages": [{"role": "user", "content": "Weather?"}, ASKED, {"role": "user", "content": "Well?"},
                   {"role": "assistant", "content": "Checking."},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "x"}]}]},
     "messages[4].content[0].tool_use_id"),
    ({"max_tokens": 10**9}, "max_tokens"),
    ({"max_tokens": RoomyModel.max_seq + 1}, "max_tokens"),
]


@pytest.mark.parametrize("body, param", BAD_MESSAGES, ids=[p for _, p in BAD_MESSAGES])
def test_messages_fields_are_checked_and_errors_are_anthropics_shape(client, surface_app, body, param):
    r = message(client, **body)
    assert r.status_code == 400, r.get_data(as_text=True)
    err = r.get_json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert err["error"]["message"].startswith(param + ":"), err
    assert in_flight(surface_app[1]) == 0


def test_count_tokens_refuses_what_messages_refuses(client):
    """An orphan tool_result is as much a 400 on count_tokens as on /v1/messages (one parser)."""
    orphan = [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "x"}]}]
    r = client.post("/v1/messages/count_tokens", json={"messages": orphan})
    assert r.status_code == 400 and r.get_json()["error"]["type"] == "invalid_request_error"
    assert r.get_json()["error"]["message"].startswith("messages[0].content[0].tool_use_id:")


def test_a_tool_result_may_follow_its_tool_use_across_user_messages_in_a_row(client, fake):
    """Anthropic joins user messages in a row into one turn: a tool_result in the second still answers
    the assistant message before the first."""
    fake.script = ("ok", "length")
    msgs = [{"role": "user", "content": "Weather?"}, ASKED, {"role": "user", "content": "Here it is."},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "Sunny."}]}]
    r = message(client, messages=msgs)
    assert r.status_code == 200, r.get_data(as_text=True)


def test_max_tokens_up_to_the_models_context_is_taken(client, fake):
    fake.script = ("ok", "length")
    assert message(client, max_tokens=RoomyModel.max_seq).status_code == 200


def test_anthropic_shape_for_route_errors_too(client):
    r = client.get("/v1/messages")
    assert r.status_code == 405 and r.get_json()["type"] == "error"
    assert client.post("/v1/messages", data=b"{", content_type="application/json").get_json()["type"] == "error"
    r = client.post("/v1/chat/completions", data=b"{", content_type="application/json")
    assert set(r.get_json()) == {"error"}  # the OpenAI routes keep theirs


def test_a_prompt_past_the_context_names_each_routes_own_fields(client):
    r = respond(client, input="x" * 1100)
    err = r.get_json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded" and err["param"] == "input"
    assert '"truncation": "auto"' in err["message"] and "truncate" not in err["message"].replace("truncation", "")
    r = message(client, messages=[{"role": "user", "content": "x" * 1100}])
    assert r.status_code == 400 and r.get_json()["error"]["message"].startswith("messages: ")
    assert "truncat" not in r.get_json()["error"]["message"]


def test_the_store_bound_is_a_setting(tmp_path):
    (tmp_path / "models").mkdir()
    settings = Settings(home=tmp_path, model_dir=(tmp_path / "models").resolve(), responses_store=1)
    app, _ = registry_app(settings, lambda p, n, d, s: RoomyModel(n, n_slots=SLOTS), lambda m, s: ChoicesBackend(m))
    c = app.test_client()
    first, second = (respond(c, key="k").get_json()["id"] for _ in range(2))
    assert c.get(f"/v1/responses/{first}", headers={"X-Api-Key": "k"}).status_code == 404  # evicted
    assert c.get(f"/v1/responses/{second}", headers={"X-Api-Key": "k"}).status_code == 200


# ---- count_tokens takes images on a vision model (issue 43, row 10) ---------------------------------------------
VLM = FIXTURES / "tiny-vlm"


@pytest.fixture(params=["gemma3-vlm", "idefics3-vlm"])
def vlm(request, tmp_path):
    """(client, scripted backend, card) over a tiny vision model of each family, really loaded with its
    projector (its tokenizer, template and image geometry are the real ones); the backend only records."""
    from pantheon.runtime import engine
    from test_web_app import ScriptBackend
    model = engine.load(VLM / f"{request.param}.gguf",
                        engine.LoadOptions(n_slots=1, max_seq=192, prefill_chunk=32, store_dir="",
                                           mmproj=str(VLM / f"{request.param}.mmproj.gguf")))
    settings = Settings(home=tmp_path, max_seq=192, batch_slots=1, prefill_chunk=32)
    app, reg = registry_app(settings, lambda p, n, d, s: model, lambda m, s: ScriptBackend(m))
    yield app.test_client(), backend(reg), model.card
    reg.close()


def test_count_tokens_counts_an_image_as_messages_runs_it(vlm):
    """An image block to count_tokens on a vision model: the count is the prompt /v1/messages runs for
    the same body, the image's tokens included (for Idefics3, as many tiles as the image's size gives)."""
    client, fake, card = vlm
    png = base64.b64encode((VLM / "image-a.png").read_bytes()).decode()
    content = [{"type": "text", "text": "What is in this image?"},
               {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}}]
    body = {"messages": [{"role": "user", "content": content}]}
    count = client.post("/v1/messages/count_tokens", json=body)
    assert count.status_code == 200, count.get_data(as_text=True)
    fake.script = ("ok", "length")
    r = client.post("/v1/messages", json={**body, "max_tokens": 2})
    assert r.status_code == 200, r.get_data(as_text=True)
    assert count.get_json() == {"input_tokens": len(fake.last_request.prompt_ids)}
    text_only = client.post("/v1/messages/count_tokens",
                            json={"messages": [{"role": "user", "content": content[:1]}]}).get_json()
    assert count.get_json()["input_tokens"] - text_only["input_tokens"] >= card.vision.n_tokens
