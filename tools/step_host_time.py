"""Host time of one decode step at batch B: what the driver spends building a step's inputs and
dispatching it, device waits excluded, on the engine as it stands in the checkout it runs from.

Works with the seam before issue 19 (`Model.step_begin` with per-row tokens, positions, sampling
parameters and penalty windows rebuilt every step) and after it (`Model.step` over a decode state that
already holds them), so the two can be compared side by side from two checkouts:

    (cd OLD && python tools/step_host_time.py --model smollm2-135m)
    (cd NEW && python tools/step_host_time.py --model smollm2-135m)

Prints one JSON line: median host ms to dispatch a step, median ms waiting for its ids, tok/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    sys.path.insert(0, str(Path.cwd()))
    from pantheon.runtime import compile_guard, engine
    from pantheon.formats.catalog import resolve_model
    from pantheon.config import load_settings

    compile_guard.enable_persistent_cache(load_settings().home)
    m = engine.load(resolve_model(args.model), engine.LoadOptions(n_slots=args.batch, max_seq=512, prefill_chunk=32))
    b, prompt = args.batch, [1, 2, 3, 4]
    state = m.new_state()
    dispatch, wait = [], []
    if hasattr(m, "step_begin"):  # before: every step hands over tokens, positions, knobs and windows
        from pantheon.runtime.sampler import SamplingParams
        knobs = [SamplingParams(temperature=0.7, top_k=40, seed=i) for i in range(b)]
        for s in range(b):
            _, _, state = m.prefill(state, s, prompt)
        toks, hist = [[5]] * b, [list(prompt) for _ in range(b)]
        for i in range(args.steps):
            t0 = time.perf_counter()
            h, state = m.step_begin(state, toks, list(range(b)), [len(x) for x in hist], knobs,
                                    [x[-64:] for x in hist], [i] * b)
            t1 = time.perf_counter()
            ids = m.step_wait(h)
            t2 = time.perf_counter()
            for x, t in zip(hist, toks):
                x.append(t[0])
            toks = [[int(t)] for t in ids]
            dispatch.append(t1 - t0)
            wait.append(t2 - t1)
    else:  # after: insert once, then steps name only the decoding slots
        from pantheon.runtime.decode_state import slot_insert
        from pantheon.runtime.engine import Chunk, StepPlan
        from pantheon.types import SamplingParams
        for s in range(b):
            state = m.insert(state, slot_insert(s, prompt, 0, SamplingParams(temperature=0.7, top_k=40, seed=s),
                                                1 << 20, ()))
            h, state = m.step(state, StepPlan(chunk=Chunk(s, tuple(prompt), 0, True)))
        m.read(h)
        slots, pos = tuple(range(b)), len(prompt)
        for _ in range(args.steps):
            t0 = time.perf_counter()
            h, state = m.step(state, StepPlan(decode=slots, reach=pos + 1))
            t1 = time.perf_counter()
            m.read(h)
            t2 = time.perf_counter()
            pos += 1
            dispatch.append(t1 - t0)
            wait.append(t2 - t1)
    skip = 10  # the first steps compile
    d, w = statistics.median(dispatch[skip:]), statistics.median(wait[skip:])
    print(json.dumps({"model": args.model, "batch": b, "api": "step_begin" if hasattr(m, "step_begin") else "step",
                      "host_dispatch_ms": round(d * 1e3, 3), "wait_ms": round(w * 1e3, 3),
                      "tok_s": round(b / (d + w), 1)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
