"""POST /v1/chat/completions: validate the body, run one generation, and shape the OpenAI response.

`parse_chat_request` turns the JSON body into a `ChatRequest` or raises a 400 naming the field; it never
ignores a field it does not honour. `Generation` is the chat side of a generation in flight
(pantheon.web.generation holds the life it shares with legacy completions: submit, per-choice events,
cancel, close): `start()` has the prompt rendered, tokenized and admitted once by the admission service
(pantheon.serving.admission: memory and context window; FIT, CAPPED with the oldest turns dropped, or
refused), builds the grammar a `response_format` or a
forced `tool_choice` asks for, and launches it; `complete()` and `frames()` shape the n choices as a
chat.completion object or as chat.completion.chunk events.

`SSEStream` is the streaming body: an iterable whose `close()` (called by the WSGI server, also on
disconnect) closes the generation even if the iteration never started.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pantheon.text.emitter import Delta, Emitter, merge_deltas
from pantheon.errors import BusyError, PantheonError
from pantheon.types import GenRequest, stop_ids
from pantheon.web import bridge
from pantheon.web import images as web_images
from pantheon.web.body import shown
from pantheon.contract import CHAT, ID_CHARS, PROMPT_CACHE_KEY_CHARS
from pantheon.web.fields import bad as _bad
from pantheon.web.fields import boolean as _boolean
from pantheon.web.fields import (
    body_object,
    bounded,
    choices_n,
    logit_bias,
    metadata,
    sampling_params,
    stream_flags,
    tool_name,
    top_logprobs,
)
from pantheon.web.fields import stop_strings as _stop
from pantheon.web.fields import string as _string
from pantheon.web.generation import ClientGone, GenerationCore, Piece, SSEStream, json_line, new_id
from pantheon.web.logprobs import chat_logprobs
from pantheon.web.schema import CHAT_MESSAGE, CHAT_REQUEST, fields

__all__ = ["ClientGone", "Generation", "SSEStream", "ChatRequest", "parse_chat_request", "cache_scope",
           "new_completion_id"]

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool", "function")  # "function": the deprecated tool result (-> "tool")
BIG_PROMPT_CHARS = 16384  # larger requests are rendered and tokenized off the hub, in an OS thread

# The fields a chat body may carry: pantheon.web.schema's, the one description of the request
# (GET /openapi.json publishes it; tests hold these validators to it).
TOP_FIELDS = fields(CHAT_REQUEST)
SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority")
VERBOSITY = ("low", "medium", "high")
REASONING_EFFORT = {"none": False, "minimal": False, "low": True, "medium": True, "high": True}
SESSION_HEADERS = ("X-Session-Id", "X-SMG-Routing-Key")  # after the body's session_id, in this order
MESSAGE_FIELDS = fields(CHAT_MESSAGE)


def new_completion_id() -> str:
    """Unpredictable and unique across restarts (the seed used an unseeded rand())."""
    return new_id("chatcmpl-")


@dataclass
class ChatRequest:
    model: str | None
    messages: list[dict]
    params: Any  # SamplingParams
    max_tokens: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    tools: list[dict] | None
    tool_choice: Any  # "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}
    session_id: str | None
    enable_thinking: bool | None
    ignore_eos: bool = False  # benchmark knob (vLLM / llama.cpp): generate the full budget past EOS
    speculative: bool | None = None  # False: no speculative decoding for this request (None: the server's default)
    truncate_oldest: bool = False  # "truncate": "oldest": drop the oldest turns to fit the window (else 400)
    user: str | None = None
    cache_salt: str | None = None
    cache_scope: str = ""  # prefix-reuse tenant (see cache_scope()); set by the route from the API key
    size: int = 0  # bytes of the request body: decides whether tokenizing is moved off the hub
    n: int = 1  # choices; at most the model's slots (checked at start)
    logprobs: int | None = None  # None: no logprobs; k: each token's logprob and the k most likely (top_logprobs)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias); ids checked against the vocabulary at start
    response_format: dict | None = None  # json_object / json_schema (None: text); its grammar is built at start
    parallel_tool_calls: bool = True  # a forced tool call may be several calls

    @property
    def tools_enabled(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forces_tool_call(self) -> bool:
        """tool_choice "required" or a named function: the output is constrained to a call."""
        return self.tools_enabled and (self.tool_choice == "required" or isinstance(self.tool_choice, dict))

    def template_tools(self) -> list[dict] | None:
        """Tools shown to the model: none for tool_choice "none", only the named one for a named choice."""
        if not self.tools_enabled:
            return None
        if isinstance(self.tool_choice, dict):
            want = self.tool_choice["function"]["name"]
            return [t for t in self.tools if t["function"]["name"] == want]
        return self.tools


# ---- validation (the generic field checks live in pantheon.web.fields) --------------------------------
def _content(msg: Mapping, where: str, required: bool) -> None:
    c = msg.get("content")
    if c is None:
        if required:
            raise _bad(f"{where}.content", "is required")
        return
    if isinstance(c, str):
        return
    if not isinstance(c, list):
        raise _bad(f"{where}.content", "must be a string or a list of text parts")
    for j, part in enumerate(c):
        p = f"{where}.content[{j}]"
        if not isinstance(part, dict):
            raise _bad(p, "must be an object like {\"type\": \"text\", \"text\": \"...\"}")
        if part.get("type") == "image_url" and msg.get("role") == "user":
            img = part.get("image_url")
            if isinstance(img, str):  # the short form some clients send
                img = part["image_url"] = {"url": img}
            if not isinstance(img, dict) or not isinstance(img.get("url"), str):
                raise _bad(f"{p}.image_url", "must be an object like {\"url\": \"data:image/png;base64,...\"}")
            extra = set(img) - {"url", "detail"}
            if extra:
                raise _bad(f"{p}.image_url.{sorted(extra)[0]}", "is not supported")
            if img.get("detail", "auto") not in ("auto", "low", "high"):
                raise _bad(f"{p}.image_url.detail", "must be \"auto\", \"low\" or \"high\"")
            if set(part) - {"type", "image_url"}:
                raise _bad(f"{p}.{sorted(set(part) - {'type', 'image_url'})[0]}", "is not supported")
            continue
        if part.get("type") != "text":
            allowed = "text and image_url parts (image_url in user messages)"
            raise _bad(f"{p}.type", f"only {allowed} are supported, got {json.dumps(part.get('type'))[:40]}")
        extra = set(part) - {"type", "text"}
        if extra:
            raise _bad(f"{p}.{sorted(extra)[0]}", "is not supported")
        if not isinstance(part.get("text"), str):
            raise _bad(f"{p}.text", "must be a string")


def _tool_calls(msg: Mapping, where: str) -> None:
    calls = msg.get("tool_calls")
    if calls is None:
        return
    if msg.get("role") != "assistant":
        raise _bad(f"{where}.tool_calls", "is only allowed on assistant messages")
    if not isinstance(calls, list):
        raise _bad(f"{where}.tool_calls", "must be a list")
    for j, call in enumerate(calls):
        p = f"{where}.tool_calls[{j}]"
        if not isinstance(call, dict):
            raise _bad(p, "must be an object")
        if call.get("type", "function") != "function":
            raise _bad(f"{p}.type", "must be \"function\"")
        if call.get("id") is not None and not isinstance(call.get("id"), str):
            raise _bad(f"{p}.id", "must be a string")
        fn = call.get("function")
        if not isinstance(fn, dict):
            raise _bad(f"{p}.function", "must be an object with name and arguments")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _bad(f"{p}.function.name", "must be a non-empty string")
        args = fn.get("arguments")
        if args is not None and not isinstance(args, (str, dict)):
            raise _bad(f"{p}.function.arguments", "must be a JSON string")
        if isinstance(args, str) and args.strip():
            check_arguments(args, f"{p}.function.arguments")


def check_arguments(args: str, where: str) -> None:
    """A tool call's `arguments` string in the history must be a JSON object: the template renders it
    as one, and a client that sends broken JSON back has a bug to hear about (peers answer 400 too)."""
    try:
        value = json.loads(args)
    except ValueError as exc:
        raise _bad(where, f"is not valid JSON ({exc.msg} at character {exc.pos})") from None
    if not isinstance(value, dict):
        raise _bad(where, "must be a JSON object")


def _messages(body: Mapping) -> list[dict]:
    msgs = body.get("messages")
    if msgs is None:
        raise _bad("messages", "is required")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages", "must be a non-empty list")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(where, "must be an object")
        # Clients echo back response messages with null fields (refusal, audio...): nulls are ignored.
        m = {k: v for k, v in m.items() if v is not None}
        unknown = sorted(set(m) - MESSAGE_FIELDS)
        if unknown:
            raise _bad(f"{where}.{unknown[0]}", "is not supported")
        role = m.get("role")
        if role not in ROLES:
            raise _bad(f"{where}.role", f"must be one of {', '.join(ROLES)}; got {json.dumps(role)[:40]}")
        m = _legacy_message(m, where)
        role = m["role"]
        _content(m, where, required=not (role == "assistant" and m.get("tool_calls")))
        _tool_calls(m, where)
        for key in ("name", "tool_call_id"):
            if key in m and not isinstance(m[key], str):
                raise _bad(f"{where}.{key}", "must be a string")
        if "tool_call_id" in m and role != "tool":
            raise _bad(f"{where}.tool_call_id", "is only allowed on tool messages")
        for key in ("reasoning_content", "reasoning"):
            if key in m and not isinstance(m[key], str):
                raise _bad(f"{where}.{key}", "must be a string")
        if "reasoning" in m and "reasoning_content" not in m:
            m["reasoning_content"] = m["reasoning"]
        m.pop("reasoning", None)
        out.append(m)
    return out


def _legacy_message(m: dict, where: str) -> dict:
    """The deprecated function-calling message forms as their tool forms: an assistant `function_call`
    becomes a one-call `tool_calls` (no id: none was ever given), a "function" message a tool result
    carrying the function's name."""
    fc = m.get("function_call")
    if fc is not None:
        if m.get("role") != "assistant":
            raise _bad(f"{where}.function_call", "is only allowed on assistant messages")
        if "tool_calls" in m:
            raise _bad(f"{where}.function_call", "cannot be given with tool_calls (it is their deprecated form)")
        if not isinstance(fc, dict) or set(fc) - {"name", "arguments"}:
            raise _bad(f"{where}.function_call", "must be an object with name and arguments")
        if not isinstance(fc.get("name"), str) or not fc["name"]:
            raise _bad(f"{where}.function_call.name", "must be a non-empty string")
        if fc.get("arguments") is not None and not isinstance(fc["arguments"], str):
            raise _bad(f"{where}.function_call.arguments", "must be a JSON string")
        m = {k: v for k, v in m.items() if k != "function_call"}
        m["tool_calls"] = [{"type": "function", "function": dict(fc)}]
    if m.get("role") == "function":
        if not isinstance(m.get("name"), str) or not m["name"]:
            raise _bad(f"{where}.name", "is required on a function message (the function's name)")
        m = {**m, "role": "tool"}
    return m


def _function_def(fn: Any, p: str, seen: set[str]) -> None:
    """Check one function definition (a tool's `function`, or an entry of the deprecated `functions`)."""
    if not isinstance(fn, dict):
        raise _bad(p, "must be an object")
    extra = set(fn) - {"name", "description", "parameters", "strict"}
    if extra:
        raise _bad(f"{p}.{sorted(extra)[0]}", "is not supported")
    tool_name(fn, p, seen)
    if "parameters" in fn and not isinstance(fn["parameters"], dict):
        raise _bad(f"{p}.parameters", "must be a JSON Schema object")
    if "strict" in fn and not isinstance(fn["strict"], bool):
        raise _bad(f"{p}.strict", "must be true or false")


def _tools(body: Mapping) -> list[dict] | None:
    """`tools`, or the deprecated `functions` (a list of function definitions) as tools; not both."""
    tools = body.get("tools")
    functions = body.get("functions")
    if functions is not None:
        if tools is not None:
            raise _bad("functions", "cannot be given with tools (it is their deprecated form)")
        if not isinstance(functions, list) or not functions:
            raise _bad("functions", "must be a non-empty list of function definitions")
        seen: set[str] = set()
        for i, fn in enumerate(functions):
            _function_def(fn, f"functions[{i}]", seen)
        return [{"type": "function", "function": fn} for fn in functions]
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad("tools", "must be a list")
    seen = set()
    for i, t in enumerate(tools):
        p = f"tools[{i}]"
        if not isinstance(t, dict):
            raise _bad(p, "must be an object")
        if t.get("type") != "function":
            raise _bad(f"{p}.type", "must be \"function\"")
        extra = set(t) - {"type", "function"}
        if extra:
            raise _bad(f"{p}.{sorted(extra)[0]}", "is not supported")
        _function_def(t.get("function"), f"{p}.function", seen)
    return tools or None


def _function_call(body: Mapping, tools: list[dict] | None) -> Any:
    """The deprecated `function_call` ("none", "auto" or {"name": ...}) as a tool_choice."""
    fc = body.get("function_call")
    if body.get("tool_choice") is not None:
        raise _bad("function_call", "cannot be given with tool_choice (it is its deprecated form)")
    if fc in ("none", "auto"):
        if fc == "auto" and not tools:
            raise _bad("function_call", "\"auto\" needs functions (only \"none\" is valid without them)")
        return fc
    if not isinstance(fc, dict) or set(fc) != {"name"} or not isinstance(fc["name"], str):
        raise _bad("function_call", "must be \"none\", \"auto\" or {\"name\": ...}")
    if fc["name"] not in {t["function"]["name"] for t in tools or []}:
        raise _bad("function_call.name", f"no function named {shown(fc['name'])!r} was declared")
    return {"type": "function", "function": {"name": fc["name"]}}


def _tool_choice(body: Mapping, tools: list[dict] | None) -> Any:
    if body.get("function_call") is not None:
        return _function_call(body, tools)
    tc = body.get("tool_choice")
    if tc is None:
        return "auto" if tools else "none"
    if isinstance(tc, str):
        if tc not in ("none", "auto", "required"):
            raise _bad("tool_choice", "must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", ...}")
        if tc != "none" and not tools:
            raise _bad("tool_choice", f"{tc!r} needs tools (only \"none\" is valid without them)")
        return tc
    if not isinstance(tc, dict) or tc.get("type") != "function" or not isinstance(tc.get("function"), dict) \
            or not isinstance(tc["function"].get("name"), str):
        raise _bad("tool_choice", "must be \"none\", \"auto\", \"required\" or "
                                  "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    names = {t["function"]["name"] for t in tools or []}
    if tc["function"]["name"] not in names:
        raise _bad("tool_choice.function.name", f"no tool named {shown(tc['function']['name'])!r} in tools")
    return {"type": "function", "function": {"name": tc["function"]["name"]}}


def _compat_fields(body: Mapping) -> bool | None:
    """Check the OpenAI fields accepted for compatibility (clients and agent frameworks send them) and
    return what `reasoning_effort` asks of the template's thinking switch (None: nothing).

    store, metadata, service_tier, prompt_cache_key, safety_identifier and verbosity change nothing
    here; modalities may only ask for text.
    """
    _boolean(body, "store")
    metadata(body)
    for key, allowed in (("service_tier", SERVICE_TIERS), ("verbosity", VERBOSITY)):
        v = _string(body, key)
        if v is not None and v not in allowed:
            raise _bad(key, f"must be one of {', '.join(allowed)}")
    _string(body, "prompt_cache_key", PROMPT_CACHE_KEY_CHARS)
    _string(body, "safety_identifier")
    mods = body.get("modalities")
    if mods is not None and (not isinstance(mods, list) or any(m != "text" for m in mods)):
        raise _bad("modalities", "only [\"text\"] is supported")
    effort = _string(body, "reasoning_effort")
    if effort is None:
        return None
    if effort not in REASONING_EFFORT:
        raise _bad("reasoning_effort", f"must be one of {', '.join(REASONING_EFFORT)}")
    return REASONING_EFFORT[effort]


def _response_format(body: Mapping) -> dict | None:
    """`response_format`: None for plain text; any other is returned for the grammar built at start
    (pantheon.text.structured owns its shape and answers a bad one with a 400 naming the field)."""
    rf = body.get("response_format")
    if rf is None or rf == {"type": "text"}:
        return None
    if not isinstance(rf, dict):
        raise _bad("response_format", "must be an object such as {\"type\": \"json_object\"}")
    return rf


def _logprobs(body: Mapping) -> int | None:
    """`logprobs` (bool) and `top_logprobs` (0..20, only with logprobs): None, or the alternatives per token."""
    want = _boolean(body, "logprobs")
    k = top_logprobs(body, CHAT)
    if body.get("top_logprobs") is not None and not want:
        raise _bad("top_logprobs", "needs \"logprobs\": true")
    return k if want else None


def parse_chat_request(body: Any, headers: Mapping[str, str]) -> ChatRequest:
    """Validate a chat-completions body; raises RequestError (400) naming the first bad field."""
    body = body_object(body, TOP_FIELDS)
    model = _string(body, "model")
    messages = _messages(body)
    max_tokens = bounded(body, "max_tokens", CHAT)
    mct = bounded(body, "max_completion_tokens", CHAT)
    if mct is not None:
        max_tokens = mct
    params = sampling_params(body, CHAT)
    stop = _stop(body)
    stream, include_usage = stream_flags(body)
    tools = _tools(body)
    tool_choice = _tool_choice(body, tools)
    parallel = _boolean(body, "parallel_tool_calls")
    session_id = _string(body, "session_id")
    # Then the headers: X-Session-Id, and X-SMG-Routing-Key (the router forwards that one and strips
    # X-Session-Id, so a session routed through SMG keeps its key all the way to the slot).
    for header in SESSION_HEADERS:
        if session_id is not None:
            break
        hdr = headers.get(header)
        if hdr:
            if len(hdr) > ID_CHARS:
                raise _bad(header, f"must be at most {ID_CHARS} characters")
            session_id = hdr
    n = choices_n(body, CHAT)
    user = _string(body, "user")
    cache_salt = _string(body, "cache_salt")
    logprobs = _logprobs(body)
    bias = logit_bias(body)
    rf = _response_format(body)
    enable_thinking = None
    ctk = body.get("chat_template_kwargs")
    if ctk is not None:
        if not isinstance(ctk, dict):
            raise _bad("chat_template_kwargs", "must be an object")
        extra = sorted(set(ctk) - {"enable_thinking"})
        if extra:
            raise _bad(f"chat_template_kwargs.{extra[0]}", "is not supported (only enable_thinking)")
        enable_thinking = _boolean(ctk, "enable_thinking")
    effort_thinking = _compat_fields(body)
    if enable_thinking is None:  # an explicit chat_template_kwargs.enable_thinking wins
        enable_thinking = effort_thinking
    ignore_eos = bool(_boolean(body, "ignore_eos"))
    speculative = _boolean(body, "speculative")
    truncate = _string(body, "truncate")
    if truncate not in (None, "none", "oldest"):
        raise _bad("truncate", "must be \"none\" or \"oldest\"")
    creq = ChatRequest(model=model, messages=messages, params=params, max_tokens=max_tokens, stop=stop,
                       stream=stream, include_usage=include_usage, tools=tools, tool_choice=tool_choice,
                       session_id=session_id, enable_thinking=enable_thinking, ignore_eos=ignore_eos,
                       speculative=speculative,
                       user=user, cache_salt=cache_salt, truncate_oldest=truncate == "oldest",
                       n=n, logprobs=logprobs, logit_bias=bias, response_format=rf,
                       parallel_tool_calls=parallel is not False)
    return creq


def cache_scope(api_key: str | None, creq: Any) -> str:
    """The tenant whose earlier prompts this request may reuse from the prefix cache.

    Automatic longest-prefix reuse is a side channel: `cached_tokens` (and the time to first token)
    tell a client how much of its prompt matches one another client just ran, enough to read a
    secret one guessed character at a time. So reuse happens only between requests that present the
    same API key, the same `user`, the same session (`session_id` / `X-Session-Id`) and the same
    `cache_salt`; with none of these given, requests on one key share one scope. The key is hashed,
    never kept.

    Each part goes into the hash length-prefixed, so no two different tuples of parts encode alike: with
    a separator byte instead, `user="x\\0\\1y"` and `user="x", session_id="y\\0"` hashed the same bytes
    (client-chosen strings may hold any character) and shared one scope.
    """
    h = hashlib.sha256()
    for part in (api_key, creq.user, creq.session_id, creq.cache_salt):
        if part is None:
            h.update(b"\x00")
            continue
        data = part.encode("utf-8", "surrogatepass")
        h.update(b"\x01" + len(data).to_bytes(8, "big") + data)
    return h.hexdigest()[:32]


# ---- the prompt ----------------------------------------------------------------------------------------
def render_prompt(card: Any, creq: ChatRequest, messages: list[dict] | None = None) -> str:
    """The chat template applied to `messages` (default: the request's) with the request's tools, tool
    choice and thinking switch: the one rendering every chat-shaped route (and count_tokens) uses."""
    kwargs: dict[str, Any] = {"tools": creq.template_tools(), "add_generation_prompt": True}
    if kwargs["tools"]:  # words the generic tool format's instruction (pantheon.text.tool_format)
        kwargs["tool_choice"] = creq.tool_choice
    if creq.enable_thinking is not None:
        kwargs["enable_thinking"] = creq.enable_thinking
    return card.template.render(creq.messages if messages is None else messages, **kwargs)


def prompt_ids(card: Any, rendered: str) -> list[int]:
    """The token ids of a rendered prompt, BOS added when the model wants one."""
    tok = card.tokenizer
    ids = tok.encode(rendered)
    if tok.add_bos and tok.bos_id is not None and (not ids or ids[0] != tok.bos_id):
        ids.insert(0, tok.bos_id)
    return ids


# ---- running one completion --------------------------------------------------------------------------
class Generation(GenerationCore):
    """One chat completion in flight (see pantheon.web.generation for its life). Greenlet only."""

    id_prefix = "chatcmpl-"

    def __init__(self, registry: Any, entry: Any, creq: ChatRequest, environ: dict, metrics: Any = None,
                 t0: float | None = None, watch: Any = None, settings: Any = None, *,
                 grammars: bridge.WorkPool, images: bridge.WorkPool | None = None):
        super().__init__(registry, entry, environ, metrics=metrics, t0=t0, watch=watch, settings=settings)
        self.creq = creq
        self.grammars = grammars  # the server's grammar-compile pool (ServerState.grammars)
        self.image_pool = images  # the server's image-decoding pool (ServerState.images); None: a thread each
        self.prompt_capped = False  # the oldest turns were dropped (prefix reuse is skipped for the turn)
        self.images: list[Any] = []  # the encoder's inputs, preprocessed (pantheon.formats.images.Preprocessed)
        self.image_texts: list[str] = []  # the text each image's marker becomes (web_images.expand)
        self.image_embd: Any = None  # their embeddings [N, tokens, H] when the backend encoded them here

    # -- setup --------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Render, tokenize, submit, and wait for the first event. Raises PantheonError for an HTTP error."""
        card = self.entry.card
        tok = card.tokenizer
        creq = self.creq
        self.check_generations(creq.n)
        self.admission.limits(card, creq.n, creq.logit_bias)
        parts: list[web_images.ImagePart] = []
        if web_images.image_parts(creq.messages):  # headers only (maybe a fetch), off the hub; 400 on a bad one
            msgs, parts, self.image_texts = bridge.call_in_thread(
                web_images.plan_images, creq.messages, card, self.registry.settings, name="pantheon-image")
            creq = self.creq = dataclasses.replace(creq, messages=msgs)
        admit = lambda: self.admission.chat(card, creq.messages, lambda m: self._render(card, m),  # noqa: E731
                                            self._prompt_ids_of(card), creq.max_tokens,
                                            creq.truncate_oldest)
        try:
            if creq.size > BIG_PROMPT_CHARS:  # rendering + tokenizing would hold the hub for a while
                admitted = bridge.call_in_thread(admit, name="pantheon-tokenize")
            else:
                admitted = admit()
        except PantheonError:
            self.observe_admission("denied")
            raise
        rendered, ids, self.prompt_capped = admitted.rendered, admitted.ids, admitted.capped
        self.capped = self.prompt_capped
        if parts:  # admitted: only now are the pixels decoded, of the images still in the prompt (capping
            # drops the oldest turns with their images: the markers left are the last images')
            kept = min(len(parts), rendered.count(card.vision.marker))
            self.images = self._decode_images(card, parts[len(parts) - kept:]) if kept else []
        encode = getattr(self.entry.backend, "encode_images", None)
        if self.images and encode is not None:  # after admission: a refused prompt costs no encode
            self.image_embd = bridge.call_in_thread(encode, [p.pixels for p in self.images], name="pantheon-image")
        max_tokens = self.budget(card, len(ids), creq.max_tokens)
        self.observe_admission("capped" if self.capped else "fit")
        constraint, reservation = None, None
        if creq.response_format is not None or creq.forces_tool_call:
            reservation, constraint = self._compile_constraint(tok)
        try:
            self._launch(card, rendered, ids, max_tokens, constraint, reservation)
        finally:
            if reservation is not None:
                reservation.release()  # (a no-op once submit took it over)

    def _decode_images(self, card: Any, parts: list[web_images.ImagePart]) -> list[Any]:
        """The admitted request's images decoded and tiled in the server's image pool (`image_pool`:
        PANTHEON_IMAGE_THREADS at once, PANTHEON_IMAGE_QUEUE waiting, past that 429 with Retry-After),
        waiting at most PANTHEON_QUEUE_WAIT_S for it (then 503); a client that leaves cancels it.
        Without a pool (a unit test's app) in an OS thread of its own."""
        st = self.registry.settings
        decode = lambda: web_images.decode_images(parts, card, st)  # noqa: E731
        if self.image_pool is None:
            return bridge.call_in_thread(decode, name="pantheon-image")
        try:
            return self.image_pool.call(decode, timeout=st.queue_wait_s, check=self.check_client)
        except bridge.Timeout:
            raise BusyError(f"the request's images were not decoded within {st.queue_wait_s:g} s "
                            "(PANTHEON_QUEUE_WAIT_S): the server is busy", status=503, retry_after=5) from None

    def _compile_constraint(self, tok: Any) -> tuple[Any, Any]:
        """(the model's queue reservation or None, the compiled grammar), for a request that needs one.

        After prompt admission, and only with a place in the model's queue (`reserve`, where the
        backend offers it): a request the model cannot take is refused (429/503) before any compile, and
        a compiling request counts in the queue's bound. The compile runs in the server's bounded pool
        (`ServerState.grammars`: PANTHEON_GRAMMAR_THREADS running, PANTHEON_GRAMMAR_QUEUE waiting, past
        that 429), off the hub; the request waits at most PANTHEON_GRAMMAR_TIMEOUT_S for it (then 503),
        and a client that leaves cancels it (a compile still waiting never runs; a running one's result
        is dropped). The first grammar of a tokenizer also builds llguidance's token table (0.15 s
        SmolLM2, 3 s Gemma 3).
        """
        wait_s = self.registry.settings.grammar_timeout_s
        reservation = self.admission.place(self.entry.backend)
        try:
            constraint = self.grammars.call(lambda: self._constraint(tok), timeout=wait_s, check=self.check_client)
        except BaseException as exc:  # refused, invalid, timed out, client gone: the place goes back
            if reservation is not None:
                reservation.release()
            if isinstance(exc, bridge.Timeout):
                raise BusyError(f"the structured-output grammar did not compile within {wait_s:g} s "
                                "(PANTHEON_GRAMMAR_TIMEOUT_S): the server is busy, or the schema is too complex",
                                status=503, retry_after=5) from None
            raise
        return reservation, constraint

    def _launch(self, card: Any, rendered: str, ids: list[int], max_tokens: int, constraint: Any,
                reservation: Any) -> None:
        """Build the GenRequest and submit it (into `reservation`'s place when there is one)."""
        creq = self.creq
        tok = card.tokenizer
        ends_in_think = getattr(card.template, "prompt_ends_in_think", None)
        in_think = bool(ends_in_think(rendered)) if ends_in_think else False
        tool_names = [t["function"]["name"] for t in creq.template_tools() or []]
        emitters = [Emitter(stop=creq.stop, in_think=in_think, tools_enabled=creq.tools_enabled, tool_names=tool_names,
                            calls_only=creq.forces_tool_call) for _ in range(creq.n)]
        session = None if self.prompt_capped else creq.session_id  # a capped turn starts over
        req = GenRequest(prompt_ids=ids, params=creq.params, max_tokens=max_tokens,  # resolves the seed, once
                         stop_ids=stop_ids(tok, creq.ignore_eos), session_id=session, cache_scope=creq.cache_scope,
                         request_id=self.id, n=creq.n, logprobs=creq.logprobs, logit_bias=creq.logit_bias,
                         constraint=constraint, speculative=creq.speculative,
                         images=web_images.prompt_images(ids, self.images, card, self.image_embd)
                         if self.image_texts else ())
        self.launch(req, emitters, reservation=reservation)

    def _constraint(self, tok: Any) -> Any:
        """The grammar the output must follow: a forced tool call, or a response_format's JSON; None.

        Both may be given (an agent with a typed final answer forces a tool on its first turn and keeps
        its output format on every turn: the OpenAI Agents SDK sends exactly that). A forced call's
        output is the call, so the call's grammar constrains this turn; the format, which shapes a text
        answer, is still compiled so a bad schema is refused now rather than on the turn that uses it.
        """
        creq = self.creq
        if creq.response_format is None and not creq.forces_tool_call:
            return None
        from pantheon.text import structured  # the grammar engine (llguidance) loads only when a request needs it

        st = self.registry.settings
        limits = structured.SchemaLimits(max_nodes=st.grammar_max_nodes, max_properties=st.grammar_max_properties)
        answer = None
        if creq.response_format is not None:
            answer = structured.Grammar.from_response_format(creq.response_format, tok, limits=limits)
        if not creq.forces_tool_call:
            return answer
        return structured.Grammar.for_tools(creq.tools, creq.tool_choice, tok, parallel=creq.parallel_tool_calls,
                                            limits=limits)

    def _render(self, card: Any, messages: list[dict] | None = None) -> str:
        """The chat template applied to `messages` (default: the request's) and the request's tools."""
        return render_prompt(card, self.creq, messages)

    def _prompt_ids_of(self, card: Any) -> Any:
        """Rendered text -> the prompt's token ids (BOS added when the model wants one), each image's
        placeholder expanded to its image tokens first, as the model's processor does."""
        return lambda text: prompt_ids(card, web_images.expand(text, card, self.image_texts) if self.image_texts
                                   else text)


    # -- response shapes ---------------------------------------------------------------------------------
    def _chunk_logprobs(self, piece_logprobs: Sequence[Any]) -> dict | None:
        """A piece's (or a whole choice's) `logprobs` object; None when not asked for or it carries none."""
        if not self.want_logprobs or not piece_logprobs:
            return None
        return chat_logprobs(self._tok, (p.logprob for p in piece_logprobs))

    def complete(self) -> dict:
        """Run to the end and return the non-streamed chat.completion object (n choices, index order)."""
        deltas: list[list[Delta]] = [[] for _ in self.choices]
        entries: list[list[Any]] = [[] for _ in self.choices]
        for piece in self.pump():
            if piece.delta is not None:
                deltas[piece.choice].append(piece.delta)
            entries[piece.choice] += piece.logprobs
        choices = []
        for c in self.choices:
            merged = merge_deltas(deltas[c.index])
            message = {"role": "assistant", "content": merged["content"],
                       "reasoning_content": merged["reasoning_content"], "reasoning": merged["reasoning_content"],
                       "tool_calls": merged["tool_calls"]}
            logprobs = chat_logprobs(self._tok, (e.logprob for e in entries[c.index])) if self.want_logprobs \
                else None
            choices.append({"index": c.index, "message": message, "logprobs": logprobs,
                            "finish_reason": c.finish_reason})
        out = {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model_name,
               "choices": choices, "usage": self.usage()}
        if self.capped:
            out["context_capped"] = True
        return out

    def _chunk(self, index: int, delta: dict, finish_reason: str | None = None, logprobs: dict | None = None,
               **extra: Any) -> bytes:
        return json_line({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                          "model": self.model_name,
                          "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                       "finish_reason": finish_reason}],
                          **extra})

    def _piece_chunk(self, piece: Piece) -> bytes:
        lp = self._chunk_logprobs(piece.logprobs)
        d = piece.delta
        if d is None:
            return self._chunk(piece.choice, {}, piece.finish_reason, lp,
                               **({"context_capped": True} if self.capped else {}))
        if d.kind == "content":
            delta: dict = {"content": d.text}
        elif d.kind == "reasoning":
            delta = {"reasoning_content": d.text, "reasoning": d.text}
        else:
            delta = {"tool_calls": [d.tool_call]}
        return self._chunk(piece.choice, delta, None, lp)

    def frames(self) -> Iterator[bytes]:
        """Each choice's role chunk, its deltas (with the logprob entries they carry), its finish chunk;
        then the optional usage chunk."""
        for c in self.choices:
            yield self._chunk(c.index, {"role": "assistant", "content": ""})
        for piece in self.pump():
            yield self._piece_chunk(piece)
        if self.creq.include_usage:
            yield json_line({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                             "model": self.model_name, "choices": [], "usage": self.usage()})
