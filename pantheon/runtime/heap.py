"""The C heap: hand the pages freed memory leaves in glibc's arenas back to the OS.

Its own module because both the engine (after its background compile) and the serving layers
(after a load or an unload) call it, and the engine must not depend on admission (pantheon.runtime.memory).
"""

from __future__ import annotations

from collections.abc import Callable

_malloc_trim: Callable[[int], int] | None | bool = False  # False: not looked up yet; None: not glibc


def _find_malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None where the C library has none (musl, macOS).

    Looked up among the symbols already loaded into the process (`CDLL(None)`), not with
    ctypes.util.find_library: that runs ldconfig in a subprocess, which gevent refuses from a
    non-main OS thread (the server's startup and admin threads)."""
    import ctypes
    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


def release_freed_memory() -> bool:
    """Collect garbage, then hand the C heap's free pages back to the OS; True if the heap was trimmed.

    Why: XLA:CPU's buffers (weights, caches, step temporaries) are malloc'd. When an unloaded model's
    gigabytes are freed, glibc keeps most of them in its arenas (freed chunks below the top of a heap,
    one arena per thread that ever allocated) instead of returning them, so the worker's RSS barely
    drops and the next load's fresh allocations stack on top (measured: 2.9 -> 3.9 GiB over five
    load/unload cycles of SmolLM2-135M). `malloc_trim(0)` releases every free page of every arena.
    A full gc and a trim take well under a second; the registry calls this after a load (the
    upload's host transients), an unload and a failed upload, the scheduler after its warm-up and
    the engine when its background compile ends (what compiling freed), never per request.
    """
    global _malloc_trim
    import gc
    gc.collect()
    if _malloc_trim is False:
        _malloc_trim = _find_malloc_trim()
    if _malloc_trim is None:
        return False
    try:
        return bool(_malloc_trim(0))  # type: ignore[operator]
    except Exception:  # never let giving memory back fail an unload
        return False
