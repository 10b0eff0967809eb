"""An image as a client sends it, checked into the pool's one form (``shared.images``).

Every API family's parser calls these with its own name for the part (``where``:
``"messages[1].content[0]"``), so that a malformed image is an :class:`ImageRefused`
(a 400) naming what the client sent::

    part = image_from_url("data:image/png;base64,iVBOR...", "messages[0].content[1]")
    part = image_from_base64(block["source"]["data"], "image/png", "messages[0].content[0]")

Nothing here decodes an image: base64 becomes the file's bytes, and the file's first
bytes (its signature) must be those of a PNG, JPEG, WebP or GIF. Reading its header
(pixels, frames) and its pixels is the worker's. An ``http(s)`` URL becomes a *pending*
part (``{"type": "image", "url": ..., "part": where}``): the daemon either refuses it or
fetches it (``server.images``) before the request reaches a pool; any other scheme, a
local path included, is refused here.
"""

from __future__ import annotations

import binascii
from collections.abc import Mapping, Sequence
from typing import Any, Final

from modelpool.shared.errors import ImageRefused
from modelpool.shared.images import IMAGE_MEDIA_TYPES, ImageLimits, ImageMediaType

IMAGE_NOTE: Final = "[image omitted: this model reads no images]"
"""What an image sent to a model that reads none becomes (``unsupported_images = "note"``)."""

_DATA_URL_HEADER_CHARS: Final = 256
"""Where a data URL's comma must be (``data:image/png;base64,`` and parameters)."""

_SIGNATURES: tuple[tuple[bytes, int, ImageMediaType], ...] = (
    (b"\x89PNG\r\n\x1a\n", 0, "image/png"),
    (b"\xff\xd8\xff", 0, "image/jpeg"),
    (b"GIF87a", 0, "image/gif"),
    (b"GIF89a", 0, "image/gif"),
    (b"WEBP", 8, "image/webp"),
)


def sniff_media_type(data: bytes) -> ImageMediaType | None:
    """The image type whose signature ``data`` starts with, or None."""
    for signature, offset, media_type in _SIGNATURES:
        if data[offset : offset + len(signature)] == signature:
            if media_type == "image/webp" and data[:4] != b"RIFF":
                continue
            return media_type
    return None


def decode_base64(text: object, where: str, start: int = 0) -> bytes:
    """Strict base64 (no stray characters, padding only at the end) from ``text[start:]``.

    Decoded by pybase64 (SIMD, and it releases the GIL), as vLLM decodes images: Python's
    ``binascii`` held the GIL through ~0.11 s for a 15 MB image, and under ten clients
    sending such images that was 44 % of the time the daemon's threads held the GIL
    (py-spy), while its event loop and every other request stood still; pybase64 takes
    ~0.02 s. ``start`` is where a data URL's payload begins."""
    import pybase64

    if not isinstance(text, str) or len(text) <= start:
        raise ImageRefused(
            f"{where}: the image data must be a non-empty base64 string",
            part=where,
            reason="invalid_base64",
        )
    length = len(text) - start
    if length % 4:
        raise ImageRefused(
            f"{where}: the image data is not valid base64 (its length {length} is not a "
            "multiple of 4)",
            part=where,
            reason="invalid_base64",
        )
    try:
        return pybase64.b64decode(text[start:] if start else text, validate=True)
    except (binascii.Error, ValueError) as exc:
        # ValueError: a character outside ASCII (pybase64 reads a str as ASCII only).
        raise ImageRefused(
            f"{where}: the image data is not valid base64 ({exc})",
            part=where,
            reason="invalid_base64",
        ) from None


def image_part(data: bytes, declared: object, where: str) -> dict[str, Any]:
    """The pool's part for an image file: ``declared`` (the client's media type, None when
    it gave none) must be one served, and the bytes must be an image by their signature;
    a client's mislabel between image types (a JPEG sent as image/png) is forgiven."""
    if declared is not None and declared not in IMAGE_MEDIA_TYPES:
        raise ImageRefused(
            f"{where}: media type {declared!r} is not an image type served "
            f"(served: {', '.join(IMAGE_MEDIA_TYPES)})",
            part=where,
            reason="unsupported_media_type",
        )
    media_type = sniff_media_type(data)
    if media_type is None:
        raise ImageRefused(
            f"{where}: the data is not a PNG, JPEG, WebP or GIF image (its first bytes are "
            f"{data[:8]!r})",
            part=where,
            reason="not_an_image",
        )
    return {"type": "image", "data": data, "media_type": media_type}


def image_from_base64(text: object, media_type: object, where: str) -> dict[str, Any]:
    """A base64 image (Anthropic's ``source.data``, Ollama's ``images``)."""
    return image_part(decode_base64(text, where), media_type, where)


def image_from_url(url: object, where: str) -> dict[str, Any]:
    """A ``data:`` URL's image, or a pending part for an ``http(s)`` one; any other
    scheme (``file:``, a bare path) is refused: nothing local is ever read."""
    if not isinstance(url, str) or not url:
        raise ImageRefused(
            f"{where}: the image URL must be a non-empty string",
            part=where,
            reason="invalid_image_url",
        )
    # Headers are short: partitioning the whole URL would copy a 20 MB image's text.
    scheme = url[:16].partition(":")[0].lower()
    if scheme == "data":
        return _from_data_url(url, where)
    if scheme in ("http", "https"):
        return {"type": "image", "url": url, "part": where}
    raise ImageRefused(
        f"{where}: an image URL must be a data: URL (data:image/png;base64,...) or an "
        f"http(s) URL; {url[:40]!r} is neither (local files are never read)",
        part=where,
        reason="invalid_image_url",
    )


def _from_data_url(url: str, where: str) -> dict[str, Any]:
    comma = url.find(",", 0, _DATA_URL_HEADER_CHARS)
    params = url[len("data:") : max(comma, 0)].split(";")
    if comma < 0 or params[-1].lower() != "base64":
        raise ImageRefused(
            f"{where}: a data URL must be data:<image type>;base64,<data>",
            part=where,
            reason="invalid_image_url",
        )
    media_type = params[0].lower()
    if media_type not in IMAGE_MEDIA_TYPES:
        raise ImageRefused(
            f"{where}: the data URL's type {params[0]!r} is not an image type served "
            f"(served: {', '.join(IMAGE_MEDIA_TYPES)})",
            part=where,
            reason="unsupported_media_type",
        )
    return image_part(decode_base64(url, where, start=comma + 1), media_type, where)


def part_name(part: Mapping[str, Any], message: int, index: int, prefix: str) -> str:
    """The name of an image part: the client's own, as its parser recorded it, else its
    place in the prompt (``prefix`` is ``"messages"`` or ``"prompt"``)."""
    name = part.get("part")
    return name if isinstance(name, str) else f"{prefix}[{message}].content[{index}]"


def check_image_limits(messages: object, limits: ImageLimits, prefix: str = "messages") -> int:
    """What needs no decoding: at most ``max_images`` images, each of at most
    ``max_bytes``; returns how many there are. A pending (remote) image counts too; its
    bytes are bounded when it is fetched."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        return 0
    count = 0
    for message_index, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, list):
            continue
        for index, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "image":
                continue
            count += 1
            where = part_name(part, message_index, index, prefix)
            if count > limits.max_images:
                raise ImageRefused(
                    f"{where}: at most {limits.max_images} images in one request "
                    "(image_limits.max_images)",
                    part=where,
                    reason="too_many_images",
                )
            data = part.get("data")
            if isinstance(data, (bytes, bytearray, memoryview)) and len(data) > limits.max_bytes:
                raise ImageRefused(
                    f"{where}: the image is {len(data)} bytes, over the {limits.max_bytes} "
                    "allowed (image_limits.max_bytes)",
                    part=where,
                    reason="image_too_large",
                )
    return count


def omit_images(messages: Sequence[Mapping[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """The messages with each image replaced by :data:`IMAGE_NOTE`, and how many were; a
    content left with text alone is one string again, as a text-only model's template
    expects."""
    converted: list[dict[str, Any]] = []
    omitted = 0
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            converted.append(dict(message))
            continue
        texts = []
        for part in content:
            if part.get("type") == "image":
                omitted += 1
                texts.append(IMAGE_NOTE)
            else:
                texts.append(str(part.get("text", "")))
        converted.append({**message, "content": "\n".join(texts)})
    return converted, omitted
