"""Admin routes: load and unload models at runtime, and show how the dies are used.

Loads and unloads block for seconds to minutes (weight upload, draining in-flight requests), so each
runs in its own OS thread via `bridge.call_in_thread`; the request greenlet waits cooperatively and
every other route keeps answering. Paths are confined to PANTHEON_MODEL_DIR (see `security`).

A file the client named that turns out not to be a loadable model (not a GGUF, a header that lies, a
projector that is none) is the client's mistake: a 400 naming the body field that gave it, with the
name as the client gave it. The server's absolute paths are never in an admin answer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flask import Blueprint, Response, jsonify

from pantheon.errors import CatalogError, ModelLoadError, RequestError
from pantheon.web import bridge
from pantheon.web.body import shown
from pantheon.contract import ADMIN_DIES_MAX, ADMIN_NAME_CHARS, LOAD, UNLOAD
from pantheon.web.fields import body_object, boolean, bounded
from pantheon.web.routes import read_json, server
from pantheon.web.schema import LOAD_REQUEST, UNLOAD_REQUEST, fields
from pantheon.web.security import model_path_in_dir

bp = Blueprint("admin", __name__, url_prefix="/admin")

LOAD_FIELDS = fields(LOAD_REQUEST)  # pantheon.web.schema describes the bodies; these validators hold to it
UNLOAD_FIELDS = fields(UNLOAD_REQUEST)
MAX_DIES = ADMIN_DIES_MAX


def _opt_str(body: dict, key: str) -> str | None:
    v = body.get(key)
    if v is not None and (not isinstance(v, str) or not v or len(v) > ADMIN_NAME_CHARS):
        raise RequestError(f"{key}: must be a non-empty string", param=key)
    return v


def _resolver(body: dict) -> tuple[str, Any, str | None]:
    """(source, resolve, field) for a load body: catalog names pull from the catalog (field None); paths
    stay in the model dir (field: the body field that named the file)."""
    from pantheon.formats.catalog import CATALOG, pull

    path, model = _opt_str(body, "path"), _opt_str(body, "model")
    if (path is None) == (model is None):
        raise RequestError("give exactly one of \"path\" (a file in the model directory) or \"model\" "
                           "(a catalog name)", param="path" if path else "model")
    settings = server().settings
    if model is not None and model in CATALOG:
        return model, lambda src: pull(src, progress=False), None
    raw = path if path is not None else model
    if model is not None and settings.model_dir is None:
        raise CatalogError(f"{shown(model)!r} is not a catalog model; the catalog has: {', '.join(sorted(CATALOG))}")
    target = model_path_in_dir(settings, raw)
    try:
        is_file = target.is_file()
    except (OSError, ValueError) as exc:  # a name the file system refuses (ENAMETOOLONG, ...): the client's
        raise RequestError(f"{'path' if path else 'model'}: not a usable file name ({exc.strerror or exc})"
                           if isinstance(exc, OSError) else f"{'path' if path else 'model'}: not a usable file name",
                           param="path" if path else "model") from None
    if not is_file:
        raise RequestError(f"no model file {shown(raw)!r} in the model directory", param="path" if path else "model",
                           status=404, code="model_not_found")
    return str(target), lambda src: Path(src), "path" if path is not None else "model"


def _not_loadable(exc: ModelLoadError, named: dict[str, tuple[str, str]]) -> Exception:
    """What the client is told when a load failed on a file: `named` maps each body field that gave a
    file in the model directory to (the name as the client gave it, the absolute path it resolved to).

    A failure of that file's content is a 400 naming the field (`invalid_model_file`); any other
    failure on it (the device refused the upload) stays a 500 `model_load_error`. Either way the
    message shows the client's name, and no absolute path of the server; a failure on a file the
    client did not name (a catalog download) is left as it is."""
    try:
        failed = Path(exc.path).resolve()
    except (OSError, RuntimeError, ValueError):
        return exc
    field = next((f for f, (_, where) in named.items() if Path(where) == failed), None)
    if field is None:
        return exc
    given = shown(named[field][0])
    problem = exc.problem
    for name, where in named.values():  # an OSError's text may carry a path: the client's names instead
        problem = problem.replace(where, shown(name))
    root = server().settings.model_dir
    if root is not None:
        problem = problem.replace(str(root), "<model directory>")
    if not exc.in_file:
        return ModelLoadError(given, problem, in_file=False)
    return RequestError(f"{field} {given!r} is not a loadable model file: {problem}", param=field,
                        code="invalid_model_file")


def _then_register(registration: Any, fn: Any, *args: Any) -> Any:
    """Run a load or unload (in its OS thread), then bring the router's table in line with it: a
    loaded name is registered, a name with no replica left is deleted (when registration is on).
    The registration's keep-alive thread talks to the router; this waits for it at most
    PANTHEON_REGISTRY_TIMEOUT_S, so a stuck router cannot hold the admin reply longer than that."""
    try:
        return fn(*args)
    finally:
        if registration is not None:
            registration.sync()


def _file_in_dir(name: str, param: str, what: str) -> str:
    """The absolute path of file `name` inside PANTHEON_MODEL_DIR (like a load's "path"); a 400 or 404
    naming `param` (the body field that gave it) when it is outside the directory or no such file."""
    target = model_path_in_dir(server().settings, name, field=param)
    try:
        is_file = target.is_file()
    except (OSError, ValueError):
        is_file = False
    if not is_file:
        raise RequestError(f"no {what} file {shown(name)!r} in the model directory", param=param,
                           status=404, code="model_not_found")
    return str(target)


def _in_catalog(name: str) -> bool:
    from pantheon.formats.catalog import CATALOG
    return name in CATALOG


def _draft_file(draft: str) -> str:
    """The file an admin load's `draft_model` names: a catalog model (pulled when the load runs), else a
    file inside PANTHEON_MODEL_DIR (as an absolute path)."""
    return draft if _in_catalog(draft) else _file_in_dir(draft, "draft_model", "draft model")


@bp.post("/models/load")
def load() -> Response:
    body = body_object(read_json(), LOAD_FIELDS)
    # The whole body is checked before the file system or the catalog is asked anything.
    name = _opt_str(body, "name")
    dies = body.get("dies")
    if dies is not None:
        if not isinstance(dies, list) or len(dies) > MAX_DIES or \
                not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dies):
            raise RequestError("dies: must be a list of die numbers (non-negative integers)", param="dies")
    mmproj = _opt_str(body, "mmproj")
    # this model's speculative decoding (defaults: PANTHEON_SPECULATIVE, PANTHEON_SPEC_K)
    overrides = {k: v for k, v in (("speculative", boolean(body, "speculative")),
                                   ("spec_k", bounded(body, "spec_k", LOAD))) if v is not None}
    draft = _opt_str(body, "draft_model")
    source, resolve, field = _resolver(body)
    named = {}  # body field -> (the client's name, the file it is) for each file from the model directory
    if field is not None:
        named[field] = (body[field], source)
    if draft is not None:  # a catalog name, else (like "path") a file inside the model directory
        overrides["draft_model"] = _draft_file(draft)
        if not _in_catalog(draft):
            named["draft_model"] = (draft, overrides["draft_model"])
    if mmproj is not None:  # like "path": a file inside the model directory
        named["mmproj"] = (mmproj, _file_in_dir(mmproj, "mmproj", "projector"))
        mmproj = named["mmproj"][1]
    registry = server().registry
    load_fn = registry.load if mmproj is None and not overrides else (
        lambda *a: registry.load(*a, mmproj=mmproj, overrides=overrides))  # noqa: E731
    try:
        info = bridge.call_in_thread(_then_register, server().registration, load_fn, source, name, dies, resolve,
                                     name="pantheon-admin-load")
    except ModelLoadError as exc:
        raise _not_loadable(exc, named) from None
    return jsonify(status="loaded", **info)


@bp.post("/models/unload")
def unload() -> Response:
    body = body_object(read_json(), UNLOAD_FIELDS)
    name, instance_id = _opt_str(body, "name"), _opt_str(body, "instance_id")
    if (name is None) == (instance_id is None):
        raise RequestError("give exactly one of \"name\" (every replica of that model) or \"instance_id\"",
                           param="name")
    timeout = bounded(body, "timeout_s", UNLOAD)  # seconds
    registry = server().registry
    done = bridge.call_in_thread(_then_register, server().registration, registry.unload, name, instance_id, timeout,
                                 name="pantheon-admin-unload")
    return jsonify(status="unloaded", unloaded=done)


@bp.get("/dies")
def dies() -> Response:
    st = server()
    table = bridge.call_in_thread(st.registry.dies, name="pantheon-admin-dies")  # may build the die manager
    watch = st.memwatch
    snap = watch.snapshot() if watch is not None else None
    return jsonify(object="list", data=table, memory=snap.as_dict() if snap is not None else None)
