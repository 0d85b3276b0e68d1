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

from pantheon.errors import RequestError
from pantheon.types import LOGIT_BIAS_RANGE, MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS, SamplingParams
from pantheon.web.body import shown

MAX_STOP = 4
MAX_STOP_CHARS = 512
MAX_ID_CHARS = 256
MAX_TOKENS_LIMIT = 1 << 31  # an integer field's ceiling where the real bound is the model's context


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
    (Responses' function tools, Messages' custom tools): a unique name of 1-64 characters and a
    string description. Adds the name to `seen`."""
    name = t.get("name")
    if not isinstance(name, str) or not name or len(name) > 64:
        raise bad(f"{p}.name", "must be a non-empty string of at most 64 characters")
    if name in seen:
        raise bad(f"{p}.name", f"duplicate tool name {name[:64]!r}")
    seen.add(name)
    if "description" in t and not isinstance(t["description"], str):
        raise bad(f"{p}.description", "must be a string")
    return name

def is_num(v: Any) -> bool:
    """A JSON number. Integers are exact (math.isfinite would overflow on an integer literal past 1e308)."""
    if isinstance(v, bool):
        return False
    return isinstance(v, int) or (isinstance(v, float) and math.isfinite(v))


def number(body: Mapping, key: str, lo: float, hi: float, lo_open: bool = False) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if not is_num(v):
        raise bad(key, f"must be a number, got {json.dumps(v)[:40]}")
    if v < lo or v > hi or (lo_open and v == lo):
        raise bad(key, f"must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {shown(repr(v))}")
    return float(v)


def integer(body: Mapping, key: str, lo: int, hi: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not isinstance(v, int) or isinstance(v, bool):
        raise bad(key, f"must be an integer, got {json.dumps(v)[:40]}")
    if v < lo or v > hi:
        raise bad(key, f"must be in [{lo}, {hi}], got {v}")
    return v


def string(body: Mapping, key: str, max_len: int = MAX_ID_CHARS) -> str | None:
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
    """`stop`: a string or at most MAX_STOP strings; empty ones are dropped (they would match at once)."""
    s = body.get("stop")
    if s is None:
        return ()
    items = [s] if isinstance(s, str) else s
    if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
        raise bad("stop", "must be a string or a list of strings")
    if len(items) > MAX_STOP:
        raise bad("stop", f"at most {MAX_STOP} stop strings are allowed")
    if any(len(x) > MAX_STOP_CHARS for x in items):
        raise bad("stop", f"a stop string may have at most {MAX_STOP_CHARS} characters")
    return tuple(x for x in items if x)


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


def sampling_params(body: Mapping) -> SamplingParams:
    """The sampling knobs (temperature, top_p, top_k, min_p, the penalties, seed) as SamplingParams."""
    temperature = number(body, "temperature", 0.0, 2.0)
    top_p = number(body, "top_p", 0.0, 1.0, lo_open=True)
    top_k = integer(body, "top_k", -1, 1 << 30)
    min_p = number(body, "min_p", 0.0, 1.0)
    rep = number(body, "repetition_penalty", 0.0, 10.0, lo_open=True)
    pres = number(body, "presence_penalty", -2.0, 2.0)
    freq = number(body, "frequency_penalty", -2.0, 2.0)
    seed = integer(body, "seed", -(1 << 63), (1 << 63) - 1)  # a signed 64-bit integer, as OpenAI's
    try:
        return SamplingParams(
            temperature=1.0 if temperature is None else temperature,
            top_k=0 if top_k is None or top_k < 0 else top_k,
            top_p=1.0 if top_p is None else top_p,
            min_p=0.0 if min_p is None else min_p,
            repetition_penalty=1.0 if rep is None else rep,
            presence_penalty=0.0 if pres is None else pres,
            frequency_penalty=0.0 if freq is None else freq,
            seed=seed,
        )
    except ValueError as exc:  # SamplingParams names the field first
        field = str(exc).split(" ", 1)[0]
        raise RequestError(str(exc), param=field) from None


def choices_n(body: Mapping) -> int:
    """`n`, the number of choices: at least 1 here; the model's slot count bounds it when the request starts."""
    n = integer(body, "n", 1, MAX_TOKENS_LIMIT)
    return 1 if n is None else n


def top_logprobs(body: Mapping, key: str = "top_logprobs") -> int:
    """A count of alternatives per token, 0..MAX_TOP_LOGPROBS (OpenAI's limit)."""
    k = integer(body, key, 0, MAX_TOP_LOGPROBS)
    return 0 if k is None else k


def logit_bias(body: Mapping) -> tuple[tuple[int, float], ...]:
    """`logit_bias`: {"<token id>": bias in [-100, 100]} with at most MAX_LOGIT_BIAS entries, as (id, bias)
    pairs in the client's order. Ids are checked against the model's vocabulary when the request starts."""
    lb = body.get("logit_bias")
    if lb is None:
        return ()
    if not isinstance(lb, dict):
        raise bad("logit_bias", "must be an object mapping token ids (as strings) to numbers in [-100, 100]")
    if len(lb) > MAX_LOGIT_BIAS:
        raise bad("logit_bias", f"at most {MAX_LOGIT_BIAS} entries are allowed, got {len(lb)}")
    out: list[tuple[int, float]] = []
    seen: set[int] = set()
    for key, v in lb.items():
        if not (key.isascii() and key.isdigit()) or len(key) > 10:
            raise bad("logit_bias", f"keys must be token ids written in decimal, got {shown(json.dumps(key))}")
        tid = int(key)
        if tid in seen:
            raise bad("logit_bias", f"token id {tid} appears twice")
        seen.add(tid)
        if not is_num(v) or not -LOGIT_BIAS_RANGE <= v <= LOGIT_BIAS_RANGE:
            raise bad("logit_bias", f"the bias of token {tid} must be a number in [-100, 100], "
                                    f"got {json.dumps(v)[:40]}")
        out.append((tid, float(v)))
    return tuple(out)
