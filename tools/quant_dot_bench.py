"""Single-product timings of the native stored-weight kernels, exact vs int8, against copy bandwidth.

Why: issue 30 asks for a batch-1 product at the memory-bandwidth bound. This times one jitted
`native.weight_matmul` on 7B-shaped matrices (random blocks: the timing does not depend on the
values), for rows 1, 2, 4, 8, each form, and prints weight bytes / median time beside numpy's copy
bandwidth of a 1 GB array measured the same way (median of repeats; `copyto` reads and writes, so
its figure counts both). The machine is shared: run it twice and compare.

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


def median_time(fn, repeat: int) -> float:
    fn()  # warm: compile, first touch
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def copy_bandwidth(repeat: int) -> float:
    """numpy copyto of a 1 GB f32 array: bytes read + written per second."""
    a = np.ones(1 << 28, np.float32)
    b = np.empty_like(a)
    return 2 * a.nbytes / median_time(lambda: np.copyto(b, a), repeat)


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
    bw = copy_bandwidth(max(5, args.repeat // 3))
    print(f"numpy copyto, 1 GB: {bw / 1e9:.1f} GB/s (read + write); read-only share {bw / 2e9:.1f} GB/s")
    print(f"{'format':6} {'N x K':>12} {'MB':>6} {'rows':>4} {'exact ms':>9} {'GB/s':>6} {'int8 ms':>8} {'GB/s':>6} "
          f"{'speedup':>7}")
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
        data = jnp.asarray(blocks.reshape(n, -1))
        nbytes = data.size
        for m in rows:
            x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32))
            t = {}
            for dot in ("exact", "int8"):
                fn = jax.jit(lambda x, d, dot=dot: native.weight_matmul(x, d, fmt, dot=dot))
                t[dot] = median_time(lambda: fn(x, data).block_until_ready(), args.repeat)
            print(f"{fmt:6} {n:>5}x{k:<6} {nbytes / 1e6:6.1f} {m:>4} {t['exact'] * 1e3:9.2f} "
                  f"{nbytes / t['exact'] / 1e9:6.1f} {t['int8'] * 1e3:8.2f} {nbytes / t['int8'] / 1e9:6.1f} "
                  f"{t['exact'] / t['int8']:7.2f}x", flush=True)


if __name__ == "__main__":
    main()
