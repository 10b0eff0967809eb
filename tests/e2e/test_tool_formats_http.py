"""Tool calls in each family's own syntax, end to end through a daemon and the clients
people point at it: one model per family (a tiny model directory carrying the family's
chat template and special tokens, so that ``tool_parser = "auto"`` detects it), served
by the testing backend, whose "model" writes the family's raw call syntax as the prompt
says. The ``openai`` client (calls, streamed deltas, the error of a malformed call),
``anthropic`` (``tool_use`` blocks, streamed too), Responses ``function_call`` items,
Ollama's ``tool_calls``, LangChain's ``bind_tools`` and the openai-agents SDK on the
non-Hermes families; and on the hf backend, a tiny Mistral-style model whose grammar
writes ``[TOOL_CALLS]`` as its special token, decoded and read back as the call.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from e2e_support import (
    Daemon,
    daemon_config,
    keyed_daemon,
    keyed_http,
    registry_config,
    start_daemon,
)

from tool_families import FAMILIES, SAMPLE_CALLS, build_family_model

pytestmark = pytest.mark.slow

KEY = "test-tool-formats-key"
PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}
WEATHER: Any = {
    "type": "function",
    "function": {"name": "get_weather", "description": "The weather", "parameters": PARAMETERS},
}
# Text of every family's syntax that must never reach content.
MARKERS = ("<tool_call>", "<function=", "[TOOL_CALLS]", "<|channel|>", "to=functions", '"name"')


def expected_calls(parser: str) -> list[dict[str, Any]]:
    return SAMPLE_CALLS[:1] if parser == "gpt_oss" else SAMPLE_CALLS


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {parser: build_family_model(root, family) for parser, family in FAMILIES.items()}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, models: dict[str, Path]) -> Iterator[Daemon]:
    tables: dict[str, dict[str, Any]] = {
        parser: {"model": str(path)} for parser, path in models.items()
    }
    # A model whose template says Hermes, told to read Mistral's syntax.
    tables["told"] = {"model": str(models["hermes"]), "tool_parser": "mistral"}
    config = registry_config(tables, workers=1, server={"max_request_timeout_s": 60.0})
    yield from keyed_daemon(tmp_path_factory.mktemp("daemon"), config, KEY)


@pytest.fixture(scope="module")
def client(daemon: Daemon) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=daemon.url + "/v1", api_key=KEY, max_retries=0, timeout=60.0
    ) as opened:
        yield opened


def ask(text: str) -> Any:
    return [{"role": "user", "content": "echo:" + text}]


@pytest.mark.parametrize("parser", list(FAMILIES))
def test_openai_chat_reads_each_family_whole_and_streamed(
    client: openai.OpenAI, parser: str
) -> None:
    sample = FAMILIES[parser].sample
    whole = client.chat.completions.create(
        model=parser, messages=ask(sample), tools=[WEATHER]
    ).choices[0]
    assert whole.finish_reason == "tool_calls"
    calls = whole.message.tool_calls or []
    assert [json.loads(call.function.arguments) for call in calls] == expected_calls(parser)
    assert {call.function.name for call in calls} == {"get_weather"}
    content = whole.message.content or ""
    assert content == ("" if parser == "llama3_json" else "Checking. ")
    assert not any(marker in content for marker in MARKERS)

    chunks = list(
        client.chat.completions.create(
            model=parser, messages=ask(sample), tools=[WEATHER], stream=True
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert text == content
    arguments = [
        json.loads(
            "".join(d.function.arguments or "" for d in deltas if d.index == index and d.function)
        )
        for index in sorted({d.index for d in deltas})
    ]
    assert arguments == expected_calls(parser)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_parser_named_in_the_config_wins_over_the_template(client: openai.OpenAI) -> None:
    mistral = FAMILIES["mistral"].sample
    calls = (
        client.chat.completions.create(model="told", messages=ask(mistral), tools=[WEATHER])
        .choices[0]
        .message.tool_calls
    )
    assert calls is not None and len(calls) == 2
    # Hermes text is plain content to a model told to read Mistral's syntax.
    hermes = FAMILIES["hermes"].sample
    answer = client.chat.completions.create(model="told", messages=ask(hermes), tools=[WEATHER])
    assert answer.choices[0].message.content == hermes


def test_a_malformed_call_is_an_error_naming_the_model_never_content(
    client: openai.OpenAI,
) -> None:
    broken = 'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}'
    with pytest.raises(openai.APIStatusError) as raised:
        client.chat.completions.create(model="mistral", messages=ask(broken), tools=[WEATHER])
    assert raised.value.status_code == 502
    body: Any = raised.value.body
    assert body["code"] == "malformed_tool_call" and body["tool_parser"] == "mistral"
    assert "mistral" in body["message"] and "[TOOL_CALLS]" in body["message"]
    # Streamed: the content before it went out, then the error ends the stream.
    stream = client.chat.completions.create(
        model="mistral", messages=ask(broken), tools=[WEATHER], stream=True
    )
    with pytest.raises(openai.APIError, match="cannot be read"):
        list(stream)
    # A call of a tool that was not offered is not dropped either.
    unknown = FAMILIES["qwen3_coder"].sample.replace("get_weather", "get_time")
    with pytest.raises(openai.APIStatusError, match="not among the tools"):
        client.chat.completions.create(model="qwen3_coder", messages=ask(unknown), tools=[WEATHER])


def test_anthropic_tool_use_blocks_from_a_mistral_model(daemon: Daemon) -> None:
    tool: Any = {"name": "get_weather", "description": "The weather", "input_schema": PARAMETERS}
    messages: Any = ask(FAMILIES["mistral"].sample)
    with anthropic.Anthropic(base_url=daemon.url, api_key=KEY, max_retries=0) as client:
        message = client.messages.create(
            model="mistral", max_tokens=200, messages=messages, tools=[tool]
        )
        assert message.stop_reason == "tool_use"
        kinds = [block.type for block in message.content]
        assert kinds == ["text", "tool_use", "tool_use"]
        inputs = [block.input for block in message.content if block.type == "tool_use"]
        assert inputs == SAMPLE_CALLS
        with client.messages.stream(
            model="gpt_oss", max_tokens=200, messages=ask(FAMILIES["gpt_oss"].sample), tools=[tool]
        ) as stream:
            final = stream.get_final_message()
        assert [b.type for b in final.content] == ["text", "tool_use"]
        assert final.content[1].type == "tool_use" and final.content[1].input == SAMPLE_CALLS[0]
        broken: Any = ask(
            "<tool_call>\n<function=get_weather>\n<parameter=days>\ntwo\n</parameter>"
        )
        with pytest.raises(anthropic.APIStatusError) as raised:
            client.messages.create(
                model="qwen3_coder", max_tokens=200, messages=broken, tools=[tool]
            )
        assert raised.value.status_code == 502


def test_responses_function_calls_and_ollama_tool_calls(
    client: openai.OpenAI, daemon: Daemon
) -> None:
    tool: Any = {"type": "function", "name": "get_weather", "parameters": PARAMETERS}
    response = client.responses.create(
        model="qwen3_coder", input="echo:" + FAMILIES["qwen3_coder"].sample, tools=[tool]
    )
    calls = [item for item in response.output if item.type == "function_call"]
    assert [json.loads(call.arguments) for call in calls] == SAMPLE_CALLS
    with keyed_http(daemon, KEY, timeout=60.0) as http:
        answer = http.post(
            "/api/chat",
            json={
                "model": "llama3_json",
                "messages": ask(FAMILIES["llama3_json"].sample),
                "tools": [WEATHER],
                "stream": False,
            },
        )
    assert answer.status_code == 200, answer.text
    message = answer.json()["message"]
    assert [call["function"]["arguments"] for call in message["tool_calls"]] == SAMPLE_CALLS
    assert message["content"] == ""


def test_langchain_bind_tools_on_a_qwen3_coder_model(daemon: Daemon) -> None:
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(
        model="qwen3_coder",
        base_url=daemon.url + "/v1",
        api_key=KEY,  # type: ignore[arg-type]
        max_retries=0,
    )
    answer = chat.bind_tools([WEATHER]).invoke("echo:" + FAMILIES["qwen3_coder"].sample)
    assert [call["args"] for call in answer.tool_calls] == SAMPLE_CALLS
    assert answer.content == "Checking. "


def test_openai_agents_runs_a_tool_of_a_mistral_model(daemon: Daemon) -> None:
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    cities: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        cities.append(city)
        return f"echo:sunny in {city}"  # what the testing "model" answers next

    async def run() -> Any:
        async with AsyncOpenAI(base_url=daemon.url + "/v1", api_key=KEY) as client:
            agent = agents.Agent(
                name="weather",
                instructions="Answer with the weather.",
                tools=[get_weather],
                model=agents.OpenAIChatCompletionsModel(model="mistral", openai_client=client),
            )
            call = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
            return await agents.Runner.run(agent, "echo:" + call)

    result = asyncio.run(run())
    assert cities == ["Paris"]
    assert result.final_output == "sunny in Paris"


@pytest.fixture(scope="module")
def hf_mistral(
    tmp_path_factory: pytest.TempPathFactory, models: dict[str, Path]
) -> Iterator[Daemon]:
    config = daemon_config(model=str(models["mistral"]), backend="hf", workers=1, deadline_s=180.0)
    daemon = start_daemon(tmp_path_factory.mktemp("hf"), config, ready_timeout=300.0)
    yield daemon
    assert daemon.stop() == 0, daemon.log()[-4000:]


def test_hf_mistral_model_calls_in_its_own_special_token_syntax(hf_mistral: Daemon) -> None:
    parameters = {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
        "required": ["city"],
        "additionalProperties": False,
    }
    tool: Any = {"type": "function", "function": {"name": "get_weather", "parameters": parameters}}
    with httpx.Client(base_url=hf_mistral.url, timeout=180.0) as http:
        answer = http.post(
            "/v1/chat/completions",
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": "Weather?"}],
                "tools": [tool],
                "tool_choice": "required",
                "max_tokens": 60,
            },
        )
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"])["city"] in ("Paris", "Oslo")


def test_a_malformed_call_streamed_ends_each_api_stream_with_its_error(daemon: Daemon) -> None:
    broken = "echo:Sure. [TOOL_CALLS]get_weather{}"
    tool: Any = {"type": "function", "name": "get_weather", "parameters": PARAMETERS}
    bodies = {
        "/v1/responses": {"model": "mistral", "input": broken, "tools": [tool], "stream": True},
        "/v1/messages": {
            "model": "mistral",
            "max_tokens": 100,
            "messages": [{"role": "user", "content": broken}],
            "tools": [{"name": "get_weather", "input_schema": PARAMETERS}],
            "stream": True,
        },
        "/api/chat": {
            "model": "mistral",
            "messages": [{"role": "user", "content": broken}],
            "tools": [WEATHER],
        },
    }
    with keyed_http(daemon, KEY, timeout=60.0) as http:
        for path, body in bodies.items():
            with http.stream("POST", path, json=body) as answer:
                lines = [line for line in answer.iter_lines() if line.strip()]
            last = lines[-1]
            assert "cannot be read" in last and "mistral" in last, (path, lines)
            # The content before the call went out first; the call's syntax never did.
            assert "Sure." in "".join(lines) and not any("TOOL_CALLS" in x for x in lines[:-1])


# A long argument, written word by word by the scripted model (``think:0:ANSWER``: no
# thinking, then ANSWER a word a token), so that a call's arguments stream in pieces.
CITY = "Llanfair pwll gwyn gyll go gery chwyrn drobwll llan ty silio go go goch"
LONG_ARGUMENTS = json.dumps({"city": CITY, "days": 2})
LONG_CALLS = {
    "hermes": f'Checking. <tool_call>\n{{"name": "get_weather", "arguments": {LONG_ARGUMENTS}}}'
    "\n</tool_call>",
    "llama3_json": f'<|python_tag|>{{"name": "get_weather", "parameters": {LONG_ARGUMENTS}}}',
    "mistral": f'Checking. [TOOL_CALLS][{{"name": "get_weather", "arguments": {LONG_ARGUMENTS}}}]',
    "gpt_oss": "<|channel|>final<|message|>Checking. <|end|><|start|>assistant<|channel|>"
    "commentary to=functions.get_weather <|constrain|>json<|message|>"
    f"{LONG_ARGUMENTS}<|call|>",
    # Its parameters make the JSON: each goes out as it closes.
    "qwen3_coder": "Checking. <tool_call>\n<function=get_weather>\n<parameter=city>\n"
    f"{CITY}\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
}
# Mistral's tekken form, one marker per call.
MISTRAL_ARGS = f"Checking. [TOOL_CALLS]get_weather[ARGS]{LONG_ARGUMENTS}"


def words(answer: str) -> Any:
    return [{"role": "user", "content": "think:0:" + answer}]


@pytest.mark.parametrize("parser", list(LONG_CALLS))
def test_openai_streams_a_calls_arguments_as_the_model_writes_them(
    client: openai.OpenAI, parser: str
) -> None:
    messages = words(LONG_CALLS[parser])
    whole = client.chat.completions.create(model=parser, messages=messages, tools=[WEATHER])
    (call,) = whole.choices[0].message.tool_calls or []
    assert json.loads(call.function.arguments) == {"city": CITY, "days": 2}

    chunks = list(
        client.chat.completions.create(
            model=parser, messages=messages, tools=[WEATHER], stream=True
        )
    )
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert {d.index for d in deltas} == {0}
    first = deltas[0]
    assert first.id and first.function and first.function.name == "get_weather"
    assert first.function.arguments == ""
    pieces = [d.function.arguments for d in deltas[1:] if d.function and d.function.arguments]
    # As written, a word a token (qwen3_coder's city too: a string's text streams).
    assert len(pieces) > 10
    assert "".join(pieces) == LONG_ARGUMENTS == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def anthropic_streamed(daemon: Daemon, model: str, text: str) -> tuple[list[str], Any]:
    """A streamed Messages call's ``input_json_delta`` pieces and its final message."""
    tool: Any = {"name": "get_weather", "description": "The weather", "input_schema": PARAMETERS}
    with (
        anthropic.Anthropic(base_url=daemon.url, api_key=KEY, max_retries=0) as client,
        client.messages.stream(
            model=model, max_tokens=300, messages=words(text), tools=[tool]
        ) as stream,
    ):
        events = list(stream)
        final = stream.get_final_message()
    partial = [
        e.delta.partial_json
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    ]
    return partial, final


def test_anthropic_streams_input_json_deltas(daemon: Daemon) -> None:
    partial, final = anthropic_streamed(daemon, "mistral", LONG_CALLS["mistral"])
    assert len(partial) > 5
    assert "".join(partial) == LONG_ARGUMENTS
    assert [b.type for b in final.content] == ["text", "tool_use"]
    block = final.content[1]
    assert block.type == "tool_use" and block.input == {"city": CITY, "days": 2}


def test_responses_streams_function_call_arguments_deltas(client: openai.OpenAI) -> None:
    tool: Any = {"type": "function", "name": "get_weather", "parameters": PARAMETERS}
    events = list(
        client.responses.create(
            model="hermes", input="think:0:" + LONG_CALLS["hermes"], tools=[tool], stream=True
        )
    )
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(deltas) > 5
    assert "".join(deltas) == done.arguments == LONG_ARGUMENTS
    (completed,) = [e for e in events if e.type == "response.completed"]
    (item,) = [i for i in completed.response.output if i.type == "function_call"]
    assert item.arguments == LONG_ARGUMENTS


def test_streamed_arguments_that_do_not_validate_end_the_stream_with_the_error(
    client: openai.OpenAI,
) -> None:
    bad = LONG_CALLS["hermes"].replace('"days": 2', '"days": "two"')
    stream = client.chat.completions.create(
        model="hermes", messages=words(bad), tools=[WEATHER], stream=True
    )
    pieces: list[str] = []
    with pytest.raises(openai.APIError, match="do not validate"):
        for chunk in stream:
            for delta in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
                pieces.append(delta.function.arguments or "" if delta.function else "")
    # The pieces went out as written; the error, not a call, ends the stream.
    assert "".join(pieces).startswith('{"city": "Llanfair')


def test_mistral_args_form_and_qwen3_coder_stream_in_every_api(
    client: openai.OpenAI, daemon: Daemon
) -> None:
    """The two syntaxes whose arguments are not a JSON object in a JSON call: Mistral's
    ``NAME[ARGS]{...}`` and Qwen3-Coder's parameters, streamed as chat deltas, Responses
    ``function_call_arguments.delta`` and Messages ``input_json_delta``."""
    for model, text in (("mistral", MISTRAL_ARGS), ("qwen3_coder", LONG_CALLS["qwen3_coder"])):
        chunks = list(
            client.chat.completions.create(
                model=model, messages=words(text), tools=[WEATHER], stream=True
            )
        )
        deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
        pieces = [d.function.arguments for d in deltas if d.function and d.function.arguments]
        assert len(pieces) > 10, (model, pieces)
        assert "".join(pieces) == LONG_ARGUMENTS
        assert chunks[-1].choices[0].finish_reason == "tool_calls"

        tool: Any = {"type": "function", "name": "get_weather", "parameters": PARAMETERS}
        events = list(
            client.responses.create(model=model, input="think:0:" + text, tools=[tool], stream=True)
        )
        arguments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
        (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert len(arguments) > 10
        assert "".join(arguments) == done.arguments == LONG_ARGUMENTS

        partial, final = anthropic_streamed(daemon, model, text)
        assert len(partial) > 10
        assert "".join(partial) == LONG_ARGUMENTS
        block = final.content[-1]
        assert block.type == "tool_use" and block.input == {"city": CITY, "days": 2}
