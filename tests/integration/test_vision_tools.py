"""Tools on an hf vision model (the tiny random LLaVA), through a real pool: the tools
offered by the processor's template or in the system turn, the answer held to the tool
grammar (greedy, the grammar forcing a call) and read into calls as for any model."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from images_support import image_part, pattern, text_part
from modelpool import ModelPool, PoolConfig
from modelpool.shared.tools import parse_tool_request, read_answer
from modelpool.tinyvision import IMAGE_TOKENS, VISION_CHAT_TEMPLATE, build_tiny_vision_model

COLOUR = {
    "type": "object",
    "properties": {"colour": {"enum": ["red", "green", "blue"]}},
    "required": ["colour"],
    "additionalProperties": False,
}
SHAPE = {
    "type": "object",
    "properties": {"sides": {"enum": [3, 4]}},
    "required": ["sides"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "name_colour", "parameters": COLOUR}},
    {"type": "function", "function": {"name": "count_sides", "parameters": SHAPE}},
]
# The tiny template with a tools block, as the templates that render tools have.
TOOLS_TEMPLATE = (
    "{% if tools %}<|tools|>\n{% for tool in tools %}{{ tool['function']['name'] }}\n"
    "{% endfor %}{% endif %}" + VISION_CHAT_TEMPLATE
)
PROMPT = [
    {
        "role": "user",
        "content": [text_part("What colour is this?"), image_part(pattern(40, 30, seed=5))],
    }
]


@pytest.fixture(scope="module")
def tiny_vision_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_vision_model(tmp_path_factory.mktemp("models") / "tiny-llava")


def _pool(model_dir: Path, **backend_options: Any) -> ModelPool:
    config = PoolConfig(
        model=str(model_dir),
        backend="hf",
        workers=1,
        devices=["cpu"],
        backend_options=backend_options,
    )
    return ModelPool(config)


def _one_call(plan_body: dict[str, Any], text: str) -> tuple[str, dict[str, Any]]:
    plan = parse_tool_request(plan_body)
    assert plan is not None
    content, calls = read_answer(plan, text)
    assert content is None and len(calls) == 1, text
    return calls[0].name, json.loads(calls[0].arguments)


@pytest.mark.slow
def test_a_vision_model_calls_a_tool_about_an_image(tiny_vision_dir: Path) -> None:
    required = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}
    named = {
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "count_sides"}},
    }
    with _pool(tiny_vision_dir) as pool:
        plain = pool.generate(PROMPT, max_new_tokens=8)
        answers = {}
        for label, body in (("required", required), ("named", named)):
            plan = parse_tool_request(body)
            assert plan is not None
            answers[label] = pool.generate(
                PROMPT, max_new_tokens=160, **plan.for_model(pool.config).pool_params()
            )
    name, arguments = _one_call(required, answers["required"].text)
    jsonschema.validate(arguments, COLOUR if name == "name_colour" else SHAPE)
    name, arguments = _one_call(named, answers["named"].text)
    assert name == "count_sides"
    jsonschema.validate(arguments, SHAPE)
    for answer in answers.values():
        assert answer.finish_reason == "stop", (answer.text, answer.completion_tokens)
        assert answer.prompt_tokens is not None and plain.prompt_tokens is not None
        # The template renders no tools: they are offered in a system turn, the image kept.
        assert answer.prompt_tokens > plain.prompt_tokens + IMAGE_TOKENS // 4


@pytest.mark.slow
def test_a_template_that_renders_tools_gets_them(tiny_vision_dir: Path) -> None:
    """The processor's own template renders the tools: the prompt is its rendering."""
    from PIL import Image
    from transformers import AutoProcessor

    body = {"tools": TOOLS, "tool_choice": "required"}
    plan = parse_tool_request(body)
    assert plan is not None
    with _pool(tiny_vision_dir, chat_template=TOOLS_TEMPLATE) as pool:
        answer = pool.generate(
            PROMPT, max_new_tokens=160, **plan.for_model(pool.config).pool_params()
        )
    processor: Any = AutoProcessor.from_pretrained(tiny_vision_dir)
    processor.chat_template = TOOLS_TEMPLATE
    picture = Image.open(io.BytesIO(PROMPT[0]["content"][1]["data"])).convert("RGB")
    messages = [
        {"role": "user", "content": [PROMPT[0]["content"][0], {"type": "image", "image": picture}]}
    ]
    expected = processor.apply_chat_template(
        messages, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    assert answer.prompt_tokens == len(expected["input_ids"][0])
    name, arguments = _one_call(body, answer.text)
    jsonschema.validate(arguments, COLOUR if name == "name_colour" else SHAPE)
