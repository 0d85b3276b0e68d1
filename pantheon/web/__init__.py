"""The HTTP server: a Flask app factory for gunicorn's gevent worker (`pantheon.web:create_app()`).

`create_app` does no JAX work itself: under gunicorn it runs in the worker after the fork, and it only
starts one OS thread that loads the configured models (PANTHEON_MODELS) into the registry. Until that
thread is done, `/` answers 503 `{"status": "loading"}`; chat requests get 503 until a model is ready.
That thread also builds the die manager (every JAX device with its memory budget, pantheon.serving.dies) and
starts the memory watch (pantheon.runtime.memory) that chat admission and the schedulers' pressure read.
If a configured model cannot be loaded, the worker exits with gunicorn's boot-error code so the whole
server stops with the error in its log instead of serving without the model.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from flask import Flask

from pantheon import osthread
from pantheon.config import Settings, load_settings
from pantheon.serving.registry import Registry, parse_spec

log = logging.getLogger(__name__)

WORKER_BOOT_ERROR = 3  # gunicorn's arbiter halts when a worker exits with this code


@dataclass
class ServerState:
    """Per-app state (in `app.extensions["pantheon"]`): settings, model table and startup status."""

    settings: Settings
    registry: Registry
    status: str = "loading"  # "loading" -> "ok" | "failed"; written once by the startup thread
    error: str | None = None
    startup: object | None = field(default=None, repr=False)  # the startup OSThread
    metrics: object | None = field(default=None, repr=False)  # pantheon.serving.metrics.Metrics
    dies: Any = field(default=None, repr=False)  # pantheon.serving.dies.DieManager, set by the startup thread
    memwatch: Any = field(default=None, repr=False)  # pantheon.runtime.memory.MemWatch, set by the startup thread
    # pantheon.serving.registration.Registration when PANTHEON_REGISTRY_URL is set, else None (no router traffic)
    registration: Any = field(default=None, repr=False)
    _throughput: Any = field(default=None, repr=False)  # pantheon.web.router_api's per-model token rates
    # pantheon.web.bridge.WorkPool of the structured-output grammar compiles (threads start on demand)
    grammars: Any = field(default=None, repr=False)
    # pantheon.web.bridge.WorkPool decoding and tiling admitted requests' images (threads start on demand)
    images: Any = field(default=None, repr=False)
    # pantheon.web.responses.ResponseStore: stored Responses-API answers (made on first use)
    responses: Any = field(default=None, repr=False)


def _configure_logging() -> None:
    root = logging.getLogger("pantheon")
    if not root.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s [%(process)d] [%(levelname)s] %(name)s: %(message)s"))
        root.addHandler(handler)
    root.setLevel(logging.INFO)


# Host used fractions that PANTHEON_TEST_PRESSURE=0..3 reports: inside OK, ELEVATED, HIGH, CRITICAL.
_FORCED_HOST_FRACTION = (0.50, 0.85, 0.93, 0.99)
_stop_registered = False  # atexit stops the process-wide watch; registered once per process


def _forced_host_reader(level: int) -> Any:
    """A MemWatch host reader that reports the host at pressure `level` (test-only)."""
    import psutil

    from pantheon.runtime.memory import PoolSample
    total = int(psutil.virtual_memory().total)
    used = int(total * _FORCED_HOST_FRACTION[level])
    return lambda: PoolSample("host", total, used, "given")


def _start_memwatch(state: ServerState) -> None:
    """Build the die manager and start the memory watch (after the fork: this may import JAX)."""
    global _stop_registered
    from pantheon.runtime import memory
    state.dies = state.registry.die_manager()
    level = state.settings.test_pressure
    if level is None:
        watch = memory.start_memwatch(state.dies)  # the process-wide watch (idempotent)
        if not _stop_registered:
            _stop_registered = True
            atexit.register(memory.stop_memwatch)
    else:  # test-only: a private watch that reports a fixed pressure level instead of measuring
        watch = memory.MemWatch(state.dies, host_reader=_forced_host_reader(level)).start()
        atexit.register(watch.stop)
        log.warning("PANTHEON_TEST_PRESSURE=%d: memory pressure is forced to %s (test-only setting)", level,
                    memory.LEVEL_NAMES[level])
    state.memwatch = watch
    state.registry.attach_memwatch(watch)


def _load_startup_models(state: ServerState, exit_on_failure: bool) -> None:
    """Startup thread: build the dies and the memory watch, load every configured model in order,
    then flip `/` to ok."""
    settings = state.settings
    try:
        from pantheon.serving import distributed
        cluster = distributed.spec_from_settings(settings)
        if cluster is not None:  # process 0 of a multi-host cluster: join before anything touches JAX
            distributed.start_leader(cluster)
        if settings.compile_cache:
            from pantheon.runtime import compile_guard
            compile_guard.enable_persistent_cache(settings.home)
        _start_memwatch(state)
        for text in settings.models:
            spec = parse_spec(text)
            log.info("loading %s", text)
            # In a cluster a model without a die list spans every process's dies.
            state.registry.load(spec.source, spec.name, spec.dies or distributed.all_dies(),
                                **({"mmproj": spec.mmproj} if spec.mmproj else {}))
            if state.registration is not None:
                state.registration.sync()  # each model is registered as soon as it is ready
        state.status = "ok"
        log.info("ready: %d model instance(s) loaded", state.registry.ready_count())
        from pantheon.serving.registration import local_base
        base = local_base()
        if base is not None:  # under gunicorn: where a person on this machine opens the pages
            log.info("chat page: %s/  dashboard: %s/dashboard", base, base)
    except BaseException as exc:  # noqa: BLE001 - any failure ends startup with a message
        state.error = f"{type(exc).__name__}: {exc}"
        state.status = "failed"
        log.critical("startup failed, not serving: %s", state.error)
        if exit_on_failure:
            logging.shutdown()
            os._exit(WORKER_BOOT_ERROR)


def served_models(registry: Registry) -> list[Any]:
    """The ready model names as the router should see them (pantheon.serving.registration.Served): a name's
    replicas are one worker whose capacity is their slots together."""
    from pantheon.serving.registration import Served
    slots: dict[str, int] = {}
    ctx: dict[str, int] = {}
    for e in registry.ready_entries():
        info = e.backend.load_info() or {}
        slots[e.name] = slots.get(e.name, 0) + int(info.get("slots") or 1)
        length = int(getattr(e.card, "context_length", 0) or registry.settings.max_seq)
        ctx[e.name] = min(ctx.get(e.name, length), length)
    return [Served(name=n, capacity=slots[n], context_length=ctx[n]) for n in slots]


def create_app(settings: Settings | None = None, registry: Registry | None = None,
               exit_on_failure: bool | None = None) -> Flask:
    """Build the app and start loading the configured models in the background.

    `exit_on_failure` (default: only inside a gunicorn worker) ends the process when a startup model
    fails to load. Tests may pass their own `settings` and a `registry` with fake models.
    """
    _configure_logging()
    settings = settings or load_settings()
    for text in settings.models:  # fail fast on a malformed spec, before anything loads
        try:
            parse_spec(text)
        except ValueError as exc:
            raise SystemExit(f"pantheon: bad PANTHEON_MODELS entry: {exc}") from None
    state = ServerState(settings=settings, registry=registry or Registry(settings))
    from pantheon.web import bridge
    state.grammars = bridge.WorkPool("pantheon-grammar", settings.grammar_threads, settings.grammar_queue,
                                     "too many structured-output grammars are compiling; retry shortly")
    state.images = bridge.WorkPool("pantheon-image", settings.image_threads, settings.image_queue,
                                   "too many requests' images are being decoded; retry shortly")
    app = Flask(__name__)
    app.json.sort_keys = False
    app.extensions["pantheon"] = state

    from pantheon.serving.metrics import Metrics
    metrics = state.metrics = Metrics()
    metrics.set_backend_source(state.registry.load_infos)
    # dies() imports JAX on its first call: only once the startup thread has loaded the models
    metrics.set_die_source(lambda: state.registry.dies() if state.status == "ok" else [])
    metrics.set_memory_source(lambda: state.memwatch.snapshot() if state.memwatch is not None else None)

    from pantheon.web import admin, errors, openapi, page, router_api, routes, security, tokens
    errors.init_app(app)
    security.init_app(app, settings)
    app.register_blueprint(routes.bp)
    app.register_blueprint(page.bp)
    app.register_blueprint(router_api.bp)
    app.register_blueprint(admin.bp)
    app.register_blueprint(tokens.bp)
    app.register_blueprint(openapi.bp)
    from pantheon.web import embeddings, messages, responses
    app.register_blueprint(embeddings.bp)
    app.register_blueprint(responses.bp)
    app.register_blueprint(messages.bp)
    if settings.registry_url:  # otherwise nothing here ever contacts a router
        from pantheon.serving.registration import Registration
        state.registration = Registration(settings, served=lambda: served_models(state.registry)).start()

    @app.after_request
    def _count_request(resp):  # also runs for error-handler responses and preflights
        from flask import request
        metrics.observe_request(request.url_rule.rule if request.url_rule is not None else None, resp.status_code)
        return resp

    if exit_on_failure is None:
        exit_on_failure = "gunicorn.arbiter" in sys.modules
    state.startup = osthread.start_thread(lambda: _load_startup_models(state, exit_on_failure),
                                          name="pantheon-startup")
    return app
