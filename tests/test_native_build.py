"""Building pantheon.ops.native's library: in any OS thread of a gevent-patched process, atomically, visibly.

Why these tests: under `pantheon serve` the first model loads in an OS thread of gunicorn's
gevent-patched worker, where `subprocess` cannot wait for children; the build used to fail there, leave
a `tmp*.so` behind and serve on XLA's slower forms with only a log line to say so. The gevent cases run
in child processes (`python -c`) so this test process stays unpatched. The compiles cost a few seconds
each on a loaded CPU; the failure and timeout cases use a broken source or a fake compiler and are quick.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from conftest import wait_until
from pantheon.ops import native
from pantheon import osthread
from pantheon.serving.metrics import Metrics
from server_util import LLAMA, ROOT, start_server

needs_build = pytest.mark.skipif(not native._cpu_supported() or not (shutil.which("g++") or shutil.which("c++")),
                                 reason="the kernels need an x86 CPU with AVX2/FMA/F16C and a C++ compiler")

# Run in a child: patch everything like gunicorn's gevent worker, then enable the kernels from a real
# OS thread (as pantheon.web's loader does) and use them once. With "watcher", the hub's thread first
# runs a gevent subprocess, which installs gevent's SIGCHLD handler: from then on it reaps every child,
# the build's compiler included, and the hub keeps running while the build waits.
# The children build at -O0 (what is tested is how two builds meet, not the code's speed: -O3 costs
# 17 CPU-seconds a build), and each waits for the other at a file barrier before it builds, so that
# the two compiles really run at once; each reports when its compile ran (CLOCK_MONOTONIC, one clock
# for every process of the host).
_GEVENT_BUILD = textwrap.dedent("""
    from gevent import monkey; monkey.patch_all()
    import json, os, subprocess, sys, time
    from pathlib import Path
    import gevent
    from pantheon import osthread
    from pantheon.ops import native
    native._FLAGS = tuple("-O0" if f == "-O3" else f for f in native._FLAGS)
    if sys.argv[2] == "watcher":
        subprocess.run(["true"], check=True)
    out = {}
    compile_one = native._compile
    def timed_compile(path):
        start = time.monotonic()
        try:
            compile_one(path)
        finally:
            out["compiled"] = [start, time.monotonic()]
    native._compile = timed_compile
    def build():
        try:
            barrier = Path(sys.argv[3])
            (barrier / sys.argv[2]).touch()
            deadline = time.monotonic() + 300
            while len(os.listdir(barrier)) < 2:  # both children are here (hang guard: 300 s)
                assert time.monotonic() < deadline, "the other child never arrived"
                osthread.original("time", "sleep")(0.01)  # poll interval; this OS thread has no hub
            out["ok"] = native.enable(Path(sys.argv[1]))
            out["reason"] = native.unavailable_reason()
            if out["ok"]:
                import jax, jax.numpy as jnp, numpy as np
                x = np.arange(24, dtype=np.float32).reshape(3, 8) / 10
                w = np.arange(40, dtype=np.float32).reshape(5, 8) / 7
                got = np.asarray(jax.jit(native.matmul)(jnp.asarray(x), jnp.asarray(w)))
                out["matmul_ok"] = bool(np.allclose(got, x @ w.T, rtol=1e-5))
        except BaseException as exc:
            out["error"] = repr(exc)
    t = osthread.start_thread(build, "native-build")
    while not t.join(0):
        gevent.sleep(0.02)
    print("RESULT " + json.dumps(out))
""")


@pytest.mark.slow
@needs_build
def test_two_gevent_patched_processes_build_from_os_threads_at_once(tmp_path, monkeypatch):
    """Both builds run at once into one empty directory, one of them with gevent's SIGCHLD handler
    reaping its compiler: both load a working library, and exactly that library remains."""
    cache, barrier = tmp_path / "native", tmp_path / "barrier"
    barrier.mkdir()
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    procs = [subprocess.Popen([sys.executable, "-c", _GEVENT_BUILD, str(cache), mode, str(barrier)], cwd=ROOT,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for mode in ("plain", "watcher")]
    spans = []
    for proc in procs:
        log, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, log[-3000:]
        line = next((ln for ln in log.splitlines() if ln.startswith("RESULT ")), None)
        assert line, log[-3000:]
        result = json.loads(line[len("RESULT "):])
        spans.append(result.pop("compiled"))
        assert result == {"ok": True, "reason": None, "matmul_ok": True}, log[-3000:]
    print("compiles ran (monotonic s):", spans)
    assert max(a for a, _ in spans) < min(b for _, b in spans), spans  # the two compiles overlapped
    monkeypatch.setattr(native, "_FLAGS", tuple("-O0" if f == "-O3" else f for f in native._FLAGS))  # as built
    assert [p.name for p in cache.iterdir()] == [native._library_path(cache).name]


def test_a_compile_error_leaves_nothing_and_says_why(tmp_path, monkeypatch):
    if not (shutil.which("g++") or shutil.which("c++")):
        pytest.skip("no C++ compiler")
    broken = tmp_path / "broken.cc"
    broken.write_text("int f() { return ; }\nthis is not C++\n")
    monkeypatch.setattr(native, "SOURCE", broken)
    cache = tmp_path / "native"
    with pytest.raises(RuntimeError, match=r"failed with exit status 1: .*(error|expected)") as info:
        native._compile(cache / "lib.so")
    assert "broken.cc" in str(info.value)
    assert list(cache.iterdir()) == []


def _fake_compiler(bin_dir: Path, body: str) -> None:
    bin_dir.mkdir()
    for name in ("g++", "c++"):
        script = bin_dir / name
        script.write_text("#!/bin/sh\n" + body)
        script.chmod(0o755)


def test_enable_reports_a_failing_compiler_and_keeps_xla(tmp_path, monkeypatch):
    """The reason names the compiler, its exit status and its stderr; the flags are restored after."""
    _fake_compiler(tmp_path / "bin", "echo 'fakecc: cannot build today' >&2\nexit 7\n")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    monkeypatch.setattr(native, "_ready", False)
    monkeypatch.setattr(native, "_failed", None)
    monkeypatch.setattr(native, "_cpu_supported", lambda: True)
    cache = tmp_path / "native"
    assert native.enable(cache) is False
    reason = native.unavailable_reason()
    assert "exit status 7" in reason and "fakecc: cannot build today" in reason, reason
    assert list(cache.iterdir()) == []


def test_a_hung_compiler_is_killed_with_its_children_and_leaves_nothing(tmp_path, monkeypatch):
    """The compiler's own children (cc1plus, as, ld) would otherwise write the output after the temp
    was removed: how the subprocess build left an orphan `tmp*.so` behind."""
    pids = tmp_path / "pids"
    # The fake compiler records its pid and its background child's, whose job is to write the output
    # 3 s later, after the 2 s build timeout; then it hangs (sleep 60). Those sleeps are the test's
    # input, not a wait.
    _fake_compiler(tmp_path / "bin", textwrap.dedent(f"""\
        while [ "$#" -gt 1 ]; do [ "$1" = -o ] && out=$2; shift; done
        ( sleep 3; echo late > "$out" ) &
        echo $$ $! > {str(pids)!r}
        sleep 60
    """))
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    monkeypatch.setattr(native, "BUILD_TIMEOUT_S", 2.0)
    cache = tmp_path / "native"
    with pytest.raises(RuntimeError, match="timed out"):
        native._compile(cache / "lib.so")
    compiler, writer = (int(p) for p in pids.read_text().split())

    def gone(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    # Killed, not left to finish: the hung compiler would live 60 s, past this hang guard. A writer
    # that survived would have written by the time it is gone, which the listing below would show.
    wait_until(lambda: gone(compiler) and gone(writer), 30, "the compiler and its child to be killed")
    assert list(cache.iterdir()) == []


def test_run_reports_status_and_output_without_gevent(tmp_path):
    status, output = osthread.run_process(["/bin/sh", "-c", "echo out; echo err >&2; exit 3"], 10)
    assert status == 3 and output.split() == ["out", "err"]


def test_stale_temps_of_dead_builders_go_and_live_ones_stay(tmp_path):
    host = native._host_tag()
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no longer runs
    names = {
        "dead": f"{native.TEMP_PREFIX}{host}-{dead.pid}-abc.so",
        "live": f"{native.TEMP_PREFIX}{host}-{os.getpid()}-abc.so",
        "other_host_fresh": f"{native.TEMP_PREFIX}0000beef-{dead.pid}-abc.so",
        "other_host_old": f"{native.TEMP_PREFIX}0000beef-{os.getpid()}-def.so",
        "legacy_fresh": "tmpabc123.so",
        "legacy_old": "tmpdef456.so",
        "library": "cpu_kernels-0123456789abcdef.so",
    }
    for name in names.values():
        (tmp_path / name).write_bytes(b"x")
    old = time.time() - 3 * native.BUILD_TIMEOUT_S
    for key in ("other_host_old", "legacy_old"):
        os.utime(tmp_path / names[key], (old, old))
    removed = native.remove_stale_temps(tmp_path)
    assert sorted(p.name for p in removed) == sorted(names[k] for k in ("dead", "other_host_old", "legacy_old"))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        names[k] for k in ("live", "other_host_fresh", "legacy_fresh", "library"))


def test_native_kernels_gauge_takes_the_max_over_replicas():
    m = Metrics()
    m.set_backend_source(lambda: [("a", {"native_kernels": 1, "running": 1}), ("a", {"native_kernels": 1}),
                                  ("b", {"native_kernels": 0})])
    body = m.render()[0].decode()
    assert re.search(r'^pantheon_native_kernels\{model="a"\} 1\.0$', body, re.M), body
    assert re.search(r'^pantheon_native_kernels\{model="b"\} 0\.0$', body, re.M), body
    assert re.search(r'^pantheon_running_requests\{model="a"\} 1\.0$', body, re.M), body


@pytest.mark.slow
@needs_build
def test_first_serve_on_an_empty_home_builds_and_uses_the_kernels(tmp_path):
    """A real gunicorn gevent server with nothing in $PANTHEON_HOME: the model's steps use the kernels,
    /metrics says so, and the cache holds the library and no temp file."""
    # its own server: an empty home is the point (no kernels, no compile cache), so nothing can be shared
    srv = start_server([f"tiny={LLAMA}"], env={"PANTHEON_HOME": str(tmp_path), "PANTHEON_WARMUP": "0"})
    try:
        body = srv.get("/metrics").text
        assert re.search(r'^pantheon_native_kernels\{model="tiny"\} 1\.0$', body, re.M), \
            "\n".join(ln for ln in body.splitlines() if "native" in ln) + "\n" + srv.log_tail()
        cache = tmp_path / "native"
        assert [p.name for p in cache.iterdir()] == [native._library_path(cache).name]
        assert "native matmul unavailable" not in srv.log_tail(400)
    finally:
        srv.stop()
