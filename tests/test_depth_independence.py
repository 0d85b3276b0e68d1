"""A step's program does not grow with the model's depth.

Why this is a contract: every serving bucket is traced, lowered and compiled at start, so a program
that carries one branch per layer makes start-up (and the compiled programs' memory) grow with the
layer count x the bucket count: a 28-layer file took 14x a 2-layer one. Each kind of matrix is one
stack over the layers (grouped by format), read in place by the layer loop, so the program of a
decode step is the same whatever the depth. These tests count what is traced (jaxpr equations, sub-
programs included) and lowered (StableHLO text), not wall time.
"""

from __future__ import annotations

from pathlib import Path
from collections.abc import Callable
from typing import Any

import gguf
import jax
import numpy as np
import pytest
from conftest import tiny_fixture
from test_sized_gguf import _tool as _sized_tool

from pantheon.runtime import engine
from pantheon.runtime.engine import StepPlan

SHAPE = dict(hidden=256, n_heads=4, n_kv_heads=2, head_dim=64, ffn=512, vocab=512)
MOE = dict(hidden=256, n_heads=4, n_kv_heads=2, head_dim=128, n_experts=8, n_used=2, expert_ffn=256, vocab=512)
HYBRID = dict(hidden=256, n_heads=2, n_kv_heads=1, head_dim=128, n_experts=8, n_used=2, expert_ffn=256,
              shared_ffn=256, n_k_heads=2, n_v_heads=4, linear_head_dim=64, vocab=512)


def _deepened(src: Path, dst: Path, layers: int,
              source: Callable[[int, int], int] = lambda i, depth: i % depth) -> Path:
    """The fixture `src` rewritten with `layers` layers: layer i is a copy of the fixture's layer
    source(i, depth), i mod depth unless told (same formats, shapes and metadata otherwise), as the
    gguf package writes files."""
    r = gguf.GGUFReader(str(src))
    arch = r.fields["general.architecture"].contents()
    depth = int(r.fields[f"{arch}.block_count"].contents())
    w = gguf.GGUFWriter(str(dst), arch)
    w.kv_data[0].clear()
    for name, f in r.fields.items():
        if name.startswith("GGUF."):
            continue
        vtype = f.types[0]
        value = layers if name == f"{arch}.block_count" else f.contents()
        w.add_key_value(name, value, vtype, sub_type=f.types[1] if vtype == gguf.GGUFValueType.ARRAY else None)
    by_name = {t.name: t for t in r.tensors}
    names = [t.name for t in r.tensors if not t.name.startswith("blk.")]
    for i in range(layers):
        names += [n.replace("blk.0.", f"blk.{i}.", 1) for n in by_name if n.startswith("blk.0.")]
    for n in names:
        src_name = n if not n.startswith("blk.") else "blk.{}.{}".format(source(int(n.split(".")[1]), depth),
                                                                        n.split(".", 2)[2])
        t = by_name[src_name]
        quant = t.tensor_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
        w.add_tensor(n, t.data, raw_dtype=t.tensor_type if quant else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def _count_eqns(jaxpr: Any) -> int:
    """Equations of a jaxpr and of every sub-jaxpr (scan/cond/switch bodies, pjit calls)."""
    total = 0
    for eqn in jaxpr.eqns:
        total += 1
        for v in eqn.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    total += _count_eqns(inner)
    return total


def _program_size(path: Path) -> dict[str, int]:
    """What a one-row decode step of the model at `path` traces to and lowers to, and how many
    programs its warm-up compiles."""
    model = engine.load(path, engine.LoadOptions(n_slots=2, max_seq=64, prefill_chunk=32))
    try:
        state = model.new_state()
        plan = model._serve_plan(StepPlan(decode=(model.scratch_slot,), reach=8))
        traced = plan.fn.trace(model.params, state.cache, state.slots, *plan.args, **plan.kwargs)
        return {"eqns": _count_eqns(traced.jaxpr.jaxpr), "hlo_chars": len(traced.lower().as_text()),
                "programs": len(model.warmup_plans()), "layers": model.config.n_layers}
    finally:
        model.free()


def _sized(tmp: Path, profile: str, layers: int, mix: str, **dims: Any) -> Path:
    return _sized_tool().write_sized_gguf(tmp / f"{profile}-{layers}-{mix}.gguf", profile, template=False,
                                          layers=layers, mix=mix, **dims)


CASES = {
    # dense llama family; llama.cpp's Q4_K_M rule mixes Q4_K and Q6_K layers of attn_v / ffn_down
    "qwen2": ("qwen2-7b", SHAPE, 8, 28),
    "qwen3moe": ("qwen3moe-30b-a3b", MOE, 4, 24),
    "qwen35moe": ("qwen35moe-30b-a3b", HYBRID, 8, 32),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("mix", ["q4_k_m", "llama.cpp"])
def test_decode_program_is_the_same_at_any_depth(case, mix, tmp_path):
    profile, dims, shallow, deep = CASES[case]
    a = _program_size(_sized(tmp_path, profile, shallow, mix, **dims))
    b = _program_size(_sized(tmp_path, profile, deep, mix, **dims))
    assert (a["layers"], b["layers"]) == (shallow, deep)
    assert a["programs"] == b["programs"]  # the buckets do not depend on depth
    # A branch per layer made the deep program 3.5-4x the shallow one. Now the program has a branch
    # per combination of formats a layer body meets: with the uniform Q4_K_M layout both depths meet
    # the same ones, so the programs are the same; llama.cpp's rule gives more layers of a deep file
    # more bits, which can add a combination or two (measured: +17% for the 32-layer hybrid).
    if mix == "q4_k_m":
        assert b["eqns"] == a["eqns"], (a, b)
        assert b["hlo_chars"] <= a["hlo_chars"] * 1.05, (a, b)
    else:
        assert b["eqns"] <= a["eqns"] * 1.25, (a, b)
        assert b["hlo_chars"] <= a["hlo_chars"] * 1.25, (a, b)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gemma3", "phi3", "llama"])
def test_deepened_fixture_traces_the_same_program(arch, tmp_path):
    """The tiny oracle fixtures at 2 and 14 x their depth: gemma3's local/global layers and phi3's
    fused projections included."""
    src, _, _ = tiny_fixture(arch)
    depth = int(gguf.GGUFReader(str(src)).fields[f"{arch}.block_count"].contents())
    a = _program_size(_deepened(src, tmp_path / "a.gguf", 2 * depth))
    b = _program_size(_deepened(src, tmp_path / "b.gguf", 14 * depth))
    assert b["eqns"] == a["eqns"], (a, b)
    assert b["hlo_chars"] <= a["hlo_chars"] * 1.05, (a, b)


def test_the_count_sees_a_branch_per_layer():
    """The measure above is not blind: per-layer weights handed over as a tuple (one branch per
    layer, the form engine-loaded models no longer take) make the same decode step grow with depth."""
    from pantheon.ops import weights

    def program(n_layers: int) -> int:
        ws = tuple(weights.dense(np.ones((8, 8), np.float32) * i) for i in range(n_layers))

        def loop(x: jax.Array) -> jax.Array:
            def body(h, li):
                return weights.pick_linear(ws, li, h) + h, None
            return jax.lax.scan(body, x, jax.numpy.arange(n_layers))[0]
        return _count_eqns(jax.make_jaxpr(loop)(jax.numpy.ones((1, 8))).jaxpr)

    def stacked(n_layers: int) -> int:
        ws = weights.layer_stack([weights.dense(np.ones((8, 8), np.float32) * i) for i in range(n_layers)])

        def loop(x: jax.Array) -> jax.Array:
            def body(h, li):
                return weights.pick_linear(ws, li, h) + h, None
            return jax.lax.scan(body, x, jax.numpy.arange(n_layers))[0]
        return _count_eqns(jax.make_jaxpr(loop)(jax.numpy.ones((1, 8))).jaxpr)

    assert program(28) - program(2) >= 26  # every layer adds its branch
    assert stacked(28) == stacked(2)
