"""The Ollama routes, wired onto the daemon's walks (``app.create_app`` passes them in: a
route module never imports ``app``)::

    install_ollama_routes(app, state, generate=_generate)

``/api/chat`` and ``/api/generate`` take the generation walk (``OllamaApi``), ``/api/embed``
and ``/api/embeddings`` the embedding routes' (``pooling_routes.serve_embeddings``), so
the key, the body bound, the check threads, the budget, the fair share, the deadline and
cancel-on-disconnect are theirs. ``/api/tags``, ``/api/ps``, ``/api/show`` and
``/api/version`` read the registry's stats (``ollama.models``); ``/`` answers 200, as
Ollama's heartbeat expects. ``/api/pull``, ``push``,
``create``, ``copy``, ``delete`` and ``blobs`` answer 501 with how modelpool gets its
models.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.concurrency import run_in_threadpool

from modelpool.server.core.cost import check_size
from modelpool.server.core.fields import parse_priority
from modelpool.server.core.served import Served
from modelpool.server.embeddings import EmbedJob, inputs_size, parse_inputs, unit
from modelpool.server.generation import Api
from modelpool.server.http import ApiError, invalid
from modelpool.server.models import KEEP_ALIVE
from modelpool.server.ollama import models as listing
from modelpool.server.ollama.answer import Clock
from modelpool.server.ollama.api import OllamaApi
from modelpool.server.pooling_routes import serve_embeddings
from modelpool.shared.config import ServerConfig
from modelpool.shared.embeddings import EmbeddingResult
from modelpool.shared.validation import is_int

if TYPE_CHECKING:
    from modelpool.server.state import ServerState

Generate = Callable[[Request, "ServerState", Api[Any]], Awaitable[Response]]

# ``priority`` is vLLM's, as on the other embedding routes (and where a tenant's bound
# writes the clamped value).
EMBED_FIELDS = frozenset(
    {"model", "input", "truncate", "options", "dimensions", "priority", KEEP_ALIVE}
)
LEGACY_EMBED_FIELDS = frozenset({"model", "prompt", "options", "priority", KEEP_ALIVE})
NO_MODEL_MANAGEMENT = (
    "modelpool does not pull, push, create, copy or delete models: it serves the models its "
    "configuration names (the top-level model, or a [models.NAME] table each: a local "
    "directory, a GGUF file or a Hugging Face id), each loaded on its first request and "
    "unloaded when idle; edit the configuration and restart the daemon"
)


def install_ollama_routes(app: FastAPI, state: ServerState, generate: Generate) -> None:
    """The ``/api/`` routes (see the module docstring)."""

    @app.post("/api/chat")
    async def chat(request: Request) -> Response:
        return await generate(
            request, state, OllamaApi("chat", state, Clock(time.monotonic_ns()), request)
        )

    @app.post("/api/generate")
    async def generate_route(request: Request) -> Response:
        api = OllamaApi("generate", state, Clock(time.monotonic_ns()), request)
        return await generate(request, state, api)

    @app.post("/api/embed")
    async def embed(request: Request) -> Response:
        started_ns = time.monotonic_ns()

        def answer(job: EmbedJob, result: EmbeddingResult, served: Served) -> object:
            return {
                "model": served.name,
                "embeddings": [unit(vector) for vector in result.vectors],
                "total_duration": time.monotonic_ns() - started_ns,
                "load_duration": Clock(started_ns, served.waited_s).load_ns(),
                "prompt_eval_count": result.prompt_tokens,
            }

        return await serve_embeddings(request, state, _parse_embed, answer)

    @app.post("/api/embeddings")
    async def legacy_embeddings(request: Request) -> Response:
        def answer(job: EmbedJob, result: EmbeddingResult, served: Served) -> object:
            return {"embedding": result.vectors[0]}

        return await serve_embeddings(request, state, _parse_legacy_embed, answer)

    @app.get("/api/tags")
    async def tags() -> Response:
        registry = state.registry
        if registry is None:
            assert state.pool is not None
            snapshot = await state.pool.astats()
            need = sum(int((w.rss_mb or 0) * 2**20) for w in snapshot.workers)
            one = listing.tag(
                state.model_name, state.pool.config, snapshot.backend, need, state.started
            )
            return JSONResponse({"models": [one]})
        stats = await run_in_threadpool(registry.stats, with_pools=False)
        return JSONResponse(
            {
                "models": [
                    listing.registry_tag(model, registry.spec(name).pool, state.started)
                    for name, model in stats.models.items()
                ]
            }
        )

    @app.get("/api/ps")
    async def ps() -> Response:
        now = datetime.datetime.now(datetime.UTC)
        registry = state.registry
        if registry is None:
            assert state.pool is not None
            snapshot = await state.pool.astats()
            one = listing.pool_running(state.model_name, state.pool.config, snapshot, now)
            return JSONResponse({"models": [one]})
        stats = await run_in_threadpool(registry.stats)
        loaded = [
            listing.registry_running(model, registry.spec(name).pool, now)
            for name, model in stats.models.items()
            if model.state == "loaded"
        ]
        return JSONResponse({"models": loaded})

    @app.post("/api/show")
    async def show(request: Request) -> Response:
        body = await state.read_json(request)
        name = _show_name(body)
        registry = state.registry
        if registry is None:
            assert state.pool is not None
            snapshot = await state.pool.astats()
            return JSONResponse(
                listing.show_body(
                    state.model_name,
                    state.pool.config,
                    snapshot.backend,
                    snapshot.task,
                    snapshot.max_model_len,
                    state.started,
                )
            )
        spec = registry.spec(name)
        model = await run_in_threadpool(registry.model_stats, spec.name, with_pool=True)
        pool = model.pool
        return JSONResponse(
            listing.show_body(
                spec.name,
                spec.pool,
                model.backend,
                None if pool is None else pool.task,
                None if pool is None else pool.max_model_len,
                state.started,
            )
        )

    @app.get("/api/version")
    async def version() -> Response:
        return JSONResponse(listing.version_body())

    @app.api_route("/", methods=["GET", "HEAD"])
    async def root() -> Response:
        # Ollama's CLI and some of its clients probe / for a 200 before anything else.
        return PlainTextResponse("modelpool is running (Ollama's API under /api/)")

    async def no_model_management(request: Request) -> Response:
        raise ApiError(501, NO_MODEL_MANAGEMENT, type="not_implemented", code="not_supported")

    for path, methods in (
        ("/api/pull", ["POST"]),
        ("/api/push", ["POST"]),
        ("/api/create", ["POST"]),
        ("/api/copy", ["POST"]),
        ("/api/delete", ["DELETE"]),
        ("/api/blobs/{digest}", ["HEAD", "POST"]),
    ):
        app.add_api_route(path, no_model_management, methods=methods)


def _show_name(body: Mapping[str, Any]) -> str:
    for key in body:
        if key not in ("model", "name", "verbose"):
            raise invalid(f"unsupported field {key!r}", param=key, code="unsupported_field")
    name = body.get("model", body.get("name"))
    if not isinstance(name, str) or not name:
        raise invalid("model is required", "model", "missing_field")
    return name


def _embed_fields(body: Mapping[str, Any], allowed: frozenset[str]) -> None:
    for name, value in body.items():
        if name not in allowed and value is not None:
            raise invalid(f"unsupported field {name!r}", param=name, code="unsupported_field")
    # An embedding has no sampling: Ollama's options do not change it.
    if body.get("options") is not None and not isinstance(body["options"], dict):
        raise invalid("options must be an object", "options")


def _parse_embed(body: dict[str, Any], config: ServerConfig) -> EmbedJob:
    """``/api/embed``: ``input`` a string or strings; ``truncate`` true unless it says
    false (Ollama's default); ``dimensions``."""
    _embed_fields(body, EMBED_FIELDS)
    if "input" not in body:
        raise invalid("input is required", "input", "missing_field")
    truncate = body.get("truncate")
    if truncate is not None and not isinstance(truncate, bool):
        raise invalid("truncate must be true or false", "truncate")
    dimensions = body.get("dimensions")
    if dimensions is not None and not is_int(dimensions, minimum=1):
        raise invalid("dimensions must be an integer >= 1", "dimensions")
    job = EmbedJob(
        parse_inputs(body["input"], "input"),
        dimensions,
        truncate is not False,
        priority=parse_priority(body) or 0,
    )
    check_size(inputs_size(job.inputs), limit=config.max_request_tokens, param="input")
    return job


def _parse_legacy_embed(body: dict[str, Any], config: ServerConfig) -> EmbedJob:
    """``/api/embeddings`` (Ollama's older route): one ``prompt``, truncated to fit."""
    _embed_fields(body, LEGACY_EMBED_FIELDS)
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise invalid("prompt must be a non-empty string", "prompt")
    check_size(len(prompt), limit=config.max_request_tokens, param="prompt")
    return EmbedJob((prompt,), truncate=True, priority=parse_priority(body) or 0)
