"""Per-model generation backends: the continuous-batching scheduler, one per loaded model.

The single-user setting (PANTHEON_BATCH_SLOTS=0) is the same scheduler with one slot that refuses a
second concurrent request at once (429) instead of queueing it: one generation loop, not two.
"""

from __future__ import annotations

from typing import Any

from pantheon.config import Settings
from pantheon.types import Backend, Finished, GenRequest, Handle, Sink, Started, Tokens

__all__ = ["Backend", "Finished", "GenRequest", "Handle", "Sink", "Started", "Tokens", "make_backend"]


def make_backend(model: Any, settings: Settings, watch: Any = None, dies: Any = None) -> Backend:
    """The model's scheduler. Its memory-pressure callback reads `watch` (a pantheon.runtime.memory.MemWatch;
    default: the process-wide one) scoped to the model's dies (`dies`: the DieManager that maps its
    devices to die ids; without one, every pool counts). No running watch: never under pressure.
    """
    from pantheon.runtime import memory
    from pantheon.scheduler.batch import BatchScheduler
    w = watch if watch is not None else memory.memwatch()
    if w is None or not w.running:
        return BatchScheduler(model, settings)
    devices = getattr(model, "devices", None)
    ids = dies.die_ids_of(devices) if dies is not None and devices else None
    return BatchScheduler(model, settings, pressure=w.pressure_fn(ids))
