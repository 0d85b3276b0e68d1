"""Admission: the one place that decides whether a request may run, and in what form.

Why one owner. Before, the decision was spread over the model card (a closure of the engine's),
the memory module reading the engine by `getattr`, the chat and completions modules (each with its
own window and capping rules), the scheduler's queue bound, and the embeddings route, which checked
the window but never memory. So two routes could answer the same pressure differently, and a prompt
was rendered up to three times on its way in. Here every route asks the same service the same
questions, in the same order:

1. `limits`: what only the model can bound -- `n` by its slots (each choice holds one), `logit_bias`
   ids by its vocabulary.
2. the window and memory: `chat` (a conversation: rendered once, tokenized once, capped when asked or
   when memory is short), `prompt` (token ids taken as they are: legacy completions), `embeddings`
   (inputs taken whole). Memory is the arithmetic of pantheon.runtime.memory over the
   `ModelGeometry` the engine published on the card (`ModelCard.geometry`), against the server's
   memory watch; a card without a geometry is held to its window alone, and without a running watch
   admission fails open (memory is an optimisation, never a reason to refuse where it cannot measure).
3. `budget`: the completion budget the context leaves (clamping marks the answer `context_capped`).
4. `place`: a place in the model's queue, taken before any work that a full queue would waste (a
   grammar compile) and handed to `submit`. The queue's bound itself is the scheduler's to enforce
   (it must be atomic with the queue: `BatchScheduler.reserve`), but it is asked here, for every
   route, and nowhere else in the web layer.

Refusals: 400 `context_length_exceeded` when the window is the limit (as OpenAI answers), 503 with
Retry-After when memory is (retry later), 429/503 from the queue.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pantheon.errors import RequestError
from pantheon.runtime import memory

ANSWER_RESERVE_MAX = 256  # tokens admission keeps free for the answer (also at most window // 8 and max_tokens)

# Roles whose content every chat template renders (after trimming) into the prompt: their text
# bounds the prompt's token count from below. An assistant turn's may be dropped (earlier reasoning).
BOUND_ROLES = ("system", "user", "tool")


def answer_reserve(window: int, max_tokens: int | None) -> int:
    """Tokens kept free for the answer when deciding whether a prompt must be capped."""
    reserve = max(1, min(ANSWER_RESERVE_MAX, window // 8))
    return min(reserve, max_tokens) if max_tokens else reserve


@dataclass(frozen=True)
class AdmittedPrompt:
    """A chat prompt as admitted: the text the template rendered, its ids, and whether turns were dropped."""

    rendered: str
    ids: list[int]
    capped: bool


def _last_user_content(messages: Sequence[dict]) -> Any:
    return next((m.get("content") for m in reversed(messages) if m.get("role") == "user"), None)


def content_bound(tok: Any, messages: Sequence[dict]) -> int:
    """A lower bound on a conversation's prompt tokens from its BOUND_ROLES messages' text alone, before
    the template renders anything (0 when the tokenizer has no length bound). Why: rendering 100,001
    messages took 4 s of CPU in the template, holding the interpreter while every stream waited, only to
    learn that the prompt was far past the window (issue 43)."""
    if not callable(getattr(tok, "min_tokens", None)):
        return 0
    texts = []
    for m in messages:
        if m.get("role") not in BOUND_ROLES:
            continue
        c = m.get("content")
        if isinstance(c, str):
            texts.append(c.strip())
        elif isinstance(c, list):
            texts.extend(p["text"] for p in c if isinstance(p, dict) and p.get("type") == "text"
                         and isinstance(p.get("text"), str))
    return tok.min_tokens("".join(texts))


def _window_exceeded(n: str, window: int) -> RequestError:
    return RequestError(f"messages: this model's maximum context length is {window} tokens and at least one must "
                        f"be left to generate, but the prompt (the messages and any tools, in the chat template) "
                        f"has {n} tokens; shorten them, or send \"truncate\": \"oldest\" to have the oldest turns "
                        "dropped", param="messages", code="context_length_exceeded")


def _prompt_too_long(n: str, window: int) -> RequestError:
    return RequestError(f"prompt: this model's maximum context length is {window} tokens and at least one must "
                        f"be left to generate, but the prompt has {n} tokens", param="prompt",
                        code="context_length_exceeded")


def _input_too_long(index: int, n: str, window: int) -> RequestError:
    return RequestError(f"input[{index}]: this model's maximum context length is {window} tokens, but the input has "
                        f"{n} tokens; shorten it", param="input", code="context_length_exceeded")


def _cap_by_length(bound: Callable[[list[dict]], int], msgs: list[dict], window: int,
                   reserve: int, over: bool = False) -> tuple[list[dict], bool]:
    """Drop (or refuse) what certainly cannot fit, before the prompt is ever tokenized.

    A 4 MB message takes seconds to tokenize, and capping a conversation re-tokenizes it a dozen
    times: a prompt far over the window cost 19-60 s before its 400. When the text alone proves the
    prompt longer than the window (`bound`, a lower bound on the token count from the text's length),
    the same capping runs first on that lower bound: what it drops, the real capping would drop too
    (the bound never exceeds the real count), and a prompt that cannot fit even with only its last turn
    (tools and the template's text stay whatever is dropped) is refused at once. So what is tokenized
    afterwards is at most about a window's worth of text. (capped) is True when anything was dropped.
    `over`: the caller already knows the conversation is past the window (its messages' text alone is),
    so it is not rendered whole to learn it.
    """
    if not over and bound(msgs) <= window - 1:  # might still be taken as sent: leave it to the real count
        return msgs, False
    last = max((i for i, m in enumerate(msgs) if m.get("role") == "user"), default=0)

    def refuse() -> RequestError:
        return RequestError(f"messages: the prompt has at least {bound(msgs)} tokens, with only its last turn at "
                            f"least {bound(msgs[last:])}; this model's context holds {window} and at least one must "
                            "be left to generate (dropping earlier turns is not enough: the last message, with the "
                            "tools, is too long)", param="messages", code="context_length_exceeded")

    if bound(msgs[last:]) > window - reserve:  # what capping can never drop is already too long
        raise refuse()
    capped, _ = memory.cap_messages(msgs, bound, window - reserve, over=True)
    if bound(capped) > window - reserve or _last_user_content(capped) != _last_user_content(msgs):
        raise refuse()
    return capped, True


def _count_within(tok: Any, rendered: str, tokenize: Callable[[str], list[int]], fit: int) -> int:
    """`rendered`'s token count, or a lower bound on it already past `fit` (then it is not tokenized):
    a capping candidate provably too long costs its length, not a tokenizer pass."""
    least = tok.min_tokens(rendered) if callable(getattr(tok, "min_tokens", None)) else 0
    return least if least > fit else len(tokenize(rendered))


class AdmissionService:
    """Decides window, memory, queue place, `n` and capping for chat, completions and embeddings.

    `watch`: the server's pantheon.runtime.memory.MemWatch (None: the process-wide one). Stateless
    otherwise: one may be built per request."""

    def __init__(self, watch: Any = None):
        self.watch = watch

    # -- what only the model bounds ---------------------------------------------------------------------
    @staticmethod
    def limits(card: Any, n: int, logit_bias: Sequence[tuple[int, float]] = ()) -> None:
        """`n` by the model's slots (each choice holds one), `logit_bias` ids by its vocabulary (400s)."""
        if n > int(card.n_slots):
            raise RequestError(f"n: this model runs at most {card.n_slots} sequences at once, so n may be at most "
                               f"{card.n_slots}; got {n}", param="n")
        vocab = int(card.tokenizer.vocab_size)
        out = next((tid for tid, _ in logit_bias if tid >= vocab), None)
        if out is not None:
            raise RequestError(f"logit_bias: {out} is not a token id of this model (0..{vocab - 1})",
                               param="logit_bias")

    @staticmethod
    def generations(n: int, prompts: int, limit: int) -> None:
        """A request's generations (`prompts` x `n`) against PANTHEON_MAX_GENERATIONS_PER_REQUEST (`limit`):
        400 naming `n` (or `prompt` when n is 1) past it, before anything is tokenized. Why per request:
        the slot bound on `n` holds one prompt's choices, but a 64-prompt completion with n 8 was 512
        generations from one request (issue 43)."""
        if n * prompts <= limit:
            return
        param = "n" if n > 1 else "prompt"
        what = f"{prompts} prompts x n {n}" if prompts > 1 else f"n {n}"
        raise RequestError(f"{param}: {what} is {n * prompts} generations; one request may start at most {limit} "
                           "(PANTHEON_MAX_GENERATIONS_PER_REQUEST): send fewer prompts or choices, or several "
                           "requests", param=param)

    # -- memory ------------------------------------------------------------------------------------------
    def memory(self, card: Any, n_tokens: int, reserve: int, min_tokens: int | None = None
               ) -> memory.Admission | None:
        """The memory arithmetic for `n_tokens` (+ `reserve` answer tokens) on the card's model, or None
        when the card publishes no geometry (the window alone applies)."""
        geo = getattr(card, "geometry", None)
        if geo is None:
            return None
        return memory.admit(geo, n_tokens, watch=self.watch, reserve_tokens=reserve, min_tokens=min_tokens)

    # -- chat ----------------------------------------------------------------------------------------------
    def chat(self, card: Any, messages: Sequence[dict], text: Callable[[list[dict]], str],
             tokenize: Callable[[str], list[int]], max_tokens: int | None = None,
             truncate: bool = False) -> AdmittedPrompt:
        """Admit a conversation: render it once (`text`: the chat template, tools and all), bound its
        token count from the rendered text's length, tokenize that same text once (`tokenize`), then
        hold it to the window and the memory free now.

        The prompt must fit the model's context window (halved under HIGH memory pressure) and the
        memory free now, leaving `answer_reserve` tokens for the answer. If it does not, the oldest turns
        are dropped (then the system prompt's end), never the last user message: capped=True, and the
        caller marks the response `context_capped` and skips prefix reuse. If even that does not fit, the
        original prompt is still taken when it leaves room for one generated token; otherwise 400
        `context_length_exceeded` when the window is the limit, 503 (retry later) when memory is. Memory
        alone too tight for any useful prompt (CRITICAL pressure): 503.

        Turns are dropped for the *window* only when the request asks for it (`truncate`: "oldest"), as
        OpenAI and the peer servers answer a longer conversation with 400 `context_length_exceeded`;
        dropping turns because the *memory* free now is short stays automatic. Only a prompt that is
        capped is rendered and tokenized again: O(log turns) candidates, each about the size of what
        is kept (`memory.cap_messages` gallops from the newest turn), a candidate whose length alone
        proves it too long never tokenized -- so capping costs in proportion to the window, not to
        the body (issue 43: 3,000 turns of 900 characters cost 18-30 s of CPU before).
        """
        window = int(card.context_length)
        reserve = answer_reserve(window, max_tokens)
        tok = card.tokenizer
        over = content_bound(tok, messages) > window - 1  # its messages' text alone is past the window
        if over and not truncate:  # provably too long: refused with nothing rendered
            raise _window_exceeded(f"at least {content_bound(tok, messages)}", window)
        msgs = [dict(m) for m in messages]
        first: list[str] = []  # the one rendering of the prompt as sent, made when first needed

        def whole() -> str:
            if not first:
                first.append(text(msgs))
            return first[0]

        pre_capped = False
        if callable(getattr(tok, "min_tokens", None)):
            def bound(ms: list[dict]) -> int:
                return tok.min_tokens(whole() if ms is msgs else text(ms))

            if truncate:  # (a conversation `over` is capped from its newest turn without being rendered whole)
                kept, pre_capped = _cap_by_length(bound, msgs, window, reserve, over=over)
                if pre_capped:
                    msgs, first[:] = kept, [text(kept)]
            elif bound(msgs) > window - 1:  # provably too long: refused before tokenizing
                raise _window_exceeded(f"at least {bound(msgs)}", window)
        rendered = whole()
        ids = tokenize(rendered)
        n = len(ids)
        if n > window - 1 and not truncate:
            raise _window_exceeded(str(n), window)
        adm = self.memory(card, n, reserve)
        if adm is not None:
            adm.raise_if_denied()
        measured = adm is not None and adm.window > 0  # a live memory reading was applied
        fit = adm.fit_tokens if measured and adm is not None else window - reserve
        if n <= fit:
            return AdmittedPrompt(rendered, ids, pre_capped)
        memory_short = measured and adm is not None and (adm.window < window or adm.fit_tokens < window - reserve)
        if not truncate and not memory_short:  # the window is the limit and one token still fits: as sent
            return AdmittedPrompt(rendered, ids, pre_capped)
        capped, _ = memory.cap_messages(msgs, lambda m: _count_within(tok, text(m), tokenize, fit), fit, over=True)
        c_rendered = text(capped)
        c_ids = tokenize(c_rendered)
        if len(c_ids) <= fit and _last_user_content(capped) == _last_user_content(msgs):
            return AdmittedPrompt(c_rendered, c_ids, True)
        # Only cutting the last turn itself would make it fit: take it whole if one token still fits.
        budget = fit + reserve
        if n <= budget - 1:
            return AdmittedPrompt(rendered, ids, pre_capped)
        if measured and adm is not None and (adm.window < window or budget < adm.window):
            memory.Admission(memory.DENIED, max(0, budget - 1), f"the prompt has {n} tokens and only {budget - 1} "
                             "fit in the memory free now", adm.window, adm.pressure).raise_if_denied()
        raise RequestError(f"messages: the prompt has {n} tokens; this model's context holds {window} and at least "
                           "one must be left to generate (dropping earlier turns is not enough: the last message "
                           "alone is too long)", param="messages", code="context_length_exceeded")

    @staticmethod
    def chat_count(card: Any, messages: Sequence[dict], text: Callable[[], str],
                   tokenize: Callable[[str], list[int]]) -> list[int]:
        """The ids of a conversation (`text()`: its rendering) held to the window as `chat` holds one sent
        without truncation: refused (400 context_length_exceeded, the same error) from its messages' text
        before it is rendered, from its rendered length before it is tokenized, or from its count after. For the routes that only count a prompt
        (`/v1/messages/count_tokens`): what the route it counts for refuses, it refuses too, and never
        spends more than a window's worth of tokenizing on it (issue 43: 3.8 MB took 27 s of CPU)."""
        window = int(card.context_length)
        tok = card.tokenizer
        if content_bound(tok, messages) > window - 1:
            raise _window_exceeded(f"at least {content_bound(tok, messages)}", window)
        rendered = text()
        if callable(getattr(tok, "min_tokens", None)) and tok.min_tokens(rendered) > window - 1:
            raise _window_exceeded(f"at least {tok.min_tokens(rendered)}", window)
        ids = tokenize(rendered)
        if len(ids) > window - 1:
            raise _window_exceeded(str(len(ids)), window)
        return ids

    # -- a prompt of ids, taken as it is ------------------------------------------------------------------
    @staticmethod
    def prompt_bound(card: Any, least: int) -> None:
        """Refuse (400) a text prompt whose lower bound on tokens `least` already passes the window,
        before it is tokenized."""
        window = int(card.context_length)
        if least > window - 1:
            raise _prompt_too_long(f"at least {least}", window)

    def prompt(self, card: Any, n_prompt: int, max_tokens: int | None) -> None:
        """Admit a prompt of `n_prompt` tokens as it is (nothing can be dropped to make it fit): it must
        leave one token of the window to generate (else 400 context_length_exceeded) and fit the memory
        free now (else 503 with Retry-After)."""
        window = int(card.context_length)
        if n_prompt > window - 1:
            raise _prompt_too_long(str(n_prompt), window)
        reserve = answer_reserve(window, max_tokens)
        adm = self.memory(card, n_prompt, reserve)
        if adm is None:
            return
        adm.raise_if_denied()
        budget = adm.fit_tokens + reserve
        if adm.window > 0 and n_prompt > budget - 1:
            memory.Admission(memory.DENIED, max(0, budget - 1), f"the prompt has {n_prompt} tokens and only "
                             f"{budget - 1} fit in the memory free now", adm.window, adm.pressure).raise_if_denied()

    # -- embeddings ---------------------------------------------------------------------------------------
    @staticmethod
    def embedding_input(card: Any, index: int, n_tokens: int, at_least: bool = False) -> None:
        """One embeddings input against the window (an input is taken whole, never cut): 400 past it."""
        window = int(card.context_length)
        if n_tokens > window:
            raise _input_too_long(index, f"at least {n_tokens}" if at_least else str(n_tokens), window)

    def embeddings(self, card: Any, lengths: Sequence[int]) -> None:
        """Admit an embeddings request's inputs (their token counts) like a prompt: each within the window,
        and the memory free now must hold the widest input's chunk (an input is fed a chunk at a time,
        inputs batched into one call), within the window the memory ladder leaves (halved under HIGH
        pressure); nothing can be capped, so what does not fit is 503 with Retry-After, and under
        CRITICAL pressure nothing is admitted -- as for chat."""
        for i, n in enumerate(lengths):
            self.embedding_input(card, i, n)
        if not lengths:
            return
        widest = max(lengths)
        adm = self.memory(card, widest, 0, min_tokens=widest)
        if adm is not None and not adm.fit:
            memory.Admission(memory.DENIED, adm.fit_tokens, adm.reason, adm.window, adm.pressure).raise_if_denied()

    # -- the completion budget ----------------------------------------------------------------------------
    @staticmethod
    def budget(card: Any, n_prompt: int, want: int | None) -> tuple[int, bool]:
        """(the completion budget, whether it was clamped): `want` (None: all the room left), at most the
        room the context leaves after the prompt (clamping marks the response context_capped)."""
        room = int(card.context_length) - n_prompt
        clamped = want is not None and want > room
        return (room if want is None else min(want, room)), clamped

    # -- the queue -----------------------------------------------------------------------------------------
    @staticmethod
    def place(backend: Any) -> Any:
        """A place in the model's queue (`backend.reserve()`: refused now, 429/503, if the request could not
        be queued), for `submit(..., reservation=)`; None where the backend keeps no queue of places."""
        reserve = getattr(backend, "reserve", None)
        return reserve() if reserve is not None else None
