"""The projector file of a vision-language model: llama.cpp's `mmproj` GGUF (`general.architecture = clip`).

A VLM ships as two GGUFs: the text model (an ordinary `gemma3` / `llama` / ... file Pantheon already
runs) and this one, which holds the vision encoder (a ViT: `v.*` tensors) and the projector that maps
its output into the text model's embedding space (`mm.*`). This module reads its header into a
`VisionConfig` (what the encoder and the image preprocessing need) and hands out its tensors through
the same `TensorSource` as the text file. Which projector types are implemented is the vision
registry's business (`pantheon.jax_models.siglip`); an unknown one is refused here by name, so
`--mmproj` with a file from another family fails at load and says what it got.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pantheon.errors import ModelLoadError
from pantheon.formats.gguf_loader import TensorSource, _float, _int
from pantheon.formats.gguf_reader import open_reader, read_metadata

# projector type (clip.projector_type) -> whether image tokens attend to each other both ways in the
# text model (Gemma 3: HF's token_type_ids block mask, llama.cpp's non-causal image batch; Idefics3 /
# SmolVLM: plain causal attention over the image tokens, as HF's Llama text model runs them)
PROJECTORS: dict[str, bool] = {"gemma3": True, "idefics3": False}


@dataclass(frozen=True)
class VisionConfig:
    """The encoder's shape and the image preprocessing, from the mmproj header."""

    projector: str  # clip.projector_type
    image_size: int  # what the encoder sees: image_size x image_size (Gemma 3: the whole image; Idefics3: one tile)
    patch_size: int
    hidden: int  # the ViT width
    ffn: int
    n_layers: int
    n_heads: int
    eps: float  # the ViT's LayerNorm eps (also the projector's RMSNorm eps for Gemma 3)
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    text_hidden: int  # clip.vision.projection_dim: the text model's embedding width
    merge: int  # the projector's pooling factor per side (clip.vision.projector.scale_factor; Gemma 3: 4)
    bidirectional: bool  # the text model attends both ways inside one image's tokens
    longest_edge: int = 0  # Idefics3: clip.vision.preproc_image_size, the longest side an image is resized
    # to before it is cut into image_size tiles (0: no tiling, one image_size x image_size image)

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def tokens_per_image(self) -> int:
        """Embeddings one image (Idefics3: one tile) becomes in the text model (Gemma 3: (64 / 4)^2 = 256;
        SmolVLM-256M: (512 / 16 / 4)^2 = 64, by average pooling or by the pixel shuffle alike)."""
        side = self.patches_per_side // self.merge
        return side * side


@dataclass
class MmprojFile:
    path: Path
    meta: dict[str, Any]
    config: VisionConfig
    tensors: TensorSource


def _triple(meta: dict[str, Any], key: str, default: float, path: Path) -> tuple[float, float, float]:
    val = meta.get(key, [default] * 3)
    if not isinstance(val, list) or len(val) != 3 or not all(isinstance(v, (int, float)) for v in val):
        raise ModelLoadError(path, f"metadata {key!r} = {val!r} is not three numbers")
    if key.endswith("std") and any(v <= 0 for v in val):
        raise ModelLoadError(path, f"metadata {key!r} = {val!r} must be positive")
    return (float(val[0]), float(val[1]), float(val[2]))


def config_from_metadata(path: Path, meta: dict[str, Any]) -> VisionConfig:
    if meta.get("general.architecture") != "clip":
        raise ModelLoadError(path, f"not a projector (mmproj) file: general.architecture is "
                                   f"{meta.get('general.architecture')!r}, expected 'clip'")
    if not meta.get("clip.has_vision_encoder", False):
        raise ModelLoadError(path, "the projector file has no vision encoder (clip.has_vision_encoder is false)")
    proj = meta.get("clip.projector_type") or meta.get("clip.vision.projector_type")
    if proj not in PROJECTORS:
        raise ModelLoadError(path, f"projector type {proj!r} is not supported (supported: {', '.join(PROJECTORS)})")
    p = "clip.vision."
    image_size = _int(meta, p + "image_size", path=path, lo=1, hi=1 << 14, required=True)
    patch = _int(meta, p + "patch_size", path=path, lo=1, hi=1 << 10, required=True)
    merge = _int(meta, p + "projector.scale_factor", 4, path=path, lo=1, hi=1 << 10)
    if image_size % patch or (image_size // patch) % merge:
        raise ModelLoadError(path, f"image size {image_size} is not a whole number of {patch}-pixel patches "
                                   f"pooled {merge} x {merge}")
    hidden = _int(meta, p + "embedding_length", path=path, lo=1, hi=1 << 16, required=True)
    heads = _int(meta, p + "attention.head_count", path=path, lo=1, hi=1 << 12, required=True)
    if hidden % heads:
        raise ModelLoadError(path, f"vision width {hidden} is not divisible by {heads} heads")
    return VisionConfig(
        projector=proj, image_size=image_size, patch_size=patch, hidden=hidden,
        ffn=_int(meta, p + "feed_forward_length", path=path, lo=1, hi=1 << 20, required=True),
        n_layers=_int(meta, p + "block_count", path=path, lo=1, hi=1 << 10, required=True), n_heads=heads,
        eps=_float(meta, p + "attention.layer_norm_epsilon", 1e-6, path=path, positive=True),
        mean=_triple(meta, p + "image_mean", 0.5, path), std=_triple(meta, p + "image_std", 0.5, path),
        text_hidden=_int(meta, p + "projection_dim", path=path, lo=1, hi=1 << 20, required=True),
        merge=merge, bidirectional=PROJECTORS[proj],
        longest_edge=_longest_edge(meta, proj, image_size, path))


def _longest_edge(meta: dict[str, Any], proj: str, image_size: int, path: Path) -> int:
    """Idefics3's tiling size: the converter writes the processor's `size.longest_edge` (SmolVLM-256M:
    2048, four 512-pixel tiles a side). Every image's longer side is resized to it before tiling, so
    one smaller than a tile would be a file from another processor: refused."""
    if proj != "idefics3":
        return 0
    edge = _int(meta, "clip.vision.preproc_image_size", image_size, path=path, lo=1, hi=1 << 15)
    if edge < image_size:
        raise ModelLoadError(path, f"clip.vision.preproc_image_size {edge} is smaller than one {image_size}-pixel tile")
    return edge


def open_mmproj(path: str | Path) -> MmprojFile:
    """Read and check a projector GGUF's header (tensors stay mapped, read on demand)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ModelLoadError(p, "projector file not found")
    reader = open_reader(p)
    meta = read_metadata(reader, p)
    return MmprojFile(path=p, meta=meta, config=config_from_metadata(p, meta), tensors=TensorSource(p, reader))
