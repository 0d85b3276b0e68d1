"""Log probabilities in the two OpenAI shapes: chat's per-token objects and legacy completions' columns.

The backend hands over `TokenLogprob(id, logprob, top)` records; this module is the one place that turns
them into JSON. A token's text is its own piece as the tokenizer decodes it alone (`token_text`: a partial
UTF-8 character shows as U+FFFD), and its `bytes` are the raw bytes it stands for (for a byte-fallback
token, the one byte), so a client can rebuild text that is split inside a character.

Log probabilities are finite in the JSON: a token the grammar or a -100 bias masked out has -inf, which
JSON cannot carry, so it is written as -9999.0 (OpenAI's own floor for such tokens).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from pantheon.types import TokenLogprob

LOGPROB_FLOOR = -9999.0


def finite(lp: float) -> float:
    """`lp` as JSON can carry it: -inf (and NaN) become LOGPROB_FLOOR."""
    lp = float(lp)
    return LOGPROB_FLOOR if math.isnan(lp) or lp < LOGPROB_FLOOR else lp


def _token(tok: Any, tid: int, lp: float) -> dict:
    return {"token": tok.token_text(tid), "logprob": finite(lp), "bytes": list(tok.token_bytes(tid))}


def chat_entry(tok: Any, lp: TokenLogprob) -> dict:
    """One item of chat's `logprobs.content`: the token, its logprob and bytes, and its `top_logprobs`."""
    return {**_token(tok, lp.id, lp.logprob), "top_logprobs": [_token(tok, i, v) for i, v in lp.top]}


def chat_logprobs(tok: Any, entries: Iterable[TokenLogprob]) -> dict:
    """Chat's `logprobs` object for these tokens (a whole choice, or the ones one chunk carries)."""
    return {"content": [chat_entry(tok, e) for e in entries], "refusal": None}


@dataclass(frozen=True)
class Positioned:
    """A token of a legacy completion with where its text starts in the returned text (`text_offset`);
    `logprob` is None for the prompt's first token (nothing predicts it)."""

    id: int
    logprob: TokenLogprob | None
    offset: int


def legacy_logprobs(tok: Any, items: Sequence[Positioned]) -> dict:
    """Legacy completions' `logprobs`: parallel lists `tokens`, `token_logprobs`, `top_logprobs`
    ({token text: logprob}, the k most likely and, as OpenAI does, always the token itself, so up to
    k + 1 entries; a text two tokens share keeps the likelier one) and `text_offset`."""
    tokens, lps, tops, offsets = [], [], [], []
    for it in items:
        tokens.append(tok.token_text(it.id))
        offsets.append(it.offset)
        if it.logprob is None:
            lps.append(None)
            tops.append(None)
            continue
        lps.append(finite(it.logprob.logprob))
        top: dict[str, float] = {}
        for i, v in (*it.logprob.top, (it.id, it.logprob.logprob)):
            top.setdefault(tok.token_text(i), finite(v))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}
