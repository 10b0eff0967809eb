"""``/v1/responses`` through the ``openai`` client against a real daemon (testing backend,
whose "model" writes what the prompt says): plain, streamed (every event parsed into the
client's own types, in OpenAI's order, sequence numbers rising), a function tool called
and streamed as argument deltas, ``text.format``, two turns by ``previous_response_id``,
``GET``/``DELETE``, hosted tools ignored, a deadline mid-stream ending in
``response.failed``, and refusals that name the Responses field.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pydantic
import pytest
from e2e_support import Daemon, daemon_config, start_daemon

from helpers import FAR_DEADLINE_S

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather forecast for a city",
    "parameters": WEATHER_PARAMETERS,
}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}</tool_call>'


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    # max_model_len: the testing backend then counts prompt tokens (usage, two turns).
    server = start_daemon(
        tmp_path_factory.mktemp("responses"),
        daemon_config(deadline_s=FAR_DEADLINE_S),
        args=("--max-model-len", "4096"),
    )
    yield server
    assert server.stop() == 0, server.log()[-4000:]


@pytest.fixture()
def client(daemon: Daemon) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=daemon.url + "/v1", api_key="none", max_retries=0) as made:
        yield made


def test_plain(client: openai.OpenAI) -> None:
    response = client.responses.create(model="m", input="echo:hello there", instructions="Be brief")
    assert response.status == "completed"
    assert response.output_text == "hello there"
    assert [item.type for item in response.output] == ["message"]
    assert response.instructions == "Be brief"
    assert response.id.startswith("resp_")


def test_usage(client: openai.OpenAI) -> None:
    # tokens:N is the testing backend's command that counts its tokens.
    response = client.responses.create(model="m", input="tokens:2", instructions="Be brief")
    assert response.usage is not None
    # The template's markers around "Be brief" and "tokens:2", and the assistant's turn.
    assert response.usage.input_tokens == (2 + 2) + (2 + 1) + 1
    assert response.usage.output_tokens == 2
    assert response.usage.total_tokens == 10
    assert response.usage.input_tokens_details.cached_tokens == 0


def test_max_output_tokens_is_incomplete(client: openai.OpenAI) -> None:
    response = client.responses.create(model="m", input="tokens:50", max_output_tokens=3)
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text == "t0 t1 t2 "


def test_streamed(client: openai.OpenAI) -> None:
    events = list(client.responses.create(model="m", input="tokens:4", stream=True))
    kinds = [event.type for event in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * (len(kinds) - 8),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    numbers = [event.sequence_number for event in events]
    assert numbers == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == "t0 t1 t2 t3 "
    final = events[-1]
    assert final.type == "response.completed"
    assert final.response.output_text == deltas
    assert final.response.usage is not None and final.response.usage.output_tokens == 4


def test_stream_helper_gives_the_final_response(client: openai.OpenAI) -> None:
    with client.responses.stream(model="m", input="echo:streamed whole") as stream:
        texts = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(texts) == "streamed whole" == final.output_text


def test_function_tool(client: openai.OpenAI) -> None:
    response = client.responses.create(model="m", input="echo:" + CALL, tools=[WEATHER])
    assert [item.type for item in response.output] == ["function_call"]
    call = response.output[0]
    assert call.type == "function_call"
    assert call.name == "get_weather"
    assert call.call_id.startswith("call_")
    arguments = json.loads(call.arguments)
    jsonschema.validate(arguments, WEATHER_PARAMETERS)
    assert arguments == {"city": "Paris", "days": 2}


def test_function_tool_streamed(client: openai.OpenAI) -> None:
    events = list(
        client.responses.create(model="m", input="echo:" + CALL, tools=[WEATHER], stream=True)
    )
    kinds = [event.type for event in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    done = events[4]
    assert done.type == "response.function_call_arguments.done"
    jsonschema.validate(json.loads(done.arguments), WEATHER_PARAMETERS)
    final = events[-1]
    assert final.type == "response.completed"
    assert final.response.output[0].type == "function_call"


def test_tool_loop_by_previous_response_id(client: openai.OpenAI) -> None:
    first = client.responses.create(model="m", input="echo:" + CALL, tools=[WEATHER])
    call = first.output[0]
    assert call.type == "function_call"
    second = client.responses.create(
        model="m",
        previous_response_id=first.id,
        tools=[WEATHER],
        input=[
            {"type": "function_call_output", "call_id": call.call_id, "output": "echo:sunny"},
        ],
    )
    assert second.output_text == "sunny"
    assert second.previous_response_id == first.id


class Answer(pydantic.BaseModel):
    city: str
    days: int


def test_text_format_json_schema(client: openai.OpenAI) -> None:
    # The testing backend does not constrain its text: this checks the translation, the
    # grammar's effect is test_structured_outputs' (and the hf test below).
    parsed = client.responses.parse(
        model="m", input='echo:{"city": "Oslo", "days": 3}', text_format=Answer
    )
    assert parsed.output_parsed == Answer(city="Oslo", days=3)
    assert parsed.text is not None and parsed.text.format is not None
    assert parsed.text.format.type == "json_schema"


def test_two_turns_by_previous_response_id(client: openai.OpenAI) -> None:
    first = client.responses.create(model="m", input="tokens:3")
    second = client.responses.create(model="m", input="tokens:2", previous_response_id=first.id)
    assert (first.output_text, second.output_text) == ("t0 t1 t2 ", "t0 t1 ")
    assert first.usage is not None and second.usage is not None
    # The first turn's question (3 tokens) and answer (2 + 3) are in the second's prompt.
    assert (first.usage.input_tokens, second.usage.input_tokens) == (4, 4 + 5 + 3)
    stored = client.responses.retrieve(second.id)
    assert stored.output_text == "t0 t1 "
    assert stored.previous_response_id == first.id


def test_delete_then_not_found(client: openai.OpenAI) -> None:
    response = client.responses.create(model="m", input="echo:x")
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError) as raised:
        client.responses.create(model="m", input="echo:y", previous_response_id=response.id)
    assert raised.value.code == "previous_response_not_found"


def test_store_false_is_not_kept(client: openai.OpenAI) -> None:
    response = client.responses.create(model="m", input="echo:x", store=False)
    assert response.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


def test_hosted_tools_are_ignored_not_refused(client: openai.OpenAI, daemon: Daemon) -> None:
    response = client.responses.create(
        model="m",
        input="echo:fine",
        tools=[{"type": "web_search"}, WEATHER],
        reasoning={"effort": "low"},
        include=["reasoning.encrypted_content"],
    )
    assert response.output_text == "fine"
    log = daemon.log()
    assert "tools[0] (web_search)" in log
    # reasoning is a control now (test_reasoning): read, not ignored.
    assert "accepted and ignored: include, model" in log


def test_deadline_mid_stream_is_response_failed(client: openai.OpenAI) -> None:
    # Two tokens, then the worker hangs: the deadline kills it mid-stream.
    events = list(
        client.responses.create(
            model="m", input="stall:2", stream=True, extra_headers={"X-Request-Timeout": "1"}
        )
    )
    assert events[0].type == "response.created"
    assert any(event.type == "response.output_text.delta" for event in events)
    last = events[-1]
    assert last.type == "response.failed"
    assert last.response.status == "failed"
    assert last.response.error is not None
    assert last.response.error.code == "deadline_exceeded"
    assert "deadline" in last.response.error.message


def test_crash_before_any_text_is_its_status(client: openai.OpenAI) -> None:
    with pytest.raises(openai.APIStatusError) as raised:
        list(client.responses.create(model="m", input="segfault", stream=True))
    assert raised.value.status_code == 502
    assert raised.value.code == "worker_crashed"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "max_output_tokens": "many"}, "max_output_tokens"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
            "input[0].content[0]",
        ),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        ({"input": "x", "frequency_penalty": 1}, "frequency_penalty"),
        ({"input": "x", "tools": [{"type": "function", "name": "bad name!"}]}, "tools[0].name"),
        ({}, "input"),
    ],
)
def test_refusals_name_the_field(daemon: Daemon, body: dict[str, Any], param: str) -> None:
    answer = httpx.post(daemon.url + "/v1/responses", json=body, timeout=30)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param


def test_context_length_error_in_openai_shape(tmp_path: Path) -> None:
    small = start_daemon(tmp_path, daemon_config(workers=1), args=("--max-model-len", "12"))
    try:
        made = openai.OpenAI(base_url=small.url + "/v1", api_key="none", max_retries=0)
        with made, pytest.raises(openai.BadRequestError) as raised:
            made.responses.create(model="m", input="echo: " + "word " * 40)
        assert raised.value.code == "context_length_exceeded"
    finally:
        assert small.stop() == 0, small.log()[-4000:]
