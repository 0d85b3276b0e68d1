"""Broken model files fail with a clear ModelLoadError naming the file and the problem.

The files are written by the tests with `gguf.GGUFWriter` (a small llama that loads and generates),
then damaged one way at a time: not a GGUF, truncated, unknown architecture, missing tensor, wrong
tensor shape, missing metadata.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from conftest import TINY
from pantheon.runtime import engine
from pantheon.errors import ModelLoadError
from pantheon.formats.gguf_reader import open_reader, read_metadata
from pantheon.runtime import reference

H, FF, NH, L = 8, 16, 2, 1


def _tokenizer_fields() -> dict:
    """The tiny llama fixture's vocabulary (512 tokens, byte-level BPE) to make a loadable file."""
    meta = read_metadata(open_reader(TINY / "llama.gguf"))
    return {k: v for k, v in meta.items() if k.startswith("tokenizer.")}


def add_tiny_tokenizer(w: gguf.GGUFWriter) -> int:
    """Write the tiny fixture's tokenizer into w; returns its vocabulary size."""
    tok = _tokenizer_fields()
    w.add_tokenizer_model(tok["tokenizer.ggml.model"])
    w.add_token_list(tok["tokenizer.ggml.tokens"])
    w.add_token_types(tok["tokenizer.ggml.token_type"])
    w.add_token_merges(tok["tokenizer.ggml.merges"])
    w.add_bos_token_id(tok["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(tok["tokenizer.ggml.eos_token_id"])
    return len(tok["tokenizer.ggml.tokens"])


def write_llama(path: Path, *, arch: str = "llama", drop: set[str] = frozenset(),
                reshape: dict[str, tuple[int, ...]] | None = None, drop_meta: set[str] = frozenset()) -> Path:
    """A 1-layer random llama GGUF, optionally missing tensors/keys or with a tensor of the wrong shape."""
    w = gguf.GGUFWriter(str(path), arch)
    keys = {
        f"{arch}.block_count": L, f"{arch}.embedding_length": H, f"{arch}.feed_forward_length": FF,
        f"{arch}.attention.head_count": NH, f"{arch}.attention.head_count_kv": NH, f"{arch}.context_length": 64,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-6,
    }
    for k, v in keys.items():
        if k in drop_meta:
            continue
        if isinstance(v, float):
            w.add_float32(k, v)
        else:
            w.add_uint32(k, v)
    vocab = add_tiny_tokenizer(w)
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (vocab, H), "output_norm.weight": (H,), "blk.0.attn_norm.weight": (H,),
              "blk.0.attn_q.weight": (H, H), "blk.0.attn_k.weight": (H, H), "blk.0.attn_v.weight": (H, H),
              "blk.0.attn_output.weight": (H, H), "blk.0.ffn_norm.weight": (H,),
              "blk.0.ffn_gate.weight": (FF, H), "blk.0.ffn_up.weight": (FF, H), "blk.0.ffn_down.weight": (H, FF)}
    shapes.update(reshape or {})
    for name, shape in shapes.items():
        if name not in drop:
            w.add_tensor(name, rng.normal(0, 0.2, size=shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def load(path: Path) -> engine.Model:
    return engine.load(path, engine.LoadOptions(n_slots=1, max_seq=32, prefill_chunk=16))


def test_the_written_model_loads_and_generates(tmp_path):
    m = load(write_llama(tmp_path / "ok.gguf"))
    assert len(list(reference.generate(m, [5, 6, 7], max_tokens=3, stop_ids=[]))) == 3


def expect_error(path: Path, *words: str) -> ModelLoadError:
    with pytest.raises(ModelLoadError) as exc:
        load(path)
    msg = str(exc.value)
    assert str(path) in msg, msg
    for w in words:
        assert w in msg, msg
    return exc.value


def test_missing_file(tmp_path):
    expect_error(tmp_path / "nope.gguf", "does not exist")


def test_not_a_gguf(tmp_path):
    p = tmp_path / "junk.gguf"
    p.write_bytes(b"PK\x03\x04" + bytes(200))
    expect_error(p, "not a GGUF")


@pytest.mark.parametrize("keep", [0.3, 0.6, 0.99])
def test_truncated_file(tmp_path, keep):
    good = write_llama(tmp_path / "full.gguf")
    data = good.read_bytes()
    p = tmp_path / f"cut{keep}.gguf"
    p.write_bytes(data[: int(len(data) * keep)])
    expect_error(p)


def test_unknown_architecture(tmp_path):
    expect_error(write_llama(tmp_path / "arch.gguf", arch="frobnicator"), "unsupported architecture", "frobnicator")


def test_missing_tensor(tmp_path):
    expect_error(write_llama(tmp_path / "miss.gguf", drop={"blk.0.ffn_up.weight"}), "missing tensor",
                 "blk.0.ffn_up.weight")


def test_wrong_tensor_shape(tmp_path):
    expect_error(write_llama(tmp_path / "shape.gguf", reshape={"blk.0.attn_q.weight": (H + 2, H)}),
                 "blk.0.attn_q.weight", "shape")


def test_missing_metadata_key(tmp_path):
    expect_error(write_llama(tmp_path / "meta.gguf", drop_meta={"llama.block_count"}), "llama.block_count")
