"""Shared fixtures: oracle fixture paths, real models pulled once per session, tiny models."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

# The oracle and logit-parity tests compare with f32 references at tight tolerances, so the suite runs
# the native kernels' exact form (pantheon.ops.native: dot="exact"); the int8 form's tests ask for it
# by name (LoadOptions.native_dot="int8", weight_matmul(dot="int8")), whatever the serving default or
# the caller's environment says. Set before any Settings is read, and inherited by the servers the
# tests start.
os.environ["PANTHEON_NATIVE_DOT"] = "exact"
# Programs are compiled, not read from $PANTHEON_HOME/executables, in every test but the store's own
# (tests/test_exec_store.py passes a store directory explicitly and reads it back in child processes,
# one model each, as a server's start does): a test's outcome never depends on what an earlier test,
# or an earlier run, left in the store, and the compile counts the tests assert are this run's own.
os.environ["PANTHEON_EXEC_STORE"] = "0"

def _find_fixtures() -> Path:
    """$PANTHEON_FIXTURES when set (another copy, e.g. while fixtures are being rebuilt), else the copy in
    the repository (tests/fixtures, see its PROVENANCE.md): the suite reads nothing outside the checkout."""
    from pantheon.config import load_settings
    configured = load_settings().fixtures
    return configured if configured is not None else Path(__file__).resolve().parent / "fixtures"


FIXTURES = _find_fixtures()
TINY = FIXTURES / "tiny"
REAL = FIXTURES / "real"


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(config, items):
    """A test that loads a catalog model (`load_real`: its weights, its compiles) is `real`, marked or not.
    Reading only a catalog model's tokenizer or metadata (`real_model_path`) is not: it costs a download
    into PANTHEON_HOME once, then milliseconds."""
    for item in items:
        if "load_real" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.real)


def pytest_configure(config):
    """The test process counts compiles and keeps no JAX persistent cache (for the reason above). JAX's
    own switch is turned off, so an app started in this process (its start-up sets the cache's
    directory) cannot turn the cache on. The servers the tests start keep it (PANTHEON_COMPILE_CACHE's
    default)."""
    import jax

    from pantheon.runtime import compile_guard

    jax.config.update("jax_enable_compilation_cache", False)
    compile_guard.install()


def tiny_fixture(name: str) -> tuple[Path, dict, np.ndarray]:
    """(gguf path, json, oracle logits [24, 512]) of a tiny random-weight fixture."""
    j = json.loads((TINY / f"{name}.json").read_text())
    return TINY / j["gguf_file"], j, np.load(TINY / j["logits_file"])


_tiny_models: dict[str, object] = {}


def tiny_model(name: str):
    """A tiny fixture model loaded once per session with small caches (2 slots, 64 positions)."""
    from pantheon.runtime import engine

    if name not in _tiny_models:
        path, _, _ = tiny_fixture(name)
        _tiny_models[name] = engine.load(path, engine.LoadOptions(n_slots=2, max_seq=64, prefill_chunk=16,
                                                                          kv_dtype="float32", native_dot="exact"))
    return _tiny_models[name]


def real_fixture(name: str) -> dict:
    return json.loads((REAL / f"{name}.json").read_text())


def centered(x: np.ndarray) -> np.ndarray:
    """Per-row centering removes a constant logit shift, which softmax ignores."""
    return x - x.max(axis=-1, keepdims=True)


@pytest.fixture(scope="session")
def real_model_path():
    """real_model_path(name) -> Path of a catalog model, downloaded once into PANTHEON_HOME."""
    from pantheon.formats import catalog

    def get(name: str) -> Path:
        return catalog.pull(name, progress=False)

    return get


_loaded: dict[str, object] = {}


@pytest.fixture(scope="session")
def load_real(real_model_path):
    """load_real(name) -> a Model loaded once per test session (shared by every test that asks)."""
    from pantheon.runtime import engine

    def get(name: str, kv_dtype: str | None = None, dot: str = "exact"):
        """kv_dtype None: the default KV cache (float16 on CPU), 8 slots; "float32": a one-slot instance
        for parity with an f32 oracle (its weights are the same file pages as the default's).
        dot: the native kernels' form ("exact", the oracle's; "int8", llama.cpp's arithmetic)."""
        key = (name, kv_dtype, dot)
        if key not in _loaded:
            slots = 8 if kv_dtype is None else 1
            _loaded[key] = engine.load(real_model_path(name), engine.LoadOptions(name=name, max_seq=1024, n_slots=slots,
                                                                                 kv_dtype=kv_dtype, native_dot=dot))
        return _loaded[key]

    return get


_shared_servers: dict[tuple, object] = {}  # key -> a Server, or the exception its start raised (not retried)


def _server_key(models, env=None, via_cli: bool = False, timeout: float = 0.0) -> tuple:
    return tuple(models), tuple(sorted((env or {}).items())), via_cli


def _stop_shared(key: tuple) -> None:
    srv = _shared_servers.pop(key, None)
    if srv is not None and not isinstance(srv, Exception):
        srv.stop()


@pytest.fixture(scope="session")
def shared_server():
    """shared_server(models, env=None, via_cli=False, timeout=240.0) -> a running server_util.Server.

    One server per configuration and pytest run: modules asking for the same models, environment and
    start path get the same process. Tests using one must leave it as they found it: no admin loads or
    unloads, no kills. The configurations several modules share have a fixture of their own below.
    """
    from server_util import start_server

    def get(models: list[str], env: dict[str, str] | None = None, via_cli: bool = False, timeout: float = 240.0):
        key = _server_key(models, env, via_cli)
        if key not in _shared_servers:
            try:
                _shared_servers[key] = start_server(list(models), dict(env or {}), via_cli, timeout)
            except Exception as exc:
                _shared_servers[key] = exc
                raise
        srv = _shared_servers[key]
        if isinstance(srv, Exception):
            raise RuntimeError(f"the shared server {key} failed to start earlier in this run") from srv
        assert srv.proc.poll() is None, f"the shared server {key} has exited:\n{srv.log_tail()}"
        return srv

    yield get
    for key in list(_shared_servers):
        _stop_shared(key)


# The shared configurations by name (server_util.SMOL, server_util.TINY_BATCHED). Asking for one by its
# fixture lets the run stop its server right after the last test that uses it (pytest_runtest_teardown
# below), rather than keep it for the rest of the session.
_NAMED_SERVERS = {"smol_server": "SMOL", "tiny_batched_server": "TINY_BATCHED"}
_last_users: dict[str, list[str]] = {}  # node id of a server's last test -> the fixture names it ends


@pytest.fixture(scope="session")
def smol_server(shared_server):
    """The real default model's server (server_util.SMOL), shared by every module that asks."""
    from server_util import SMOL
    return shared_server(**SMOL)


@pytest.fixture(scope="session")
def tiny_batched_server(shared_server):
    """The tiny llama on the batched path (server_util.TINY_BATCHED), shared by every module that asks."""
    from server_util import TINY_BATCHED
    return shared_server(**TINY_BATCHED)


def pytest_collection_finish(session):
    last: dict[str, str] = {}
    for item in session.items:  # the run's order, after deselection
        for name in _NAMED_SERVERS:
            if name in getattr(item, "fixturenames", ()):
                last[name] = item.nodeid
    _last_users.clear()
    for name, nodeid in last.items():
        _last_users.setdefault(nodeid, []).append(name)


@pytest.hookimpl(trylast=True)  # after the item's own fixtures are torn down
def pytest_runtest_teardown(item, nextitem):
    import server_util
    for name in _last_users.get(item.nodeid, ()):
        _stop_shared(_server_key(**getattr(server_util, _NAMED_SERVERS[name])))
    if nextitem is None or getattr(nextitem, "module", None) is not getattr(item, "module", None):
        # A module's background compiles end with it (a `compile-<model>` thread left running would
        # compile beside the next module's tests, charged to tests that did not start it): a model the
        # module owns is stopped after the program in progress (a test that needs every program waits
        # for them itself; what nobody waited for would only be thrown away with the model), and a
        # session-shared one (tiny_model, load_real) finishes its catalog, which later modules use ...
        from pantheon.runtime import engine
        shared = {id(m) for m in (*_tiny_models.values(), *_loaded.values())}
        for model in list(engine._WARMING):
            if id(model) in shared:
                assert model.wait_compiled(900), f"{model.name}: its background compile did not end"
            else:
                thread = model._warmer
                model.stop_warmup(900)
                assert thread is None or not thread.is_alive(), f"{model.name}: its background compile did not stop"
        # ... and so do its executables. Each XLA:CPU executable holds three memory mappings of its own
        # (code, constants, data), and JAX's jit caches keep every executable a module-level function
        # ever compiled (one per model config seen): the one process running the whole suite grew to
        # 63,346 mappings by test_speculative (~75 %) and crashed there inside XLA, a segfault in a
        # compile or an abort in a deserialisation, at the kernel's vm.max_map_count (65,530).
        # Between modules the collected models' programs go and the jit caches are emptied.
        import gc

        import jax
        gc.collect()
        jax.clear_caches()


def wait_until(cond, timeout: float = 30.0, what: str = "condition") -> None:
    """Poll `cond()` until it is true; fail the test (never hang) if `timeout` seconds pass first."""
    import time
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.002)


class Collector:
    """A backend sink that records a request's events and lets a test wait for its Finished."""

    def __init__(self) -> None:
        import threading
        self.events: list = []
        self.done = threading.Event()

    def __call__(self, ev) -> None:
        from pantheon.types import Finished
        self.events.append(ev)
        if isinstance(ev, Finished):
            self.done.set()

    @property
    def ids(self) -> list[int]:
        from pantheon.types import Tokens
        return [i for ev in self.events if isinstance(ev, Tokens) for i in ev.ids]

    @property
    def finished(self):
        from pantheon.types import Finished
        return next(ev for ev in self.events if isinstance(ev, Finished))

    @property
    def started(self):
        from pantheon.types import Started
        return next((ev for ev in self.events if isinstance(ev, Started)), None)
