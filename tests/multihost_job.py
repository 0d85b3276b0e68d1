"""One process of a two-process engine job for tests/test_multihost.py (not a test itself).

`python tests/multihost_job.py follow-when-told PORT`: process 1 of a two-process `pantheon serve` cluster
that joins jax.distributed at once but the control channel only when a line arrives on stdin (a slow
host: the leader's control port stays open meanwhile).

`python tests/multihost_job.py PORT PROCESS_ID OUT.npz`: process 0 loads the tiny llama fixture over
the 4 dies of both processes through pantheon.serving.distributed, computes teacher-forced logits, a greedy
continuation, one two-row batched step, and two models generating from two threads at once, and writes them to OUT.npz; process 1 mirrors it until
process 0 stops the cluster. Each process sees 2 CPU devices (XLA_FLAGS set by the caller).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import TINY  # noqa: E402

from pantheon.serving import distributed
from pantheon.runtime import engine  # noqa: E402
from pantheon.runtime.sampler import SamplingParams  # noqa: E402
from pantheon.runtime import reference  # noqa: E402

OPTS = engine.LoadOptions(n_slots=2, max_seq=64, prefill_chunk=16, kv_dtype="float32")
TWO_MODEL_PROMPT = list(range(3, 15))


def batched_steps(model, prompt: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Slots 0 and 1 take two prompts (one chunk each), then decode one token each in one step:
    (the first tokens, the decode step's tokens, its logits [2, V])."""
    from pantheon.runtime.decode_state import slot_insert
    from pantheon.runtime.engine import Chunk, StepPlan
    greedy = SamplingParams(temperature=0.0, seed=0)
    state = model.new_state()
    first = []
    for slot, part in ((0, prompt[:5]), (1, prompt[5:12])):
        state = model.insert(state, slot_insert(slot, part, 0, greedy, 8, ()))
        h, state = model.step(state, StepPlan(chunk=Chunk(slot, tuple(part), 0, True)))
        first.append(int(model.read(h)[0, 0]))
    h, state = model.step(state, StepPlan(decode=(0, 1), reach=8), want_logits=True)
    second = model.read(h)[:, 0]
    logits = engine._to_host(h.logits)[:2]
    return np.asarray(first), second, logits


def follow_when_told(port: int) -> int:
    from pantheon.config import load_settings
    spec = distributed.ClusterSpec(f"127.0.0.1:{port}", 2, 1, 120.0, secret=load_settings().cluster_secret)
    distributed.initialize(spec)
    print("joined jax.distributed; waiting to be told", flush=True)
    sys.stdin.readline()
    return distributed.run_follower(spec)


def main() -> int:
    if sys.argv[1] == "follow-when-told":
        return follow_when_told(int(sys.argv[2]))
    port, pid, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    from pantheon.config import load_settings
    # the cluster secret comes from the environment, as `pantheon serve` reads it
    spec = distributed.ClusterSpec(f"127.0.0.1:{port}", 2, pid, 90.0, secret=load_settings().cluster_secret)
    if pid != 0:
        return distributed.run_follower(spec)
    leader = distributed.start_leader(spec)
    fixture = json.loads((TINY / "llama.json").read_text())
    model = leader.load(TINY / "llama.gguf", OPTS, [0, 1, 2, 3])
    prompt = fixture["prompt_ids"]
    logits = reference.logits(model, prompt)
    t0 = time.perf_counter()
    greedy = list(reference.generate(model, prompt, SamplingParams(temperature=0.0), max_tokens=len(fixture["greedy_ids"]),
                                 stop_ids=[]))
    gen_s = time.perf_counter() - t0
    first, second, batch_logits = batched_steps(model, prompt)
    # Two models on the same dies, stepped from two threads at once (as two schedulers would).
    import threading
    other = leader.load(TINY / "qwen2.gguf", OPTS, [0, 1, 2, 3])
    both: dict[str, list[int]] = {}

    def run(name: str, m) -> None:
        both[name] = list(reference.generate(m, TWO_MODEL_PROMPT, SamplingParams(temperature=0.0), max_tokens=20, stop_ids=[]))

    threads = [threading.Thread(target=run, args=(n, m), name=f"job-{n}") for n, m in (("llama", model),
                                                                                      ("qwen2", other))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    np.savez(out, logits=logits, greedy=np.asarray(greedy), first=first, second=second,
             batch_logits=batch_logits, gen_s=gen_s, devices=len(model.devices),
             both_llama=np.asarray(both.get("llama", [])), both_qwen2=np.asarray(both.get("qwen2", [])))
    leader.stop()
    sys.stdout.flush()
    os._exit(0)  # as a follower would: no exit-time barrier with a process that has already gone


if __name__ == "__main__":
    raise SystemExit(main())
