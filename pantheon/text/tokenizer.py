"""Tokenizer built from a GGUF file's vocabulary (or an HF tokenizer.json), plus streaming detokenization.

Encoding is delegated to the HF `tokenizers` library: we only assemble its model, normalizer and
pre-tokenizer from the file's metadata so that the result reproduces what llama.cpp and HF produce for the
same file (the oracle fixtures check this id for id).

Decoding is done here, from a per-token byte table, instead of with an HF decoder: a token is a byte
string, and a text is the UTF-8 decoding of the concatenated bytes. That makes streaming exact and O(1)
per token (an incremental UTF-8 decoder holds back an incomplete character), so the streamed chunks always
concatenate to the full decode, which an HF decoder cannot guarantee for invalid byte sequences.

Facts used (from llama.cpp's llama-vocab.cpp and the GGUF spec, re-expressed here):

* ``tokenizer.ggml.model = gpt2``: byte-level BPE; the text is split by the regex list selected by
  ``tokenizer.ggml.pre`` (each regex splits the pieces left by the previous one, keeping unmatched text as
  pieces), then every byte is mapped to the GPT-2 printable alphabet and merged by ``tokenizer.ggml.merges``.
* ``tokenizer.ggml.model = llama``: SentencePiece BPE. Spaces become ``▁`` (and one is prepended when
  ``tokenizer.ggml.add_space_prefix`` is true), there is no pre-splitting, adjacent symbols are merged by the
  score of the merged token (highest first), and characters missing from the vocabulary fall back to the
  ``<0xXX>`` byte tokens.
* ``tokenizer.ggml.model = rwkv``: the RWKV World tokenizer. Each token text is the Python ``repr`` of its
  bytes without the quotes (``\\xNN``, ``\\t``, ``\\n``, ``\\r`` and ``\\<c>`` escapes); encoding is a greedy
  longest match over the UTF-8 bytes in a trie of every token (control and padding tokens included), with no
  normalizer, pre-splitting or BOS.
* ``token_type``: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte. Control and
  user-defined tokens are matched verbatim in the input before the model sees it.
"""

from __future__ import annotations

import codecs
import functools
import json
import re
from pathlib import Path
from typing import Any, Iterable, Sequence

from tokenizers import AddedToken, Regex, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from pantheon.errors import ModelLoadError

TT_NORMAL, TT_UNKNOWN, TT_CONTROL, TT_USER_DEFINED, TT_UNUSED, TT_BYTE = 1, 2, 3, 4, 5, 6

# --- pre-tokenizer regexes (llama.cpp's lists, by `tokenizer.ggml.pre`) -----------------------------------

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
_QWEN2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
          r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
          r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")

_PRE_FAMILIES: dict[str, list[str]] = {
    "default": [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"],
    "gpt2": [_GPT2],
    "llama3": [_LLAMA3],
    "qwen2": [_QWEN2],
    "digits": [r"\p{N}", _GPT2],
    "falcon": [r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"],
    "gpt4o": [_GPT4O],
}
# `tokenizer.ggml.pre` value -> (family, ignore_merges). llama.cpp sets ignore_merges for the llama3 family:
# a pre-token that is itself a vocabulary entry is emitted whole instead of being merged up from bytes.
_PRE_NAMES: dict[str, tuple[str, bool]] = {
    "default": ("default", False),
    **{n: ("gpt2", False) for n in ("gpt-2", "gpt2", "phi-2", "jina-es", "jina-de", "jina-v1-en", "jina-v2-es",
                                     "jina-v2-de", "jina-v2-code", "roberta-bpe", "gigachat", "mpt", "olmo",
                                     "jais", "trillion", "mellum", "a.x-4.0")},
    **{n: ("llama3", True) for n in ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                                      "midm-2.0", "lfm2")},
    **{n: ("llama3", False) for n in ("dbrx", "smaug-bpe", "chatglm-bpe")},
    **{n: ("qwen2", False) for n in ("qwen2", "stablelm2", "deepseek-r1-qwen", "megrez", "hunyuan")},
    **{n: ("digits", False) for n in ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone",
                                       "minerva-7b")},
    "falcon": ("falcon", False),
    **{n: ("gpt4o", False) for n in ("gpt-4o", "llama4")},
}

# Texts of control tokens that end a turn or a document; all of them stop generation.
_EOG_TEXTS = frozenset({
    "<|im_end|>", "<|endoftext|>", "<|end_of_text|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>",
    "<|return|>", "<|call|>", "<｜end▁of▁sentence｜>", "<|END_OF_TURN_TOKEN|>", "<EOT>", "<|eot|>",
})


def _byte_level_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map: printable Latin-1 bytes stand for themselves,
    the remaining bytes take the characters from U+0100 upwards in byte order."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(0x100 + extra)
            extra += 1
    return out


_BYTE_TO_CHAR = _byte_level_alphabet()
# Translate byte-level characters to the Latin-1 character with the same byte value, so that
# `token.translate(_CHAR_TO_LATIN1).encode("latin-1")` gives the token's bytes in one C call.
_CHAR_TO_LATIN1 = {ord(c): chr(b) for b, c in _BYTE_TO_CHAR.items()}
_BYTE_TOKEN_RE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_bytes(token: str) -> bytes:
    try:
        return token.translate(_CHAR_TO_LATIN1).encode("latin-1")
    except UnicodeEncodeError:  # not a byte-level string (e.g. a raw added token): take it literally
        return token.encode("utf-8")


def _spm_bytes(token: str) -> bytes:
    m = _BYTE_TOKEN_RE.fullmatch(token)
    if m:
        return bytes([int(m.group(1), 16)])
    return token.replace("\u2581", " ").encode("utf-8")


def _sentencepiece_merges(tokens: Sequence[str], scores: Sequence[float], types: Sequence[int],
                          vocab: dict[str, int]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's score-driven merging: every split of a normal token into two
    vocabulary entries is a merge, ranked by the merged token's score (higher first, then lower id)."""
    order = sorted((i for i, t in enumerate(tokens) if types[i] == TT_NORMAL and len(t) > 1),
                   key=lambda i: (-scores[i], i))
    merges: list[tuple[str, str]] = []
    for tid in order:
        tok = tokens[tid]
        for i in range(1, len(tok)):
            left, right = tok[:i], tok[i:]
            if left in vocab and right in vocab:
                merges.append((left, right))
    return merges


def unescape_rwkv(text: str) -> bytes:
    """The bytes an RWKV World token text stands for: the converter wrote `repr(token_bytes)[2:-1]`, so
    `\\xNN` is a byte, `\\t` `\\n` `\\r` their controls, `\\<c>` the character c, anything else itself."""
    if "\\" not in text:
        return text.encode("utf-8")
    out = bytearray()
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c != "\\" or i + 1 == n:
            out += c.encode("utf-8")
            i += 1
            continue
        e = text[i + 1]
        if e == "x" and i + 3 < n and all(h in "0123456789abcdefABCDEF" for h in text[i + 2:i + 4]):
            out.append(int(text[i + 2:i + 4], 16))
            i += 4
            continue
        out += {"t": b"\t", "n": b"\n", "r": b"\r"}.get(e, e.encode("utf-8"))
        i += 2
    return bytes(out)


class ByteTrie:
    """The RWKV World encoder: at each position, the longest token whose bytes start there.

    Why not an HF `tokenizers` model: none of them does a greedy longest match over raw bytes in linear
    time (WordPiece matches greedily, but over characters, by shrinking the candidate from the end: quadratic
    in the word, and a prompt is one word here). The trie is nested dicts keyed by byte; the key -1 holds
    the id of the token ending at that node (a later id wins, as in llama.cpp's trie).
    """

    normalizer = None  # read by Tokenizer.min_tokens: the bytes are matched as they are

    def __init__(self, token_bytes: Sequence[bytes]):
        self._root: dict[int, Any] = {}
        for tid, b in enumerate(token_bytes):
            if not b:
                continue
            node = self._root
            for byte in b:
                node = node.setdefault(byte, {})
            node[-1] = tid

    def encode(self, data: bytes) -> list[int]:
        """Ids of `data`; a byte no token starts with is skipped (a World vocabulary has every byte)."""
        out: list[int] = []
        root, pos, n = self._root, 0, len(data)
        while pos < n:
            node = root.get(data[pos])
            best, end = -1, pos + 1
            j = pos
            while node is not None:
                j += 1
                tid = node.get(-1)
                if tid is not None:
                    best, end = tid, j
                if j >= n:
                    break
                node = node.get(data[j])
            if best >= 0:
                out.append(best)
            pos = end
        return out

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[Any]:
        """The slice of the HF `Tokenizer` interface `Tokenizer.encode` uses."""
        return [_Encoding(self.encode(t.encode("utf-8", "surrogatepass"))) for t in texts]


class _Encoding:
    __slots__ = ("ids",)

    def __init__(self, ids: list[int]):
        self.ids = ids


class Tokenizer:
    """Text <-> ids for one model. Special-token text in the input is always parsed as the special token."""

    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    eot_ids: frozenset[int]
    add_bos: bool
    add_eos: bool
    bos_token: str | None
    eos_token: str | None
    chat_template: str | None

    def __init__(self, hf: "HFTokenizer | ByteTrie", token_bytes: list[bytes], control_ids: frozenset[int], *,
                 bos_id: int | None, eos_id: int | None, eot_ids: Iterable[int], add_bos: bool, add_eos: bool,
                 strip_leading_space: bool, chat_template: str | None = None):
        """Low-level constructor; use `from_gguf_metadata` or `from_hf_files`."""
        self._hf = hf
        self._bytes = token_bytes
        self._control = control_ids
        self._strip_leading_space = strip_leading_space
        self.vocab_size = len(token_bytes)
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.eot_ids = frozenset(i for i in eot_ids if 0 <= i < self.vocab_size)
        self.add_bos = add_bos
        self.add_eos = add_eos
        self.bos_token = self._text_of(bos_id)
        self.eos_token = self._text_of(eos_id)
        self.chat_template = chat_template

    def _text_of(self, tid: int | None) -> str | None:
        if tid is None or not 0 <= tid < self.vocab_size:
            return None
        return self._bytes[tid].decode("utf-8", errors="replace")

    # --- construction ------------------------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], path: str = "") -> "Tokenizer":
        """Build the tokenizer described by a GGUF file's `tokenizer.ggml.*` keys.

        Raises ModelLoadError naming `path` for anything inconsistent, so a broken file fails at load time
        rather than producing wrong ids later.
        """
        tokens = meta.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
            raise ModelLoadError(path, "tokenizer.ggml.tokens is missing or not a list of strings")
        n = len(tokens)
        types = meta.get("tokenizer.ggml.token_type")
        if types is None:
            types = [TT_NORMAL] * n
        if not isinstance(types, list) or len(types) != n:
            raise ModelLoadError(path, f"tokenizer.ggml.token_type has {len(types)} entries for {n} tokens"
                                 if isinstance(types, list) else "tokenizer.ggml.token_type is not a list")
        kind = meta.get("tokenizer.ggml.model")
        try:
            if kind == "gpt2":
                hf, tbytes, strip = cls._build_byte_level(meta, tokens, types, path)
            elif kind == "llama":
                hf, tbytes, strip = cls._build_sentencepiece(meta, tokens, types, path)
            elif kind == "rwkv":
                tbytes = [unescape_rwkv(t) for t in tokens]
                hf, strip = ByteTrie(tbytes), False
            else:
                raise ModelLoadError(path, f"unsupported tokenizer.ggml.model {kind!r} (supported: gpt2, llama, rwkv)")
        except ModelLoadError:
            raise
        except Exception as exc:  # the tokenizers library rejects e.g. merges that name unknown tokens
            raise ModelLoadError(path, f"invalid tokenizer data: {type(exc).__name__}: {exc}") from exc

        def opt_id(key: str) -> int | None:
            v = meta.get(key)
            if v is None:
                return None
            if not isinstance(v, int) or not 0 <= v < n:
                raise ModelLoadError(path, f"{key} = {v!r} is not a token id (vocabulary has {n} tokens)")
            return v

        bos_id, eos_id = opt_id("tokenizer.ggml.bos_token_id"), opt_id("tokenizer.ggml.eos_token_id")
        eot = {i for i in (eos_id, opt_id("tokenizer.ggml.eot_token_id"), opt_id("tokenizer.ggml.eom_token_id"))
               if i is not None}
        eot |= {i for i, t in enumerate(tokens) if types[i] == TT_CONTROL and t in _EOG_TEXTS}
        control = frozenset(i for i, t in enumerate(types) if t == TT_CONTROL)
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama"))
        add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
        return cls(hf, tbytes, control, bos_id=bos_id, eos_id=eos_id, eot_ids=eot, add_bos=add_bos,
                   add_eos=add_eos, strip_leading_space=strip, chat_template=meta.get("tokenizer.chat_template"))

    @staticmethod
    def _added_tokens(tokens: Sequence[str], types: Sequence[int]) -> list[AddedToken]:
        """Control and user-defined tokens, matched verbatim in the raw (un-normalized) input."""
        return [AddedToken(t, special=(ty == TT_CONTROL), normalized=False)
                for t, ty in zip(tokens, types) if ty in (TT_CONTROL, TT_USER_DEFINED) and t]

    @staticmethod
    def _vocab(tokens: Sequence[str]) -> dict[str, int]:
        vocab: dict[str, int] = {}
        for i, t in enumerate(tokens):
            vocab.setdefault(t, i)  # a duplicated string encodes to its first id
        return vocab

    @classmethod
    def _build_byte_level(cls, meta: dict[str, Any], tokens: list[str], types: list[int],
                          path: str) -> tuple[HFTokenizer, list[bytes], bool]:
        merges_raw = meta.get("tokenizer.ggml.merges")
        if not isinstance(merges_raw, list):
            raise ModelLoadError(path, "gpt2 tokenizer without tokenizer.ggml.merges")
        merges = []
        for m in merges_raw:
            parts = m.split(" ", 1) if isinstance(m, str) else []
            if len(parts) != 2 or not parts[0] or not parts[1]:
                raise ModelLoadError(path, f"malformed merge {m!r} in tokenizer.ggml.merges")
            merges.append((parts[0], parts[1]))
        pre = meta.get("tokenizer.ggml.pre", "default")
        if pre not in _PRE_NAMES:
            raise ModelLoadError(path, f"unknown pre-tokenizer tokenizer.ggml.pre = {pre!r} "
                                       f"(supported: {', '.join(sorted(_PRE_NAMES))})")
        family, ignore_merges = _PRE_NAMES[pre]
        hf = HFTokenizer(models.BPE(cls._vocab(tokens), merges, ignore_merges=ignore_merges))
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in _PRE_FAMILIES[family]]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        hf.add_tokens(cls._added_tokens(tokens, types))
        tbytes = [t.encode("utf-8") if ty in (TT_CONTROL, TT_USER_DEFINED) else _byte_level_bytes(t)
                  for t, ty in zip(tokens, types)]
        return hf, tbytes, False

    @classmethod
    def _build_sentencepiece(cls, meta: dict[str, Any], tokens: list[str], types: list[int],
                             path: str) -> tuple[HFTokenizer, list[bytes], bool]:
        scores = meta.get("tokenizer.ggml.scores")
        if not isinstance(scores, list) or len(scores) != len(tokens):
            raise ModelLoadError(path, "llama (SentencePiece) tokenizer needs tokenizer.ggml.scores, one per token")
        vocab = cls._vocab(tokens)
        unk_id = meta.get("tokenizer.ggml.unknown_token_id")
        unk = tokens[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < len(tokens) else None
        merges = _sentencepiece_merges(tokens, scores, types, vocab)
        hf = HFTokenizer(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
        add_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        replace = normalizers.Replace(" ", "\u2581")
        hf.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), replace]) if add_prefix else replace
        hf.add_tokens(cls._added_tokens(tokens, types))
        tbytes = [t.encode("utf-8") if ty in (TT_CONTROL, TT_USER_DEFINED, TT_UNKNOWN) else _spm_bytes(t)
                  for t, ty in zip(tokens, types)]
        return hf, tbytes, add_prefix

    @classmethod
    def from_hf_files(cls, tokenizer_json: Path, tokenizer_config_json: Path | None = None) -> "Tokenizer":
        """Load an HF `tokenizer.json` (safetensors model directories), with bos/eos from tokenizer_config.

        Only the byte-level (GPT-2 style) and SentencePiece (``▁`` + byte fallback) vocabularies are
        supported, because decoding uses the same per-token byte table as the GGUF path.
        """
        try:
            raw = json.loads(Path(tokenizer_json).read_text(encoding="utf-8"))
            hf = HFTokenizer.from_str(json.dumps(raw))
            config = (json.loads(Path(tokenizer_config_json).read_text(encoding="utf-8"))
                      if tokenizer_config_json is not None and Path(tokenizer_config_json).exists() else {})
        except Exception as exc:
            raise ModelLoadError(tokenizer_json, f"cannot read tokenizer: {type(exc).__name__}: {exc}") from exc
        vocab = hf.get_vocab(with_added_tokens=True)
        n = max(vocab.values()) + 1 if vocab else 0
        if n == 0:
            raise ModelLoadError(tokenizer_json, "empty vocabulary")
        added = {a["id"]: a for a in raw.get("added_tokens", [])}
        decoder_text = json.dumps(raw.get("decoder") or {})
        if "ByteLevel" in decoder_text:
            to_bytes, strip = _byte_level_bytes, False
        elif "ByteFallback" in decoder_text or "Metaspace" in decoder_text or "\u2581" in decoder_text:
            to_bytes, strip = _spm_bytes, ('"Strip"' in decoder_text or '"prepend_scheme": "always"' in decoder_text
                                           or '"prepend_scheme": "first"' in decoder_text)
        else:
            raise ModelLoadError(tokenizer_json, "unsupported decoder (need ByteLevel or SentencePiece byte fallback)")
        tbytes = [b""] * n
        for tok, i in vocab.items():
            tbytes[i] = tok.encode("utf-8") if i in added else to_bytes(tok)
        control = frozenset(i for i, a in added.items() if a.get("special"))

        def config_token(key: str) -> str | None:
            v = config.get(key)
            return v.get("content") if isinstance(v, dict) else v

        bos_text, eos_text = config_token("bos_token"), config_token("eos_token")
        bos_id, eos_id = vocab.get(bos_text) if bos_text else None, vocab.get(eos_text) if eos_text else None
        eot = {eos_id} if eos_id is not None else set()
        eot |= {i for i in control if added[i]["content"] in _EOG_TEXTS}
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        return cls(hf, tbytes, control, bos_id=bos_id, eos_id=eos_id, eot_ids=eot,
                   add_bos=bool(config.get("add_bos_token", False)), add_eos=bool(config.get("add_eos_token", False)),
                   strip_leading_space=strip, chat_template=template)

    # --- use -----------------------------------------------------------------------------------------------

    def encode(self, text: str, add_special: bool = False) -> list[int]:
        """Token ids of `text`; special-token text is parsed as special. With `add_special`, BOS/EOS are added
        as the file asks (BOS not twice when the text already starts with it)."""
        # encode_batch, not encode: the Rust side releases the GIL only in the batch call. A 4 MB prompt
        # takes seconds to tokenize; in a worker thread it must not freeze the server's event loop.
        ids = self._hf.encode_batch([text], add_special_tokens=False)[0].ids
        if add_special:
            if self.add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
                ids.insert(0, self.bos_id)
            if self.add_eos and self.eos_id is not None:
                ids.append(self.eos_id)
        return ids

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most bytes any one token stands for: a text of B bytes has at least B / this many tokens."""
        return max(1, max((len(b) for b in self._bytes), default=1))

    def min_tokens(self, text: str) -> int:
        """A lower bound on len(encode(text)), in time linear in the text and without tokenizing it.

        Every token stands for at most `max_token_bytes` bytes, so B bytes need B / max_token_bytes
        tokens. A normaliser can shrink the text first (Unicode composition folds up to 3 code points
        into one), so with one the bound is divided by 3 more. Admission uses it to refuse a prompt
        that cannot fit before spending seconds tokenizing it.
        """
        per_token = self.max_token_bytes * (1 if getattr(self._hf, "normalizer", None) is None else 3)
        return len(text.encode("utf-8", "surrogatepass")) // per_token

    def token_bytes(self, id: int) -> bytes:
        """The raw bytes one token stands for (b"" for an id outside the vocabulary)."""
        return self._bytes[id] if 0 <= id < self.vocab_size else b""

    def token_text(self, id: int) -> str:
        """The text of one token as a client sees it (a partial UTF-8 character shows as U+FFFD)."""
        return self.token_bytes(id).decode("utf-8", errors="replace")

    def is_control(self, id: int) -> bool:
        """True for control tokens (BOS, EOS, turn markers): the ones `skip_special` removes."""
        return id in self._control

    def _pieces(self, ids: Iterable[int], skip_special: bool) -> Iterable[bytes]:
        first = self._strip_leading_space
        for i in ids:
            if skip_special and i in self._control:
                continue
            b = self.token_bytes(i)
            if first:
                # SentencePiece with an added prefix space: the first token's space is that prefix, not text.
                first = False
                if b.startswith(b" "):
                    b = b[1:]
            yield b

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """Text of `ids`. Special tokens decode to their text unless `skip_special`; invalid UTF-8 decodes to
        U+FFFD; ids outside the vocabulary decode to nothing."""
        return b"".join(self._pieces(ids, skip_special)).decode("utf-8", errors="replace")

    def stream(self, skip_special: bool = False, at_start: bool = True) -> "StreamDecoder":
        """An incremental decoder whose chunks concatenate to `decode(all pushed ids)`.

        `at_start=False`: the ids continue a text decoded elsewhere (a legacy completion after its prompt),
        so a SentencePiece first token keeps its leading space: there it is a word break, not the prefix."""
        return StreamDecoder(self, skip_special, at_start)


class StreamDecoder:
    """Turns generated ids into text chunks one token at a time, never splitting a UTF-8 character."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False, at_start: bool = True):
        self._tok = tokenizer
        self._skip = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._first = tokenizer._strip_leading_space and at_start

    def push(self, token_id: int) -> str:
        """Text completed by this token ("" while a multi-byte character is still incomplete)."""
        if self._skip and self._tok.is_control(token_id):
            return ""
        b = self._tok.token_bytes(token_id)
        if self._first:
            self._first = False
            if b.startswith(b" "):
                b = b[1:]
        return self._utf8.decode(b)

    def flush(self) -> str:
        """Whatever is held back (an incomplete character at the end decodes to U+FFFD)."""
        return self._utf8.decode(b"", final=True)
