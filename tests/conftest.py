"""Fixtures shared by every test directory."""

from __future__ import annotations

import itertools
import random
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from helpers import BackendModule, record_children_baseline
from modelpool import ModelPool
from modelpool.shared.processes import set_child_subreaper
from modelpool.tinymodel import build_tiny_model


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--shuffle-files",
        metavar="SEED",
        type=int,
        default=None,
        help="run the test files in an order shuffled with SEED; the tests of a file keep "
        "their order, so that module-scoped daemons and pools are still built once "
        "(scripts/test --stress)",
    )


def pytest_report_header(config: pytest.Config) -> str | None:
    seed = config.getoption("shuffle_files")
    return None if seed is None else f"test files shuffled: --shuffle-files={seed}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A file order no test may depend on: one left behind by a file, or needed from an
    earlier one, shows up as a failure that the seed reproduces."""
    seed = config.getoption("shuffle_files")
    if seed is None:
        return
    files: dict[Path, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.path, []).append(item)
    order = list(files)
    random.Random(seed).shuffle(order)
    items[:] = [item for path in order for item in files[path]]


@pytest.fixture(autouse=True)
def _children_baseline() -> None:
    """Leak checks count only the processes the running test started."""
    record_children_baseline()


def _device_names(devices: Any) -> Iterator[str]:
    for entry in devices:
        if isinstance(entry, str):
            yield entry
        else:
            yield from _device_names(entry)


@pytest.fixture(autouse=True)
def _pools_stay_off_real_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test may depend on whether the host has a GPU: a pool a test starts in this
    process runs on "cpu", or is given a fake NVML (``gpu_probe=``, the GPU tests). A pool
    that would look for a real GPU ("auto", "cuda:N") fails here on every host, not only
    on one with a driver. (Pools in subprocesses and daemons pin ``devices`` the same way:
    ``helpers.make_config``, ``e2e_support.daemon_config``.)"""
    probed: weakref.WeakSet[ModelPool] = weakref.WeakSet()
    original_init = ModelPool.__init__
    original_start = ModelPool.start

    def init(self: ModelPool, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        if kwargs.get("gpu_probe") is not None:
            probed.add(self)

    def start(self: ModelPool) -> ModelPool:
        real_gpus = sorted(set(_device_names(self.config.devices)) - {"cpu"})
        assert self in probed or not real_gpus, (
            f"a test pool would use real GPUs {real_gpus}: pin devices=('cpu',) "
            "(helpers.make_config does) or pass a fake NVML as gpu_probe"
        )
        return original_start(self)

    monkeypatch.setattr(ModelPool, "__init__", init)
    monkeypatch.setattr(ModelPool, "start", start)


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
