"""The model registry on fake models: phases of a load, routing rules, refcounts, replicas, session
affinity, unload drain, and the die manager's ledger agreeing with the loads (no drift)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from conftest import wait_until
from pantheon.config import Settings, split_model_specs
from pantheon.serving.dies import LoadEstimate
from pantheon.errors import PantheonError, RequestError
from pantheon.serving.registry import MAX_ENTRIES, MAX_SESSIONS, ModelSpec, Registry, default_name, parse_spec

MB = 1 << 20


class FakeModel:
    def __init__(self, path: Path, name: str, dies):
        self.path, self.name, self.dies = path, name, dies
        self.weight_bytes = SIZES.get(path.name, MB)


class FakeBackend:
    def __init__(self, model):
        self.model = model
        self.closed = False

    def close(self, timeout: float = 10.0) -> None:
        self.closed = True


SIZES = {"big.gguf": 900 * MB, "mid.gguf": 400 * MB, "small.gguf": MB}
STATE = 10 * MB  # cache + scratch every fake load also reserves (on every die it is placed on)


def estimate(path: Path, settings, platform) -> LoadEstimate:
    """Weights (split over dies, as an FFN is) plus per-die state: what pantheon.serving.dies estimates."""
    w = SIZES.get(path.name, MB)
    return LoadEstimate(weights_bytes=w, ffn_weight_bytes=w, scratch_bytes=STATE)


def make_registry(budget_mb=(1000, 1000), load_model=None, make_backend=None) -> Registry:
    devices = [{"die": i, "platform": "cpu", "kind": "cpu", "budget_bytes": b * MB} for i, b in enumerate(budget_mb)]
    return Registry(Settings(home=Path("/tmp")),
                    load_model=load_model or (lambda p, n, d, s: FakeModel(p, n, d)),
                    make_backend=make_backend or (lambda m, s: FakeBackend(m)),
                    devices=lambda s: devices, estimate=estimate)


def load(reg: Registry, source="small.gguf", name=None, dies=None) -> dict:
    return reg.load(source, name, dies, resolve=Path)


def status_of(exc_info) -> int:
    return exc_info.value.status


# ---- specs -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text,spec", [
    ("smollm2-135m", ModelSpec("smollm2-135m")),
    ("chat=smollm2-135m", ModelSpec("smollm2-135m", "chat")),
    ("chat=/m/a.gguf@0,1", ModelSpec("/m/a.gguf", "chat", (0, 1))),
    ("/m/a.gguf@3", ModelSpec("/m/a.gguf", None, (3,))),
    ("org/model=x.gguf", ModelSpec("x.gguf", "org/model")),
    ("mail@host.gguf", ModelSpec("mail@host.gguf")),
])
def test_parse_spec(text, spec):
    assert parse_spec(text) == spec


@pytest.mark.parametrize("text", ["", "x=", "bad name=a.gguf", "a.gguf@0,0", "=a.gguf"])
def test_parse_spec_rejects(text):
    with pytest.raises(ValueError):
        parse_spec(text)


def test_split_model_specs():
    assert split_model_specs("a=x@0,1;b@2") == ("a=x@0,1", "b@2")
    assert split_model_specs("a@0,1,b,c@3") == ("a@0,1", "b", "c@3")
    assert split_model_specs(" a ;\n b ") == ("a", "b")


def test_default_name():
    assert default_name("smollm2-135m") == "smollm2-135m"
    assert default_name("/models/My Model.Q4.gguf") == "My-Model.Q4"


# ---- load, route, release --------------------------------------------------------------------------------
def test_load_publishes_and_lists():
    reg = make_registry()
    info = load(reg, name="a")
    assert info["state"] == "ready" and info["name"] == "a" and info["instance_id"].startswith("inst-")
    assert info["dies"] == [0] and info["bytes"] == MB + STATE and info["weight_bytes"] == MB
    assert [m["id"] for m in reg.models()] == ["a"]


def test_route_rules():
    reg = make_registry()
    with pytest.raises(RequestError) as e:
        reg.acquire("a")
    assert status_of(e) == 503
    load(reg, name="a")
    e1 = reg.acquire("anything")  # one resident model: every name routes to it
    assert e1.name == "a"
    reg.release(e1)
    load(reg, name="b")
    assert reg.acquire("b").name == "b"
    assert reg.acquire(None).name == "a"  # no name: the first resident entry
    with pytest.raises(RequestError) as e:
        reg.acquire("c")
    assert status_of(e) == 404 and e.value.param == "model"


def test_replicas_share_load_by_fewest_refs():
    reg = make_registry()
    r1 = load(reg, name="m", dies=[0])["instance_id"]
    r2 = load(reg, name="m", dies=[1])["instance_id"]
    assert [m["id"] for m in reg.models()] == ["m"]  # deduped
    got = [reg.acquire("m") for _ in range(4)]
    assert [e.instance_id for e in got] == [r1, r2, r1, r2]
    reg.release(got[1])
    reg.release(got[3])  # r2 idle now, r1 has 2 refs
    assert reg.acquire("m").instance_id == r2
    assert reg.acquire("m").instance_id == r2
    assert reg.acquire("m").instance_id == r1  # tie 2-2: lowest slot


def test_release_without_acquire_raises():
    reg = make_registry()
    load(reg, name="a")
    e = reg.acquire("a")
    reg.release(e)
    with pytest.raises(RuntimeError):
        reg.release(e)


def test_table_holds_16():
    reg = make_registry(budget_mb=(100000,))
    for i in range(MAX_ENTRIES):
        load(reg, name=f"m{i}")
    with pytest.raises(RequestError) as e:
        load(reg, name="one-more")
    assert status_of(e) == 507
    assert len(reg.snapshot()) == MAX_ENTRIES


# ---- placement and admission -------------------------------------------------------------------------------
def test_does_not_fit_is_507_and_frees_the_slot():
    reg = make_registry(budget_mb=(1000,))
    load(reg, "mid.gguf", "a")
    before = reg.dies()
    with pytest.raises(PantheonError) as e:
        load(reg, "big.gguf", "b")
    assert status_of(e) == 507 and e.value.code == "insufficient_memory" and "MiB" in str(e.value)
    assert [i["name"] for i in reg.snapshot()] == ["a"]
    assert reg.dies() == before  # nothing leaked into the ledger
    load(reg, "mid.gguf", "b")  # 820 of 1000 MiB: fits


def test_auto_placement_picks_the_emptiest_die():
    reg = make_registry(budget_mb=(1000, 1000))
    assert load(reg, "mid.gguf", "a")["dies"] == [0]
    assert load(reg, "mid.gguf", "b")["dies"] == [1]
    assert load(reg, "small.gguf", "c")["dies"] == [0]  # a tie: the lower id
    assert load(reg, "small.gguf", "d")["dies"] == [1]  # die 0 now holds more
    dies = reg.dies()
    assert dies[0]["used_bytes"] == dies[1]["used_bytes"] == 401 * MB + 2 * STATE
    assert {m["name"] for m in dies[0]["models"]} == {"a", "c"}
    assert all(m["state"] == "ready" for m in dies[0]["models"])
    assert dies[0]["free_bytes"] == dies[0]["budget_bytes"] - dies[0]["used_bytes"]
    assert set(dies[0]) >= {"die", "platform", "kind", "budget_bytes", "used_bytes", "free_bytes", "models"}


def test_multi_die_load_splits_bytes():
    reg = make_registry(budget_mb=(500, 500))
    info = load(reg, "big.gguf", "a", dies=[0, 1])  # 450 MiB of weights + the state on each die
    assert info["dies"] == [0, 1] and info["bytes"] == 450 * MB + STATE
    assert [d["used_bytes"] for d in reg.dies()] == [450 * MB + STATE] * 2
    with pytest.raises(PantheonError) as e:
        load(reg, "mid.gguf", "b", dies=[0, 1])  # 200 + 10 more on each: over budget
    assert status_of(e) == 507


def test_ledger_agrees_with_the_loads_and_does_not_drift():
    reg = make_registry(budget_mb=(1000, 1000, 1000))
    base = load(reg, "mid.gguf", "base", dies=[0])
    start = reg.dies()
    for i in range(50):
        infos = [load(reg, "small.gguf", f"s{i}"), load(reg, "mid.gguf", f"m{i}", dies=[1, 2])]
        with pytest.raises(PantheonError):
            load(reg, "big.gguf", f"x{i}", dies=[0])  # refused: reserves nothing
        dies = reg.dies()
        for d in dies:  # every die's used bytes are exactly what its residents reserved
            assert d["used_bytes"] == sum(m["bytes"] for m in d["models"])
            assert d["used_bytes"] == sum(x["bytes"] for x in [base] + infos if d["die"] in x["dies"])
        reg.unload(instance_id=infos[i % 2]["instance_id"])
        reg.unload(instance_id=infos[1 - i % 2]["instance_id"])
        assert reg.dies() == start
    assert [i["name"] for i in reg.snapshot()] == ["base"]


@pytest.mark.parametrize("dies", [[5], [0, 0], [-1]])
def test_bad_dies_are_400(dies):
    reg = make_registry()
    with pytest.raises(RequestError) as e:
        load(reg, dies=dies)
    assert status_of(e) == 400 and e.value.param == "dies"
    assert reg.snapshot() == []


def test_bad_name_is_400():
    with pytest.raises(RequestError) as e:
        load(make_registry(), name="no spaces")
    assert status_of(e) == 400


# ---- loading concurrently --------------------------------------------------------------------------------
def test_registry_serves_during_load_and_refuses_duplicate():
    gate = threading.Event()
    entered = threading.Event()

    def slow_load(p, n, d, s):
        if n == "slow":
            entered.set()
            assert gate.wait(10)
        return FakeModel(p, n, d)

    reg = make_registry(load_model=slow_load)
    load(reg, name="fast")
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("info", load(reg, name="slow")))
    t.start()
    assert entered.wait(10)
    # serviceable: routing, listing and releasing work while the upload runs
    e = reg.acquire("fast")
    reg.release(e)
    assert [m["id"] for m in reg.models()] == ["fast"]
    states = {i["name"]: i["state"] for i in reg.snapshot()}
    assert states == {"fast": "ready", "slow": "loading"}
    with pytest.raises(RequestError) as err:
        load(reg, name="slow")
    assert status_of(err) == 409
    with pytest.raises(RequestError) as err:
        reg.unload("slow")
    assert status_of(err) == 409
    with pytest.raises(RequestError) as err:
        reg.acquire("slow")
    assert status_of(err) == 503
    gate.set()
    t.join(10)
    assert result["info"]["state"] == "ready"
    assert reg.acquire("slow").name == "slow"


def test_one_upload_at_a_time():
    active, peak = [0], [0]
    lock = threading.Lock()

    def tracked(p, n, d, s):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.05)  # the test's input: a load that takes a while, so two unserialized loads would overlap
        with lock:
            active[0] -= 1
        return FakeModel(p, n, d)

    reg = make_registry(budget_mb=(100000,), load_model=tracked)
    threads = [threading.Thread(target=load, args=(reg, "small.gguf", f"m{i}")) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert peak[0] == 1 and len(reg.models()) == 4


@pytest.mark.parametrize("stage", ["load", "backend"])
def test_failed_load_frees_the_slot(stage):
    def boom(*a):
        raise RuntimeError("boom")

    reg = make_registry(load_model=boom if stage == "load" else None,
                        make_backend=boom if stage == "backend" else None)
    with pytest.raises(RuntimeError):
        load(reg, name="a")
    assert reg.snapshot() == []
    assert reg.dies()[0]["used_bytes"] == 0 and reg.dies()[0]["models"] == []


# ---- unload ---------------------------------------------------------------------------------------------------
def test_unload_waits_for_refs_then_frees():
    reg = make_registry()
    load(reg, name="a")
    load(reg, name="b")
    e = reg.acquire("a")
    backend = e.backend
    done = {}
    t = threading.Thread(target=lambda: done.setdefault("r", reg.unload("a")))
    t.start()
    wait_until(lambda: [i["state"] for i in reg.snapshot() if i["name"] == "a"] == ["unloading"], 10,
               "the unload to start draining")
    assert t.is_alive() and not backend.closed  # draining: the in-flight request keeps its model
    with pytest.raises(RequestError) as err:
        reg.acquire("a")  # no new work for an unloading model
    assert status_of(err) == 503
    with pytest.raises(RequestError) as err:
        reg.unload("a")
    assert status_of(err) == 409
    reg.release(e)
    t.join(5)
    assert not t.is_alive() and backend.closed
    assert done["r"][0]["state"] == "unloaded"
    assert [m["id"] for m in reg.models()] == ["b"]


def test_unload_timeout_is_409_and_keeps_the_model():
    reg = make_registry()
    load(reg, name="a")
    e = reg.acquire("a")
    t0 = time.monotonic()
    with pytest.raises(RequestError) as err:
        reg.unload("a", timeout_s=0.1)
    assert status_of(err) == 409 and err.value.code == "unload_timeout"
    assert time.monotonic() - t0 >= 0.1
    assert not e.backend.closed
    e2 = reg.acquire("a")  # acquirable again
    reg.release(e)
    reg.release(e2)
    assert reg.unload("a", timeout_s=1)[0]["name"] == "a"


def test_unload_one_instance_keeps_the_other_replica():
    reg = make_registry()
    r1 = load(reg, name="m")["instance_id"]
    r2 = load(reg, name="m")["instance_id"]
    assert [i["instance_id"] for i in reg.unload(instance_id=r1)] == [r1]
    assert reg.acquire("m").instance_id == r2
    with pytest.raises(RequestError) as err:
        reg.unload(instance_id=r1)
    assert status_of(err) == 404


def test_unload_by_name_takes_every_replica():
    reg = make_registry()
    load(reg, name="m")
    load(reg, name="m")
    assert len(reg.unload("m")) == 2
    assert reg.snapshot() == []
    with pytest.raises(RequestError) as err:
        reg.unload("m")
    assert status_of(err) == 404


# ---- session affinity over replicas -------------------------------------------------------------------------
def test_sessions_stick_to_their_replica_and_spread():
    reg = make_registry()
    r1 = load(reg, name="m", dies=[0])["instance_id"]
    r2 = load(reg, name="m", dies=[1])["instance_id"]
    first = {}
    for i in range(8):  # one at a time: new sessions still alternate (fewest sessions)
        e = reg.acquire("m", f"s{i}")
        first[f"s{i}"] = e.instance_id
        reg.release(e)
    assert sorted(first.values()) == sorted([r1] * 4 + [r2] * 4)
    held = [reg.acquire("m", "s0") for _ in range(3)]  # a busy replica keeps its session
    assert {e.instance_id for e in held} == {first["s0"]}
    for sid, inst in first.items():
        e = reg.acquire("m", sid)
        assert e.instance_id == inst and reg.session_instance(sid) == inst
        reg.release(e)
    for e in held:
        reg.release(e)
    assert reg.acquire("m").instance_id == r1  # no session: fewest refs, then lowest slot


def test_session_falls_back_when_its_replica_is_gone():
    reg = make_registry()
    r1 = load(reg, name="m", dies=[0])["instance_id"]
    r2 = load(reg, name="m", dies=[1])["instance_id"]
    e = reg.acquire("m", "s")
    assert e.instance_id == r1
    reg.release(e)
    reg.unload(instance_id=r1)
    assert reg.session_instance("s") is None
    e = reg.acquire("m", "s")
    assert e.instance_id == r2 and reg.session_instance("s") == r2
    reg.release(e)
    r3 = load(reg, name="m", dies=[0])["instance_id"]
    e = reg.acquire("m", "s")  # still sticks to r2, although r3 is idle and in a lower slot
    assert e.instance_id == r2 and r3 != r2
    reg.release(e)


def test_session_map_is_bounded():
    reg = make_registry()
    load(reg, name="m")
    for i in range(MAX_SESSIONS + 10):
        reg.release(reg.acquire("m", f"s{i}"))
    assert reg.session_instance("s0") is None and reg.session_instance(f"s{MAX_SESSIONS + 9}") is not None
    assert len(reg._sessions) == MAX_SESSIONS and sum(reg._session_counts.values()) == MAX_SESSIONS


def test_a_load_may_set_its_own_speculative_decoding():
    """The admin load's `speculative` / `spec_k` reach this model's load and its scheduler, not the others'."""
    seen: dict[str, tuple] = {}
    reg = make_registry(load_model=lambda p, n, d, s: (seen.setdefault(n, (s.speculative, s.spec_k)),
                                                       FakeModel(p, n, d))[1],
                        make_backend=lambda m, s: (seen.setdefault(m.name + "/backend", (s.speculative, s.spec_k)),
                                                   FakeBackend(m))[1])
    reg.load("small.gguf", "plain", None, resolve=Path)
    reg.load("small.gguf", "tuned", None, resolve=Path, overrides={"speculative": False, "spec_k": 3})
    assert seen["plain"] == seen["plain/backend"] == (True, 6)
    assert seen["tuned"] == seen["tuned/backend"] == (False, 3)
