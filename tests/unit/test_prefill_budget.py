"""The "auto" prefill budget (backends/common/scheduler.PrefillBudget): the last slice of a
prompt read beside decoding rows leaves room for the join that follows it."""

from __future__ import annotations

from modelpool.worker.backends.common.scheduler import PrefillBudget


def steered_budget() -> PrefillBudget:
    budget = PrefillBudget("auto")
    for _ in range(8):
        budget.timed_decode(0.1)
    # A slice of 16 tokens (the first size beside rows) added 0.02 s: 1.25 ms a token.
    budget.steer(16, 0.02, beside_rows=True)
    return budget


def test_before_a_join_is_measured_it_counts_as_one_decoding_step() -> None:
    budget = steered_budget()
    # A 0.1 s step is 80 tokens of slice: of a 100-token budget, 20 are left for the last.
    assert budget.last_slice(100, 20, cells=2_000) == 20
    assert budget.last_slice(100, 60, cells=2_000) == 40  # leaves a last slice of 20
    assert budget.last_slice(100, 500, cells=2_000) == 100  # not the last: the whole budget


def test_a_measured_join_shrinks_the_last_slice_by_its_cost() -> None:
    budget = steered_budget()
    budget.joined(cells=1_000, seconds=0.025)  # 25 us a cell
    # 2,000 cells: a 0.05 s join, 40 tokens of slice: the last slice may be 60.
    assert budget.last_slice(100, 60, cells=2_000) == 60
    assert budget.last_slice(100, 90, cells=2_000) == 30  # 30 now, the last 60 next step
    # A cheap join takes nothing away.
    budget.joined(cells=1_000, seconds=0.0)
    assert budget.last_slice(100, 100, cells=2_000) == 100


def test_a_fixed_chunk_size_is_left_as_it_is() -> None:
    budget = PrefillBudget(64)
    budget.joined(cells=10, seconds=10.0)
    assert budget.last_slice(64, 50, cells=10_000) == 50
    assert budget.last_slice(64, 100, cells=10_000) == 64
