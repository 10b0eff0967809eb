"""The field checks every API family's body parser uses: a field's type and range, the
fields a route accepts, and the few it accepts without effect (their shapes still held).

Every refusal is an :class:`~modelpool.server.http.ApiError` (HTTP 400) naming the field
the client sent::

    check_fields(body, frozenset({"input", "dimensions"}))  # unsupported_field otherwise
    dimensions = opt_int(body, "dimensions", 1)             # None when absent
    priority = parse_priority(body)                          # vLLM's: lower runs first
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from modelpool.server.http import invalid
from modelpool.shared.validation import MAX_INT, MAX_PRIORITY, is_int, is_number

# Fields accepted without effect: they do not change what is generated. Each is held to
# OpenAI's own shape and size (a megabyte array there would cost the event loop its
# parsing and checking, for nothing).
_IGNORED_STRINGS = frozenset(
    {"model", "user", "service_tier", "safety_identifier", "prompt_cache_key"}
)
_IGNORED_BOOLS = frozenset({"store"})
IGNORED_FIELDS = _IGNORED_STRINGS | _IGNORED_BOOLS | {"metadata"}
MAX_IGNORED_STRING = 512
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY = 64


def parse_priority(body: Mapping[str, Any]) -> int | None:
    """vLLM's ``priority``: an integer, lower runs first; None when the body has none."""
    priority = body.get("priority")
    if priority is not None and not is_int(priority, minimum=-MAX_PRIORITY, maximum=MAX_PRIORITY):
        raise invalid(
            f"priority must be an integer in [{-MAX_PRIORITY}, {MAX_PRIORITY}] (lower runs "
            f"first), got {priority!r}",
            param="priority",
        )
    return priority


def check_fields(body: Mapping[str, Any], allowed: frozenset[str]) -> None:
    """400 ``unsupported_field`` for a field neither in ``allowed`` nor ignored."""
    for name in body:
        if name not in allowed and name not in IGNORED_FIELDS:
            raise invalid(f"unsupported field {name!r}", param=name, code="unsupported_field")
    check_ignored_fields(body)


def check_ignored_fields(body: Mapping[str, Any]) -> None:
    """The accepted-but-ignored fields have OpenAI's shapes and sizes: short strings,
    booleans, and ``metadata`` as at most 16 short string pairs."""
    for name in _IGNORED_STRINGS & body.keys():
        value = body[name]
        if value is not None and (not isinstance(value, str) or len(value) > MAX_IGNORED_STRING):
            raise invalid(
                f"{name} must be a string of at most {MAX_IGNORED_STRING} characters", name
            )
    for name in _IGNORED_BOOLS & body.keys():
        if body[name] is not None and not isinstance(body[name], bool):
            raise invalid(f"{name} must be true or false", param=name)
    metadata = body.get("metadata")
    if metadata is None:
        return
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_PAIRS:
        raise invalid(
            f"metadata must be an object of at most {MAX_METADATA_PAIRS} pairs", "metadata"
        )
    for key, value in metadata.items():
        if (
            len(key) > MAX_METADATA_KEY
            or not isinstance(value, str)
            or len(value) > MAX_IGNORED_STRING
        ):
            raise invalid(
                f"metadata: keys of at most {MAX_METADATA_KEY} characters, string values of "
                f"at most {MAX_IGNORED_STRING}",
                param="metadata",
            )


def opt_int(body: Mapping[str, Any], name: str, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not is_int(value, minimum=minimum):
        raise invalid(
            f"{name} must be an integer in [{minimum}, {MAX_INT}], got {value!r}", param=name
        )
    assert isinstance(value, int)
    return value


def opt_number(body: Mapping[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if not is_number(value):
        raise invalid(f"{name} must be a number, got {value!r}", param=name)
    return float(value)


def opt_bool(body: Mapping[str, Any], name: str) -> bool | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise invalid(f"{name} must be true or false, got {value!r}", param=name)
    return value


def unsupported_unless(condition: bool, name: str, why: str) -> None:
    if not condition:
        raise invalid(f"{name}: {why}", param=name, code="unsupported_value")
