"""A request's deadline: what the client asks (the body's ``timeout`` or the
``X-Request-Timeout`` header), held to what the operator allows::

    deadline_s = deadline_from(body, request.headers, default_s=60.0, cap_s=None)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from modelpool.server.http import invalid
from modelpool.shared.validation import is_number

TIMEOUT_HEADER = "x-request-timeout"


def deadline_from(
    body: Mapping[str, Any], headers: Mapping[str, str], default_s: float, cap_s: float | None
) -> float:
    """Body ``timeout`` wins over the header. Either is capped at ``cap_s`` (the server's
    ``max_request_timeout_s``) or, when the operator set none, at ``default_s`` (the
    pool's ``deadline_s``): a client may ask for less time than the operator's deadline,
    never for more unless the operator allows it."""
    value: object = body.get("timeout")
    name = "timeout"
    if value is None and TIMEOUT_HEADER in headers:
        name = "X-Request-Timeout"
        try:
            value = float(headers[TIMEOUT_HEADER])
        except ValueError:
            raise invalid(f"{name} must be a number of seconds", param=name) from None
    if value is None:
        value = default_s
    if not is_number(value) or value <= 0:  # type: ignore[operator]
        raise invalid(f"{name} must be a number of seconds > 0, got {value!r}", param=name)
    seconds = float(value)  # type: ignore[arg-type]
    return min(seconds, cap_s if cap_s is not None else default_s)
