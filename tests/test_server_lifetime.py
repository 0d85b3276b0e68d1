"""A server never outlives what started it: killing a test run (or `pantheon serve`) ends its worker.

A killed test process used to leave its gunicorn servers running (one held 4.2 GB). Now the test
helper's server asks the kernel to SIGKILL it when the test process dies, and pantheon's gunicorn
worker asks the same of its arbiter, so `kill -9` of the test process ends the whole tree.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from server_util import LLAMA

pytestmark = pytest.mark.slow  # server processes (make test-quick leaves it out)

HERE = Path(__file__).resolve().parent

RUNNER = textwrap.dedent(f"""
    import sys, time
    sys.path.insert(0, {str(HERE)!r})
    from server_util import start_server
    srv = start_server(["llama={LLAMA}"], env={{"PANTHEON_WARMUP": "0"}})
    print(srv.proc.pid, flush=True)
    time.sleep(600)  # killed by the test long before this
""")


def gone_within(pids: list[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return True
        time.sleep(0.1)
    return False


def test_killing_the_test_process_kills_its_server_and_worker():
    runner = subprocess.Popen([sys.executable, "-c", RUNNER], stdout=subprocess.PIPE, text=True)
    tree: list[int] = []
    try:
        master = int(runner.stdout.readline())
        workers = [c.pid for c in psutil.Process(master).children(recursive=True)]
        assert workers, "gunicorn has no worker"
        tree = [master, *workers]
        os.kill(runner.pid, signal.SIGKILL)  # no cleanup code of the test run gets to run
        runner.wait(10)
        assert gone_within(tree, 30), [p for p in tree if psutil.pid_exists(p)]
    finally:
        for pid in tree:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if runner.poll() is None:
            runner.kill()
