"""Measure what a JSON schema costs llguidance to compile, and what Pantheon's caps do with it.

For each shape and size: the schema's bytes, the wall and CPU seconds llguidance takes to compile it
(the cost `pantheon.text.structured.SchemaLimits` bounds; uncapped here, on purpose) and its first mask,
then what `Grammar.from_response_format` answers with the default caps (compiled, or refused, and how
long the refusal took). The CPU figure is the stable one on a shared machine; wall time includes waiting
for a core. Used for the table in docs/http-api.md ("Structured outputs: limits").

    python tools/grammar_curve.py                       # the default table (several minutes: 10k runs long)
    python tools/grammar_curve.py --shape optional --sizes 500 1000 2000
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path
from typing import Any, Callable

import llguidance as llg
import numpy as np

from pantheon.formats.gguf_reader import open_reader, read_metadata
from pantheon.text import structured
from pantheon.text.tokenizer import Tokenizer


def optional(n: int) -> dict:
    return {"type": "object", "properties": {f"prop_{i:05d}": {"type": "string"} for i in range(n)}}


def required(n: int) -> dict:
    s = optional(n)
    s["required"] = list(s["properties"])
    return s


def spread(n: int) -> dict:
    """n properties in objects of 100 (the per-object cap does not apply; the node cap does)."""
    k = max(1, n // 100)
    return {"type": "object", "properties": {f"o{j}": {"type": "object", "properties": {
        f"o{j}_p{i:03d}": {"type": "string"} for i in range(100)}} for j in range(k)}}


def objects_of_400(n: int) -> dict:
    """n // 400 objects of 400 optional properties: the top of the default caps' range."""
    return {"type": "object", "properties": {f"o{j}": {"type": "object", "properties": {
        f"o{j}_p{i:03d}": {"type": "string"} for i in range(400)}} for j in range(max(1, n // 400))}}


def pattern_properties(n: int) -> dict:
    return {"type": "object", "patternProperties": {f"^k{i}[a-z]+$": {"type": "integer"} for i in range(n)}}


SHAPES: dict[str, tuple[Callable[[int], dict], list[int]]] = {
    "optional": (optional, [250, 500, 1000, 2000, 5000, 10000]),
    "required": (required, [1000, 4900, 10000]),
    "spread": (spread, [1000, 5000, 10000]),
    "objects_of_400": (objects_of_400, [4800]),
    "pattern_properties": (pattern_properties, [50, 100, 200]),
}


def smollm2() -> Tokenizer:
    path = Path.home() / ".cache" / "pantheon" / "models" / "smollm2-135m.gguf"
    return Tokenizer.from_gguf_metadata(read_metadata(open_reader(path)), str(path))


def measure(schema: dict, tok: Tokenizer) -> dict[str, Any]:
    lt = structured.prepare(tok)
    t0, c0 = time.perf_counter(), time.process_time()
    grammar = llg.LLMatcher.grammar_from_json_schema(structured._with_whitespace(schema))
    m = llg.LLMatcher(lt, grammar, log_level=0, limits=structured._LIMITS)
    t1, c1 = time.perf_counter(), time.process_time()
    row = np.zeros(structured.mask_words(lt.vocab_size), np.int32)
    if not m.is_error():
        m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
    t2 = time.perf_counter()
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    t3 = time.perf_counter()
    try:
        structured.Grammar.from_response_format(rf, tok)
        capped = "compiles"
    except structured.SchemaTooLarge as exc:
        capped = f"400 schema_too_large ({str(exc).split(': ', 1)[1][:40]}...)"
    except Exception as exc:  # noqa: BLE001 - a measurement: report whatever it is
        capped = f"{type(exc).__name__}: {str(exc)[:60]}"
    t4 = time.perf_counter()
    return {"bytes": len(json.dumps(schema)), "compile_wall_s": round(t1 - t0, 3), "compile_cpu_s": round(c1 - c0, 3),
            "first_mask_ms": round((t2 - t1) * 1000, 1), "llguidance_error": m.get_error()[:60] if m.is_error() else "",
            "with_caps": capped, "with_caps_s": round(t4 - t3, 3),
            "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), action="append")
    ap.add_argument("--sizes", type=int, nargs="+")
    args = ap.parse_args()
    tok = smollm2()
    structured.prepare(tok)  # the token trie, built once (not part of any compile below)
    for name in args.shape or list(SHAPES):
        make, sizes = SHAPES[name]
        for n in args.sizes or sizes:
            print(json.dumps({"shape": name, "n": n, **measure(make(n), tok)}), flush=True)


if __name__ == "__main__":
    main()
