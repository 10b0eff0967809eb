"""A large body's base64 data URLs parsed apart from the JSON parser (server.large_bodies):
the value is the one ``json.loads`` gives, whatever the body holds around them."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from modelpool.server.http import ApiError, parse_json_object
from modelpool.server.large_bodies import MIN_PAYLOAD, loads_large

PAYLOAD = "QUJD" * (MIN_PAYLOAD // 4 + 10)


def _reject(name: str) -> None:
    raise ValueError(name)


def _body(text: str, url: str) -> bytes:
    return json.dumps(
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": text}]},
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]},
            ],
            "also": [url, {"k": url}],
        },
        ensure_ascii=False,
    ).encode()


@given(st.text(max_size=40))
def test_the_value_is_json_loads_value(text: str) -> None:
    raw = _body(text + ";base64,", "data:image/png;base64," + PAYLOAD)
    assert loads_large(raw, _reject) == json.loads(raw)


def test_escaped_non_ascii_and_short_strings_are_left_to_the_parser() -> None:
    escaped = json.dumps({"u": "data:image/png;base64," + PAYLOAD + "\\/"}).encode()
    assert loads_large(escaped, _reject) == json.loads(escaped)
    accented = _body("é", "data:image/png;base64,é" + PAYLOAD)
    assert loads_large(accented, _reject) == json.loads(accented)
    short = _body("x", "data:image/png;base64,QUJD")
    assert loads_large(short, _reject) == json.loads(short)


def test_a_broken_body_is_still_a_400() -> None:
    raw = _body("x", "data:image/png;base64," + PAYLOAD)[:-1]
    with pytest.raises(ApiError, match="not valid JSON"):
        parse_json_object(raw)
    invalid_utf8 = b'{"u": "data:image/png;base64,' + b"\xff" * MIN_PAYLOAD + b'"}'
    with pytest.raises(ApiError, match="not valid JSON"):
        parse_json_object(invalid_utf8)
