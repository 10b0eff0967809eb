"""The OpenAI Agents SDK (``openai-agents``, which speaks the Responses API) running an
agent with one function tool to completion against a real daemon (testing backend: its
"model" writes what the prompt says, so the first turn calls the tool and the second
answers with what the tool returned)."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator

import pytest
from e2e_support import Daemon, daemon_config, start_daemon

from helpers import FAR_DEADLINE_S

agents = pytest.importorskip("agents")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    server = start_daemon(
        tmp_path_factory.mktemp("agents"), daemon_config(deadline_s=FAR_DEADLINE_S)
    )
    yield server
    assert server.stop() == 0, server.log()[-4000:]


def test_agent_with_one_tool_runs_to_completion(daemon: Daemon) -> None:
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        # What the testing backend's "model" answers with on the next turn.
        return f"echo:sunny in {city}"

    async def run() -> agents.RunResult:
        async with AsyncOpenAI(base_url=daemon.url + "/v1", api_key="none") as client:
            agent = agents.Agent(
                name="weather",
                instructions="Answer with the weather.",
                tools=[get_weather],
                model=agents.OpenAIResponsesModel(model="testing", openai_client=client),
            )
            call = json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})
            return await agents.Runner.run(agent, f"echo:<tool_call>{call}</tool_call>")

    result = asyncio.run(run())
    assert calls == ["Paris"]
    assert result.final_output == "sunny in Paris"
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"]
    assert len(result.raw_responses) == 2
    assert log_routes(daemon) == ["POST /v1/responses 200"] * 2


ACCESS = re.compile(r"((?:POST|GET|DELETE) /v1/\S+ \d{3}) request_id=")


def log_routes(daemon: Daemon) -> list[str]:
    """The API calls in the daemon's access log: method, path and status."""
    return ACCESS.findall(daemon.log())
