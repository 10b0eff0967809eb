"""Decoding a request's images in the worker: untrusted bytes, bounded before a pixel is read.

The daemon never decodes an image (its event loop and the supervisor's thread stay free):
the canonical parts of :mod:`modelpool.shared.images` travel as the client's encoded bytes,
and the backend that reads images decodes them here, in the worker process. What a file
declares is checked before it is decoded, from its header (Pillow opens lazily):

=====================  ==========================================================
reason                 refused when
=====================  ==========================================================
``malformed``          the part has no bytes, or a media type that is not an image's
``too_large``          its encoded bytes exceed ``max_bytes``
``not_an_image``       Pillow recognises no image format in the bytes
``media_type_mismatch``  the bytes are another format than the media type says
``too_many_pixels``    width times height declared exceeds ``max_pixels`` (or Pillow's
                       own decompression-bomb bound)
``too_many_frames``    an animation declares more frames than ``max_frames``
``truncated``          the file ends, or its data stream breaks, before the image does
``corrupt``            the decoder rejects the data in any other way
=====================  ==========================================================

Each refusal is an :class:`~modelpool.shared.errors.ImageRefused` naming the part
(``"messages[1].content[0]"``): the worker answers it as a refusal (kind ``"invalid"``),
a 400 to an HTTP client, and stays warm. A decoder that crashes the process (a native
bug on a crafted file) takes the worker down with the one request in it: the pool's
poison-request rule then refuses that request rather than retrying it into every worker.

The limits come from the pool (``PoolConfig.image_limits``), through ``WorkerSpec``:
:func:`configure` is called once when the worker starts, before its backend loads.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from modelpool.shared.errors import ImageRefused
from modelpool.shared.images import IMAGE_MEDIA_TYPES, ImageLimits, image_parts

if TYPE_CHECKING:
    from PIL import Image

# Pillow's format names for each media type of shared.images.
_FORMATS: Final[dict[str, str]] = {
    "image/png": "PNG",
    "image/jpeg": "JPEG",
    "image/webp": "WEBP",
    "image/gif": "GIF",
}

_limits = ImageLimits()


def configure(limits: ImageLimits) -> None:
    """Set this worker's limits (from its ``WorkerSpec``); once, before the backend loads."""
    global _limits
    _limits = limits


def current_limits() -> ImageLimits:
    """The limits this worker decodes under."""
    return _limits


@dataclass(frozen=True)
class DecodedImage:
    """One image part, decoded: ``image`` is an RGB bitmap, ``data`` its encoded bytes."""

    part: str
    """Where it was: ``"messages[1].content[0]"``."""
    image: Image.Image
    format: str
    """Pillow's name of its format (``"PNG"``)."""
    data: bytes
    media_type: str


def image_locations(messages: object) -> list[tuple[str, Mapping[str, Any]]]:
    """Each image part of a chat prompt with its location, in order (none for a string
    or token ids)."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        return []
    found: list[tuple[str, Mapping[str, Any]]] = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            continue
        content = message.get("content")
        if not image_parts(content):
            continue
        assert isinstance(content, Sequence)  # image_parts found parts in it
        for position, part in enumerate(content):
            if isinstance(part, Mapping) and part.get("type") == "image":
                found.append((f"messages[{index}].content[{position}]", part))
    return found


def refuse_images(messages: object, model: str) -> None:
    """A backend serving a model that reads no images: an image part is refused (the
    daemon replaces them before they get here; the embedded pool gets this error)."""
    located = image_locations(messages)
    if located:
        part = located[0][0]
        raise ImageRefused(
            f"{part}: this model reads no images ({model})",
            part=part,
            reason="model_not_multimodal",
        )


def decode_prompt_images(messages: object, limits: ImageLimits | None = None) -> list[DecodedImage]:
    """Every image of a chat prompt decoded, in order; the first one refused raises."""
    bounds = _limits if limits is None else limits
    located = image_locations(messages)
    if len(located) > bounds.max_images:
        part = located[bounds.max_images][0]
        raise ImageRefused(
            f"{part}: more than {bounds.max_images} images in one request",
            part=part,
            reason="too_many_images",
        )
    return [decode_image(part, where, bounds) for where, part in located]


def decode_image(part: Mapping[str, Any], where: str, limits: ImageLimits) -> DecodedImage:
    """One image part decoded to RGB, or an :class:`ImageRefused` saying why not."""
    from PIL import Image

    data, media_type = part.get("data"), part.get("media_type")
    if not isinstance(data, (bytes, bytearray)) or not data:
        raise _refused(where, "malformed", "the image part carries no bytes")
    if media_type not in IMAGE_MEDIA_TYPES:
        raise _refused(
            where,
            "malformed",
            f"media type {media_type!r} is not one of {', '.join(IMAGE_MEDIA_TYPES)}",
        )
    if len(data) > limits.max_bytes:
        raise _refused(
            where, "too_large", f"{len(data)} bytes, over the limit of {limits.max_bytes}"
        )
    encoded = bytes(data)
    with warnings.catch_warnings():
        # Our own bound (max_pixels) decides; Pillow's warning below its hard bound is noise.
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        image = _open(encoded, where, limits)
        expected = _FORMATS[str(media_type)]
        if image.format != expected:
            raise _refused(
                where,
                "media_type_mismatch",
                f"sent as {media_type} but the bytes are {image.format or 'unknown'}",
            )
        frames = int(getattr(image, "n_frames", 1))
        if frames > limits.max_frames:
            raise _refused(
                where,
                "too_many_frames",
                f"{frames} frames, over the limit of {limits.max_frames}",
            )
        rgb = _load(image, where)
    return DecodedImage(where, rgb, expected, encoded, str(media_type))


def _open(encoded: bytes, where: str, limits: ImageLimits) -> Image.Image:
    """The image with only its header read, its declared size within the limits."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(encoded), formats=list(_FORMATS.values()))
    except Image.DecompressionBombError as exc:
        raise _refused(where, "too_many_pixels", str(exc)) from None
    except UnidentifiedImageError:
        raise _refused(where, "not_an_image", "the bytes are no image this server reads") from None
    except (OSError, SyntaxError, ValueError) as exc:
        # A header Pillow recognised and could not read: cut short, or broken.
        reason = "truncated" if "truncated" in str(exc) or isinstance(exc, EOFError) else "corrupt"
        raise _refused(where, reason, f"its header cannot be read: {exc}") from None
    width, height = image.size
    if width <= 0 or height <= 0:
        raise _refused(where, "corrupt", f"it declares a {width}x{height} canvas")
    if width * height > limits.max_pixels:
        raise _refused(
            where,
            "too_many_pixels",
            f"it declares {width}x{height} = {width * height} pixels, over the limit of "
            f"{limits.max_pixels}",
        )
    return image


def _load(image: Image.Image, where: str) -> Image.Image:
    """Decode the first frame's pixels, as RGB."""
    try:
        image.load()
        return image.convert("RGB")
    except (OSError, EOFError) as exc:
        text = str(exc)
        reason = "truncated" if "truncated" in text or "broken" in text else "corrupt"
        raise _refused(where, reason, f"it cannot be decoded: {text}") from None
    except (SyntaxError, ValueError, MemoryError) as exc:
        raise _refused(where, "corrupt", f"it cannot be decoded: {exc}") from None


def _refused(where: str, reason: str, detail: str) -> ImageRefused:
    return ImageRefused(f"{where}: image refused ({reason}): {detail}", part=where, reason=reason)


def describe(image: DecodedImage) -> str:
    """``"64x48 PNG"``: what the testing backend says of an image it read."""
    width, height = image.image.size
    return f"{width}x{height} {image.format}"
