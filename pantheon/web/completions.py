"""POST /v1/completions, the legacy OpenAI route: a prompt continued as it is, with no chat template.

Clients still use it for plain continuation, for scoring (`echo` + `logprobs`: the prompt's own token
log probabilities) and in benchmarks. `parse_completion_request` validates the body with the same field
checks as chat (pantheon.web.fields); `CompletionGeneration` tokenizes the prompt (BOS as the tokenizer
wants it; a prompt given as token ids is taken as it is), admits it against the context window and the
memory free now (pantheon.serving.admission), and shares the rest of its life with chat (pantheon.web.generation): n choices, stop
strings per choice, logprobs carried on the chunks they belong to.

Choices that differ from OpenAI's (stated in docs/http-api.md):

* a list of prompts is a batch (`BatchCompletion`): each prompt is its own generation, all submitted at
  once, and the answer holds n choices per prompt, choice i of prompt p at index p * n + i, streamed
  prompt after prompt; `usage` sums them;
* `suffix` (fill-in-the-middle) is a 400, and so is `best_of` other than 1 or `n` (no server-side ranking);
* `max_tokens` is at least 1 (scoring a prompt alone is `echo` + `logprobs` with `max_tokens: 1`);
* `top_logprobs` lists the k most likely tokens and always the token itself (up to k + 1 entries), as
  OpenAI documents; `text_offset` counts characters of the returned `text` (the echoed prompt included).

Echo with logprobs is the one answer whose size a request multiplies at no generation cost: a 4 kB
prompt with `logprobs: 20` and `n: 8` was 8 MB of JSON (each choice repeats the prompt's entries), built
on the event loop. So n x prompt tokens x (logprobs + 1) is capped (`PANTHEON_MAX_ECHO_LOGPROBS`, a
400 beyond it), and past `LARGE_ECHO_ENTRIES` the prompt's entries are scored and serialised in OS
threads, once for all the choices.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pantheon.config import Settings
from pantheon.text.emitter import Emitter
from pantheon.errors import PantheonError
from pantheon.types import GenRequest, SamplingParams, stop_ids
from pantheon.web import bridge
from pantheon.web.chat import BIG_PROMPT_CHARS
from pantheon.contract import COMPLETIONS, PROMPTS_MAX
from pantheon.web.fields import (
    bad,
    body_object,
    boolean,
    bounded,
    choices_n,
    logit_bias,
    sampling_params,
    stop_strings,
    stream_flags,
    string,
    top_logprobs,
)
from pantheon.web.generation import GenerationCore, Piece, json_line
from pantheon.web.logprobs import Positioned, legacy_logprobs
from pantheon.web.schema import COMPLETION_REQUEST, fields

DEFAULT_MAX_TOKENS = COMPLETIONS["max_tokens"].default  # OpenAI's default for this route
LARGE_ECHO_ENTRIES = 4096  # echoed prompt logprob entries (n x tokens x (k + 1)) past which work leaves the hub

COMPLETION_FIELDS = fields(COMPLETION_REQUEST)  # pantheon.web.schema describes the body


@dataclass
class CompletionRequest:
    model: str | None
    prompt: str | list[int]  # text, or token ids taken as they are
    prompts: list[str | list[int]] | None  # a batch of several (BatchCompletion); None for one
    params: SamplingParams
    max_tokens: int
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    n: int = 1
    logprobs: int | None = None  # None: none; k: each token's logprob and the k most likely
    echo: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()
    ignore_eos: bool = False
    speculative: bool | None = None  # False: no speculative decoding for this request (None: the server's default)
    user: str | None = None
    # what the routes and cache_scope() read of every generation request; this route has no sessions
    session_id: str | None = None
    cache_salt: str | None = None
    cache_scope: str = ""
    size: int = 0


def _token_ids(v: Any, where: str) -> list[int] | None:
    """`v` as a list of token ids, None when it is not a list of integers."""
    if not isinstance(v, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in v):
        return None
    if not v:
        raise bad(where, "must not be empty")
    neg = next((i for i in v if i < 0), None)
    if neg is not None:
        raise bad(where, f"{neg} is not a token id")
    return v


def _prompts(body: Mapping) -> list[str | list[int]]:
    """`prompt`: a string, a list of token ids, or a list of either kind (not a mix), as the list of prompts."""
    p = body.get("prompt")
    if p is None:
        raise bad("prompt", "is required")
    if isinstance(p, str):
        return [p]
    ids = _token_ids(p, "prompt")
    if ids is not None:
        return [ids]
    if isinstance(p, list) and p and (all(isinstance(x, str) for x in p) or all(isinstance(x, list) for x in p)):
        if len(p) > PROMPTS_MAX:
            raise bad("prompt", f"at most {PROMPTS_MAX} prompts per request, got {len(p)}")
        out: list[str | list[int]] = []
        for k, x in enumerate(p):
            if isinstance(x, str):
                out.append(x)
                continue
            ids = _token_ids(x, f"prompt[{k}]")
            if ids is None:
                raise bad(f"prompt[{k}]", "must be a list of token ids")
            out.append(ids)
        return out
    raise bad("prompt", "must be a string, a list of token ids, or a list of strings or of token-id lists")


def parse_completion_request(body: Any, headers: Mapping[str, str]) -> CompletionRequest:
    """Validate a legacy completions body; raises RequestError (400) naming the first bad field."""
    body = body_object(body, COMPLETION_FIELDS)
    model = string(body, "model")
    prompts = _prompts(body)
    if body.get("suffix") not in (None, ""):
        raise bad("suffix", "suffix is not supported (no fill-in-the-middle)")
    max_tokens = bounded(body, "max_tokens", COMPLETIONS)
    params = sampling_params(body, COMPLETIONS)
    stop = stop_strings(body)
    stream, include_usage = stream_flags(body)
    n = choices_n(body, COMPLETIONS)
    best_of = bounded(body, "best_of", COMPLETIONS)
    if best_of is not None and best_of not in (1, n):
        raise bad("best_of", f"only 1 or n ({n}) is supported: choices are not ranked on the server")
    logprobs = top_logprobs(body, COMPLETIONS, "logprobs") if body.get("logprobs") is not None else None
    echo = bool(boolean(body, "echo"))
    return CompletionRequest(model=model, prompt=prompts[0], prompts=prompts if len(prompts) > 1 else None,
                             params=params,
                             max_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens, stop=stop,
                             stream=stream, include_usage=include_usage, n=n, logprobs=logprobs, echo=echo,
                             logit_bias=logit_bias(body), ignore_eos=bool(boolean(body, "ignore_eos")),
                             speculative=boolean(body, "speculative"),
                             user=string(body, "user"))


class CompletionGeneration(GenerationCore):
    """One legacy completion in flight (see pantheon.web.generation for its life). Greenlet only."""

    id_prefix = "cmpl-"

    def __init__(self, registry: Any, entry: Any, creq: CompletionRequest, environ: dict, metrics: Any = None,
                 t0: float | None = None, watch: Any = None, settings: Any = None):
        super().__init__(registry, entry, environ, metrics=metrics, t0=t0, watch=watch, settings=settings)
        self.creq = creq
        self.echo_text = ""  # the prompt as returned with echo
        self.index_base = 0  # in a batch, prompt p's choices are numbered from p * n
        self._prompt_lp: dict | None = None  # the prompt's `logprobs` columns (echo + logprobs), built once

    def _check_echo_size(self, n_prompt: int) -> None:
        """Refuse (400) an echo + logprobs request whose prompt entries, over all choices, pass the cap."""
        creq = self.creq
        assert creq.logprobs is not None
        cap = Settings.max_echo_logprobs if self.settings is None else self.settings.max_echo_logprobs
        entries = creq.n * n_prompt * (creq.logprobs + 1)
        self.large_answer = entries > LARGE_ECHO_ENTRIES
        if entries > cap:
            raise bad("logprobs", f"echo with logprobs {creq.logprobs} and n {creq.n} on a prompt of {n_prompt} "
                                  f"tokens returns {entries} prompt log-probability entries (n x prompt tokens x "
                                  f"(logprobs + 1)); at most {cap} are returned (PANTHEON_MAX_ECHO_LOGPROBS): ask "
                                  "fewer alternatives or choices, or score a shorter prompt")

    def start(self) -> None:
        card = self.entry.card
        tok = card.tokenizer
        creq = self.creq
        self.check_generations(creq.n)
        self.admission.limits(card, creq.n, creq.logit_bias)
        if isinstance(creq.prompt, str) and len(creq.prompt) > BIG_PROMPT_CHARS:  # off the hub
            ids, bos_added = bridge.call_in_thread(lambda: self._tokenize(tok), name="pantheon-tokenize")
        else:
            ids, bos_added = self._tokenize(tok)
        score_prompt = creq.echo and creq.logprobs is not None
        if score_prompt:
            self._check_echo_size(len(ids))
        try:
            self.admission.prompt(card, len(ids), creq.max_tokens)
        except PantheonError:
            self.observe_admission("denied")
            raise
        max_tokens = self.budget(card, len(ids), creq.max_tokens)
        self.observe_admission("capped" if self.capped else "fit")
        self.echo_text = creq.prompt if isinstance(creq.prompt, str) else tok.decode(ids)
        req = GenRequest(prompt_ids=ids, params=creq.params, max_tokens=max_tokens,
                         stop_ids=stop_ids(tok, creq.ignore_eos),
                         cache_scope=creq.cache_scope, request_id=self.id, n=creq.n, logprobs=creq.logprobs,
                         logit_bias=creq.logit_bias, prompt_logprobs=creq.logprobs if score_prompt else None,
                         speculative=creq.speculative)
        emitters = [Emitter(stop=creq.stop, parse_think=False) for _ in range(creq.n)]
        self.launch(req, emitters, continuation=True)
        if score_prompt:
            work = lambda: legacy_logprobs(tok, self._score_prompt(tok, ids, bos_added))  # noqa: E731
            self._prompt_lp = bridge.call_in_thread(work, name="pantheon-logprobs") if self.large_answer else work()

    def _tokenize(self, tok: Any) -> tuple[list[int], bool]:
        """The prompt's ids, and whether a BOS was put in front of text that did not hold one."""
        p = self.creq.prompt
        if not isinstance(p, str):
            out = next((i for i in p if i >= tok.vocab_size), None)
            if out is not None:
                raise bad("prompt", f"{out} is not a token id of this model (0..{tok.vocab_size - 1})")
            return list(p), False
        bound = getattr(tok, "min_tokens", None)
        if callable(bound):  # provably too long: refused before it is tokenized
            self.admission.prompt_bound(self.entry.card, bound(p))
        ids = tok.encode(p)
        added = tok.add_bos and tok.bos_id is not None and (not ids or ids[0] != tok.bos_id)
        if added:
            ids.insert(0, tok.bos_id)
        if not ids:
            raise bad("prompt", "is empty (it has no tokens)")
        return ids, added

    def _score_prompt(self, tok: Any, ids: Sequence[int], bos_added: bool) -> list[Positioned]:
        """The prompt's entries from Started.prompt_logprobs, placed in the echoed text (a BOS the server
        added takes no room in it)."""
        got = self.started.prompt_logprobs if self.started is not None else None
        if got is None or len(got) != len(ids):
            raise RuntimeError("the backend did not return the prompt's log probabilities")
        dec, offset, out = tok.stream(skip_special=False), 0, []
        for k, (tid, lp) in enumerate(zip(ids, got)):
            out.append(Positioned(tid, None if k == 0 else lp, offset))
            if not (k == 0 and bos_added):
                offset += len(dec.push(tid))
        return out

    # -- response shapes ---------------------------------------------------------------------------------
    def _generated(self, items: Sequence[Positioned]) -> list[Positioned]:
        """Generated tokens' entries with offsets into the returned text (after the echoed prompt)."""
        shift = len(self.echo_text) if self.creq.echo else 0
        return [Positioned(p.id, p.logprob, p.offset + shift) for p in items]

    def _choice_logprobs(self, items: Sequence[Positioned]) -> dict:
        """A whole choice's `logprobs`: the echoed prompt's columns (built once), then its own tokens'."""
        own = legacy_logprobs(self._tok, self._generated(items))
        if self._prompt_lp is None:
            return own
        return {k: self._prompt_lp[k] + own[k] for k in own}

    def complete(self) -> dict:
        """Run to the end and return the non-streamed text_completion object (n choices, index order)."""
        texts: list[list[str]] = [[] for _ in self.choices]
        items: list[list[Positioned]] = [[] for _ in self.choices]
        for piece in self.pump():
            if piece.delta is not None:
                texts[piece.choice].append(piece.delta.text)
            items[piece.choice] += piece.logprobs
        prefix = self.echo_text if self.creq.echo else ""
        choices = [{"text": prefix + "".join(texts[c.index]), "index": self.index_base + c.index,
                    "logprobs": self._choice_logprobs(items[c.index]) if self.want_logprobs else None,
                    "finish_reason": c.finish_reason} for c in self.choices]
        out = {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model_name,
               "choices": choices, "usage": self.usage()}
        if self.capped:
            out["context_capped"] = True
        return out

    def _chunk(self, index: int, text: str, logprobs: Sequence[Positioned] = (), finish_reason: str | None = None,
               **extra: Any) -> bytes:
        lp = legacy_logprobs(self._tok, logprobs) if self.want_logprobs and logprobs else None
        return self._chunk_with(index, text, lp, finish_reason, **extra)

    def _chunk_with(self, index: int, text: str, lp: dict | None, finish_reason: str | None = None,
                    stepwise: bool = False, **extra: Any) -> bytes:
        return json_line({"id": self.id, "object": "text_completion", "created": self.created,
                          "model": self.model_name,
                          "choices": [{"text": text, "index": self.index_base + index, "logprobs": lp,
                                       "finish_reason": finish_reason}],
                          **extra}, stepwise=stepwise)

    def _echo_chunks(self) -> list[bytes]:
        """Each choice's first chunk: the prompt, and its scored tokens when asked (the same columns)."""
        lp = self._prompt_lp if self.want_logprobs and self._prompt_lp and self._prompt_lp["tokens"] else None
        return [self._chunk_with(c.index, self.echo_text, lp, stepwise=self.large_answer) for c in self.choices]

    def _piece_chunk(self, piece: Piece) -> bytes:
        items = self._generated(piece.logprobs)
        if piece.delta is None:
            return self._chunk(piece.choice, "", items, piece.finish_reason,
                               **({"context_capped": True} if self.capped else {}))
        return self._chunk(piece.choice, piece.delta.text, items)

    def frames(self) -> Iterator[bytes]:
        """With echo, each choice's prompt first (and its logprobs); the text as it comes; each choice's
        finish chunk; then the optional usage chunk."""
        if self.creq.echo:
            yield from (bridge.call_in_thread(self._echo_chunks, name="pantheon-logprobs") if self.large_answer
                        else self._echo_chunks())
        for piece in self.pump():
            yield self._piece_chunk(piece)
        if self.creq.include_usage:
            yield json_line({"id": self.id, "object": "text_completion", "created": self.created,
                             "model": self.model_name, "choices": [], "usage": self.usage()})


class _SharedRef:
    """The registry as a batch's parts see it: the batch holds the one model ref and gives it back itself."""

    def __init__(self, registry: Any):
        self.settings = registry.settings

    def release(self, entry: Any) -> None:
        pass


class BatchCompletion(GenerationCore):
    """A legacy completion of several prompts: one `CompletionGeneration` per prompt, all submitted before
    any is read (the backend batches them), answered prompt after prompt with each one's choices
    numbered from p * n. Greenlet only."""

    id_prefix = "cmpl-"

    def __init__(self, registry: Any, entry: Any, creq: CompletionRequest, environ: dict, metrics: Any = None,
                 t0: float | None = None, watch: Any = None, settings: Any = None):
        super().__init__(registry, entry, environ, metrics=metrics, t0=t0, watch=watch, settings=settings)
        self.creq = creq
        assert creq.prompts is not None
        shared = _SharedRef(registry)
        self.parts: list[CompletionGeneration] = []
        for p, prompt in enumerate(creq.prompts):
            one = dataclasses.replace(creq, prompt=prompt, prompts=None, include_usage=False)
            part = CompletionGeneration(shared, entry, one, environ, metrics=metrics, t0=t0, watch=watch,
                                        settings=settings)
            part.id, part.created, part.index_base = self.id, self.created, p * creq.n
            self.parts.append(part)

    def start(self) -> None:
        self.check_generations(self.creq.n, len(self.parts))
        for part in self.parts:
            part.start()
        self.large_answer = any(p.large_answer for p in self.parts)
        self.capped = any(p.capped for p in self.parts)

    def usage(self) -> dict:
        prompt = sum(p.prompt_tokens for p in self.parts)
        completion = sum(p.completion_tokens for p in self.parts)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(p.cached_tokens for p in self.parts)}}

    def complete(self) -> dict:
        choices = []
        for part in self.parts:
            choices += part.complete()["choices"]
        out = {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model_name,
               "choices": choices, "usage": self.usage()}
        if any(p.capped for p in self.parts):
            out["context_capped"] = True
        return out

    def frames(self) -> Iterator[bytes]:
        for part in self.parts:
            yield from part.frames()
        if self.creq.include_usage:
            yield json_line({"id": self.id, "object": "text_completion", "created": self.created,
                             "model": self.model_name, "choices": [], "usage": self.usage()})

    def close(self) -> None:
        """Close every part (each cancels what it still runs), then give the one model ref back."""
        try:
            for part in self.parts:
                part.close()
        finally:
            super().close()


def make_completion(registry: Any, entry: Any, creq: CompletionRequest, environ: dict, **kwargs: Any) -> GenerationCore:
    """The generation a completions request needs: one prompt, or a batch of them."""
    if creq.prompts is not None:
        return BatchCompletion(registry, entry, creq, environ, **kwargs)
    return CompletionGeneration(registry, entry, creq, environ, **kwargs)
