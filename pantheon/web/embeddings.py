"""POST /v1/embeddings (and /m/<model>/v1/embeddings): OpenAI's embeddings API over any loaded model.

An embedding is the model's final hidden state (after the final norm, before the LM head), pooled
over the input's tokens and L2-normalised. Generative models were not trained for this, so the vectors
are fit for similarity search between texts of one model, not interchangeable with a trained
embedding model's. Pooling is OpenAI-compatible by default ("mean" over the tokens); the extension
field `pooling: "last"` takes the last token's state instead (what last-token embedding models use).

Request: `input` (a string, a list of strings, a list of token ids, or a list of lists of token ids; at
most MAX_INPUTS items, none empty), `model`, `encoding_format` ("float" | "base64": the vector's
little-endian float32 bytes), `dimensions` (only the model's own size: vectors are not truncated),
`user` (accepted, unused), `pooling`. Texts are tokenized with the model's BOS/EOS as its file asks
(`Tokenizer.encode(add_special=True)`); token ids are taken as given. An input longer than the
model's context window is a 400 `context_length_exceeded`, as in chat, and the request is admitted
against the memory free now by the same service as chat (pantheon.serving.admission: 503 with
Retry-After under CRITICAL pressure). A request carries at most
`PANTHEON_EMBED_MAX_TOKENS` tokens in all (its inputs summed): beyond it, a 400 naming both figures.
Texts are tokenized one by one and the count stops at the first input past the budget, so a refused
request never costs more tokenizing than the budget plus one input.

The inputs go to the model's scheduler as one `EmbedRequest`: they are batched with each other and with
concurrent requests' (pantheon.scheduler.embed, which also keeps them from starving generation), and
the request greenlet waits cooperatively for the result, noticing a client that went away (the job is
then cancelled). A large answer is encoded off the hub, in an OS thread, a vector at a time.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from flask import Blueprint, Response, request

from pantheon.errors import PantheonError, RequestError
from pantheon.serving.admission import AdmissionService
from pantheon.types import EMBED_POOLINGS, EmbedRequest, Embedded, Finished
from pantheon.web import bridge
from pantheon.web.body import parse_json
from pantheon.web.chat import BIG_PROMPT_CHARS
from pantheon.web.fields import bad as _bad
from pantheon.web.fields import body_object, bounded
from pantheon.web.generation import CHECK_GAP_S, POLL_S, ClientGone
from pantheon.web.routes import INSTANCE_HEADER, parse_for_root, read_raw, server
from pantheon.contract import EMBED_INPUTS_MAX, EMBEDDINGS, ID_CHARS
from pantheon.web.schema import EMBEDDING_REQUEST, fields

bp = Blueprint("embeddings", __name__)

FIELDS = fields(EMBEDDING_REQUEST)  # pantheon.web.schema describes the body
ENCODINGS = ("float", "base64")
MAX_INPUTS = EMBED_INPUTS_MAX  # items one request may carry (OpenAI's limit)
BIG_ANSWER_FLOATS = 1 << 16  # answers with more floats are encoded off the hub, in an OS thread (~0.1 s of work)
CANCEL_WAIT_S = 5.0  # how long a request whose client left waits for the scheduler to let go of its slots


@dataclass
class EmbeddingsRequest:
    """A validated body. Exactly one of `texts` / `token_inputs` is set."""

    texts: list[str] | None
    token_inputs: list[list[int]] | None
    model: str | None = None
    encoding_format: str = "float"
    dimensions: int | None = None
    pooling: str = "mean"

    @property
    def count(self) -> int:
        return len(self.texts if self.texts is not None else self.token_inputs or [])


def _is_id(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _inputs(raw: Any) -> tuple[list[str] | None, list[list[int]] | None]:
    """OpenAI's four shapes of `input` -> (texts, None) or (None, token id lists)."""
    shape = "must be a string, a list of strings, a list of token ids or a list of lists of token ids"
    if isinstance(raw, str):
        raw = [raw]
    if not isinstance(raw, list):
        raise _bad("input", shape)
    if not raw:
        raise _bad("input", "must not be empty")
    if all(_is_id(v) for v in raw):
        raw = [raw]  # one input given as token ids
    if len(raw) > MAX_INPUTS:
        raise _bad("input", f"at most {MAX_INPUTS} inputs are allowed, got {len(raw)}")
    if all(isinstance(v, str) for v in raw):
        for i, text in enumerate(raw):
            if not text:
                raise _bad(f"input[{i}]", "must not be an empty string")
        return raw, None
    if all(isinstance(v, list) for v in raw):
        for i, ids in enumerate(raw):
            if not ids:
                raise _bad(f"input[{i}]", "must not be an empty list of token ids")
            if not all(_is_id(t) and t >= 0 for t in ids):
                raise _bad(f"input[{i}]", "must be a list of token ids (non-negative integers)")
        return None, raw
    raise _bad("input", shape + " (not a mix of them)")


def parse_embeddings_request(body: Any) -> EmbeddingsRequest:
    """Validate an embeddings body; raises RequestError (400) naming the first bad field."""
    body = body_object(body, FIELDS)
    if "input" not in body:
        raise _bad("input", "is required")
    texts, token_inputs = _inputs(body["input"])
    for key in ("model", "user"):
        v = body.get(key)
        if v is not None and (not isinstance(v, str) or len(v) > ID_CHARS):
            raise _bad(key, f"must be a string of at most {ID_CHARS} characters")
    fmt = body.get("encoding_format")
    if fmt is None:
        fmt = "float"
    if fmt not in ENCODINGS:
        raise _bad("encoding_format", f"must be one of {', '.join(ENCODINGS)}")
    dims = bounded(body, "dimensions", EMBEDDINGS)
    pooling = body.get("pooling")
    if pooling is None:
        pooling = "mean"
    if pooling not in EMBED_POOLINGS:
        raise _bad("pooling", f"must be one of {', '.join(EMBED_POOLINGS)}")
    return EmbeddingsRequest(texts=texts, token_inputs=token_inputs, model=body.get("model"),
                             encoding_format=fmt, dimensions=dims, pooling=pooling)


def _over_budget(total: str, budget: int) -> RequestError:
    return _bad("input", f"the inputs have {total} tokens in all; one embeddings request may carry at most {budget} "
                         "(PANTHEON_EMBED_MAX_TOKENS): split them over several requests")


def tokenize_inputs(card: Any, ereq: EmbeddingsRequest, budget: int) -> list[list[int]]:
    """Each input's token ids, checked against the model's vocabulary and context window and their sum
    against `budget` (400s). Cheap checks come first: token ids are counted before any id is looked at;
    texts are refused by their lower bound before tokenizing, and tokenizing stops at the input that
    passes the budget (the count is then "at least")."""
    tok = card.tokenizer
    if ereq.token_inputs is not None:
        total = sum(len(ids) for ids in ereq.token_inputs)
        if total > budget:
            raise _over_budget(str(total), budget)
        vocab = int(tok.vocab_size)
        for i, ids in enumerate(ereq.token_inputs):
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                raise _bad(f"input[{i}]", f"{bad} is not a token id of this model (0..{vocab - 1})")
            AdmissionService.embedding_input(card, i, len(ids))
        return ereq.token_inputs
    texts = ereq.texts or []
    bound = getattr(tok, "min_tokens", None)
    if callable(bound):  # provably too many: refused before tokenizing anything
        least = 0
        for i, text in enumerate(texts):
            n = bound(text)
            AdmissionService.embedding_input(card, i, n, at_least=True)
            least += n
        if least > budget:
            raise _over_budget(f"at least {least}", budget)
    out = []
    total = 0
    for i, text in enumerate(texts):
        ids = tok.encode(text, add_special=True)
        if not ids:
            raise _bad(f"input[{i}]", "has no tokens")
        AdmissionService.embedding_input(card, i, len(ids))
        total += len(ids)
        if total > budget:
            raise _over_budget(str(total) if i == len(texts) - 1 else f"at least {total}", budget)
        out.append(ids)
    return out


def model_dimensions(entry: Any) -> int | None:
    """The model's embedding size (its hidden size), or None when the entry does not say."""
    cfg = getattr(getattr(entry, "model", None), "config", None)
    hidden = getattr(cfg, "hidden", None)
    return int(hidden) if isinstance(hidden, int) else None


def encode_vector(vec: np.ndarray, fmt: str) -> list[float] | str:
    """One embedding as OpenAI sends it: a list of floats, or base64 of its little-endian float32 bytes."""
    v = np.asarray(vec, dtype="<f4")
    if fmt == "base64":
        return base64.b64encode(v.tobytes()).decode("ascii")
    return v.tolist()


def response_json(vectors: np.ndarray, fmt: str, model: str, prompt_tokens: int) -> str:
    """The answer's JSON text, built a vector at a time. Why not one json.dumps of the whole answer:
    that is one C call holding the GIL throughout (2048 vectors of 576 floats: about 1.5 s), which
    stalls every stream on the hub and the model's driver thread; between per-vector pieces the
    thread building it gives the GIL up whenever another thread asks."""
    compact = (",", ":")
    items = (json.dumps({"object": "embedding", "index": i, "embedding": encode_vector(v, fmt)}, separators=compact)
             for i, v in enumerate(vectors))
    usage = json.dumps({"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}, separators=compact)
    return (f'{{"object":"list","data":[{",".join(items)}],"model":{json.dumps(model)},'
            f'"usage":{usage}}}')


def _wait(channel: bridge.Channel, environ: dict) -> Any:
    """The backend's one event; raises ClientGone when the client leaves first."""
    last_check = 0.0
    while True:
        now = time.monotonic()
        if now - last_check >= CHECK_GAP_S:
            last_check = now
            if bridge.client_gone(environ):
                raise ClientGone()
        try:
            return channel.get(timeout=POLL_S)
        except bridge.Timeout:
            continue


def _run(entry: Any, inputs: list[list[int]], pooling: str, environ: dict, admission: AdmissionService,
         observe: Callable[[str], None] = lambda outcome: None) -> Embedded:
    """Admit the inputs (window, memory, a queue place: pantheon.serving.admission, as for chat), submit
    them to the model's scheduler and wait for the vectors; a backend error is raised as is."""
    submit = getattr(entry.backend, "submit_embed", None)
    if submit is None:
        raise RequestError(f"model {entry.name!r} does not serve embeddings", param="model", status=400,
                           code="embeddings_unsupported")
    try:
        admission.embeddings(entry.card, [len(ids) for ids in inputs])
    except PantheonError:
        observe("denied")
        raise
    observe("fit")
    channel = bridge.Channel()
    req = EmbedRequest(inputs=inputs, pooling=pooling)
    reservation = admission.place(entry.backend)
    try:
        handle = submit(req, channel.put) if reservation is None else submit(req, channel.put, reservation=reservation)
    finally:
        if reservation is not None:
            reservation.release()  # (a no-op once submit took it over)
    try:
        ev = _wait(channel, environ)
    except ClientGone:
        handle.cancel()
        try:  # the scheduler lets go of the job's slots before the registry ref goes
            channel.get(timeout=CANCEL_WAIT_S)
        except bridge.Timeout:
            pass
        raise
    if isinstance(ev, Finished):
        raise ev.error if ev.error is not None else RuntimeError(f"embeddings {ev.reason}")
    return ev


@bp.post("/v1/embeddings")
def embeddings() -> Response:
    return handle_embeddings()


@bp.post("/m/<path:model>/v1/embeddings")
def model_embeddings(model: str) -> Response:
    return handle_embeddings(root_model=model)


def handle_embeddings(root_model: str | None = None) -> Response:
    """One embeddings request. `root_model`: it came in under that model's own root (`/m/<model>/...`)."""
    raw = read_raw()
    ereq = parse_for_root(raw, lambda: parse_embeddings_request(parse_json(raw)), root_model)
    st = server()
    registry = st.registry
    entry = registry.acquire(ereq.model)
    try:
        dims = model_dimensions(entry)
        if ereq.dimensions is not None and dims is not None and ereq.dimensions != dims:
            raise _bad("dimensions", f"this model's embeddings have {dims} dimensions (they cannot be shortened)")
        chars = sum(len(t) for t in ereq.texts or [])
        work = lambda: tokenize_inputs(entry.card, ereq, st.settings.embed_max_tokens)  # noqa: E731
        inputs = bridge.call_in_thread(work, name="pantheon-tokenize") if chars > BIG_PROMPT_CHARS else work()
        try:
            observe = st.metrics.observe_admission if st.metrics is not None else (lambda outcome: None)
            done = _run(entry, inputs, ereq.pooling, request.environ, AdmissionService(st.memwatch), observe)
        except ClientGone:
            return Response(status=499)
        vectors = np.asarray(done.vectors, np.float32)
        if ereq.dimensions is not None and ereq.dimensions != vectors.shape[1]:
            raise _bad("dimensions", f"this model's embeddings have {vectors.shape[1]} dimensions (they cannot be "
                                     "shortened)")
        if st.metrics is not None:
            st.metrics.add_tokens(entry.name, done.prompt_tokens, 0)
        answer = lambda: response_json(vectors, ereq.encoding_format, entry.name, done.prompt_tokens)  # noqa: E731
        big = vectors.size > BIG_ANSWER_FLOATS
        resp = Response(bridge.call_in_thread(answer, name="pantheon-encode") if big else answer(),
                        mimetype="application/json")
        resp.headers[INSTANCE_HEADER] = entry.instance_id
        return resp
    finally:
        registry.release(entry)
