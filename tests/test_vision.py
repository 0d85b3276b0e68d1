"""Images in prompts (Gemma 3 VLM: SigLIP encoder + projector from an mmproj GGUF) against the float64 HF
oracle of tests/fixtures/tiny-vlm: preprocessing, teacher-forced logits with one and two images, chunked
prefill around image runs, the scheduler (greedy equal to the oracle, batched equal to alone, prefix reuse
keyed by the image's content), and the refusals."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from conftest import FIXTURES, Collector, centered, tiny_fixture, wait_until
from pantheon.config import Settings
from pantheon.errors import ModelLoadError, RequestError
from pantheon.formats import images
from pantheon.runtime import engine, reference
from pantheon.runtime.sampler import SamplingParams
from pantheon.scheduler import GenRequest
from pantheon.scheduler.batch import BatchScheduler
from pantheon.types import PromptImage

VLM = FIXTURES / "tiny-vlm"
GREEDY = SamplingParams(temperature=0.0)
TOL = 1e-4  # per-row-centred logits, f32 engine vs float64 oracle (measured ~4e-6)


def fixture() -> dict:
    return json.loads((VLM / "gemma3-vlm.json").read_text())


def load(**kw) -> engine.Model:
    opts = dict(mmproj=str(VLM / "gemma3-vlm.mmproj.gguf"), kv_dtype="float32", max_seq=192, n_slots=4,
                prefill_chunk=64)
    opts.update(kw)
    return engine.load(VLM / "gemma3-vlm.gguf", engine.LoadOptions(**opts))


@pytest.fixture(scope="module")
def model() -> engine.Model:
    return load()


def pixels(name: str, model: engine.Model) -> images.Preprocessed:
    v = model.card.vision
    return images.load((VLM / name).read_bytes(), v.image_size, v.mean, v.std)


def image_runs(ids: list[int], image_id: int) -> list[int]:
    """The offset of each image's first token."""
    return [i for i, t in enumerate(ids) if t == image_id and (i == 0 or ids[i - 1] != image_id)]


def request(model: engine.Model, ids: list[int], pics: list[images.Preprocessed], n: int = 8) -> GenRequest:
    v = model.card.vision
    offs = image_runs(ids, v.image_id)
    assert len(offs) == len(pics)
    ims = tuple(PromptImage(pixels=p.pixels, digest=p.digest, offset=o, n_tokens=v.n_tokens) for p, o in zip(pics, offs))
    return GenRequest(prompt_ids=list(ids), params=GREEDY, max_tokens=n, images=ims)


def teacher_forced(model: engine.Model, ids: list[int], pics: list[np.ndarray], chunks: list[int]) -> np.ndarray:
    """Every position's logits, the prompt fed in the given chunk lengths, image rows as the engine takes them."""
    v = model.card.vision
    emb = model.encode_images(pics)
    key, rows, k = [], np.zeros((len(ids), model.config.hidden), np.float32), 0
    for i, t in enumerate(ids):
        if t == v.image_id:
            key.append(-1 - k // v.n_tokens)
            rows[i] = emb[k // v.n_tokens, k % v.n_tokens]
            k += 1
        else:
            key.append(t)
    state, out, start = model.new_state(), [], 0
    for n in chunks:
        got, state = model.forward_rows(state, [key[start:start + n]], [0], [start], all_logits=True,
                                        embd=[rows[start:start + n]])
        out.append(got[0, :n])
        start += n
    assert start == len(ids)
    return np.concatenate(out)


def test_preprocessing_matches_hf_processor(model):
    """Resize (PIL bilinear), rescale and normalise exactly as Gemma3ImageProcessorPil did for the oracle."""
    j = fixture()
    ref = np.load(VLM / j["pixels_file"])
    for i, name in enumerate(j["image_files"]):
        got = pixels(name, model)
        assert got.pixels.shape == (3, 64, 64)
        np.testing.assert_allclose(got.pixels, ref[i], atol=1e-6, rtol=0)


@pytest.mark.parametrize("case", ["one", "two"])
def test_teacher_forced_logits_match_float64_oracle(model, case):
    j = fixture()
    c = j["cases"][case]
    ref = np.load(VLM / c["logits_file"])
    pics = list(np.load(VLM / j["pixels_file"])[: c["n_images"]])
    n = len(c["prompt_ids"])
    got = teacher_forced(model, c["prompt_ids"], pics, [min(n, 64)] + ([n - 64] if n > 64 else []))  # 64: no image
    assert np.abs(centered(got) - centered(ref)).max() < TOL


def test_chunked_prefill_around_images_matches_oracle(model):
    """Chunks that end just before, and start just after, each image give the same rows."""
    j = fixture()
    c = j["cases"]["two"]
    ids = c["prompt_ids"]
    offs = image_runs(ids, model.card.vision.image_id)
    cuts = [offs[0], 16, offs[1] - offs[0] - 16, 16]
    chunks = cuts + [len(ids) - sum(cuts)]
    got = teacher_forced(model, ids, list(np.load(VLM / j["pixels_file"])), chunks)
    assert np.abs(centered(got) - centered(np.load(VLM / c["logits_file"]))).max() < TOL


def test_image_tokens_attend_both_ways(model):
    """Gemma 3's image block is bidirectional: computed causally, the rows are far off the oracle."""
    j = fixture()
    c = j["cases"]["one"]
    causal = dataclasses.replace(model.vision, bidirectional=False)
    saved, model.vision = model.vision, causal
    try:
        got = teacher_forced(model, c["prompt_ids"], list(np.load(VLM / j["pixels_file"])[:1]),
                             [len(c["prompt_ids"])])
    finally:
        model.vision = saved
    assert np.abs(centered(got) - centered(np.load(VLM / c["logits_file"]))).max() > 0.1


def settings(**kw) -> Settings:
    base = dict(home=Path("/tmp"), batch_slots=4, queue_depth=32, queue_wait_s=60.0, prefill_chunk=8)
    base.update(kw)
    return Settings(**base)


@pytest.fixture(scope="module")
def sched(model):
    s = BatchScheduler(model, settings(forbid_compile=True, warmup=True))
    yield s
    s.close()


def run(sched, req: GenRequest) -> Collector:
    c = Collector()
    sched.submit(req, c)
    assert c.done.wait(120)
    assert c.finished.reason == "length", c.finished
    return c


@pytest.mark.slow  # a scheduler with every bucket compiled
@pytest.mark.parametrize("case", ["one", "two"])
def test_greedy_through_the_scheduler_equals_oracle(model, sched, case):
    """Chunks of 8 around 16-token images (the scheduler stretches or stops a chunk at an image)."""
    j = fixture()
    c = j["cases"][case]
    pics = [pixels(n, model) for n in j["image_files"][: c["n_images"]]]
    got = run(sched, request(model, c["prompt_ids"], pics))
    assert got.ids == c["greedy_ids"]


@pytest.mark.slow  # a scheduler with every bucket compiled
def test_batched_with_text_streams_equals_alone(model, sched):
    """Two image prompts and two text-only prompts in flight together: each equals running alone."""
    j = fixture()
    one, two = j["cases"]["one"], j["cases"]["two"]
    pa, pb = (pixels(n, model) for n in j["image_files"])
    text = [[2, 4] + one["prompt_ids"][2:12], [2, 4] + two["prompt_ids"][40:60]]
    alone = [list(reference.generate(model, p, GREEDY, max_tokens=10, stop_ids=[])) for p in text]
    reqs = [request(model, one["prompt_ids"], [pa]), request(model, two["prompt_ids"], [pa, pb])]
    reqs += [GenRequest(prompt_ids=p, params=GREEDY, max_tokens=10) for p in text]
    cs = [Collector() for _ in reqs]
    for r, c in zip(reqs, cs):
        sched.submit(r, c)
    for c in cs:
        assert c.done.wait(120)
    assert [c.ids for c in cs] == [one["greedy_ids"], two["greedy_ids"]] + alone


@pytest.mark.slow  # a scheduler with every bucket compiled
def test_prefix_reuse_is_keyed_by_image_content(model):
    """The same ids with another picture reuse nothing past the image's first token; the same picture
    again reuses the whole prompt but its last token."""
    j = fixture()
    ids = j["cases"]["one"]["prompt_ids"]
    pa, pb = (pixels(n, model) for n in j["image_files"])
    off = image_runs(ids, model.card.vision.image_id)[0]
    fresh = BatchScheduler(model, settings(batch_slots=1))
    try:
        alone_b = run(fresh, request(model, ids, [pb])).ids
    finally:
        fresh.close()
    s = BatchScheduler(model, settings(batch_slots=1))
    try:
        first = run(s, request(model, ids, [pa]))
        assert first.ids == j["cases"]["one"]["greedy_ids"]
        other = run(s, request(model, ids, [pb]))
        assert other.finished.reused_tokens <= off
        assert other.ids == alone_b
        same = run(s, request(model, ids, [pb]))
        assert same.finished.reused_tokens == len(ids) - 1
        assert same.ids == alone_b
    finally:
        s.close()


def test_image_to_text_only_model_is_refused():
    path, _, _ = tiny_fixture("gemma3")
    m = engine.load(path, engine.LoadOptions(n_slots=1, max_seq=64, prefill_chunk=16))
    s = BatchScheduler(m, settings(batch_slots=1))
    try:
        pic = images.Preprocessed(pixels=np.zeros((3, 64, 64), np.float32), digest="0" * 64)
        req = GenRequest(prompt_ids=[2, 8, 8], params=GREEDY, max_tokens=2,
                         images=(PromptImage(pixels=pic.pixels, digest=pic.digest, offset=1, n_tokens=2),))
        with pytest.raises(RequestError, match="does not take images"):
            s.submit(req, Collector())
    finally:
        s.close()


def test_projector_checks_at_load(tmp_path):
    """A projector for another width, or a text GGUF given as a projector, fails the load by name."""
    path, _, _ = tiny_fixture("llama")
    with pytest.raises(ModelLoadError, match="does not fit"):
        engine.load(path, engine.LoadOptions(mmproj=str(VLM / "gemma3-vlm.mmproj.gguf"), n_slots=1, max_seq=64))
    with pytest.raises(ModelLoadError, match="not a projector"):
        load(mmproj=str(VLM / "gemma3-vlm.gguf"))


def test_undecodable_and_oversized_images_are_refused():
    with pytest.raises(images.ImageError, match="could not be decoded"):
        images.decode(b"GIF89a not really an image")
    data = (VLM / "image-b.png").read_bytes()
    with pytest.raises(images.ImageError, match="bytes"):
        images.decode(data, images.ImageLimits(max_bytes=100))
    with pytest.raises(images.ImageError, match="pixels"):
        images.decode(data, images.ImageLimits(max_pixels=96 * 80 - 1))
    assert images.decode(data, images.ImageLimits(max_pixels=96 * 80)).size == (80, 96)


def test_chunk_is_raised_to_hold_an_image():
    """Gemma 3's image tokens attend both ways, so the engine's chunk holds at least one image."""
    m = load(prefill_chunk=8, n_slots=1)
    assert m.chunk == 16


def test_model_specs_carry_the_projector(tmp_path):
    """`--mmproj` is written into the model spec the worker reads (before a die list); parse_spec reads it."""
    from pantheon.serving.registry import parse_spec
    from pantheon.web.launch import with_mmproj
    proj = tmp_path / "p.gguf"
    (spec,) = with_mmproj(["vlm=model.gguf@0,1"], str(proj))
    assert spec == f"vlm=model.gguf?mmproj={proj}@0,1"
    assert parse_spec(spec) == parse_spec(f"vlm=model.gguf@0,1").__class__(
        source="model.gguf", name="vlm", dies=(0, 1), mmproj=str(proj))
    assert parse_spec("model.gguf").mmproj is None
    with pytest.raises(ValueError, match="exactly one"):
        with_mmproj(["a.gguf", "b.gguf"], str(proj))
    with pytest.raises(ValueError, match="names no projector"):
        parse_spec("model.gguf?mmproj=")


@pytest.mark.slow  # a scheduler with every bucket compiled
def test_two_choices_fork_after_the_image(model, sched):
    """n = 2: the prompt (image included) is prefilled once and forked; both greedy choices are the oracle's."""
    j = fixture()
    c = j["cases"]["one"]
    req = request(model, c["prompt_ids"], [pixels(j["image_files"][0], model)])
    req = GenRequest(prompt_ids=req.prompt_ids, params=GREEDY, max_tokens=8, images=req.images, n=2)
    from pantheon.types import Finished, Tokens
    col = Collector()
    sched.submit(req, col)
    wait_until(lambda: sum(isinstance(e, Finished) for e in list(col.events)) == 2, 120, "both choices to finish")
    for choice in (0, 1):
        assert [i for e in col.events if isinstance(e, Tokens) and e.choice == choice for i in e.ids] == c["greedy_ids"]
