"""gpt-oss's Harmony on a real backend: a tiny random hf model carrying Harmony's special
tokens and a Harmony chat template (``tinymodel.build_thinking_model(..., "gpt_oss")``),
served by a daemon. The worker keeps Harmony's tokens in the decoded text (the hf backend
drops special tokens otherwise), so that the daemon splits the analysis channel from the
final one; the worker's forced close is Harmony's own switch to the final channel; and a
call written on the commentary channel (constrained by the gpt_oss grammar) comes back
as ``tool_calls``. Random weights never close their own thinking: every close here is
the worker's."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from e2e_support import Daemon, daemon_config, start_daemon

from modelpool.server.reasoning import CLOSED_HEADER
from modelpool.tinymodel import build_thinking_model
from tool_families import weather_tool

pytestmark = pytest.mark.slow

HARMONY = ("<|channel|>", "<|message|>", "<|end|>", "<|start|>", "<|call|>", "analysis")
CHAT: Any = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def harmony_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("harmony")
    path: Path = build_thinking_model(root / "tiny-harmony", "gpt_oss")
    config = daemon_config(model=str(path), backend="hf", workers=1, deadline_s=180.0)
    daemon = start_daemon(root / "daemon", config, ready_timeout=300.0)
    yield daemon
    assert daemon.stop() == 0, daemon.log()[-4000:]


@pytest.fixture(scope="module")
def client(harmony_daemon: Daemon) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=harmony_daemon.url + "/v1", api_key="none", max_retries=0, timeout=180.0
    ) as made:
        yield made


def test_analysis_is_reasoning_and_the_budget_holds(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model="tiny",
        messages=CHAT,
        max_tokens=40,
        temperature=0,
        extra_body={"thinking_token_budget": 5},
    )
    answer = raw.parse()
    choice = answer.choices[0]
    reasoning = choice.message.model_extra["reasoning_content"]
    content = choice.message.content or ""
    assert reasoning and content
    assert not any(marker in text for marker in HARMONY for text in (reasoning, content))
    assert answer.usage is not None and answer.usage.completion_tokens_details is not None
    assert answer.usage.completion_tokens_details.reasoning_tokens == 5
    assert choice.model_extra["thinking_closed"] == "budget"
    assert raw.headers[CLOSED_HEADER] == "budget"

    streamed_reasoning, streamed_content = [], []
    for chunk in client.chat.completions.create(
        model="tiny",
        messages=CHAT,
        max_tokens=40,
        temperature=0,
        stream=True,
        extra_body={"thinking_token_budget": 5},
    ):
        if chunk.choices:
            delta = chunk.choices[0].delta
            streamed_reasoning.append((delta.model_extra or {}).get("reasoning_content") or "")
            streamed_content.append(delta.content or "")
    assert "".join(streamed_reasoning) == reasoning
    assert "".join(streamed_content) == content


WEATHER = weather_tool(enum=["Paris", "Oslo"])


def test_a_call_after_the_workers_forced_close(client: openai.OpenAI) -> None:
    # The template opened analysis; the budget closes it at <|start|>assistant and the
    # tool grammar, past the analysis, offers only the call (required).
    answer = client.chat.completions.create(
        model="tiny",
        messages=CHAT,
        max_tokens=120,  # the call alone is some 50 of the tiny vocabulary's tokens
        temperature=0,
        tools=[WEATHER],
        tool_choice="required",
        extra_body={"thinking_token_budget": 5},
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")
    assert choice.model_extra["thinking_closed"] == "budget"
    assert answer.usage is not None and answer.usage.completion_tokens_details is not None
    assert answer.usage.completion_tokens_details.reasoning_tokens == 5
    # (Random weights may write any token while thinking, Harmony's among them.)
    assert choice.message.model_extra["reasoning_content"]
    assert not choice.message.content


def test_auto_after_a_forced_close_never_reopens_analysis(client: openai.OpenAI) -> None:
    # Random weights choose between the final channel and the call; analysis is not
    # among the choices any more, so thinking stays at the budget's 5 tokens.
    answer = client.chat.completions.create(
        model="tiny",
        messages=CHAT,
        max_tokens=120,
        temperature=0,
        tools=[WEATHER],
        extra_body={"thinking_token_budget": 5},
    )
    choice = answer.choices[0]
    assert answer.usage is not None and answer.usage.completion_tokens_details is not None
    assert answer.usage.completion_tokens_details.reasoning_tokens == 5
    content = choice.message.content or ""
    assert choice.message.tool_calls or content
    assert not any(marker in content for marker in HARMONY)
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
