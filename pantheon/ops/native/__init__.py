"""Native step kernels: small C++ XLA FFI kernels, built with the machine's compiler on first use.

Why: a decode step multiplies a handful of rows (1-8 slots, a few more in a mixed step) by every
weight matrix, and attends one query per row over that row's slot of the cache. XLA:CPU runs the
first as a general GEMM that packs the weights on every call (an 8-row product at half the speed the
weights stream from memory) and the second as a gather of a bucketed span of every slot followed by
masked batched matmuls. `cpu_kernels.cc` beside this file does both directly, and keeps each row's result
independent of the other rows in the call (see its header). The matmul takes every row count on one
CPU die, prefill chunks included: from 64 rows up it still matches or beats XLA's GEMM (a 64-row
SmolLM2 step 137-151 vs 189-199 ms; 128 rows level), and a decode row's products are then the same
bits in a decode step or beside a prefill chunk.

Weights stay in their GGUF format on the device (pantheon.ops.weights), and `weight_matmul` multiplies
every format of `quant_formats.FORMATS` where it lies: F32 through the f32 kernel, F16/BF16 and all
block formats (Q4_0 .. Q8_0, the K-quants Q2_K .. Q6_K, IQ4_NL, IQ4_XS) through one kernel that widens
each weight to exactly the f32 value `gguf.quants.dequantize` gives. So a product over stored weights
has the same bits as the f32 kernel's over the dequantized matrix: the format changes what is
streamed (a Q4_K matrix is 1/7 of its f32 bytes), never the result. The decode attention reads f32,
f16 or bf16 caches in place, widening keys and values on the fly.

Whether a forward uses the kernels is the caller's static decision (a weight's placement records it);
`applies`, `weight_matmul_applies` and `attention_applies` only say whether the kernels *can* serve a
call: built and registered here, and the shapes and dtypes fit. They serve x86 CPUs with AVX2, FMA and
F16C; anywhere else, or when the build fails, `enable` returns False and callers keep XLA's forms
(as they do with PANTHEON_NATIVE_MATMUL=0).

The shared library is cached in `$PANTHEON_HOME/native/`, named by a hash of the source, the flags
and the jaxlib version, so a changed kernel or jaxlib rebuilds it (under a minute of g++ on two busy
cores: each format at each decode row count 1-8 is its own fully unrolled loop).

The build runs wherever the first model loads, which under `pantheon serve` is a real OS thread of a
gevent-monkey-patched gunicorn worker. There gevent's `subprocess` needs the default loop's child
watcher (TypeError in any other thread) and the saved stdlib `Popen` has lost its fork helper, so the
compiler is started with the unpatched `os.posix_spawn` and reaped with the unpatched `os.waitpid`:
that works in any thread, patched or not. It writes to `.building-<host>-<pid>-<random>.so` in the
cache directory, removed on any failure and `os.replace`d into place on success, so a concurrent
builder (another worker, another server on the same home) sees the whole library or none, and both
end with a working one; the compiler is killed and reaped before its temp is removed, so it cannot
write the file again afterwards (how the subprocess-based build left an orphan `tmp*.so` on every
start). Temp files of builders that died (their pid is gone, or they are older than any build may
run) are removed whenever the kernels are enabled.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pantheon import osthread
from pantheon.ops.quant_formats import FORMATS

log = logging.getLogger(__name__)

TARGET = "pantheon_rows_matmul"  # x f32 times w [N, K] f32
QUANT_TARGET = "pantheon_rows_matmul_q"  # x f32 times w stored in any other format (attr qtype: ggml id)
ATTENTION_TARGET = "pantheon_decode_attention"
# Every format the kernels multiply (today all of quant_formats.FORMATS): F32 by TARGET, all others
# by QUANT_TARGET. Spelled out, not derived: a format added to the table is not read by the kernels
# until cpu_kernels.cc learns it.
NATIVE_FORMATS: frozenset[str] = frozenset(
    {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
     "IQ4_NL", "IQ4_XS"}) & frozenset(FORMATS)
# Formats with an int8 form (dot="int8": the activation row quantized to 8 bits once per call,
# integer dot products with the blocks; cpu_kernels.cc, "the int8 form"). F16 and BF16 have none: with
# dot="int8" they keep the exact form.
INT8_FORMATS: frozenset[str] = frozenset(
    {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"}) & NATIVE_FORMATS
DOTS = ("exact", "int8")  # the two forms of a stored-weight product (the `dot` argument)
# The dtype a float format's [N, K] weights are stored in (block formats: uint8 [N, row bytes]).
_FLOAT_DTYPES = {"F32": jnp.dtype(jnp.float32), "F16": jnp.dtype(jnp.float16), "BF16": jnp.dtype(jnp.bfloat16)}
_CACHE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
SOURCE = Path(__file__).with_name("cpu_kernels.cc")
# -ffp-contract=off: GCC would otherwise fuse a separate multiply and add into an fma (its C++
# default, ISO mode or not), rounding once where gguf's numpy rounds twice; the kernels write every
# fma they mean explicitly, and their results must have numpy's bits.
_FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-std=c++17", "-shared", "-fPIC", "-w")
BUILD_TIMEOUT_S = 300.0  # a cold g++ of cpu_kernels.cc takes under a minute; a hung one is killed then
TEMP_PREFIX = ".building-"  # in-progress builds: .building-<host>-<pid>-<random>.so

_build_lock = osthread.Lock()  # serialises build/registration; guards _ready and _failed
_ready = False  # the FFI targets are registered in this process
_library_id: str | None = None  # the registered library's file name (a hash of its source, flags, jaxlib)
_failed: str | None = None  # why the kernels are unavailable (set once; not retried)


def _cpu_supported() -> bool:
    """x86 with AVX2, FMA and F16C (the kernels' instructions), read from Linux's cpuinfo."""
    if sys.platform != "linux":
        return False
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return {"avx2", "fma", "f16c"} <= flags
    except OSError:
        pass
    return False


def _library_path(cache_dir: Path) -> Path:
    import jaxlib
    h = hashlib.sha256(SOURCE.read_bytes())
    h.update(" ".join(_FLAGS).encode())
    h.update(jaxlib.__version__.encode())
    return cache_dir / f"cpu_kernels-{h.hexdigest()[:16]}.so"


def _host_tag() -> str:
    """A short, filename-safe tag of this host: pids are only compared on the host that wrote them."""
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def remove_stale_temps(cache_dir: Path, max_age_s: float = 2 * BUILD_TIMEOUT_S) -> list[Path]:
    """Delete build temp files whose builder is gone; returns those removed.

    Gone means: written on this host by a pid that no longer runs, or older than `max_age_s` (no live
    build lasts that long, since `_run` kills it at BUILD_TIMEOUT_S; this also covers temps from other
    hosts sharing the directory, and a pid reused since). A live builder's temp is never touched.
    Earlier versions built into `tmp*.so` and left one behind on every failed start under gevent;
    those carry no pid and go by age alone.
    """
    removed: list[Path] = []
    here = _host_tag()
    now = time.time()
    try:
        entries = [*Path(cache_dir).glob(TEMP_PREFIX + "*"), *Path(cache_dir).glob("tmp*.so")]
    except OSError:
        return removed
    for path in entries:
        try:
            dead = False
            if path.name.startswith(TEMP_PREFIX):
                parts = path.name[len(TEMP_PREFIX):].split("-")
                dead = len(parts) >= 3 and parts[0] == here and parts[1].isdigit() and not _pid_alive(int(parts[1]))
            if dead or now - path.stat().st_mtime > max_age_s:
                path.unlink()
                removed.append(path)
        except OSError:  # gone meanwhile, or not ours to delete
            continue
    return removed


def _compile(out: Path) -> None:
    """Build the kernels into `out` atomically: complete library there, or no file and a RuntimeError."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise RuntimeError("no C++ compiler (g++ or c++) on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f"{TEMP_PREFIX}{_host_tag()}-{os.getpid()}-", suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        cmd = [os.path.abspath(cxx), *_FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", tmp]
        try:
            status, output = osthread.run_process(cmd, BUILD_TIMEOUT_S)
        except TimeoutError as exc:
            raise RuntimeError(f"{cxx} timed out: {exc}") from None
        if status is None:
            # gevent's SIGCHLD handler (installed once anything used gevent's subprocess in the
            # hub's thread) reaps every child, so the status is lost. The output tells instead: a
            # failed compile never links, a failed link removes it, and a bad library fails to load.
            if not os.path.exists(tmp) or os.path.getsize(tmp) == 0:
                raise RuntimeError(f"{cxx} produced no library: {output.strip()[-2000:]}")
        elif status:
            raise RuntimeError(f"{cxx} failed with exit status {status}: {output.strip()[-2000:]}")
        os.replace(tmp, out)  # atomic: a concurrent builder sees the whole library or none
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def enable(cache_dir: Path) -> bool:
    """Build (once per source/jaxlib) and register the kernels; True when the kernels can be used.

    Idempotent and safe from several threads. A failure is logged once and leaves XLA's forms in place.
    """
    global _ready, _failed, _library_id
    with _build_lock:
        if _ready or _failed:
            return _ready
        try:
            if not _cpu_supported():
                raise RuntimeError("this CPU lacks AVX2/FMA/F16C")
            lib_path = _library_path(Path(cache_dir))
            remove_stale_temps(lib_path.parent)
            if not lib_path.exists():
                _compile(lib_path)
            lib = ctypes.cdll.LoadLibrary(str(lib_path))
            jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.PantheonRowsMatmul), platform="cpu")
            jax.ffi.register_ffi_target(QUANT_TARGET, jax.ffi.pycapsule(lib.PantheonRowsMatmulQuant),
                                        platform="cpu")
            jax.ffi.register_ffi_target(ATTENTION_TARGET, jax.ffi.pycapsule(lib.PantheonDecodeAttention),
                                        platform="cpu")
            _library_id = lib_path.name
            _ready = True
        except Exception as exc:  # XLA's forms still work; say why once
            _failed = f"{type(exc).__name__}: {exc}"
            log.warning("native matmul unavailable, using XLA's dot and attention: %s", _failed)
        return _ready


def library_id() -> str | None:
    """Which kernel library this process registered (None: none): compiled programs call its FFI
    targets by name, so a stored program is only reused with the same library."""
    return _library_id


def unavailable_reason() -> str | None:
    return _failed


def applies(rows: int, w: jax.Array) -> bool:
    """Whether `matmul` can serve `rows` rows times this f32 weight [N, K] (at trace time)."""
    return (_ready and rows > 0 and w.ndim == 2 and w.dtype == jnp.float32 and w.shape[1] > 0
            and w.shape[1] % 8 == 0)


def _skip_rows(rows: int, skip: tuple[jax.Array, jax.Array] | None) -> jax.Array:
    """The kernels' [first, end) of flattened rows to leave out (their outputs are zero); none by default."""
    if skip is None:
        return jnp.full((2,), rows, jnp.int32)
    return jnp.stack([jnp.asarray(skip[0], jnp.int32), jnp.asarray(skip[1], jnp.int32)])


def matmul(x: jax.Array, w: jax.Array, skip: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    """x [..., K] @ w.T for w [N, K] in f32 (CPU only: callers check `applies`).

    skip: flattened rows [first, end) whose products nobody reads (a prefill chunk's padding); they
    come back as zeros and cost nothing.
    """
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k).astype(jnp.float32)
    y = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x2.shape[0], w.shape[0]), jnp.float32))(
        x2, w, _skip_rows(x2.shape[0], skip))
    return y.reshape(lead + (w.shape[0],))


def _fits(k: int, data: jax.Array, qtype: str) -> bool:
    """Whether `data` holds an [N, k] matrix stored in format `qtype` the kernels read."""
    fmt = FORMATS.get(qtype)
    if fmt is None or qtype not in NATIVE_FORMATS or k <= 0 or k % fmt.block_weights or data.ndim != 2:
        return False
    if fmt.is_block:
        return data.dtype == jnp.uint8 and data.shape[1] == fmt.row_bytes(k)
    return k % 8 == 0 and data.dtype == _FLOAT_DTYPES.get(qtype) and data.shape[1] == k


def weight_matmul_applies(rows: int, k: int, data: jax.Array, qtype: str) -> bool:
    """Whether `weight_matmul` can serve `rows` rows of k inputs times `data` in format `qtype` (at trace time).

    True when the kernels are built and registered here, rows > 0, k is a multiple of the format's block
    (and of 8 for float formats) and `data` has the stored shape and dtype of an [N, k] matrix.
    """
    return _ready and rows > 0 and _fits(k, data, qtype)


def weight_matmul(x: jax.Array, data: jax.Array, qtype: str,
                  skip: tuple[jax.Array, jax.Array] | None = None, index: jax.Array | None = None,
                  dot: str = "exact") -> jax.Array:
    """x [..., K] f32 @ W.T -> [..., N] f32 for the matrix W [N, K] stored as `data` in format `qtype`.

    data: uint8 blocks [N, K / block_weights * block_bytes] for block formats, the [N, K] array itself
    (f32, f16, bf16) for float formats. dot="exact": every weight is widened to the f32 value gguf's
    dequantizer gives, so the result has the bits `matmul(x, dequantized W)` has. dot="int8" (formats
    of INT8_FORMATS; the others stay exact): each row of x is quantized to 8 bits per weight block and
    multiplied in integers, as llama.cpp does: about 3x less work per weight, an error of about 1/254
    of each block's largest activation per product; a row's result still does not depend on the other
    rows. A static choice (part of the traced program). skip: as for `matmul`.
    index: with data a stack [E, ...] of such matrices (an MoE layer's experts), the product with
    matrix `index` (clamped into [0, E)), read in place: slicing it out first would make XLA copy it.
    CPU only: callers check `weight_matmul_applies` (on the stack: `stacked_matmul_applies`).
    """
    if dot not in DOTS:
        raise ValueError(f"dot must be one of {DOTS}, not {dot!r}")
    k = x.shape[-1]
    if index is not None and qtype == "F32":  # the f32 kernel reads one matrix: slice it out
        data, index = jax.lax.dynamic_index_in_dim(data, index, axis=0, keepdims=False), None
    matrix = data if index is None else jax.ShapeDtypeStruct(data.shape[1:], data.dtype)
    if not _fits(k, matrix, qtype):
        raise ValueError(f"{qtype} data {data.dtype}{list(data.shape)} is no matrix of {k} inputs the kernels read")
    if qtype == "F32":
        return matmul(x, data, skip)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).astype(jnp.float32)
    n = matrix.shape[0]
    out = jax.ShapeDtypeStruct((x2.shape[0], n), jnp.float32)
    which = jnp.zeros((1,), jnp.int32) if index is None else jnp.reshape(jnp.asarray(index, jnp.int32), (1,))
    y = jax.ffi.ffi_call(QUANT_TARGET, out)(x2, data, _skip_rows(x2.shape[0], skip), which,
                                            qtype=np.int32(FORMATS[qtype].type_id),
                                            dot=np.int32(DOTS.index(dot)), mapped=np.int32(0))
    return y.reshape(lead + (n,))


FILE_UNIT = 32  # bytes: a mapped file is handed to the kernels as [units, FILE_UNIT] (cpu_kernels.cc kFileUnit)


def mapped_matmul(x: jax.Array, file: jax.Array, qtype: str, n: int, unit: jax.Array, matrix: jax.Array | int = 0,
                  skip: tuple[jax.Array, jax.Array] | None = None, dot: str = "exact") -> jax.Array:
    """`weight_matmul` for a matrix read in place from a mapped file.

    file: the whole file's bytes as uint8 [units, FILE_UNIT]; the matrices [.., n, row_bytes] of one
    tensor start `unit` * FILE_UNIT bytes in (traced: a layer's tensor picked by the layer loop), and
    the product is with matrix `matrix` of them (an expert of an MoE layer's tensor; 0 otherwise).
    The kernel refuses (an error, never a read elsewhere) a matrix that would end past the file.
    """
    if dot not in DOTS:
        raise ValueError(f"dot must be one of {DOTS}, not {dot!r}")
    k = x.shape[-1]
    fmt = FORMATS.get(qtype)
    matrix_spec = jax.ShapeDtypeStruct((n, fmt.row_bytes(k) if fmt and fmt.is_block else 0), jnp.uint8)
    if not (_ready and n > 0 and fmt is not None and fmt.is_block and _fits(k, matrix_spec, qtype)) \
            or file.dtype != jnp.uint8 or file.ndim != 2 or file.shape[1] != FILE_UNIT:
        raise ValueError(f"{qtype} matrix [{n}, {k}] cannot be read from file data {file.dtype}{list(file.shape)}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).astype(jnp.float32)
    where = jnp.stack([jnp.asarray(unit, jnp.int32).reshape(()), jnp.asarray(matrix, jnp.int32).reshape(())])
    y = jax.ffi.ffi_call(QUANT_TARGET, jax.ShapeDtypeStruct((x2.shape[0], n), jnp.float32))(
        x2, file, _skip_rows(x2.shape[0], skip), where, qtype=np.int32(FORMATS[qtype].type_id),
        dot=np.int32(DOTS.index(dot)), mapped=np.int32(1))
    return y.reshape(lead + (n,))


def stacked_matmul_applies(rows: int, k: int, data: jax.Array, qtype: str) -> bool:
    """Whether `weight_matmul(..., index=e)` can serve one matrix of the stack data [E, N, ...] (trace time)."""
    return _ready and rows > 0 and data.ndim == 3 and _fits(k, jax.ShapeDtypeStruct(data.shape[1:], data.dtype),
                                                            qtype)


def attention_applies(q: jax.Array, cache: jax.Array) -> bool:
    """Whether `decode_attention` can serve q [B, 1, N, D] over cache [L, S, K, C, D] (at trace time).

    The cache may be f32, f16 or bf16 (the values cache must match it).
    """
    d = q.shape[-1]
    return (_ready and q.ndim == 4 and q.shape[1] == 1 and cache.ndim == 5
            and cache.dtype in _CACHE_DTYPES and cache.shape[-1] == d and d % 8 == 0 and d <= 256
            and cache.shape[2] > 0 and q.shape[2] % cache.shape[2] == 0)


def decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array,
                     slots: jax.Array, pos: jax.Array, scale: float) -> jax.Array:
    """Causal attention of one query token per row, read in place from the slot caches.

    q [B, 1, N, D]; caches [L, S, K, C, D], both f32, f16 or bf16 (keys and values are widened to f32
    as they are read; the arithmetic is f32); row b attends to positions 0..pos[b] of slot slots[b] in
    layer `layer`. Returns [B, 1, N * D] like common.attention. CPU only (callers check `attention_applies`).
    """
    if k_cache.dtype != v_cache.dtype or k_cache.shape != v_cache.shape:
        raise ValueError(f"k and v caches differ: {k_cache.dtype}{list(k_cache.shape)} vs "
                         f"{v_cache.dtype}{list(v_cache.shape)}")
    b, _, n, d = q.shape
    out = jax.ShapeDtypeStruct((b, n, d), jnp.float32)
    o = jax.ffi.ffi_call(ATTENTION_TARGET, out)(
        q.reshape(b, n, d).astype(jnp.float32), k_cache, v_cache, jnp.asarray(layer, jnp.int32),
        slots.astype(jnp.int32), pos.astype(jnp.int32), scale=np.float32(scale))
    return o.reshape(b, 1, n * d).astype(q.dtype)
