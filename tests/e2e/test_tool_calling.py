"""Tool calling through clients nobody here wrote, against real daemons.

On a tiny random model (its free text is gibberish, so a parsed, schema-valid call is the
grammar's doing): the ``openai`` client with ``tool_choice`` required and named, streamed
and not, several at once in a batch; ``langchain-openai``'s ``with_structured_output(...,
method="function_calling")`` and a ``bind_tools`` agent loop of two tool turns; ``litellm``
(its ``openai/`` provider). On the testing backend, whose "model" writes what the prompt
says: a call written in ``auto`` mode, streamed as OpenAI streams tool-call deltas, and
one that does not validate answered as an error.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import jsonschema
import openai
import pydantic
import pytest
from e2e_support import Daemon, daemon_config, start_daemon

pytestmark = pytest.mark.slow

# Bounded everywhere: a random model would otherwise write one string until max_tokens.
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "enum": [1, 2, 3]},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather forecast for a city",
        "parameters": WEATHER_PARAMETERS,
    },
}
TIME: Any = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 4}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
SCHEMAS = {"get_weather": WEATHER_PARAMETERS, "get_time": TIME["function"]["parameters"]}
ASK: Any = [{"role": "user", "content": "What is the weather in Paris?"}]


def valid_arguments(name: str, arguments: str) -> dict[str, Any]:
    parsed = json.loads(arguments)
    jsonschema.validate(parsed, SCHEMAS[name])
    assert isinstance(parsed, dict)
    return parsed


@pytest.fixture(scope="module")
def hf_daemon(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Daemon]:
    # Generous bounds: they catch a hung daemon; on a busy shared machine a call of ~80
    # byte-level tokens can take tens of seconds.
    config = daemon_config(
        model=str(tiny_model_dir), backend="hf", workers=1, max_batch_size=4, deadline_s=180.0
    )
    daemon = start_daemon(tmp_path_factory.mktemp("tools"), config, ready_timeout=300.0)
    yield daemon
    assert daemon.stop() == 0, daemon.log()[-4000:]


@pytest.fixture(scope="module")
def client(hf_daemon: Daemon) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=hf_daemon.url + "/v1", api_key="unused", max_retries=0, timeout=180.0
    ) as opened:
        yield opened


def test_required_calls_validate_several_at_once_in_a_batch(client: openai.OpenAI) -> None:
    def ask(seed: int) -> Any:
        return client.chat.completions.create(
            model="tiny",
            messages=ASK,
            tools=[WEATHER, TIME],
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=120,
            temperature=1.0,
            seed=seed,
        )

    with ThreadPoolExecutor(4) as threads:
        completions = list(threads.map(ask, range(4)))
    for completion in completions:
        choice = completion.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message
        (call,) = choice.message.tool_calls
        assert call.id.startswith("call_") and call.type == "function"
        valid_arguments(call.function.name, call.function.arguments)


def test_named_tool_streamed_as_openai_streams_calls(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=120,
        stream=True,
    )
    deltas = []
    finish_reason = None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.tool_calls:
            deltas += chunk.choices[0].delta.tool_calls
        if chunk.choices and chunk.choices[0].finish_reason:
            finish_reason = chunk.choices[0].finish_reason
    assert finish_reason == "tool_calls"
    first, *rest = deltas
    assert first.index == 0 and first.id and first.id.startswith("call_")
    assert first.type == "function" and first.function is not None
    assert first.function.name == "get_time" and first.function.arguments == ""
    assert rest and all(delta.index == 0 and delta.id is None for delta in rest)
    arguments = "".join(delta.function.arguments or "" for delta in rest if delta.function)
    valid_arguments("get_time", arguments)


class Forecast(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    city: Literal["Paris", "Oslo"]
    rain: bool


def _chat(hf_daemon: Daemon) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        model="tiny",
        base_url=hf_daemon.url + "/v1",
        api_key="unused",  # type: ignore[arg-type]
        max_retries=0,
        max_completion_tokens=120,
    )


def test_langchain_with_structured_output_function_calling(hf_daemon: Daemon) -> None:
    structured = _chat(hf_daemon).with_structured_output(Forecast, method="function_calling")
    answers = structured.batch(["Rain in Paris?", "Rain in Oslo?"])
    assert all(isinstance(answer, Forecast) for answer in answers), answers


def test_langchain_bind_tools_agent_loop_of_two_tool_turns(hf_daemon: Daemon) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage

    chat = _chat(hf_daemon)
    messages: list[Any] = [HumanMessage("Weather in Paris, then the time there?")]
    for name, result in (("get_weather", "sunny, 21 C"), ("get_time", "14:05")):
        # The tiny model would not choose a tool itself: the turn names the one it wants.
        answer = chat.bind_tools([WEATHER, TIME], tool_choice=name).invoke(messages)
        (call,) = answer.tool_calls
        assert call["name"] == name
        jsonschema.validate(call["args"], SCHEMAS[name])
        messages += [answer, ToolMessage(result, tool_call_id=call["id"])]
    # The conversation, with both calls and both results, is read and answered again.
    final = chat.invoke(messages)
    assert isinstance(final.content, str)


def test_litellm_tool_calling(hf_daemon: Daemon) -> None:
    import litellm

    response: Any = litellm.completion(
        model="openai/tiny",
        api_base=hf_daemon.url + "/v1",
        api_key="unused",
        messages=ASK,
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=120,
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    valid_arguments("get_weather", call.function.arguments)


def test_penalties_reach_the_model(client: openai.OpenAI) -> None:
    plain = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=8)
    forced = [
        client.chat.completions.create(
            model="tiny", messages=ASK, max_tokens=8, logit_bias={token: 100}, seed=seed
        )
        for token, seed in (("70", 1), ("70", 2), ("71", 1))
    ]
    texts = [completion.choices[0].message.content for completion in forced]
    # +100 forces the token whatever else: the same text for any seed, another token's
    # text for another token, and no end of sequence before max_tokens.
    assert texts[0] == texts[1] != texts[2] and texts[0] != plain.choices[0].message.content
    assert all(completion.choices[0].finish_reason == "length" for completion in forced)


@pytest.fixture(scope="module")
def echo_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    daemon = start_daemon(tmp_path_factory.mktemp("echo"), daemon_config(deadline_s=30.0))
    with openai.OpenAI(
        base_url=daemon.url + "/v1", api_key="unused", max_retries=0, timeout=30.0
    ) as opened:
        yield opened
    assert daemon.stop() == 0, daemon.log()[-4000:]


def test_auto_call_and_text_streamed_and_whole(echo_client: openai.OpenAI) -> None:
    written = (
        '<tool_call>{"name": "get_weather", "arguments": {"city":"Oslo","days":2}}</tool_call>'
    )
    asked: Any = [{"role": "user", "content": "echo:Let me look. " + written}]
    whole = echo_client.chat.completions.create(model="m", messages=asked, tools=[WEATHER, TIME])
    message = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls"
    assert message.content == "Let me look. "
    (call,) = message.tool_calls or []
    assert valid_arguments("get_weather", call.function.arguments) == {"city": "Oslo", "days": 2}

    stream = echo_client.chat.completions.create(
        model="m", messages=asked, tools=[WEATHER, TIME], stream=True
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert text == "Let me look. "
    assert calls[0].function is not None and calls[0].function.name == "get_weather"
    assert "".join(d.function.arguments or "" for d in calls if d.function) == (
        call.function.arguments
    )
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    # Two calls in one piece of streamed text: each its own index, id first.
    second = written.replace("get_weather", "get_time").replace('"Oslo","days":2', '"Lima"')
    asked = [{"role": "user", "content": "echo:" + written + "\n" + second}]
    stream = echo_client.chat.completions.create(
        model="m", messages=asked, tools=[WEATHER, TIME], stream=True
    )
    calls = [d for c in stream if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert [(d.index, d.function.name if d.function else None) for d in calls if d.id] == [
        (0, "get_weather"),
        (1, "get_time"),
    ]
    by_index = {
        index: "".join(d.function.arguments or "" for d in calls if d.index == index and d.function)
        for index in (0, 1)
    }
    assert valid_arguments("get_time", by_index[1]) == {"city": "Lima"}

    # A call that does not validate is never passed on as one, nor as text: an error
    # naming the model (502 malformed_tool_call).
    broken = written.replace('"days":2', '"days":9')
    asked = [{"role": "user", "content": "echo:" + broken}]
    with pytest.raises(openai.APIStatusError) as raised:
        echo_client.chat.completions.create(model="m", messages=asked, tools=[WEATHER])
    assert raised.value.status_code == 502
    body: Any = raised.value.body
    assert body["code"] == "malformed_tool_call" and body["model"] == "m"
