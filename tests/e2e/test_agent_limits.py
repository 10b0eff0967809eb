"""What an agent's requests get from a model's context, through the openai and anthropic
clients against a real daemon (testing backend, a 4096-token context): a request that
sets no maximum gets all the room the context leaves (not a fixed 128), and no more
than decodes before its deadline at the pool's measured rate, a Messages
``max_tokens`` past the context (Claude Code asks 32000) is cut to what fits, or, for a
model whose ``generation_defaults`` say ``fit_to_context = false``, refused with the
real numbers in Anthropic's words.

The docs, The agent APIs.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest
from e2e_support import Daemon, keyed_daemon, registry_config

from helpers import FAR_DEADLINE_S

KEY = "test-agent-limits-key"
CONTEXT = 4096
# More tokens than the context holds: the testing backend writes min(N, the limit).
PAST_THE_CONTEXT = "tokens:9000"
# A model whose runs decode 50 tokens a second: 9000 of them would pass its deadline.
PACED = "tokens:9000:0.02"
PACED_DEADLINE_S = 8.0


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    context: dict[str, Any] = {"backend_options": {"max_model_len": CONTEXT}, "workers": 1}
    models: dict[str, dict[str, Any]] = {
        "fits": {"model": "fits", "preload": True, **context},
        "refuses": {
            "model": "refuses",
            "preload": True,
            "generation_defaults": {"fit_to_context": False},
            **context,
        },
        "paced": {"model": "paced", "preload": True, "deadline_s": PACED_DEADLINE_S, **context},
    }
    config = registry_config(models, workers=1, server={"max_request_timeout_s": FAR_DEADLINE_S})
    yield from keyed_daemon(tmp_path_factory.mktemp("agent-limits"), config, KEY)


@pytest.fixture()
def claude(daemon: Daemon) -> Iterator[anthropic.Anthropic]:
    # A timeout of its own: the client refuses a non-streamed max_tokens of 32000 under
    # its default one.
    with anthropic.Anthropic(
        base_url=daemon.url, api_key=KEY, max_retries=0, timeout=60.0
    ) as client:
        yield client


@pytest.fixture()
def gpt(daemon: Daemon) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=daemon.url + "/v1", api_key=KEY, max_retries=0) as client:
        yield client


def test_a_chat_without_max_tokens_gets_the_room_the_context_leaves(gpt: openai.OpenAI) -> None:
    answer = gpt.chat.completions.create(
        model="fits", messages=[{"role": "user", "content": PAST_THE_CONTEXT}]
    )
    usage = answer.usage
    assert usage is not None and usage.completion_tokens > 128
    assert usage.prompt_tokens + usage.completion_tokens == CONTEXT
    assert answer.choices[0].finish_reason == "length"


def test_a_response_without_max_output_tokens_gets_the_room_too(gpt: openai.OpenAI) -> None:
    response = gpt.responses.create(model="refuses", input=PAST_THE_CONTEXT)
    usage = response.usage
    assert usage is not None and usage.input_tokens + usage.output_tokens == CONTEXT
    assert response.status == "incomplete"


def test_messages_max_tokens_past_the_context_is_cut_to_what_fits(
    claude: anthropic.Anthropic,
) -> None:
    message = claude.messages.create(
        model="fits", max_tokens=32000, messages=[{"role": "user", "content": PAST_THE_CONTEXT}]
    )
    assert message.usage.input_tokens + message.usage.output_tokens == CONTEXT
    assert message.stop_reason == "max_tokens"
    # Streamed, as Claude Code asks.
    with claude.messages.stream(
        model="fits", max_tokens=32000, messages=[{"role": "user", "content": PAST_THE_CONTEXT}]
    ) as stream:
        streamed = stream.get_final_message()
    assert streamed.usage.output_tokens == message.usage.output_tokens
    assert streamed.stop_reason == "max_tokens"
    short = claude.messages.create(
        model="fits", max_tokens=32000, messages=[{"role": "user", "content": "tokens:5"}]
    )
    assert short.usage.output_tokens == 5 and short.stop_reason == "end_turn"


def test_a_model_that_refuses_names_the_prompt_the_request_and_the_context(
    claude: anthropic.Anthropic,
) -> None:
    with pytest.raises(anthropic.BadRequestError) as raised:
        claude.messages.create(
            model="refuses", max_tokens=32000, messages=[{"role": "user", "content": "hi"}]
        )
    body = raised.value.body
    assert isinstance(body, dict) and body["error"]["code"] == "context_length_exceeded"
    message = body["error"]["message"]
    prompt = int(message.split(": ")[1].split(" + ")[0])
    assert 0 < prompt < 100
    assert message == (
        f"input length and `max_tokens` exceed context limit: {prompt} + 32000 > {CONTEXT}, "
        "decrease input length or `max_tokens` and try again"
    )


def test_a_prompt_past_the_context_is_too_long_whatever_the_model_chose(
    claude: anthropic.Anthropic,
) -> None:
    for model in ("fits", "refuses"):
        with pytest.raises(anthropic.BadRequestError) as raised:
            claude.messages.create(
                model=model,
                max_tokens=32000,
                messages=[{"role": "user", "content": "word " * (CONTEXT + 100)}],
            )
        body = raised.value.body
        assert isinstance(body, dict)
        message = body["error"]["message"]
        assert message.startswith("prompt is too long: ") and message.endswith(
            f" tokens > {CONTEXT} maximum"
        ), message
        assert int(message.split()[4]) > CONTEXT


def test_a_chat_without_max_tokens_ends_within_its_deadline_once_rates_are_measured(
    gpt: openai.OpenAI,
) -> None:
    for _ in range(3):  # the runs the pool measures its decode rate on
        gpt.chat.completions.create(
            model="paced", messages=[{"role": "user", "content": PACED}], max_tokens=20
        )
    answer = gpt.chat.completions.create(
        model="paced", messages=[{"role": "user", "content": PACED}]
    )
    # Cut by what decodes before the deadline (about 50 a second, less a fifth), not a
    # 504 after 8 s, nor the 4,096 tokens the context leaves.
    usage = answer.usage
    assert usage is not None and 20 < usage.completion_tokens < 50 * PACED_DEADLINE_S
    assert answer.choices[0].finish_reason == "length"
