"""The host's mirror of one slot of a model's decode state, and the states a slot may be in.

Why a table. A slot's state decides who may use it: admission (IDLE only), the step planner (PREFILL,
DECODE), the n > 1 fork (FORK, FORKWAIT), the embeddings component (EMBED). A state written where no
rule expects it (a FORKWAIT slot planned as a decoder, an EMBED slot admitted into) corrupts a
cache silently. So every change goes through `Slot.state`'s setter, which checks it against
`TRANSITIONS` and raises `IllegalTransition` otherwise: the driver then dies loudly (every request
fails with 500, `GET /` names the model) instead of computing into a slot it does not own.

    IDLE      -> PREFILL (admitted), FORKWAIT (a sibling choice of an n > 1 request), EMBED (an
                 embeddings input)
    PREFILL   -> DECODE (its last chunk is dispatched), FORK (an n > 1 prompt is in, but its last
                 token), IDLE (finished, cancelled, failed)
    FORK      -> DECODE (the choices forked), IDLE
    FORKWAIT  -> DECODE (the fork copied the prompt into it), IDLE
    DECODE    -> IDLE (stop, length, cancel, failure)
    EMBED     -> IDLE (its input is done, cancelled, or generation took the slot back)

Locks: `state` and `job` are guarded by the scheduler's `_mu`; every other field is the driver
thread's alone (no lock).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class SlotState(enum.Enum):
    IDLE = "IDLE"  # free: admission may give it to a request (its history may still serve a prefix)
    PREFILL = "PREFILL"  # its prompt is fed in chunks
    DECODE = "DECODE"  # one token per step, batched with every other DECODE slot
    FORK = "FORK"  # an n > 1 prompt (but its last token) is in its cache: the choices fork from it next
    FORKWAIT = "FORKWAIT"  # a sibling choice of an n > 1 request, waiting for the fork's copy
    EMBED = "EMBED"  # an embeddings input is fed into it (pantheon.scheduler.embed)

    def __str__(self) -> str:
        return self.value


IDLE, PREFILL, DECODE = SlotState.IDLE, SlotState.PREFILL, SlotState.DECODE
FORK, FORKWAIT, EMBED = SlotState.FORK, SlotState.FORKWAIT, SlotState.EMBED

# state -> the states it may turn into (see the module docstring). Staying in a state is no transition.
TRANSITIONS: dict[SlotState, frozenset[SlotState]] = {
    IDLE: frozenset({PREFILL, FORKWAIT, EMBED}),
    PREFILL: frozenset({DECODE, FORK, IDLE}),
    FORK: frozenset({DECODE, IDLE}),
    FORKWAIT: frozenset({DECODE, IDLE}),
    DECODE: frozenset({IDLE}),
    EMBED: frozenset({IDLE}),
}


class IllegalTransition(RuntimeError):
    """A slot was moved from one state to another the table does not allow: a scheduler bug."""


@dataclass(eq=False)
class Slot:
    """What the host knows of one slot of the device state."""

    index: int
    _state: SlotState = field(default=IDLE, repr=False)  # _mu; written only through `state`
    job: Any = None  # _mu: the request (scheduler's job) it serves, or None
    # Driver-only fields (no lock): what the host knows of the slot's cache.
    hist: list[int] = field(default_factory=list)  # tokens whose K/V sit in the slot's cache (as of the last read step)
    session_id: str | None = None
    scope: str = ""  # cache_scope of the request whose tokens `hist` holds
    pending: list[int] = field(default_factory=list)  # prompt tokens not yet dispatched
    pos: int = 0  # positions dispatched so far (hist + steps in flight): the span bucket's bound
    last_token: int = -1  # the last token emitted: the input of the slot's next decode row
    generated: int = 0
    reused: int = 0
    choice: int = 0  # which choice of its job the slot generates (n > 1)
    matcher: Any = None  # the choice's grammar matcher (GenRequest.constraint), driver-only
    lookup: Any = None  # driver-only: the choice's sequence for prompt-lookup drafts (scheduler.drafts), or None
    budget: Any = None  # driver-only: its DraftBudget (how many tokens to draft next)
    model_budget: Any = None  # driver-only: the DraftBudget of the draft model's proposals, or None (no draft model)
    resume: Any = None  # the prefix snapshot admission chose for it (restored by the driver's insert), driver-only

    @property
    def state(self) -> SlotState:
        return self._state

    @state.setter
    def state(self, to: SlotState) -> None:
        """Move to `to`, if the table allows it from the current state (else IllegalTransition)."""
        now = self._state
        if to is not now and to not in TRANSITIONS[now]:
            raise IllegalTransition(f"slot {self.index}: {now} -> {to} is not a slot transition "
                                    f"(from {now}: {', '.join(sorted(str(s) for s in TRANSITIONS[now])) or 'none'})")
        self._state = to

    def forget_history(self) -> None:
        """Its cache no longer holds what `hist` says (overwritten, rebuilt, or moved past it): nothing
        may reuse it as a prefix."""
        self.hist, self.scope, self.session_id = [], "", None
