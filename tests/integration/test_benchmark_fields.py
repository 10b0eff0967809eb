"""The request fields load generators and benchmark tools send (issue 28), through the
daemon's app over real pools of testing workers, one-call and batched.

vLLM's ``ignore_eos`` (guidellm and genai-perf fix output lengths with it),
``/tokenize`` and ``/detokenize`` (vLLM's and SGLang's routes),
``stream_options.continuous_usage_stats`` (usage on every chunk) and
``usage.prompt_tokens_details.cached_tokens`` in every answer.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from helpers import open_pool
from modelpool.server import create_app
from modelpool.shared.config import ServerConfig

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux processes")


@pytest.fixture(scope="module", params=[1, 4], ids=["one-call", "batched"])
def client(request: pytest.FixtureRequest) -> Iterator[TestClient]:
    with open_pool(workers=1, max_batch_size=request.param) as pool:
        app = create_app(pool, ServerConfig(), "test-model")
        yield TestClient(app, base_url="http://127.0.0.1")


def events(response: Any) -> list[dict[str, Any]]:
    lines = [line for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: ") :]) for line in lines[:-1]]


def test_ignore_eos_generates_up_to_max_tokens(client: TestClient) -> None:
    # "tokens:3" ends (its end of sequence) after three tokens.
    body = {"model": "m", "prompt": "tokens:3", "max_tokens": 6}
    ended = client.post("/v1/completions", json=body).json()
    assert ended["usage"]["completion_tokens"] == 3
    assert ended["choices"][0]["finish_reason"] == "stop"
    forced = client.post("/v1/completions", json={**body, "ignore_eos": True}).json()
    assert forced["usage"]["completion_tokens"] == 6
    assert forced["choices"][0]["finish_reason"] == "length"
    assert forced["choices"][0]["text"] == "t0 t1 t2 t3 t4 t5 "
    refused = client.post("/v1/completions", json={**body, "ignore_eos": "yes"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "ignore_eos"


def test_tokenize_and_detokenize_use_the_workers_tokenizer(client: TestClient) -> None:
    # The testing backend's tokens are code points.
    answer = client.post("/tokenize", json={"model": "m", "prompt": "héllo"}).json()
    assert answer == {
        "tokens": [104, 233, 108, 108, 111],
        "count": 5,
        "max_model_len": None,
        "token_strs": None,
    }
    chat = client.post(
        "/tokenize",
        json={"messages": [{"role": "user", "content": "ab"}], "add_generation_prompt": False},
    ).json()
    assert chat["tokens"] == [97, 98] and chat["count"] == 2
    text = client.post("/detokenize", json={"model": "m", "tokens": [104, 233]}).json()
    assert text == {"prompt": "hé"}
    assert client.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}
    both = client.post("/tokenize", json={"prompt": "a", "messages": []})
    assert both.status_code == 400
    bad = client.post("/detokenize", json={"tokens": [1, -2]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_continuous_usage_stats_puts_usage_on_every_chunk(client: TestClient) -> None:
    body = {
        "prompt": "tokens:4",
        "max_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    chunks = events(client.post("/v1/completions", json=body))
    with_choices = [chunk for chunk in chunks if chunk["choices"]]
    assert all("usage" in chunk for chunk in with_choices)
    completion = [chunk["usage"]["completion_tokens"] for chunk in with_choices]
    assert completion == sorted(completion) and completion[-1] == 4
    text_chunks = [chunk for chunk in with_choices if chunk["choices"][0]["text"]]
    # Each chunk's count is the tokens its worker had generated when it sent that chunk.
    assert [chunk["usage"]["completion_tokens"] for chunk in text_chunks] == [1, 2, 3, 4]
    assert all(chunk["usage"]["prompt_tokens"] == 1 for chunk in text_chunks)
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    plain = events(client.post("/v1/completions", json={**body, "stream_options": None}))
    assert not any("usage" in chunk for chunk in plain)


def test_cached_tokens_are_in_every_usage(client: TestClient) -> None:
    chat = client.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "echo:hi"}]}
    ).json()
    assert chat["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    completion = client.post("/v1/completions", json={"prompt": "echo:hi"}).json()
    assert completion["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
