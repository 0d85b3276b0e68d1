"""Speculative decoding with a draft model: a second model with the target's vocabulary proposes
greedy drafts where prompt lookup finds none, and the tokens stay those of plain decoding.

The draft is the target itself (every draft accepted), the target's Q8_0 twin, a twin whose output
matrix is reversed (drafts almost always rejected) and another architecture with the same tokenizer
(qwen3 for qwen2): greedy and seeded output equal the target's alone, batched or not. A draft with
another vocabulary, or with recurrent state, is refused with both models named."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import Collector, tiny_fixture
from pantheon.config import Settings
from pantheon.runtime import engine, reference
from pantheon.scheduler import GenRequest
from pantheon.scheduler.batch import BatchScheduler
from pantheon.scheduler.drafts import DraftMismatch, DraftModel
from pantheon.types import SamplingParams
from test_exec_store import twin_with_other_weights

GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, seed=21)
OPTS = engine.LoadOptions(n_slots=4, max_seq=128, prefill_chunk=16, kv_dtype="float32", native_dot="exact")


def settings(**kw) -> Settings:
    # (spec_gauge off: whether verify steps pay is a wall-clock measurement; these tests count drafts)
    base = dict(home=Path("/tmp"), batch_slots=4, queue_depth=32, queue_wait_s=30.0, prefill_chunk=16,
                warmup=False, spec_gauge=False)
    base.update(kw)
    return Settings(**base)


_loaded: dict[str, engine.Model] = {}


def load(path: Path, spec_k: int | None = None) -> engine.Model:
    key = f"{path}:{spec_k}"
    if key not in _loaded:
        _loaded[key] = engine.load(path, engine.LoadOptions(**{**OPTS.__dict__, "spec_k": spec_k}))
    return _loaded[key]


def with_draft(target_name: str, draft_path: Path) -> engine.Model:
    """The module's `target_name` model with `draft_path` loaded as its draft, for the scheduler the test
    starts next (a scheduler reads `draft` when it starts). The target is the model plain decoding runs
    on (`load`, the same options) and the drafts are loaded once too, so the tests share their compiled
    programs instead of compiling the same ones for a fresh pair each."""
    target = load(tiny_fixture(target_name)[0])
    target.draft = load(draft_path, spec_k=0)
    return target


def prompts(name: str) -> list[list[int]]:
    """Prompts on which prompt lookup rarely matches: the draft model does the drafting."""
    base = tiny_fixture(name)[1]["prompt_ids"]
    return [base[:7], base[3:15], base[1:4] + base[9:20]]


def run(sched: BatchScheduler, prompt: list[int], params: SamplingParams, n: int = 24) -> list[int]:
    c = Collector()
    sched.submit(GenRequest(prompt_ids=prompt, params=params, max_tokens=n), c)
    assert c.done.wait(300)
    assert c.finished.reason == "length", c.finished
    return c.ids


def together(sched: BatchScheduler, ps: list[list[int]], params: list[SamplingParams], n: int = 24) -> list[list[int]]:
    cs = []
    for p, prm in zip(ps, params):
        c = Collector()
        sched.submit(GenRequest(prompt_ids=p, params=prm, max_tokens=n), c)
        cs.append(c)
    for c in cs:
        assert c.done.wait(300)
    return [c.ids for c in cs]


def alone(model: engine.Model, prompt: list[int], params: SamplingParams, n: int = 24) -> list[int]:
    return list(reference.generate(model, prompt, params, max_tokens=n, stop_ids=[]))


def test_the_target_as_its_own_draft_has_every_draft_accepted():
    target = with_draft("llama", tiny_fixture("llama")[0])
    sched = BatchScheduler(target, settings())
    try:
        plain = load(tiny_fixture("llama")[0])
        for p in prompts("llama"):
            assert run(sched, p, GREEDY) == alone(plain, p, GREEDY)
        st = sched.load_info()
        assert st["spec_model_drafted"] > 0 and st["spec_model_accepted"] == st["spec_model_drafted"]
        assert st["decode_steps"] < st["decode_tokens"]  # drafts saved steps
        # batched: two streams draft in the same draft steps, each keeps its tokens
        ps = prompts("llama")[:2]
        assert together(sched, ps, [GREEDY, GREEDY]) == [alone(plain, p, GREEDY) for p in ps]
        after = sched.load_info()
        assert after["spec_model_accepted"] == after["spec_model_drafted"] > st["spec_model_drafted"]
        assert sched.failure is None
    finally:
        sched.close()


@pytest.mark.parametrize("draft", ["q8_0", "reversed"])
def test_a_draft_with_other_weights_gives_the_tokens_of_plain_decoding(draft, tmp_path):
    path = tiny_fixture("llama.q8_0")[0] if draft == "q8_0" else \
        twin_with_other_weights(tiny_fixture("llama")[0], tmp_path / "twin.gguf")
    target = with_draft("llama", path)
    sched = BatchScheduler(target, settings())
    try:
        plain = load(tiny_fixture("llama")[0])
        ps = prompts("llama")
        for p in ps:
            assert run(sched, p, GREEDY) == alone(plain, p, GREEDY)
        params = [SEEDED, GREEDY, SamplingParams(temperature=1.0, top_k=40, seed=5, repetition_penalty=1.2)]
        assert together(sched, ps, params) == [alone(plain, p, prm) for p, prm in zip(ps, params)]
        st = sched.load_info()
        assert st["spec_model_drafted"] > 0
        assert st["spec_model_accepted"] < st["spec_model_drafted"]  # some rejected: the corrected token goes on
        if draft == "q8_0":
            assert st["spec_model_accepted"] > 0
        assert sched.failure is None
    finally:
        sched.close()


def test_another_architecture_with_the_same_tokenizer_drafts():
    target = with_draft("qwen2", tiny_fixture("qwen3")[0])
    sched = BatchScheduler(target, settings())
    try:
        plain = load(tiny_fixture("qwen2")[0])
        for p, prm in zip(prompts("qwen2"), (GREEDY, SEEDED)):
            assert run(sched, p, prm) == alone(plain, p, prm)
        assert sched.load_info()["spec_model_drafted"] > 0
    finally:
        sched.close()


def test_seeded_sampling_gives_the_same_tokens_with_and_without_the_draft():
    target = with_draft("llama", tiny_fixture("llama")[0])
    sched = BatchScheduler(target, settings())
    try:
        plain = load(tiny_fixture("llama")[0])
        for seed in (1, 2, 3):
            prm = SamplingParams(temperature=0.9, seed=seed)
            p = prompts("llama")[seed % 3]
            assert run(sched, p, prm) == alone(plain, p, prm)
        st = sched.load_info()
        assert 0 < st["spec_model_accepted"] <= st["spec_model_drafted"]
    finally:
        sched.close()


def test_the_draft_model_proposes_its_own_greedy_continuation():
    """DraftModel.propose, directly: k greedy tokens of the draft after the sequence, whatever its
    slot held before (a longer sequence, another one, a shared prefix)."""
    m = load(tiny_fixture("llama")[0])
    dm = DraftModel(m, engine.load(tiny_fixture("llama")[0], engine.LoadOptions(**{**OPTS.__dict__, "spec_k": 0})))
    p = tiny_fixture("llama")[1]["prompt_ids"][:20]
    full = alone(m, p, GREEDY, 12)
    assert dm.propose([(0, p, 5)]) == [tuple(full[:5])]
    seq = p + full[:3]  # three accepted: the slot keeps its rows and goes on
    assert dm.propose([(0, seq, 4)]) == [tuple(full[3:7])]
    other = p[:6] + [9, 8, 7]  # a shared prefix only; and a second slot in the same steps
    got = dm.propose([(0, other, 3), (1, seq + full[3:6], 6)])
    assert got == [tuple(alone(m, other, GREEDY, 3)), tuple(full[6:12])]
    assert dm.propose([(1, p, 0)]) == [()]
    # near the end of the context: only as many drafts as positions are left
    long = alone(m, p, GREEDY, m.max_seq - len(p))
    near = p + long[:m.max_seq - len(p) - 2]
    assert dm.propose([(0, near, 5)]) == [tuple(long[len(near) - len(p):])]
    assert len(long[len(near) - len(p):]) == 2


def test_a_draft_with_another_vocabulary_or_recurrent_state_is_refused():
    qwen2 = load(tiny_fixture("qwen2")[0])
    with pytest.raises(DraftMismatch, match=r"draft model .*llama.* for .*qwen2.*vocabularies differ"):
        DraftModel(qwen2, load(tiny_fixture("llama")[0]))
    with pytest.raises(DraftMismatch, match="recurrent state"):
        DraftModel(qwen2, load(tiny_fixture("qwen35")[0]))


# ---- loading: the admin load's `draft_model`, PANTHEON_DRAFT_MODEL and `pantheon serve --draft-model` ----
ADMIN = "draft-admin"


def real_app(tmp_path: Path, **kw):
    """(app, registry) over the real engine on one CPU die, loading from the tiny fixtures' directory."""
    from conftest import TINY
    from pantheon.serving.registry import Registry
    from pantheon.web import create_app
    s = settings(home=tmp_path, admin_key=ADMIN, model_dir=TINY.resolve(), batch_slots=2, max_seq=128,
                 exec_store=False, **kw)
    reg = Registry(s, devices=lambda _: [{"die": 0, "platform": "cpu", "kind": "cpu", "budget_bytes": 10**10}])
    app = create_app(s, registry=reg, exit_on_failure=False)
    app.extensions["pantheon"].startup.join(120)
    return app, reg


def admin(client, path: str, body: dict):
    return client.post("/admin" + path, json=body, headers={"Authorization": f"Bearer {ADMIN}"})


def draft_counter(client, model: str, what: str) -> float:
    text = client.get("/metrics").get_data(as_text=True)
    name = f"pantheon_speculative_draft_model_{what}_tokens_total"
    line = next(ln for ln in text.splitlines() if ln.startswith(name) and f'model="{model}"' in ln)
    return float(line.rsplit(" ", 1)[1])


@pytest.mark.slow  # a target and a draft loaded and warmed by the registry, over 10 s on 2 cores: left out of make test-quick
def test_the_admin_load_field_attaches_a_draft_the_scheduler_uses_and_unload_frees_it(tmp_path):
    app, reg = real_app(tmp_path)
    client = app.test_client()
    r = admin(client, "/models/load", {"path": "llama.gguf", "name": "t", "draft_model": "llama.q8_0.gguf"})
    assert r.status_code == 200, r.get_data(as_text=True)
    (entry,) = reg.ready_entries("t")
    draft = entry.model.draft
    assert draft is not None and draft.n_slots == entry.model.n_slots and draft.max_seq == entry.model.max_seq
    assert entry.backend._drafter is not None and entry.backend._drafter.model is draft
    prompt = tiny_fixture("llama")[1]["prompt_ids"][:9]
    out = client.post("/v1/completions", json={"model": "t", "prompt": prompt, "max_tokens": 16, "temperature": 0})
    assert out.status_code == 200, out.get_data(as_text=True)
    plain = alone(load(tiny_fixture("llama")[0]), prompt, GREEDY, 16)
    tok = entry.model.tokenizer
    assert out.get_json()["choices"][0]["text"] == tok.decode(plain)
    assert draft_counter(client, "t", "drafted") > 0 and draft_counter(client, "t", "accepted") > 0

    # another vocabulary: 400 naming both models, and nothing stays loaded or reserved
    dies = admin_get(client, "/dies")
    r = admin(client, "/models/load", {"path": "qwen2.gguf", "name": "q", "draft_model": "llama.gguf"})
    assert r.status_code == 400, r.get_data(as_text=True)
    err = r.get_json()["error"]
    assert err["param"] == "draft_model" and err["code"] == "draft_model_mismatch"
    assert "'q'" in err["message"] and "llama" in err["message"] and "vocabularies differ" in err["message"]
    assert admin_get(client, "/dies") == dies and not reg.ready_entries("q")
    r = admin(client, "/models/load", {"path": "llama.gguf", "name": "x", "draft_model": "nope.gguf"})
    assert r.status_code == 404 and r.get_json()["error"]["param"] == "draft_model"
    # a file outside the model directory is refused before anything is read, naming the field that gave it
    for field in ("draft_model", "mmproj"):
        r = admin(client, "/models/load", {"path": "llama.gguf", "name": "x", field: "../outside.gguf"})
        err = r.get_json()["error"]
        assert r.status_code == 403 and err["param"] == field and err["code"] == "path_not_allowed", err
        assert err["message"].startswith(f"{field} '../outside.gguf' is outside the model directory")

    assert admin(client, "/models/unload", {"name": "t"}).status_code == 200
    assert draft.released  # unloading the target unloads its draft


def admin_get(client, path: str):
    r = client.get("/admin" + path, headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200
    return r.get_json()["data"]


def test_the_cli_flag_becomes_the_setting_every_startup_load_drafts_with(tmp_path, monkeypatch):
    """`pantheon serve --draft-model FILE` hands PANTHEON_DRAFT_MODEL (an absolute path) to the worker,
    whose startup loads each model with that draft, its scheduler drafting with it."""
    from pantheon import cli
    from pantheon.config import load_settings
    from pantheon.web import launch
    seen = {}

    def execve(exe, argv, env):
        seen.update(env)
        raise SystemExit(0)

    monkeypatch.setattr(launch.os, "execve", execve)
    llama, q8 = tiny_fixture("llama")[0], tiny_fixture("llama.q8_0")[0]
    monkeypatch.chdir(q8.parent)
    with pytest.raises(SystemExit):
        cli.main(["serve", "--model", f"t={llama}", "--draft-model", q8.name, "--port", "1"])
    from_env = load_settings(dict(seen))  # what the worker reads
    assert from_env.draft_model == str(q8.resolve()) and from_env.models == (f"t={llama}",)

    app, reg = real_app(tmp_path, models=from_env.models, draft_model=from_env.draft_model)
    assert app.extensions["pantheon"].status == "ok", app.extensions["pantheon"].error
    (entry,) = reg.ready_entries("t")
    assert entry.backend._drafter is not None and entry.backend._drafter.model is entry.model.draft
    reg.unload("t", None, 30)


@pytest.mark.slow  # every program of a target and its draft, over 10 s on 2 cores: left out of make test-quick
def test_warm_up_makes_the_draft_programs_too_and_nothing_compiles_after():
    target = with_draft("llama", tiny_fixture("llama.q8_0")[0])
    sched = BatchScheduler(target, settings(warmup=True, forbid_compile=True))
    try:
        assert target.wait_compiled(600) and target.draft.wait_compiled(600)
        assert not target.compile_errors and not target.draft.compile_errors
        plain = load(tiny_fixture("llama")[0])
        ps = prompts("llama")[:2]
        assert together(sched, ps, [GREEDY, SEEDED]) == [alone(plain, p, prm) for p, prm in zip(ps, (GREEDY, SEEDED))]
        assert sched.failure is None and sched.load_info()["spec_model_accepted"] > 0
    finally:
        sched.close()


@pytest.mark.real
def test_a_real_model_as_its_own_draft_keeps_its_tokens_and_its_drafts_are_accepted(real_model_path):
    """SmolLM2 drafting for itself on a free-form prompt (prompt lookup finds little there): greedy
    tokens equal plain decoding's, and the draft-model tokens are accepted (all of them, measured)."""
    from conftest import real_fixture
    opts = engine.LoadOptions(n_slots=2, max_seq=512, prefill_chunk=64)
    target = engine.load(real_model_path("smollm2-135m"), opts)
    target.draft = engine.load(real_model_path("smollm2-135m"), engine.LoadOptions(**{**opts.__dict__, "spec_k": 0}))
    stops = frozenset(real_fixture("smollm2-135m")["stop_ids"])
    text = target.card.template.render([{"role": "user", "content": "Write a short poem about the sea."}],
                                       add_generation_prompt=True)
    prompt = target.tokenizer.encode(text)
    want = list(reference.generate(target, prompt, GREEDY, max_tokens=40, stop_ids=stops))
    sched = BatchScheduler(target, settings(prefill_chunk=64))
    try:
        c = Collector()
        sched.submit(GenRequest(prompt_ids=prompt, params=GREEDY, max_tokens=40, stop_ids=stops), c)
        assert c.done.wait(600)
        assert c.ids == want
        st = sched.load_info()
        # (the draft feeds the prompt's last token as a decode row, the target in a prompt chunk: the two
        # paths may round differently, so a near tie could go another way -- none did when measured)
        assert st["spec_model_drafted"] > 0 and st["spec_model_accepted"] >= 0.9 * st["spec_model_drafted"]
    finally:
        sched.close()
        target.free()
