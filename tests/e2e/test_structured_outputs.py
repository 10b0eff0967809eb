"""Structured outputs through clients nobody here wrote, against a real daemon on a tiny
random model: its free text is gibberish, so a parsed, schema-valid answer is the grammar's
doing. The ``openai`` client's ``chat.completions.parse`` (streamed and not) and
``langchain-openai``'s ``with_structured_output(method="json_schema")``; the completions
route and vLLM's ``structured_outputs``; and the 400 that names a keyword the engine cannot
honour."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest
from e2e_support import Daemon, daemon_config, start_daemon

pytestmark = pytest.mark.slow


class Verdict(pydantic.BaseModel):
    """Bounded everywhere: a random model would otherwise write one string until max_tokens."""

    model_config = pydantic.ConfigDict(extra="forbid")
    ok: bool
    size: Literal["small", "large"]
    note: str = pydantic.Field(max_length=8)


MESSAGES = [{"role": "user", "content": "Is this small or large?"}]


@pytest.fixture(scope="module")
def hf_daemon(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Daemon]:
    config = daemon_config(
        model=str(tiny_model_dir), backend="hf", workers=1, max_batch_size=4, deadline_s=60.0
    )
    daemon = start_daemon(tmp_path_factory.mktemp("structured"), config, ready_timeout=300.0)
    yield daemon
    assert daemon.stop() == 0, daemon.log()[-4000:]


@pytest.fixture(scope="module")
def client(hf_daemon: Daemon) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=hf_daemon.url + "/v1", api_key="unused", max_retries=0, timeout=60.0
    ) as opened:
        yield opened


def test_openai_parse_returns_a_valid_model(client: openai.OpenAI) -> None:
    completion = client.chat.completions.parse(
        model="tiny", messages=MESSAGES, response_format=Verdict, max_tokens=60
    )
    message = completion.choices[0].message
    assert isinstance(message.parsed, Verdict), message.content
    assert completion.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(message.content or ""), Verdict.model_json_schema())


def test_openai_parse_streamed(client: openai.OpenAI) -> None:
    with client.chat.completions.stream(
        model="tiny",
        messages=MESSAGES,
        response_format=Verdict,
        max_tokens=60,
        temperature=1.0,
        seed=5,
    ) as stream:
        deltas = [event for event in stream if event.type == "content.delta"]
        final = stream.get_final_completion()
    assert len(deltas) > 1, "streamed in pieces"
    assert isinstance(final.choices[0].message.parsed, Verdict)


def test_langchain_with_structured_output_json_schema(hf_daemon: Daemon) -> None:
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(
        model="tiny",
        base_url=hf_daemon.url + "/v1",
        api_key="unused",  # type: ignore[arg-type]
        max_retries=0,
        max_completion_tokens=60,
    )
    structured = chat.with_structured_output(Verdict, method="json_schema")
    answers = structured.batch(["small?", "large?"])
    assert all(isinstance(answer, Verdict) for answer in answers), answers


def test_completions_route_and_vllm_structured_outputs(hf_daemon: Daemon) -> None:
    with httpx.Client(base_url=hf_daemon.url, timeout=60.0) as http:
        regex = http.post(
            "/v1/completions",
            json={
                "prompt": "Code:",
                "max_tokens": 20,
                "structured_outputs": {"regex": "[A-Z]{2}[0-9]{3}"},
            },
        )
        assert regex.status_code == 200, regex.text
        assert re.fullmatch("[A-Z]{2}[0-9]{3}", regex.json()["choices"][0]["text"])
        schema = Verdict.model_json_schema()
        as_json = http.post(
            "/v1/completions",
            json={
                "prompt": "{",
                "max_tokens": 60,
                "response_format": {"type": "json_schema", "json_schema": {"schema": schema}},
            },
        )
        assert as_json.status_code == 200, as_json.text
        jsonschema.validate(json.loads(as_json.json()["choices"][0]["text"]), schema)


def test_a_keyword_the_engine_cannot_honour_is_a_400_naming_it(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"when": {"type": "string", "format": "nope"}}}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "w", "schema": schema},
            },
        )
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["param"] == "response_format.json_schema.schema.properties.when.format"
    assert "format" in error["message"]
