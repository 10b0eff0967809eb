"""Hypothesis over every field of both routes, streaming and not: no input gives a 5xx
other than a backend's own failure (502, 503, 504), and never a 500.

The bodies mix plausible values with hostile ones: integers beyond float range,
Infinity/NaN literals, lone surrogate escapes, wrong types, deep nesting. The field
names come from the request parser's own tables, so a new field is fuzzed as soon as it exists.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from modelpool.server.core.generation_body import CHAT_FIELDS, COMPLETION_FIELDS

pytestmark = pytest.mark.slow

HOSTILE_NUMBERS = st.sampled_from(
    [10**400, -(10**400), 2**64, -(2**63) - 1, 1e308, -1, 0, 1, 0.5, 2]
)
HOSTILE_TEXT = st.sampled_from(["\ud800", "a\udfffb", "", "echo:x", "\x00", "é" * 3])
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    HOSTILE_NUMBERS,
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    HOSTILE_TEXT,
)
ANY_JSON = st.recursive(
    SCALARS,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.one_of(st.text(max_size=8), HOSTILE_TEXT), children, max_size=4),
    ),
    max_leaves=12,
)
ECHO_PROMPT = st.text(max_size=30).map(lambda text: f"echo:{text}")
MESSAGES = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant"]), "content": ECHO_PROMPT}
    ),
    min_size=1,
    max_size=3,
)


def _body(route: str) -> st.SearchStrategy[dict[str, Any]]:
    fields = COMPLETION_FIELDS if route == "completions" else CHAT_FIELDS
    required = "prompt" if route == "completions" else "messages"
    valid_required = ECHO_PROMPT if route == "completions" else MESSAGES
    others = sorted(fields - {required})
    return st.fixed_dictionaries(
        {required: st.one_of(valid_required, ANY_JSON)},
        optional={name: ANY_JSON for name in others} | {"stream": st.booleans()},
    )


def _post(client: httpx.Client, route: str, body: dict[str, Any]) -> httpx.Response:
    raw = json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")
    path = "/v1/completions" if route == "completions" else "/v1/chat/completions"
    headers = {"Content-Type": "application/json"}
    with client.stream("POST", path, content=raw, headers=headers) as response:
        response.read()
        return response


def _check(response: httpx.Response, body: dict[str, Any]) -> None:
    status = response.status_code
    assert status != 500, (body, response.text[:2000])
    assert status < 500 or status in (502, 503, 504), (body, status, response.text[:2000])
    if status >= 400:
        assert "error" in response.json(), response.text[:2000]


FUZZ = settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@FUZZ
@given(body=_body("completions"))
def test_completions_never_answer_500(http: httpx.Client, body: dict[str, Any]) -> None:
    _check(_post(http, "completions", body), body)


@FUZZ
@given(body=_body("chat"))
def test_chat_completions_never_answer_500(http: httpx.Client, body: dict[str, Any]) -> None:
    _check(_post(http, "chat", body), body)


@pytest.mark.parametrize("route", ["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_lone_surrogate_is_a_400_naming_the_field(
    http: httpx.Client, route: str, stream: bool
) -> None:
    if route == "completions":
        body: dict[str, Any] = {"prompt": "echo:\ud800", "stream": stream}
        field = "prompt"
    else:
        body = {"messages": [{"role": "user", "content": "echo:\ud800"}], "stream": stream}
        field = "messages[0].content"
    response = _post(http, route, body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field
