"""`pantheon serve`: check the model specs, fetch catalog models, then exec gunicorn with one gevent worker.

Everything is handed to the worker through the environment (PANTHEON_MODELS, `;`-separated), so
`pantheon serve --model a --model b@0,1` and `PANTHEON_MODELS='a;b@0,1' gunicorn -k
pantheon.web.worker.PantheonWorker -w 1 'pantheon.web:create_app()'` start the same server. One worker, because models live in its memory;
concurrency comes from gevent (requests) and the backends' OS threads (generation). No `--preload`:
JAX must first be touched after the fork.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from pantheon.errors import PantheonError


def bind_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


WORKER_CLASS = "pantheon.web.worker.PantheonWorker"  # gevent, plus deadlines, a connection cap, JSON errors


def gunicorn_argv(host: str, port: int, timeout: int) -> list[str]:
    # --keep-alive must be non-zero: gunicorn then reads every request line and headers under the
    # worker's header deadline (PANTHEON_HEADER_TIMEOUT_S), which also bounds the keep-alive idle time.
    return [sys.executable, "-m", "gunicorn", "-k", WORKER_CLASS, "-w", "1", "-b", bind_address(host, port),
            "--timeout", str(max(0, timeout)), "--graceful-timeout", "10", "--keep-alive", "5",
            "pantheon.web:create_app()"]


def with_mmproj(specs: list[str], mmproj: str) -> list[str]:
    """The one model spec of `specs` with `?mmproj=PROJ` (an absolute path: the worker's directory may
    differ) written before its die list: what `--mmproj` means."""
    if len(specs) != 1:
        raise ValueError("--mmproj needs exactly one --model (or write MODEL?mmproj=PROJ in each spec)")
    head, at, tail = specs[0].rpartition("@")
    base, dies = (head, "@" + tail) if at and tail.replace(",", "").isdigit() else (specs[0], "")
    return [f"{base}?mmproj={Path(mmproj).expanduser().resolve()}{dies}"]


def serve(args: argparse.Namespace) -> int:
    """Validate `--model` specs, pull catalog models (with progress, here rather than in the worker),
    then replace this process with gunicorn. Returns only on a bad argument."""
    from pantheon.formats.catalog import DEFAULT_MODEL, resolve_model
    from pantheon.config import load_settings, split_model_specs
    from pantheon.serving.registry import parse_spec

    specs = [s for m in (args.model or []) for s in split_model_specs(m)]
    mmproj = getattr(args, "mmproj", None)
    if mmproj:  # `--mmproj PROJ` belongs to the one `--model` beside it
        try:
            specs = with_mmproj(specs, mmproj)
        except ValueError as exc:
            print(f"pantheon: {exc}", file=sys.stderr)
            return 2
    if not specs:
        try:
            specs = list(load_settings().models) or [DEFAULT_MODEL]
        except ValueError as exc:
            print(f"pantheon: {exc}", file=sys.stderr)
            return 2
    for text in specs:
        try:
            spec = parse_spec(text)
        except ValueError as exc:
            print(f"pantheon: {exc}", file=sys.stderr)
            return 2
        try:
            resolve_model(spec.source)  # a catalog name is downloaded now, with a progress bar
        except PantheonError as exc:
            print(f"pantheon: {exc}", file=sys.stderr)
            return 1
    env = dict(os.environ, PANTHEON_MODELS=";".join(specs))
    draft = getattr(args, "draft_model", None)
    if draft:  # pulled here like the models; an absolute path, since the worker's directory may differ
        try:
            env["PANTHEON_DRAFT_MODEL"] = str(resolve_model(draft).expanduser().resolve())
        except PantheonError as exc:
            print(f"pantheon: --draft-model: {exc}", file=sys.stderr)
            return 1
    for flag, var in (("coordinator", "PANTHEON_COORDINATOR"), ("num_processes", "PANTHEON_NUM_PROCESSES"),
                      ("process_id", "PANTHEON_PROCESS_ID")):
        value = getattr(args, flag, None)
        if value is not None:
            env[var] = str(value)
    from pantheon.serving.distributed import run_follower, spec_from_settings
    try:
        cluster = spec_from_settings(load_settings(env))
    except ValueError as exc:
        print(f"pantheon: {exc}", file=sys.stderr)
        return 2
    if cluster is not None and not cluster.is_leader:  # a follower serves no HTTP: it mirrors process 0
        os.environ.update(env)
        return run_follower(cluster)
    argv = gunicorn_argv(args.host, args.port, int(getattr(args, "timeout", 0) or 0))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, argv, env)
    return 0  # not reached
