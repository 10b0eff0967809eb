"""Priority in the dispatcher's queue (lower runs first, aging bounds starvation), the
queued-by-priority counts callers' threads read, and the wait predictor behind
``max_queue_time_s``; driven with the fake world of ``test_batch_dispatch``."""

from __future__ import annotations

import collections
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_batch_dispatch import World

from modelpool.scheduling.prediction import DUE_RUNS, WaitPredictor
from modelpool.scheduling.queueing import ahead_of, dispatch_order, promoted, urgent_share
from modelpool.scheduling.sizes import Work
from modelpool.supervisor.records import Request
from modelpool.supervisor.results import PoolFuture


def _queued_counts(world: World) -> dict[int, int]:
    return dict(collections.Counter(r.priority for r in world.d.queue.values()))


def test_a_higher_priority_request_takes_the_next_free_slot() -> None:
    world = World(workers=1, batch=1, preempt_for_priority=False)
    busy = world.submit("p0")
    low = [world.submit(f"low{index}", priority=5) for index in range(3)]
    high = world.submit("high", priority=-1)
    assert world.d.priorities.waiting == {5: 3, -1: 1}
    world.finish(busy)
    assert high.state == "running", "lower value, earlier turn, though it came last"
    assert all(request.state == "queued" for request in low)
    world.finish(high)
    assert [r.state for r in low] == ["running", "queued", "queued"], "FIFO within one"
    assert world.d.priorities.waiting == {5: 2}


def test_aging_promotes_a_request_that_waited_priority_aging_s() -> None:
    world = World(workers=1, batch=1, priority_aging_s=5.0)
    busy = world.submit("p0")
    old_low = world.submit("low", priority=10)
    world.clock.now += 5.0
    young_high = world.submit("high", priority=-10)
    world.finish(busy)
    assert old_low.state == "running", "it waited priority_aging_s: ahead of every younger one"
    assert young_high.state == "queued"


def test_a_request_ages_from_its_arrival_at_the_caller_not_twice() -> None:
    """One clock (issue 58): a request that waited 4 s in the daemon's fair share before it
    was submitted (``arrived_at``) is promoted after 1 s more in the pool, not after 5: it
    went ahead of the more urgent ones that came after it, and none preempts it."""
    world = World(workers=1, batch=1, priority_aging_s=5.0)
    busy = world.submit("p0", priority=-10)
    waited = world.submit("low", priority=10)
    waited.arrived_at = world.clock.now - 4.0
    fresh = world.submit("low2", priority=10)
    world.clock.now += 1.0
    high = world.submit("high", priority=-10)
    assert promoted(waited, now=world.clock.now, aging_s=5.0)
    assert not promoted(fresh, now=world.clock.now, aging_s=5.0)
    world.finish(busy)
    assert waited.state == "running" and high.state == "queued"


def test_a_request_admitted_by_its_predicted_wait_goes_ahead_once_due() -> None:
    """Its due time (ModelPool.promotion_at) comes before priority_aging_s: from then on
    it is ahead of younger, more urgent requests, and no more urgent one preempts it."""
    world = World(workers=1, batch=1, priority_aging_s=60.0)
    busy = world.submit("p0", priority=-10)  # as urgent as any: nothing preempts it
    bounded = world.submit("low", priority=10)
    bounded.due_at = world.clock.now + 2.0
    unbounded = world.submit("low2", priority=10)
    world.clock.now += 2.0
    high = world.submit("high", priority=-10)
    assert [
        r.request_id
        for r in dispatch_order(world.d.queue.values(), now=world.clock.now, aging_s=60.0)
    ] == [bounded.request_id, high.request_id, unbounded.request_id]
    world.finish(busy)
    assert bounded.state == "running", "due: ahead of the more urgent one that came later"
    assert high.state == "queued", "and it does not preempt it"
    assert promoted(bounded, now=world.clock.now, aging_s=60.0)
    assert not promoted(unbounded, now=world.clock.now, aging_s=60.0)


def test_the_promotion_lead_is_a_few_runs_and_a_first_token() -> None:
    predictor = WaitPredictor()
    for run_s in (1.0, 3.0, 1.0, 3.0):
        predictor.observe(run_s=run_s, ttft_s=0.5, prompt_tokens=10, completion_tokens=8)
    lead = predictor.promotion_lead_s()
    assert lead == pytest.approx(DUE_RUNS * (predictor.run_s + predictor.run_spread_s) + 0.5)
    assert lead > DUE_RUNS * predictor.run_s, "the spread counts: runs ahead may be long ones"


def test_a_retry_keeps_its_priority_and_goes_first_within_it() -> None:
    world = World(workers=1, spares=1, batch=1, preempt_for_priority=False)
    first = world.submit("p0", priority=1)
    same = world.submit("p1", priority=1)
    better = world.submit("p2", priority=0)
    world.die(world.worker_of(first))
    running = {r.request_id for r in (first, same, better) if r.state == "running"}
    assert better.request_id in running, "priority 0 goes before the priority-1 retry"
    assert _queued_counts(world) == world.d.priorities.waiting


def test_counts_follow_cancel_deadline_and_dispatch() -> None:
    world = World(workers=1, batch=1)
    busy = world.submit("p0")
    doomed = world.submit("a", priority=2)
    cancelled = world.submit("b", priority=2)
    world.clock.now += 30.0
    kept = world.submit("c", priority=3)
    assert world.d.priorities.waiting == {2: 2, 3: 1}
    world.d.cancel(cancelled.request_id, False)
    assert world.d.priorities.waiting == {2: 1, 3: 1}
    world.clock.now = doomed.deadline
    world.d.run_due_timers()
    world.d.after_event()
    assert doomed.state == "done" and busy.state != "queued"
    assert world.d.priorities.waiting == _queued_counts(world) == {3: 1}
    world.clock.now = kept.deadline
    world.d.run_due_timers()
    world.d.after_event()
    assert world.d.priorities.waiting == _queued_counts(world) == {}


def _request(number: int, priority: int, submitted_at: float) -> Request:
    return Request(
        request_id=f"r{number}",
        payload=b"",
        future=PoolFuture(f"r{number}", lambda _: None),
        submitted_at=submitted_at,
        deadline=submitted_at + 60.0,
        priority=priority,
    )


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(-3, 3), st.floats(0.0, 30.0)), min_size=1, max_size=30),
    st.floats(0.1, 20.0),
)
def test_dispatch_order_is_priority_then_arrival_with_aged_ones_first(
    entries: list[tuple[int, float]], aging_s: float
) -> None:
    now = 30.0
    # The queue is in arrival order (the dispatcher appends; only retries go first).
    entries = sorted(entries, key=lambda entry: entry[1])
    queue = [_request(n, p, at) for n, (p, at) in enumerate(entries)]
    order = dispatch_order(queue, now=now, aging_s=aging_s)
    assert sorted(r.request_id for r in order) == sorted(r.request_id for r in queue)
    position = {r.request_id: index for index, r in enumerate(queue)}
    for before, after in itertools.pairwise(order):
        aged_before = now - before.submitted_at >= aging_s
        aged_after = now - after.submitted_at >= aging_s
        assert aged_before or not aged_after, "an aged request is never behind a young one"
        if aged_before == aged_after and (aged_before or before.priority == after.priority):
            assert position[before.request_id] < position[after.request_id], "arrival order"
        elif not aged_before:
            assert before.priority <= after.priority


def test_the_predictor_needs_samples_then_counts_runs_of_unknown_size_at_the_mean() -> None:
    predictor = WaitPredictor()
    assert predictor.predict_ttft(ahead=Work(unsized=10), free=0, capacity=2) is None
    for _ in range(5):
        predictor.observe(run_s=1.0, ttft_s=0.25, prompt_tokens=100, completion_tokens=31)
    assert predictor.predict_ttft(ahead=Work(unsized=0), free=1, capacity=2) == pytest.approx(0.25)
    # Fourth in line, two slots, a run a second: two seconds, then its own first token.
    assert predictor.predict_ttft(ahead=Work(unsized=3), free=0, capacity=2) == pytest.approx(2.25)
    assert predictor.to_dict()["prefill_tokens_per_s"] == pytest.approx(400.0)
    assert predictor.to_dict()["decode_tokens_per_s"] == pytest.approx(40.0)
    assert ahead_of({-1: Work(unsized=2), 0: Work(unsized=3), 5: Work(unsized=7)}, 0).runs == 5
    # A fifth of the slots goes to more urgent requests: the line moves at 4/5 the speed.
    slowed = predictor.predict_ttft(ahead=Work(unsized=3), free=0, capacity=2, urgent_share=0.2)
    assert slowed == pytest.approx(2.0 / 0.8 + 0.25)
    assert urgent_share({0: 20, 10: 80}, 10) == pytest.approx(0.2)
    assert urgent_share({0: 20, 10: 80}, 0) == 0.0
    assert urgent_share({}, 3) == 0.0


def test_the_predictor_counts_runs_long_by_their_spread() -> None:
    """Runs of 0.5 s and 1.5 s average 1 s; a line of them is predicted at the mean plus
    the mean deviation (issue 38: an admitted request timed out behind long runs)."""
    steady, uneven = WaitPredictor(), WaitPredictor()
    for n in range(40):
        steady.observe(run_s=1.0, ttft_s=0.25, prompt_tokens=10, completion_tokens=5)
        uneven.observe(run_s=0.5 + n % 2, ttft_s=0.25, prompt_tokens=10, completion_tokens=5)
    assert steady.to_dict()["run_spread_s"] == 0.0
    assert uneven.run_s == pytest.approx(1.0, abs=0.1)
    assert 0.3 < uneven.run_spread_s < 0.6
    steady_s = steady.predict_ttft(ahead=Work(unsized=3), free=0, capacity=2)
    uneven_s = uneven.predict_ttft(ahead=Work(unsized=3), free=0, capacity=2)
    assert steady_s is not None and uneven_s is not None
    assert uneven_s - steady_s == pytest.approx(2 * uneven.run_spread_s, abs=0.2)


def test_the_predictor_counts_the_slot_time_lost_to_preempted_runs() -> None:
    predictor = WaitPredictor()
    for _ in range(5):
        predictor.observe(run_s=1.0, ttft_s=0.25, prompt_tokens=10, completion_tokens=5)
    for n in range(2000):  # one run in five is preempted
        predictor.dispatched(preempted=n % 5 == 4)
    assert predictor.preempted_share == pytest.approx(0.2, abs=0.05)
    share = predictor.preempted_share
    slowed = predictor.predict_ttft(ahead=Work(unsized=3), free=0, capacity=2, urgent_share=0.2)
    assert slowed == pytest.approx(2.0 / (1 - 0.2 - share) + 0.25)
    # Nothing more urgent: nothing preempts it, the line moves at full speed.
    assert predictor.predict_ttft(ahead=Work(unsized=3), free=0, capacity=2) == pytest.approx(2.25)


def test_the_dispatcher_counts_the_priorities_of_its_recent_dispatches() -> None:
    world = World(workers=1, batch=1)
    for priority in (0, 5, 5):
        world.finish(world.submit("p", priority=priority))
    assert world.d.priorities.dispatched == {0: 1, 5: 2}
