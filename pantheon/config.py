"""Every environment variable Pantheon reads, parsed in one place into a frozen dataclass.

The README's table documents each one; nothing else in the code calls os.environ for configuration.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path


def _flag(env: dict[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    return raw.strip().lower() not in ("0", "false", "no", "off")


def _int(env: dict[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw)
    except ValueError as exc:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from exc


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


def _float(env: dict[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return float(raw)
    except ValueError as exc:
        raise ValueError(f"environment variable {name}={raw!r} is not a number") from exc


@dataclass(frozen=True)
class Settings:
    home: Path
    models: tuple[str, ...] = ()
    api_key: str | None = None
    admin_key: str | None = None
    model_dir: Path | None = None
    cors_origins: tuple[str, ...] = ()
    max_body_bytes: int = 4 * 1024 * 1024
    # Slow clients (pantheon.web.body, pantheon.web.worker): the request line and headers (and a
    # kept-alive connection's wait for its next request) must arrive within header_timeout_s; the
    # body within body_timeout_s and at body_min_rate bytes/s or faster after a short grace.
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    body_min_rate: float = 1024.0
    max_connections: int = 1000  # open connections per worker; past it the oldest idle or slow one is dropped
    dtype: str = "auto"
    max_seq: int = 2048
    forbid_compile: bool = False
    compile_cache: bool = True
    batch_slots: int = 8
    prefill_chunk: int = 128
    queue_depth: int = 32
    queue_wait_s: float = 30.0
    # Tokens one embeddings request may carry, its inputs summed; beyond it, 400 (pantheon.web.embeddings).
    # Why a cap: it bounds one request's work, memory and answer (a 2048-input request of ~1M tokens
    # held the model's slots for minutes); a client splits larger work over several requests.
    embed_max_tokens: int = 65536
    bs_stats: bool = False
    bs_mixed: bool = True
    die_budget_mb: int = 0
    warmup: bool = True
    native_matmul: bool = True
    kv_dtype: str = "auto"  # KV cache dtype: auto (float16 on CPU, bfloat16 on GPU) | float32 | float16 | bfloat16
    # Test-only (PANTHEON_TEST_PRESSURE=0..3): the memory watch reports the host at this pressure level
    # (OK, ELEVATED, HIGH, CRITICAL) instead of measuring it, so tests can force admission denials.
    test_pressure: int | None = None
    # Router registration (pantheon.serving.registration): all off unless registry_url is set.
    registry_url: str | None = None  # the router's base URL (SMG), e.g. http://10.0.0.1:30000
    registry_key: str | None = None  # bearer token for the router's control plane
    node_id: str = "node0"
    registry_transport: str = "local"
    advertise_url: str | None = None  # how the router reaches this server; default: the bound address
    registry_interval_s: float = 5.0  # keep-alive: how often the router's view is checked
    # One model over several hosts (pantheon.serving.distributed): process 0 of num_processes serves HTTP, the
    # others mirror its steps. coordinator is HOST:PORT of process 0's jax.distributed service.
    coordinator: str | None = None
    num_processes: int = 1
    process_id: int = 0
    cluster_timeout_s: float = 120.0  # start-up wait for every process to join (and their loads' acks)
    extra: dict[str, str] = field(default_factory=dict, compare=False, hash=False)


def load_settings(env: dict[str, str] | None = None) -> Settings:
    """Read the environment once; callers keep the returned object."""
    env = dict(os.environ if env is None else env)
    home = Path(env.get("PANTHEON_HOME") or Path.home() / ".cache" / "pantheon").expanduser()
    models = split_model_specs(env.get("PANTHEON_MODELS") or "")
    origins = tuple(o.strip() for o in (env.get("PANTHEON_CORS_ORIGINS") or "").split(",") if o.strip())
    model_dir = env.get("PANTHEON_MODEL_DIR")
    raw_slots = env.get("QWEN35_BATCH_SLOTS")
    batch_slots = 8 if raw_slots in (None, "") else _int(env, "QWEN35_BATCH_SLOTS", 8)
    if batch_slots == 1 and raw_slots is not None:
        # The seed used QWEN35_BATCH_SLOTS=1 to mean "batching on"; keep that meaning.
        batch_slots = 8
    return Settings(
        home=home,
        models=models,
        api_key=env.get("PANTHEON_API_KEY") or None,
        admin_key=env.get("PANTHEON_ADMIN_KEY") or None,
        model_dir=Path(model_dir).expanduser().resolve() if model_dir else None,
        cors_origins=origins,
        max_body_bytes=_int(env, "PANTHEON_MAX_BODY_BYTES", 4 * 1024 * 1024),
        header_timeout_s=max(0.1, _float(env, "PANTHEON_HEADER_TIMEOUT_S", 10.0)),
        body_timeout_s=max(0.1, _float(env, "PANTHEON_BODY_TIMEOUT_S", 30.0)),
        body_min_rate=max(0.0, _float(env, "PANTHEON_BODY_MIN_RATE", 1024.0)),
        max_connections=max(8, _int(env, "PANTHEON_MAX_CONNECTIONS", 1000)),
        dtype=env.get("PANTHEON_DTYPE", "auto"),
        max_seq=_int(env, "QWEN35_MAX_SEQ", 2048),
        forbid_compile=_flag(env, "PANTHEON_FORBID_COMPILE", False),
        compile_cache=_flag(env, "PANTHEON_COMPILE_CACHE", True),
        batch_slots=max(0, batch_slots),
        prefill_chunk=max(1, _int(env, "QWEN35_BS_PREFILL_CHUNK", 128)),
        queue_depth=max(0, _int(env, "BS_QUEUE_DEPTH", 32)),
        queue_wait_s=_float(env, "PANTHEON_QUEUE_WAIT_S", 30.0),
        embed_max_tokens=max(1, _int(env, "PANTHEON_EMBED_MAX_TOKENS", 65536)),
        bs_stats=_flag(env, "QWEN35_BS_STATS", False),
        bs_mixed=_flag(env, "PANTHEON_BS_MIXED", True),
        die_budget_mb=_int(env, "PANTHEON_DIE_BUDGET_MB", 0),
        warmup=_flag(env, "PANTHEON_WARMUP", True),
        native_matmul=_flag(env, "PANTHEON_NATIVE_MATMUL", True),
        kv_dtype=_kv_dtype(env),
        test_pressure=_test_pressure(env),
        registry_url=_url(env, "PANTHEON_REGISTRY_URL"),
        registry_key=env.get("PANTHEON_REGISTRY_KEY") or None,
        node_id=(env.get("PANTHEON_NODE_ID") or "node0").strip() or "node0",
        registry_transport=(env.get("PANTHEON_REGISTRY_TRANSPORT") or "local").strip() or "local",
        advertise_url=_url(env, "PANTHEON_ADVERTISE_URL"),
        registry_interval_s=max(0.2, _float(env, "PANTHEON_REGISTRY_INTERVAL_S", 5.0)),
        coordinator=(env.get("PANTHEON_COORDINATOR") or "").strip() or None,
        num_processes=max(1, _int(env, "PANTHEON_NUM_PROCESSES", 1)),
        process_id=_int(env, "PANTHEON_PROCESS_ID", 0),
        cluster_timeout_s=max(1.0, _float(env, "PANTHEON_CLUSTER_TIMEOUT_S", 120.0)),
    )


def _url(env: dict[str, str], name: str) -> str | None:
    """An http(s) base URL without a trailing slash, or None when unset or empty."""
    raw = (env.get(name) or "").strip().rstrip("/")
    if not raw:
        return None
    if not raw.startswith(("http://", "https://")):
        raise ValueError(f"environment variable {name}={raw!r} must be an http:// or https:// URL")
    return raw


def _kv_dtype(env: dict[str, str]) -> str:
    raw = (env.get("PANTHEON_KV_DTYPE") or "auto").strip().lower()
    names = {"auto": "auto", "f32": "float32", "float32": "float32", "f16": "float16", "float16": "float16",
             "bf16": "bfloat16", "bfloat16": "bfloat16"}
    if raw not in names:
        raise ValueError(f"environment variable PANTHEON_KV_DTYPE={raw!r} must be auto, float32, float16 or bfloat16")
    return names[raw]


def _test_pressure(env: dict[str, str]) -> int | None:
    raw = env.get("PANTHEON_TEST_PRESSURE")
    if raw is None or raw.strip() == "":
        return None
    level = _int(env, "PANTHEON_TEST_PRESSURE", 0)
    if not 0 <= level <= 3:
        raise ValueError(f"environment variable PANTHEON_TEST_PRESSURE={raw!r} must be 0..3")
    return level
