"""Prefix snapshots of recurrent slots: how a hybrid model's second turn skips its history.

Why. An attention-only slot can serve any prefix of what it holds (its K/V rows are per position), so a
follow-up turn or a request sharing a system prompt reuses the common prefix. A recurrent model's slot
(Qwen3.5 / Qwen3-Next DeltaNet layers, RWKV-7) holds one state valid at one position only: the end of
what it last consumed. A second turn whose prompt re-renders the first answer differently (a stripped
reasoning block, a re-tokenized reply), or a request that shares only a system prompt, would be
prefilled from scratch. So the driver keeps copies of a slot's recurrent state taken where prompt
chunks end (`Model.snapshot`), and admission resumes a prompt from the longest one whose prefix it
starts with (`Model.restore`): only the rest is prefilled, and `cached_tokens` says how much was not.

What a snapshot holds, and what it does not. Only the recurrent parts (conv and delta-rule state, or
RWKV's shift and WKV): a fixed size per sequence (`Model.snapshot_bytes`), whatever the prefix length.
The attention layers' K/V rows stay where they are, in the slot the snapshot was taken from (its
`slot`), position-indexed. A snapshot is therefore usable only while that slot's committed history
still starts with the snapshot's prefix (`usable`: the host mirror `Slot.hist` says so; it is never
ahead of the device). Resuming into that same slot needs nothing more; resuming into another slot
first copies the source slot's cache (`Model.copy_slot`: every position, so its rows below the
prefix come along), then restores the snapshot over the copied recurrent state. A model without
per-token state (RWKV-7) needs no source: its snapshots resume into any slot with no copy.

Bounds. The pool holds at most `budget_bytes` of snapshots (PANTHEON_PREFIX_SNAPSHOT_MB); a new one
evicts the least recently used (taken or resumed from) until it fits. A snapshot is keyed by the
request's cache scope and the hash of its token prefix (`GenRequest.prefix_key`: image positions carry
their content hash), so one is never used across scopes, nor for a prompt that differs anywhere in
the prefix (the source slot's history is also compared token by token before a resume).

Threads: the pool is the driver thread's alone (admission runs in that thread, under the scheduler's
`_mu`, and the snapshot-taking step too); it has no lock of its own.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


def pool_bytes(budget_mb: int, entry_bytes: int, n_slots: int, max_seq: int, chunk: int) -> int:
    """The most device memory a model's snapshot pool may hold: PANTHEON_PREFIX_SNAPSHOT_MB, but never
    more than one snapshot per chunk boundary of every slot's (and the scratch slot's) full window --
    so a tiny model is not charged a gigabyte it can never use. The load estimate charges this."""
    if entry_bytes <= 0 or budget_mb <= 0:
        return 0
    most = (n_slots + 1) * -(-max(1, max_seq) // max(1, chunk)) * entry_bytes
    return min(int(budget_mb) << 20, most)


def _tokens_bytes(tokens: Sequence[int]) -> bytes:
    return np.asarray(tokens, np.int64).tobytes()


def prefix_digest(tokens: Sequence[int]) -> bytes:
    """The key of a token prefix (incremental hashing of longer prefixes gives the same digests)."""
    return hashlib.blake2b(_tokens_bytes(tokens), digest_size=16).digest()


@dataclass(eq=False)
class Snapshot:
    """One slot's recurrent state after the first `n` tokens of a prompt of scope `scope`."""

    scope: str
    n: int  # prefix length: the position the state is valid at
    digest: bytes  # prefix_digest(prompt[:n])
    slot: int  # the slot it was taken from (whose K/V rows below n it needs)
    state: Any  # the device copy (Model.snapshot)
    nbytes: int


class SnapshotPool:
    """Snapshots of recurrent slot state at prompt chunk boundaries, bounded in bytes, evicted LRU."""

    def __init__(self, budget_bytes: int, entry_bytes: int):
        self.budget_bytes = max(0, int(budget_bytes))
        self.entry_bytes = int(entry_bytes)
        self._entries: OrderedDict[tuple[str, int, bytes], Snapshot] = OrderedDict()  # oldest use first
        self.bytes = 0
        self.taken = 0
        self.evicted = 0

    @property
    def enabled(self) -> bool:
        """Whether one snapshot fits the budget at all (0 MB, or a model with no recurrent state: off)."""
        return 0 < self.entry_bytes <= self.budget_bytes

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[Snapshot]:
        """The snapshots, least recently used first (tests and stats read it)."""
        return list(self._entries.values())

    def add(self, scope: str, prefix: Sequence[int], slot: int, state: Any) -> None:
        """Keep `state`, slot `slot`'s recurrent state after `prefix`, evicting the least recently used
        snapshots until it fits. A snapshot of the same scope and prefix is replaced (the newer one's
        source slot is the likelier to still hold the prefix)."""
        if not self.enabled or not prefix:
            return
        key = (scope, len(prefix), prefix_digest(prefix))
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= old.nbytes
        while self._entries and self.bytes + self.entry_bytes > self.budget_bytes:
            _, gone = self._entries.popitem(last=False)
            self.bytes -= gone.nbytes
            self.evicted += 1
        self._entries[key] = Snapshot(scope, len(prefix), key[2], slot, state, self.entry_bytes)
        self.bytes += self.entry_bytes
        self.taken += 1

    def best(self, scope: str, prompt: Sequence[int], limit: int,
             usable: Callable[[Snapshot], bool]) -> Snapshot | None:
        """The longest snapshot of scope `scope` whose prefix `prompt` starts with, at most `limit` long,
        that `usable` accepts (its source slot still holds the prefix's K/V rows), or None.

        The prompt's prefixes are hashed once, incrementally, at the lengths the pool holds."""
        cands = [e for e in self._entries.values() if e.scope == scope and e.n <= limit]
        if not cands:
            return None
        lengths = sorted({e.n for e in cands})
        data = np.asarray(prompt[: lengths[-1]], np.int64)
        h = hashlib.blake2b(digest_size=16)
        digests: dict[int, bytes] = {}
        at = 0
        for n in lengths:
            h.update(data[at:n].tobytes())
            at = n
            digests[n] = h.digest()
        for e in sorted(cands, key=lambda e: -e.n):
            if digests[e.n] == e.digest and usable(e):
                return e
        return None

    def touch(self, snap: Snapshot) -> None:
        """`snap` was resumed from: it becomes the most recently used."""
        key = (snap.scope, snap.n, snap.digest)
        if self._entries.get(key) is snap:
            self._entries.move_to_end(key)

    def overwritten(self, slot: int, keep: int) -> None:
        """Slot `slot`'s cache rows from `keep` on are about to be overwritten: the snapshots taken there
        past `keep` lost their K/V rows (a model with per-token state only; the caller decides)."""
        for key, e in list(self._entries.items()):
            if e.slot == slot and e.n > keep:
                del self._entries[key]
                self.bytes -= e.nbytes

    def clear(self) -> None:
        """Forget every snapshot (the state they were taken with was rebuilt)."""
        self._entries.clear()
        self.bytes = 0
