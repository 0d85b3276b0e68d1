"""Admin API end to end: a server started with `pantheon serve` (the CLI path) on tiny models.

Loads and unloads by path inside PANTHEON_MODEL_DIR, replicas under one name, /admin/dies accounting
(each load reserves its estimate: weights + KV cache + scratch), a 507 from a 220 MiB die budget, and
503 once every model is unloaded. And, in process (the real registry and loader, no server), a file
that is not a loadable model is a 400 naming the field that gave it.
"""

from __future__ import annotations

import shutil

import openai
import pytest
import requests

from pantheon.config import Settings
from pantheon.serving.dies import estimate_load_bytes
from pantheon.serving.registry import Registry
from pantheon.runtime.engine import LoadOptions
from server_util import LLAMA, QWEN2, TINY, assert_error, start_server

slow = pytest.mark.slow  # the tests on the real server process (make test-quick leaves them out)

ADMIN = "adm-key"
HELLO = [{"role": "user", "content": "Hi"}]
LLAMA_WEIGHTS, QWEN2_WEIGHTS = 854272, 725248  # f32 weights of the tiny fixtures
# What a load reserves: the estimate for the server's options (1 slot with PANTHEON_BATCH_SLOTS=0, PANTHEON_MAX_SEQ
# and PANTHEON_PREFILL_CHUNK from server_util.BASE_ENV), about 65 MiB each (64 MiB of it scratch).
OPTS = LoadOptions(n_slots=1, max_seq=128, prefill_chunk=32)
LLAMA_BYTES = estimate_load_bytes(LLAMA, OPTS).total_bytes
QWEN2_BYTES = estimate_load_bytes(QWEN2, OPTS).total_bytes


# Its own server: the tests load and unload models through the admin API (state no other module may
# see), and it is the one started through `pantheon serve`.
@pytest.fixture(scope="module")
def srv():
    s = start_server([f"base={LLAMA}"], via_cli=True,
                     env={"PANTHEON_BATCH_SLOTS": "0", "PANTHEON_ADMIN_KEY": ADMIN, "PANTHEON_MODEL_DIR": str(TINY),
                          "PANTHEON_DIE_BUDGET_MB": "220"})
    yield s
    s.stop()


def admin(srv, path, body=None, key=ADMIN):
    if body is None:
        return srv.get("/admin" + path, key=key)
    return srv.post("/admin" + path, body, key=key)


def chat(srv, model, **kw):
    return srv.post("/v1/chat/completions", {"model": model, "messages": HELLO, "max_tokens": 3, **kw})


def model_ids(srv):
    return sorted(m["id"] for m in srv.get("/v1/models").json()["data"])


@slow
def test_dies_table(srv):
    r = admin(srv, "/dies")
    assert r.status_code == 200
    (die,) = r.json()["data"]
    assert die["die"] == 0 and die["platform"] == "cpu"
    assert die["budget_bytes"] == 220 * 1024 * 1024
    assert die["used_bytes"] == LLAMA_BYTES and die["free_bytes"] == die["budget_bytes"] - LLAMA_BYTES
    (m,) = die["models"]
    assert m["name"] == "base" and m["instance_id"].startswith("inst-") and m["state"] == "ready"


@slow
def test_admin_auth(srv):
    assert_error(admin(srv, "/dies", key="nope"), 401)
    assert_error(requests.get(srv.url + "/admin/dies", timeout=10), 401)
    assert srv.get("/v1/models").status_code == 200  # no API key configured: open


@slow
@pytest.mark.parametrize("body,status,param", [
    ({"path": "../../../etc/passwd"}, 403, "path"),
    ({"path": "/etc/hostname"}, 403, "path"),
    ({"path": "nope.gguf"}, 404, "path"),
    ({"model": "no-such-catalog-model"}, 404, "model"),
    ({"path": "qwen2.gguf", "color": "red"}, 400, "color"),
    ({"path": "qwen2.gguf", "dies": [9]}, 400, "dies"),
    ({"path": "qwen2.gguf", "name": "has space"}, 400, "name"),
    ({"path": "qwen2.gguf", "spec_k": 99}, 400, "spec_k"),
    ({"path": "qwen2.gguf", "speculative": "yes"}, 400, "speculative"),
    ({"name": "x"}, 400, None),
])
def test_load_errors(srv, body, status, param):
    err = assert_error(admin(srv, "/models/load", body), status)
    if param:
        assert err["param"] == param


@slow
def test_load_then_chat_then_unload(srv):
    r = admin(srv, "/models/load", {"path": "qwen2.gguf", "name": "extra"})
    assert r.status_code == 200, r.text
    info = r.json()
    assert info["status"] == "loaded" and info["name"] == "extra" and info["dies"] == [0]
    assert info["bytes"] == QWEN2_BYTES and info["weight_bytes"] == QWEN2_WEIGHTS
    assert model_ids(srv) == ["base", "extra"]
    out = chat(srv, "extra").json()
    assert out["model"] == "extra"
    assert_error(chat(srv, "other"), 404, "model")  # two loaded: exact names only
    dies = admin(srv, "/dies").json()["data"][0]
    assert dies["used_bytes"] == LLAMA_BYTES + QWEN2_BYTES
    assert {m["instance_id"] for m in dies["models"]} >= {info["instance_id"]}
    r = admin(srv, "/models/unload", {"name": "extra"})
    assert r.status_code == 200 and r.json()["unloaded"][0]["instance_id"] == info["instance_id"]
    assert model_ids(srv) == ["base"]
    assert_error(admin(srv, "/models/unload", {"name": "extra"}), 404)
    assert chat(srv, "whatever").json()["model"] == "base"  # one model left: every name routes to it


@slow
def test_replicas_and_507(srv):
    r = admin(srv, "/models/load", {"model": "llama.gguf", "name": "base"})  # a second replica of "base"
    assert r.status_code == 200, r.text
    replica = r.json()["instance_id"]
    assert model_ids(srv) == ["base"]  # deduped
    dies = admin(srv, "/dies").json()["data"][0]
    assert [m["name"] for m in dies["models"]] == ["base", "base"]
    assert chat(srv, "base").status_code == 200
    # 2 x 65.4 MiB resident + 65.2 MiB fits in 220 MiB; one more 65.2 MiB does not
    r = admin(srv, "/models/load", {"path": "qwen2.gguf", "name": "q1"})
    assert r.status_code == 200, r.text
    before = admin(srv, "/dies").json()["data"]
    err = assert_error(admin(srv, "/models/load", {"path": "qwen2.gguf", "name": "q2"}), 507)
    assert "MiB" in err["message"] and err["code"] == "insufficient_memory"
    assert admin(srv, "/dies").json()["data"] == before  # the refused load left nothing behind
    assert model_ids(srv) == ["base", "q1"]
    assert admin(srv, "/models/unload", {"name": "q1"}).status_code == 200
    assert admin(srv, "/models/unload", {"instance_id": replica}).status_code == 200
    dies = admin(srv, "/dies").json()["data"][0]
    assert [m["name"] for m in dies["models"]] == ["base"] and dies["used_bytes"] == LLAMA_BYTES


@slow
def test_unload_errors(srv):
    assert_error(admin(srv, "/models/unload", {"name": "base", "instance_id": "x"}), 400)
    assert_error(admin(srv, "/models/unload", {"name": "base", "timeout_s": "soon"}), 400, "timeout_s")
    assert_error(admin(srv, "/models/unload", {"instance_id": "inst-000"}), 404, "instance_id")
    assert_error(admin(srv, "/models/unload", {"name": "base", "force": True}), 400, "force")


@slow
def test_none_loaded_is_503_then_reload(srv):
    assert admin(srv, "/models/unload", {"name": "base", "timeout_s": 30}).status_code == 200
    err = assert_error(chat(srv, "base"), 503)
    assert err["code"] == "model_not_loaded"
    assert srv.get("/v1/models").json() == {"object": "list", "data": []}
    assert srv.get("/").json()["status"] == "ok"  # the server itself is healthy
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(model="base", messages=HELLO)
    assert admin(srv, "/models/load", {"path": "llama.gguf", "name": "base"}).status_code == 200
    assert chat(srv, "base").status_code == 200


@slow
def test_cors_off_by_default(srv):
    r = requests.options(srv.url + "/v1/chat/completions", headers={"Origin": "http://x.example"}, timeout=10)
    assert r.status_code == 200 and "Access-Control-Allow-Origin" not in r.headers


# ---- files that are not loadable models (issue 43, row 7) -----------------------------------------------

NOT_GGUF = {"notgguf.gguf": b"junk", "truncated.gguf": b"GGUF\x03\x00\x00\x00"}


def admin_app(tmp_path, **hooks):
    """The admin routes on the real registry (no server process; `hooks` replace its loader) over a
    model directory holding the tiny llama and files that are not GGUFs; the die budget is generous."""
    from pantheon.web import create_app
    models = tmp_path / "models"
    models.mkdir()
    shutil.copy(LLAMA, models / "llama.gguf")
    for name, data in NOT_GGUF.items():
        (models / name).write_bytes(data)
    s = Settings(home=tmp_path / "home", admin_key=ADMIN, model_dir=models.resolve(), batch_slots=1, max_seq=128,
                 prefill_chunk=32, exec_store=False)
    reg = Registry(s, devices=lambda _: [{"die": 0, "platform": "cpu", "kind": "cpu", "budget_bytes": 10**10}],
                   **hooks)
    app = create_app(s, registry=reg, exit_on_failure=False)
    app.extensions["pantheon"].startup.join(60)
    return app.test_client(), reg, models


@pytest.fixture()
def in_process(tmp_path):
    client, reg, models = admin_app(tmp_path)
    yield client, reg, models
    reg.close()


@pytest.mark.parametrize("junk", sorted(NOT_GGUF))
@pytest.mark.parametrize("field", ["path", "model", "mmproj", "draft_model"])
def test_a_file_that_is_not_a_loadable_gguf_is_a_400_naming_its_field(in_process, field, junk):
    """`path`, `model` (a file name), `mmproj` and `draft_model` naming a junk file in the model
    directory: 400 `invalid_model_file` naming that field and the file as the client wrote it, never
    the server's path; nothing is loaded or left reserved."""
    client, reg, models = in_process
    body = {"path": "llama.gguf", "name": "x"}
    if field == "model":
        body = {"model": junk, "name": "x"}
    else:
        body[field] = junk
    before = client.get("/admin/dies", headers={"Authorization": f"Bearer {ADMIN}"}).get_json()["data"]
    r = client.post("/admin/models/load", json=body, headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 400, r.get_data(as_text=True)
    err = r.get_json()["error"]
    assert err["param"] == field and err["code"] == "invalid_model_file", err
    assert err["message"].startswith(f"{field} {junk!r} is not a loadable model file: "), err
    assert str(models) not in err["message"] and str(models.parent) not in err["message"]
    assert not reg.ready_entries("x")
    assert client.get("/admin/dies", headers={"Authorization": f"Bearer {ADMIN}"}).get_json()["data"] == before


def test_a_load_the_device_refuses_stays_a_500_and_never_shows_the_servers_path(tmp_path):
    """A good file whose upload fails (the runtime's fault, not the file's) is no 400, but its message
    names the file as the client gave it too."""
    from pantheon.errors import ModelLoadError

    def refused(path, name, dies, settings, **kw):
        raise ModelLoadError(path, f"placing the weights on the device failed: RESOURCE_EXHAUSTED mapping {path}",
                             in_file=False)

    client, reg, models = admin_app(tmp_path, load_model=refused)
    try:
        r = client.post("/admin/models/load", json={"path": "llama.gguf"}, headers={"Authorization": f"Bearer {ADMIN}"})
        err = r.get_json()["error"]
        assert r.status_code == 500 and err["code"] == "model_load_error", err
        assert "llama.gguf" in err["message"] and str(models) not in err["message"], err
    finally:
        reg.close()
