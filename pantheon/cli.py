"""`pantheon` command line: pull, info, generate, logits, serve, bench."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from pantheon.errors import PantheonError


def _model_arg(value: str) -> Path:
    from pantheon.formats.catalog import resolve_model
    return resolve_model(value)


def _sampling(args: argparse.Namespace):
    from pantheon.runtime.sampler import SamplingParams
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                          frequency_penalty=args.frequency_penalty, seed=args.seed)


def cmd_pull(args: argparse.Namespace) -> int:
    from pantheon.formats.catalog import pull
    for name in args.names:
        print(pull(name))
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from collections import Counter

    from pantheon.formats.gguf_loader import open_gguf
    f = open_gguf(_model_arg(args.model))
    print(f"file: {f.path} ({f.path.stat().st_size:,} bytes)")
    for k, v in sorted(f.config.__dict__.items()):
        if k != "extra":
            print(f"  {k}: {v}")
    if args.metadata:
        for k, v in sorted(f.meta.items()):
            if isinstance(v, list) and len(v) > 8:
                v = f"[{len(v)} items]"
            print(f"  {k} = {v}")
    types = Counter(f.tensors.qtype(n) for n in f.tensors.names())
    print("tensor types: " + ", ".join(f"{t} x{n}" for t, n in types.most_common()))
    print(f"tensors: {len(f.tensors.names())}")
    return 0


def _load(args: argparse.Namespace):
    from pantheon.runtime.engine import LoadOptions, load
    return load(_model_arg(args.model), LoadOptions(name=args.model, max_seq=args.max_seq, n_slots=1,
                                                    kv_dtype=getattr(args, "kv_dtype", None)))


def cmd_generate(args: argparse.Namespace) -> int:
    from pantheon.runtime import reference
    model = _load(args)
    tok = model.tokenizer
    if args.chat:
        text = model.card.template.render([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
        ids = tok.encode(text)
    else:
        ids = ([tok.bos_id] if tok.add_bos and tok.bos_id is not None else []) + tok.encode(args.prompt)
    stream = tok.stream()
    t0 = time.perf_counter()
    n = 0
    first = None
    for tid in reference.generate(model, ids, _sampling(args), max_tokens=args.max_tokens):
        if first is None:
            first = time.perf_counter() - t0
        n += 1
        if tid in tok.eot_ids:
            break
        sys.stdout.write(stream.push(tid))
        sys.stdout.flush()
    sys.stdout.write(stream.flush() + "\n")
    dt = time.perf_counter() - t0
    if args.verbose:
        print(f"[{len(ids)} prompt tokens, {n} generated, first token {first:.2f}s, {n / dt:.1f} tok/s]",
              file=sys.stderr)
    return 0


def cmd_logits(args: argparse.Namespace) -> int:
    import numpy as np

    from pantheon.runtime import reference
    model = _load(args)
    ids = [int(x) for x in args.ids.split(",") if x.strip()]
    lg = reference.logits(model, ids).astype(np.float32)
    np.save(args.out, lg)
    print(f"wrote {args.out}: {lg.shape}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from pantheon.web.launch import serve
    return serve(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from pantheon.bench.engine import main as bench_main
    return bench_main(args)


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)


def build_parser() -> argparse.ArgumentParser:
    from pantheon.formats.catalog import DEFAULT_MODEL
    ap = argparse.ArgumentParser(prog="pantheon", description="JAX-native LLM inference engine and server")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("pull", help="download catalog models into $PANTHEON_HOME")
    p.add_argument("names", nargs="*", default=[DEFAULT_MODEL])
    p.set_defaults(fn=cmd_pull)

    p = sub.add_parser("info", help="show a GGUF's config and tensor types")
    p.add_argument("model")
    p.add_argument("--metadata", action="store_true", help="also print every metadata key")
    p.set_defaults(fn=cmd_info)

    p = sub.add_parser("generate", help="stream a completion to stdout")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-seq", type=int, default=2048)
    p.add_argument("-v", "--verbose", action="store_true")
    _add_sampling(p)
    p.set_defaults(fn=cmd_generate)

    p = sub.add_parser("logits", help="write teacher-forced logits [T, vocab] as float32 .npy")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--ids", required=True, help="comma-separated token ids")
    p.add_argument("--out", required=True)
    p.add_argument("--max-seq", type=int, default=2048)
    # The numerics tool computes at full precision: the serving default (f16 on CPU) moves logits by
    # ~5e-3 against an f32/f64 oracle, f32 by ~1e-5; pass --kv-dtype auto to see what serving computes.
    p.add_argument("--kv-dtype", default="float32", choices=("float32", "float16", "bfloat16", "auto"),
                   help="KV cache dtype (default float32, unlike serving's PANTHEON_KV_DTYPE)")
    p.set_defaults(fn=cmd_logits)

    p = sub.add_parser("serve", help="serve models over an OpenAI-compatible HTTP API")
    p.add_argument("--model", action="append", default=[], help="[NAME=]MODEL[@DIE,DIE] (repeatable)")
    p.add_argument("--mmproj", default=None, metavar="GGUF",
                   help="vision projector (llama.cpp's mmproj GGUF) of the --model: the model takes images")
    p.add_argument("--draft-model", default=None, metavar="NAME_OR_PATH",
                   help="a draft model for speculative decoding, loaded beside every model; it must share their "
                        "tokenizer (PANTHEON_DRAFT_MODEL)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--timeout", type=int, default=0, help="gunicorn worker timeout (0 = none)")
    p.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="one model over several hosts: process 0's jax.distributed address (PANTHEON_COORDINATOR)")
    p.add_argument("--num-processes", type=int, default=None, help="processes in the cluster (PANTHEON_NUM_PROCESSES)")
    p.add_argument("--process-id", type=int, default=None,
                   help="this process's rank; 0 serves HTTP, the others follow (PANTHEON_PROCESS_ID)")
    p.set_defaults(fn=cmd_serve)

    from pantheon.serving.router_cmd import add_parser as add_router_parser
    add_router_parser(sub)

    p = sub.add_parser("bench", help="engine and serving benchmarks")
    p.add_argument("bench_args", nargs=argparse.REMAINDER)
    p.set_defaults(fn=cmd_bench)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args) or 0)
    except PantheonError as exc:
        print(f"pantheon: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
