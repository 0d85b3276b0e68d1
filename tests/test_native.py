"""The native decode kernels (pantheon.ops.native): exact enough, row-invariant, used by the engine, optional."""

from __future__ import annotations

from functools import partial

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_fixture
from pantheon.runtime import engine
from pantheon.ops import native, weights
from pantheon.runtime.decode_state import slot_insert
from pantheon.runtime.engine import Chunk, StepPlan
from pantheon.types import GREEDY
from pantheon.config import load_settings
from pantheon.jax_models import common
from pantheon.runtime import reference


@pytest.fixture(scope="module")
def kernel():
    if not native.enable(load_settings().home / "native"):
        pytest.fail(f"the native kernel did not build on this machine: {native.unavailable_reason()}")
    return jax.jit(native.matmul)


@pytest.mark.parametrize("n, k", [(1001, 64), (7, 8), (3072, 576)])
def test_the_product_matches_float64_numpy(kernel, n, k):
    rng = np.random.default_rng(n)
    w = rng.standard_normal((n, k), np.float32)
    x = rng.standard_normal((32, k), np.float32)
    got = np.asarray(kernel(jnp.asarray(x), jnp.asarray(w)))
    want = x.astype(np.float64) @ w.astype(np.float64).T
    assert got.shape == (32, n)
    assert np.abs(got - want).max() <= 1e-5 * np.sqrt(k) * np.abs(want).max()


def test_a_row_gives_the_same_bits_whatever_rows_share_the_call(kernel):
    """Batch invariance: alone, in a batch of 8, among 32 rows or in a prefill chunk plus decode rows
    (136), a row's product is bit-identical."""
    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.standard_normal((1536, 576), np.float32))
    x = jnp.asarray(rng.standard_normal((136, 576), np.float32))
    full = np.asarray(kernel(x, w))
    for m in (*range(1, 33), 47, 64, 100, 136):
        assert np.array_equal(np.asarray(kernel(x[:m], w)), full[:m]), m
    assert np.array_equal(np.asarray(kernel(x[5:6], w)), full[5:6])
    assert np.array_equal(np.asarray(kernel(x[130:131], w)), full[130:131])


def test_skipped_rows_cost_nothing_and_the_others_keep_their_bits(kernel):
    """A prefill chunk's padding rows [first, end) are left out: zeros there, the same bits elsewhere
    (also when live rows on both sides are tiled as one block, and when 8 or fewer remain)."""
    rng = np.random.default_rng(4)
    w = rng.standard_normal((300, 576)).astype(np.float32)
    blocks = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1)
    x = jnp.asarray(rng.standard_normal((72, 576), np.float32))
    def quant(x, wt, skip=None):
        return native.weight_matmul(x, wt, "Q4_1", skip)

    for product, weights in ((native.matmul, jnp.asarray(w)), (quant, jnp.asarray(blocks))):
        fn = jax.jit(lambda x, wt, a, b: product(x, wt, (a, b)))
        full = np.asarray(jax.jit(product)(x, weights))
        for first, end in ((45, 64), (21, 32), (3, 67), (0, 72), (70, 72), (10, 10), (60, 99)):
            got = np.asarray(fn(x, weights, jnp.int32(first), jnp.int32(end)))
            dead = np.zeros(72, bool)
            dead[first:min(end, 72)] = True
            assert np.array_equal(got[~dead], full[~dead]), (first, end)
            assert not got[dead].any(), (first, end)


def test_leading_axes_are_kept(kernel):
    x = jnp.ones((2, 3, 16), jnp.float32)
    w = jnp.ones((5, 16), jnp.float32)
    assert kernel(x, w).shape == (2, 3, 5)
    assert float(kernel(x, w)[1, 2, 4]) == 16.0


def test_the_kernel_serves_the_shapes_it_can(kernel):
    w = jnp.ones((8, 64), jnp.float32)
    assert native.applies(1, w) and native.applies(512, w)  # decode rows and prefill chunks
    assert not native.applies(0, w)
    assert not native.applies(8, jnp.ones((8, 60), jnp.float32))  # K not a multiple of 8
    assert not native.applies(8, w.astype(jnp.bfloat16))  # the f32 kernel; 16-bit weights have their own


def _lowered(model, rows: int, t: int) -> str:
    fn = jax.jit(partial(model._forward_impl, span=64, all_logits=False, kernels=model.kernels))
    z = jnp.zeros((rows,), jnp.int32)
    return fn.lower(model.params, model.new_state().cache, jnp.zeros((rows, t), jnp.int32), z, z,
                    jnp.ones((rows,), jnp.int32)).as_text()


def test_only_a_model_that_opts_in_uses_it(kernel):
    """The kernels are a load-time decision (engine.choose_kernels), static in every step."""
    path, _, _ = tiny_fixture("llama")
    model = engine.load(path, engine.LoadOptions(n_slots=2, max_seq=64, prefill_chunk=16, native_matmul=False))
    assert not model.native_matmul and not model.kernels.attention
    assert "call @pantheon" not in _lowered(model, 2, 1)


def test_decode_steps_and_prefill_chunks_run_the_kernels(kernel):
    path, _, _ = tiny_fixture("llama")
    model = engine.load(path, engine.LoadOptions(n_slots=2, max_seq=64, prefill_chunk=16, native_matmul=True))
    assert model.native_matmul

    n_layers = model.config.n_layers
    decode, chunk = _lowered(model, 2, 1), _lowered(model, 1, 64)
    # decode: qkv, o, gate-up and down, once in the layer scan's body whatever the depth (each reads
    # its layer of the stack), and the LM head
    assert n_layers > 1 and decode.count("call @" + native.TARGET) == 4 + 1
    assert decode.count("call @" + native.ATTENTION_TARGET) == 1  # in the layer scan's body
    # a 64-token chunk: the same matmuls; its attention (many queries per row) stays XLA's
    assert chunk.count("call @" + native.TARGET) == 4 + 1
    assert native.ATTENTION_TARGET not in chunk


def test_a_decode_row_has_the_same_logits_alone_batched_and_beside_a_prefill_chunk(kernel):
    """One decode row of slot 1 computed alone, with a second decode row, and in a mixed step beside
    slot 0's 40-token chunk (65 rows, every matmul in the kernel). Alone and batched agree bit for bit
    here; beside the chunk within f32 rounding, because XLA's RMSNorm reduction is itself not
    row-invariant from some row count on (65 rows at H=64; 8 at H=576)."""
    path, j, _ = tiny_fixture("llama")
    model = engine.load(path, engine.LoadOptions(n_slots=4, max_seq=128, prefill_chunk=64, native_matmul=True))
    prompt = j["prompt_ids"][:9]

    def decode_row_logits(decode: tuple[int, ...], chunk: list[int] | None = None) -> np.ndarray:
        """Slot 1's decode-row logits (after `prompt`, feeding the token the prompt's last chunk
        sampled), decoded beside the slots in `decode` and maybe a prompt chunk for slot 0."""
        state = model.new_state()
        for slot in (1, 2):
            state = model.insert(state, slot_insert(slot, prompt, 0, GREEDY, 8, ()))
            _, state = model.step(state, StepPlan(chunk=Chunk(slot, tuple(prompt), 0, True)))
        c = None
        if chunk is not None:
            state = model.insert(state, slot_insert(0, chunk, 0, GREEDY, 8, ()))
            c = Chunk(0, tuple(chunk), 0, True)
        h, _ = model.step(state, StepPlan(chunk=c, decode=decode, reach=10), want_logits=True)
        return np.asarray(h.logits)[(c is not None) + decode.index(1)]

    alone = decode_row_logits((1,))
    batched = decode_row_logits((2, 1))
    mixed = decode_row_logits((1,), list(range(3, 43)))
    assert np.array_equal(alone, batched)
    np.testing.assert_allclose(mixed, alone, rtol=0, atol=1e-5)
    assert int(np.argmax(mixed)) == int(np.argmax(alone))


def _cache_and_queries(seed: int, rows: int):
    rng = np.random.default_rng(seed)
    L, S, K, C, D, N = 3, 9, 2, 300, 64, 6  # 3 query heads per kv head
    kc, vc = (jnp.asarray(rng.standard_normal((L, S, K, C, D), np.float32)) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((rows, 1, N, D), np.float32))
    return q, kc, vc


def test_decode_attention_equals_the_gathered_masked_form(kernel):
    q, kc, vc = _cache_and_queries(0, 8)
    slots = jnp.asarray([3, 1, 0, 8, 5, 2, 7, 6], jnp.int32)
    pos = jnp.asarray([0, 5, 100, 299, 17, 3, 64, 200], jnp.int32)  # first and last position included
    layer = jnp.int32(2)
    assert native.attention_applies(q, kc)
    got = jax.jit(partial(native.decode_attention, scale=0.125))(q, kc, vc, layer, slots, pos)
    want = common.attention(q, common.gather_span(kc, layer, slots, 300), common.gather_span(vc, layer, slots, 300),
                            pos[:, None], 0.125)
    assert got.shape == want.shape == (8, 1, 6 * 64)
    assert np.abs(np.asarray(got) - np.asarray(want)).max() < 1e-5


def test_with_and_without_the_kernel_a_model_computes_the_same_logits(kernel):
    path, j, _ = tiny_fixture("qwen3")
    opts = dict(n_slots=2, max_seq=64, prefill_chunk=16, kv_dtype="float32")  # kernels alone, no f16 rounding
    on = engine.load(path, engine.LoadOptions(native_matmul=True, **opts))
    off = engine.load(path, engine.LoadOptions(native_matmul=False, **opts))
    assert on.native_matmul and not off.native_matmul
    ids = j["prompt_ids"][:12]
    got = [np.asarray(reference.logits(m, ids, chunk=1)) for m in (on, off)]  # one token a step: decode-shaped
    assert np.abs(got[0] - got[1]).max() < 1e-4
    # one 12-token chunk in its 16-row bucket: the kernels skip the 4 padding rows
    got = [np.asarray(reference.logits(m, ids, chunk=16)) for m in (on, off)]
    assert got[0].shape == (12, on.config.vocab) and np.abs(got[0] - got[1]).max() < 1e-4


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_the_block_format_product_equals_the_f32_product_over_ggufs_dequantized_weights(kernel, fmt):
    """Bit for bit: the kernel expands each block to exactly the f32 values gguf's dequantizer gives."""
    rng = np.random.default_rng(2)
    qtype = gguf.GGMLQuantizationType[fmt]
    quant = jax.jit(partial(native.weight_matmul, qtype=fmt))
    # K = 1536 (w_down) and 600 columns: more than 5 rows are cut into parts of K that fit L1, with
    # partial sums carried over more columns than one carry group holds
    for n, k in ((333, 576), (600, 1536)):
        blocks = gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
        weights = gguf.quants.dequantize(blocks, qtype).astype(np.float32)
        x = jnp.asarray(rng.standard_normal((32, k), np.float32))
        full = np.asarray(kernel(x, jnp.asarray(weights)))
        for m in (*range(1, 10), 13, 32):  # up to 8 rows the blocks are expanded in registers, above in a scratch
            assert np.array_equal(np.asarray(quant(x[:m], jnp.asarray(blocks))), full[:m]), (n, k, m)
    # 12 rows with [2, 10) skipped leave 4 live rows: the register path, rows on both sides of the gap
    skipped = np.asarray(native.weight_matmul(x[:12], jnp.asarray(blocks), fmt, (2, 10)))
    assert np.array_equal(skipped[[0, 1, 10, 11]], full[[0, 1, 10, 11]]) and not skipped[2:10].any()
    assert native.weight_matmul_applies(8, 1536, jnp.asarray(blocks), fmt)
    assert not native.weight_matmul_applies(8, 1504, jnp.asarray(blocks), fmt)  # bytes per row do not fit 1504


def _write_quantized_llama(path, formats: dict[str, str]) -> None:
    """A 2-layer random llama whose matrices are stored in the given GGUF block formats."""
    from test_gguf_loader import add_tiny_tokenizer
    H, FF, L = 64, 128, 2
    w = gguf.GGUFWriter(str(path), "llama")
    for k, v in {"block_count": L, "embedding_length": H, "feed_forward_length": FF, "attention.head_count": 4,
                 "attention.head_count_kv": 2, "context_length": 128}.items():
        w.add_uint32(f"llama.{k}", v)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-6)
    vocab = add_tiny_tokenizer(w)
    rng = np.random.default_rng(3)
    shapes = {"token_embd.weight": (vocab, H), "output_norm.weight": (H,)}
    for i in range(L):
        shapes.update({f"blk.{i}.attn_norm.weight": (H,), f"blk.{i}.attn_q.weight": (H, H),
                       f"blk.{i}.attn_k.weight": (H // 2, H), f"blk.{i}.attn_v.weight": (H // 2, H),
                       f"blk.{i}.attn_output.weight": (H, H), f"blk.{i}.ffn_norm.weight": (H,),
                       f"blk.{i}.ffn_gate.weight": (FF, H), f"blk.{i}.ffn_up.weight": (FF, H),
                       f"blk.{i}.ffn_down.weight": (H, FF)})
    for name, shape in shapes.items():
        values = rng.normal(0, 0.3 if len(shape) == 2 else 1.0, size=shape).astype(np.float32)
        fmt = next((f for part, f in formats.items() if part in name), None) if len(shape) == 2 else None
        if fmt:
            qtype = gguf.GGMLQuantizationType[fmt]
            w.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, values)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_quantized_file_decodes_from_its_blocks_with_the_f32_results(kernel, tmp_path):
    path = tmp_path / "q.gguf"
    _write_quantized_llama(path, {"attn_q": "Q4_1", "attn_k": "Q4_1", "attn_v": "Q4_1", "attn_output": "Q4_0",
                                  "ffn_gate": "Q5_0", "ffn_up": "Q5_0", "ffn_down": "Q5_1", "token_embd": "Q8_0"})
    opts = dict(n_slots=2, max_seq=64, prefill_chunk=16)
    on = engine.load(path, engine.LoadOptions(native_matmul=True, **opts))
    off = engine.load(path, engine.LoadOptions(native_matmul=False, **opts))
    lay = common.present(on.params.layers)
    assert {k for k in lay if isinstance(lay[k], weights.LayerStack)} == {"wqkv", "wo", "w_gu", "w_down"}  # fused
    assert [w.qtype for w in lay["wqkv"].groups] == ["Q4_1"] and len(lay["wqkv"]) == 2  # one stack of 2 layers
    assert on.params.embed.qtype == "Q8_0"
    text = _lowered(on, 2, 1)
    # the layer body's 4 matmuls (each reads its layer of the stack in place) and the tied LM head
    # read their blocks
    assert text.count("call @" + native.QUANT_TARGET) == 4 + 1
    assert "call @pantheon" not in _lowered(off, 2, 1)
    ids = list(range(5, 25))
    got = [np.asarray(reference.logits(m, ids, chunk=1)) for m in (on, off)]
    assert np.abs(got[0] - got[1]).max() < 1e-4
    greedy = [list(reference.generate(m, ids, max_tokens=12, stop_ids=[])) for m in (on, off)]
    assert greedy[0] == greedy[1]


def test_matrices_whose_formats_differ_stay_apart_each_in_its_own_format(kernel, tmp_path):
    path = tmp_path / "mixed.gguf"
    _write_quantized_llama(path, {"attn_q": "Q4_1", "attn_k": "Q8_0", "ffn_gate": "Q4_0", "ffn_up": "Q4_0"})
    model = engine.load(path, engine.LoadOptions(native_matmul=True, n_slots=1, max_seq=32, prefill_chunk=16))
    lay = model.params.layers
    assert lay.wqkv is None and lay.w_gu is not None  # q/k/v differ (v is F32); gate/up share Q4_0
    assert (lay.wq.host_layer(0).qtype, lay.wk.host_layer(0).qtype, lay.wv.host_layer(0).qtype) == (
        "Q4_1", "Q8_0", "F32")
    assert model.params.embed.qtype == "F32"
    assert len(list(reference.generate(model, [5, 6, 7], max_tokens=3, stop_ids=[]))) == 3


def test_a_failed_build_leaves_xla_in_place(tmp_path, monkeypatch, caplog):
    broken = tmp_path / "broken.cc"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(native, "SOURCE", broken)
    monkeypatch.setattr(native, "_ready", False)
    monkeypatch.setattr(native, "_failed", None)
    assert native.enable(tmp_path / "cache") is False
    assert "failed" in native.unavailable_reason()
    assert "native matmul unavailable" in caplog.text
    assert not native.applies(8, jnp.ones((8, 64), jnp.float32))
    assert not native.attention_applies(*_cache_and_queries(0, 1)[:2])
    assert native.enable(tmp_path / "cache") is False  # not retried on every load
