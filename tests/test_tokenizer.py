"""Specification of pantheon.text.tokenizer against the HF oracle fixtures and the streaming invariant.

The real-model cases require ids equal to HF's (`ids_hf`), which is also llama.cpp's except for one Qwen
string where llama.cpp re-types the normal token `</s>` as control; HF's answer is the reference.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import decoders

from conftest import FIXTURES
from pantheon.errors import ModelLoadError
from pantheon.formats.gguf_reader import open_reader, read_metadata
from pantheon.text.tokenizer import StreamDecoder, Tokenizer

REAL_NAMES = ["smollm2-135m", "qwen-0.5b", "gemma3-270m"]
_cache: dict[str, Tokenizer] = {}


def _fixture(name: str) -> dict:
    return json.loads((FIXTURES / "real" / f"{name}.json").read_text())


@pytest.fixture(scope="session")
def real_tok(real_model_path):
    """real_tok(name) -> Tokenizer of a catalog model, built once per session (metadata reads are slow)."""

    def get(name: str) -> Tokenizer:
        if name not in _cache:
            path = real_model_path(name)  # a failed pull fails the test: real models never skip
            _cache[name] = Tokenizer.from_gguf_metadata(read_metadata(open_reader(path)), str(path))
        return _cache[name]

    return get


def _cases(key: str) -> list:
    out = []
    for name in REAL_NAMES:
        for i, case in enumerate(_fixture(name)[key]):
            out.append(pytest.param(name, case, id=f"{name}-{i}"))
    return out


@pytest.mark.parametrize("name,case", _cases("tokenizer_cases"))
def test_encode_matches_hf(real_tok, name, case):
    assert real_tok(name).encode(case["text"]) == case["ids_hf"]


@pytest.mark.parametrize("name,case", _cases("tokenizer_cases"))
def test_decode_matches_hf(real_tok, name, case):
    assert real_tok(name).decode(case["ids_hf"]) == case["decoded_hf"]


@pytest.mark.parametrize("name,case", _cases("chat_cases"))
def test_rendered_prompt_ids(real_tok, name, case):
    assert real_tok(name).encode(case["rendered"]) == case["prompt_ids"]


@pytest.mark.parametrize("name", REAL_NAMES)
def test_stop_ids_are_the_end_of_generation_set(real_tok, name):
    assert real_tok(name).eot_ids == frozenset(_fixture(name)["stop_ids"])


def test_real_special_tokens(real_tok):
    qwen = real_tok("qwen-0.5b")
    ids = qwen.encode("<tool_call>x</tool_call><|im_end|>")
    assert ids[0] == 151657 and ids[-2:] == [151658, 151645]
    # Special tokens decode to their text (downstream emitters look for the markers); skip_special drops
    # control tokens only.
    assert qwen.decode(ids) == "<tool_call>x</tool_call><|im_end|>"
    assert qwen.decode(ids, skip_special=True) == "<tool_call>x</tool_call>"
    assert qwen.token_text(151645) == "<|im_end|>"
    assert (qwen.bos_id, qwen.eos_id, qwen.add_bos) == (151643, 151645, False)
    gemma = real_tok("gemma3-270m")
    assert (gemma.bos_token, gemma.eos_token, gemma.add_bos) == ("<bos>", "<eos>", True)
    assert gemma.encode("hi", add_special=True)[0] == gemma.bos_id
    assert gemma.encode("<bos>hi", add_special=True).count(gemma.bos_id) == 1  # never a double BOS
    assert gemma.decode(gemma.encode("\n\n  a\tb"), skip_special=True) == "\n\n  a\tb"  # user-defined kept


# --- streaming ---------------------------------------------------------------------------------------------

_MULTIBYTE = "中文测试：你好，世界！日本語のテキスト😀👍🏽👨‍👩‍👧‍👦🇫🇷Ελληνικά ŁÓDŹ é 𓀀ꙮ𝕏ᚠ"


def _check_stream(tok: Tokenizer, ids: list[int], skip_special: bool = False) -> None:
    dec = tok.stream(skip_special)
    assert isinstance(dec, StreamDecoder)
    emitted = ""
    for k, i in enumerate(ids):
        chunk = dec.push(i)
        emitted += chunk
        so_far = tok.decode(ids[: k + 1], skip_special)
        # Everything emitted is final text, and only an incomplete character (shown as U+FFFD by a full
        # decode of the prefix) may be held back.
        assert so_far.startswith(emitted)
        assert set(so_far[len(emitted):]) <= {"\ufffd"}
    emitted += dec.flush()
    assert emitted == tok.decode(ids, skip_special)


@pytest.mark.parametrize("name", ["qwen-0.5b", "gemma3-270m"])
def test_stream_splits_multibyte_characters(real_tok, name):
    tok = real_tok(name)
    ids = tok.encode(_MULTIBYTE)
    assert any("\ufffd" in tok.token_text(i) for i in ids)  # the text really is split inside characters
    dec = tok.stream()
    chunks = [dec.push(i) for i in ids] + [dec.flush()]
    assert "".join(chunks) == _MULTIBYTE
    assert not any("\ufffd" in c for c in chunks)


@pytest.mark.parametrize("name", ["qwen-0.5b", "gemma3-270m"])
def test_stream_property(real_tok, name):
    tok = real_tok(name)
    multibyte_ids = sorted(set(tok.encode(_MULTIBYTE)))
    byte_ids = [i for i in range(min(tok.vocab_size, 1000)) if len(tok.token_bytes(i)) == 1
                and tok.token_bytes(i)[0] >= 0x80]
    pool = st.one_of(st.integers(0, tok.vocab_size - 1), st.sampled_from(multibyte_ids), st.sampled_from(byte_ids))

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(ids=st.lists(pool, max_size=40), skip=st.booleans())
    def prop(ids, skip):
        _check_stream(tok, ids, skip)

    prop()


# --- tiny fixtures and error handling ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_tiny_fixture_round_trip(name):
    path = FIXTURES / "tiny" / f"{name}.gguf"
    tok = Tokenizer.from_gguf_metadata(read_metadata(open_reader(path)), str(path))
    text = "The quick brown fox jumps over the lazy dog. It's 42!"
    ids = tok.encode(text)
    assert 0 < len(ids) < len(text) and all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.vocab_size == 512
    im_end = tok.encode("<|im_end|>")
    assert len(im_end) == 1 and im_end[0] in tok.eot_ids
    _check_stream(tok, ids + im_end)


def _tiny_meta() -> dict:
    return read_metadata(open_reader(FIXTURES / "tiny" / "llama.gguf"))


@pytest.mark.parametrize("change,needle", [
    ({"tokenizer.ggml.tokens": None}, "tokenizer.ggml.tokens"),
    ({"tokenizer.ggml.model": "bert"}, "unsupported tokenizer.ggml.model"),
    ({"tokenizer.ggml.pre": "made-up"}, "unknown pre-tokenizer"),
    ({"tokenizer.ggml.merges": None}, "merges"),
    ({"tokenizer.ggml.merges": ["nospace"]}, "malformed merge"),
    ({"tokenizer.ggml.merges": ["zzzz qqqq"]}, "invalid tokenizer data"),
    ({"tokenizer.ggml.token_type": [1, 1]}, "token_type"),
    ({"tokenizer.ggml.eos_token_id": 99999}, "eos_token_id"),
    ({"tokenizer.ggml.model": "llama"}, "scores"),
])
def test_inconsistent_file_is_a_model_load_error(change, needle):
    meta = _tiny_meta()
    for k, v in change.items():
        if v is None:
            meta.pop(k)
        else:
            meta[k] = v
    with pytest.raises(ModelLoadError, match=needle) as info:
        Tokenizer.from_gguf_metadata(meta, "/models/broken.gguf")
    assert info.value.path == "/models/broken.gguf"


def test_from_hf_files(tmp_path):
    """An HF tokenizer.json (as in safetensors directories) loads with bos/eos from tokenizer_config."""
    gguf_tok = Tokenizer.from_gguf_metadata(_tiny_meta())
    hf = gguf_tok._hf
    hf.decoder = decoders.ByteLevel()
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>"}, "chat_template": "{{ messages }}"}))
    tok = Tokenizer.from_hf_files(tmp_path / "tokenizer.json", tmp_path / "tokenizer_config.json")
    text = "<|im_start|>user\nHello there, café!<|im_end|>"
    assert tok.encode(text) == gguf_tok.encode(text)
    assert tok.decode(tok.encode(text)) == text
    assert (tok.bos_token, tok.eos_token, tok.chat_template) == ("<|im_start|>", "<|im_end|>", "{{ messages }}")
    assert tok.eot_ids == gguf_tok.eot_ids
    with pytest.raises(ModelLoadError):
        Tokenizer.from_hf_files(tmp_path / "missing.json")
