"""The decode state the engine's verbs carry from step to step: per slot, everything a request needs on
the device, next to the architecture's cache. One typed, donated pytree.

Why the request's data lives on the device: a decode step used to be handed, for every row and every
step, the token to feed, its position, the request's sampling parameters and seed and a 64-token
penalty window -- six lists rebuilt on the host each step, for values that change by one token. Here
`insert` writes a request's data into its slot once; a step's host input is only which slot feeds which
prompt chunk and which slots decode. Each decode row reads its token and position from the table, the
sampler reads the slot's knobs, seed and recent-token ring, and the step itself appends the sampled
token, spends the budget and checks the stop ids. That is also what lets the driver dispatch step N+1
before it has read step N's tokens: the next input is already on the device.

Row flags of a step's packed output ([rows, 2] int32: token id, flag):
  RUNNING  the slot sampled a token and goes on;
  STOP     the token is one of the slot's stop ids (the slot is now inactive);
  LENGTH   the budget or the sequence limit is spent (inactive);
  IDLE     the row carried no live slot (a prefill chunk that is not the prompt's last, a slot already
           finished or released, padding): its id means nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from pantheon.types import GREEDY, MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS, PENALTY_WINDOW, SamplingParams
from pantheon.runtime.sampler import (
    SamplerRows,
    apply_bias,
    apply_mask,
    apply_penalties,
    make_rows_np,
    pick,
    token_logprobs,
)

MAX_STOP_IDS = 16  # stop token ids a slot can hold (end-of-turn ids: 1-4 in every catalog model)

RUNNING, STOP, LENGTH, IDLE = 0, 1, 2, 3
FINISH_REASONS = {STOP: "stop", LENGTH: "length"}


@struct.dataclass
class SlotTable:
    """Per-slot request data, leading axis = slots (the scratch slot included, always idle)."""

    pos: jax.Array  # i32[S] positions the slot's cache holds (the next token goes here)
    last: jax.Array  # i32[S] the last sampled token: a decode row's input
    step: jax.Array  # i32[S] index of the next token to generate (the sampler's per-request counter)
    budget: jax.Array  # i32[S] tokens the request may still generate
    active: jax.Array  # bool[S] generating; rows of an inactive slot are sent to the scratch slot
    stop: jax.Array  # i32[S, MAX_STOP_IDS] stop ids, -1 = none
    ring: jax.Array  # i32[S, PENALTY_WINDOW] recent tokens (prompt tail, then sampled), oldest first, -1 = empty
    sampling: SamplerRows  # [S] the request's knobs and resolved seed
    bias_ids: jax.Array  # i32[S, MAX_LOGIT_BIAS] logit_bias token ids, -1 = unused
    bias: jax.Array  # f32[S, MAX_LOGIT_BIAS] their biases
    want_lp: jax.Array  # bool[S] the request asked for logprobs (a step computes them only if a row wants)


@struct.dataclass
class DecodeState:
    """What a caller owns and hands to every verb (donated: use only the returned one)."""

    cache: Any  # the architecture's KV / recurrent cache (jax_models.<arch>.init_state)
    slots: SlotTable


@struct.dataclass
class StepRows:
    """What the forward part of a step tells its sampling part about each output row."""

    slot: jax.Array  # i32[R] the slot the row belongs to (scratch for padding and dead rows)
    emit: jax.Array  # bool[R] the row samples a token that counts (a live decode row, a prompt's last chunk)
    pos: jax.Array  # i32[R] the slot's position after the row (what `pos` becomes where the row is live)
    live: jax.Array  # bool[R] the row advanced its slot (a live decode row or any prompt chunk)


def empty_table(n_slots: int) -> SlotTable:
    """A table of `n_slots` idle slots (greedy knobs, nothing to stop on, no budget)."""
    rows = make_rows_np([GREEDY] * n_slots, n_slots)
    return SlotTable(pos=np.zeros(n_slots, np.int32), last=np.zeros(n_slots, np.int32),
                     step=np.zeros(n_slots, np.int32), budget=np.zeros(n_slots, np.int32),
                     active=np.zeros(n_slots, bool), stop=np.full((n_slots, MAX_STOP_IDS), -1, np.int32),
                     ring=np.full((n_slots, PENALTY_WINDOW), -1, np.int32), sampling=rows,
                     bias_ids=np.full((n_slots, MAX_LOGIT_BIAS), -1, np.int32),
                     bias=np.zeros((n_slots, MAX_LOGIT_BIAS), np.float32), want_lp=np.zeros(n_slots, bool))


@struct.dataclass
class SlotInsert:
    """One request's data for `insert`, as host arrays (the only time its parameters cross to the device)."""

    slot: np.ndarray  # i32[] the slot
    pos: np.ndarray  # i32[] prompt tokens already in the slot's cache (a reused prefix)
    budget: np.ndarray  # i32[] max tokens to generate
    stop: np.ndarray  # i32[MAX_STOP_IDS]
    ring: np.ndarray  # i32[PENALTY_WINDOW] the prompt's last tokens
    sampling: SamplerRows  # one row
    last: np.ndarray  # i32[] the slot's first decode input (0 when the prompt's last chunk samples first)
    bias_ids: np.ndarray  # i32[MAX_LOGIT_BIAS]
    bias: np.ndarray  # f32[MAX_LOGIT_BIAS]
    want_lp: np.ndarray  # bool[]


def slot_insert(slot: int, prompt: Sequence[int], reused: int, params: SamplingParams, max_tokens: int,
                stop_ids: Iterable[int], *, logit_bias: Sequence[tuple[int, float]] = (),
                logprobs: bool = False, last: int | None = None) -> SlotInsert:
    """Build the host payload that makes `slot` serve a request (its seed must be resolved already,
    so the seed is decided once per request, by whoever built `params`).

    `last`: the slot starts decoding at once, `last` being its first input at position `reused`
    (a choice of an n > 1 request forked from a prefilled prompt: its cache holds the prompt but its
    last token, which the first decode row feeds). None: a prompt chunk samples the first token.
    """
    stops = sorted(set(int(s) for s in stop_ids))
    if len(stops) > MAX_STOP_IDS:
        raise ValueError(f"{len(stops)} stop ids; a slot holds at most {MAX_STOP_IDS}")
    if params.seed is None:
        raise ValueError("insert needs a resolved seed (SamplingParams.resolved())")
    stop = np.full(MAX_STOP_IDS, -1, np.int32)
    stop[: len(stops)] = stops
    ring = np.full(PENALTY_WINDOW, -1, np.int32)
    tail = list(prompt)[-PENALTY_WINDOW:]
    if tail:
        ring[PENALTY_WINDOW - len(tail):] = tail
    if len(logit_bias) > MAX_LOGIT_BIAS:
        raise ValueError(f"{len(logit_bias)} logit_bias entries; a slot holds at most {MAX_LOGIT_BIAS}")
    bias_ids = np.full(MAX_LOGIT_BIAS, -1, np.int32)
    bias = np.zeros(MAX_LOGIT_BIAS, np.float32)
    for j, (tid, b) in enumerate(logit_bias):
        bias_ids[j], bias[j] = tid, b
    return SlotInsert(slot=np.int32(slot), pos=np.int32(reused), budget=np.int32(max(0, max_tokens)), stop=stop,
                      ring=ring, sampling=make_rows_np([params], 1), last=np.int32(0 if last is None else last),
                      bias_ids=bias_ids, bias=bias, want_lp=np.bool_(logprobs))


def insert(table: SlotTable, new: SlotInsert) -> SlotTable:
    """The table with one slot taken by a new request (pure; the engine jits it with the table donated)."""
    s = new.slot
    sampling = jax.tree.map(lambda col, row: col.at[s].set(row[0]), table.sampling, new.sampling)
    return table.replace(pos=table.pos.at[s].set(new.pos), last=table.last.at[s].set(new.last),
                         step=table.step.at[s].set(0), budget=table.budget.at[s].set(new.budget),
                         active=table.active.at[s].set(True), stop=table.stop.at[s].set(new.stop),
                         ring=table.ring.at[s].set(new.ring), sampling=sampling,
                         bias_ids=table.bias_ids.at[s].set(new.bias_ids), bias=table.bias.at[s].set(new.bias),
                         want_lp=table.want_lp.at[s].set(new.want_lp))


def copy_slot(cache: Any, src: jax.Array, dst: jax.Array) -> Any:
    """The cache with slot `dst` a copy of slot `src` (every leaf's axis 1 is the slot: KV rows and
    recurrent state alike). How the choices of an n > 1 request share one prefilled prompt."""
    return jax.tree.map(lambda x: x.at[:, dst].set(x[:, src]), cache)


def release(table: SlotTable, slot: jax.Array) -> SlotTable:
    """The table with `slot` inactive: rows still in flight for it compute into the scratch slot."""
    return table.replace(active=table.active.at[slot].set(False))


@struct.dataclass
class VerifyRows:
    """What a verify step's forward tells its acceptance part (`verify_and_advance`), per decode slot.

    A verify step runs each decode slot d as K + 1 one-token rows d * (K + 1) + j: row 0 feeds the
    slot's last token at its position, row j > 0 feeds draft j - 1 at the position after it. Rows
    past the slot's drafts (and every row of a dead slot) go to the scratch slot."""

    slot: jax.Array  # i32[D] the slot (scratch for padding and dead slots)
    on: jax.Array  # bool[D] a live slot
    start: jax.Array  # i32[D] the slot's position before the step (its last token goes there)
    drafts: jax.Array  # i32[D, K] the drafted tokens, -1 past the slot's n_draft
    n_draft: jax.Array  # i32[D] how many drafts the slot carries (0: a plain decode row)


@struct.dataclass
class Sampled:
    """A step's sampling output: what crosses to the host."""

    packed: jax.Array  # i32[R, 2] (token id, flag)
    logprobs: jax.Array  # f32[R, 1 + MAX_TOP_LOGPROBS] the token's logprob, then the top ones (zeros: none asked)
    top_ids: jax.Array  # i32[R, MAX_TOP_LOGPROBS] the top tokens' ids


def sample_and_advance(table: SlotTable, logits: jax.Array, rows: StepRows, mask: jax.Array, masked: jax.Array,
                       max_seq: int, barrier: bool = True) -> tuple[Sampled, SlotTable]:
    """Sample every row with its slot's own knobs, then move the live slots on (pure, jittable).

    The logits of a row are processed in this order: the slot's logit_bias, the penalties over its
    ring, the grammar mask (`mask` i32[R, ceil(V / 32)], applied only when the scalar `masked` is
    true: unconstrained rows carry all ones), then temperature, filters and the draw. When a row's
    slot asked for logprobs, the step also returns the sampled token's log probability and the top
    MAX_TOP_LOGPROBS under that processed distribution (skipped entirely when no row asks).

    Returns (Sampled; the new table). A row that emits appends its token to the slot's ring, becomes
    the slot's `last` (the next decode input), spends one token of budget and is checked against the
    slot's stop ids, its budget and `max_seq` (the row's position + 1 must stay below it, as a
    sequence never grows past max_seq). `barrier`: see `sampler.sample`.
    """
    n_slots = table.pos.shape[0]
    slot = rows.slot
    knobs = jax.tree.map(lambda col: col[slot], table.sampling)
    x = jnp.asarray(logits, jnp.float32)
    x = jax.lax.cond(jnp.any(table.bias_ids[slot] >= 0), lambda: apply_bias(x, table.bias_ids[slot], table.bias[slot]),
                     lambda: x)
    x = apply_penalties(x, knobs, table.ring[slot])
    x = jax.lax.cond(masked, lambda: apply_mask(x, mask), lambda: x)
    ids = pick(x, knobs, table.step[slot], barrier=barrier)
    r = x.shape[0]
    want = table.want_lp[slot] & rows.emit
    lps, top_ids = jax.lax.cond(
        jnp.any(want), lambda: token_logprobs(x, ids, MAX_TOP_LOGPROBS),
        lambda: (jnp.zeros((r, 1 + MAX_TOP_LOGPROBS), jnp.float32), jnp.zeros((r, MAX_TOP_LOGPROBS), jnp.int32)))
    stop_hit = jnp.any(table.stop[slot] == ids[:, None], axis=-1)
    spent = (table.budget[slot] - 1 <= 0) | (rows.pos + 1 >= max_seq)
    flag = jnp.where(stop_hit, STOP, jnp.where(spent, LENGTH, RUNNING))
    flag = jnp.where(rows.emit, flag, IDLE).astype(jnp.int32)
    at_live = jnp.where(rows.live, slot, n_slots)  # out of range: the scatter drops the row
    at_emit = jnp.where(rows.emit, slot, n_slots)
    ring = jnp.concatenate([table.ring[slot][:, 1:], ids[:, None]], axis=1)
    table = table.replace(
        pos=table.pos.at[at_live].set(rows.pos, mode="drop"),
        last=table.last.at[at_emit].set(ids, mode="drop"),
        step=table.step.at[at_emit].add(1, mode="drop"),
        budget=table.budget.at[at_emit].add(-1, mode="drop"),
        active=table.active.at[at_emit].set(flag == RUNNING, mode="drop"),
        ring=table.ring.at[at_emit].set(ring, mode="drop"),
    )
    packed = jnp.stack([ids.astype(jnp.int32), flag], axis=1)
    return Sampled(packed=packed, logprobs=lps, top_ids=top_ids), table


def verify_and_advance(table: SlotTable, logits: jax.Array, rows: VerifyRows, max_seq: int,
                       barrier: bool = True) -> tuple[Sampled, SlotTable]:
    """Sample every position of a verify step, accept each slot's agreeing prefix plus one, and move
    the slots on (pure, jittable). `logits` f32[D * (K + 1), V], row d * (K + 1) + j the position
    after the slot's j-th draft.

    Why this is exact: row j of slot d is sampled with exactly what a plain decode step would use for
    the slot's next-but-j token had the j drafts before it been that decode's tokens -- the slot's
    knobs and logit bias, the penalty ring with those j drafts appended, and the draw key of step
    index `step + j`. A draft is accepted only if it *equals* the token sampled at its position, so
    every emitted token is the token plain decoding would have emitted there, greedy or seeded. (For
    a deterministic draft this is also the rejection-sampling rule: the draft survives with
    probability p(draft), and on a mismatch the token is a draw from p without the draft,
    renormalised -- the residual distribution. docs/speculative.md.) Emission stops at the first
    mismatch (the sampled token there is the corrected one), after the last draft (the bonus
    token), or at a token that ends the request (stop id, budget, max_seq): nothing past it leaks.

    Returns (Sampled over the D * (K + 1) rows -- IDLE for every row not emitted -- ; the new table):
    each live slot moves on by the count of its emitted tokens, whose last becomes its `last`.
    """
    n_slots = table.pos.shape[0]
    d, k = rows.drafts.shape
    g = k + 1
    r = d * g
    jj = jnp.arange(g, dtype=jnp.int32)
    slot = jnp.repeat(rows.slot, g)
    step_j = jnp.tile(jj, d)
    knobs = jax.tree.map(lambda col: col[slot], table.sampling)
    x = jnp.asarray(logits, jnp.float32)
    x = jax.lax.cond(jnp.any(table.bias_ids[slot] >= 0), lambda: apply_bias(x, table.bias_ids[slot], table.bias[slot]),
                     lambda: x)
    w = table.ring.shape[1]
    ext = jnp.concatenate([table.ring[rows.slot], jnp.where(rows.drafts >= 0, rows.drafts, -1)], axis=1)  # [D, W+K]
    window = jnp.arange(w, dtype=jnp.int32)[None, :] + jj[:, None]  # [G, W]: row j's ring = ext[j: j + W]
    rings = ext[:, window].reshape(r, w)
    x = apply_penalties(x, knobs, rings)
    ids = pick(x, knobs, table.step[slot] + step_j, barrier=barrier)
    ids2 = ids.reshape(d, g)
    stop_hit = jnp.any(table.stop[slot] == ids[:, None], axis=-1).reshape(d, g)
    left = table.budget[rows.slot][:, None] - (jj[None, :] + 1)  # budget after token j
    after = rows.start[:, None] + jj[None, :] + 1  # the slot's position after token j
    spent = (left <= 0) | (after + 1 >= max_seq)
    flag = jnp.where(stop_hit, STOP, jnp.where(spent, LENGTH, RUNNING)).astype(jnp.int32)
    target = jnp.concatenate([rows.drafts, jnp.full((d, 1), -1, jnp.int32)], axis=1)
    cont = (ids2 == target) & (flag == RUNNING) & (jj[None, :] < rows.n_draft[:, None])
    reach = jnp.cumprod(cont.astype(jnp.int32), axis=1)  # 1 while every token so far agreed and ran on
    emitted = rows.on[:, None] & jnp.concatenate([jnp.ones((d, 1), bool), reach[:, :-1] > 0], axis=1)
    count = jnp.sum(emitted, axis=1).astype(jnp.int32)
    out_flag = jnp.where(emitted, flag, IDLE).astype(jnp.int32)
    want = (table.want_lp[rows.slot][:, None] & emitted).reshape(r)
    lps, top_ids = jax.lax.cond(
        jnp.any(want), lambda: token_logprobs(x, ids, MAX_TOP_LOGPROBS),
        lambda: (jnp.zeros((r, 1 + MAX_TOP_LOGPROBS), jnp.float32), jnp.zeros((r, MAX_TOP_LOGPROBS), jnp.int32)))
    last_j = jnp.maximum(count - 1, 0)[:, None]
    new_last = jnp.take_along_axis(ids2, last_j, axis=1)[:, 0]
    last_flag = jnp.take_along_axis(flag, last_j, axis=1)[:, 0]
    ring_ext = jnp.concatenate([table.ring[rows.slot], ids2], axis=1)  # [D, W + G]
    new_ring = jnp.take_along_axis(ring_ext, jnp.arange(w, dtype=jnp.int32)[None, :] + count[:, None], axis=1)
    at = jnp.where(rows.on, rows.slot, n_slots)  # out of range: the scatter drops the slot
    table = table.replace(
        pos=table.pos.at[at].set(rows.start + count, mode="drop"),
        last=table.last.at[at].set(new_last, mode="drop"),
        step=table.step.at[at].add(count, mode="drop"),
        budget=table.budget.at[at].add(-count, mode="drop"),
        active=table.active.at[at].set(last_flag == RUNNING, mode="drop"),
        ring=table.ring.at[at].set(new_ring, mode="drop"),
    )
    packed = jnp.stack([ids.astype(jnp.int32), out_flag.reshape(r)], axis=1)
    return Sampled(packed=packed, logprobs=lps, top_ids=top_ids), table
