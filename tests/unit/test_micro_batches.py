"""How the daemon splits a pooling request (server.micro_batches): the micro-batches'
bounds, a request's cost in the fair share, and the size measured from the pool's time."""

from __future__ import annotations

from modelpool.server.micro_batches import (
    MAX_UNITS,
    MICRO_BATCH_ITEMS,
    MICRO_BATCH_S,
    MICRO_BATCH_UNITS,
    MIN_UNITS,
    Pace,
    Plan,
    spans,
)


def test_spans_keep_order_and_bounds() -> None:
    assert spans([3, 3, 3, 9, 1], units=6) == [range(0, 2), range(2, 3), range(3, 4), range(4, 5)]
    assert spans([1] * (MICRO_BATCH_ITEMS + 1), units=10**9) == [
        range(0, MICRO_BATCH_ITEMS),
        range(MICRO_BATCH_ITEMS, MICRO_BATCH_ITEMS + 1),
    ]
    assert spans([]) == []


def test_a_request_costs_a_run_per_micro_batch_units_not_per_piece() -> None:
    # Three queries of /score: three pieces, one run of cost.
    tiny = Plan.joined([Plan.of([5], MICRO_BATCH_UNITS) for _ in range(3)])
    assert (len(tiny.pieces), tiny.runs) == (3, 1)
    large = Plan.of([256] * 1024, 512)
    assert (len(large.pieces), large.runs) == (512, 1024 * 256 // MICRO_BATCH_UNITS)
    assert set(large.piece_units) == {512}


def test_the_size_follows_the_measured_time_within_bounds() -> None:
    pace = Pace()
    assert pace.units() == MICRO_BATCH_UNITS
    pace.note(1000, 2 * MICRO_BATCH_S)  # 1,000 units in twice the time wanted
    assert pace.units() == 500
    for _ in range(50):
        pace.note(1000, 0.0)  # instant work: the largest micro-batch
    assert pace.units() == MAX_UNITS
    for _ in range(50):
        pace.note(10, 60.0)  # a minute for ten units: the smallest
    assert pace.units() == MIN_UNITS
