"""A large body's base64 data URLs kept out of the JSON parser.

``json.loads`` holds the GIL through one C call: a 19 MB body of one image data URL
held the daemon's event loop for 0.12 s (measured on a loaded 2-core machine), however it
was threaded. Before parsing a body over ``LARGE_BODY_BYTES``, each ``;base64,`` payload
string is cut out of the raw bytes whole (found with ``bytes.find``, memchr-fast) and
replaced by a short token; the JSON left is small, and once it is parsed each token is
replaced by its string, the bytes decoded (one copy). A string is cut only when its
bytes are its value: no backslash (no escape). Anything else is left to the parser,
which reads it as before::

    data = loads_large(raw)   # the same value as json.loads(raw)
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from typing import Any

MARKER = b";base64,"
# A payload shorter than this is left to the parser: cutting it would save nothing.
MIN_PAYLOAD = 65_536


def loads_large(raw: bytes, parse_constant: Callable[[str], Any]) -> Any:
    """``json.loads(raw)``, the strings that hold long base64 payloads of data URLs kept
    out of the parser: each such string's bytes, quote to quote, are cut out whole."""
    nonce = secrets.token_hex(8)
    view = memoryview(raw)
    pieces: list[bytes | memoryview] = []
    payloads: dict[str, memoryview] = {}
    position = 0
    while (found := raw.find(MARKER, position)) != -1:
        opening = raw.rfind(b'"', position, found) + 1
        end = raw.find(b'"', found)
        if opening == 0 or end == -1:
            break
        if end - found >= MIN_PAYLOAD and raw.find(b"\\", opening, end) == -1:
            token = f"@modelpool-payload-{len(payloads)}-{nonce}@"
            payloads[token] = view[opening:end]
            pieces += (view[position:opening], token.encode("ascii"))
        else:
            pieces.append(view[position:end])
        position = end
    if not payloads:
        return json.loads(raw, parse_constant=parse_constant)
    pieces.append(view[position:])
    data = json.loads(b"".join(pieces), parse_constant=parse_constant)
    return _restore(data, payloads)


def _restore(value: Any, payloads: dict[str, memoryview]) -> Any:
    """``value`` with each token put back as its string (a stack: no recursion). The
    string is its bytes decoded: UTF-8 (ASCII for base64), as JSON's unescaped text is."""
    if isinstance(value, str):
        return str(payloads[value], "utf-8") if value in payloads else value
    stack: list[Any] = [value]
    while stack:
        item = stack.pop()
        keys = list(item.keys()) if isinstance(item, dict) else range(len(item))
        for key in keys:
            child = item[key]
            if isinstance(child, str) and child in payloads:
                item[key] = str(payloads[child], "utf-8")
            elif isinstance(child, (dict, list)):
                stack.append(child)
    return value
