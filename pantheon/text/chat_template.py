"""Chat prompt rendering: the model file's own Jinja template, or ChatML when the file has none.

The template is rendered the way HF transformers' `apply_chat_template` does (sandboxed environment,
trim_blocks/lstrip_blocks, `raise_exception`, `strftime_now`, a non-escaping `tojson`), because model
templates are written and tested against that behaviour; any difference shows up as a prompt the model was
not trained on. Every failure becomes `TemplateError` (a 400): a template that rejects a conversation is
the client's problem to fix, not a server crash.

Tools reach every model: what a template cannot render (tool definitions, earlier tool calls, tool
results; `tool_support` reads its source once) is rewritten by `pantheon.text.tool_format` into the generic
format before the template runs. This happens here, in `ChatTemplate.render`, so every caller (the chat
route, the CLI, tests) renders the same prompt for the same conversation.
"""

from __future__ import annotations

import copy
import json
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pantheon.text import tool_format
from pantheon.errors import TemplateError
from pantheon.text.tool_format import ToolSupport

THINK_OPEN = "<think>"


class _TemplateRaised(Exception):
    """What `raise_exception(...)` inside a template throws; its message is the template author's."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes <, >, & and ' ; HF's does not, and templates expect HF's output.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` (HF's assistant-mask marker): renders its body unchanged,
    so templates that use it compile here too."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols, _GenerationTag])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _content_text(content: Any, index: int) -> Any:
    """OpenAI content parts -> one string (text parts joined by newlines); None -> ""."""
    if content is None:
        return ""
    if isinstance(content, list):
        out, prev_text = [], False
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                text = part["text"]
            elif isinstance(part, str):
                text = part
            elif isinstance(part, dict) and part.get("type") == "image" and isinstance(part.get("marker"), str):
                # an image (the web layer checked and decoded it): the model's marker, with no separator
                # around it, as Gemma 3's own template writes image parts between text parts
                out.append(part["marker"])
                prev_text = False
                continue
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise TemplateError(f"messages[{index}]: content part of type {kind!r} is not supported "
                                    "(text only)")
            out.append(("\n" if prev_text else "") + text)
            prev_text = True
        return "".join(out)
    return content


def _normalise_messages(messages: list[dict]) -> list[dict]:
    """Copies of the messages with string content, and tool-call arguments as objects: templates write them
    with `tojson`, which would otherwise quote an OpenAI-style JSON string a second time."""
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise TemplateError(f"messages[{i}] is not an object")
        m = copy.deepcopy(msg)
        m["content"] = _content_text(m.get("content"), i)
        for call in m.get("tool_calls") or []:
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                try:
                    parsed = json.loads(fn["arguments"])
                except ValueError:
                    continue
                if isinstance(parsed, dict):
                    fn["arguments"] = parsed
        out.append(m)
    return out


def read_tool_support(ast: nodes.Template) -> ToolSupport:
    """What a parsed template renders natively: the `tools` variable is read, an assistant message's
    `tool_calls` is read (as an attribute or a subscript), and the role name "tool" is mentioned.

    A template that never mentions one of these cannot render it, whatever the messages hold (SmolLM2's
    writes every role name verbatim, so a "tool" turn would come out as a role the model never saw).
    """
    names = {n.name for n in ast.find_all(nodes.Name) if n.ctx == "load"}
    attrs = {n.attr for n in ast.find_all(nodes.Getattr)}
    consts = {n.value for n in ast.find_all(nodes.Const) if isinstance(n.value, str)}
    return ToolSupport(declarations="tools" in names, calls="tool_calls" in attrs | consts,
                       results="tool" in consts)


def _chatml(messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool,
            enable_thinking: bool | None, tool_choice: Any = "auto") -> str:
    """ChatML with Hermes/Qwen-style tool calls, for files without a template. The tools block is
    Qwen's own text; a required or named `tool_choice` adds the generic format's sentence saying so."""
    out: list[str] = []
    rest = messages
    if tools:
        system = ""
        if messages and messages[0].get("role") == "system":
            system, rest = str(messages[0]["content"]) + "\n\n", messages[1:]
        specs = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        out.append(
            f"<|im_start|>system\n{system}# Tools\n\nYou may call one or more functions to assist with the user "
            "query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{specs}\n</tools>\n\nFor each function call, return a json object with function name and "
            "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
            + ("" if tool_choice in (None, "auto") else "\n\n" + tool_format.choice_instruction(tool_choice))
            + "<|im_end|>\n")
    for i, m in enumerate(rest):
        role = m.get("role")
        if role == "tool":
            if i == 0 or rest[i - 1].get("role") != "tool":
                out.append("<|im_start|>user")
            out.append(f"\n<tool_response>\n{m['content']}\n</tool_response>")
            if i == len(rest) - 1 or rest[i + 1].get("role") != "tool":
                out.append("<|im_end|>\n")
        elif role == "assistant" and m.get("tool_calls"):
            out.append("<|im_start|>assistant" + (f"\n{m['content']}" if m["content"] else ""))
            for call in m["tool_calls"]:
                fn = call.get("function", call) if isinstance(call, dict) else {}
                body = json.dumps({"name": fn.get("name"), "arguments": fn.get("arguments", {})}, ensure_ascii=False)
                out.append(f"\n<tool_call>\n{body}\n</tool_call>")
            out.append("<|im_end|>\n")
        else:
            out.append(f"<|im_start|>{role}\n{m['content']}<|im_end|>\n")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n" + (THINK_OPEN + "\n" if enable_thinking else ""))
    return "".join(out)


class ChatTemplate:
    """Renders conversations into a prompt string with the model's template (or ChatML)."""

    has_source: bool
    error: str | None  # why the file's template does not compile (renders then raise TemplateError)
    tool_support: ToolSupport  # what the template renders of tools itself (the rest: pantheon.text.tool_format)

    def __init__(self, source: str | None, bos_token: str | None = None, eos_token: str | None = None):
        """Compile `source` once. A template that does not compile does not fail the model load (plain
        completions still work); `render` reports it as TemplateError and `error` says why."""
        self.source = source if source else None
        self.has_source = self.source is not None
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.error = None
        self._template: jinja2.Template | None = None
        self.tool_support = tool_format.NATIVE  # the ChatML fallback renders all of it
        if self.source is not None:
            try:
                env = _environment()
                ast = env.parse(self.source)
                self.tool_support = read_tool_support(ast)
                self._template = env.from_string(ast)
            except jinja2.TemplateError as exc:
                self.error = f"the model's chat template does not compile: {type(exc).__name__}: {exc}"

    def render(self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True,
               enable_thinking: bool | None = None, tool_choice: Any = "auto") -> str:
        """The prompt for `messages`. `enable_thinking` is passed to the template only when given, so a
        template's own default applies otherwise; in the ChatML fallback True prefills `<think>`.

        `tools` are the tools shown to the model (the caller leaves out those `tool_choice` excludes);
        `tool_choice` only words the generic format's instruction. What the template cannot render of
        tools is rewritten first (`pantheon.text.tool_format`). The generic tools block goes into a system
        message; a template that refuses the new system turn gets it at the top of the first user turn."""
        msgs = _normalise_messages(messages)
        if not self.has_source:
            return _chatml(msgs, tools, add_generation_prompt, enable_thinking, tool_choice)
        if self._template is None:
            raise TemplateError(self.error or "chat template unavailable")
        adapted, shown_tools = tool_format.adapt(msgs, tools, tool_choice, self.tool_support)
        try:
            return self._render(adapted, shown_tools, add_generation_prompt, enable_thinking)
        except TemplateError:
            added_system = tools and not self.tool_support.declarations and \
                not (msgs and msgs[0].get("role") == "system")
            if not added_system:
                raise
        adapted, shown_tools = tool_format.adapt(msgs, tools, tool_choice, self.tool_support, in_system=False)
        return self._render(adapted, shown_tools, add_generation_prompt, enable_thinking)

    def _render(self, msgs: list[dict], tools: list[dict] | None, add_generation_prompt: bool,
                enable_thinking: bool | None) -> str:
        ctx: dict[str, Any] = {"messages": msgs, "tools": tools, "add_generation_prompt": add_generation_prompt}
        # Like HF, unset special tokens are left undefined rather than passed as "" (`is defined` works).
        if self.bos_token is not None:
            ctx["bos_token"] = self.bos_token
        if self.eos_token is not None:
            ctx["eos_token"] = self.eos_token
        if enable_thinking is not None:
            ctx["enable_thinking"] = enable_thinking
        assert self._template is not None
        try:
            return self._template.render(**ctx)
        except _TemplateRaised as exc:
            raise TemplateError(f"chat template rejected the conversation: {exc}") from exc
        except jinja2.TemplateError as exc:
            raise TemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from exc
        except Exception as exc:  # e.g. TypeError from `'text' + none` inside the template
            raise TemplateError(f"chat template failed on these messages: {type(exc).__name__}: {exc}") from exc

    def prompt_ends_in_think(self, rendered: str) -> bool:
        """True when the generation prompt ends with an open `<think>`: the model then starts in its
        reasoning channel without writing the tag itself."""
        return rendered.rstrip().endswith(THINK_OPEN)
