"""Context limits over HTTP: a daemon on a tiny model whose config says 64 positions.

vLLM's behaviour is the reference: a request whose prompt and ``max_tokens``
do not fit is a 400 naming the numbers (OpenAI's ``context_length_exceeded``
code), on both routes, streaming or not; one that fits runs to the last
position; ``/v1/models`` reports ``max_model_len``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from e2e_support import Daemon, daemon_config, start_daemon

from modelpool.tinymodel import build_tiny_model

pytestmark = pytest.mark.slow

LIMIT = 64
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-64", context_length=LIMIT)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def hf_daemon(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Daemon]:
    config = daemon_config(model=str(model_dir), backend="hf", workers=1, deadline_s=60.0)
    daemon = start_daemon(tmp_path_factory.mktemp("hf"), config, ready_timeout=300.0)
    yield daemon
    assert daemon.stop() == 0, daemon.log()[-4000:]


@pytest.fixture()
def http(hf_daemon: Daemon) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=hf_daemon.url, timeout=60.0) as client:
        yield client


def prompt_of(tokenizer: Any, tokens: int) -> str:
    """A string prompt of exactly ``tokens`` tokens."""
    for text in ("a" * tokens, "x " * tokens):
        for cut in range(len(text), 0, -1):
            if len(tokenizer(text[:cut])["input_ids"]) == tokens:
                return text[:cut]
    raise AssertionError(f"no prompt of {tokens} tokens")


def templated_length(tokenizer: Any, messages: list[dict[str, str]]) -> int:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def post(http: httpx.Client, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    """Status and body: the JSON answer, or for a stream the events' payloads."""
    if not body.get("stream"):
        response = http.post(path, json=body)
        return response.status_code, response.json()
    with http.stream("POST", path, json=body) as response:
        if not response.headers["content-type"].startswith("text/event-stream"):
            response.read()
            return response.status_code, response.json()
        events = [
            line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")
        ]
    assert events[-1] == "[DONE]", events[-3:]
    return response.status_code, [json.loads(event) for event in events[:-1]]


def assert_context_error(status: int, body: Any, prompt_tokens: int, max_tokens: int) -> None:
    assert status == 400, body
    error = body["error"]
    assert error["code"] == "context_length_exceeded"
    assert error["type"] == "invalid_request_error"
    assert f"maximum context length is {LIMIT} tokens" in error["message"]
    assert f"{prompt_tokens + max_tokens} tokens" in error["message"]
    assert (error["prompt_tokens"], error["max_new_tokens"], error["max_model_len"]) == (
        prompt_tokens,
        max_tokens,
        LIMIT,
    )
    assert error["attempts"] == []


def test_models_and_stats_report_the_context_length(hf_daemon: Daemon) -> None:
    listed = hf_daemon.get("/v1/models").json()["data"]
    assert [card["max_model_len"] for card in listed] == [LIMIT]
    assert hf_daemon.get(f"/v1/models/{listed[0]['id']}").json()["max_model_len"] == LIMIT
    stats = hf_daemon.stats()
    assert stats["max_model_len"] == LIMIT
    assert [w["max_model_len"] for w in stats["workers"]] == [LIMIT]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_completion_one_token_under_runs_and_one_over_is_400(
    http: httpx.Client, tokenizer: Any, stream: bool
) -> None:
    prompt = prompt_of(tokenizer, 40)
    room = LIMIT - 40
    body: dict[str, Any] = {"prompt": prompt, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    status, answer = post(http, COMPLETIONS, {**body, "max_tokens": room - 1})
    assert status == 200, answer
    usage = answer[-1]["usage"] if stream else answer["usage"]
    assert usage["prompt_tokens"] == 40 and usage["completion_tokens"] <= room - 1

    status, answer = post(http, COMPLETIONS, {**body, "max_tokens": room + 1})
    assert_context_error(status, answer, 40, room + 1)
    status, answer = post(http, COMPLETIONS, {**body, "max_tokens": 20_000})
    assert_context_error(status, answer, 40, 20_000)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_is_measured_after_its_template(
    http: httpx.Client, tokenizer: Any, stream: bool
) -> None:
    messages = [{"role": "user", "content": prompt_of(tokenizer, 30)}]
    templated = templated_length(tokenizer, messages)
    room = LIMIT - templated
    # The content alone would leave room for this many; the template takes some of it.
    assert room > 1 and 30 + room + 1 <= LIMIT
    body: dict[str, Any] = {"messages": messages, "stream": stream}
    status, answer = post(http, CHAT, {**body, "max_tokens": room - 1})
    assert status == 200, answer
    status, answer = post(http, CHAT, {**body, "max_tokens": room + 1})
    assert_context_error(status, answer, templated, room + 1)


def test_without_max_tokens_the_default_is_capped_to_what_fits(
    http: httpx.Client, tokenizer: Any
) -> None:
    # The daemon's default is 64 new tokens; a 60-token prompt leaves 4, which the tiny
    # model (greedy, no end-of-sequence token this early) fills.
    prompt = prompt_of(tokenizer, LIMIT - 4)
    status, answer = post(http, COMPLETIONS, {"prompt": prompt})
    assert status == 200, answer
    assert answer["choices"][0]["finish_reason"] == "length"
    assert (answer["usage"]["prompt_tokens"], answer["usage"]["completion_tokens"]) == (
        LIMIT - 4,
        4,
    )
    body = {"prompt": prompt, "stream": True, "stream_options": {"include_usage": True}}
    status, events = post(http, COMPLETIONS, body)
    assert status == 200, events
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"
    assert events[-1]["usage"]["completion_tokens"] == 4
    status, answer = post(http, COMPLETIONS, {"prompt": prompt_of(tokenizer, LIMIT)})
    assert status == 400 and answer["error"]["code"] == "context_length_exceeded", answer


def test_the_openai_client_sees_the_code(hf_daemon: Daemon, tokenizer: Any) -> None:
    with openai.OpenAI(
        base_url=hf_daemon.url + "/v1", api_key="unused", max_retries=0, timeout=60.0
    ) as client:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": prompt_of(tokenizer, LIMIT + 1)}],
            )
        assert caught.value.code == "context_length_exceeded"
        assert "maximum context length is 64 tokens" in caught.value.message
        # The worker refused without failing: it still answers.
        reply = client.completions.create(model="tiny", prompt="Hello", max_tokens=3)
        assert reply.usage is not None and reply.usage.completion_tokens


def test_the_command_line_option_sets_the_limit(tmp_path: Path) -> None:
    daemon = start_daemon(tmp_path, daemon_config(workers=1), args=("--max-model-len", "12"))
    try:
        assert daemon.get("/v1/models").json()["data"][0]["max_model_len"] == 12
        response = httpx.post(
            daemon.url + COMPLETIONS,
            json={"prompt": "echo:" + " w" * 10, "max_tokens": 2},
            timeout=30.0,
        )
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "context_length_exceeded"
    finally:
        assert daemon.stop() == 0, daemon.log()[-4000:]
