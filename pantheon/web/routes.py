"""The OpenAI-compatible routes and the health probe: `/`, `/v1/models`, `/v1/chat/completions`.

`/` and `/v1/models` only read the registry table (a lock held for microseconds), so they answer at
once however many generations are running. Chat handlers hold a registry ref for exactly as long as
the generation runs; `Generation.close` gives it back on every path out (done, error, disconnect).
A chat response names the instance (replica) that served it in `X-Pantheon-Instance`.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from flask import Blueprint, Response, current_app, jsonify, request

from ..errors import RequestError
from .chat import ClientGone, Generation, SSEStream, parse_chat_request

log = logging.getLogger(__name__)

bp = Blueprint("openai", __name__)

INSTANCE_HEADER = "X-Pantheon-Instance"  # on chat responses: the model instance (replica) that served it


def server() -> Any:
    """This app's ServerState (settings, registry, startup status)."""
    return current_app.extensions["pantheon"]


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def read_json() -> Any:
    """The request body as JSON, or 400 saying why not. Size was already checked (413)."""
    raw = request.get_data(cache=False)
    if not raw:
        raise RequestError("the request body is empty; send a JSON object")
    try:
        return json.loads(raw, parse_constant=_reject_constant)
    except RecursionError:
        raise RequestError("malformed JSON: nested too deeply") from None
    except ValueError as exc:  # includes UnicodeDecodeError
        raise RequestError(f"malformed JSON: {exc}") from None


@bp.get("/")
def health() -> Response:
    st = server()
    if st.status == "ok":
        return jsonify(service="pantheon", status="ok")
    body = {"service": "pantheon", "status": st.status}
    if st.error:
        body["error"] = st.error
    resp = jsonify(body)
    resp.status_code = 503
    return resp


@bp.get("/v1/models")
def list_models() -> Response:
    return jsonify(object="list", data=server().registry.models())


@bp.get("/metrics")
def metrics() -> Response:
    body, ctype = server().metrics.render()
    return Response(body, content_type=ctype)


@bp.post("/v1/chat/completions")
def chat_completions() -> Response:
    t0 = time.perf_counter()
    creq = parse_chat_request(read_json(), request.headers)
    creq.size = request.content_length or 0
    registry = server().registry
    entry = registry.acquire(creq.model, creq.session_id)
    try:
        gen = Generation(registry, entry, creq, request.environ, metrics=server().metrics, t0=t0,
                         watch=server().memwatch)
    except BaseException:
        registry.release(entry)
        raise
    try:
        gen.start()
    except ClientGone:
        gen.close()
        return Response(status=499)
    except BaseException:
        gen.close()
        raise
    if creq.stream:
        return Response(SSEStream(gen), mimetype="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                 INSTANCE_HEADER: entry.instance_id})
    try:
        resp = jsonify(gen.complete())
        resp.headers[INSTANCE_HEADER] = entry.instance_id
        return resp
    except ClientGone:
        return Response(status=499)
    finally:
        gen.close()
