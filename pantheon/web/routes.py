"""The OpenAI-compatible routes and the health probe: `/`, `/v1/models`, `/v1/chat/completions`,
`/v1/completions`.

`/` and `/v1/models` only read the registry table (a lock held for microseconds), so they answer at
once however many generations are running. Generation handlers (chat and legacy completions, one
`serve_generation`) hold a registry ref for exactly as long as the generation runs;
`GenerationCore.close` gives it back on every path out (done, error, disconnect). A generation's
response names the instance (replica) that served it in `X-Pantheon-Instance`.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any

from flask import Blueprint, Response, current_app, jsonify, request

from pantheon.serving import distributed
from pantheon.errors import RequestError
from pantheon.web.body import parse_json, read_body
from pantheon.web import bridge, page
from pantheon.web.chat import Generation, cache_scope, parse_chat_request
from pantheon.web.completions import make_completion, parse_completion_request
from pantheon.web.generation import ClientGone, GenerationCore, SSEStream, json_text
from pantheon.web.security import presented_key

log = logging.getLogger(__name__)

bp = Blueprint("openai", __name__)

INSTANCE_HEADER = "X-Pantheon-Instance"  # on chat responses: the model instance (replica) that served it
BIG_BODY_BYTES = 65536  # larger request bodies are parsed and validated off the event loop


def server() -> Any:
    """This app's ServerState (settings, registry, startup status)."""
    return current_app.extensions["pantheon"]


def read_raw() -> bytes:
    """The request body, bounded in type, size and time (pantheon.web.body)."""
    st = server().settings
    return read_body(request.environ, st.max_body_bytes, st.body_timeout_s, st.body_min_rate)


def read_json() -> Any:
    """The request body as JSON, also bounded in depth and Unicode (pantheon.web.body)."""
    return parse_json(read_raw())


def health_body() -> tuple[dict, int]:
    """The server's health: 200 ok; 503 while loading, after a failed start, or while a model's
    driver has failed (named in `error`) -- the one rule every health route answers with."""
    st = server()
    status, error = st.status, st.error
    broken = distributed.failure()  # multi-host: a follower is gone, its models cannot step
    if status == "ok":
        failed = st.registry.failures()
        if broken:
            status, error = "failed", broken
        elif failed:
            status, error = "failed", "; ".join(failed)
    body = {"service": "pantheon", "status": status}
    if error:
        body["error"] = error
    if status == "ok":
        body.update(compile_progress(st.registry.load_infos()))
    return body, 200 if status == "ok" else 503


def compile_progress(infos: Any) -> dict:
    """While ready models still compile step programs in the background (they serve meanwhile, a
    bucket not compiled yet padded into a larger one): {"progress": "compiled k/n" over all of them,
    "compiling": {model: "compiled k/n"}}; {} once every program exists."""
    per: dict[str, list[int]] = {}
    for name, info in infos:
        k, n = info.get("compiled"), info.get("programs")
        if isinstance(k, int) and isinstance(n, int):
            acc = per.setdefault(name, [0, 0])
            acc[0] += k
            acc[1] += n
    busy = {name: kn for name, kn in per.items() if kn[0] < kn[1]}
    if not busy:
        return {}
    k, n = sum(kn[0] for kn in per.values()), sum(kn[1] for kn in per.values())
    return {"progress": f"compiled {k}/{n}", "compiling": {name: f"compiled {a}/{b}" for name, (a, b) in busy.items()}}


@bp.get("/")
@bp.get("/health")
def health() -> Response:
    """200 once every configured model is loaded and no model's driver (or cluster peer) has failed;
    503 while loading, after a failed start or while a model has failed (the body says which).
    `/health` is the path routers probe (SMG's default). A browser asking for `/` gets the chat page
    instead (pantheon.web.page: content negotiation); every other client gets this JSON, unchanged."""
    if request.path == "/" and page.wants_page(request.accept_mimetypes):
        return page.chat_page()
    body, code = health_body()
    resp = jsonify(body)
    resp.status_code = code
    if request.path == "/":
        resp.vary.add("Accept")  # the same URL answers a browser with the page
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
    return handle_chat()


@bp.post("/v1/completions")
def completions() -> Response:
    return handle_completion()


def handle_chat(root_model: str | None = None) -> Response:
    """One chat completion. `root_model`: the request came in under that model's own root
    (`/m/<model>/...`, pantheon.web.router_api), which serves that model only."""
    return serve_generation(parse_chat_request, functools.partial(Generation, grammars=server().grammars,
                                                                 images=server().images), root_model)


def handle_completion(root_model: str | None = None) -> Response:
    """One legacy completion (`root_model` as for chat)."""
    return serve_generation(parse_completion_request, make_completion, root_model)


def parse_for_root(raw: bytes, parse: Callable[[], Any], root_model: str | None) -> Any:
    """`parse()`'s request (anything with a `model` field), bound to the model root it came in under.

    A large body is parsed and validated in an OS thread: a 4 MB body of tiny items is ~10^6 Python
    objects to check, long enough to stall every other request if it ran on the event loop. Under
    `/m/<model>/...` the request is that model's: a body naming another one is a 404.
    """
    req = bridge.call_in_thread(parse, name="pantheon-parse") if len(raw) > BIG_BODY_BYTES else parse()
    if root_model is not None:
        if req.model and req.model != root_model:
            raise RequestError(f"model {req.model!r} is not served at this root (it serves {root_model!r})",
                               param="model", status=404, code="model_not_found")
        req.model = root_model
    return req


def json_answer(obj: Any, large: bool) -> Response:
    """`jsonify(obj)`; when `large`, the same bytes written in an OS thread by the stepwise encoder
    (pantheon.web.generation.json_text), so a response of many megabytes never holds the event loop."""
    if not large:
        return jsonify(obj)
    text = bridge.call_in_thread(lambda: json_text(obj, ensure_ascii=True, sort_keys=True), name="pantheon-json")
    return Response(text + "\n", mimetype="application/json")


def serve_generation(parse_body: Callable[[Any, Any], Any], make: Callable[..., GenerationCore],
                     root_model: str | None) -> Response:
    """Parse with `parse_body(json, headers)`, take a model ref, start `make(...)`'s generation, and
    answer with its SSE stream or its complete object."""
    t0 = time.perf_counter()
    raw = read_raw()
    headers = request.headers
    creq = parse_for_root(raw, lambda: parse_body(parse_json(raw), headers), root_model)
    creq.size = len(raw)
    creq.cache_scope = cache_scope(presented_key(), creq)
    registry = server().registry
    distributed.check_healthy()  # 503 while a multi-host model has lost a process
    entry = registry.acquire(creq.model, creq.session_id)
    try:
        gen = make(registry, entry, creq, request.environ, metrics=server().metrics, t0=t0,
                   watch=server().memwatch, settings=server().settings)
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
        resp = json_answer(gen.complete(), gen.large_answer)
        resp.headers[INSTANCE_HEADER] = entry.instance_id
        return resp
    except ClientGone:
        return Response(status=499)
    finally:
        gen.close()
