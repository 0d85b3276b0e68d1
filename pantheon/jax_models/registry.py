"""GGUF architecture string -> the module that implements it, and what that module can do.

Every module satisfies `interface.ArchModule` and declares its optional capabilities in
`CAPABILITIES`; callers read them with `capabilities_of` instead of probing for functions.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from pantheon.jax_models.interface import Capabilities

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
    "rwkv7": "rwkv7",
}

NO_CAPABILITIES = Capabilities()


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


def capabilities_of(arch: Any) -> Capabilities:
    """The optional capabilities `arch` (a module from `module_for`) declares.

    None (no module) and stand-ins without a declaration (test doubles) have none: every optional
    path then stays off, which is always a correct, if slower, way to run.
    """
    caps = getattr(arch, "CAPABILITIES", None)
    return caps if isinstance(caps, Capabilities) else NO_CAPABILITIES


def registered_modules() -> list[ModuleType]:
    """Every distinct module the table names (those whose file exists), in table order."""
    out: list[ModuleType] = []
    for arch in _MODULES:
        mod = module_for(arch)
        if mod is not None and mod not in out:
            out.append(mod)
    return out
