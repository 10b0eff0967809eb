"""Embeddings take the generation walk's admission step, on a real daemon whose registry
holds a chat model and an embedding model of one testing worker each.

docs/architecture.md, "The daemon's walk": an embedding request is judged once, on arrival,
by its predicted wait counting the runs that wait ahead of it in the fair share, and is
refused with the same 429 ``queue_full`` a chat request gets. Judged only by the pool, as
before, it would wait in the fair share behind a long run, enter an idle pool once that run
ended and be answered long after its bound.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_support import Daemon, keyed_daemon, keyed_http, registry_config, wait_for

from helpers import slack, wait_until

KEY = "test-pooling-walk-key"
# The embedding model's bound on a request's predicted wait: about three of its warm-up
# runs (EMBED_RUN_S each) queued ahead of a request pass it.
MAX_QUEUE_TIME_S = 0.8
EMBED_RUN_S = 0.25

MODELS: dict[str, dict[str, Any]] = {
    "chat": {"model": "chat-weights", "preload": True},
    "emb": {
        "model": "emb-weights",
        "preload": True,
        "max_queue_time_s": MAX_QUEUE_TIME_S,
        # One place in the pool, as in the fair share: the blocker fills it.
        "pooling_batch_size": 1,
        "backend_options": {"task": "embed"},
    },
}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    config = registry_config(MODELS, workers=1, server={})
    yield from keyed_daemon(tmp_path_factory.mktemp("pooling-walk"), config, KEY)


@pytest.fixture()
def http(daemon: Daemon) -> Iterator[httpx.Client]:
    with keyed_http(daemon, KEY, timeout=slack(30.0)) as client:
        yield client


def _chat_refusal(http: httpx.Client) -> httpx.Response:
    """A chat request refused by its predicted wait: after the samples the predictor
    needs, a bound shorter than any time to first token."""
    for _ in range(3):
        warm = http.post("/v1/completions", json={"model": "chat", "prompt": "tokens:2:0.05"})
        assert warm.status_code == 200, warm.text
    return http.post(
        "/v1/completions",
        json={"model": "chat", "prompt": "echo:late", "max_queue_time_s": 0.001},
    )


def test_an_embedding_is_refused_by_its_predicted_wait_as_a_chat_is(
    http: httpx.Client, tmp_path: Path
) -> None:
    chat = _chat_refusal(http)
    assert chat.status_code == 429, chat.text

    def embed(text: str) -> httpx.Response:
        return http.post("/v1/embeddings", json={"model": "emb", "input": text})

    for _ in range(3):  # the predictor's samples
        assert embed(f"embed_sleep:{EMBED_RUN_S}").status_code == 200

    def in_share() -> dict[str, Any]:
        shares: dict[str, Any] = http.get("/stats").json()["fair_share_by_model"]["emb"]
        return shares

    release = tmp_path / "release"
    with concurrent.futures.ThreadPoolExecutor(10) as threads:
        blocker = threads.submit(embed, f"embed_wait:{release}")
        try:
            wait_for(in_share, lambda s: s["in_pool"] == 1, slack(10), "the blocker running")
            # Each waits in the fair share behind the blocker, until one's predicted wait
            # (the runs ahead of it) passes the model's bound.
            waiting: list[concurrent.futures.Future[httpx.Response]] = []
            refused: httpx.Response | None = None
            for number in range(8):
                sent = threads.submit(embed, f"text {number}")
                wait_until(
                    lambda sent=sent: sent.done() or in_share()["waiting"] == len(waiting) + 1,
                    timeout=slack(10),
                    message="the embedding waiting or answered",
                )
                if sent.done():
                    refused = sent.result()
                    break
                waiting.append(sent)
        finally:
            release.touch()
        assert blocker.result().status_code == 200
        answered = [future.result() for future in waiting]
    assert refused is not None, "every embedding waited: none was judged on arrival"
    assert refused.status_code == 429, refused.text
    assert all(answer.status_code == 200 for answer in answered)
    error, chat_error = refused.json()["error"], chat.json()["error"]
    assert error["code"] == chat_error["code"] == "queue_full"
    assert set(error) == set(chat_error)
    assert error["predicted_ttft_s"] > MAX_QUEUE_TIME_S
    for response in (refused, chat):
        assert int(response.headers["retry-after"]) >= 1
        assert response.headers["x-should-retry"] == "true"
