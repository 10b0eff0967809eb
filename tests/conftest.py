"""Fixtures shared by every test directory."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers import BackendModule, record_children_baseline
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


_backend_numbers = itertools.count(1)


@pytest.fixture
def backend_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> BackendModule:
    """Install a backend written inline: ``backend_module(SOURCE, factory="factory")`` writes
    SOURCE as a module with a name no other test uses, puts it on sys.path (workers get
    the supervisor's sys.path) and returns the ``"module:factory"`` to pass as ``backend``."""

    def install(source: str, factory: str = "factory") -> str:
        name = f"mp_inline_backend_{next(_backend_numbers)}"
        (tmp_path / f"{name}.py").write_text(source, encoding="utf-8")
        monkeypatch.syspath_prepend(str(tmp_path))
        return f"{name}:{factory}"

    return install
