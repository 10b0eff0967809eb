"""Fixtures shared by every test directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import record_children_baseline
from modelpool.tinymodel import build_tiny_model


@pytest.fixture(autouse=True)
def _children_baseline() -> None:
    """Leak checks count only the processes the running test started."""
    record_children_baseline()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random llama model with a byte-level tokenizer, built once per session."""
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama")
