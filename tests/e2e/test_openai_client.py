"""The daemon through the official ``openai`` client: completions, chat, streaming."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from e2e_support import Daemon
from openai.types.chat import ChatCompletionMessageParam


@pytest.fixture()
def client(daemon: Daemon) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=daemon.url + "/v1", api_key="unused", max_retries=0, timeout=30.0
    ) as client:
        yield client


def test_completion(client: openai.OpenAI) -> None:
    completion = client.completions.create(model="anything", prompt="echo:hello there")
    assert completion.choices[0].text == "hello there"
    assert completion.choices[0].finish_reason == "stop"
    assert completion.object == "text_completion"
    assert completion.id.startswith("cmpl-")
    assert completion.model == "none"
    assert completion.created > 0


def test_completion_with_a_list_of_prompts_has_one_choice_each_in_order(
    client: openai.OpenAI,
) -> None:
    completion = client.completions.create(
        model="anything", prompt=["echo:first", "tokens:3", "echo:third"]
    )
    assert [choice.index for choice in completion.choices] == [0, 1, 2]
    assert [choice.text for choice in completion.choices] == ["first", "t0 t1 t2 ", "third"]
    assert completion.usage is None or completion.usage.completion_tokens is None


def test_chat(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="anything",
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "tokens:5"},
        ],
    )
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == "t0 t1 t2 t3 t4 "
    assert choice.finish_reason == "stop"
    assert reply.object == "chat.completion"
    assert reply.usage is not None and reply.usage.completion_tokens == 5


def test_max_tokens_ends_with_length(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "tokens:10"}], max_tokens=3
    )
    assert reply.choices[0].message.content == "t0 t1 t2 "
    assert reply.choices[0].finish_reason == "length"


def test_sampling_fields_are_accepted(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "echo:ok"}],
        temperature=0.7,
        top_p=0.9,
        seed=1,
        stop=["\n\n"],
        n=1,
        presence_penalty=0,
        user="someone",
    )
    assert reply.choices[0].message.content == "ok"


def test_streaming_chat_joins_to_the_non_streamed_text(client: openai.OpenAI) -> None:
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "tokens:12:0.01"}]
    whole = client.chat.completions.create(model="m", messages=messages)
    chunks = list(client.chat.completions.create(model="m", messages=messages, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert streamed == whole.choices[0].message.content == "".join(f"t{i} " for i in range(12))
    assert len({c.id for c in chunks}) == 1
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_streaming_chat_reports_usage_when_asked(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "tokens:5"}],
            stream=True,
            stream_options={"include_usage": True},
            max_tokens=3,
        )
    )
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finishing] == ["length"]
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3


def test_streaming_completion(client: openai.OpenAI) -> None:
    stream = client.completions.create(model="m", prompt="tokens:4", stream=True)
    assert "".join(c.choices[0].text for c in stream) == "t0 t1 t2 t3 "


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["none"]
    assert client.models.retrieve("none").id == "none"


def test_errors_reach_the_client_typed(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], n=0)
    assert info.value.status_code == 400
    assert info.value.body["param"] == "n"  # type: ignore[index]
    with pytest.raises(openai.APIStatusError) as crashed:
        client.completions.create(model="m", prompt="segfault")
    assert crashed.value.status_code == 502
