"""The daemon's features with ``model=ADAPTER`` (issue 59, docs/lora.md), through the
``openai`` client on the tiny random model (its free text is gibberish, so a parsed,
schema-valid answer is the grammar's doing): ``response_format`` json_schema and ``tools``
with ``tool_choice`` required, streamed and not; and ``priority``: an urgent adapter
request goes into the pool before base requests that queued earlier, as
tests/e2e/test_priority_http.py checks for the base alone.

The adapters' answers against PEFT's, their metrics and the prefix cache by adapter:
tests/e2e/test_lora_daemon.py, tests/integration/test_lora.py and
tests/integration/test_vllm_metrics.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from e2e_support import Daemon, keyed_daemon, keyed_http, registry_config, wait_for

from helpers import slack
from lora_adapters import make_adapter

pytestmark = pytest.mark.slow

KEY = "test-lora-features-key"
# Bounded everywhere: a random model would otherwise write one string until max_tokens.
VERDICT = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "size": {"type": "string", "enum": ["small", "large"]},
        "note": {"type": "string", "maxLength": 8},
    },
    "required": ["ok", "size", "note"],
    "additionalProperties": False,
}
RESPONSE_FORMAT: Any = {
    "type": "json_schema",
    "json_schema": {"name": "verdict", "schema": VERDICT, "strict": True},
}
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "enum": [1, 2, 3]},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER: Any = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": WEATHER_PARAMETERS},
}
MESSAGES: Any = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Daemon]:
    adapters = tmp_path_factory.mktemp("adapters")
    models: dict[str, dict[str, Any]] = {
        # One row at a time: the priority test needs requests to queue; and no aging
        # within the test's wait (a run that waited priority_aging_s counts as the most
        # urgent, which a slow blocker on a loaded machine would reach).
        "tiny": {
            "priority_aging_s": 600.0,
            "model": str(tiny_model_dir),
            "backend": "hf",
            "max_batch_size": 1,
            "deadline_s": 120.0,
            "backend_options": {"dtype": "float32", "torch_threads": 1, "max_loras": 2},
        },
        "sql": {
            "base": "tiny",
            "adapter": str(make_adapter(tiny_model_dir, adapters / "sql", seed=0)),
        },
        "poet": {
            "base": "tiny",
            "adapter": str(make_adapter(tiny_model_dir, adapters / "poet", seed=1)),
        },
    }
    config = registry_config(models, workers=1, server={})
    yield from keyed_daemon(tmp_path_factory.mktemp("daemon"), config, KEY)


@pytest.fixture()
def client(daemon: Daemon) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=daemon.url + "/v1", api_key=KEY, max_retries=0, timeout=slack(120)
    ) as opened:
        yield opened


def test_an_adapters_json_schema_answer_parses_and_matches_streamed_or_not(
    client: openai.OpenAI,
) -> None:
    whole = client.chat.completions.create(
        model="sql",
        messages=MESSAGES,
        response_format=RESPONSE_FORMAT,
        max_tokens=80,
        temperature=0,
    )
    assert whole.model == "sql"
    choice = whole.choices[0]
    assert choice.finish_reason == "stop", choice.message
    jsonschema.validate(json.loads(choice.message.content or ""), VERDICT)
    stream = client.chat.completions.create(
        model="sql",
        messages=MESSAGES,
        response_format=RESPONSE_FORMAT,
        max_tokens=80,
        temperature=0,
        stream=True,
    )
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert len([p for p in pieces if p]) > 1, "streamed in pieces"
    # Greedy with the same adapter: the stream is the same answer.
    assert "".join(pieces) == choice.message.content


def test_an_adapters_required_tool_call_is_valid_streamed_or_not(client: openai.OpenAI) -> None:
    def ask(stream: bool) -> Any:
        return client.chat.completions.create(
            model="poet",
            messages=MESSAGES,
            tools=[WEATHER],
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=120,
            temperature=0,
            stream=stream,
        )

    whole = ask(False)
    assert whole.model == "poet"
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMETERS)
    deltas = []
    finish_reason = None
    for chunk in ask(True):
        if chunk.choices and chunk.choices[0].delta.tool_calls:
            deltas += chunk.choices[0].delta.tool_calls
        if chunk.choices and chunk.choices[0].finish_reason:
            finish_reason = chunk.choices[0].finish_reason
    assert finish_reason == "tool_calls"
    assert deltas[0].function is not None and deltas[0].function.name == "get_weather"
    arguments = "".join(d.function.arguments or "" for d in deltas if d.function)
    assert json.loads(arguments) == json.loads(call.function.arguments)


def test_an_urgent_adapter_request_overtakes_queued_base_ones(
    daemon: Daemon, client: openai.OpenAI
) -> None:
    def send(model: str, prompt: str, priority: int, tokens: int) -> Any:
        return client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=tokens,
            temperature=0,
            extra_body={"priority": priority, "ignore_eos": True},
        )

    def stats() -> Any:
        with keyed_http(daemon, KEY, timeout=slack(10)) as http:
            return http.get("/stats").raise_for_status().json()

    with ThreadPoolExecutor(5) as threads:
        # Most urgent of all (none preempts it), long enough for the others to queue
        # behind it on a loaded machine.
        blocker = threads.submit(send, "tiny", "Hello", -5, 400)
        wait_for(
            stats,
            lambda s: (s["models"]["tiny"]["pool"] or {}).get("running") == 1,
            slack(30),
            "the blocker running",
        )
        lows = [threads.submit(send, "tiny", f"low {i}", 3, 2) for i in range(3)]
        wait_for(
            stats,
            lambda s: s["fair_share_by_model"].get("tiny", {}).get("waiting") == 3,
            slack(10),
            "three low-priority base requests waiting",
        )
        high = threads.submit(send, "sql", "high", -2, 2)
        wait_for(
            stats,
            lambda s: s["fair_share_by_model"].get("tiny", {}).get("waiting") == 4,
            slack(10),
            "the urgent adapter request waiting",
        )
        assert blocker.result().choices[0].finish_reason == "length"
        answers = [future.result() for future in (high, *lows)]
    # The request ids say the order the pool took them in (a counter per pool).
    order = sorted(answers, key=lambda a: int(a.id.rsplit("-", 1)[-1], 16))
    assert order[0].model == "sql", [(a.model, a.id) for a in order]
    assert all(a.model == "tiny" for a in order[1:])
