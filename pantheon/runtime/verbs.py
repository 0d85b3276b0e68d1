"""The engine's interface, declared: what a loaded model offers, and which of its methods are verbs.

Why declared. A multi-host cluster keeps every process stepping in lock step by sending each
*verb* -- a method that changes device state or runs a compiled program -- to the followers before
it runs on the leader (pantheon.serving.distributed). A verb the leader runs without sending it
desyncs the followers silently: their next collective waits for a program that never comes. So the
set of verbs is not a list kept beside the engine; it is derived from this one interface, which
`engine.Model` implements and the cluster's `LeaderModel` is built from, member by member:

    @verb   changes device state or runs a compiled program: every process runs it, in order
    @wait   reads a dispatched result to the host (may block on the device): the leader's own copy
    @host   touches no device state (host bookkeeping, the bucket tables)

plus the data attributes below (read-only numbers and host objects). `uncovered(cls)` names what a
class offers beyond the interface, or declares wrongly: a public method the interface does not
declare, and a method declared @wait / @host whose signature carries a `DecodeState` (state in or
out: it changes device state, so it must be a verb). tests/test_multihost.py holds `Model` to it, so
a new state-changing method of the engine fails a test until it is declared a verb.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # the annotations' names only (this module imports nothing of JAX)
    from pantheon.runtime.decode_state import DecodeState

VERB, WAIT, HOST = "verb", "wait", "host"
STATE_TYPE = "DecodeState"  # a signature that carries one changes device state


def _kind(kind: str) -> Callable[[Callable], Callable]:
    def mark(fn: Callable) -> Callable:
        fn.__engine_kind__ = kind  # type: ignore[attr-defined]
        return fn
    return mark


verb, wait, host = _kind(VERB), _kind(WAIT), _kind(HOST)


class Engine(Protocol):
    """A loaded model as the scheduler, the registry, the tools and the cluster see it."""

    # -- what it is (read-only) ---------------------------------------------------------------------
    name: str
    config: Any  # the architecture's ModelConfig
    arch: Any  # the architecture's module (pantheon.jax_models)
    caps: Any  # its Capabilities
    card: Any  # the JAX-free ModelCard the web layer reads
    tokenizer: Any
    devices: list
    opts: Any  # the LoadOptions it was loaded with
    dtype: Any
    kv_dtype: Any
    weight_bytes: int
    native_matmul: bool
    kernels: Any
    n_slots: int
    max_seq: int
    chunk: int
    capacity: int
    scratch_slot: int
    mask_words: int
    supports_mixed: bool
    mixed_rows: int
    supports_verify: bool
    verify_ks: tuple
    verify_rows: tuple
    row_buckets: tuple
    chunk_buckets: tuple
    span_buckets: tuple
    fresh_embed_rows: int  # rows `embed_fresh` takes at most (0: it is not offered)
    released: bool

    # -- verbs: change device state or run a compiled program -----------------------------------------
    @verb
    def new_state(self) -> DecodeState: ...

    @verb
    def warmup(self, state: DecodeState, decode: bool = True, prefill: bool = True,
               mixed: bool = True) -> DecodeState: ...

    @verb
    def insert(self, state: DecodeState, new: Any) -> DecodeState: ...

    @verb
    def release(self, state: DecodeState, slot: int) -> DecodeState: ...

    @verb
    def step(self, state: DecodeState, plan: Any, want_logits: bool = False,
             mask: Any = None) -> tuple[Any, DecodeState]: ...

    @verb
    def forward(self, state: DecodeState, plan: Any) -> tuple[Any, DecodeState]: ...

    @verb
    def sample(self, state: DecodeState, fwd: Any, mask: Any = None,
               want_logits: bool = False) -> tuple[Any, DecodeState]: ...

    @verb
    def copy_slot(self, state: DecodeState, src: int, dst: int) -> DecodeState: ...

    @verb
    def snapshot(self, state: DecodeState, slot: int) -> Any: ...  # runs a program; followers keep theirs

    @verb
    def restore(self, state: DecodeState, slot: int, snap: Any) -> DecodeState: ...

    @verb
    def prompt_logprobs(self, state: DecodeState, tokens: Sequence[int], k: int) -> tuple[list, DecodeState]: ...

    @verb
    def forward_rows(self, state: DecodeState, tokens: Sequence[Sequence[int]], slots: Sequence[int],
                     starts: Sequence[int], all_logits: bool = False) -> tuple[Any, DecodeState]: ...

    @verb
    def embed(self, state: DecodeState, rows: Sequence[Sequence[int]], slots: Sequence[int],
              starts: Sequence[int], pooling: Any = "mean") -> tuple[Any, DecodeState]: ...

    @verb
    def embed_fresh(self, rows: Sequence[Sequence[int]], pooling: Any = "mean") -> Any: ...  # runs a program

    @verb
    def encode_images(self, pixels: list) -> Any: ...  # runs the vision encoder's program

    @verb
    def free(self) -> None: ...

    # -- reads of a dispatched result -----------------------------------------------------------------
    @wait
    def read(self, handle: Any) -> Any: ...

    @wait
    def read_logprobs(self, handle: Any) -> Any: ...

    # -- host only -------------------------------------------------------------------------------------
    @host
    def poll(self, handle: Any) -> Any: ...

    @host
    def state_bytes_per_token(self) -> int: ...

    @host
    def embed_fresh_shape(self, rows: int, longest: int) -> tuple[int, int]: ...  # the padded (rows, tokens) of a call

    @host
    def snapshot_bytes(self) -> int: ...

    @host
    def warmup_plans(self, decode: bool = True, prefill: bool = True, mixed: bool = True) -> list: ...

    @host
    def compiled_shapes(self) -> set: ...

    # -- the background compile (one die only: a mesh compiles every program before serving) --------
    @host
    def program_keys(self, decode: bool = True, prefill: bool = True, mixed: bool = True) -> list: ...

    @host
    def compile_progress(self) -> tuple[int, int]: ...

    @host
    def verify_fits(self, n_decode: int, k: int, reach: int) -> bool: ...

    @host
    def warming(self) -> bool: ...

    @host
    def wait_compiled(self, timeout: float | None = None) -> bool: ...

    @host
    def stop_warmup(self, timeout: float = 300.0) -> None: ...


def _methods(kind: str) -> frozenset[str]:
    return frozenset(n for n, v in vars(Engine).items() if getattr(v, "__engine_kind__", None) == kind)


VERBS: frozenset[str] = _methods(VERB)  # what the cluster broadcasts: derived, never listed
WAITS: frozenset[str] = _methods(WAIT)
HOSTS: frozenset[str] = _methods(HOST)
ATTRIBUTES: frozenset[str] = frozenset(Engine.__annotations__)
MEMBERS: frozenset[str] = VERBS | WAITS | HOSTS | ATTRIBUTES


def _carries_state(fn: Any) -> bool:
    """Whether a method's signature takes or returns a DecodeState (by its annotations' text)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return False
    notes = [p.annotation for p in sig.parameters.values()] + [sig.return_annotation]
    return any(STATE_TYPE in (a if isinstance(a, str) else getattr(a, "__name__", repr(a))) for a in notes
               if a is not inspect.Parameter.empty)


def uncovered(cls: type) -> list[str]:
    """What `cls` offers that the interface does not cover: each public method it does not declare, and
    each method it declares @wait or @host (not broadcast) whose signature carries a DecodeState."""
    out = []
    for name, raw in inspect.getmembers(cls):
        if name.startswith("_"):
            continue
        fn = raw.fget if isinstance(raw, property) else raw
        if not callable(fn) or isinstance(raw, property):
            continue
        if name not in MEMBERS:
            out.append(f"{cls.__name__}.{name} is not declared in pantheon.runtime.verbs.Engine "
                       "(a verb, a wait or a host method)")
        elif name not in VERBS and _carries_state(fn):
            out.append(f"{cls.__name__}.{name} takes or returns a {STATE_TYPE} but is not a verb: "
                       "a cluster would not broadcast it")
    return out
