"""The OpenAPI document and the validators as one specification (issue 20, item 10).

* `GET /openapi.json` documents every route the app serves, and no other; it is open without a key,
  and describes the keys when they are configured.
* The validators hold to pantheon.web.schema, field by field: each property's example is accepted, every
  value its schema refuses is a 400 naming the field, its bounds hold at and just past the edge, and a
  field the schema does not list is refused.
* A schemathesis fuzz of every documented operation (valid and invalid bodies, from the published
  document) on a fake backend: no answer is a 5xx, every 4xx is the JSON error shape, every 200 JSON
  answer matches its documented schema, and no body the schema refuses is taken. Deterministic
  (derandomized, no example database) and bounded.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema_rs
import numpy as np
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode

from fake_backend import ChoicesBackend
from pantheon import osthread
from pantheon.config import Settings
from pantheon.types import Embedded
from pantheon.serving.registry import Registry
from pantheon.web import create_app, schema
from pantheon.web.errors import ANTHROPIC_PATHS, ANTHROPIC_TYPES, ERROR_TYPES
from pantheon.web.openapi import ADMIN, OPERATIONS, Operation, document
from test_web_app import CharTokenizer, FakeModel, Handle

MODEL = "fuzz-target"  # the one resident model (a name the fuzzer will not guess: nothing unloads it)
ADMIN_KEY = "openapi-admin"
HELLO = [{"role": "user", "content": "hi"}]

class ByteTokenizer(CharTokenizer):
    """test_web_app's one-character-one-token tokenizer on 512 ids: small enough for llguidance to build
    its token table at once, so response_format and forced tool calls compile real grammars."""

    vocab_size = 512
    eos_id = 0


class RoomyModel(FakeModel):
    max_seq = 4096  # room for the prompts the fuzzer writes (the 64 of test_web_app would refuse most)
    config = type("Config", (), {"hidden": 64})()  # the embedding size /v1/embeddings reads

    def __init__(self, name: str):
        super().__init__(name, n_slots=4)
        self.tokenizer = ByteTokenizer()
        self.card = dataclasses.replace(self.card, tokenizer=self.tokenizer)


class FuzzBackend(ChoicesBackend):
    """fake_backend's n-choice, logprob-speaking backend, plus embeddings: a unit vector per input."""

    def submit_embed(self, req, sink):
        handle = Handle()
        vectors = np.full((len(req.inputs), 64), 1 / 8, np.float32)
        osthread.start_thread(lambda: sink(Embedded(vectors, sum(map(len, req.inputs)))), name="embed")
        return handle


def make_app(tmp: Path, **config: Any) -> Any:
    """A Pantheon app on the scripted fake backend with MODEL loaded; admin paths under tmp/models."""
    (tmp / "models").mkdir(exist_ok=True)
    st = Settings(home=tmp, model_dir=(tmp / "models").resolve(), **config)
    reg = Registry(st, load_model=lambda p, n, d, s: RoomyModel(n), make_backend=lambda m, s: FuzzBackend(m),
                   devices=lambda s: [{"die": 0, "platform": "cpu", "kind": "cpu", "budget_bytes": 10**9}],
                   estimate=lambda p, s, pl: 1000)
    app = create_app(st, registry=reg, exit_on_failure=False)
    app.extensions["pantheon"].startup.join(10)
    reg.load("fake", MODEL, None, resolve=lambda s: Path(s))
    return app


def _no_download(*args: Any, **kwargs: Any) -> Any:
    from pantheon.errors import CatalogError
    raise CatalogError("downloads are off in this test")


@pytest.fixture(scope="module")
def no_downloads():
    with pytest.MonkeyPatch.context() as mp:  # a catalog name in a fuzzed admin load must not download
        mp.setattr("pantheon.formats.catalog.pull", _no_download)
        yield


@pytest.fixture(scope="module")
def app(tmp_path_factory, no_downloads):
    return make_app(tmp_path_factory.mktemp("openapi"), admin_key=ADMIN_KEY)


@pytest.fixture(scope="module")
def admin_app(tmp_path_factory, no_downloads):
    """A second app for the admin routes, so that whatever a fuzzed load or unload does stays there."""
    return make_app(tmp_path_factory.mktemp("openapi-admin"), admin_key=ADMIN_KEY)


@pytest.fixture(scope="module")
def client(app):
    return app.test_client()


def served(app: Any) -> set[tuple[str, str]]:
    """(method, OpenAPI path) of every route of the app's URL map (HEAD/OPTIONS are Flask's own). The
    browser pages (pantheon.web.page: `/dashboard`, `/ui/...`) are not API operations."""
    out = set()
    for rule in app.url_map.iter_rules():
        if rule.endpoint == "static" or rule.endpoint.startswith("page."):
            continue
        path = rule.rule
        for arg in rule.arguments:
            path = path.replace(f"<path:{arg}>", f"{{{arg}}}").replace(f"<{arg}>", f"{{{arg}}}")
        out |= {(m.lower(), path) for m in rule.methods - {"HEAD", "OPTIONS"}}
    return out


def anthropic_error_shape(status: int, raw: bytes, ctype: str) -> dict:
    """The error of a 4xx answer on an Anthropic route, as OpenAI's error fields (param from the message)."""
    assert ctype.startswith("application/json"), f"{status} answered {ctype!r}: {raw[:200]!r}"
    body = json.loads(raw)
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"} and body["error"]["message"], body
    assert body["error"]["type"] == ANTHROPIC_TYPES.get(status, "invalid_request_error"), body
    message = body["error"]["message"]
    return {"message": message, "type": body["error"]["type"], "code": None,
            "param": message.split(":", 1)[0] if ": " in message else None}


def error_shape(status: int, raw: bytes, ctype: str, anthropic: bool = False) -> dict:
    """The error object of a 4xx answer; fails unless it is exactly the documented shape."""
    if anthropic:
        return anthropic_error_shape(status, raw, ctype)
    assert ctype.startswith("application/json"), f"{status} answered {ctype!r}: {raw[:200]!r}"
    body = json.loads(raw)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"], body
    assert err["type"] == ERROR_TYPES.get(status, "invalid_request_error"), body
    assert err["param"] is None or isinstance(err["param"], str), body
    assert err["code"] is None or isinstance(err["code"], str), body
    return err


# ---- the document -----------------------------------------------------------------------------------------
def test_every_served_route_is_documented_and_nothing_else(app):
    doc = app.test_client().get("/openapi.json").get_json()
    documented = {(m, p) for p, item in doc["paths"].items() for m in item}
    assert documented == {(op.method, op.path) for op in OPERATIONS}
    assert served(app) == documented


def test_the_document_is_built_from_the_validators_schema(client):
    doc = client.get("/openapi.json").get_json()
    assert doc["openapi"].startswith("3.1")
    assert doc["components"]["schemas"] == json.loads(json.dumps(schema.COMPONENTS))
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    assert chat["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ChatCompletionRequest"}
    assert set(chat["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    assert chat["responses"]["400"] == {"$ref": "#/components/responses/Error400"}
    error = doc["components"]["responses"]["Error400"]["content"]["application/json"]["schema"]
    assert error == {"$ref": "#/components/schemas/Error"}
    assert "security" not in doc and "apiKey" not in doc["components"].get("securitySchemes", {})
    assert doc["paths"]["/admin/dies"]["get"]["security"] == [{"adminKey": []}, {"adminKeyHeader": []}]
    jsonschema_rs.Draft202012Validator(doc["components"]["schemas"]["ChatCompletionRequest"])  # a valid schema


@pytest.mark.parametrize("keys", [{}, {"api_key": "k", "admin_key": "a"}], ids=["no keys", "keys"])
def test_the_document_is_valid_openapi_3_1(keys):
    from schemathesis.specs.openapi.definitions import OPENAPI_31_VALIDATOR  # the OAS 3.1 meta-schema
    doc = document(Settings(home=Path("/nonexistent"), **keys))
    errors = [e.message for e in OPENAPI_31_VALIDATOR.iter_errors(doc)]
    assert not errors, errors[:3]


def test_with_an_api_key_the_document_is_open_and_says_which_routes_need_it(tmp_path, no_downloads):
    app = make_app(tmp_path, api_key="user-key")
    c = app.test_client()
    r = c.get("/openapi.json")  # no key
    assert r.status_code == 200
    doc = r.get_json()
    assert doc["components"]["securitySchemes"]["apiKey"]["scheme"] == "bearer"
    assert doc["security"] == [{"apiKey": []}, {"apiKeyHeader": []}]
    assert "adminKey" not in doc["components"]["securitySchemes"]
    for path, item in doc["paths"].items():
        for method, op in item.items():
            url = path.replace("{model}", MODEL).replace("{model_id}", MODEL).replace("{response_id}", "resp_1")
            r = c.open(url, method=method.upper(), json={} if method == "post" else None)
            if path.startswith("/admin/"):  # no admin key configured: the admin API is off, for everyone
                assert op["security"] == [] and r.status_code == 403, (path, r.status_code)
            elif op.get("security") == []:
                assert r.status_code == 200, (path, r.status_code)
            else:
                assert r.status_code == 401, (path, r.status_code)
                if path.endswith(ANTHROPIC_PATHS):  # Anthropic's shape has no code: its type says it
                    assert error_shape(401, r.data, r.content_type, True)["type"] == "authentication_error"
                else:
                    assert error_shape(401, r.data, r.content_type)["code"] == "invalid_api_key"


# ---- the validators hold to the schema --------------------------------------------------------------------
@dataclass
class BodyRoute:
    """A route whose body the schema describes, and how to send it one field at a time."""

    path: str
    schema: dict
    base: dict  # a valid body without the field under test
    ok: int  # the status a valid body gets here (admin: 404, there are no model files)
    context: dict[str, dict] = field(default_factory=dict)  # what a field needs beside it (null: absent)
    at_edge: dict[str, set[int]] = field(default_factory=dict)  # statuses a field's longest value may get
    admin: bool = False


# Fields the model bounds below the field's own range (a 400 naming the field at the field's edge): n by
# its batch slots (best_of must equal n or 1), dimensions by its embedding size, Messages' max_tokens by
# its context (Anthropic refuses a max_tokens past the model's maximum; the others clamp it).
BY_MODEL = {"n": {200, 400}, "best_of": {200, 400}, "dimensions": {200, 400}}

BODY_ROUTES = {
    "chat": BodyRoute("/v1/chat/completions", schema.CHAT_REQUEST, {"messages": HELLO, "max_tokens": 1}, 200,
                      {"stream_options": {"stream": True}, "top_logprobs": {"logprobs": True},
                       "function_call": {"functions": [{"name": "f"}]}}, at_edge=BY_MODEL),
    "tokenize": BodyRoute("/tokenize", schema.TOKENIZE_REQUEST, {"content": "hi"}, 200),
    "detokenize": BodyRoute("/detokenize", schema.DETOKENIZE_REQUEST, {"tokens": [104, 105]}, 200),
    "load": BodyRoute("/admin/models/load", schema.LOAD_REQUEST, {"path": "missing.gguf"}, 404,
                      {"model": {"path": None}},
                      # a path as long as the field allows is longer than the file system's PATH_MAX once
                      # the model directory is put in front: that 400 is the OS's bound, not the field's
                      at_edge={"path": {400, 404}, "model": {400, 404}}, admin=True),
    "unload": BodyRoute("/admin/models/unload", schema.UNLOAD_REQUEST, {"name": "not-loaded"}, 404,
                        {"instance_id": {"name": None}}, admin=True),
    "completions": BodyRoute("/v1/completions", schema.COMPLETION_REQUEST, {"prompt": "hi", "max_tokens": 1}, 200,
                             {"stream_options": {"stream": True}}, at_edge=BY_MODEL),
    "embeddings": BodyRoute("/v1/embeddings", schema.EMBEDDING_REQUEST, {"input": "hi"}, 200, at_edge=BY_MODEL),
    "responses": BodyRoute("/v1/responses", schema.RESPONSES_REQUEST, {"input": "hi", "max_output_tokens": 1}, 200,
                           {"stream_options": {"stream": True}},
                           # no stored response has the example's id: a 404 naming it is the valid answer
                           at_edge={"previous_response_id": {404}}),
    "messages": BodyRoute("/v1/messages", schema.MESSAGES_REQUEST, {"messages": HELLO, "max_tokens": 1}, 200,
                          at_edge={"max_tokens": {200, 400}}),
    "count_tokens": BodyRoute("/v1/messages/count_tokens", schema.COUNT_TOKENS_REQUEST, {"messages": HELLO}, 200),
}

# Values of every JSON kind, some at the edges: each one a property's schema refuses must be refused.
ODD_VALUES = [True, False, 0, -1, 1.5, 10**30, "", "x", [], [None], [1.5], ["x"], {}, {"x": None}, {"x": 1},
              {"type": "x"}]


def _edges(prop: dict) -> list[tuple[Any, bool]]:
    """(value, valid) at and just past each bound the property declares (huge ones left out)."""
    out: list[tuple[Any, bool]] = []
    types = prop.get("type")
    step = 1 if types == "integer" or (isinstance(types, list) and "integer" in types) else 1e-6
    if "minimum" in prop:
        out += [(prop["minimum"], True), (prop["minimum"] - step, False)]
    if "maximum" in prop:
        out += [(prop["maximum"], True), (prop["maximum"] + step, False)]
    if "exclusiveMinimum" in prop:
        out += [(prop["exclusiveMinimum"], False), (prop["exclusiveMinimum"] + step, True)]
    example = prop.get("examples", [None])[0]
    if prop.get("maxLength", 1 << 20) <= 1 << 16:
        n = prop["maxLength"]
        text = "a" * n
        out += [(text, True), (text + "a", False)]
    if isinstance(example, list) and example:
        for key, ok_at in (("minItems", True), ("maxItems", True)):
            if key in prop and prop[key] <= 4096:
                n = prop[key]
                out += [([example[0]] * n, ok_at), ([example[0]] * (n - 1 if key == "minItems" else n + 1), False)]
    if isinstance(example, dict) and example and "maxProperties" in prop:
        value = next(iter(example.values()))
        n = prop["maxProperties"]
        many = {str(i): value for i in range(n + 1)}
        out += [(dict(list(many.items())[:n]), True), (many, False)]
    return out


def _field_cases(kind: str) -> list:
    """(route, field) cases; for "bounds" only the fields that declare one."""
    out = []
    for route_name, route in BODY_ROUTES.items():
        for name, prop in route.schema["properties"].items():
            if kind == "bounds" and not _edges(prop):
                continue
            out.append(pytest.param(route_name, name, id=f"{route_name}.{name}"))
    return out


def _post(app: Any, route: BodyRoute, body: Any) -> tuple[int, bytes, str]:
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"} if route.admin else {}
    r = app.test_client().post(route.path, json=body, headers=headers)
    data = r.get_data()
    r.close()
    return r.status_code, data, r.content_type


def _with(route: BodyRoute, name: str, value: Any) -> dict:
    return {**route.base, **route.context.get(name, {}), name: value}


def _refused_naming(route: BodyRoute, name: str, status: int, raw: bytes, ctype: str) -> None:
    assert status == 400, f"{name}: answered {status} {raw[:200]!r}"
    param = error_shape(status, raw, ctype, route.path.endswith(ANTHROPIC_PATHS))["param"] or ""
    assert param == name or param.startswith((name + ".", name + "[")), f"{name}: the 400 names {param!r}"


@pytest.mark.parametrize("route_name, name", _field_cases("accepts"))
def test_each_property_example_is_accepted(app, admin_app, route_name, name):
    route = BODY_ROUTES[route_name]
    prop = route.schema["properties"][name]
    assert prop.get("examples"), f"{name}: every property carries an example"
    status, raw, _ = _post(admin_app if route.admin else app, route, _with(route, name, prop["examples"][0]))
    assert status in route.at_edge.get(name, {route.ok}), f"{name}={prop['examples'][0]!r}: {status} {raw[:300]!r}"


@pytest.mark.parametrize("route_name, name", _field_cases("refuses"))
def test_each_value_the_schema_refuses_is_a_400_naming_the_field(app, admin_app, route_name, name):
    route = BODY_ROUTES[route_name]
    check = jsonschema_rs.Draft202012Validator(route.schema["properties"][name])
    bad = [v for v in ODD_VALUES if not check.is_valid(v)]
    assert bad, f"{name}: its schema refuses none of the odd values"
    for value in bad:
        _refused_naming(route, name, *_post(admin_app if route.admin else app, route, _with(route, name, value)))


@pytest.mark.parametrize("route_name, name", _field_cases("bounds"))
def test_each_bound_holds_at_its_edge(app, admin_app, route_name, name):
    route = BODY_ROUTES[route_name]
    prop = route.schema["properties"][name]
    check = jsonschema_rs.Draft202012Validator(prop)
    edges = _edges(prop)
    target = admin_app if route.admin else app
    for value, valid in edges:
        assert check.is_valid(value) == valid, f"{name}: the edge {str(value)[:40]} is misjudged by this test"
        status, raw, ctype = _post(target, route, _with(route, name, value))
        if valid:
            assert status in route.at_edge.get(name, {route.ok}), f"{name}={str(value)[:60]}: {status} {raw[:300]!r}"
        else:
            _refused_naming(route, name, status, raw, ctype)


@pytest.mark.parametrize("route_name", list(BODY_ROUTES))
def test_a_field_the_schema_does_not_list_is_refused(app, admin_app, route_name):
    route = BODY_ROUTES[route_name]
    status, raw, ctype = _post(admin_app if route.admin else app, route, {**route.base, "not_a_field": 1})
    _refused_naming(route, "not_a_field", status, raw, ctype)


def _message_cases() -> list:
    """(role, variant number) for each role each message variant allows."""
    out = []
    for i, variant in enumerate(schema.CHAT_MESSAGE["anyOf"]):
        role = variant["properties"]["role"]
        for name in role.get("enum") or [role["const"]]:
            out.append(pytest.param(name, i, id=f"{name}-{i}"))
    return out


@pytest.mark.parametrize("role, variant", _message_cases())
def test_message_fields_follow_the_schema(app, role, variant):
    """Every field of a message variant takes its example; a field no variant lists is refused unless
    it is null (then it counts as absent)."""
    props = schema.CHAT_MESSAGE["anyOf"][variant]["properties"]
    route = BODY_ROUTES["chat"]
    base = {"role": role, **{k: props[k]["examples"][0] for k in schema.CHAT_MESSAGE["anyOf"][variant]["required"]}}
    for name, prop in props.items():
        msg = {**base, name: prop["examples"][0]}
        status, raw, _ = _post(app, route, {**route.base, "messages": [msg]})
        assert status == 200, f"{msg}: {status} {raw[:200]!r}"
    status, raw, ctype = _post(app, route, {**route.base, "messages": [{**base, "x": 1}]})
    _refused_naming(route, "messages[0].x", status, raw, ctype)
    status, _, _ = _post(app, route, {**route.base, "messages": [{**base, "x": None}]})
    assert status == 200


def test_a_pattern_is_matched_whole(app):
    """The schema's patterns are ECMA regexes, whose "$" is the very end; Python's "$" also passes a
    final newline, so a validator must fullmatch. (json_schema.name took "answer\\n" until this test.)"""
    route = BODY_ROUTES["chat"]
    rf = {"type": "json_schema", "json_schema": {"name": "answer\n", "schema": {"type": "object"}}}
    assert not jsonschema_rs.Draft202012Validator(schema.RESPONSE_FORMAT).is_valid(rf)
    _refused_naming(route, "response_format", *_post(app, route, {**route.base, "response_format": rf}))


# ---- the fuzz -----------------------------------------------------------------------------------------------
def _examples(op: Operation, mode: GenerationMode) -> int:
    """Examples per operation and mode: bodies get the most; a route without inputs needs one."""
    if op.body is not None:
        return 60 if "chat" in op.path else 40
    return 15 if "{" in op.path else 2


FUZZ = [pytest.param(op, mode, id=f"{op.method.upper()} {op.path} {mode.value}")
        for op in OPERATIONS
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
        if mode is GenerationMode.POSITIVE or op.body is not None]  # a path parameter cannot be made invalid


@pytest.fixture(scope="module")
def schemas(app, admin_app):
    """The published document, loaded by schemathesis from each app's GET /openapi.json."""
    return {id(a): schemathesis.openapi.from_wsgi("/openapi.json", a) for a in (app, admin_app)}


def _answer_schema(doc: dict, op: Operation, status: int, ctype: str) -> dict | None:
    media = doc["paths"][op.path][op.method]["responses"].get(str(status), {}).get("content", {})
    found = media.get(ctype.split(";")[0].strip())
    if found is None:
        return None
    ref = found["schema"].get("$ref", "")
    return doc["components"]["schemas"][ref.rsplit("/", 1)[1]] if ref else found["schema"]


def check_answer(doc: dict, op: Operation, mode: GenerationMode, case: Any, resp: Any) -> int:
    """Every fuzzed answer: no 5xx; a 4xx is the error shape; a body the schema refuses is not taken;
    a 200 is as documented (SSE ends with [DONE]). Returns the status."""
    status = resp.status_code
    ctype = (resp.headers.get("content-type") or [""])[0]
    sent = f"{case.method} {case.formatted_path} {str(case.body)[:300]}"
    assert status < 500, f"{sent} -> {status} {resp.content[:300]!r}"
    err = error_shape(status, resp.content, ctype, op.error == "AnthropicError") if status >= 400 else None
    # A body that got as far as the model lookup was taken: the schema must not refuse it.
    taken = status < 300 or (err is not None and (err["code"] == "model_not_found" or (
        op.error == "AnthropicError" and status == 404 and err["param"] == "model")))
    if mode is GenerationMode.NEGATIVE and taken and op.body is not None:
        body_check = jsonschema_rs.Draft202012Validator(doc["components"]["schemas"][op.body])
        wrong = list(body_check.iter_errors(case.body))
        assert not wrong, f"{sent} -> {status}: a body the schema refuses was taken ({wrong[0].message[:200]})"
    if status == 200 and ctype.startswith("text/event-stream"):
        # each frame's data line (Anthropic's frames put an `event:` line before it)
        frames = [ln[6:] for f in resp.content.split(b"\n\n") for ln in f.split(b"\n") if ln.startswith(b"data: ")]
        if op.error == "AnthropicError":  # Anthropic's stream: named events, message_stop (or error) last
            if not getattr(resp, "stream_cut_short", False):
                assert frames and json.loads(frames[-1])["type"] in ("message_stop", "error"), resp.content[-200:]
        elif not getattr(resp, "stream_cut_short", False):  # the client stopped reading a long stream
            assert frames and frames[-1] == b"[DONE]", f"{sent} -> {resp.content[-200:]!r}"
        assert all(isinstance(json.loads(f), dict) for f in frames if f != b"[DONE]"), f"{sent} -> {resp.content!r}"
    elif status == 200:
        answer = _answer_schema(doc, op, status, ctype)
        assert answer is not None, f"{sent} -> an undocumented {ctype!r} answer"
        if ctype.startswith("application/json"):
            errors = list(jsonschema_rs.Draft202012Validator(answer).iter_errors(json.loads(resp.content)))
            assert not errors, f"{sent} -> 200 not as documented: {errors[0]}"
    return status


@pytest.mark.parametrize("op, mode", FUZZ)
def test_fuzz_no_5xx_and_every_4xx_is_the_error_shape(app, admin_app, schemas, op, mode):
    target = admin_app if op.access == ADMIN else app
    doc = document(target.extensions["pantheon"].settings)
    operation = schemas[id(target)][op.path][op.method.upper()]
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"} if op.access == ADMIN else {}
    seen: dict[int, int] = {}

    @settings(max_examples=_examples(op, mode), derandomize=True, database=None, deadline=None,
              phases=(Phase.explicit, Phase.generate, Phase.shrink), suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def fuzz(case: Any) -> None:
        status = check_answer(doc, op, mode, case, case.call(app=target, headers=headers))
        seen[status] = seen.get(status, 0) + 1

    fuzz()
    assert seen, "no request was sent"
