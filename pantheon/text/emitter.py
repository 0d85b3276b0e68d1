"""Streaming output emitter: turns detokenized text fragments into reasoning, content and tool-call deltas.

It sits between the detokenizer (one fragment of text per generated token) and the SSE writer. Markers
(`<think>`, `</think>`, `<tool_call>`, `</tool_call>`) and stop strings can be split across fragments, so
the emitter keeps a *carry*: the longest tail of unprocessed text that could still turn into a marker or a
stop string. The carry is never emitted early (a client must never see half a marker or half a stop string
that is then "taken back"), and it is released as soon as the next text shows it cannot match. The result is
independent of how the text was split: feeding fragments yields the same merged message as feeding the whole
text at once.

The work is done in two stages, so that each stays simple and exact:

1. Marker splitting routes text to the reasoning channel, the content channel, or a tool-call body.
2. Stop strings are matched on the content channel only, after markers were removed, i.e. on exactly the
   text a client will show. Hence the merged content never contains a stop string.

Choices (the OpenAI API leaves them open):

* Reasoning is on when constructed with ``in_think=True`` (the prompt ended with an open ``<think>``) or when
  the generated text starts, ignoring leading whitespace, with ``<think>``; that opening tag and the
  whitespace before it are swallowed (also with ``in_think=True``, so a model repeating the tag is harmless).
  The first ``</think>`` ends reasoning; everything after it is content.
* The think markers never reach the output: a stray ``<think>``/``</think>`` anywhere else is dropped.
  Removal is one left-to-right pass: text that only becomes a marker once another marker was cut out of its
  middle (``<th</think>ink>``) is left as it is; no model writes that.
* Leading whitespace of the content is stripped right after ``</think>`` and right after a parsed tool call,
  because models emit ``"\\n\\n"`` there, and whitespace-only content next to a tool call is noise.
* Stop strings apply to the content channel only. Reasoning is the model's scratch pad; cutting it (and the
  answer that has not been written yet) on a word that happens to appear while thinking would surprise the
  client. Tool-call bodies are not content either. Empty stop strings are ignored (they would match at once).
* A tool-call block ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` (Qwen/Hermes style) is emitted
  only once complete. A malformed block is emitted verbatim, tags included, as content, so nothing the model
  wrote is lost; so is an unterminated block at `Emitter.finish` (think markers in it are still dropped),
  unless the generation was *cut* (the token limit, ``finish(cut=True)``): then the block is the call the
  model was writing, and it goes out as a tool call with what is known of it (`partial_tool_call`: the name
  so far, the arguments' JSON text so far), `finish_reason` "length", as OpenAI returns a call cut by
  ``max_tokens``. Call syntax never reaches the content that way. The same holds for a bare JSON call cut
  once its name, a declared tool's, is complete; and with ``calls_only`` (a forced ``tool_choice``: the
  grammar allows nothing but calls) a cut that leaves only part of an opening tag drops that part.
  Inside reasoning, tool-call tags are plain reasoning text (models talk about the calls they plan).
* A tool-call delta carries the raw body (the text between the tags) in `Delta.text`, which is what makes
  "nothing is lost" checkable.
* With `tool_names` given (tools enabled), an answer that is a bare JSON call of one of those tools,
  ``{"name": ..., "arguments": {...}}``, or that object in a ```` ``` ```` / ```` ```json ```` fence, is a
  tool call too (`pantheon.text.bare_tool_call`): content that starts, after whitespace, with ``{`` or a
  backtick is held until it is known to be such a call or not. This applies where an answer starts (the
  first content, after ``</think>``, and again after a bare call, so several calls in a row work); such a
  call's `Delta.text` is all the text it consumed (whitespace and fences included). Text that turns out
  not to be a call is content, routed as if it had never been held.
* "Everything from the stop string on is cut" includes tool calls: a call that comes after the start of a
  stop string is dropped. So that this is decided correctly, a tool call that follows content held back as a
  possible stop prefix is held too, until that content is released (or cut); deltas keep the text's order.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass
from typing import Collection, Iterable, Literal, Sequence

from pantheon.text.bare_tool_call import BareCallScanner

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
TOOL_OPEN = "<tool_call>"
TOOL_CLOSE = "</tool_call>"

_THINK_MARKERS_RE = re.compile(re.escape(THINK_OPEN) + "|" + re.escape(THINK_CLOSE))
_ID_ALPHABET = string.ascii_letters + string.digits
_ID_LENGTH = 24

DeltaKind = Literal["content", "reasoning", "tool_call"]


@dataclass
class Delta:
    """One piece of output for the SSE writer.

    For ``content``/``reasoning`` `text` is the new text. For ``tool_call``, `tool_call` is the OpenAI
    tool-call dict with ``"index"`` (its position among this turn's calls) added, and `text` is the raw
    body the call was parsed from, or for a bare JSON call all the text it consumed (not meant for clients;
    it lets tests account for every input character).
    """

    kind: DeltaKind
    text: str = ""
    tool_call: dict | None = None


def new_tool_call_id() -> str:
    """An OpenAI-style call id; `secrets` so ids cannot be predicted or collide across requests."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(_ID_LENGTH))


def parse_tool_call(body: str) -> dict | None:
    """Parse a tool-call body into an OpenAI tool-call dict, or None when it is malformed.

    The body must be a JSON object with a non-empty string ``name``. ``arguments`` given as an object is
    serialized (ensure_ascii=False, so non-ASCII arguments stay readable); given as a string it is kept as
    the model wrote it (it already is the JSON string OpenAI expects); missing or null means ``"{}"``.
    """
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    arguments = obj.get("arguments")
    if arguments is None:
        arguments = "{}"
    elif isinstance(arguments, dict):
        arguments = json.dumps(arguments, ensure_ascii=False)
    elif not isinstance(arguments, str):
        return None
    return {"id": new_tool_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _string_prefix(raw: str) -> str:
    """The text of a JSON string literal cut short (`raw` starts at its opening quote): as much of it as
    decodes, leaving out an escape sequence that was cut in the middle."""
    body = raw[1:]
    for drop in range(min(len(body), 6) + 1):
        try:
            return json.loads('"' + body[:len(body) - drop] + '"', strict=False)
        except ValueError:
            continue
    return ""


def partial_tool_call(body: str) -> tuple[dict, bool]:
    """The call a tool-call body cut short was writing, and whether its name is complete.

    Reads the JSON object as far as it goes: ``name`` is the name's text so far ("" before it began),
    ``arguments`` the arguments' JSON text so far (an object not yet closed stays the prefix the model
    wrote, as OpenAI returns the arguments of a call cut by ``max_tokens``; a complete one is
    serialised as `parse_tool_call` does). Never fails: text that is no call object gives empty fields.
    """
    name, arguments, name_done = "", "", False
    decoder = json.JSONDecoder(strict=False)
    i = _skip_ws(body, 0)
    if body.startswith("{", i):
        i += 1
        while True:
            i = _skip_ws(body, i)
            if not body.startswith('"', i):
                break
            try:
                key, i = json.decoder.scanstring(body, i + 1, False)
            except ValueError:
                break
            i = _skip_ws(body, i)
            if not body.startswith(":", i):
                break
            i = _skip_ws(body, i + 1)
            try:
                value, end = decoder.raw_decode(body, i)
            except ValueError:  # the cut is inside this value
                quoted = body.startswith('"', i)
                if key == "name" and quoted:
                    name = _string_prefix(body[i:])
                elif key == "arguments":
                    arguments = _string_prefix(body[i:]) if quoted else body[i:]
                break
            if key == "name" and isinstance(value, str):
                name, name_done = value, True
            elif key == "arguments" and value is not None:
                arguments = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
            i = _skip_ws(body, end)
            if not body.startswith(",", i):
                break
            i += 1
    call = {"id": new_tool_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}
    return call, name_done


def _held_suffix_len(text: str, patterns: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `patterns`.

    That suffix is the carry: more text could complete it into a pattern, so it must not be emitted yet.
    Everything before it can never be the start of a match and is safe to release.
    """
    longest = max((len(p) for p in patterns), default=0)
    for k in range(min(len(text), longest - 1), 0, -1):
        tail = text[-k:]
        if any(len(p) > k and p.startswith(tail) for p in patterns):
            return k
    return 0


def _earliest(text: str, patterns: Sequence[str]) -> tuple[int, str | None]:
    """Position and identity of the leftmost occurrence of any pattern (-1, None when there is none)."""
    best, found = -1, None
    for p in patterns:
        i = text.find(p)
        if i >= 0 and (best < 0 or i < best):
            best, found = i, p
    return best, found


class Emitter:
    """Turns a stream of text fragments into `Delta`s; see the module docstring for the rules.

    Call `feed` with each fragment and `finish` once at the end. `stopped`, `tool_calls`, `content` and
    `reasoning` hold the totals so far (what a non-streaming response returns).
    """

    def __init__(
        self,
        stop: Sequence[str] = (),
        in_think: bool = False,
        tools_enabled: bool = False,
        parse_think: bool = True,
        tool_names: Collection[str] = (),
        calls_only: bool = False,
    ) -> None:
        """`parse_think=False` disables the reasoning channel entirely: think tags are plain content and
        `in_think` is ignored (for models without reasoning, or clients that want the raw text).
        `tool_names`: the declared tools whose bare JSON calls are recognised (needs `tools_enabled`).
        `calls_only`: a grammar allows nothing but tool calls, so a cut part of an opening tag is dropped."""
        self._stops: tuple[str, ...] = tuple(s for s in stop if s)
        self._parse_think = parse_think
        self._in_think = in_think and parse_think
        self._tools_enabled = tools_enabled
        # "start": deciding whether the text opens with <think>; "think": reasoning; "content"; "tool":
        # inside a <tool_call> block, collecting its body; "bare": deciding whether held text is a bare call.
        self._bare_names = frozenset(tool_names) if tools_enabled else frozenset()
        self._bare_armed = bool(self._bare_names)  # at the start of an answer: a bare call may follow
        self._bare: BareCallScanner | None = None
        self._mode: str = "start" if parse_think else "content"
        self._buf = ""  # stage 1: text not yet routed (the marker carry, or a tool-call body)
        self._strip_ws = False  # strip the content's leading whitespace (after </think> or a tool call)
        self._stop_buf = ""  # stage 2: content held back as a possible stop-string prefix
        # tool calls that came after held content: (offset into _stop_buf, call, raw body)
        self._held_calls: list[tuple[int, dict, str]] = []
        self._out: list[Delta] = []
        self._finished = False
        self._calls_only = calls_only and tools_enabled
        self._cut = False  # finish(cut=True): generation ended at the token limit
        self.cut_call = False  # the last call was cut short and went out partial
        self.stopped = False
        self.stop_hit: str | None = None  # the stop string that ended the content (Anthropic's stop_sequence)
        self.tool_calls: list[dict] = []
        self.content = ""
        self.reasoning = ""

    @property
    def finish_reason(self) -> Literal["tool_calls", "stop", "length"] | None:
        """"length" when a call was cut short, "tool_calls" when calls were made, "stop" when a stop string
        was hit, else None (the caller knows whether generation ended by end-of-sequence, "stop", or by
        the token limit, "length")."""
        if self.cut_call:
            return "length"
        if self.tool_calls:
            return "tool_calls"
        return "stop" if self.stopped else None

    def feed(self, text: str) -> list[Delta]:
        """Process one fragment; returns the deltas that are now certain. Ignored once stopped."""
        if self._finished:
            raise RuntimeError("Emitter.feed() called after finish()")
        if self.stopped or not text:
            return []
        self._buf += text
        self._route(final=False)
        return self._take()

    def finish(self, cut: bool = False) -> list[Delta]:
        """End of generation: release whatever carry is left (nothing can complete it any more).

        `cut`: generation stopped at the token limit, mid-text: a tool call being written goes out as
        the partial call it is (see the module docstring), not as content."""
        if self._finished:
            return []
        self._finished = True
        self._cut = cut
        if not self.stopped:
            self._route(final=True)
            if not self.stopped:
                self._release(len(self._stop_buf))
        return self._take()

    # -- stage 1: markers ----------------------------------------------------------------------------

    def _route(self, final: bool) -> None:
        """Route as much of the buffer as is certain to its channel; with `final`, all of it."""
        while not self.stopped:
            mode = self._mode
            if mode == "start":
                rest = self._buf.lstrip()
                if rest.startswith(THINK_OPEN):
                    self._buf = rest[len(THINK_OPEN):]
                    self._mode = "think"
                    continue
                if not final and THINK_OPEN.startswith(rest):
                    return  # only whitespace and maybe the beginning of "<think>" so far
                self._mode = "think" if self._in_think else "content"
                continue

            if mode == "tool":
                end = self._buf.find(TOOL_CLOSE)
                if end < 0:
                    if final and self._cut:  # cut while writing it: the call so far
                        self._partial_call(self._buf)
                    elif final:  # unterminated: what the model wrote goes out as content
                        self._content(self._raw(TOOL_OPEN + self._buf))
                    if final:
                        self._buf = ""
                    return
                body = self._buf[:end]
                self._buf = self._buf[end + len(TOOL_CLOSE):]
                self._mode = "content"
                call = parse_tool_call(body)
                if call is None:
                    self._content(self._raw(TOOL_OPEN + body + TOOL_CLOSE))
                else:
                    self._tool_call(call, body)
                    self._strip_ws = True
                continue

            if mode == "bare":
                assert self._bare is not None
                verdict = self._bare.scan(self._buf, final and not self._cut)
                if verdict.kind == "wait" and final:  # cut while it was undecided
                    start = self._bare.object_start()
                    if start is not None and self._cut_bare_call(start):
                        return
                    verdict = self._bare.scan(self._buf, True)
                if verdict.kind == "wait":
                    return
                self._mode, self._bare = "content", None
                if verdict.kind == "call":
                    assert verdict.call is not None
                    raw, self._buf = self._buf[:verdict.end], self._buf[verdict.end:]
                    self._tool_call(verdict.call, raw)
                    self._strip_ws = True
                else:
                    self._bare_armed = False  # ordinary content: routed below as if never held
                continue

            if mode == "content" and self._strip_ws:
                self._buf = self._buf.lstrip()
                if not self._buf:
                    return  # keep stripping when more text comes
                self._strip_ws = False

            if mode == "content" and self._bare_armed:
                rest = self._buf.lstrip()
                if not rest and not final:
                    return  # only whitespace so far: it may lead into a bare call
                if rest[:1] in ("{", "`"):
                    self._mode, self._bare = "bare", BareCallScanner(parse_tool_call, self._bare_names)
                    continue
                self._bare_armed = False

            markers = self._markers()
            pos, marker = _earliest(self._buf, markers)
            emit = self._reasoning if mode == "think" else self._content
            if marker is None:
                keep = 0 if final else _held_suffix_len(self._buf, markers)
                cut = len(self._buf) - keep
                if final and self._cut and self._calls_only and mode == "content":
                    cut -= _held_suffix_len(self._buf, (TOOL_OPEN,))  # a cut opening tag: syntax, dropped
                emit(self._buf[:cut])
                self._buf = "" if final else self._buf[cut:]
                return
            emit(self._buf[:pos])
            self._buf = self._buf[pos + len(marker):]
            if marker == THINK_CLOSE and mode == "think":
                self._mode = "content"
                self._strip_ws = True
                self._bare_armed = bool(self._bare_names)
            elif marker == TOOL_OPEN:
                self._mode = "tool"
            # any other think marker is stray and simply dropped

    def _partial_call(self, body: str) -> None:
        """A `<tool_call>` block cut short: the call it was writing, marked cut."""
        call, _ = partial_tool_call(body)
        self._tool_call(call, body)
        self.cut_call = not self.stopped

    def _cut_bare_call(self, start: int) -> bool:
        """A bare JSON call cut short (its object opens at `start`): a call once its name, one of the
        declared tools', is complete; True when it went out as one."""
        call, name_done = partial_tool_call(self._buf[start:])
        if not name_done or call["function"]["name"] not in self._bare_names:
            return False
        self._tool_call(call, self._buf)
        self.cut_call = not self.stopped
        self._buf, self._mode, self._bare = "", "content", None
        return True

    def _raw(self, text: str) -> str:
        """A failed tool-call block as content: verbatim, except that think markers are dropped as in any
        other content (one left-to-right pass, like the scan in `_route`)."""
        return _THINK_MARKERS_RE.sub("", text) if self._parse_think else text

    def _markers(self) -> tuple[str, ...]:
        """Markers that mean something in the current mode (tool calls are not parsed inside reasoning)."""
        markers: tuple[str, ...] = (THINK_OPEN, THINK_CLOSE) if self._parse_think else ()
        if self._mode == "content" and self._tools_enabled:
            markers += (TOOL_OPEN,)
        return markers

    # -- stage 2: stop strings on content -------------------------------------------------------------

    def _content(self, text: str) -> None:
        """Content text in order; cut at the first stop string, holding back a possible stop prefix."""
        if self.stopped or not text:
            return
        self._stop_buf += text
        pos, hit = _earliest(self._stop_buf, self._stops)
        if pos >= 0:
            self._release(pos)
            self._stop_buf = ""
            self._held_calls = []
            self.stopped = True
            self.stop_hit = hit
            return
        self._release(len(self._stop_buf) - _held_suffix_len(self._stop_buf, self._stops))

    def _release(self, cut: int) -> None:
        """Emit held content up to `cut`, with the held tool calls that come before that point."""
        done = 0
        while self._held_calls and self._held_calls[0][0] <= cut:
            offset, call, body = self._held_calls.pop(0)
            self._push("content", self._stop_buf[done:offset])
            self._emit_call(call, body)
            done = offset
        self._push("content", self._stop_buf[done:cut])
        self._stop_buf = self._stop_buf[cut:]
        self._held_calls = [(offset - cut, call, body) for offset, call, body in self._held_calls]

    def _tool_call(self, call: dict, body: str) -> None:
        """A parsed call goes out now, unless content before it is still held (a stop might cut it)."""
        if self.stopped:
            return
        if self._stop_buf:
            self._held_calls.append((len(self._stop_buf), call, body))
        else:
            self._emit_call(call, body)

    def _emit_call(self, call: dict, body: str) -> None:
        index = len(self.tool_calls)
        self.tool_calls.append(call)
        self._out.append(Delta("tool_call", text=body, tool_call={"index": index, **call}))

    def _reasoning(self, text: str) -> None:
        if text:
            self._push("reasoning", text)

    def _push(self, kind: DeltaKind, text: str) -> None:
        """Append text output, coalescing with the previous delta of the same kind from this call."""
        if not text:
            return
        if kind == "content":
            self.content += text
        else:
            self.reasoning += text
        if self._out and self._out[-1].kind == kind:
            self._out[-1].text += text
        else:
            self._out.append(Delta(kind, text=text))

    def _take(self) -> list[Delta]:
        out, self._out = self._out, []
        return out


def merge_deltas(deltas: Iterable[Delta]) -> dict:
    """What a non-streamed assistant message holds for these deltas.

    ``content`` is None only when it is empty and there are tool calls (OpenAI sends null content with
    tool calls, "" for an empty answer); ``reasoning_content`` and ``tool_calls`` are None when empty.
    Tool calls lose the streaming-only ``index``.
    """
    content: list[str] = []
    reasoning: list[str] = []
    tool_calls: list[dict] = []
    for d in deltas:
        if d.kind == "content":
            content.append(d.text)
        elif d.kind == "reasoning":
            reasoning.append(d.text)
        elif d.tool_call is not None:
            tool_calls.append({k: v for k, v in d.tool_call.items() if k != "index"})
    text = "".join(content)
    return {
        "content": text if text or not tool_calls else None,
        "reasoning_content": "".join(reasoning) or None,
        "tool_calls": tool_calls or None,
    }
