"""Images on the testing backend: a "vision model" without weights.

With ``backend_options = {"vision": True}`` the testing backend reads the image parts of a
chat prompt (``{"type": "image", "data": ..., "media_type": ...}``, see
:mod:`modelpool.shared.images`): it decodes each through the worker's decoder
(:mod:`modelpool.worker.images`, with its limits and refusals), and its answer starts
with one line per image, numbered over the whole prompt::

    image 1: 64x48 PNG
    image 2: 10x10 JPEG

then goes on as the prompt's text commands it (``echo:``, ``tokens:``, ...: the last
message's text parts, joined). Each image counts :data:`IMAGE_TOKENS` prompt tokens.

Without ``vision`` an image part is an :class:`~modelpool.shared.errors.ImageRefused`
(reason ``model_not_multimodal``): the daemon replaces images for a text-only model, and
the embedded pool's caller gets that typed refusal.

A PNG whose text chunk ``modelpool-fault`` is ``segfault`` crashes the worker once its
header has been read, as a decoder bug on a crafted file would: the request that carried
it costs one request, never the pool (see :func:`fault_png`).
"""

from __future__ import annotations

import ctypes
import io
from collections.abc import Mapping, Sequence
from typing import Final

from modelpool.shared.protocol import Prompt, TokenIds
from modelpool.worker import images

IMAGE_TOKENS: Final = 16
"""Prompt tokens one image counts on the testing backend (what an image encoder's fixed
number of patches would)."""

FAULT_KEY: Final = "modelpool-fault"


def content_text(content: object) -> str:
    """A message's text: the string, or its text parts joined (images left out)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, Sequence):
        return ""
    return "".join(
        str(part.get("text", ""))
        for part in content
        if isinstance(part, Mapping) and part.get("type") == "text"
    )


def image_tokens(prompt: Prompt) -> int:
    """The prompt tokens its images count."""
    if isinstance(prompt, (str, TokenIds)):
        return 0
    return IMAGE_TOKENS * len(images.image_locations(prompt))


def read_images(prompt: Prompt, vision: bool) -> str:
    """The answer's preamble, one line per image ("" without images); a refusal raises."""
    if isinstance(prompt, (str, TokenIds)):
        return ""
    if not vision:
        images.refuse_images(prompt, "the testing backend without vision = true")
        return ""
    decoded = images.decode_prompt_images(prompt)
    for image in decoded:
        if image.image.info.get(FAULT_KEY) == "segfault":
            ctypes.string_at(0)
    return "".join(
        f"image {number}: {image.image.width}x{image.image.height} {image.format}\n"
        for number, image in enumerate(decoded, start=1)
    )


def fault_png(fault: str = "segfault") -> bytes:
    """A small valid PNG whose decoding crashes the testing backend (``FAULT_KEY``)."""
    from PIL import Image, PngImagePlugin

    info = PngImagePlugin.PngInfo()
    info.add_text(FAULT_KEY, fault)
    buffer = io.BytesIO()
    Image.new("RGB", (4, 4), (255, 0, 0)).save(buffer, format="PNG", pnginfo=info)
    return buffer.getvalue()
