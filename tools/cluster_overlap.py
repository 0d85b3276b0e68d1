"""What releasing the cluster's dispatch lock at dispatch is worth: decode steps per second of one model
over two processes, the driver's way (dispatch step N+1, then read step N), with the lock released at
dispatch (one mirrored model: `Leader.chained`) and held until each call's device work is done (as with
several models).

    python tools/cluster_overlap.py            # runs both processes itself; prints one line per mode

Each process sees 2 CPU devices; the tiny llama fixture (tests/fixtures) is sharded over all 4. A figure
on a shared machine: compare the two modes of one run, not runs of different days.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu",
       "PANTHEON_CLUSTER_SECRET": "overlap-measurement-secret"}
STEPS = 100
ROUNDS = 3  # each mode measured this many times, alternating
HOST_MS = (0.0, 5.0)  # host work per step: none, and about the driver's for a full batch


def busy(ms: float) -> None:
    """Hold the interpreter for `ms` milliseconds, as the driver's planning and emitting do."""
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        pass


def decode_rate(model, steps: int, host_ms: float) -> float:
    """Steps per second of two slots decoding, each step dispatched before the previous one is read,
    with `host_ms` of host work per step (the driver's planning, emitting and bookkeeping)."""
    from pantheon.runtime.decode_state import slot_insert
    from pantheon.runtime.engine import Chunk, StepPlan
    from pantheon.types import GREEDY
    state = model.new_state()
    for slot in (0, 1):
        state = model.insert(state, slot_insert(slot, [3, 4, 5], 0, GREEDY, 10 ** 6, ()))
        h, state = model.step(state, StepPlan(chunk=Chunk(slot, (3, 4, 5), 0, True)))
        model.read(h)
    h, state = model.step(state, StepPlan(decode=(0, 1), reach=5))
    model.read(h)  # every program compiled
    t0 = time.perf_counter()
    prev = None
    for i in range(steps):
        h, state = model.step(state, StepPlan(decode=(0, 1), reach=min(6 + i, 60)))
        busy(host_ms)
        if prev is not None:
            model.read(prev)
        prev = h
    model.read(prev)
    return steps / (time.perf_counter() - t0)


def process(port: int, pid: int) -> int:
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import TINY
    from pantheon.config import load_settings
    from pantheon.runtime import engine
    from pantheon.serving import distributed
    spec = distributed.ClusterSpec(f"127.0.0.1:{port}", 2, pid, 90.0, secret=load_settings().cluster_secret)
    if pid != 0:
        return distributed.run_follower(spec)
    leader = distributed.start_leader(spec)
    opts = engine.LoadOptions(n_slots=2, max_seq=64, prefill_chunk=16, kv_dtype="float32")
    model = leader.load(TINY / "llama.gguf", opts, [0, 1, 2, 3])
    chained = leader.chained
    lines = []
    hold = lambda: False  # noqa: E731 - as with several mirrored models: held until each call is done
    for host_ms in HOST_MS:
        rates: dict[str, list[float]] = {"released": [], "held": []}
        for mode in ("held", "released") * ROUNDS:  # alternated, so drift on a shared machine hits both
            leader.chained = chained if mode == "released" else hold
            rates[mode].append(decode_rate(model, STEPS, host_ms))
        lines.append(f"host work {host_ms:g} ms/step: lock released at dispatch "
                     f"{'/'.join(f'{r:.1f}' for r in rates['released'])} steps/s, held until done "
                     f"{'/'.join(f'{r:.1f}' for r in rates['held'])} steps/s")
    print(" | ".join(lines) + f" ({STEPS} two-row decode steps, tiny llama over 2 processes x 2 CPU devices)",
          flush=True)
    leader.stop()
    sys.stdout.flush()
    os._exit(0)


def main() -> int:
    if len(sys.argv) == 3:
        return process(int(sys.argv[1]), int(sys.argv[2]))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PANTHEON_", "XLA_"))} | ENV
    procs = [subprocess.Popen([sys.executable, __file__, str(port), str(pid)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE if pid == 0 else subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, text=True) for pid in (0, 1)]
    out, _ = procs[0].communicate(timeout=600)
    procs[1].wait(timeout=60)
    print(out.strip().splitlines()[-1] if out.strip() else f"no result (exit {procs[0].returncode})")
    return procs[0].returncode or 0


if __name__ == "__main__":
    raise SystemExit(main())
