"""Small real image files for the image tests, written without an imaging library.

``png(width, height)`` is a valid RGB PNG (a grey gradient), ``data_url(data)`` its
``data:`` URL, ``b64(data)`` its base64::

    url = data_url(png(32, 16))
"""

from __future__ import annotations

import base64
import os
import struct
import zlib


def _chunk(kind: bytes, payload: bytes) -> bytes:
    crc = zlib.crc32(kind + payload) & 0xFFFFFFFF
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", crc)


def png(width: int, height: int, *, noise: bool = False) -> bytes:
    """A ``width`` x ``height`` RGB PNG; ``noise``: pseudo-random pixels, so that the file
    is about as large as its pixels (a large image that does not compress away)."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    if noise:
        rows = b"".join(b"\x00" + os.urandom(width * 3) for _ in range(height))
    else:
        rows = b"".join(b"\x00" + bytes([row % 256]) * (width * 3) for row in range(height))
    return (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", header)
        + _chunk(b"IDAT", zlib.compress(rows, 1))
        + _chunk(b"IEND", b"")
    )


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{b64(data)}"
