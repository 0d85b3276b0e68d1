"""The command line: `pantheon logits` writes oracle-equal logits; `info` and `generate` run on real files."""

from __future__ import annotations

import numpy as np

from conftest import centered, tiny_fixture
from pantheon.cli import main


def test_logits_command_computes_at_full_precision_by_default(tmp_path, monkeypatch):
    """`pantheon logits` is the tool for comparing with other engines: it keeps its KV cache in f32
    whatever the serving default is, and matches the HF float64 oracle to ~1e-5."""
    monkeypatch.setenv("PANTHEON_KV_DTYPE", "float16")  # the serving setting must not leak into it
    path, j, ref = tiny_fixture("qwen2")
    ids = ",".join(map(str, j["prompt_ids"]))
    out = tmp_path / "l.npy"
    assert main(["logits", "--model", str(path), "--ids", ids, "--out", str(out), "--max-seq", "64"]) == 0
    got = np.load(out)
    assert got.dtype == np.float32 and got.shape == ref.shape
    assert np.abs(centered(got) - centered(ref)).max() < 3e-5
    half = tmp_path / "h.npy"  # asked for, the serving cache dtype is used (and is measurably coarser)
    assert main(["logits", "--model", str(path), "--ids", ids, "--out", str(half), "--max-seq", "64",
                 "--kv-dtype", "auto"]) == 0
    assert np.abs(centered(np.load(half)) - centered(ref)).max() > np.abs(centered(got) - centered(ref)).max()


def test_info_lists_config_and_tensor_types(capsys):
    path, _, _ = tiny_fixture("llama.q8_0")
    assert main(["info", str(path)]) == 0
    out = capsys.readouterr().out
    assert "arch: llama" in out and "Q8_0" in out


def test_generate_streams_text(capsys):
    path, _, _ = tiny_fixture("llama")
    assert main(["generate", "--model", str(path), "--prompt", "Hello", "--max-tokens", "5", "--max-seq", "64"]) == 0
    assert capsys.readouterr().out.strip()


def test_unknown_model_is_a_clean_error(capsys):
    assert main(["info", "no-such-model"]) == 1
    assert "no-such-model" in capsys.readouterr().err
