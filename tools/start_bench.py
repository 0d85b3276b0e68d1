"""Start to ready, cold and warm, of `pantheon serve` on one file: the figure issue 29 is judged by.

Why a script: a cold start needs an empty `PANTHEON_HOME` (no compile cache, no stored executables,
no built kernels) holding only the model, and a warm start is the second start on that home. This
makes the home, runs `tools/serve_memory.py` twice (ready = `GET /` 200; settled = every program made,
the `progress` key gone; then one chat request) and prints one JSON line per start. It runs wherever
Pantheon runs: on a lent GPU it gives the device's cold and warm start of the 7B-shaped file.

    python tools/start_bench.py /tmp/sized/qwen2-7b.gguf --name qwen2-7b
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf")
    ap.add_argument("--name", default="model")
    ap.add_argument("--port", type=int, default=8097)
    ap.add_argument("--timeout", type=float, default=1800.0)
    args = ap.parse_args(argv)
    home = Path(tempfile.mkdtemp(prefix="pantheon-start-"))
    (home / "models").mkdir()
    os.symlink(Path(args.gguf).resolve(), home / "models" / f"{args.name}.gguf")
    url = f"http://127.0.0.1:{args.port}"
    pantheon = Path(sys.executable).with_name("pantheon")
    try:
        for run in ("cold", "warm"):
            cmd = [sys.executable, str(ROOT / "tools" / "serve_memory.py"), "--ready", url + "/", "--settled", url + "/",
                   "--request", url + "/v1/chat/completions", "--hold", "1", "--timeout", str(args.timeout), "--",
                   str(pantheon), "serve", "--model", f"{args.name}={args.gguf}", "--port", str(args.port)]
            out = subprocess.run(cmd, env={**os.environ, "PANTHEON_HOME": str(home)}, capture_output=True, text=True)
            row: dict = {"file": args.name, "start": run}
            for line in out.stdout.splitlines():
                if line.startswith("{"):
                    row.update(json.loads(line))
            print(json.dumps(row), flush=True)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
