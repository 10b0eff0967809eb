"""The embedding and scoring routes on a real daemon with three models in its registry: a
chat model, an embedding model and a cross-encoder (the testing backend's, whose vectors
come from a hash and whose cross-encoder logit is "shared words - 0.5"), each route
reaching the right one; the shapes of OpenAI, Cohere/Jina, TEI and vLLM; base64; the
refusals that name their field; the API key, the request budget, the body bound and the
client's fair share as on every route.

The docs, Embeddings and reranking over HTTP.
"""

from __future__ import annotations

import base64
import math
import struct
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from e2e_support import Daemon, keyed_daemon, keyed_http, registry_config

from helpers import slack, wait_until

KEY = "test-embeddings-key"
CONTEXT = 16
DIMENSIONS = 8  # the testing backend's vectors

MODELS: dict[str, dict[str, Any]] = {
    "chat": {"model": "chat-weights", "preload": True},
    "emb": {
        "model": "emb-weights",
        "preload": True,
        "aliases": ["text-embedding-3-small"],
        "backend_options": {"task": "embed", "max_model_len": CONTEXT},
    },
    "ce": {"model": "ce-weights", "preload": True, "backend_options": {"task": "score"}},
}


SERVER = {
    "max_request_tokens": 2000,
    "max_body_bytes": 32768,
    "client_max_running": 1,
    "client_max_queued": 0,
}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    config = registry_config(MODELS, workers=1, server=SERVER)
    yield from keyed_daemon(tmp_path_factory.mktemp("embeddings"), config, KEY)


@pytest.fixture()
def http(daemon: Daemon) -> Iterator[httpx.Client]:
    with keyed_http(daemon, KEY, timeout=slack(20.0)) as client:
        yield client


def ok(response: httpx.Response) -> Any:
    assert response.status_code == 200, response.text
    return response.json()


def refused(response: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    return error


def norm(vector: list[float]) -> float:
    return math.sqrt(sum(value * value for value in vector))


def test_float_and_base64_answer_the_same_vectors(http: httpx.Client) -> None:
    texts = ["hello world", "a different text here"]
    plain = ok(http.post("/v1/embeddings", json={"model": "emb", "input": texts}))
    assert plain["object"] == "list" and plain["model"] == "emb"
    assert [item["index"] for item in plain["data"]] == [0, 1]
    assert plain["usage"] == {"prompt_tokens": 6, "total_tokens": 6}
    vectors = [item["embedding"] for item in plain["data"]]
    assert all(len(vector) == DIMENSIONS for vector in vectors)
    assert all(norm(vector) == pytest.approx(1.0) for vector in vectors)
    assert vectors[0] != vectors[1]
    encoded = ok(
        http.post(
            "/v1/embeddings",
            json={"model": "emb", "input": texts, "encoding_format": "base64"},
        )
    )
    for item, vector in zip(encoded["data"], vectors, strict=True):
        raw = base64.b64decode(item["embedding"])
        # A quarter of the values, or garbage, is what a server that ignores it gives.
        assert len(raw) == 4 * DIMENSIONS
        assert struct.unpack(f"<{DIMENSIONS}f", raw) == pytest.approx(vector, rel=1e-6)


def test_an_alias_answers_with_the_model_name(http: httpx.Client) -> None:
    body = ok(http.post("/v1/embeddings", json={"model": "text-embedding-3-small", "input": "x"}))
    assert body["model"] == "emb"


def test_token_id_inputs(http: httpx.Client) -> None:
    one = ok(http.post("/v1/embeddings", json={"model": "emb", "input": [5, 6, 7]}))
    assert len(one["data"]) == 1 and one["usage"]["prompt_tokens"] == 3
    two = ok(http.post("/v1/embeddings", json={"model": "emb", "input": [[5, 6], [7]]}))
    assert [len(item["embedding"]) for item in two["data"]] == [DIMENSIONS, DIMENSIONS]
    assert two["usage"]["prompt_tokens"] == 3
    assert two["data"][0]["embedding"] != one["data"][0]["embedding"]


def test_dimensions_cut_and_renormalise(http: httpx.Client) -> None:
    full = ok(http.post("/v1/embeddings", json={"model": "emb", "input": "cut me"}))
    short = ok(
        http.post("/v1/embeddings", json={"model": "emb", "input": "cut me", "dimensions": 4})
    )
    head = full["data"][0]["embedding"][:4]
    cut = short["data"][0]["embedding"]
    assert cut == pytest.approx([value / norm(head) for value in head])
    error = refused(
        http.post(
            "/v1/embeddings",
            json={"model": "emb", "input": "x", "dimensions": DIMENSIONS + 1},
        )
    )
    assert error["param"] == "dimensions"
    assert str(DIMENSIONS) in error["message"]


@pytest.mark.parametrize("value", ["", [], [""], [[]], ["a", [1]]])
def test_empty_input_is_refused_naming_input(http: httpx.Client, value: object) -> None:
    error = refused(http.post("/v1/embeddings", json={"model": "emb", "input": value}))
    assert error["param"] == "input"


def test_context_limit_refused_or_truncated_when_asked(http: httpx.Client) -> None:
    long_text = " ".join(["word"] * (CONTEXT + 4))
    error = refused(http.post("/v1/embeddings", json={"model": "emb", "input": long_text}))
    assert error["code"] == "context_length_exceeded"
    cut = ok(
        http.post("/v1/embeddings", json={"model": "emb", "input": long_text, "truncate": True})
    )
    assert cut["usage"]["prompt_tokens"] == CONTEXT


def test_each_route_reaches_its_model_and_refuses_the_wrong_task(http: httpx.Client) -> None:
    chat = {"messages": [{"role": "user", "content": "echo:hi"}], "max_tokens": 4}
    assert ok(http.post("/v1/chat/completions", json={"model": "chat", **chat}))["choices"]
    for model in ("chat", "ce"):
        error = refused(http.post("/v1/embeddings", json={"model": model, "input": "x"}))
        assert error["code"] == "wrong_task" and error["param"] == "model"
        assert repr(model) in error["message"]
    error = refused(
        http.post("/v1/rerank", json={"model": "chat", "query": "q", "documents": ["d"]})
    )
    assert error["code"] == "wrong_task"
    assert "text generation" in error["message"]
    error = refused(http.post("/v1/chat/completions", json={"model": "emb", **chat}))
    assert error["code"] == "wrong_task"
    assert "embed" in error["message"]


DOCUMENTS = ["bananas are yellow", "the capital of france is paris", "paris city of france"]
QUERY = "capital of france"


def test_cohere_rerank_sorted_cut_with_indices(http: httpx.Client) -> None:
    body = ok(
        http.post(
            "/v1/rerank",
            json={"model": "ce", "query": QUERY, "documents": DOCUMENTS, "top_n": 2},
        )
    )
    results = body["results"]
    # Shared words with the query: 3, 2, 0; the logit is that - 0.5, through a sigmoid.
    assert [result["index"] for result in results] == [1, 2]
    assert [result["relevance_score"] for result in results] == pytest.approx(
        [1 / (1 + math.exp(-2.5)), 1 / (1 + math.exp(-1.5))]
    )
    assert results[0]["document"] == {"text": DOCUMENTS[1]}
    assert body["model"] == "ce" and body["id"].startswith("rerank-")
    v2 = ok(
        http.post(
            "/v2/rerank",
            json={"model": "ce", "query": QUERY, "documents": [{"text": d} for d in DOCUMENTS]},
        )
    )
    assert [result["index"] for result in v2["results"]] == [1, 2, 0]
    assert "document" not in v2["results"][0]


def test_tei_rerank_raw_scores(http: httpx.Client) -> None:
    body = ok(
        http.post(
            "/rerank",
            json={
                "model": "ce",
                "query": QUERY,
                "texts": DOCUMENTS,
                "raw_scores": True,
                "return_text": True,
            },
        )
    )
    assert body == [
        {"index": 1, "score": pytest.approx(2.5), "text": DOCUMENTS[1]},
        {"index": 2, "score": pytest.approx(1.5), "text": DOCUMENTS[2]},
        {"index": 0, "score": pytest.approx(-0.5), "text": DOCUMENTS[0]},
    ]


def test_vllm_score_pairs_in_order(http: httpx.Client) -> None:
    body = ok(http.post("/score", json={"model": "ce", "text_1": QUERY, "text_2": DOCUMENTS}))
    scores = [item["score"] for item in body["data"]]
    assert [item["index"] for item in body["data"]] == [0, 1, 2]
    assert scores == pytest.approx([1 / (1 + math.exp(-x)) for x in (-0.5, 2.5, 1.5)])
    pairwise = ok(
        http.post(
            "/v1/score",
            json={"model": "ce", "text_1": ["paris", "bananas"], "text_2": DOCUMENTS[:2]},
        )
    )
    assert [item["score"] for item in pairwise["data"]] == pytest.approx(
        [1 / (1 + math.exp(0.5)), 1 / (1 + math.exp(0.5))]
    )


def test_an_embedding_model_reranks_by_cosine(http: httpx.Client) -> None:
    body = ok(
        http.post(
            "/v1/rerank",
            json={"model": "emb", "query": "same words", "documents": ["other", "same words"]},
        )
    )
    assert body["results"][0]["index"] == 1
    assert body["results"][0]["relevance_score"] == pytest.approx(1.0)


def test_tei_embed(http: httpx.Client) -> None:
    vectors = ok(http.post("/embed", json={"model": "emb", "inputs": ["hello world", "x"]}))
    plain = ok(http.post("/v1/embeddings", json={"model": "emb", "input": ["hello world", "x"]}))
    assert len(vectors) == 2
    for vector, item in zip(vectors, plain["data"], strict=True):
        assert vector == pytest.approx(item["embedding"])


def test_models_lists_every_task(http: httpx.Client) -> None:
    listed = {card["id"]: card["task"] for card in ok(http.get("/v1/models"))["data"]}
    assert listed == {"chat": "generate", "emb": "embed", "ce": "score"}


def test_the_key_the_budget_and_the_body_bound(daemon: Daemon, http: httpx.Client) -> None:
    for path, body in [
        ("/v1/embeddings", {"model": "emb", "input": "x"}),
        ("/v1/rerank", {"model": "ce", "query": "q", "documents": ["d"]}),
        ("/score", {"model": "ce", "text_1": "q", "text_2": "d"}),
    ]:
        assert httpx.post(daemon.url + path, json=body, timeout=slack(10.0)).status_code == 401
    error = refused(
        http.post("/v1/embeddings", json={"model": "emb", "input": ["word " * 300] * 2})
    )
    assert error["code"] == "request_too_expensive" and error["param"] == "input"
    error = refused(
        http.post("/v1/rerank", json={"model": "ce", "query": "q", "documents": ["w" * 2100]})
    )
    assert error["code"] == "request_too_expensive" and error["param"] == "documents"
    too_big = {"model": "emb", "input": ["x" * 1000] * 40}
    assert http.post("/v1/embeddings", json=too_big).status_code == 413


def test_one_client_past_its_share_is_refused(daemon: Daemon, http: httpx.Client) -> None:
    # client_max_running = 1 and client_max_queued = 0: a second request of the same
    # client while the first runs is a 429, as for a generation.
    slow: list[httpx.Response] = []

    def send_slow() -> None:
        headers = {"Authorization": f"Bearer {KEY}"}
        body = {"model": "emb", "input": "embed_sleep:3"}
        with httpx.Client(base_url=daemon.url, timeout=slack(20.0), headers=headers) as other:
            slow.append(other.post("/v1/embeddings", json=body))

    thread = threading.Thread(target=send_slow)
    thread.start()
    try:
        wait_until(
            lambda: ok(http.get("/stats"))["fair_share_by_model"]["emb"]["in_pool"] or None,
            slack(10.0),
            interval=0.05,
        )
        second = http.post("/v1/embeddings", json={"model": "emb", "input": "x"})
        assert second.status_code == 429, second.text
    finally:
        thread.join(slack(20.0))
    assert slow and slow[0].status_code == 200, slow


def test_a_client_that_goes_away_cancels_its_embedding(daemon: Daemon, http: httpx.Client) -> None:
    def cancelled() -> int:
        count: int = ok(http.get("/stats"))["models"]["emb"]["pool"]["counters"]["cancelled"]
        return count

    before = cancelled()
    # Longer than the wait below and shorter than the deadline: only the disconnect ends it.
    body = {"model": "emb", "input": "embed_sleep:15"}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            daemon.url + "/v1/embeddings",
            json=body,
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=1.0,
        )
    wait_until(lambda: cancelled() == before + 1 or None, slack(10.0), interval=0.05)
    assert "/v1/embeddings 499" in daemon.log()


def test_score_pairs_of_several_queries_share_one_deadline(http: httpx.Client) -> None:
    # Two text_1s: two pool requests, one after the other, each taking 1.5 s, within a
    # request deadline of 2 s: the second gets what the first left, and the whole is a 504.
    body = {"model": "ce", "text_1": ["a", "b"], "text_2": ["embed_sleep:1.5"] * 2}
    response = http.post("/score", json=body, headers={"X-Request-Timeout": "2"})
    assert response.status_code == 504, response.text
    assert response.json()["error"]["code"] == "deadline_exceeded"
