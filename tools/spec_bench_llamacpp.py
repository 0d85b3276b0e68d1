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
model, spec, ntok = sys.argv[1], sys.argv[2], int(sys.argv[3])
port = 18931
server = sys.argv[4] if len(sys.argv) > 4 else "llama-server"
args = [server, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-c", "4096",
        "-np", "1", "-t", "2", "--spec-type", spec]
p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
try:
    for _ in range(120):
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200: break
        except Exception: time.sleep(1)
    for name, ask in WORKLOADS.items():
        best, n = 0.0, 0
        for rep in range(3):
            body = json.dumps({"messages": [{"role": "user", "content": ask}], "max_tokens": ntok, "temperature": 0,
                               "cache_prompt": False}).encode()
            r = json.load(urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                                                        {"Content-Type": "application/json"}), timeout=600))
            t = r.get("timings", {})
            if rep: best = max(best, t.get("predicted_per_second", 0.0))
            n = t.get("predicted_n")
            dn, da = t.get("draft_n"), t.get("draft_n_accepted")
        print(f"llama.cpp {model.split('/')[-1]} {name} spec={spec} tokens={n} best={best:.1f} tok/s draft={dn} accepted={da}", flush=True)
finally:
    p.terminate(); p.wait()
