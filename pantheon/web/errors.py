"""Every failure leaves the server as one OpenAI-style JSON error, built here and nowhere else (on the
Anthropic routes, the same error in Anthropic's shape: `anthropic_body`).

Shape: `{"error": {"message", "type", "param", "code"}}`. `type` follows the HTTP status (so a client
can branch on it without a table of our codes); `code` is the specific reason (`context_length_exceeded`,
`model_not_found`, `server_busy`, ...) and `param` names the offending request field when there is one.
"""

from __future__ import annotations

import logging
from typing import Any

from flask import Flask, Response, json, request
from werkzeug.exceptions import HTTPException

from pantheon.errors import BusyError, PantheonError

log = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    431: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    501: "invalid_request_error",  # a transfer coding the server does not implement: the request's to change
    503: "service_unavailable_error",
    507: "insufficient_storage_error",
}

_HTTP_CODES = {400: "bad_request", 404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


def error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> dict:
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# Anthropic's error types by status, for the Anthropic routes (/v1/messages, /v1/messages/count_tokens).
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                   503: "overloaded_error", 529: "overloaded_error"}
ANTHROPIC_PATHS = ("/v1/messages", "/v1/messages/count_tokens")


def anthropic_body(status: int, body: dict) -> dict:
    """An OpenAI-shaped error body in Anthropic's shape: {"type": "error", "error": {"type", "message"}}."""
    kind = ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": body["error"]["message"]}}


def is_anthropic_path(path: str) -> bool:
    """A path of Anthropic's API (also under a model root), whose errors are in Anthropic's shape."""
    return path.endswith(ANTHROPIC_PATHS)


def from_exception(exc: BaseException) -> tuple[int, dict, dict[str, str]]:
    """(status, body, extra headers) for any exception: ours carry their status, others are 500s."""
    if isinstance(exc, PantheonError):
        status = int(getattr(exc, "status", 500) or 500)
        headers = {}
        if isinstance(exc, BusyError) and exc.retry_after is not None:
            headers["Retry-After"] = str(int(exc.retry_after))
        return status, error_body(status, str(exc), exc.code, getattr(exc, "param", None)), headers
    if isinstance(exc, HTTPException):
        status = exc.code or 500
        return status, error_body(status, exc.description or exc.name, _HTTP_CODES.get(status)), {}
    return 500, error_body(500, f"internal error: {type(exc).__name__}", "internal_error"), {}


def init_app(app: Flask) -> None:
    """Register the JSON handlers: our errors, werkzeug's HTTP errors (404/405/413...), and the rest."""

    @app.errorhandler(PantheonError)
    def _ours(exc: PantheonError) -> Response:
        status, body, headers = from_exception(exc)
        if isinstance(exc, BusyError):
            from flask import current_app
            m = getattr(current_app.extensions.get("pantheon"), "metrics", None)
            if m is not None:
                m.observe_rejection(status)
        if status >= 500:
            log.error("request failed: %s", exc)
        return _json(status, body, headers)

    @app.errorhandler(HTTPException)
    def _http(exc: HTTPException) -> Response:
        status, body, headers = from_exception(exc)
        if status == 404:
            body["error"]["message"] = f"no route {request.method} {request.path}"
        elif status == 405:
            allowed = sorted(m for m in getattr(exc, "valid_methods", None) or () if m != "OPTIONS")
            headers["Allow"] = ", ".join(allowed)
            body["error"]["message"] = f"method {request.method} is not allowed on {request.path}" + \
                (f" (allowed: {', '.join(allowed)})" if allowed else "")
        elif status == 413:
            body["error"]["message"] = "the request body is larger than PANTHEON_MAX_BODY_BYTES allows"
        return _json(status, body, headers)

    @app.errorhandler(Exception)
    def _other(exc: Exception) -> Response:
        log.exception("unhandled error")
        status, body, headers = from_exception(exc)
        return _json(status, body, headers)


def _json(status: int, body: Any, headers: dict[str, str]) -> Response:
    if is_anthropic_path(request.path):
        body = anthropic_body(status, body)
    resp = Response(json.dumps(body), status=status, mimetype="application/json")
    for k, v in headers.items():
        resp.headers[k] = v
    return resp
