"""Where a serving process's memory goes: RSS after each stage of bringing a model up, in one process.

Why: "memory is a figure like speed", and the worker's RSS beyond the weights and the KV cache has
to be found before it can be cut. This loads a model the way `pantheon serve` does (engine.load,
new_state, warmup) and prints the resident set after each stage, split into anonymous memory
(heap, device buffers, compiled code) and file pages (the mapped GGUF, shared libraries), from
/proc/self/status.

    python tools/rss_breakdown.py ~/.cache/pantheon/models/smollm2-135m.gguf
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--slots", type=int, default=None, help="n_slots (default: the serving default)")
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
