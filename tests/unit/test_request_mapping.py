"""OpenAI request fields to pool calls, without a daemon (parsed in server.core.generation_body)."""

from __future__ import annotations

from typing import Any

import pytest

from modelpool.cli.daemon import is_loopback, served_model_name
from modelpool.server.core.deadline import deadline_from
from modelpool.server.core.generation_body import parse_chat, parse_completion
from modelpool.server.errors import pool_error_to_api
from modelpool.server.http import ApiError
from modelpool.shared.config import PoolConfig, ServerConfig
from modelpool.shared.errors import (
    BackendError,
    DeadlineExceeded,
    InvalidRequest,
    PoolClosed,
    PoolOverloaded,
    WorkerCrashed,
)
from modelpool.shared.protocol import TokenIds


def test_completion_fields_map_to_generation_kwargs() -> None:
    job = parse_completion(
        {
            "model": "x",
            "prompt": ["hello"],
            "max_tokens": 7,
            "min_tokens": 5,
            "temperature": 0,
            "top_p": 0.5,
            "top_k": 40,
            "stop": "END",
            "seed": 3,
            "n": 1,
            "presence_penalty": 0,
            "user": "u",
            "stream": True,
        }
    )
    assert job.prompts == ["hello"]
    assert job.params == {
        "max_new_tokens": 7,
        "min_new_tokens": 5,
        "temperature": 0.0,
        "top_p": 0.5,
        "top_k": 40,
        "stop": ["END"],
        "seed": 3,
    }
    assert job.stream is True
    assert (job.n, job.logprobs, job.echo) == (1, None, False)


def test_chat_messages_and_parts() -> None:
    job = parse_chat(
        {
            "messages": [
                {"role": "developer", "content": "be brief"},
                {
                    "role": "user",
                    "name": "ann",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
            ],
            "max_completion_tokens": 5,
            "stop": [],
            "stream_options": None,
        }
    )
    assert job.prompts == [
        [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "a\nb"},
        ]
    ]
    assert job.params == {"max_new_tokens": 5}
    assert job.stream is False


USER = [{"role": "user", "content": "x"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {}}}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": USER, "max_tokens": True}, "max_tokens"),
        ({"messages": USER, "temperature": -1}, "temperature"),
        ({"messages": USER, "max_tokens": 3, "min_tokens": 4}, "min_tokens"),
        ({"messages": USER, "min_tokens": -1}, "min_tokens"),
        ({"messages": USER, "top_k": -2}, "top_k"),
        ({"messages": USER, "top_k": 1.5}, "top_k"),
        ({"messages": USER, "max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens"),
        (
            {"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
            "messages[0].tool_calls",
        ),
        ({"messages": USER, "stream_options": {"include_usage": False}}, "stream_options"),
        ({"messages": USER, "frequency_penalty": 2.5}, "frequency_penalty"),
        ({"messages": USER, "presence_penalty": -3}, "presence_penalty"),
        ({"messages": USER, "logit_bias": {"x": 1}}, "logit_bias"),
        ({"messages": USER, "logit_bias": {"5": 100.5}}, "logit_bias"),
        ({"messages": USER, "n": 0}, "n"),
        ({"messages": USER, "suffix": "y"}, "suffix"),
        ({"messages": USER, "tools": [TOOL, TOOL]}, "tools"),
        ({"messages": USER, "tools": [{"type": "function"}]}, "tools[0].function"),
        ({"messages": USER, "tool_choice": "auto"}, "tool_choice"),
        ({"messages": USER, "tools": [TOOL], "tool_choice": "any"}, "tool_choice"),
        ({"messages": USER, "bogus": 1}, "bogus"),
    ],
)
def test_chat_rejections_are_400_naming_the_field(body: dict[str, Any], param: str) -> None:
    """The docs: what cannot be honoured is a 400 naming the field, never silently dropped."""
    with pytest.raises(ApiError) as info:
        parse_chat(body)
    assert info.value.status == 400
    assert info.value.param == param


def test_top_k_off_as_vllm_spells_it() -> None:
    # vLLM's -1 and 0 both mean every token is a candidate: the pool's 0.
    for off in (-1, 0):
        params = parse_chat({"messages": USER, "top_k": off}).params
        # No max_tokens: the room the context leaves (fit_to_context).
        assert params == {"top_k": 0, "fit_to_context": True}


def test_deadline_sources_and_cap() -> None:
    assert deadline_from({}, {}, 60.0, None) == 60.0
    assert deadline_from({}, {}, 60.0, 30.0) == 30.0
    assert deadline_from({"timeout": 5}, {"x-request-timeout": "9"}, 60.0, None) == 5.0
    assert deadline_from({}, {"x-request-timeout": "9"}, 60.0, None) == 9.0
    assert deadline_from({"timeout": 500}, {}, 60.0, 120.0) == 120.0
    # A client may ask for less than the operator's deadline_s, never for more unless
    # max_request_timeout_s allows it (issue 25: one client held the pool for 40 s).
    assert deadline_from({"timeout": 40}, {}, 5.0, None) == 5.0
    assert deadline_from({}, {"x-request-timeout": "30"}, 5.0, None) == 5.0
    assert deadline_from({"timeout": 40}, {}, 5.0, 60.0) == 40.0
    for body, headers in (
        ({"timeout": "5"}, {}),
        ({"timeout": 0}, {}),
        ({}, {"x-request-timeout": "soon"}),
        ({}, {"x-request-timeout": "inf"}),
    ):
        with pytest.raises(ApiError):
            deadline_from(body, headers, 60.0, None)


def test_pool_errors_map_to_status_codes() -> None:
    assert pool_error_to_api(InvalidRequest("bad")).status == 400
    overloaded = pool_error_to_api(PoolOverloaded("full"))
    assert overloaded.status == 429 and overloaded.headers["Retry-After"] == "1"
    assert (
        pool_error_to_api(DeadlineExceeded("late", partial_text="t0")).extra["partial_text"] == "t0"
    )
    assert pool_error_to_api(WorkerCrashed("died")).status == 502


def test_retry_headers_say_which_errors_to_send_again() -> None:
    overloaded = pool_error_to_api(PoolOverloaded("full")).headers
    assert overloaded["x-should-retry"] == "true" and overloaded["Retry-After"] == "1"
    closed = pool_error_to_api(PoolClosed("closed")).headers
    assert closed["x-should-retry"] == "true" and closed["Retry-After"] == "5"
    for error in (
        DeadlineExceeded("late"),
        WorkerCrashed("died"),
        BackendError("raised"),
        InvalidRequest("bad"),
    ):
        headers = pool_error_to_api(error).headers
        assert headers["x-should-retry"] == "false" and "Retry-After" not in headers


def test_logprobs_echo_n_and_token_ids_map_to_pool_requests() -> None:
    job = parse_completion(
        {"prompt": [[1, 2], [3]], "echo": True, "max_tokens": 0, "logprobs": 1, "n": 2, "seed": 5}
    )
    assert job.prompts == [TokenIds((1, 2)), TokenIds((3,))]
    runs = job.choices()
    assert [(index, prompt) for index, prompt, _ in runs] == [
        (0, TokenIds((1, 2))),
        (1, TokenIds((1, 2))),
        (2, TokenIds((3,))),
        (3, TokenIds((3,))),
    ]
    assert [params["seed"] for _, _, params in runs] == [5, 6, 5, 6]
    assert runs[0][2]["max_new_tokens"] == 0
    assert runs[0][2]["logprobs"] == runs[0][2]["prompt_logprobs"] == 1

    chat = parse_chat(
        {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 3}
    )
    assert chat.logprobs == 3 and chat.params["logprobs"] == 3 and chat.chat
    for body in (
        {"prompt": "x", "max_tokens": 0},  # scoring needs echo
        {"prompt": [], "echo": True},
        {"prompt": [1, "a"]},
        {"prompt": "x", "n": 2, "best_of": 1},
        {"prompt": "x", "best_of": 3, "stream": True},
        {"prompt": [1], "echo": True, "stream": True},
        {"prompt": ["x"] * 65, "n": 2},  # more runs than one request may start
    ):
        with pytest.raises(ApiError) as info:
            parse_completion(body)
        assert info.value.status == 400, body


def test_cli_helpers() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("example.org")
    pool = PoolConfig(model="embedded:smollm2-135m-instruct", backend="testing")
    assert served_model_name(pool, ServerConfig()) == "smollm2-135m-instruct"
    assert served_model_name(pool, ServerConfig(model_name="named")) == "named"


def test_penalties_and_logit_bias_become_pool_kwargs() -> None:
    job = parse_chat(
        {
            "messages": USER,
            "presence_penalty": 0.5,
            "frequency_penalty": -2,
            "logit_bias": {"50256": -100, "7": 2.5},
        }
    )
    assert job.params == {
        "presence_penalty": 0.5,
        "frequency_penalty": -2.0,
        "logit_bias": {50256: -100.0, 7: 2.5},
        "fit_to_context": True,
    }
