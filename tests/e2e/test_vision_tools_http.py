"""An hf vision model (the tiny random LLaVA) through a daemon, sent tools and an image as
Claude Code sends them: a 200 with a ``tool_use`` block (or text), never a 400; the
OpenAI chat and Responses shapes of the same call."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from e2e_support import Daemon, keyed_daemon, registry_config

from helpers import slack
from image_files import b64, data_url
from images_support import pattern
from modelpool.tinyvision import build_tiny_vision_model

KEY = "vision-tools-key"
PICTURE = pattern(40, 30, seed=5)
SIDES = {
    "type": "object",
    "properties": {"sides": {"enum": [3, 4]}},
    "required": ["sides"],
    "additionalProperties": False,
}
# A call is about 65 tokens of the tiny model's character-level tokenizer.
ROOM = 160


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    model_dir: Path = build_tiny_vision_model(tmp_path_factory.mktemp("models") / "tiny-llava")
    models = {
        "seer": {"model": str(model_dir), "backend": "hf", "preload": True, "deadline_s": 120.0}
    }
    config = registry_config(models, workers=1, server={})
    yield from keyed_daemon(tmp_path_factory.mktemp("vision-tools"), config, KEY)


def _claude(daemon: Daemon) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=daemon.url, api_key=KEY, max_retries=0, timeout=slack(120.0)
    )


def _image_turn() -> list[Any]:
    image = {"type": "base64", "media_type": "image/png", "data": b64(PICTURE)}
    return [
        {
            "role": "user",
            "content": [
                {"type": "image", "source": image},
                {"type": "text", "text": "How many sides has the shape?"},
            ],
        }
    ]


@pytest.mark.slow
def test_claude_code_sends_tools_and_an_image(daemon: Daemon) -> None:
    tool: Any = {"name": "count_sides", "description": "Count sides", "input_schema": SIDES}
    with _claude(daemon) as claude:
        forced = claude.messages.create(
            model="seer",
            max_tokens=ROOM,
            tools=[tool],
            tool_choice={"type": "any"},
            messages=_image_turn(),
        )
        # As Claude Code sends it: tools offered, the model free to answer in text.
        free = claude.messages.create(
            model="seer", max_tokens=ROOM, tools=[tool], messages=_image_turn()
        )
    uses = [block for block in forced.content if block.type == "tool_use"]
    assert forced.stop_reason == "tool_use" and len(uses) == 1, forced
    assert uses[0].name == "count_sides" and uses[0].input["sides"] in (3, 4)
    assert free.content and {block.type for block in free.content} <= {"text", "tool_use"}
    assert free.usage.input_tokens == forced.usage.input_tokens


@pytest.mark.slow
def test_a_streamed_session_reads_a_picture_through_a_tool(daemon: Daemon) -> None:
    """Claude Code's shape: streamed turns, the model calls Read, the result is the picture
    as an image block, and the next turn (tools still offered) is answered too."""
    read: Any = {
        "name": "Read",
        "description": "Read a file",
        "input_schema": {
            "type": "object",
            "properties": {"file_path": {"enum": ["shot.png"]}},
            "required": ["file_path"],
            "additionalProperties": False,
        },
    }
    asked: list[Any] = [{"role": "user", "content": "Look at shot.png"}]
    with _claude(daemon) as claude:
        with claude.messages.stream(
            model="seer",
            max_tokens=ROOM,
            tools=[read],
            tool_choice={"type": "tool", "name": "Read"},
            messages=asked,
        ) as stream:
            first = stream.get_final_message()
        uses = [block for block in first.content if block.type == "tool_use"]
        assert first.stop_reason == "tool_use" and len(uses) == 1, first
        assert uses[0].input == {"file_path": "shot.png"}
        image = {"type": "base64", "media_type": "image/png", "data": b64(PICTURE)}
        result = {
            "type": "tool_result",
            "tool_use_id": uses[0].id,
            "content": [{"type": "image", "source": image}],
        }
        conversation: list[Any] = [
            *asked,
            {"role": "assistant", "content": [block.model_dump() for block in first.content]},
            {"role": "user", "content": [result]},
        ]
        with claude.messages.stream(
            model="seer", max_tokens=ROOM, tools=[read], messages=conversation
        ) as stream:
            second = stream.get_final_message()
    assert second.content and {block.type for block in second.content} <= {"text", "tool_use"}
    assert second.usage.input_tokens > first.usage.input_tokens


@pytest.mark.slow
def test_chat_and_responses_tool_calls_with_an_image(daemon: Daemon) -> None:
    function = {"name": "count_sides", "parameters": SIDES}
    with openai.OpenAI(
        base_url=daemon.url + "/v1", api_key=KEY, max_retries=0, timeout=slack(120.0)
    ) as client:
        chat = client.chat.completions.create(
            model="seer",
            max_tokens=ROOM,
            tools=[{"type": "function", "function": function}],
            tool_choice="required",
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "How many sides?"},
                        {"type": "image_url", "image_url": {"url": data_url(PICTURE)}},
                    ],
                }
            ],
        )
        response = client.responses.create(
            model="seer",
            max_output_tokens=ROOM,
            tools=[{"type": "function", **function, "strict": True}],
            tool_choice="required",
            input=[
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "How many sides?"},
                        {"type": "input_image", "image_url": data_url(PICTURE), "detail": "auto"},
                    ],
                }
            ],
        )
    calls = chat.choices[0].message.tool_calls
    assert chat.choices[0].finish_reason == "tool_calls" and calls and len(calls) == 1
    assert json.loads(calls[0].function.arguments)["sides"] in (3, 4)
    items = [item for item in response.output if item.type == "function_call"]
    assert len(items) == 1 and items[0].name == "count_sides"
    assert json.loads(items[0].arguments)["sides"] in (3, 4)
