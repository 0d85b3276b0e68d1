"""Recognising a tool call written without tags: a bare JSON object, or one inside a ``` code fence.

Small models asked for ``<tool_call>{...}</tool_call>`` often answer with just the JSON object
``{"name": "get_weather", "arguments": {"city": "Paris"}}``, or with that object in a ```` ```json ````
fence. `BareCallScanner` decides, as text arrives, whether a stretch of the answer is exactly that:

* optional whitespace, then either the object, or ```` ``` ```` with an info string that is empty or
  ``json`` (any case), a newline, optional whitespace, the object, optional whitespace and a closing
  ```` ``` ```` (at the end of the text the closing fence may be missing);
* the object parses as a tool call (with the parser the emitter gives, `pantheon.text.emitter.parse_tool_call`)
  of one of the declared tools.

It says "not a call" as early as the text allows (a first character other than ``{`` or a backtick,
another info string, an object whose first key is neither "name" nor "arguments"), so prose and ordinary
code blocks are held back only for a few characters; a JSON object that is not a call is known once it
closes. The scan is incremental: the caller passes the same growing text each time, and work done on
a prefix is not repeated.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Literal

FENCE = "```"
INFO_STRINGS = ("", "json")

VerdictKind = Literal["wait", "call", "text"]


@dataclass(frozen=True)
class Verdict:
    """`kind` "wait": more text is needed; "text": not a call (the text is ordinary content); "call":
    `call` is the OpenAI tool-call dict and the first `end` characters of the text are its raw form."""

    kind: VerdictKind
    call: dict | None = None
    end: int = 0


WAIT = Verdict("wait")
TEXT = Verdict("text")


class BareCallScanner:
    """Scans one candidate stretch of text; see the module docstring. Use a new scanner per stretch."""

    def __init__(self, parse: Callable[[str], dict | None], names: Collection[str]) -> None:
        """`parse`: a JSON object's text -> an OpenAI tool-call dict, or None when it is not a call."""
        self._parse = parse
        self._names = frozenset(names)
        self._phase = "lead"  # lead, fence_open, fence_info, pre_object, object, after_object, fence_close
        self._i = 0  # next character to read
        self._ticks = 0  # backticks counted in the current fence
        self._info_start = 0
        self._fenced = False
        self._start = 0  # the object's first character
        self._end = 0  # one past the object's last character
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._key_start = -1  # where the object's first key begins (-1: not seen yet)
        self._key_checked = False

    def object_start(self) -> int | None:
        """Where the candidate object begins, while it is still being read (None before and after)."""
        return self._start if self._phase == "object" else None

    def scan(self, text: str, final: bool) -> Verdict:
        """The verdict for `text` (the whole stretch so far: what an earlier call saw, plus more);
        `final`: no more text will come."""
        while self._i < len(text):
            verdict = self._step(text, text[self._i])
            if verdict is not None:
                return verdict
            self._i += 1
        if not final:
            return WAIT
        if self._phase == "after_object" or self._phase == "fence_close":  # the closing fence never came
            return self._verdict(text, len(text))
        return TEXT

    def _step(self, text: str, c: str) -> Verdict | None:
        """Read character `c` at `self._i`; a verdict when it decides one."""
        phase = self._phase
        if phase in ("lead", "pre_object"):
            if c.isspace():
                return None
            if c == "{":
                self._phase, self._start = "object", self._i
                return self._object_char(text, c)
            if c == "`" and phase == "lead":
                self._phase, self._ticks = "fence_open", 1
                return None
            return TEXT
        if phase == "fence_open":
            if c != "`":
                return TEXT
            self._ticks += 1
            if self._ticks == len(FENCE):
                self._phase, self._info_start, self._fenced = "fence_info", self._i + 1, True
            return None
        if phase == "fence_info":
            info = text[self._info_start:self._i].strip().lower()
            if c == "\n":
                if info not in INFO_STRINGS:
                    return TEXT
                self._phase = "pre_object"
                return None
            if not any(s.startswith((info + c).strip().lower()) for s in INFO_STRINGS if s):
                return TEXT
            return None
        if phase == "object":
            return self._object_char(text, c)
        if phase == "after_object":  # only fenced objects get here; a bare one is decided when it closes
            if c.isspace():
                return None
            if c != "`":
                return TEXT
            self._phase, self._ticks = "fence_close", 1
            return None
        # fence_close
        if c != "`":
            return TEXT
        self._ticks += 1
        if self._ticks == len(FENCE):
            return self._verdict(text, self._i + 1)
        return None

    def _object_char(self, text: str, c: str) -> Verdict | None:
        """One character of the JSON object: track strings and nesting, check the first key early."""
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif c == "\\":
                self._escaped = True
            elif c == '"':
                self._in_string = False
                if self._depth == 1 and not self._key_checked:
                    self._key_checked = True
                    try:
                        key = json.loads(text[self._key_start:self._i + 1])
                    except ValueError:
                        return TEXT
                    if key not in ("name", "arguments"):
                        return TEXT
            return None
        if c == '"':
            self._in_string = True
            if self._depth == 1 and self._key_start < 0:
                self._key_start = self._i
        elif c in "{[":
            self._depth += 1
        elif c in "}]":
            self._depth -= 1
            if self._depth == 0:
                self._phase, self._end = "after_object", self._i + 1
                if not self._fenced:
                    return self._verdict(text, self._end)
        elif self._depth == 1 and self._key_start < 0 and not c.isspace():
            return TEXT  # an object's first token is a key (a string)
        return None

    def _verdict(self, text: str, end: int) -> Verdict:
        call = self._parse(text[self._start:self._end])
        if call is None or call["function"]["name"] not in self._names:
            return TEXT
        return Verdict("call", call, end)
