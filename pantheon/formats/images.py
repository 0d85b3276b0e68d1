"""Images in requests: decode (PNG, JPEG, WebP), check the limits, and preprocess as the model's processor does.

No JAX here: the web layer decodes and preprocesses an image while it validates the request (a bad
or oversized image is a 400 before anything reaches a scheduler), and hands the scheduler only a
float32 [3, S, S] array and the content hash that keys prefix reuse.

Preprocessing is HF's PIL path, step for step. Gemma 3 (`Gemma3ImageProcessorPil`): transparency
is composited onto white, the image is converted to RGB, resized to S x S with PIL's bilinear filter
(aspect ratio not kept; no pan-and-scan, which is off by default), rescaled by 1/255 (in float64, then
float32) and normalised with the projector's mean and std. Idefics3 / SmolVLM
(`Idefics3ImageProcessorPil`, `tiles`): the same RGB conversion, then Lanczos resizes on the 8-bit
image and a cut into S x S tiles plus the whole image downscaled to S x S, each tile rescaled and
normalised as above.
"""

from __future__ import annotations

import hashlib
import io
import math
from dataclasses import dataclass

import numpy as np

FORMATS = ("PNG", "JPEG", "WEBP")


class ImageError(ValueError):
    """An image that cannot be used: undecodable, of another format, or over a limit (a 400)."""


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int = 10 << 20  # encoded size
    max_pixels: int = 16_000_000  # width x height once decoded (checked before the pixels are decoded)


@dataclass(frozen=True)
class Preprocessed:
    """One image, ready for the encoder: pixels f32 [3, S, S] and the sha256 of those pixels (so two
    encodings of the same picture share a prefix, and any pixel that differs does not)."""

    pixels: np.ndarray
    digest: str


def decode(data: bytes, limits: ImageLimits = ImageLimits()):
    """A PIL image from encoded bytes, or ImageError saying why not."""
    img = opened(data, limits)
    try:
        img.load()
    except Exception as exc:  # truncated or corrupt data past the header
        raise ImageError(f"the image could not be decoded: {exc}") from None
    return img


def size(data: bytes, limits: ImageLimits = ImageLimits()) -> tuple[int, int]:
    """(width, height) from the image's header alone, within `limits`, or ImageError: what admission needs
    to know how many tokens the image will take, before any pixel is decoded."""
    return opened(data, limits).size


def opened(data: bytes, limits: ImageLimits = ImageLimits()):
    """A PIL image with only its header read (no pixel decoded yet), checked against `limits`."""
    from PIL import Image, UnidentifiedImageError
    if len(data) > limits.max_bytes:
        raise ImageError(f"the image is {len(data)} bytes; at most {limits.max_bytes} are accepted")
    if not data:
        raise ImageError("the image is empty")
    try:
        img = Image.open(io.BytesIO(data), formats=FORMATS)
    except UnidentifiedImageError:
        raise ImageError(f"the image could not be decoded (supported formats: {', '.join(FORMATS)})") from None
    except Exception as exc:
        raise ImageError(f"the image could not be decoded: {exc}") from None
    w, h = img.size
    if w < 1 or h < 1 or w * h > limits.max_pixels:
        raise ImageError(f"the image is {w} x {h} pixels; at most {limits.max_pixels} pixels are accepted")
    return img


def to_rgb(img):
    """RGB, with any transparency composited onto a white background (HF's convert_to_rgb)."""
    from PIL import Image
    if "A" in img.getbands() or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return img.convert("RGB")


def preprocess(img, size: int, mean: tuple[float, float, float], std: tuple[float, float, float]) -> Preprocessed:
    """Resize to size x size (bilinear), rescale to [0, 1], normalise per channel: f32 [3, size, size]."""
    from PIL import Image
    return _normalised(to_rgb(img).resize((size, size), resample=Image.Resampling.BILINEAR), mean, std)


@dataclass(frozen=True)
class Tiled:
    """One image cut as Idefics3's processor cuts it: `tiles` row-major (rows x cols of them), then the
    whole image downscaled, each S x S; rows = cols = 0 when the image is one tile (then `tiles` holds
    just that one)."""

    tiles: tuple[Preprocessed, ...]
    rows: int
    cols: int


MAX_SIDE = 4096  # HF's Idefics3 bound on either side after the first resize


def _fit_longest(h: int, w: int, longest: int) -> tuple[int, int]:
    """HF's first Idefics3 resize: the longer side to `longest`, the other by the aspect ratio, truncated
    and then rounded up to even; then both under MAX_SIDE. The float arithmetic is HF's, term for term,
    so the sizes agree to the pixel."""
    aspect = w / h
    if w >= h:
        w = longest
        h = int(w / aspect)
        h += h % 2
    else:
        h = longest
        w = int(h * aspect)
        w += w % 2
    h, w = max(h, 1), max(w, 1)
    aspect = w / h
    if w >= h and w > MAX_SIDE:
        w, h = MAX_SIDE, int(MAX_SIDE / aspect)
    elif h > w and h > MAX_SIDE:
        h, w = MAX_SIDE, int(MAX_SIDE * aspect)
    return max(h, 1), max(w, 1)


def _whole_tiles(h: int, w: int, tile: int) -> tuple[int, int]:
    """HF's `resize_for_vision_encoder`: the longer side up to a multiple of the tile, the other side by the
    aspect ratio and then up to a multiple of the tile too."""
    aspect = w / h
    if w >= h:
        w = math.ceil(w / tile) * tile
        h = math.ceil(int(w / aspect) / tile) * tile
    else:
        h = math.ceil(h / tile) * tile
        w = math.ceil(int(h * aspect) / tile) * tile
    return h, w


def grid(width: int, height: int, tile: int, longest: int) -> tuple[int, int]:
    """(rows, cols) of tiles `tiles` cuts an image of this size into ((0, 0): one tile), from the size
    alone -- the same arithmetic, so the image's prompt text is known from its header."""
    h, w = _whole_tiles(*_fit_longest(height, width, longest), tile)
    return (0, 0) if h <= tile and w <= tile else (h // tile, w // tile)


def tiles(img, tile: int, longest: int, mean: tuple[float, float, float],
          std: tuple[float, float, float]) -> Tiled:
    """Idefics3's preprocessing (image splitting on, as SmolVLM's processors ship): resize (Lanczos) so
    the longer side is `longest`, resize again to whole tiles, cut row-major into tile x tile crops and
    append the whole image resized to tile x tile; every resize on the 8-bit image, as HF's PIL path."""
    from PIL import Image
    lanczos = Image.Resampling.LANCZOS
    rgb = to_rgb(img)
    h, w = _fit_longest(rgb.height, rgb.width, longest)
    rgb = rgb.resize((w, h), resample=lanczos)
    h, w = _whole_tiles(h, w, tile)
    rgb = rgb.resize((w, h), resample=lanczos)
    if h <= tile and w <= tile:
        return Tiled(tiles=(_normalised(rgb, mean, std),), rows=0, cols=0)
    rows, cols = h // tile, w // tile
    crops = [rgb.crop((c * tile, r * tile, (c + 1) * tile, (r + 1) * tile)) for r in range(rows) for c in range(cols)]
    crops.append(rgb.resize((tile, tile), resample=lanczos))
    return Tiled(tiles=tuple(_normalised(c, mean, std) for c in crops), rows=rows, cols=cols)


def _normalised(rgb, mean: tuple[float, float, float], std: tuple[float, float, float]) -> Preprocessed:
    """8-bit RGB -> f32 [3, H, W]: rescaled by 1/255 (float64, then float32), then normalised."""
    x = (np.asarray(rgb, dtype=np.uint8).astype(np.float64) * (1 / 255)).astype(np.float32)
    x = (x - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)
    pixels = np.ascontiguousarray(x.transpose(2, 0, 1), dtype=np.float32)
    return Preprocessed(pixels=pixels, digest=hashlib.sha256(pixels.tobytes()).hexdigest())


def load(data: bytes, size: int, mean: tuple[float, float, float], std: tuple[float, float, float],
         limits: ImageLimits = ImageLimits()) -> Preprocessed:
    """decode + preprocess."""
    return preprocess(decode(data, limits), size, mean, std)
