"""The engine seam: load a model onto JAX devices and run its verbs over a donated decode state.

`load(path, opts)` / `load_on(path, opts, dies)` return a `Model`. A model owns its params and its
compiled programs; it does not own sequences. A caller (the scheduler) owns a `DecodeState` from
`new_state()` -- the architecture's cache plus a per-slot table (pantheon.runtime.decode_state) -- and drives
it with three verbs, in the manner of JetStream's insert / generate:

    insert(state, SlotInsert)   a request's data into its slot, once (knobs, seed, stop ids, budget)
    step(state, StepPlan)       one forward + sample over a prompt chunk and the decoding slots;
                                returns at once (JAX async dispatch) with a handle whose packed
                                [rows, 2] (id, flag) output is already being copied to the host;
                                its two phases are verbs too: forward(state, plan), then
                                sample(state, forward, mask) (the grammar masks go between them)
    release(state, slot)        take a slot back early (cancel)

A step's host input is only which slot feeds which prompt chunk and which slots decode: decode rows
read their token and position from the state, and the sampler, ring, budget and stop checks run
inside the step. Only ids and flags come back.

Shapes are bucketed so the number of compiled programs is small and known at load: decode rows in
(1, 2, 4, 8), prompt chunks of 32 and quarters of prefill_chunk tokens, attention spans doubling
from 128 up to max_seq (the top bucket also covers the chunk's padding slack). A chunk and decode
rows share one "mixed" program (one per chunk bucket and span) when the architecture declares mixed
steps. The cache has one extra "scratch" slot that padding and dead rows write to.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import logging
import os
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from pantheon.runtime import compile_guard, decode_state, exec_store, heap
from pantheon.ops import native, weights
from pantheon import osthread
from pantheon.config import load_settings
from pantheon.errors import ModelLoadError, clear_exception_frames
from pantheon.formats.gguf_loader import GGUFFile, ModelConfig, open_gguf
from pantheon.runtime.decode_state import DecodeState
from pantheon.contract import MAX_SPEC_K
from pantheon.types import GREEDY, MAX_TOP_LOGPROBS, ModelCard, ModelGeometry
from pantheon.jax_models.common import last_valid
from pantheon.jax_models.registry import capabilities_of
from pantheon.ops.weights import XLA, Kernels

log = logging.getLogger(__name__)


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
    native_matmul: bool | None = None  # on one CPU die, use pantheon.ops.native's kernels (None: PANTHEON_NATIVE_MATMUL)
    native_dot: str | None = None  # their quantized products: "exact" | "int8" (None: PANTHEON_NATIVE_DOT)
    kv_dtype: str | None = None  # KV cache dtype: float32 | float16 | bfloat16 | auto (None: PANTHEON_KV_DTYPE)
    native_dir: str | None = None  # where the kernels' library is cached (default $PANTHEON_HOME/native)
    # where compiled step programs are kept across starts (pantheon.runtime.exec_store): None is
    # $PANTHEON_HOME/executables when PANTHEON_EXEC_STORE is on; "" keeps none
    store_dir: str | None = None
    mmproj: str | None = None  # a vision projector GGUF (llama.cpp's mmproj): the model takes images
    # the most draft tokens a verify step checks per slot (speculative decoding); 0: no verify
    # programs. None: PANTHEON_SPEC_K
    spec_k: int | None = None


@dataclass(frozen=True)
class Geometry:
    """How long a sequence may grow and how the cache is sized for it: one rule, read by the engine
    (its cache, buckets and limits) and by the load estimate (pantheon.serving.dies), so the bytes a
    load is admitted for are the bytes the engine then allocates."""

    max_seq: int  # the longest sequence: LoadOptions.max_seq, capped by the model's context length
    chunk: int  # prefill chunk: at most max_seq
    capacity: int  # cache positions per slot: max_seq + chunk, so a padded chunk never writes past the end


def geometry(cfg: ModelConfig, opts: LoadOptions) -> Geometry:
    """The sequence geometry of a model of config `cfg` loaded with `opts`."""
    max_seq = min(opts.max_seq, cfg.context_length) if cfg.context_length else opts.max_seq
    chunk = max(1, min(opts.prefill_chunk, max_seq))
    return Geometry(max_seq=max_seq, chunk=chunk, capacity=max_seq + chunk)


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


FRESH_EMBED_ROWS = 64  # short embeddings inputs one slot-free forward takes at most (`Model.embed_fresh`)


def _bucket(n: int, buckets: Sequence[int]) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


@dataclass(frozen=True)
class Chunk:
    """A prompt chunk a step feeds into one slot: `tokens` at positions start.. (start is the host's own
    count, used to pick the attention-span bucket; the device reads the slot's position itself)."""

    slot: int
    tokens: tuple[int, ...]
    start: int
    final: bool  # the prompt's last chunk: its row samples the request's first token
    # Image rows (vision models): a negative entry of `tokens` marks a position whose input is row i of
    # `embd` [len(tokens), H] instead of a token embedding; a run of one negative value is one image
    embd: Any = None


@dataclass(frozen=True)
class StepPlan:
    """One step's host input: which slot feeds which prompt chunk, and which slots decode.

    No token, position or sampling parameter of a decode row crosses here: each is in the decode
    state. `reach` bounds the positions the decode rows write (the highest position + 1), only to pick
    the span bucket; a bound that is too high costs a wider span, never a wrong result.
    """

    chunk: Chunk | None = None
    decode: tuple[int, ...] = ()
    reach: int = 0
    # Speculative decoding: per decode slot (in `decode`'s order) the draft tokens to verify after its
    # last token (empty: the slot decodes one token as usual). Any draft makes the step a "verify"
    # step (no prompt chunk): slot d runs as K + 1 one-token rows and may emit up to len(draft) + 1
    # tokens (decode_state.verify_and_advance). `reach` then bounds the position after the drafts.
    drafts: tuple[tuple[int, ...], ...] = ()


@struct.dataclass
class StepHandle:
    """A dispatched step's output (a typed pytree): the packed [rows, 2] int32 (id, flag), already
    being copied to the host asynchronously, the logprobs arrays (decode_state.Sampled) and the
    logits when asked for."""

    packed: jax.Array
    logits: jax.Array | None
    n_rows: int = struct.field(pytree_node=False)  # the plan's rows (the rest is padding)
    logprobs: jax.Array | None = None  # f32[R, 1 + MAX_TOP_LOGPROBS]
    top_ids: jax.Array | None = None  # i32[R, MAX_TOP_LOGPROBS]

    def ready(self) -> bool:
        return self.packed.is_ready()


@struct.dataclass
class Forward:
    """A dispatched step's first phase (`Model.forward`): each row's logits and the rows' slot
    bookkeeping (decode_state.StepRows) on the device, for `Model.sample`."""

    logits: jax.Array
    rows: Any  # decode_state.StepRows
    n_rows: int = struct.field(pytree_node=False)  # the plan's rows
    padded_rows: int = struct.field(pytree_node=False)  # the forward's rows (the bucket's, padding included)
    aot: bool = struct.field(pytree_node=False, default=False)  # run by a stored program: so is the sampler


@dataclass
class _Plan:
    """One step's compiled forward, its arguments after (params, cache[, table]), and its bucket key."""

    fn: Any
    args: tuple
    kwargs: dict[str, Any]
    key: tuple  # the shape bucket, for compiled_shapes()
    rows: int
    program: Any = None  # the ahead-of-time compiled program of `key`, when warm-up made one (else `fn` jits)


class Model:
    """A loaded model: its device params and the compiled verbs (`insert`, `step`, `release`).

    A model does not own sequences: callers own a `DecodeState` from `new_state()` and hand it to every
    verb (it is donated: only the returned state may be used). The card (`self.card`) is the JAX-free
    description the web layer reads: config, tokenizer, chat template and limits.
    """

    def __init__(self, path: Path, name: str, cfg: ModelConfig, arch: Any,
                 params: Any, tokenizer: Any, template: Any, opts: LoadOptions, devices: list[Any],
                 compute_dtype: Any, weight_bytes: int, kernels: Kernels = XLA, kv_dtype: Any = jnp.float32,
                 vision: Any = None, vision_params: Any = None, vision_card: Any = None):
        self.name = name
        self.vision = vision  # pantheon.formats.mmproj.VisionConfig, or None (text only)
        self.vision_params = vision_params
        self.config = cfg
        self.arch = arch
        self.caps = capabilities_of(arch)
        self.params = params
        self.opts = opts
        self.devices = devices
        self.dtype = compute_dtype
        self.weight_bytes = weight_bytes
        self.kernels = kernels  # which kernels the steps use (static: part of every jit cache key)
        self.native_matmul = kernels.matmul  # for health and metrics
        self.kv_dtype = jnp.dtype(kv_dtype)  # the KV cache's element type (PANTHEON_KV_DTYPE)
        self.n_slots = opts.n_slots
        geo = geometry(cfg, opts)
        self.max_seq, self.chunk, self.capacity = geo.max_seq, geo.chunk, geo.capacity
        self.scratch_slot = self.n_slots
        self.card = ModelCard(name=name, path=str(path), arch=cfg.arch, context_length=self.max_seq,
                              n_slots=self.n_slots, tokenizer=tokenizer, template=template,
                              native_kernels=bool(kernels.matmul), vision=vision_card)
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
        if arch is not None and hasattr(arch, "state_bytes_per_token") and arch.state_bytes_per_token(cfg) == 0:
            self.span_buckets = (self.capacity,)  # nothing attended (RWKV): a span would only add programs
        # What admission reads (pantheon.serving.admission), published once as a value on the card.
        self.card = dataclasses.replace(self.card, geometry=self._published_geometry())
        # Mixed steps: one prefill row of T tokens plus up to n_slots - 1 decode rows in one forward
        # (the architecture's forward_groups), so a new request's prompt does not stall the decoders.
        # The decode group is always padded to n_slots - 1 rows: one program per (T, span), not four.
        self.mixed_rows = self.n_slots - 1
        self.supports_mixed = self.caps.mixed_steps and self.mixed_rows >= 1
        # Verify steps (speculative decoding): up to VERIFY_MAX_ROWS decoding slots, each with K + 1
        # one-token rows, K one of `verify_ks`. Only where a slot's state can be rolled back by
        # rewinding its position -- attention-only models: a recurrent state (qwen35, rwkv7) would
        # have absorbed the rejected drafts -- and text-only models (the image path jits its steps).
        spec_k = load_settings().spec_k if opts.spec_k is None else int(opts.spec_k)
        spec_k = max(0, min(spec_k, self.chunk, MAX_SPEC_K))
        self.supports_verify = spec_k > 0 and not self.caps.recurrent_state and vision is None
        # two K buckets, K and half of it: a slot whose acceptance dropped drafts few tokens, and its
        # step should not compute K + 1 rows for them (on a CPU every row costs its share of compute)
        self.verify_ks = tuple(sorted({-(-spec_k // 2), spec_k})) if self.supports_verify else ()
        self.verify_rows = tuple(b for b in self.row_buckets if b <= VERIFY_MAX_ROWS) if self.supports_verify else ()
        # Two programs per step: the forward (one per (kind, rows, tokens, span) bucket) and the
        # sampler + slot update (one per rows bucket). Keeping the sampler out of the forward compiles
        # it a handful of times, not once per forward bucket. Several dies: one mesh over them, params
        # and state split tensor-parallel (pantheon.runtime.sharding); the step pins the state it returns to
        # the layout it took, so one program serves every step.
        self.shard_plan = None
        raw, serve = self._forward_impl, self._serve_impl
        if len(devices) > 1:
            from pantheon.runtime.sharding import ShardPlan
            self.shard_plan = ShardPlan(devices, cfg)
            raw, serve = self.shard_plan.wrap_forward(raw), self.shard_plan.wrap_forward(serve)
            self._sharded_init = self.shard_plan.state_initializer(
                lambda: self.arch.init_state(self.config, self.n_slots + 1, self.capacity, self.kv_dtype))
        self._forward = jax.jit(raw, static_argnames=("span", "all_logits", "kernels"), donate_argnums=(1,))
        self._serve = jax.jit(serve, static_argnames=("span", "kernels", "kind"), donate_argnums=(1,))
        max_seq, barrier = self.max_seq, self.shard_plan is None
        self._advance = jax.jit(
            lambda table, logits, rows, mask, masked: decode_state.sample_and_advance(
                table, logits, rows, mask, masked, max_seq, barrier),
            donate_argnums=(0,))
        self._accept = jax.jit(
            lambda table, logits, rows: decode_state.verify_and_advance(table, logits, rows, max_seq, barrier),
            donate_argnums=(0,))
        self._insert = jax.jit(decode_state.insert, donate_argnums=(0,))
        self._release = jax.jit(decode_state.release, donate_argnums=(0,))
        self._copy = jax.jit(decode_state.copy_slot, donate_argnums=(0,))
        # A recurrent slot's state at a prompt chunk's end (prefix snapshots, pantheon.scheduler.snapshots):
        # `_snap` copies one slot's recurrent parts out (a new buffer: the state is not donated, the next
        # step donates it), `_restore` writes such a copy back into a slot (donated).
        self._snap = self._restore_snap = None
        if self.caps.recurrent_state:
            self._snap = jax.jit(lambda cache, slot: arch.snapshot_slot(cache, slot))
            self._restore_snap = jax.jit(lambda cache, slot, snap: arch.restore_slot(cache, slot, snap),
                                         donate_argnums=(0,))
        self._score = jax.jit(_score_rows, static_argnames=("k",))
        self.mask_words = -(-cfg.vocab // 32)  # a grammar mask row: one bit per token of the logits
        self._no_mask: dict[int, tuple[jax.Array, jax.Array]] = {}  # rows -> (all-ones mask, False) on the device
        embed = self._embed_impl if self.shard_plan is None else self.shard_plan.wrap_forward(self._embed_impl)
        self._embed = jax.jit(embed, static_argnames=("span", "kernels"), donate_argnums=(1,))
        # Short embeddings inputs need no slot: a forward over a cache made for the call (`embed_fresh`),
        # many rows at once. Single-device models only (a sharded cache has its own layout).
        self._embed_fresh = (jax.jit(self._embed_fresh_impl, static_argnames=("span", "kernels"))
                             if self.shard_plan is None else None)
        self.fresh_embed_rows = FRESH_EMBED_ROWS if self._embed_fresh is not None else 0
        if vision is not None:
            from pantheon.jax_models import siglip
            # One image per call, always resized to the same size: one program, compiled once.
            self._encode = jax.jit(lambda vp, px: siglip.encode(vp, px, vc=vision))
        self._compiled_keys: set[tuple] = set()
        # _keys_lock guards _compiled_keys, _programs, _planned and _routes (steps may come from several
        # threads; the compile-<model> thread adds programs while the driver routes steps).
        self._keys_lock = osthread.Lock()
        # Ahead-of-time programs (warm-up): program key -> a compiled executable, loaded from the
        # executable store or compiled here. ("serve", kind, D, T, span), ("advance", rows), ("insert",),
        # ("release",), ("copy",). Once warm-up has made the first ones, steps run only these: a bucket
        # not compiled yet is routed to the smallest larger one (_routes caches the choice).
        self._programs: dict[tuple, Any] = {}
        self._planned: list[tuple] = []  # every program warm-up will make, in order (progress: k of n)
        self._routes: dict[tuple, tuple | None] = {}
        self._aot = False  # steps run the ahead-of-time programs (set by warm-up, single-die models)
        self._warmer: osthread.OSThread | None = None  # the compile-<model> thread
        self._warm_stop = osthread.Event()
        self.program_seconds: dict[tuple, tuple[str, float]] = {}  # key -> ("loaded" | "compiled", seconds)
        self.compile_errors: list[str] = []  # programs the background compile could not make (logged)
        self.warm_failure: str | None = None  # the compile thread itself failed (logged; steps still run)
        self._store: exec_store.ExecStore | None | bool = None  # None: not opened yet; False: none
        self._abstract: tuple | None = None  # (params, cache, table) as ShapeDtypeStructs, for lowering
        # The leaves of every state this model handed out, held weakly, so free() can free the caches'
        # device buffers even if a caller still holds a state. id(leaf) -> leaf; an entry goes by
        # itself when its leaf dies (donated or dropped).
        self._states: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
        self.released = False
        # A draft model for speculative decoding (`--draft-model`), loaded beside this one with its slots
        # and sequence length; its scheduler drafts with it. Freed with this model.
        self.draft: Model | None = None

    @property
    def tokenizer(self) -> Any:
        """The card's tokenizer (host side: for tools and tests that tokenize beside the engine)."""
        return self.card.tokenizer

    # ---- state ---------------------------------------------------------------------------------
    def new_state(self) -> DecodeState:
        """Fresh state for n_slots sequences plus the scratch slot, on the model's device(s)."""
        self._check_live()
        table = decode_state.empty_table(self.n_slots + 1)
        if self.shard_plan is not None:  # the cache straight into its shards, the table on every die
            cache = self._sharded_init()
            table = jax.device_put(table, self.shard_plan.replicated)
        else:
            with jax.default_device(self.devices[0]):
                cache = self.arch.init_state(self.config, self.n_slots + 1, self.capacity, self.kv_dtype)
            # Committed to the device like every step's output, so the first step and later ones share
            # one compiled program (an uncommitted input is a different jit cache key).
            cache = jax.device_put(cache, self.devices[0])
            table = jax.device_put(table, self.devices[0])
        return self._track(DecodeState(cache=cache, slots=table))

    def _track(self, state: Any) -> Any:
        """Remember `state`'s leaves weakly (for free); returns it unchanged."""
        for leaf in jax.tree.leaves(state):
            self._states[id(leaf)] = leaf
        return state

    def _check_live(self) -> None:
        if self.released:
            raise RuntimeError(f"model {self.name!r} has been released (unloaded)")

    # ---- free ------------------------------------------------------------------------------------
    def free(self) -> None:
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
        draft, self.draft = self.draft, None
        if draft is not None:
            draft.free()
        self.stop_warmup()
        self.released = True
        _delete_arrays(list(self._states.values()))
        self._states.clear()
        params, self.params = self.params, None
        _delete_arrays(params)
        self._no_mask.clear()
        _delete_arrays(self.vision_params)
        self.vision_params = None
        for attr in ("_forward", "_serve", "_advance", "_accept", "_insert", "_release", "_copy", "_snap", "_restore_snap",
                     "_score", "_embed", "_encode"):
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
            self._programs.clear()
            self._routes.clear()
            self._aot = False

    def _published_geometry(self) -> ModelGeometry:
        """The value admission reads of this model (window, chunk, buckets, widths, cache bytes, dies):
        stated here, where the engine's own numbers are, so nothing above reaches into the Model."""
        cfg = self.config
        per_seq = getattr(self.arch, "state_bytes_per_sequence", None)
        return ModelGeometry(
            max_seq=self.max_seq, n_slots=self.n_slots, chunk=self.chunk, capacity=self.capacity,
            chunk_buckets=tuple(self.chunk_buckets), span_buckets=tuple(self.span_buckets),
            hidden=int(cfg.hidden), head_dim=int(cfg.head_dim), n_heads=int(cfg.n_heads),
            n_kv_heads=int(cfg.n_kv_heads), vocab=int(cfg.vocab),
            ffn=max(int(cfg.ffn), int(cfg.n_experts_used) * int(cfg.expert_ffn)) + int(cfg.n_experts),
            state_bytes_per_token=self.state_bytes_per_token(),
            state_bytes_per_sequence=int(per_seq(cfg)) if per_seq is not None else 0,
            dies=tuple(int(getattr(d, "id", i)) for i, d in enumerate(self.devices)),
            platform=str(getattr(self.devices[0], "platform", "cpu")) if self.devices else "cpu")

    def state_bytes_per_token(self) -> int:
        """What one more token of context costs in this model's cache (at its KV dtype)."""
        return kv_bytes(self.arch.state_bytes_per_token(self.config), self.kv_dtype)

    # ---- the verbs -------------------------------------------------------------------------------
    def insert(self, state: DecodeState, new: decode_state.SlotInsert) -> DecodeState:
        """Give a slot to a request: its sampling knobs and seed, stop ids, budget, the prompt's tail
        for penalties, and the position its reused prefix reaches. Written once; steps read it."""
        self._check_live()
        if not 0 <= int(new.slot) < self.n_slots:
            raise ValueError(f"slot {int(new.slot)} is not one of the model's {self.n_slots}")
        return state.replace(slots=self._track(self._program(("insert",), self._insert)(state.slots, new)))

    def release(self, state: DecodeState, slot: int) -> DecodeState:
        """Take a slot back before its request finished by itself (cancel): later rows for it, even
        ones already planned, compute into the scratch slot and change nothing."""
        self._check_live()
        return state.replace(slots=self._track(self._program(("release",), self._release)(state.slots, np.int32(slot))))

    def step(self, state: DecodeState, plan: StepPlan, want_logits: bool = False,
             mask: np.ndarray | None = None) -> tuple[StepHandle, DecodeState]:
        """Dispatch one whole step (returns at once): `forward`, then `sample` with `mask`; read its
        result with `read(handle)`. A caller that builds grammar masks while the forward runs calls the
        two phases itself (the scheduler does)."""
        fwd, state = self.forward(state, plan)
        return self.sample(state, fwd, mask, want_logits)

    def forward(self, state: DecodeState, plan: StepPlan) -> tuple[Forward, DecodeState]:
        """A step's first phase: dispatch its forward (returns at once). Rows: the plan's chunk first (if
        any), then one per decoding slot, in the plan's order. Hand the result to `sample`; between the
        two the host may build the step's grammar masks while the device runs the forward."""
        self._check_live()
        p = self._serve_plan(plan)
        self._note_shape(p.key)
        if p.program is not None:  # ahead-of-time: no tracing, no jit cache lookup, never a compile
            logits, rows, cache = p.program(self.params, state.cache, state.slots, *p.args)
        else:
            logits, rows, cache = p.fn(self.params, state.cache, state.slots, *p.args, **p.kwargs)
        n = (plan.chunk is not None) + len(plan.decode)
        if p.key[0] == "verify":
            n = len(plan.decode) * (p.key[2] + 1)
        return Forward(logits=logits, rows=rows, n_rows=n, padded_rows=p.rows, aot=p.program is not None), \
            self._track(state.replace(cache=cache))

    def sample(self, state: DecodeState, fwd: Forward, mask: np.ndarray | None = None,
               want_logits: bool = False) -> tuple[StepHandle, DecodeState]:
        """A step's second phase: dispatch the sampler and slot update over `fwd`'s logits (returns at
        once). Each row's packed output is (token id, flag) (decode_state's RUNNING / STOP / LENGTH / IDLE).

        `mask`: i32[rows, mask_words] (bit t of a row allows token t; an unconstrained row is all ones),
        or None for no mask (an all-ones mask kept on the device and a false switch)."""
        self._check_live()
        if isinstance(fwd.rows, decode_state.VerifyRows):
            if mask is not None:
                raise ValueError("a verify step takes no grammar mask (constrained slots do not speculate)")
            D, K = fwd.rows.drafts.shape
            accept = self._program(("accept", D, K), self._accept) if fwd.aot else self._accept
            out, table = accept(state.slots, fwd.logits, fwd.rows)
            return self._sampled(state, fwd, out, table, want_logits)
        if mask is None:
            m, masked = self._unmasked(fwd.padded_rows)
        else:
            m = np.full((fwd.padded_rows, self.mask_words), -1, np.int32)
            m[:fwd.n_rows] = mask
            m, masked = self._on_device(m), self._on_device(np.bool_(True))
        advance = self._program(("advance", fwd.padded_rows), self._advance) if fwd.aot else self._advance
        out, table = advance(state.slots, fwd.logits, fwd.rows, m, masked)
        return self._sampled(state, fwd, out, table, want_logits)

    def _sampled(self, state: DecodeState, fwd: Forward, out: decode_state.Sampled, table: Any,
                 want_logits: bool) -> tuple[StepHandle, DecodeState]:
        """The handle of a dispatched sampler (its outputs already on their way to the host)."""
        for x in (out.packed, out.logprobs, out.top_ids):
            if x.is_fully_addressable:  # (over several processes each reads its own replicated copy)
                x.copy_to_host_async()  # the host reads it after dispatching the next step
        state = self._track(DecodeState(cache=state.cache, slots=table))
        return StepHandle(packed=out.packed, logits=fwd.logits if want_logits else None, n_rows=fwd.n_rows,
                          logprobs=out.logprobs, top_ids=out.top_ids), state

    def _on_device(self, x: Any) -> Any:
        """A host input placed like the state (replicated over a mesh), so the program is reused."""
        return jax.device_put(x, self.shard_plan.replicated if self.shard_plan is not None else self.devices[0])

    def _unmasked(self, rows: int) -> tuple[jax.Array, jax.Array]:
        """The all-ones mask of a step of `rows` rows and the False switch, kept on the device (no
        transfer on a step without a grammar)."""
        if rows not in self._no_mask:
            self._no_mask[rows] = (self._on_device(np.full((rows, self.mask_words), -1, np.int32)),
                                   self._on_device(np.bool_(False)))
        return self._no_mask[rows]

    def copy_slot(self, state: DecodeState, src: int, dst: int) -> DecodeState:
        """Make slot `dst`'s cache a copy of slot `src`'s (all positions; recurrent state too): the
        choices of an n > 1 request start from one prefilled prompt. Insert `dst` afterwards."""
        self._check_live()
        for s in (src, dst):
            if not 0 <= s < self.n_slots:
                raise ValueError(f"slot {s} is not one of the model's {self.n_slots}")
        copy = self._program(("copy",), self._copy)
        return self._track(state.replace(cache=copy(state.cache, np.int32(src), np.int32(dst))))

    def snapshot(self, state: DecodeState, slot: int) -> Any:
        """A copy, on the device, of slot `slot`'s recurrent state as it stands after every step dispatched
        so far (a recurrent model only: `caps.recurrent_state`). Returns at once; `state` stays usable
        (it is read, not donated). The KV rows of the attention layers are not in it: they stay in the
        slot, position-indexed (the scheduler's snapshot pool says when they are still valid)."""
        self._check_live()
        if self._snap is None:
            raise ValueError(f"model {self.name!r} has no recurrent state to snapshot")
        return self._track(self._program(("snapshot",), self._snap)(state.cache, np.int32(slot)))

    def restore(self, state: DecodeState, slot: int, snap: Any) -> DecodeState:
        """Put `snap` (from `snapshot`) back as slot `slot`'s recurrent state: the slot then continues
        from the position the snapshot was taken at (its KV rows below it must hold the same prefix)."""
        self._check_live()
        if not 0 <= slot < self.n_slots:
            raise ValueError(f"slot {slot} is not one of the model's {self.n_slots}")
        restore = self._program(("restore",), self._restore_snap)
        return self._track(state.replace(cache=restore(state.cache, np.int32(slot), snap)))

    def snapshot_bytes(self) -> int:
        """Device bytes one `snapshot` holds (the f32 recurrent state of one sequence; 0: not recurrent)."""
        if not self.caps.recurrent_state:
            return 0
        return int(self.arch.state_bytes_per_sequence(self.config))

    def prompt_logprobs(self, state: DecodeState, tokens: Sequence[int], k: int
                        ) -> tuple[list[tuple[float, list[tuple[int, float]]] | None], DecodeState]:
        """Teacher-forced log probabilities of a prompt's own tokens, on the scratch slot.

        Entry i (i >= 1) is (logprob of tokens[i] given tokens[:i], the k most likely tokens there);
        entry 0 is None (nothing predicts the first token). Chunks of `chunk` tokens run the raw
        forward with every position's logits, reduced on the device: only [T, 1 + 2k] values come
        back. Costs one extra prefill of the prompt (legacy completions' echo + logprobs).
        """
        self._check_live()
        if not 0 <= k <= MAX_TOP_LOGPROBS:
            raise ValueError(f"k must be in 0..{MAX_TOP_LOGPROBS}")
        toks = list(tokens)
        out: list[tuple[float, list[tuple[int, float]]] | None] = [None]
        for start in range(0, max(len(toks) - 1, 0), self.chunk):
            part = toks[start:start + self.chunk]
            follow = toks[start + 1:start + 1 + len(part)]  # the token each position predicts
            plan = self._plan([part], [self.scratch_slot], [start], True)
            self._note_shape(plan.key)
            _, every, cache = plan.fn(self.params, state.cache, *plan.args, **plan.kwargs)
            state = self._track(state.replace(cache=cache))
            nxt = np.zeros((1, every.shape[1]), np.int32)  # padded to the chunk bucket
            nxt[0, :len(follow)] = follow
            lps, ids = self._score(every[:1], self._on_device(nxt), k=MAX_TOP_LOGPROBS)
            lps, ids = _to_host(lps)[0], _to_host(ids)[0]
            for j in range(len(follow)):
                out.append((float(lps[j, 0]), [(int(ids[j, i]), float(lps[j, 1 + i])) for i in range(k)]))
        return out, state

    @staticmethod
    def read(handle: StepHandle) -> np.ndarray:
        """The step's packed [rows, 2] (id, flag), waiting for the device if needed."""
        return _to_host(handle.packed)[: handle.n_rows]

    @staticmethod
    def read_logprobs(handle: StepHandle) -> tuple[np.ndarray, np.ndarray]:
        """The step's (f32[rows, 1 + MAX_TOP_LOGPROBS], i32[rows, MAX_TOP_LOGPROBS]): each row's
        sampled-token logprob, then the top logprobs and their ids (zeros for rows that asked none)."""
        assert handle.logprobs is not None and handle.top_ids is not None
        return _to_host(handle.logprobs)[: handle.n_rows], _to_host(handle.top_ids)[: handle.n_rows]

    @staticmethod
    def poll(handle: StepHandle) -> np.ndarray | None:
        """`read` if the step has finished, else None (never blocks)."""
        return Model.read(handle) if handle.ready() else None

    # ---- the jitted parts --------------------------------------------------------------------------
    def _forward_impl(self, params, cache, tokens, slots, start, n_new, override=None, *, span: int,
                      all_logits: bool, kernels: Kernels):
        if override is not None:
            logits, cache = self.arch.forward_images(params, cache, tokens, slots, start, n_new, override,
                                                     cfg=self.config, span=span, all_logits=all_logits,
                                                     kernels=kernels)
        else:
            logits, cache = self.arch.forward(params, cache, tokens, slots, start, n_new, cfg=self.config,
                                              span=span, all_logits=all_logits, kernels=kernels)
        last = last_valid(logits, n_new) if all_logits else logits
        return last, (logits if all_logits else None), cache

    def _serve_impl(self, params, cache, table, chunk_tok, chunk_meta, dec_slots, override=None, *, span: int,
                    kernels: Kernels, kind: str):
        """The forward of a serving step: decode rows take their token and position from `table`.

        chunk_tok i32[1, T], chunk_meta i32[3] = (slot, real tokens, final), dec_slots i32[D] (padding:
        the scratch slot). A decode row whose slot is inactive (finished or released while this step
        was being planned) is sent to the scratch slot, so it changes no cache and no recurrent state.
        Returns (logits [R, V] of each row's last token, StepRows, cache).

        kind "verify" (speculative decoding): chunk_tok is the drafts i32[D, K] and chunk_meta their
        counts i32[D]; slot d runs as K + 1 one-token rows (its last token, then each draft, at the
        positions after it), so each row is computed exactly as a plain decode row of that token at
        that position would be -- the rows' keys and values are all written before any row attends,
        and a row attends only up to its own position. Rows past a slot's drafts go to the scratch
        slot. Returns (logits [D * (K + 1), V], decode_state.VerifyRows, cache).
        """
        scratch = self.scratch_slot
        if kind == "verify":
            drafts, n_draft = chunk_tok, chunk_meta
            D, K = drafts.shape
            jj = jnp.arange(K + 1, dtype=jnp.int32)
            on = table.active[dec_slots] & (dec_slots != scratch)
            start = jnp.where(on, table.pos[dec_slots], 0)
            n_draft = jnp.where(on, jnp.clip(n_draft, 0, K), 0)
            tok = jnp.concatenate([table.last[dec_slots][:, None], drafts], axis=1)  # [D, K + 1]
            real = on[:, None] & (jj[None, :] <= n_draft[:, None])
            r_slot = jnp.where(real, dec_slots[:, None], scratch).reshape(-1)
            r_start = jnp.where(real, start[:, None] + jj[None, :], jj[None, :]).reshape(-1)
            r_tok = jnp.where(real, tok, 0).reshape(-1, 1)
            logits, cache = self.arch.forward(params, cache, r_tok, r_slot, r_start, jnp.ones_like(r_start),
                                              cfg=self.config, span=span, all_logits=False, kernels=kernels)
            rows = decode_state.VerifyRows(
                slot=jnp.where(on, dec_slots, scratch), on=on, start=start,
                drafts=jnp.where(jj[None, :K] < n_draft[:, None], drafts, -1), n_draft=n_draft)
            return logits, rows, cache
        groups, slot, emit, pos, live = [], [], [], [], []
        if kind in ("prefill", "mixed"):
            c_slot, c_n, c_final = chunk_meta[0:1], chunk_meta[1:2], chunk_meta[2:3]
            c_start = table.pos[c_slot]
            groups.append((chunk_tok, c_slot, c_start, c_n))
            slot.append(c_slot)
            emit.append(c_final > 0)
            pos.append(c_start + c_n)
            live.append(jnp.ones((1,), bool))
        if kind in ("decode", "mixed"):
            on = table.active[dec_slots] & (dec_slots != scratch)
            d_slot = jnp.where(on, dec_slots, scratch)
            d_start = jnp.where(on, table.pos[dec_slots], 0)
            d_tok = jnp.where(on, table.last[dec_slots], 0)[:, None]
            groups.append((d_tok, d_slot, d_start, jnp.ones_like(d_start)))
            slot.append(d_slot)
            emit.append(on)
            pos.append(d_start + 1)
            live.append(on)
        if kind == "mixed":
            logits, cache = self.arch.forward_groups(params, cache, tuple(groups), cfg=self.config, span=span,
                                                     kernels=kernels)
        else:
            if override is not None and kind == "prefill":
                logits, cache = self.arch.forward_images(params, cache, *groups[0], override, cfg=self.config,
                                                         span=span, all_logits=False, kernels=kernels)
            else:
                logits, cache = self.arch.forward(params, cache, *groups[0], cfg=self.config, span=span,
                                                  all_logits=False, kernels=kernels)
        rows = decode_state.StepRows(slot=jnp.concatenate(slot), emit=jnp.concatenate(emit),
                                     pos=jnp.concatenate(pos), live=jnp.concatenate(live))
        return logits, rows, cache

    def _serve_plan(self, plan: StepPlan) -> _Plan:
        """Which compiled forward a serving step runs and its padded host inputs: the plan's own bucket,
        or (ahead-of-time programs, some not compiled yet) the smallest compiled bucket that holds it."""
        exact = self._exact_bucket(plan)
        if not self._aot:
            return self._padded(plan, exact, None)
        route = self._route(exact, plan.chunk.start if plan.chunk is not None else 0)
        if route is None:  # nothing compiled holds it (warm-up did not plan this kind): the jit compiles
            return self._padded(plan, exact, None)
        with self._keys_lock:
            program = self._programs[("serve", *route)]
        return self._padded(plan, route, program)

    def _exact_bucket(self, plan: StepPlan) -> tuple:
        """The (kind, decode rows, chunk tokens, span) bucket of a serving step; checks the plan."""
        c, dec = plan.chunk, list(plan.decode)
        if c is None and not dec:
            raise ValueError("a step needs a prompt chunk or a decoding slot")
        if any(plan.drafts):
            return self._verify_bucket(plan)
        if c is not None and not c.tokens:
            raise ValueError("a prompt chunk needs at least one token")
        if c is not None and dec and not self.supports_mixed:
            raise ValueError(f"{self.config.arch} cannot mix a prompt chunk with decode rows in one step")
        if len(dec) > (self.mixed_rows if c is not None else self.n_slots):
            raise ValueError(f"{len(dec)} decode rows do not fit the step")
        reach = max(plan.reach, 1) if dec else 0
        T = 0
        if c is not None:
            # A one-token chunk (a prompt whose prefix is all cached) runs unpadded: padding it to the
            # smallest chunk bucket would cost ~30x its compute, right on the time to first token.
            T = 1 if len(c.tokens) == 1 else _bucket(len(c.tokens), self.chunk_buckets)
            reach = max(reach, c.start + T)
        span = self._span_for(reach)
        if c is not None and dec:
            kind, D = "mixed", self.mixed_rows
        elif c is not None:
            kind, D = "prefill", 0
        else:
            kind, D = "decode", _bucket(len(dec), self.row_buckets)
        return (kind, D, T, span)

    def _verify_bucket(self, plan: StepPlan) -> tuple:
        """The ("verify", D, K, span) bucket of a step with drafts; checks the plan."""
        if not self.supports_verify:
            raise ValueError(f"{self.name} does not verify drafts (recurrent state, an image model, or spec_k 0)")
        if plan.chunk is not None:
            raise ValueError("a verify step carries no prompt chunk")
        if len(plan.drafts) != len(plan.decode):
            raise ValueError("a verify step needs one draft (maybe empty) per decoding slot")
        if len(plan.decode) > self.verify_rows[-1]:
            raise ValueError(f"{len(plan.decode)} decoding slots do not fit a verify step (at most {self.verify_rows[-1]})")
        k = max(len(d) for d in plan.drafts)
        if k > self.verify_ks[-1]:
            raise ValueError(f"{k} drafts exceed the verify step's {self.verify_ks[-1]}")
        K = _bucket(k, self.verify_ks)
        reach = max(plan.reach, 1 + k)
        return ("verify", _bucket(len(plan.decode), self.verify_rows), K, self._span_for(reach))

    def verify_fits(self, n_decode: int, k: int, reach: int) -> bool:
        """Whether a verify step of `n_decode` slots with up to `k` drafts reaching `reach` can run now
        without compiling: the model verifies, the shape fits, and (ahead-of-time programs) a compiled
        bucket holds it -- the scheduler plans a plain decode step otherwise."""
        if not self.supports_verify or not 0 < n_decode <= self.verify_rows[-1] or not 0 < k <= self.verify_ks[-1]:
            return False
        if reach > self.capacity:
            return False
        if not self._aot:
            return True
        exact = ("verify", _bucket(n_decode, self.verify_rows), _bucket(k, self.verify_ks), self._span_for(reach))
        return self._route(exact, 0) is not None

    def _padded(self, plan: StepPlan, bucket: tuple, program: Any) -> _Plan:
        """The step's host inputs padded to `bucket` (its own or a larger one: extra chunk positions
        are zeros past the chunk's real count, extra decode rows are the scratch slot, a wider span
        only attends over more masked positions -- the same tokens come out)."""
        kind, D, T, span = bucket
        c, dec = plan.chunk, plan.decode
        if kind == "verify":  # (drafts [D, K], their counts [D], slots [D])
            drafts, counts = np.zeros((D, T), np.int32), np.zeros(D, np.int32)
            ds = np.full((D,), self.scratch_slot, np.int32)
            ds[: len(dec)] = dec
            for i, d in enumerate(plan.drafts):
                drafts[i, : len(d)] = d
                counts[i] = len(d)
            return _Plan(self._serve, (drafts, counts, ds), dict(span=span, kernels=self.kernels, kind=kind),
                         bucket, D * (T + 1), program)
        ctok, cmeta, ovr = np.zeros((1, max(T, 1)), np.int32), np.zeros(3, np.int32), None
        if c is not None:
            ctok, ovr = self._chunk_inputs([c.tokens], [c.embd], T)
            cmeta = np.array([c.slot, len(c.tokens), int(c.final)], np.int32)
        ds = np.full((max(D, 1),), self.scratch_slot, np.int32)
        ds[: len(dec)] = dec
        args = (ctok, cmeta, ds) if ovr is None or kind != "prefill" else (ctok, cmeta, ds, ovr)
        return _Plan(self._serve, args, dict(span=span, kernels=self.kernels, kind=kind),
                     bucket, (1 if c is not None else 0) + D, program)

    def _chunk_inputs(self, rows: Sequence[Sequence[int]], embds: Sequence[Any], T: int, B: int | None = None
                      ) -> tuple[np.ndarray, Any]:
        """Token ids [B, T] for the device and, for a vision model, the embedding override of the rows.

        A negative entry is an image position: its id on the device is 0 (never read: the override's
        row replaces its embedding), and each run of one negative value is one image's block, whose
        tokens see each other both ways where the model says so (Gemma 3). A text-only row of a vision
        model still passes an (all-off) override, so a prompt with and without images share a program.
        """
        B = B or len(rows)
        tok = np.zeros((B, T), np.int32)
        if self.vision is None:
            for b, r in enumerate(rows):
                if any(t < 0 for t in r):
                    raise ValueError("this model has no vision projector: a chunk cannot carry image rows")
                tok[b, : len(r)] = r
            return tok, None
        from pantheon.jax_models.common import EmbdOverride
        H = self.config.hidden
        emb = np.zeros((B, T, H), np.float32)
        use = np.zeros((B, T), bool)
        lo = np.zeros((B, T), np.int32)
        hi = np.zeros((B, T), np.int32)
        for b, (r, e) in enumerate(zip(rows, embds)):
            img = [t < 0 for t in r]
            tok[b, : len(r)] = [0 if m else t for t, m in zip(r, img)]
            if not any(img):
                continue
            if e is None or np.shape(e) != (len(r), H):
                raise ValueError(f"a chunk with image rows needs embd [{len(r)}, {H}], got "
                                 f"{None if e is None else np.shape(e)}")
            emb[b, : len(r)] = e
            use[b, : len(r)] = img
            if self.vision.bidirectional:
                i = 0
                while i < len(r):
                    j = i + 1
                    if img[i]:
                        while j < len(r) and r[j] == r[i]:
                            j += 1
                        lo[b, i:j], hi[b, i:j] = i, j
                    i = j
        return tok, EmbdOverride(rows=emb, use=use, lo=lo, hi=hi)

    # ---- images ----------------------------------------------------------------------------------
    def encode_images(self, pixels: Sequence[np.ndarray]) -> np.ndarray:
        """Preprocessed images ([3, S, S] f32 each) -> their embeddings [N, tokens_per_image, H] on the
        host, one image per call of one compiled program (every image has the same shape)."""
        self._check_live()
        if self.vision is None:
            raise ValueError(f"model {self.name!r} has no vision projector")
        S = self.vision.image_size
        out = []
        for px in pixels:
            px = np.asarray(px, np.float32)
            if px.shape != (3, S, S):
                raise ValueError(f"an image for this model is [3, {S}, {S}] after preprocessing, got {px.shape}")
            self._note_shape(("encode", S))
            out.append(_to_host(self._encode(self.vision_params, self._on_device(px[None])))[0])
        return np.stack(out) if out else np.zeros((0, self.vision.tokens_per_image, self.config.hidden), np.float32)

    # ---- teacher-forced rows (numerics: logits, tests, tools) ------------------------------------
    def forward_rows(self, state: DecodeState, tokens: Sequence[Sequence[int]], slots: Sequence[int],
                     starts: Sequence[int], all_logits: bool = False, embd: Sequence[Any] | None = None
                     ) -> tuple[np.ndarray, DecodeState]:
        """Feed rows of given tokens straight into the cache, no sampling, no slot table.

        Row b feeds tokens[b] at positions starts[b].. into slot slots[b]. Returns the logits of each
        row's last token [rows, V] (all_logits: every position, [rows, T, V]) and the new state.
        `embd` (vision models): per row, the image rows of its negative entries (see `Chunk.embd`).
        """
        self._check_live()
        plan = self._plan(tokens, slots, starts, all_logits, embd)
        self._note_shape(plan.key)
        last, every, cache = plan.fn(self.params, state.cache, *plan.args, **plan.kwargs)
        state = self._track(state.replace(cache=cache))
        out = _to_host(every if all_logits else last)[: len(tokens)]
        return out, state

    def _plan(self, tokens: Sequence[Sequence[int]], slots: Sequence[int], starts: Sequence[int],
              all_logits: bool, embd: Sequence[Any] | None = None) -> _Plan:
        """The raw forward's bucket and padded host inputs (rows, tokens, span buckets)."""
        n = len(tokens)
        if n == 0:
            raise ValueError("step needs at least one row")
        lens = [len(t) for t in tokens]
        if min(lens) < 1:
            raise ValueError("every row needs at least one token")
        B = _bucket(n, self.row_buckets)
        T = 1 if max(lens) == 1 else _bucket(max(lens), self.chunk_buckets)
        span = self._span_for(max(s + T for s in starts))
        sl = np.full((B,), self.scratch_slot, np.int32)
        st = np.zeros((B,), np.int32)
        nn = np.ones((B,), np.int32)
        for b in range(n):
            sl[b] = slots[b]
            st[b] = starts[b]
            nn[b] = lens[b]
        tok, ovr = self._chunk_inputs(tokens, list(embd) if embd is not None else [None] * n, T, B)
        args = (tok, sl, st, nn) if ovr is None else (tok, sl, st, nn, ovr)
        return _Plan(self._forward, args, dict(span=span, all_logits=all_logits, kernels=self.kernels),
                     ("raw", B, T, span, all_logits), B)

    # ---- embeddings ------------------------------------------------------------------------------
    def embed(self, state: DecodeState, rows: Sequence[Sequence[int]], slots: Sequence[int],
              starts: Sequence[int], pooling: str | Sequence[str] = "mean") -> tuple[np.ndarray, DecodeState]:
        """Feed rows of tokens into slots' caches as a prompt chunk would, and pool each row's final
        hidden states on the device: only [rows, D] comes back, never [rows, T, D] or logits.

        Row b feeds rows[b] (at most `chunk` tokens) at positions starts[b].. into slot slots[b]
        (distinct serving slots; the caller gives the slot up to this: its cache rows from starts[b]
        on are overwritten, and a row at start 0 restarts any recurrent state). `pooling` (one for
        all rows, or one per row): "mean" returns the *sum* of the row's hidden states, "last" the
        hidden state of its last token -- so a long input fed in several calls with increasing starts
        is pooled on the host (sums added, then divided by the length; the last call's "last").
        Returns f32 [rows, D] on the host and the new state. Compiled per (rows, tokens, span)
        bucket, as `forward_rows`; both poolings come out of one program.
        """
        self._check_live()
        n = len(rows)
        kinds = [pooling] * n if isinstance(pooling, str) else list(pooling)
        if len(kinds) != n or any(k not in ("mean", "last") for k in kinds):
            raise ValueError(f"pooling must be \"mean\" or \"last\" (one, or one per row), got {pooling!r}")
        if len(slots) != n or len(starts) != n:
            raise ValueError("embed needs one slot and one start per row")
        if len(set(slots)) != n or not all(0 <= int(s) < self.n_slots for s in slots):
            raise ValueError(f"embed rows need distinct serving slots (0..{self.n_slots - 1}), got {list(slots)}")
        if any(len(r) > self.chunk for r in rows):
            raise ValueError(f"an embedding row feeds at most {self.chunk} tokens per call")
        plan = self._plan(rows, slots, starts, False)
        key = ("embed", *plan.key[1:4])
        self._note_shape(key)
        pooled, _, cache = self._embed(self.params, state.cache, *plan.args[:4], span=plan.kwargs["span"],
                                       kernels=self.kernels)
        state = self._track(state.replace(cache=cache))
        both = _to_host(pooled)[:, :n]  # [2, rows, D]: sums, last
        return np.stack([both[0 if k == "mean" else 1, b] for b, k in enumerate(kinds)]).astype(np.float32), state

    def embed_fresh(self, rows: Sequence[Sequence[int]], pooling: str | Sequence[str] = "mean") -> np.ndarray:
        """Embed whole short inputs without any slot: each row (at most `chunk` tokens, at most
        `fresh_embed_rows` rows) is fed from position 0 into a cache made inside the call and dropped with
        it, so the serving slots' caches are untouched and no slot is taken. Returns f32 [rows, D]:
        "mean" rows the *sum* of the hidden states (as `embed`), "last" rows the last token's.

        Why: an input of a slot-fed `embed` call holds a slot, so a request of 2,048 tiny inputs took
        2,048 / n_slots forwards, one driver iteration each, and did not finish in 120 s beside a stream
        (issue 43). Here one forward takes up to `fresh_embed_rows` of them. Compiled per (rows, tokens)
        bucket; the state it returns is not the serving state (there is none to return)."""
        self._check_live()
        n = len(rows)
        kinds = [pooling] * n if isinstance(pooling, str) else list(pooling)
        if n == 0 or n > self.fresh_embed_rows or len(kinds) != n or any(k not in ("mean", "last") for k in kinds):
            raise ValueError(f"embed_fresh takes 1..{self.fresh_embed_rows} rows, each pooled \"mean\" or \"last\"")
        lens = [len(r) for r in rows]
        if min(lens) < 1 or max(lens) > self.chunk:
            raise ValueError(f"an embed_fresh row holds 1..{self.chunk} tokens")
        B, T = self.embed_fresh_shape(n, max(lens))
        span = self._span_for(T)
        tok = np.zeros((B, T), np.int32)
        nn = np.ones((B,), np.int32)  # padding rows feed one token of id 0; their output is dropped
        for b, r in enumerate(rows):
            tok[b, :lens[b]] = r
            nn[b] = lens[b]
        self._note_shape(("embed_fresh", B, T, span))
        pooled = self._embed_fresh(self.params, tok, nn, span=span, kernels=self.kernels)
        both = _to_host(pooled)[:, :n]  # [2, rows, D]: sums, last
        return np.stack([both[0 if k == "mean" else 1, b] for b, k in enumerate(kinds)]).astype(np.float32)

    def embed_fresh_shape(self, rows: int, longest: int) -> tuple[int, int]:
        """The padded (rows, tokens) of an `embed_fresh` call of `rows` inputs, the longest `longest`
        tokens: its forward costs rows x tokens token-rows whatever the inputs' own lengths, so the
        scheduler budgets a call by this, not by the tokens it carries (64 inputs of 4 tokens are a
        64 x 32 forward: ~10 s on SmolLM2, a stall of every stream)."""
        return _bucket(rows, _geometric_buckets(1, self.fresh_embed_rows, 2)), _bucket(longest, self.chunk_buckets)

    def _embed_fresh_impl(self, params, tokens, n_new, *, span: int, kernels: Kernels):
        """`_embed_impl` over a cache of tokens.shape[0] rows and `span` positions made here."""
        rows = tokens.shape[0]
        cache = self.arch.init_state(self.config, rows, span, self.kv_dtype)
        slots = jnp.arange(rows, dtype=jnp.int32)
        pooled, _, _ = self._embed_impl(params, cache, tokens, slots, jnp.zeros((rows,), jnp.int32), n_new,
                                        span=span, kernels=kernels)
        return pooled

    def _embed_impl(self, params, cache, tokens, slots, start, n_new, *, span: int, kernels: Kernels):
        """The hidden-state forward and both poolings: [2, B, D] (sum over each row's real tokens,
        the last real token's), f32. Padding positions are masked with `where`, not multiplied: the
        native kernels leave a padded chunk's rows unwritten, and 0 * NaN is NaN."""
        h, cache = self.arch.hidden_states(params, cache, tokens, slots, start, n_new, cfg=self.config, span=span,
                                           kernels=kernels)
        h = h.astype(jnp.float32)
        real = (jnp.arange(h.shape[1], dtype=jnp.int32)[None, :] < n_new[:, None])[..., None]
        sums = jnp.sum(jnp.where(real, h, 0.0), axis=1)
        return jnp.stack([sums, last_valid(h, n_new)]), None, cache

    def _span_for(self, need: int) -> int:
        if need > self.capacity:
            raise ValueError(f"sequence position {need} exceeds the cache capacity {self.capacity}")
        return _bucket(need, self.span_buckets)

    def _note_shape(self, key: tuple) -> None:
        with self._keys_lock:
            self._compiled_keys.add(key)

    # ---- warm-up -------------------------------------------------------------------------------
    def warmup_plans(self, decode: bool = True, prefill: bool = True, mixed: bool = True) -> list[StepPlan]:
        """Every serving step shape the scheduler can ask for, as plans on the scratch slot."""
        plans: list[StepPlan] = []
        s = self.scratch_slot
        if decode:
            plans += [StepPlan(decode=(s,) * b, reach=sp) for b in self.row_buckets for sp in self.span_buckets]
            plans += [StepPlan(decode=(s,) * b, drafts=((0,) * k,) * b, reach=sp)
                      for b in self.verify_rows for k in self.verify_ks for sp in self.span_buckets]
        chunks = [(t, sp) for t in (1, *self.chunk_buckets) for sp in self.span_buckets if sp >= t]
        for t, sp in chunks:
            start = max(0, min(sp - t, self.capacity - t)) if sp != self.span_buckets[0] else 0
            if prefill:
                plans.append(StepPlan(chunk=Chunk(s, (0,) * t, start, False)))
            if mixed and self.supports_mixed:
                plans.append(StepPlan(chunk=Chunk(s, (0,) * t, start, False), decode=(s,), reach=start + t))
        return plans

    def warmup(self, state: DecodeState, decode: bool = True, prefill: bool = True,
               mixed: bool = True, background: bool | None = None) -> DecodeState:
        """Make the step programs the scheduler can ask for; returns the state.

        On one die the programs are made ahead of time, each loaded from the executable store
        (pantheon.runtime.exec_store: no tracing, no lowering, no compile) or compiled and stored.
        The first ones -- the largest bucket of each step kind, their samplers and the slot verbs --
        are made before this returns, in parallel, and run once on the scratch slot: with them any
        request can be served (padded into the largest bucket). The rest follow in the
        `compile-<model>` thread when `background` (default PANTHEON_WARMUP_BACKGROUND), each one
        serving its bucket as soon as it exists; `compile_progress()` counts them. Several dies
        (a mesh, maybe over processes that must run the same programs) and a vision model compile
        everything here, through the jit.
        """
        if self.shard_plan is not None or self.vision is not None:
            # a vision model's prefill takes an embedding override the stored programs do not: jit
            return self._warmup_jit(state, decode, prefill, mixed)
        if background is None:
            background = load_settings().warmup_background
        self.stop_warmup()  # a second warm-up (another scheduler on this model) takes over the list
        keys = self.program_keys(decode, prefill, mixed)
        first = [k for k in keys if k in self._first_programs(decode, prefill, mixed)]
        rest = [k for k in keys if k not in first]
        self._abstract = (_abstract(self.params), _abstract(state.cache), _abstract(state.slots))
        with self._keys_lock:
            self._planned = list(dict.fromkeys([*self._planned, *keys]))
        self._exec_store()  # opened here, once, before the compile threads read it
        osthread.map_threads(self._obtain, [k for k in first if not self._has(k)], os.cpu_count() or 1,
                             name=f"compile-{self.name}")
        with self._keys_lock:
            self._aot = True
            self._routes.clear()
        state = self._exercise(state, first)
        if not rest:
            self._store_done()
        elif background:
            self._warm_stop = osthread.Event()
            stop = self._warm_stop
            self._warmer = osthread.start_thread(lambda: self._warm_rest(rest, stop), name=f"compile-{self.name}")
            _WARMING.add(self)
        else:
            for k in rest:
                self._obtain(k)
            self._store_done()
        return state

    def _warmup_jit(self, state: DecodeState, decode: bool, prefill: bool, mixed: bool) -> DecodeState:
        """Several dies: compile every step shape (jit, cores in parallel), then run each once on the
        scratch slot (which also compiles the sampler programs). Every process of a cluster runs the
        same list, so they compile and route alike."""
        step_plans = self.warmup_plans(decode, prefill, mixed)
        plans = [self._serve_plan(p) for p in step_plans]
        osthread.map_threads(
            lambda pl: pl.fn.lower(self.params, state.cache, state.slots, *pl.args, **pl.kwargs).compile(),
            plans, os.cpu_count() or 1, name=f"compile-{self.name}")
        for plan in step_plans:
            h, state = self.step(state, plan)
            self.read(h)
        if self.vision is not None:  # the image encoder's one program
            S = self.vision.image_size
            self.encode_images([np.zeros((3, S, S), np.float32)])
        state = self.insert(state, decode_state.slot_insert(0, [0], 0, GREEDY, 0, ()))  # compiles insert
        state = self.copy_slot(state, 0, 0)  # ... the n > 1 fork
        if self.caps.recurrent_state:  # ... prefix snapshots of the recurrent state
            state = self.restore(state, 0, self.snapshot(state, 0))
        return self.release(state, 0)  # ... and release, leaving slot 0 idle

    def program_keys(self, decode: bool = True, prefill: bool = True, mixed: bool = True) -> list[tuple]:
        """Every ahead-of-time program warm-up makes, in the order it makes them: the first ones
        (`_first_programs`), then the sampler of each row count, then the step buckets from the
        narrowest span up (short contexts are the common case), fewest rows and tokens first."""
        serve = list(dict.fromkeys(self._exact_bucket(p) for p in self.warmup_plans(decode, prefill, mixed)))
        serve.sort(key=lambda b: (b[3], b[1] + b[2], ("decode", "prefill", "mixed", "verify").index(b[0])))
        rows = sorted({_rows_of(b) for b in serve if b[0] != "verify"})
        first = self._first_programs(decode, prefill, mixed)
        out = [k for k in first if k[0] != "serve" or k[1:] in serve]
        out += [("advance", r) for r in rows]
        out += sorted({("accept", b[1], b[2]) for b in serve if b[0] == "verify"})
        out += [("serve", *b) for b in serve]
        return list(dict.fromkeys(out))

    def _first_programs(self, decode: bool, prefill: bool, mixed: bool) -> list[tuple]:
        """What the first request needs, whatever it is: the largest bucket of each step kind (any
        step fits it, padded), the samplers of their row counts, and the slot verbs."""
        top, cap = self.chunk_buckets[-1], self.capacity
        serve = []
        if decode:
            serve.append(("decode", self.row_buckets[-1], 0, cap))
        if prefill:
            serve.append(("prefill", 0, top, cap))
        if mixed and self.supports_mixed:
            serve.append(("mixed", self.mixed_rows, top, cap))
        rows = sorted({_rows_of(b) for b in serve})
        verbs = [("insert",), ("release",), ("copy",)]
        if self.caps.recurrent_state:
            verbs += [("snapshot",), ("restore",)]
        return [*verbs, *[("advance", r) for r in rows], *[("serve", *b) for b in serve]]

    def _has(self, key: tuple) -> bool:
        with self._keys_lock:
            return key in self._programs

    def _program(self, key: tuple, jitted: Any) -> Any:
        """The ahead-of-time program `key` if warm-up made it, else the jitted function."""
        with self._keys_lock:
            return self._programs.get(key, jitted) if self._aot else jitted

    def _route(self, exact: tuple, chunk_start: int) -> tuple | None:
        """The compiled bucket a step of bucket `exact` runs in: itself once compiled, else the cheapest
        compiled bucket of its kind at least as large in rows, tokens and span (its sampler compiled
        too), whose span also holds the padded chunk. None: no compiled bucket holds it."""
        kind, D, T, span = exact
        with self._keys_lock:
            if ("serve", *exact) in self._programs:
                return exact
            cands = self._routes.get(exact)
            if cands is None:
                cands = sorted((k[1:] for k in self._programs
                                if k[0] == "serve" and k[1] == kind and k[2] >= D and k[3] >= T and k[4] >= span
                                and _sampler_key(k[1:]) in self._programs),
                               key=lambda b: (b[3] * (b[1] + b[2]), b))
                self._routes[exact] = cands
        for b in cands:
            if kind in ("decode", "verify") or b[3] >= chunk_start + b[2]:
                return b
        return None

    def _add_program(self, key: tuple, compiled: Any) -> None:
        with self._keys_lock:
            self._programs[key] = compiled
            self._routes.clear()

    def compile_progress(self) -> tuple[int, int]:
        """(programs made, programs warm-up plans): `compiled k/n` on the health routes."""
        with self._keys_lock:
            return sum(1 for k in self._planned if k in self._programs), len(self._planned)

    def warming(self) -> bool:
        """Whether the compile-<model> thread is still making programs."""
        return self._warmer is not None and self._warmer.is_alive()

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Wait for the background compile to end; True when it has (or none runs)."""
        w = self._warmer
        return w is None or w.join(timeout)

    def stop_warmup(self, timeout: float = 300.0) -> None:
        """Stop the background compile after the program it is making (unload, a new warm-up)."""
        self._warm_stop.set()
        if self._warmer is not None:
            if not self._warmer.join(timeout):
                log.warning("%s: the compile thread did not stop within %.0f s", self.name, timeout)
            self._warmer = None

    def _warm_rest(self, keys: list[tuple], stop: Any) -> None:
        """The compile-<model> thread: make each remaining program; a program that fails is logged
        and counted (its bucket keeps being served by a larger one); a failure of the loop itself is
        logged and kept in `warm_failure` -- never a silent end."""
        t0 = time.perf_counter()
        try:
            store = self._exec_store()
            if store:  # what the store holds first, a few at a time (a load is milliseconds, not seconds)
                stored = [k for k in keys if store.has(_program_name(k))]
                osthread.map_threads(lambda k: stop.is_set() or self._obtain(k, compile_missing=False), stored,
                                     min(4, os.cpu_count() or 1), name=f"compile-{self.name}")
            for k in keys:
                if stop.is_set():
                    return
                if self._has(k):
                    continue
                try:
                    self._obtain(k)
                except Exception as exc:  # noqa: BLE001 - one bucket lost, the rest still compile
                    log.exception("%s: compiling %s failed; a larger bucket serves it", self.name, k)
                    self.compile_errors.append(f"{k}: {type(exc).__name__}: {exc}")
            done, n = self.compile_progress()
            log.info("%s: %d/%d programs ready after %.1f s in the background", self.name, done, n,
                     time.perf_counter() - t0)
            self._store_done()
            # what compiling freed stays in glibc's arenas until trimmed (SmolLM2: ~0.07 GB after a cold
            # start's 101 compiles; nothing measurable when every program was read from the store)
            heap.release_freed_memory()
        except BaseException as exc:  # noqa: BLE001 - the thread never dies quietly
            self.warm_failure = f"{type(exc).__name__}: {exc}"
            log.critical("%s: the compile thread failed: %s", self.name, self.warm_failure, exc_info=True)

    def _store_done(self) -> None:
        kinds: dict[str, list[float]] = {}
        for key, (how, sec) in list(self.program_seconds.items()):
            if how == "compiled":
                kinds.setdefault(key[1] if key[0] == "serve" else key[0], []).append(sec)
        if kinds:  # what each kind of program costs to trace, lower and compile (chooses buckets)
            log.info("%s: compile seconds by kind: %s", self.name, ", ".join(
                f"{k} {len(v)} x {sum(v) / len(v):.1f} s" for k, v in sorted(kinds.items())))
        store = self._exec_store()
        if store:
            log.info("%s: executable store %s: %d programs loaded, %d compiled and saved", self.name,
                     store.dir, store.loaded, store.saved)
            store.prune()

    def _exercise(self, state: DecodeState, keys: list[tuple]) -> DecodeState:
        """Run the slot verbs and the decode program of the first ones once on the scratch slot: a
        store whose programs do not run in this process (its runtime or kernels) shows here, and its
        first programs are dropped and compiled afresh (once). The prefill and mixed programs are not
        run (a 128-token chunk at the widest span is most of a warm start's time on a busy CPU); they
        come from the same store, key and runtime."""
        plans = {self._exact_bucket(p): p for p in self.warmup_plans()}
        for attempt in (0, 1):
            try:
                for k in keys:
                    if k[0] == "serve" and k[1] == "decode" and k[1:] in plans:
                        h, state = self.step(state, plans[k[1:]])
                        self.read(h)
                state = self.insert(state, decode_state.slot_insert(0, [0], 0, GREEDY, 0, ()))
                state = self.copy_slot(state, 0, 0)
                if self.caps.recurrent_state:
                    state = self.restore(state, 0, self.snapshot(state, 0))
                return self.release(state, 0)
            except Exception:
                store = self._exec_store()
                if attempt or not store or not store.loaded:
                    raise
                log.warning("%s: a stored program failed to run; compiling the first programs afresh",
                            self.name, exc_info=True)
                for k in keys:
                    store.discard(_program_name(k))
                    with self._keys_lock:
                        self._programs.pop(k, None)
                osthread.map_threads(lambda k: self._obtain(k, use_store=False), keys, os.cpu_count() or 1,
                                     name=f"compile-{self.name}")
                state = self.new_state()  # the failed call may have consumed the donated state
        raise AssertionError("unreachable")

    def _obtain(self, key: tuple, use_store: bool = True, compile_missing: bool = True) -> None:
        """Make program `key`: load it from the executable store, else (`compile_missing`) lower and
        compile it, and store it."""
        store = self._exec_store()
        name = _program_name(key)
        compiled = store.load(name, self.devices) if store and use_store else None
        if compiled is None and not compile_missing:
            return
        t0 = time.perf_counter()
        how = "loaded"
        if compiled is None:
            how = "compiled"
            lowered = self._lower(key)
            if store:
                # Compiled afresh, not taken from JAX's persistent cache: on XLA:CPU an executable read
                # from that cache serialises without some of its functions ("Function ... not found"
                # when the stored copy runs), so what goes into the store must be compiled here.
                with compile_guard.fresh_compile() as options:
                    compiled = lowered.compile(compiler_options=options)
                store.save(name, compiled)
            else:
                compiled = lowered.compile()
        self.program_seconds[key] = (how, time.perf_counter() - t0)
        log.debug("%s: %s %s in %.2f s", self.name, how, _program_name(key), self.program_seconds[key][1])
        self._add_program(key, compiled)

    def _lower(self, key: tuple) -> Any:
        """Trace and lower program `key` for this model's abstract params, cache and slot table."""
        params, cache, table = self._abstract
        if key[0] == "serve" and key[1] == "verify":
            _, D, K, span = key[1:]
            args = (np.zeros((D, K), np.int32), np.zeros(D, np.int32), np.zeros((D,), np.int32))
            return self._serve.lower(params, cache, table, *args, span=span, kernels=self.kernels, kind="verify")
        if key[0] == "accept":
            D, K = key[1:]
            r = D * (K + 1)
            logits = jax.ShapeDtypeStruct((r, self.config.vocab), self._logits_dtype(), sharding=table.pos.sharding)
            rows = decode_state.VerifyRows(slot=np.zeros(D, np.int32), on=np.zeros(D, bool), start=np.zeros(D, np.int32),
                                           drafts=np.zeros((D, K), np.int32), n_draft=np.zeros(D, np.int32))
            return self._accept.lower(table, logits, rows)
        if key[0] == "serve":
            kind, D, T, span = key[1:]
            args = (np.zeros((1, max(T, 1)), np.int32), np.zeros(3, np.int32), np.zeros((max(D, 1),), np.int32))
            return self._serve.lower(params, cache, table, *args, span=span, kernels=self.kernels, kind=kind)
        if key[0] == "advance":
            r = key[1]
            logits = jax.ShapeDtypeStruct((r, self.config.vocab), self._logits_dtype(), sharding=table.pos.sharding)
            rows = decode_state.StepRows(slot=np.zeros(r, np.int32), emit=np.zeros(r, bool),
                                         pos=np.zeros(r, np.int32), live=np.zeros(r, bool))
            return self._advance.lower(table, logits, rows, np.zeros((r, self.mask_words), np.int32), np.bool_(False))
        if key[0] == "insert":
            return self._insert.lower(table, decode_state.slot_insert(0, [0], 0, GREEDY, 0, ()))
        if key[0] == "release":
            return self._release.lower(table, np.int32(0))
        if key[0] == "copy":
            return self._copy.lower(cache, np.int32(0), np.int32(0))
        if key[0] == "snapshot":
            return self._snap.lower(cache, np.int32(0))
        if key[0] == "restore":
            snap = jax.eval_shape(self._snap, cache, np.int32(0))
            return self._restore_snap.lower(cache, np.int32(0), snap)
        raise ValueError(f"unknown program {key!r}")

    def _logits_dtype(self) -> Any:
        """The dtype of a step's logits (what the sampler program takes), from the forward's abstract
        evaluation (a trace, only when a sampler is compiled rather than loaded)."""
        params, cache, table = self._abstract
        out = jax.eval_shape(functools.partial(self._serve_impl, span=self.span_buckets[0], kernels=self.kernels,
                                               kind="decode"),
                             params, cache, table, np.zeros((1, 1), np.int32), np.zeros(3, np.int32),
                             np.zeros((1,), np.int32))
        return out[0].dtype

    def _exec_store(self) -> exec_store.ExecStore | None:
        """This model's executable store, or None: turned off, or no identity for it. Opened by warm-up
        before any compile thread starts (so it is never built twice)."""
        if self._store is None and self._abstract is not None:
            self._store = False
            where = self.opts.store_dir
            settings = load_settings()
            if where is None and settings.exec_store:
                where = str(settings.home / "executables")
            if where:
                try:
                    self._store = exec_store.ExecStore(Path(where), self._identity(), settings.exec_store_mb << 20)
                except Exception as exc:  # no store is slower, never wrong
                    log.warning("%s: no executable store: %s: %s", self.name, type(exc).__name__, exc)
        return self._store or None

    def _identity(self) -> dict[str, Any]:
        """Everything a step program depends on (pantheon.runtime.exec_store explains each part)."""
        params, cache, table = self._abstract
        return {
            "runtime": exec_store.runtime_identity(self.devices),
            "file": exec_store.file_identity(Path(self.card.path)),
            "arch": [self.config.arch, self.arch.__name__, repr(self.config)],
            "engine": {"n_slots": self.n_slots, "max_seq": self.max_seq, "chunk": self.chunk,
                       "capacity": self.capacity, "rows": self.row_buckets, "chunks": self.chunk_buckets,
                       "spans": self.span_buckets, "mixed_rows": self.mixed_rows, "mixed": self.supports_mixed,
                       "dtype": jnp.dtype(self.dtype).name, "kv_dtype": self.kv_dtype.name,
                       "kernels": repr(self.kernels), "mask_words": self.mask_words},
            "native": native.library_id() if self.kernels.matmul or self.kernels.attention else None,
            "params": exec_store.signature(params), "cache": exec_store.signature(cache),
            "table": exec_store.signature(table),
        }

    def compiled_shapes(self) -> set[tuple]:
        with self._keys_lock:
            return set(self._compiled_keys)


# Models whose compile-<model> thread may still run: stopped at exit (after the program in progress),
# so the interpreter never tears JAX's backends down under a compile.
_WARMING: weakref.WeakSet[Model] = weakref.WeakSet()


@atexit.register
def _stop_warmers() -> None:
    for m in list(_WARMING):
        m.stop_warmup(timeout=60.0)


def _rows_of(bucket: tuple) -> int:
    """The output rows of a step bucket (kind, D, T, span): its chunk row, if any, and its decode rows
    (a verify bucket ("verify", D, K, span): K + 1 rows per slot)."""
    kind, D = bucket[0], bucket[1]
    if kind == "verify":
        return D * (bucket[2] + 1)
    return (0 if kind == "decode" else 1) + D


def _sampler_key(bucket: tuple) -> tuple:
    """The sampler program a step bucket's output goes through: ("advance", rows), or for a verify
    bucket ("accept", D, K)."""
    if bucket[0] == "verify":
        return ("accept", bucket[1], bucket[2])
    return ("advance", _rows_of(bucket))


def _program_name(key: tuple) -> str:
    return "-".join(str(p) for p in key)


def _abstract(tree: Any) -> Any:
    """A pytree of arrays as ShapeDtypeStructs with their shardings: what lowering needs, without
    holding (or reading) the buffers."""
    def one(x: Any) -> Any:
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        return x
    return jax.tree.map(one, tree)


def _score_rows(logits: jax.Array, nxt: jax.Array, *, k: int) -> tuple[jax.Array, jax.Array]:
    """Per position of [B, T, V] logits: the logprob of the next prompt token `nxt` [B, T] and the
    top k (sampler.token_logprobs over the flattened positions)."""
    from pantheon.runtime.sampler import token_logprobs
    b, t, v = logits.shape
    lps, ids = token_logprobs(logits.reshape(b * t, v), nxt.reshape(b * t), k)
    return lps.reshape(b, t, 1 + k), ids.reshape(b, t, k)


def _to_host(x: jax.Array) -> np.ndarray:
    """A step output's host copy. Outputs are replicated; over a mesh spanning processes only this
    process's copy is readable (pantheon.serving.distributed), and it is the whole value."""
    if not x.is_fully_addressable:
        x = x.addressable_data(0)
    return np.asarray(x)


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
    from pantheon.jax_models import registry
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
    """Whether a single-die CPU f32 load asks for pantheon.ops.native's kernels."""
    return load_settings().native_matmul if opts.native_matmul is None else bool(opts.native_matmul)


def choose_kernels(opts: LoadOptions, devices: Sequence[Any], dtype: Any) -> Kernels:
    """The one decision of which kernels a model's steps use (made once, at load).

    The native CPU kernels need the whole model on one CPU die computing in f32, the library
    built, and the option (PANTHEON_NATIVE_MATMUL / LoadOptions.native_matmul) on; everything else
    runs XLA's forms, which expand the weights' blocks inside the step in `dtype`. Their quantized
    products take the form PANTHEON_NATIVE_DOT / LoadOptions.native_dot names (exact or int8).
    """
    compute = jnp.dtype(dtype).name
    if len(devices) != 1 or devices[0].platform != "cpu" or dtype != jnp.float32 or not native_wanted(opts):
        return Kernels(compute=compute)
    built = native.enable(Path(opts.native_dir) if opts.native_dir else load_settings().home / "native")
    dot = getattr(opts, "native_dot", None) or load_settings().native_dot
    if dot not in native.DOTS:
        raise ValueError(f"native dot {dot!r} is not one of {', '.join(native.DOTS)}")
    return Kernels(matmul=built, attention=built, compute=compute, dot=dot)


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
# the most decoding slots a verify step holds: more slots already share each weight read, and on a CPU
# their K + 1 rows each made a step compute-bound (4 streams of a code edit ran at 0.80x, measured)
VERIFY_MAX_ROWS = 2


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
    (gguf_reader, gguf_loader, tokenizer) raise ModelLoadError themselves with a specific message.
    """
    opts = opts or LoadOptions()
    compile_guard.install()
    all_devices = jax.devices()
    if dies:
        bad = [d for d in dies if d < 0 or d >= len(all_devices)]
        if bad:
            raise ModelLoadError(path, f"no such die(s) {bad}; this host has {len(all_devices)}", in_file=False)
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
        clear_exception_frames(exc)
        if isinstance(exc, ModelLoadError):
            raise
        # reading and building from the file fail because of the file; the upload and the model's
        # construction fail because of the device or the host (memory), whatever file it was
        raise ModelLoadError(p, f"{stage[0]} failed: {type(exc).__name__}: {exc}",
                             in_file=stage[0] not in _RUNTIME_STAGES) from exc


# load_on's stages whose unexpected failures are the runtime's, not the file's (ModelLoadError.in_file)
_RUNTIME_STAGES = ("placing the weights on the device", "building the model")


def _load_files(p: Path, opts: LoadOptions, devices: list[Any], stage: list[str]) -> Model:
    """load_on's body: read and check the file, build and upload the weights, then the tokenizer and
    template (a failure there deletes the uploaded weights at once). `stage[0]` says which step runs."""
    from pantheon.formats import hf_loader
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
    host_params = weights.stack_layers(weights.stamp(host_params, kernels))
    weight_bytes = weights.tree_bytes(host_params)
    stage[0] = "placing the weights on the device"
    if len(devices) > 1:  # tensor-parallel over the dies: each leaf goes straight into its shards
        from pantheon.runtime.sharding import ShardPlan
        params = ShardPlan(devices, cfg).put_params(host_params)
    else:
        params = weights.place(host_params, lambda _path, _leaf: devices[0])
    del host_params
    name = opts.name or p.stem
    vparams = None
    try:
        stage[0] = "building the tokenizer and chat template"
        tokenizer, template = _tokenizer_and_template(p, f.meta)
        if "hf.config" not in f.meta and tokenizer.vocab_size > cfg.vocab:
            raise ModelLoadError(p, f"the tokenizer has {tokenizer.vocab_size} tokens but token_embd.weight has "
                                    f"{cfg.vocab} rows: ids past the embedding would read nothing")
        vision = vcard = None
        if opts.mmproj:
            if len(devices) > 1:
                raise ModelLoadError(Path(opts.mmproj), "a vision projector is supported on one die only (the "
                                                        "tensor-parallel steps take no image rows yet)", in_file=False)
            stage[0] = "loading the vision projector"
            vision, vparams, vcard = _load_vision(Path(opts.mmproj).expanduser(), cfg, tokenizer, kernels, devices)
            if opts.prefill_chunk < vision.tokens_per_image:
                # the scheduler never ends a chunk inside an image (Gemma 3's tokens attend to each other
                # both ways), so one image (one Idefics3 tile) must fit one chunk
                log.info("%s: prefill chunk raised from %d to %d (one image's tokens)", name, opts.prefill_chunk,
                         vision.tokens_per_image)
                opts = replace(opts, prefill_chunk=vision.tokens_per_image)
            weight_bytes += weights.tree_bytes(vparams)
        stage[0] = "building the model"
        return Model(p, name, cfg, arch, params, tokenizer, template, opts, devices, dtype, weight_bytes,
                     kernels=kernels, kv_dtype=resolve_kv_dtype(opts, devices[0]), vision=vision,
                     vision_params=vparams, vision_card=vcard)
    except BaseException:
        _delete_arrays(params)  # nothing may stay on the device when the load fails
        _delete_arrays(vparams)
        raise


# the text architectures each projector type was made for (their modules declare image_inputs)
VISION_TEXT_ARCHS = {"gemma3": ("gemma3",), "idefics3": ("llama",)}
GEMMA3_TOKENS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")
IDEFICS3_TOKENS = ("<fake_token_around_image>", "<global-img>", "<image>")


def _single_tokens(path: Path, tokenizer: Any, texts: Sequence[str], family: str) -> dict[str, int]:
    """Each text's one token id, or ModelLoadError: the prompt's image tokens must be single tokens of
    this tokenizer, or the image rows would land on the wrong positions."""
    ids = {}
    for text in texts:
        got = tokenizer.encode(text)
        if len(got) != 1:
            raise ModelLoadError(path, f"the text model's tokenizer has no {text} token (a {family} vision model "
                                       "needs it)")
        ids[text] = got[0]
    return ids


def _vision_card(path: Path, vc: Any, tokenizer: Any) -> Any:
    """What the web layer needs to write an image into a prompt, per projector family (the strings are
    what HF's processor of that family writes)."""
    from pantheon.types import VisionCard
    n = vc.tokens_per_image
    if vc.projector == "idefics3":
        fake, glob, image = IDEFICS3_TOKENS
        side = vc.longest_edge // vc.image_size  # the largest grid: side x side tiles
        grid = [f"<row_{r}_col_{c}>" for r in range(1, side + 1) for c in range(1, side + 1)] if side > 1 else []
        ids = _single_tokens(path, tokenizer, IDEFICS3_TOKENS + tuple(grid), "SmolVLM / Idefics3")
        return VisionCard(image_size=vc.image_size, mean=vc.mean, std=vc.std, n_tokens=n, image_id=ids[image],
                          marker=image, expansion=fake + glob + image * n + fake, tiling=vc.longest_edge,
                          tile_prefix=fake + "<row_{row}_col_{col}>", image_text=image)
    boi, eoi, soft = GEMMA3_TOKENS
    ids = _single_tokens(path, tokenizer, GEMMA3_TOKENS, "Gemma 3")
    return VisionCard(image_size=vc.image_size, mean=vc.mean, std=vc.std, n_tokens=n, image_id=ids[soft],
                      marker=boi, expansion="\n\n" + boi + soft * n + eoi + "\n\n", image_text=soft)


def _load_vision(path: Path, cfg: ModelConfig, tokenizer: Any, kernels: Kernels, devices: list[Any]):
    """The projector file's config, its params on the device, and the card the web layer reads."""
    from pantheon.formats.mmproj import open_mmproj
    from pantheon.jax_models import siglip
    f = open_mmproj(path)
    vc = f.config
    if cfg.arch not in VISION_TEXT_ARCHS.get(vc.projector, ()) or not capabilities_of(_arch_module(cfg, path)).image_inputs:
        raise ModelLoadError(path, f"a {vc.projector!r} projector does not fit a {cfg.arch!r} text model")
    if vc.text_hidden != cfg.hidden:
        raise ModelLoadError(path, f"the projector outputs width {vc.text_hidden}, the text model's embeddings "
                                   f"are {cfg.hidden} wide: not this model's projector")
    card = _vision_card(path, vc, tokenizer)
    host = weights.stamp(siglip.load_params(f.tensors, vc), kernels)
    return vc, weights.place(host, lambda _path, _leaf: devices[0]), card


def _tokenizer_and_template(path: Path, meta: dict[str, Any]):
    from pantheon.text.chat_template import ChatTemplate
    from pantheon.text.tokenizer import Tokenizer
    if "hf.config" in meta:  # an HF checkpoint: tokenizer.json + tokenizer_config.json
        from pantheon.formats.hf_loader import tokenizer_and_template
        return tokenizer_and_template(path, meta)
    if "tokenizer.ggml.tokens" not in meta:
        raise ModelLoadError(path, "the file has no tokenizer (tokenizer.ggml.tokens missing)")
    tok = Tokenizer.from_gguf_metadata(meta, str(path))
    source = meta.get("tokenizer.chat_template")
    if source is not None and not isinstance(source, str):
        raise ModelLoadError(path, f"tokenizer.chat_template is {type(source).__name__}, not a string")
    tmpl = ChatTemplate(source, tok.bos_token, tok.eos_token)
    return tok, tmpl
