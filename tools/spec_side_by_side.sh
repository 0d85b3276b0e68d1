#!/usr/bin/env bash
# Speculative decoding side by side with llama.cpp's server (issue 33): the same file, the same chats,
# the same load generator (`pantheon bench serve --compare`), 1 and 8 streams, greedy.
#
#   tools/spec_side_by_side.sh CATALOG_NAME LLAMA_SERVER [OUT_DIR]
#   (REQUESTS=8 per level and round, WORKLOADS="code-edit free-chat", PY=python in the environment)
#
# Starts Pantheon (`pantheon serve`, speculation on by default) and two llama.cpp servers on the same
# GGUF (-np 8 -t 2: plain, and --spec-type ngram-simple, its prompt-lookup mode), writes two datasets
# (code-edit: rewrite a code block with a function renamed, 8 names; free-chat: 8 short stories), and
# for each runs Pantheon-on vs llama.cpp plain, Pantheon-on vs llama.cpp n-gram, and Pantheon with
# `"speculative": false` vs llama.cpp plain. Each table is printed and kept in OUT_DIR.
set -euo pipefail
name=$1 llama=$2 out=${3:-/tmp/spec-side-by-side} requests=${REQUESTS:-8}
mkdir -p "$out"
py=${PY:-python}
gguf=$($py -c "from pantheon.formats.catalog import resolve_model; print(resolve_model('$name', progress=False))")
P=18170 L=18171 N=18172
$py - "$out" <<'PY'
import json, sys
sys.path.insert(0, "tools")
from spec_bench import CODE
out = sys.argv[1]
names = ["read_config", "fetch_config", "get_config", "open_config", "parse_config", "load_settings", "read_settings",
         "load_conf"]
with open(f"{out}/code-edit.jsonl", "w") as f:
    for n in names:
        ask = (f"Rewrite this Python code with the function load_config renamed to {n}. Output only the full code."
               f"\n\n```python\n{CODE}```")
        f.write(json.dumps({"messages": [{"role": "user", "content": ask}]}) + "\n")
topics = ["a robot who learns to paint", "a lighthouse keeper and a storm", "a cat who runs a bakery",
          "two friends lost in a forest", "a girl who can talk to birds", "an old clock that stops time",
          "a dragon afraid of fire", "a sailor who finds a map"]
with open(f"{out}/free-chat.jsonl", "w") as f:
    for t in topics:
        f.write(json.dumps({"messages": [{"role": "user", "content": f"Write a short story about {t}."}]}) + "\n")
PY
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true' EXIT
$py -m pantheon.cli serve --model "$name" --host 127.0.0.1 --port $P > "$out/pantheon.log" 2>&1 & pids+=($!)
"$llama" -m "$gguf" --host 127.0.0.1 --port $L -c 16384 -np 8 -t 2 > "$out/llama-plain.log" 2>&1 & pids+=($!)
"$llama" -m "$gguf" --host 127.0.0.1 --port $N -c 16384 -np 8 -t 2 --spec-type ngram-simple \
    > "$out/llama-ngram.log" 2>&1 & pids+=($!)
for port in $P $L $N; do  # ready: 200 on /health, and Pantheon's background compile done
    for _ in $(seq 900); do
        body=$(curl -sf "http://127.0.0.1:$port/health" || true)
        [[ -n "$body" && "$body" != *progress* ]] && break
        sleep 1
    done
done
bench() {  # label, dataset, compare port, extra body
    $py -m pantheon.cli bench serve --url "http://127.0.0.1:$P" --model "$name" --compare "http://127.0.0.1:$3" \
        --dataset "$out/$2.jsonl" --concurrency 1,8 --requests "$requests" --gen 128 --rounds 2 --no-progress \
        --extra-body "$4" | tee "$out/$1.txt"
}
for w in ${WORKLOADS:-code-edit free-chat}; do
    bench "$w-on-vs-plain" $w $L '{"temperature": 0}'
    bench "$w-on-vs-ngram" $w $N '{"temperature": 0}'
    bench "$w-off-vs-plain" $w $L '{"temperature": 0, "speculative": false}'
done
curl -s "http://127.0.0.1:$P/metrics" | grep '^pantheon_speculative' > "$out/pantheon-spec-metrics.txt" || true
