"""What ``/api/tags``, ``/api/ps`` and ``/api/show`` say of the served models, from the
registry's stats (or the one pool's).

- ``/api/tags``: every configured model, loaded or not; ``size`` is the memory it was
  measured to need (0 before its first load: modelpool measures, it keeps no files);
- ``/api/ps``: the loaded ones, with the memory they hold now (``size``, ``size_vram``
  the GPUs' part), their context, and ``expires_at``: when the registry unloads them
  idle (``ttl_s``, or a request's ``keep_alive``; a model in use expires that long
  after its last request ends; a pinned model, ``keep_alive: -1`` or the one pool of a
  one-model daemon, never: Ollama's far-future date);
- ``/api/show``: the details, the context (``model_info``: ``<backend>.context_length``,
  once loaded or where the configuration says) and the capabilities: ``completion`` and
  ``tools`` for a chat model, ``embedding`` for an embedding model.

``digest`` is a keyed hash of the model's name and source (modelpool has no blobs): it
changes when the configuration points the name elsewhere, and, keyed by a secret of the
daemon's process, lets no client confirm a guessed path.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import secrets
from typing import Any

from modelpool import __version__
from modelpool.shared.config import PoolConfig
from modelpool.supervisor.registry import ModelStats
from modelpool.supervisor.stats import PoolStats

# The Ollama API these routes follow (clients such as VS Code's check a minimum version).
OLLAMA_API_VERSION = "0.12.6"
# What Ollama answers for a model kept loaded for good: now plus the largest duration.
_FOREVER = datetime.timedelta(microseconds=(2**63 - 1) // 1000)
_MIB = 2**20


def version_body() -> dict[str, str]:
    return {"version": OLLAMA_API_VERSION, "modelpool_version": __version__}


def timestamp(moment: datetime.datetime) -> str:
    return moment.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


# The digests' key: a path an operator configured is not a client's to test guesses on.
_DIGEST_KEY = secrets.token_bytes(32)


def digest(name: str, source: str) -> str:
    return hmac.new(_DIGEST_KEY, f"{name}:{source}".encode(), hashlib.sha256).hexdigest()


def details(backend: str) -> dict[str, Any]:
    return {
        "parent_model": "",
        "format": backend,
        "family": "",
        "families": None,
        "parameter_size": "",
        "quantization_level": "",
    }


def tag(name: str, config: PoolConfig, backend: str, size: int, started: int) -> dict[str, Any]:
    """One model as ``/api/tags`` lists it."""
    return {
        "name": name,
        "model": name,
        "modified_at": timestamp(datetime.datetime.fromtimestamp(started, datetime.UTC)),
        "size": size,
        "digest": digest(name, config.model),
        "details": details(backend),
    }


def registry_tag(stats: ModelStats, config: PoolConfig, started: int) -> dict[str, Any]:
    return tag(stats.name, config, stats.backend, stats.need_bytes or 0, started)


def expires_at(stats: ModelStats, now: datetime.datetime) -> str:
    """When the registry unloads the model if no request comes (see the docstring)."""
    keep = stats.keep_alive_s
    if keep is None:
        return timestamp(now + _FOREVER)
    idle = 0.0 if stats.in_use or stats.idle_s is None else stats.idle_s
    return timestamp(now + datetime.timedelta(seconds=max(0.0, keep - idle)))


def running(
    name: str,
    config: PoolConfig,
    backend: str,
    memory: tuple[int, int],
    context: int | None,
    expires: str,
) -> dict[str, Any]:
    """One loaded model as ``/api/ps`` lists it; ``memory``: (RAM, GPU) bytes."""
    ram, gpu = memory
    return {
        "name": name,
        "model": name,
        "size": ram + gpu,
        "digest": digest(name, config.model),
        "details": details(backend),
        "expires_at": expires,
        "size_vram": gpu,
        "context_length": context,
    }


def registry_running(
    stats: ModelStats, config: PoolConfig, now: datetime.datetime
) -> dict[str, Any]:
    context = None if stats.pool is None else stats.pool.max_model_len
    memory = (stats.rss_bytes or 0, sum(stats.gpu_bytes.values()))
    return running(stats.name, config, stats.backend, memory, context, expires_at(stats, now))


def pool_running(
    name: str, config: PoolConfig, stats: PoolStats, now: datetime.datetime
) -> dict[str, Any]:
    """The one pool of a one-model daemon: loaded for the daemon's lifetime."""
    ram = sum(int((worker.rss_mb or 0) * _MIB) for worker in stats.workers)
    gpu = sum(int((worker.gpu_mb or 0) * _MIB) for worker in stats.workers)
    forever = timestamp(now + _FOREVER)
    return running(name, config, stats.backend, (ram, gpu), stats.max_model_len, forever)


def show_body(
    name: str,
    config: PoolConfig,
    backend: str,
    task: str | None,
    context: int | None,
    started: int,
) -> dict[str, Any]:
    """``/api/show``: what is known of the model without loading it (``task`` and
    ``context`` once loaded, else what its configuration says)."""
    task = task or str(config.backend_options.get("task", "generate"))
    if context is None:
        configured = config.backend_options.get("max_model_len")
        context = configured if isinstance(configured, int) else None
    capabilities = {"generate": ["completion", "tools"], "embed": ["embedding"]}.get(task, [])
    model_info: dict[str, Any] = {"general.architecture": backend, "general.basename": name}
    if context is not None:
        model_info[f"{backend}.context_length"] = context
    return {
        "modelfile": "",
        "parameters": "",
        "template": "",
        "details": details(backend),
        "model_info": model_info,
        "capabilities": capabilities,
        "modified_at": timestamp(datetime.datetime.fromtimestamp(started, datetime.UTC)),
    }
