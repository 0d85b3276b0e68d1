"""POST /v1/responses (OpenAI's Responses API), and GET / DELETE /v1/responses/{id}.

Why a translation and not a second engine: a Responses request is a chat completion in other clothes
(input items are turns, `instructions` the system prompt, `text.format` the response_format, function
tools the same tools), so `parse_responses_request` turns the body into a `ChatRequest` (with the few
Responses-only fields beside it) and `ResponsesGeneration` is the chat `Generation` with other answer
shapes: a `response` object, or the typed event stream the `openai` SDK parses (`response.created`,
`response.output_item.added`, `response.output_text.delta`, `response.function_call_arguments.delta`,
..., `response.completed`). Admission, the grammar path (forced tools, json_schema), cache scoping,
metrics and the model roots are the chat route's, unchanged.

Conversation state. With `store` (the default, as OpenAI's) a finished response is kept in a bounded
in-process store (`ResponseStore`: the oldest go first past PANTHEON_RESPONSES_STORE responses or
PANTHEON_RESPONSES_STORE_MB of the memory their objects hold) together with the conversation it ended,
each turn held once (a continued conversation points at the turns before it instead of copying them);
`previous_response_id` continues that conversation, so its
prompt starts with the same tokens and the prefix cache serves them (`cached_tokens`). A stored response
belongs to the API key that made it (its hash; the key is never kept) and to the request's cache scope
(pantheon.web.chat.cache_scope: key, user, session, cache_salt): `previous_response_id` needs the same
scope, `GET` / `DELETE` the same key; otherwise it is a 404, as if it did not exist. The store is per
server process and does not survive a restart.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import re
import sys
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from flask import Blueprint, Response, jsonify

from pantheon import osthread
from pantheon.errors import RequestError
from pantheon.text.emitter import Delta
from pantheon.web.chat import REASONING_EFFORT, ChatRequest, Generation, check_arguments
from pantheon.contract import ID_CHARS, PROMPT_CACHE_KEY_CHARS, RESPONSES
from pantheon.web.body import shown
from pantheon.web.fields import bad, body_object, boolean, bounded, metadata, sampling_params, string, tool_name
from pantheon.web.generation import new_id
from pantheon.web.schema import RESPONSES_REQUEST, fields

bp = Blueprint("responses", __name__)

TOP_FIELDS = fields(RESPONSES_REQUEST)
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text", "text")
STORE_MAX_ENTRIES = 1024  # stored responses kept per server process (PANTHEON_RESPONSES_STORE)
STORE_MAX_BYTES = 64 << 20  # and the bytes their objects hold (PANTHEON_RESPONSES_STORE_MB)


# ---- the store ----------------------------------------------------------------------------------------------
def retained_bytes(obj: Any) -> int:
    """The bytes the Python objects of `obj` hold: `sys.getsizeof` of every object reachable through
    dicts, lists, tuples and sets, each object once (a key string shared by many dicts counts once).

    Why not the JSON text's length: a conversation of 100,000 one-character messages is 3.4 M
    characters of JSON but 18 MB of dicts and strings (the objects' headers, hash tables and pointer
    arrays dwarf one character), so a bound in characters held several times what it said. This is
    deterministic for the same objects and agrees with tracemalloc's count of their allocations within
    a few percent (tests/test_agent_apis_shapes.py); objects shared with the rest of the process (the
    interned strings, None, small integers) are counted too, which errs on the side of the bound."""
    seen: set[int] = set()
    stack = [obj]
    total = 0
    while stack:
        o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        total += sys.getsizeof(o)
        if isinstance(o, dict):
            stack.extend(o.keys())
            stack.extend(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            stack.extend(o)
    return total


class Turns:
    """One stored turn's own messages (its input and the answer's message), and the turns before it.

    A conversation continued by `previous_response_id` is a chain: each turn holds only what it added
    and points at the turn it continued, so a store of N turns of one conversation holds each message
    once, not N growing copies. A turn lives while a stored response ends with it or a live turn
    continues it (`refs`, kept by the store under its lock); its bytes are counted exactly that long."""

    __slots__ = ("parent", "own", "nbytes", "refs")

    def __init__(self, parent: Turns | None, own: list[dict]):
        self.parent = parent
        self.own = own
        self.nbytes = 0  # set by the store when it first holds the turn
        self.refs = 0

    def conversation(self) -> list[dict]:
        """The whole conversation to this turn, oldest first (a new list; the messages are shared)."""
        chain = []
        node: Turns | None = self
        while node is not None:
            chain.append(node.own)
            node = node.parent
        return [m for own in reversed(chain) for m in own]


class Stored:
    """A stored response: the answer as returned, whom it belongs to, and the conversation it ended.
    `messages` is this turn's own (its input and its output message); `previous`, the stored response
    it continued, gives the rest, shared rather than copied."""

    __slots__ = ("key_hash", "scope", "response", "turns", "nbytes")

    def __init__(self, key_hash: str, scope: str, response: dict, messages: list[dict],
                 previous: Stored | None = None):
        self.key_hash = key_hash  # sha256 of the API key that created it ("" without one)
        self.scope = scope  # the cache scope of the request that created it
        self.response = response
        self.turns = Turns(previous.turns if previous is not None else None, messages)
        self.nbytes = 0  # the response's bytes and this object's, set by the store

    @property
    def messages(self) -> list[dict]:
        """The whole conversation in chat form, its output included."""
        return self.turns.conversation()


class ResponseStore:
    """Stored responses by id, bounded in count and in the bytes their objects hold (`retained_bytes`:
    each stored answer, and each conversation turn once while some stored response needs it); the
    oldest go first. Any thread: one lock, held briefly (sizing a new entry happens before it)."""

    def __init__(self, max_entries: int = STORE_MAX_ENTRIES, max_bytes: int = STORE_MAX_BYTES):
        self._lock = osthread.Lock()
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self._bytes = 0
        self.max_entries = max_entries
        self.max_bytes = max_bytes

    @property
    def nbytes(self) -> int:
        """The bytes the store holds now, as it counts them."""
        return self._bytes

    def put(self, rid: str, item: Stored) -> None:
        turns = item.turns
        item.nbytes = retained_bytes(item.response) + sys.getsizeof(item) + sys.getsizeof(rid)
        turns.nbytes = retained_bytes(turns.own) + sys.getsizeof(turns)
        with self._lock:
            old = self._items.pop(rid, None)
            if old is not None:
                self._drop(old)
            self._items[rid] = item
            self._bytes += item.nbytes
            self._hold(turns)
            while self._items and (len(self._items) > self.max_entries or self._bytes > self.max_bytes):
                _, old = self._items.popitem(last=False)
                self._drop(old)

    def _hold(self, turns: Turns | None) -> None:
        """One more holder of `turns`; a turn not held before (new, or one whose holders all went while
        a request was continuing it) counts its bytes and holds its parent in turn. Under the lock."""
        while turns is not None:
            turns.refs += 1
            if turns.refs > 1:
                return
            self._bytes += turns.nbytes
            turns = turns.parent

    def _drop(self, item: Stored) -> None:
        """Forget `item`: its bytes go, and each turn of its conversation no one else holds. Under the lock."""
        self._bytes -= item.nbytes
        turns: Turns | None = item.turns
        while turns is not None:
            turns.refs -= 1
            if turns.refs > 0:
                return
            self._bytes -= turns.nbytes
            turns = turns.parent

    def get(self, rid: str, key_hash: str, scope: str | None = None) -> Stored | None:
        """The stored response if `key_hash` (and `scope`, when given) own it; else None."""
        with self._lock:
            item = self._items.get(rid)
        if item is None or item.key_hash != key_hash or (scope is not None and item.scope != scope):
            return None
        return item

    def delete(self, rid: str, key_hash: str) -> bool:
        with self._lock:
            item = self._items.get(rid)
            if item is None or item.key_hash != key_hash:
                return False
            del self._items[rid]
            self._drop(item)
            return True

    def __len__(self) -> int:
        return len(self._items)


def key_hash(api_key: str | None) -> str:
    return "" if api_key is None else hashlib.sha256(api_key.encode("utf-8", "surrogatepass")).hexdigest()


# ---- the request ----------------------------------------------------------------------------------------------
@dataclass
class ResponsesRequest(ChatRequest):
    """A chat request, plus what a Responses answer echoes and what the store needs."""

    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    text_format: dict = field(default_factory=lambda: {"type": "text"})
    reasoning: dict | None = None
    metadata: dict = field(default_factory=dict)
    tools_echo: list = field(default_factory=list)  # the tools as the client sent them
    tool_choice_echo: Any = "auto"
    max_output_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    # (input index, call_id) of each function_call_output no function_call of the input made: the
    # previous_response_id conversation must have made it (checked once that is looked up)
    orphan_outputs: list = field(default_factory=list)


def _text_of(content: Any, where: str, allowed: tuple[str, ...] = TEXT_PARTS, images: bool = False) -> Any:
    """The text of an item's `content`: a string, or text parts (joined with newlines). With `images`
    (a user turn), `input_image` parts are taken too: then the content is chat parts, text and
    `image_url` in order (the chat path decodes and checks them)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(where, "must be a string or a list of content parts")
    out = []
    parts: list[dict] = []
    for j, part in enumerate(content):
        p = f"{where}[{j}]"
        if not isinstance(part, dict):
            raise bad(p, "must be an object like {\"type\": \"input_text\", \"text\": \"...\"}")
        kind = part.get("type")
        if kind == "input_image" and images:
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                raise bad(f"{p}.image_url", "must be a data: URL string (file_id is not supported)")
            extra = sorted(set(part) - {"type", "image_url", "detail"})
            if extra:
                raise bad(f"{p}.{extra[0]}", "is not supported")
            parts.append({"type": "image_url", "image_url": {"url": url}})
            continue
        if kind in ("input_image", "input_file", "input_audio"):
            raise bad(f"{p}.type", f"{kind} parts are not supported (text only)")
        if kind == "refusal":
            if not isinstance(part.get("refusal"), str):
                raise bad(f"{p}.refusal", "must be a string")
            out.append(part["refusal"])
            continue
        if kind not in allowed:
            raise bad(f"{p}.type", f"must be one of {', '.join(allowed)}; got {json.dumps(kind)[:40]}")
        if not isinstance(part.get("text"), str):
            raise bad(f"{p}.text", "must be a string")
        out.append(part["text"])
        parts.append({"type": "text", "text": part["text"]})
    if any(q["type"] == "image_url" for q in parts):
        return parts
    return "\n".join(out)


def _input_messages(value: Any, orphans: list[tuple[int, str]] | None = None) -> list[dict]:
    """`input` as chat messages: a string is one user turn; items map to turns, function calls join the
    assistant turn they belong to, reasoning items become the next assistant turn's reasoning.

    A `function_call_output` answers a call: one whose `call_id` no earlier `function_call` item of the
    input made is appended to `orphans` as (its index, the call_id), for the caller to look up in the
    `previous_response_id` conversation (`unanswerable`)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise bad("input", "must be a string or a list of input items")
    out: list[dict] = []
    reasoning: list[str] = []
    calls: set[str] = set()  # the call_ids of the function_call items so far

    def assistant() -> dict:
        """The assistant turn a function call joins: the last turn when it is one, else a new one."""
        if out and out[-1]["role"] == "assistant" and "tool_call_id" not in out[-1]:
            return out[-1]
        msg: dict = {"role": "assistant", "content": None}
        if reasoning:
            msg["reasoning_content"] = "\n".join(reasoning)
            reasoning.clear()
        out.append(msg)
        return msg

    for i, raw in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(raw, dict):
            raise bad(where, "must be an object")
        item = {k: v for k, v in raw.items() if v is not None}
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise bad(f"{where}.role", f"must be one of {', '.join(ROLES)}; got {json.dumps(role)[:40]}")
            extra = sorted(set(item) - {"type", "role", "content", "id", "status"})
            if extra:
                raise bad(f"{where}.{extra[0]}", "is not supported")
            if "content" not in item:
                raise bad(f"{where}.content", "is required")
            text = _text_of(item["content"], f"{where}.content", images=ROLES[role] == "user")
            msg = {"role": ROLES[role], "content": text}
            if ROLES[role] == "assistant" and reasoning:
                msg["reasoning_content"] = "\n".join(reasoning)
                reasoning.clear()
            out.append(msg)
        elif kind == "function_call":
            extra = sorted(set(item) - {"type", "call_id", "name", "arguments", "id", "status"})
            if extra:
                raise bad(f"{where}.{extra[0]}", "is not supported")
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str) or (key != "arguments" and not item[key]):
                    raise bad(f"{where}.{key}", "is required (a string)")
            if item["arguments"].strip():
                check_arguments(item["arguments"], f"{where}.arguments")
            calls.add(item["call_id"])
            msg = assistant()
            msg.setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function",
                 "function": {"name": item["name"], "arguments": item["arguments"] or "{}"}})
        elif kind == "function_call_output":
            extra = sorted(set(item) - {"type", "call_id", "output", "id", "status"})
            if extra:
                raise bad(f"{where}.{extra[0]}", "is not supported")
            if not isinstance(item.get("call_id"), str) or not item["call_id"]:
                raise bad(f"{where}.call_id", "is required (a string)")
            if "output" not in item:
                raise bad(f"{where}.output", "is required")
            if item["call_id"] not in calls and orphans is not None:
                orphans.append((i, item["call_id"]))
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": _text_of(item["output"], f"{where}.output")})
        elif kind == "reasoning":
            extra = sorted(set(item) - {"type", "id", "summary", "content", "encrypted_content", "status"})
            if extra:
                raise bad(f"{where}.{extra[0]}", "is not supported")
            if "encrypted_content" in item:
                raise bad(f"{where}.encrypted_content", "is not supported (this server never encrypts reasoning)")
            texts = []
            for key, part_kind in (("content", "reasoning_text"), ("summary", "summary_text")):
                parts = item.get(key, [])
                if not isinstance(parts, list):
                    raise bad(f"{where}.{key}", "must be a list")
                if key == "summary" and item.get("content"):
                    break  # the full text is there: the summary would repeat it
                texts.append(_text_of(parts, f"{where}.{key}", (part_kind,)))
            text = "\n".join(t for t in texts if t)
            if text:
                reasoning.append(text)
        else:
            raise bad(f"{where}.type", "must be message, function_call, function_call_output or reasoning "
                                       f"(item references and built-in tool items are not supported); "
                                       f"got {json.dumps(kind)[:40]}")
    if not out:
        raise bad("input", "holds no message")
    return out


def unanswerable(orphans: list[tuple[int, str]], earlier: list[dict]) -> RequestError | None:
    """The 400 for the first function_call_output whose call no function_call made, neither in the input
    nor in `earlier` (the previous_response_id conversation); None when every output answers a call.
    OpenAI refuses such an output too (`invalid_request_error`): the template would show the model a
    tool result for a call it never made."""
    if not orphans:
        return None
    made = {c.get("id") for m in earlier for c in m.get("tool_calls") or ()}
    for i, call_id in orphans:
        if call_id not in made:
            where = f"input[{i}].call_id"
            return bad(where, f"no function_call with call_id {shown(call_id)!r} precedes this "
                              "function_call_output (in the input, or in the previous_response_id conversation)")
    return None


def _tools(body: Mapping) -> tuple[list[dict] | None, list]:
    """(the function tools in chat form, as echoed); built-in tool types are refused."""
    tools = body.get("tools")
    if tools is None:
        return None, []
    if not isinstance(tools, list):
        raise bad("tools", "must be a list")
    out, seen = [], set()
    for i, t in enumerate(tools):
        p = f"tools[{i}]"
        if not isinstance(t, dict):
            raise bad(p, "must be an object")
        kind = t.get("type")
        if kind != "function":
            raise bad(f"{p}.type", f"only function tools are supported (built-in tools such as web_search, "
                                   f"file_search or code_interpreter are not); got {json.dumps(kind)[:40]}")
        t = {k: v for k, v in t.items() if v is not None}
        extra = sorted(set(t) - {"type", "name", "description", "parameters", "strict"})
        if extra:
            raise bad(f"{p}.{extra[0]}", "is not supported")
        tool_name(t, p, seen)
        if "parameters" in t and not isinstance(t["parameters"], dict):
            raise bad(f"{p}.parameters", "must be a JSON Schema object")
        if "strict" in t and not isinstance(t["strict"], bool):
            raise bad(f"{p}.strict", "must be true or false")
        out.append({"type": "function", "function": {k: v for k, v in t.items() if k != "type"}})
    return out or None, tools


def _tool_choice(body: Mapping, tools: list[dict] | None) -> tuple[Any, Any]:
    """(the chat tool_choice, as echoed)."""
    tc = body.get("tool_choice")
    if tc is None:
        return ("auto" if tools else "none"), "auto"
    if isinstance(tc, str):
        if tc not in ("none", "auto", "required"):
            raise bad("tool_choice", "must be \"none\", \"auto\", \"required\" or "
                                     "{\"type\": \"function\", \"name\": ...}")
        if tc != "none" and not tools:
            raise bad("tool_choice", f"{tc!r} needs function tools (only \"none\" is valid without them)")
        return tc, tc
    if not isinstance(tc, dict) or tc.get("type") != "function" or not isinstance(tc.get("name"), str):
        raise bad("tool_choice", "must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"name\": ...} "
                                 "(built-in tool choices are not supported)")
    if tc["name"] not in {t["function"]["name"] for t in tools or []}:
        raise bad("tool_choice.name", f"no function tool named {tc['name'][:64]!r} in tools")
    return {"type": "function", "function": {"name": tc["name"]}}, {"type": "function", "name": tc["name"]}


def _text_format(body: Mapping) -> tuple[dict | None, dict]:
    """(the chat response_format, the `text` object as echoed)."""
    text = body.get("text")
    if text is None:
        return None, {"format": {"type": "text"}}
    if not isinstance(text, dict):
        raise bad("text", "must be an object such as {\"format\": {\"type\": \"json_object\"}}")
    extra = sorted(set(text) - {"format", "verbosity"})
    if extra:
        raise bad(f"text.{extra[0]}", "is not supported")
    verbosity = text.get("verbosity")
    if verbosity is not None and verbosity not in ("low", "medium", "high"):
        raise bad("text.verbosity", "must be one of low, medium, high")
    fmt = text.get("format")
    if fmt is None or fmt == {"type": "text"}:
        return None, {"format": {"type": "text"}}
    if not isinstance(fmt, dict):
        raise bad("text.format", "must be an object such as {\"type\": \"json_object\"}")
    kind = fmt.get("type")
    if kind == "json_object":
        if set(fmt) - {"type"}:
            raise bad(f"text.format.{sorted(set(fmt) - {'type'})[0]}", "is not supported")
        return {"type": "json_object"}, {"format": fmt}
    if kind == "json_schema":
        extra = sorted(set(fmt) - {"type", "name", "schema", "strict", "description"})
        if extra:
            raise bad(f"text.format.{extra[0]}", "is not supported")
        name = fmt.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
            raise bad("text.format.name", "is required: 1 to 64 letters, digits, _ or -")
        if not isinstance(fmt.get("schema"), dict):
            raise bad("text.format.schema", "is required: a JSON Schema object")
        if fmt.get("strict") is not None and not isinstance(fmt["strict"], bool):
            raise bad("text.format.strict", "must be true or false")
        if fmt.get("description") is not None and not isinstance(fmt["description"], str):
            raise bad("text.format.description", "must be a string")
        inner = {k: fmt[k] for k in ("name", "schema", "strict", "description") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": inner}, {"format": fmt}
    if kind == "text":
        raise bad("text.format", "a text format takes no other field")
    raise bad("text.format.type", f"must be text, json_object or json_schema; got {json.dumps(kind)[:40]}")


def _reasoning(body: Mapping) -> tuple[bool | None, dict | None]:
    """(the template's thinking switch, or None; the `reasoning` object as echoed)."""
    r = body.get("reasoning")
    if r is None:
        return None, None
    if not isinstance(r, dict):
        raise bad("reasoning", "must be an object such as {\"effort\": \"low\"}")
    extra = sorted(set(r) - {"effort", "summary", "generate_summary"})
    if extra:
        raise bad(f"reasoning.{extra[0]}", "is not supported")
    r = {k: v for k, v in r.items() if v is not None}
    for key in ("summary", "generate_summary"):
        if key in r and r[key] not in ("auto", "concise", "detailed"):
            raise bad(f"reasoning.{key}", "must be auto, concise or detailed")
    effort = r.get("effort")
    if effort is None:
        return None, {"effort": None, "summary": r.get("summary")}
    if not isinstance(effort, str) or effort not in REASONING_EFFORT:
        raise bad("reasoning.effort", f"must be one of {', '.join(REASONING_EFFORT)}")
    return REASONING_EFFORT[effort], {"effort": effort, "summary": r.get("summary")}


def parse_responses_request(body: Any, headers: Mapping[str, str]) -> ResponsesRequest:
    """Validate a Responses body; raises RequestError (400) naming the first bad field."""
    body = body_object(body, TOP_FIELDS)
    model = string(body, "model")
    if "input" not in body or body["input"] is None:
        raise bad("input", "is required")
    orphans: list[tuple[int, str]] = []
    messages = _input_messages(body["input"], orphans)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad("instructions", "must be a string")
    max_output = bounded(body, "max_output_tokens", RESPONSES)
    # top_k, min_p and repetition_penalty: the sampling extensions chat takes too (the SMG router adds them,
    # at their neutral values, to every Responses request it forwards)
    params = sampling_params(body, RESPONSES)
    bounded(body, "priority", RESPONSES)  # SGLang's request priority (SMG sends 0): no priority scheduling here
    stream = bool(boolean(body, "stream"))
    so = body.get("stream_options")
    if so is not None:
        if not stream:
            raise bad("stream_options", "is only allowed when stream is true")
        if not isinstance(so, dict) or set(so) - {"include_obfuscation"}:
            raise bad("stream_options", "may only hold include_obfuscation")
        boolean(so, "include_obfuscation")
    tools, tools_echo = _tools(body)
    tool_choice, tc_echo = _tool_choice(body, tools)
    parallel = boolean(body, "parallel_tool_calls")
    rf, text_echo = _text_format(body)
    thinking, reasoning = _reasoning(body)
    store = boolean(body, "store")
    prev = string(body, "previous_response_id")
    if prev is None and (err := unanswerable(orphans, [])) is not None:
        raise err
    include = body.get("include")
    if include is not None:
        if not isinstance(include, list) or not all(isinstance(x, str) for x in include):
            raise bad("include", "must be a list of strings")
        unknown = [x for x in include if x not in ("reasoning.encrypted_content", "message.output_text.logprobs")]
        if unknown:
            raise bad("include", f"{unknown[0][:60]!r} is not supported")
        if "message.output_text.logprobs" in include:
            raise bad("include", "message.output_text.logprobs is not supported on this route (use chat completions)")
    truncation = body.get("truncation")
    if truncation is not None and truncation not in ("auto", "disabled"):
        raise bad("truncation", "must be \"auto\" or \"disabled\"")
    if boolean(body, "background"):
        raise bad("background", "background responses are not supported")
    for key, allowed in (("service_tier", ("auto", "default", "flex", "scale", "priority")),):
        v = string(body, key)
        if v is not None and v not in allowed:
            raise bad(key, f"must be one of {', '.join(allowed)}")
    string(body, "prompt_cache_key", PROMPT_CACHE_KEY_CHARS)
    string(body, "safety_identifier")
    user = string(body, "user")
    creq = ResponsesRequest(
        model=model, messages=messages, params=params, max_tokens=max_output, stop=(), stream=stream,
        include_usage=False, tools=tools, tool_choice=tool_choice, session_id=None, enable_thinking=thinking,
        user=user, truncate_oldest=truncation == "auto", response_format=rf, parallel_tool_calls=parallel is not False,
        instructions=instructions, previous_response_id=prev, store=store is not False, text_format=text_echo,
        reasoning=reasoning, metadata=metadata(body), tools_echo=tools_echo, tool_choice_echo=tc_echo,
        max_output_tokens=max_output, temperature=params.temperature, top_p=params.top_p, orphan_outputs=orphans)
    for header in ("X-Session-Id", "X-SMG-Routing-Key"):
        hdr = headers.get(header)
        if hdr:
            if len(hdr) > ID_CHARS:
                raise bad(header, f"must be at most {ID_CHARS} characters")
            creq.session_id = hdr
            break
    return creq


# ---- output items --------------------------------------------------------------------------------------------
class OutputItems:
    """Builds the response's `output` from the deltas in order, and the stream events that go with it.

    Consecutive text is one message item, consecutive reasoning one reasoning item, each tool call one
    function_call item; a change of kind closes the open item. `feed` and `close` return the events
    (without sequence numbers), which the non-streamed answer simply drops."""

    def __init__(self) -> None:
        self.items: list[dict] = []
        self._open: dict | None = None

    def _add(self, item: dict) -> list[dict]:
        self.items.append(item)
        index = len(self.items) - 1
        events = [{"type": "response.output_item.added", "output_index": index, "item": copy.deepcopy(item)}]
        if item["type"] == "message":
            events.append({"type": "response.content_part.added", "item_id": item["id"], "output_index": index,
                           "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": [],
                                                        "logprobs": []}})
            item["content"] = [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]
        elif item["type"] == "reasoning":
            item["content"] = [{"type": "reasoning_text", "text": ""}]
        self._open = item
        return events

    def feed(self, d: Delta) -> list[dict]:
        events: list[dict] = []
        kind = {"content": "message", "reasoning": "reasoning", "tool_call": "function_call"}[d.kind]
        if self._open is not None and (self._open["type"] != kind or kind == "function_call"):
            events += self.close_open()
        if d.kind == "tool_call":
            call = d.tool_call or {}
            fn = call.get("function") or {}
            args = fn.get("arguments") or ""
            item = {"type": "function_call", "id": new_id("fc_"), "call_id": call.get("id") or new_id("call_"),
                    "name": fn.get("name", ""), "arguments": "", "status": "in_progress"}
            events += self._add(item)
            index = len(self.items) - 1
            item["arguments"] = args
            events.append({"type": "response.function_call_arguments.delta", "item_id": item["id"],
                           "output_index": index, "delta": args})
            return events
        if self._open is None:
            if kind == "message":
                events += self._add({"type": "message", "id": new_id("msg_"), "status": "in_progress",
                                     "role": "assistant", "content": []})
            else:
                events += self._add({"type": "reasoning", "id": new_id("rs_"), "summary": [], "content": [],
                                     "status": "in_progress"})
        item = self._open
        assert item is not None
        index = len(self.items) - 1
        item["content"][0]["text"] += d.text
        if kind == "message":
            events.append({"type": "response.output_text.delta", "item_id": item["id"], "output_index": index,
                           "content_index": 0, "delta": d.text, "logprobs": []})
        else:
            events.append({"type": "response.reasoning_text.delta", "item_id": item["id"], "output_index": index,
                           "content_index": 0, "delta": d.text})
        return events

    def close_open(self) -> list[dict]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = len(self.items) - 1
        item["status"] = "completed"
        events: list[dict] = []
        if item["type"] == "message":
            part = item["content"][0]
            events += [{"type": "response.output_text.done", "item_id": item["id"], "output_index": index,
                        "content_index": 0, "text": part["text"], "logprobs": []},
                       {"type": "response.content_part.done", "item_id": item["id"], "output_index": index,
                        "content_index": 0, "part": copy.deepcopy(part)}]
        elif item["type"] == "reasoning":
            events.append({"type": "response.reasoning_text.done", "item_id": item["id"], "output_index": index,
                           "content_index": 0, "text": item["content"][0]["text"]})
        else:
            events.append({"type": "response.function_call_arguments.done", "item_id": item["id"],
                           "output_index": index, "name": item["name"], "arguments": item["arguments"]})
        events.append({"type": "response.output_item.done", "output_index": index, "item": copy.deepcopy(item)})
        return events

    def chat_message(self) -> dict:
        """The output as one assistant turn in chat form (what a later turn's history holds)."""
        text = "".join(i["content"][0]["text"] for i in self.items if i["type"] == "message")
        reasoning = "".join(i["content"][0]["text"] for i in self.items if i["type"] == "reasoning")
        calls = [{"id": i["call_id"], "type": "function",
                  "function": {"name": i["name"], "arguments": _object_text(i["arguments"])}}
                 for i in self.items if i["type"] == "function_call"]
        msg: dict = {"role": "assistant", "content": text if text or not calls else None}
        if calls:
            msg["tool_calls"] = calls
        if reasoning:
            msg["reasoning_content"] = reasoning
        return msg


def _object_text(args: str) -> str:
    """A call's arguments as history keeps them: a call cut short (max_output_tokens) has partial JSON,
    which a later turn's template could not read; it is kept as the empty object."""
    try:
        return args if isinstance(json.loads(args), dict) else "{}"
    except ValueError:
        return "{}"


# ---- the generation ------------------------------------------------------------------------------------------
class ResponsesGeneration(Generation):
    """One Responses request in flight: the chat generation with the Responses shapes. Greenlet only."""

    id_prefix = "resp_"

    def __init__(self, *args: Any, store: ResponseStore, key: str, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.store = store
        self.key_hash = key
        self.creq: ResponsesRequest
        self.previous: Stored | None = None  # the stored response this one continues
        self.history: list[dict] = []  # its conversation (shallow copies of the messages, for the prompt)
        self.turn: list[dict] = []  # this request's own input turns
        self.out = OutputItems()
        self.status = "in_progress"
        self._seq = 0

    def start(self) -> None:
        creq = self.creq
        turn = list(creq.messages)
        if creq.previous_response_id is not None:
            prev = self.store.get(creq.previous_response_id, self.key_hash, creq.cache_scope)
            if prev is None:
                raise RequestError(f"previous_response_id: no stored response {creq.previous_response_id[:64]!r} "
                                   "(it was never stored, was deleted or evicted, or belongs to another key or "
                                   "cache scope)", param="previous_response_id", status=404, code="not_found")
            self.previous = prev
            self.history = [dict(m) for m in prev.messages]
        if (err := unanswerable(creq.orphan_outputs, self.history)) is not None:
            raise err
        self.turn = turn
        system = [{"role": "system", "content": creq.instructions}] if creq.instructions is not None else []
        creq.messages = system + self.history + turn
        try:
            super().start()
        except RequestError as exc:  # name the Responses fields, not the chat ones they were mapped to
            param = getattr(exc, "param", None) or ""
            if param.startswith("response_format"):
                raise RequestError(str(exc).replace("response_format.json_schema", "text.format")
                                   .replace("response_format", "text.format"),
                                   param="text.format" + param[len("response_format"):].replace(".json_schema", ""),
                                   status=exc.status, code=exc.code) from None
            if param == "messages":
                text = str(exc).replace("messages:", "input:", 1).replace('"truncate": "oldest"', '"truncation": "auto"')
                raise RequestError(text, param="input", status=exc.status, code=exc.code) from None
            raise

    # -- shapes -------------------------------------------------------------------------------------------
    def usage(self) -> dict:
        return {"input_tokens": self.prompt_tokens, "input_tokens_details": {"cached_tokens": self.cached_tokens},
                "output_tokens": self.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    def response(self, final: bool) -> dict:
        creq = self.creq
        c = self.choices[0] if self.choices else None
        incomplete = final and c is not None and c.finish_reason == "length"
        status = ("incomplete" if incomplete else "completed") if final else "in_progress"
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "background": False, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": creq.instructions, "max_output_tokens": creq.max_output_tokens,
            "model": self.model_name, "output": copy.deepcopy(self.out.items) if final else [],
            "parallel_tool_calls": creq.parallel_tool_calls, "previous_response_id": creq.previous_response_id,
            "reasoning": creq.reasoning or {"effort": None, "summary": None}, "store": creq.store,
            "temperature": creq.temperature, "text": creq.text_format, "tool_choice": creq.tool_choice_echo,
            "tools": creq.tools_echo, "top_p": creq.top_p, "truncation": "auto" if creq.truncate_oldest else "disabled",
            "usage": self.usage() if final else None, "user": creq.user, "metadata": creq.metadata,
        }

    def _run(self) -> Iterator[dict]:
        """Every output event, in order, ending with the open item closed."""
        for piece in self.pump():
            if piece.delta is not None:
                yield from self.out.feed(piece.delta)
        yield from self.out.close_open()

    def _final(self) -> dict:
        out = self.response(final=True)
        if self.creq.store:
            self.store.put(self.id, Stored(self.key_hash, self.creq.cache_scope, out,
                                           self.turn + [self.out.chat_message()], previous=self.previous))
        return out

    def complete(self) -> dict:
        for _ in self._run():
            pass
        return self._final()

    def _event(self, ev: dict) -> bytes:
        ev["sequence_number"] = self._seq
        self._seq += 1
        data = json.dumps(ev, ensure_ascii=False, separators=(",", ":"))
        return f"event: {ev['type']}\ndata: {data}\n\n".encode("utf-8")

    def frames(self) -> Iterator[bytes]:
        start = self.response(final=False)
        yield self._event({"type": "response.created", "response": start})
        yield self._event({"type": "response.in_progress", "response": start})
        for ev in self._run():
            yield self._event(ev)
        # `response.completed` also when the status is "incomplete" (max_output_tokens hit): the openai SDK's
        # stream helpers finish only on that event (a `response.incomplete` left get_final_response failing).
        yield self._event({"type": "response.completed", "response": self._final()})


# ---- routes ------------------------------------------------------------------------------------------------------
def store() -> ResponseStore:
    from pantheon.web.routes import server
    st = server()
    if st.responses is None:
        st.responses = ResponseStore(st.settings.responses_store, int(st.settings.responses_store_mb * (1 << 20)))
    return st.responses


def handle_responses(root_model: str | None = None) -> Response:
    from pantheon.web.routes import serve_generation, server
    from pantheon.web.security import presented_key
    make = functools.partial(ResponsesGeneration, grammars=server().grammars, images=server().images, store=store(),
                             key=key_hash(presented_key()))
    return serve_generation(parse_responses_request, make, root_model)


def _not_found(rid: str) -> RequestError:
    return RequestError(f"no stored response {rid[:64]!r} (it was never stored, was deleted or evicted, or belongs "
                        "to another API key)", param="response_id", status=404, code="not_found")


@bp.post("/v1/responses")
def create_response() -> Response:
    return handle_responses()


@bp.get("/v1/responses/<response_id>")
def get_response(response_id: str) -> Response:
    from pantheon.web.security import presented_key
    item = store().get(response_id, key_hash(presented_key()))
    if item is None:
        raise _not_found(response_id)
    return jsonify(item.response)


@bp.delete("/v1/responses/<response_id>")
def delete_response(response_id: str) -> Response:
    from pantheon.web.security import presented_key
    if not store().delete(response_id, key_hash(presented_key())):
        raise _not_found(response_id)
    return jsonify(id=response_id, object="response", deleted=True)


@bp.post("/m/<path:model>/v1/responses")
def model_responses(model: str) -> Response:
    return handle_responses(root_model=model)


__all__ = ["ResponseStore", "ResponsesGeneration", "ResponsesRequest", "parse_responses_request", "bp"]
