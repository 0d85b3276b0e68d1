"""The generic tool format: tools, tool calls and tool results for chat templates that cannot show them.

Many small models ship a chat template with no tools branch (SmolLM2's renders only role and content).
Handing such a template `tools` changes nothing, an assistant turn's `tool_calls` vanish, and a `tool`
message becomes a turn of a role the model never saw. So whatever the template cannot render natively
is rewritten here into plain messages it can render, in the Hermes/Qwen syntax that
`pantheon.text.emitter` parses back out of the answer:

* **Tool definitions** (when the template never reads the `tools` variable) become a block of text in the
  system message: the definitions as JSON lines within ``<tools></tools>``, and the instruction to answer
  a call as ``<tool_call>\\n{"name": <tool name>, "arguments": <JSON object>}\\n</tool_call>``. The block is
  appended to the client's system message (after a blank line: the operator's persona comes first), or,
  without one, becomes a new system message at the front (which replaces a template's built-in default
  system prompt). `tool_choice` adds one sentence: "required" says a call is required, a named choice
  names the one tool to call (and only that tool is listed: `ChatRequest.template_tools`).
* **Earlier calls** (when the template never reads `tool_calls`) are appended to that assistant turn's
  content, one ``<tool_call>`` block each, in exactly the syntax above.
* **Tool results** (when the template never mentions the `tool` role) become user turns holding
  ``<tool_response>\\n{"name": ..., "tool_call_id": ..., "content": ...}\\n</tool_response>``; the name is
  looked up from the call with that id when the message has none. Consecutive results, and a user message
  right after them, share one user turn, so templates that insist on alternating roles still render.

Each piece is decided on its own (`ToolSupport`), so a template that declares tools natively but has no
`tool` role still gets its results as user turns. Everything here is a pure function over message lists
(string content, as `chat_template._normalise_messages` leaves it); nothing a client sent is dropped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"  # the emitter's markers (pantheon.text.emitter.TOOL_OPEN / TOOL_CLOSE)
TOOL_CALL_CLOSE = "</tool_call>"
RESPONSE_OPEN = "<tool_response>"
RESPONSE_CLOSE = "</tool_response>"

CALL_SHAPE = '{"name": <function-name>, "arguments": <args-json-object>}'


@dataclass(frozen=True)
class ToolSupport:
    """What a chat template renders natively; each False piece is rewritten into the generic format."""

    declarations: bool  # reads the `tools` variable
    calls: bool  # reads an assistant message's `tool_calls`
    results: bool  # renders `tool` role messages

    @property
    def complete(self) -> bool:
        return self.declarations and self.calls and self.results


NATIVE = ToolSupport(True, True, True)


def choice_instruction(tool_choice: Any) -> str:
    """The sentence that says whether a call is optional, required, or which tool must be called."""
    if isinstance(tool_choice, dict):
        name = tool_choice.get("function", {}).get("name")
        return f"You must call the function {json.dumps(name, ensure_ascii=False)} in this answer."
    if tool_choice == "required":
        return "You must call at least one of these functions in this answer."
    return "If no function is needed, answer the user directly."


def tools_block(tools: list[dict], tool_choice: Any = "auto") -> str:
    """The system-prompt text that declares `tools` and how to call them."""
    specs = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{specs}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            f"{TOOL_CALL_OPEN}{TOOL_CALL_CLOSE} XML tags:\n{TOOL_CALL_OPEN}\n{CALL_SHAPE}\n{TOOL_CALL_CLOSE}\n\n"
            f"Results of calls come back within {RESPONSE_OPEN}{RESPONSE_CLOSE} XML tags. "
            + choice_instruction(tool_choice))


def call_text(call: dict) -> str:
    """One OpenAI tool call (or a bare {"name", "arguments"}) as a ``<tool_call>`` block.

    Arguments given as a JSON string that parses to an object are written as that object, as the model
    should write them; any other string is kept as a string (nothing is lost)."""
    fn = call.get("function", call) if isinstance(call, dict) else {}
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except ValueError:
            parsed = None
        args = parsed if isinstance(parsed, dict) else args
    body = json.dumps({"name": fn.get("name"), "arguments": {} if args is None else args}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"


def result_text(content: str, name: str | None = None, call_id: str | None = None) -> str:
    """A tool result as a ``<tool_response>`` block: a JSON object with the tool's name and call id when
    known, and the content (a JSON object or array stays structured, anything else is a string)."""
    value: Any = content
    stripped = content.strip()
    if stripped[:1] in ("{", "["):
        try:
            value = json.loads(stripped)
        except ValueError:
            value = content
    obj: dict[str, Any] = {}
    if name:
        obj["name"] = name
    if call_id:
        obj["tool_call_id"] = call_id
    obj["content"] = value
    return f"{RESPONSE_OPEN}\n{json.dumps(obj, ensure_ascii=False)}\n{RESPONSE_CLOSE}"


def _call_names(messages: list[dict]) -> dict[str, str]:
    """Call id -> tool name, over every assistant tool call in the history."""
    names: dict[str, str] = {}
    for m in messages:
        for call in m.get("tool_calls") or []:
            fn = call.get("function", call) if isinstance(call, dict) else {}
            if isinstance(call, dict) and isinstance(call.get("id"), str) and isinstance(fn.get("name"), str):
                names[call["id"]] = fn["name"]
    return names


def _with_calls(msg: dict) -> dict:
    """An assistant message whose tool calls are appended to its content as ``<tool_call>`` blocks."""
    out = {k: v for k, v in msg.items() if k != "tool_calls"}
    parts = [msg["content"]] if msg.get("content") else []
    parts += [call_text(c) for c in msg["tool_calls"]]
    out["content"] = "\n".join(parts)
    return out


def rewrite_history(messages: list[dict], support: ToolSupport = NATIVE) -> list[dict]:
    """The messages with the tool calls and tool results the template cannot render rewritten as text.

    A rewritten result is user text; it shares a user turn with the results and user messages right
    next to it (results joined by a newline, a result and user text by a blank line)."""
    if support.calls and support.results:
        return messages
    names = _call_names(messages)
    out: list[dict] = []
    ends: list[str | None] = []  # per turn of out: "result" or "user" for user turns (what its text ends with)
    for m in messages:
        role = m.get("role")
        if role == "assistant" and m.get("tool_calls") and not support.calls:
            out.append(_with_calls(m))
            ends.append(None)
            continue
        if role == "tool" and not support.results:
            call_id = m.get("tool_call_id")
            name = m.get("name") or (names.get(call_id) if isinstance(call_id, str) else None)
            text, kind = result_text(str(m.get("content") or ""), name, call_id), "result"
        elif role == "user":
            text, kind = str(m.get("content") or ""), "user"
        else:
            out.append(m)
            ends.append(None)
            continue
        prev_kind = ends[-1] if ends else None
        if prev_kind is not None and "result" in (kind, prev_kind):
            prev = out[-1]
            sep = "\n" if kind == prev_kind == "result" else "\n\n"
            out[-1] = {**prev, "content": f"{prev['content']}{sep}{text}" if prev["content"] else text}
            ends[-1] = kind
        else:
            out.append(m if kind == "user" else {"role": "user", "content": text})
            ends.append(kind)
    return out


def declare_tools(messages: list[dict], tools: list[dict], tool_choice: Any = "auto",
                  in_system: bool = True) -> list[dict]:
    """The messages with the tools block added: appended to the first system message, or a new system
    message at the front; with `in_system` False (a template that refuses a system role), prepended to
    the first user message instead."""
    block = tools_block(tools, tool_choice)
    out = list(messages)
    if out and out[0].get("role") == "system":
        system = out[0].get("content") or ""
        out[0] = {**out[0], "content": f"{system}\n\n{block}" if system else block}
    elif in_system:
        out.insert(0, {"role": "system", "content": block})
    else:
        i = next((j for j, m in enumerate(out) if m.get("role") == "user"), None)
        if i is None:
            out.insert(0, {"role": "user", "content": block})
        else:
            out[i] = {**out[i], "content": f"{block}\n\n{out[i].get('content') or ''}"}
    return out


def adapt(messages: list[dict], tools: list[dict] | None, tool_choice: Any, support: ToolSupport,
          in_system: bool = True) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) to hand a template with `support`: what it renders natively passes through,
    the rest is rewritten into the generic format (the returned tools are then None)."""
    msgs = rewrite_history(messages, support)
    if not tools or support.declarations:
        return msgs, tools or None
    return declare_tools(msgs, tools, tool_choice, in_system), None
