"""Admin API end to end: a server started with `pantheon serve` (the CLI path) on tiny models.

Loads and unloads by path inside PANTHEON_MODEL_DIR, replicas under one name, /admin/dies accounting
(each load reserves its estimate: weights + KV cache + scratch), a 507 from a 220 MiB die budget, and
503 once every model is unloaded.
"""

from __future__ import annotations

import openai
import pytest
import requests

from pantheon.serving.dies import estimate_load_bytes
from pantheon.runtime.engine import LoadOptions
from server_util import LLAMA, QWEN2, TINY, assert_error, start_server

pytestmark = pytest.mark.slow  # a real server process (make test-quick leaves it out)

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


def test_dies_table(srv):
    r = admin(srv, "/dies")
    assert r.status_code == 200
    (die,) = r.json()["data"]
    assert die["die"] == 0 and die["platform"] == "cpu"
    assert die["budget_bytes"] == 220 * 1024 * 1024
    assert die["used_bytes"] == LLAMA_BYTES and die["free_bytes"] == die["budget_bytes"] - LLAMA_BYTES
    (m,) = die["models"]
    assert m["name"] == "base" and m["instance_id"].startswith("inst-") and m["state"] == "ready"


def test_admin_auth(srv):
    assert_error(admin(srv, "/dies", key="nope"), 401)
    assert_error(requests.get(srv.url + "/admin/dies", timeout=10), 401)
    assert srv.get("/v1/models").status_code == 200  # no API key configured: open


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


def test_unload_errors(srv):
    assert_error(admin(srv, "/models/unload", {"name": "base", "instance_id": "x"}), 400)
    assert_error(admin(srv, "/models/unload", {"name": "base", "timeout_s": "soon"}), 400, "timeout_s")
    assert_error(admin(srv, "/models/unload", {"instance_id": "inst-000"}), 404, "instance_id")
    assert_error(admin(srv, "/models/unload", {"name": "base", "force": True}), 400, "force")


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


def test_cors_off_by_default(srv):
    r = requests.options(srv.url + "/v1/chat/completions", headers={"Origin": "http://x.example"}, timeout=10)
    assert r.status_code == 200 and "Access-Control-Allow-Origin" not in r.headers
