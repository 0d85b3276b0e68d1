"""The request-side types: what a request asks for and what comes back, with no JAX anywhere.

The web layer builds these and the schedulers consume them; neither the web package nor this module
imports JAX (a test enforces it), so request validation, templating and streaming never wait on, or
pull in, the device runtime.

Events a backend hands a request's sink, in order:

    Started()                       the request has a slot and is prefilling (absent if refused)
    Tokens(ids, choice, logprobs,   one or more sampled ids of one choice, in order; `stop`: the
           stop)                    last id is one of the request's stop ids (the device's STOP flag)
    Finished(reason, error, ...)    once per choice, last for it: "stop" (a stop id), "length"
                                    (budget), "cancelled" (Handle.cancel), or "error" with `error` set

"stop" and "length" are the device's own flags for the step that ended the choice (the decode state's
STOP / LENGTH, pantheon.runtime.decode_state), carried as they are: the web layer maps them to its
finish reasons and never re-derives them from the ids. (A stop *string*, a tool call and a call cut
short are the web layer's own findings, on the text.)

An n > 1 request gets one Started, then each choice's Tokens interleaved, and n Finished events
(a refused request gets a single Finished("error")).

A request that cannot start (queue timeout, shutdown, admission denied) gets only
`Finished("error", error=BusyError(...))`, so the web layer can still answer with a status code.
`sink` must not block: it hands the event to the request greenlet through a thread-safe wake-up.
"""

from __future__ import annotations

import functools
import math
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Protocol

import numpy as np

from pantheon.contract import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS, SAMPLING, Bound

PENALTY_WINDOW = 64  # the most recent tokens a slot keeps on the device for penalties (decode_state's ring)
DEFAULT_PENALTY_WINDOW = PENALTY_WINDOW  # a request looks at all of them unless it asks for fewer
_U64 = (1 << 64) - 1


def _real(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return out


def _integer(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return int(value)


def _knob(name: str, value: object) -> float | int:
    """`value` checked against the contract's bound for sampling knob `name` (the same one the HTTP
    validators and /openapi.json read), as a float or an int by the bound's kind."""
    b: Bound = SAMPLING[name]
    v = _integer(name, value) if b.kind == "integer" else _real(name, value)
    if not b.holds(v):
        raise ValueError(f"{name} must be in {b.interval()}, got {value!r}")
    return v


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling knobs, validated on construction so a bad request fails before it is queued.

    Out-of-range values raise ``ValueError`` naming the field (the web layer turns it into a 400); the
    ranges are pantheon.contract's, the ones the HTTP routes publish and check.  Neutral
    values (the defaults, except ``temperature``) switch a stage off, so ``SamplingParams(temperature=0)``
    is plain greedy decoding.
    """

    # The defaults and ranges are the request contract's (pantheon.contract.SAMPLING).
    temperature: float = SAMPLING["temperature"].default  # 0 => greedy
    top_k: int = SAMPLING["top_k"].default  # 0 (or >= vocabulary size) => off, -1 too (stored as 0); 1 => greedy
    top_p: float = SAMPLING["top_p"].default  # 1 => off
    min_p: float = SAMPLING["min_p"].default  # 0 => off
    repetition_penalty: float = SAMPLING["repetition_penalty"].default  # 1 => off
    presence_penalty: float = SAMPLING["presence_penalty"].default
    frequency_penalty: float = SAMPLING["frequency_penalty"].default
    seed: int | None = None  # None => a fresh random seed each time one is resolved; any integer (mod 2**64)
    penalty_window: int = DEFAULT_PENALTY_WINDOW  # how many recent tokens the penalties look at; 0 => none

    def __post_init__(self) -> None:
        set_ = partial(object.__setattr__, self)
        for name in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            set_(name, _knob(name, getattr(self, name)))
        if self.top_k < 0:  # the contract's other "off"
            set_("top_k", 0)
        # The seed is not held to the wire's signed 64-bit range: choice_seed derives unsigned ones.
        if self.seed is not None:
            set_("seed", _integer("seed", self.seed))
        w = _integer("penalty_window", self.penalty_window)
        if w < 0:
            raise ValueError(f"penalty_window must be >= 0, got {self.penalty_window!r}")
        set_("penalty_window", w)

    @property
    def is_greedy(self) -> bool:
        """True when the result is the argmax of the penalised logits and no random number is used."""
        return self.temperature == 0.0 or self.top_k == 1

    def resolved_seed(self) -> int:
        """The 64-bit seed to sample with: ``seed mod 2**64`` (so -1 is a valid, fixed seed), or, when no seed
        was given, a fresh one from ``os.urandom`` -- a new one on *every* call, so resolve once per request
        (see :meth:`resolved`) if its draws should form one stream."""
        if self.seed is None:
            return int.from_bytes(os.urandom(8), "little")
        return self.seed & _U64

    def resolved(self) -> "SamplingParams":
        """A copy whose seed is fixed, for the scheduler to keep for the lifetime of a request."""
        return self if self.seed is not None else replace(self, seed=self.resolved_seed())


GREEDY = SamplingParams(temperature=0.0, penalty_window=0, seed=0)


def choice_seed(seed: int, choice: int) -> int:
    """The seed of choice `choice` of an n > 1 request whose (resolved) seed is `seed`: choice 0 keeps
    it (so n=1 and the first of n choices sample alike), the others get distinct 64-bit seeds derived
    from it by a fixed mix (splitmix64), so a seeded n > 1 request is reproducible and its choices differ."""
    if choice == 0:
        return seed & _U64
    z = (seed + choice * 0x9E3779B97F4A7C15) & _U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
    return z ^ (z >> 31)


def stop_ids(tokenizer: Any, ignore_eos: bool = False) -> frozenset[int]:
    """The ids that end a request's generation: the tokenizer's end-of-turn ids (its EOS among them), or
    none under `ignore_eos` (a benchmark's full budget). The one place the set is built: the request
    carries it (`GenRequest.stop_ids`) to the device's stop table and the grammar matcher; the web layer
    learns of a stop from the events (`Tokens.stop`, `Finished.reason`), not by looking the id up."""
    return frozenset() if ignore_eos else frozenset(tokenizer.eot_ids)


@dataclass
class GenRequest:
    """One generation as the schedulers see it: token ids in, a budget, stop ids and sampling knobs.

    The seed is resolved here, once per request: every later reader (the decode state's slot, a
    replay) sees the same one.
    """

    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    stop_ids: frozenset[int] = frozenset()  # stop_ids(tokenizer, ignore_eos): the device stops on these
    session_id: str | None = None
    # Prefix reuse happens only between requests of one scope (the web layer's tenant key: API key,
    # user, session, cache_salt), so a prompt's cached length never tells one client about another's.
    cache_scope: str = ""
    request_id: str = field(default_factory=lambda: secrets.token_hex(12))
    # n > 1: choices that share the prompt (prefilled once); choice i samples with choice_seed(seed, i)
    n: int = 1
    # None: no log probabilities; k in 0..MAX_TOP_LOGPROBS: each sampled token's logprob and the k most
    # likely tokens' (Tokens.logprobs), computed inside the step
    logprobs: int | None = None
    # (token id, bias) pairs added to the logits before everything else in the sampler (ids checked < vocab
    # by the web layer; at most MAX_LOGIT_BIAS)
    logit_bias: tuple[tuple[int, float], ...] = ()
    # A host-side grammar (pantheon.text.structured.Grammar) every choice's tokens must follow, or None. The
    # scheduler gives each choice a matcher; the step masks the logits with its bitmask.
    constraint: Any = None
    # (legacy completions' echo + logprobs) the prompt's own token logprobs with the top k, delivered in
    # Started.prompt_logprobs; None: not computed
    prompt_logprobs: int | None = None
    # Images whose embeddings replace the token embeddings at their positions (PromptImage each, in
    # prompt order; the prompt holds the model's image token at every such position)
    images: tuple["PromptImage", ...] = ()
    # Speculative decoding (prompt-lookup drafts verified inside the step): None follows the server's
    # default (PANTHEON_SPECULATIVE), False opts out. The tokens are the same either way.
    speculative: bool | None = None

    def __post_init__(self) -> None:
        p = self.params.resolved()
        if p.penalty_window > PENALTY_WINDOW:
            p = replace(p, penalty_window=PENALTY_WINDOW)
        self.params = p
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {self.logprobs}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} logit_bias entries, got {len(self.logit_bias)}")

    @functools.cached_property
    def prefix_key(self) -> list[int]:
        """The prompt as prefix reuse compares it: the ids, except that every position of an image
        holds a negative number derived from the image's full content hash (never a token id).

        Why: the image's positions hold the same placeholder id whatever the picture, so comparing
        ids would reuse a cache computed for another image. Python ints compare the whole 256-bit
        digest, so two images share a key only when their pixels are identical; the engine reads a
        negative entry of a chunk as "an image row here"."""
        if not self.images:
            return self.prompt_ids
        key = list(self.prompt_ids)
        for im in self.images:
            mark = -1 - int(im.digest, 16)
            key[im.offset:im.offset + im.n_tokens] = [mark] * im.n_tokens
        return key

    def choice_params(self, choice: int) -> SamplingParams:
        """The sampling knobs of choice `choice` (its own derived seed)."""
        return self.params if choice == 0 else replace(self.params, seed=choice_seed(self.params.seed, choice))


@dataclass(frozen=True)
class PromptImage:
    """One image of a prompt: its preprocessed pixels (f32 [3, S, S], host), the sha256 of those
    pixels, and the `n_tokens` prompt positions from `offset` on that its embeddings fill. `embd`
    [n_tokens, H] (host) when the request already had it encoded (the web layer does, off the
    driver thread); else the scheduler encodes the pixels at insert."""

    pixels: Any = field(repr=False, compare=False)
    digest: str
    offset: int
    n_tokens: int
    embd: Any = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class VisionCard:
    """What the web layer needs to turn an image into prompt tokens: the size images are resized to,
    the normalisation, how many embeddings one image becomes, and the token ids around them.

    The chat template renders each image part as `marker`; like HF's processor, the rendered text then
    has every marker replaced by the image's expansion (`expansion_for`) and is tokenized whole; the
    image's embeddings go where the ids are `image_id`, n_tokens per encoder input. Gemma 3: two
    newlines, <start_of_image>, n_tokens x <image_soft_token>, <end_of_image>, two newlines. Idefics3 /
    SmolVLM (`tiling` > 0): the image is cut into a grid of tiles plus the whole image downscaled, each
    its own run of n_tokens x <image>, written as HF's Idefics3Processor writes them."""

    image_size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    n_tokens: int
    image_id: int
    marker: str
    expansion: str  # one untiled image (Idefics3: the downscaled whole image, after the tiles)
    tiling: int = 0  # Idefics3: the longest side images are resized to before tiling (0: no tiling)
    tile_prefix: str = ""  # Idefics3: what precedes a tile's run, with {row} and {col} (1-based)
    image_text: str = ""  # the image token's text (one run is n_tokens of it)

    def expansion_for(self, rows: int, cols: int) -> str:
        """The text one image becomes: rows x cols tiles (each row ended by a newline), then a newline and
        the whole image; or, untiled (rows = cols = 0), `expansion` alone."""
        if rows == 0 and cols == 0:
            return self.expansion
        run = self.image_text * self.n_tokens
        grid = "".join("".join(self.tile_prefix.format(row=r, col=c) + run for c in range(1, cols + 1)) + "\n"
                       for r in range(1, rows + 1))
        return grid + "\n" + self.expansion


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log probability and, when asked for, the k most likely tokens at its position
    (most likely first), all from the same distribution: the logits after logit_bias, the penalties
    and the grammar mask, before temperature and the top-k / top-p / min-p filters."""

    id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Started:
    reused_tokens: int = 0  # prompt tokens served from a prefix already in the slot
    # GenRequest.prompt_logprobs: one entry per prompt token, the first None (nothing predicts it)
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None


@dataclass(frozen=True)
class Tokens:
    ids: tuple[int, ...]
    choice: int = 0  # which of the request's n choices
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per id when the request asked for logprobs
    # The last id is one of the request's stop ids: the device flagged its step STOP. It ends the choice
    # (a Finished("stop") follows) and is not text.
    stop: bool = False


@dataclass(frozen=True)
class Finished:
    """The end of one choice (an n > 1 request gets one per choice; an "error" one may end them all:
    the web layer treats any error as the request's)."""

    reason: str  # "stop" | "length" (the device's flag) | "cancelled" | "error"
    error: Exception | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0  # of this choice
    reused_tokens: int = 0
    choice: int = 0


Event = Started | Tokens | Finished
Sink = Callable[[Event], None]


class Handle(Protocol):
    def cancel(self, choice: int | None = None) -> None:
        """Stop generating (client gone, stop string hit): the slot is freed within one step.
        `choice`: stop only that choice of an n > 1 request (its own stop string), the others go on."""


class Backend(Protocol):
    def submit(self, req: GenRequest, sink: Sink) -> Handle:
        """Start or queue a request; raises BusyError (429/503) when it cannot even be queued."""

    def load_info(self) -> dict:
        """Counters for /metrics and bench: running, queued, slots, prefix hits..."""

    def close(self, timeout: float = 10.0) -> None:
        """Refuse new work, cancel what runs, join the thread(s)."""


@dataclass(frozen=True)
class ModelGeometry:
    """What admission must know of a loaded model, as a value the engine publishes at load.

    Why a value and not the model: admission (pantheon.serving.admission) sits above the engine and
    must not reach into it (`getattr` on a live Model), and the web layer must not import it. So the
    engine states, once, the numbers admission's arithmetic reads (pantheon.runtime.memory): the
    window, the prefill chunk and cache capacity with the step's padding buckets, the architecture's
    widths (the activations of a prefill chunk), what a token and a sequence cost in the cache, and
    where the model's memory lives (its dies and their platform). A geometry with `hidden == 0` is
    unsized (a test fake): admission then charges `state_bytes_per_token` per token.
    """

    max_seq: int  # the longest sequence a slot holds (prompt + completion)
    n_slots: int = 1
    chunk: int = 0  # the prefill chunk (0: unknown)
    capacity: int = 0  # cache positions per slot
    chunk_buckets: tuple[int, ...] = ()  # the step's padded chunk lengths
    span_buckets: tuple[int, ...] = ()  # the step's attention spans
    hidden: int = 0
    head_dim: int = 0
    n_heads: int = 0
    n_kv_heads: int = 0
    ffn: int = 0  # the widest FFN a token goes through: max(ffn, experts used x expert ffn) + the router's logits
    vocab: int = 0
    state_bytes_per_token: int = 0  # one more token of context in the cache (at the KV dtype)
    state_bytes_per_sequence: int = 0  # a hybrid's recurrent state per sequence (0: none)
    dies: tuple[int, ...] = ()  # the dies the model's memory lives on
    platform: str = "cpu"  # their platform: a "cpu" model's memory is the host's

    @property
    def sized(self) -> bool:
        """Whether the widths are known, so a request's activations can be computed."""
        return self.hidden > 0 and self.chunk > 0 and self.capacity > 0


@dataclass(frozen=True)
class ModelCard:
    """What the web layer knows of a loaded model: no device arrays, no compiled programs, no callables.

    The tokenizer and chat template are host objects (tokenizers + Jinja2); `context_length` is the
    longest sequence a slot holds (prompt + completion), `n_slots` the concurrent sequences;
    `geometry` is what admission reads (None: a model that cannot size one; the window alone applies).
    """

    name: str
    path: str
    arch: str
    context_length: int
    n_slots: int
    tokenizer: Any
    template: Any
    native_kernels: bool = False
    geometry: ModelGeometry | None = None
    vision: VisionCard | None = None  # None: a text-only model (an image part is a 400)


# ---- embeddings ------------------------------------------------------------------------------------
EMBED_POOLINGS = ("mean", "last")


@dataclass
class EmbedRequest:
    """One embeddings request as the schedulers see it: token ids of each input, and how to pool them.

    Every input is run through the model like a prompt (in chunks into one slot) and its final hidden
    states pooled: "mean" over its tokens, or "last" (the last token's); then L2-normalised. The inputs
    of a request, and of concurrent requests, share the model's forward calls (batched).
    """

    inputs: list[list[int]]
    pooling: str = "mean"
    request_id: str = field(default_factory=lambda: secrets.token_hex(12))

    def __post_init__(self) -> None:
        if self.pooling not in EMBED_POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(EMBED_POOLINGS)}, got {self.pooling!r}")
        if not self.inputs:
            raise ValueError("an embeddings request needs at least one input")
        if any(len(ids) == 0 for ids in self.inputs):
            raise ValueError("every embeddings input needs at least one token")

    @property
    def prompt_tokens(self) -> int:
        return sum(len(ids) for ids in self.inputs)


@dataclass(frozen=True)
class Embedded:
    """An embeddings request's result, its only event on success: float32 unit vectors [inputs, D]
    (numpy), in the request's input order. A failed or refused request gets Finished("error") instead,
    a cancelled one Finished("cancelled")."""

    vectors: Any
    prompt_tokens: int = 0


EmbedEvent = Embedded | Finished
EmbedSink = Callable[[EmbedEvent], None]
