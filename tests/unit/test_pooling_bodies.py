"""The embedding and scoring routes' bodies and answers (server/embeddings.py, rerank.py):
what each accepts, the field each refusal names, and the shapes of the answers."""

from __future__ import annotations

import base64
import math
import struct
from typing import Any

import pytest

from modelpool.server.embeddings import (
    MAX_INPUTS,
    EmbedJob,
    base64_vector,
    embeddings_body,
    inputs_size,
    parse_embeddings,
    parse_tei_embed,
    tei_embed_body,
)
from modelpool.server.http import ApiError
from modelpool.server.rerank import (
    RerankJob,
    parse_rerank,
    parse_score,
    ranked,
    rerank_body,
    score_body,
)


def refused(parse: Any, body: dict[str, Any], **kwargs: Any) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parse(body, **kwargs)
    assert caught.value.status == 400
    return caught.value


@pytest.mark.parametrize(
    ("value", "inputs"),
    [
        ("hello", ("hello",)),
        (["a", "b"], ("a", "b")),
        ([1, 2, 3], ((1, 2, 3),)),
        ([[1, 2], [3]], ((1, 2), (3,))),
    ],
)
def test_every_input_form_of_openai(value: object, inputs: tuple[object, ...]) -> None:
    job = parse_embeddings({"model": "m", "input": value, "user": "u"})
    assert job.inputs == inputs
    assert job.encoding_format == "float"
    assert job.dimensions is None
    assert not job.truncate


@pytest.mark.parametrize(
    "value",
    ["", [], [""], ["a", ""], [[]], [[1], []], ["a", [1]], [1, "a"], [-1], [True], {"a": 1}, 7],
)
def test_empty_or_mixed_input_is_refused_naming_input(value: object) -> None:
    assert refused(parse_embeddings, {"input": value}).param == "input"


def test_missing_input_and_too_many() -> None:
    assert refused(parse_embeddings, {"model": "m"}).code == "missing_field"
    error = refused(parse_embeddings, {"input": ["x"] * (MAX_INPUTS + 1)})
    assert error.param == "input"
    assert str(MAX_INPUTS) in error.message


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("encoding_format", "binary"),
        ("dimensions", 0),
        ("dimensions", "8"),
        ("truncate", "yes"),
        ("unknown_field", 1),
    ],
)
def test_bad_fields_are_named(field: str, value: object) -> None:
    assert refused(parse_embeddings, {"input": "x", field: value}).param == field


def test_base64_and_dimensions_and_truncate() -> None:
    job = parse_embeddings(
        {"input": "x", "encoding_format": "base64", "dimensions": 8, "truncate": True}
    )
    assert (job.encoding_format, job.dimensions, job.truncate) == ("base64", 8, True)


def test_base64_is_little_endian_float32_as_openai_sends_it() -> None:
    vector = [0.5, -1.25, 3.0e-5, 1.0]
    raw = base64.b64decode(base64_vector(vector))
    assert len(raw) == 4 * len(vector)
    decoded = struct.unpack("<4f", raw)
    assert decoded == pytest.approx(vector, rel=1e-6)


def test_openai_answer_shape_in_both_encodings() -> None:
    vectors = [[1.0, 0.0], [0.0, 1.0]]
    plain = embeddings_body(EmbedJob(("a", "b")), vectors, 7, "emb")
    assert plain == {
        "object": "list",
        "data": [
            {"object": "embedding", "index": 0, "embedding": [1.0, 0.0]},
            {"object": "embedding", "index": 1, "embedding": [0.0, 1.0]},
        ],
        "model": "emb",
        "usage": {"prompt_tokens": 7, "total_tokens": 7},
    }
    encoded = embeddings_body(EmbedJob(("a", "b"), encoding_format="base64"), vectors, 7, "emb")
    second = encoded["data"][1]["embedding"]
    assert isinstance(second, str)
    assert struct.unpack("<2f", base64.b64decode(second)) == (0.0, 1.0)


def test_inputs_size_counts_characters_and_token_ids() -> None:
    assert inputs_size(("abc", (1, 2))) == 5


def test_tei_embed_normalises_unless_told_not_to() -> None:
    job = parse_tei_embed({"inputs": ["a", "b"]})
    assert job.normalize and job.inputs == ("a", "b")
    (vector,) = tei_embed_body(job, [[3.0, 4.0]])
    assert vector == pytest.approx([0.6, 0.8])
    raw = parse_tei_embed({"inputs": "a", "normalize": False})
    assert tei_embed_body(raw, [[3.0, 4.0]]) == [[3.0, 4.0]]
    assert refused(parse_tei_embed, {"inputs": ""}).param == "inputs"
    assert refused(parse_tei_embed, {"inputs": "a", "truncation_direction": "left"}).param == (
        "truncation_direction"
    )


def test_cohere_body_strings_and_objects() -> None:
    job = parse_rerank(
        {"model": "r", "query": "q", "documents": ["a", {"text": "b"}], "top_n": 1},
        return_documents_default=False,
    )
    assert job == RerankJob("q", ("a", "b"), "cohere", top_n=1)
    assert parse_rerank({"query": "q", "documents": ["a"]}, return_documents_default=True)
    with_max = parse_rerank(
        {"query": "q", "documents": ["a"], "max_tokens_per_doc": 512},
        return_documents_default=True,
    )
    assert with_max.truncate and with_max.return_documents


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"documents": ["a"]}, "query"),
        ({"query": "", "documents": ["a"]}, "query"),
        ({"query": "q"}, "documents"),
        ({"query": "q", "documents": []}, "documents"),
        ({"query": "q", "documents": [{"title": "x"}]}, "documents"),
        ({"query": "q", "documents": ["a"], "top_n": 0}, "top_n"),
        ({"query": "q", "documents": ["a"], "rank_fields": ["x"]}, "rank_fields"),
        ({"query": "q", "texts": []}, "texts"),
        ({"query": "q", "texts": ["a", 3]}, "texts"),
        ({"query": "q", "texts": ["a"], "top_n": 1}, "top_n"),
    ],
)
def test_rerank_refusals_name_the_field(body: dict[str, Any], param: str) -> None:
    assert refused(parse_rerank, body, return_documents_default=True).param == param


def test_rerank_answer_sorted_cut_with_indices() -> None:
    job = RerankJob("q", ("a", "b", "c"), "cohere", top_n=2, return_documents=True)
    body = rerank_body(job, [0.1, 0.9, 0.5], 12, "r")
    assert isinstance(body, dict)
    assert body["results"] == [
        {"index": 1, "relevance_score": 0.9, "document": {"text": "b"}},
        {"index": 2, "relevance_score": 0.5, "document": {"text": "c"}},
    ]
    assert body["model"] == "r"
    assert body["usage"]["total_tokens"] == 12
    bare = rerank_body(RerankJob("q", ("a", "b"), "cohere"), [0.2, 0.2], 3, "r")
    assert isinstance(bare, dict)
    # Ties keep the order sent; no top_n means every document.
    assert bare["results"] == [
        {"index": 0, "relevance_score": 0.2},
        {"index": 1, "relevance_score": 0.2},
    ]


def test_tei_rerank_body_and_answer() -> None:
    job = parse_rerank(
        {"query": "q", "texts": ["a", "b"], "raw_scores": True, "return_text": True},
        return_documents_default=False,
    )
    assert job.shape == "tei" and job.raw_scores and job.return_documents
    assert rerank_body(job, [-2.0, 3.5], 4, "r") == [
        {"index": 1, "score": 3.5, "text": "b"},
        {"index": 0, "score": -2.0, "text": "a"},
    ]


def test_ranked_orders_high_to_low() -> None:
    assert ranked([0.3, math.inf, -1.0, 0.3], 3) == [(1, math.inf), (0, 0.3), (3, 0.3)]


@pytest.mark.parametrize(
    ("text_1", "text_2", "pairs"),
    [
        ("q", "a", (("q", "a"),)),
        ("q", ["a", "b"], (("q", "a"), ("q", "b"))),
        (["q"], ["a", "b"], (("q", "a"), ("q", "b"))),
        (["q", "p"], "a", (("q", "a"), ("p", "a"))),
        (["q", "p"], ["a", "b"], (("q", "a"), ("p", "b"))),
    ],
)
def test_vllm_score_pairs(text_1: object, text_2: object, pairs: tuple[Any, ...]) -> None:
    job = parse_score({"model": "s", "text_1": text_1, "text_2": text_2})
    assert job.pairs == pairs


def test_vllm_score_groups_by_query_and_refuses_uneven_lists() -> None:
    job = parse_score({"text_1": ["q", "p", "q"], "text_2": ["a", "b", "c"]})
    assert job.by_query() == [("q", [0, 2]), ("p", [1])]
    assert refused(parse_score, {"text_1": ["q", "p"], "text_2": ["a", "b", "c"]}).param == (
        "text_2"
    )
    assert refused(parse_score, {"text_2": "a"}).param == "text_1"
    assert refused(parse_score, {"text_1": "q", "text_2": [""]}).param == "text_2"
    body = score_body([0.25, 0.75], 9, "s")
    assert body["data"] == [
        {"index": 0, "object": "score", "score": 0.25},
        {"index": 1, "object": "score", "score": 0.75},
    ]
    assert body["object"] == "list" and body["usage"]["prompt_tokens"] == 9


def test_pool_inputs_are_all_texts_or_all_token_ids() -> None:
    assert parse_embeddings({"input": ["a", "b"]}).pool_inputs() == ["a", "b"]
    assert parse_embeddings({"input": [[1], [2, 3]]}).pool_inputs() == [(1,), (2, 3)]


def test_priority_is_taken_by_every_pooling_body_and_checked() -> None:
    assert parse_embeddings({"input": "a", "priority": -3}).priority == -3
    assert parse_embeddings({"input": "a"}).priority == 0
    assert parse_tei_embed({"inputs": "a", "priority": 2}).priority == 2
    rerank = parse_rerank(
        {"query": "q", "documents": ["d"], "priority": 1}, return_documents_default=True
    )
    assert rerank.priority == 1
    assert (
        parse_rerank(
            {"query": "q", "texts": ["d"], "priority": 4}, return_documents_default=True
        ).priority
        == 4
    )
    assert parse_score({"text_1": "q", "text_2": ["d"], "priority": -1}).priority == -1
    for bad in ("high", 1.5, True, 2**31):
        assert refused(parse_embeddings, {"input": "a", "priority": bad}).param == "priority"
        assert (
            refused(parse_score, {"text_1": "q", "text_2": "d", "priority": bad}).param
            == "priority"
        )
