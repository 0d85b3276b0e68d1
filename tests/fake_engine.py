"""A small fake engine with the real verbs' contract, for tests of scheduling rather than numerics.

It keeps the slot table on the host and "samples" a token that depends only on the slot's own history
(prompt + fed tokens), so a request's tokens are the same alone or batched, and stop ids, budgets, the
sequence limit, inactive slots and release behave as the device's (pantheon.runtime.decode_state). A step can be
made to block (`gate`) so tests can hold the driver mid-step deterministically.
"""

from __future__ import annotations

import threading
import zlib
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np

from pantheon.runtime.decode_state import IDLE, LENGTH, RUNNING, STOP
from pantheon.jax_models.interface import Capabilities


def fake_token(history: list[int], vocab: int = 1000) -> int:
    """The token the fake model samples after `history`."""
    return 1 + zlib.crc32(np.asarray(history, np.int64).tobytes()) % (vocab - 1)


@dataclass
class _Slot:
    hist: list[int] = field(default_factory=list)
    last: int = 0
    budget: int = 0
    stop: tuple[int, ...] = ()
    active: bool = False


@dataclass
class FakeHandle:
    packed: np.ndarray
    n_rows: int


class FakeModel:
    """Enough of engine.Model for BatchScheduler: insert / step / read / release over a host table."""

    def __init__(self, n_slots: int = 4, chunk: int = 8, max_seq: int = 256, name: str = "fake",
                 mixed: bool = True):
        self.n_slots, self.chunk, self.max_seq, self.name = n_slots, chunk, max_seq, name
        self.supports_mixed = mixed
        self.caps = Capabilities(mixed_steps=mixed)
        self.devices: list = []
        self.steps: list = []  # every plan stepped, in order
        self.gate: threading.Event | None = None  # when set to an Event, each step waits for it
        self.config = SimpleNamespace(vocab=1000)
        self.mask_words = -(-self.config.vocab // 32)
        self.masks: list[np.ndarray] = []  # every grammar mask a step was given, in order

    def new_state(self) -> list[_Slot]:
        return [_Slot() for _ in range(self.n_slots)]

    def insert(self, state: list[_Slot], new) -> list[_Slot]:
        s = int(new.slot)
        state[s] = _Slot(hist=state[s].hist[: int(new.pos)], budget=int(new.budget), last=int(new.last),
                         stop=tuple(int(x) for x in new.stop if x >= 0), active=True)
        return state

    def copy_slot(self, state: list[_Slot], src: int, dst: int) -> list[_Slot]:
        state[dst] = _Slot(hist=list(state[src].hist))
        return state

    def release(self, state: list[_Slot], slot: int) -> list[_Slot]:
        state[slot].active = False
        return state

    def _emit(self, sl: _Slot, allowed: np.ndarray | None = None) -> tuple[int, int]:
        tok = fake_token(sl.hist)
        if allowed is not None:  # a grammar mask row: the first allowed token from the fake's own choice on
            bits = [(int(allowed[t // 32]) >> (t % 32)) & 1 for t in range(self.config.vocab)]
            tok = next(t for t in [*range(tok, self.config.vocab), *range(tok)] if bits[t])
        sl.last = tok
        sl.budget -= 1
        flag = STOP if tok in sl.stop else LENGTH if sl.budget <= 0 or len(sl.hist) + 1 >= self.max_seq else RUNNING
        sl.active = flag == RUNNING
        return tok, flag

    def step(self, state: list[_Slot], plan, want_logits: bool = False, mask=None):
        fwd, state = self.forward(state, plan)
        return self.sample(state, fwd, mask)

    def forward(self, state: list[_Slot], plan):
        """The step's first phase: the fake computes nothing yet (its rows are computed by `sample`)."""
        if self.gate is not None:
            self.gate.wait(30)
        self.steps.append(plan)
        return plan, state

    def sample(self, state: list[_Slot], plan, mask=None):
        """The step's second phase, with the grammar masks built between the two."""
        words = mask
        if words is not None:
            self.masks.append(np.array(words))
        rows = []
        if plan.chunk is not None:
            sl = state[plan.chunk.slot]
            sl.hist.extend(plan.chunk.tokens)
            rows.append(self._emit(sl, None if words is None else words[0]) if plan.chunk.final else (0, IDLE))
        for i, s in enumerate(plan.decode, start=len(rows)):
            sl = state[s]
            if not sl.active:
                rows.append((0, IDLE))
                continue
            sl.hist.append(sl.last)
            rows.append(self._emit(sl, None if words is None else words[i]))
        return FakeHandle(np.array(rows, np.int32).reshape(-1, 2), len(rows)), state

    @staticmethod
    def read_logprobs(handle: FakeHandle) -> tuple[np.ndarray, np.ndarray]:
        """Fake logprobs: a token's is -id/1000 and the top ones are ids 1, 2, ... with -i/100."""
        from pantheon.types import MAX_TOP_LOGPROBS
        n = handle.n_rows
        lp = np.zeros((n, 1 + MAX_TOP_LOGPROBS), np.float32)
        lp[:, 0] = -handle.packed[:, 0] / 1000.0
        lp[:, 1:] = -np.arange(1, MAX_TOP_LOGPROBS + 1) / 100.0
        ids = np.tile(np.arange(1, MAX_TOP_LOGPROBS + 1, dtype=np.int32), (n, 1))
        return lp, ids

    @staticmethod
    def read(handle: FakeHandle) -> np.ndarray:
        return handle.packed

    def generate_alone(self, prompt: list[int], max_tokens: int, stop: tuple[int, ...] = ()) -> list[int]:
        """What one request yields alone: the reference the scheduler's output is compared with."""
        hist, out = list(prompt), []
        while True:
            tok = fake_token(hist)
            out.append(tok)
            if tok in stop or len(out) >= max_tokens or len(hist) + 1 >= self.max_seq:
                return out
            hist.append(tok)
