"""Many models behind one daemon: a request's ``model`` → its pool, through a
:class:`~modelpool.supervisor.registry.ModelRegistry`, and the
routes that show and steer the models.

Every route that runs a model asks ``state.serve(request, body)`` (``state.ServerState``)
for its model, which ends here in :func:`serve`: the registry loads the model if need
be, within the request's deadline, and the lease that keeps it loaded is released by
:class:`ModelUse` once the answer, a stream included, has gone out. What it returns is
the one record of the model (``core.served.Served``), which the walk passes on::

    served = await state.serve(request, body)       # 404 model_not_found, 503, 504, 507
    result = await served.pool.agenerate(prompt, deadline_s=served.time_left(deadline))

Without ``[models]`` the daemon serves its one pool whatever ``model`` says, as always.

Routes added with a registry: ``POST /models/load``, ``POST /models/unload``,
``POST /models/pin`` and ``POST /models/unpin`` (``{"model": NAME}``, for operators
only: ``rights.OPERATOR_ONLY``); ``/v1/models`` lists every configured model with its
``status`` (``loaded``, ``loading``, ``unloaded``, ``unloading``, ``failed`` with
``reason``: the registry's text for an operator, its class for a tenant), backend and
measured memory.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from modelpool.server import rights
from modelpool.server.core.deadline import deadline_from
from modelpool.server.core.served import Served
from modelpool.server.fair_share import FairShare
from modelpool.server.http import invalid
from modelpool.server.lora import AdapterUse, base_of, install_lora_routes, lora_table, resolve
from modelpool.server.metrics import PoolMetrics
from modelpool.shared.config import PoolConfig, ServerConfig
from modelpool.supervisor.registry import ModelRegistry, ModelStats, parse_keep_alive

if TYPE_CHECKING:
    from modelpool.supervisor.pool import ModelPool

LEASES = "model_leases"
# A body field Ollama reads (seconds or "5m"; 0 unloads once idle, -1 keeps loaded).
KEEP_ALIVE = "keep_alive"
# The routes whose time ``modelpool_request_duration_seconds`` counts, by model.
GENERATION_PATHS = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/responses",
        "/v1/messages",
        "/api/chat",
        "/api/generate",
    }
)
_UNSET = object()


class ServedModels(Protocol):
    """What this module reads of the daemon's ``state.ServerState`` (which imports this
    module, so not the other way round)."""

    @property
    def pool(self) -> ModelPool | None: ...

    @property
    def registry(self) -> ModelRegistry | None: ...

    @property
    def config(self) -> ServerConfig: ...

    @property
    def model_name(self) -> str: ...

    @property
    def fair_share(self) -> FairShare: ...

    @property
    def shares(self) -> dict[str, FairShare]: ...

    @property
    def started(self) -> int: ...

    async def read_json(self, request: Request) -> dict[str, Any]: ...


class Releasable(Protocol):
    """What a request holds until its answer is sent: a model's lease, an adapter's use."""

    name: str

    def release(self) -> None: ...


class ModelUse:
    """ASGI middleware around a request's use of its model: releases the model leases
    (and the adapter's use) it took once its answer is sent (the app returns only after a
    streamed body's last event), and times a generation request under its model's name
    (``metrics``: the served model's, or the leased one's with a registry) and adapter's."""

    def __init__(self, app: ASGIApp, metrics: PoolMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = time.perf_counter()
        try:
            await self.app(scope, receive, send)
        finally:
            note = scope.get("state")
            leases: list[Releasable] = note.pop(LEASES, []) if isinstance(note, dict) else []
            for lease in leases:
                lease.release()
            if scope["type"] == "http" and scope["path"] in GENERATION_PATHS:
                model = next((u.name for u in leases if not isinstance(u, AdapterUse)), None)
                lora = next((u.name for u in leases if isinstance(u, AdapterUse)), None)
                self.metrics.observe_request(time.perf_counter() - started, model, lora)


def split_keep_alive(body: dict[str, Any]) -> object:
    """Take ``keep_alive`` out of a body before the OpenAI parser sees it (which would
    refuse an unknown field); :func:`serve` reads what this returns back from it."""
    return body.pop(KEEP_ALIVE, _UNSET)


def put_keep_alive(body: dict[str, Any], value: object) -> None:
    if value is not _UNSET:
        body[KEEP_ALIVE] = value


def _model_name(body: Mapping[str, Any]) -> str:
    name = body.get("model")
    if not isinstance(name, str):
        raise invalid("model is required: the name of one of the models /v1/models lists", "model")
    return name


def config_for(registry: ModelRegistry, body: Mapping[str, Any]) -> PoolConfig:
    """The pool configuration of ``body["model"]``, loaded or not (ModelNotFound if no
    model of that name or alias is configured)."""
    return registry.spec(base_of(registry, _model_name(body))).pool


async def serve(
    state: ServedModels, request: Request, body: Mapping[str, Any], client: str
) -> Served:
    """The model that serves ``body["model"]`` (see the module docstring), for ``client``
    (its tenant or address: the registry charges it the swaps its requests cause, and its
    ``keep_alive`` counts for its own use only), resolved once."""
    registry = state.registry
    if registry is None:
        assert state.pool is not None
        return Served(state.pool, state.model_name, state.fair_share)
    # An adapter's requests go to its base's pool with the adapter (server.lora); its use
    # is held, like the lease, until the answer is out.
    name, adapter_use = await resolve(registry, _model_name(body))
    if adapter_use is not None:
        request.scope.setdefault("state", {}).setdefault(LEASES, []).append(adapter_use)
    spec = registry.spec(name)
    deadline = deadline_from(
        dict(body), request.headers, spec.pool.deadline_s, state.config.max_request_timeout_s
    )
    keep_alive: Any = "default"
    if KEEP_ALIVE in body:
        try:
            keep_alive = parse_keep_alive(body[KEEP_ALIVE])
        except ValueError as exc:
            raise invalid(str(exc), KEEP_ALIVE) from None
    started = time.monotonic()
    lease = await registry.aacquire(
        spec.name, deadline_s=deadline, keep_alive=keep_alive, client=client
    )
    # All that is left in the request's scope: what ModelUse releases once the answer
    # is out (a stream's last event included), which no handler's return can know.
    request.scope.setdefault("state", {}).setdefault(LEASES, []).append(lease)
    share = state.shares.get(spec.name)
    if share is None:
        share = state.fair_share
    else:
        share.fit_to_pool(lease.pool.config.workers * lease.pool.config.max_batch_size)
    # An adapter's answers name the adapter; its base serves them.
    answers_as = spec.name if adapter_use is None else adapter_use.name
    return Served(lease.pool, answers_as, share, lease, time.monotonic() - started)


def model_card(stats: ModelStats, created: int) -> dict[str, Any]:
    """One configured model as ``/v1/models`` lists it."""
    pool = stats.pool
    return {
        "id": stats.name,
        "object": "model",
        "created": created,
        "owned_by": "modelpool",
        "status": stats.state,
        "reason": stats.reason,
        # The pool's once loaded; before, what serve resolved "auto" to at start.
        "backend": stats.backend if pool is None or not pool.backend else pool.backend,
        "aliases": list(stats.aliases),
        "pinned": stats.pinned,
        "memory_bytes": stats.rss_bytes,
        "measured_need_bytes": stats.need_bytes,
        "gpu_memory_bytes": stats.gpu_bytes,
        "max_model_len": None if pool is None else pool.max_model_len,
        # What it serves ("generate", "embed", "score"); known once loaded.
        "task": None if pool is None else pool.task,
    }


def install_routes(app: FastAPI, state: ServedModels, registry: ModelRegistry) -> None:
    """``/v1/models`` (every model, with its status) and the admin load/unload routes."""

    async def cards(request: Request) -> list[dict[str, Any]]:
        from starlette.concurrency import run_in_threadpool

        stats = await run_in_threadpool(registry.stats)
        cards = [model_card(model, state.started) for model in stats.models.values()]
        operator = rights.operates(request)
        cards = cards if operator else [rights.tenant_card(c) for c in cards]
        return cards + lora_table(registry).cards(state.started, operator)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        return {"object": "list", "data": await cards(request)}

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> dict[str, Any]:
        adapter = lora_table(registry).get(model_id)
        name = model_id if adapter is not None else registry.spec(model_id).name
        return next(card for card in await cards(request) if card["id"] == name)

    install_lora_routes(app, registry, state.config, state.read_json)

    @app.post("/models/load", dependencies=[rights.OPERATOR_ONLY])
    async def load(request: Request) -> Response:
        body = await state.read_json(request)
        name = _admin_name(body)
        spec = registry.spec(name)
        bound = deadline_from(body, request.headers, spec.load_deadline_s, spec.load_deadline_s)
        lease = await registry.aacquire(name, deadline_s=bound)
        lease.release()
        return JSONResponse(model_card(registry.model_stats(name, with_pool=False), state.started))

    @app.post("/models/unload", dependencies=[rights.OPERATOR_ONLY])
    async def unload(request: Request) -> Response:
        name = _admin_name(await state.read_json(request))
        return JSONResponse(model_card(registry.unload(name), state.started))

    # A runtime pin: never evicted nor unloaded when idle, until unpinned (not loaded by it).
    @app.post("/models/pin", dependencies=[rights.OPERATOR_ONLY])
    async def pin(request: Request) -> Response:
        name = _admin_name(await state.read_json(request))
        return JSONResponse(model_card(registry.pin(name, True), state.started))

    @app.post("/models/unpin", dependencies=[rights.OPERATOR_ONLY])
    async def unpin(request: Request) -> Response:
        name = _admin_name(await state.read_json(request))
        return JSONResponse(model_card(registry.pin(name, False), state.started))


def _admin_name(body: Mapping[str, Any]) -> str:
    for key in body:
        if key not in ("model", "timeout"):
            raise invalid(f"unsupported field {key!r}", param=key, code="unsupported_field")
    name = body.get("model")
    if not isinstance(name, str):
        raise invalid("model must be the name of a configured model", "model")
    return name
