"""Single-product timings of the native stored-weight kernels, exact vs int8, against copy bandwidth.

Why: issue 30 asks for a batch-1 product at the memory-bandwidth bound. This times one jitted
`native.weight_matmul` on 7B-shaped matrices (random blocks: the timing does not depend on the
values), for rows 1, 2, 4, 8, each form, and prints weight bytes / time (median and best of the
repeats) beside numpy's copy bandwidth of a 1 GB array measured the same way (`copyto` reads and
writes, so its figure counts both). Each call reads one of several copies of the matrix (256 MB in
all), so the weights come from memory, not from the last-level cache. The machine is shared: run
it twice and compare.

    python tools/quant_dot_bench.py [--repeat 15] [--rows 1,2,4,8]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from pantheon.config import load_settings
from pantheon.ops import native
from pantheon.ops.quant_formats import FORMATS

SHAPES = (("Q4_K", 4096, 4096), ("Q4_K", 11008, 4096), ("Q6_K", 11008, 4096), ("Q4_K", 4096, 11008),
          ("Q6_K", 4096, 11008), ("Q4_0", 4096, 4096), ("Q8_0", 4096, 4096), ("Q5_0", 4096, 4096),
          ("Q5_K", 4096, 4096))


def times_of(fn, repeat: int) -> tuple[float, float]:
    """(median, best) seconds of `repeat` calls after a warm-up call."""
    fn()  # warm: compile, first touch
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), min(times)


def copy_bandwidth(repeat: int) -> float:
    """numpy copyto of a 1 GB f32 array: bytes read + written per second."""
    a = np.ones(1 << 28, np.float32)
    b = np.empty_like(a)
    med, best = times_of(lambda: np.copyto(b, a), repeat)
    return 2 * a.nbytes / med, 2 * a.nbytes / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--formats", default="")
    args = ap.parse_args()
    if not native.enable(load_settings().home / "native"):
        raise SystemExit(f"native kernels unavailable: {native.unavailable_reason()}")
    rows = [int(r) for r in args.rows.split(",")]
    rng = np.random.default_rng(0)
    bw, bw_best = copy_bandwidth(max(5, args.repeat // 3))
    print(f"numpy copyto, 1 GB: median {bw / 1e9:.1f} GB/s, best {bw_best / 1e9:.1f} GB/s (read + write)")
    print("weights' bytes / time, median (best) of the repeats")
    print(f"{'format':6} {'N x K':>12} {'MB':>6} {'rows':>4} {'exact ms':>14} {'GB/s':>11} {'int8 ms':>14} "
          f"{'GB/s':>11} {'speedup':>7}")
    for fmt, n, k in SHAPES:
        if args.formats and fmt not in args.formats.split(","):
            continue
        f = FORMATS[fmt]
        data = jnp.asarray(rng.integers(0, 256, (n, f.row_bytes(k)), dtype=np.uint8))
        scales = {"Q4_K": [0, 2], "Q6_K": [208], "Q4_0": [0], "Q8_0": [0], "Q5_0": [0], "Q5_K": [0, 2]}[fmt]
        blocks = np.asarray(data).reshape(n, -1, f.block_bytes).copy()
        for off in scales:  # ordinary f16 scales (random bytes would make infs and NaNs)
            blocks[..., off:off + 2] = np.full(blocks.shape[:2], 0.01, np.float16).view(np.uint8).reshape(
                *blocks.shape[:2], 2)
        # distinct copies cycled through, together past any last-level cache: each call reads DRAM
        copies = [jnp.asarray(np.roll(blocks.reshape(n, -1), c, axis=0)) for c in range(-(-(1 << 28) // blocks.size))]
        nbytes = blocks.size
        turn = [0]

        def data() -> jax.Array:
            turn[0] += 1
            return copies[turn[0] % len(copies)]
        for m in rows:
            x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32))
            t = {}
            for dot in ("exact", "int8"):
                fn = jax.jit(lambda x, d, dot=dot: native.weight_matmul(x, d, fmt, dot=dot))
                t[dot] = times_of(lambda: fn(x, data()).block_until_ready(), args.repeat)
            cells = " ".join(f"{t[d][0] * 1e3:6.2f} ({t[d][1] * 1e3:5.2f}) {nbytes / t[d][0] / 1e9:4.1f} "
                             f"({nbytes / t[d][1] / 1e9:4.1f})" for d in ("exact", "int8"))
            print(f"{fmt:6} {n:>5}x{k:<6} {nbytes / 1e6:6.1f} {m:>4} {cells} {t['exact'][0] / t['int8'][0]:6.2f}x",
                  flush=True)


if __name__ == "__main__":
    main()
