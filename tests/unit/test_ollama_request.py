"""Ollama's ``/api/chat`` and ``/api/generate`` bodies translated onto the chat and
completion jobs (``server.ollama.request``): options, format, tool calls and results,
raw prompts, load-only bodies, and refusals that name Ollama's own field."""

from __future__ import annotations

from typing import Any

import pytest

from modelpool.server.http import ApiError
from modelpool.server.ollama.request import parse_chat_body, parse_generate_body

HELLO = [{"role": "user", "content": "hello"}]


def refusal(body: dict[str, Any], *, generate: bool = False) -> ApiError:
    with pytest.raises(ApiError) as raised:
        (parse_generate_body if generate else parse_chat_body)(body)
    assert raised.value.status == 400
    return raised.value


def test_options_become_the_pool_kwargs() -> None:
    request = parse_chat_body(
        {
            "model": "m",
            "messages": HELLO,
            "options": {
                "num_predict": 7,
                "temperature": 0.2,
                "top_k": 3,
                "top_p": 0.5,
                "seed": 9,
                "stop": ["\n"],
                "repeat_penalty": 1.2,
                "num_ctx": 512,
                "num_gpu": 99,
            },
        }
    )
    params = request.job.params
    assert params["max_new_tokens"] == 7 and params["temperature"] == 0.2
    assert params["top_k"] == 3 and params["top_p"] == 0.5 and params["seed"] == 9
    assert params["stop"] == ["\n"] and params["repetition_penalty"] == 1.2
    assert request.num_ctx == 512 and request.ignored == ["options.num_gpu"]
    assert request.job.stream is True  # Ollama streams unless told not to
    assert request.job.prompts == [HELLO]


def test_num_predict_minus_one_is_the_model_default() -> None:
    request = parse_chat_body({"model": "m", "messages": HELLO, "options": {"num_predict": -1}})
    assert "max_new_tokens" not in request.job.params


def test_refusals_name_ollama_fields() -> None:
    bad_temperature = {"model": "m", "messages": HELLO, "options": {"temperature": -1}}
    assert refusal(bad_temperature).param == "options.temperature"
    assert refusal({"model": "m", "messages": HELLO, "format": "xml"}).param == "format"
    assert refusal({"model": "m", "messages": HELLO, "options": {"min_p": 0.1}}).param == (
        "options.min_p"
    )
    assert refusal({"model": "m", "messages": HELLO, "options": {"bogus": 1}}).param == (
        "options.bogus"
    )
    assert refusal({"model": "m", "messages": [{"role": "robot", "content": "x"}]}).param == (
        "messages[0].role"
    )
    assert refusal({"messages": HELLO}).param == "model"
    assert refusal({"model": "m", "messages": HELLO, "logprobs": True}).param == "logprobs"


def test_format_json_and_schema_are_structured_outputs() -> None:
    as_json = parse_chat_body({"model": "m", "messages": HELLO, "format": "json"})
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    shaped = parse_chat_body({"model": "m", "messages": HELLO, "format": schema})
    assert "grammar" in as_json.job.params and "grammar" in shaped.job.params
    plain = parse_chat_body({"model": "m", "messages": HELLO, "format": ""})
    assert "grammar" not in plain.job.params


def test_tool_calls_get_ids_and_results_answer_them() -> None:
    request = parse_chat_body(
        {
            "model": "m",
            "messages": [
                *HELLO,
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {"function": {"name": "a", "arguments": {"x": 1}}},
                        {"function": {"name": "b", "arguments": {}}},
                    ],
                },
                {"role": "tool", "content": "B", "tool_name": "b"},
                {"role": "tool", "content": "A"},
            ],
        }
    )
    prompt = request.job.prompts[0]
    assert isinstance(prompt, list)
    calls = prompt[1]["tool_calls"]
    assert [call["function"]["arguments"] for call in calls] == [{"x": 1}, {}]
    by_id = {call["id"]: call["function"]["name"] for call in calls}
    assert by_id[prompt[2]["tool_call_id"]] == "b" and prompt[2]["name"] == "b"
    assert by_id[prompt[3]["tool_call_id"]] == "a" and prompt[3]["name"] == "a"


def test_generate_templated_or_raw() -> None:
    templated = parse_generate_body({"model": "m", "prompt": "hi", "system": "be brief"})
    assert templated.job.prompts == [
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    ]
    assert templated.job.chat is True
    raw = parse_generate_body({"model": "m", "prompt": "<s>hi", "raw": True, "context": [1, 2]})
    assert raw.job.prompts == ["<s>hi"] and raw.job.chat is False
    assert raw.ignored == ["context"]
    assert refusal(
        {"model": "m", "prompt": "x", "raw": True, "system": "s"}, generate=True
    ).param == ("system")
    assert refusal(
        {"model": "m", "prompt": "x", "template": "{{ .Prompt }}"}, generate=True
    ).param == ("template")


def test_no_messages_or_an_empty_prompt_runs_nothing() -> None:
    assert parse_chat_body({"model": "m", "messages": []}).runs is False
    assert parse_chat_body({"model": "m"}).runs is False
    assert parse_generate_body({"model": "m", "prompt": ""}).runs is False
    assert parse_generate_body({"model": "m", "prompt": "x"}).runs is True
