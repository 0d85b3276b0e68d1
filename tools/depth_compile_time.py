"""Trace, lower and compile time of one decode bucket at two depths of one model shape.

Why: a step program with a branch per layer made start-up grow with depth (issue 29). This prints,
for the same shape at `--layers a,b`, the seconds to trace, lower and compile the one-row decode
step and the size of what was traced, so the ratio deep / shallow can be read off (near 1: the
program does not grow with depth).

    python tools/depth_compile_time.py --profile qwen2-7b --layers 2,28
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DIMS = dict(hidden=512, n_heads=8, n_kv_heads=2, head_dim=64, ffn=1024, vocab=1024)


def _sized() -> object:
    spec = importlib.util.spec_from_file_location("make_sized_gguf", ROOT / "tools" / "make_sized_gguf.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["make_sized_gguf"] = mod
    spec.loader.exec_module(mod)
    return mod


def measure(path: Path) -> dict[str, float]:
    import jax
    from pantheon.runtime import engine
    from pantheon.runtime.engine import StepPlan

    model = engine.load(path, engine.LoadOptions(n_slots=8, max_seq=512, prefill_chunk=64))
    try:
        state = model.new_state()
        plan = model._serve_plan(StepPlan(decode=(model.scratch_slot,), reach=8))
        jax.clear_caches()
        t0 = time.perf_counter()
        traced = plan.fn.trace(model.params, state.cache, state.slots, *plan.args, **plan.kwargs)
        t1 = time.perf_counter()
        lowered = traced.lower()
        t2 = time.perf_counter()
        lowered.compile()
        t3 = time.perf_counter()
        return {"layers": model.config.n_layers, "trace_s": t1 - t0, "lower_s": t2 - t1, "compile_s": t3 - t2,
                "hlo_chars": len(lowered.as_text())}
    finally:
        model.free()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="qwen2-7b")
    ap.add_argument("--layers", default="2,28")
    ap.add_argument("--mix", default="q4_k_m")
    args = ap.parse_args()
    import jax
    jax.config.update("jax_enable_compilation_cache", False)  # measure the compile, not a cache hit
    tool = _sized()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in (int(v) for v in args.layers.split(",")):
            path = tool.write_sized_gguf(Path(tmp) / f"{n}.gguf", args.profile, template=False, layers=n,
                                         mix=args.mix, **DIMS)
            rows.append(measure(path))
    for r in rows:
        total = r["trace_s"] + r["lower_s"] + r["compile_s"]
        print(f"layers {r['layers']:3d}: trace {r['trace_s']:.2f} s, lower {r['lower_s']:.2f} s, "
              f"compile {r['compile_s']:.2f} s, total {total:.2f} s, HLO {r['hlo_chars']:,} chars")
    t = [r["trace_s"] + r["lower_s"] + r["compile_s"] for r in rows]
    print(f"deep / shallow: {t[-1] / t[0]:.2f}x")


if __name__ == "__main__":
    main()
