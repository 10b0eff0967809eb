"""The worker's side of embed and score requests: which task a backend serves, and its
answer to an ``EmbedRequest`` or ``ScoreRequest``, checked into plain types.

A backend that embeds has a ``task`` attribute (``protocol.Task``) and the methods::

    handler.embed(request: EmbedRequest, call: Call) -> Generation   # pooled.vectors
    handler.score(request: ScoreRequest, call: Call) -> Generation   # pooled.scores

They read ``call.cancelled()`` between pieces of work (a micro-batch), so that a deadline
never has to kill a worker that computes honestly, and return ``Generation("",
"cancelled")`` when it is set. The worker answers these requests as it answers tokenize
(between two decoding steps in the batched loop), unless the backend batches them: a
``protocol.BatchedHandler`` with ``batches_pooling = True`` is admitted each one as a
call whose ``request`` attribute is the ``EmbedRequest`` or ``ScoreRequest``, and one
``step()`` answers every admitted request together (the requests of concurrent clients
packed into shared forward passes); its answers are checked by :func:`checked_answer`.
"""

from __future__ import annotations

import abc
import math
from typing import Any

from modelpool.shared.errors import InvalidRequest, WrongTask
from modelpool.shared.protocol import (
    TASKS,
    BatchCall,
    Call,
    EmbedRequest,
    Finished,
    Generation,
    PooledAnswer,
    PoolingRequest,
    ScoreRequest,
    Task,
)

_WHAT = {
    "generate": "generates text (a generation model)",
    "embed": "embeds text (an embedding model)",
    "score": "scores a query against documents (a cross-encoder)",
}


def handler_task(handler: object) -> Task:
    """What ``handler``'s model does: its ``task`` attribute, else "generate"."""
    task = getattr(handler, "task", "generate")
    if task not in TASKS:
        raise ValueError(f"the backend's task is {task!r}, not one of {', '.join(TASKS)}")
    return task


def wrong_task(task: Task, asked: str) -> WrongTask:
    """The typed refusal of asking a model that ``task``s to ``asked`` (embed, score,
    generate)."""
    return WrongTask(f"this model {_WHAT[task]}; it cannot {asked}", task=task)


def check_task(task: Task, request: object, generation: bool) -> None:
    """``WrongTask`` for a request a model that ``task``s cannot answer (``generation``: the
    request is a generation); the pool checks before dispatch, the worker refuses too."""
    if generation and task != "generate":
        raise wrong_task(task, "generate text")
    if isinstance(request, EmbedRequest) and task != "embed":
        raise wrong_task(task, "embed")
    if isinstance(request, ScoreRequest) and task == "generate":
        raise wrong_task(task, "score")


def batches_pooling(handler: object) -> bool:
    """Does ``handler`` admit embed and score requests into its batch (see above)?"""
    return getattr(handler, "batches_pooling", False) is True


def answer_pooling_request(handler: object, request: PoolingRequest, call: Call) -> Generation:
    """The backend's answer to ``request``, or ``WrongTask`` when its model does not do
    that (a generation model asked to embed, a cross-encoder asked to embed)."""
    task = handler_task(handler)
    if isinstance(request, EmbedRequest):
        method = getattr(handler, "embed", None) if task == "embed" else None
        if method is None:
            raise wrong_task(task, "embed")
        return checked_answer(request, method(request, call))
    if not isinstance(request, ScoreRequest):
        raise TypeError(f"not a pooling request: {type(request).__name__}")
    method = getattr(handler, "score", None) if task != "generate" else None
    if method is None:
        raise wrong_task(task, "score")
    return checked_answer(request, method(request, call))


def checked_answer(request: PoolingRequest, output: object) -> Generation:
    """A backend's answer to ``request`` as plain lists of floats, the only thing that
    crosses the pipe (a tensor would drag torch into the supervisor): one per input, all
    finite, else ``TypeError``/``ValueError``."""
    if isinstance(request, EmbedRequest):
        count, field = len(request.inputs), "vectors"
    else:
        count, field = len(request.documents), "scores"
    if not isinstance(output, Generation):
        raise TypeError(f"a pooling backend returned {type(output).__name__}, not Generation")
    if output.finish_reason == "cancelled":
        return Generation("", "cancelled", output.prompt_tokens, 0)
    pooled = output.pooled
    if pooled is None:
        raise TypeError(f"a pooling backend's Generation has no pooled {field}")
    prompt_tokens = None if output.prompt_tokens is None else int(output.prompt_tokens)
    if field == "vectors":
        vectors = [[float(value) for value in vector] for vector in pooled.vectors or []]
        if len(vectors) != count or any(not _finite(vector) for vector in vectors):
            raise ValueError(f"a pooling backend gave {len(vectors)} vectors for {count} inputs")
        return Generation("", "stop", prompt_tokens, 0, pooled=PooledAnswer(vectors=vectors))
    scores = [float(value) for value in pooled.scores or []]
    if len(scores) != count or not _finite(scores):
        raise ValueError(f"a pooling backend gave {len(scores)} scores for {count} documents")
    method = "cross-encoder" if pooled.method == "cross-encoder" else "cosine"
    answer = PooledAnswer(scores=scores, method=method)
    return Generation("", "stop", prompt_tokens, 0, pooled=answer)


def _finite(values: list[float]) -> bool:
    return all(math.isfinite(value) for value in values)


class PooledBatching(abc.ABC):
    """The batched surface (``admit``, ``step``, ``retire``, ``abort``) of a pooling
    handler that reads a request with ``_prepare(request, call)`` and answers a list of
    prepared requests together with ``_answers(pending)`` (the hf and llama.cpp ones)."""

    batches_pooling = True
    _pending: list[tuple[BatchCall, Any]]

    @abc.abstractmethod
    def _prepare(self, request: EmbedRequest | ScoreRequest, call: Call) -> Any:
        """The request's rows, read the handler's way (tokenized, checked)."""

    @abc.abstractmethod
    def _answers(self, pending: list[Any]) -> list[Generation]:
        """One answer per prepared request, from the handler's own forward passes."""

    def admit(self, call: BatchCall) -> None:
        request = getattr(call, "request", None)
        if not isinstance(request, (EmbedRequest, ScoreRequest)):
            raise InvalidRequest("a pooling model answers embed and score requests only")
        self._pending.append((call, self._prepare(request, call)))

    def step(self) -> list[Finished]:
        """Every admitted request's answer: all their inputs packed together."""
        pending, self._pending = self._pending, []
        answers = self._answers([entry for _, entry in pending])
        return [(call, answer) for (call, _), answer in zip(pending, answers, strict=True)]

    def retire(self, call: BatchCall) -> Generation:
        self._pending = [(own, entry) for own, entry in self._pending if own is not call]
        return Generation("", "cancelled", 0, 0)

    def abort(self) -> None:
        self._pending.clear()
