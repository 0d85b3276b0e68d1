"""Reading a request body: type, size, time and shape are bounded before any route sees the JSON.

Why here and not in Flask's `request.get_data()`: a body is the one part of a request whose arrival
the client controls, and the stock readers wait for it forever (a client that sends 10 of its 126
bytes held a greenlet and a connection for as long as it liked), silently cut a chunked body at
the size limit (then answered "malformed JSON"), and let gunicorn's chunk-parser errors escape as
500s. `read_body` reads `wsgi.input` itself:

* `Content-Type` must be JSON (`application/json` or `*/*+json`), else 415: a web page cannot post to
  a keyless local server with a "simple" CORS request (text/plain, forms), which skips the preflight.
* At most `PANTHEON_MAX_BODY_BYTES`, announced (`Content-Length`) or counted while reading a chunked
  body: 413 either way.
* The whole body within `PANTHEON_BODY_TIMEOUT_S`, and never slower than
  `PANTHEON_BODY_MIN_RATE` bytes/s after the first `BODY_GRACE_S` seconds: else 408.
* A malformed chunked encoding is a 400; a transfer coding other than plain `chunked` (`gzip, chunked`)
  is a 501 (`check_transfer_coding`, run before authentication).

When reading fails the connection is shut for reading, so gunicorn does not wait to drain the rest
of the body before closing it (the client gets its error at once).

`parse_json` then decodes strict UTF-8 (a raw surrogate such as b"\\xed\\xa0\\x80" is refused, where
`json.loads` on bytes would let it through), parses, and walks the value once without recursion:
strings with a lone surrogate ("\\ud800") and nesting deeper than `MAX_JSON_DEPTH` are 400s here, so
no later stage (tokenizer, chat template, validators) can be handed one and raise.
"""

from __future__ import annotations

import json
import socket
import time
from typing import Any

from pantheon.errors import RequestError
from pantheon.web.connections import APP, BODY, set_phase

READ_STEP = 16384  # bytes asked of the socket per read; also the granularity of the rate check
BODY_GRACE_S = 5.0  # the minimum rate applies only after this long (a slow start is not an attack)
MAX_JSON_DEPTH = 64  # arrays/objects inside each other: deeper is refused (schemas rarely pass 20)
MAX_NAME_CHARS = 64  # a client-supplied name (field, path) is echoed back at most this long


def shown(name: str) -> str:
    """A client-chosen name as it may appear in an error: short, so a 1 MB field name is no 2 MB answer."""
    return name if len(name) <= MAX_NAME_CHARS else name[:MAX_NAME_CHARS] + f"... ({len(name)} characters)"


def _is_json_type(ctype: str | None) -> bool:
    mime = (ctype or "").split(";", 1)[0].strip().lower()
    return mime == "application/json" or (mime.startswith("application/") and mime.endswith("+json"))


def _shut_reading(environ: dict) -> None:
    """Stop reading this connection: gunicorn then closes it after the answer instead of draining."""
    sock = environ.get("gunicorn.socket")
    if sock is None:
        return
    try:
        sock.shutdown(socket.SHUT_RD)
    except OSError:
        pass


def _body_failed(environ: dict, message: str, status: int, code: str) -> RequestError:
    _shut_reading(environ)
    return RequestError(message, status=status, code=code)


def check_transfer_coding(environ: dict) -> None:
    """Refuse (501) a request whose `Transfer-Encoding` is anything but plain `chunked`.

    gunicorn takes `Transfer-Encoding: gzip, chunked` (it removes the chunking and closes the connection
    afterwards), but nothing here undoes the gzip: the compressed bytes would be read as the JSON body.
    RFC 9112 lets a server answer a coding it does not implement with 501, which is what gunicorn
    itself answers for the codings it does not know. Checked before authentication, with the size.
    """
    raw = environ.get("HTTP_TRANSFER_ENCODING")
    if raw is None:
        return
    codings = [c.strip(" \t").lower() for c in raw.split(",")]
    if codings != ["chunked"]:
        raise _body_failed(environ, f"Transfer-Encoding {shown(raw)!r} is not supported: send the body as it is "
                           "(Content-Length) or chunked, with no other transfer coding", 501,
                           "unsupported_transfer_coding")


def announced_length(environ: dict, max_bytes: int) -> int | None:
    """The body's Content-Length (None when chunked or absent); 413 when it is over `max_bytes`.

    Checked before authentication too (security's gate), so an oversized body is refused unread."""
    raw_len = environ.get("CONTENT_LENGTH") or ""
    if not raw_len.strip():
        return None
    try:
        length = int(raw_len)
    except ValueError:
        raise _body_failed(environ, "Content-Length is not a number", 400, "invalid_request_error") from None
    if length > max_bytes:
        raise _body_failed(environ, f"request body of {length} bytes exceeds the limit of {max_bytes}", 413,
                           "request_too_large")
    return length


def read_body(environ: dict, max_bytes: int, timeout_s: float, min_rate: float) -> bytes:
    """The request body, bounded in type, size and time (see the module docstring for the statuses)."""
    if not _is_json_type(environ.get("CONTENT_TYPE")):
        got = environ.get("CONTENT_TYPE") or "none"
        raise RequestError(f"Content-Type must be application/json (got {shown(got)})", status=415,
                           code="unsupported_media_type")
    length = announced_length(environ, max_bytes)
    stream = environ["wsgi.input"]
    want = max_bytes + 1 if length is None else length  # chunked: one byte past the limit proves it is over
    set_phase(environ, BODY)  # the client owes us bytes: evictable by the worker's connection cap
    try:
        raw = _read_all(environ, stream, want, length, max_bytes, timeout_s, min_rate)
    finally:
        set_phase(environ, APP)
    return raw


def _read_all(environ: dict, stream: Any, want: int, length: int | None, max_bytes: int, timeout_s: float,
              min_rate: float) -> bytes:
    parts: list[bytes] = []
    got = 0
    start = time.monotonic()
    timer = _Deadline(timeout_s, min_rate, start)
    while got < want:
        step = min(READ_STEP, want - got)
        try:
            with timer.for_read(got + step):
                data = stream.read(step)
        except _ReadTimeout:
            raise _body_failed(environ, f"the request body did not arrive in time (after "
                               f"{time.monotonic() - start:.1f} s; limits: {timeout_s:g} s in all, at least "
                               f"{min_rate:g} bytes/s after the first {BODY_GRACE_S:g} s)", 408,
                               "request_timeout") from None
        except Exception as exc:  # noqa: BLE001 - gunicorn's chunk-parser errors, a body cut short...
            detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            raise _body_failed(environ, f"malformed request body ({shown(detail)})", 400,
                               "invalid_request_error") from None
        if not data:
            break
        parts.append(data)
        got += len(data)
    if length is None and got > max_bytes:
        raise _body_failed(environ, f"request body exceeds the limit of {max_bytes} bytes", 413, "request_too_large")
    if length is not None and got < length:
        raise _body_failed(environ, f"the request body ended after {got} of {length} bytes", 400,
                           "invalid_request_error")
    return b"".join(parts)


class _ReadTimeout(Exception):
    """A read did not finish by the body's deadline."""


class _Deadline:
    """When the bytes read so far must have arrived: the whole-body timeout, or the minimum rate.

    Under gevent each read runs under a `gevent.Timeout` to that moment; without gevent (Flask's test
    client, whose input is in memory) reads never wait, so no timer is needed.
    """

    def __init__(self, timeout_s: float, min_rate: float, start: float):
        self.timeout_s = timeout_s
        self.min_rate = min_rate
        self.start = start
        from pantheon.web.bridge import gevent_active
        self.gevent = gevent_active()

    def due(self, total_bytes: int) -> float:
        """Monotonic time by which `total_bytes` must have been read."""
        end = self.start + self.timeout_s
        if self.min_rate > 0:
            end = min(end, self.start + BODY_GRACE_S + total_bytes / self.min_rate)
        return end

    def for_read(self, total_bytes: int) -> Any:
        import contextlib
        if not self.gevent:
            return contextlib.nullcontext()
        import gevent
        return gevent.Timeout(max(0.001, self.due(total_bytes) - time.monotonic()), _ReadTimeout)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_json(raw: bytes) -> Any:
    """Strict JSON of a body: valid UTF-8, no lone surrogates, at most MAX_JSON_DEPTH deep; else 400."""
    if not raw:
        raise RequestError("the request body is empty; send a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestError(f"malformed JSON: the body is not valid UTF-8 (byte {exc.start})") from None
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise RequestError(f"malformed JSON: nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as exc:
        raise RequestError(f"malformed JSON: {exc}") from None
    check_json_value(value)
    return value


def _has_surrogate(s: str) -> bool:
    if s.isascii():
        return False
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def check_json_value(value: Any) -> None:
    """Refuse (400) lone surrogates anywhere (keys too) and nesting deeper than MAX_JSON_DEPTH.

    Iterative, so the check itself cannot hit the recursion limit whatever it is given.
    """
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, str):
            if _has_surrogate(v):
                raise RequestError("malformed JSON: a string holds a lone UTF-16 surrogate (not valid Unicode)")
        elif isinstance(v, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise RequestError(f"malformed JSON: nested deeper than {MAX_JSON_DEPTH} levels")
            if isinstance(v, dict):
                for k, item in v.items():
                    if _has_surrogate(k):
                        raise RequestError("malformed JSON: a key holds a lone UTF-16 surrogate "
                                           "(not valid Unicode)")
                    stack.append((item, depth + 1))
            else:
                stack.extend((item, depth + 1) for item in v)
