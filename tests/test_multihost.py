"""One model over several hosts (pantheon.serving.distributed): two processes on this machine, 2 CPU devices each,
serve one tiny model tensor-parallel over all 4 devices.

Specification:
* the cluster computes what one process computes: teacher-forced logits, a greedy continuation and a
  batched step equal the single-process engine (and the HF float64 oracle within the parity tolerance);
* `pantheon serve --coordinator --num-processes --process-id`: process 0 serves HTTP, its chat answers
  equal the single-process engine's greedy output; stopping it ends the follower with status 0;
* a killed follower turns the leader's `GET /` into 503 naming the model within seconds, chat requests
  get 503, and the leader still stops promptly: nothing hangs.

Every process started here runs in its own session, dies with the test process, and is killed at the end.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import requests

from conftest import TINY, centered, tiny_fixture, wait_until
from server_util import LLAMA, ROOT, Server, die_with_parent, free_port
from pantheon.runtime import reference

pytestmark = pytest.mark.slow  # several processes (make test-quick leaves it out)

TOL = 1e-3  # the oracle parity tolerance (tests/test_oracle_parity.py)
JOB = Path(__file__).resolve().parent / "multihost_job.py"
TWO_DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
# The servers: small caches, no warm-up (programs compile on first use, in both processes), 2 slots.
SERVER_ENV = {**TWO_DEVICES, "PANTHEON_WARMUP": "0", "QWEN35_BATCH_SLOTS": "2", "PANTHEON_KV_DTYPE": "float32",
              "PANTHEON_CLUSTER_TIMEOUT_S": "120"}


def _spawn(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("PANTHEON_", "QWEN35_", "XLA_"))}
    full.update(env)
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, cwd=ROOT, env=full, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=die_with_parent)


def _kill(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)


def _wait_exit(proc: subprocess.Popen, timeout: float) -> int | None:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


def _tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


# ---- the verb broadcast, in one process -----------------------------------------------------------------
class SeamModel:
    """A stand-in with the seam's verbs (insert / step / free), to show the broadcast does not depend on
    any verb's argument list: a verb is a name in distributed.VERBS, nothing more."""

    def __init__(self, scale: float):
        self.scale = scale
        self.calls: list[tuple] = []
        self.released = False

    def new_state(self):
        import jax.numpy as jnp
        self.calls.append(("new_state",))
        return {"kv": jnp.zeros((4,))}

    def insert(self, state, slot: int, tokens: list[int]):
        self.calls.append(("insert", slot, tuple(tokens)))
        return {"kv": state["kv"].at[slot].add(self.scale * sum(tokens))}

    def step(self, state):
        from pantheon.runtime.engine import StepHandle
        self.calls.append(("step",))
        new = {"kv": state["kv"] + 1}
        return StepHandle(packed=new["kv"].astype("int32"), logits=None, n_rows=4), new

    def free(self):
        self.calls.append(("free",))
        self.released = True

    @staticmethod
    def read(handle):
        return np.asarray(handle.packed)[: handle.n_rows]

    def run(self, tokens: list[int]):
        """A convenience built on the verbs (like Model.prefill / logits / generate)."""
        state = self.insert(self.new_state(), 1, tokens)
        handle, state = self.step(state)
        return self.read(handle)


@pytest.fixture
def channel():
    """A Leader with one follower whose end of the control channel is a local socket pair."""
    import socket

    from pantheon.serving import distributed
    ours, theirs = socket.socketpair()
    leader = distributed.Leader(distributed.ClusterSpec("127.0.0.1:1", 2, 0))
    leader.followers.append(distributed._Follower(1, ours))
    yield leader, theirs
    leader._stopped = True
    ours.close()
    theirs.close()


def _frames(sock, n: int) -> list:
    from pantheon.serving import distributed
    sock.settimeout(5)
    return [distributed.recv_frame(sock) for _ in range(n)]


def test_each_verb_goes_to_the_followers_before_it_runs_with_device_state_as_a_reference(channel):
    from pantheon.serving import distributed
    leader, theirs = channel
    proxy = distributed.LeaderModel(leader, 7, SeamModel(scale=1.0))
    assert proxy.run([2, 3]).tolist() == [1, 6, 1, 1]
    frames = _frames(theirs, 3)
    assert [f[:3] for f in frames] == [("call", 7, "new_state"), ("call", 7, "insert"), ("call", 7, "step")]
    # host arguments travel as they are; the state a verb returned travels as "state number k"
    assert frames[1][3] == (distributed.StateRef(0), 1, [2, 3]) and frames[2][3] == (distributed.StateRef(1),)
    assert [f[5] for f in frames] == [0, 1, 2]  # the number the next returned state will get

    # A follower replays the frames on its own model (its own shard) and ends in the same state.
    follower = distributed.Follower(distributed.ClusterSpec("127.0.0.1:1", 2, 1))
    mirror = follower.models[7] = SeamModel(scale=1.0)
    for f in frames:
        follower._call(*f[1:])
    assert mirror.calls == proxy.inner.calls
    # the step returned (its output, the state): numbered 2 and 3 on both sides
    assert np.asarray(follower.states[(7, 3)]["kv"]).tolist() == [1, 6, 1, 1]

    # States that died on the leader (donated, dropped) are dropped by the followers with the next call.
    import gc
    gc.collect()
    proxy.free()
    (last,) = _frames(theirs, 1)
    assert last[2] == "free" and set(frames[2][6]) | set(last[6]) == {0, 1, 2, 3}
    follower._call(*last[1:])
    assert 7 not in follower.models and not follower.states  # a released model is forgotten


def test_after_a_failure_every_verb_answers_503_but_an_unload_still_frees_memory(channel):
    from pantheon.serving import distributed
    leader, _ = channel
    proxy = distributed.LeaderModel(leader, 0, SeamModel(scale=1.0))
    handle, _ = proxy.step(proxy.new_state())
    leader.fail("follower process 1 is gone (test)")
    assert proxy.read(handle).tolist() == [1, 1, 1, 1]  # a step that finished can still be read
    for call in (lambda: proxy.new_state(), lambda: proxy.run([1])):
        with pytest.raises(distributed.ClusterFailed) as err:
            call()
        assert err.value.status == 503 and "follower process 1 is gone" in str(err.value)
    proxy.free()  # an unload still frees this process's memory
    assert proxy.inner.released


def test_a_closed_follower_connection_fails_the_cluster_within_a_second(channel):
    from pantheon import osthread
    leader, theirs = channel
    leader._models[0] = "tiny"
    osthread.start_thread(lambda: leader._read(leader.followers[0]), name="test-ctl-reader")
    theirs.close()
    t0 = time.monotonic()
    wait_until(lambda: leader.failure is not None, 30, "the leader to see the follower gone")  # a hang guard
    print(f"failed after {time.monotonic() - t0:.3f} s")  # a figure on a shared machine, not a criterion
    assert "follower process 1 is gone" in leader.failure and "'tiny'" in leader.failure


# ---- the engine over two processes ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def single():
    """The same fixture model in this one process (one die): the reference."""
    from pantheon.runtime import engine
    from multihost_job import OPTS
    return engine.load(TINY / "llama.gguf", OPTS)


@pytest.fixture(scope="module")
def cluster_result(tmp_path_factory):
    """Run tests/multihost_job.py as processes 0 and 1 and return what process 0 computed."""
    tmp = tmp_path_factory.mktemp("multihost")
    out, port = tmp / "out.npz", free_port()
    procs = [_spawn([sys.executable, str(JOB), str(port), str(pid), str(out)], TWO_DEVICES, tmp / f"p{pid}.log")
             for pid in (0, 1)]
    try:
        codes = [_wait_exit(p, 240) for p in procs]
        assert codes == [0, 0], f"exit codes {codes}\n--- p0\n{_tail(tmp / 'p0.log')}\n--- p1\n{_tail(tmp / 'p1.log')}"
        return dict(np.load(out))
    finally:
        for p in procs:
            _kill(p)


def test_the_cluster_spans_the_four_devices_of_both_processes(cluster_result):
    assert int(cluster_result["devices"]) == 4


def test_teacher_forced_logits_equal_the_single_process_and_the_oracle(cluster_result, single):
    _, fixture, oracle = tiny_fixture("llama")
    got = cluster_result["logits"]
    ref = reference.logits(single, fixture["prompt_ids"])
    assert got.shape == ref.shape == oracle.shape
    assert np.abs(got - ref).max() < 1e-4  # same function, only the summation order of the all-reduce differs
    assert np.abs(centered(got) - centered(oracle)).max() < TOL


def test_greedy_continuation_equals_the_single_process_and_the_oracle(cluster_result, single):
    from pantheon.runtime.sampler import SamplingParams
    _, fixture, _ = tiny_fixture("llama")
    ref = list(reference.generate(single, fixture["prompt_ids"], SamplingParams(temperature=0.0),
                               max_tokens=len(fixture["greedy_ids"]), stop_ids=[]))
    assert cluster_result["greedy"].tolist() == ref == fixture["greedy_ids"]


def test_a_batched_step_equals_the_single_process(cluster_result, single):
    prompt = tiny_fixture("llama")[1]["prompt_ids"]
    from multihost_job import batched_steps
    first, second, logits = batched_steps(single, prompt)
    assert cluster_result["first"].tolist() == first.tolist()
    assert cluster_result["second"].tolist() == second.tolist()
    assert np.abs(cluster_result["batch_logits"] - logits).max() < 1e-4


def test_two_models_stepping_at_once_from_two_threads_each_equal_the_single_process(cluster_result, single):
    from multihost_job import OPTS, TWO_MODEL_PROMPT

    from pantheon.runtime import engine
    from pantheon.runtime.sampler import SamplingParams
    qwen2 = engine.load(TINY / "qwen2.gguf", OPTS)
    for name, model in (("llama", single), ("qwen2", qwen2)):
        ref = list(reference.generate(model, TWO_MODEL_PROMPT, SamplingParams(temperature=0.0), max_tokens=20, stop_ids=[]))
        assert cluster_result[f"both_{name}"].tolist() == ref, name


# ---- `pantheon serve` over two processes ----------------------------------------------------------------
class Cluster:
    """A leader (`gunicorn`, as `pantheon serve` execs it) and a follower (`pantheon serve --process-id 1`)."""

    def __init__(self) -> None:
        port = free_port()
        cluster = {"PANTHEON_COORDINATOR": f"127.0.0.1:{port}", "PANTHEON_NUM_PROCESSES": "2"}
        self.leader = Server([LLAMA], env={**SERVER_ENV, **cluster, "PANTHEON_PROCESS_ID": "0"})
        self.follower_log = Path(tempfile.mkstemp(prefix="pantheon-follower-", suffix=".log")[1])
        self.follower_cmd = [sys.executable, "-m", "pantheon.cli", "serve", "--model", LLAMA,
                             "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", "1"]
        self.follower: subprocess.Popen | None = None

    def start(self) -> "Cluster":
        self.leader.start()
        self.follower = _spawn(self.follower_cmd, SERVER_ENV, self.follower_log)
        try:
            self.leader.wait_ready(240)
        except BaseException as exc:
            self.stop()
            raise AssertionError(f"{exc}\n--- follower\n{_tail(self.follower_log)}") from None
        return self

    def chat(self, text: str, max_tokens: int = 8) -> requests.Response:
        return self.leader.post("/v1/chat/completions", {"messages": [{"role": "user", "content": text}],
                                                         "temperature": 0, "max_tokens": max_tokens}, timeout=120)

    def stop(self) -> None:
        self.leader.stop()
        _kill(self.follower)
        try:
            self.follower_log.unlink()
        except OSError:
            pass


def _poll(fn, timeout: float, every: float = 0.1):
    """fn() until it returns a truthy value or `timeout` passes; returns the last value."""
    deadline = time.monotonic() + timeout
    value = fn()
    while not value and time.monotonic() < deadline:
        time.sleep(every)
        value = fn()
    return value


def _single_process_reply(single, text: str, max_tokens: int) -> str:
    from pantheon.runtime.sampler import SamplingParams
    prompt = single.card.template.render([{"role": "user", "content": text}], add_generation_prompt=True)
    ids = single.tokenizer.encode(prompt)
    out = list(reference.generate(single, ids, SamplingParams(temperature=0.0), max_tokens=max_tokens))
    out = [t for t in out if t not in single.tokenizer.eot_ids]
    return single.tokenizer.decode(out)


def test_the_leader_serves_the_single_process_greedy_reply_and_its_stop_ends_the_follower(single):
    cl = Cluster().start()
    try:
        assert cl.leader.get("/").json() == {"service": "pantheon", "status": "ok"}
        for text in ("hello there", "tell me about the sea"):
            r = cl.chat(text)
            assert r.status_code == 200, r.text[:500]
            assert r.json()["choices"][0]["message"]["content"] == _single_process_reply(single, text, 8)
        assert cl.follower.poll() is None  # the follower serves no HTTP: it only mirrors the steps
        cl.leader.stop()
        assert _wait_exit(cl.follower, 20) == 0, _tail(cl.follower_log)
    finally:
        cl.stop()


def test_a_killed_follower_turns_the_leader_503_within_seconds_and_nothing_hangs():
    cl = Cluster().start()
    try:
        assert cl.chat("warm the steps up", 4).status_code == 200
        # A stream in flight when the follower dies ends at once with a cluster_failed error event.
        stream = requests.post(cl.leader.url + "/v1/chat/completions", stream=True, timeout=60, json={
            "messages": [{"role": "user", "content": "tell me a long story about the sea"}], "temperature": 0,
            "max_tokens": 120, "stream": True})
        assert stream.status_code == 200
        events = stream.iter_lines(decode_unicode=True)
        assert next(line for line in events if line.startswith("data: "))  # generation is under way
        os.killpg(cl.follower.pid, signal.SIGKILL)
        t0 = time.monotonic()
        rest = [line for line in events if line.startswith("data: ")]
        assert time.monotonic() - t0 < 10 and rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][len("data: "):])["error"]["code"] == "cluster_failed", rest[-2:]
        t0 = time.monotonic()
        # (a Response is falsy for a 503, so the poll returns its status and body)
        health = _poll(lambda: (lambda r: (r.status_code, r.json()) if r.status_code == 503 else None)(
            cl.leader.get("/", timeout=5)), 15)
        assert health is not None, "GET / still 200 fifteen seconds after the follower died"
        assert time.monotonic() - t0 < 10
        body = health[1]
        assert body["status"] == "failed"
        assert "follower process 1" in body["error"] and "'llama'" in body["error"], body
        r = cl.chat("are you there?")
        assert r.status_code == 503, r.text[:300]
        assert r.json()["error"]["code"] == "cluster_failed"
        assert cl.leader.proc.poll() is None  # the leader answers; it did not crash
        t1 = time.monotonic()
        cl.leader.stop()
        assert cl.leader.proc.poll() is not None and time.monotonic() - t1 < 20
    finally:
        cl.stop()


def test_a_killed_leader_ends_the_follower_at_once():
    cl = Cluster().start()
    try:
        os.killpg(cl.leader.proc.pid, signal.SIGKILL)  # no stop frame: the follower sees the channel close
        assert _wait_exit(cl.follower, 15) == 0, _tail(cl.follower_log)
    finally:
        cl.stop()
