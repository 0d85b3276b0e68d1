"""Where a decode step's time goes, per op: XLA:CPU's per-thunk trace grouped by source function.

    python tools/profile_decode.py FILE.gguf [--batches 1,8] [--steps 3] [--top 25]

Loads the model as the engine does, runs decode steps at each batch size (two warm-ups that compile),
traces `--steps` more with `jax.profiler`, and prints, per batch size, the step time and the time of
the leaf thunks (fusions, custom calls such as the native matmuls, copies, scatters) grouped by the
Python function of the model code that emitted them (from the optimized HLO's op metadata, dumped
with `--xla_dump_to`). Why by function: one decode step is thousands of thunks; what a reader needs
is "DeltaNet recurrence / conv / state gather-scatter / routed experts / attention / head".

Also prints the machine's copy bandwidth (numpy `copyto` of 512 MB: read + write) so a step's time can
be set against its byte floor.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def copy_bandwidth(mb: int = 512, reps: int = 5) -> float:
    """Bytes moved per second (read + write) by numpy's copyto of `mb` MB."""
    import numpy as np

    a = np.ones(mb * (1 << 20) // 8)
    b = np.empty_like(a)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t)
    return 2 * a.nbytes / best


_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?metadata=\{([^}]*)\}")
_MODEL_FILES = ("qwen35", "moe_kernels", "common", "llama", "qwen3", "engine")


def _frames(lines: list[str]) -> dict[int, str]:
    """stack_frame_id -> `file.func > file.func` (outermost model frame first) from the module's
    FileNames / FunctionNames / FileLocations / StackFrames tables."""
    tables: dict[str, dict[int, str]] = {}
    cur = None
    for line in lines:
        head = line.strip()
        if head in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            cur = tables.setdefault(head, {})
            continue
        if cur is None:
            continue
        m = re.match(r"^(\d+)\s+(.*)$", head)
        if not m:
            if head.startswith("%") or head.startswith("HloModule") or head.startswith("ENTRY"):
                cur = None
            continue
        cur[int(m.group(1))] = m.group(2)
    files = {k: Path(v.strip('"')).stem for k, v in tables.get("FileNames", {}).items()}
    funcs = {k: v.strip('"') for k, v in tables.get("FunctionNames", {}).items()}
    locs: dict[int, str] = {}
    for k, v in tables.get("FileLocations", {}).items():
        f = re.search(r"file_name_id=(\d+)", v)
        fn = re.search(r"function_name_id=(\d+)", v)
        if f and fn:
            ln = re.search(r"line=(\d+)", v)
            locs[k] = f"{files.get(int(f.group(1)), '?')}.{funcs.get(int(fn.group(1)), '?')}:{ln.group(1) if ln else '?'}"
    parent: dict[int, tuple[int, int]] = {}
    for k, v in tables.get("StackFrames", {}).items():
        fl = re.search(r"file_location_id=(\d+)", v)
        pf = re.search(r"parent_frame_id=(\d+)", v)
        # parent_frame_id counts from 1 over the frames as listed from 0: frame k's parent is p - 1
        parent[k] = (int(fl.group(1)) if fl else 0, int(pf.group(1)) - 1 if pf else 0)
    out: dict[int, str] = {}
    for k in parent:
        chain, f, seen = [], k, set()
        while f in parent and f not in seen:
            seen.add(f)
            loc, up = parent[f]
            chain.append(locs.get(loc, "?"))
            f = up
        model = [c for c in reversed(chain) if c.split(".")[0] in _MODEL_FILES and "_serve_impl" not in c]
        model = [c.rsplit(":", 1)[0] for c in model[:-1]] + model[-1:]  # a line number on the innermost only
        out[k] = " > ".join(model[-3:]) if model else (chain[0] if chain else "?")
    return out


def hlo_sources(dump_dir: str) -> dict[str, dict[str, str]]:
    """module name -> instruction name -> the model functions (innermost three) that emitted it."""
    out: dict[str, dict[str, str]] = {}
    for f in glob.glob(os.path.join(dump_dir, "*after_optimizations.txt")):
        lines = open(f, errors="replace").read().splitlines()
        if not lines or not lines[0].startswith("HloModule "):
            continue
        mod_name = lines[0].split()[1].rstrip(",")
        frames = _frames(lines)
        table: dict[str, str] = {}
        for line in lines:
            m = _INSTR.match(line)
            if not m:
                continue
            sf = re.search(r"stack_frame_id=(\d+)", m.group(2))
            if sf and int(sf.group(1)) in frames:
                table[m.group(1)] = frames[int(sf.group(1))]
        out.setdefault(mod_name, {}).update(table)
    return out


def leaf_times(trace_dir: str) -> tuple[dict[tuple[str, str], float], dict[tuple[str, str], int]]:
    """(module, hlo op) -> total self time in us of leaf thunks (events containing no other thunk)."""
    fs = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True))
    events = [e for e in json.load(gzip.open(fs[-1]))["traceEvents"]
              if e.get("ph") == "X" and "hlo_op" in e.get("args", {})]
    by_tid: dict[Any, list] = collections.defaultdict(list)
    for e in events:
        by_tid[e["tid"]].append(e)
    total: dict[tuple[str, str], float] = collections.Counter()
    count: dict[tuple[str, str], int] = collections.Counter()
    for evs in by_tid.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        for i, e in enumerate(evs):
            end = e["ts"] + e["dur"]
            nxt = evs[i + 1] if i + 1 < len(evs) else None
            if nxt is not None and nxt["ts"] < end and nxt["ts"] + nxt["dur"] <= end + 1e-3:
                continue  # a while/conditional/call thunk: its children are counted instead
            key = (e["args"].get("hlo_module", "?"), e["args"]["hlo_op"])
            total[key] += e["dur"]
            count[key] += 1
    return total, count


def byte_floor(path: str, batch: int, state_bytes_per_row: int) -> tuple[float, dict[str, float]]:
    """Bytes a decode step of `batch` rows must move: every weight matrix but the embedding once,
    of each layer's experts only those chosen (expected distinct experts of `batch` rows choosing k
    of E uniformly: E (1 - (1 - k/E)^batch)), and each row's recurrent state read and written once
    (KV is negligible at the short positions profiled). Returns (total, parts)."""
    import gguf

    r = gguf.GGUFReader(path)
    arch = str(bytes(r.fields["general.architecture"].parts[-1]), "utf8")
    kf = r.fields.get(f"{arch}.expert_used_count")
    k = int(kf.parts[-1][0]) if kf else 0
    parts: dict[str, float] = collections.Counter()
    for t in r.tensors:
        name, nb = t.name, int(t.n_bytes)
        if name == "token_embd.weight":
            continue
        if "_exps" in name:
            e = int(t.shape[-1])
            parts["active experts"] += nb / e * e * (1 - (1 - k / e) ** batch)
        elif name == "output.weight":
            parts["head"] += nb
        else:
            parts["dense/attention/shared"] += nb
    parts["recurrent state r+w"] = 2 * state_bytes_per_row * batch
    return sum(parts.values()), dict(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--no-native", action="store_true")
    args = ap.parse_args(argv)
    dump = tempfile.mkdtemp(prefix="pantheon-hlo-")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump} --xla_dump_hlo_as_text"
                               " --xla_dump_hlo_pass_re=^$").strip()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import jax

    from pantheon.runtime import engine
    from pantheon.runtime.decode_state import slot_insert
    from pantheon.runtime.engine import Chunk, StepPlan
    from pantheon.types import GREEDY

    bw = copy_bandwidth()
    print(f"copy bandwidth (numpy copyto, read + write): {bw / 1e9:.1f} GB/s", flush=True)
    m = engine.load(args.gguf, engine.LoadOptions(native_matmul=not args.no_native, n_slots=args.slots, max_seq=512,
                                                  prefill_chunk=32))
    print(f"weights {m.weight_bytes / 1e9:.2f} GB, {m.kernels}", flush=True)
    state = m.new_state()
    for b in (int(x) for x in args.batches.split(",")):
        slots, pos = tuple(range(b)), 4
        for s in slots:
            prompt = [1 + s, 2, 3, 4]
            state = m.insert(state, slot_insert(s, prompt, 0, GREEDY, 1 << 30, ()))
            h, state = m.step(state, StepPlan(chunk=Chunk(s, tuple(prompt), 0, True)))
        for _ in range(2):
            h, state = m.step(state, StepPlan(decode=slots, reach=pos + 1))
            m.read(h)
            pos += 1
        trace = tempfile.mkdtemp(prefix="pantheon-trace-")
        times = []
        jax.profiler.start_trace(trace)
        for _ in range(args.steps):
            t = time.perf_counter()
            h, state = m.step(state, StepPlan(decode=slots, reach=pos + 1))
            m.read(h)
            times.append(time.perf_counter() - t)
            pos += 1
        jax.profiler.stop_trace()
        med = statistics.median(times)
        srcs = hlo_sources(dump)
        tot, cnt = leaf_times(trace)
        by_fn: dict[str, float] = collections.Counter()
        n_fn: dict[str, int] = collections.Counter()
        for (mod, op), us in tot.items():
            fn = srcs.get(mod, {}).get(op) or f"[{mod}] {re.sub(r'[.][0-9]+$', '', op)}"
            by_fn[fn] += us / args.steps
            n_fn[fn] += cnt[(mod, op)] // args.steps
        covered = sum(by_fn.values()) / 1e3
        per_row = m.arch.state_bytes_per_sequence(m.config) if hasattr(m.arch, "state_bytes_per_sequence") else 0
        floor, parts = byte_floor(args.gguf, b, per_row)
        print("  bytes that must move: " + ", ".join(f"{k} {v / 1e6:.0f} MB" for k, v in parts.items())
              + f"; total {floor / 1e6:.0f} MB = {floor / bw * 1e3:.1f} ms at {bw / 1e9:.1f} GB/s; step "
              f"{med * 1e3 / (floor / bw * 1e3):.1f}x that floor", flush=True)
        print(f"\nbatch {b}: {med * 1e3:.1f} ms/step (traced, median of {args.steps}), {b / med:.2f} tok/s; "
              f"leaf thunks {covered:.1f} ms/step", flush=True)
        for fn, us in sorted(by_fn.items(), key=lambda kv: -kv[1])[: args.top]:
            print(f"  {us / 1e3:8.2f} ms  {100 * us / 1e3 / (med * 1e3):5.1f}%  x{n_fn[fn]:<5d} {fn}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
