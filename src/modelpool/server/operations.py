"""The daemon's operational routes, beside the API families': liveness (``/healthz``),
readiness (``/readyz``), ``/stats``, the status page (``/ui``), ``/metrics``, and the
models: ``/v1/models`` of a one-model daemon, or a registry's models with their
management routes (``models.install_routes``); and the observers each pool gets (the
``vllm:`` series, the traces)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from modelpool.server import models as multi
from modelpool.server import rights
from modelpool.server.errors import RETRY_AFTER_UNAVAILABLE
from modelpool.server.http import ApiError
from modelpool.server.metrics import CONTENT_TYPE, PoolMetrics
from modelpool.server.state import ServerState
from modelpool.server.ui import add_ui_routes
from modelpool.shared.config import ServerConfig
from modelpool.supervisor.registry import ModelRegistry

if TYPE_CHECKING:
    from modelpool.supervisor.pool import ModelPool

logger = logging.getLogger(__name__)

READY_WORKER_STATES = frozenset({"idle", "busy", "spare"})


def install_operational_routes(
    app: FastAPI, state: ServerState, tracing: Callable[[], dict[str, int]] | None
) -> None:
    """Register the operational routes on ``app``; ``tracing``: the trace exporter's
    snapshot, shown in ``/stats`` (None: no tracing)."""
    registry, pool, metrics = state.registry, state.pool, state.metrics

    @app.get("/healthz")
    async def healthz() -> Response:
        # Liveness, not readiness: never waits on the dispatcher (a wedged one is what
        # this must report), and a pool that is starting or degraded is still alive.
        state.loop_watch.ensure_started()
        health = state.health()
        lag = state.loop_watch.lag_s()
        reasons: list[str] = [] if health.alive else [health.reason or "the pool is not alive"]
        if lag > state.config.max_event_loop_lag_s:
            reasons.append(
                f"the HTTP server's event loop runs {lag:.1f} s late "
                f"(max_event_loop_lag_s = {state.config.max_event_loop_lag_s:g})"
            )
        body: dict[str, Any] = {
            "status": "unhealthy" if reasons else "ok",
            "pool": health.state,
            "heartbeat_age_s": health.heartbeat_age_s,
            "event_loop_lag_s": lag,
        }
        if reasons:
            body["reason"] = "; ".join(reasons)
            body["reasons"] = reasons
            logger.warning("/healthz: unhealthy: %s", "; ".join(reasons))
        return JSONResponse(body, status_code=503 if reasons else 200)

    @app.get("/readyz")
    async def readyz(request: Request) -> Response:
        if registry is not None:
            return await _registry_ready(state, registry, listed=rights.known(request))
        assert pool is not None
        stats = await run_in_threadpool(pool.stats)
        ready_workers = sum(1 for w in stats.workers if w.state in READY_WORKER_STATES)
        ready = not state.draining and stats.state in ("ready", "degraded") and ready_workers > 0
        body = {
            "status": "ready" if ready else "not ready",
            "pool": stats.state,
            "ready_workers": ready_workers,
            "draining": state.draining,
        }
        headers = {} if ready else {"Retry-After": str(RETRY_AFTER_UNAVAILABLE)}
        return JSONResponse(body, status_code=200 if ready else 503, headers=headers)

    @app.get("/stats")
    async def stats(request: Request) -> Response:
        server_parts = {
            "fair_share": state.fair_share.snapshot(),
            "checks": state.checks.snapshot(),
            "responses_store": state.responses.store.snapshot(),
            **({"tracing": tracing()} if tracing is not None else {}),
        }
        if registry is not None:
            server_parts["fair_share_by_model"] = {
                name: share.snapshot() for name, share in state.shares.items()
            }
            snapshot_all = (await run_in_threadpool(registry.stats)).to_dict()
        else:
            assert pool is not None
            snapshot_all = (await pool.astats()).to_dict()
        full = {**snapshot_all, **server_parts}
        return JSONResponse(full if rights.operates(request) else rights.tenant_stats(full))

    add_ui_routes(app)

    @app.get("/metrics")
    async def prometheus() -> Response:
        body = await run_in_threadpool(metrics.render)
        return Response(body, media_type=CONTENT_TYPE)

    if registry is not None:
        multi.install_routes(app, state, registry)
    else:
        assert pool is not None
        _install_model_routes(app, state, pool)


def _install_model_routes(app: FastAPI, state: ServerState, pool: ModelPool) -> None:
    """``/v1/models`` of a one-model daemon: the served model."""
    model_name = state.model_name

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        snapshot = await pool.astats()
        return {
            "object": "list",
            "data": [_model_card(state, snapshot.max_model_len, snapshot.task)],
        }

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != model_name:
            raise ApiError(
                404,
                f"model {model_id!r} is not served here (serving {model_name!r})",
                type="not_found_error",
                code="model_not_found",
                param="model",
            )
        snapshot = await pool.astats()
        return _model_card(state, snapshot.max_model_len, snapshot.task)


async def _registry_ready(state: ServerState, registry: ModelRegistry, *, listed: bool) -> Response:
    """Ready: not draining, the registry alive, and every preload model loaded (any other
    model loads on its first request). The models and their states only when ``listed``
    (a caller with a key): an unauthenticated probe learns ready or not, and why in
    general terms, not which models the operator serves."""
    stats = await run_in_threadpool(registry.stats, with_pools=False)
    waiting_for = [
        name
        for name, model in stats.models.items()
        if registry.spec(name).preload and model.state != "loaded"
    ]
    ready = not state.draining and registry.health().alive and not waiting_for
    body: dict[str, Any] = {"status": "ready" if ready else "not ready", "draining": state.draining}
    if waiting_for:
        body["reason"] = f"{len(waiting_for)} preloaded model(s) not loaded yet"
    if listed:
        body["models"] = {name: model.state for name, model in stats.models.items()}
    headers = {} if ready else {"Retry-After": str(RETRY_AFTER_UNAVAILABLE)}
    return JSONResponse(body, status_code=200 if ready else 503, headers=headers)


def observe_pools(
    served: ModelPool | ModelRegistry,
    model_name: str,
    metrics: PoolMetrics,
    server_config: ServerConfig,
) -> Callable[[], dict[str, int]] | None:
    """The ``vllm:`` series and the traces of the pool, or of each pool a registry loads
    (its name the ``model_name`` label): one exporter, its thread the daemon's, whatever
    the number of loads. Returns the exporter's ``snapshot`` (None: no tracing)."""
    tracer: Callable[[str, ModelPool], None] | None = None
    tracing: Callable[[], dict[str, int]] | None = None
    endpoint = server_config.otlp_traces_endpoint
    if endpoint is not None:
        try:
            from modelpool.supervisor.tracing import PoolTracer, TraceExporter
        except ImportError as exc:
            raise RuntimeError(
                "[server] otlp_traces_endpoint needs OpenTelemetry: pip install "
                f"'modelpool[tracing]' ({exc})"
            ) from exc
        logger.info("tracing requests to %s", endpoint)
        exporter = TraceExporter(endpoint)
        tracing = exporter.snapshot
        metrics.add_tracing(tracing)

        def tracer(name: str, pool: ModelPool) -> None:
            ratio = server_config.otlp_traces_sample_ratio
            PoolTracer(pool, exporter, model_name=name, sample_ratio=ratio)

    def observe(name: str, pool: ModelPool) -> None:
        if metrics.vllm is not None:
            pool.add_observer(on_request=metrics.vllm.observer(name))
        if tracer is not None:
            tracer(name, pool)

    if isinstance(served, ModelRegistry):
        served.add_pool_hook(observe)
    else:
        observe(model_name, served)
    return tracing


def _model_card(state: ServerState, max_model_len: int | None, task: str) -> dict[str, Any]:
    # max_model_len as vLLM reports it, so that clients can size their requests; task:
    # what the model serves ("generate", "embed", "score").
    return {
        "id": state.model_name,
        "object": "model",
        "created": state.started,
        "owned_by": "modelpool",
        "max_model_len": max_model_len,
        "task": task,
    }
