"""Small routes over a model's card: `GET /v1/models/<id>`, `POST /tokenize`, `POST /detokenize`.

`/tokenize` and `/detokenize` take llama.cpp's server shapes so its clients work unchanged:
`{"content": str, "add_special": bool, "with_pieces": bool}` -> `{"tokens": [id, ...]}` (or, with
pieces, `[{"id": id, "piece": str}, ...]`), and `{"tokens": [id, ...]}` -> `{"content": str}`. An
optional `"model"` picks the model as in chat completions. Both only read the model's tokenizer (a
host object on its card): they hold a registry reference for the call and never touch the device.
Long texts are tokenized in an OS thread (the same bound as chat prompts), off the event loop.
"""

from __future__ import annotations

from typing import Any

from flask import Blueprint, Response, jsonify

from pantheon.errors import RequestError
from pantheon.web import bridge
from pantheon.web.body import shown
from pantheon.web.chat import BIG_PROMPT_CHARS
from pantheon.web.fields import body_object
from pantheon.web.routes import read_json, server
from pantheon.web.schema import DETOKENIZE_MAX, DETOKENIZE_REQUEST, ID_CHARS, TOKENIZE_REQUEST, fields

bp = Blueprint("tokens", __name__)

MAX_DETOKENIZE = DETOKENIZE_MAX  # token ids one /detokenize call may carry


def _flag(body: dict, key: str) -> bool:
    v = body.get(key, False)
    if not isinstance(v, bool):
        raise RequestError(f"{key}: must be true or false", param=key)
    return v


def _with_tokenizer(body: dict, fn: Any) -> Any:
    """Run `fn(tokenizer)` on the requested model's tokenizer, holding a registry reference meanwhile."""
    name = body.get("model")
    if name is not None and (not isinstance(name, str) or len(name) > ID_CHARS):
        raise RequestError(f"model: must be a string of at most {ID_CHARS} characters", param="model")
    registry = server().registry
    entry = registry.acquire(name)
    try:
        return fn(entry.card.tokenizer)
    finally:
        registry.release(entry)


@bp.get("/v1/models/<path:model_id>")
def get_model(model_id: str) -> Response:
    for m in server().registry.models():
        if m["id"] == model_id:
            return jsonify(m)
    raise RequestError(f"model {shown(model_id)!r} is not loaded", param="model", status=404, code="model_not_found")


@bp.post("/tokenize")
def tokenize() -> Response:
    body = body_object(read_json(), fields(TOKENIZE_REQUEST))
    content = body.get("content")
    if not isinstance(content, str):
        raise RequestError("content: must be a string", param="content")
    add_special, with_pieces = _flag(body, "add_special"), _flag(body, "with_pieces")

    def run(tok: Any) -> list:
        ids = tok.encode(content, add_special=add_special)
        return [{"id": i, "piece": tok.token_text(i)} for i in ids] if with_pieces else ids

    work = lambda: _with_tokenizer(body, run)  # noqa: E731
    tokens = bridge.call_in_thread(work, name="pantheon-tokenize") if len(content) > BIG_PROMPT_CHARS else work()
    return jsonify(tokens=tokens)


@bp.post("/detokenize")
def detokenize() -> Response:
    body = body_object(read_json(), fields(DETOKENIZE_REQUEST))
    ids = body.get("tokens")
    if isinstance(ids, list):  # JSON has one number type: 5.0 is the id 5, as in every integer field
        ids = [int(i) if isinstance(i, float) and i.is_integer() else i for i in ids]
    if not isinstance(ids, list) or len(ids) > MAX_DETOKENIZE or \
            not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise RequestError(f"tokens: must be a list of at most {MAX_DETOKENIZE} token ids", param="tokens")

    def run(tok: Any) -> str:
        bad = next((i for i in ids if not 0 <= i < tok.vocab_size), None)
        if bad is not None:
            raise RequestError(f"tokens: {bad} is not a token id of this model (0..{tok.vocab_size - 1})",
                               param="tokens")
        return tok.decode(ids)

    return jsonify(content=_with_tokenizer(body, run))
