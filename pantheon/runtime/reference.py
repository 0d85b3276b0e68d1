"""Conveniences built on the engine's verbs: teacher-forced prefill and logits, and one sequence
generated alone. They are not part of `Model` (which holds only the compiled verbs and their buckets):
tests, the CLI and tools use them, and the scheduler's batched output is compared against
`generate`. Each takes any object with the verbs, so a multi-host leader's proxy works the same.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from pantheon.runtime import decode_state
from pantheon.runtime.decode_state import DecodeState
from pantheon.runtime.engine import Chunk, Model, StepPlan
from pantheon.types import SamplingParams
from pantheon.types import stop_ids as model_stop_ids


def prefill(model: Model, state: DecodeState, slot: int, ids: Sequence[int], start: int = 0, chunk: int | None = None,
            all_logits: bool = False) -> tuple[int, np.ndarray, DecodeState]:
    """Teacher-force `ids` into `slot` from position `start` in chunks (no sampling).

    Returns (the greedy next id, logits: the last position's [V], or every position's
    [len(ids), V] with all_logits, the new state)."""
    chunk = chunk or model.chunk
    ids = list(ids)
    if not ids:
        raise ValueError("prefill needs at least one token")
    parts, pos = [], start
    for i in range(0, len(ids), chunk):
        part = ids[i: i + chunk]
        lg, state = model.forward_rows(state, [part], [slot], [pos], all_logits=all_logits)
        parts.append(lg[0, : len(part)] if all_logits else lg[0])
        pos += len(part)
    if all_logits:
        every = np.concatenate(parts, axis=0)
        return int(np.argmax(every[-1])), every, state
    return int(np.argmax(parts[-1])), parts[-1], state

def logits(model: Model, ids: Sequence[int], chunk: int | None = None) -> np.ndarray:
    """Teacher-forced logits [len(ids), V] as float32 (for comparison with other engines)."""
    _, lg, _ = prefill(model, model.new_state(), 0, ids, chunk=chunk, all_logits=True)
    return lg

def generate(model: Model, prompt_ids: Sequence[int], params: SamplingParams | None = None, max_tokens: int = 128,
             stop_ids: Sequence[int] | None = None, state: DecodeState | None = None, slot: int = 0,
             cancel: Any = None, chunk: int | None = None,
             decode_from: int | None = None,
             draft: Callable[[list[int]], Sequence[int]] | None = None) -> Iterator[int]:
    """One sequence, alone, through the serving verbs (insert, then steps): yields token ids.

    The reference the scheduler's batched output is compared with. `decode_from` feeds
    prompt_ids[decode_from:] one token per chunk (a test hook: chunking must not change tokens).
    `draft` (speculative decoding): given the sequence so far (prompt and generated tokens), the
    tokens to verify after it (at most the model's largest verify K; empty: a plain decode step);
    each verify step yields every token it accepted, which must be the tokens plain decoding yields.
    """
    params = (params or SamplingParams(temperature=0.0)).resolved()
    if stop_ids is None:  # the model's own set, as a request gets it
        stop_ids = model_stop_ids(model.tokenizer) if model.tokenizer else ()
    stop = tuple(stop_ids)
    prompt = list(prompt_ids)
    if len(prompt) + max_tokens > model.max_seq:
        max_tokens = model.max_seq - len(prompt)
        if max_tokens <= 0:
            raise ValueError(f"prompt of {len(prompt)} tokens does not fit max_seq {model.max_seq}")
    state = state if state is not None else model.new_state()
    state = model.insert(state, decode_state.slot_insert(slot, prompt, 0, params, max_tokens, stop))
    chunk = chunk or model.chunk
    cut = len(prompt) if decode_from is None else max(1, decode_from)
    pieces = [prompt[i: min(i + chunk, cut)] for i in range(0, cut, chunk)] + [[t] for t in prompt[cut:]]
    pos = 0
    for i, part in enumerate(pieces):
        h, state = model.step(state, StepPlan(chunk=Chunk(slot, tuple(part), pos, i == len(pieces) - 1)))
        pos += len(part)
    tok, flag = (int(x) for x in model.read(h)[0])
    seq = prompt + [tok]
    while True:
        yield tok
        if flag != decode_state.RUNNING or (cancel is not None and cancel.is_set()):
            return
        d = tuple(draft(seq))[: max(0, model.max_seq - pos - 2)] if draft is not None else ()
        if d:
            h, state = model.step(state, StepPlan(decode=(slot,), drafts=(d,), reach=pos + 1 + len(d)))
            got = [(int(t), int(f)) for t, f in model.read(h) if f != decode_state.IDLE]
            pos += len(got)
            for t, f in got[:-1]:
                seq.append(t)
                yield t
            tok, flag = got[-1]
            seq.append(tok)
            continue
        h, state = model.step(state, StepPlan(decode=(slot,), reach=pos + 1))
        pos += 1
        tok, flag = (int(x) for x in model.read(h)[0])
        seq.append(tok)
