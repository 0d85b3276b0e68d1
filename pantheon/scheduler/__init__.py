"""Per-model generation backends: the batch scheduler (default) or the single-user path."""

from __future__ import annotations

from typing import Any

from ..config import Settings
from .api import Backend, Finished, GenRequest, Handle, Sink, Started, Tokens
from .single import SingleUserBackend

__all__ = ["Backend", "Finished", "GenRequest", "Handle", "Sink", "Started", "Tokens", "SingleUserBackend",
           "make_backend"]


def make_backend(model: Any, settings: Settings) -> Backend:
    """QWEN35_BATCH_SLOTS=0 selects the single-user path; otherwise the continuous-batching scheduler."""
    if settings.batch_slots == 0:
        return SingleUserBackend(model)
    try:
        from .batch import BatchScheduler
    except ImportError:
        return SingleUserBackend(model)
    return BatchScheduler(model, settings)
