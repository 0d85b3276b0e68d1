"""`GET /openapi.json`: the OpenAPI 3.1 document of every route, built from pantheon.web.schema.

Why generated: the bodies' schemas are the ones the validators read their fields from
(pantheon.web.schema), so the document cannot describe a field the server refuses or miss one it
takes. This module only adds what is per route: method and path, which body, which answers, and who
may call it. `OPERATIONS` lists every route the app serves (a test holds it equal to Flask's URL map),
and the fuzz test (tests/test_openapi.py) drives every operation from the published document.

The document depends on the settings only in its security: with `PANTHEON_API_KEY` set every route
but the health probes and this one needs the key (`bearer` or `X-Api-Key`); `/admin/*` needs
`PANTHEON_ADMIN_KEY`, and without one every admin call answers 403.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flask import Blueprint, Response, current_app, jsonify

from pantheon import __version__
from pantheon.config import Settings
from pantheon.web.schema import COMPONENTS

bp = Blueprint("openapi", __name__)

OPEN, API, ADMIN = "open", "api", "admin"  # who may call an operation

# What each error status means, for every operation that can answer it.
ERROR_MEANING = {
    400: "invalid request: malformed JSON, a bad or unknown field (error.param names it), prompt too long",
    401: "missing or wrong API key (admin routes: admin key)",
    403: "admin API disabled, or an admin path outside PANTHEON_MODEL_DIR",
    404: "unknown model (model_not_found), or no such file for an admin load",
    408: "the body did not arrive in time",
    409: "the model is being loaded or unloaded, or an unload timed out",
    413: "the body is larger than PANTHEON_MAX_BODY_BYTES",
    415: "the body's Content-Type is not JSON",
    429: "the model is busy or its queue is full (Retry-After says when to retry)",
    500: "a failed generation or model load",
    503: "still starting, no model loaded, model loading or unloading, or memory short (Retry-After)",
    507: "the model table is full or the model does not fit the dies' free memory",
}
BODY_ERRORS = (400, 408, 413, 415)
MODEL_ERRORS = (404, 429, 500, 503)


@dataclass(frozen=True)
class Operation:
    """One route: `body` and `answer` name components of pantheon.web.schema (None: no JSON)."""

    method: str
    path: str  # OpenAPI form: {name} for a path parameter
    summary: str
    answer: str | None = None  # the 200 JSON body's component
    body: str | None = None  # the request body's component
    errors: tuple[int, ...] = ()
    access: str = API
    stream: bool = False  # stream: true answers text/event-stream
    media: str = "application/json"  # the 200 answer's media type when it is not JSON
    error: str = "Error"  # the errors' component: Anthropic's routes answer in Anthropic's shape


OPERATIONS: tuple[Operation, ...] = (
    Operation("get", "/", "Health: 200 once every configured model is loaded, else 503", "Health", access=OPEN,
              errors=(503,)),
    Operation("get", "/health", "Health, as GET / (the path routers probe)", "Health", access=OPEN, errors=(503,)),
    Operation("get", "/openapi.json", "This document", access=OPEN),
    Operation("get", "/metrics", "Prometheus metrics", media="text/plain"),
    Operation("get", "/v1/models", "Resident models, one item per name", "ModelList"),
    Operation("get", "/v1/models/{model_id}", "One resident model", "Model", errors=(404,)),
    Operation("get", "/v1/loads", "Live load in SMG's scheduler-load shape", "Loads"),
    Operation("post", "/v1/chat/completions", "Chat completion, streamed (SSE) or not", "ChatCompletion",
              "ChatCompletionRequest", BODY_ERRORS + MODEL_ERRORS + (507,), stream=True),
    Operation("post", "/v1/completions", "Text completion of a raw prompt (the legacy API)", "Completion",
              "CompletionRequest", BODY_ERRORS + MODEL_ERRORS, stream=True),
    Operation("post", "/v1/embeddings", "Embedding vectors of texts or token ids", "EmbeddingList", "EmbeddingRequest",
              BODY_ERRORS + MODEL_ERRORS),
    Operation("post", "/tokenize", "Token ids of a text (llama.cpp's shape)", "TokenizeResponse", "TokenizeRequest",
              BODY_ERRORS + (404, 503)),
    Operation("post", "/detokenize", "The text of token ids (llama.cpp's shape)", "DetokenizeResponse",
              "DetokenizeRequest", BODY_ERRORS + (404, 503)),
    Operation("get", "/m/{model}/health", "Health of one model: 200 ready, 503 loading or failed, 404 not served",
              "Health", access=OPEN, errors=(404, 503)),
    Operation("get", "/m/{model}/v1/models", "The model list, for this model only", "ModelList"),
    Operation("get", "/m/{model}/v1/loads", "Live load, for this model only", "Loads", errors=(404,)),
    Operation("post", "/m/{model}/v1/chat/completions", "Chat completion on this model only", "ChatCompletion",
              "ChatCompletionRequest", BODY_ERRORS + MODEL_ERRORS + (507,), stream=True),
    Operation("post", "/m/{model}/v1/completions", "Text completion on this model only", "Completion",
              "CompletionRequest", BODY_ERRORS + MODEL_ERRORS, stream=True),
    Operation("post", "/m/{model}/v1/embeddings", "Embeddings on this model only", "EmbeddingList",
              "EmbeddingRequest", BODY_ERRORS + MODEL_ERRORS),
    Operation("post", "/v1/responses", "OpenAI Responses API: a response, streamed (typed SSE events) or not; "
              "stored for previous_response_id unless store is false", "Response", "ResponseRequest",
              BODY_ERRORS + MODEL_ERRORS + (507,), stream=True),
    Operation("get", "/v1/responses/{response_id}", "A stored response (only with the API key that made it)",
              "Response", errors=(404,)),
    Operation("delete", "/v1/responses/{response_id}", "Delete a stored response (only with the API key that made "
              "it)", "ResponseDeleted", errors=(404,)),
    Operation("post", "/v1/messages", "Anthropic Messages API: a message, streamed (Anthropic's SSE events) or not",
              "Message", "MessagesRequest", BODY_ERRORS + MODEL_ERRORS + (507,), stream=True, error="AnthropicError"),
    Operation("post", "/v1/messages/count_tokens", "The prompt tokens a Messages request would take",
              "TokenCount", "CountTokensRequest", BODY_ERRORS + (404, 503), error="AnthropicError"),
    Operation("post", "/m/{model}/v1/responses", "Responses API on this model only", "Response", "ResponseRequest",
              BODY_ERRORS + MODEL_ERRORS + (507,), stream=True),
    Operation("post", "/m/{model}/v1/messages", "Messages API on this model only", "Message", "MessagesRequest",
              BODY_ERRORS + MODEL_ERRORS + (507,), stream=True, error="AnthropicError"),
    Operation("post", "/m/{model}/v1/messages/count_tokens", "count_tokens on this model only", "TokenCount",
              "CountTokensRequest", BODY_ERRORS + (404, 503), error="AnthropicError"),
    Operation("post", "/admin/models/load", "Load a model (blocks until it is ready)", "Loaded", "LoadRequest",
              BODY_ERRORS + (401, 403, 404, 409, 500, 507), access=ADMIN),
    Operation("post", "/admin/models/unload", "Unload a model or one instance (waits for its requests)", "Unloaded",
              "UnloadRequest", BODY_ERRORS + (401, 403, 404, 409), access=ADMIN),
    Operation("get", "/admin/dies", "Each device: memory budget, bytes used, resident models", "Dies",
              errors=(401, 403), access=ADMIN),
)


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _responses(op: Operation, key_required: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if op.answer is not None:
        content: dict[str, Any] = {"application/json": {"schema": _ref(op.answer)}}
    elif op.media == "application/json":
        content = {"application/json": {"schema": {"type": "object"}}}
    else:
        content = {op.media: {"schema": {"type": "string"}}}
    if op.stream:
        content["text/event-stream"] = {"schema": {"type": "string", "description": (
            "with stream: true, server-sent events: `data: <chunk JSON>` frames, an error object in-band if "
            "the generation fails after the answer started, then `data: [DONE]`")}}
    out["200"] = {"description": "OK", "content": content}
    errors = set(op.errors)
    if key_required and op.access != OPEN:
        errors.add(401)
    if op.access == ADMIN:
        errors |= {401, 403}
    for status in sorted(errors):
        if status == 503 and op.answer == "Health":  # a health probe's 503 is its own body
            out["503"] = {"description": "loading, failed, or not ready", "content": content}
            continue
        if op.error != "Error":
            out[str(status)] = {"description": ERROR_MEANING.get(status, "an error"),
                                "content": {"application/json": {"schema": _ref(op.error)}}}
            continue
        out[str(status)] = {"$ref": f"#/components/responses/Error{status}"}
    if op.error != "Error":
        out["default"] = {"description": "an error", "content": {"application/json": {"schema": _ref(op.error)}}}
        return out
    out["default"] = {"$ref": "#/components/responses/Error"}
    return out


def _parameters(path: str) -> list[dict]:
    names = [part[1:-1] for part in path.split("/") if part.startswith("{")]
    return [{"name": n, "in": "path", "required": True, "schema": {"type": "string", "minLength": 1},
             "description": "a model name" if n in ("model", "model_id") else n.replace("_", " ")} for n in names]


def _security(op: Operation, settings: Settings) -> list | None:
    """The operation's `security` (None: the document's default applies)."""
    if op.access == OPEN:
        return [] if settings.api_key else None
    if op.access == ADMIN:
        return [{"adminKey": []}, {"adminKeyHeader": []}] if settings.admin_key else []
    return None


def _operation(op: Operation, settings: Settings) -> dict[str, Any]:
    out: dict[str, Any] = {"operationId": op.method + op.path.replace("/", "_").replace("{", "").replace("}", "")
                           .replace(".", "_"), "summary": op.summary}
    if op.access == ADMIN and not settings.admin_key:
        out["description"] = "The admin API is off (PANTHEON_ADMIN_KEY is not set): every call answers 403."
    params = _parameters(op.path)
    if params:
        out["parameters"] = params
    if op.body is not None:
        out["requestBody"] = {"required": True, "content": {"application/json": {"schema": _ref(op.body)}}}
    out["responses"] = _responses(op, bool(settings.api_key))
    security = _security(op, settings)
    if security is not None:
        out["security"] = security
    return out


def _security_schemes(settings: Settings) -> dict[str, Any]:
    schemes: dict[str, Any] = {}
    if settings.api_key:
        schemes["apiKey"] = {"type": "http", "scheme": "bearer", "description": "PANTHEON_API_KEY"}
        schemes["apiKeyHeader"] = {"type": "apiKey", "in": "header", "name": "X-Api-Key",
                                   "description": "PANTHEON_API_KEY, as a header"}
    if settings.admin_key:
        schemes["adminKey"] = {"type": "http", "scheme": "bearer", "description": "PANTHEON_ADMIN_KEY"}
        schemes["adminKeyHeader"] = {"type": "apiKey", "in": "header", "name": "X-Api-Key",
                                     "description": "PANTHEON_ADMIN_KEY, as a header"}
    return schemes


def document(settings: Settings) -> dict[str, Any]:
    """The OpenAPI 3.1 document for a server with these settings."""
    from pantheon.web.errors import ERROR_TYPES
    paths: dict[str, dict[str, Any]] = {}
    for op in OPERATIONS:
        paths.setdefault(op.path, {})[op.method] = _operation(op, settings)
    error = {"application/json": {"schema": _ref("Error")}}
    responses: dict[str, Any] = {"Error": {"description": "an error (see Error)", "content": error}}
    for status, meaning in ERROR_MEANING.items():
        responses[f"Error{status}"] = {"description": f"{meaning} (error.type: {ERROR_TYPES[status]})",
                                       "content": error}
    components: dict[str, Any] = {"schemas": COMPONENTS, "responses": responses}
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "Pantheon", "version": __version__,
                 "description": "OpenAI-compatible LLM inference server. Every error is "
                                "{\"error\": {\"message\", \"type\", \"param\", \"code\"}}; fields set to null count "
                                "as absent; any field not listed is refused with 400. Every path also answers "
                                "OPTIONS (CORS preflight)."},
        "paths": paths,
        "components": components,
    }
    schemes = _security_schemes(settings)
    if schemes:
        components["securitySchemes"] = schemes
    if settings.api_key:
        doc["security"] = [{"apiKey": []}, {"apiKeyHeader": []}]
    return doc


@bp.get("/openapi.json")
def openapi_json() -> Response:
    return jsonify(document(current_app.extensions["pantheon"].settings))
