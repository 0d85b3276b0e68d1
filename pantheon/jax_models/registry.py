"""GGUF architecture string -> the module that implements it.

Each module provides load_params(src, cfg, dtype), init_state(cfg, n_slots, capacity, dtype),
state_bytes_per_token(cfg) and forward(params, state, tokens, slots, start, n_new, *, cfg, span,
all_logits) -> (logits, state).
"""

from __future__ import annotations

import importlib
from types import ModuleType

_MODULES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "llama",
    "qwen3": "llama",
    "qwen3moe": "llama",
    "phi3": "phi3",
    "gemma3": "gemma3",
    "qwen35": "qwen35",
    "qwen35moe": "qwen35",
    "qwen3next": "qwen35",
}


def module_for(arch: str) -> ModuleType | None:
    """The implementing module, or None when the arch is known but its file does not exist yet."""
    mod = _MODULES.get(arch)
    if mod is None:
        return None
    try:
        return importlib.import_module(f"pantheon.jax_models.{mod}")
    except ModuleNotFoundError as exc:
        if exc.name == f"pantheon.jax_models.{mod}":
            return None
        raise
