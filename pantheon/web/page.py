"""The pages a person opens in a browser: the chat playground at `/` and the live dashboard at
`/dashboard`, their scripts and style under `/ui/` (the files of pantheon/web/ui, package data).

* `/` is negotiated (`wants_page`): a request whose Accept header asks for `text/html` above JSON (what a
  browser sends on navigation) gets the chat page; every other client (curl's `*/*`, no Accept at all,
  `application/json`) gets the JSON status exactly as before (pantheon.web.routes.health). `/health`
  always answers JSON.
* Static files only, read from the package: no build step, no CDN, nothing fetched from elsewhere (the
  plots are SVG drawn by the page's own script). The pages carry no data: they read everything through
  the API with the key the person types into them (sent as a bearer), so they are open without a key
  (pantheon.web.security.is_page) and show nothing but their own code.
* Every page response carries a strict Content-Security-Policy: scripts only from this server's own
  files (no inline script, no eval), requests only to this server, no plugins, no framing, and Trusted
  Types required, so the browser itself refuses an HTML string put into the DOM. The scripts render
  every model-generated string as text (textContent), never as HTML.

None of these routes are API operations: the OpenAPI document (pantheon.web.openapi) leaves them out.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from flask import Blueprint, Response, request
from werkzeug.datastructures import MIMEAccept

from pantheon.errors import RequestError

bp = Blueprint("page", __name__)

UI_DIR = Path(__file__).resolve().parent / "ui"

# The only files served, by name: nothing else under the folder (or outside it) can be asked for.
ASSETS: dict[str, str] = {
    "chat.html": "text/html; charset=utf-8",
    "dashboard.html": "text/html; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
    "common.js": "text/javascript; charset=utf-8",
    "chat.js": "text/javascript; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "plot.js": "text/javascript; charset=utf-8",
}

CONTENT_SECURITY_POLICY = "; ".join((
    "default-src 'none'",
    "script-src 'self'",
    "style-src 'self'",
    "img-src 'self' data: blob:",  # attached images are shown from their data: URLs
    "connect-src 'self'",
    "base-uri 'none'",
    "form-action 'none'",
    "frame-ancestors 'none'",
    "require-trusted-types-for 'script'",  # innerHTML and the like refuse strings outright
    "trusted-types 'none'",
))
PAGE_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cache-Control": "no-cache",  # revalidated each time (ETag): an upgraded server serves its new pages
}


def wants_page(accept: MIMEAccept) -> bool:
    """True when the client asks for `text/html` by name, at a higher quality than JSON: a browser's
    navigation (`text/html,...,*/*;q=0.8`). `*/*`, an absent header, `application/json`, or text/html
    and JSON asked for equally all mean a program, which keeps the JSON answer."""
    html = max((q for value, q in accept if value.lower() == "text/html"), default=0)
    return html > 0 and html > accept.quality("application/json")


def asset(name: str) -> Response:
    """One file of the UI folder with the page headers; 404 for any name not in ASSETS."""
    mimetype = ASSETS.get(name)
    if mimetype is None:
        raise RequestError(f"no page file {name[:64]!r}", status=404, code="not_found")
    data = (UI_DIR / name).read_bytes()
    resp = Response(data, headers=PAGE_HEADERS, content_type=mimetype)
    resp.set_etag(hashlib.sha256(data).hexdigest()[:32])
    return resp.make_conditional(request)


def chat_page() -> Response:
    resp = asset("chat.html")
    resp.vary.add("Accept")  # `/` answers JSON or this page by the Accept header
    return resp


@bp.get("/dashboard")
def dashboard() -> Response:
    return asset("dashboard.html")


@bp.get("/ui/<path:name>")
def ui_file(name: str) -> Response:
    return asset(name)
