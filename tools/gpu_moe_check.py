#!/usr/bin/env python3
"""One prepared GPU check of the MoE kernels and the hybrid MoE engine (bounded, < 5 minutes).

What it does, in order, each stage skipped (and said so) once the time budget runs short:

1. Compile probe: does the Pallas grouped-matmul kernel (`moe_ffn(..., impl="pallas")`, Triton)
   compile for each shape and dtype, and what does `impl="auto"` resolve to at decode and prefill?
2. Correctness: `pallas`, `tiles` and a `jax.lax.ragged_dot` MoE against the `dense` reference on
   random inputs whose routing has empty, tiny (1-2 pair) and large (> one 64-row tile) expert
   groups, in f32 (all matmuls at HIGHEST precision, tolerance 1e-4 relative to the output's max)
   and bf16 (3e-2). Max abs errors are reported per impl.
3. Timing: pallas vs tiles vs ragged_dot (vs dense) at decode (8 tokens x top-k) and prefill
   (512 tokens) sizes, bf16 on GPU, for the mid-size model's layer shape and the 35B-A3B's.
4. Engine: writes the mid-size random qwen35moe (tools/make_random_qwen35moe.py) into /tmp and
   runs `pantheon.bench.engine.bench_engine(path, [1, 8], prompt_len=128, gen=16, reps=2)` with
   impl="auto" (Pallas on GPU) and, time permitting, with the MoE forced to `tiles`.

Prints progress on stderr and ONE JSON summary as the last stdout line (also --out FILE).
Exit status: 0 all good; 1 numerical mismatch; 2 a kernel failed to compile/run; 3 the engine
stage failed; 4 the hard time limit (--budget-s + 40 s) hit (partial summary still printed).
Parts skipped for the soft budget are listed in "skipped" ("complete": false) with exit status 0.

    PYTHONPATH=. python3 tools/gpu_moe_check.py                 # GPU (jax[cuda] + gguf needed)
    PYTHONPATH=. python tools/gpu_moe_check.py --cpu-smoke      # CPU: tiny sizes, Pallas interpreted

On CPU (`--cpu-smoke`) sizes shrink and the Pallas kernel runs in interpret mode, to prove the
script itself works before a GPU machine is spent on it.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import signal
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

_T_START = time.perf_counter()  # the budget counts from the script's start (jax import included)

ROOT = Path(__file__).resolve().parents[1]
for p in (str(ROOT), str(ROOT / "tools")):
    if p not in sys.path:
        sys.path.insert(0, p)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pantheon.ops import moe_kernels as mk  # noqa: E402

TOL = {"float32": 1e-4, "bfloat16": 3e-2}  # max |impl - dense| / max |dense|


def log(msg: str) -> None:
    print(f"[gpu_moe_check {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Budget:
    def __init__(self, seconds: float):
        self.t0 = _T_START
        self.seconds = seconds

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    @property
    def left(self) -> float:
        return self.seconds - self.elapsed


class OutOfTime(Exception):
    """The hard alarm: stop everything and print what there is."""


class StageShort(Exception):
    """A stage ran short of its share of the budget: skip its rest, go on to the next stage."""


# ---- inputs ----------------------------------------------------------------------------------------
def make_weights(E: int, H: int, F: int, dtype, seed: int = 0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    s = 0.05
    wg = (jax.random.normal(ks[0], (E, F, H), jnp.float32) * s).astype(dtype)
    wu = (jax.random.normal(ks[1], (E, F, H), jnp.float32) * s).astype(dtype)
    wd = (jax.random.normal(ks[2], (E, H, F), jnp.float32) * s).astype(dtype)
    router = jax.random.normal(ks[3], (E, H), jnp.float32) * 0.1
    return wg, wu, wd, router


def skewed_routing(n: int, k: int, E: int, H: int, seed: int = 0):
    """x [n, H], weights [n, k], ids [n, k] (distinct per token): experts 0..half-1 drawn with a
    power-law (expert 0 gets a large group), half..E-3 empty, E-1 one pair, E-2 two pairs."""
    rng = np.random.RandomState(seed)
    half = max(k + 1, E // 2)
    half = min(half, E)
    p = 1.0 / (np.arange(half) + 1.0) ** 1.5
    p /= p.sum()
    idx = np.stack([rng.choice(half, k, replace=False, p=p) for _ in range(n)]).astype(np.int32)
    if E - half >= 2:
        idx[0, -1] = E - 1
        if n >= 3:
            idx[1, -1] = idx[2, -1] = E - 2
    w = np.exp(rng.randn(n, k)).astype(np.float32)
    w /= w.sum(-1, keepdims=True)
    x = rng.randn(n, H).astype(np.float32)
    counts = np.bincount(idx.ravel(), minlength=E)
    groups = {"empty": int((counts == 0).sum()), "tiny_1_2": int(((counts >= 1) & (counts <= 2)).sum()),
              "max": int(counts.max()), "over_64_rows": int((counts > 64).sum())}
    return jnp.asarray(x), jnp.asarray(w), jnp.asarray(idx), groups


# ---- a ragged_dot MoE (the XLA grouped matmul, for comparison) ---------------------------------------
def experts_ragged(x, w, idx, wg_t, wu_t, wd_t):
    """Σ_j w · down(silu(gate x) * up x) with jax.lax.ragged_dot over expert-sorted rows.

    wg_t/wu_t [E, H, F], wd_t [E, F, H]: the (in, out) layout ragged_dot wants, transposed once
    outside the timed function.
    """
    n, k = idx.shape
    E = wg_t.shape[0]
    e_flat = idx.reshape(-1)
    order = jnp.argsort(e_flat, stable=True)
    counts = jnp.bincount(e_flat, length=E).astype(jnp.int32)
    xs = x.astype(wg_t.dtype)[order // k]
    g = jax.lax.ragged_dot(xs, wg_t, counts, preferred_element_type=jnp.float32)
    u = jax.lax.ragged_dot(xs, wu_t, counts, preferred_element_type=jnp.float32)
    a = (jax.nn.silu(g) * u).astype(wd_t.dtype)
    y = jax.lax.ragged_dot(a, wd_t, counts, preferred_element_type=jnp.float32)
    y = jnp.zeros_like(y).at[order].set(y)
    return jnp.einsum("nkh,nk->nh", y.reshape(n, k, -1), w.astype(jnp.float32))


def moe_ragged(h, router, wg_t, wu_t, wd_t, k):
    logits = jnp.einsum("nh,eh->ne", h.astype(jnp.float32), router.astype(jnp.float32))
    w, idx = mk.route(logits, k)
    return experts_ragged(h, w, idx, wg_t, wu_t, wd_t).astype(h.dtype)


# ---- timing ----------------------------------------------------------------------------------------
def _block(x):
    return jax.tree.map(lambda a: a.block_until_ready(), x)


def time_fn(f: Callable, args: tuple, reps: int) -> dict[str, float]:
    t0 = time.perf_counter()
    _block(f(*args))
    compile_s = time.perf_counter() - t0
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        _block(f(*args))
        ts.append(time.perf_counter() - t0)
    return {"median_ms": round(statistics.median(ts) * 1e3, 4), "min_ms": round(min(ts) * 1e3, 4),
            "first_call_s": round(compile_s, 3)}


def _err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:400] if str(exc) else ''}"


# ---- stages ----------------------------------------------------------------------------------------
def stage_compile_probe(cfg, summary, budget):
    out = []
    for sname, E, k, H, F in cfg["shapes"]:
        for dt in cfg["dtypes"]:
            rec: dict[str, Any] = {"shape": sname, "E": E, "k": k, "H": H, "F": F, "dtype": dt}
            wg = jax.ShapeDtypeStruct((E, F, H), jnp.dtype(dt))
            rec["fits_triton_tiles"] = mk._pallas_fits(wg)
            if not cfg["interpret"]:
                for tm in (16, 64):
                    rec[f"compiles_tm{tm}"] = mk.pallas_compiles("pallas", dt, E, F, H, tm)
            rec["auto_decode"] = mk.pick_impl(cfg["decode_n"] * k, wg)
            rec["auto_prefill"] = mk.pick_impl(cfg["prefill_n"] * k, wg)
            out.append(rec)
            log(f"probe {rec}")
    summary["compile_probe"] = out


def stage_correctness(cfg, summary, budget):
    pallas = cfg["pallas_impl"]
    rows = []
    for sname, E, k, H, F in cfg["shapes"]:
        for dt in cfg["dtypes"]:
            dtype = jnp.dtype(dt)
            wg, wu, wd, router = make_weights(E, H, F, dtype, seed=1)
            wg_t, wu_t, wd_t = (jnp.swapaxes(a, 1, 2) for a in (wg, wu, wd))
            cases = [("single_token", 1), ("decode_skewed", cfg["decode_n"]), ("prefill_skewed", cfg["prefill_n"]),
                     ("prefill_router", cfg["prefill_n"])]
            for case, n in cases:
                if budget.left < cfg["kernel_reserve_s"]:
                    summary["correctness"] = rows
                    raise StageShort(f"correctness from {sname}/{dt}/{case} on")
                x, w, idx, groups = skewed_routing(n, k, E, H, seed=n)
                if case == "prefill_router":  # natural top-k routing from a random router
                    w, idx = mk.route(x @ router.T, k)
                    c = np.bincount(np.asarray(idx).ravel(), minlength=E)
                    groups = {"empty": int((c == 0).sum()), "tiny_1_2": int(((c >= 1) & (c <= 2)).sum()),
                              "max": int(c.max()), "over_64_rows": int((c > 64).sum())}
                x = x.astype(dtype)
                with jax.default_matmul_precision("highest"):
                    ref = np.asarray(jax.jit(functools.partial(mk.experts, impl="dense"))(x, w, idx, wg, wu, wd))
                    scale = float(np.abs(ref).max()) or 1.0
                    rec: dict[str, Any] = {"shape": sname, "dtype": dt, "case": case, "n_tokens": n, "k": k,
                                           "groups": groups, "ref_absmax": round(scale, 5), "impls": {}}
                    fns = {pallas: lambda: jax.jit(functools.partial(mk.experts, impl=pallas))(x, w, idx, wg, wu, wd),
                           "tiles": lambda: jax.jit(functools.partial(mk.experts, impl="tiles"))(x, w, idx, wg, wu, wd),
                           "ragged_dot": lambda: jax.jit(experts_ragged)(x, w, idx, wg_t, wu_t, wd_t)}
                    for name, fn in fns.items():
                        try:
                            got = np.asarray(fn())
                            err = float(np.abs(got.astype(np.float32) - ref).max())
                            finite = bool(np.isfinite(got).all())
                            ok = finite and err <= TOL[dt] * scale
                            rec["impls"][name] = {"max_abs_err": err, "rel_err": err / scale, "ok": ok}
                            if not ok:
                                summary["mismatches"].append(f"{sname}/{dt}/{case}/{name}: max|err| {err:.3g} "
                                                             f"(tol {TOL[dt] * scale:.3g}, finite {finite})")
                        except Exception as exc:  # a kernel that does not compile or run
                            rec["impls"][name] = {"error": _err(exc)}
                            summary["errors"].append(f"{sname}/{dt}/{case}/{name}: {_err(exc)}")
                            log(traceback.format_exc(limit=3))
                rows.append(rec)
                log(f"check {sname} {dt} {case} n={n} groups={groups} " +
                    " ".join(f"{k_}={v.get('max_abs_err', v.get('error'))}" for k_, v in rec["impls"].items()))
    summary["correctness"] = rows


def stage_timing(cfg, summary, budget):
    pallas = cfg["pallas_impl"]
    rows = []
    for sname, E, k, H, F in cfg["shapes"]:
        dt = cfg["time_dtype"]
        dtype = jnp.dtype(dt)
        wg, wu, wd, router = make_weights(E, H, F, dtype, seed=2)
        wg_t, wu_t, wd_t = (jnp.swapaxes(a, 1, 2) for a in (wg, wu, wd))
        for phase, n in (("decode", cfg["decode_n"]), ("prefill", cfg["prefill_n"])):
            if budget.left < cfg["kernel_reserve_s"]:
                summary["timing"] = rows
                raise StageShort(f"timing from {sname}/{phase} on")
            h = jax.random.normal(jax.random.PRNGKey(n), (n, H), jnp.float32).astype(dtype)
            reps = cfg["reps_decode"] if phase == "decode" else cfg["reps_prefill"]
            rec: dict[str, Any] = {"shape": sname, "E": E, "k": k, "H": H, "F": F, "phase": phase, "n_tokens": n,
                                   "pairs": n * k, "dtype": dt, "reps": reps, "impls": {}}
            fns = {impl: (jax.jit(functools.partial(mk.moe_ffn, k=k, impl=impl)), (h, router, wg, wu, wd))
                   for impl in (pallas, "tiles", "dense")}
            fns["ragged_dot"] = (jax.jit(functools.partial(moe_ragged, k=k)), (h, router, wg_t, wu_t, wd_t))
            for name, (f, args) in fns.items():
                try:
                    rec["impls"][name] = time_fn(f, args, reps)
                except Exception as exc:
                    rec["impls"][name] = {"error": _err(exc)}
                    summary["errors"].append(f"timing {sname}/{phase}/{name}: {_err(exc)}")
            rows.append(rec)
            log(f"time {sname} {phase} n={n} " + " ".join(
                f"{k_}={v.get('median_ms', v.get('error'))}ms" for k_, v in rec["impls"].items()))
    summary["timing"] = rows


def stage_engine(cfg, summary, budget):
    try:
        import gguf  # noqa: F401
    except ImportError as exc:
        summary["engine"] = {"skipped": f"gguf is not importable ({exc}); carry its wheel (see docs/benchmarks.md)"}
        summary["engine_failed"] = True
        return
    from make_random_qwen35moe import write_random_qwen35moe
    from pantheon.bench.engine import bench_engine

    path = Path(cfg["model_path"])
    t0 = time.perf_counter()
    if not path.is_file():
        write_random_qwen35moe(path, **cfg["model"])
    res: dict[str, Any] = {"file": str(path), "model_config": cfg["model"],
                           "write_s": round(time.perf_counter() - t0, 2), "runs": {}}
    summary["engine"] = res
    orig = mk.pick_impl
    for label, forced in cfg["engine_runs"]:
        need = cfg["engine_need_s"] if label == "auto" else cfg["engine_need_s"] + cfg["reserve_s"]
        if budget.left < need:
            res["runs"][label] = {"skipped": f"time budget ({budget.left:.0f} s left, {need} s needed)"}
            continue
        if forced:
            mk.pick_impl = lambda n_pairs, wg, _f=forced: _f
        else:
            wg = jax.ShapeDtypeStruct((cfg["model"]["n_experts"], cfg["model"]["expert_ffn"], cfg["model"]["hidden"]),
                                      jnp.bfloat16 if jax.default_backend() != "cpu" else jnp.float32)
            res["auto_resolves_to"] = {"decode_b1": orig(cfg["model"]["n_used"], wg),
                                       "decode_b8": orig(8 * cfg["model"]["n_used"], wg),
                                       "prefill": orig(cfg["bench"]["prompt_len"] * cfg["model"]["n_used"], wg)}
        try:
            t0 = time.perf_counter()
            r = bench_engine(str(path), **cfg["bench"])
            r["wall_s"] = round(time.perf_counter() - t0, 1)
            res["runs"][label] = r
            log(f"engine[{label}] prefill {r['prefill_tok_s']} tok/s, decode " +
                ", ".join(f"b{b}={d['tok_s']} tok/s" for b, d in r["decode"].items()))
        except Exception as exc:
            res["runs"][label] = {"error": _err(exc)}
            summary["engine_failed"] = True
            log(traceback.format_exc(limit=5))
        finally:
            mk.pick_impl = orig


# ---- main ------------------------------------------------------------------------------------------
def config(args) -> dict[str, Any]:
    if args.cpu_smoke:
        return dict(
            mode="cpu-smoke", interpret=True, pallas_impl="pallas_interpret",
            shapes=[("smoke", 8, 2, 64, 32)], dtypes=["float32", "bfloat16"], time_dtype="float32",
            decode_n=8, prefill_n=96, reps_decode=2, reps_prefill=2, reserve_s=10,
            model_path=args.model_path or "/tmp/qwen35moe-smoke.gguf",
            model=dict(hidden=64, n_layers=4, n_experts=8, n_used=2, expert_ffn=32, vocab=512, seed=0),
            bench=dict(batches=[1, 2], prompt_len=16, gen=4, reps=1), engine_need_s=20,
            engine_runs=[("auto", None), ("pallas_interpret", "pallas_interpret")])
    return dict(
        mode="gpu", interpret=False, pallas_impl="pallas",
        shapes=[("mid", 32, 4, 512, 256), ("35b_a3b", 256, 8, 2048, 512)], dtypes=["float32", "bfloat16"],
        time_dtype="bfloat16", decode_n=8, prefill_n=512, reps_decode=50, reps_prefill=20, reserve_s=20,
        model_path=args.model_path or "/tmp/qwen35moe-mid.gguf",
        model=dict(hidden=512, n_layers=8, n_experts=32, n_used=4, expert_ffn=256, vocab=512, seed=0),
        bench=dict(batches=[1, 8], prompt_len=128, gen=16, reps=2), engine_need_s=60,
        engine_runs=[("auto", None), ("tiles", "tiles")])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Pallas MoE kernel + qwen35moe engine check for a GPU machine")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny sizes, Pallas in interpret mode (runs on CPU)")
    ap.add_argument("--budget-s", type=float, default=240.0,
                    help="soft time budget in seconds from start; later parts are skipped (hard stop 40 s after)")
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--model-path", default=None, help="where the random qwen35moe GGUF is written/read")
    ap.add_argument("--out", default=None, help="also write the JSON summary to this file")
    args = ap.parse_args(argv)
    cfg = config(args)
    # kernel stages stop early enough to leave the engine stage its time
    cfg["kernel_reserve_s"] = cfg["reserve_s"] + (0 if args.skip_engine else cfg["engine_need_s"])
    budget = Budget(args.budget_s)
    dev = jax.devices()[0]
    summary: dict[str, Any] = {
        "mode": cfg["mode"], "pallas_impl": cfg["pallas_impl"],
        "env": {"python": platform.python_version(), "jax": jax.__version__, "backend": jax.default_backend(),
                "device": getattr(dev, "device_kind", str(dev)), "n_devices": jax.device_count(),
                "host_cpus": os.cpu_count()},
        "tolerance_rel": TOL, "mismatches": [], "errors": [], "skipped": []}
    if not args.cpu_smoke and jax.default_backend() != "gpu":
        log(f"warning: backend is {jax.default_backend()!r}, not gpu; the Pallas Triton kernel will not compile "
            "(use --cpu-smoke on CPU)")

    def on_alarm(signum, frame):
        raise OutOfTime("hard alarm")

    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(max(1, int(args.budget_s + 40 - budget.elapsed)))
    code = 0
    stages = [("compile_probe", stage_compile_probe), ("correctness", stage_correctness), ("timing", stage_timing)]
    if not args.skip_engine:
        stages.append(("engine", stage_engine))
    try:
        for name, fn in stages:
            if budget.left < cfg["reserve_s"]:
                summary["skipped"].append(name)
                continue
            log(f"stage {name} ({budget.elapsed:.0f} s elapsed)")
            try:
                fn(cfg, summary, budget)
            except OutOfTime:
                raise
            except StageShort as exc:
                summary["skipped"].append(f"{exc} (time budget)")
            except Exception as exc:
                summary["errors"].append(f"stage {name}: {_err(exc)}")
                log(traceback.format_exc(limit=5))
                if name == "engine":
                    summary["engine_failed"] = True
    except OutOfTime as exc:
        summary["skipped"].append(f"out of time at {exc}")
        code = 4
    finally:
        signal.alarm(0)
    if summary["errors"] and code == 0:
        code = 3 if all(e.startswith("stage engine") for e in summary["errors"]) else 2
    if summary.get("engine_failed") and code == 0:
        code = 3
    if summary["mismatches"]:
        code = 1
    summary["elapsed_s"] = round(budget.elapsed, 1)
    summary["exit_code"] = code
    summary["ok"] = code == 0
    summary["complete"] = code == 0 and not summary["skipped"] and not any(
        "skipped" in r for r in (summary.get("engine") or {}).get("runs", {}).values())
    text = json.dumps(summary, default=str)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
