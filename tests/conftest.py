"""Fixtures shared by every test directory."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers import record_children_baseline
from modelpool.processes import set_child_subreaper
from modelpool.tinymodel import build_tiny_model


@pytest.fixture(autouse=True)
def _children_baseline() -> None:
    """Leak checks count only the processes the running test started."""
    record_children_baseline()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random llama model with a byte-level tokenizer, built once per session."""
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture
def subreaper() -> Iterator[None]:
    """Orphans of the processes a test starts come back to it (not to an init that may be
    slow to reap), so it can reap them and tell "gone" from "zombie" itself (Linux)."""
    if not set_child_subreaper(True):
        pytest.skip("cannot become a child subreaper")
    try:
        yield
    finally:
        set_child_subreaper(False)
