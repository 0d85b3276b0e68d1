"""The engine seam: load a model onto JAX devices and run jitted, donated, sampled steps.

`load(path, opts)` / `load_on(path, opts, dies)` return a `Model`. A model owns its params and its
compiled step; it does not own sequences. Callers (the single-user generator below, the batch
scheduler) own a state from `new_state()` and pass it to `step_begin`, which dispatches one jitted
forward over B rows and returns at once (JAX async dispatch); `step_poll` / `step_wait` collect the
sampled token ids. Only ids (and logits when asked for) cross back to the host.

Shapes are bucketed so the number of compiled programs is small and known at load: rows B in
(1, 2, 4, 8), tokens per row T in (1, 32 and quarters of prefill_chunk), attention span doubling
from 128 up to max_seq (the top bucket also covers the chunk's padding slack). A step whose rows
are one prompt chunk plus single decode tokens runs as a "mixed" program (one per T and span) when
the architecture has `forward_groups`. The cache has one extra "scratch" slot that padding rows
write to.
"""

from __future__ import annotations

import dataclasses
import os
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import compile_guard, memory, native, osthread, weights
from .config import load_settings
from .errors import ModelLoadError
from .gguf_loader import GGUFFile, ModelConfig, open_gguf
from .jax_models.common import last_valid
from .jax_models.registry import capabilities_of
from .sampler import SamplingParams, make_rows_np, sample
from .weights import XLA, Kernels

PENALTY_WINDOW = 64  # tokens of history each row hands the in-step sampler for penalties


@dataclass(frozen=True)
class LoadOptions:
    """How to load and place a model. `n_slots` rows share one cache; `max_seq` bounds a sequence."""

    name: str | None = None
    dtype: str = "auto"  # "auto": f32 on CPU (XLA:CPU is slow in bf16), bf16 on GPU
    n_slots: int = 8
    max_seq: int = 2048
    prefill_chunk: int = 128
    config_path: str | None = None  # HF config.json for a safetensors checkpoint
    warmup: bool = False  # compile every bucket at load
    native_matmul: bool | None = None  # on one CPU die, use pantheon.native's kernels (None: PANTHEON_NATIVE_MATMUL)
    kv_dtype: str | None = None  # KV cache dtype: float32 | float16 | bfloat16 | auto (None: PANTHEON_KV_DTYPE)
    native_dir: str | None = None  # where the kernels' library is cached (default $PANTHEON_HOME/native)


def _geometric_buckets(lo: int, hi: int, factor: int) -> tuple[int, ...]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= factor
    out.append(hi)
    return tuple(out)


def _chunk_buckets(chunk: int) -> tuple[int, ...]:
    """Prefill lengths: 32 and, from a 128-token chunk up, every quarter of it (128 -> 32, 64, 96, 128)."""
    lengths = {min(32, chunk), chunk}
    if chunk >= 128:
        lengths |= {-(-chunk * i // 4) for i in range(1, 4)}
    return tuple(sorted(lengths))


def _bucket(n: int, buckets: Sequence[int]) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


@dataclass
class StepHandle:
    """A dispatched step: device arrays that become ready asynchronously."""

    ids: jax.Array
    logits: jax.Array | None
    n_rows: int

    def ready(self) -> bool:
        return self.ids.is_ready()


@dataclass
class _Plan:
    """One step's compiled forward, its arguments after (params, state), and the sampler's row count."""

    fn: Any
    args: tuple
    kwargs: dict[str, Any]
    key: tuple  # the shape bucket, for compiled_shapes()
    rows: int


class Model:
    """A loaded model: config, tokenizer, chat template, device params and the compiled step."""

    def __init__(self, path: Path, name: str, cfg: ModelConfig, meta: dict[str, Any], arch: Any,
                 params: Any, tokenizer: Any, template: Any, opts: LoadOptions, devices: list[Any],
                 compute_dtype: Any, weight_bytes: int, kernels: Kernels = XLA, kv_dtype: Any = jnp.float32):
        self.path = path
        self.name = name
        self.config = cfg
        self.meta = meta
        self.arch = arch
        self.params = params
        self.tokenizer = tokenizer
        self.template = template
        self.opts = opts
        self.devices = devices
        self.dtype = compute_dtype
        self.weight_bytes = weight_bytes
        self.kernels = kernels  # which kernels the steps use (static: part of every jit cache key)
        self.native_matmul = kernels.matmul  # for health and metrics
        self.kv_dtype = jnp.dtype(kv_dtype)  # the KV cache's element type (PANTHEON_KV_DTYPE)
        self.n_slots = opts.n_slots
        self.max_seq = min(opts.max_seq, cfg.context_length) if cfg.context_length else opts.max_seq
        self.chunk = max(1, min(opts.prefill_chunk, self.max_seq))
        self.capacity = self.max_seq + self.chunk  # a padded chunk never writes past the end
        self.scratch_slot = self.n_slots
        # Few buckets = few programs to compile at load (each costs seconds on CPU). Rows double,
        # prefill chunks step by a quarter of the full chunk (prefill is compute-bound, so a 70-token
        # prompt padded to 128 would cost almost twice what it needs).
        self.row_buckets = _geometric_buckets(1, max(1, self.n_slots), 2)
        self.chunk_buckets = _chunk_buckets(self.chunk)
        # Spans double from 128 to max_seq: batched decode time grows with the span it attends over
        # (span 1024 costs ~4x span 256 at 8 rows), so a bucket is at most twice the filled part.
        # The last one stretches to the capacity (the chunk's padding slack) instead of adding a
        # bucket just above max_seq: one program fewer per (rows, tokens) bucket.
        self.span_buckets = (*_geometric_buckets(min(128, self.max_seq), self.max_seq, 2)[:-1], self.capacity)
        # Two programs per step: the forward (one per (rows, tokens, span) bucket) and the sampler
        # (one per rows bucket). Keeping the sampler out of the forward compiles it 4 times, not 40.
        # Several dies: one mesh over them, params and state split tensor-parallel (pantheon.sharding);
        # the step pins the state it returns to the layout it took, so one program serves every step.
        self.shard_plan = None
        impl = self._forward_impl
        if len(devices) > 1:
            from .sharding import ShardPlan
            self.shard_plan = ShardPlan(devices, cfg)
            impl = self.shard_plan.wrap_forward(self._forward_impl)
            self._sharded_init = self.shard_plan.state_initializer(
                lambda: self.arch.init_state(self.config, self.n_slots + 1, self.capacity, self.kv_dtype))
        self._forward = jax.jit(impl, static_argnames=("span", "all_logits", "kernels"), donate_argnums=(1,))
        # Mixed steps: one prefill row of T tokens plus up to n_slots - 1 decode rows in one forward
        # (the architecture's forward_groups), so a new request's prompt does not stall the decoders.
        # The decode group is always padded to n_slots - 1 rows: one program per (T, span), not four.
        self.mixed_rows = self.n_slots - 1
        self.supports_mixed = capabilities_of(arch).mixed_steps and self.mixed_rows >= 1
        if self.supports_mixed:
            mixed = self._mixed_impl if self.shard_plan is None else self.shard_plan.wrap_forward(self._mixed_impl)
            self._forward_mixed = jax.jit(mixed, static_argnames=("span", "kernels"), donate_argnums=(1,))
        self._sample = jax.jit(sample)
        if self.shard_plan is not None:
            self._sample = self.shard_plan.on_first_die(self._sample)
        self._compiled_keys: set[tuple] = set()
        self._keys_lock = osthread.Lock()  # guards _compiled_keys (steps may come from several threads)
        # The leaves of every state this model handed out (new_state, step_begin), held weakly, so
        # release() can free the caches' device buffers even if a caller still holds a state.
        # id(leaf) -> leaf; an entry goes by itself when its leaf dies (donated or dropped).
        self._states: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
        self.released = False

    # ---- state ---------------------------------------------------------------------------------
    def new_state(self) -> Any:
        """Fresh state for n_slots sequences plus the scratch slot, on the model's device."""
        self._check_live()
        if self.shard_plan is not None:  # built straight into its shards over the model's dies
            return self._track(self._sharded_init())
        with jax.default_device(self.devices[0]):
            state = self.arch.init_state(self.config, self.n_slots + 1, self.capacity, self.kv_dtype)
        # Committed to the device like every step's output, so the first step and later ones share
        # one compiled program (an uncommitted input is a different jit cache key).
        return self._track(jax.device_put(state, self.devices[0]))

    def _track(self, state: Any) -> Any:
        """Remember `state`'s leaves weakly (for release); returns it unchanged."""
        for leaf in jax.tree.leaves(state):
            self._states[id(leaf)] = leaf
        return state

    def _check_live(self) -> None:
        if self.released:
            raise RuntimeError(f"model {self.name!r} has been released (unloaded)")

    # ---- release ---------------------------------------------------------------------------------
    def release(self) -> None:
        """Free what this model holds on its devices now, whoever still references the Model.

        Why explicit: a loaded model's memory is its params, its slot caches and its compiled
        programs, and Python frees them only when the last reference goes -- which an unload cannot
        guarantee (a scheduler or a traceback still pointing at a state, reference cycles through the
        jitted closures). So unload calls this: every param and every state leaf still alive is
        deleted (device buffers go at once; a later use raises instead of reading freed memory), the
        compiled programs of this model's own jitted functions are dropped (`clear_cache` is per
        function: other loaded models keep theirs, unlike the global `jax.clear_caches()`), and the
        references are cut so the closures can be collected. Idempotent; the model cannot step after.
        Call it only once no thread is stepping the model (the registry closes the backend first).
        """
        if self.released:
            return
        self.released = True
        _delete_arrays(list(self._states.values()))
        self._states.clear()
        params, self.params = self.params, None
        _delete_arrays(params)
        for attr in ("_forward", "_forward_mixed", "_sample"):
            fn = getattr(self, attr, None)
            clear = getattr(fn, "clear_cache", None)
            if callable(clear):
                clear()
            if fn is not None:
                setattr(self, attr, None)
        self._sharded_init = None
        self.shard_plan = None
        with self._keys_lock:
            self._compiled_keys.clear()

    def state_bytes_per_token(self) -> int:
        """What one more token of context costs in this model's cache (at its KV dtype)."""
        return kv_bytes(self.arch.state_bytes_per_token(self.config), self.kv_dtype)

    # ---- the jitted step -----------------------------------------------------------------------
    def _forward_impl(self, params, state, tokens, slots, start, n_new, *, span: int, all_logits: bool,
                      kernels: Kernels):
        logits, state = self.arch.forward(params, state, tokens, slots, start, n_new, cfg=self.config,
                                          span=span, all_logits=all_logits, kernels=kernels)
        last = last_valid(logits, n_new) if all_logits else logits
        return last, (logits if all_logits else None), state

    def _mixed_impl(self, params, state, prefill, decode, order, *, span: int, kernels: Kernels):
        logits, state = self.arch.forward_groups(params, state, (prefill, decode), cfg=self.config, span=span,
                                                 kernels=kernels)
        return logits[order], None, state

    def step_begin(self, state: Any, tokens: Sequence[Sequence[int]], slots: Sequence[int],
                   starts: Sequence[int], params: Sequence[SamplingParams | None] | None = None,
                   recent: Sequence[Sequence[int]] | None = None, steps: Sequence[int] | None = None,
                   want_logits: bool = False, all_logits: bool = False) -> tuple[StepHandle, Any]:
        """Dispatch one forward + sample over len(tokens) rows. Returns (handle, new state).

        Row b feeds tokens[b] at positions starts[b].. into cache slot slots[b]. The old state is
        donated: the caller must use only the returned one.
        """
        self._check_live()
        plan = self._plan(tokens, slots, starts, all_logits)
        self._note_shape(plan.key)
        last, every, state = plan.fn(self.params, state, *plan.args, **plan.kwargs)
        self._track(state)
        # The forward is running now: the sampler's per-row inputs are built while it computes
        # (1.4 ms of host work at 8 rows that used to delay its start), then its call queues behind it.
        rows, rec, stp = self._sampling_rows(plan.rows, params, recent, steps, len(tokens))
        ids = self._sample(last, rows, rec, stp)
        logits = every if all_logits else (last if want_logits else None)
        return StepHandle(ids=ids, logits=logits, n_rows=len(tokens)), state

    def _plan(self, tokens: Sequence[Sequence[int]], slots: Sequence[int], starts: Sequence[int],
              all_logits: bool) -> "_Plan":
        """Which compiled forward a step runs and its padded host inputs (rows, tokens, span buckets)."""
        n = len(tokens)
        if n == 0:
            raise ValueError("step needs at least one row")
        lens = [len(t) for t in tokens]
        if min(lens) < 1:
            raise ValueError("every row needs at least one token")
        long_rows = [b for b in range(n) if lens[b] > 1]
        if self.supports_mixed and len(long_rows) == 1 and 1 < n <= self.mixed_rows + 1 and not all_logits:
            return self._plan_mixed(tokens, slots, starts, long_rows[0])
        B = _bucket(n, self.row_buckets)
        T = 1 if max(lens) == 1 else _bucket(max(lens), self.chunk_buckets)
        span = self._span_for(max(s + T for s in starts))
        tok = np.zeros((B, T), np.int32)
        sl = np.full((B,), self.scratch_slot, np.int32)
        st = np.zeros((B,), np.int32)
        nn = np.ones((B,), np.int32)
        for b in range(n):
            tok[b, : lens[b]] = tokens[b]
            sl[b] = slots[b]
            st[b] = starts[b]
            nn[b] = lens[b]
        return _Plan(self._forward, (tok, sl, st, nn), dict(span=span, all_logits=all_logits, kernels=self.kernels),
                     (B, T, span, all_logits), B)

    def _plan_mixed(self, tokens: Sequence[Sequence[int]], slots: Sequence[int], starts: Sequence[int],
                    p: int) -> "_Plan":
        """Row p ([1, T] prefill group) and every other row ([mixed_rows, 1] decode group) in one forward.

        The forward returns its logits in the caller's row order (then the padding rows), so the
        sampler and the handle see rows exactly as a plain step would.
        """
        n, D = len(tokens), self.mixed_rows
        T = _bucket(len(tokens[p]), self.chunk_buckets)
        span = self._span_for(max(starts[p] + T, *(starts[b] + 1 for b in range(n) if b != p)))
        ptok = np.zeros((1, T), np.int32)
        ptok[0, : len(tokens[p])] = tokens[p]
        prefill = (ptok, np.array([slots[p]], np.int32), np.array([starts[p]], np.int32),
                   np.array([len(tokens[p])], np.int32))
        dtok = np.zeros((D, 1), np.int32)
        dsl = np.full((D,), self.scratch_slot, np.int32)
        dst = np.zeros((D,), np.int32)
        order = np.zeros((D + 1,), np.int32)  # caller row b -> its row in the forward's output
        d = 0
        for b in range(n):
            if b == p:
                continue
            dtok[d, 0], dsl[d], dst[d] = tokens[b][0], slots[b], starts[b]
            order[b] = 1 + d
            d += 1
        order[n:] = np.arange(1 + d, D + 1)  # padding rows after the caller's
        decode = (dtok, dsl, dst, np.ones((D,), np.int32))
        return _Plan(self._forward_mixed, (prefill, decode, order), dict(span=span, kernels=self.kernels),
                     ("mixed", T, span), D + 1)

    def _span_for(self, need: int) -> int:
        if need > self.capacity:
            raise ValueError(f"sequence position {need} exceeds the cache capacity {self.capacity}")
        return _bucket(need, self.span_buckets)

    @staticmethod
    def _sampling_rows(B: int, params: Sequence[SamplingParams | None] | None,
                       recent: Sequence[Sequence[int]] | None, steps: Sequence[int] | None,
                       n: int) -> tuple[Any, np.ndarray, np.ndarray]:
        """Per-row sampler inputs for n caller rows padded to B: parameters, penalty window, step index."""
        rec = np.full((B, PENALTY_WINDOW), -1, np.int32)
        stp = np.zeros((B,), np.int32)
        for b in range(n):
            if recent is not None and recent[b]:
                r = list(recent[b])[-PENALTY_WINDOW:]
                rec[b, PENALTY_WINDOW - len(r):] = r
            if steps is not None:
                stp[b] = steps[b]
        plist = list(params) if params is not None else [None] * n
        return make_rows_np(plist + [None] * (B - n), B), rec, stp  # host arrays: the call transfers them

    @staticmethod
    def step_poll(handle: StepHandle) -> np.ndarray | None:
        """Sampled ids [n_rows] if the step has finished, else None (never blocks)."""
        if not handle.ready():
            return None
        return np.asarray(handle.ids)[: handle.n_rows]

    @staticmethod
    def step_wait(handle: StepHandle) -> np.ndarray:
        return np.asarray(handle.ids)[: handle.n_rows]

    # The seed's names for the async seam (pn_forward_step_begin / pn_forward_step_poll).
    forward_step_begin = step_begin
    forward_step_poll = step_poll

    def _note_shape(self, key: tuple) -> None:
        with self._keys_lock:
            self._compiled_keys.add(key)

    # ---- warm-up -------------------------------------------------------------------------------
    def warmup(self, state: Any, decode: bool = True, prefill: bool = True, mixed: bool = True) -> Any:
        """Compile every step shape the scheduler can ask for; returns the state.

        Shapes are (rows, tokens of the first row, tokens of the others, span): decode (b, 1, 1, sp),
        prefill (1, t, -, sp), and mixed (2, t, 1, sp): one prefill row riding with a decode row.
        """
        shapes = []
        if decode:
            shapes += [(b, 1, 1, sp) for b in self.row_buckets for sp in self.span_buckets]
        if prefill:
            shapes += [(1, t, 1, sp) for t in self.chunk_buckets for sp in self.span_buckets if sp >= t]
        if mixed and self.supports_mixed:
            shapes += [(2, t, 1, sp) for t in self.chunk_buckets if t > 1 for sp in self.span_buckets if sp >= t]
        steps = []
        for b, t, t_rest, sp in shapes:
            start = max(0, sp - t) if sp != self.span_buckets[0] else 0
            start = min(start, self.capacity - t)
            steps.append(([[0] * t] + [[0] * t_rest for _ in range(b - 1)], [self.scratch_slot] * b, [start] * b))
        # XLA compiles with the GIL released: compile ahead of time on every core, then run each shape
        # once (the run reuses the compiled program; it only compiles the small sampler programs).
        plans = [self._plan(toks, slots, starts, False) for toks, slots, starts in steps]
        osthread.map_threads(lambda pl: pl.fn.lower(self.params, state, *pl.args, **pl.kwargs).compile(), plans,
                             os.cpu_count() or 1, name=f"compile-{self.name}")
        for toks, slots, starts in steps:
            h, state = self.step_begin(state, toks, slots, starts)
            self.step_wait(h)
        return state

    # ---- conveniences built on the step -------------------------------------------------------
    def prefill(self, state: Any, slot: int, ids: Sequence[int], start: int = 0,
                params: SamplingParams | None = None, recent: Sequence[int] | None = None,
                step: int = 0, chunk: int | None = None, want_logits: bool = False,
                all_logits: bool = False) -> tuple[int, np.ndarray | None, Any]:
        """Feed `ids` into `slot` from position `start`, in chunks; returns (sampled next id, logits, state).

        logits are the last position's [V] (want_logits) or every position's [len(ids), V] (all_logits).
        """
        chunk = chunk or self.chunk
        ids = list(ids)
        if not ids:
            raise ValueError("prefill needs at least one token")
        hist = list(recent or [])
        out_logits = []
        pos = start
        next_id = -1
        last_logits = None
        for i in range(0, len(ids), chunk):
            part = ids[i: i + chunk]
            final = i + chunk >= len(ids)
            hist_now = (hist + ids[: i + len(part)])[-PENALTY_WINDOW:]
            h, state = self.step_begin(state, [part], [slot], [pos], [params], [hist_now], [step],
                                       want_logits=want_logits and final, all_logits=all_logits)
            if all_logits:
                out_logits.append(np.asarray(h.logits)[0, : len(part)])
            elif final and want_logits:
                last_logits = np.asarray(h.logits)[0]
            if final:
                next_id = int(self.step_wait(h)[0])
            pos += len(part)
        if all_logits:
            return next_id, np.concatenate(out_logits, axis=0), state
        return next_id, last_logits, state

    def logits(self, ids: Sequence[int], chunk: int | None = None) -> np.ndarray:
        """Teacher-forced logits [len(ids), V] as float32 (for comparison with other engines)."""
        state = self.new_state()
        _, lg, _ = self.prefill(state, 0, ids, chunk=chunk, all_logits=True)
        return lg

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams | None = None, max_tokens: int = 128,
                 stop_ids: Sequence[int] | None = None, state: Any = None, slot: int = 0,
                 cancel: Any = None, chunk: int | None = None,
                 decode_from: int | None = None) -> Iterator[int]:
        """Single-sequence generation (the single-user path): yields token ids as they are sampled.

        `decode_from` prefills only prompt_ids[:decode_from] in chunks and feeds the rest one token
        at a time (a test hook: chunked prefill and step-by-step decode must agree).
        """
        params = params or SamplingParams(temperature=0.0)
        if params.seed is None:
            params = dataclasses.replace(params, seed=params.resolved_seed())
        stop = set(self.tokenizer.eot_ids if stop_ids is None and self.tokenizer else (stop_ids or ()))
        prompt = list(prompt_ids)
        if len(prompt) + max_tokens > self.max_seq:
            max_tokens = self.max_seq - len(prompt)
            if max_tokens <= 0:
                raise ValueError(f"prompt of {len(prompt)} tokens does not fit max_seq {self.max_seq}")
        state = state if state is not None else self.new_state()
        cut = len(prompt) if decode_from is None else max(1, decode_from)
        nxt, _, state = self.prefill(state, slot, prompt[:cut], params=params, chunk=chunk)
        hist = prompt[:cut]
        for tok in prompt[cut:]:
            h, state = self.step_begin(state, [[tok]], [slot], [len(hist)], [params], [hist + [tok]], [0])
            hist.append(tok)
            nxt = int(self.step_wait(h)[0])
        pos = len(hist)
        for i in range(max_tokens):
            yield nxt
            if nxt in stop or i + 1 >= max_tokens or (cancel is not None and cancel.is_set()):
                return
            hist.append(nxt)
            h, state = self.step_begin(state, [[nxt]], [slot], [pos], [params], [hist], [i + 1])
            pos += 1
            nxt = int(self.step_wait(h)[0])

    def compiled_shapes(self) -> set[tuple]:
        with self._keys_lock:
            return set(self._compiled_keys)


def _delete_arrays(tree: Any) -> None:
    """Delete every JAX array in `tree` (its device buffers are freed now, not at the next gc); other
    leaves (host numpy copies, None) are left to Python."""
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array) and not leaf.is_deleted():
            try:
                leaf.delete()
            except Exception:  # already donated or freed by its backend: nothing left to give back
                pass


# ---- loading -----------------------------------------------------------------------------------
def _arch_module(cfg: ModelConfig, path: Path):
    from .jax_models import registry
    mod = registry.module_for(cfg.arch)
    if mod is None:
        raise ModelLoadError(path, f"architecture {cfg.arch!r} is recognised but not implemented yet")
    return mod


def _resolve_dtype(opt: str, device: Any):
    if opt == "auto":
        return jnp.float32 if device.platform == "cpu" else jnp.bfloat16
    try:
        return jnp.dtype(opt).type
    except TypeError as exc:
        raise ValueError(f"unknown dtype {opt!r}") from exc


def native_wanted(opts: LoadOptions) -> bool:
    """Whether a single-die CPU f32 load asks for pantheon.native's kernels."""
    return load_settings().native_matmul if opts.native_matmul is None else bool(opts.native_matmul)


def choose_kernels(opts: LoadOptions, devices: Sequence[Any], dtype: Any) -> Kernels:
    """The one decision of which kernels a model's steps use (made once, at load).

    The native CPU kernels need the whole model on one CPU die computing in f32, the library
    built, and the option (PANTHEON_NATIVE_MATMUL / LoadOptions.native_matmul) on; everything else
    runs XLA's forms, which expand the weights' blocks inside the step in `dtype`.
    """
    compute = jnp.dtype(dtype).name
    if len(devices) != 1 or devices[0].platform != "cpu" or dtype != jnp.float32 or not native_wanted(opts):
        return Kernels(compute=compute)
    built = native.enable(Path(opts.native_dir) if opts.native_dir else load_settings().home / "native")
    return Kernels(matmul=built, attention=built, compute=compute)


def resolve_kv_dtype(opts: LoadOptions, device: Any) -> Any:  # device: a jax device or a platform name
    """The KV cache's dtype: LoadOptions.kv_dtype, else PANTHEON_KV_DTYPE; "auto" is float16 on CPU
    (what llama.cpp keeps: half the bytes, the native attention widens it with F16C) and bfloat16
    elsewhere."""
    name = getattr(opts, "kv_dtype", None) or load_settings().kv_dtype
    if name == "auto":
        platform = device if isinstance(device, str) else device.platform
        name = "float16" if platform == "cpu" else "bfloat16"
    if name not in KV_DTYPES:
        raise ValueError(f"KV dtype {name!r} is not one of {', '.join(KV_DTYPES)}")
    return jnp.dtype(name)


KV_DTYPES = ("float32", "float16", "bfloat16")


def kv_bytes(f32_bytes: int, kv_dtype: Any) -> int:
    """Bytes of a cache sized `f32_bytes` at 4 bytes an element, kept in `kv_dtype` instead."""
    return int(f32_bytes) * jnp.dtype(kv_dtype).itemsize // 4


class _MatrixSource:
    """A tensor source that can hand out matrices as weights: GGUF's TensorSource does (views of the
    file); an HF checkpoint's safetensors source gives float arrays, wrapped as dense weights."""

    def __init__(self, src: Any):
        self._src = src

    @classmethod
    def of(cls, src: Any) -> Any:
        return src if hasattr(src, "matrix") else cls(src)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._src, name)

    def matrix(self, name: str, shape: tuple[int, ...] | None = None) -> weights.QuantWeight:
        return weights.dense(self._src.get(name, shape))


def load(path: str | Path, opts: LoadOptions | None = None) -> Model:
    return load_on(path, opts, None)


def load_on(path: str | Path, opts: LoadOptions | None = None, dies: Sequence[int] | None = None) -> Model:
    """Load a GGUF (or HF safetensors dir) onto the given JAX devices (default: the first device).

    Any failure raises ModelLoadError naming the file; nothing stays allocated on the device. This
    is the one place every exception of the file-reading and building stage (gguf's reader, the
    metadata, the tokenizer, the chat template, the arch's parameter builder, the upload) is turned
    into one: a damaged or lying file is the file's problem (500 `model_load_error`), never an
    `internal_error`, whatever library happened to trip over it. The checks that know what is wrong
    (gguf_meta, gguf_loader, tokenizer) raise ModelLoadError themselves with a specific message.
    """
    opts = opts or LoadOptions()
    compile_guard.install()
    all_devices = jax.devices()
    if dies:
        bad = [d for d in dies if d < 0 or d >= len(all_devices)]
        if bad:
            raise ModelLoadError(path, f"no such die(s) {bad}; this host has {len(all_devices)}")
        devices = [all_devices[d] for d in dies]
    else:
        devices = [all_devices[0]]
    p = Path(path).expanduser()
    stage = ["reading the file"]  # what _load_files is doing, for the message of an unexpected failure
    try:
        return _load_files(p, opts, devices, stage)
    except Exception as exc:
        # The frames of a failed build hold host copies of the weights (and maybe device arrays):
        # clear them so the exception, logged and kept by a caller for a while, holds no memory.
        memory.clear_exception_frames(exc)
        if isinstance(exc, ModelLoadError):
            raise
        raise ModelLoadError(p, f"{stage[0]} failed: {type(exc).__name__}: {exc}") from exc


def _load_files(p: Path, opts: LoadOptions, devices: list[Any], stage: list[str]) -> Model:
    """load_on's body: read and check the file, build and upload the weights, then the tokenizer and
    template (a failure there deletes the uploaded weights at once). `stage[0]` says which step runs."""
    from . import hf_loader
    f: GGUFFile | hf_loader.HFCheckpoint
    if hf_loader.is_hf_checkpoint(p, opts.config_path):  # safetensors directory / file + config.json
        f = hf_loader.open_hf(p, opts.config_path)
    else:
        f = open_gguf(p)
    cfg = f.config
    arch = _arch_module(cfg, p)
    dtype = _resolve_dtype(opts.dtype, devices[0])
    kernels = choose_kernels(opts, devices, dtype)
    stage[0] = "building parameters"
    try:  # matrices stay views of the mapped file: nothing is widened here
        host_params = arch.load_params(_MatrixSource.of(f.tensors), cfg)
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(p, f"failed to build parameters: {type(exc).__name__}: {exc}") from exc
    if len(devices) == 1 and capabilities_of(arch).fused_projections:  # sharding splits q/k/v by their own heads
        host_params = arch.fuse_projections(host_params)
    host_params = weights.stamp(host_params, kernels)
    weight_bytes = weights.tree_bytes(host_params)
    stage[0] = "placing the weights on the device"
    if len(devices) > 1:  # tensor-parallel over the dies: each leaf goes straight into its shards
        from .sharding import ShardPlan
        params = ShardPlan(devices, cfg).put_params(host_params)
    else:
        params = weights.place(host_params, lambda _path, _leaf: devices[0])
    del host_params
    name = opts.name or p.stem
    try:
        stage[0] = "building the tokenizer and chat template"
        tokenizer, template = _tokenizer_and_template(p, f.meta)
        if "hf.config" not in f.meta and tokenizer.vocab_size > cfg.vocab:
            raise ModelLoadError(p, f"the tokenizer has {tokenizer.vocab_size} tokens but token_embd.weight has "
                                    f"{cfg.vocab} rows: ids past the embedding would read nothing")
        stage[0] = "building the model"
        return Model(p, name, cfg, f.meta, arch, params, tokenizer, template, opts, devices, dtype, weight_bytes,
                     kernels=kernels, kv_dtype=resolve_kv_dtype(opts, devices[0]))
    except BaseException:
        _delete_arrays(params)  # nothing may stay on the device when the load fails
        raise


def _tokenizer_and_template(path: Path, meta: dict[str, Any]):
    from .chat_template import ChatTemplate
    from .tokenizer import Tokenizer
    if "hf.config" in meta:  # an HF checkpoint: tokenizer.json + tokenizer_config.json
        from .hf_loader import tokenizer_and_template
        return tokenizer_and_template(path, meta)
    if "tokenizer.ggml.tokens" not in meta:
        raise ModelLoadError(path, "the file has no tokenizer (tokenizer.ggml.tokens missing)")
    tok = Tokenizer.from_gguf_metadata(meta, str(path))
    source = meta.get("tokenizer.chat_template")
    if source is not None and not isinstance(source, str):
        raise ModelLoadError(path, f"tokenizer.chat_template is {type(source).__name__}, not a string")
    tmpl = ChatTemplate(source, tok.bos_token, tok.eos_token)
    return tok, tmpl
