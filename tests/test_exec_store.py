"""Step programs kept across starts and served while the rest compile.

A restart loads the stored executables and compiles nothing; a different file or engine config has its
own key and compiles its own programs (never another model's); a damaged program is compiled again. While
the background compile runs the model is ready, the health routes say `compiled k/n`, and a request
whose bucket is not compiled yet runs padded in a larger one with the same tokens.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import requests

from conftest import Collector, tiny_fixture, wait_until
from server_util import LLAMA, start_server
from pantheon import osthread
from pantheon.config import Settings, load_settings
from pantheon.runtime import compile_guard, engine, exec_store, reference
from pantheon.runtime.decode_state import slot_insert
from pantheon.runtime.engine import Chunk, StepPlan
from pantheon.types import GREEDY

# Small geometry: 2 slots, spans (32 + 16,), chunks (16,): eleven programs, seconds to compile.
SMALL = dict(n_slots=2, max_seq=32, prefill_chunk=16, kv_dtype="float32")


def greedy(model: engine.Model, state, prompt: list[int], n: int) -> tuple[list[int], object]:
    """`n` greedy tokens of `prompt` in slot 0 through the serving verbs (insert, chunked prefill, decode)."""
    state = model.insert(state, slot_insert(0, prompt, 0, GREEDY, n, ()))
    for i in range(0, len(prompt), model.chunk):
        part = prompt[i:i + model.chunk]
        h, state = model.step(state, StepPlan(chunk=Chunk(0, tuple(part), i, i + model.chunk >= len(prompt))))
    out = [int(model.read(h)[0, 0])]
    for k in range(n - 1):
        h, state = model.step(state, StepPlan(decode=(0,), reach=len(prompt) + k + 1))
        out.append(int(model.read(h)[0, 0]))
    return out, model.release(state, 0)


def warm(path: Path, store: Path, **opts) -> tuple[engine.Model, object, int]:
    """Load and warm up (every program before returning); the compiles warm-up made."""
    m = engine.load(path, engine.LoadOptions(**{**SMALL, **opts}, store_dir=str(store)))
    state = m.new_state()
    c0 = compile_guard.compile_count()
    state = m.warmup(state, background=False)
    return m, state, compile_guard.compile_count() - c0


def twin_with_other_weights(src: Path, dst: Path) -> Path:
    """A copy of a tiny GGUF with the same shapes and other weights: its output matrix rows reversed."""
    from pantheon.formats.gguf_reader import MappedGGUF
    t = next(t for t in MappedGGUF(src).tensors if t.name == "output.weight")
    raw = bytearray(src.read_bytes())
    w = np.frombuffer(bytes(raw[t.data_offset:t.data_offset + t.n_bytes]), np.float32).reshape(t.shape[1], t.shape[0])
    raw[t.data_offset:t.data_offset + t.n_bytes] = np.ascontiguousarray(w[::-1]).tobytes()
    dst.write_bytes(bytes(raw))
    return dst


_CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from pantheon.runtime import compile_guard
from test_exec_store import greedy, warm
compile_guard.install()
m, state, compiles = warm(Path(sys.argv[2]), Path(sys.argv[3]))
c0 = compile_guard.compile_count()
ids, state = greedy(m, state, json.loads(sys.argv[4]), 8)
store = m._exec_store()
print(json.dumps({"warmup_compiles": compiles, "serve_compiles": compile_guard.compile_count() - c0,
                  "loaded": store.loaded, "saved": store.saved, "programs": m.compile_progress(), "ids": ids}))
"""


@pytest.fixture(scope="module")
def stored(tmp_path_factory) -> dict:
    """One cold warm-up of the tiny llama into a fresh store: every program compiled here, once, and saved."""
    path, j, _ = tiny_fixture("llama")
    store = tmp_path_factory.mktemp("store")
    m, state, compiles = warm(path, store)
    k, n = m.compile_progress()
    ids, _ = greedy(m, state, j["prompt_ids"], 8)
    return dict(path=path, store=store, n=n, k=k, compiles=compiles, saved=m._exec_store().saved, ids=ids,
                key=m._exec_store().key, j=j)


@pytest.mark.slow  # the store's cold warm-up (every program, over 10 s on 2 cores): left out of make test-quick
def test_a_cold_start_compiles_every_program_once_and_stores_it(stored):
    # every program was made here and saved (the compile count is not compared with n: jitted slot
    # verbs shared with a model loaded earlier in the same process may have been lowered already)
    assert stored["k"] == stored["n"] > 0 and stored["compiles"] > 0
    assert stored["saved"] == stored["n"]
    assert stored["ids"] == stored["j"]["greedy_ids"][:8]


def restart(stored: dict, store: Path) -> dict:
    """A second start of the stored model on `store`, in a child process (like a server's start, and a
    crash stays there): its counts of programs compiled, loaded and saved, and its 8 greedy tokens."""
    out = subprocess.run([sys.executable, "-c", _CHILD, str(Path(__file__).parent), str(stored["path"]),
                          str(store), json.dumps(stored["j"]["prompt_ids"])],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # a child process (and the cold warm-up before it): left out of make test-quick
def test_a_restart_loads_the_stored_programs_and_compiles_nothing(stored):
    """A second process on the same file, config and machine: every program comes from the store,
    nothing is traced, lowered or compiled from warm-up through serving, and the tokens are the same."""
    again = restart(stored, stored["store"])
    n = stored["n"]
    assert again["warmup_compiles"] == 0 and again["serve_compiles"] == 0, again
    assert again["loaded"] == n and again["saved"] == 0 and again["programs"] == [n, n]
    assert again["ids"] == stored["ids"]


@pytest.mark.slow  # two more cold warm-ups (over 10 s on 2 cores): left out of make test-quick
def test_a_different_file_or_config_compiles_its_own_programs(stored, tmp_path):
    path, prompt = stored["path"], stored["j"]["prompt_ids"]
    store = tmp_path / "store"
    shutil.copytree(stored["store"], store)

    # Same shapes, other weights: its own key, its own programs, its own tokens.
    twin = twin_with_other_weights(path, tmp_path / "twin.gguf")
    b, sb, compiles = warm(twin, store)
    assert compiles > 0 and b._exec_store().loaded == 0 and b._exec_store().key != stored["key"]
    ids_b, _ = greedy(b, sb, prompt, 8)
    assert ids_b == list(reference.generate(b, prompt, GREEDY, max_tokens=8, stop_ids=[]))
    assert ids_b != stored["ids"]

    # Same file, another engine config (three slots): another key again.
    c, _, compiles = warm(path, store, n_slots=3)
    assert compiles > 0 and c._exec_store().loaded == 0
    assert len([d for d in store.iterdir() if d.is_dir()]) == 3


@pytest.mark.slow  # a child process (and the cold warm-up before it): left out of make test-quick
def test_a_damaged_program_is_compiled_again_never_loaded(stored, tmp_path):
    store = tmp_path / "store"
    shutil.copytree(stored["store"], store)
    victim = store / stored["key"] / "serve-decode-2-0-48.xla"
    blob = bytearray(victim.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    victim.write_bytes(bytes(blob))
    again = restart(stored, store)
    n = stored["n"]
    assert again["loaded"] == n - 1 and again["saved"] == 1 and again["warmup_compiles"] >= 1
    assert again["ids"] == stored["ids"]
    assert victim.exists()  # written again, whole: the next start loads it


def test_the_store_keeps_its_bound_by_dropping_the_least_recently_used_models(tmp_path):
    from pantheon.runtime import exec_store
    for i, name in enumerate(("old", "mid", "new")):
        d = tmp_path / name
        d.mkdir()
        (d / "p.xla").write_bytes(b"x" * 1000)
        os.utime(d, (1000 + i, 1000 + i))
    removed = exec_store.prune(tmp_path, 2500, keep="old")
    assert [p.name for p in removed] == ["mid"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new", "old"]


class _Planted:
    """What an attacker who can write the store's directory plants: a pickle whose loading runs code
    (here, harmlessly, writing a marker file)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


def _small_store(root: Path) -> exec_store.ExecStore:
    return exec_store.ExecStore(root, {"test": "exec-store-mac"}, 1 << 30)


def _small_program():
    import jax
    import jax.numpy as jnp
    return jax.jit(lambda x: x * 2 + 1).lower(jnp.arange(4, dtype=jnp.float32)).compile()


@pytest.mark.parametrize("magic", [b"PNTHXLA1", exec_store.MAGIC], ids=["old-format", "current-magic"])
def test_a_planted_pickle_with_a_valid_checksum_is_never_unpickled(tmp_path, caplog, magic):
    """A file with the right magic and a correct SHA-256 of its body (all the old check asked) is not
    authenticated: it is skipped with a log line, deleted, and its pickle never runs."""
    import jax
    import pickle
    marker = tmp_path / "marker"
    store = _small_store(tmp_path / "executables")
    assert store.has("serve-decode") is False  # opens the store: the key file and the key directory
    body = pickle.dumps(_Planted(marker))
    planted = store.dir / "serve-decode.xla"
    planted.write_bytes(magic + hashlib.sha256(body).digest() + body)
    with caplog.at_level("WARNING", logger="pantheon.runtime.exec_store"):
        assert store.load("serve-decode", jax.devices()) is None
    assert not marker.exists(), "the planted pickle ran"
    assert store.skipped == 1 and store.loaded == 0 and not planted.exists()
    assert "skipping" in caplog.text and "not unpickled" in caplog.text


def test_a_program_loads_back_under_the_install_key_and_nowhere_else(tmp_path, caplog):
    """What this install saves, a second store on the same directory (another start) loads and runs;
    the key is one private file beside the key directories; the same bytes under another program's
    name, or a store whose key was replaced, are refused before unpickling."""
    import jax
    import jax.numpy as jnp
    root = tmp_path / "executables"
    first = _small_store(root)
    assert first.save("double", _small_program())
    key = root / exec_store.KEY_FILE
    assert key.is_file() and stat.S_IMODE(key.stat().st_mode) == 0o600 and len(key.read_bytes()) == 32

    again = _small_store(root)
    program = again.load("double", jax.devices())
    assert program is not None and again.loaded == 1
    assert np.asarray(program(jnp.arange(4, dtype=jnp.float32))).tolist() == [1.0, 3.0, 5.0, 7.0]

    shutil.copy(first.dir / "double.xla", first.dir / "other.xla")  # a valid file under another name
    with caplog.at_level("WARNING", logger="pantheon.runtime.exec_store"):
        assert again.load("other", jax.devices()) is None
    assert "MAC mismatch" in caplog.text

    key.write_bytes(os.urandom(32))  # another install's key: what the old one signed does not verify
    assert _small_store(root).load("double", jax.devices()) is None


def test_a_key_file_others_can_read_or_write_is_not_trusted(tmp_path, caplog):
    """A key another user can read is a key they can forge with: the store is not used (a miss
    compiles), and the log says why."""
    import jax
    root = tmp_path / "executables"
    assert _small_store(root).save("double", _small_program())
    (root / exec_store.KEY_FILE).chmod(0o644)
    store = _small_store(root)
    with caplog.at_level("WARNING", logger="pantheon.runtime.exec_store"):
        assert store.load("double", jax.devices()) is None and not store.save("double", _small_program())
    assert "not used" in caplog.text and "open to other users" in caplog.text


@pytest.mark.slow  # a server's whole catalog compiled in the test, over 10 s on 2 cores: left out of make test-quick
def test_ready_before_every_bucket_compiles_and_a_request_runs_padded_in_a_larger_one(tmp_path):
    """Serve while compiling, through the server: `/` is 200 and says `compiled k/n` while the
    background compile is held back; a request whose buckets are not compiled yet is served by the
    largest ones (the driver compiles nothing: PANTHEON_FORBID_COMPILE is on) with the oracle's
    tokens; once the rest exist, the same request runs in its own buckets, same tokens, and `/`
    drops the progress."""
    from pantheon.scheduler import GenRequest
    from pantheon.scheduler.batch import BatchScheduler
    from test_web_app import registry_app

    path, j, _ = tiny_fixture("llama")
    model = engine.load(path, engine.LoadOptions(n_slots=2, max_seq=256, prefill_chunk=16, kv_dtype="float32",
                                                 store_dir=""))
    gate, original = osthread.Event(), model._warm_rest

    def held(keys, stop):  # the compile thread waits for the test before making anything
        gate.wait(120)
        original(keys, stop)

    model._warm_rest = held
    settings = Settings(home=tmp_path, batch_slots=2, prefill_chunk=16, max_seq=256, forbid_compile=True)
    app, reg = registry_app(settings, lambda p, n, d, s: model, lambda m, s: BatchScheduler(m, s))
    try:
        client = app.test_client()
        k, n = model.compile_progress()
        assert 0 < k < n
        body = client.get("/").get_json()
        assert client.get("/").status_code == 200 and body["status"] == "ok"
        assert body["progress"] == f"compiled {k}/{n}" and body["compiling"] == {"m": f"compiled {k}/{n}"}
        assert client.get("/m/m/health").get_json()["progress"] == f"compiled {k}/{n}"

        backend = reg.ready_entries("m")[0].backend

        def serve() -> list[int]:
            c = Collector()
            backend.submit(GenRequest(prompt_ids=j["prompt_ids"], params=GREEDY, max_tokens=8), c)
            assert c.done.wait(120)
            assert c.finished.reason == "length", c.finished
            return c.ids

        assert serve() == j["greedy_ids"][:8]
        top = model.capacity
        assert {key[3] for key in model.compiled_shapes()} == {top}  # every step ran in a top-span bucket
        assert model.compiled_shapes() <= {("prefill", 0, 16, top), ("decode", 2, 0, top), ("mixed", 1, 16, top)}

        gate.set()
        assert model.wait_compiled(300) and model.compile_progress() == (n, n) and not model.compile_errors
        with model._keys_lock:
            model._compiled_keys.clear()
        assert serve() == j["greedy_ids"][:8]
        assert ("decode", 1, 0, 128) in model.compiled_shapes()  # its own bucket now
        wait_until(lambda: "progress" not in client.get("/").get_json(), what="the progress to leave /")
    finally:
        gate.set()
        reg.close()


_ROUND_TRIP = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from test_exec_store import greedy, warm
m, state, _ = warm(Path(sys.argv[2]), Path(sys.argv[3]))
ids, state = greedy(m, state, json.loads(sys.argv[4]), 8)
store = m._exec_store()
print(json.dumps({"loaded": store.loaded, "saved": store.saved, "ids": ids}))
"""


def round_trip(arch: str, store: Path) -> subprocess.CompletedProcess:
    """One start of the tiny `arch` fixture on `store` in a fresh child process (what a restart is; a
    crash stays there)."""
    path, j, _ = tiny_fixture(arch)
    return subprocess.run([sys.executable, "-c", _ROUND_TRIP, str(Path(__file__).parent), str(path), str(store),
                           json.dumps(j["prompt_ids"])], capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["rwkv7", "qwen35", "qwen35moe"])
def test_a_recurrent_model_restarts_from_its_stored_programs(arch, tmp_path):
    """rwkv7 and the hybrids qwen35 / qwen35moe (recurrent state; the hybrids' prefill calls LAPACK's
    triangular solve, a custom call jaxlib binds only when it lowers one): the second start, a fresh
    process that lowers nothing, loads every program, runs them and gives the oracle's tokens."""
    first, second = (round_trip(arch, tmp_path) for _ in range(2))
    assert first.returncode == 0 and second.returncode == 0, (first.stderr[-2000:], second.stderr[-2000:])
    a, b = (json.loads(r.stdout.strip().splitlines()[-1]) for r in (first, second))
    assert a["saved"] > 0 and a["loaded"] == 0 and b["loaded"] == a["saved"] and b["saved"] == 0
    assert a["ids"] == b["ids"] == tiny_fixture(arch)[1]["greedy_ids"][:8]


def _compilations(url: str) -> float:
    text = requests.get(url + "/metrics", timeout=30).text
    return float(next(line.split()[-1] for line in text.splitlines()
                      if line.startswith("pantheon_jax_compilations_total")))


@pytest.mark.slow
def test_a_served_restart_loads_its_stored_programs(tmp_path):
    """Through `pantheon serve` (gunicorn's gevent worker, where `threading.Lock` is a greenlet lock and the
    compile-<model> workers are OS threads): the second start of the same model loads what the first
    stored, becomes ready, compiles nothing the first compiled, and answers the same. (A patched lock
    shared by two loading workers once left the warm start waiting forever.)"""
    home = tmp_path / "home"
    home.mkdir()
    (home / "native").symlink_to(load_settings().home / "native")  # the kernels' build, not rebuilt
    env = {"PANTHEON_HOME": str(home), "PANTHEON_EXEC_STORE": "1"}
    answers, compiled, stored = [], [], []
    for _ in ("cold", "warm"):
        srv = start_server([f"tiny={LLAMA}"], env=env)
        try:
            wait_until(lambda: "progress" not in requests.get(srv.url + "/", timeout=30).json(),
                       what="every program to be made", timeout=600)
            r = requests.post(srv.url + "/v1/completions", timeout=120,
                              json={"model": "tiny", "prompt": "Once upon", "max_tokens": 6, "temperature": 0})
            assert r.status_code == 200, r.text
            answers.append(r.json()["choices"][0]["text"])
            compiled.append(_compilations(srv.url))
            found = re.findall(r"executable store \S+: (\d+) programs loaded, (\d+) compiled and saved",
                               srv.log_path.read_text())
            assert len(found) == 1, srv.log_tail()
            stored.append(tuple(int(v) for v in found[0]))
        finally:
            srv.stop()
    (_, saved), (loaded, resaved) = stored
    assert saved > 0 and loaded == saved and resaved == 0, stored
    assert answers[0] == answers[1]
    # what still lowers at a warm start is the state's eager allocation (a fill or two), no step program
    assert compiled[1] < compiled[0] - saved + 3, (compiled, stored)
