"""The HTTP daemon: OpenAI-compatible completions, health, stats and metrics.

``create_app(pool, server_config, model_name)`` builds a FastAPI app that talks
to a started :class:`~modelpool.ModelPool` only through its public API
(``agenerate``, ``astream``, ``stats``). ``modelpool serve`` (``modelpool.cli.daemon``)
runs it on uvicorn::

    app = create_app(pool, ServerConfig(), "smollm2-135m-instruct")
    app = create_app(registry, ServerConfig())     # many models: a started ModelRegistry
    uvicorn.run(app, host="127.0.0.1", port=8000)

Every route that runs a model gets it from ``state.serve(request, body)``, once: the one
pool, whatever ``model`` says, or the registry's model of that name (``models.py``), as a
``core.served.Served`` record the walk passes on (its share, its name, its wait).
The state the routes share (``ServerState``) and the walk of the small routes
(``on_a_worker``) are ``state.py``'s; the route modules import it, never this one.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true``
sends server-sent events ending with ``data: [DONE]``), ``POST /v1/responses`` (with
``GET``/``DELETE /v1/responses/{id}`` for stored ones), ``POST /v1/messages`` and
``POST /v1/messages/count_tokens`` (Anthropic's, errors in its shape), Ollama's
``/api/`` routes (``ollama.routes``); the operational routes, ``GET /v1/models``,
``GET /healthz``, ``GET /readyz``, ``GET /stats``, ``GET /metrics``, ``GET /ui`` (the
status page, ``server/ui``), are ``operations``'s, and the exception handlers
``error_handlers``'s. Every generating route takes the one walk of ``_generate``; its
API family (``generation.Api``) only parses the body into a job and writes the answer.

Request bodies are parsed and checked, field by field, in ``core.generation_body``
(every rejection names the OpenAI field the client sent; a field we cannot
honour is a 400, never ignored). A request becomes one pool request per choice
(``n``, a batch of prompts); each family builds its answer's shape (OpenAI's in
``openai.format``).

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
import os
import time
from collections.abc import (
    AsyncIterator,
    Callable,
    Coroutine,
)
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from modelpool.server import models as multi
from modelpool.server import rights
from modelpool.server.anthropic.api import MessagesApi, count_job, count_prompt, fit_max_tokens
from modelpool.server.checks import LARGE_BODY_BYTES, Checks
from modelpool.server.core.admission import admit
from modelpool.server.core.cost import check_budget, check_size, prompt_size
from modelpool.server.core.deadline import deadline_from
from modelpool.server.core.job import Job
from modelpool.server.error_handlers import install_error_handlers, note_attempts
from modelpool.server.errors import (
    shutting_down,
)
from modelpool.server.fair_share import FairShare
from modelpool.server.generation import Api, P, bind_tool_syntax, bound_by_deadline
from modelpool.server.guard import BrowserGuard, Gate, require_json
from modelpool.server.http import (
    ClientGone,
    json_bytes,
    off_loop_if,
    parse_json_object,
    read_body,
    run_unless_disconnected,
)
from modelpool.server.images import IMAGES_OMITTED_HEADER, fetch_images, settle_images
from modelpool.server.lora import lora_table
from modelpool.server.metrics import PoolMetrics
from modelpool.server.ollama.routes import install_ollama_routes
from modelpool.server.openai.api import ChatApi, CompletionsApi
from modelpool.server.operations import install_operational_routes, observe_pools
from modelpool.server.pooling_routes import install_pooling_routes
from modelpool.server.priority_bound import ClampedHeader, PriorityBound
from modelpool.server.reasoning import closed_header, split_result, splits, with_deadline
from modelpool.server.responses.api import ResponsesApi
from modelpool.server.responses.store import ResponseStore
from modelpool.server.state import ServerState, check_not_draining, client_of, on_a_worker
from modelpool.server.streaming import (
    ENCODE_OFF_LOOP_TOKENS,
    EventStream,
    StreamedChoice,
    answer_tokens,
    note_results,
)
from modelpool.server.tenants import Keys, partition
from modelpool.server.tokenize import (
    TokenizeJob,
    parse_detokenize,
    parse_tokenize,
    tokenize_body,
)
from modelpool.shared.config import PoolConfig, ServerConfig
from modelpool.shared.errors import (
    PoolError,
)
from modelpool.shared.protocol import Prompt
from modelpool.supervisor.registry import ModelRegistry
from modelpool.worker.backends.common.params import DEFAULT_MAX_NEW_TOKENS

if TYPE_CHECKING:
    from modelpool.supervisor.pool import ModelPool, Result
    from modelpool.supervisor.streams import AsyncPoolStream


# --------------------------------------------------------------------------------------------
# The app


def api_key_from_env(server_config: ServerConfig) -> str | None:
    """The bearer key, or None when no key is configured (an empty variable counts as none)."""
    if not server_config.api_key_env:
        return None
    return os.environ.get(server_config.api_key_env) or None


def create_app(
    served: ModelPool | ModelRegistry,
    server_config: ServerConfig,
    model_name: str = "",
    *,
    api_key: str | None = None,
) -> FastAPI:
    """The daemon's ASGI app for a started pool (serving ``model_name``) or a started
    :class:`ModelRegistry`. The key is ``api_key``, or else read from the variable
    ``server_config.api_key_env`` names."""
    registry: ModelRegistry | None = None
    pool: ModelPool | None = None
    if isinstance(served, ModelRegistry):
        registry = served
        configs = [spec.pool for spec in registry.config.models]
    else:
        pool = served
        configs = [pool.config]
    keys = Keys.configured(server_config.keys_file, api_key or api_key_from_env(server_config))
    fair_share = FairShare(
        capacity=sum(c.workers * c.max_batch_size for c in configs),
        max_running=server_config.client_max_running,
        max_queued=server_config.client_max_queued,
        max_waiting=sum(c.max_queue for c in configs),
        aging_s=min(c.priority_aging_s for c in configs),
        preempt=all(c.preempt_for_priority for c in configs),
    )
    shares = {
        spec.name: FairShare(
            capacity=spec.pool.workers * spec.pool.max_batch_size,
            max_running=server_config.client_max_running,
            max_queued=server_config.client_max_queued,
            max_waiting=spec.pool.max_queue,
            aging_s=spec.pool.priority_aging_s,
            preempt=spec.pool.preempt_for_priority,
        )
        for spec in (registry.config.models if registry is not None else ())
    }
    if registry is not None:
        metrics = PoolMetrics(registry_source=registry.stats, vllm=server_config.vllm_metrics)
        if metrics.vllm is not None:
            metrics.vllm.lora_info = lora_table(registry).in_flight
    else:
        assert pool is not None
        metrics = PoolMetrics(
            pool.stats,
            model=model_name,
            vllm=server_config.vllm_metrics,
            waiting=lambda: fair_share.snapshot()["waiting"],
        )
    tracing = observe_pools(served, model_name, metrics, server_config)
    state = ServerState(
        pool=pool,
        registry=registry,
        config=server_config,
        model_name=model_name,
        metrics=metrics,
        started=int(time.time()),
        fair_share=fair_share,
        shares=shares,
        keys=keys,
        checks=Checks(fair_share, max_waiting=sum(c.max_queue for c in configs)),
        responses=ResponsesApi(
            ResponseStore(
                max_entries=server_config.responses_store_entries,
                max_bytes=server_config.responses_store_bytes,
                ttl_s=server_config.responses_store_ttl_s,
            )
        ),
    )
    app = FastAPI(title="modelpool", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.modelpool = state
    # Inside the Gate: a model's lease is released once the answer is out.
    app.add_middleware(multi.ModelUse, metrics=metrics)
    app.add_middleware(ClampedHeader)
    app.add_middleware(
        Gate,
        keys=keys,
        max_body_bytes=server_config.max_body_bytes,
        guard=BrowserGuard(server_config),
    )

    install_error_handlers(app)
    install_operational_routes(app, state, tracing)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        async def run(pool: ModelPool, job: TokenizeJob, left_s: float) -> list[int]:
            return await pool.atokenize(
                job.prompt, add_generation_prompt=job.add_generation_prompt, deadline_s=left_s
            )

        pool, tokens = await on_a_worker(request, state, _parse_tokenize, run)
        snapshot = await pool.astats()
        body = tokenize_body(tokens, snapshot.max_model_len)
        content = await off_loop_if(
            len(tokens) > ENCODE_OFF_LOOP_TOKENS, state.heavy_work, json_bytes, body
        )
        return Response(content, media_type="application/json")

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        async def run(pool: ModelPool, tokens: list[int], left_s: float) -> str:
            return await pool.adetokenize(tokens, deadline_s=left_s) if tokens else ""

        _, text = await on_a_worker(request, state, _parse_detokenize, run)
        return JSONResponse({"prompt": text})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate(request, state, CompletionsApi())

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _generate(request, state, ChatApi())

    # Each tenant's stored responses are its own: another's id reads as unknown.
    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await _generate(request, state, state.responses.of(rights.owner(request)))

    @app.get("/v1/responses/{response_id}")
    async def stored_response(request: Request, response_id: str) -> Response:
        return JSONResponse(state.responses.of(rights.owner(request)).stored(response_id))

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(request: Request, response_id: str) -> Response:
        return JSONResponse(state.responses.of(rights.owner(request)).delete(response_id))

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await _generate(request, state, MessagesApi())

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        # The images settled as /v1/messages settles them: a text-only model counts the
        # note its generation would be given (or refuses them), a vision model its images.
        def parse(body: dict[str, Any], config: ServerConfig) -> Job:
            return _parse_count(body, config, state.pool_config_for(body))

        async def run(pool: ModelPool, job: Job, left_s: float) -> tuple[int, list[int]]:
            await fetch_images(job, state.config, pool.config.image_limits)
            return job.images_omitted, await pool.atokenize(count_prompt(job), deadline_s=left_s)

        _, (omitted, tokens) = await on_a_worker(request, state, parse, run)
        headers = {IMAGES_OMITTED_HEADER: str(omitted)} if omitted else {}
        return JSONResponse({"input_tokens": len(tokens)}, headers=headers)

    install_pooling_routes(app, state)
    install_ollama_routes(app, state, _generate)
    return app


def _parse_tokenize(body: dict[str, Any], config: ServerConfig) -> TokenizeJob:
    job = parse_tokenize(body)
    check_size(prompt_size(job.prompt), limit=config.max_request_tokens, param="prompt")
    return job


def _parse_count(body: dict[str, Any], config: ServerConfig, pool_config: PoolConfig) -> Job:
    job = count_job(body)
    settle_images(job, pool_config, config)
    check_size(prompt_size(count_prompt(job)), limit=config.max_request_tokens, param="messages")
    return job


def _parse_detokenize(body: dict[str, Any], config: ServerConfig) -> list[int]:
    tokens = parse_detokenize(body)
    check_size(len(tokens), limit=config.max_request_tokens, param="tokens")
    return tokens


async def _generate(request: Request, state: ServerState, api: Api[P]) -> Response:
    """The one walk of every generating route: ``api`` parses the body into a job and
    writes the answer (see ``generation``)."""
    check_not_draining(state)
    require_json(request.headers.get("content-type"))
    try:
        raw = await read_body(request, state.config.max_body_bytes)
    except ClientDisconnect:
        return ClientGone()
    client = client_of(request, state)
    # The wait for a check thread counts against the request's deadline, which only the
    # body says exactly: until it is parsed, the header's or the pool's.
    waiting_s = deadline_from(
        {}, request.headers, state.default_deadline_s(), state.config.max_request_timeout_s
    )
    budget = client.config(state.config).max_request_tokens
    body, parsed = await state.checks.run(
        client.name,
        client.limits,
        waiting_s,
        _parse,
        raw,
        api,
        budget,
        state.pool_config_for,
        state.config,
        large=len(raw) > LARGE_BODY_BYTES,
    )
    job = parsed.job
    await fetch_images(job, state.config, state.pool_config_for(body).image_limits)
    image_headers = {IMAGES_OMITTED_HEADER: str(job.images_omitted)} if job.images_omitted else {}
    taken = await api.take_pool(parsed, body, lambda: state.serve(request, body))
    if isinstance(taken, Response):
        return taken  # answered without a run (Ollama's load and unload)
    served = taken
    pool = served.pool
    deadline = served.time_left(
        deadline_from(
            body, request.headers, pool.config.deadline_s, state.config.max_request_timeout_s
        )
    )
    # One pool request per choice (n > 1, several prompts), all with the same deadline,
    # each let into the pool when this client's turn comes.
    bound = PriorityBound(client.tenant)
    bound.clamp_field(job.params)
    bound.note(request.scope)
    admission = admit(
        served,
        request.headers,
        client.name,
        job.params.get("priority", 0),
        job.params.pop("max_queue_time_s", None),
        deadline,
    )
    job.params.update(admission.queue)
    bound_by_deadline(job, pool, deadline, budget)
    with_deadline(job.params, pool.config.backend, time.time() + deadline)
    runs = job.choices()
    # Every run in its tenant's partition of the prefix cache, whatever the body said.
    cache_partition = partition(client.tenant, job.params.get("cache_salt"))
    for _, _, params in runs:
        params.pop("cache_salt", None)
        if cache_partition is not None:
            params["cache_salt"] = cache_partition
    ticket = served.share.reserve(
        client.name, len(runs), client.limits, admission.priority, admission.due_at
    )

    if job.stream:

        def note_error(exc: PoolError) -> None:
            note_attempts(request.scope, exc.request_id, exc.attempts)

        @contextlib.asynccontextmanager
        async def start(choice: StreamedChoice) -> AsyncIterator[AsyncPoolStream]:
            async with ticket.slot(deadline) as left_s:
                choice.source = pool.astream(choice.prompt, deadline_s=left_s, **choice.params)
                yield choice.source

        split = job.chat and splits(pool.config.reasoning_parser)
        choices = [StreamedChoice(index, p, params, None, split) for index, p, params in runs]
        return EventStream(
            choices,
            api.writer(parsed, choices, served.name),
            on_error=note_error,
            send_timeout_s=state.config.send_timeout_s,
            start=start,
            ticket=ticket,
            heavy_work=state.heavy_work,
            headers=image_headers,
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
    if job.chat and splits(pool.config.reasoning_parser):
        results = [split_result(result) for result in results]
    by_index = {index: result for (index, _, _), result in zip(runs, results, strict=True)}
    note_results(request.scope.setdefault("state", {}), results)
    content = await off_loop_if(
        answer_tokens(*results) > ENCODE_OFF_LOOP_TOKENS,
        state.heavy_work,
        api.answer,
        parsed,
        by_index,
        served.name,
    )
    return Response(
        content,
        media_type="application/json",
        headers={
            "X-Request-Id": results[0].request_id,
            **closed_header(by_index),
            **image_headers,
        },
    )


def _parse(
    raw: bytes,
    api: Api[P],
    budget: int,
    config_for: Callable[[dict[str, Any]], PoolConfig],
    server_config: ServerConfig,
) -> tuple[dict[str, Any], P]:
    """A generation's body, parsed by its API family, its images settled against its
    model (``images``), checked and costed against ``budget`` (``max_request_tokens``)
    with its model's ``max_new_tokens`` for a request that says none; in a check thread.
    ``keep_alive`` (Ollama's) is the registry's, not the API's."""
    body = parse_json_object(raw)
    keep_alive = multi.split_keep_alive(body)
    parsed = api.parse(body)
    multi.put_keep_alive(body, keep_alive)
    config = config_for(body)
    settle_images(parsed.job, config, server_config)
    fit_max_tokens(parsed, config)
    bind_tool_syntax(parsed.job, config, str(body.get("model") or config.model))
    # A request with no maximum is costed as before it got the context's room (128).
    default_max_tokens = config.generation_defaults.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    check_budget(parsed.job, limit=budget, default_max_tokens=default_max_tokens)
    return body, parsed


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
        # One error answers; the others (every run of a request times out at its one
        # deadline) are read here, or asyncio logs each as never retrieved, at ERROR.
        for task in tasks:
            if not task.cancelled():
                task.exception()
