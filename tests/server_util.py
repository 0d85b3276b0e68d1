"""Start a real `gunicorn -k gevent` Pantheon server on a free local port for end-to-end tests.

A server is started once per configuration and pytest run where test modules can share it: conftest's
session fixture `shared_server(**CONFIG)` keys servers by (models, env, via_cli), and the configurations
several modules use are named below (SMOL, TINY_BATCHED), each with a conftest fixture of its own
(`smol_server`, `tiny_batched_server`) that stops its server after the last test using it. A module whose tests change what a server
holds for good, or own its lifetime (kill it, unload its model, start it in a special home or with a
special environment), starts its own with `start_server` and says why. Either way the server runs in
its own process group so stopping it also stops the worker, and it dies with the test process
(PR_SET_PDEATHSIG) when the run is killed before it could stop it. Its log goes to a file whose tail
is shown when it fails to come up.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]
from conftest import FIXTURES  # noqa: E402  (one place decides where the oracle fixtures live)

from pantheon.config import load_settings, setting  # noqa: E402
from pantheon.web.launch import gunicorn_argv  # noqa: E402  (the same command line `pantheon serve` runs)

TINY = FIXTURES / "tiny"
LLAMA = str(TINY / "llama.gguf")
QWEN2 = str(TINY / "qwen2.gguf")

# Light defaults for every test server: CPU, small caches, no stray keys from the caller's shell.
BASE_ENV = {"JAX_PLATFORMS": "cpu", "PANTHEON_MAX_SEQ": "128", "PANTHEON_PREFILL_CHUNK": "32"}
_CLEARED = ("PANTHEON_API_KEY", "PANTHEON_ADMIN_KEY", "PANTHEON_MODEL_DIR", "PANTHEON_CORS_ORIGINS",
            "PANTHEON_DIE_BUDGET_MB", "PANTHEON_MAX_BODY_BYTES", "PANTHEON_BATCH_SLOTS", "QWEN35_BATCH_SLOTS",
            "PANTHEON_MODELS", "XLA_FLAGS")


def _names_of(name: str) -> tuple[str, ...]:
    """Every name the setting `name` goes by (just `name` when it is not Pantheon's, e.g. JAX_PLATFORMS)."""
    try:
        row = setting(name)
    except KeyError:
        return (name,)
    return (row.name, *row.aliases)


# ---- configurations shared by several modules (conftest: smol_server, tiny_batched_server) ---------------
# The real default model: batching on (8 slots), room for a 1024-token prompt, and an API key, which the
# clients of every module using it send (test_embeddings checks that a wrong one is refused).
SMOL_KEY = "smol-key"
SMOL = {"models": ["smol=smollm2-135m"], "timeout": 400.0,
        "env": {"QWEN35_MAX_SEQ": "1024", "QWEN35_BATCH_SLOTS": "8", "PANTHEON_API_KEY": SMOL_KEY}}
# The tiny llama on the continuous-batching path (8 slots), no keys: streams, cancels and bench runs.
TINY_BATCHED = {"models": [f"tiny={LLAMA}"], "env": {"QWEN35_BATCH_SLOTS": "8"}}


def die_with_parent() -> None:
    """In the forked child before exec: the kernel SIGKILLs it when the test process dies, however that
    happens (its worker then follows: pantheon's worker asks the same of its arbiter)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One server process. `env` adds to BASE_ENV; `via_cli` starts it with `pantheon serve`."""

    def __init__(self, models: list[str], env: dict[str, str] | None = None, via_cli: bool = False):
        self.models = models
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {k: v for k, v in os.environ.items() if k not in _CLEARED}
        self.env.update(BASE_ENV)
        for name in env or {}:  # a test's setting replaces the base one under any of its names (aliases)
            for other in _names_of(name):
                self.env.pop(other, None)
        self.env.update(env or {})
        self.via_cli = via_cli
        self.proc: subprocess.Popen | None = None
        self.log_path = Path(tempfile.mkstemp(prefix="pantheon-server-", suffix=".log")[1])
        self.seen_statuses: list[tuple[int, dict]] = []  # (HTTP status, body) of every / poll

    def start(self) -> "Server":
        if load_settings().test_tier == "quick":  # set by `make test-quick`
            raise RuntimeError("a server process in the quick tier: mark the test (or its module) "
                               "@pytest.mark.slow, or test it on the Flask test client")
        if self.via_cli:
            cmd = [sys.executable, "-m", "pantheon.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port)]
            for m in self.models:
                cmd += ["--model", m]
        else:
            self.env["PANTHEON_MODELS"] = ";".join(self.models)
            cmd = gunicorn_argv("127.0.0.1", self.port, 0)
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True, preexec_fn=die_with_parent)
        log.close()
        return self

    def wait_ready(self, timeout: float = 240.0) -> "Server":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                r = requests.get(self.url + "/", timeout=2)
                self.seen_statuses.append((r.status_code, r.json()))
                if r.status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"server not ready after {timeout} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGINT)  # gunicorn's quick shutdown
                self.proc.wait(timeout=15)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout=5)
        try:
            self.log_path.unlink()
        except OSError:
            pass

    # -- helpers ------------------------------------------------------------------------------------------
    def post(self, path: str, body: object = None, key: str | None = None, **kw) -> requests.Response:
        headers = kw.pop("headers", {})
        if key:
            headers["Authorization"] = f"Bearer {key}"
        return requests.post(self.url + path, json=body, headers=headers, timeout=kw.pop("timeout", 120), **kw)

    def get(self, path: str, key: str | None = None, **kw) -> requests.Response:
        headers = kw.pop("headers", {})
        if key:
            headers["Authorization"] = f"Bearer {key}"
        return requests.get(self.url + path, headers=headers, timeout=kw.pop("timeout", 30), **kw)


def start_server(models: list[str], env: dict[str, str] | None = None, via_cli: bool = False,
                 timeout: float = 240.0) -> Server:
    srv = Server(models, env, via_cli).start()
    try:
        return srv.wait_ready(timeout)
    except BaseException:
        srv.stop()
        raise


def sse_events(resp: requests.Response) -> list:
    """Parse an SSE body into JSON objects, ending with the string "[DONE]"."""
    import json
    out = []
    for line in resp.iter_lines(decode_unicode=True):
        if not line or not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def assert_error(resp: requests.Response, status: int, param: str | None = None) -> dict:
    """The response is a JSON error with this status (and names `param` when given)."""
    assert resp.status_code == status, (resp.status_code, resp.text[:500])
    assert resp.headers.get("Content-Type", "").startswith("application/json"), resp.headers
    body = resp.json()
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
        assert param.split("[")[0].split(".")[0] in err["message"], err
    return err
