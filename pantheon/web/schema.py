"""The HTTP API's request and response bodies as JSON Schema (the OpenAPI 3.1 dialect), as Python data.

Why data and not prose: this module is the one description of what each route takes. The route
validators read their field lists from it (`chat.TOP_FIELDS` is `CHAT_REQUEST`'s properties,
`chat.MESSAGE_FIELDS` is `CHAT_MESSAGE`'s, completions', embeddings', the admin and tokenizer routes'
allowed fields and bounds likewise), `GET /openapi.json` (pantheon.web.openapi) publishes it, and
tests/test_openapi.py holds the validators to it: every property's `examples[0]` must be accepted,
every value the property's schema refuses must be a 400 naming the field, the bounds (`minimum`,
`maximum`, `maxLength`, `maxItems`, ...) are probed at and just past their edges, and a field missing
here is refused; a fuzz of every route from the published document finds no body the schema refuses
taken. So a field cannot be added to a validator without being documented, nor documented without
being checked. Every bound itself (a numeric field's range, default and example; a string's or a
list's size) is a row or a constant of pantheon.contract: `bound()` turns a row into its schema here,
and pantheon.web.fields checks a value against the same row (tests/test_contract.py generates both
from the table and compares them with the published document). Bounds a model sets (n by its slots, token ids by its vocabulary, dimensions by its size) are checked
when the request starts; the schema gives the field's own range.

Conventions: request objects are closed (`additionalProperties: false`: the validators refuse a field
they do not know rather than ignore it); an optional top-level field set to null counts as absent
(`nullable`); cross-field rules a schema cannot say plainly (stream_options only with stream, a named
tool_choice naming one of the tools, ...) are in the `description`, and the validators enforce them.
Every property carries `examples`, its first entry valid on its own.
"""

from __future__ import annotations

import copy
from typing import Any

from pantheon import contract
from pantheon.contract import (
    ADMIN_DIES_MAX,
    ADMIN_NAME_CHARS,
    EMBED_INPUTS_MAX,
    FORMAT_NAME_PATTERN,
    ID_CHARS,
    LOGIT_BIAS_KEY_DIGITS,
    LOGIT_BIAS_VALUE,
    MAX_LOGIT_BIAS,
    METADATA_KEY_CHARS,
    METADATA_MAX,
    METADATA_VALUE_CHARS,
    PROMPT_CACHE_KEY_CHARS,
    PROMPTS_MAX,
    STOP_CHARS,
    STOP_MAX,
    TOKENS_MAX,
    TOOL_NAME_CHARS,
    Bound,
)

Schema = dict[str, Any]

ROLES = ("system", "user", "assistant", "tool", "function")  # "function": the deprecated tool result
SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority")
VERBOSITY = ("low", "medium", "high")
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")
TRUNCATE = ("none", "oldest")
TOOL_CHOICES = ("none", "auto", "required")


# ---- helpers ------------------------------------------------------------------------------------------
def nullable(schema: Schema) -> Schema:
    """`schema` or null: an optional field the validators treat as absent when it is null."""
    out = copy.deepcopy(schema)
    t = out.get("type")
    if isinstance(t, str) and not any(k in out for k in ("enum", "const")):
        out["type"] = [t, "null"]
        return out
    if isinstance(t, list) and "null" not in t and not any(k in out for k in ("enum", "const")):
        out["type"] = [*t, "null"]
        return out
    keep = {k: out.pop(k) for k in ("description", "examples", "deprecated") if k in out}
    return {"anyOf": [out, {"type": "null"}], **keep}


def _str(max_len: int | None = ID_CHARS, example: str = "abc", **extra: Any) -> Schema:
    s: Schema = {"type": "string", "examples": [example], **extra}
    if max_len is not None:
        s["maxLength"] = max_len
    return s


def bound(b: Bound, **extra: Any) -> Schema:
    """A numeric field's JSON Schema from its contract row: the one way a bound reaches the document."""
    s: Schema = {"type": b.kind, "examples": [b.example], **extra}
    if b.lo is not None:
        s["exclusiveMinimum" if b.lo_open else "minimum"] = b.lo
    if b.hi is not None:
        s["maximum"] = b.hi
    return s


def _bool(example: bool = True, **extra: Any) -> Schema:
    return {"type": "boolean", "examples": [example], **extra}


def _enum(values: tuple[str, ...], **extra: Any) -> Schema:
    return {"type": "string", "enum": list(values), "examples": [values[0]], **extra}


def _object(properties: dict[str, Schema], required: tuple[str, ...] = (), closed: bool = True,
            **extra: Any) -> Schema:
    s: Schema = {"type": "object", "properties": properties, **extra}
    if required:
        s["required"] = list(required)
    if closed:
        s["additionalProperties"] = False
    return s


def _optional(properties: dict[str, Schema], keep: tuple[str, ...] = ()) -> dict[str, Schema]:
    """Every property nullable (null means absent), except those in `keep`."""
    return {k: v if k in keep else nullable(v) for k, v in properties.items()}


def _token_list(example: list) -> Schema:
    return {"type": "array", "items": {"type": "integer", "minimum": 0}, "examples": [example]}


# ---- chat completions -----------------------------------------------------------------------------------
TEXT_PART: Schema = _object({"type": {"const": "text"}, "text": {"type": "string"}}, required=("type", "text"))

TOOL_CALL: Schema = _object({
    "id": {"type": ["string", "null"]},
    "type": {"const": "function"},
    "function": _object({"name": {"type": "string", "minLength": 1},
                         "arguments": {"type": ["string", "object", "null"],
                                       "description": "a JSON string (an object is taken too)"}},
                        required=("name",), closed=False),
}, required=("function",), closed=False)

_CONTENT: Schema = {"anyOf": [{"type": "string"}, {"type": "array", "items": TEXT_PART}],
                    "description": "a string, or text parts (joined with newlines)",
                    "examples": ["Hello!", [{"type": "text", "text": "Hello!"}]]}
IMAGE_PART: Schema = _object({
    "type": {"const": "image_url"},
    "image_url": {"anyOf": [
        _object({"url": {"type": "string", "description": "a data: URL (PNG, JPEG, WebP, base64); an http(s) URL "
                                                           "only under PANTHEON_IMAGE_URL_ALLOWLIST"},
                 "detail": {"enum": ["auto", "low", "high"]}}, required=("url",)),
        {"type": "string"}]},
}, required=("type", "image_url"))
_USER_CONTENT: Schema = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"anyOf": [TEXT_PART, IMAGE_PART]}}],
                         "description": "a string, or text parts (joined with newlines) and image parts (a model "
                                        "loaded with a vision projector)",
                         "examples": ["Hello!", [{"type": "text", "text": "What is this?"},
                                                 {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}]]}
_MESSAGE_COMMON: dict[str, Schema] = {
    "content": _CONTENT,
    "name": _str(None, "alice"),
    "reasoning_content": _str(None, "The user greets me.", description="an earlier turn's reasoning"),
    "reasoning": _str(None, "The user greets me.", description="the same as reasoning_content"),
}
_TOOL_CALLS: Schema = {"type": "array", "items": TOOL_CALL, "examples": [
    [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]]}


def _message(role: Schema, required: tuple[str, ...], **more: Schema) -> Schema:
    # A field set to null counts as absent (clients echo back refusal, audio, ... as null), so every
    # field but the required ones may be null, and so may any field not listed.
    props = {"role": role, **_MESSAGE_COMMON, **more}
    return {"type": "object", "properties": _optional(props, keep=("role", *required)),
            "required": ["role", *required], "additionalProperties": {"type": "null"}}


_FUNCTION_CALL: Schema = {**_object({"name": {"type": "string", "minLength": 1},
                                     "arguments": {"type": ["string", "null"], "description": "a JSON string"}},
                                    required=("name",)),
                           "deprecated": True, "description": "the old form of one tool call",
                           "examples": [{"name": "get_weather", "arguments": "{}"}]}

CHAT_MESSAGE: Schema = {
    "description": "One turn: content is required except on an assistant message with tool_calls (or the "
                   "deprecated function_call, not both); tool_calls and function_call only on assistant "
                   "messages, tool_call_id only on tool messages; a function message (the deprecated tool "
                   "result) names its function. Any other field is refused unless it is null.",
    "anyOf": [
        _message(_enum(("system",), examples=["system"]), ("content",)),
        _message(_enum(("user",), examples=["user"]), ("content",), content=_USER_CONTENT),
        _message({"const": "assistant", "examples": ["assistant"]}, ("content",),
                 tool_calls=_TOOL_CALLS, function_call=_FUNCTION_CALL),
        _message({"const": "assistant", "examples": ["assistant"]}, ("tool_calls",),
                 tool_calls={**_TOOL_CALLS, "minItems": 1}),
        _message({"const": "assistant", "examples": ["assistant"]}, ("function_call",),
                 function_call=_FUNCTION_CALL),
        _message({"const": "tool", "examples": ["tool"]}, ("content",), tool_call_id=_str(None, "call_1")),
        _message({"const": "function", "examples": ["function"], "deprecated": True}, ("content", "name"),
                 name={"type": "string", "minLength": 1, "examples": ["get_weather"]},
                 tool_call_id=_str(None, "call_1")),
    ],
}

FUNCTION_DEF: Schema = _object({
    "name": {"type": "string", "minLength": 1, "maxLength": TOOL_NAME_CHARS},
    "description": {"type": "string"},
    "parameters": {"type": "object", "description": "a JSON Schema object"},
    "strict": {"type": "boolean"},
}, required=("name",))

TOOL: Schema = _object({"type": {"const": "function"}, "function": FUNCTION_DEF}, required=("type", "function"))

NAMED_FUNCTION: Schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}

LOGIT_BIAS: Schema = {
    "type": "object",
    "description": "token id (as a string) -> bias added to its logit before sampling; -100 bans it, 100 forces it",
    "propertyNames": {"pattern": f"^[0-9]{{1,{LOGIT_BIAS_KEY_DIGITS}}}$"},
    "additionalProperties": bound(LOGIT_BIAS_VALUE),
    "maxProperties": MAX_LOGIT_BIAS,
    "examples": [{"50": -100}],
}

_JSON_SCHEMA_OBJECT: Schema = {"type": "object", "description": "a JSON Schema object (llguidance must support it)"}
RESPONSE_FORMAT: Schema = {
    "oneOf": [
        _object({"type": {"const": "text"}}, required=("type",)),
        _object({"type": {"const": "json_object"},
                 "schema": {**_JSON_SCHEMA_OBJECT, "type": ["object", "null"],
                            "description": "llama.cpp's form: a schema the object must match"}}, required=("type",)),
        _object({"type": {"const": "json_schema"},
                 "json_schema": _object({"name": {"type": "string", "pattern": FORMAT_NAME_PATTERN},
                                         "description": {"type": "string"},
                                         "schema": _JSON_SCHEMA_OBJECT,
                                         "strict": {"type": ["boolean", "null"]}}, required=("name", "schema"))},
                required=("type", "json_schema")),
    ],
    "description": "text: free text; json_object: a JSON object; json_schema: JSON valid for the given schema. "
                   "Not with tool_choice \"required\" or a named function (each constrains the whole output).",
    "examples": [{"type": "text"}, {"type": "json_object"}],
}

CHAT_REQUEST: Schema = _object(_optional({
    "model": _str(example="my-model", description="a resident model's name; see the routing rules"),
    "messages": {"type": "array", "minItems": 1, "items": CHAT_MESSAGE,
                 "examples": [[{"role": "user", "content": "Hello!"}]]},
    "max_tokens": bound(contract.CHAT["max_tokens"], description="clamped to the room left in the context"),
    "max_completion_tokens": bound(contract.CHAT["max_completion_tokens"], description="wins over max_tokens"),
    "temperature": bound(contract.CHAT["temperature"]),
    "top_p": bound(contract.CHAT["top_p"]),
    "top_k": bound(contract.CHAT["top_k"], description="-1 and 0 both mean off"),
    "min_p": bound(contract.CHAT["min_p"]),
    "repetition_penalty": bound(contract.CHAT["repetition_penalty"]),
    "presence_penalty": bound(contract.CHAT["presence_penalty"]),
    "frequency_penalty": bound(contract.CHAT["frequency_penalty"]),
    "seed": bound(contract.CHAT["seed"]),
    "stop": {"anyOf": [{"type": "string", "maxLength": STOP_CHARS},
                       {"type": "array", "maxItems": STOP_MAX, "items": {"type": "string", "maxLength": STOP_CHARS}}],
             "examples": ["\n\n", ["END", "###"]]},
    "stream": _bool(False, description="server-sent events"),
    "stream_options": {**_object({"include_usage": nullable(_bool())}),
                       "description": "only with stream: true", "examples": [{"include_usage": True}]},
    "tools": {"type": "array", "items": TOOL, "description": "function names are unique",
              "examples": [[{"type": "function", "function": {"name": "get_weather",
                                                              "parameters": {"type": "object"}}}]]},
    "tool_choice": {"anyOf": [_enum(TOOL_CHOICES), _object({"type": {"const": "function"},
                                                             "function": NAMED_FUNCTION},
                                                            required=("type", "function"), closed=False)],
                    "description": "anything but \"none\" needs tools; a named function must be one of them",
                    "examples": ["none"]},
    "parallel_tool_calls": _bool(),
    "session_id": _str(example="conversation-1", description="also the X-Session-Id / X-SMG-Routing-Key header"),
    "n": bound(contract.CHAT["n"], description="choices to generate; at most the model's batch slots"),
    "user": _str(example="user-1234"),
    "logprobs": _bool(False, description="return the chosen tokens' log probabilities"),
    "top_logprobs": bound(contract.CHAT["top_logprobs"], description="alternatives per position; needs logprobs: true"),
    "logit_bias": LOGIT_BIAS,
    "response_format": RESPONSE_FORMAT,
    "functions": {"type": "array", "minItems": 1, "items": FUNCTION_DEF, "deprecated": True,
                  "description": "the old form of tools (not with tools); names unique",
                  "examples": [[{"name": "get_weather", "parameters": {"type": "object"}}]]},
    "function_call": {"anyOf": [_enum(("none", "auto")), {**NAMED_FUNCTION, "additionalProperties": False}],
                      "deprecated": True, "examples": ["none"],
                      "description": "the old form of tool_choice (not with it): \"auto\" needs functions, a name "
                                     "must be one of them"},
    "chat_template_kwargs": {**_object({"enable_thinking": nullable(_bool())}),
                             "examples": [{"enable_thinking": False}]},
    "ignore_eos": _bool(False, description="generate the full budget past end-of-turn tokens (benchmarks)"),
    "speculative": _bool(False, description="false: no speculative decoding for this request (the tokens are the "
                                            "same either way; docs/speculative.md)"),
    "cache_salt": _str(example="tenant-a", description="part of the prefix-cache scope"),
    "truncate": _enum(TRUNCATE, description="oldest: drop the oldest turns to fit the context window"),
    "reasoning_effort": _enum(REASONING_EFFORTS, examples=["low"],
                              description="the chat template's thinking switch: none/minimal off, others on"),
    # accepted for OpenAI compatibility, checked, and changing nothing here
    "store": _bool(False),
    "metadata": {"type": "object", "maxProperties": METADATA_MAX,
                 "propertyNames": {"maxLength": METADATA_KEY_CHARS},
                 "additionalProperties": {"type": "string", "maxLength": METADATA_VALUE_CHARS},
                 "examples": [{"trace": "abc"}]},
    "service_tier": _enum(SERVICE_TIERS),
    "prompt_cache_key": _str(PROMPT_CACHE_KEY_CHARS, "k1"),
    "safety_identifier": _str(example="u-hash"),
    "verbosity": _enum(VERBOSITY),
    "modalities": {"type": "array", "items": {"const": "text"}, "examples": [["text"]]},
}, keep=("messages",)), required=("messages",))

# ---- completions (legacy) and embeddings ------------------------------------------------------------------
_IDS: Schema = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
PROMPT: Schema = {
    "anyOf": [{"type": "string"}, _IDS,
              {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": PROMPTS_MAX},
              {"type": "array", "items": _IDS, "minItems": 1, "maxItems": PROMPTS_MAX}],
    "description": "a text or token ids, or a list of texts or of token-id lists (not a mix): n choices each, "
                   "choice i of prompt p at index p * n + i",
    "examples": ["Once upon a time", [1, 2, 3], ["Once upon a time", "The end"]],
}

COMPLETION_REQUEST: Schema = _object(_optional({
    "model": CHAT_REQUEST["properties"]["model"],
    "prompt": PROMPT,
    "suffix": {"type": "string", "maxLength": 0, "examples": [""],
               "description": "fill-in-the-middle is not supported: only empty"},
    "max_tokens": bound(contract.COMPLETIONS["max_tokens"], description="default 16, as OpenAI's"),
    "temperature": bound(contract.COMPLETIONS["temperature"]),
    "top_p": bound(contract.COMPLETIONS["top_p"]),
    "top_k": bound(contract.COMPLETIONS["top_k"]),
    "min_p": bound(contract.COMPLETIONS["min_p"]),
    "n": bound(contract.COMPLETIONS["n"], description="choices to generate; at most the model's batch slots"),
    "best_of": bound(contract.COMPLETIONS["best_of"], description="only 1 or equal to n (choices are not ranked)"),
    "stream": _bool(False),
    "stream_options": {**_object({"include_usage": nullable(_bool())}),
                       "description": "only with stream: true", "examples": [{"include_usage": True}]},
    "logprobs": bound(contract.COMPLETIONS["logprobs"], description="alternatives per position (0: the chosen token only); "
                     "with echo, n x prompt tokens x (logprobs + 1) is at most PANTHEON_MAX_ECHO_LOGPROBS "
                     "(65536 by default), else 400"),
    "echo": _bool(False, description="put the prompt before the completion (with logprobs: scored, within a cap)"),
    "stop": CHAT_REQUEST["properties"]["stop"],
    "presence_penalty": bound(contract.COMPLETIONS["presence_penalty"]),
    "frequency_penalty": bound(contract.COMPLETIONS["frequency_penalty"]),
    "repetition_penalty": bound(contract.COMPLETIONS["repetition_penalty"]),
    "seed": bound(contract.COMPLETIONS["seed"]),
    "logit_bias": LOGIT_BIAS,
    "user": _str(example="user-1234"),
    "ignore_eos": _bool(False, description="generate the full budget past end-of-text tokens (benchmarks)"),
    "speculative": CHAT_REQUEST["properties"]["speculative"],
}, keep=("prompt",)), required=("prompt",))

EMBEDDING_REQUEST: Schema = _object(_optional({
    "input": {"anyOf": [{"type": "string", "minLength": 1}, _IDS,
                        {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1,
                         "maxItems": EMBED_INPUTS_MAX},
                        {"type": "array", "items": _IDS, "minItems": 1, "maxItems": EMBED_INPUTS_MAX}],
              "description": "a text, token ids, or a list of either (not a mix): one vector each",
              "examples": ["The food was delicious.", ["a", "b"]]},
    "model": CHAT_REQUEST["properties"]["model"],
    "encoding_format": _enum(("float", "base64"), description="base64: little-endian float32"),
    "dimensions": bound(contract.EMBEDDINGS["dimensions"], description="the model's own dimensions only (vectors are not shortened)"),
    "user": _str(example="user-1234"),
    "pooling": _enum(("mean", "last"), description="how token states become one vector (default: mean)"),
}, keep=("input",)), required=("input",))

# ---- tokenizer routes (llama.cpp's shapes) --------------------------------------------------------------
TOKENIZE_REQUEST: Schema = _object({
    "content": _str(None, "Hello world", description=f"a text of at most {TOKENS_MAX} tokens (more is a 400)"),
    "add_special": _bool(False, description="add the model's BOS/EOS the way it wants them"),
    "with_pieces": _bool(False, description="answer [{id, piece}, ...] instead of ids"),
    "model": CHAT_REQUEST["properties"]["model"],
}, required=("content",))

DETOKENIZE_REQUEST: Schema = _object({
    "tokens": {**_token_list([72, 105]), "maxItems": TOKENS_MAX,
               "description": "ids of the model's vocabulary"},
    "model": CHAT_REQUEST["properties"]["model"],
}, required=("tokens",))

# ---- admin ----------------------------------------------------------------------------------------------
_ADMIN_STR = {"type": "string", "minLength": 1, "maxLength": ADMIN_NAME_CHARS}


def _exactly_one(a: str, b: str) -> list[Schema]:
    """oneOf: `a` or `b` given (a string), not both; null counts as absent."""
    return [{"required": [k], "properties": {k: {"type": "string"}}} for k in (a, b)]


LOAD_REQUEST: Schema = {**_object(_optional({
    "path": {**_ADMIN_STR, "description": "a file inside PANTHEON_MODEL_DIR", "examples": ["model.gguf"]},
    "model": {**_ADMIN_STR, "description": "a catalog name, or a file inside PANTHEON_MODEL_DIR",
              "examples": ["model.gguf"]},
    "name": {**_ADMIN_STR, "description": "the served name: letters, digits and ._:/+-, at most 128 characters",
             "examples": ["chat"]},
    "dies": {"type": "array", "maxItems": ADMIN_DIES_MAX, "items": {"type": "integer", "minimum": 0},
             "examples": [[0]]},
    "mmproj": {**_ADMIN_STR, "description": "a vision projector (llama.cpp mmproj GGUF) inside PANTHEON_MODEL_DIR: "
               "the model takes images", "examples": ["mmproj.gguf"]},
    "speculative": _bool(True, description="this model's default for prompt-lookup speculative decoding "
                                           "(default PANTHEON_SPECULATIVE); a request may still opt out"),
    "draft_model": {**_ADMIN_STR, "description": "a draft model (a catalog name, or a file inside "
                    "PANTHEON_MODEL_DIR) with the model's tokenizer: it proposes the drafts prompt lookup finds "
                    "none for (default PANTHEON_DRAFT_MODEL)", "examples": ["draft.gguf"]},
    "spec_k": bound(contract.LOAD["spec_k"], description="the most drafts a verify step checks per slot "
                                                         "(default PANTHEON_SPEC_K); 0: no verify programs"),
})), "oneOf": _exactly_one("path", "model"), "description": "exactly one of path and model"}

UNLOAD_REQUEST: Schema = {**_object(_optional({
    "name": {**_ADMIN_STR, "examples": ["chat"]},
    "instance_id": {**_ADMIN_STR, "examples": ["inst-8f2a61c0d9e4"]},
    "timeout_s": bound(contract.UNLOAD["timeout_s"], description="give up (409) if requests are still in flight"),
})), "oneOf": _exactly_one("name", "instance_id"), "description": "exactly one of name and instance_id"}

# ---- OpenAI Responses and Anthropic Messages ---------------------------------------------------------------
_ITEM: Schema = {"type": "object", "description": "an input item: a message (role user/system/developer/assistant, "
                 "content a string or input_text/output_text parts, and input_image parts with a data: URL in user "
                 "items of a model with a vision projector), function_call, function_call_output or "
                 "reasoning; fields set to null count as absent"}
_FORMAT_NAME: Schema = {"type": "string", "pattern": FORMAT_NAME_PATTERN}
TEXT_FORMAT: Schema = {
    "oneOf": [
        _object({"type": {"const": "text"}}, required=("type",)),
        _object({"type": {"const": "json_object"}}, required=("type",)),
        _object({"type": {"const": "json_schema"}, "name": _FORMAT_NAME, "schema": _JSON_SCHEMA_OBJECT,
                 "strict": {"type": ["boolean", "null"]}, "description": {"type": ["string", "null"]}},
                required=("type", "name", "schema")),
    ],
    "examples": [{"type": "text"}, {"type": "json_object"}],
}
RESPONSES_REQUEST: Schema = _object(_optional({
    "model": CHAT_REQUEST["properties"]["model"],
    "input": {"anyOf": [{"type": "string"}, {"type": "array", "items": _ITEM, "minItems": 1}],
              "description": "a user message, or a list of input items",
              "examples": ["Hello!", [{"role": "user", "content": "Hello!"}]]},
    "instructions": _str(None, "Answer briefly.", description="the system prompt (not carried to later turns)"),
    "max_output_tokens": bound(contract.RESPONSES["max_output_tokens"], description="clamped to the room left in the context"),
    "temperature": bound(contract.RESPONSES["temperature"]),
    "top_p": bound(contract.RESPONSES["top_p"]),
    "top_k": bound(contract.RESPONSES["top_k"], description="-1 and 0 both mean off (the SMG router sends -1)"),
    "min_p": bound(contract.RESPONSES["min_p"]),
    "repetition_penalty": bound(contract.RESPONSES["repetition_penalty"]),
    "priority": bound(contract.RESPONSES["priority"], description="SGLang's request priority, which the SMG router sends: only 0"),
    "stream": _bool(False, description="typed server-sent events (response.created ... response.completed)"),
    "stream_options": {**_object({"include_obfuscation": nullable(_bool())}), "description": "only with stream",
                       "examples": [{"include_obfuscation": False}]},
    "tools": {"type": "array", "items": {"type": "object", "properties": {"type": {"type": "string"}},
                                         "required": ["type"]},
              "description": "function tools {type: function, name, description, parameters, strict}; built-in "
                             "tool types are refused", "examples": [[{"type": "function", "name": "get_weather",
                                                                      "parameters": {"type": "object"}}]]},
    "tool_choice": {"anyOf": [_enum(TOOL_CHOICES), _object({"type": {"const": "function"}, "name": {"type": "string"}},
                                                            required=("type", "name"), closed=False)],
                    "examples": ["none"], "description": "anything but \"none\" needs tools"},
    "parallel_tool_calls": _bool(),
    "text": {**_object({"format": nullable(TEXT_FORMAT), "verbosity": nullable(_enum(VERBOSITY))}),
             "examples": [{"format": {"type": "text"}}]},
    "reasoning": {**_object({"effort": nullable(_enum(REASONING_EFFORTS)),
                             "summary": nullable(_enum(("auto", "concise", "detailed"))),
                             "generate_summary": nullable(_enum(("auto", "concise", "detailed")))}),
                  "description": "effort: the chat template's thinking switch (none/minimal off, others on)",
                  "examples": [{"effort": "low"}]},
    "store": _bool(True, description="keep the response for previous_response_id and GET (default true)"),
    "previous_response_id": _str(example="resp_0123", description="continue a stored response's conversation"),
    "include": {"type": "array", "items": _enum(("reasoning.encrypted_content",)), "examples": [[]],
                "description": "accepted for compatibility; reasoning is never encrypted here"},
    "truncation": _enum(("disabled", "auto"), description="auto: drop the oldest turns to fit the context"),
    "background": {"const": False, "examples": [False], "description": "background responses are not supported"},
    "metadata": CHAT_REQUEST["properties"]["metadata"],
    "user": _str(example="user-1234"),
    "service_tier": _enum(SERVICE_TIERS),
    "prompt_cache_key": _str(PROMPT_CACHE_KEY_CHARS, "k1"),
    "safety_identifier": _str(example="u-hash"),
}, keep=("input",)), required=("input",))

_BLOCK: Schema = {"type": "object", "properties": {"type": {"type": "string"}}, "required": ["type"],
                  "description": "a content block: text, tool_use, tool_result, thinking or redacted_thinking; "
                                 "image (a base64 source) in user turns of a model with a vision projector"}
ANTHROPIC_MESSAGE: Schema = _object({
    "role": _enum(("user", "assistant")),
    "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _BLOCK}],
                "examples": ["Hello!"]},
}, required=("role", "content"))
_SYSTEM: Schema = {"anyOf": [{"type": "string"}, {"type": "array", "items": _BLOCK}],
                   "description": "the system prompt: a string or text blocks", "examples": ["Answer briefly."]}
_ANTHROPIC_TOOLS: Schema = {"type": "array", "items": {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": TOOL_NAME_CHARS}, "description": {"type": "string"},
    "input_schema": {"type": "object"}}, "required": ["name", "input_schema"]},
    "description": "custom tools (name, description, input_schema); server tool types are refused",
    "examples": [[{"name": "get_weather", "input_schema": {"type": "object"}}]]}
_ANTHROPIC_TOOL_CHOICE: Schema = {"type": "object", "properties": {
    "type": {"enum": ["auto", "any", "tool", "none"]}, "name": {"type": "string"},
    "disable_parallel_tool_use": {"type": "boolean"}}, "required": ["type"],
    "description": "tool needs name, one of the tools", "examples": [{"type": "auto"}]}
_THINKING: Schema = {"type": "object", "properties": {"type": {"enum": ["enabled", "disabled", "adaptive"]},
                                                      "budget_tokens": bound(contract.THINKING["budget_tokens"]),
                                                      "display": {"enum": ["summarized", "omitted", None]}},
                     "required": ["type"], "description": "the chat template's thinking switch",
                     "examples": [{"type": "disabled"}]}
_MESSAGES_COMMON: dict[str, Schema] = {
    "model": CHAT_REQUEST["properties"]["model"],
    "messages": {"type": "array", "minItems": 1, "items": ANTHROPIC_MESSAGE,
                 "examples": [[{"role": "user", "content": "Hello!"}]]},
    "system": _SYSTEM,
    "tools": _ANTHROPIC_TOOLS,
    "tool_choice": _ANTHROPIC_TOOL_CHOICE,
    "thinking": _THINKING,
}
MESSAGES_REQUEST: Schema = _object(_optional({
    **_MESSAGES_COMMON,
    "max_tokens": bound(contract.MESSAGES["max_tokens"],
                        description="required, as Anthropic requires it; more than the model's context is a 400 "
                                    "naming it, and the room the prompt leaves in the context caps it"),
    "stop_sequences": {"type": "array", "maxItems": STOP_MAX, "items": {"type": "string", "maxLength": STOP_CHARS},
                       "examples": [["END"]]},
    "stream": _bool(False, description="Anthropic's server-sent events (message_start ... message_stop)"),
    "temperature": bound(contract.MESSAGES["temperature"]),
    "top_p": bound(contract.MESSAGES["top_p"]),
    "top_k": bound(contract.MESSAGES["top_k"]),
    "metadata": {**_object({"user_id": nullable(_str())}), "examples": [{"user_id": "u-1"}]},
    "output_config": {**_object({"format": nullable(_object({"type": {"const": "json_schema"},
                                                             "schema": _JSON_SCHEMA_OBJECT},
                                                            required=("type", "schema"))),
                                 "effort": {"type": "null", "description": "not supported"}}),
                      "description": "format: JSON valid for the schema, through the grammar path",
                      "examples": [{"format": {"type": "json_schema", "schema": {"type": "object"}}}]},
    "cache_control": {**_object({"type": {"const": "ephemeral"}, "ttl": {"enum": ["5m", "1h"]}}, required=("type",)),
                      "description": "accepted; the prefix cache is automatic here",
                      "examples": [{"type": "ephemeral"}]},
    "service_tier": _enum(("auto", "standard_only")),
}, keep=("messages", "max_tokens")), required=("messages", "max_tokens"))
COUNT_TOKENS_REQUEST: Schema = _object(_optional(_MESSAGES_COMMON, keep=("messages",)), required=("messages",))

# ---- responses ------------------------------------------------------------------------------------------
ERROR: Schema = {
    "type": "object",
    "description": "Every error, from any route. type follows the HTTP status; code is the specific reason.",
    "properties": {"error": {
        "type": "object",
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}},
        "required": ["message", "type", "param", "code"],
    }},
    "required": ["error"],
}

HEALTH: Schema = {"type": "object", "properties": {
    "service": {"const": "pantheon"}, "status": {"enum": ["ok", "loading", "failed", "not_ready"]},
    "error": {"type": ["string", "null"]}, "model": {"type": "string"}}, "required": ["service", "status"]}

MODEL: Schema = {"type": "object", "properties": {
    "id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
    "owned_by": {"type": "string"}}, "required": ["id", "object", "created", "owned_by"]}

MODEL_LIST: Schema = {"type": "object", "properties": {"object": {"const": "list"}, "data": {"type": "array",
                                                                                           "items": MODEL}},
                      "required": ["object", "data"]}

USAGE: Schema = {"type": "object", "properties": {
    "prompt_tokens": {"type": "integer"}, "completion_tokens": {"type": "integer"},
    "total_tokens": {"type": "integer"},
    "prompt_tokens_details": {"type": "object", "properties": {"cached_tokens": {"type": "integer"}}}},
    "required": ["prompt_tokens", "total_tokens"]}

_CHOICE_LOGPROBS = {"type": ["object", "null"], "description": "with logprobs: the chosen tokens and alternatives"}

CHAT_COMPLETION: Schema = {"type": "object", "properties": {
    "id": {"type": "string"}, "object": {"const": "chat.completion"}, "created": {"type": "integer"},
    "model": {"type": "string"},
    "choices": {"type": "array", "items": {"type": "object", "properties": {
        "index": {"type": "integer"},
        "message": {"type": "object", "properties": {
            "role": {"const": "assistant"}, "content": {"type": ["string", "null"]},
            "reasoning_content": {"type": ["string", "null"]}, "reasoning": {"type": ["string", "null"]},
            "tool_calls": {"type": ["array", "null"], "items": TOOL_CALL}}, "required": ["role", "content"]},
        "logprobs": _CHOICE_LOGPROBS,
        "finish_reason": {"type": ["string", "null"], "description": "stop, length, tool_calls"}},
        "required": ["index", "message", "finish_reason"]}},
    "usage": USAGE,
    "context_capped": {"type": "boolean", "description": "true when turns were dropped or max_tokens clamped"}},
    "required": ["id", "object", "created", "model", "choices", "usage"]}

COMPLETION: Schema = {"type": "object", "properties": {
    "id": {"type": "string"}, "object": {"const": "text_completion"}, "created": {"type": "integer"},
    "model": {"type": "string"},
    "choices": {"type": "array", "items": {"type": "object", "properties": {
        "index": {"type": "integer"}, "text": {"type": "string"}, "logprobs": _CHOICE_LOGPROBS,
        "finish_reason": {"type": ["string", "null"]}}, "required": ["index", "text", "finish_reason"]}},
    "usage": USAGE}, "required": ["id", "object", "created", "model", "choices"]}

EMBEDDING_LIST: Schema = {"type": "object", "properties": {
    "object": {"const": "list"}, "model": {"type": "string"},
    "data": {"type": "array", "items": {"type": "object", "properties": {
        "object": {"const": "embedding"}, "index": {"type": "integer"},
        "embedding": {"anyOf": [{"type": "array", "items": {"type": "number"}}, {"type": "string"}],
                      "description": "floats, or base64 of little-endian float32"}},
        "required": ["object", "index", "embedding"]}},
    "usage": USAGE}, "required": ["object", "data", "model"]}

_PIECE = {"type": "object", "properties": {"id": {"type": "integer"}, "piece": {"type": "string"}},
          "required": ["id", "piece"]}
TOKENIZE_RESPONSE: Schema = {"type": "object", "properties": {"tokens": {"anyOf": [
    {"type": "array", "items": {"type": "integer"}, "maxItems": TOKENS_MAX},
    {"type": "array", "items": _PIECE, "maxItems": TOKENS_MAX}]}}, "required": ["tokens"]}

DETOKENIZE_RESPONSE: Schema = {"type": "object", "properties": {"content": {"type": "string"}},
                               "required": ["content"]}

_RANK_LOAD = {"type": "object", "properties": {k: {"type": "integer"} for k in (
    "dp_rank", "num_running_reqs", "num_waiting_reqs", "num_total_reqs", "num_used_tokens", "max_total_num_tokens",
    "max_running_requests")} | {k: {"type": "number"} for k in (
        "token_usage", "gen_throughput", "cache_hit_rate", "utilization")}, "required": ["dp_rank", "num_running_reqs"]}

LOADS: Schema = {"type": "object", "description": "SMG's scheduler-load document", "properties": {
    "timestamp": {"type": "string"}, "version": {"type": "string"}, "dp_rank_count": {"type": "integer"},
    "loads": {"type": "array", "items": _RANK_LOAD}, "aggregate": {"type": "object"}},
    "required": ["timestamp", "dp_rank_count", "loads", "aggregate"]}

INSTANCE: Schema = {"type": "object", "properties": {
    "instance_id": {"type": "string"}, "name": {"type": "string"}, "source": {"type": "string"},
    "state": {"type": "string"}, "dies": {"type": "array", "items": {"type": "integer"}},
    "bytes": {"type": "integer"}, "weight_bytes": {"type": "integer"}, "in_flight": {"type": "integer"},
    "created": {"type": "integer"}}, "required": ["instance_id", "name", "state", "dies"]}

LOADED: Schema = {**INSTANCE, "properties": {**INSTANCE["properties"], "status": {"const": "loaded"}},
                  "required": ["status", *INSTANCE["required"]]}

UNLOADED: Schema = {"type": "object", "properties": {"status": {"const": "unloaded"},
                                                     "unloaded": {"type": "array", "items": INSTANCE}},
                    "required": ["status", "unloaded"]}

DIES: Schema = {"type": "object", "properties": {
    "object": {"const": "list"},
    "data": {"type": "array", "items": {"type": "object", "properties": {
        "id": {"type": "integer"}, "die": {"type": "integer"}, "budget_bytes": {"type": "integer"},
        "used_bytes": {"type": "integer"}, "free_bytes": {"type": "integer"}, "models": {"type": "array"}}}},
    "memory": {"type": ["object", "null"], "description": "the memory watch's latest reading"}},
    "required": ["object", "data"]}

_RESPONSE_USAGE: Schema = {"type": "object", "properties": {
    "input_tokens": {"type": "integer"}, "output_tokens": {"type": "integer"}, "total_tokens": {"type": "integer"},
    "input_tokens_details": {"type": "object", "properties": {"cached_tokens": {"type": "integer"}}}},
    "required": ["input_tokens", "output_tokens", "total_tokens"]}
RESPONSE: Schema = {"type": "object", "properties": {
    "id": {"type": "string"}, "object": {"const": "response"}, "created_at": {"type": "integer"},
    "status": {"enum": ["completed", "incomplete", "in_progress"]}, "model": {"type": "string"},
    "output": {"type": "array", "items": {"type": "object", "properties": {
        "type": {"enum": ["message", "reasoning", "function_call"]}}, "required": ["type"]}},
    "usage": {"anyOf": [_RESPONSE_USAGE, {"type": "null"}]},
    "incomplete_details": {"type": ["object", "null"]}},
    "required": ["id", "object", "created_at", "status", "model", "output"]}
RESPONSE_DELETED: Schema = {"type": "object", "properties": {
    "id": {"type": "string"}, "object": {"const": "response"}, "deleted": {"const": True}},
    "required": ["id", "deleted"]}
MESSAGE: Schema = {"type": "object", "properties": {
    "id": {"type": "string"}, "type": {"const": "message"}, "role": {"const": "assistant"},
    "model": {"type": "string"},
    "content": {"type": "array", "items": {"type": "object", "properties": {
        "type": {"enum": ["text", "tool_use", "thinking"]}}, "required": ["type"]}},
    "stop_reason": {"enum": ["end_turn", "max_tokens", "stop_sequence", "tool_use", None]},
    "stop_sequence": {"type": ["string", "null"]},
    "usage": {"type": "object", "properties": {
        "input_tokens": {"type": "integer"}, "output_tokens": {"type": "integer"},
        "cache_read_input_tokens": {"type": "integer"}, "cache_creation_input_tokens": {"type": "integer"}},
        "required": ["input_tokens", "output_tokens"]}},
    "required": ["id", "type", "role", "model", "content", "stop_reason", "usage"]}
TOKEN_COUNT: Schema = {"type": "object", "properties": {"input_tokens": {"type": "integer"}},
                       "required": ["input_tokens"]}
ANTHROPIC_ERROR: Schema = {
    "type": "object", "description": "An error on the Anthropic routes (/v1/messages...), in Anthropic's shape",
    "properties": {"type": {"const": "error"}, "error": {"type": "object", "properties": {
        "type": {"type": "string"}, "message": {"type": "string"}}, "required": ["type", "message"]}},
    "required": ["type", "error"]}

# Named schemas, as `components.schemas` of the OpenAPI document.
COMPONENTS: dict[str, Schema] = {
    "Error": ERROR,
    "ChatCompletionRequest": CHAT_REQUEST, "ChatMessage": CHAT_MESSAGE, "ChatCompletion": CHAT_COMPLETION,
    "CompletionRequest": COMPLETION_REQUEST, "Completion": COMPLETION,
    "EmbeddingRequest": EMBEDDING_REQUEST, "EmbeddingList": EMBEDDING_LIST,
    "TokenizeRequest": TOKENIZE_REQUEST, "TokenizeResponse": TOKENIZE_RESPONSE,
    "DetokenizeRequest": DETOKENIZE_REQUEST, "DetokenizeResponse": DETOKENIZE_RESPONSE,
    "Health": HEALTH, "Model": MODEL, "ModelList": MODEL_LIST, "Loads": LOADS,
    "LoadRequest": LOAD_REQUEST, "Loaded": LOADED, "UnloadRequest": UNLOAD_REQUEST, "Unloaded": UNLOADED,
    "Dies": DIES,
    "ResponseRequest": RESPONSES_REQUEST, "Response": RESPONSE, "ResponseDeleted": RESPONSE_DELETED,
    "MessagesRequest": MESSAGES_REQUEST, "Message": MESSAGE, "CountTokensRequest": COUNT_TOKENS_REQUEST,
    "TokenCount": TOKEN_COUNT, "AnthropicError": ANTHROPIC_ERROR,
}


def fields(schema: Schema) -> frozenset[str]:
    """The property names of an object schema (of all its `anyOf` variants): the fields a validator may
    accept, and no others."""
    names = set(schema.get("properties", ()))
    for variant in schema.get("anyOf", ()):
        names |= fields(variant)
    return frozenset(names)
