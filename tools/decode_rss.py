"""Load a GGUF, then time decode steps at a few batch sizes and report RSS: the real-size proof.

    python tools/decode_rss.py FILE.gguf [--batches 1,8] [--steps 3] [--no-native] [--copied-stacks]

Prints the load time, weight bytes on the device, peak RSS during the load, then per batch size
the median seconds per decode step (after two warm-up steps that compile), tokens/s and RSS.
RSS counts the file pages a step has touched (weights served from the mapping are the page
cache's, reclaimable like llama.cpp's mmap).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import psutil


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--no-native", action="store_true")
    ap.add_argument("--copied-stacks", action="store_true",
                    help="copy each layer stack into one buffer instead of reading it from the file mapping "
                         "(the form before weights.MappedStack: to compare the two)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from pantheon.ops import weights
    from pantheon.runtime import engine
    from pantheon.runtime.decode_state import slot_insert
    from pantheon.runtime.engine import Chunk, StepPlan
    from pantheon.types import GREEDY

    proc, peak, stop = psutil.Process(), [0], threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            stop.wait(0.05)

    threading.Thread(target=watch, daemon=True, name="rss").start()
    if args.copied_stacks:
        weights.mapped_stack = lambda parts, files: None
    t0 = time.perf_counter()
    m = engine.load(args.gguf, engine.LoadOptions(native_matmul=not args.no_native, n_slots=args.slots, max_seq=512,
                                                  prefill_chunk=32))
    print(f"load {time.perf_counter() - t0:.1f} s, weights {m.weight_bytes / 1e9:.2f} GB, peak RSS during load "
          f"{peak[0] / 1e9:.2f} GB, {m.kernels}", flush=True)
    state = m.new_state()
    for b in (int(x) for x in args.batches.split(",")):
        slots, pos = tuple(range(b)), 4
        for s in slots:
            prompt = [1 + s, 2, 3, 4]
            state = m.insert(state, slot_insert(s, prompt, 0, GREEDY, 1 << 30, ()))
            h, state = m.step(state, StepPlan(chunk=Chunk(s, tuple(prompt), 0, True)))
        times = []
        for _ in range(args.steps + 2):
            t = time.perf_counter()
            h, state = m.step(state, StepPlan(decode=slots, reach=pos + 1))
            m.read(h)
            times.append(time.perf_counter() - t)
            pos += 1
        med = statistics.median(times[2:])
        print(f"batch {b}: {med:.3f} s/step, {b / med:.2f} tok/s, RSS {proc.memory_info().rss / 1e9:.2f} GB "
              f"(peak {peak[0] / 1e9:.2f})", flush=True)
    stop.set()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
