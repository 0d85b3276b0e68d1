"""Stacked layers stay in the mapped file where the native kernels read them.

Why this is a contract: a stack of one kind of matrix over the layers (what keeps a step's program
the same at any depth) used to be a copy of the layers into one buffer. That copy was 8.6 s of a 7B
file's 9.6 s load and made every weight anonymous memory, so a 20 GB file barely fit a 24 GB
machine. A `MappedStack` is the file itself (one aliased buffer) plus where each layer's tensor
starts, so these tests check three things: the weights are the file's pages (no copy), a step
computes exactly what the copied stacks compute (same kernel, same bytes: the same bits), and the
kernel refuses a matrix that would end past the file rather than read beyond it.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_sized_gguf import SMALL, _tool

from pantheon.config import load_settings
from pantheon.ops import native, weights
from pantheon.runtime import engine, reference
from pantheon.runtime.sampler import SamplingParams

OPTS = engine.LoadOptions(n_slots=2, max_seq=64, prefill_chunk=32)
PROMPT = [5, 17, 99, 3, 250, 41, 7, 12, 300, 8, 19]


def _file(tmp: Path, profile: str, mix: str = "llama.cpp") -> Path:
    # llama.cpp's Q4_K_M rule mixes Q4_K and Q6_K layers of one kind: two groups per stack
    return _tool().write_sized_gguf(tmp / f"{profile}.gguf", profile, template=False, mix=mix, **SMALL[profile])


def _stacks(params) -> list:
    return [x for x in jax.tree.leaves(params, is_leaf=lambda v: isinstance(v, (weights.MappedStack,
                                                                                   weights.QuantWeight)))
            if isinstance(x, (weights.MappedStack, weights.QuantWeight))]


def _run(model) -> tuple[np.ndarray, list[int]]:
    lg = reference.logits(model, PROMPT)
    out = list(reference.generate(model, PROMPT, SamplingParams(temperature=0.0), max_tokens=6, stop_ids=[]))
    return lg, out


@pytest.fixture(autouse=True, scope="module")
def built():
    if not native.enable(load_settings().home / "native"):
        pytest.fail(f"the native kernels did not build on this machine: {native.unavailable_reason()}")


# The two MoE profiles (experts in the file, loaded and run twice) take over 10 s on 2 cores: not in make test-quick.
@pytest.mark.parametrize("profile", ["qwen2-7b", pytest.param("qwen3moe-30b-a3b", marks=pytest.mark.slow),
                                     pytest.param("qwen35moe-30b-a3b", marks=pytest.mark.slow)])
def test_layers_stay_in_the_file_and_compute_the_copied_stacks_bits(tmp_path, monkeypatch, profile):
    path = _file(tmp_path, profile)
    mapped = engine.load(path, OPTS)
    try:
        assert mapped.kernels.matmul
        stacks = [w for w in _stacks(mapped.params) if isinstance(w, weights.MappedStack)]
        # every layer-stacked block-format matrix (experts included) is in the file: none was copied
        layer_groups = [g for s in jax.tree.leaves(mapped.params, is_leaf=lambda v: isinstance(v, weights.LayerStack))
                        if isinstance(s, weights.LayerStack) for g in s.groups]
        block = [g for g in layer_groups if weights.FORMATS[g.qtype].is_block]
        assert block and all(isinstance(g, weights.MappedStack) for g in block)
        assert {s.qtype for s in stacks} >= {"Q4_K", "Q6_K"}
        # one buffer for the whole model, and it is the file's mapping (aliased, not a copy)
        assert len({s.file.unsafe_buffer_pointer() for s in stacks}) == 1
        assert stacks[0].file.shape == (path.stat().st_size // native.FILE_UNIT, native.FILE_UNIT)
        # the load's accounting counts the matrices, not the file once per stack
        assert mapped.weight_bytes < path.stat().st_size
        got = _run(mapped)
    finally:
        mapped.free()
    monkeypatch.setattr(weights, "mapped_stack", lambda parts, files: None)  # the copied form
    copied = engine.load(path, OPTS)
    try:
        assert not any(isinstance(w, weights.MappedStack) for w in _stacks(copied.params))
        want = _run(copied)
    finally:
        copied.free()
    np.testing.assert_array_equal(got[0], want[0])
    assert got[1] == want[1]


def test_a_member_is_sliced_out_on_the_host_as_the_file_holds_it(tmp_path):
    """`MappedStack.at` (tests, XLA's fallbacks) gives the layer's bytes exactly where the file has them."""
    import gguf
    path = _file(tmp_path, "qwen2-7b")
    model = engine.load(path, OPTS)
    try:
        ws = model.params.layers.w_down
        assert isinstance(ws, weights.LayerStack)
        host = jax.tree.map(np.asarray, ws)
        tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
        for layer in range(len(ws)):
            np.testing.assert_array_equal(np.asarray(host.host_layer(layer).data).reshape(-1),
                                          np.asarray(tensors[f"blk.{layer}.ffn_down.weight"].data).reshape(-1))
            # the traced slice (XLA's path) reads the same bytes
            g = ws.groups[ws.group_of[layer]]
            traced = jax.jit(lambda s, i: s.at(i).data)(g, jnp.int32(ws.index_in[layer]))
            np.testing.assert_array_equal(np.asarray(traced), np.asarray(host.host_layer(layer).data))
    finally:
        model.free()


def test_the_kernel_refuses_a_matrix_past_the_end_of_the_file():
    file = jnp.zeros((10, native.FILE_UNIT), jnp.uint8)  # 320 bytes: two Q4_K rows of 256 inputs fit
    x = jnp.ones((1, 256), jnp.float32)
    ok = native.mapped_matmul(x, file, "Q4_K", 2, 0)
    assert ok.shape == (1, 2)
    with pytest.raises(Exception, match="outside the mapped file"):
        jax.block_until_ready(native.mapped_matmul(x, file, "Q4_K", 2, 5))  # starts at 160, ends at 448
    with pytest.raises(Exception, match="outside the mapped file"):
        jax.block_until_ready(native.mapped_matmul(x, file, "Q4_K", 2, 0, matrix=1))


def test_only_views_of_an_aligned_mapping_stay_in_place():
    """Copies, arrays in memory and unaligned starts are stacked by copying (the form every path reads)."""
    parts = [weights.QuantWeight(data=np.zeros((2, 144), np.uint8), qtype="Q4_K", cols=256, kernel="native")
             for _ in range(3)]
    assert weights.mapped_stack(parts, {}) is None
    assert isinstance(weights.layer_stack(parts).groups[0], weights.QuantWeight)
