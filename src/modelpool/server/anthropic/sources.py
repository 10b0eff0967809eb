"""Anthropic's ``image`` and ``document`` blocks as the pool's parts (``shared.images``).

An ``image`` block's ``source`` is ``base64`` (``media_type`` and ``data``) or ``url``
(an http(s) URL, under the daemon's host rule, ``server.images``); a ``document`` block
is read when it is text (``source.type`` ``text``, or ``content`` of text blocks); a PDF
(or any other file) is a 400 naming the block: no model served here reads one::

    part = source_block(block, "messages[0].content[1]")
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from modelpool.server.http import invalid
from modelpool.shared.errors import ImageRefused
from modelpool.shared.image_input import image_from_base64, image_from_url


def source_block(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    """An ``image`` block as an image part, a text ``document`` block as a text part."""
    source = block.get("source")
    if not isinstance(source, Mapping):
        raise ImageRefused(f"{where}.source must be an object", part=where, reason="invalid_image")
    kind = source.get("type")
    if block.get("type") == "document":
        return _document(source, where)
    if kind == "base64":
        return image_from_base64(source.get("data"), source.get("media_type"), where)
    if kind == "url":
        return image_from_url(source.get("url"), where)
    raise ImageRefused(
        f"{where}.source.type must be 'base64' or 'url', got {kind!r}",
        part=where,
        reason="invalid_image",
    )


def _document(source: Mapping[str, Any], where: str) -> dict[str, Any]:
    kind = source.get("type")
    if kind == "text" and isinstance(source.get("data"), str):
        return {"type": "text", "text": source["data"]}
    content = source.get("content")
    if kind == "content" and isinstance(content, list):
        texts = [block.get("text") for block in content if isinstance(block, Mapping)]
        if all(isinstance(text, str) for text in texts):
            return {"type": "text", "text": "\n".join(str(text) for text in texts)}
    media_type = source.get("media_type")
    raise invalid(
        f"{where}: a document of type {media_type or kind!r} is not read here: the models "
        "served read text and images, not PDFs or other files (send its text as a text "
        "document, or its pages as images)",
        where,
        "unsupported_document",
    )
