"""Per-model generation backends: the batch scheduler (default) or the single-user path."""

from __future__ import annotations

from typing import Any

from ..config import Settings
from .api import Backend, Finished, GenRequest, Handle, Sink, Started, Tokens
from .single import SingleUserBackend

__all__ = ["Backend", "Finished", "GenRequest", "Handle", "Sink", "Started", "Tokens", "SingleUserBackend",
           "make_backend"]


def make_backend(model: Any, settings: Settings, watch: Any = None, dies: Any = None) -> Backend:
    """QWEN35_BATCH_SLOTS=0 selects the single-user path; otherwise the continuous-batching scheduler.

    The scheduler's memory-pressure callback reads `watch` (a pantheon.memory.MemWatch; default: the
    process-wide one) scoped to the model's dies (`dies`: the DieManager that maps its devices to die
    ids; without one, every pool counts). No running watch: the scheduler's plain default (never
    under pressure).
    """
    if settings.batch_slots == 0:
        return SingleUserBackend(model)
    try:
        from .batch import BatchScheduler
    except ImportError:
        return SingleUserBackend(model)
    from .. import memory
    w = watch if watch is not None else memory.memwatch()
    if w is None or not w.running:
        return BatchScheduler(model, settings)
    devices = getattr(model, "devices", None)
    ids = dies.die_ids_of(devices) if dies is not None and devices else None
    return BatchScheduler(model, settings, pressure=w.pressure_fn(ids))
