"""Checks of single request-body fields, shared by every generation route (chat and legacy completions).

Each helper reads one field (or one group that only makes sense together: the sampling knobs, `stream`
with `stream_options`) and either returns its value or raises a 400 `RequestError` naming the field,
so the two routes refuse the same bad value with the same message. Checks that need the model (token
ids against its vocabulary, `n` against its slots) happen when the request starts, in
pantheon.web.generation.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from pantheon.contract import (
    ID_CHARS,
    LOGIT_BIAS_KEY_DIGITS,
    LOGIT_BIAS_VALUE,
    MAX_LOGIT_BIAS,
    METADATA_KEY_CHARS,
    METADATA_MAX,
    METADATA_VALUE_CHARS,
    SAMPLING,
    STOP_CHARS,
    STOP_MAX,
    TOOL_NAME_CHARS,
    Bound,
)
from pantheon.errors import RequestError
from pantheon.types import SamplingParams
from pantheon.web.body import shown


def body_object(body: Any, allowed: frozenset[str]) -> dict:
    """`body` if it is a JSON object holding only `allowed` fields; else a 400 naming the first other
    field (a route never ignores a field it does not honour). Every route's first check."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", param=None)
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise bad(unknown[0], "is not a supported field" +
                  (f" (also unsupported: {', '.join(shown(u) for u in unknown[1:6])})" if len(unknown) > 1 else ""))
    return body


def bad(param: str, message: str) -> RequestError:
    """A 400 naming `param` (shortened: a field name is the client's text)."""
    param = shown(param)
    return RequestError(f"{param}: {message}", param=param)



def tool_name(t: Mapping[str, Any], p: str, seen: set[str]) -> str:
    """A declared tool's name and description checked, the same rule for every API that takes tools
    (chat's functions, Responses' function tools, Messages' custom tools): a unique name of 1 to
    TOOL_NAME_CHARS characters and a string description. Adds the name to `seen`."""
    name = t.get("name")
    if not isinstance(name, str) or not name or len(name) > TOOL_NAME_CHARS:
        raise bad(f"{p}.name", f"must be a non-empty string of at most {TOOL_NAME_CHARS} characters")
    if name in seen:
        raise bad(f"{p}.name", f"duplicate tool name {name[:TOOL_NAME_CHARS]!r}")
    seen.add(name)
    if "description" in t and not isinstance(t["description"], str):
        raise bad(f"{p}.description", "must be a string")
    return name


def is_num(v: Any) -> bool:
    """A JSON number. Integers are exact (math.isfinite would overflow on an integer literal past 1e308)."""
    if isinstance(v, bool):
        return False
    return isinstance(v, int) or (isinstance(v, float) and math.isfinite(v))


def number(body: Mapping, key: str, b: Bound, at: str = "") -> float | None:
    """A JSON number in the contract's range `b`, or None when absent (or null). `at`: the path of
    `body` in the request ("thinking."), which the 400 puts before the field's name."""
    v = body.get(key)
    if v is None:
        return None
    if not is_num(v):
        raise bad(at + key, f"must be a number, got {json.dumps(v)[:40]}")
    if not b.holds(v):
        raise bad(at + key, f"must be in {b.interval()}, got {shown(repr(v))}")
    return float(v)


def integer(body: Mapping, key: str, b: Bound, at: str = "") -> int | None:
    """A JSON integer (2.0 counts) in the contract's range `b`, or None when absent (or null)."""
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not isinstance(v, int) or isinstance(v, bool):
        raise bad(at + key, f"must be an integer, got {json.dumps(v)[:40]}")
    if not b.holds(v):
        raise bad(at + key, f"must be in {b.interval()}, got {v}")
    return v


def bounded(body: Mapping, key: str, table: Mapping[str, Bound], at: str = "") -> float | int | None:
    """Field `key` checked against its row of a route's contract table (pantheon.contract): the only
    way a validator reads a numeric bound, so the check and /openapi.json cannot drift apart."""
    b = table[key]
    return integer(body, key, b, at) if b.kind == "integer" else number(body, key, b, at)


def string(body: Mapping, key: str, max_len: int = ID_CHARS) -> str | None:
    v = body.get(key)
    if v is None:
        return None
    if not isinstance(v, str):
        raise bad(key, "must be a string")
    if len(v) > max_len:
        raise bad(key, f"must be at most {max_len} characters")
    return v


def boolean(body: Mapping, key: str) -> bool | None:
    v = body.get(key)
    if v is None:
        return None
    if not isinstance(v, bool):
        raise bad(key, "must be true or false")
    return v


def stop_strings(body: Mapping) -> tuple[str, ...]:
    """`stop`: a string or at most STOP_MAX strings; empty ones are dropped (they would match at once)."""
    return stop_list(body, "stop", one_allowed=True)


def stop_list(body: Mapping, key: str, one_allowed: bool = False) -> tuple[str, ...]:
    """Stop strings under `key` (`stop`, Messages' `stop_sequences`): a list of at most STOP_MAX strings
    of at most STOP_CHARS characters each (`one_allowed`: a single string too); empty ones dropped."""
    s = body.get(key)
    if s is None:
        return ()
    items = [s] if one_allowed and isinstance(s, str) else s
    if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
        raise bad(key, "must be a string or a list of strings" if one_allowed else "must be a list of strings")
    if len(items) > STOP_MAX:
        raise bad(key, f"at most {STOP_MAX} stop strings are allowed")
    if any(len(x) > STOP_CHARS for x in items):
        raise bad(key, f"a stop string may have at most {STOP_CHARS} characters")
    return tuple(x for x in items if x)


def metadata(body: Mapping) -> dict:
    """`metadata` (chat, Responses): at most METADATA_MAX string values under short keys; kept, not used."""
    md = body.get("metadata")
    if md is None:
        return {}
    if not isinstance(md, dict) or len(md) > METADATA_MAX:
        raise bad("metadata", f"must be an object of at most {METADATA_MAX} string values")
    for k, v in md.items():
        if len(k) > METADATA_KEY_CHARS or not isinstance(v, str) or len(v) > METADATA_VALUE_CHARS:
            raise bad(f"metadata.{k}", f"keys are at most {METADATA_KEY_CHARS} characters and values strings "
                                       f"of at most {METADATA_VALUE_CHARS}")
    return md


def stream_flags(body: Mapping) -> tuple[bool, bool]:
    """(`stream`, `stream_options.include_usage`); stream_options is only allowed with stream true."""
    stream = bool(boolean(body, "stream"))
    so = body.get("stream_options")
    if so is None:
        return stream, False
    if not stream:
        raise bad("stream_options", "is only allowed when stream is true")
    if not isinstance(so, dict):
        raise bad("stream_options", "must be an object")
    extra = sorted(set(so) - {"include_usage"})
    if extra:
        raise bad(f"stream_options.{extra[0]}", "is not supported")
    iu = so.get("include_usage")
    if iu is not None and not isinstance(iu, bool):
        raise bad("stream_options.include_usage", "must be true or false")
    return stream, bool(iu)


def sampling_params(body: Mapping, table: Mapping[str, Bound] = SAMPLING) -> SamplingParams:
    """The sampling knobs of `body` (those of the contract's SAMPLING a route's `table` has) as
    SamplingParams; an absent knob takes the contract's default. A route whose table narrows a
    knob (Messages' temperature) is held to its own range first, then to SamplingParams' own."""
    given = {}
    for key in SAMPLING:
        if key in table:
            v = bounded(body, key, table)
            if v is not None:
                given[key] = v
    try:
        return SamplingParams(**given)
    except ValueError as exc:  # SamplingParams names the field first
        field = str(exc).split(" ", 1)[0]
        raise RequestError(str(exc), param=field) from None


def choices_n(body: Mapping, table: Mapping[str, Bound]) -> int:
    """`n`, the number of choices: at least 1 here; the model's slot count bounds it when the request starts."""
    n = bounded(body, "n", table)
    return 1 if n is None else n


def top_logprobs(body: Mapping, table: Mapping[str, Bound], key: str = "top_logprobs") -> int:
    """A count of alternatives per token, in the contract's range (0 to OpenAI's limit)."""
    k = bounded(body, key, table)
    return 0 if k is None else k


def logit_bias(body: Mapping) -> tuple[tuple[int, float], ...]:
    """`logit_bias`: {"<token id>": bias in LOGIT_BIAS_VALUE} with at most MAX_LOGIT_BIAS entries, as (id,
    bias) pairs in the client's order. Ids are checked against the model's vocabulary when the request starts."""
    lb = body.get("logit_bias")
    if lb is None:
        return ()
    span = LOGIT_BIAS_VALUE.interval()
    if not isinstance(lb, dict):
        raise bad("logit_bias", f"must be an object mapping token ids (as strings) to numbers in {span}")
    if len(lb) > MAX_LOGIT_BIAS:
        raise bad("logit_bias", f"at most {MAX_LOGIT_BIAS} entries are allowed, got {len(lb)}")
    out: list[tuple[int, float]] = []
    seen: set[int] = set()
    for key, v in lb.items():
        if not (key.isascii() and key.isdigit()) or len(key) > LOGIT_BIAS_KEY_DIGITS:
            raise bad("logit_bias", f"keys must be token ids written in decimal, got {shown(json.dumps(key))}")
        tid = int(key)
        if tid in seen:
            raise bad("logit_bias", f"token id {tid} appears twice")
        seen.add(tid)
        if not is_num(v) or not LOGIT_BIAS_VALUE.holds(v):
            raise bad("logit_bias", f"the bias of token {tid} must be a number in {span}, "
                                    f"got {json.dumps(v)[:40]}")
        out.append((tid, float(v)))
    return tuple(out)
