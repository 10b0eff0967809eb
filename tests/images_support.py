"""Image files for the tests: real encodings made with Pillow, and the bombs."""

from __future__ import annotations

import io
import struct
import zlib
from typing import Any

from PIL import Image


def encoded(
    width: int = 64, height: int = 48, fmt: str = "PNG", color: tuple[int, int, int] = (200, 30, 90)
) -> bytes:
    """A real image file of ``width`` x ``height`` in Pillow's format ``fmt``."""
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buffer, format=fmt)
    return buffer.getvalue()


def pattern(width: int, height: int, seed: int = 0) -> bytes:
    """A PNG with varied pixels (a vision model's answer depends on them)."""
    image = Image.new("RGB", (width, height))
    image.putdata(
        [
            ((x * 7 + seed * 31) % 256, (y * 11 + seed * 17) % 256, (x * y + seed) % 256)
            for y in range(height)
            for x in range(width)
        ]
    )
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def animated_gif(frames: int) -> bytes:
    buffer = io.BytesIO()
    images = [Image.new("RGB", (8, 8), (index * 40 % 256, 0, 0)) for index in range(frames)]
    images[0].save(buffer, format="GIF", save_all=True, append_images=images[1:], duration=50)
    return buffer.getvalue()


def png_bomb(width: int, height: int) -> bytes:
    """A tiny PNG whose header declares ``width`` x ``height``: a decompression bomb's
    shape (the few bytes of data behind it do not matter: it must be refused unread)."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return (
            struct.pack(">I", len(body))
            + kind
            + body
            + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)
        )

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    data = zlib.compress(b"\x00" * 64)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", data) + chunk(b"IEND", b"")
    )


def image_part(data: bytes, media_type: str = "image/png") -> dict[str, Any]:
    return {"type": "image", "data": data, "media_type": media_type}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}
