"""The bodies and answers of the daemon's scoring routes: reranking in Cohere's and Jina's
shape and in TEI's, and vLLM's ``/score``; parsed and checked field by field (every
refusal names the field the client sent)::

    POST /v1/rerank, /rerank, /v2/rerank
        {"model": M, "query": "q", "documents": ["a", {"text": "b"}], "top_n": 3,
         "return_documents": true}
     -> {"id": ..., "model": M, "results": [{"index": 1, "relevance_score": 0.98,
         "document": {"text": "b"}}, ...], "meta": {...}, "usage": {"total_tokens": N}}
    POST /rerank (TEI's: "texts" in place of "documents")
        {"query": "q", "texts": ["a", "b"], "raw_scores": false, "return_text": false}
     -> [{"index": 1, "score": 0.98}, {"index": 0, "score": 0.01}]
    POST /score, /v1/score (vLLM's)
        {"model": M, "text_1": "q", "text_2": ["a", "b"]}
     -> {"object": "list", "data": [{"index": 0, "object": "score", "score": 0.01}, ...],
         "usage": {...}}

Results are sorted by score, highest first (ties in the order sent), and cut to
``top_n``; each keeps the ``index`` of its document. The scores are the pool's
(``ModelPool.ascore``): a cross-encoder's sigmoid of its logit (the logit itself when
``raw_scores`` is asked), an embedding model's cosine similarity.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from modelpool.server.core.fields import check_fields, opt_bool, opt_int, parse_priority
from modelpool.server.embeddings import MAX_INPUTS
from modelpool.server.http import invalid

RerankShape = Literal["cohere", "tei"]

# ``keep_alive`` (Ollama's) is the registry's, read where the request takes its model's
# pool (``server.models.serve``), as on the generation routes.
RERANK_FIELDS = frozenset(
    {
        "model",
        "query",
        "documents",
        "top_n",
        "return_documents",
        "max_tokens_per_doc",
        "priority",
        "keep_alive",
    }
)
TEI_RERANK_FIELDS = frozenset(
    {
        "model",
        "query",
        "texts",
        "raw_scores",
        "return_text",
        "truncate",
        "truncation_direction",
        "priority",
        "keep_alive",
    }
)
SCORE_FIELDS = frozenset({"model", "text_1", "text_2", "truncate", "priority", "keep_alive"})


@dataclass(frozen=True)
class RerankJob:
    """One query against documents, and how the answer is written (``shape``)."""

    query: str
    documents: tuple[str, ...]
    shape: RerankShape
    top_n: int | None = None
    return_documents: bool = False
    raw_scores: bool = False
    truncate: bool = False
    priority: int = 0  # vLLM's: lower runs first


@dataclass(frozen=True)
class ScoreJob:
    """vLLM's pairs: ``pairs[i]`` is ``(text_1, text_2)`` of the ``i``-th score."""

    pairs: tuple[tuple[str, str], ...]
    truncate: bool = False
    priority: int = 0

    def by_query(self) -> list[tuple[str, list[int]]]:
        """The pairs grouped by their ``text_1`` (one pool request each), in first-seen
        order: the query and the indices of its pairs."""
        groups: dict[str, list[int]] = {}
        for index, (query, _) in enumerate(self.pairs):
            groups.setdefault(query, []).append(index)
        return list(groups.items())


def parse_rerank(body: Mapping[str, Any], *, return_documents_default: bool) -> RerankJob:
    """Cohere's or Jina's body (``documents``), or TEI's (``texts``)."""
    if "texts" in body:
        return _parse_tei_rerank(body)
    check_fields(body, RERANK_FIELDS)
    if "documents" not in body:
        raise invalid("missing field 'documents'", param="documents", code="missing_field")
    documents = body["documents"]
    if not isinstance(documents, list) or not documents:
        raise invalid("documents must be a non-empty list", param="documents")
    _check_count(len(documents), "documents")
    texts = tuple(_document(item, index) for index, item in enumerate(documents))
    return_documents = opt_bool(body, "return_documents")
    # Cohere's: documents cut to this many tokens. Cut at the model's context instead,
    # which is what a model can read; a smaller number would change the scores silently.
    max_tokens = opt_int(body, "max_tokens_per_doc", 1)
    return RerankJob(
        query=_query(body),
        documents=texts,
        shape="cohere",
        top_n=opt_int(body, "top_n", 1),
        return_documents=return_documents_default if return_documents is None else return_documents,
        truncate=max_tokens is not None,
        priority=parse_priority(body) or 0,
    )


def _parse_tei_rerank(body: Mapping[str, Any]) -> RerankJob:
    check_fields(body, TEI_RERANK_FIELDS)
    texts = body["texts"]
    if not isinstance(texts, list) or not texts:
        raise invalid("texts must be a non-empty list of strings", param="texts")
    _check_count(len(texts), "texts")
    for index, text in enumerate(texts):
        if not isinstance(text, str) or not text:
            raise invalid(f"texts[{index}] must be a non-empty string", param="texts")
    if body.get("truncation_direction") not in (None, "right", "Right"):
        raise invalid(
            "truncation_direction: only 'right' (the end of a text is cut) is supported",
            param="truncation_direction",
            code="unsupported_value",
        )
    return RerankJob(
        query=_query(body),
        documents=tuple(texts),
        shape="tei",
        return_documents=bool(opt_bool(body, "return_text")),
        raw_scores=bool(opt_bool(body, "raw_scores")),
        truncate=bool(opt_bool(body, "truncate")),
        priority=parse_priority(body) or 0,
    )


def parse_score(body: Mapping[str, Any]) -> ScoreJob:
    """vLLM's ``text_1`` and ``text_2``, each a string or a list of strings: one against
    many, one list broadcast against the other when it has one item, else pairwise."""
    check_fields(body, SCORE_FIELDS)
    first = _score_texts(body, "text_1")
    second = _score_texts(body, "text_2")
    if len(first) == 1:
        first = first * len(second)
    elif len(second) == 1:
        second = second * len(first)
    if len(first) != len(second):
        raise invalid(
            f"text_1 has {len(first)} items and text_2 {len(second)}: send one of them as "
            "one string, or both lists of the same length",
            param="text_2",
        )
    _check_count(len(first), "text_2")
    return ScoreJob(
        tuple(zip(first, second, strict=True)),
        bool(opt_bool(body, "truncate")),
        parse_priority(body) or 0,
    )


def _score_texts(body: Mapping[str, Any], name: str) -> list[str]:
    if name not in body:
        raise invalid(f"missing field {name!r}", param=name, code="missing_field")
    value = body[name]
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items:
        raise invalid(f"{name} must be a string or a non-empty list of strings", param=name)
    for item in items:
        if not isinstance(item, str) or not item:
            raise invalid(f"{name} must hold non-empty strings, got {item!r}", param=name)
    return list(items)


def _query(body: Mapping[str, Any]) -> str:
    query = body.get("query")
    if "query" not in body:
        raise invalid("missing field 'query'", param="query", code="missing_field")
    if not isinstance(query, str) or not query:
        raise invalid("query must be a non-empty string", param="query")
    return query


def _document(item: object, index: int) -> str:
    text = item.get("text") if isinstance(item, dict) else item
    if not isinstance(text, str) or not text:
        raise invalid(
            f"documents[{index}] must be a non-empty string or an object with a non-empty 'text'",
            param="documents",
        )
    return text


def _check_count(count: int, param: str) -> None:
    if count > MAX_INPUTS:
        raise invalid(f"{param} has {count} items; at most {MAX_INPUTS} in one request", param)


def ranked(scores: Sequence[float], top_n: int | None = None) -> list[tuple[int, float]]:
    """``(index, score)`` highest score first, ties in the order sent, at most ``top_n``."""
    order = sorted(range(len(scores)), key=lambda index: -scores[index])
    return [(index, scores[index]) for index in order[:top_n]]


def rerank_body(
    job: RerankJob, scores: Sequence[float], prompt_tokens: int, model: str
) -> dict[str, Any] | list[dict[str, Any]]:
    """The answer in the shape the body was sent in."""
    if job.shape == "tei":
        return [
            {"index": index, "score": score}
            | ({"text": job.documents[index]} if job.return_documents else {})
            for index, score in ranked(scores)
        ]
    results = [
        {"index": index, "relevance_score": score}
        | ({"document": {"text": job.documents[index]}} if job.return_documents else {})
        for index, score in ranked(scores, job.top_n)
    ]
    return {
        "id": f"rerank-{uuid.uuid4().hex}",
        "model": model,
        "results": results,
        "meta": {"api_version": {"version": "2"}, "billed_units": {"search_units": 1}},
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }


def score_body(scores: Sequence[float], prompt_tokens: int, model: str) -> dict[str, Any]:
    """vLLM's ``/score`` answer: the scores in the order of the pairs."""
    return {
        "id": f"score-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": [
            {"index": index, "object": "score", "score": score}
            for index, score in enumerate(scores)
        ],
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }


def score_size(texts: Sequence[str]) -> int:
    """The budget's units of a scoring request: characters, as a prompt's are counted."""
    return sum(len(text) for text in texts)
