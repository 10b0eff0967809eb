"""Anthropic's ``/v1/messages`` through the ``anthropic`` client against a real daemon
(testing backend, whose "model" writes what the prompt says): ``messages.create``,
``messages.stream`` (every event parsed by the client, in Anthropic's order), a two-turn
``tool_use``/``tool_result`` loop, ``count_tokens``, the key as ``x-api-key``, errors in
Anthropic's shape (context length, refusals naming the field, a deadline mid-stream as
an ``error`` event) and the fields Claude Code sends accepted and ignored.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest
from e2e_support import Daemon, daemon_config, start_daemon

from helpers import FAR_DEADLINE_S
from modelpool.server.anthropic.api import count_job, count_prompt

KEY = "sk-test-messages"
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER: Any = {
    "name": "get_weather",
    "description": "The weather forecast for a city",
    "input_schema": WEATHER_SCHEMA,
}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Lima", "days": 1}}</tool_call>'


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    server = start_daemon(
        tmp_path_factory.mktemp("messages"),
        daemon_config(deadline_s=FAR_DEADLINE_S),
        env={"MODELPOOL_API_KEY": KEY},
        args=("--max-model-len", "4096"),
    )
    yield server
    assert server.stop() == 0, server.log()[-4000:]


@pytest.fixture()
def client(daemon: Daemon) -> Iterator[anthropic.Anthropic]:
    # The anthropic client sends its key as x-api-key, never as a bearer token.
    with anthropic.Anthropic(base_url=daemon.url, api_key=KEY, max_retries=0) as made:
        yield made


def test_create(client: anthropic.Anthropic) -> None:
    message = client.messages.create(
        model="m",
        max_tokens=32,
        system=[{"type": "text", "text": "Be brief", "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": "tokens:3"}],
    )
    assert message.type == "message" and message.role == "assistant"
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].type == "text"
    assert message.content[0].text == "t0 t1 t2 "
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert message.usage.input_tokens == (2 + 2) + (2 + 1) + 1
    assert message.usage.output_tokens == 3


def test_max_tokens_stop_reason(client: anthropic.Anthropic) -> None:
    message = client.messages.create(
        model="m", max_tokens=2, messages=[{"role": "user", "content": "tokens:9"}]
    )
    assert message.stop_reason == "max_tokens"


def test_stop_sequence_names_the_string(client: anthropic.Anthropic) -> None:
    message = client.messages.create(
        model="m",
        max_tokens=32,
        stop_sequences=["zz", "t2"],
        messages=[{"role": "user", "content": "tokens:9"}],
    )
    assert message.content[0].type == "text" and message.content[0].text == "t0 t1 "
    assert message.stop_reason == "stop_sequence"
    assert message.stop_sequence == "t2"
    unmatched = client.messages.create(
        model="m",
        max_tokens=32,
        stop_sequences=["zz"],
        messages=[{"role": "user", "content": "tokens:2"}],
    )
    assert (unmatched.stop_reason, unmatched.stop_sequence) == ("end_turn", None)


def test_stop_sequence_streamed(client: anthropic.Anthropic) -> None:
    with client.messages.stream(
        model="m",
        max_tokens=32,
        stop_sequences=["t3"],
        messages=[{"role": "user", "content": "tokens:9"}],
    ) as stream:
        deltas = [event for event in stream if event.type == "message_delta"]
        final = stream.get_final_message()
    assert len(deltas) == 1
    assert deltas[0].delta.stop_reason == "stop_sequence"  # type: ignore[union-attr]
    assert deltas[0].delta.stop_sequence == "t3"  # type: ignore[union-attr]
    assert final.content[0].type == "text" and final.content[0].text == "t0 t1 t2 "
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "t3")


def test_top_k_is_taken(client: anthropic.Anthropic) -> None:
    # This client (2.x) has no sampling keywords: the API's fields go as extra_body.
    message = client.messages.create(
        model="m",
        max_tokens=32,
        extra_body={"temperature": 0.7, "top_k": 5},
        messages=[{"role": "user", "content": "tokens:3"}],
    )
    assert message.content[0].type == "text" and message.content[0].text == "t0 t1 t2 "
    with pytest.raises(anthropic.BadRequestError) as raised:
        client.messages.create(
            model="m",
            max_tokens=4,
            extra_body={"top_k": -1},
            messages=[{"role": "user", "content": "x"}],
        )
    body = raised.value.body
    assert isinstance(body, dict) and body["error"]["param"] == "top_k"


def test_stream(client: anthropic.Anthropic) -> None:
    with client.messages.stream(
        model="m", max_tokens=32, messages=[{"role": "user", "content": "tokens:3"}]
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [event.type for event in events if not event.type.startswith(("text", "input"))]
    deltas = kinds.count("content_block_delta")
    assert deltas >= 1
    assert kinds == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * deltas,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert final.content[0].type == "text"
    assert final.content[0].text == "t0 t1 t2 "
    assert final.stop_reason == "end_turn"
    assert final.usage.output_tokens == 3


def test_tool_use_loop(client: anthropic.Anthropic) -> None:
    question: Any = {"role": "user", "content": "echo:" + CALL}
    first = client.messages.create(model="m", max_tokens=64, tools=[WEATHER], messages=[question])
    assert first.stop_reason == "tool_use"
    uses = [block for block in first.content if block.type == "tool_use"]
    assert len(uses) == 1
    use = uses[0]
    assert use.type == "tool_use" and use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER_SCHEMA)
    second = client.messages.create(
        model="m",
        max_tokens=64,
        tools=[WEATHER],
        messages=[
            question,
            {"role": "assistant", "content": first.content},  # type: ignore[typeddict-item]
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": use.id, "content": "echo:sunny"}
                ],
            },
        ],
    )
    assert second.stop_reason == "end_turn"
    assert second.content[0].type == "text" and second.content[0].text == "sunny"


def test_tool_use_streamed(client: anthropic.Anthropic) -> None:
    with client.messages.stream(
        model="m",
        max_tokens=64,
        tools=[WEATHER],
        tool_choice={"type": "any"},
        messages=[{"role": "user", "content": "echo:" + CALL}],
    ) as stream:
        raw = [event for event in stream if event.type == "content_block_delta"]
        final = stream.get_final_message()
    assert [event.delta.type for event in raw] == ["input_json_delta"]
    assert final.stop_reason == "tool_use"
    block = final.content[0]
    assert block.type == "tool_use"
    jsonschema.validate(block.input, WEATHER_SCHEMA)
    assert json.loads(raw[0].delta.partial_json) == block.input  # type: ignore[union-attr]


def test_count_tokens(client: anthropic.Anthropic, daemon: Daemon) -> None:
    counted = client.messages.count_tokens(
        model="m", system="Be brief", messages=[{"role": "user", "content": "hello there"}]
    )
    # The worker's own count, as /tokenize gives it for the same conversation (the
    # testing backend's tokenizer: one id per character of the last message).
    tokenized = httpx.post(
        daemon.url + "/tokenize",
        headers={"x-api-key": KEY},
        json={
            "messages": [
                {"role": "system", "content": "Be brief"},
                {"role": "user", "content": "hello there"},
            ]
        },
        timeout=30,
    ).json()
    assert counted.input_tokens == tokenized["count"] == len("hello there")


def test_count_tokens_counts_the_tools() -> None:
    prompt = count_prompt(
        count_job({"tools": [WEATHER], "messages": [{"role": "user", "content": "hi"}]})
    )
    assert isinstance(prompt, list)
    assert prompt[0]["role"] == "system"
    assert '"name": "get_weather"' in prompt[0]["content"]
    assert prompt[1] == {"role": "user", "content": "hi"}


def test_claude_code_fields_are_ignored(client: anthropic.Anthropic, daemon: Daemon) -> None:
    message = client.messages.create(
        model="m",
        max_tokens=16,
        metadata={"user_id": "someone"},
        thinking={"type": "enabled", "budget_tokens": 1024},
        tools=[WEATHER, {"type": "web_search_20250305", "name": "web_search"}],
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "echo:ok", "cache_control": {"type": "ephemeral"}}
                ],
            }
        ],
    )
    assert message.content[0].type == "text" and message.content[0].text == "ok"
    log = daemon.log()
    # thinking is a control now (test_reasoning): read, not ignored.
    assert "accepted and ignored: metadata, model, tools[1]" in log
    assert "tools[1] (web_search_20250305)" in log


def test_bad_key_is_anthropic_authentication_error(daemon: Daemon) -> None:
    bad = anthropic.Anthropic(base_url=daemon.url, api_key="wrong", max_retries=0)
    with bad, pytest.raises(anthropic.AuthenticationError) as raised:
        bad.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    body = raised.value.body
    assert isinstance(body, dict) and body["error"]["type"] == "authentication_error"


def test_refusals_name_the_field(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as raised:
        client.messages.create(
            model="m",
            max_tokens=4,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is this"},
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": "AA=="},
                        },
                    ],
                }
            ],
        )
    body = raised.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    error = body["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == "messages[0].content[1]"
    assert error["code"] == "not_an_image"  # "AA==" is one zero byte


def test_max_tokens_is_required(daemon: Daemon) -> None:
    answer = httpx.post(
        daemon.url + "/v1/messages",
        headers={"x-api-key": KEY},
        json={"model": "m", "messages": [{"role": "user", "content": "x"}]},
        timeout=30,
    )
    assert answer.status_code == 400
    body = answer.json()
    assert body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["param"] == "max_tokens"


def test_deadline_mid_stream_is_an_error_event(daemon: Daemon) -> None:
    with httpx.stream(
        "POST",
        daemon.url + "/v1/messages",
        headers={"x-api-key": KEY, "X-Request-Timeout": "1"},
        json={
            "model": "m",
            "max_tokens": 64,
            "stream": True,
            "messages": [{"role": "user", "content": "stall:2"}],
        },
        timeout=60,
    ) as answer:
        assert answer.status_code == 200
        lines = [line for line in answer.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    assert names[0] == "message_start"
    assert names[-1] == "error"
    error = json.loads(lines[-1].removeprefix("data: "))
    assert error["type"] == "error"
    assert error["error"]["type"] == "timeout_error"
    assert "deadline" in error["error"]["message"]


def test_deadline_mid_stream_raises_in_the_client(client: anthropic.Anthropic) -> None:
    with (
        pytest.raises(anthropic.APIStatusError, match="deadline"),
        client.messages.stream(
            model="m",
            max_tokens=64,
            messages=[{"role": "user", "content": "stall:2"}],
            extra_headers={"X-Request-Timeout": "1"},
        ) as stream,
    ):
        list(stream)


def test_context_length_error_in_anthropic_shape(tmp_path: Path) -> None:
    small = start_daemon(tmp_path, daemon_config(workers=1), args=("--max-model-len", "12"))
    try:
        made = anthropic.Anthropic(base_url=small.url, api_key="none", max_retries=0)
        with made, pytest.raises(anthropic.BadRequestError) as raised:
            made.messages.create(
                model="m", max_tokens=4, messages=[{"role": "user", "content": "word " * 40}]
            )
        body = raised.value.body
        assert isinstance(body, dict)
        assert body["error"]["type"] == "invalid_request_error"
        assert body["error"]["message"].startswith("prompt is too long: ")
        assert body["error"]["code"] == "context_length_exceeded"
    finally:
        assert small.stop() == 0, small.log()[-4000:]
