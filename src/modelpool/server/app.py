"""The HTTP daemon: OpenAI-compatible completions, health, stats and metrics.

``create_app(pool, server_config, model_name)`` builds a FastAPI app that talks
to a started :class:`~modelpool.ModelPool` only through its public API
(``agenerate``, ``astream``, ``stats``). ``modelpool serve`` (``cli.py``) runs it
on uvicorn::

    app = create_app(pool, ServerConfig(), "smollm2-135m-instruct")
    uvicorn.run(app, host="127.0.0.1", port=8000)

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true``
sends server-sent events ending with ``data: [DONE]``), ``GET /v1/models``,
``GET /healthz``, ``GET /readyz``, ``GET /stats``, ``GET /metrics``, ``GET /ui`` (the
status page, ``server/ui``).

Request bodies are parsed and checked, field by field, in ``openai.request``
(every rejection names the OpenAI field the client sent; a field we cannot
honour is a 400, never ignored). A request becomes one pool request per choice
(``n``, a batch of prompts); the response shapes, logprobs included, are built
in ``openai.format``.

Status codes: 400 invalid (``context_length_exceeded`` when the prompt and
``max_tokens`` do not fit the model's context, which ``/v1/models`` reports as
``max_model_len``; ``request_too_expensive`` past ``max_request_tokens``), 401
missing/bad key, 403 Host or Origin not allowed (``guard``), 404/405 unknown
route or method, 413 body too large, 415 body not declared JSON, 429
``PoolOverloaded`` or a client past its share (``fair_share``), 503 ``PoolClosed`` /
``ModelLoadFailed`` / draining, 504 ``DeadlineExceeded``, 502 ``WorkerCrashed``
and ``CudaError``, 507 ``OutOfMemory`` (CUDA), 500 only for ``BackendError``
(the model code raised) or a bug here. Every error says ``x-should-retry``
(true only for 429 and 503, which also carry ``Retry-After``): the pool has
applied its own retry policy already.

A client that disconnects cancels its request in the worker: a task waits on
the ASGI ``receive`` channel for ``http.disconnect`` (no polling) and cancels
the generation, whose cancellation the pool forwards to the worker. A client that
stops reading a stream is treated the same after ``send_timeout_s``: the stream's
events wait in a bounded queue, and each is sent only once the socket took the last.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import signal
import socket
import time
from collections.abc import (
    AsyncIterator,
    Coroutine,
    Iterator,
)
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Scope

from modelpool.config import ServerConfig
from modelpool.errors import (
    PoolError,
)
from modelpool.protocol import Prompt
from modelpool.server.errors import RETRY_AFTER_UNAVAILABLE, pool_error_to_api, shutting_down
from modelpool.server.fair_share import FairShare
from modelpool.server.guard import BrowserGuard, Gate, require_json
from modelpool.server.http import (
    ApiError,
    ClientGone,
    json_bytes,
    off_loop_if,
    parse_json_object,
    read_body,
    run_unless_disconnected,
)
from modelpool.server.metrics import CONTENT_TYPE, PoolMetrics
from modelpool.server.openai.format import Job, response_body
from modelpool.server.openai.request import (
    check_budget,
    deadline_from,
    parse_chat,
    parse_completion,
)
from modelpool.server.openai.stream import (
    ENCODE_OFF_LOOP_TOKENS,
    EventStream,
    StreamedChoice,
    answer_tokens,
    note_results,
)
from modelpool.server.tokenize import parse_detokenize, parse_tokenize, tokenize_body
from modelpool.server.ui import add_ui_routes
from modelpool.validation import valid_traceparent

if TYPE_CHECKING:
    from modelpool.pool import AsyncPoolStream, ModelPool, Result

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Bodies larger than this are parsed and checked off the event loop.
PARSE_OFF_LOOP_BYTES = 65_536
READY_WORKER_STATES = frozenset({"idle", "busy", "spare"})


# --------------------------------------------------------------------------------------------
# The app


class LoopWatch:
    """How late this event loop runs a timer: the server's half of ``/healthz``.

    A task sleeps ``interval_s`` at a time and records how late it woke. A loop blocked
    by synchronous code shows either as that lateness or, while the block lasts, as a
    tick overdue, whichever the probe's handler sees first::

        watch = LoopWatch()
        watch.ensure_started()            # from a coroutine on the loop to watch
        watch.lag_s()                     # 0.0 on a loop that keeps up
    """

    def __init__(self, interval_s: float = 0.25) -> None:
        self.interval_s = interval_s
        self._task: asyncio.Task[None] | None = None
        self._last_tick: float | None = None
        self._last_lag = 0.0

    def ensure_started(self) -> None:
        if self._task is None or self._task.done():
            loop = asyncio.get_running_loop()
            self._last_tick = loop.time()
            self._task = loop.create_task(self._tick(), name="modelpool-loop-watch")

    async def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self.interval_s
            await asyncio.sleep(self.interval_s)
            now = loop.time()
            self._last_lag = max(0.0, now - due)
            self._last_tick = now

    def lag_s(self) -> float:
        """Seconds late: the latest tick's lateness, or how overdue the next one is."""
        if self._last_tick is None:
            return 0.0
        overdue = asyncio.get_running_loop().time() - self._last_tick - self.interval_s
        return round(max(self._last_lag, overdue, 0.0), 3)


@dataclass
class ServerState:
    """Mutable state shared by the routes and the CLI's signal handler."""

    pool: ModelPool
    config: ServerConfig
    model_name: str
    metrics: PoolMetrics
    started: int
    fair_share: FairShare
    # Parsing and building large bodies and answers, in a thread, one at a time.
    heavy_work: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(1))
    draining: bool = False
    loop_watch: LoopWatch = field(default_factory=LoopWatch)


def api_key_from_env(server_config: ServerConfig) -> str | None:
    """The bearer key, or None when no key is configured (an empty variable counts as none)."""
    if not server_config.api_key_env:
        return None
    return os.environ.get(server_config.api_key_env) or None


def create_app(
    pool: ModelPool,
    server_config: ServerConfig,
    model_name: str,
    *,
    api_key: str | None = None,
) -> FastAPI:
    """The daemon's ASGI app for a started ``pool``. The key is ``api_key``, or else read
    from the variable ``server_config.api_key_env`` names."""
    fair_share = FairShare(
        capacity=pool.config.workers * pool.config.max_batch_size,
        max_running=server_config.client_max_running,
        max_queued=server_config.client_max_queued,
        max_waiting=pool.config.max_queue,
        aging_s=pool.config.priority_aging_s,
    )
    metrics = PoolMetrics(
        pool.stats,
        vllm_model_name=model_name if server_config.vllm_metrics else None,
        waiting=lambda: fair_share.snapshot()["waiting"],
    )
    if metrics.vllm is not None:
        pool.add_observer(on_request=metrics.vllm.observe)
    if server_config.otlp_traces_endpoint is not None:
        _start_tracing(pool, server_config.otlp_traces_endpoint, model_name)
    state = ServerState(
        pool=pool,
        config=server_config,
        model_name=model_name,
        metrics=metrics,
        started=int(time.time()),
        fair_share=fair_share,
    )
    app = FastAPI(title="modelpool", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.modelpool = state
    app.add_middleware(
        Gate,
        api_key=api_key or api_key_from_env(server_config),
        max_body_bytes=server_config.max_body_bytes,
        metrics=metrics,
        guard=BrowserGuard(server_config),
    )

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, exc: ApiError) -> Response:
        return exc.response()

    @app.exception_handler(PoolError)
    async def on_pool_error(request: Request, exc: PoolError) -> Response:
        _note_attempts(request.scope, exc.request_id, exc.attempts)
        return pool_error_to_api(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 404:
            error = ApiError(
                404,
                f"no route {request.method} {request.url.path}",
                type="not_found_error",
                code="not_found",
            )
        elif exc.status_code == 405:
            error = ApiError(
                405,
                f"method {request.method} not allowed on {request.url.path}",
                code="method_not_allowed",
                headers=exc.headers,
            )
        else:
            error = ApiError(
                exc.status_code, str(exc.detail), code="http_error", headers=exc.headers
            )
        return error.response()

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> Response:
        # Starlette re-raises after sending this, so uvicorn logs the traceback once.
        return ApiError(
            500,
            f"internal server error: {type(exc).__name__}",
            type="server_error",
            code="internal_error",
        ).response()

    @app.get("/healthz")
    async def healthz() -> Response:
        # Liveness, not readiness: never waits on the dispatcher (a wedged one is what
        # this must report), and a pool that is starting or degraded is still alive.
        state.loop_watch.ensure_started()
        health = pool.health()
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
    async def readyz() -> Response:
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
    async def stats() -> Response:
        snapshot = await pool.astats()
        return JSONResponse({**snapshot.to_dict(), "fair_share": state.fair_share.snapshot()})

    add_ui_routes(app)

    @app.get("/metrics")
    async def prometheus() -> Response:
        body = await run_in_threadpool(metrics.render)
        return Response(body, media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        snapshot = await pool.astats()
        return {"object": "list", "data": [_model_card(state, snapshot.max_model_len)]}

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
        return _model_card(state, snapshot.max_model_len)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        body = await _read_json(request, state)
        job = parse_tokenize(body)
        deadline = deadline_from({}, request.headers, pool.config.deadline_s, None)
        tokens = await pool.atokenize(
            job.prompt, add_generation_prompt=job.add_generation_prompt, deadline_s=deadline
        )
        snapshot = await pool.astats()
        return JSONResponse(tokenize_body(tokens, snapshot.max_model_len))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        tokens = parse_detokenize(await _read_json(request, state))
        deadline = deadline_from({}, request.headers, pool.config.deadline_s, None)
        text = await pool.adetokenize(tokens, deadline_s=deadline) if tokens else ""
        return JSONResponse({"prompt": text})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate(request, state, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _generate(request, state, chat=True)

    return app


def _start_tracing(pool: ModelPool, endpoint: str, model_name: str) -> None:
    """Trace the pool's requests to ``endpoint`` (it flushes at exit)."""
    try:
        from modelpool.tracing import PoolTracer
    except ImportError as exc:
        raise RuntimeError(
            "[server] otlp_traces_endpoint needs OpenTelemetry: pip install 'modelpool[tracing]'"
            f" ({exc})"
        ) from exc
    PoolTracer(pool, endpoint, model_name=model_name)
    logger.info("tracing requests to %s", endpoint)


def _model_card(state: ServerState, max_model_len: int | None) -> dict[str, Any]:
    # max_model_len as vLLM reports it, so that clients can size their requests.
    return {
        "id": state.model_name,
        "object": "model",
        "created": state.started,
        "owned_by": "modelpool",
        "max_model_len": max_model_len,
    }


def _note_attempts(scope: Scope, request_id: str | None, attempts: list[Any]) -> None:
    note = scope.setdefault("state", {})
    note["request_id"] = request_id
    if attempts:
        note["attempts"] = len(attempts)
        note["worker_pid"] = attempts[-1].worker_pid


def _check_not_draining(state: ServerState) -> None:
    if state.draining:
        raise ApiError(
            503,
            "the server is shutting down",
            type="unavailable_error",
            code="draining",
            headers={"Retry-After": str(RETRY_AFTER_UNAVAILABLE), "Connection": "close"},
        )


async def _read_json(request: Request, state: ServerState) -> dict[str, Any]:
    """A small JSON body (the tokenizer routes'), parsed off the loop when large."""
    _check_not_draining(state)
    require_json(request.headers.get("content-type"))
    raw = await read_body(request, state.config.max_body_bytes)
    return await off_loop_if(
        len(raw) > PARSE_OFF_LOOP_BYTES, state.heavy_work, parse_json_object, raw
    )


async def _generate(request: Request, state: ServerState, *, chat: bool) -> Response:
    _check_not_draining(state)
    require_json(request.headers.get("content-type"))
    try:
        raw = await read_body(request, state.config.max_body_bytes)
    except ClientDisconnect:
        return ClientGone()
    body, job = await off_loop_if(
        len(raw) > PARSE_OFF_LOOP_BYTES, state.heavy_work, _parse, raw, chat
    )
    pool = state.pool
    check_budget(
        job,
        limit=state.config.max_request_tokens,
        default_max_tokens=pool.config.generation_defaults.get("max_new_tokens", 0),
    )
    deadline = deadline_from(
        body, request.headers, pool.config.deadline_s, state.config.max_request_timeout_s
    )
    priority = _admit(request, state, job, deadline)
    # One pool request per choice (n > 1, several prompts), all with the same deadline,
    # each let into the pool when this client's turn comes.
    runs = job.choices()
    client = request.client.host if request.client is not None else "-"
    ticket = state.fair_share.reserve(client, len(runs), priority)

    if job.stream:

        def note_error(exc: PoolError) -> None:
            _note_attempts(request.scope, exc.request_id, exc.attempts)

        @contextlib.asynccontextmanager
        async def start(choice: StreamedChoice) -> AsyncIterator[AsyncPoolStream]:
            async with ticket.slot(deadline) as left_s:
                choice.source = pool.astream(choice.prompt, deadline_s=left_s, **choice.params)
                yield choice.source

        return EventStream(
            [StreamedChoice(index, prompt, params) for index, prompt, params in runs],
            job,
            model=state.model_name,
            on_error=note_error,
            send_timeout_s=state.config.send_timeout_s,
            start=start,
            ticket=ticket,
            heavy_work=state.heavy_work,
        )

    async def run(prompt: Prompt, params: dict[str, Any]) -> Result:
        async with ticket.slot(deadline) as left_s:
            return await pool.agenerate(prompt, deadline_s=left_s, **params)

    try:
        finished, results = await run_unless_disconnected(
            request.receive, _all_or_none([run(prompt, params) for _, prompt, params in runs])
        )
    except asyncio.CancelledError:
        # Only the server cancels a handler: the drain timeout passed or a second signal
        # forced the exit. The pool requests are cancelled already; answering says why
        # (uvicorn would send a bare 500). Not re-raised, so that the answer goes out.
        raise shutting_down() from None
    finally:
        ticket.close()
    if not finished or results is None:
        return ClientGone()
    by_index = {index: result for (index, _, _), result in zip(runs, results, strict=True)}
    note_results(request.scope.setdefault("state", {}), results)
    content = await off_loop_if(
        answer_tokens(*results) > ENCODE_OFF_LOOP_TOKENS,
        state.heavy_work,
        _render,
        job,
        by_index,
        state.model_name,
    )
    return Response(
        content,
        media_type="application/json",
        headers={"X-Request-Id": results[0].request_id},
    )


def _admit(request: Request, state: ServerState, job: Job, deadline: float) -> int:
    """Admission by predicted wait (QueueFull, a 429, when it would wait too long), once,
    here: the runs wait in the fair share and then in the pool, so the prediction counts
    both, and the pool does not judge again a request the daemon accepted. The caller's
    ``traceparent`` goes with the runs. Returns the request's priority."""
    params = job.params
    priority: int = params.get("priority", 0)
    state.pool.check_admission(
        priority,
        params.get("max_queue_time_s"),
        deadline,
        also_waiting=state.fair_share.waiting_ahead(priority),
    )
    params["max_queue_time_s"] = math.inf
    traceparent = request.headers.get("traceparent")
    if traceparent is not None and valid_traceparent(traceparent):
        params["traceparent"] = traceparent
    return priority


def _parse(raw: bytes, chat: bool) -> tuple[dict[str, Any], Job]:
    body = parse_json_object(raw)
    return body, parse_chat(body) if chat else parse_completion(body)


def _render(job: Job, by_index: dict[int, Result], model: str) -> bytes:
    return json_bytes(response_body(job, by_index, model, int(time.time())))


async def _all_or_none(work: list[Coroutine[Any, Any, Result]]) -> list[Result]:
    """Every result in order, or the first error with the other requests cancelled
    (asyncio.gather would leave them running). Cancelling this cancels them all."""
    tasks = [asyncio.ensure_future(item) for item in work]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        return [task.result() for task in tasks]
    finally:
        pending = [task for task in tasks if not task.done()]
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)


# --------------------------------------------------------------------------------------------
# Running it


class DrainingServer(uvicorn.Server):
    """uvicorn's Server with the daemon's signal handling.

    uvicorn's own handler re-raises the captured signal after shutdown (so the
    process would die of SIGTERM instead of exiting 0) and escalates only on a
    second SIGINT. Here the first SIGTERM or SIGINT marks the app as draining and
    stops accepting; uvicorn then waits up to ``timeout_graceful_shutdown`` for the
    requests in flight. A second signal stops at once (``forced``): the requests in
    flight are cancelled and answer 503 ``shutting_down``, on every Python version.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.app_state = state
        self.signals = 0
        self.forced = False

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if sockets is not None:
            # The daemon binds its port before the pool loads and hands the socket over;
            # uvicorn then leaves out its "Uvicorn running on ..." line (it expects its
            # own process manager to have said it), which says the port now listens.
            self._log_started_message(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        for sig in self.SIGNALS:
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            yield
        finally:
            for sig in self.SIGNALS:
                loop.remove_signal_handler(sig)

    def _on_signal(self, sig: int) -> None:
        self.signals += 1
        name = signal.Signals(sig).name
        if self.signals == 1:
            logger.info(
                "%s: draining requests in flight (up to %.0f s), then stopping",
                name,
                self.config.timeout_graceful_shutdown or 0,
            )
            self.app_state.draining = True
            self.should_exit = True
        else:
            logger.warning("%s again: stopping now; requests in flight fail", name)
            self.forced = True
            self.force_exit = True
            # force_exit only ends uvicorn's waiting loops; it then awaits
            # asyncio.Server.wait_closed(), which since Python 3.12 waits for every open
            # connection (it returned at once before). So the requests in flight are
            # cancelled here, as uvicorn does when the drain timeout passes: each answers
            # 503 shutting_down and closes its connection, and the server exits.
            for task in self.server_state.tasks:
                task.cancel(msg=f"{name} again: stopping now")
