"""Reasoning models through real clients against a real daemon: the testing backend's
scripted thinker (``think:N:ANSWER``, ``think:loop:ANSWER``; ``testing_thinking``) with
the worker's bound over it. Thinking comes back apart from the answer in every API's
shape (chat ``reasoning_content``/``reasoning``, Responses' ``reasoning`` item, Messages'
``thinking`` blocks, Ollama's ``message.thinking``), the controls each API has bound it,
and every forced close is marked and counted."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from e2e_support import Daemon

from modelpool.server.reasoning import CLOSED_HEADER

THOUGHT = "w0 w1 w2 w3 w4"


@pytest.fixture()
def client(daemon: Daemon) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=daemon.url + "/v1", api_key="none", max_retries=0) as made:
        yield made


def _chat(client: openai.OpenAI, prompt: str, **kwargs: Any) -> Any:
    return client.chat.completions.create(
        model="none", messages=[{"role": "user", "content": prompt}], **kwargs
    )


def test_chat_separates_thinking_under_both_names(client: openai.OpenAI) -> None:
    answer = _chat(client, "think:5:the answer is 4", reasoning_effort="low")
    message = answer.choices[0].message
    assert message.content == "the answer is 4"
    assert message.reasoning_content == THOUGHT
    assert message.reasoning == THOUGHT
    assert answer.choices[0].finish_reason == "stop"
    assert answer.usage.completion_tokens_details.reasoning_tokens == 5


def test_budget_closes_thinking_and_marks_it(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model="none",
        messages=[{"role": "user", "content": "think:40:done"}],
        extra_body={"thinking_token_budget": 3},
    )
    answer = raw.parse()
    assert answer.choices[0].message.reasoning_content == "w0 w1 w2"
    assert answer.choices[0].message.content == "done"
    assert answer.choices[0].model_extra["thinking_closed"] == "budget"
    assert raw.headers[CLOSED_HEADER] == "budget"


def test_stream_sends_thinking_as_reasoning_deltas(client: openai.OpenAI) -> None:
    reasoning, content, names = [], [], set()
    for chunk in _chat(client, "think:5:the answer is 4", stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        extra = delta.model_extra or {}
        names |= extra.keys()
        reasoning.append(extra.get("reasoning_content") or "")
        content.append(delta.content or "")
    assert "".join(reasoning) == THOUGHT
    assert "".join(content) == "the answer is 4"
    assert {"reasoning_content", "reasoning"} <= names


def test_a_looping_thinker_is_closed_and_answers(client: openai.OpenAI, daemon: Daemon) -> None:
    answer = _chat(client, "think:loop:the answer", max_tokens=400)
    choice = answer.choices[0]
    assert choice.message.content == "the answer"
    assert choice.finish_reason == "stop"
    assert choice.model_extra["thinking_closed"] == "loop"
    assert answer.usage.completion_tokens < 120  # closed near the detector's 64 tokens
    metrics = httpx.get(daemon.url + "/metrics", timeout=30).text
    assert 'modelpool_thinking_closed_total{reason="loop"}' in metrics
    line = next(
        line
        for line in metrics.splitlines()
        if line.startswith('modelpool_thinking_closed_total{reason="loop"}')
    )
    assert float(line.split()[-1]) >= 1


def test_max_tokens_keeps_a_reserve_for_the_answer(client: openai.OpenAI) -> None:
    answer = _chat(client, "think:loop:the answer", max_tokens=24)
    choice = answer.choices[0]
    assert choice.message.content == "the answer"
    assert choice.finish_reason == "stop"
    assert choice.model_extra["thinking_closed"] == "reserve"


def test_enable_thinking_false_closes_thinking_at_once(client: openai.OpenAI) -> None:
    answer = _chat(
        client,
        "think:9:plain answer",
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    message = answer.choices[0].message
    assert message.content == "plain answer"
    assert message.reasoning_content == ""


def test_bad_controls_are_refused_naming_the_field(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        _chat(client, "think:5:x", reasoning_effort="extreme")
    assert refused.value.body["param"] == "reasoning_effort"
    with pytest.raises(openai.BadRequestError) as refused:
        _chat(client, "think:5:x", extra_body={"thinking_token_budget": -1})
    assert refused.value.body["param"] == "thinking_token_budget"


def test_responses_reasoning_item_comes_first(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model="none", input="think:5:the answer is 4", reasoning={"effort": "low"}
    )
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "message"]
    assert response.output[0].content[0].text == THOUGHT
    assert response.output_text == "the answer is 4"
    assert response.usage.output_tokens_details.reasoning_tokens == 5


def test_responses_stream_sends_reasoning_text(client: openai.OpenAI) -> None:
    events = list(
        client.responses.create(
            model="none", input="think:5:the answer is 4", reasoning={"effort": "high"}, stream=True
        )
    )
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    answer = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert thought == THOUGHT
    assert answer == "the answer is 4"
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "message"]


def test_responses_mark_a_forced_close_whole_and_streamed(client: openai.OpenAI) -> None:
    # 40 thinking tokens do not leave the answer's reserve of 24: closed for it.
    asked: Any = {"model": "none", "input": "think:40:done", "max_output_tokens": 24}
    whole = client.responses.create(**asked)
    assert whole.output_text == "done"
    assert (whole.model_extra or {})["thinking_closed"] == "reserve"
    final = list(client.responses.create(**asked, stream=True))[-1].response
    assert (final.model_extra or {})["thinking_closed"] == "reserve"


def test_messages_thinking_blocks(daemon: Daemon) -> None:
    with anthropic.Anthropic(base_url=daemon.url, api_key="none", max_retries=0) as client:
        message = client.messages.create(
            model="none",
            max_tokens=64,
            thinking={"type": "enabled", "budget_tokens": 1024},
            messages=[{"role": "user", "content": "think:5:the answer is 4"}],
        )
        assert [block.type for block in message.content] == ["thinking", "text"]
        assert message.content[0].thinking == THOUGHT
        assert message.content[1].text == "the answer is 4"
        # The thinking block sent back in the next turn is accepted, and not read as text.
        again = client.messages.create(
            model="none",
            max_tokens=64,
            messages=[
                {"role": "user", "content": "think:5:the answer is 4"},
                {"role": "assistant", "content": [block.model_dump() for block in message.content]},
                {"role": "user", "content": "echo:fine"},
            ],
        )
        assert [block.type for block in again.content] == ["text"]
        assert again.content[0].text == "fine"


def test_messages_stream_thinking_delta(daemon: Daemon) -> None:
    client = anthropic.Anthropic(base_url=daemon.url, api_key="none", max_retries=0)
    with (
        client,
        client.messages.stream(
            model="none",
            max_tokens=64,
            thinking={"type": "enabled", "budget_tokens": 2},
            messages=[{"role": "user", "content": "think:5:the answer is 4"}],
        ) as stream,
    ):
        events = list(stream)
        final = stream.get_final_message()
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == "w0 w1"
    # The forced close, marked in the stream as on the whole message.
    (closing,) = [e for e in events if e.type == "message_delta"]
    assert (closing.delta.model_extra or {})["thinking_closed"] == "budget"
    assert "".join(d.text for d in deltas if d.type == "text_delta") == "the answer is 4"
    assert [block.type for block in final.content] == ["thinking", "text"]


def test_messages_thinking_disabled(daemon: Daemon) -> None:
    with anthropic.Anthropic(base_url=daemon.url, api_key="none", max_retries=0) as client:
        message = client.messages.create(
            model="none",
            max_tokens=64,
            thinking={"type": "disabled"},
            messages=[{"role": "user", "content": "think:5:the answer is 4"}],
        )
    assert [block.type for block in message.content] == ["text"]
    assert (message.model_extra or {})["thinking_closed"] == "budget"
    assert message.content[0].text == "the answer is 4"


def test_ollama_think_returns_message_thinking(http: httpx.Client) -> None:
    body = {
        "model": "none",
        "messages": [{"role": "user", "content": "think:5:the answer is 4"}],
        "think": True,
        "stream": False,
    }
    answer = http.post("/api/chat", json=body).json()
    assert answer["message"]["thinking"] == THOUGHT
    assert answer["message"]["content"] == "the answer is 4"
    lines = [
        json.loads(line)
        for line in http.post("/api/chat", json={**body, "stream": True}).text.splitlines()
    ]
    assert "".join(line["message"].get("thinking", "") for line in lines) == THOUGHT
    assert "".join(line["message"]["content"] for line in lines) == "the answer is 4"
    generate = {"model": "none", "prompt": "think:5:the answer is 4", "think": "low"}
    answer = http.post("/api/generate", json={**generate, "stream": False}).json()
    assert answer["thinking"] == THOUGHT and answer["response"] == "the answer is 4"
    lines = [
        json.loads(line)
        for line in http.post("/api/generate", json={**generate, "stream": True}).text.splitlines()
    ]
    assert "".join(line.get("thinking", "") for line in lines) == THOUGHT
    assert "".join(line["response"] for line in lines) == "the answer is 4"
    bad = http.post("/api/generate", json={**generate, "think": "max"})
    assert bad.status_code == 400 and "think must be" in bad.json()["error"]


def test_langchain_chat_openai_reads_the_answer(daemon: Daemon) -> None:
    from langchain_openai import ChatOpenAI

    model = ChatOpenAI(
        base_url=daemon.url + "/v1",
        api_key="none",
        model="none",
        reasoning_effort="low",
        max_retries=0,
    )
    reply = model.invoke("think:5:the answer is 4")
    assert reply.content == "the answer is 4"
    responses = ChatOpenAI(
        base_url=daemon.url + "/v1",
        api_key="none",
        model="none",
        use_responses_api=True,
        reasoning={"effort": "low"},
        max_retries=0,
    )
    blocks = responses.invoke("think:5:the answer is 4").content
    assert any(isinstance(b, dict) and b.get("type") == "reasoning" for b in blocks), blocks


def test_harmony_channels_from_a_backend_that_writes_them(client: openai.OpenAI) -> None:
    harmony = (
        "<|channel|>analysis<|message|>Easy sum.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>4."
    )
    message = _chat(client, "echo:" + harmony).choices[0].message
    assert message.reasoning_content == "Easy sum."
    assert message.content == "4."
    streamed = [
        c.choices[0].delta for c in _chat(client, "echo:" + harmony, stream=True) if c.choices
    ]
    assert "".join(d.content or "" for d in streamed) == "4."
    assert "".join((d.model_extra or {}).get("reasoning", "") for d in streamed) == "Easy sum."


def test_the_request_deadline_closes_thinking_in_time(client: openai.OpenAI) -> None:
    # 10 ms a token for 400 tokens would pass the 3 s timeout; closed, it answers within.
    answer = _chat(client, "think:400:done:0.01", max_tokens=2000, extra_body={"timeout": 3})
    choice = answer.choices[0]
    assert choice.model_extra["thinking_closed"] == "deadline"
    assert choice.message.content == "done"
