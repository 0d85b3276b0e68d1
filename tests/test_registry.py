"""The model registry on fake models: phases of a load, routing rules, refcounts, replicas, unload drain."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from pantheon.config import Settings, split_model_specs
from pantheon.errors import RequestError
from pantheon.registry import MAX_ENTRIES, ModelSpec, Registry, default_name, parse_spec

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


def make_registry(budget_mb=(1000, 1000), load_model=None, make_backend=None) -> Registry:
    devices = [{"die": i, "platform": "cpu", "kind": "cpu", "budget_bytes": b * MB} for i, b in enumerate(budget_mb)]
    return Registry(Settings(home=Path("/tmp")),
                    load_model=load_model or (lambda p, n, d, s: FakeModel(p, n, d)),
                    make_backend=make_backend or (lambda m, s: FakeBackend(m)),
                    devices=lambda s: devices,
                    estimate=lambda p, s, platform: SIZES.get(p.name, MB))


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
    assert info["dies"] == [0] and info["bytes"] == MB
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
    with pytest.raises(RequestError) as e:
        load(reg, "big.gguf", "b")
    assert status_of(e) == 507 and "MiB" in str(e.value)
    assert [i["name"] for i in reg.snapshot()] == ["a"]
    load(reg, "mid.gguf", "b")  # 800 of 1000 MiB: fits


def test_auto_placement_picks_the_emptiest_die():
    reg = make_registry(budget_mb=(1000, 1000))
    assert load(reg, "mid.gguf", "a")["dies"] == [0]
    assert load(reg, "mid.gguf", "b")["dies"] == [1]
    assert load(reg, "small.gguf", "c")["dies"] == [0]
    dies = reg.dies()
    assert dies[0]["used_bytes"] == 401 * MB and dies[1]["used_bytes"] == 400 * MB
    assert {m["name"] for m in dies[0]["models"]} == {"a", "c"}
    assert dies[0]["free_bytes"] == dies[0]["budget_bytes"] - dies[0]["used_bytes"]


def test_multi_die_load_splits_bytes():
    reg = make_registry(budget_mb=(500, 500))
    info = load(reg, "big.gguf", "a", dies=[0, 1])  # 450 MiB per die
    assert info["dies"] == [0, 1]
    assert [d["used_bytes"] for d in reg.dies()] == [450 * MB, 450 * MB]


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
        time.sleep(0.05)
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
    assert reg.dies()[0]["used_bytes"] == 0


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
    time.sleep(0.1)
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
