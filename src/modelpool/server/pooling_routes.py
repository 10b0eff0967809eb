"""The daemon's routes for embedding and scoring models: ``POST /v1/embeddings`` (OpenAI's),
``/embed`` (TEI's), ``/v1/rerank``, ``/rerank`` and ``/v2/rerank`` (Cohere's and Jina's
shape, or TEI's when the body sends ``texts``), ``/score`` and ``/v1/score`` (vLLM's).

Each takes the walk of ``micro_batches.in_turns``: its body parsed, checked and costed
against ``max_request_tokens`` (the inputs' size) in a check thread, its model
(``state.serve``: the one pool, or the registry's ``[models.NAME]``), the generation
routes' admission step (its predicted wait; the caller's ``traceparent``), then its items
in bounded micro-batches, one pool request each in the client's turn of fair share,
within the request's one deadline; the API key, the body bound and the Host checks are
the Gate's, as for every route. A model that does not do what the route asks (a chat
model asked for embeddings, a cross-encoder asked for vectors) is a 400 ``wrong_task``
naming the model and what it serves::

    install_pooling_routes(app, state)      # in create_app

Bodies and answers are ``embeddings`` (vectors) and ``rerank`` (scores).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from modelpool.server.core.cost import check_size
from modelpool.server.core.served import Served
from modelpool.server.embeddings import (
    EmbedJob,
    embeddings_body,
    inputs_size,
    parse_embeddings,
    parse_tei_embed,
    tei_embed_body,
)
from modelpool.server.http import ApiError, ClientGone, json_bytes, off_loop_if
from modelpool.server.micro_batches import Plan, Queue, in_turns, tokens_of
from modelpool.server.rerank import (
    RerankJob,
    ScoreJob,
    parse_rerank,
    parse_score,
    rerank_body,
    score_body,
    score_size,
)
from modelpool.shared.config import ServerConfig
from modelpool.shared.embeddings import EmbeddingResult, ScoreResult

if TYPE_CHECKING:
    from modelpool.server.state import ServerState
    from modelpool.supervisor.pool import ModelPool

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


def install_pooling_routes(app: FastAPI, state: ServerState) -> None:
    """The embedding and scoring routes (see the module docstring)."""

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        return await serve_embeddings(request, state, _parse_embeddings, _openai_answer)

    @app.post("/embed")
    async def tei_embed(request: Request) -> Response:
        return await serve_embeddings(request, state, _parse_tei_embed, _tei_answer)

    async def rerank(request: Request, return_documents: bool) -> Response:
        def parse(body: dict[str, Any], config: ServerConfig) -> RerankJob:
            job = parse_rerank(body, return_documents_default=return_documents)
            check_size(
                score_size((job.query, *job.documents)),
                limit=config.max_request_tokens,
                param="texts" if job.shape == "tei" else "documents",
            )
            return job

        def plan(job: RerankJob) -> Plan:
            # A cross-encoder reads the query with each document.
            query = tokens_of(job.query)
            return Plan.of([query + tokens_of(document) for document in job.documents])

        async def run(
            pool: ModelPool, job: RerankJob, piece: Sequence[int], left_s: float, queue: Queue
        ) -> ScoreResult:
            return await pool.ascore(
                job.query,
                [job.documents[index] for index in piece],
                raw_scores=job.raw_scores,
                truncate=job.truncate,
                deadline_s=left_s,
                priority=job.priority,
                **queue,
            )

        def check(served: Served) -> None:
            _check_task(served, request, SCORES)

        answer = await in_turns(request, state, parse, check, plan, run, priority_of=_priority)
        if answer is None:
            return ClientGone()
        served, job, results = answer
        scores = [score for _, result in results for score in result.scores]
        tokens = sum(result.prompt_tokens for _, result in results)
        body = rerank_body(job, scores, tokens, served.name)
        return Response(json_bytes(body), media_type="application/json")

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
        def check(served: Served) -> None:
            _check_task(served, request, SCORES)

        answer = await in_turns(
            request, state, _parse_score, check, _score_plan, _score_piece, priority_of=_priority
        )
        if answer is None:
            return ClientGone()
        served, job, results = answer
        scores = [0.0] * len(job.pairs)
        for piece, result in results:
            for index, value in zip(piece, result.scores, strict=True):
                scores[index] = value
        tokens = sum(result.prompt_tokens for _, result in results)
        body = score_body(scores, tokens, served.name)
        return Response(json_bytes(body), media_type="application/json")

    @app.post("/score")
    async def score_plain(request: Request) -> Response:
        return await score(request)

    @app.post("/v1/score")
    async def score_v1(request: Request) -> Response:
        return await score(request)


# An embedding route's answer: (its job, the pool's vectors, its model) -> its body.
EmbedAnswer = Callable[[EmbedJob, EmbeddingResult, Served], object]


def _openai_answer(job: EmbedJob, result: EmbeddingResult, served: Served) -> object:
    return embeddings_body(job, result.vectors, result.prompt_tokens, served.name)


def _tei_answer(job: EmbedJob, result: EmbeddingResult, served: Served) -> object:
    return tei_embed_body(job, result.vectors)


async def serve_embeddings(
    request: Request,
    state: ServerState,
    parse: Callable[[dict[str, Any], ServerConfig], EmbedJob],
    answer: EmbedAnswer,
) -> Response:
    """An embedding route's walk (``in_turns``: its inputs in micro-batches, each in the
    client's turn), whatever shape its body and answer have (OpenAI's, TEI's, Ollama's)."""

    def check(served: Served) -> None:
        _check_task(served, request, EMBEDS)

    def plan(job: EmbedJob) -> Plan:
        return Plan.of([tokens_of(item) for item in job.inputs])

    async def run(
        pool: ModelPool, job: EmbedJob, piece: Sequence[int], left_s: float, queue: Queue
    ) -> EmbeddingResult:
        return await pool.aembed(
            replace(job, inputs=tuple(job.inputs[index] for index in piece)).pool_inputs(),
            dimensions=job.dimensions,
            truncate=job.truncate,
            deadline_s=left_s,
            priority=job.priority,
            **queue,
        )

    walked = await in_turns(request, state, parse, check, plan, run, priority_of=_priority)
    if walked is None:
        return ClientGone()
    served, job, results = walked
    whole = EmbeddingResult(
        [vector for _, result in results for vector in result.vectors],
        sum(result.prompt_tokens for _, result in results),
        results[0][1].dimensions,
    )

    def encoded() -> bytes:
        # The answer's own work (Ollama's and TEI's normalise every vector) goes off the
        # loop with the encoding when the answer is large.
        return json_bytes(answer(job, whole, served))

    values = len(whole.vectors) * whole.dimensions
    content = await off_loop_if(values > ENCODE_OFF_LOOP_VALUES, state.heavy_work, encoded)
    return Response(content, media_type="application/json")


def _priority(job: EmbedJob | RerankJob | ScoreJob) -> int:
    return job.priority


def _score_plan(job: ScoreJob) -> Plan:
    """Each ``text_1``'s pairs (one pool request needs one query), in micro-batches."""
    plans = []
    for query, indices in job.by_query():
        own = Plan.of([tokens_of(query) + tokens_of(job.pairs[index][1]) for index in indices])
        pieces = [[indices[at] for at in piece] for piece in own.pieces]
        plans.append(Plan(pieces, own.tokens))
    return Plan.joined(plans)


async def _score_piece(
    pool: ModelPool, job: ScoreJob, piece: Sequence[int], left_s: float, queue: Queue
) -> ScoreResult:
    return await pool.ascore(
        job.pairs[piece[0]][0],
        [job.pairs[index][1] for index in piece],
        truncate=job.truncate,
        deadline_s=left_s,
        priority=job.priority,
        **queue,
    )


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


def _check_task(served: Served, request: Request, serves: frozenset[str]) -> None:
    """400 ``wrong_task`` unless the pool's model does what the route asks."""
    task = served.pool.task
    if task in serves:
        return
    # The served name, never the operator's path (``pool.config.model``).
    name = served.name
    wanted = "an embedding model" if serves == EMBEDS else "an embedding model or a cross-encoder"
    raise ApiError(
        400,
        f"model {name!r} serves {TASK_SERVES.get(task, task)}; {request.url.path} needs {wanted}",
        code="wrong_task",
        param="model",
    )
