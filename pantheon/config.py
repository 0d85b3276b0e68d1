"""Every environment variable Pantheon reads: one declared table, parsed once into a frozen dataclass.

`SETTINGS` is the table. Each row names a variable (always `PANTHEON_*`), the design's older names
it still answers to (the seed's `QWEN35_*` / `BS_*`, which its operators already use), how its text
is parsed, its default and what it means. `load_settings()` turns an environment into `Settings` by
walking the rows; docs/settings.md is generated from the same rows (`settings_table_markdown`), and
tests/test_settings.py keeps the page, the dataclass and every name used in the code in step with it.
Nothing else in pantheon reads os.environ for configuration: callers keep a `Settings` (or call
`load_settings()` when they have none), so a variable's meaning lives in exactly one place.

Two rules hold for every row, because an operator should not have to learn them per variable:

* a variable that is unset or set to the empty string counts as unset, so its default applies;
* when a variable and one of its aliases are both set, the `PANTHEON_*` name wins (the first set name
  in `(name, *aliases)` is used), so a new-style deployment overrides an inherited old-style one.

Not in the table, because they are not Pantheon's: `JAX_PLATFORMS`, `XLA_FLAGS` and the rest of JAX's
and XLA's own variables, read by JAX itself (the tests set them for child processes). And one read
outside this module: tools/make_random_qwen35moe.py looks at `PANTHEON_FIXTURES` itself, because it
is meant to run as a stand-alone script where pantheon need not be importable.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Settings:
    """The parsed environment. Fields are documented on their rows in `SETTINGS`; tests build this
    directly with keywords, so every field but `home` keeps a plain default equal to its row's."""

    home: Path
    models: tuple[str, ...] = ()
    api_key: str | None = None
    admin_key: str | None = None
    model_dir: Path | None = None
    cors_origins: tuple[str, ...] = ()
    max_body_bytes: int = 4 * 1024 * 1024
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    body_min_rate: float = 1024.0
    max_connections: int = 1000
    max_echo_logprobs: int = 65536
    max_generations: int = 16
    responses_store: int = 1024
    responses_store_mb: float = 64.0
    grammar_threads: int = 2
    grammar_queue: int = 8
    grammar_timeout_s: float = 10.0
    grammar_max_nodes: int = 5000
    grammar_max_properties: int = 400
    grammar_mask_ms: float = 200.0
    embed_max_tokens: int = 65536
    max_images: int = 8
    max_image_bytes: int = 10 * 1024 * 1024
    max_image_pixels: int = 16_000_000
    image_url_allowlist: tuple[str, ...] = ()
    image_threads: int = 2
    image_queue: int = 8
    dtype: str = "auto"
    max_seq: int = 2048
    forbid_compile: bool = False
    compile_cache: bool = True
    batch_slots: int = 8
    prefill_chunk: int = 128
    queue_depth: int = 32
    queue_wait_s: float = 30.0
    request_slot_share: float = 0.5
    bs_stats: bool = False
    bs_mixed: bool = True
    speculative: bool = True
    spec_k: int = 6
    spec_gauge: bool = True
    draft_model: str | None = None  # catalog name or file of a draft model loaded beside each model
    prefix_snapshot_mb: int = 1024
    die_budget_mb: int = 0
    warmup: bool = True
    warmup_background: bool = True
    exec_store: bool = True
    exec_store_mb: int = 4096
    native_matmul: bool = True
    native_dot: str = "int8"
    kv_dtype: str = "auto"
    registry_url: str | None = None
    registry_key: str | None = None
    registry_worker_key: str | None = None
    registry_timeout_s: float = 5.0
    registry_max_reply_bytes: int = 4 * 1024 * 1024
    node_id: str = "node0"
    registry_transport: str = "local"
    advertise_url: str | None = None
    registry_interval_s: float = 5.0
    coordinator: str | None = None
    num_processes: int = 1
    process_id: int = 0
    cluster_timeout_s: float = 120.0
    # The secret every process of a cluster shares: the control channel authenticates with it before it
    # reads anything. Never printed (repr=False). Filled from PANTHEON_CLUSTER_SECRET or, read at load
    # time, from the file PANTHEON_CLUSTER_SECRET_FILE names (load_settings).
    cluster_secret: bytes | None = field(default=None, repr=False)
    cluster_secret_file: Path | None = None
    cluster_trusted_network: bool = False
    test_pressure: int | None = None
    fixtures: Path | None = None
    test_tier: str = "full"


# ---- parsers: the text of a set (non-empty) variable -> its value; None means "as if unset" --------------
# A parser raises ValueError with the complaint only; load_settings prefixes the variable and its text.

def _text(raw: str) -> str:
    return raw


def _stripped(raw: str) -> str | None:
    return raw.strip() or None


def _flag(raw: str) -> bool:
    return raw.strip().lower() not in ("0", "false", "no", "off")


def _integer(low: int | None = None) -> Callable[[str], int | None]:
    """An integer parser clamped to `low`: out-of-range values are pulled in, not refused, as before."""
    def parse(raw: str) -> int | None:
        if not raw.strip():
            return None
        try:
            value = int(raw)
        except ValueError:
            raise ValueError("is not an integer") from None
        return value if low is None else max(low, value)
    return parse


def _number(low: float | None = None) -> Callable[[str], float | None]:
    def parse(raw: str) -> float | None:
        if not raw.strip():
            return None
        try:
            value = float(raw)
        except ValueError:
            raise ValueError("is not a number") from None
        return value if low is None else max(low, value)
    return parse


def _home(raw: str) -> Path:
    return Path(raw).expanduser()


def _default_home() -> Path:
    return Path.home() / ".cache" / "pantheon"


def _model_dir(raw: str) -> Path:
    return Path(raw).expanduser().resolve()


def split_model_specs(raw: str) -> tuple[str, ...]:
    """Split PANTHEON_MODELS into `[NAME=]MODEL[@DIE,DIE]` specs.

    `;` (or a newline) separates models, because a die list `@0,1` itself contains commas. For
    convenience a comma also separates models when what follows it is not a bare die number, so
    `a@0,1,b` is read as `a@0,1` and `b` (a model is never named by digits alone).
    """
    specs: list[str] = []
    for part in raw.replace("\n", ";").split(";"):
        pieces: list[str] = []
        for piece in part.split(","):
            piece = piece.strip()
            if piece.isdigit() and pieces and "@" in pieces[-1]:
                pieces[-1] += "," + piece
            elif piece:
                pieces.append(piece)
        specs.extend(pieces)
    return tuple(specs)


def _origins(raw: str) -> tuple[str, ...]:
    return tuple(o.strip() for o in raw.split(",") if o.strip())


def _url(raw: str) -> str | None:
    """An http(s) base URL without a trailing slash (the router and the advertised address are joined
    with paths), or None when blank."""
    url = raw.strip().rstrip("/")
    if not url:
        return None
    if not url.startswith(("http://", "https://")):
        raise ValueError("must be an http:// or https:// URL")
    return url


_KV_DTYPES = {"auto": "auto", "f32": "float32", "float32": "float32", "f16": "float16", "float16": "float16",
              "bf16": "bfloat16", "bfloat16": "bfloat16"}


def _kv_dtype(raw: str) -> str:
    name = _KV_DTYPES.get(raw.strip().lower())
    if name is None:
        raise ValueError("must be auto, float32, float16 or bfloat16")
    return name


NATIVE_DOTS = ("exact", "int8")  # pantheon.ops.native.DOTS (config is floor 0: spelled out here)


def _native_dot(raw: str) -> str:
    name = raw.strip().lower()
    if name not in NATIVE_DOTS:
        raise ValueError("must be exact or int8")
    return name


def _batch_slots(raw: str) -> int | None:
    """The seed switched batching on with QWEN35_BATCH_SLOTS=1 (its slot count was fixed at 8), so 1
    keeps that meaning under either name: 8 slots. 0 is the single-user setting."""
    slots = _integer(low=0)(raw)
    return 8 if slots == 1 else slots


def _pressure(raw: str) -> int | None:
    level = _integer()(raw)
    if level is not None and not 0 <= level <= 3:
        raise ValueError("must be 0..3")
    return level


def _test_tier(raw: str) -> str:
    tier = raw.strip().lower()
    if tier not in ("quick", "full"):
        raise ValueError("must be quick or full")
    return tier


def _fixtures(raw: str) -> Path:
    return Path(raw)


MIN_SECRET_BYTES = 16  # a shorter shared secret could be guessed by whoever can reach the control port


def _secret(raw: str) -> bytes | None:
    secret = raw.strip().encode("utf-8")
    if not secret:
        return None
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"is {len(secret)} bytes long; use at least {MIN_SECRET_BYTES} random bytes "
                         "(for example the output of `openssl rand -hex 32`)")
    return secret


# ---- the table ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Setting:
    """One environment variable: the `Settings` field it fills and everything its documentation says."""

    name: str  # the PANTHEON_* variable
    field: str  # the Settings attribute
    parse: Callable[[str], Any]  # text of a set variable -> value (None: as if unset)
    doc: str  # what it means (markdown; one line in the generated table)
    aliases: tuple[str, ...] = ()  # older names still read, after `name`
    shown_default: str | None = None  # the docs' default column, where the value does not say it plainly
    for_tests: bool = False  # only the test suite sets it
    default_factory: Callable[[], Any] | None = None  # a default computed at load time (home)
    secret: bool = False  # a malformed value is reported without its text

    def default(self) -> Any:
        if self.default_factory is not None:
            return self.default_factory()
        return _FIELD_DEFAULTS[self.field]

    def shown(self) -> str:
        """The default as the docs show it: flags as 0/1, unset for None, code for text."""
        if self.shown_default is not None:
            return self.shown_default
        value = self.default()
        if value is None or value == ():
            return "unset"
        if isinstance(value, bool):
            return str(int(value))
        if isinstance(value, float) and value.is_integer():
            return str(int(value))
        if isinstance(value, str):
            return f"`{value}`"
        return str(value)


SETTINGS: tuple[Setting, ...] = (
    # -- where things live, what is served
    Setting("PANTHEON_HOME", "home", _home, default_factory=_default_home, shown_default="`~/.cache/pantheon`",
            doc="model downloads (`models/`), JAX's persistent compilation cache (`xla-cache/`), the built "
                "CPU kernels (`native/`) and the stored step programs (`executables/`, authenticated with the "
                "install's key `executables/.mac-key`); code is loaded from here, so it must not be writable "
                "by other users"),
    Setting("PANTHEON_MODELS", "models", split_model_specs,
            doc="models loaded at start: `[NAME=]MODEL[@DIE,DIE]` items separated by `;` (what "
                "`pantheon serve --model` sets)"),
    # -- access
    Setting("PANTHEON_API_KEY", "api_key", _text,
            doc="when set, every route but the health probes (`/`, `/health`, `/m/<model>/health`) and "
                "`/openapi.json` needs `Authorization: Bearer KEY` or `X-Api-Key: KEY`"),
    Setting("PANTHEON_ADMIN_KEY", "admin_key", _text,
            doc="admin routes need it; when unset they answer 403"),
    Setting("PANTHEON_MODEL_DIR", "model_dir", _model_dir,
            doc="admin loads may only open files under this directory (or catalog names)"),
    Setting("PANTHEON_CORS_ORIGINS", "cors_origins", _origins, shown_default="unset (CORS off)",
            doc="comma-separated allowed origins, or `*`"),
    # -- slow and large clients (pantheon.web.body, pantheon.web.worker)
    Setting("PANTHEON_MAX_BODY_BYTES", "max_body_bytes", _integer(),
            doc="larger request bodies get 413 (announced or chunked)"),
    Setting("PANTHEON_HEADER_TIMEOUT_S", "header_timeout_s", _number(low=0.1),
            doc="the request line and headers (and a kept-alive connection's idle wait) must arrive within "
                "this, else the connection is closed (at least 0.1)"),
    Setting("PANTHEON_BODY_TIMEOUT_S", "body_timeout_s", _number(low=0.1),
            doc="the whole body must arrive within this, else 408 (at least 0.1)"),
    Setting("PANTHEON_BODY_MIN_RATE", "body_min_rate", _number(low=0.0),
            doc="bytes/s a body must keep up after its first 5 s, else 408 (0: no minimum)"),
    Setting("PANTHEON_MAX_CONNECTIONS", "max_connections", _integer(low=8),
            doc="open connections per worker (at least 8); past it the connection that has waited longest "
                "on its client is evicted (requests being served never are), so `GET /` stays answerable"),
    Setting("PANTHEON_MAX_ECHO_LOGPROBS", "max_echo_logprobs", _integer(low=0),
            doc="legacy completions with `echo` and `logprobs`: at most this many prompt log-probability "
                "entries in one answer (n x prompt tokens x (logprobs + 1)); more is a 400 naming `logprobs`"),
    Setting("PANTHEON_MAX_GENERATIONS_PER_REQUEST", "max_generations", _integer(low=1),
            doc="generations one request may start: `n` for a chat, prompts x `n` for a legacy completion; "
                "more is a 400 naming `n` (or `prompt`), before anything is tokenized"),
    Setting("PANTHEON_RESPONSES_STORE", "responses_store", _integer(low=0),
            doc="stored `/v1/responses` answers kept for `previous_response_id` and `GET` (the oldest go first; "
                "0 keeps none)"),
    Setting("PANTHEON_RESPONSES_STORE_MB", "responses_store_mb", _number(low=0.0),
            doc="and the memory they hold together, in MB (MiB): the Python objects of the stored answers and "
                "their conversations, each counted by its measured size, a turn shared by a continued "
                "conversation once; past it the oldest go"),
    # -- structured outputs (pantheon.text.structured, pantheon.web.bridge.WorkPool, pantheon.scheduler.masks)
    Setting("PANTHEON_GRAMMAR_THREADS", "grammar_threads", _integer(low=1),
            doc="structured-output grammars compiling at once (OS threads started on demand, `pantheon-grammar-<i>`)"),
    Setting("PANTHEON_GRAMMAR_QUEUE", "grammar_queue", _integer(low=0),
            doc="grammars waiting for a compile thread; past it 429"),
    Setting("PANTHEON_GRAMMAR_TIMEOUT_S", "grammar_timeout_s", _number(low=0.1),
            doc="longest a request waits for its grammar (queue and compile), then 503"),
    Setting("PANTHEON_GRAMMAR_MAX_NODES", "grammar_max_nodes", _integer(low=1),
            doc="subschemas plus enum values a structured-output schema may have (the forced tools together), "
                "else 400 `schema_too_large`"),
    Setting("PANTHEON_GRAMMAR_MAX_PROPERTIES", "grammar_max_properties", _integer(low=1),
            doc="optional properties one object of such a schema may have, else 400 `schema_too_large` "
                "(docs/http-api.md has the measured compile-time curve)"),
    Setting("PANTHEON_GRAMMAR_MASK_MS", "grammar_mask_ms", _number(low=1.0),
            doc="longest one grammar mask row may take in a step; a request whose row is later fails alone "
                "(400 `grammar_too_complex`)"),
    # -- embeddings (pantheon.web.embeddings, pantheon.scheduler.embed)
    Setting("PANTHEON_EMBED_MAX_TOKENS", "embed_max_tokens", _integer(low=1),
            doc="tokens one `/v1/embeddings` request may hold, summed over its inputs; more is a 400 naming both "
                "figures"),
    Setting("PANTHEON_MAX_IMAGES", "max_images", _integer(low=0),
            doc="images one chat request may carry (vision models); more is a 400"),
    Setting("PANTHEON_MAX_IMAGE_BYTES", "max_image_bytes", _integer(low=1),
            doc="encoded size of one image (after base64 decoding, or as fetched); more is a 400"),
    Setting("PANTHEON_MAX_IMAGE_PIXELS", "max_image_pixels", _integer(low=1),
            doc="width x height of one image, read from its header before its pixels are decoded; more is a 400"),
    Setting("PANTHEON_IMAGE_THREADS", "image_threads", _integer(low=1),
            doc="images decoding and tiling at once, over all requests (OS threads started on demand, "
                "`pantheon-image-<i>`); a request's image tokens are checked against the context from the "
                "images' headers first, so a prompt that cannot fit decodes nothing"),
    Setting("PANTHEON_IMAGE_QUEUE", "image_queue", _integer(low=0),
            doc="requests waiting for an image-decoding thread; past it 429 `Retry-After`"),
    Setting("PANTHEON_IMAGE_URL_ALLOWLIST", "image_url_allowlist", _origins, shown_default="unset (no fetching)",
            doc="comma-separated URL prefixes (`https://images.example.com/`) that an `image_url` may name "
                "to be fetched by the server; unset, only `data:` URLs are taken and any other URL is a 400 "
                "(the server never fetches an arbitrary URL)"),
    # -- the engine
    Setting("PANTHEON_DTYPE", "dtype", _text,
            doc="compute dtype: `auto` (f32 on CPU, bf16 on GPU), `float32`, `bfloat16`"),
    Setting("PANTHEON_MAX_SEQ", "max_seq", _integer(), aliases=("QWEN35_MAX_SEQ",),
            doc="longest sequence (prompt + completion) per slot, clamped to the model's context length"),
    Setting("PANTHEON_KV_DTYPE", "kv_dtype", _kv_dtype,
            doc="KV cache element type: `auto` (float16 on CPU, bfloat16 on GPU), `float32`, `float16`, "
                "`bfloat16` (or `f32`, `f16`, `bf16`); the admission and `/admin/dies` figures count its real "
                "bytes"),
    Setting("PANTHEON_NATIVE_MATMUL", "native_matmul", _flag,
            doc="on a single CPU die (x86 with AVX2+FMA+F16C, f32 compute), the steps use the C++ kernels of "
                "`pantheon/ops/native/` (products straight from every GGUF format for decode rows and prefill "
                "chunks, in-place decode attention), built with `g++` on first use; 0 expands the blocks "
                "inside the step with XLA instead"),
    Setting("PANTHEON_NATIVE_DOT", "native_dot", _native_dot,
            doc="how the native kernels multiply a quantized weight: `int8` (the default) quantizes each "
                "activation row to 8 bits per block (power-of-two finer steps for sub-blocks of smaller "
                "values) and uses integer dot products, as llama.cpp does (~3x less work per weight; logits "
                "within llama.cpp's own distance from the f32 model, greedy tokens HF's or llama.cpp's where "
                "HF's top two are 0.5 apart or more); `exact` widens every weight to gguf's f32 value "
                "(bit-identical to the f32 product: the oracle tests' form). F16/BF16 weights are exact "
                "either way"),
    Setting("PANTHEON_FORBID_COMPILE", "forbid_compile", _flag,
            doc="1: a JAX compile in a serving driver after warm-up is an error"),
    Setting("PANTHEON_COMPILE_CACHE", "compile_cache", _flag,
            doc="0 disables the persistent compilation cache"),
    Setting("PANTHEON_WARMUP", "warmup", _flag,
            doc="0: the scheduler compiles bucket shapes on first use instead of at load (dev/tests)"),
    Setting("PANTHEON_WARMUP_BACKGROUND", "warmup_background", _flag,
            doc="1: a model is ready once the largest bucket of each step kind exists (any request fits it, "
                "padded); the other buckets compile in the `compile-<model>` thread while it serves, and the "
                "health routes say `compiled k/n`; 0: every bucket before ready"),
    Setting("PANTHEON_EXEC_STORE", "exec_store", _flag,
            doc="keep compiled step programs under `$PANTHEON_HOME/executables`, keyed by the model file, "
                "engine config, machine and versions, so a restart loads them instead of tracing and "
                "compiling; 0 turns it off"),
    Setting("PANTHEON_EXEC_STORE_MB", "exec_store_mb", _integer(low=0),
            doc="bound of the executable store (MiB): past it the least recently used models' programs go"),
    Setting("PANTHEON_DIE_BUDGET_MB", "die_budget_mb", _integer(),
            doc="memory budget per device when the backend reports none (CPU); else host RAM"),
    # -- the batch scheduler
    Setting("PANTHEON_BATCH_SLOTS", "batch_slots", _batch_slots, aliases=("QWEN35_BATCH_SLOTS",),
            doc="slots per model; `0`: the single-user setting (the same scheduler with one slot; a second "
                "concurrent request gets 429 at once); `1` means the default 8, as the seed's on switch did"),
    Setting("PANTHEON_PREFILL_CHUNK", "prefill_chunk", _integer(low=1), aliases=("QWEN35_BS_PREFILL_CHUNK",),
            doc="prefill chunk size (tokens): a prompt is fed in chunks of this many, decode steps of the "
                "other slots in between"),
    Setting("PANTHEON_QUEUE_DEPTH", "queue_depth", _integer(low=0), aliases=("BS_QUEUE_DEPTH",),
            doc="waiting requests beyond the free slots before 429 `Retry-After: 5`"),
    Setting("PANTHEON_QUEUE_WAIT_S", "queue_wait_s", _number(),
            doc="how long a queued request waits for a slot before 429"),
    Setting("PANTHEON_REQUEST_SLOT_SHARE", "request_slot_share", _number(low=0.0),
            doc="while a job of another request waits, one request's generations (a completion's prompts x "
                "`n`) are admitted into at most this share of the slots (at least one); so a waiting request "
                "takes the next slot that frees instead of queueing behind every generation of a big one"),
    Setting("PANTHEON_STEP_STATS", "bs_stats", _flag, aliases=("QWEN35_BS_STATS",),
            doc="1 logs every step (kind, width, tokens, device ms from dispatch to read, host ms of "
                "planning/dispatch/emit, start in s since load) to stderr"),
    Setting("PANTHEON_BS_MIXED", "bs_mixed", _flag,
            doc="a prefill chunk and the decode rows of the other slots share one forward (llama-family "
                "models); 0 alternates chunk and decode steps instead"),
    Setting("PANTHEON_SPECULATIVE", "speculative", _flag,
            doc="speculative decoding with prompt-lookup drafts for every request that does not opt out "
                "(`\"speculative\": false`): the step verifies up to PANTHEON_SPEC_K drafted tokens per slot and "
                "greedy (and seeded) output stays the same token for token (docs/speculative.md); 0 turns it off"),
    Setting("PANTHEON_SPEC_GAUGE", "spec_gauge", _flag,
            doc="verify steps run only while they measure at least as many tokens per second as plain decode "
                "steps (per decoding-slot count; a slower one rests speculation for 256 steps, then probes "
                "again); 0 always verifies drafts when there are some"),
    Setting("PANTHEON_SPEC_K", "spec_k", _integer(low=0),
            doc="the most draft tokens one verify step checks per slot (verify programs are made for this K "
                "and K / 2: fewer drafts ride padded); 0 makes no verify programs"),
    Setting("PANTHEON_DRAFT_MODEL", "draft_model", _stripped,
            doc="a draft model (catalog name or GGUF file) loaded beside each model with its slots and context: "
                "where prompt lookup finds nothing, it proposes greedy drafts the step verifies (same tokens "
                "with and without, docs/speculative.md). Its tokenizer must be the model's; `pantheon serve "
                "--draft-model`, or the admin load's `draft_model` per model"),
    # -- router registration (pantheon.serving.registration): all off unless PANTHEON_REGISTRY_URL is set
    Setting("PANTHEON_PREFIX_SNAPSHOT_MB", "prefix_snapshot_mb", _integer(low=0),
            doc="device memory per model for prefix snapshots of a recurrent model's slot state (Qwen3.5 / "
                "Qwen3-Next hybrids, RWKV-7), taken where prompt chunks end, so a later turn or a request "
                "sharing a prefix resumes from one instead of prefilling it again; least recently used "
                "evicted first; `0`: off"),
    Setting("PANTHEON_REGISTRY_URL", "registry_url", _url,
            doc="the router (SMG) to register every loaded model with, e.g. `http://10.0.0.1:30000`; unset: "
                "registration is off and no router traffic is sent"),
    Setting("PANTHEON_REGISTRY_KEY", "registry_key", _text,
            doc="bearer token for the router's control plane (`pantheon router` requires it from registrants "
                "when set); unset: no token is sent (never `PANTHEON_API_KEY`)"),
    Setting("PANTHEON_REGISTRY_WORKER_KEY", "registry_worker_key", _text,
            doc="the key the router presents to this server: registered as each worker's `api_key`, and "
                "accepted besides `PANTHEON_API_KEY` on the model roots `/m/<model>/...` only. Needed when "
                "`PANTHEON_API_KEY` is set (the router is refused otherwise); unset: the router is given no key"),
    Setting("PANTHEON_REGISTRY_TIMEOUT_S", "registry_timeout_s", _number(low=0.1),
            doc="one call to the router, from connecting to the reply's last byte (a router that trickles its "
                "reply is cut off there); also the longest an admin load / unload waits for the router's "
                "table to follow it; at least 0.1"),
    Setting("PANTHEON_REGISTRY_MAX_REPLY_BYTES", "registry_max_reply_bytes", _integer(low=64 * 1024),
            doc="the largest reply taken from the router (its `GET /workers` lists every worker of the fleet: "
                "raise it for a very large one); a larger one is refused unread and the call fails; at least 65536"),
    Setting("PANTHEON_NODE_ID", "node_id", _stripped,
            doc="the `node_id` label of this server's workers at the router"),
    Setting("PANTHEON_REGISTRY_TRANSPORT", "registry_transport", _stripped,
            doc="the `transport` label of this server's workers at the router"),
    Setting("PANTHEON_ADVERTISE_URL", "advertise_url", _url, shown_default="the bound address",
            doc="the base URL the router reaches this server at (set it when binding `0.0.0.0` behind NAT or "
                "a proxy)"),
    Setting("PANTHEON_REGISTRY_INTERVAL_S", "registry_interval_s", _number(low=0.2),
            doc="how often the keep-alive checks that the router still holds this server's workers (and "
                "registers them again after a router restart); at least 0.2"),
    # -- one model over several hosts (pantheon.serving.distributed)
    Setting("PANTHEON_COORDINATOR", "coordinator", _stripped,
            doc="one model over several hosts: `HOST:PORT` of process 0's `jax.distributed` coordination "
                "service (what `pantheon serve --coordinator` sets); unset: one process"),
    Setting("PANTHEON_NUM_PROCESSES", "num_processes", _integer(low=1),
            doc="processes in the cluster (`--num-processes`)"),
    Setting("PANTHEON_PROCESS_ID", "process_id", _integer(),
            doc="this process's rank (`--process-id`): 0 serves HTTP, the others only mirror its steps"),
    Setting("PANTHEON_CLUSTER_TIMEOUT_S", "cluster_timeout_s", _number(low=1.0),
            doc="how long start-up waits for every process to join (and each process's model load to be "
                "acknowledged, at least 600 s)"),
    Setting("PANTHEON_CLUSTER_SECRET", "cluster_secret", _secret, secret=True,
            doc="the secret every process of a cluster shares (at least 16 bytes, e.g. `openssl rand -hex 32`): "
                "the control channel runs a mutual HMAC handshake with it and authenticates every frame before "
                "it deserialises anything. A cluster refuses to start without it (or the file below) unless "
                "`PANTHEON_CLUSTER_TRUSTED_NETWORK=1`. Never logged"),
    Setting("PANTHEON_CLUSTER_SECRET_FILE", "cluster_secret_file", _home,
            doc="a file holding the cluster secret (surrounding whitespace dropped), read at start; set this or "
                "`PANTHEON_CLUSTER_SECRET`, not both"),
    Setting("PANTHEON_CLUSTER_TRUSTED_NETWORK", "cluster_trusted_network", _flag,
            doc="1: the operator states that only the cluster's processes can reach its ports, so a cluster may "
                "start without a secret (the channel then authenticates nothing; both ends log a warning)"),
    # -- set by the test suite only
    Setting("PANTHEON_TEST_PRESSURE", "test_pressure", _pressure, for_tests=True,
            doc="pin the memory-pressure level (0 OK, 1 ELEVATED, 2 HIGH, 3 CRITICAL) instead of measuring "
                "it, so tests can force admission denials"),
    Setting("PANTHEON_FIXTURES", "fixtures", _fixtures, for_tests=True,
            shown_default="`tests/fixtures` in the checkout (a copy of the oracle fixtures, see its PROVENANCE.md)",
            doc="the oracle fixtures directory (`tiny/`, `real/`) the tests and tools/make_random_qwen35moe.py "
                "read"),
    Setting("PANTHEON_TEST_TIER", "test_tier", _test_tier, for_tests=True,
            doc="`quick` (what `make test-quick` sets): the test helpers refuse to start a server, so a server "
                "test not marked `slow` fails loudly instead of slowing the quick tier; `full`: everything runs"),
)

_FIELD_DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(Settings)}


def _lookup(env: Mapping[str, str], row: Setting) -> tuple[str, str] | None:
    """The first of the row's names that is set to a non-empty value, and that value."""
    for name in (row.name, *row.aliases):
        raw = env.get(name)
        if raw:
            return name, raw
    return None


def load_settings(env: Mapping[str, str] | None = None) -> Settings:
    """Parse the environment (os.environ unless given) once, row by row; callers keep the result.

    A malformed value raises ValueError naming the variable as it was set (alias or not)."""
    env = dict(os.environ if env is None else env)
    values: dict[str, Any] = {}
    for row in SETTINGS:
        found = _lookup(env, row)
        value = None
        if found is not None:
            name, raw = found
            try:
                value = row.parse(raw)
            except ValueError as exc:
                shown = name if row.secret else f"{name}={raw!r}"
                raise ValueError(f"environment variable {shown} {exc}") from None
        values[row.field] = row.default() if value is None else value
    values["cluster_secret"] = _cluster_secret(values["cluster_secret"], values["cluster_secret_file"])
    return Settings(**values)


def _cluster_secret(given: bytes | None, path: Path | None) -> bytes | None:
    """The cluster's secret: PANTHEON_CLUSTER_SECRET's, or the contents of PANTHEON_CLUSTER_SECRET_FILE's
    file (whitespace around it dropped, so `openssl rand -hex 32 > f` works). Both at once is refused:
    which one wins would be a guess."""
    if path is None:
        return given
    if given is not None:
        raise ValueError("set PANTHEON_CLUSTER_SECRET or PANTHEON_CLUSTER_SECRET_FILE, not both")
    try:
        text = path.read_bytes().decode("utf-8", errors="replace")
    except OSError as exc:
        raise ValueError(f"environment variable PANTHEON_CLUSTER_SECRET_FILE={str(path)!r}: the file cannot be "
                         f"read ({exc.strerror})") from None
    try:
        return _secret(text)
    except ValueError as exc:
        raise ValueError(f"the cluster secret in PANTHEON_CLUSTER_SECRET_FILE {exc}") from None


def setting(name: str) -> Setting:
    """The row that reads `name`, whether it is the PANTHEON_* name or an alias."""
    for row in SETTINGS:
        if name == row.name or name in row.aliases:
            return row
    raise KeyError(name)


# docs/settings.md holds the generated table between these two lines (tools/settings_doc.py rewrites it).
TABLE_BEGIN = "<!-- settings table: generated from pantheon.config.SETTINGS by tools/settings_doc.py -->"
TABLE_END = "<!-- end of settings table -->"


def settings_table_markdown() -> str:
    """The settings table of docs/settings.md, generated so the page cannot drift from `SETTINGS`."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    lines = ["| variable | aliases | default | meaning |", "|---|---|---|---|"]
    for row in SETTINGS:
        aliases = ", ".join(f"`{a}`" for a in row.aliases)
        meaning = ("*tests only:* " if row.for_tests else "") + row.doc
        lines.append(f"| `{row.name}` | {aliases} | {cell(row.shown())} | {cell(meaning)} |")
    return "\n".join(lines) + "\n"
