"""Where a serving process's memory goes: RSS after each stage of bringing a model up, in one process.

Why: "memory is a figure like speed", and the worker's RSS beyond the weights and the KV cache has
to be found before it can be cut. This loads a model the way `pantheon serve` does (engine.load,
new_state, warmup) and prints the resident set after each stage, split into anonymous memory
(heap, device buffers, compiled code) and file pages (the mapped GGUF, shared libraries), from
/proc/self/status.

    python tools/rss_breakdown.py ~/.cache/pantheon/models/smollm2-135m.gguf
    python tools/rss_breakdown.py --by-kind ~/.cache/pantheon/models/smollm2-135m.gguf

`--by-kind` makes the programs one at a time, in one thread (the engine's own `_obtain`: read from the
executable store when it holds them, else compiled), and prints what each kind of program adds to the
resident set: the cost of a program, not of the compiler, once the store is warm.
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path


def rss() -> dict[str, int]:
    """RssAnon / RssFile / RssShmem of this process in MB."""
    out: dict[str, int] = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("RssAnon", "RssFile", "RssShmem", "VmRSS")):
            k, v = line.split(":")
            out[k] = int(v.split()[0]) // 1024
    return out


def by_kind(model, state) -> None:
    """Make every warm-up program in turn and print the anonymous memory each kind adds (after a trim,
    so freed compiler heap is not counted)."""
    import ctypes
    from collections import defaultdict

    from pantheon.runtime import engine
    trim = ctypes.CDLL(None).malloc_trim
    model._abstract = (engine._abstract(model.params), engine._abstract(state.cache), engine._abstract(state.slots))
    kinds: dict[str, list[float]] = defaultdict(list)
    for key in model.program_keys():
        trim(0)
        before = rss()["RssAnon"]
        model._obtain(key)
        trim(0)
        kinds[key[1] if key[0] == "serve" else key[0]].append(rss()["RssAnon"] - before)
    total = sum(sum(v) for v in kinds.values())
    for kind, mb in sorted(kinds.items(), key=lambda kv: -sum(kv[1])):
        print(f"{kind:10s} {len(mb):3d} programs  {sum(mb):6.0f} MB  ({sum(mb) / len(mb):.1f} MB each)")
    print(f"{'all':10s} {sum(len(v) for v in kinds.values()):3d} programs  {total:6.0f} MB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--slots", type=int, default=None, help="n_slots (default: the serving default)")
    ap.add_argument("--by-kind", action="store_true", help="each program's RSS, summed by kind")
    args = ap.parse_args()
    rows = [("start", rss())]
    import jax  # noqa: F401
    import jax.numpy as jnp
    from pantheon.runtime import engine
    jnp.zeros(1).block_until_ready()
    rows.append(("jax imported, backend up", rss()))
    opts = engine.LoadOptions() if args.slots is None else engine.LoadOptions(n_slots=args.slots)
    model = engine.load(args.model, opts)
    gc.collect()
    rows.append(("weights loaded", rss()))
    state = model.new_state()
    jax.block_until_ready(state)
    rows.append(("decode state (KV cache) allocated", rss()))
    if args.by_kind:
        by_kind(model, state)
        return
    plans = model.warmup_plans()
    state = model.warmup(state)
    gc.collect()
    rows.append((f"warm-up: {len(plans)} step programs compiled and run", rss()))
    import ctypes
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    rows.append(("after malloc_trim(0)", rss()))
    prev = None
    for name, r in rows:
        delta = "" if prev is None else f"  (+{r['VmRSS'] - prev['VmRSS']} MB)"
        print(f"{name:50s} RSS {r['VmRSS']:6d} MB  anon {r['RssAnon']:6d}  file {r['RssFile']:6d}{delta}")
        prev = r
    cache_bytes = sum(x.nbytes for x in jax.tree.leaves(state.cache))
    print(json.dumps({"weights_mb": model.weight_bytes >> 20, "kv_and_state_mb": cache_bytes >> 20,
                      "slots": model.n_slots, "programs": len(plans), "final": rows[-1][1]}))


if __name__ == "__main__":
    main()
