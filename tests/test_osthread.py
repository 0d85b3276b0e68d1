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
