"""The admission service (pantheon.serving.admission): one owner for window, memory, `n`, capping and the
queue place, for chat, completions and embeddings alike.

Through the web routes on a fake model (no JAX): a chat prompt is rendered by the template once and
tokenized once per request; a legacy completion's prompt is tokenized once; the embeddings route is
refused under memory pressure exactly like chat (503, Retry-After, nothing submitted) and admitted
when memory is fine. At the seam: the engine publishes its geometry as a value on the card (no callable
on the card) and imports nothing of memory or admission.
"""

from __future__ import annotations

import ast
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from pantheon.config import Settings
from pantheon.errors import BusyError, RequestError
from pantheon.runtime.memory import MemSnapshot, PoolSample
from pantheon.serving.admission import AdmissionService
from pantheon.types import Embedded, ModelCard, ModelGeometry
from test_web_app import ADMIN, HELLO, CharTokenizer, ScriptBackend, Template, registry_app

GiB = 1024 ** 3
ROOT = Path(__file__).resolve().parents[1]


class CountingTemplate(Template):
    def __init__(self):
        super().__init__()
        self.renders = 0

    def render(self, messages, **kwargs) -> str:
        self.renders += 1
        return super().render(messages, **kwargs)


class CountingTokenizer(CharTokenizer):
    def __init__(self):
        self.encodes = 0

    def encode(self, text: str, add_special: bool = False) -> list[int]:
        self.encodes += 1
        return super().encode(text, add_special)

    def min_tokens(self, text: str) -> int:  # a character is at least a quarter token (a real tokenizer's kind of bound)
        return len(text) // 4


class CountingModel:
    max_seq = 64
    weight_bytes = 1000

    def __init__(self, name: str):
        self.name = name
        self.template = CountingTemplate()
        self.tokenizer = CountingTokenizer()
        geo = ModelGeometry(max_seq=self.max_seq, n_slots=2, state_bytes_per_token=1024, dies=(0,), platform="cpu")
        self.card = ModelCard(name=name, path="", arch="fake", context_length=self.max_seq, n_slots=2,
                              tokenizer=self.tokenizer, template=self.template, geometry=geo)


class EmbedBackend(ScriptBackend):
    """Answers an embeddings request with one unit vector per input; records what it was given."""

    def __init__(self, model):
        super().__init__(model)
        self.embedded: list = []

    def submit_embed(self, req, sink):
        self.embedded.append(req)
        sink(Embedded(vectors=np.eye(len(req.inputs), 4, dtype=np.float32), prompt_tokens=req.prompt_tokens))
        return SimpleNamespace(cancel=lambda: None)


def watch_at(used_frac: float) -> SimpleNamespace:
    snap = MemSnapshot(host=PoolSample("host", 100 * GiB, int(100 * GiB * used_frac), "given"),
                       taken_at=time.monotonic())
    return SimpleNamespace(snapshot=lambda: snap, running=True)


@pytest.fixture()
def served(tmp_path):
    """(test client, the model, its backend, the server state) on a counting fake model."""
    settings = Settings(home=tmp_path, admin_key=ADMIN)
    models: dict = {}

    def load(p, n, d, s):
        models[n] = CountingModel(n)
        return models[n]

    app, reg = registry_app(settings, load, lambda m, s: EmbedBackend(m))
    e = reg.acquire("m")
    reg.release(e)
    state = app.extensions["pantheon"]
    state.memwatch = watch_at(0.2)
    return app.test_client(), models["m"], e.backend, state


def test_a_chat_prompt_is_rendered_and_tokenized_once(served):
    client, model, _, _ = served
    r = client.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 3})
    assert r.status_code == 200, r.get_json()
    assert (model.template.renders, model.tokenizer.encodes) == (1, 1)
    # asking for truncation costs nothing more when the conversation fits as sent
    r = client.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 3, "truncate": "oldest"})
    assert r.status_code == 200, r.get_json()
    assert (model.template.renders, model.tokenizer.encodes) == (2, 2)


def test_only_a_capped_prompt_is_rendered_again(served):
    client, model, _, _ = served
    msgs = [{"role": "user", "content": "x" * 30}, {"role": "assistant", "content": "y" * 30},
            {"role": "user", "content": "last"}]
    r = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 3, "truncate": "oldest"})
    body = r.get_json()
    assert r.status_code == 200 and body["context_capped"] is True, body
    assert model.template.renders > 1  # the capping's candidates are the only renders past the first


def test_a_completion_prompt_is_tokenized_once(served):
    client, model, _, _ = served
    r = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
    assert r.status_code == 200, r.get_json()
    assert model.tokenizer.encodes == 1


def test_embeddings_are_refused_under_memory_pressure_like_chat(served):
    client, _, backend, state = served
    state.memwatch = watch_at(0.99)  # CRITICAL
    answers = [client.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 3}),
               client.post("/v1/embeddings", json={"input": "hello"})]
    for r in answers:
        assert r.status_code == 503 and r.headers.get("Retry-After"), r.get_json()
        assert "memory" in r.get_json()["error"]["message"]
    assert backend.embedded == [] and backend.last_request is None  # neither reached the scheduler
    state.memwatch = watch_at(0.2)
    r = client.post("/v1/embeddings", json={"input": ["hello", "there"]})
    assert r.status_code == 200 and len(r.get_json()["data"]) == 2
    assert len(backend.embedded) == 1


def test_the_service_decides_every_route_alike():
    geo = ModelGeometry(max_seq=64, n_slots=2, state_bytes_per_token=1024, dies=(0,))
    card = ModelCard(name="m", path="", arch="fake", context_length=64, n_slots=2, tokenizer=CharTokenizer(),
                     template=None, geometry=geo)
    ok, critical = AdmissionService(watch_at(0.2)), AdmissionService(watch_at(0.99))
    with pytest.raises(RequestError) as e:
        ok.limits(card, 3)
    assert e.value.param == "n"
    ok.prompt(card, 20, 8)
    ok.embeddings(card, [20, 64])
    for refuse in (lambda: critical.prompt(card, 20, 8), lambda: critical.embeddings(card, [20])):
        with pytest.raises(BusyError) as b:
            refuse()
        assert b.value.status == 503
    with pytest.raises(RequestError) as e:  # an input past the window: 400 whatever the memory
        ok.embeddings(card, [65])
    assert e.value.code == "context_length_exceeded"
    assert AdmissionService.budget(card, 60, 16) == (4, True)


def test_the_card_carries_no_callable_and_the_engine_no_admission():
    import dataclasses
    for f in dataclasses.fields(ModelCard):
        assert "Callable" not in str(f.type), f"ModelCard.{f.name} is a callable: the card is data only"
    tree = ast.parse((ROOT / "pantheon" / "runtime" / "engine.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names} | \
               {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not {"memory", "pantheon.runtime.memory", "pantheon.serving.admission"} & imported


def test_a_loaded_model_publishes_its_geometry_on_its_card():
    from conftest import TINY
    from pantheon.runtime import engine, memory
    m = engine.load(TINY / "llama.gguf", engine.LoadOptions(n_slots=2, max_seq=512, prefill_chunk=16))
    try:
        geo = m.card.geometry
        assert isinstance(geo, ModelGeometry) and geo.sized
        assert (geo.max_seq, geo.n_slots, geo.chunk, geo.capacity) == (m.max_seq, m.n_slots, m.chunk, m.capacity)
        assert geo.chunk_buckets == tuple(m.chunk_buckets) and geo.span_buckets == tuple(m.span_buckets)
        assert (geo.hidden, geo.vocab, geo.state_bytes_per_token) == (m.config.hidden, m.config.vocab,
                                                                      m.state_bytes_per_token())
        assert geo.platform == "cpu" and len(geo.dies) == 1
        assert memory.activation_bytes(geo, 300) > memory.activation_bytes(geo, 4) > 0  # wider spans cost more
    finally:
        m.free()


# ---- capping costs in proportion to the window, not to the body (issue 43 row 1) ------------------------------
class MeteredTemplate:
    """A ChatML-like template that records the size of every rendering."""

    def __init__(self):
        self.sizes: list[int] = []

    def render(self, messages, **kwargs) -> str:
        text = "".join(f"<|{m['role']}|>{m.get('content') or ''}<|end|>\n" for m in messages) + "<|assistant|>"
        self.sizes.append(len(text))
        return text


class MeteredTokenizer(CharTokenizer):
    """One token a character; records the size of every text it tokenizes."""

    def __init__(self):
        self.sizes: list[int] = []

    def encode(self, text: str, add_special: bool = False) -> list[int]:
        self.sizes.append(len(text))
        return super().encode(text, add_special)

    def min_tokens(self, text: str) -> int:  # as weak as a real vocabulary's longest token makes it
        return len(text) // 8


@pytest.mark.parametrize("turns, chars", [(3000, 900), (60000, 1)])
def test_capping_a_huge_conversation_renders_and_tokenizes_only_window_sized_candidates(turns, chars):
    # The body ("truncation": "auto" / "truncate": "oldest" on a 2.8 MB conversation) once cost a
    # dozen renders of half the conversation and more, and one tokenizer pass per candidate.
    window = 2048
    tmpl, tok = MeteredTemplate(), MeteredTokenizer()
    card = ModelCard(name="m", path="", arch="fake", context_length=window, n_slots=2, tokenizer=tok, template=tmpl)
    msgs = [{"role": "user", "content": ("lorem ipsum dolor " * 50)[:chars]} for _ in range(turns)]
    admitted = AdmissionService().chat(card, msgs, tmpl.render, tok.encode, 2, truncate=True)
    assert admitted.capped and len(admitted.ids) <= window - 1
    assert admitted.rendered.endswith(f"<|user|>{msgs[-1]['content']}<|end|>\n<|assistant|>")  # the last turn whole
    turn = len(tmpl.render(msgs[:1])) - len("<|assistant|>")
    tmpl.sizes.pop()
    reach = 8 * window  # the most text that can still be within the window by its length bound
    log_turns = turns.bit_length()
    # its messages' text alone is past the window, so the conversation as sent is never rendered whole:
    # every rendering is a capping candidate near the window's size, O(log turns) of them
    assert max(tmpl.sizes) <= 2 * reach + 2 * turn, sorted(tmpl.sizes)[-5:]
    assert len(tmpl.sizes) <= 4 * log_turns + 8
    # and the tokenizer only ever sees text its length bound could not already refuse
    assert max(tok.sizes) <= reach + turn and len(tok.sizes) <= 2 * log_turns + 4
