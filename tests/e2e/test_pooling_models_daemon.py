"""A daemon on the hf backend with three real (tiny, random) models in its registry: the
tiny chat model, a sentence-transformers embedding model and a cross-encoder. Each route
reaches its model, and the numbers are sentence-transformers' own for the same
directories, read in this process: the vectors (cosine >= 0.9999), the cross-encoder's
scores, and the embedding model's cosine scores when it reranks.

The docs, Embeddings and reranking over HTTP.
"""

from __future__ import annotations

import base64
import math
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_support import Daemon, start_daemon

from embedding_models import HIDDEN_SIZE, build_cross_encoder, build_embedding_model
from helpers import slack, toml_value

pytestmark = pytest.mark.slow

TEXTS = ["the capital of france is paris", "bananas are yellow fruit", "a dog runs fast"]
QUERY = "capital of france"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pooling-models")
    return {
        "chat": tiny_model_dir,
        "emb": build_embedding_model(root / "st-mean"),
        "ce": build_cross_encoder(root / "cross-encoder"),
    }


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, models: dict[str, Path]) -> Iterator[Daemon]:
    lines = [
        'backend = "hf"',
        "workers = 1",
        'devices = ["cpu"]',
        "deadline_s = 120.0",
        "",
        "[generation_defaults]",
        "max_new_tokens = 4",
        "",
        "[server]",
        'host = "127.0.0.1"',
        "port = 0",
    ]
    for name, path in models.items():
        lines += ["", f"[models.{name}]", f"model = {toml_value(str(path))}", "preload = true"]
    server = start_daemon(
        tmp_path_factory.mktemp("pooling-daemon"), "\n".join(lines) + "\n", ready_timeout=300.0
    )
    yield server
    assert server.stop() == 0, server.log()[-4000:]


@pytest.fixture()
def http(daemon: Daemon) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=daemon.url, timeout=slack(60.0)) as client:
        yield client


def ok(response: httpx.Response) -> Any:
    assert response.status_code == 200, response.text
    return response.json()


def cosine(first: list[float], second: list[float]) -> float:
    dot = sum(a * b for a, b in zip(first, second, strict=True))
    return dot / math.sqrt(sum(a * a for a in first) * sum(b * b for b in second))


def test_vectors_are_sentence_transformers_own(http: httpx.Client, models: dict[str, Path]) -> None:
    from sentence_transformers import SentenceTransformer

    expected = SentenceTransformer(str(models["emb"]), device="cpu").encode(TEXTS).tolist()
    body = ok(
        http.post(
            "/v1/embeddings", json={"model": "emb", "input": TEXTS, "encoding_format": "base64"}
        )
    )
    assert body["usage"]["prompt_tokens"] > len(TEXTS)
    for item, wanted in zip(body["data"], expected, strict=True):
        vector = list(struct.unpack(f"<{HIDDEN_SIZE}f", base64.b64decode(item["embedding"])))
        assert cosine(vector, wanted) >= 0.9999


def test_each_route_reaches_its_model(http: httpx.Client) -> None:
    chat = ok(
        http.post(
            "/v1/chat/completions",
            json={"model": "chat", "messages": [{"role": "user", "content": "hi"}]},
        )
    )
    assert chat["model"] == "chat" and chat["usage"]["completion_tokens"] > 0
    refused = http.post("/v1/embeddings", json={"model": "chat", "input": "hi"})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "wrong_task"
    refused = http.post(
        "/v1/chat/completions",
        json={"model": "emb", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "wrong_task"
    cards = {card["id"]: card["task"] for card in ok(http.get("/v1/models"))["data"]}
    assert cards == {"chat": "generate", "emb": "embed", "ce": "score"}


def test_keep_alive_counts_on_every_pooling_route(http: httpx.Client) -> None:
    # The docs: every request's keep_alive counts (issue 61: it was a 400 here).
    bodies = {
        "/v1/embeddings": {"model": "emb", "input": TEXTS},
        "/embed": {"model": "emb", "inputs": TEXTS},
        "/v1/rerank": {"model": "ce", "query": QUERY, "documents": TEXTS},
        "/rerank": {"model": "ce", "query": QUERY, "texts": TEXTS},
        "/score": {"model": "ce", "text_1": QUERY, "text_2": TEXTS},
    }
    for path, body in bodies.items():
        ok(http.post(path, json={**body, "keep_alive": "5m"}))
        refused = http.post(path, json={**body, "keep_alive": "soon"})
        assert refused.status_code == 400, (path, refused.text)
        assert refused.json()["error"]["param"] == "keep_alive", (path, refused.text)


def test_cross_encoder_scores_are_sentence_transformers_own(
    http: httpx.Client, models: dict[str, Path]
) -> None:
    from sentence_transformers import CrossEncoder

    reference = CrossEncoder(str(models["ce"]), device="cpu")
    expected = reference.predict([(QUERY, text) for text in TEXTS]).tolist()
    body = ok(http.post("/v1/rerank", json={"model": "ce", "query": QUERY, "documents": TEXTS}))
    order = sorted(range(len(TEXTS)), key=lambda index: -expected[index])
    assert [result["index"] for result in body["results"]] == order
    for result in body["results"]:
        assert result["relevance_score"] == pytest.approx(expected[result["index"]], abs=1e-5)
    scored = ok(http.post("/score", json={"model": "ce", "text_1": QUERY, "text_2": TEXTS}))
    assert [item["score"] for item in scored["data"]] == pytest.approx(expected, abs=1e-5)


def test_embedding_model_reranks_by_sentence_transformers_cosine(
    http: httpx.Client, models: dict[str, Path]
) -> None:
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(models["emb"]), device="cpu")
    query, *documents = reference.encode([QUERY, *TEXTS]).tolist()
    expected = [cosine(query, document) for document in documents]
    body = ok(
        http.post(
            "/rerank",
            json={"model": "emb", "query": QUERY, "texts": TEXTS, "raw_scores": False},
        )
    )
    assert [item["index"] for item in body] == sorted(
        range(len(TEXTS)), key=lambda index: -expected[index]
    )
    for item in body:
        assert item["score"] == pytest.approx(expected[item["index"]], abs=1e-4)
