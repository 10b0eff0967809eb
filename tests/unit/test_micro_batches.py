"""How the daemon splits a pooling request (server.micro_batches): the micro-batches'
bounds, the tokens estimated without the model, and a request's cost in the fair share."""

from __future__ import annotations

from modelpool.server.micro_batches import (
    CHARS_PER_TOKEN,
    MICRO_BATCH_ITEMS,
    MICRO_BATCH_TOKENS,
    Plan,
    spans,
    tokens_of,
)


def test_spans_keep_order_and_bounds() -> None:
    assert spans([3, 3, 3, 9, 1], units=6) == [range(0, 2), range(2, 3), range(3, 4), range(4, 5)]
    assert spans([1] * (MICRO_BATCH_ITEMS + 1), units=10**9) == [
        range(0, MICRO_BATCH_ITEMS),
        range(MICRO_BATCH_ITEMS, MICRO_BATCH_ITEMS + 1),
    ]
    assert spans([]) == []


def test_tokens_are_ids_or_characters_over_a_ratio() -> None:
    assert tokens_of((7,) * 256) == 256
    assert tokens_of("x" * (10 * CHARS_PER_TOKEN + 1)) == 11
    assert tokens_of("a") == 1


def test_a_request_costs_a_run_per_micro_batch_tokens_not_per_piece() -> None:
    # Three queries of /score: three pieces, one run of cost.
    tiny = Plan.joined([Plan.of([5]) for _ in range(3)])
    assert (len(tiny.pieces), tiny.runs) == (3, 1)
    # The review's 1,024 inputs of 256 ids: 16 in a micro-batch, a run per 4,096 tokens.
    large = Plan.of([256] * 1024)
    per_piece = MICRO_BATCH_TOKENS // 256
    assert [len(piece) for piece in large.pieces] == [per_piece] * (1024 // per_piece)
    assert large.runs == 1024 * 256 // MICRO_BATCH_TOKENS
