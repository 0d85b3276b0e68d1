"""Images in requests: decode (PNG, JPEG, WebP), check the limits, and preprocess as the model's processor does.

No JAX here: the web layer decodes and preprocesses an image while it validates the request (a bad
or oversized image is a 400 before anything reaches a scheduler), and hands the scheduler only a
float32 [3, S, S] array and the content hash that keys prefix reuse.

Preprocessing is HF's PIL path for Gemma 3 (`Gemma3ImageProcessorPil`), step for step: transparency
is composited onto white, the image is converted to RGB, resized to S x S with PIL's bilinear filter
(aspect ratio not kept; no pan-and-scan, which is off by default), rescaled by 1/255 (in float64, then
float32) and normalised with the projector's mean and std.
"""

from __future__ import annotations

import hashlib
import io
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
    try:
        img.load()
    except Exception as exc:  # truncated or corrupt data past the header
        raise ImageError(f"the image could not be decoded: {exc}") from None
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
    rgb = to_rgb(img).resize((size, size), resample=Image.Resampling.BILINEAR)
    x = (np.asarray(rgb, dtype=np.uint8).astype(np.float64) * (1 / 255)).astype(np.float32)
    x = (x - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)
    pixels = np.ascontiguousarray(x.transpose(2, 0, 1), dtype=np.float32)
    return Preprocessed(pixels=pixels, digest=hashlib.sha256(pixels.tobytes()).hexdigest())


def load(data: bytes, size: int, mean: tuple[float, float, float], std: tuple[float, float, float],
         limits: ImageLimits = ImageLimits()) -> Preprocessed:
    """decode + preprocess."""
    return preprocess(decode(data, limits), size, mean, std)
