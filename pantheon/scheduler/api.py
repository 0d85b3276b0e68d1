"""The seam between the web layer and whatever generates tokens for a model.

A backend (`SingleUserBackend` when batching is off, `BatchScheduler` by default) accepts a
`GenRequest` and a `sink` callback, and returns a `Handle` at once: it never blocks the caller (a
gevent greenlet). From then on the backend's own OS thread calls `sink` with, in order:

    Started()                       the request has a slot and is prefilling (absent if refused)
    Tokens(ids)                     one or more sampled ids, in order
    Finished(reason, error, ...)    exactly once, last: "stop" (EOS id), "length" (budget),
                                    "cancelled" (Handle.cancel), or "error" with `error` set

A request that cannot start (queue timeout, shutdown, admission denied) gets only
`Finished("error", error=BusyError(...))`, so the web layer can still answer with a status code.
`sink` must not block: it hands the event to the request greenlet through a thread-safe wake-up.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from ..sampler import SamplingParams


@dataclass
class GenRequest:
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    stop_ids: frozenset[int] = frozenset()
    session_id: str | None = None
    # Prefix reuse happens only between requests of one scope (the web layer's tenant key: API key,
    # user, session, cache_salt), so a prompt's cached length never tells one client about another's.
    cache_scope: str = ""
    request_id: str = field(default_factory=lambda: secrets.token_hex(12))

    def __post_init__(self) -> None:
        # One seed per request (not per step), and a penalty window the in-step sampler can see.
        from ..engine import PENALTY_WINDOW
        p = self.params.resolved()
        if p.penalty_window > PENALTY_WINDOW:
            p = dataclasses.replace(p, penalty_window=PENALTY_WINDOW)
        self.params = p


@dataclass(frozen=True)
class Started:
    reused_tokens: int = 0  # prompt tokens served from a prefix already in the slot


@dataclass(frozen=True)
class Tokens:
    ids: tuple[int, ...]


@dataclass(frozen=True)
class Finished:
    reason: str  # "stop" | "length" | "cancelled" | "error"
    error: Exception | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reused_tokens: int = 0


Event = Started | Tokens | Finished
Sink = Callable[[Event], None]


class Handle(Protocol):
    def cancel(self) -> None:
        """Stop generating (client gone, stop string hit): the slot/lock is freed within one step."""


class Backend(Protocol):
    def submit(self, req: GenRequest, sink: Sink) -> Handle:
        """Start or queue a request; raises BusyError (429/503) when it cannot even be queued."""

    def load_info(self) -> dict:
        """Counters for /metrics and bench: running, queued, slots, prefix hits..."""

    def close(self, timeout: float = 10.0) -> None:
        """Refuse new work, cancel what runs, join the thread(s)."""
