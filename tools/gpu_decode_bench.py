"""Decode throughput of a real-size quantized model on a GPU: GB/s of weights read per step.

A decode step streams every weight once, so its floor is weight bytes / HBM bandwidth (an H200:
~4.8 TB/s). This script writes the 7B-shaped random Q4_K_M-layout GGUF (tools/make_sized_gguf.py)
unless one is given, loads it on the first GPU (weights stay in their blocks; XLA expands them
inside the step in bf16), and times batch-1 and batch-8 decode steps after warm-up. It prints one
JSON line per batch size: ms per step (median of `--steps`), tokens/s, and the GB/s of weights a
step reads against the device's bandwidth.

    python tools/gpu_decode_bench.py [--gguf /tmp/qwen2-7b.gguf] [--steps 20] [--layers 28] [--startup]

--startup first times two starts of `pantheon serve` on the file with one fresh PANTHEON_HOME (cold:
every program compiled; warm: read back from the executable store), each to ready and to every
program made (`tools/serve_memory.py --settled`), one JSON line each, then runs the decode timing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HBM_TB_S = 4.8  # H200


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", default="/tmp/sized/qwen2-7b.gguf")
    ap.add_argument("--layers", type=int, default=None, help="write a shallower file (quick check)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--startup", action="store_true", help="time a cold and a warm `pantheon serve` first")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

    import jax
    import numpy as np

    from pantheon.runtime import engine
    from pantheon.runtime.decode_state import slot_insert
    from pantheon.runtime.engine import Chunk, StepPlan
    from pantheon.types import GREEDY

    path = Path(args.gguf)
    if not path.exists():
        from tools.make_sized_gguf import write_sized_gguf
        overrides = {"layers": args.layers} if args.layers else {}
        t0 = time.perf_counter()
        write_sized_gguf(path, "qwen2-7b", **overrides)
        print(json.dumps({"wrote": str(path), "bytes": path.stat().st_size, "s": round(time.perf_counter() - t0, 1)}),
              flush=True)
    if args.startup:
        startup(path)
    print(json.dumps({"devices": [str(d) for d in jax.devices()]}), flush=True)
    t0 = time.perf_counter()
    model = engine.load(path, engine.LoadOptions(n_slots=8, max_seq=1024, prefill_chunk=128))
    load_s = time.perf_counter() - t0
    weight_bytes = model.weight_bytes
    print(json.dumps({"load_s": round(load_s, 1), "weight_gb": round(weight_bytes / 1e9, 3),
                      "kernels": str(model.kernels)}), flush=True)
    state = model.new_state()
    for b in (int(x) for x in args.batches.split(",")):
        slots = tuple(range(b))
        for s in slots:  # a short prompt per slot
            prompt = [1 + s, 2, 3, 4]
            state = model.insert(state, slot_insert(s, prompt, 0, GREEDY, 1 << 30, ()))
            h, state = model.step(state, StepPlan(chunk=Chunk(s, tuple(prompt), 0, True)))
        pos = 4
        times = []
        for i in range(args.steps + 3):
            t = time.perf_counter()
            h, state = model.step(state, StepPlan(decode=slots, reach=pos + 1))
            ids = model.read(h)
            dt = time.perf_counter() - t
            pos += 1
            if i >= 3:  # the first steps compile
                times.append(dt)
        ms = statistics.median(times) * 1e3
        gbs = weight_bytes / (ms / 1e3) / 1e9
        print(json.dumps({"batch": b, "ms_per_step": round(ms, 2), "tok_s": round(b * 1e3 / ms, 1),
                          "weights_gb_s": round(gbs, 1), "of_hbm": round(gbs / (HBM_TB_S * 1e3), 3),
                          "finite": bool(np.all(np.isfinite(np.asarray(ids))))}), flush=True)
    return 0


def startup(path: Path, port: int = 18499) -> None:
    """Cold then warm start of `pantheon serve --model PATH` in a fresh PANTHEON_HOME (issue 29's table
    on the device): serve_memory's JSON lines, labelled."""
    import os
    import subprocess
    import tempfile

    root = Path(__file__).resolve().parent.parent
    home = tempfile.mkdtemp(prefix="pantheon-home-")
    env = {**os.environ, "PANTHEON_HOME": home, "PYTHONPATH": str(root)}
    serve = [sys.executable, "-c", "import sys; from pantheon.cli import main; sys.exit(main(sys.argv[1:]))",
             "serve", "--model", f"sized={path}", "--port", str(port)]
    url = f"http://127.0.0.1:{port}/"
    for label in ("cold", "warm"):
        watch = [sys.executable, str(root / "tools" / "serve_memory.py"), "--ready", url, "--settled", url,
                 "--hold", "1", "--timeout", "1800", "--"]
        out = subprocess.run([*watch, *serve], env=env, capture_output=True, text=True)
        for line in out.stdout.splitlines():
            print(json.dumps({"start": label, **json.loads(line)}), flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
