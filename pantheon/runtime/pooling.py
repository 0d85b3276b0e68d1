"""The host side of embeddings: feeding an input in chunks, pooling across them, normalising.

`Model.embed` runs one call of at most `chunk` tokens per row and pools each row on the device (the sum
of its hidden states, and its last one). An input longer than a chunk is fed in several calls into the
same slot with increasing starts (its earlier chunks stay in the slot's cache, so attention sees the
whole input), and `EmbedRun` adds the calls up: mean = (sum of the sums) / length, last = the last
call's last. Why the division happens here and not on the device: the device never sees the whole
input at once, and summing on the host keeps one compiled program per shape bucket whatever the
input's length. No JAX here: the scheduler and the tests drive it with plain numpy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

POOLINGS = ("mean", "last")
NORM_EPS = 1e-12  # a zero vector stays zero instead of dividing by zero


def normalize(v: np.ndarray) -> np.ndarray:
    """`v` (one vector or rows of them) scaled to unit L2 length, as float32."""
    v = np.asarray(v, np.float64)
    norm = np.linalg.norm(v, axis=-1, keepdims=True)
    return (v / np.maximum(norm, NORM_EPS)).astype(np.float32)


@dataclass(eq=False)
class EmbedRun:
    """One input on its way through the model: which tokens are still to feed and what is pooled so far."""

    tokens: Sequence[int]
    pooling: str = "mean"
    fed: int = 0  # tokens already fed (the next chunk's start)
    total: np.ndarray | None = field(default=None, repr=False)  # f64 sum of hidden states ("mean")
    last: np.ndarray | None = field(default=None, repr=False)  # the latest chunk's last hidden state

    def __post_init__(self) -> None:
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {self.pooling!r}")
        if len(self.tokens) == 0:
            raise ValueError("an embedding input needs at least one token")

    @property
    def done(self) -> bool:
        return self.fed >= len(self.tokens)

    def next_chunk(self, chunk: int) -> tuple[list[int], int]:
        """The next chunk to feed (at most `chunk` tokens) and its start position."""
        return list(self.tokens[self.fed: self.fed + chunk]), self.fed

    def add(self, n_fed: int, pooled: np.ndarray) -> None:
        """Take one call's output for the `n_fed` tokens just fed (a sum or a last vector, as pooled)."""
        v = np.asarray(pooled, np.float64)
        if self.pooling == "mean":
            self.total = v if self.total is None else self.total + v
        self.last = v
        self.fed += n_fed

    def vector(self) -> np.ndarray:
        """The finished input's unit-length embedding, float32 [D]."""
        if not self.done:
            raise ValueError("the input has not been fed completely")
        v = self.total / len(self.tokens) if self.pooling == "mean" else self.last
        return normalize(v)


def embed_inputs(model: Any, state: Any, inputs: Sequence[Sequence[int]], slots: Sequence[int],
                 pooling: str = "mean") -> tuple[np.ndarray, Any]:
    """Embed `inputs` straight through `model.embed`, input i in slot slots[i] (so at most as many
    inputs as slots), all of them batched in every call until the longest is done: float32 [n, D]
    unit vectors and the new state. The scheduler does the same between generation steps; this is
    its reference (tests, tools)."""
    if len(inputs) > len(slots):
        raise ValueError(f"{len(inputs)} inputs need as many slots, got {len(slots)}")
    runs = [EmbedRun(list(t), pooling) for t in inputs]
    chunk = int(model.chunk)
    while True:
        live = [i for i, r in enumerate(runs) if not r.done]
        if not live:
            break
        parts = [runs[i].next_chunk(chunk) for i in live]
        out, state = model.embed(state, [p[0] for p in parts], [slots[i] for i in live], [p[1] for p in parts],
                                 pooling)
        for i, (toks, _), vec in zip(live, parts, out):
            runs[i].add(len(toks), vec)
    return np.stack([r.vector() for r in runs]) if runs else np.zeros((0, 0), np.float32), state
