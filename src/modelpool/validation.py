"""Checks the pool applies to every request before anything is dispatched."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from modelpool.errors import InvalidRequest
from modelpool.protocol import Prompt


def _is_number(value: object) -> bool:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def check_generation_params(params: Mapping[str, Any], *, where: str = "") -> None:
    """The backend-independent checks of DESIGN.md; raises :class:`InvalidRequest`."""
    prefix = f"{where}." if where else ""
    if "max_new_tokens" in params:
        value = params["max_new_tokens"]
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise InvalidRequest(
                f"{prefix}max_new_tokens must be a positive integer, got {value!r}"
            )
    if "temperature" in params:
        value = params["temperature"]
        if not _is_number(value) or value < 0:
            raise InvalidRequest(f"{prefix}temperature must be a number >= 0, got {value!r}")
    if "top_p" in params:
        value = params["top_p"]
        if not _is_number(value) or not 0 < value <= 1:
            raise InvalidRequest(f"{prefix}top_p must be in (0, 1], got {value!r}")


def check_prompt(prompt: object) -> Prompt:
    """A prompt is a string or a non-empty list of ``{"role", "content"}`` string messages.

    Returns what is sent: the string, or a copy of the messages as plain dicts, so that
    a caller's later change to its list, or a mapping type only its own process can
    rebuild, cannot reach a worker.
    """
    if isinstance(prompt, str):
        return prompt
    if not isinstance(prompt, (list, tuple)) or not prompt:
        raise InvalidRequest(
            "prompt must be a string or a non-empty list of chat messages, "
            f"got {type(prompt).__name__}"
        )
    messages: list[dict[str, str]] = []
    for index, message in enumerate(prompt):
        if not isinstance(message, Mapping):
            raise InvalidRequest(f"prompt[{index}] must be a mapping with 'role' and 'content'")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise InvalidRequest(f"prompt[{index}].role must be a non-empty string")
        if not isinstance(content, str):
            raise InvalidRequest(f"prompt[{index}].content must be a string")
        messages.append({"role": str(role), "content": str(content)})
    return messages


def check_deadline(deadline_s: object) -> None:
    if not _is_number(deadline_s) or deadline_s <= 0:  # type: ignore[operator]
        raise InvalidRequest(f"deadline_s must be a number > 0, got {deadline_s!r}")
