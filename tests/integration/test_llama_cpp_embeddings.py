"""GGUF embedding models on the llama_cpp backend (``backends/llama_cpp/embedding.py``).

The GGUF is the packaged all-MiniLM-L6-v2 converted here by llama.cpp's own converter
(``convert_hf_to_gguf.py``, from the pinned llama-cpp-python's source distribution, the
llama.cpp the backend's wheel is built from), and its vectors are compared with
sentence-transformers' for the same model.
"""

from __future__ import annotations

import concurrent.futures
import math
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from helpers import FakeCall, skip_unless_pypi
from modelpool import ContextLengthExceeded, ModelPool, PoolConfig, WrongTask
from modelpool.shared.embedded import EMBEDDING_NAME, prepare_model
from modelpool.shared.protocol import EmbedRequest, Generation

pytestmark = pytest.mark.slow

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
TEXTS = [
    "The cat sits outside",
    "A man is playing guitar",
    "The new movie is awesome",
    "Paris is the capital and most populous city of France.",
]


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("llama_cpp")
    pytest.importorskip("gguf")
    skip_unless_pypi("llama.cpp's converter (llama-cpp-python's sdist) and the model")
    work = tmp_path_factory.mktemp("llama-embedding")
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary",
         ":all:", "-d", str(work), LLAMA_CPP_PYTHON],
        check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    (sdist,) = work.glob("llama_cpp_python-*.tar.gz")
    with tarfile.open(sdist) as archive:
        members = [
            member
            for member in archive.getmembers()
            if "/vendor/llama.cpp/" in member.name
            and any(
                part in member.name
                for part in ("convert_hf_to_gguf.py", "/conversion/", "/gguf-py/")
            )
        ]
        archive.extractall(work, members=members, filter="data")
    (converter,) = work.glob("*/vendor/llama.cpp/convert_hf_to_gguf.py")
    root = converter.parent
    target = work / "minilm-f32.gguf"
    environment = {**os.environ, "PYTHONPATH": f"{root / 'gguf-py'}{os.pathsep}{root}"}
    model = prepare_model(EMBEDDING_NAME, progress=False)
    subprocess.run(
        [sys.executable, str(converter), str(model), "--outfile", str(target), "--outtype", "f32"],
        check=True, capture_output=True, timeout=600, env=environment,
    )  # fmt: skip
    return target


def _cosine(first: list[float], second: list[float]) -> float:
    dot = sum(a * b for a, b in zip(first, second, strict=True))
    return dot / math.sqrt(sum(a * a for a in first) * sum(b * b for b in second))


def test_gguf_vectors_equal_sentence_transformers(gguf_file: Path) -> None:
    sentence_transformers = pytest.importorskip("sentence_transformers")
    from modelpool.worker.backends.llama_cpp import load
    from modelpool.worker.backends.llama_cpp.embedding import LlamaEmbeddingHandler

    handler = load(str(gguf_file), threads=1)
    assert isinstance(handler, LlamaEmbeddingHandler) and handler.task == "embed"
    answer = handler.embed(EmbedRequest(tuple(TEXTS)), FakeCall(""))
    assert answer.pooled is not None and answer.pooled.vectors is not None
    reference = sentence_transformers.SentenceTransformer(
        str(prepare_model(EMBEDDING_NAME, progress=False)), device="cpu"
    ).encode(TEXTS)
    cosines = [
        _cosine(a, b) for a, b in zip(answer.pooled.vectors, reference.tolist(), strict=True)
    ]
    assert min(cosines) >= 0.9999, cosines
    ids = tuple(handler.tokenize(TEXTS[0]))
    by_ids = handler.embed(EmbedRequest((ids,)), FakeCall(""))
    assert by_ids.pooled is not None and by_ids.pooled.vectors is not None
    assert _cosine(by_ids.pooled.vectors[0], answer.pooled.vectors[0]) > 0.99999
    cancelled = FakeCall("", flag=True)
    assert handler.embed(EmbedRequest(tuple(TEXTS)), cancelled).finish_reason == "cancelled"


def test_a_pool_serves_the_gguf_as_an_embedding_model(gguf_file: Path) -> None:
    config = PoolConfig(
        model=str(gguf_file), backend="llama_cpp", workers=1, devices=["cpu"],
        backend_options={"threads": 1},
    )  # fmt: skip
    with ModelPool(config) as pool:
        assert pool.task == "embed" and pool.stats().max_model_len == 512
        scored = pool.score("What is the capital of France?", TEXTS)
        assert max(range(len(TEXTS)), key=scored.scores.__getitem__) == 3
        assert pool.embed(TEXTS[:2], dimensions=64).dimensions == 64
        with pytest.raises(ContextLengthExceeded):
            pool.embed("word " * 600)
        assert pool.embed("word " * 600, truncate=True).prompt_tokens == 512
        with pytest.raises(WrongTask):
            pool.generate("hello")


def test_concurrent_requests_batch_and_keep_their_vectors(gguf_file: Path) -> None:
    from modelpool.worker.backends.llama_cpp import load

    handler = load(str(gguf_file), threads=1)
    solo = []
    for text in TEXTS:
        answer = handler.embed(EmbedRequest((text,)), FakeCall(""))
        assert answer.pooled is not None and answer.pooled.vectors is not None
        solo.append(answer.pooled.vectors[0])
    # Admitted together, one step embeds them all; a cancelled one is answered cancelled.
    calls = [FakeCall("") for _ in TEXTS]
    cancelled = FakeCall("", flag=True)
    for call, text in zip(calls, TEXTS, strict=True):
        call.request = EmbedRequest((text,))  # type: ignore[attr-defined]
        handler.admit(call)  # type: ignore[arg-type]
    cancelled.request = EmbedRequest(("dropped",))  # type: ignore[attr-defined]
    handler.admit(cancelled)  # type: ignore[arg-type]
    finished = handler.step()
    assert [call for call, _ in finished] == [*calls, cancelled]
    answers = [answer for _, answer in finished]
    assert isinstance(answers[-1], Generation) and answers[-1].finish_reason == "cancelled"
    for answer, expected in zip(answers, solo, strict=False):
        assert isinstance(answer, Generation) and answer.pooled is not None
        assert answer.pooled.vectors is not None
        assert _cosine(answer.pooled.vectors[0], expected) > 0.99999
    config = PoolConfig(
        model=str(gguf_file), backend="llama_cpp", workers=1, devices=["cpu"],
        backend_options={"threads": 1, "embedding": True},
    )  # fmt: skip
    with ModelPool(config) as pool, concurrent.futures.ThreadPoolExecutor(4) as executor:
        assert pool.config.max_batch_size == 32
        results = list(executor.map(pool.embed, TEXTS))
        for result, expected in zip(results, solo, strict=True):
            assert _cosine(result.vectors[0], expected) > 0.99999
