"""LoRA adapters in the daemon: the adapters a registry serves, what a request naming one
becomes, and vLLM's run-time load and unload routes.

A request whose ``model`` is an adapter goes to its base's pool (``models.pool_for``
asks :func:`resolve`), with the adapter set on the request's context
(``shared.lora.REQUEST_LORA``) for the pool to write into its parameters; a request to
the base sets none, so it uses no adapter. An adapter is checked once (per version of its
files) in a child process before its first request reaches a worker
(``shared.lora.check_adapter``): a bad one is a 400 naming it and why, a check that hangs
a 503, and neither touches a worker or another model's requests.

Routes (operators only, ``rights.OPERATOR_ONLY``; the API key as everywhere)::

    POST /v1/load_lora_adapter    {"lora_name": "sql", "lora_path": "/adapters/sql",
                                   "base_model_name": "chat"}   # base: optional with one model
    POST /v1/unload_lora_adapter  {"lora_name": "sql"}

A loaded adapter's directory must lie under one of ``[server] lora_dirs`` (resolved, links
followed): the daemon reads no other path a caller names. An unload takes the name away
at once (new requests get 404) and answers once the adapter's running requests ended.
"""

from __future__ import annotations

import asyncio
import os
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from starlette.concurrency import run_in_threadpool

from modelpool.server import rights
from modelpool.server.http import ApiError, invalid
from modelpool.shared.config import ServerConfig
from modelpool.shared.errors import InvalidRequest
from modelpool.shared.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    CHECK_TIMEOUT_S,
    DEFAULT_MAX_LORAS,
    REQUEST_LORA,
    AdapterSpec,
    LoraRef,
    check_adapter,
)
from modelpool.supervisor.registry import ModelRegistry

# An adapter's name (its error names it), its path and the version of its files.
_Version = tuple[str, str, tuple[int, int, int, int] | None]


@dataclass(eq=False)
class AdapterUse:
    """One running request of an adapter; released with the request's model lease."""

    table: LoraTable
    name: str
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.table.ended(self.name)


@dataclass(eq=False)
class LoraTable:
    """The adapters a registry serves, by name, with their running requests."""

    registry: ModelRegistry
    adapters: dict[str, AdapterSpec] = field(default_factory=dict)
    running: dict[str, int] = field(default_factory=dict)
    # Each adapter's last check, by the version of its files: None passed, else the error.
    checked: dict[_Version, InvalidRequest | None] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    # The unloads waiting for an adapter's running requests to end.
    idle: dict[str, tuple[asyncio.Event, asyncio.AbstractEventLoop]] = field(default_factory=dict)
    check_timeout_s: float = CHECK_TIMEOUT_S

    def get(self, name: str) -> AdapterSpec | None:
        with self.lock:
            return self.adapters.get(name)

    def started(self, name: str) -> AdapterUse:
        with self.lock:
            self.running[name] = self.running.get(name, 0) + 1
        return AdapterUse(self, name)

    def ended(self, name: str) -> None:
        with self.lock:
            left = self.running.get(name, 1) - 1
            self.running[name] = left
            waiting = self.idle.pop(name, None) if left <= 0 else None
        if waiting is not None:
            # Called on the event loop's thread or another: set through the loop either way.
            event, loop = waiting
            loop.call_soon_threadsafe(event.set)

    def check(self, adapter: AdapterSpec) -> None:
        """The adapter's files checked (in a child, bounded) once per version of them."""
        version = (adapter.name, adapter.path, _stamp(adapter.path))
        with self.lock:
            known = version in self.checked
            error = self.checked.get(version)
        if not known:
            base = self.registry.spec(adapter.base).pool.model
            try:
                folder = base if os.path.exists(base) else None  # a directory or a GGUF
                check_adapter(adapter.name, adapter.path, folder, self.check_timeout_s)
            except InvalidRequest as exc:
                error = exc
            with self.lock:
                self.checked[version] = error
        if error is not None:
            raise InvalidRequest(error.message)

    def in_flight(self) -> dict[str, tuple[tuple[str, ...], int]]:
        """Per base model: its adapters with requests in flight, and the ``max_loras`` its
        workers hold (vLLM's ``vllm:lora_requests_info``, ``vllm_metrics``)."""
        with self.lock:
            names = {
                name: self.adapters[name].base
                for name, count in self.running.items()
                if count > 0 and name in self.adapters
            }
            bases = {adapter.base for adapter in self.adapters.values()}
        info = {}
        for base in sorted(bases):
            try:
                options = self.registry.spec(base).pool.backend_options
            except Exception:
                continue  # a base taken away since: nothing of it to show
            held = tuple(sorted(name for name, of in names.items() if of == base))
            info[base] = (held, int(options.get("max_loras", DEFAULT_MAX_LORAS)))
        return info

    def cards(self, created: int, operator: bool) -> list[dict[str, Any]]:
        """The adapters as ``/v1/models`` lists them (vLLM's ``parent``; the path, vLLM's
        ``root``, for operators only)."""
        with self.lock:
            adapters = list(self.adapters.values())
        cards = []
        for adapter in adapters:
            card: dict[str, Any] = {
                "id": adapter.name,
                "object": "model",
                "created": created,
                "owned_by": "modelpool",
                "parent": adapter.base,
                "root": adapter.path if operator else adapter.name,
                "adapter": "lora",
            }
            cards.append(card)
        return cards


_TABLES: weakref.WeakKeyDictionary[ModelRegistry, LoraTable] = weakref.WeakKeyDictionary()
_TABLES_LOCK = threading.Lock()


def lora_table(registry: ModelRegistry) -> LoraTable:
    """The registry's adapters (its configuration's, then those loaded at run time)."""
    with _TABLES_LOCK:
        table = _TABLES.get(registry)
        if table is None:
            table = LoraTable(registry, {a.name: a for a in registry.config.adapters})
            _TABLES[registry] = table
        return table


async def resolve(registry: ModelRegistry, name: str) -> tuple[str, AdapterUse | None]:
    """The registry model that serves ``name`` and, when ``name`` is an adapter, its use
    (to release once the answer is sent). Sets the request's adapter (None for a model)."""
    table = lora_table(registry)
    adapter = table.get(name)
    if adapter is None:
        REQUEST_LORA.set(None)
        return name, None
    await run_in_threadpool(table.check, adapter)
    REQUEST_LORA.set(LoraRef(adapter.name, adapter.path))
    return adapter.base, table.started(adapter.name)


def base_of(registry: ModelRegistry, name: str) -> str:
    """``name``, or its base when it is an adapter (no check, nothing set)."""
    adapter = lora_table(registry).get(name)
    return name if adapter is None else adapter.base


def served_name(registry: ModelRegistry, name: str) -> str:
    """The name an answer gives: an adapter's own, else the registry's for the model."""
    return name if lora_table(registry).get(name) is not None else registry.spec(name).name


def install_lora_routes(
    app: FastAPI, registry: ModelRegistry, config: ServerConfig, read_json: Any
) -> None:
    """vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (module docstring)."""
    table = lora_table(registry)
    table.check_timeout_s = config.lora_check_timeout_s

    @app.post("/v1/load_lora_adapter", dependencies=[rights.OPERATOR_ONLY])
    async def load_lora_adapter(request: Request) -> PlainTextResponse:
        body = await read_json(request)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name:
            raise invalid("lora_name is required: the adapter's model name", "lora_name")
        if not isinstance(path, str) or not path:
            raise invalid("lora_path is required: the adapter's directory", "lora_path")
        base = body.get("base_model_name")
        if base is None:
            names = registry.names()
            if len(names) != 1:
                raise invalid(
                    f"base_model_name is required with several models ({', '.join(names)})",
                    "base_model_name",
                )
            base = names[0]
        if not isinstance(base, str):
            raise invalid("base_model_name must be a model's name", "base_model_name")
        base = registry.spec(base).name  # 404 for an unknown base
        folder = allowed_path(path, config.lora_dirs)
        taken = table.get(name) is not None or name in _model_names(registry)
        if taken:
            raise invalid(f"the name {name!r} is taken by a model or adapter", "lora_name")
        adapter = AdapterSpec(name, base, str(folder))
        await run_in_threadpool(table.check, adapter)
        with table.lock:
            if name in table.adapters:
                raise invalid(f"the name {name!r} is taken by a model or adapter", "lora_name")
            table.adapters[name] = adapter
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", dependencies=[rights.OPERATOR_ONLY])
    async def unload_lora_adapter(request: Request) -> PlainTextResponse:
        body = await read_json(request)
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            raise invalid("lora_name is required: the adapter's model name", "lora_name")
        event = asyncio.Event()
        with table.lock:
            if table.adapters.pop(name, None) is None:
                raise ApiError(
                    404,
                    f"no LoRA adapter named {name!r}",
                    code="model_not_found",
                    param="lora_name",
                )
            running = table.running.get(name, 0) > 0
            if running:
                table.idle[name] = (event, asyncio.get_running_loop())
        if running:
            await event.wait()
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


def allowed_path(path: str, lora_dirs: tuple[str, ...]) -> Path:
    """``path`` resolved, if it lies under one of ``lora_dirs`` and holds an adapter; else a
    400 that names no file outside them."""
    if not lora_dirs:
        raise ApiError(
            403,
            "loading LoRA adapters at run time is off: set [server] lora_dirs to the "
            "directories adapters may be read from",
            code="lora_loading_disabled",
        )
    folder = Path(path).expanduser().resolve()
    roots = [Path(root).expanduser().resolve() for root in lora_dirs]
    if not any(folder == root or root in folder.parents for root in roots):
        raise invalid(
            f"lora_path must lie under one of [server] lora_dirs ({', '.join(lora_dirs)})",
            "lora_path",
        )
    gguf = folder.is_file() and folder.suffix == ".gguf"  # a LoRA GGUF, for llama_cpp
    if not gguf and not (folder / ADAPTER_CONFIG).is_file():
        raise invalid(f"{path} holds no {ADAPTER_CONFIG} and is no .gguf file", "lora_path")
    return folder


def _model_names(registry: ModelRegistry) -> set[str]:
    return {name for spec in registry.config.models for name in (spec.name, *spec.aliases)}


def _stamp(path: str) -> tuple[int, int, int, int] | None:
    """The version of an adapter's files (mtime and size of its config and weights, or of
    its one GGUF file)."""
    try:
        if os.path.isfile(path):
            found = os.stat(path)
            return found.st_mtime_ns, found.st_size, 0, 0
        config = os.stat(os.path.join(path, ADAPTER_CONFIG))
        weights = os.stat(os.path.join(path, ADAPTER_WEIGHTS))
    except OSError:
        return None
    return config.st_mtime_ns, config.st_size, weights.st_mtime_ns, weights.st_size
