"""modelpool.shared.tools: the plan and grammar of a request's tools, rendering, and the one
reader of the model's calls (whole and streamed)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from modelpool.server.core.generation_body import parse_chat
from modelpool.server.http import ApiError
from modelpool.server.openai.format import response_body
from modelpool.shared.errors import MalformedToolCall
from modelpool.shared.tools import (
    CALL_OPEN,
    CallReader,
    ToolCall,
    ToolPlan,
    parse_tool_request,
    read_answer,
    render_chat,
    template_features,
)
from modelpool.supervisor.results import Result

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
USER = [{"role": "user", "content": "Weather in Paris?"}]
# The arguments as the grammar has them written: compact JSON.
GOOD = '<tool_call>{"name": "get_weather", "arguments": {"city":"Paris"}}</tool_call>'


def plan(choice: Any = None, parallel: bool | None = None) -> ToolPlan:
    body: dict[str, Any] = {"tools": [WEATHER, TIME]}
    if choice is not None:
        body["tool_choice"] = choice
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    result = parse_tool_request(body)
    assert result is not None
    return result


def test_tool_choice_forms() -> None:
    assert plan().choice == "auto" and plan().parallel
    assert plan("required").choice == "required"
    named = plan({"type": "function", "function": {"name": "get_time"}})
    assert (named.choice, named.named) == ("named", "get_time")
    assert not plan(parallel=False).parallel
    assert parse_tool_request({"tool_choice": "none"}) is None
    legacy = parse_tool_request({"functions": [WEATHER["function"]], "function_call": "auto"})
    assert legacy is not None and legacy.legacy and legacy.choice == "auto"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "bad name"}}]},
            "tools[0].function.name",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]},
            "tools[0].function.parameters",
        ),
        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"tools": [WEATHER], "functions": [WEATHER["function"]]}, "functions"),
    ],
)
def test_bad_tool_requests_are_400_naming_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as info:
        parse_chat({"messages": USER, **body})
    assert info.value.status == 400 and info.value.param == param


def _matcher_accepts(grammar: str, text: str, tokenizer_dir: Path) -> bool:
    """Does llguidance's matcher take every token of ``text`` and then accept the end?"""
    import llguidance
    import llguidance.hf
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    matcher = llguidance.LLMatcher(
        llguidance.hf.from_tokenizer(tokenizer), llguidance.LLMatcher.grammar_from_lark(grammar)
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    return matcher.consume_tokens(ids) and matcher.is_accepting() and not matcher.is_error()


def test_grammars_constrain_every_call_in_every_mode(tiny_model_dir: Path) -> None:
    auto = plan().grammar()
    assert auto is not None
    bad_arguments = GOOD.replace('"city"', '"town"')
    parallel = GOOD + "\n" + GOOD.replace("get_weather", "get_time").replace('"Paris"', '"x"')
    cases = {
        "auto": (
            auto,
            ["Just text, no call.", "Let me check. " + GOOD, parallel],
            [bad_arguments, "text " + bad_arguments, GOOD + " trailing text"],
        ),
        "required": (plan("required").grammar(), [GOOD, parallel], ["Just text.", bad_arguments]),
        "named": (
            plan({"type": "function", "function": {"name": "get_weather"}}).grammar(),
            [GOOD],
            [parallel, GOOD.replace("get_weather", "get_time")],
        ),
        "single": (plan(parallel=False).grammar(), [GOOD], [parallel]),
    }
    for mode, (grammar, accepted, refused) in cases.items():
        assert grammar is not None
        for text in accepted:
            assert _matcher_accepts(grammar, text, tiny_model_dir), (mode, text)
        for text in refused:
            assert not _matcher_accepts(grammar, text, tiny_model_dir), (mode, text)
    assert plan("none").grammar() is None


def test_reader_gives_the_same_calls_streamed_char_by_char_and_whole() -> None:
    text = "Checking. " + GOOD + "\n" + GOOD.replace("Paris", "Oslo")
    content, calls = read_answer(plan(), text)
    assert content == "Checking. "
    assert [json.loads(call.arguments) for call in calls] == [{"city": "Paris"}, {"city": "Oslo"}]
    assert all(call.id.startswith("call_") for call in calls)
    reader = CallReader(plan())
    events = [event for char in text for event in reader.feed(char)] + reader.finish()
    streamed = [e for e in events if isinstance(e, ToolCall)]
    assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in calls]
    assert "".join(e for e in events if isinstance(e, str)) == "Checking. "
    # A text that only starts like the marker is passed on whole.
    assert read_answer(plan(), "a <tool b")[0] == "a <tool b"


@pytest.mark.parametrize(
    "text",
    [
        GOOD.replace('"Paris"', "3"),  # does not validate against parameters
        GOOD.replace("get_weather", "no_such_tool"),
        GOOD.replace("}}</tool_call>", "</tool_call>"),  # not JSON
        GOOD[:-5],  # cut by max_tokens
    ],
)
def test_a_call_that_cannot_be_read_is_an_error_never_text(text: str) -> None:
    with pytest.raises(MalformedToolCall, match="hermes syntax"):
        read_answer(plan(), text)


def test_answers_carry_tool_calls_and_finish_reason() -> None:
    job = parse_chat({"messages": USER, "tools": [WEATHER], "tool_choice": "required"})
    assert job.tools is not None and job.params["tools"][0]["function"]["name"] == "get_weather"
    assert job.params["grammar"].startswith("%llguidance")
    result = Result(GOOD, "stop", "r1", 1, 3, 0.1, 0.0)
    body = response_body(job, {0: result}, "m", 0)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    legacy = parse_chat({"messages": USER, "functions": [WEATHER["function"]]})
    message = response_body(legacy, {0: result}, "m", 0)["choices"][0]
    assert message["finish_reason"] == "function_call"
    assert message["message"]["function_call"]["name"] == "get_weather"
    # A call cut by max_tokens is not a call, nor content: an error.
    with pytest.raises(MalformedToolCall, match="ends inside a call"):
        response_body(job, {0: Result(GOOD[:-3], "length", "r", 1, 3, 0.1, 0.0)}, "m", 0)


def test_conversations_with_calls_and_results() -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    job = parse_chat(
        {
            "messages": [
                *USER,
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            ],
            "tools": [WEATHER],
        }
    )
    _, asked, answered = job.prompts[0]
    assert isinstance(asked, dict) and isinstance(answered, dict)
    assert asked["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert answered == {
        "role": "tool",
        "content": "sunny",
        "tool_call_id": "call_1",
        "name": "get_weather",
    }
    bad = {**call, "function": {"name": "get_weather", "arguments": "{not json"}}
    with pytest.raises(ApiError) as info:
        parse_chat({"messages": [*USER, {"role": "assistant", "tool_calls": [bad]}]})
    assert info.value.param == "messages[1].tool_calls[0].function.arguments"


TOOLS_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }}{% endfor %}\n{% endfor %}"
    "assistant:"
)


def test_rendering_uses_the_template_tools_or_the_generic_preamble(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    tokenizer.chat_template = TOOLS_TEMPLATE
    features = template_features(tokenizer)
    assert features.tools and features.calls
    text = render_chat(tokenizer, USER, [WEATHER])
    assert text.startswith("TOOLS:get_weather;") and "You can call functions" not in text
    tokenizer.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    assert not template_features(tokenizer).tools
    asked = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "c",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    }
    text = render_chat(tokenizer, [*USER, asked], [WEATHER])
    assert text.startswith("system: You can call functions")
    assert '"name": "get_weather"' in text
    assert CALL_OPEN + '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text


def test_the_pool_refuses_a_malformed_tools_keyword_before_dispatch() -> None:
    from modelpool.shared.errors import InvalidRequest
    from modelpool.worker.backends.hf.handler import validate

    validate(plan().pool_params())
    for tools in ("get_weather", [{"name": "get_weather"}], [{"function": {}}]):
        with pytest.raises(InvalidRequest, match="tools must be"):
            validate({"tools": tools})
