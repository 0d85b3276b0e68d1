"""Slot states (pantheon.scheduler.slot): every change of a slot's state goes through one transition table.

A transition the table does not list raises IllegalTransition, so a scheduler bug that would hand a
slot to two owners (a FORKWAIT sibling planned as a decoder, an EMBED slot admitted into) ends the
driver loudly instead of corrupting a cache. No model, no JAX.
"""

from __future__ import annotations

import itertools

import pytest

from pantheon.scheduler.slot import (
    DECODE,
    EMBED,
    FORK,
    FORKWAIT,
    IDLE,
    PREFILL,
    TRANSITIONS,
    IllegalTransition,
    Slot,
    SlotState,
)


def slot_in(state: SlotState) -> Slot:
    """A slot brought to `state` along the table's own paths."""
    path = {IDLE: [], PREFILL: [PREFILL], DECODE: [PREFILL, DECODE], FORK: [PREFILL, FORK],
            FORKWAIT: [FORKWAIT], EMBED: [EMBED]}[state]
    sl = Slot(0)
    for s in path:
        sl.state = s
    assert sl.state is state
    return sl


def test_the_table_covers_every_state_and_every_state_can_get_back_to_idle():
    assert set(TRANSITIONS) == set(SlotState)
    for state in SlotState:
        if state is not IDLE:
            assert IDLE in TRANSITIONS[state], f"{state} could never be freed"


@pytest.mark.parametrize("src,dst", [(a, b) for a, b in itertools.product(SlotState, SlotState) if a is not b])
def test_a_transition_is_allowed_exactly_when_the_table_lists_it(src, dst):
    sl = slot_in(src)
    if dst in TRANSITIONS[src]:
        sl.state = dst
        assert sl.state is dst
    else:
        with pytest.raises(IllegalTransition) as e:
            sl.state = dst
        assert str(src) in str(e.value) and str(dst) in str(e.value)
        assert sl.state is src  # refused: nothing changed


def test_the_lifecycles_the_scheduler_drives_are_in_the_table():
    lifecycles = [
        [PREFILL, DECODE, IDLE],  # one request
        [PREFILL, FORK, DECODE, IDLE],  # the first slot of an n > 1 request
        [FORKWAIT, DECODE, IDLE],  # a sibling choice
        [PREFILL, IDLE], [PREFILL, FORK, IDLE], [FORKWAIT, IDLE],  # cancelled or failed on the way
        [EMBED, IDLE],  # an embeddings input (done, cancelled, or taken back by generation)
    ]
    for states in lifecycles:
        sl = Slot(1)
        for s in states:
            sl.state = s


def test_staying_in_a_state_is_no_transition_and_forget_history_clears_the_prefix():
    sl = slot_in(DECODE)
    sl.state = DECODE
    sl.hist, sl.scope, sl.session_id = [1, 2], "tenant", "s"
    sl.forget_history()
    assert (sl.hist, sl.scope, sl.session_id) == ([], "", None)
