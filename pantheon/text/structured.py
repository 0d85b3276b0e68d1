"""Structured outputs on the host: OpenAI `response_format` and forced tool calls as llguidance grammars.

What this module is: the bridge from a request's JSON Schema (or its tools) to a per-step token bitmask.
What it is not: it never touches the device; the scheduler copies the rows it fills into the step's
``i32[rows, mask_words]`` mask, and the sampler turns cleared bits into ``-inf`` logits.

Lifecycle (one request)::

    g = Grammar.from_response_format(rf, tokenizer, limits)   # a compile-pool thread; None for {"type": "text"}
    g = Grammar.for_tools(tools, choice, tokenizer, limits=)  # or: a forced tool call (None for "auto"/"none")
    m = g.matcher(stop_ids, vocab)                            # driver thread, one per choice
    loop: m.fill_mask(rows[i]) (a mask worker); ...sample...; m.consume(token) (driver)   until m.done

Bounds (issue 31): a schema past `SchemaLimits` is refused before llguidance sees it (`SchemaTooLarge`,
400), because a compile cannot be interrupted and its time grows steeply with a schema's size; the web
layer compiles in a bounded pool with a deadline and cancels a compile whose client left
(`pantheon.web.chat.Generation._compile_constraint`); the compile also computes the first mask, so
matchers start warm; and the scheduler builds mask rows in worker threads with a per-row deadline
(`pantheon.scheduler.masks`), failing a request whose row is late, or whose matcher stops on one of
llguidance's own limits, alone.

Mask layout: one int32 word per 32 tokens, ``mask_words(vocab) = (vocab + 31) // 32``; bit ``t % 32`` of word
``t // 32`` set means token ``t`` may come next (the engine's `apply_mask` layout). Bits at positions >= vocab
mean nothing: `fill_all`/`ALL_ALLOWED_ROW` set them (a row of -1, what the engine uses for unconstrained
rows), a matcher clears them. Tokens the tokenizer does not have (``tokenizer.vocab_size <= t < vocab``, the
padding of a wider logits row) are never allowed.

Stop ids (the model's end-of-turn ids, passed to `Grammar.matcher`) are handled here, not by llguidance:

* they are allowed exactly when the grammar is accepting (the text so far is a complete document);
  when nothing else can follow, they are the only allowed tokens;
* consuming one ends the matcher (`done`); consuming one before the grammar is complete is a rejection;
* they are never treated as text, even when a stop id happens to be an ordinary token;
* a row is never all zeros: if the grammar allows nothing (an llguidance error or dead end, or after a
  rejected token) the stop ids are allowed, so the choice can end; `Matcher.error` then says why.

`done` becomes true as soon as nothing but a stop id can follow (e.g. right after the closing ``}``), so the
scheduler may finish the choice there without spending a step on the stop token, or take one more step
(whose row allows only the stop ids).

JSON whitespace: llguidance's default (any run of JSON whitespace between tokens) lets a model, or a noisy
sampler, emit whitespace forever. Every place that may hold whitespace takes at most one ``WHITESPACE``
match instead: one space, or a newline and up to 24 spaces/tabs of indentation. That covers compact,
``json.dumps`` and pretty-printed styles; nothing may precede the opening brace or follow the closing one.

Schema semantics are JSON Schema's, as enforced by llguidance 1.9: properties come in schema order,
``additionalProperties`` defaults to allowed, and a schema llguidance cannot enforce (``not``,
``uniqueItems``, look-around in ``pattern``, an unsatisfiable schema...) is refused with `UnsupportedSchema`
(HTTP 400) naming the feature, rather than silently unenforced. One exception: a string ``format``
llguidance does not know (``password``, ``binary``, ``uri-reference``...) is dropped as the annotation JSON
Schema says it is, unless the schema is ``strict`` (then it is refused, as OpenAI's strict mode does).
Known formats: `KNOWN_FORMATS`.

Tool calls follow the emitter's syntax (`pantheon.text.emitter`): ``<tool_call>`` + whitespace + a JSON object
``{"name": <declared name>, "arguments": <that tool's parameters>}`` + whitespace + ``</tool_call>``; for
``"required"`` one or more of them separated by whitespace, for a named tool exactly one. The tags are text
to llguidance: in Qwen's vocabulary ``<tool_call>`` is one (user-defined, not control) token whose bytes are
the tag, in SmolLM2's it is several ordinary tokens; both spellings match. Only control tokens (BOS, EOS,
turn markers) are special and never allowed inside the grammar. The grammar covers the whole output from
the first generated token, so no reasoning or text may come before the first call. A string argument that
contains the text ``</tool_call>`` would cut the block short in the emitter; the grammar does not forbid it.

Costs, measured on the 2-core CPU this was written on (shared, so noisy), llguidance 1.9.1, a noisy
random sampler driving a 5-property schema (nested object, array, pattern, email format), the two-tool
``required`` grammar and ``json_object``, a few hundred to a few thousand steps each:

* ``fill_mask`` + ``consume`` per token, median: 10-20 us on SmolLM2's 49k vocabulary, 35-50 us on Qwen's
  152k (80 us for free-form ``json_object``); 90th percentile 60-110 us / 80-190 us; the 99th percentile
  and the rare slow steps (a long lexeme, a fresh lexer state) take 0.2-5 ms, up to ~10 ms on a loaded CPU.
* Compiling (`Grammar.from_response_format` for that schema): 0.7-1 ms median, ~1.5 ms the first time;
  the two-tool grammar 1-2 ms. `Grammar.matcher` (a deep copy of the compiled prototype): ~40 us. Large
  schemas take longer: ~9 CPU-seconds for one object of 10k optional properties, which `SchemaLimits`
  refuses (its docstring and docs/http-api.md have the measured curve). The first mask is computed
  while compiling (a 3000-property grammar: 80 ms cold; 0.1 ms on a matcher copied from the warmed
  prototype).
* The first grammar for a tokenizer also builds llguidance's token trie: ~0.15 s for SmolLM2, ~0.5 s for
  Qwen (152k), ~3 s for Gemma 3 (262k). It is cached per tokenizer object; `prepare(tokenizer)` builds it
  ahead (at model load, in a thread).

Known gaps: llguidance's ``date-time`` accepts second 60 at any time of day (RFC 3339's
leap-second syntax), which strict validators reject except at 23:59:60Z. Tokens the tokenizer marks unused
(Qwen's ``[PAD...]`` fillers) are ordinary text to the grammar, as they are to the detokenizer.

Threads: a `Grammar` is immutable once built and may be shared; `Grammar.matcher` may be called from any
thread. A `Matcher` belongs to one thread at a time (a mask worker while it fills a row, the driver
while it consumes; the hand-over goes through the mask builder's lock); llguidance releases the GIL
while it computes a mask. Compiling holds no lock; llguidance releases the GIL while it compiles, but a
gevent greenlet would still block the hub for that time, so the server compiles in its pool
(`pantheon.web.bridge.WorkPool`). Two threads building the same tokenizer's trie at once both build
it; one result is kept.
"""

from __future__ import annotations

import functools
import json
import re
import weakref
from dataclasses import dataclass
from typing import Any, Iterable

import llguidance as llg
import numpy as np

from pantheon.contract import FORMAT_NAME_PATTERN
from pantheon.text.emitter import TOOL_CLOSE, TOOL_OPEN
from pantheon.errors import RequestError
from pantheon.types import stop_ids as model_stop_ids

# At most one of these at every place JSON allows whitespace (see the module docstring).
WHITESPACE = r"(?: |\n[ \t]{0,24})?"
# Between the tool-call tags and the JSON, and between calls.
_TAG_SPACE = r"[ \t\r\n]{0,4}"
# String formats llguidance 1.9 enforces; any other is an error in llguidance (kept only for strict schemas).
KNOWN_FORMATS = frozenset({"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6",
                           "uuid", "uri"})
_NAME_RE = re.compile(FORMAT_NAME_PATTERN)  # OpenAI's rule for response_format.json_schema.name
_MAX_MESSAGE = 400  # llguidance's messages can quote the schema; a client gets the first characters
# verbose_errors=False: error messages say what is wrong without dumping parser state and grammar.
_LIMITS = llg.LLParserLimits(verbose_errors=False)


class SchemaTooLarge(RequestError):
    """A schema past `SchemaLimits` (400 ``schema_too_large``), refused before llguidance sees it."""

    def __init__(self, message: str, param: str):
        super().__init__(f"{param}: {message}", param=param, code="schema_too_large")


class UnsupportedSchema(RequestError):
    """A JSON Schema that structured outputs cannot enforce (400). `feature` is llguidance's reason."""

    def __init__(self, feature: str, param: str):
        feature = feature.strip()
        if len(feature) > _MAX_MESSAGE:
            feature = feature[:_MAX_MESSAGE] + "..."
        self.feature = feature
        super().__init__(f"{param}: structured outputs cannot enforce this schema: {feature}", param=param)


# --- mask rows ----------------------------------------------------------------------------------------------


def mask_words(vocab: int) -> int:
    """int32 words in one mask row for a logits row of `vocab` entries."""
    return (vocab + 31) // 32


@functools.lru_cache(maxsize=16)
def ALL_ALLOWED_ROW(vocab: int) -> np.ndarray:  # noqa: N802 - the name the scheduler was promised
    """A read-only all-ones row (every token allowed, bits past `vocab` set too); copy it into a mask."""
    row = np.full(mask_words(vocab), -1, np.int32)
    row.flags.writeable = False
    return row


def fill_all(out: np.ndarray) -> None:
    """Make `out` (one mask row) allow every token; bits past the vocabulary are set too."""
    out.fill(-1)


def _bit(token: int) -> tuple[int, np.int32]:
    """(word index, int32 with the token's bit set)."""
    return token >> 5, np.uint32(1 << (token & 31)).view(np.int32)


# --- tokenizer bridge -----------------------------------------------------------------------------------------


class _TokenizerView:
    """What `llguidance.TokenizerWrapper` reads: the exact byte string of every token (the same table our
    detokenizer uses, so the grammar sees the text a client sees), the control tokens as special ids, and
    an encoder (llguidance tokenizes grammar literals with it)."""

    def __init__(self, tokenizer: Any):
        n = tokenizer.vocab_size
        self._tok = tokenizer
        self.tokens = [tokenizer.token_bytes(i) for i in range(n)]
        self.special_token_ids = [i for i in range(n) if tokenizer.is_control(i)]
        self.bos_token_id = tokenizer.bos_id
        eos = tokenizer.eos_id
        if eos is None:
            eos = min(tokenizer.eot_ids, default=None)
        if eos is None:
            # llguidance needs an EOS; give it a token of its own past the vocabulary (never allowed here).
            eos = n
            self.tokens.append(b"")
            self.special_token_ids.append(n)
        self.eos_token_id = eos

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):  # TokenizerWrapper probes with bytes; refused, it passes str
            raise TypeError("text must be a str")
        return self._tok.encode(text)


_LLG_TOKENIZERS: "weakref.WeakKeyDictionary[Any, llg.LLTokenizer]" = weakref.WeakKeyDictionary()


def prepare(tokenizer: Any) -> llg.LLTokenizer:
    """llguidance's view of `tokenizer` (its token trie), built once per tokenizer object and cached.

    Building takes ~0.15 s for a 49k vocabulary, ~0.5 s for 152k and ~3 s for 262k; call this at model
    load (in a thread) so that the first structured request does not pay it.
    """
    lt = _LLG_TOKENIZERS.get(tokenizer)
    if lt is None:
        lt = llg.LLTokenizer(llg.TokenizerWrapper(_TokenizerView(tokenizer)))
        lt = _LLG_TOKENIZERS.setdefault(tokenizer, lt)
    return lt


# --- schema handling ------------------------------------------------------------------------------------------

# Keywords whose value is a subschema, a list of subschemas, or a map of name -> subschema.
_ONE = ("items", "additionalItems", "additionalProperties", "not", "if", "then", "else", "contains",
        "propertyNames", "unevaluatedItems", "unevaluatedProperties", "contentSchema")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _subschemas(node: dict) -> Iterable[dict]:
    for key in _ONE:
        if isinstance(node.get(key), dict):
            yield node[key]
    for key in _LIST:
        if isinstance(node.get(key), list):
            yield from (s for s in node[key] if isinstance(s, dict))
    for key in _MAP:
        if isinstance(node.get(key), dict):
            yield from (s for s in node[key].values() if isinstance(s, dict))


def _unknown_format_nodes(schema: dict) -> list[dict]:
    """Schema nodes whose ``format`` llguidance would refuse (iterative: schemas can nest deeply)."""
    found, stack = [], [schema]
    while stack:
        node = stack.pop()
        fmt = node.get("format")
        if isinstance(fmt, str) and fmt not in KNOWN_FORMATS:
            found.append(node)
        stack.extend(_subschemas(node))
    return found


@dataclass(frozen=True)
class SchemaLimits:
    """How large a schema may be before it is refused uncompiled (`SchemaTooLarge`).

    Why these three: llguidance's compile time (which cannot be interrupted) grows with the schema's
    subschemas, with the square of one object's optional properties, and steeply with
    patternProperties; its own cap (50k compiled nodes) sits far above the range where a compile takes
    seconds. Measured on SmolLM2's tokenizer (docs/http-api.md, "Structured outputs: limits"): one
    object of 10k optional string properties (340 kB) takes ~8.6 CPU-seconds to compile, 5k 1.8 s, 2k
    0.28 s, 1k 0.08 s, 500 0.02 s; 10k required ones 0.86 s; 10k spread over objects of 100 0.56 s;
    200 patternProperties 0.4 s (400: 6 s). Within these defaults the worst compile measured is ~0.3
    CPU-seconds. They also keep a schema generatable: an object of more than ~498 optional properties
    compiles, but llguidance's 2000-item parser row refuses its opening brace.
    """

    max_nodes: int = 5000  # subschemas (every JSON object in the schema) plus enum values
    max_properties: int = 400  # optional properties (not in `required`) of one object
    max_pattern_properties: int = 100  # patternProperties entries, the whole schema together


DEFAULT_LIMITS = SchemaLimits()


def check_size(schema: Any, limits: SchemaLimits, param: str) -> None:
    """Raise `SchemaTooLarge` when `schema` is past `limits` (iterative, and it stops at the first
    limit passed, so a huge schema costs no more than the limit to refuse)."""
    nodes = patterns = 0
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        nodes += 1
        if isinstance(node.get("enum"), list):
            nodes += len(node["enum"])
        props = node.get("properties")
        if isinstance(props, dict) and len(props) > limits.max_properties:
            required = node.get("required")
            optional = len(set(props) - set(r for r in required if isinstance(r, str))) \
                if isinstance(required, list) else len(props)
            if optional > limits.max_properties:
                raise SchemaTooLarge(f"an object with {optional} optional properties; structured outputs take at "
                                     f"most {limits.max_properties} in one object (PANTHEON_GRAMMAR_MAX_PROPERTIES): "
                                     "compiling the grammar takes time that grows with the square of that count "
                                     "(list them in `required`, or split the object)", param)
        if isinstance(node.get("patternProperties"), dict):
            patterns += len(node["patternProperties"])
            if patterns > limits.max_pattern_properties:
                raise SchemaTooLarge(f"more than {limits.max_pattern_properties} patternProperties entries; "
                                     "structured outputs take at most that many in one schema (compiling them "
                                     "takes time that grows steeply with their count)", param)
        if nodes > limits.max_nodes:
            raise SchemaTooLarge(f"more than {limits.max_nodes} subschemas and enum values; structured outputs "
                                 f"take at most that many (PANTHEON_GRAMMAR_MAX_NODES): compiling the grammar "
                                 "takes time that grows with them", param)
        stack.extend(_subschemas(node))


def _prepare_schema(schema: dict, strict: bool, param: str) -> dict:
    """The schema llguidance gets: unknown formats dropped unless strict (a copy only when that changes it)."""
    if strict or not _unknown_format_nodes(schema):
        return schema
    try:
        schema = json.loads(json.dumps(schema))
    except (TypeError, ValueError, RecursionError) as exc:
        raise RequestError(f"{param} is not a JSON Schema: {exc}", param=param) from exc
    for node in _unknown_format_nodes(schema):
        del node["format"]
    return schema


def _with_whitespace(schema: dict) -> dict:
    """`schema` with our whitespace rule in its top-level llguidance options (a client's x-guidance keeps
    its other keys)."""
    opts = schema.get("x-guidance")
    opts = dict(opts) if isinstance(opts, dict) else {}
    opts["whitespace_pattern"] = WHITESPACE
    return {**schema, "x-guidance": opts}


# --- grammars -------------------------------------------------------------------------------------------------


class Grammar:
    """A compiled grammar for one request (immutable; any thread). Make one `matcher` per choice."""

    def __init__(self, proto: llg.LLMatcher, tokenizer: Any, kind: str, source: str):
        """Low-level; use `from_response_format`, `for_tools` or `from_json_schema`."""
        self._proto = proto
        self._tokenizer = tokenizer
        self._llg_vocab = prepare(tokenizer).vocab_size
        self._llg_eos = tuple(prepare(tokenizer).eos_tokens)
        self.kind = kind  # "json_object" | "json_schema" | "tools"
        # the request field a failure while generating is blamed on (the scheduler's error names it)
        self.param = "tools" if kind == "tools" else "response_format"
        self.source = source  # the llguidance grammar (for logs and debugging)
        self.warnings: list[str] = list(proto.get_grammar_warnings())

    # -- construction ----------------------------------------------------------------------------------------

    @classmethod
    def _compile(cls, grammar: str, tokenizer: Any, kind: str, param: str) -> "Grammar":
        m = _matcher_of(grammar, tokenizer)
        if m.is_error():
            raise UnsupportedSchema(m.get_error(), param)
        return cls(m, tokenizer, kind, grammar)

    @classmethod
    def from_json_schema(cls, schema: Any, tokenizer: Any, *, strict: bool = False,
                         param: str = "response_format.json_schema.schema", kind: str = "json_schema",
                         limits: SchemaLimits = DEFAULT_LIMITS) -> "Grammar":
        """A grammar for JSON documents valid against `schema` (a JSON Schema object); `SchemaTooLarge`
        past `limits`."""
        if not isinstance(schema, dict):
            raise RequestError(f"{param} must be a JSON Schema object", param=param)
        check_size(schema, limits, param)
        schema = _with_whitespace(_prepare_schema(schema, strict, param))
        try:
            grammar = llg.LLMatcher.grammar_from_json_schema(schema)
        except (ValueError, TypeError, RecursionError) as exc:
            raise RequestError(f"{param} is not a JSON Schema: {exc}", param=param) from exc
        return cls._compile(grammar, tokenizer, kind, param)

    @classmethod
    def from_response_format(cls, rf: Any, tokenizer: Any, limits: SchemaLimits = DEFAULT_LIMITS) -> "Grammar | None":
        """The grammar an OpenAI ``response_format`` asks for; None for ``{"type": "text"}``.

        ``{"type": "json_object"}``: any JSON object. ``{"type": "json_schema", "json_schema": {"name": ...,
        "schema": {...}, "strict": bool, "description": str}}``: a document valid against the schema.
        llama.cpp's ``{"type": "json_object", "schema": {...}}`` is accepted too. Raises RequestError
        naming the field for a malformed value, UnsupportedSchema for a schema that cannot be enforced,
        SchemaTooLarge for one past `limits`.
        """
        if not isinstance(rf, dict):
            raise RequestError("response_format must be an object", param="response_format")
        kind = rf.get("type")
        allowed = {"text": {"type"}, "json_object": {"type", "schema"}, "json_schema": {"type", "json_schema"}}
        if kind not in allowed:
            raise RequestError('response_format.type must be "text", "json_object" or "json_schema"',
                               param="response_format.type")
        extra = sorted(set(rf) - allowed[kind])
        if extra:
            raise RequestError(f"response_format.{extra[0]} is not supported with type {kind!r}",
                               param=f"response_format.{extra[0]}")
        if kind == "text":
            return None
        if kind == "json_object":
            schema = rf.get("schema")
            if schema is None:
                schema = {"type": "object"}
            return cls.from_json_schema(schema, tokenizer, param="response_format.schema", kind="json_object",
                                        limits=limits)
        js = rf.get("json_schema")
        p = "response_format.json_schema"
        if not isinstance(js, dict):
            raise RequestError(f"{p} must be an object with name and schema", param=p)
        extra = sorted(set(js) - {"name", "schema", "strict", "description"})
        if extra:
            raise RequestError(f"{p}.{extra[0]} is not supported", param=f"{p}.{extra[0]}")
        name = js.get("name")
        if not isinstance(name, str) or not _NAME_RE.fullmatch(name):  # fullmatch: "$" passes a final "\n"
            raise RequestError(f"{p}.name is required: 1 to 64 characters of a-z, A-Z, 0-9, _ and -",
                               param=f"{p}.name")
        if "description" in js and not isinstance(js["description"], str):
            raise RequestError(f"{p}.description must be a string", param=f"{p}.description")
        strict = js.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise RequestError(f"{p}.strict must be true or false", param=f"{p}.strict")
        if "schema" not in js:
            raise RequestError(f"{p}.schema is required", param=f"{p}.schema")
        return cls.from_json_schema(js["schema"], tokenizer, strict=bool(strict), param=f"{p}.schema", limits=limits)

    @classmethod
    def for_tools(cls, tools: Any, choice: Any, tokenizer: Any, *, parallel: bool = True,
                  limits: SchemaLimits = DEFAULT_LIMITS) -> "Grammar | None":
        """The grammar of a forced tool call: ``choice`` ``"required"`` (one or more calls to declared tools,
        exactly one when not `parallel`) or ``{"type": "function", "function": {"name": N}}`` (one call to
        N). None for ``"auto"``/``"none"`` (nothing is forced). `tools` are OpenAI tool objects; each
        call's arguments must match its tool's ``parameters`` (no parameters: an empty object).

        Raises RequestError for malformed tools or an unknown name, UnsupportedSchema (param
        ``tools[i].function.parameters``) for parameters that cannot be enforced, SchemaTooLarge (param
        ``tools``) when the forced tools' parameters together are past `limits`.
        """
        if choice in ("auto", "none", None):
            return None
        specs = _tool_specs(tools)
        if choice == "required":
            wanted = list(range(len(specs)))
            single = not parallel
        elif (isinstance(choice, dict) and choice.get("type") == "function"
              and isinstance(choice.get("function"), dict)):
            name = choice["function"].get("name")
            wanted = [i for i, (n, _, _) in enumerate(specs) if n == name]
            if not wanted:
                raise RequestError(f"tool_choice.function.name: no tool named {name!r} in tools",
                                   param="tool_choice.function.name")
            wanted = wanted[:1]
            single = True
        else:
            raise RequestError('tool_choice must be "none", "auto", "required" or '
                               '{"type": "function", "function": {"name": ...}}', param="tool_choice")
        calls = []
        for i in wanted:
            name, params, strict = specs[i]
            params = _prepare_schema(params, strict, f"tools[{i}].function.parameters")
            # Its own base URI makes the parameters a separate schema resource, so that their "#/$defs/..."
            # references resolve inside them rather than against the call wrapper (pydantic writes those).
            params = params if "$id" in params else {"$id": f"urn:pantheon:tools:{i}", **params}
            calls.append(_call_schema(name, params))
        body = calls[0] if len(calls) == 1 else {"anyOf": calls}
        check_size(body, limits, "tools")
        grammar = _tool_grammar(_with_whitespace(body), single)
        try:
            return cls._compile(grammar, tokenizer, "tools", "tools")
        except UnsupportedSchema:
            # Name the tool whose parameters are at fault, when one alone fails.
            for i, call in zip(wanted, calls):
                probe = _matcher_of(_tool_grammar(_with_whitespace(call), True), tokenizer)
                if probe.is_error():
                    raise UnsupportedSchema(probe.get_error(), f"tools[{i}].function.parameters") from None
            raise

    # -- use -----------------------------------------------------------------------------------------------------

    def matcher(self, stop_ids: Iterable[int], vocab: int) -> "Matcher":
        """A fresh matcher for one choice. `stop_ids`: the request's (pantheon.types.stop_ids); when it has
        none (ignore_eos), the model's own set, so the grammar still has an end; `vocab`: the logits width,
        which may exceed the tokenizer's."""
        stops = sorted({int(t) for t in stop_ids if 0 <= int(t) < vocab})
        if not stops:
            stops = sorted({t for t in model_stop_ids(self._tokenizer) if t < vocab})
        if not stops:
            raise ValueError("a structured matcher needs at least one stop id below the vocabulary size")
        return Matcher(self._proto.deep_copy(), stops, vocab, self._llg_vocab, self._llg_eos)


def _matcher_of(grammar: str, tokenizer: Any) -> llg.LLMatcher:
    """llguidance's matcher for `grammar`, with its first mask already computed (check `is_error()`).

    Why the first mask here: a fresh grammar's first mask builds its lexer states, which for a large
    schema takes milliseconds to a tenth of a second; computed on the prototype in the compile thread,
    every matcher `Grammar.matcher` copies from it starts warm (measured: a 3000-property schema's first
    mask 80 ms cold, 0.1 ms on a copy of the warmed prototype), so the scheduler's first row for the
    request costs what any row does. A grammar that fails at its very first mask fails here, as a 400.
    """
    lt = prepare(tokenizer)
    m = llg.LLMatcher(lt, grammar, log_level=0, limits=_LIMITS)
    if not m.is_error():
        row = np.zeros(mask_words(lt.vocab_size), np.int32)
        m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
    return m


def _tool_specs(tools: Any) -> list[tuple[str, dict, bool]]:
    """(name, parameters schema, strict) per tool, checking only what the grammar relies on (the web
    layer validates the rest)."""
    if not isinstance(tools, list) or not tools:
        raise RequestError("tools must be a non-empty list to force a tool call", param="tools")
    out = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RequestError(f"tools[{i}].function.name must be a non-empty string",
                               param=f"tools[{i}].function.name")
        params = fn.get("parameters")
        if params is None:  # OpenAI: no parameters is a function without arguments
            params = {"type": "object", "properties": {}, "additionalProperties": False}
        if not isinstance(params, dict):
            raise RequestError(f"tools[{i}].function.parameters must be a JSON Schema object",
                               param=f"tools[{i}].function.parameters")
        out.append((fn["name"], params, fn.get("strict") is True))
    return out


def _call_schema(name: str, params: dict) -> dict:
    """The JSON of one call, exactly what `pantheon.text.emitter.parse_tool_call` reads."""
    return {"type": "object", "properties": {"name": {"const": name}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def _tool_grammar(call_schema: dict, single: bool) -> str:
    """A Lark grammar around the call JSON, which goes in as a separate named grammar (no escaping of the
    schema inside Lark text)."""
    lark = "\n".join([
        "start: call" if single else "start: call (SEP call)*",
        f"call: {json.dumps(TOOL_OPEN)} SEP @call_json SEP {json.dumps(TOOL_CLOSE)}",
        f"SEP: /{_TAG_SPACE}/",
    ])
    return json.dumps({"grammars": [{"lark_grammar": lark}, {"name": "call_json", "json_schema": call_schema}]})


# --- matching -------------------------------------------------------------------------------------------------


class Matcher:
    """One choice's position in a grammar: fills mask rows and follows the sampled tokens.

    Not thread-safe: one thread at a time (a mask worker fills a row, then the driver consumes).
    """

    def __init__(self, m: llg.LLMatcher, stops: list[int], vocab: int, llg_vocab: int, llg_eos: tuple[int, ...]):
        """Low-level; use `Grammar.matcher`."""
        self._m = m
        self._vocab = vocab
        self._words = mask_words(vocab)
        self._llg_vocab = llg_vocab
        self._llg_words = mask_words(llg_vocab)
        # llguidance writes its own row size; a narrower logits row gets a copy through this buffer
        self._scratch = np.zeros(self._llg_words, np.int32) if self._llg_words > self._words else None
        self._stop_set = frozenset(stops)
        self._llg_eos = frozenset(llg_eos)
        self._stop_bits = [_bit(t) for t in stops]
        # llguidance's EOS bit marks "accepting"; the stop ids replace it (it may not be one of them), and
        # a stop id that is also ordinary text is never offered as text
        self._clear = [(w, ~b) for w, b in (_bit(t) for t in sorted({*llg_eos, *stops}) if t < self._words * 32)]
        self._ended = False  # a stop id was consumed
        self._dead = False  # the last row had nothing but the fallback stop ids
        self._error: str | None = None

    @property
    def done(self) -> bool:
        """Nothing but a stop id can follow (the document is complete), a stop id was consumed, or a
        token was rejected."""
        return self._ended or self._error is not None or self._m.is_stopped()

    @property
    def accepting(self) -> bool:
        """The text so far is a complete document (a stop id may come next)."""
        return self._error is None and self._m.is_accepting()

    @property
    def error(self) -> str | None:
        """Why the matcher stopped without completing the grammar (a rejected token, an llguidance
        error or a dead end); None otherwise."""
        if self._error is None and self._m.is_error():
            self._error = self._m.get_error()
        if self._error is None and self._dead:
            return "no token can continue the output (only the stop ids were offered)"
        return self._error

    def fill_mask(self, out: np.ndarray) -> None:
        """Write the allowed next tokens into `out`, an ``int32[mask_words(vocab)]`` C-contiguous row."""
        if out.dtype != np.int32 or out.shape != (self._words,) or not out.flags.c_contiguous:
            raise ValueError(f"mask row must be contiguous int32[{self._words}], got {out.dtype}{list(out.shape)}")
        if self.done:
            out.fill(0)
            self._set_stops(out)
            return
        if self._scratch is None:
            self._m.unsafe_compute_mask_ptr(out.ctypes.data, 4 * self._llg_words)
            out[self._llg_words:] = 0
        else:
            self._m.unsafe_compute_mask_ptr(self._scratch.ctypes.data, self._scratch.nbytes)
            out[:] = self._scratch[:self._words]
            if self._vocab % 32:
                out[-1] &= np.uint32((1 << (self._vocab % 32)) - 1).view(np.int32)
        for w, keep in self._clear:
            out[w] &= keep
        if self._m.is_accepting():
            self._set_stops(out)
        elif not out.any():
            self._dead = True
            self._set_stops(out)

    def _set_stops(self, out: np.ndarray) -> None:
        for w, b in self._stop_bits:
            out[w] |= b

    def consume(self, token: int) -> bool:
        """Advance by the sampled token. False when the grammar rejects it; the matcher is then done and
        its rows allow only the stop ids. A stop id is accepted when the grammar is complete (or dead)."""
        token = int(token)
        if self._ended or self._error is not None:
            return False
        if token in self._stop_set:
            if self._m.is_accepting() or self._m.is_stopped() or self._dead:
                self._ended = True
                return True
            self._error = f"stop token {token} before the output was complete"
            return False
        if not 0 <= token < self._llg_vocab or token in self._llg_eos:
            self._error = f"token {token} is not allowed by the grammar"
            return False
        if not self._m.consume_token(token):
            self._error = self._m.get_error() or f"token {token} is not allowed by the grammar"
            return False
        return True
