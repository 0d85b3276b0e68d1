"""Start a server, sample its memory until it is ready, then keep it serving: start-to-ready, peak RSS
during load, RSS after warm-up.

Memory is a figure like speed: this runs any server command (Pantheon's or llama-server) as a child,
samples the RSS of its whole process tree (gunicorn master + worker) every 50 ms, and polls `--ready`
until it answers 200. It prints one JSON line when ready (seconds from start to ready, peak tree
RSS so far, tree RSS now) and, on SIGINT/SIGTERM or when `--hold` seconds have passed, a final line
with the peak over the whole run and the RSS at the end (after whatever load a benchmark put on it).

    python tools/serve_memory.py --ready http://127.0.0.1:8000/ --hold 600 -- \\
        .venv/bin/pantheon serve --model qwen-0.5b --port 8000
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import psutil


def tree_rss(proc: psutil.Process) -> int:
    """RSS of a process and all its descendants (bytes)."""
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            continue
    return total


def ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except Exception:
        return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ready", required=True, help="URL that answers 200 once the server can serve")
    ap.add_argument("--hold", type=float, default=0.0, help="keep serving this many seconds after ready")
    ap.add_argument("--timeout", type=float, default=900.0, help="give up if not ready after this")
    ap.add_argument("--settled", help="URL whose JSON carries a \"progress\" key while programs still compile "
                                       "(Pantheon's GET /): also report when it is gone (every program made)")
    ap.add_argument("--request", help="an OpenAI /v1/chat/completions URL: after settling, send one short chat "
                                      "and report the RSS after serving it")
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd and args.cmd[0] == "--" else args.cmd
    t0 = time.monotonic()
    child = subprocess.Popen(cmd)
    proc = psutil.Process(child.pid)
    peak = [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], tree_rss(proc))
            stop.wait(0.05)

    threading.Thread(target=sample, daemon=True, name="rss-sampler").start()
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    while not ready(args.ready):
        if child.poll() is not None or time.monotonic() - t0 > args.timeout:
            print(json.dumps({"error": "not ready", "exit": child.poll()}), flush=True)
            child.terminate()
            return 1
        time.sleep(0.2)
    print(json.dumps({"ready_s": round(time.monotonic() - t0, 1), "peak_load_rss_gb": round(peak[0] / 1e9, 3),
                      "rss_ready_gb": round(tree_rss(proc) / 1e9, 3)}), flush=True)
    if args.settled:
        while True:
            try:
                with urllib.request.urlopen(args.settled, timeout=5) as r:
                    if "progress" not in json.loads(r.read() or b"{}"):
                        break
            except Exception:
                pass
            if child.poll() is not None:
                break
            time.sleep(0.5)
        print(json.dumps({"settled_s": round(time.monotonic() - t0, 1), "rss_settled_gb": round(tree_rss(proc) / 1e9, 3)}),
              flush=True)
    if args.request:
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "Say hello."}],
                           "max_tokens": 16, "temperature": 0}).encode()
        req = urllib.request.Request(args.request, body, {"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=300).read()
        except Exception as exc:
            print(json.dumps({"request_error": str(exc)}), flush=True)
        print(json.dumps({"rss_served_gb": round(tree_rss(proc) / 1e9, 3)}), flush=True)
    done.wait(args.hold if args.hold > 0 else None)
    print(json.dumps({"peak_rss_gb": round(peak[0] / 1e9, 3), "rss_end_gb": round(tree_rss(proc) / 1e9, 3)}),
          flush=True)
    stop.set()
    child.terminate()
    try:
        child.wait(30)
    except subprocess.TimeoutExpired:
        child.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
