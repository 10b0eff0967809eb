"""Embeddings and scores: what ``ModelPool.embed`` and ``ModelPool.score`` return, the
checks their inputs pass before dispatch, and the vector arithmetic every backend shares.

    result = pool.embed(["a first text", "a second"])        # EmbeddingResult
    result.vectors[0][:3], result.dimensions, result.prompt_tokens
    pool.embed("one text", dimensions=128)                   # Matryoshka: cut, renormalised
    pool.score("a query", ["doc one", "doc two"]).scores     # ScoreResult, one per document

Shared by both sides and free of heavy imports: the pool checks inputs with it on the
caller's thread, a worker's backend cuts and normalises vectors with it when it has no
tensors of its own (the testing backend, llama.cpp).
"""

from __future__ import annotations

import concurrent.futures
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from modelpool.shared.errors import InvalidRequest
from modelpool.shared.protocol import EmbedRequest, FinishReason, PooledAnswer, ScoreRequest
from modelpool.shared.validation import is_int

ScoreMethod = Literal["cross-encoder", "cosine"]


@dataclass(frozen=True)
class EmbeddingResult:
    """One vector per input, in input order; ``dimensions`` is each vector's length (the
    model's, or the ``dimensions`` asked for); ``prompt_tokens`` the tokens read, all inputs
    together (after truncation)."""

    vectors: list[list[float]]
    prompt_tokens: int
    dimensions: int


@dataclass(frozen=True)
class ScoreResult:
    """One relevance score per document, in document order (higher is more relevant).
    ``method``: "cross-encoder" (a sequence-classification model's score: the sigmoid of its
    logit unless raw scores were asked for) or "cosine" (an embedding model's cosine
    similarity of query and document)."""

    scores: list[float]
    prompt_tokens: int
    method: ScoreMethod


class Answered(Protocol):
    """What a finished pool request carries (a ``Result``)."""

    @property
    def finish_reason(self) -> FinishReason: ...

    @property
    def prompt_tokens(self) -> int | None: ...

    @property
    def pooled(self) -> PooledAnswer | None: ...


def embedding_result(answer: Answered) -> EmbeddingResult:
    """The caller's result of an embed request's answer (``CancelledError`` if it was
    cancelled: there are no vectors to give)."""
    vectors = _pooled(answer).vectors or []
    dimensions = len(vectors[0]) if vectors else 0
    return EmbeddingResult(vectors, answer.prompt_tokens or 0, dimensions)


def score_result(answer: Answered) -> ScoreResult:
    """The caller's result of a score request's answer."""
    pooled = _pooled(answer)
    method: ScoreMethod = "cross-encoder" if pooled.method == "cross-encoder" else "cosine"
    return ScoreResult(pooled.scores or [], answer.prompt_tokens or 0, method)


def _pooled(answer: Answered) -> PooledAnswer:
    if answer.finish_reason == "cancelled" or answer.pooled is None:
        raise concurrent.futures.CancelledError("the request was cancelled")
    return answer.pooled


def embed_request(inputs: object, dimensions: object, truncate: object) -> EmbedRequest:
    """The wire request for ``ModelPool.embed``'s arguments, or ``InvalidRequest`` naming the
    field: ``input`` is a string, a list of strings, a list of token ids (one input) or a
    list of lists of token ids, none of them empty; ``dimensions`` a positive integer."""
    if dimensions is not None and not is_int(dimensions, minimum=1):
        raise InvalidRequest(f"dimensions must be a positive integer, got {dimensions!r}")
    if not isinstance(truncate, bool):
        raise InvalidRequest(f"truncate must be true or false, got {truncate!r}")
    checked = dimensions if dimensions is None else int(dimensions)  # type: ignore[call-overload]
    return EmbedRequest(_inputs(inputs), truncate, checked)


def score_request(
    query: object, documents: object, raw_scores: object, truncate: object
) -> ScoreRequest:
    """The wire request for ``ModelPool.score``'s arguments, or ``InvalidRequest`` naming the
    field (``query``, ``documents``)."""
    if not isinstance(query, str) or not query:
        raise InvalidRequest(f"query must be a non-empty string, got {_shown(query)}")
    if isinstance(documents, (str, bytes)) or not isinstance(documents, Sequence):
        raise InvalidRequest(f"documents must be a list of strings, got {_shown(documents)}")
    if not documents:
        raise InvalidRequest("documents must not be empty")
    for index, document in enumerate(documents):
        if not isinstance(document, str) or not document:
            raise InvalidRequest(
                f"documents[{index}] must be a non-empty string, got {_shown(document)}"
            )
    for name, flag in (("raw_scores", raw_scores), ("truncate", truncate)):
        if not isinstance(flag, bool):
            raise InvalidRequest(f"{name} must be true or false, got {flag!r}")
    return ScoreRequest(query, tuple(documents), bool(raw_scores), bool(truncate))


def _inputs(inputs: object) -> tuple[str | tuple[int, ...], ...]:
    if isinstance(inputs, str):
        if not inputs:
            raise InvalidRequest("input must not be an empty string")
        return (inputs,)
    if isinstance(inputs, bytes) or not isinstance(inputs, Sequence):
        raise InvalidRequest(
            "input must be a string, a list of strings, a list of token ids or a list of "
            f"lists of token ids, got {_shown(inputs)}"
        )
    if not inputs:
        raise InvalidRequest("input must not be empty")
    if all(is_int(item, minimum=0) for item in inputs):
        return (tuple(int(item) for item in inputs),)
    checked: list[str | tuple[int, ...]] = []
    for index, item in enumerate(inputs):
        if isinstance(item, str):
            if not item:
                raise InvalidRequest(f"input[{index}] must not be an empty string")
            checked.append(item)
        elif isinstance(item, Sequence) and not isinstance(item, bytes):
            if not item:
                raise InvalidRequest(f"input[{index}] must not be an empty list of token ids")
            if not all(is_int(token, minimum=0) for token in item):
                raise InvalidRequest(f"input[{index}] must be a list of non-negative token ids")
            checked.append(tuple(int(token) for token in item))
        else:
            raise InvalidRequest(
                f"input[{index}] must be a string or a list of token ids, got {_shown(item)}"
            )
    return tuple(checked)


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_dimensions(dimensions: int | None, size: int) -> int:
    """The vector length a request gets from a model of ``size``; ``InvalidRequest`` naming
    ``dimensions`` when it asks for more than the model has."""
    if dimensions is None:
        return size
    if dimensions > size:
        raise InvalidRequest(
            f"dimensions is {dimensions}, but this model's embeddings have {size}: "
            f"ask for at most {size}"
        )
    return dimensions


def cut_and_normalise(vector: Sequence[float], dimensions: int) -> list[float]:
    """The first ``dimensions`` values of ``vector``, scaled to unit length (a zero vector
    stays zero)."""
    head = [float(value) for value in vector[:dimensions]]
    norm = math.sqrt(math.fsum(value * value for value in head))
    return head if norm == 0.0 else [value / norm for value in head]


def cosine(first: Sequence[float], second: Sequence[float]) -> float:
    """The cosine similarity of two vectors (0 when either is zero)."""
    dot = math.fsum(a * b for a, b in zip(first, second, strict=True))
    norms = math.sqrt(math.fsum(a * a for a in first) * math.fsum(b * b for b in second))
    return 0.0 if norms == 0.0 else dot / norms
