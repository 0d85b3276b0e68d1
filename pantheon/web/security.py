"""API keys, the admin gate, CORS and the request-body limit: checks that run before any route.

* `PANTHEON_API_KEY` set: every route but the health probes (`GET /`, `/health`, `/m/<model>/health`),
  the API's description (`GET /openapi.json`), the browser pages' static files (`/dashboard`, `/ui/...`;
  pantheon.web.page) and CORS preflights needs it, as
  `Authorization: Bearer KEY` or `X-Api-Key: KEY` (compared in constant time).
* `PANTHEON_REGISTRY_WORKER_KEY` set: it is accepted besides the API key on the model roots
  (`/m/<model>/...`), which are all a router calls; it is the key registered with the router for it to
  present (pantheon.serving.registration), so the router never needs the server's own key.
* `/admin/*` needs `PANTHEON_ADMIN_KEY` the same way (the API key does not open it); with no admin key
  configured the admin API is off (403), so a default install cannot be told to read files.
* CORS is off unless `PANTHEON_CORS_ORIGINS` lists origins (or `*`).
* Bodies larger than `PANTHEON_MAX_BODY_BYTES` are refused with 413 before they are read.
"""

from __future__ import annotations

import hmac
from pathlib import Path

from flask import Flask, Response, request

from pantheon.config import Settings
from pantheon.errors import RequestError
from pantheon.web.body import announced_length, check_transfer_coding, shown

CORS_HEADERS = "Authorization, Content-Type, X-Api-Key, X-Session-Id, X-SMG-Routing-Key, Anthropic-Version"
CORS_METHODS = "GET, POST, DELETE, OPTIONS"
NAME_MAX_BYTES = 255  # the longest file-name component Linux file systems take (NAME_MAX)


def presented_key() -> str | None:
    """The key the request presents (Bearer or X-Api-Key), whether or not the server wants one."""
    auth = request.headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return request.headers.get("X-Api-Key")


def _matches(presented: str | None, expected: str) -> bool:
    if presented is None:
        return False
    return hmac.compare_digest(presented.encode("utf-8", "surrogatepass"), expected.encode("utf-8"))


def is_probe(path: str) -> bool:
    """Health probes answer without a key: `/`, `/health` and a model root's `/m/<model>/health`
    (routers and load balancers probe them, and they tell nothing but ready or not)."""
    return path in ("/", "/health") or (path.startswith("/m/") and path.endswith("/health"))


def is_page(path: str, method: str) -> bool:
    """The browser pages and their files (pantheon.web.page: `/dashboard`, `/ui/...`; the chat page is
    `/`, a probe). They are static code and hold no data: the page asks the person for the key and
    sends it with each API call it makes, so the page itself must open without one."""
    return method in ("GET", "HEAD") and (path == "/dashboard" or path.startswith("/ui/"))


# Paths anyone may read: the API's description is the same for every server of this version (it
# tells only whether keys are required, as any 401 does); clients and tools fetch it before they
# have a key.
PUBLIC_PATHS = ("/openapi.json",)


def check_access(settings: Settings) -> None:
    """Raise 401/403 unless the request may use the route it targets."""
    if request.method == "OPTIONS" or is_probe(request.path) or request.path in PUBLIC_PATHS or \
            is_page(request.path, request.method):
        return
    key = presented_key()
    if request.path.startswith("/admin/") or request.path == "/admin":
        if not settings.admin_key:
            raise RequestError("the admin API is disabled (set PANTHEON_ADMIN_KEY to enable it)", status=403,
                               code="admin_disabled")
        if not _matches(key, settings.admin_key):
            raise RequestError("a valid admin key is required (Authorization: Bearer KEY or X-Api-Key)",
                               status=401, code="invalid_api_key")
        return
    if settings.api_key and not _matches(key, settings.api_key) and not _router_on_model_root(settings, key):
        raise RequestError("a valid API key is required (Authorization: Bearer KEY or X-Api-Key)", status=401,
                           code="invalid_api_key")


def _router_on_model_root(settings: Settings, key: str | None) -> bool:
    """The router's own key (PANTHEON_REGISTRY_WORKER_KEY) on a model root: it opens those only, so
    a router's key cannot reach the admin API or this server's other routes."""
    worker_key = settings.registry_worker_key
    return bool(worker_key) and request.path.startswith("/m/") and _matches(key, worker_key)


def allowed_origin(settings: Settings, origin: str | None) -> str | None:
    """The value for Access-Control-Allow-Origin, or None when CORS does not apply."""
    if not origin or not settings.cors_origins:
        return None
    if "*" in settings.cors_origins:
        return "*"
    return origin if origin in settings.cors_origins else None


def add_cors_headers(settings: Settings, resp: Response) -> Response:
    allowed = allowed_origin(settings, request.headers.get("Origin"))
    if allowed:
        resp.headers["Access-Control-Allow-Origin"] = allowed
        resp.headers["Vary"] = "Origin"
        if request.method == "OPTIONS":
            resp.headers["Access-Control-Allow-Methods"] = CORS_METHODS
            resp.headers["Access-Control-Allow-Headers"] = CORS_HEADERS
            resp.headers["Access-Control-Max-Age"] = "600"
    return resp


def model_path_in_dir(settings: Settings, raw: str, field: str = "path") -> Path:
    """Resolve an admin-supplied path inside PANTHEON_MODEL_DIR; anything outside it is refused (403).
    `field` is the body field that gave it (`path`, `draft_model`, `mmproj`): errors name it.

    Symlinks are resolved before the check, so a link out of the directory does not get out either.
    """
    if settings.model_dir is None:
        raise RequestError("loading by path is disabled (set PANTHEON_MODEL_DIR); use a catalog name",
                           param=field, status=403, code="path_not_allowed")
    if "\x00" in raw:
        raise RequestError(f"{field} contains a NUL byte", param=field)
    try:
        raw.encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError(f"{field} is not valid Unicode (a lone surrogate)", param=field) from None
    if any(len(part.encode("utf-8")) > NAME_MAX_BYTES for part in Path(raw).parts):
        raise RequestError(f"{field} has a component longer than {NAME_MAX_BYTES} bytes", param=field)
    root = settings.model_dir
    try:
        candidate = Path(raw).expanduser()
        if not candidate.is_absolute():
            candidate = root / candidate
        resolved = candidate.resolve()
    except (OSError, RuntimeError, ValueError) as exc:  # ~user that does not exist, a symlink loop, ...
        raise RequestError(f"{field} cannot be resolved ({type(exc).__name__})", param=field) from None
    if resolved != root and root not in resolved.parents:
        raise RequestError(f"{field} {shown(raw)!r} is outside the model directory", param=field, status=403,
                           code="path_not_allowed")
    return resolved


def init_app(app: Flask, settings: Settings) -> None:
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes

    @app.before_request
    def _gate() -> Response | None:
        if request.method == "OPTIONS":
            return Response("{}", status=200, mimetype="application/json")  # preflight: before any auth
        check_transfer_coding(request.environ)  # 501 before any auth: a body we would misread
        announced_length(request.environ, settings.max_body_bytes)  # 413 before any auth
        check_access(settings)
        return None

    @app.after_request
    def _cors(resp: Response) -> Response:
        return add_cors_headers(settings, resp)
