"""What ``modelpool serve`` checks of every ``[models.NAME]`` table before its port opens.

A model of a registry loads on its first request, so a mistake in its table (a path
that does not exist, a directory without weights, a GPU this machine lacks) would
otherwise surface there, as a 503 to whoever asked first; and an embedded model on
``hf`` would be converted inside that request (tens of seconds of its deadline). Here
each model gets, once and in the order of the file, what ``ModelPool.start()``'s
preflight gives one model (see :mod:`modelpool.supervisor.preflight`)::

    specs = check_models(effective.models, probe)    # ModelCheckFailed: one line
    registry = ModelRegistry(RegistryConfig.from_server(specs, server_config))

- its devices resolved, and ``backend = "auto"`` resolved to the backend it will run
  on: the returned specs carry it, so ``/v1/models`` and ``modelpool ps`` show what
  serves the model, not ``auto``;
- an ``embedded:`` model prepared for that backend (downloaded, converted once);
- a local source checked: a path that does not exist, a file where a directory is
  needed, a directory without config, tokenizer or weights (``hf``); a GGUF file or a
  directory holding one (``llama_cpp``).

A hub id is left to its first load, which fetches it (a daemon of many models does not
download every one of them before it opens its port).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence
from pathlib import Path

from modelpool.shared.config import ModelSpec, PoolConfig
from modelpool.shared.embedded import EmbeddedModelError, resolve_model
from modelpool.shared.errors import PreflightError
from modelpool.supervisor import gpu
from modelpool.supervisor.backend_choice import AUTO, choose_backend
from modelpool.supervisor.preflight import HF_BACKEND, check_devices, check_model_source
from modelpool.worker.backends import BUILTIN_BACKENDS, resolve_backend

logger = logging.getLogger(__name__)


class ModelCheckFailed(PreflightError):
    """A ``[models.NAME]`` table names a model that cannot load; the message is one line
    that starts with the table."""


def check_models(specs: Sequence[ModelSpec], probe: gpu.GpuProbe) -> tuple[ModelSpec, ...]:
    """``specs`` with each backend resolved, after every model was checked (see above)."""
    return tuple(_checked(spec, probe) for spec in specs)


def _checked(spec: ModelSpec, probe: gpu.GpuProbe) -> ModelSpec:
    config = spec.pool
    try:
        devices = check_devices(config, probe)
        if config.backend == AUTO:
            choice = choose_backend(config.model, config.backend_options, devices)
            config = config.replace(backend=choice.backend)
            check_devices(config, probe)  # with the chosen backend's own checks
            logger.info(
                "model %s: %s on the %s backend (auto: %s)",
                spec.name,
                config.model,
                config.backend,
                choice.reason,
            )
        source = resolve_model(config.model, config.backend)
        check_local_source(source, config)
    except (PreflightError, EmbeddedModelError) as exc:
        raise ModelCheckFailed(f"[models.{spec.name}] {exc}") from None
    return dataclasses.replace(spec, pool=config)


def check_local_source(model: str, config: PoolConfig) -> None:
    """The preflight's refusals of a local ``model`` for the hf backend, and its GGUF file
    for the llama_cpp backend; a hub id passes (its first load fetches it)."""
    target = resolve_backend(config.backend)
    local = Path(os.path.expanduser(model)).exists() or _is_a_path(model)
    if target == HF_BACKEND and local:
        check_model_source(model, config.backend, config.backend_options)
    elif target == BUILTIN_BACKENDS["llama_cpp"]:
        from modelpool.worker.backends.llama_cpp.options import gguf_path

        try:
            gguf_path(model, config.backend_options.get("gguf_file"))
        except (OSError, ValueError) as exc:
            raise PreflightError(f"model {model!r}: {exc}") from None


def _is_a_path(model: str) -> bool:
    """As the preflight tells a path from a hub id (``name`` or ``owner/name``)."""
    return model.startswith(("/", "./", "../", "~")) or model.count("/") > 1 or model.endswith("/")
