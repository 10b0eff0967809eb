"""gpt-oss's Harmony calls after thinking, on the testing backend's scripted gpt-oss
(``harmony:N:ANSWER``, ``testing_thinking``): a call after the worker closed thinking
(the close stops at ``<|start|>assistant`` when tools are offered, so that the model
names the commentary channel itself), and a call after the model's own end of analysis.
Both come back as ``tool_calls`` with the analysis apart, through the ``openai`` client,
whole and streamed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from e2e_support import Daemon, daemon_config, start_daemon

from modelpool.server.reasoning import CLOSED_HEADER
from tool_families import weather_tool

WEATHER = weather_tool()
CALL = (
    "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    '{"city": "Paris"}<|call|>'
)
MARKERS = ("<|channel|>", "<|message|>", "<|end|>", "<|start|>", "to=functions", "analysis")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    config = daemon_config(workers=1, tool_parser="gpt_oss", reasoning_parser="gpt_oss")
    started = start_daemon(tmp_path_factory.mktemp("harmony-calls"), config)
    yield started
    assert started.stop() == 0, started.log()[-4000:]


@pytest.fixture(scope="module")
def client(daemon: Daemon) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=daemon.url + "/v1", api_key="none", max_retries=0) as made:
        yield made


def _ask(script: str) -> Any:
    return [{"role": "user", "content": script}]


def test_a_call_after_the_workers_forced_close(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model="none",
        messages=_ask("harmony:40:" + CALL),
        tools=[WEATHER],
        extra_body={"thinking_token_budget": 3},
    )
    answer = raw.parse()
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert choice.message.model_extra["reasoning_content"] == "w0 w1 w2 "
    assert not choice.message.content
    assert choice.model_extra["thinking_closed"] == "budget"
    assert raw.headers[CLOSED_HEADER] == "budget"
    assert answer.usage is not None and answer.usage.completion_tokens_details is not None
    assert answer.usage.completion_tokens_details.reasoning_tokens == 3

    chunks = list(
        client.chat.completions.create(
            model="none",
            messages=_ask("harmony:40:" + CALL),
            tools=[WEATHER],
            stream=True,
            extra_body={"thinking_token_budget": 3},
        )
    )
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    arguments = "".join(d.function.arguments or "" for d in deltas if d.function)
    assert json.loads(arguments) == {"city": "Paris"}
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_call_after_the_models_own_end_of_analysis(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(
        model="none", messages=_ask("harmony:4:" + CALL), tools=[WEATHER]
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    reasoning = choice.message.model_extra["reasoning_content"]
    assert reasoning == "w0 w1 w2 w3 "
    assert choice.model_extra.get("thinking_closed") is None
    assert answer.usage is not None and answer.usage.completion_tokens_details is not None
    assert answer.usage.completion_tokens_details.reasoning_tokens == 4
    assert not any(marker in (choice.message.content or "") for marker in MARKERS)


def test_without_tools_the_close_goes_to_the_final_channel(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(
        model="none",
        messages=_ask("harmony:40:<|channel|>final<|message|>It is 4."),
        extra_body={"thinking_token_budget": 2},
    )
    message = answer.choices[0].message
    assert message.content == "It is 4."
    assert message.model_extra["reasoning_content"] == "w0 w1 "
    assert answer.choices[0].model_extra["thinking_closed"] == "budget"
