"""`pantheon bench engine`: in-process speed of one model (compile, prefill, batched decode, memory).

Figures are medians of several timed repetitions after a warm-up call per shape, so compile time is
reported separately and never pollutes a throughput figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numpy as np


def _rss_peak_mb() -> float:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _device_mem(model: Any) -> dict:
    try:
        stats = model.devices[0].memory_stats() or {}
    except Exception:
        stats = {}
    return {k: stats[k] for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit") if k in stats}


def bench_engine(model_name: str, batches: list[int], prompt_len: int, gen: int, reps: int,
                 max_seq: int | None = None) -> dict:
    from pantheon.formats.catalog import resolve_model
    from pantheon.runtime.compile_guard import compile_count
    from pantheon.runtime.decode_state import slot_insert
    from pantheon.runtime.engine import Chunk, LoadOptions, StepPlan, load
    from pantheon.types import SamplingParams

    path = resolve_model(model_name)
    t0 = time.perf_counter()
    n_slots = max(batches)
    seq = max_seq or (prompt_len + gen * (reps + 1) + 16)  # every timed step stays inside the sequence
    model = load(path, LoadOptions(name=model_name, n_slots=n_slots, max_seq=seq, prefill_chunk=128))
    load_s = time.perf_counter() - t0
    state = model.new_state()
    greedy = SamplingParams(temperature=0.0, seed=0)
    prompt = [(7 * i + 11) % (model.config.vocab - 1) + 1 for i in range(prompt_len)]
    out: dict[str, Any] = {"model": model_name, "file": str(path), "arch": model.config.arch,
                           "weights_mb": round(model.weight_bytes / 1e6, 1), "load_s": round(load_s, 2),
                           "prompt_len": prompt_len, "gen": gen, "reps": reps, "dtype": str(model.dtype.__name__)}

    def fill(state: Any, slot: int, **extra: Any) -> Any:
        """Give `slot` the prompt (greedy, a budget no rep exhausts) through the serving verbs."""
        state = model.insert(state, slot_insert(slot, prompt, 0, greedy, 1 << 30, (), **extra))
        for i in range(0, prompt_len, model.chunk):
            part = tuple(prompt[i: i + model.chunk])
            h, state = model.step(state, StepPlan(chunk=Chunk(slot, part, i, i + model.chunk >= prompt_len)))
        model.read(h)
        return state

    # Prefill: the whole prompt in chunks, timed end to end (includes the first sampled token).
    c0, t0 = compile_count(), time.perf_counter()
    state = fill(state, 0)
    out["prefill_compile_s"] = round(time.perf_counter() - t0, 2)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        state = fill(state, 0)
        times.append(time.perf_counter() - t0)
    out["prefill_tok_s"] = round(prompt_len / statistics.median(times), 1)

    decode: dict[str, Any] = {}
    for b in batches:
        slots = tuple(range(b))
        for s in slots:
            state = fill(state, s)
        t0 = time.perf_counter()
        h, state = model.step(state, StepPlan(decode=slots, reach=prompt_len + 1))
        model.read(h)
        compile_s = time.perf_counter() - t0
        rates = []
        pos = prompt_len + 1
        for _ in range(reps):
            t0 = time.perf_counter()
            for i in range(gen):  # dispatch step i+1 before reading step i, as the scheduler does
                nxt, state = model.step(state, StepPlan(decode=slots, reach=pos + 1))
                model.read(h)
                h, pos = nxt, pos + 1
            rates.append(b * gen / (time.perf_counter() - t0))
        decode[str(b)] = {"tok_s": round(statistics.median(rates), 1),
                          "ms_per_step": round(1000 * b / statistics.median(rates), 1),
                          "first_call_s": round(compile_s, 2)}
    out["decode"] = decode

    # What the OpenAI features cost a decode step at the largest batch: logprobs (top 20 computed on
    # the device) on every row, a grammar mask (all ones, built on the host and sent each step) on
    # every row, a 300-entry logit bias on every row; against the same rows without them.
    b = max(batches)
    slots = tuple(range(b))
    ones = np.full((b, model.mask_words), -1, np.int32)
    bias = [(t, 0.5) for t in range(1, 301)]
    variants = {"plain": ({}, None), "logprobs": ({"logprobs": True}, None), "mask": ({}, ones),
                "logit_bias": ({"logit_bias": bias}, None)}
    features: dict[str, Any] = {}
    for name, (extra, mask) in variants.items():
        for s in slots:
            state = fill(state, s, **extra)
        pos, per_step = prompt_len + 1, []
        h, state = model.step(state, StepPlan(decode=slots, reach=pos + 1), mask=mask)
        model.read(h)
        for _ in range(reps):
            t0 = time.perf_counter()
            for i in range(gen):  # read each step before the next: the masked path's own order
                h, state = model.step(state, StepPlan(decode=slots, reach=pos + 2), mask=mask)
                model.read(h)
                pos += 1
            per_step.append((time.perf_counter() - t0) * 1000 / gen)
        features[name] = round(statistics.median(per_step), 2)
    out["decode_features_ms"] = {"batch": b, **features}
    out["compiles"] = compile_count() - c0
    out["peak_rss_mb"] = round(_rss_peak_mb(), 1)
    out["device_memory"] = _device_mem(model)
    return out


def _print_table(r: dict) -> None:
    print(f"model {r['model']} ({r['arch']}, {r['dtype']}, weights {r['weights_mb']} MB), load {r['load_s']} s")
    print(f"prefill {r['prompt_len']} tokens: {r['prefill_tok_s']} tok/s (first call {r['prefill_compile_s']} s)")
    print(f"{'batch':>6} {'tok/s':>9} {'ms/step':>9} {'first call s':>13}")
    for b, d in r["decode"].items():
        print(f"{b:>6} {d['tok_s']:>9} {d['ms_per_step']:>9} {d['first_call_s']:>13}")
    base = r["decode"].get("1")
    if base:
        for b, d in r["decode"].items():
            if b != "1":
                print(f"aggregate decode at batch {b} = {d['tok_s'] / base['tok_s']:.2f}x batch 1")
    f = r["decode_features_ms"]
    print(f"decode step at batch {f['batch']}, ms: " + ", ".join(f"{k} {v}" for k, v in f.items() if k != "batch"))
    print(f"peak RSS {r['peak_rss_mb']} MB; device memory {r['device_memory'] or 'n/a'}")


def main(args: argparse.Namespace) -> int:
    from pantheon.formats.catalog import DEFAULT_MODEL
    if args.bench_args[:1] == ["serve"]:  # its options start with "--": hand them over untouched
        from pantheon.bench.serve import main as serve_main
        return serve_main(args.bench_args[1:])
    ap = argparse.ArgumentParser(prog="pantheon bench")
    sub = ap.add_subparsers(dest="what", required=True)
    e = sub.add_parser("engine", help="in-process engine benchmark")
    e.add_argument("--model", default=DEFAULT_MODEL)
    e.add_argument("--batch", default="1,8", help="comma-separated batch sizes")
    e.add_argument("--prompt-len", type=int, default=512)
    e.add_argument("--gen", type=int, default=64)
    e.add_argument("--reps", type=int, default=3)
    e.add_argument("--json", action="store_true")
    sub.add_parser("serve", help="load generator against an OpenAI-compatible server (see --help)")
    a = ap.parse_args(args.bench_args)
    if a.what == "engine":
        r = bench_engine(a.model, [int(x) for x in a.batch.split(",")], a.prompt_len, a.gen, a.reps)
        if a.json:
            print(json.dumps(r))
        else:
            _print_table(r)
        return 0
    return 2
