"""Single-stream decode speed with and without speculative decoding, through the batch scheduler.

Loads a GGUF, runs each workload once to compile its shapes, then times it with prompt-lookup
speculation off and on (alternating, best of `--reps`): decode tokens/s from the first token to the
last, and the acceptance the scheduler counted. The tokens of both runs are compared (they must be
the same: docs/speculative.md). Usage:

    python tools/spec_bench.py ~/.cache/pantheon/models/smollm2-135m.gguf [--streams 1] [--tokens 200]
        [--draft-model DRAFT.gguf] [--workloads free-chat,code-edit]

`--draft-model`: a draft model loaded beside it (docs/speculative.md), drafting where prompt lookup
finds nothing; its drafted / accepted counts are printed beside prompt lookup's.
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

from pantheon.config import load_settings
from pantheon.runtime import engine
from pantheon.scheduler import GenRequest
from pantheon.scheduler.batch import BatchScheduler
from pantheon.types import Finished, SamplingParams, Tokens

CODE = '''def load_config(path):
    with open(path) as f:
        data = json.load(f)
    if "name" not in data:
        raise ValueError("config has no name")
    return Config(name=data["name"], size=data.get("size", 0), tags=data.get("tags", []))


def save_config(config, path):
    data = {"name": config.name, "size": config.size, "tags": config.tags}
    with open(path, "w") as f:
        json.dump(data, f, indent=2)


def merge_configs(a, b):
    tags = sorted(set(a.tags) | set(b.tags))
    return Config(name=a.name, size=max(a.size, b.size), tags=tags)
'''
DOC = ("The Lighthouse of Alexandria was built in the third century BC on the island of Pharos. It stood "
       "over one hundred metres tall and guided ships into the harbour for more than a thousand years. "
       "Earthquakes damaged it between 956 and 1323, and its last ruins were used to build the Citadel of "
       "Qaitbay in 1480. Divers found remains of the lighthouse in the harbour in 1994.")
WORKLOADS = {
    "code-edit": f"Rewrite this Python code with the function load_config renamed to read_config. Output only "
                 f"the full code.\n\n```python\n{CODE}```",
    "quote-doc": f"Document:\n{DOC}\n\nQuestion: When was the lighthouse built and what happened to it? Answer by "
                 f"quoting the document's sentences word for word.",
    "free-chat": "Write a short story about a robot who learns to paint.",
}


class Timed:
    def __init__(self) -> None:
        self.ids: list[int] = []
        self.times: list[float] = []
        self.done = threading.Event()

    def __call__(self, ev) -> None:
        if isinstance(ev, Tokens):
            self.ids += ev.ids
            self.times += [time.perf_counter()] * len(ev.ids)
        elif isinstance(ev, Finished):
            self.done.set()


def run(sched: BatchScheduler, prompt: list[int], n: int, spec: bool, streams: int, stops) -> tuple[float, list]:
    sinks = []
    for i in range(streams):
        s = Timed()
        sched.submit(GenRequest(prompt_ids=prompt, params=SamplingParams(temperature=0.0), max_tokens=n,
                                stop_ids=stops, speculative=spec, cache_scope=f"s{i}-{spec}-{time.time()}"), s)
        sinks.append(s)
    for s in sinks:
        s.done.wait(600)
    first = min(s.times[0] for s in sinks)
    last = max(s.times[-1] for s in sinks)
    toks = sum(len(s.ids) - 1 for s in sinks)
    return toks / max(last - first, 1e-9), [s.ids for s in sinks]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--streams", type=int, default=1)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--draft-model", default=None, help="a draft model GGUF with the same tokenizer")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    a = ap.parse_args()
    settings = load_settings()
    opts = engine.LoadOptions(n_slots=8, max_seq=2048, prefill_chunk=128)
    m = engine.load(Path(a.gguf).expanduser(), opts)
    if a.draft_model:
        m.draft = engine.load(Path(a.draft_model).expanduser(), engine.LoadOptions(**{**opts.__dict__, "spec_k": 0}))
    sched = BatchScheduler(m, settings, warmup=False)
    stops = frozenset(m.tokenizer.eot_ids)
    try:
        for name in a.workloads.split(","):
            ask = WORKLOADS[name]
            text = m.card.template.render([{"role": "user", "content": ask}], add_generation_prompt=True)
            prompt = m.tokenizer.encode(text)
            for spec in (False, True):  # compile the shapes this workload reaches
                run(sched, prompt, a.tokens, spec, a.streams, stops)
            best = {False: 0.0, True: 0.0}
            outs = {}
            for _ in range(a.reps):
                for spec in (False, True):
                    before = sched.load_info()
                    tps, ids = run(sched, prompt, a.tokens, spec, a.streams, stops)
                    after = sched.load_info()
                    best[spec] = max(best[spec], tps)
                    outs[spec] = ids
                    if spec:
                        d = after["spec_drafted"] - before["spec_drafted"]
                        acc = after["spec_accepted"] - before["spec_accepted"]
                        md = after["spec_model_drafted"] - before["spec_model_drafted"]
                        macc = after["spec_model_accepted"] - before["spec_model_accepted"]
                        steps = after["spec_steps"] - before["spec_steps"]
            same = outs[False] == outs[True]
            print(f"{Path(a.gguf).stem} {name} streams={a.streams} prompt={len(prompt)} tokens={len(outs[True][0])} "
                  f"off={best[False]:.1f} tok/s on={best[True]:.1f} tok/s x{best[True] / best[False]:.2f} "
                  f"lookup drafted={d} accepted={acc} model drafted={md} accepted={macc} verify_steps={steps} "
                  f"same_tokens={same}", flush=True)
    finally:
        sched.close()


if __name__ == "__main__":
    main()
