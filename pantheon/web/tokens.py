"""Small routes over a model's card: `GET /v1/models/<id>`, `POST /tokenize`, `POST /detokenize`.

`/tokenize` and `/detokenize` take llama.cpp's server shapes so its clients work unchanged:
`{"content": str, "add_special": bool, "with_pieces": bool}` -> `{"tokens": [id, ...]}` (or, with
pieces, `[{"id": id, "piece": str}, ...]`), and `{"tokens": [id, ...]}` -> `{"content": str}`. An
optional `"model"` picks the model as in chat completions. Both only read the model's tokenizer (a
host object on its card): they hold a registry reference for the call and never touch the device.

Both are bounded and kept off the event loop. One call takes (detokenize) or returns (tokenize) at
most `TOKENS_MAX` ids, a long context's worth: a million ids took the hub for 3.6 s, and a 4 MB text
with its pieces is a 50 MB answer. A body over `BIG_PROMPT_CHARS` bytes is parsed and checked, then
tokenized or decoded and serialised, in OS threads (`bridge.call_in_thread`); the registry reference is
taken and given back on the request's own greenlet, which is the only place that can see the app.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flask import Blueprint, Response, current_app, jsonify

from pantheon.errors import RequestError
from pantheon.web import bridge
from pantheon.web.body import parse_json, shown
from pantheon.web.chat import BIG_PROMPT_CHARS
from pantheon.web.fields import body_object
from pantheon.web.routes import read_raw, server
from pantheon.contract import ID_CHARS, TOKENS_MAX
from pantheon.web.schema import DETOKENIZE_REQUEST, TOKENIZE_REQUEST, fields

bp = Blueprint("tokens", __name__)


def _flag(body: dict, key: str) -> bool:
    v = body.get(key, False)
    if not isinstance(v, bool):
        raise RequestError(f"{key}: must be true or false", param=key)
    return v


def _model(body: dict) -> str | None:
    name = body.get("model")
    if name is not None and (not isinstance(name, str) or len(name) > ID_CHARS):
        raise RequestError(f"model: must be a string of at most {ID_CHARS} characters", param="model")
    return name


def _dumps() -> Callable[[Any], str]:
    """JSON text as `jsonify` writes it, by a function that needs no app context (so threads can call it)."""
    provider = current_app.json
    return lambda obj: provider.dumps(obj, separators=(",", ":"))


def _in_thread_if(big: bool, fn: Callable[[], Any], name: str) -> Any:
    """`fn()`, in a named OS thread when `big` (the caller waits cooperatively), else right here."""
    return bridge.call_in_thread(fn, name=name) if big else fn()


def _on_tokenizer(model: str | None, fn: Callable[[Any], str], big: bool, name: str) -> Response:
    """The JSON text `fn(tokenizer)` makes of the requested model's tokenizer, as the answer.

    The registry reference is taken and released here, on the request's greenlet; only `fn` (no Flask
    state: the app is not visible from another thread) runs in the OS thread when `big`."""
    registry = server().registry
    entry = registry.acquire(model)
    try:
        text = _in_thread_if(big, lambda: fn(entry.card.tokenizer), name)
    finally:
        registry.release(entry)
    return Response(text + "\n", mimetype="application/json")


@bp.get("/v1/models/<path:model_id>")
def get_model(model_id: str) -> Response:
    for m in server().registry.models():
        if m["id"] == model_id:
            return jsonify(m)
    raise RequestError(f"model {shown(model_id)!r} is not loaded", param="model", status=404, code="model_not_found")


def _too_many(n: str) -> RequestError:
    return RequestError(f"content: the text has {n} tokens; one /tokenize call returns at most {TOKENS_MAX} "
                        "(split the text)", param="content")


@bp.post("/tokenize")
def tokenize() -> Response:
    raw = read_raw()
    big = len(raw) > BIG_PROMPT_CHARS

    def parse() -> tuple[dict, str, bool, bool]:
        body = body_object(parse_json(raw), fields(TOKENIZE_REQUEST))
        content = body.get("content")
        if not isinstance(content, str):
            raise RequestError("content: must be a string", param="content")
        return body, content, _flag(body, "add_special"), _flag(body, "with_pieces")

    body, content, add_special, with_pieces = _in_thread_if(big, parse, "pantheon-parse")
    dumps = _dumps()

    def run(tok: Any) -> str:
        bound = getattr(tok, "min_tokens", None)
        if callable(bound) and bound(content) > TOKENS_MAX:  # refused without tokenizing it
            raise _too_many(f"at least {bound(content)}")
        ids = tok.encode(content, add_special=add_special)
        if len(ids) > TOKENS_MAX:
            raise _too_many(str(len(ids)))
        return dumps({"tokens": [{"id": i, "piece": tok.token_text(i)} for i in ids] if with_pieces else ids})

    return _on_tokenizer(_model(body), run, big, "pantheon-tokenize")


@bp.post("/detokenize")
def detokenize() -> Response:
    raw = read_raw()
    big = len(raw) > BIG_PROMPT_CHARS

    def parse() -> tuple[dict, list[int]]:
        body = body_object(parse_json(raw), fields(DETOKENIZE_REQUEST))
        ids = body.get("tokens")
        if isinstance(ids, list) and len(ids) > TOKENS_MAX:
            raise RequestError(f"tokens: {len(ids)} ids; one /detokenize call takes at most {TOKENS_MAX}",
                               param="tokens")
        if isinstance(ids, list):  # JSON has one number type: 5.0 is the id 5, as in every integer field
            ids = [int(i) if isinstance(i, float) and i.is_integer() else i for i in ids]
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise RequestError(f"tokens: must be a list of at most {TOKENS_MAX} token ids", param="tokens")
        return body, ids

    body, ids = _in_thread_if(big, parse, "pantheon-parse")
    dumps = _dumps()

    def run(tok: Any) -> str:
        bad = next((i for i in ids if not 0 <= i < tok.vocab_size), None)
        if bad is not None:
            raise RequestError(f"tokens: {bad} is not a token id of this model (0..{tok.vocab_size - 1})",
                               param="tokens")
        return dumps({"content": tok.decode(ids)})

    return _on_tokenizer(_model(body), run, big, "pantheon-detokenize")
