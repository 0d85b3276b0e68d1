"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the chat core.

Why a translation: a Messages request is a chat completion with other field names (`system` is the
system turn, `tool_use` blocks are tool calls, `tool_result` blocks tool turns, `input_schema` a
function's parameters, `tool_choice` any/tool the forced choices, `thinking` the template's thinking
switch), so `parse_messages_request` builds a `ChatRequest` and `MessagesGeneration` is the chat
`Generation` with Anthropic's answer shapes: a `message` with text / tool_use / thinking blocks and a
`stop_reason` (end_turn, max_tokens, stop_sequence, tool_use), or Anthropic's event stream
(message_start, content_block_start / _delta / _stop, message_delta, message_stop). Admission, the
grammar path (tool_choice any/tool forces a call through it), cache scoping, metrics and the model roots
are the chat route's.

`usage.input_tokens` counts the prompt tokens that were not read from the prefix cache, and
`cache_read_input_tokens` those that were (Anthropic's split: the three input counts add up to the
prompt); nothing is ever written to a cache on request, so `cache_creation_input_tokens` is 0.
Errors on these routes are in Anthropic's shape (`{"type": "error", "error": {"type", "message"}}`,
pantheon.web.errors), streamed ones as an `error` event; the key may come as `x-api-key` (what the
`anthropic` SDK sends) or `Authorization: Bearer`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

from flask import Blueprint, Response, jsonify

from pantheon.errors import RequestError
from pantheon.serving.admission import AdmissionService
from pantheon.text.emitter import Delta
from pantheon.web import bridge
from pantheon.web import images as web_images
from pantheon.web.body import shown
from pantheon.web.chat import BIG_PROMPT_CHARS, ChatRequest, Generation, check_arguments, prompt_ids, render_prompt
from pantheon.web.errors import anthropic_body, from_exception
from pantheon.contract import ID_CHARS, MESSAGES, THINKING
from pantheon.web.fields import bad, body_object, boolean, bounded, sampling_params, stop_list, string, tool_name
from pantheon.web.generation import ClientGone, new_id
from pantheon.web.schema import COUNT_TOKENS_REQUEST, MESSAGES_REQUEST, fields

bp = Blueprint("messages", __name__)

TOP_FIELDS = fields(MESSAGES_REQUEST)
COUNT_FIELDS = fields(COUNT_TOKENS_REQUEST)
BLOCK_FIELDS = {
    "text": {"type", "text", "cache_control", "citations"},
    "tool_use": {"type", "id", "name", "input", "cache_control"},
    "tool_result": {"type", "tool_use_id", "content", "is_error", "cache_control"},
    "thinking": {"type", "thinking", "signature"},
    "redacted_thinking": {"type", "data"},
    "image": {"type", "source", "cache_control"},
}


# ---- validation ----------------------------------------------------------------------------------------------
def _block(b: Any, where: str, allowed: tuple[str, ...]) -> dict:
    if not isinstance(b, dict):
        raise bad(where, "must be an object such as {\"type\": \"text\", \"text\": \"...\"}")
    kind = b.get("type")
    if kind in ("image", "document", "search_result", "container_upload") and kind not in allowed:
        raise bad(f"{where}.type", f"{kind} blocks are not supported here" if kind == "image" else
                  f"{kind} blocks are not supported (text only)")
    if kind not in allowed:
        raise bad(f"{where}.type", f"must be one of {', '.join(allowed)}; got {json.dumps(kind)[:40]}")
    extra = sorted(set(b) - BLOCK_FIELDS[kind])
    if extra:
        raise bad(f"{where}.{extra[0]}", "is not supported")
    if kind == "text" and not isinstance(b.get("text"), str):
        raise bad(f"{where}.text", "must be a string")
    if kind == "thinking" and not isinstance(b.get("thinking"), str):
        raise bad(f"{where}.thinking", "must be a string")
    return b


def _image_url(b: dict, where: str) -> str:
    """An image block's source as the URL a chat image part carries: base64 data becomes a data: URL;
    a `url` source stays a URL (fetched only under PANTHEON_IMAGE_URL_ALLOWLIST)."""
    src = b.get("source")
    if not isinstance(src, dict):
        raise bad(f"{where}.source", "must be an object such as {\"type\": \"base64\", \"media_type\": "
                                     "\"image/png\", \"data\": \"...\"}")
    if src.get("type") == "base64":
        mt, data = src.get("media_type"), src.get("data")
        if not isinstance(mt, str) or not mt.startswith("image/"):
            raise bad(f"{where}.source.media_type", "must be an image type such as image/png")
        if not isinstance(data, str) or not data:
            raise bad(f"{where}.source.data", "must be base64 image data")
        return f"data:{mt};base64,{data}"
    if src.get("type") == "url" and isinstance(src.get("url"), str) and src["url"]:
        return src["url"]
    raise bad(f"{where}.source.type", "must be base64 (or url)")


def _texts(content: Any, where: str) -> str:
    """A string, or text blocks joined with newlines (a system prompt, a tool result's content)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(where, "must be a string or a list of text blocks")
    return "\n".join(_block(b, f"{where}[{j}]", ("text",))["text"] for j, b in enumerate(content))


def _turns(msgs: Any) -> list[dict]:
    """Anthropic's messages as chat turns: a user message's tool_result blocks become tool turns (before
    its text), an assistant message's tool_use blocks its tool calls and thinking blocks its reasoning.

    A tool_result answers a tool_use of the assistant message just before it (Anthropic's rule, and a
    400 there too; user messages in a row count as one turn, as Anthropic joins them): one with no such
    tool_use would show the model a result of a call it never made."""
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "must be a non-empty list")
    out: list[dict] = []
    asked: set[str] = set()  # the tool_use ids of the last assistant message
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(where, "must be an object")
        extra = sorted(set(m) - {"role", "content"})
        if extra:
            raise bad(f"{where}.{extra[0]}", "is not supported")
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise bad(f"{where}.role", f"must be user or assistant; got {json.dumps(role)[:40]}")
        content = m.get("content")
        if role == "assistant":
            asked = set()
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise bad(f"{where}.content", "must be a string or a list of content blocks")
        texts: list[str] = []
        if role == "user":
            parts: list[dict] = []  # text and image parts in order, when the turn has an image
            for j, b in enumerate(content):
                b = _block(b, f"{where}.content[{j}]", ("text", "tool_result", "image"))
                if b["type"] == "text":
                    texts.append(b["text"])
                    parts.append({"type": "text", "text": b["text"]})
                    continue
                if b["type"] == "image":
                    parts.append({"type": "image_url", "image_url": {"url": _image_url(b, f"{where}.content[{j}]")}})
                    continue
                p = f"{where}.content[{j}]"
                if not isinstance(b.get("tool_use_id"), str) or not b["tool_use_id"]:
                    raise bad(f"{p}.tool_use_id", "is required (a string)")
                if b["tool_use_id"] not in asked:
                    raise bad(f"{p}.tool_use_id", f"{shown(b['tool_use_id'])!r} answers no tool_use block of the "
                                                  "assistant message before it: each tool_result must answer a "
                                                  "tool_use of the assistant message just before it")
                if b.get("is_error") is not None and not isinstance(b["is_error"], bool):
                    raise bad(f"{p}.is_error", "must be true or false")
                result = _texts(b.get("content", ""), f"{p}.content")
                out.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                            "content": ("Error: " + result) if b.get("is_error") else result})
            if any(q["type"] == "image_url" for q in parts):
                out.append({"role": "user", "content": parts})
            elif texts or not content:
                out.append({"role": "user", "content": "\n".join(texts)})
            continue
        msg: dict = {"role": "assistant"}
        calls, thoughts = [], []
        for j, b in enumerate(content):
            p = f"{where}.content[{j}]"
            b = _block(b, p, ("text", "tool_use", "thinking", "redacted_thinking"))
            if b["type"] == "text":
                texts.append(b["text"])
            elif b["type"] == "thinking":
                thoughts.append(b["thinking"])
            elif b["type"] == "tool_use":
                for key in ("id", "name"):
                    if not isinstance(b.get(key), str) or not b[key]:
                        raise bad(f"{p}.{key}", "is required (a string)")
                if not isinstance(b.get("input"), dict):
                    raise bad(f"{p}.input", "must be an object (the tool's arguments)")
                args = json.dumps(b["input"], ensure_ascii=False)
                check_arguments(args, f"{p}.input")
                calls.append({"id": b["id"], "type": "function", "function": {"name": b["name"], "arguments": args}})
                asked.add(b["id"])
        msg["content"] = "".join(texts) if texts or not calls else None
        if calls:
            msg["tool_calls"] = calls
        if thoughts:
            msg["reasoning_content"] = "\n".join(thoughts)
        out.append(msg)
    return out


def _tools(body: Mapping) -> list[dict] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad("tools", "must be a list")
    out, seen = [], set()
    for i, t in enumerate(tools):
        p = f"tools[{i}]"
        if not isinstance(t, dict):
            raise bad(p, "must be an object")
        if t.get("type") not in (None, "custom"):
            raise bad(f"{p}.type", f"only custom tools are supported (server tools such as web_search or bash are "
                                   f"not); got {json.dumps(t.get('type'))[:40]}")
        extra = sorted(set(t) - {"type", "name", "description", "input_schema", "cache_control"})
        if extra:
            raise bad(f"{p}.{extra[0]}", "is not supported")
        name = tool_name(t, p, seen)
        if not isinstance(t.get("input_schema"), dict):
            raise bad(f"{p}.input_schema", "is required (a JSON Schema object)")
        fn = {"name": name, "parameters": t["input_schema"]}
        if "description" in t:
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out or None


def _tool_choice(body: Mapping, tools: list[dict] | None) -> tuple[Any, bool]:
    """(the chat tool_choice, parallel calls allowed)."""
    tc = body.get("tool_choice")
    if tc is None:
        return ("auto" if tools else "none"), True
    if not isinstance(tc, dict):
        raise bad("tool_choice", "must be an object such as {\"type\": \"auto\"}")
    extra = sorted(set(tc) - {"type", "name", "disable_parallel_tool_use"})
    if extra:
        raise bad(f"tool_choice.{extra[0]}", "is not supported")
    dp = tc.get("disable_parallel_tool_use")
    if dp is not None and not isinstance(dp, bool):
        raise bad("tool_choice.disable_parallel_tool_use", "must be true or false")
    kind = tc.get("type")
    if kind not in ("auto", "any", "tool", "none"):
        raise bad("tool_choice.type", "must be auto, any, tool or none")
    if kind == "none" or (kind == "auto" and not tools):
        return "none", True
    if not tools:
        raise bad("tool_choice", f"{kind!r} needs tools")
    if kind == "tool":
        name = tc.get("name")
        if not isinstance(name, str) or name not in {t["function"]["name"] for t in tools}:
            raise bad("tool_choice.name", "must name one of the tools")
        return {"type": "function", "function": {"name": name}}, not dp
    if "name" in tc:
        raise bad("tool_choice.name", "is only allowed with type \"tool\"")
    return ("required" if kind == "any" else "auto"), not dp


def _thinking(body: Mapping) -> bool | None:
    th = body.get("thinking")
    if th is None:
        return None
    if not isinstance(th, dict):
        raise bad("thinking", "must be an object such as {\"type\": \"enabled\", \"budget_tokens\": 1024}")
    extra = sorted(set(th) - {"type", "budget_tokens", "display"})
    if extra:
        raise bad(f"thinking.{extra[0]}", "is not supported")
    kind = th.get("type")
    if kind not in ("enabled", "disabled", "adaptive"):
        raise bad("thinking.type", "must be enabled, disabled or adaptive")
    if th.get("display") is not None and th["display"] not in ("summarized", "omitted"):
        raise bad("thinking.display", "must be summarized or omitted")
    bounded(th, "budget_tokens", THINKING, at="thinking.")
    return {"enabled": True, "disabled": False}.get(kind)


def _output_format(body: Mapping) -> dict | None:
    """`output_config.format` ({"type": "json_schema", "schema": ...}) as the chat response_format, which the
    grammar path enforces; `effort` is refused (there is no effort knob here)."""
    oc = body.get("output_config")
    if oc is None:
        return None
    if not isinstance(oc, dict):
        raise bad("output_config", "must be an object such as {\"format\": {\"type\": \"json_schema\", ...}}")
    extra = sorted(set(oc) - {"format", "effort"})
    if extra:
        raise bad(f"output_config.{extra[0]}", "is not supported")
    if oc.get("effort") is not None:
        raise bad("output_config.effort", "is not supported (use thinking to switch reasoning on or off)")
    fmt = oc.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or set(fmt) - {"type", "schema"}:
        raise bad("output_config.format", "must be {\"type\": \"json_schema\", \"schema\": {...}}")
    if not isinstance(fmt.get("schema"), dict):
        raise bad("output_config.format.schema", "is required (a JSON Schema object)")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def _request(body: dict, max_tokens: int | None, stream: bool) -> ChatRequest:
    """The chat request the fields that count_tokens also reads make (the rest are the caller's)."""
    model = string(body, "model")
    turns = _turns(body.get("messages"))
    system = body.get("system")
    if system is not None:
        turns = [{"role": "system", "content": _texts(system, "system")}] + turns
    tools = _tools(body)
    tool_choice, parallel = _tool_choice(body, tools)
    return ChatRequest(model=model, messages=turns, params=None, max_tokens=max_tokens, stop=(), stream=stream,
                       include_usage=False, tools=tools, tool_choice=tool_choice, session_id=None,
                       enable_thinking=_thinking(body), parallel_tool_calls=parallel)


def parse_messages_request(body: Any, headers: Mapping[str, str]) -> ChatRequest:
    """Validate a Messages body; raises RequestError (400) naming the first bad field."""
    body = body_object(body, TOP_FIELDS)
    if body.get("messages") is None:
        raise bad("messages", "is required")
    if body.get("max_tokens") is None:
        raise bad("max_tokens", "is required")
    max_tokens = bounded(body, "max_tokens", MESSAGES)
    stream = bool(boolean(body, "stream"))
    creq = _request(body, max_tokens, stream)
    creq.params = sampling_params(body, MESSAGES)
    creq.stop = stop_list(body, "stop_sequences")
    creq.response_format = _output_format(body)
    cc = body.get("cache_control")
    if cc is not None and (not isinstance(cc, dict) or cc.get("type") != "ephemeral" or set(cc) - {"type", "ttl"}
                           or cc.get("ttl") not in (None, "5m", "1h")):
        raise bad("cache_control", "must be {\"type\": \"ephemeral\"} (with an optional ttl of 5m or 1h)")
    md = body.get("metadata")
    if md is not None:
        if not isinstance(md, dict) or set(md) - {"user_id"}:
            raise bad("metadata", "may only hold user_id")
        creq.user = string(md, "user_id")
    tier = string(body, "service_tier")
    if tier is not None and tier not in ("auto", "standard_only"):
        raise bad("service_tier", "must be auto or standard_only")
    for header in ("X-Session-Id", "X-SMG-Routing-Key"):
        hdr = headers.get(header)
        if hdr:
            if len(hdr) > ID_CHARS:
                raise bad(header, f"must be at most {ID_CHARS} characters")
            creq.session_id = hdr
            break
    return creq


def without_truncate_hint(exc: RequestError) -> RequestError:
    """`exc` without chat's advice to send "truncate": "oldest", a field this route does not have."""
    hint = '; shorten them, or send "truncate": "oldest" to have the oldest turns dropped'
    if hint not in str(exc):
        return exc
    return RequestError(str(exc).replace(hint, "; shorten them"), param=exc.param, status=exc.status, code=exc.code)


# ---- the generation ---------------------------------------------------------------------------------------------
class MessagesGeneration(Generation):
    """One Messages request in flight: the chat generation with Anthropic's shapes. Greenlet only."""

    id_prefix = "msg_"

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.blocks: list[dict] = []
        self._open: dict | None = None

    def start(self) -> None:
        # max_tokens is required here and past the model's reach a 400, as Anthropic answers it (chat
        # completions, where max_tokens is optional, caps it to the context instead)
        most = self.entry.card.context_length
        if self.creq.max_tokens is not None and self.creq.max_tokens > most:
            raise RequestError(f"max_tokens: {self.creq.max_tokens} is more than model {self.model_name!r} "
                               f"can generate (its context is {most} tokens)", param="max_tokens")
        try:
            super().start()
        except RequestError as exc:
            raise without_truncate_hint(exc) from None

    def usage(self) -> dict:
        return {"input_tokens": self.prompt_tokens - self.cached_tokens, "output_tokens": self.completion_tokens,
                "cache_read_input_tokens": self.cached_tokens, "cache_creation_input_tokens": 0}

    def stop_reason(self) -> tuple[str, str | None]:
        c = self.choices[0]
        if any(b["type"] == "tool_use" for b in self.blocks):
            return "tool_use", None
        if c.emitter.stop_hit is not None:
            return "stop_sequence", c.emitter.stop_hit
        if c.finish_reason == "length":
            return "max_tokens", None
        return "end_turn", None

    # -- blocks, in the order the deltas come ----------------------------------------------------------
    def _feed(self, d: Delta) -> list[tuple[str, dict]]:
        """The events for one delta (the non-streamed answer drops them and keeps `blocks`)."""
        kind = {"content": "text", "reasoning": "thinking", "tool_call": "tool_use"}[d.kind]
        events = []
        if self._open is not None and (self._open["type"] != kind or kind == "tool_use"):
            events += self._close()
        index = len(self.blocks)
        if kind == "tool_use":
            call = d.tool_call or {}
            fn = call.get("function") or {}
            args = fn.get("arguments") or "{}"
            try:
                value = json.loads(args)
            except ValueError:
                value = {}
            block = {"type": "tool_use", "id": call.get("id") or new_id("toolu_"), "name": fn.get("name", ""),
                     "input": value if isinstance(value, dict) else {}}
            self.blocks.append(block)
            self._open = block
            events.append(("content_block_start", {"index": index, "content_block": {**block, "input": {}}}))
            events.append(("content_block_delta", {"index": index, "delta": {
                "type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}}))
            return events
        if self._open is None:
            block = {"type": "text", "text": ""} if kind == "text" else {"type": "thinking", "thinking": "",
                                                                        "signature": ""}
            self.blocks.append(block)
            self._open = block
            events.append(("content_block_start", {"index": index, "content_block": dict(block)}))
        index = len(self.blocks) - 1
        block = self._open
        if kind == "text":
            block["text"] += d.text
            events.append(("content_block_delta", {"index": index, "delta": {"type": "text_delta", "text": d.text}}))
        else:
            block["thinking"] += d.text
            events.append(("content_block_delta", {"index": index, "delta": {"type": "thinking_delta",
                                                                             "thinking": d.text}}))
        return events

    def _close(self) -> list[tuple[str, dict]]:
        block, self._open = self._open, None
        if block is None:
            return []
        index = len(self.blocks) - 1
        events = []
        if block["type"] == "thinking":
            events.append(("content_block_delta", {"index": index, "delta": {"type": "signature_delta",
                                                                             "signature": ""}}))
        events.append(("content_block_stop", {"index": index}))
        return events

    def _run(self) -> Iterator[tuple[str, dict]]:
        for piece in self.pump():
            if piece.delta is not None:
                yield from self._feed(piece.delta)
        yield from self._close()

    def message(self, final: bool) -> dict:
        reason, seq = self.stop_reason() if final else (None, None)
        usage = self.usage()
        if not final:
            usage["output_tokens"] = 0
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model_name,
                "content": list(self.blocks) if final else [], "stop_reason": reason, "stop_sequence": seq,
                "usage": usage}

    def complete(self) -> dict:
        for _ in self._run():
            pass
        return self.message(final=True)

    @staticmethod
    def _event(name: str, data: dict) -> bytes:
        body = json.dumps({"type": name, **data}, ensure_ascii=False, separators=(",", ":"))
        return f"event: {name}\ndata: {body}\n\n".encode("utf-8")

    def frames(self) -> Iterator[bytes]:
        yield self._event("message_start", {"message": self.message(final=False)})
        for name, data in self._run():
            yield self._event(name, data)
        reason, seq = self.stop_reason()
        yield self._event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": seq},
                                            "usage": self.usage()})
        yield self._event("message_stop", {})

    def sse(self) -> Iterator[bytes]:
        """Anthropic's stream ends with message_stop (no [DONE]); a failure after the 200 is an error event."""
        try:
            yield from self.frames()
        except ClientGone:
            return
        except Exception as exc:  # after the 200 went out: report in-band
            status, body, _ = from_exception(exc)
            yield self._event("error", {"error": anthropic_body(status, body)["error"]})


# ---- routes ------------------------------------------------------------------------------------------------------
def handle_messages(root_model: str | None = None) -> Response:
    import functools

    from pantheon.web.routes import serve_generation, server
    return serve_generation(parse_messages_request, functools.partial(MessagesGeneration, grammars=server().grammars,
                                                              images=server().images),
                            root_model)


def handle_count(root_model: str | None = None) -> Response:
    """The prompt's token count as /v1/messages would render it (template, tools and all).

    Bounded as /v1/messages is: the same body limit and parse (off the hub past BIG_BODY_BYTES), and a
    prompt /v1/messages would refuse as longer than the context is refused here with the same 400,
    from its length before any tokenizing (`AdmissionService.chat_count`); the rendering and counting of
    a body past BIG_PROMPT_CHARS run in an OS thread, as /v1/messages and /tokenize run theirs."""
    from pantheon.web.body import parse_json
    from pantheon.web.routes import parse_for_root, read_raw, server

    raw = read_raw()

    def parse() -> ChatRequest:
        body = body_object(parse_json(raw), COUNT_FIELDS)
        if body.get("messages") is None:
            raise bad("messages", "is required")
        return _request(body, None, False)

    creq = parse_for_root(raw, parse, root_model)
    registry = server().registry
    entry = registry.acquire(creq.model)
    try:
        card = entry.card
        with_images = bool(web_images.image_parts(creq.messages))

        def count() -> int:
            """The prompt /v1/messages would run, refused as /v1/messages refuses it (the same 400 from the
            messages' text, the rendering's length or the count: AdmissionService.chat_count): each
            image's marker expanded to the image tokens its header gives (plan_images: no pixel is
            decoded to count it)."""
            msgs, texts = creq.messages, None
            if with_images:
                msgs, _, texts = web_images.plan_images(creq.messages, card, registry.settings)

            def text() -> str:
                rendered = render_prompt(card, creq, msgs) if with_images else render_prompt(card, creq)
                return web_images.expand(rendered, card, texts) if with_images else rendered

            return len(AdmissionService.chat_count(card, creq.messages, text, lambda t: prompt_ids(card, t)))

        big = with_images or len(raw) > BIG_PROMPT_CHARS  # images are read: never on the hub
        n = bridge.call_in_thread(count, name="pantheon-tokenize") if big else count()
    except RequestError as exc:
        raise without_truncate_hint(exc) from None
    finally:
        registry.release(entry)
    return jsonify(input_tokens=n)


@bp.post("/v1/messages")
def create_message() -> Response:
    return handle_messages()


@bp.post("/v1/messages/count_tokens")
def count_tokens() -> Response:
    return handle_count()


@bp.post("/m/<path:model>/v1/messages")
def model_messages(model: str) -> Response:
    return handle_messages(root_model=model)


@bp.post("/m/<path:model>/v1/messages/count_tokens")
def model_count_tokens(model: str) -> Response:
    return handle_count(root_model=model)
