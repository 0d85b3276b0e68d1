"""llama.cpp's server on the same workloads as tools/spec_bench.py, one stream: its own decode timings.

Starts `llama-server -np 1 -t 2 --spec-type SPEC` on FILE, sends each workload (greedy chat, N tokens,
no prompt cache) three times and prints the best `timings.predicted_per_second` of the last two, with
its draft counts. Usage (the llama-server path is the first argument's neighbour by default):

    python tools/spec_bench_llamacpp.py FILE.gguf none|ngram-simple|... N [LLAMA_SERVER]
"""
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from spec_bench import WORKLOADS  # noqa: E402

PORT = 18931


def chat(ask: str, n: int) -> dict:
    """One greedy chat of at most `n` tokens; llama-server's `timings` of it."""
    body = json.dumps({"messages": [{"role": "user", "content": ask}], "max_tokens": n, "temperature": 0,
                       "cache_prompt": False}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{PORT}/v1/chat/completions", body,
                                 {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=600)).get("timings", {})


def main() -> None:
    model, spec, ntok = sys.argv[1], sys.argv[2], int(sys.argv[3])
    server = sys.argv[4] if len(sys.argv) > 4 else "llama-server"
    args = [server, "-m", model, "--host", "127.0.0.1", "--port", str(PORT), "-c", "4096", "-np", "1", "-t", "2",
            "--spec-type", spec]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(120):  # until it answers /health (the load takes seconds)
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=2).status == 200:
                    break
            except OSError:
                time.sleep(1)
        for name, ask in WORKLOADS.items():
            runs = [chat(ask, ntok) for _ in range(3)]  # the first warms up
            best = max(t.get("predicted_per_second", 0.0) for t in runs[1:])
            last = runs[-1]
            print(f"llama.cpp {Path(model).name} {name} spec={spec} tokens={last.get('predicted_n')} "
                  f"best={best:.1f} tok/s draft={last.get('draft_n')} accepted={last.get('draft_n_accepted')}",
                  flush=True)
    finally:
        proc.terminate()
        proc.wait()


if __name__ == "__main__":
    main()
