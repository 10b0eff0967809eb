"""One notion of a number for every field: finite, not a bool, and an int a backend can take.

An int too large for a float (``10**400``, which JSON allows), ``inf``, ``nan`` and booleans are
refused as ``InvalidRequest`` (HTTP 400) before anything is dispatched, never an
``OverflowError`` out of ``submit()`` or a 500 from the daemon.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from modelpool import InvalidRequest, ModelPool, PoolConfig
from modelpool.server.core.deadline import deadline_from
from modelpool.server.core.generation_body import parse_chat, parse_completion
from modelpool.server.http import ApiError, parse_json_object
from modelpool.shared.validation import MAX_INT, is_int, is_number

NOT_NUMBERS = [10**400, -(10**400), math.inf, -math.inf, math.nan, True, False, "1", None]


@pytest.mark.parametrize("value", NOT_NUMBERS)
def test_is_number_refuses_what_no_backend_can_use(value: object) -> None:
    assert not is_number(value)


@pytest.mark.parametrize("value", [0, 1, -3, 0.5, 1e308, 2**1000])
def test_is_number_accepts_finite_numbers(value: object) -> None:
    assert is_number(value)


def test_is_int_bounds_at_64_bits() -> None:
    assert is_int(MAX_INT, minimum=0)
    assert not is_int(MAX_INT + 1, minimum=0)
    assert not is_int(True, minimum=0)
    assert not is_int(1.0, minimum=0)


def _unstarted_pool(backend: str) -> ModelPool:
    # Validation runs before the pool checks that it was started: no worker is needed.
    return ModelPool(PoolConfig(model="unused", backend=backend))


@pytest.mark.parametrize("backend", ["hf", "testing"])
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", 10**400),
        ("temperature", -(10**400)),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("top_p", True),
        ("max_new_tokens", 2**64),
        ("max_new_tokens", True),
        ("seed", 2**64),
        ("seed", -(2**64)),
    ],
)
def test_submit_refuses_numbers_no_backend_can_take(backend: str, field: str, value: Any) -> None:
    with pytest.raises(InvalidRequest, match=field):
        _unstarted_pool(backend).submit("x", **{field: value})


@pytest.mark.parametrize(
    ("field", "value"),
    [("repetition_penalty", 10**400), ("top_k", 2**64), ("min_new_tokens", 10**30)],
)
def test_hf_options_past_their_range_are_invalid_not_overflow(field: str, value: Any) -> None:
    with pytest.raises(InvalidRequest, match=field):
        _unstarted_pool("hf").submit("x", **{field: value})


@pytest.mark.parametrize(
    ("field", "raw"),
    [
        ("temperature", "1" + "0" * 400),
        ("temperature", "-" + "1" + "0" * 400),
        ("temperature", "1e400"),
        ("top_p", "true"),
        ("presence_penalty", "1" + "0" * 400),
        ("frequency_penalty", "-1e400"),
        ("max_tokens", str(2**64)),
        ("seed", str(2**64)),
    ],
)
@pytest.mark.parametrize("route", ["completions", "chat"])
def test_http_bodies_with_such_numbers_are_400(field: str, raw: str, route: str) -> None:
    if route == "completions":
        head, parse = '{"prompt": "hi"', parse_completion
    else:
        head, parse = '{"messages": [{"role": "user", "content": "hi"}]', parse_chat
    body = parse_json_object(f'{head}, "{field}": {raw}}}'.encode())
    with pytest.raises(ApiError) as caught:
        parse(body)
    assert caught.value.status == 400
    assert field in str(caught.value)


@pytest.mark.parametrize("raw", ["1" + "0" * 400, "-" + "1" + "0" * 400, "1e400", "true"])
def test_http_timeouts_past_float_range_are_400(raw: str) -> None:
    body = parse_json_object(f'{{"prompt": "hi", "timeout": {raw}}}'.encode())
    with pytest.raises(ApiError) as caught:
        deadline_from(body, {}, 60.0, None)
    assert caught.value.status == 400


def test_json_infinity_literals_are_invalid_json() -> None:
    for raw in (b'{"prompt": "x", "temperature": Infinity}', b'{"prompt": "x", "top_p": NaN}'):
        with pytest.raises(ApiError) as caught:
            parse_json_object(raw)
        assert caught.value.status == 400
    assert json.loads("1e400") == math.inf  # why is_number, not the JSON parser, must refuse it
