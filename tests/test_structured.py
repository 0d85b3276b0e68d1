"""Specification of pantheon.text.structured: grammars from response_format and forced tool calls.

Only the real models' tokenizers are loaded (from the GGUF metadata), never the weights. Generation is
simulated on the host by a noisy sampler: random logits, the grammar's mask applied, the best allowed token
taken. Tokens that close something (a quote, a brace, a bracket) and the stop ids get a bonus, like a model
that wants to end once it may; without it a free-form string or key would go on for thousands of tokens.
Whatever it produces must be valid: that is the contract the scheduler relies on.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import jsonschema_rs
import numpy as np
import pytest

from pantheon.text import structured
from pantheon.text.emitter import Emitter
from pantheon.errors import RequestError
from pantheon.formats.gguf_reader import open_reader, read_metadata
from pantheon.text.structured import Grammar, UnsupportedSchema, mask_words
from pantheon.text.tokenizer import Tokenizer

MODELS = Path.home() / ".cache" / "pantheon" / "models"
_tokenizers: dict[str, Tokenizer] = {}
STOP_BONUS = 3.0
CLOSE_BONUS = 2.0
CAP = 3000
_bonus: dict[int, np.ndarray] = {}


@pytest.fixture(scope="module")
def tok(request):
    """tok(name) -> the Tokenizer of a real model, from its GGUF metadata (pulled once if missing)."""

    def get(name: str) -> Tokenizer:
        if name not in _tokenizers:
            path = MODELS / f"{name}.gguf"
            if not path.exists():
                path = request.getfixturevalue("real_model_path")(name)
            _tokenizers[name] = Tokenizer.from_gguf_metadata(read_metadata(open_reader(path)), str(path))
        return _tokenizers[name]

    return get


def allowed(row: np.ndarray, vocab: int) -> np.ndarray:
    """Token ids whose bit is set in a mask row."""
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab])


def closer_bonus(tokenizer: Tokenizer, vocab: int) -> np.ndarray:
    """f32[vocab]: CLOSE_BONUS for tokens whose text holds a quote, a brace or a bracket."""
    key = id(tokenizer) ^ vocab
    if key not in _bonus:
        b = np.zeros(vocab, np.float32)
        for i in range(tokenizer.vocab_size):
            if any(c in tokenizer.token_bytes(i) for c in (b'"', b"}", b"]")):
                b[i] = CLOSE_BONUS
        _bonus[key] = b
    return _bonus[key]


def generate(m: structured.Matcher, tokenizer: Tokenizer, stop_ids: list[int], vocab: int,
             seed: int, cap: int = CAP) -> tuple[str, list[int]]:
    """Sample until the matcher is done (or `cap` tokens): the text and the ids, stop id excluded."""
    rng = np.random.default_rng(seed)
    bonus = closer_bonus(tokenizer, vocab)
    row = np.zeros(mask_words(vocab), np.int32)
    ids: list[int] = []
    for _ in range(cap):
        if m.done:
            break
        m.fill_mask(row)
        ok = allowed(row, vocab)
        assert len(ok), "a mask row is never empty"
        logits = rng.standard_normal(len(ok)) + bonus[ok] + STOP_BONUS * np.isin(ok, stop_ids)
        t = int(ok[np.argmax(logits)])
        assert m.consume(t)
        if t in stop_ids:
            break
        ids.append(t)
    assert m.done, f"not done after {cap} tokens: {tokenizer.decode(ids)[:400]!r}"
    return tokenizer.decode(ids), ids


def stops_of(tokenizer: Tokenizer) -> list[int]:
    return sorted(tokenizer.eot_ids)


def json_schema_rf(schema: dict, strict: bool | None = None) -> dict:
    js = {"name": "answer", "schema": schema}
    if strict is not None:
        js["strict"] = strict
    return {"type": "json_schema", "json_schema": js}


# --- JSON Schema: whatever is generated validates ----------------------------------------------------------

OBJ = {"type": "object", "additionalProperties": False}
SCHEMAS: list[tuple[str, dict]] = [
    ("flat", {**OBJ, "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
              "required": ["name", "age"]}),
    ("nested", {**OBJ, "properties": {"user": {**OBJ, "properties": {
        "id": {"type": "integer", "minimum": 1},
        "profile": {**OBJ, "properties": {"bio": {"type": "string", "maxLength": 10}}, "required": ["bio"]}},
        "required": ["id", "profile"]}}, "required": ["user"]}),
    ("array_bounds", {**OBJ, "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                                     "minItems": 2, "maxItems": 4}}, "required": ["tags"]}),
    ("enum", {**OBJ, "properties": {"color": {"enum": ["red", "green", "blue"]},
                                    "size": {"enum": [1, 2.5, None, "xl"]}}, "required": ["color", "size"]}),
    ("number_bounds", {**OBJ, "properties": {
        "p": {"type": "number", "minimum": 0, "maximum": 1},
        "t": {"type": "integer", "exclusiveMinimum": -5, "exclusiveMaximum": 5},
        "k": {"type": "integer", "minimum": 100, "maximum": 120}}, "required": ["p", "t", "k"]}),
    ("pattern", {**OBJ, "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}(-[0-9]{4})?$"},
                                       "code": {"type": "string", "pattern": "^[A-Z]{3}$"}},
                 "required": ["zip", "code"]}),
    ("formats", {**OBJ, "properties": {"when": {"type": "string", "format": "date"},
                                       "host": {"type": "string", "format": "hostname", "maxLength": 20},
                                       "id": {"type": "string", "format": "uuid"},
                                       "ip": {"type": "string", "format": "ipv4"}},
                 "required": ["when", "host", "id", "ip"]}),
    ("email", {**OBJ, "properties": {"to": {"type": "string", "format": "email", "maxLength": 30}},
               "required": ["to"]}),
    ("optional", {**OBJ, "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"},
                                        "c": {"type": "string", "maxLength": 4}}, "required": ["b"]}),
    ("anyof", {**OBJ, "properties": {"v": {"anyOf": [{"type": "integer", "minimum": 0},
                                                     {"type": "string", "maxLength": 5}, {"type": "null"}]}},
               "required": ["v"]}),
    ("const", {**OBJ, "properties": {"kind": {"const": "point"}, "x": {"type": "integer"}},
               "required": ["kind", "x"]}),
    ("booleans_null", {**OBJ, "properties": {"ok": {"type": "boolean"}, "nothing": {"type": "null"},
                                             "maybe": {"type": ["boolean", "null"]}},
                       "required": ["ok", "nothing", "maybe"]}),
    ("array_of_objects", {**OBJ, "properties": {"items": {"type": "array", "maxItems": 3, "items": {
        **OBJ, "properties": {"sku": {"type": "string", "maxLength": 5}, "qty": {"type": "integer", "minimum": 1}},
        "required": ["sku", "qty"]}}}, "required": ["items"]}),
    ("top_level_array", {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                         "minItems": 1, "maxItems": 5}),
    ("ref_defs", {**OBJ, "$defs": {"pt": {**OBJ, "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                                          "required": ["x", "y"]}},
                  "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}}, "required": ["a", "b"]}),
    ("string_lengths", {**OBJ, "properties": {"s": {"type": "string", "minLength": 3, "maxLength": 6}},
                        "required": ["s"]}),
    ("prefix_items", {**OBJ, "properties": {"pair": {"type": "array", "prefixItems": [
        {"type": "string", "maxLength": 4}, {"type": "integer"}], "items": False}}, "required": ["pair"]}),
    ("multiple_of", {**OBJ, "properties": {"n": {"type": "integer", "multipleOf": 5, "minimum": 0,
                                                 "maximum": 1000}}, "required": ["n"]}),
    ("additional_props_typed", {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 3}),
    ("allof", {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                         {"type": "object", "properties": {"b": {"enum": ["x", "y"]}}, "required": ["b"]}]}),
]
QWEN_CASES = {"nested", "anyof", "formats", "array_of_objects"}


def _cases():
    for name, schema in SCHEMAS:
        yield pytest.param("smollm2-135m", schema, id=f"smollm2-{name}")
        if name in QWEN_CASES:
            yield pytest.param("qwen-0.5b", schema, id=f"qwen-{name}")


@pytest.mark.parametrize("model,schema", list(_cases()))
def test_generated_json_validates_against_the_schema(tok, model, schema):
    t = tok(model)
    g = Grammar.from_response_format(json_schema_rf(schema), t)
    validator = jsonschema_rs.validator_for(schema, validate_formats=True)
    for seed in range(3):
        text, _ = generate(g.matcher(stops_of(t), t.vocab_size), t, stops_of(t), t.vocab_size, seed)
        doc = json.loads(text)
        assert validator.is_valid(doc), (text, list(validator.iter_errors(doc))[:1])


@pytest.mark.parametrize("model", ["smollm2-135m", "qwen-0.5b"])
def test_json_object_produces_an_object_with_no_leading_or_trailing_text(tok, model):
    t = tok(model)
    g = Grammar.from_response_format({"type": "json_object"}, t)
    for seed in range(3):
        text, _ = generate(g.matcher(stops_of(t), t.vocab_size), t, stops_of(t), t.vocab_size, seed)
        assert text.startswith("{") and text.endswith("}")
        assert isinstance(json.loads(text), dict)


def test_text_response_format_means_no_grammar(tok):
    assert Grammar.from_response_format({"type": "text"}, tok("smollm2-135m")) is None


def test_whitespace_is_bounded_so_a_noisy_sampler_still_ends():
    """At most one space, or one newline and 24 spaces/tabs of indentation, between JSON tokens."""
    import re

    ws = re.compile(structured.WHITESPACE)
    for s in ["", " ", "\n", "\n" + " " * 24, "\n\t\t"]:
        assert ws.fullmatch(s)
    for s in ["  ", "\n\n", "\n" + " " * 25, "\t"]:
        assert not ws.fullmatch(s)


def test_a_pretty_printed_document_is_accepted(tok):
    t = tok("qwen-0.5b")
    schema = SCHEMAS[1][1]
    doc = {"user": {"id": 3, "profile": {"bio": "hi"}}}
    for text in (json.dumps(doc), json.dumps(doc, indent=2), json.dumps(doc, separators=(",", ":"))):
        m = Grammar.from_response_format(json_schema_rf(schema), t).matcher(stops_of(t), t.vocab_size)
        assert all(m.consume(i) for i in t.encode(text)), text
        assert m.accepting and m.done


# --- tool calls -----------------------------------------------------------------------------------------------

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"], "additionalProperties": False}}},
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def emitted_calls(text: str) -> list[dict]:
    """The tool calls the emitter parses from `text`, checking that nothing else comes out."""
    em = Emitter(stop=(), tools_enabled=True)
    deltas = em.feed(text) + em.finish()
    assert all(d.kind == "tool_call" for d in deltas), (text, deltas)
    return [d.tool_call["function"] for d in deltas]


@pytest.mark.parametrize("model", ["smollm2-135m", "qwen-0.5b"])
def test_required_tool_choice_produces_calls_the_emitter_parses(tok, model):
    t = tok(model)
    g = Grammar.for_tools(TOOLS, "required", t)
    names = set()
    for seed in range(6):
        text, _ = generate(g.matcher(stops_of(t), t.vocab_size), t, stops_of(t), t.vocab_size, seed)
        calls = emitted_calls(text)
        assert calls, text
        for fn in calls:
            assert fn["name"] in PARAMS
            assert jsonschema_rs.is_valid(PARAMS[fn["name"]], json.loads(fn["arguments"])), fn
            names.add(fn["name"])
    assert names == set(PARAMS)  # the anyOf really offers both tools


@pytest.mark.parametrize("model", ["smollm2-135m", "qwen-0.5b"])
def test_named_tool_choice_produces_exactly_one_call_to_that_tool(tok, model):
    t = tok(model)
    g = Grammar.for_tools(TOOLS, {"type": "function", "function": {"name": "add"}}, t)
    for seed in range(4):
        m = g.matcher(stops_of(t), t.vocab_size)
        text, _ = generate(m, t, stops_of(t), t.vocab_size, seed)
        [fn] = emitted_calls(text)
        assert fn["name"] == "add"
        assert jsonschema_rs.is_valid(PARAMS["add"], json.loads(fn["arguments"]))


def test_qwen_tool_call_tag_is_one_token_and_is_allowed(tok):
    """In Qwen's vocabulary <tool_call> is a single (user-defined) token; the grammar lexes text, so that
    token and the spelled-out tag both match. The model's own format goes through."""
    t = tok("qwen-0.5b")
    [tag] = t.encode("<tool_call>")
    g = Grammar.for_tools(TOOLS, "required", t)
    m = g.matcher(stops_of(t), t.vocab_size)
    row = np.zeros(mask_words(t.vocab_size), np.int32)
    m.fill_mask(row)
    first = set(allowed(row, t.vocab_size).tolist())
    assert tag in first and t.encode("<")[0] in first
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    ids = t.encode(text)
    assert ids[0] == tag
    assert all(m.consume(i) for i in ids) and m.accepting
    assert emitted_calls(text) == [{"name": "add", "arguments": '{"a": 1, "b": 2}'}]


def test_smollm_spells_the_tag_with_ordinary_tokens(tok):
    t = tok("smollm2-135m")
    ids = t.encode("<tool_call>")
    assert len(ids) > 1
    m = Grammar.for_tools(TOOLS, "required", t).matcher(stops_of(t), t.vocab_size)
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert all(m.consume(i) for i in t.encode(text)) and m.accepting


def test_several_calls_for_required_but_one_when_not_parallel(tok):
    t = tok("smollm2-135m")
    two = ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n'
           '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>')
    m = Grammar.for_tools(TOOLS, "required", t).matcher(stops_of(t), t.vocab_size)
    assert all(m.consume(i) for i in t.encode(two)) and m.accepting
    m = Grammar.for_tools(TOOLS, "required", t, parallel=False).matcher(stops_of(t), t.vocab_size)
    assert not all(m.consume(i) for i in t.encode(two))


def test_a_tool_without_parameters_takes_empty_arguments(tok):
    t = tok("smollm2-135m")
    tools = [{"type": "function", "function": {"name": "now"}}]
    text, _ = generate(Grammar.for_tools(tools, "required", t).matcher(stops_of(t), t.vocab_size), t,
                       stops_of(t), t.vocab_size, 0)
    assert [json.loads(fn["arguments"]) for fn in emitted_calls(text)] == [{}] * len(emitted_calls(text))


def test_tool_names_need_no_escaping_care(tok):
    t = tok("smollm2-135m")
    name = 'odd "name"} <x>'
    tools = [{"type": "function", "function": {"name": name, "parameters": PARAMS["add"]}}]
    g = Grammar.for_tools(tools, {"type": "function", "function": {"name": name}}, t)
    text, _ = generate(g.matcher([2], t.vocab_size), t, [2], t.vocab_size, 0)
    assert [fn["name"] for fn in emitted_calls(text)] == [name]


def test_parameters_with_local_references_resolve_inside_their_tool(tok):
    """pydantic puts nested models in "$defs" and points at them with "#/$defs/..."; two tools may even
    use the same definition name for different things."""
    t = tok("qwen-0.5b")

    def tool(name: str, item: dict) -> dict:
        return {"type": "function", "function": {"name": name, "parameters": {
            "type": "object", "$defs": {"Item": item}, "properties": {"item": {"$ref": "#/$defs/Item"}},
            "required": ["item"], "additionalProperties": False}}}

    tools = [tool("put", {**OBJ, "properties": {"x": {"type": "integer"}}, "required": ["x"]}),
             tool("tag", {"type": "string", "maxLength": 6})]
    g = Grammar.for_tools(tools, "required", t)
    params = {tl["function"]["name"]: tl["function"]["parameters"] for tl in tools}
    seen = set()
    for seed in range(6):
        text, _ = generate(g.matcher(stops_of(t), t.vocab_size), t, stops_of(t), t.vocab_size, seed)
        for fn in emitted_calls(text):
            assert jsonschema_rs.is_valid(params[fn["name"]], json.loads(fn["arguments"])), fn
            seen.add(fn["name"])
    assert seen == set(params)


def test_auto_and_none_force_nothing(tok):
    assert Grammar.for_tools(TOOLS, "auto", tok("smollm2-135m")) is None
    assert Grammar.for_tools(TOOLS, "none", tok("smollm2-135m")) is None


def test_tool_errors_name_the_field(tok):
    t = tok("smollm2-135m")
    with pytest.raises(RequestError) as e:
        Grammar.for_tools(TOOLS, {"type": "function", "function": {"name": "nope"}}, t)
    assert e.value.param == "tool_choice.function.name"
    with pytest.raises(RequestError) as e:
        Grammar.for_tools(TOOLS, "sometimes", t)
    assert e.value.param == "tool_choice"
    bad = [TOOLS[0], {"type": "function", "function": {"name": "x", "parameters": {"not": {"type": "object"}}}}]
    with pytest.raises(UnsupportedSchema) as e:
        Grammar.for_tools(bad, "required", t)
    assert e.value.param == "tools[1].function.parameters" and "not" in e.value.feature
    assert e.value.status == 400


# --- stop ids -------------------------------------------------------------------------------------------------


def test_stop_ids_are_allowed_only_once_the_document_is_complete(tok):
    t = tok("smollm2-135m")
    stops = [2]
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    m = Grammar.from_response_format(json_schema_rf(schema), t).matcher(stops, t.vocab_size)
    row = np.zeros(mask_words(t.vocab_size), np.int32)
    ids = t.encode('{"n": 12}')
    for i in ids[:-1]:
        m.fill_mask(row)
        assert 2 not in allowed(row, t.vocab_size) and not m.accepting and not m.done
        assert m.consume(i)
    assert m.consume(ids[-1])
    assert m.accepting and m.done  # nothing can follow the closing brace
    m.fill_mask(row)
    assert allowed(row, t.vocab_size).tolist() == stops  # only the stop id is left
    assert m.consume(2) and m.done
    assert not m.consume(ids[0])  # nothing after the end


def test_stop_ids_come_alongside_text_when_the_document_may_continue(tok):
    t = tok("smollm2-135m")
    g = Grammar.from_response_format(json_schema_rf({"type": "integer"}), t)
    m = g.matcher([0, 2], t.vocab_size)
    assert m.consume(t.encode("7")[0]) and m.accepting and not m.done
    row = np.zeros(mask_words(t.vocab_size), np.int32)
    m.fill_mask(row)
    ok = set(allowed(row, t.vocab_size).tolist())
    assert {0, 2} <= ok and t.encode("3")[0] in ok


def test_a_stop_id_is_never_text_even_when_it_is_an_ordinary_token(tok):
    t = tok("smollm2-135m")
    [one], [seven] = t.encode("1"), t.encode("7")
    m = Grammar.from_response_format(json_schema_rf({"type": "integer"}), t).matcher([one], t.vocab_size)
    row = np.zeros(mask_words(t.vocab_size), np.int32)
    m.fill_mask(row)
    ok = set(allowed(row, t.vocab_size).tolist())
    assert seven in ok and one not in ok  # "1" would be a digit, but it is the stop id here
    assert m.consume(seven)
    m.fill_mask(row)
    assert one in allowed(row, t.vocab_size)
    assert m.consume(one) and m.done  # it ended the output; "7" is the whole number


def test_a_stop_id_too_early_is_rejected_and_ends_the_matcher(tok):
    t = tok("smollm2-135m")
    m = Grammar.from_response_format({"type": "json_object"}, t).matcher([2], t.vocab_size)
    assert m.consume(t.encode("{")[0])
    assert not m.consume(2)
    assert m.done and m.error
    row = np.zeros(mask_words(t.vocab_size), np.int32)
    m.fill_mask(row)
    assert allowed(row, t.vocab_size).tolist() == [2]  # never an all-zero row


def test_a_rejected_token_stops_the_matcher(tok):
    t = tok("smollm2-135m")
    m = Grammar.from_response_format({"type": "json_object"}, t).matcher([2], t.vocab_size)
    assert not m.consume(t.encode("x")[0])
    assert m.done and m.error
    row = np.zeros(mask_words(t.vocab_size), np.int32)
    m.fill_mask(row)
    assert allowed(row, t.vocab_size).tolist() == [2]


def test_only_the_given_stop_ids_end_the_output(tok):
    """The tokenizer's EOS is llguidance's end marker; when the scheduler stops on other ids, EOS stays
    masked and those ids take its place."""
    t = tok("qwen-0.5b")
    assert t.eos_id == 151645
    m = Grammar.from_response_format(json_schema_rf({"type": "boolean"}), t).matcher([151643], t.vocab_size)
    for i in t.encode("true"):
        assert m.consume(i)
    row = np.zeros(mask_words(t.vocab_size), np.int32)
    m.fill_mask(row)
    assert allowed(row, t.vocab_size).tolist() == [151643]
    assert not Grammar.from_response_format({"type": "json_object"}, t).matcher([151643], t.vocab_size).consume(
        151645)


def test_a_wider_logits_row_never_allows_the_padding_tokens(tok):
    t = tok("smollm2-135m")
    vocab = t.vocab_size + 100
    g = Grammar.from_response_format({"type": "json_object"}, t)
    m = g.matcher([2], vocab)
    row = np.full(mask_words(vocab), -1, np.int32)
    m.fill_mask(row)
    assert allowed(row, vocab).max() < t.vocab_size
    assert not m.consume(t.vocab_size + 5)
    # and a narrower one (logits cut below the tokenizer's size) never sees bits past its width
    m = g.matcher([2], t.vocab_size - 40)
    row = np.zeros(mask_words(t.vocab_size - 40), np.int32)
    m.fill_mask(row)
    assert allowed(row, mask_words(t.vocab_size - 40) * 32).max() < t.vocab_size - 40


def test_mask_rows_are_rows_of_a_batch(tok):
    t = tok("smollm2-135m")
    g = Grammar.from_response_format({"type": "json_object"}, t)
    batch = np.zeros((3, mask_words(t.vocab_size)), np.int32)
    structured.fill_all(batch[0])
    g.matcher([2], t.vocab_size).fill_mask(batch[1])
    batch[2] = structured.ALL_ALLOWED_ROW(t.vocab_size)
    assert (batch[0] == -1).all() and (batch[2] == -1).all()
    first = allowed(batch[1], t.vocab_size).tolist()
    assert t.encode("{")[0] in first and all(t.token_text(i).startswith("{") for i in first)
    with pytest.raises(ValueError):
        g.matcher([2], t.vocab_size).fill_mask(np.zeros(mask_words(t.vocab_size), np.int64))
    assert mask_words(49152) == 1536 and mask_words(49153) == 1537


def test_matchers_are_independent(tok):
    t = tok("smollm2-135m")
    g = Grammar.from_response_format({"type": "json_object"}, t)
    a, b = g.matcher([2], t.vocab_size), g.matcher([2], t.vocab_size)
    for i in t.encode("{}"):
        assert a.consume(i)
    assert a.done and not b.done and b.consume(t.encode("{")[0])


# --- request errors -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("schema,feature", [
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "not"),
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"type": "string", "pattern": "(?=a)b"}, "look-around"),
    ({"type": "integer", "minimum": 5, "maximum": 1}, "minimum"),
])
def test_an_unenforceable_schema_is_a_400_naming_the_feature(tok, schema, feature):
    with pytest.raises(UnsupportedSchema) as e:
        Grammar.from_response_format(json_schema_rf(schema), tok("smollm2-135m"))
    assert isinstance(e.value, RequestError) and e.value.status == 400
    assert e.value.param == "response_format.json_schema.schema"
    assert feature in e.value.feature and feature in str(e.value)


def test_unknown_string_formats_are_annotations_unless_strict(tok):
    t = tok("smollm2-135m")
    schema = {**OBJ, "properties": {"pw": {"type": "string", "format": "password", "maxLength": 8}},
              "required": ["pw"]}
    text, _ = generate(Grammar.from_response_format(json_schema_rf(schema), t).matcher([2], t.vocab_size), t, [2],
                       t.vocab_size, 0)
    assert jsonschema_rs.is_valid(schema, json.loads(text))
    assert schema["properties"]["pw"]["format"] == "password"  # the caller's schema is left alone
    with pytest.raises(UnsupportedSchema) as e:
        Grammar.from_response_format(json_schema_rf(schema, strict=True), t)
    assert "password" in e.value.feature


def test_known_formats_are_the_ones_llguidance_enforces(tok):
    t = tok("smollm2-135m")
    for fmt in structured.KNOWN_FORMATS:
        Grammar.from_json_schema({"type": "string", "format": fmt}, t, strict=True)
    with pytest.raises(UnsupportedSchema):
        Grammar.from_json_schema({"type": "string", "format": "uri-reference"}, t, strict=True)


@pytest.mark.parametrize("rf,param", [
    ("json", "response_format"),
    ({"type": "xml"}, "response_format.type"),
    ({}, "response_format.type"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "has space", "schema": {}}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "a"}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": []}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": True}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "strict": "yes"}},
     "response_format.json_schema.strict"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "extra": 1}},
     "response_format.json_schema.extra"),
    ({"type": "text", "json_schema": {}}, "response_format.json_schema"),
    ({"type": "json_object", "schema": "x"}, "response_format.schema"),
])
def test_malformed_response_formats_name_the_field(tok, rf, param):
    with pytest.raises(RequestError) as e:
        Grammar.from_response_format(rf, tok("smollm2-135m"))
    assert e.value.param == param and e.value.status == 400


def test_llama_cpp_json_object_with_schema(tok):
    t = tok("smollm2-135m")
    schema = SCHEMAS[0][1]
    g = Grammar.from_response_format({"type": "json_object", "schema": schema}, t)
    text, _ = generate(g.matcher([2], t.vocab_size), t, [2], t.vocab_size, 1)
    assert jsonschema_rs.is_valid(schema, json.loads(text))


def test_a_grammar_compiled_in_one_thread_drives_matchers_in_another(tok):
    t = tok("smollm2-135m")
    box: dict = {}
    th = threading.Thread(target=lambda: box.update(g=Grammar.from_response_format({"type": "json_object"}, t)))
    th.start()
    th.join()
    out: list = []
    th = threading.Thread(target=lambda: out.append(generate(box["g"].matcher([2], t.vocab_size), t, [2],
                                                             t.vocab_size, 0)[0]))
    th.start()
    th.join()
    assert isinstance(json.loads(out[0]), dict)


def test_the_llguidance_tokenizer_is_built_once_per_tokenizer(tok):
    t = tok("smollm2-135m")
    assert structured.prepare(t) is structured.prepare(t)


# --- size and time bounds (issue 31) ----------------------------------------------------------------------------


def optional_props(n: int, prefix: str = "prop") -> dict:
    """An object of `n` optional string properties: llguidance's compile time grows with the square of n."""
    return {"type": "object", "properties": {f"{prefix}_{i:05d}": {"type": "string"} for i in range(n)}}


@pytest.fixture()
def compiles(monkeypatch):
    """How many grammars reached llguidance (a refusal by size must cost none)."""
    seen: list[str] = []
    real = structured._matcher_of

    def counting(grammar, tokenizer):
        seen.append(grammar)
        return real(grammar, tokenizer)

    monkeypatch.setattr(structured, "_matcher_of", counting)
    return seen


def test_the_issues_10k_property_schema_is_refused_before_it_compiles(tok, compiles):
    """10k optional properties (340 kB) took ~9 CPU-seconds to compile (108 s in a loaded server); the
    per-object cap sits well below that, and the refusal names the limit and its setting."""
    with pytest.raises(structured.SchemaTooLarge) as e:
        Grammar.from_response_format(json_schema_rf(optional_props(10_000)), tok("smollm2-135m"))
    assert e.value.status == 400 and e.value.code == "schema_too_large"
    assert e.value.param == "response_format.json_schema.schema"
    assert "10000 optional properties" in str(e.value) and "PANTHEON_GRAMMAR_MAX_PROPERTIES" in str(e.value)
    assert compiles == []


def test_many_small_objects_are_refused_by_the_node_cap(tok, compiles):
    """The total counts too: 60 objects of 100 properties each stay under the per-object cap but not
    under the subschema cap (compile time grows with the whole schema)."""
    schema = {"type": "object", "properties": {f"o{j}": optional_props(100, f"o{j}") for j in range(60)}}
    with pytest.raises(structured.SchemaTooLarge) as e:
        Grammar.from_response_format(json_schema_rf(schema), tok("smollm2-135m"))
    assert "PANTHEON_GRAMMAR_MAX_NODES" in str(e.value) and compiles == []


def test_enum_values_and_pattern_properties_count(tok, compiles):
    t = tok("smollm2-135m")
    with pytest.raises(structured.SchemaTooLarge):
        Grammar.from_json_schema({"enum": [f"v{i}" for i in range(6000)]}, t)
    pats = {"type": "object", "patternProperties": {f"^k{i}[a-z]+$": {"type": "integer"} for i in range(101)}}
    with pytest.raises(structured.SchemaTooLarge) as e:
        Grammar.from_json_schema(pats, t)
    assert "patternProperties" in str(e.value) and compiles == []


def test_forced_tools_are_counted_together(tok, compiles):
    """Each tool may be small; the grammar holds all of them."""
    tools = [{"type": "function", "function": {"name": f"t{i}", "parameters": optional_props(300, f"t{i}")}}
             for i in range(20)]
    with pytest.raises(structured.SchemaTooLarge) as e:
        Grammar.for_tools(tools, "required", tok("smollm2-135m"))
    assert e.value.param == "tools" and compiles == []


def test_the_limits_are_the_callers(tok):
    t = tok("smollm2-135m")
    small = structured.SchemaLimits(max_nodes=50, max_properties=10)
    with pytest.raises(structured.SchemaTooLarge):
        Grammar.from_json_schema(optional_props(11), t, limits=small)
    Grammar.from_json_schema(optional_props(10), t, limits=small)
    required = {**optional_props(30), "required": [f"prop_{i:05d}" for i in range(25)]}
    Grammar.from_json_schema(required, t, limits=small)  # 5 optional: only those grow as a square
    with pytest.raises(structured.SchemaTooLarge):
        Grammar.from_json_schema({**required, "required": required["required"][:19]}, t, limits=small)
    with pytest.raises(structured.SchemaTooLarge):
        Grammar.for_tools([{"type": "function", "function": {"name": "f", "parameters": optional_props(11)}}],
                          "required", t, limits=small)


def test_the_largest_schema_within_the_caps_compiles_and_generates(tok):
    """Twelve objects of 400 optional properties each (4813 subschemas, 150 kB): inside every default
    cap, at the top of the measured range (~0.3 CPU-seconds here). It compiles and its output is valid."""
    t = tok("smollm2-135m")
    schema = {"type": "object", "properties": {f"o{j}": optional_props(400, f"o{j}") for j in range(12)},
              "required": ["o0"], "additionalProperties": False}
    g = Grammar.from_response_format(json_schema_rf(schema), t)
    text, _ = generate(g.matcher(stops_of(t), t.vocab_size), t, stops_of(t), t.vocab_size, 0)
    assert jsonschema_rs.is_valid(schema, json.loads(text))


def test_an_object_past_llguidances_row_limit_fails_at_its_opening_brace_with_a_message(tok):
    """Why the default per-object cap is 400, not higher: llguidance's parser allows 2000 items in a row
    (4 per optional property, plus a few), so with the cap raised, 499 optional properties compile but
    the opening brace is refused with that reason (which the scheduler reports as the request's error);
    498 still work. With the default cap 499 is refused up front."""
    t = tok("smollm2-135m")
    brace = t.encode("{")[0]
    with pytest.raises(structured.SchemaTooLarge):
        Grammar.from_response_format(json_schema_rf(optional_props(499)), t)
    raised = structured.SchemaLimits(max_properties=600)
    ok = Grammar.from_response_format(json_schema_rf(optional_props(498)), t, raised).matcher(stops_of(t), t.vocab_size)
    assert ok.consume(brace) and ok.error is None
    m = Grammar.from_response_format(json_schema_rf(optional_props(499)), t, raised).matcher(stops_of(t), t.vocab_size)
    assert not m.consume(brace)
    assert "max is 2000" in m.error and m.done
