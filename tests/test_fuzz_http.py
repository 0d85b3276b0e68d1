"""Hostile bodies against a live server: every answer is a JSON 4xx, and the server stays up.

Each generated chat body is a valid request with one thing broken (an unknown field, a wrong type, an
out-of-range number, a malformed message, tool or stop list), or not a JSON object at all, or not
JSON. Valid parts use max_tokens=1, so the few bodies that reach generation cost one step.
"""

from __future__ import annotations

import json
import string
import tempfile

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pantheon.web.chat import TOP_FIELDS
from pantheon.web.messages import COUNT_FIELDS
from pantheon.web.messages import TOP_FIELDS as MESSAGES_FIELDS
from pantheon.web.responses import TOP_FIELDS as RESPONSES_FIELDS
from server_util import LLAMA, start_server

pytestmark = pytest.mark.slow  # a real server process (make test-quick leaves it out)

ADMIN = "fuzz-admin"
BASE = {"model": "llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


# Its own server: no other module runs this configuration (the admin API over an empty model folder,
# a 200 kB body cap), and a fuzzed request that broke a server must not break another module's tests.
@pytest.fixture(scope="module")
def srv():
    with tempfile.TemporaryDirectory() as empty:
        s = start_server([f"llama={LLAMA}"], env={"PANTHEON_BATCH_SLOTS": "0", "PANTHEON_ADMIN_KEY": ADMIN,
                                                  "PANTHEON_MODEL_DIR": empty, "PANTHEON_MAX_BODY_BYTES": "200000"})
        yield s
        s.stop()


@pytest.fixture(scope="module")
def session(srv):
    with requests.Session() as s:
        yield s


json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                      st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20))
json_value = st.recursive(json_leaf, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)), max_leaves=12)
not_a_number = st.one_of(st.text(max_size=5), st.lists(json_leaf, max_size=2), st.booleans(),
                         st.dictionaries(st.text(max_size=3), json_leaf, max_size=2))
not_a_string = st.one_of(st.integers(), st.floats(allow_nan=False), st.booleans(), st.lists(json_leaf, max_size=2),
                         st.dictionaries(st.text(max_size=3), json_leaf, max_size=2))

# (field, strategy of values that are never valid for it)
BAD_VALUES = [
    ("temperature", st.one_of(not_a_number, st.floats(2.0001, 1e9), st.floats(-1e9, -0.0001))),
    ("top_p", st.one_of(not_a_number, st.floats(1.0001, 1e9), st.floats(-1e9, 0.0))),
    ("top_k", st.one_of(not_a_number, st.integers(max_value=-2), st.floats(0.1, 0.9))),
    ("min_p", st.one_of(not_a_number, st.floats(1.0001, 1e6), st.floats(-1e6, -1e-6))),
    ("repetition_penalty", st.one_of(not_a_number, st.floats(-1e6, 0.0), st.floats(10.001, 1e6))),
    ("presence_penalty", st.one_of(not_a_number, st.floats(2.0001, 1e6), st.floats(-1e6, -2.0001))),
    ("frequency_penalty", st.one_of(not_a_number, st.floats(2.0001, 1e6))),
    ("max_tokens", st.one_of(not_a_number, st.integers(max_value=0), st.floats(0.1, 0.9))),
    ("max_completion_tokens", st.one_of(not_a_number, st.integers(max_value=0))),
    ("seed", st.one_of(not_a_number, st.integers(min_value=2**64), st.floats(0.1, 0.9))),
    ("n", st.one_of(not_a_number, st.integers(min_value=2), st.integers(max_value=0))),
    ("stream", st.one_of(st.integers(), st.text(max_size=5), st.lists(json_leaf, max_size=2))),
    ("logprobs", st.one_of(st.integers(), st.text(max_size=5), st.lists(json_leaf, max_size=2))),
    ("top_logprobs", st.integers(0, 20)),  # without logprobs: true
    ("logit_bias", st.one_of(st.text(max_size=5), st.integers(), st.lists(json_leaf, max_size=2),
                             st.dictionaries(st.text(max_size=4).filter(lambda k: not k.isdigit()), json_leaf,
                                             min_size=1, max_size=3),
                             st.dictionaries(st.integers(0, 100).map(str), st.floats(100.5, 1e6), min_size=1,
                                             max_size=3))),
    ("model", not_a_string),
    ("user", not_a_string),
    ("session_id", not_a_string),
    ("stop", st.one_of(st.integers(), st.booleans(), st.lists(st.text(max_size=4), min_size=5, max_size=8),
                       st.lists(not_a_string, min_size=1, max_size=3))),
    ("messages", st.one_of(st.just([]), st.text(max_size=10), st.integers(), st.dictionaries(st.text(max_size=4),
                                                                                            json_leaf, max_size=3))),
    ("tools", st.one_of(st.text(max_size=5), st.integers(), st.lists(
        st.one_of(not_a_string, st.fixed_dictionaries({"type": st.text(max_size=8).filter(lambda t: t != "function")}),
                  st.fixed_dictionaries({"type": st.just("function"), "function": not_a_string})),
        min_size=1, max_size=3))),
    ("tool_choice", st.one_of(st.text(max_size=10).filter(lambda t: t not in ("none", "auto")), st.integers(),
                              st.dictionaries(st.text(max_size=5), json_leaf, max_size=3))),
    ("stream_options", st.one_of(not_a_string, st.dictionaries(st.text(max_size=5), json_leaf, min_size=1))),
    ("response_format", st.dictionaries(st.text(max_size=5), json_leaf, min_size=1).filter(
        lambda d: d != {"type": "text"})),
]

bad_message = st.one_of(
    not_a_string,
    st.fixed_dictionaries({"role": st.text(max_size=10).filter(lambda r: r not in ("system", "user", "assistant",
                                                                                   "tool")),
                           "content": st.text(max_size=10)}),
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "tool"]), "content": not_a_string.filter(
        lambda v: not isinstance(v, list) or v)}),
    st.fixed_dictionaries({"role": st.just("user"), "content": st.lists(
        st.fixed_dictionaries({"type": st.text(max_size=8).filter(lambda t: t != "text"), "text": st.text()}),
        min_size=1, max_size=2)}),
    st.fixed_dictionaries({"role": st.just("user"), "content": st.just("x"),
                           "z" + "".join(string.ascii_lowercase[:3]): json_leaf.filter(lambda v: v is not None)}),
    st.fixed_dictionaries({"role": st.just("assistant"), "content": st.just("x"), "tool_calls": st.one_of(
        st.text(max_size=4), st.lists(not_a_string.filter(lambda v: not isinstance(v, dict)), min_size=1))}),
)


@st.composite
def hostile_chat_body(draw):
    kind = draw(st.integers(0, 5))
    if kind == 0:  # not an object at all
        return draw(st.one_of(json_leaf, st.lists(json_value, max_size=3)).filter(lambda v: not isinstance(v, dict)))
    body = json.loads(json.dumps(BASE))
    if kind == 1:  # an unknown field
        key = draw(st.one_of(st.text(min_size=1, max_size=12), st.sampled_from(
            ["functions", "function_call", "logit_bias", "best_of", "echo", "suffix", "prompt"])).filter(
            lambda k: k not in TOP_FIELDS))
        body[key] = draw(json_value)
    elif kind in (2, 3):  # a known field with a value it never accepts
        field, values = draw(st.sampled_from(BAD_VALUES))
        body[field] = draw(values)
    elif kind == 4:  # one broken message among good ones
        msgs = body["messages"] * draw(st.integers(0, 2))
        msgs.insert(draw(st.integers(0, len(msgs))), draw(bad_message))
        body["messages"] = msgs
    else:  # deep nesting where a list of objects/strings is expected: sent as raw text
        depth = draw(st.integers(50, 20000))
        field = draw(st.sampled_from(["tools", "stop", "messages", "weird"]))
        return json.dumps(BASE)[:-1] + f', "{field}": ' + "[" * depth + "]" * depth + "}"
    return body


def check_json_4xx(r: requests.Response) -> None:
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    assert r.headers["Content-Type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]


@settings(max_examples=520, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=hostile_chat_body())
def test_hostile_chat_bodies(srv, session, body):
    data = body if isinstance(body, str) else json.dumps(body)
    r = session.post(srv.url + "/v1/chat/completions", data=data.encode(), timeout=30,
                     headers={"Content-Type": "application/json"})
    check_json_4xx(r)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(raw=st.one_of(st.binary(max_size=200), st.text(max_size=200).map(lambda t: t.encode("utf-8", "replace"))))
def test_garbage_bytes(srv, session, raw):
    try:
        if isinstance(json.loads(raw), dict):
            return  # an object by chance: covered by the structured cases
    except (ValueError, RecursionError):
        pass
    check_json_4xx(session.post(srv.url + "/v1/chat/completions", data=raw, timeout=30))


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=st.one_of(json_value, st.fixed_dictionaries({"path": st.text(max_size=40)}),
                      st.fixed_dictionaries({"model": st.text(max_size=40)}),
                      st.fixed_dictionaries({"path": st.just("../" * 8 + "etc/passwd")}),
                      st.fixed_dictionaries({"name": not_a_string}),
                      st.fixed_dictionaries({"instance_id": st.text(max_size=20)})),
       route=st.sampled_from(["/admin/models/load", "/admin/models/unload"]))
def test_hostile_admin_bodies(srv, session, body, route):
    if route.endswith("unload") and body == {"name": "llama"}:
        return
    r = session.post(srv.url + route, data=json.dumps(body), timeout=30,
                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {ADMIN}"})
    check_json_4xx(r)


# ---- the Responses and Messages routes (issue 32) --------------------------------------------------------------
AGENT_ROUTES = {  # route -> (a valid body, its fields, whether errors are in Anthropic's shape)
    "/v1/responses": ({"model": "llama", "input": "hi", "max_output_tokens": 1, "store": False},
                      RESPONSES_FIELDS, False),
    "/v1/messages": ({"model": "llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
                     MESSAGES_FIELDS, True),
    "/v1/messages/count_tokens": ({"model": "llama", "messages": [{"role": "user", "content": "hi"}]},
                                  COUNT_FIELDS, True),
}
item_like = st.one_of(json_value, st.fixed_dictionaries({
    "type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "text", "tool_use",
                             "tool_result", "thinking", "image", "input_text", "x"]),
    "role": st.sampled_from(["user", "assistant", "system", "developer", "tool", "x"]),
    "content": st.one_of(json_value, st.lists(st.dictionaries(st.sampled_from(
        ["type", "text", "id", "name", "input", "tool_use_id", "content", "thinking"]), json_value, max_size=4),
        max_size=3)),
    "call_id": json_leaf, "name": json_leaf, "arguments": st.one_of(json_leaf, st.just("{bad")), "output": json_value}))


@st.composite
def hostile_agent_body(draw, route: str):
    base, allowed, _ = AGENT_ROUTES[route]
    body = json.loads(json.dumps(base))
    kind = draw(st.integers(0, 4))
    if kind == 0:  # not an object
        return draw(st.one_of(json_leaf, st.lists(json_value, max_size=3)))
    if kind == 1:  # a known field with any value at all
        body[draw(st.sampled_from(sorted(allowed)))] = draw(json_value)
    elif kind == 2:  # an unknown field
        body[draw(st.text(min_size=1, max_size=12).filter(lambda k: k not in allowed))] = draw(json_value)
    elif kind == 3:  # odd items / blocks where the conversation goes
        key = "input" if route == "/v1/responses" else "messages"
        body[key] = draw(st.lists(item_like, min_size=1, max_size=3))
    else:  # deep nesting
        depth = draw(st.integers(50, 20000))
        return json.dumps(base)[:-1] + ', "tools": ' + "[" * depth + "]" * depth + "}"
    return body


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), route=st.sampled_from(sorted(AGENT_ROUTES)))
def test_hostile_responses_and_messages_bodies(srv, session, data, route):
    """Anything goes into the two agent APIs: never a 5xx; every error in the route's own shape."""
    body = data.draw(hostile_agent_body(route))
    raw = body if isinstance(body, str) else json.dumps(body)
    r = session.post(srv.url + route, data=raw.encode(), timeout=60, headers={"Content-Type": "application/json"})
    assert r.status_code < 500, (route, raw[:300], r.status_code, r.text[:300])
    if r.status_code >= 400:
        assert r.headers["Content-Type"].startswith("application/json")
        if AGENT_ROUTES[route][2]:
            err = r.json()
            assert err["type"] == "error" and set(err["error"]) == {"type", "message"}, err
        else:
            check_json_4xx(r)


def test_server_survived(srv, session):
    health = session.get(srv.url + "/", timeout=10).json()
    # (a ready server may still be compiling its other programs in the background: `progress`)
    assert {k: health[k] for k in ("service", "status")} == {"service": "pantheon", "status": "ok"}
    assert set(health) <= {"service", "status", "progress", "compiling"}, health
    assert [m["id"] for m in session.get(srv.url + "/v1/models", timeout=10).json()["data"]] == ["llama"]
    r = session.post(srv.url + "/v1/chat/completions", json={**BASE, "max_tokens": 3}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3
    assert srv.proc.poll() is None
