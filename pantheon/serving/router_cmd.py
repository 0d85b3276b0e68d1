"""`pantheon router`: start SMG (the `smg` gateway, `pip install 'pantheon[router]'`) set up for Pantheon.

Pantheon servers started with PANTHEON_REGISTRY_URL pointing at it register their models themselves,
so the router starts with no workers. The defaults, and why:

* both listeners (the OpenAI API and SMG's Prometheus port) bind to 127.0.0.1 unless `--host` /
  `--metrics-host` say otherwise: the control plane (`POST /workers`) must not face a network by
  accident; with PANTHEON_REGISTRY_KEY set it requires that key as a bearer token
  (`--control-plane-api-keys`), which is what the Pantheon servers present;
* with PANTHEON_API_KEY set, the router's OpenAI API requires that key from its clients
  (`--api-key`), as each server would; without it the router answers anyone who can reach it
  (each server still requires its own key: the router presents the one it registered with);
* session affinity: `--policy consistent_hashing` keyed by `X-Session-Id` or `X-SMG-Routing-Key`
  (SMG forwards the latter, which Pantheon reads as the session id), so a conversation stays on the
  instance that holds its prefix cache; a saturated instance is still skipped (SMG's overload
  protection reads the `token_usage` and waiting count of each worker's `/v1/loads`);
* health probes and load polls every few seconds, so a dead instance leaves the rotation and a
  restarted one comes back within seconds, not SMG's minute-scale defaults.

Anything after `--` goes to `smg launch` unchanged (and wins over these defaults).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

SMG_MISSING = "pantheon router needs the SMG gateway: pip install 'pantheon[router]' (or pip install smg)"
CONTROL_KEY_ID = "pantheon:pantheon-registry:admin"  # SMG's id:name:role prefix of a control-plane key


def smg_argv(args: argparse.Namespace, registry_key: str | None, api_key: str | None = None) -> list[str]:
    """The `smg launch` command line for `pantheon router`'s arguments and the keys from the
    environment (PANTHEON_REGISTRY_KEY for the control plane, PANTHEON_API_KEY for clients)."""
    argv = [sys.executable, "-m", "smg", "launch",
            "--host", args.host, "--port", str(args.port),
            "--prometheus-host", args.metrics_host, "--prometheus-port", str(args.metrics_port),
            "--policy", args.policy,
            "--routing-key-headers", "x-session-id", "x-smg-routing-key",
            "--health-check-interval-secs", str(args.health_interval),
            "--load-monitor-interval", str(args.load_interval),
            "--log-level", args.log_level]
    if args.worker:
        argv += ["--worker-urls", *args.worker]
    if registry_key:
        argv += ["--control-plane-api-keys", f"{CONTROL_KEY_ID}:{registry_key}"]
    if api_key:  # clients of the router present it, as they would to one server; SMG passes it on to workers
        argv += ["--api-key", api_key]
    extra = list(args.smg_args or [])
    if extra and extra[0] == "--":
        extra = extra[1:]
    return argv + extra


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("router", help="start the SMG router that Pantheon servers register with",
                       description="Start SMG with Pantheon's defaults; extra `smg launch` flags go after --.")
    p.add_argument("--host", default="127.0.0.1", help="bind address of the router's API (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--metrics-host", default="127.0.0.1", help="bind address of SMG's Prometheus port")
    p.add_argument("--metrics-port", type=int, default=29000)
    p.add_argument("--policy", default="consistent_hashing",
                   help="SMG routing policy (default consistent_hashing: sessions stick to an instance)")
    p.add_argument("--health-interval", type=int, default=3, help="seconds between worker health probes")
    p.add_argument("--load-interval", type=int, default=2, help="seconds between worker load polls")
    p.add_argument("--log-level", default="warn", choices=("debug", "info", "warn", "error"))
    p.add_argument("--worker", action="append", default=[],
                   help="a worker URL to start with (repeatable; registered servers need none)")
    p.add_argument("smg_args", nargs=argparse.REMAINDER, help="-- then flags for `smg launch`")
    p.set_defaults(fn=run)


def run(args: argparse.Namespace) -> int:
    """Replace this process with SMG (signals and exit status are then SMG's own)."""
    if importlib.util.find_spec("smg") is None:
        print(f"pantheon: {SMG_MISSING}", file=sys.stderr)
        return 1
    from pantheon.config import load_settings
    settings = load_settings()
    argv = smg_argv(args, settings.registry_key, settings.api_key)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, argv)
    return 0  # not reached
