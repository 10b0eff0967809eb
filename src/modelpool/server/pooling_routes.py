"""The daemon's routes for embedding and scoring models: ``POST /v1/embeddings`` (OpenAI's),
``/embed`` (TEI's), ``/v1/rerank``, ``/rerank`` and ``/v2/rerank`` (Cohere's and Jina's
shape, or TEI's when the body sends ``texts``), ``/score`` and ``/v1/score`` (vLLM's).

Each takes the tokenizer routes' walk (``state.on_a_worker``): its body parsed, checked
and costed against ``max_request_tokens`` (the inputs' size) in a check thread, its
model's pool (``state.pool_for``: the one pool, or the registry's ``[models.NAME]``),
then one pool request in the client's turn of fair share, within the request's
deadline; the API key, the body bound and the Host checks are the Gate's, as for every
route. A model that does not do what the route asks (a chat model asked for
embeddings, a cross-encoder asked for vectors) is a 400 ``wrong_task`` naming the model
and what it serves::

    install_pooling_routes(app, state, on_a_worker)      # in create_app

Bodies and answers are ``embeddings`` (vectors) and ``rerank`` (scores).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import Response

from modelpool.config import ServerConfig
from modelpool.embeddings import EmbeddingResult
from modelpool.errors import InvalidRequest
from modelpool.server.embeddings import (
    EmbedJob,
    embeddings_body,
    inputs_size,
    parse_embeddings,
    parse_tei_embed,
    tei_embed_body,
)
from modelpool.server.http import (
    ApiError,
    ClientGone,
    json_bytes,
    off_loop_if,
    run_unless_disconnected,
)
from modelpool.server.openai.request import check_size
from modelpool.server.rerank import (
    RerankJob,
    ScoreJob,
    parse_rerank,
    parse_score,
    rerank_body,
    score_body,
    score_size,
)

if TYPE_CHECKING:
    from modelpool.pool import ModelPool
    from modelpool.server.state import ServerState

T = TypeVar("T")
R = TypeVar("R")

# An answer of more values than this is written in a thread (see ``off_loop_if``).
ENCODE_OFF_LOOP_VALUES = 65_536

# What each of the pool's tasks serves, in a refusal's words.
TASK_SERVES = {
    "generate": "text generation (/v1/chat/completions, /v1/completions)",
    "embed": "embeddings (/v1/embeddings, /embed; /v1/rerank and /score by cosine similarity)",
    "score": "scores of a cross-encoder (/v1/rerank, /rerank, /score), not embeddings",
}
EMBEDS = frozenset({"embed"})
SCORES = frozenset({"embed", "score"})


class OnAWorker(Protocol):
    """``state.on_a_worker``: the tokenizer routes' walk, passed in by ``app.create_app``."""

    async def __call__(
        self,
        request: Request,
        state: ServerState,
        parse: Callable[[dict[str, Any], ServerConfig], T],
        call: Callable[[ModelPool, T, float], Awaitable[R]],
        *,
        priority_of: Callable[[T], int] | None = None,
    ) -> tuple[ModelPool, R]: ...


def install_pooling_routes(app: FastAPI, state: ServerState, on_a_worker: OnAWorker) -> None:
    """The embedding and scoring routes (see the module docstring)."""

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        return await serve_embeddings(
            request, state, on_a_worker, _parse_embeddings, _openai_answer
        )

    @app.post("/embed")
    async def tei_embed(request: Request) -> Response:
        return await serve_embeddings(request, state, on_a_worker, _parse_tei_embed, _tei_answer)

    async def rerank(request: Request, return_documents: bool) -> Response:
        def parse(body: dict[str, Any], config: ServerConfig) -> RerankJob:
            job = parse_rerank(body, return_documents_default=return_documents)
            check_size(
                score_size((job.query, *job.documents)),
                limit=config.max_request_tokens,
                param="texts" if job.shape == "tei" else "documents",
            )
            return job

        async def run(pool: ModelPool, job: RerankJob, left_s: float) -> Response:
            _check_task(pool, request, SCORES)
            done, result = await run_unless_disconnected(
                request.receive,
                _naming_fields(
                    pool.ascore(
                        job.query,
                        list(job.documents),
                        raw_scores=job.raw_scores,
                        truncate=job.truncate,
                        deadline_s=left_s,
                        priority=job.priority,
                    )
                ),
            )
            if not done or result is None:
                return ClientGone()
            body = rerank_body(job, result.scores, result.prompt_tokens, _model(request, state))
            return Response(json_bytes(body), media_type="application/json")

        _, response = await on_a_worker(request, state, parse, run, priority_of=_priority)
        return response

    # Jina's and vLLM's answers carry the documents unless asked not to; Cohere's v2 none.
    @app.post("/v1/rerank")
    async def rerank_v1(request: Request) -> Response:
        return await rerank(request, True)

    @app.post("/rerank")
    async def rerank_plain(request: Request) -> Response:
        return await rerank(request, True)

    @app.post("/v2/rerank")
    async def rerank_v2(request: Request) -> Response:
        return await rerank(request, False)

    async def score(request: Request) -> Response:
        async def run(pool: ModelPool, job: ScoreJob, left_s: float) -> Response:
            _check_task(pool, request, SCORES)
            done, scored = await run_unless_disconnected(
                request.receive, _naming_fields(_score_pairs(pool, job, left_s))
            )
            if not done or scored is None:
                return ClientGone()
            scores, prompt_tokens = scored
            body = score_body(scores, prompt_tokens, _model(request, state))
            return Response(json_bytes(body), media_type="application/json")

        _, response = await on_a_worker(request, state, _parse_score, run, priority_of=_priority)
        return response

    @app.post("/score")
    async def score_plain(request: Request) -> Response:
        return await score(request)

    @app.post("/v1/score")
    async def score_v1(request: Request) -> Response:
        return await score(request)


# An embedding route's answer: (its job, the pool's vectors, the model's name) -> its body.
EmbedAnswer = Callable[[EmbedJob, EmbeddingResult, str], object]


def _openai_answer(job: EmbedJob, result: EmbeddingResult, model: str) -> object:
    return embeddings_body(job, result.vectors, result.prompt_tokens, model)


def _tei_answer(job: EmbedJob, result: EmbeddingResult, model: str) -> object:
    return tei_embed_body(job, result.vectors)


async def serve_embeddings(
    request: Request,
    state: ServerState,
    on_a_worker: OnAWorker,
    parse: Callable[[dict[str, Any], ServerConfig], EmbedJob],
    answer: EmbedAnswer,
) -> Response:
    """An embedding route's walk (``on_a_worker``), whatever shape its body and answer
    have (OpenAI's, TEI's, Ollama's)."""

    async def run(pool: ModelPool, job: EmbedJob, left_s: float) -> Response:
        _check_task(pool, request, EMBEDS)
        done, result = await run_unless_disconnected(
            request.receive,
            _naming_fields(
                pool.aembed(
                    job.pool_inputs(),
                    dimensions=job.dimensions,
                    truncate=job.truncate,
                    deadline_s=left_s,
                    priority=job.priority,
                )
            ),
        )
        if not done or result is None:
            return ClientGone()
        body = answer(job, result, _model(request, state))
        values = len(result.vectors) * result.dimensions
        content = await off_loop_if(
            values > ENCODE_OFF_LOOP_VALUES, state.heavy_work, json_bytes, body
        )
        return Response(content, media_type="application/json")

    _, response = await on_a_worker(request, state, parse, run, priority_of=_priority)
    return response


def _priority(job: EmbedJob | RerankJob | ScoreJob) -> int:
    return job.priority


async def _score_pairs(pool: ModelPool, job: ScoreJob, left_s: float) -> tuple[list[float], int]:
    """Each ``text_1``'s pairs in one pool request, one after another within the one
    deadline; the scores in the pairs' order."""
    scores = [0.0] * len(job.pairs)
    prompt_tokens = 0
    ends = time.monotonic() + left_s
    for query, indices in job.by_query():
        documents = [job.pairs[index][1] for index in indices]
        remaining = max(0.001, ends - time.monotonic())
        result = await pool.ascore(
            query, documents, truncate=job.truncate, deadline_s=remaining, priority=job.priority
        )
        prompt_tokens += result.prompt_tokens
        for index, value in zip(indices, result.scores, strict=True):
            scores[index] = value
    return scores, prompt_tokens


# The fields the pool's own refusals (InvalidRequest) of these requests may name.
POOL_FIELDS = ("dimensions", "input", "query", "documents")


async def _naming_fields(work: Awaitable[T]) -> T:
    """``work``, its plain ``InvalidRequest`` a 400 naming the field its message opens
    with (the pool's refusals of these requests say the field first: "dimensions is 512,
    but ..."; the HTTP field names are the library's). Its typed subclasses
    (ContextLengthExceeded, WrongTask) keep their own answers."""
    try:
        return await work
    except InvalidRequest as exc:
        if type(exc) is not InvalidRequest:
            raise
        field = exc.message.split(" ", 1)[0].split("[", 1)[0]
        raise ApiError(
            400,
            exc.message,
            param=field if field in POOL_FIELDS else None,
            code="invalid_value",
            extra={"request_id": exc.request_id},
        ) from None


def _parse_embeddings(body: dict[str, Any], config: ServerConfig) -> EmbedJob:
    job = parse_embeddings(body)
    check_size(inputs_size(job.inputs), limit=config.max_request_tokens, param="input")
    return job


def _parse_tei_embed(body: dict[str, Any], config: ServerConfig) -> EmbedJob:
    job = parse_tei_embed(body)
    check_size(inputs_size(job.inputs), limit=config.max_request_tokens, param="inputs")
    return job


def _parse_score(body: dict[str, Any], config: ServerConfig) -> ScoreJob:
    job = parse_score(body)
    texts = [text for pair in job.pairs for text in pair]
    check_size(score_size(texts), limit=config.max_request_tokens, param="text_2")
    return job


def _model(request: Request, state: ServerState) -> str:
    """The model an answer names: the registry's name for the one asked for (an alias
    answers with the model's own name, set by ``pool_for``), else the served one."""
    name = request.scope.get("state", {}).get("model")
    return name if isinstance(name, str) else state.model_name


def _check_task(pool: ModelPool, request: Request, serves: frozenset[str]) -> None:
    """400 ``wrong_task`` unless the pool's model does what the route asks."""
    task = pool.task
    if task in serves:
        return
    name = request.scope.get("state", {}).get("model") or pool.config.model
    wanted = "an embedding model" if serves == EMBEDS else "an embedding model or a cross-encoder"
    raise ApiError(
        400,
        f"model {name!r} serves {TASK_SERVES.get(task, task)}; {request.url.path} needs {wanted}",
        code="wrong_task",
        param="model",
    )
