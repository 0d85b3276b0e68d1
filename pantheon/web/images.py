"""Images in chat messages: OpenAI `image_url` content parts -> preprocessed pixels and template parts.

A part is `{"type": "image_url", "image_url": {"url": "data:image/png;base64,...", "detail": "auto"}}`.
The server takes `data:` URLs (PNG, JPEG, WebP). It never fetches an arbitrary URL: an http(s) URL is a
400 unless it starts with one of the prefixes of PANTHEON_IMAGE_URL_ALLOWLIST, and then it is fetched
with a timeout, without following redirects, and at most PANTHEON_MAX_IMAGE_BYTES are read.

Every failure is a 400 naming the part (`messages[i].content[j].image_url.url`): a model without a
vision projector, more than PANTHEON_MAX_IMAGES images, a malformed URL or base64, a format Pillow does
not decode, an image over the byte or pixel limit. In two steps, so a prompt is admitted before any
pixel is decoded: `plan_images` reads each image to its header (size, so the image's tokens and prompt
text), then admission holds the prompt to the context, then `decode_images` decodes and tiles, in the
server's bounded image pool (PANTHEON_IMAGE_THREADS, PANTHEON_IMAGE_QUEUE, past that 429) -- all before
the request reaches a scheduler, so a bad image costs nothing on the device.
"""

from __future__ import annotations

import base64
import binascii
import copy
import re
from dataclasses import dataclass
from typing import Any

from pantheon.errors import RequestError
from pantheon.formats import images
from pantheon.types import PromptImage

_DATA_URL = re.compile(r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[^;,]*)*)(?P<b64>;base64)?,", re.I)
FETCH_TIMEOUT_S = 10.0


def _bad(param: str, message: str, code: str | None = None) -> RequestError:
    return RequestError(f"{param}: {message}", param=param, code=code)


def image_parts(messages: list[dict]) -> list[tuple[int, int, dict]]:
    """(message index, part index, image_url object) of every image part, in prompt order."""
    out = []
    for i, m in enumerate(messages):
        c = m.get("content")
        if isinstance(c, list):
            out.extend((i, j, p["image_url"]) for j, p in enumerate(c) if isinstance(p, dict)
                       and p.get("type") == "image_url")
    return out


def _data(url: str, param: str, max_bytes: int) -> bytes:
    m = _DATA_URL.match(url)
    if m is None or not m.group("b64"):
        raise _bad(param, "must be a base64 data URL (data:image/png;base64,...)")
    mime = (m.group("mime") or "").lower()
    if mime and not mime.startswith("image/"):
        raise _bad(param, f"a data URL of type {mime!r} is not an image")
    payload = url[m.end():]
    if len(payload) * 3 // 4 > max_bytes + 3:
        raise _bad(param, f"the image is over {max_bytes} bytes (PANTHEON_MAX_IMAGE_BYTES)", code="image_too_large")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise _bad(param, "the data URL's base64 is malformed") from None


def _fetch(url: str, param: str, max_bytes: int) -> bytes:
    """GET an allowlisted URL: no redirects (they could leave the allowlist), a timeout, a size cap."""
    import urllib.error
    import urllib.request

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args: Any, **kwargs: Any) -> None:
            return None

    opener = urllib.request.build_opener(NoRedirect)
    try:
        with opener.open(urllib.request.Request(url, headers={"User-Agent": "pantheon"}), timeout=FETCH_TIMEOUT_S) as r:
            if r.status != 200:
                raise _bad(param, f"fetching the image answered HTTP {r.status}")
            data = r.read(max_bytes + 1)
    except RequestError:
        raise
    except urllib.error.HTTPError as exc:
        raise _bad(param, f"fetching the image answered HTTP {exc.code}") from None
    except Exception as exc:
        raise _bad(param, f"the image could not be fetched: {type(exc).__name__}") from None
    if len(data) > max_bytes:
        raise _bad(param, f"the image is over {max_bytes} bytes (PANTHEON_MAX_IMAGE_BYTES)", code="image_too_large")
    return data


def image_bytes(url: Any, param: str, settings: Any) -> bytes:
    """The encoded bytes an image part names: a data URL's payload, or an allowlisted URL's body."""
    if not isinstance(url, str) or not url:
        raise _bad(param, "must be a non-empty string")
    if url[:5].lower() == "data:":
        return _data(url, param, settings.max_image_bytes)
    allow = tuple(settings.image_url_allowlist)
    if url.lower().startswith(("http://", "https://")) and any(url.startswith(p) for p in allow):
        return _fetch(url, param, settings.max_image_bytes)
    if url.lower().startswith(("http://", "https://")):
        raise _bad(param, "remote image URLs are not fetched by this server (send the image as a data: URL, or "
                          "configure PANTHEON_IMAGE_URL_ALLOWLIST)", code="image_url_not_allowed")
    raise _bad(param, "must be a data: URL (or an http(s) URL on the server's allowlist)")


@dataclass(frozen=True)
class ImagePart:
    """One image part read as far as its header: its encoded bytes and the tile grid its size gives
    ((0, 0): one tile, or an untiled model). No pixel has been decoded yet."""

    param: str  # messages[i].content[j].image_url.url, for a 400 that names it
    data: bytes
    rows: int
    cols: int


def _image_error(param: str, exc: images.ImageError) -> RequestError:
    return _bad(param, str(exc), code="image_too_large" if "at most" in str(exc) else "invalid_image")


def plan_images(messages: list[dict], card: Any, settings: Any) -> tuple[list[dict], list[ImagePart], list[str]]:
    """The messages with each image part turned into the template's image part; each image read to its
    header (`ImagePart`); and the text each image's marker becomes (`expand`) -- everything admission
    needs to count the prompt's image tokens against the context, with no pixel decoded.

    Why split from decoding: 4 chats x 8 images at the pixel limit spent 17-18 s and +890 MB each
    decoding and tiling, and only then got 400 context_length_exceeded (issue 43). Blocking (base64,
    maybe a fetch): call it off the hub when the request has images; 400 on any bad part."""
    parts = image_parts(messages)
    if not parts:
        return messages, [], []
    first = f"messages[{parts[0][0]}].content[{parts[0][1]}]"
    vision = getattr(card, "vision", None)
    if vision is None:
        raise RequestError(f"{first}: model {card.name!r} does not take images (it was loaded without a vision "
                           "projector: --mmproj)", param=first, code="model_not_multimodal")
    if len(parts) > settings.max_images:
        raise RequestError(f"messages: {len(parts)} images; at most {settings.max_images} are accepted per request "
                           "(PANTHEON_MAX_IMAGES)", param="messages", code="too_many_images")
    limits = _limits(settings)
    planned: list[ImagePart] = []
    texts: list[str] = []
    for i, j, obj in parts:
        param = f"messages[{i}].content[{j}].image_url.url"
        data = image_bytes(obj.get("url"), param, settings)
        try:
            width, height = images.size(data, limits)
        except images.ImageError as exc:
            raise _image_error(param, exc) from None
        rows, cols = images.grid(width, height, vision.image_size, vision.tiling) if vision.tiling else (0, 0)
        planned.append(ImagePart(param, data, rows, cols))
        texts.append(vision.expansion_for(rows, cols) if vision.tiling else vision.expansion)
    msgs = copy.copy(messages)
    for i, j, _ in parts:
        m = dict(msgs[i])
        content = list(m["content"])
        content[j] = {"type": "image", "marker": vision.marker}
        m["content"] = content
        msgs[i] = m
    return msgs, planned, texts


def _limits(settings: Any) -> images.ImageLimits:
    return images.ImageLimits(max_bytes=settings.max_image_bytes, max_pixels=settings.max_image_pixels)


def decode_images(parts: list[ImagePart], card: Any, settings: Any) -> list[images.Preprocessed]:
    """The encoder's inputs for `plan_images`' parts, in prompt order: one per image, or for a tiling model
    (Idefics3) each image's tiles then its whole image. The expensive part (decoding, resizing, tiling):
    run it after admission, in the server's bounded image pool (`ServerState.images`)."""
    vision = card.vision
    limits = _limits(settings)
    out: list[images.Preprocessed] = []
    for part in parts:
        try:
            if vision.tiling:
                cut = images.tiles(images.decode(part.data, limits), vision.image_size, vision.tiling, vision.mean,
                                   vision.std)
                if (cut.rows, cut.cols) != (part.rows, part.cols):  # the header's arithmetic is the cut's own
                    raise images.ImageError(f"the image decoded to a {cut.rows} x {cut.cols} grid, its header "
                                            f"said {part.rows} x {part.cols}")
                out.extend(cut.tiles)
            else:
                out.append(images.load(part.data, vision.image_size, vision.mean, vision.std, limits))
        except images.ImageError as exc:
            raise _image_error(part.param, exc) from None
    return out


def load_images(messages: list[dict], card: Any, settings: Any
                ) -> tuple[list[dict], list[images.Preprocessed], list[str]]:
    """`plan_images` then `decode_images` at once (for callers with no admission step between them)."""
    msgs, parts, texts = plan_images(messages, card, settings)
    return msgs, decode_images(parts, card, settings), texts


def expand(rendered: str, card: Any, texts: list[str] | None = None) -> str:
    """The rendered prompt with each image marker replaced by its image's text (`load_images`; default:
    the model's one expansion), as HF's processor does before tokenizing. Turns dropped to fit the
    context took their markers with them, so the markers left are the last images'."""
    v = card.vision
    if texts is None:
        return rendered.replace(v.marker, v.expansion)
    pieces = rendered.split(v.marker)
    k = len(pieces) - 1
    if k > len(texts):  # the text itself spelled the marker: prompt_images refuses the extra runs
        texts = [v.expansion] * (k - len(texts)) + list(texts)
    mine = texts[len(texts) - k:] if k else []
    return pieces[0] + "".join(t + p for t, p in zip(mine, pieces[1:]))


def prompt_images(ids: list[int], pics: list[images.Preprocessed], card: Any, embd: Any = None
                  ) -> tuple[PromptImage, ...]:
    """Where each image's embeddings go in the tokenized prompt: runs of the image token, n_tokens each.

    Turns dropped to fit the context take their images with them (the oldest first), so the runs
    found belong to the last images. A run of another length, or more runs than images, means the
    prompt's own text spelled the image tokens: refused."""
    v = card.vision
    runs, i = [], 0
    while i < len(ids):
        if ids[i] == v.image_id:
            j = i
            while j < len(ids) and ids[j] == v.image_id:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    if len(runs) > len(pics) or any(n != v.n_tokens for _, n in runs):
        raise RequestError("messages: the text contains the model's image tokens (or image markers) outside "
                           "image parts", param="messages", code="invalid_image")
    first = len(pics) - len(runs)
    return tuple(PromptImage(pixels=p.pixels, digest=p.digest, offset=o, n_tokens=n,
                             embd=None if embd is None else embd[first + k])
                 for k, (p, (o, n)) in enumerate(zip(pics[first:], runs)))
