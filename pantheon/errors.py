"""Exception types shared across the engine, the scheduler and the web layer.

Each carries the HTTP status the web layer answers with, so a failure deep in the engine maps to one
well-defined response without the web layer guessing from message text.
"""

from __future__ import annotations

import traceback


class PantheonError(Exception):
    """Base class: `status` is the HTTP code, `code` the OpenAI-style error type."""

    status: int = 500
    code: str = "internal_error"


class ModelLoadError(PantheonError):
    """A model file could not be loaded: names the file and the problem. Nothing is left half-loaded.

    `in_file`: the problem is the file's content (not a GGUF, a header that lies, an unsupported
    architecture), so loading the same file again fails the same way; False for what the server
    or the request's other choices caused (an upload the device refused, a die that does not exist).
    An admin load answers the first with a 400 naming the body field that gave the file
    (pantheon.web.admin); a start-up load logs either as it is."""

    status = 500
    code = "model_load_error"

    def __init__(self, path: object, problem: str, in_file: bool = True):
        self.path = str(path)
        self.problem = problem
        self.in_file = in_file
        super().__init__(f"cannot load model {self.path}: {problem}")


class TemplateError(PantheonError):
    """The chat template failed to render for these messages (a 400-class error)."""

    status = 400
    code = "invalid_request_error"


class CatalogError(PantheonError):
    """Unknown catalog name, failed download or checksum mismatch."""

    status = 404
    code = "model_not_found"


class RequestError(PantheonError):
    """The client's request is invalid; `param` names the offending field."""

    status = 400
    code = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.status = status
        if code:
            self.code = code


class BusyError(PantheonError):
    """No capacity now (429 with Retry-After) or at all (503)."""

    code = "server_busy"

    def __init__(self, message: str, status: int = 429, retry_after: int | None = None):
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


class CompileForbiddenError(PantheonError):
    """A jit compile happened after warm-up while PANTHEON_FORBID_COMPILE=1."""

    status = 500
    code = "compile_forbidden"


class ModelFailed(PantheonError):
    """A model's driver stopped on an unexpected error: the requests it held fail with 500, later ones
    get 503 until the model is unloaded (and loaded again)."""

    code = "model_failed"

    def __init__(self, message: str, status: int = 503):
        super().__init__(message)
        self.status = status


def clear_exception_frames(exc: BaseException) -> None:
    """Clear the locals of every finished frame in `exc`'s traceback and in those of its causes.

    A traceback keeps each frame it passed through alive with all its locals; after a failed load
    those are the half-built parameters (hundreds of MB of host arrays), held for as long as anyone
    keeps the exception. The messages and types stay; only the frames' variables go.
    """
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        todo += [e.__cause__, e.__context__]
