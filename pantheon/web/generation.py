"""One generation in flight, whatever route asked for it: the part chat and legacy completions share.

A route's subclass builds the prompt and the `GenRequest` (chat renders a template, completions
tokenizes text as is), then calls `launch`. From there this core owns the request's life:

1. `launch` submits it and waits (cooperatively) for the backend's first event, so a refusal (queue
   timeout, busy single-user model) is still a real HTTP status;
2. `pump` turns the backend's events into `Piece`s, choice by choice: every choice has its own
   detokenizer, emitter (stop strings, reasoning, tool calls), token count and finish reason;
3. `close` (always, exactly once) cancels what still runs, waits a moment for the backend to confirm,
   and releases the registry ref, so the model's slot/lock is free by the time the client (or the next
   request) sees the answer.

Choices and stop strings. Each choice stops on its own: a stop string (or EOS) ends that choice's text
and its later tokens are discarded, while the other choices keep generating. A stop string cancels its
choice alone (`Handle.cancel(choice)`), or the whole request once it was the last choice running, and
the request ends when the backend has sent every choice's `Finished` (so the slots are free). An
"error" Finished is the whole request's.

Log probabilities. When the request asked for them, every token the client's text was made from has
one entry, in order, exactly once: it rides on the first `Piece` of its choice that goes out after the
token arrived (text the emitter holds back, a stop-string prefix or a tool call being written, delays
it to the next piece), and the choice's final piece carries any left. The stop token (EOS) that ends a
choice has no entry, and nor have the tokens after a stop string (they are discarded); the token that
completed a stop string has one, as OpenAI's own answers list the tokens the cut text came from.
Hidden control tokens (turn markers) keep their entries: they were generated.
"""

from __future__ import annotations

import abc
import json
import logging
import secrets
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from pantheon.text.emitter import THINK_CLOSE, THINK_OPEN, TOOL_CLOSE, TOOL_OPEN, Delta, Emitter
from pantheon.errors import PantheonError
from pantheon.serving.admission import AdmissionService
from pantheon.types import Finished, GenRequest, Started, Tokens
from pantheon.web import bridge
from pantheon.web.errors import from_exception
from pantheon.web.logprobs import Positioned

log = logging.getLogger(__name__)

# Control tokens the emitter must see although they are "special" in some GGUFs (Qwen's <tool_call>).
MARKERS = frozenset({THINK_OPEN, THINK_CLOSE, TOOL_OPEN, TOOL_CLOSE})
POLL_S = 0.1  # longest a waiting request goes without checking that its client is still there
CHECK_GAP_S = 0.005  # while events flow, check the client at most this often (one poll() syscall)
CANCEL_WAIT_S = 5.0  # how long close() waits for the backend to confirm a cancel
DONE = b"data: [DONE]\n\n"


class ClientGone(Exception):
    """The client closed its connection; there is no one left to answer."""


def new_id(prefix: str) -> str:
    """Unpredictable and unique across restarts (the seed used an unseeded rand())."""
    return prefix + secrets.token_hex(12)


def json_line(obj: dict, stepwise: bool = False) -> bytes:
    """One server-sent event carrying `obj` (`stepwise`: built by `json_text`, for a large one in a thread)."""
    text = json_text(obj) if stepwise else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return b"data: " + text.encode("utf-8") + b"\n\n"


def json_text(obj: Any, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    """`json.dumps(obj)` in the compact form, built by the pure-Python encoder.

    Slower than the C encoder, but the C encoder holds the interpreter for the whole call, so a large
    answer serialised in an OS thread would still stall the event loop; this one lets it run between
    steps. For answers of many thousand log-probability entries (echoed prompts), in a thread."""
    enc = json.JSONEncoder(ensure_ascii=ensure_ascii, sort_keys=sort_keys, separators=(",", ":"))
    return "".join(enc.iterencode(obj))


@dataclass
class Choice:
    """What one of the request's n choices holds while it runs."""

    index: int
    emitter: Emitter
    decoder: Any  # the tokenizer's StreamDecoder
    tokens: int = 0  # completion tokens: those the text was made from, up to and including a stop token
    chars: int = 0  # characters decoded so far: where the next token's text starts (legacy text_offset)
    eos: bool = False  # a stop id ended it (the device flagged it, Tokens.stop); what follows is discarded
    done: bool = False  # its final piece went out (stop string hit, or its Finished arrived)
    finished: bool = False  # the backend's Finished for it arrived
    finish_reason: str | None = None
    pending: list[Positioned] = field(default_factory=list)  # logprob entries not yet sent


@dataclass(frozen=True)
class Piece:
    """Output of one choice: a delta with the logprob entries that ride on it, or (delta None) the
    choice's end with its finish reason and any entries left."""

    choice: int
    delta: Delta | None
    logprobs: tuple[Positioned, ...] = ()
    finish_reason: str | None = None


class GenerationCore(abc.ABC):
    """One generation in flight. Greenlet only: every method runs in the request's greenlet.

    Subclasses (chat, legacy completions) implement `start` (build and `launch` the request),
    `complete` (the non-streamed body) and `frames` (the SSE events before [DONE])."""

    id_prefix = "cmpl-"

    def __init__(self, registry: Any, entry: Any, environ: dict, metrics: Any = None, t0: float | None = None,
                 watch: Any = None, settings: Any = None):
        self.settings = settings  # the server's pantheon.config.Settings (None: unit tests, the defaults)
        self.large_answer = False  # the non-streamed answer is serialised in an OS thread (see json_text)
        self.metrics = metrics  # pantheon.serving.metrics.Metrics, or None (unit tests)
        self.watch = watch  # the server's pantheon.runtime.memory.MemWatch (None: the process-wide one)
        self.admission = AdmissionService(watch)  # window, memory, n, capping and the queue place: one owner
        self.t0 = time.perf_counter() if t0 is None else t0  # request arrival
        self._t_last: float | None = None  # when the previous Tokens event arrived
        self.registry = registry
        self.entry = entry
        self.environ = environ
        self.id = new_id(self.id_prefix)
        self.created = int(time.time())
        self.model_name = entry.name
        self.channel = bridge.Channel()
        self.handle: Any = None
        self.closed = False
        self.choices: list[Choice] = []
        self.started: Started | None = None
        self.want_logprobs = False
        self.prompt_tokens = 0
        self.cached_tokens = 0  # prompt tokens served from a prefix already in the slot
        self.capped = False  # context_capped: the oldest turns were dropped, or max_tokens was clamped
        self._tok: Any = None
        self._cancelled = False
        self._last_check = 0.0  # monotonic time of the last client check; 0: check at the first wait
        self._replay: list[Any] = []  # events taken out early by launch(), delivered before the channel's

    # -- state ----------------------------------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        """The backend has sent every choice's Finished (or an error that ends them all)."""
        return bool(self.choices) and all(c.finished for c in self.choices)

    @property
    def completion_tokens(self) -> int:
        return sum(c.tokens for c in self.choices)

    def usage(self) -> dict:
        """Prompt tokens once, completion tokens summed over the choices."""
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    # -- setup ----------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def start(self) -> None:
        """Render or tokenize the prompt, admit it, build and submit the GenRequest (see `launch`)."""

    def check_generations(self, n: int, prompts: int = 1) -> None:
        """The request's generations (prompts x n) within PANTHEON_MAX_GENERATIONS_PER_REQUEST (else 400)."""
        limit = self.registry.settings.max_generations
        self.admission.generations(n, prompts, limit)

    def observe_admission(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.observe_admission(outcome)

    def budget(self, card: Any, n_prompt: int, want: int | None) -> int:
        """The completion budget the admission service leaves (clamping it marks the response context_capped)."""
        max_tokens, clamped = self.admission.budget(card, n_prompt, want)
        self.capped = self.capped or clamped
        return max_tokens

    def launch(self, req: GenRequest, emitters: Sequence[Emitter], continuation: bool = False,
               reservation: Any = None) -> None:
        """Submit `req` (one emitter per choice) and wait for the backend's first event.

        `continuation`: the generated text continues the prompt's (legacy completions), so the first
        token's SentencePiece space is text, not the prefix a detokenizer drops at the start of a text.
        `reservation`: the queue place the backend's `reserve` gave this request, which it then takes."""
        tok = self.entry.card.tokenizer
        self._tok = tok
        self.want_logprobs = req.logprobs is not None
        self.prompt_tokens = len(req.prompt_ids)
        decoder = (lambda: tok.stream(skip_special=False, at_start=False)) if continuation else \
            (lambda: tok.stream(skip_special=False))
        self.choices = [Choice(i, em, decoder()) for i, em in enumerate(emitters)]
        t_submit = time.perf_counter()
        backend = self.entry.backend
        if reservation is None:  # the queue place, asked of the admission service like every route's
            reservation = self.admission.place(backend)
        try:
            if reservation is None:
                self.handle = backend.submit(req, self.channel.put)
            else:
                self.handle = backend.submit(req, self.channel.put, reservation=reservation)
        finally:
            if reservation is not None:
                reservation.release()  # (a no-op once submit took it over)
        first = self._next_event()
        if isinstance(first, Started):
            self.started = first
            self.cached_tokens = first.reused_tokens
            if self.metrics is not None:
                self.metrics.observe_queue(self.model_name, time.perf_counter() - t_submit)
            return
        if isinstance(first, Finished) and first.error is not None:  # refused: queue timeout, shutdown...
            for c in self.choices:
                c.finished = True
            raise first.error
        self._replay.append(first)  # no Started (a backend may skip it): pump() sees it first

    def check_client(self) -> None:
        """Raise ClientGone when the client closed its connection (a poll, at most every CHECK_GAP_S)."""
        now = time.monotonic()
        if now - self._last_check >= CHECK_GAP_S:
            self._last_check = now
            if bridge.client_gone(self.environ):
                raise ClientGone()

    def _next_event(self) -> Any:
        """The next backend event; checks (at most every CHECK_GAP_S) that the client is still connected."""
        if self._replay:
            return self._replay.pop(0)
        while True:
            self.check_client()
            try:
                return self.channel.get(timeout=POLL_S)
            except bridge.Timeout:
                continue

    # -- running --------------------------------------------------------------------------------------------
    def pump(self) -> Iterator[Piece]:
        """Yield every choice's pieces until the backend has finished them all. Raises on a backend error."""
        while not self.finished:
            ev = self._next_event()
            if isinstance(ev, Tokens):
                self._observe_token_time()
                yield from self._take(self._choice(ev.choice), ev)
            elif isinstance(ev, Finished):
                if ev.reason == "error":
                    self._fail(ev)
                else:
                    yield from self._finish(self._choice(ev.choice), ev.reason)
        if self.metrics is not None:
            self.metrics.observe_e2e(self.model_name, time.perf_counter() - self.t0)

    def _observe_token_time(self) -> None:
        if self.metrics is None:
            return
        now = time.perf_counter()
        if self._t_last is None:
            self.metrics.observe_ttft(self.model_name, now - self.t0)
        else:
            self.metrics.observe_itl(self.model_name, now - self._t_last)
        self._t_last = now

    def _choice(self, index: int) -> Choice:
        if not 0 <= index < len(self.choices):
            raise RuntimeError(f"the backend sent an event for choice {index} of a request with {len(self.choices)}")
        return self.choices[index]

    def _take(self, c: Choice, ev: Tokens) -> Iterator[Piece]:
        lps = ev.logprobs
        if self.want_logprobs and (lps is None or len(lps) != len(ev.ids)):
            raise RuntimeError("the backend sent tokens without the log probabilities the request asked for")
        tok = self._tok
        last = len(ev.ids) - 1
        for k, tid in enumerate(ev.ids):
            if c.done or c.eos:
                return  # over-generated past a stop string or EOS: discarded
            c.tokens += 1
            if ev.stop and k == last:  # the device flagged it STOP: a stop id, not text
                c.eos = True
                return
            if self.want_logprobs:
                c.pending.append(Positioned(tid, lps[k], c.chars))
            if tok.is_control(tid) and tok.token_text(tid) not in MARKERS:
                continue  # turn markers, padding...: never shown; the emitter's markers pass
            text = c.decoder.push(tid)
            c.chars += len(text)
            yield from self._emit(c, c.emitter.feed(text))
            if c.emitter.stopped:
                yield self._end(c, c.emitter.finish_reason or "stop")
                self._stop_generating(c)

    def _stop_generating(self, c: Choice) -> None:
        """A stop string ended `c`: the backend stops it, or the whole request when no choice runs on."""
        if self._cancelled or c.finished:
            return
        if all(x.done for x in self.choices):
            self._cancelled = True
            self.handle.cancel()
        else:
            self.handle.cancel(c.index)

    def _finish(self, c: Choice, reason: str) -> Iterator[Piece]:
        """The backend's Finished for choice `c`: release what the emitter holds, then its final piece."""
        c.finished = True
        if c.done:
            return
        # The device's flag, as the backend passed it on: LENGTH ended it mid-text (a call being written
        # goes out partial), STOP on a stop id. What the text says (tool calls, a call cut short) wins.
        cut = reason == "length"
        yield from self._emit(c, c.emitter.feed(c.decoder.flush()) + c.emitter.finish(cut=cut))
        yield self._end(c, c.emitter.finish_reason or ("length" if cut else "stop"))

    def _fail(self, ev: Finished) -> None:
        """An error ends the whole request: raise it, unless every choice had already ended."""
        for c in self.choices:
            c.finished = True
        if not self._cancelled:
            self._cancelled = True
            self.handle.cancel()  # whatever of the request the backend still runs
        if not all(c.done for c in self.choices):
            raise ev.error if ev.error is not None else RuntimeError("generation failed")

    def _emit(self, c: Choice, deltas: list[Delta]) -> Iterator[Piece]:
        for j, d in enumerate(deltas):
            yield Piece(c.index, d, self._drain(c) if j == 0 else ())

    def _end(self, c: Choice, reason: str) -> Piece:
        c.done = True
        c.finish_reason = reason
        return Piece(c.index, None, self._drain(c), reason)

    @staticmethod
    def _drain(c: Choice) -> tuple[Positioned, ...]:
        out = tuple(c.pending)
        c.pending.clear()
        return out

    # -- ending ---------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Cancel if still running, wait briefly for the backend to confirm, release the ref. Idempotent."""
        if self.closed:
            return
        self.closed = True
        if self.metrics is not None and self.handle is not None:
            if not self.finished:  # still running: the client went away (or the request was aborted)
                self.metrics.disconnect(self.model_name)
            self.metrics.add_tokens(self.model_name, self.prompt_tokens, self.completion_tokens)
        try:
            if self.handle is not None and not self.finished:
                log.info("request %s on %s: cancelling after %d tokens (client gone or request aborted)", self.id,
                         self.model_name, self.completion_tokens)
                self.handle.cancel()
                self._await_finished()
        finally:
            self.registry.release(self.entry)

    def _await_finished(self) -> None:
        deadline = time.monotonic() + CANCEL_WAIT_S
        while not self.finished and time.monotonic() < deadline:
            try:
                ev = self.channel.get(timeout=max(0.01, deadline - time.monotonic()))
            except bridge.Timeout:
                break
            if isinstance(ev, Finished):
                for c in self.choices:
                    if ev.reason == "error" or c.index == ev.choice:
                        c.finished = True
        if not self.finished:
            log.warning("backend of %s did not confirm the cancel of %s within %.0f s", self.model_name, self.id,
                        CANCEL_WAIT_S)

    # -- streaming ------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def complete(self) -> dict:
        """Run to the end and return the route's non-streamed answer."""

    @abc.abstractmethod
    def frames(self) -> Iterator[bytes]:
        """The SSE events of a stream, before [DONE]."""

    def sse(self) -> Iterator[bytes]:
        """The SSE body: the route's frames, then [DONE]; an error after the 200 went out is sent in-band."""
        error: BaseException | None = None
        try:
            yield from self.frames()
        except ClientGone:
            return
        except Exception as exc:  # after the 200 went out: report in-band
            if not isinstance(exc, PantheonError):
                log.exception("stream %s failed", self.id)
            error = exc
        if error is not None:
            _, body, _ = from_exception(error)
            yield json_line(body)
        yield DONE


class SSEStream:
    """WSGI body for a stream: iterating yields SSE frames; close() always closes the generation, also
    when the server closes the body without ever iterating it (a client gone before the first byte)."""

    def __init__(self, gen: GenerationCore):
        self._gen = gen
        self._it = gen.sse()

    def __iter__(self) -> Iterator[bytes]:
        return self._it

    def close(self) -> None:
        try:
            self._it.close()
        finally:
            self._gen.close()
