"""``backend = "auto"`` (the default): which built-in backend serves a model, and why.

``ModelPool.start()`` makes the choice once, after the devices are resolved and before
the model is prepared, and keeps the reason for the log and ``stats()``::

    choice = choose_backend(config.model, config.backend_options, devices)
    choice.backend      # "llama_cpp"
    choice.reason       # "a GGUF model on the CPU and llama-cpp-python 0.3.36 ..."

The rule: a GGUF model (an ``embedded:`` model that ships as one; a ``.gguf`` file; a
directory that holds one and no transformers ``config.json``) runs on ``llama_cpp``
when llama-cpp-python is installed, every worker's device is the CPU, and the
``backend_options`` given are ones llama_cpp takes. Anything else runs on ``hf``. On a
CPU, llama.cpp decodes the embedded model several times faster than transformers
(docs/benchmarks.md: 6.6x a single stream); on a GPU the hf backend is the one that
runs on it by default, so a GPU keeps hf.

A pooling model's batch (``pooling_batch_size``): an embedding model or a cross-encoder
whose worker batches embed and score requests (the hf backend's, the testing backend's
``task`` option; a llama_cpp GGUF loaded with ``embedding = true``) gets
``max_batch_size = pooling_batch_size`` when ``max_batch_size`` was left at 1, since
one-text requests of concurrent clients are exactly what a shared forward pass is for.
A GGUF that is an embedding model by its metadata alone is not opened here (see below):
it batches with ``embedding = true`` or a ``max_batch_size`` of its own.

Nothing is imported to decide: llama-cpp-python is looked up (``find_spec``), not
loaded, so the supervisor never maps libllama; a broken install is then the worker's
load failure, which names it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modelpool.shared.config import PoolConfig, embedded_backend_options
from modelpool.supervisor.devices import group_devices

AUTO = "auto"


@dataclass(frozen=True)
class BackendChoice:
    """The backend ``auto`` resolved to, and the reason in one sentence."""

    backend: str
    reason: str


def choose_backend(
    model: str,
    options: Mapping[str, Any],
    devices: Sequence[str],
    *,
    llama_cpp_version: str | bool | None = True,
) -> BackendChoice:
    """The backend for ``model`` on ``devices`` (each worker's resolved label).

    ``llama_cpp_version``: True looks llama-cpp-python up; a string or None is what that
    look-up would have found (tests)."""
    if not is_gguf_model(model, options):
        return BackendChoice("hf", f"{model!r} is not a GGUF model: transformers runs it")
    gpus = sorted({device for label in devices for device in group_devices(label)} - {"cpu"})
    if gpus:
        return BackendChoice(
            "hf", f"a GGUF model on {', '.join(gpus)}: the hf backend runs it on the GPU"
        )
    version = installed_llama_cpp() if llama_cpp_version is True else llama_cpp_version
    if not isinstance(version, str):
        return BackendChoice(
            "hf",
            "a GGUF model on the CPU, but llama-cpp-python is not installed "
            "(pip install 'modelpool[llama]' for llama.cpp, several times faster here)",
        )
    from modelpool.worker.backends.llama_cpp.options import LOAD_OPTIONS

    foreign = sorted(set(options) - LOAD_OPTIONS)
    if foreign:
        return BackendChoice(
            "hf",
            f"a GGUF model on the CPU, but backend_options {', '.join(foreign)} are not "
            "llama_cpp options: the hf backend takes them",
        )
    return BackendChoice(
        "llama_cpp",
        f"a GGUF model on the CPU and llama-cpp-python {version} is installed: llama.cpp "
        'decodes it several times faster than transformers (backend = "hf" to override)',
    )


def is_gguf_model(model: str, options: Mapping[str, Any]) -> bool:
    """``model`` is a GGUF checkpoint: an ``embedded:`` model that ships as one, a ``.gguf``
    file, or a directory holding one (named by ``gguf_file``, or without a transformers
    config)."""
    if model.startswith("embedded:"):
        from modelpool.shared.embedded import MODELS

        spec = MODELS.get(model.removeprefix("embedded:"))
        return spec is None or not spec.directory_member
    path = Path(model).expanduser()
    if path.is_file():
        return path.suffix == ".gguf"
    if not path.is_dir():
        return False  # A hub id: the hf backend fetches it.
    gguf_file = options.get("gguf_file")
    if isinstance(gguf_file, str):
        return (path / gguf_file).is_file()
    return not (path / "config.json").is_file() and any(path.glob("*.gguf"))


def installed_llama_cpp() -> str | None:
    """llama-cpp-python's version when it can be imported (looked up, not imported)."""
    try:
        if importlib.util.find_spec("llama_cpp") is None:
            return None
    except (ImportError, ValueError):
        return None
    try:
        return importlib.metadata.version("llama_cpp_python")
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"


def with_pooling_batches(config: PoolConfig) -> PoolConfig:
    """``config`` with a pooling model's batch size filled in (see above); the backend and
    the model must be resolved (a local directory, not ``embedded:``)."""
    if config.max_batch_size != 1 or config.pooling_batch_size == 1:
        return config
    if config.backend == "testing":
        pooling = config.backend_options.get("task") in ("embed", "score")
    elif config.backend == "hf":
        # Two small JSON files; the hf backend's package is imported at start() anyway.
        from modelpool.worker.backends.hf.pooling import pooling_task

        pooling = pooling_task(config.model) is not None
    elif config.backend == "llama_cpp":
        pooling = config.backend_options.get("embedding") is True
    else:
        pooling = False
    return config.replace(max_batch_size=config.pooling_batch_size) if pooling else config


def with_backend_chosen(config: PoolConfig, devices: list[str]) -> tuple[PoolConfig, str]:
    """``config`` with ``backend = "auto"`` resolved (and the embedded model's hf options
    filled in), and why it serves on that backend (start() logs it once the checks pass)."""
    if config.backend == AUTO:
        choice = choose_backend(config.model, config.backend_options, devices)
        backend, reason = choice.backend, f"auto: {choice.reason}"
    else:
        backend, reason = config.backend, f"configured: backend = {config.backend!r}"
    options = embedded_backend_options(config.model, backend, config.backend_options)
    if backend != config.backend or options != config.backend_options:
        config = config.replace(backend=backend, backend_options=options)
    return config, reason


def prepared_model(model: str, backend: str) -> str:
    """``embedded:NAME`` is prepared (once) and becomes its local directory (for the
    llama_cpp backend, the directory of its GGUF file)."""
    if not model.startswith("embedded:"):
        return model
    from modelpool.shared.embedded import resolve_model

    return resolve_model(model, backend)
