"""Real OS threads carry their names into the kernel, so top and perf tell a driver from a loader."""

from __future__ import annotations

from pathlib import Path

from pantheon import osthread


def _own_os_name() -> str:
    return Path("/proc/thread-self/comm").read_text().strip()


def test_a_started_thread_has_its_name_in_the_kernel_cut_to_15_bytes():
    seen: list[str] = []
    osthread.start_thread(lambda: seen.append(_own_os_name()), name="driver-smollm2-135m").join(10)
    assert seen == ["driver-smollm2-"]


def test_map_threads_names_each_worker():
    names = osthread.map_threads(lambda _: _own_os_name(), [0, 1, 2], workers=3, name="compile-x")
    assert set(names) <= {"compile-x-0", "compile-x-1", "compile-x-2"} and names[0].startswith("compile-x-")


def test_code_that_runs_on_os_threads_takes_no_patched_lock():
    """Under gunicorn's gevent worker `threading.Lock` is a greenlet lock: shared by two OS threads
    (the compile-<model> workers loading stored programs) a waiter was never woken, and a warm start
    hung. The engine, scheduler and serving layers run on OS threads, so they take their locks,
    conditions and events from `osthread` (the originals); a module-level `threading.X()` there fails."""
    import ast

    root = Path(osthread.__file__).parent
    found = []
    for layer in ("runtime", "scheduler", "serving", "ops", "jax_models"):
        for f in sorted((root / layer).rglob("*.py")):
            for node in ast.walk(ast.parse(f.read_text())):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and isinstance(node.func.value, ast.Name) and node.func.value.id == "threading"
                        and node.func.attr in ("Lock", "RLock", "Condition", "Event", "Semaphore",
                                               "BoundedSemaphore")):
                    found.append(f"{f.relative_to(root)}:{node.lineno} threading.{node.func.attr}()")
    assert found == [], found
