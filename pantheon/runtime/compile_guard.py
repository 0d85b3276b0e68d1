"""Counts JAX compilations process-wide and, once armed, turns a new one into an error.

A serving step that recompiles stalls every stream for seconds. Models compile all their bucket
shapes at load ("warm-up"); with PANTHEON_FORBID_COMPILE=1 the guard is armed afterwards and any
later lowering raises `CompileForbiddenError` from the call that caused it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

import jax

from pantheon import osthread
from pantheon.errors import CompileForbiddenError

_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"  # fires for every new lowering, cache hit or not

# _lock guards _count and _forbidden_threads; listeners run on whichever thread compiles.
_lock = osthread.Lock()
_count = 0
_installed = False
_forbidden_threads: set[int] = set()


def _listener(name: str, duration: float, **_: object) -> None:
    global _count
    if name != _EVENT:
        return
    with _lock:
        _count += 1
        forbid = threading.get_ident() in _forbidden_threads
    if forbid:
        raise CompileForbiddenError("a JAX compilation happened after warm-up (PANTHEON_FORBID_COMPILE=1)")


def forbid_current_thread(flag: bool = True) -> None:
    """Arm (or disarm) the guard for the calling thread only: a serving driver after its warm-up,
    while other threads may still be loading and compiling other models."""
    with _lock:
        if flag:
            _forbidden_threads.add(threading.get_ident())
        else:
            _forbidden_threads.discard(threading.get_ident())


def install() -> None:
    """Idempotent: register the listener once per process."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    jax.monitoring.register_event_duration_secs_listener(_listener)


def compile_count() -> int:
    with _lock:
        return _count


def enable_persistent_cache(home: Path) -> None:
    """JAX's on-disk compilation cache under $PANTHEON_HOME, so restarts skip XLA compiles."""
    cache_dir = home / "xla-cache"
    cache_dir.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(cache_dir))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


# A compile option equal to XLA's default, so it changes no program, only the persistent cache's key
# (the key hashes the options given): a compile under `fresh_compile` never finds an entry there.
FRESH_OPTIONS = {"xla_embed_ir_in_executable": False}


@contextlib.contextmanager
def fresh_compile() -> Iterator[dict]:
    """Compile in this block (this thread only) neither from nor into JAX's persistent cache: pass the
    options it yields to `Lowered.compile(compiler_options=...)` (they make the cache key one nothing
    is ever written under; the block stops this thread's writes)."""
    from jax._src import config as jax_config  # the flag's thread-local context (no public form)
    with jax_config.persistent_cache_min_compile_time_secs(float("inf")):
        yield dict(FRESH_OPTIONS)
