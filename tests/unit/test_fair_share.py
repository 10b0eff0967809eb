"""fair_share.FairShare in one event loop: round robin between clients, places held back,
bounds, and nothing leaked by a run cancelled while it waits (issue 25)."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable

import pytest

from modelpool.scheduling import queueing
from modelpool.server.fair_share import FairShare
from modelpool.server.http import ApiError
from modelpool.shared.errors import DeadlineExceeded


def share(capacity: int = 1, **limits: int) -> FairShare:
    return FairShare(
        capacity=capacity,
        max_running=limits.get("max_running"),
        max_queued=limits.get("max_queued", 8),
        max_waiting=limits.get("max_waiting", 64),
    )


def test_clients_take_turns_and_a_cancelled_wait_leaks_nothing() -> None:
    async def scenario() -> tuple[list[str], dict[str, int]]:
        fair = share(capacity=1)
        order: list[str] = []
        release = {name: asyncio.Event() for name in ("a1", "b1", "c1", "a2", "a3")}

        async def run(client: str, name: str) -> None:
            ticket = fair.reserve(client, 1)
            try:
                async with ticket.slot(deadline_s=10):
                    order.append(name)
                    await release[name].wait()
            finally:
                ticket.close()

        tasks = {name: asyncio.ensure_future(run(name[0], name)) for name in release}
        await asyncio.sleep(0)  # a1 takes the place; b, c and a wait in that turn order
        release["a1"].set()
        # b goes away while it waits, and a1 gives its place back before b's task has
        # run again: the place goes to c, not to b's cancelled turn.
        tasks["b1"].cancel()
        for name in ("c1", "a2", "a3"):
            await asyncio.wait_for(_until(lambda expected=name: order[-1] == expected), 5)
            release[name].set()
        await asyncio.wait_for(asyncio.wait(tasks.values()), 5)
        return order, fair.snapshot()

    order, snapshot = asyncio.run(scenario())
    assert order == ["a1", "c1", "a2", "a3"]
    empty = {"in_pool": 0, "charged_preemptions": 0, "waiting": 0, "clients": 0, "checking": 0}
    assert snapshot == {"capacity": 1, **empty}


def test_a_share_fitted_to_its_started_pool_lets_in_what_the_pool_can_run() -> None:
    """A registry sizes a model's share before the load; a pooling model's pool then
    starts with a batch of pooling_batch_size, and the share follows it."""

    async def scenario() -> tuple[int, int]:
        fair = share(capacity=1)
        inside: list[str] = []
        done = asyncio.Event()

        async def run(client: str) -> None:
            ticket = fair.reserve(client, 1)
            try:
                async with ticket.slot(deadline_s=10):
                    inside.append(client)
                    await done.wait()
            finally:
                ticket.close()

        tasks = [asyncio.ensure_future(run(f"client{index}")) for index in range(3)]
        await asyncio.wait_for(_until(lambda: len(inside) == 1), 5)
        before = len(inside)
        fair.fit_to_pool(3)
        await asyncio.wait_for(_until(lambda: len(inside) == 3), 5)
        done.set()
        await asyncio.wait_for(asyncio.wait(tasks), 5)
        return before, len(inside)

    assert asyncio.run(scenario()) == (1, 3)


async def _until(condition: Callable[[], bool]) -> None:
    while not condition():
        await asyncio.sleep(0)


def test_a_place_is_held_back_for_another_active_client() -> None:
    async def scenario() -> bool:
        fair = share(capacity=2)
        ordinary = fair.reserve("ordinary", 1)
        async with ordinary.slot(deadline_s=1):
            pass  # "ordinary" is active: it sent a request a moment ago
        ordinary.close()
        burst = fair.reserve("burst", 2)
        async with burst.slot(deadline_s=1):
            with pytest.raises(DeadlineExceeded):
                async with burst.slot(deadline_s=0.05):
                    pass  # the second place stays free for "ordinary"
            burst.close()
            return True

    assert asyncio.run(scenario())


def test_past_its_share_a_client_is_refused_with_429() -> None:
    fair = share(capacity=2, max_running=1, max_queued=2)
    fair.reserve("a", 3)
    with pytest.raises(ApiError) as info:
        fair.reserve("a", 1)
    assert info.value.status == 429 and info.value.code == "client_limit"
    assert info.value.headers["Retry-After"] == "1"
    fair.reserve("b", 3)  # another client has its own share
    crowded = share(capacity=1, max_queued=100, max_waiting=4)
    crowded.reserve("a", 5)
    with pytest.raises(ApiError) as info:
        crowded.reserve("b", 1)
    assert info.value.code == "pool_overloaded"


def test_a_request_being_checked_counts_against_its_clients_share() -> None:
    fair = FairShare(capacity=2, max_running=1, max_queued=1, max_waiting=16)
    with fair.checking("a"):
        ticket = fair.reserve("a", 1)  # 1 checking + 1 reserved: the whole share
        with pytest.raises(ApiError) as refused, fair.checking("a"):
            pass
        assert refused.value.code == "client_limit"
        with pytest.raises(ApiError):
            fair.reserve("a", 1)
        with fair.checking("b"):  # another client's share is its own
            assert fair.snapshot()["checking"] == 2
        ticket.close()
    assert fair.snapshot()["checking"] == 0
    fair.reserve("a", 2).close()


def _admission_order(
    fair: FairShare, arrivals: list[tuple[str, str, int]], due: dict[str, float] | None = None
) -> list[str]:
    """Names in the order their runs went in: one place, held by a first run until every
    other (client, name, priority) waits; ``due``: the ``due_at`` of some, by name."""
    due_at = due or {}

    async def scenario() -> list[str]:
        order: list[str] = []
        gate = asyncio.Event()

        async def run(client: str, name: str, priority: int) -> None:
            ticket = fair.reserve(client, 1, priority=priority, due_at=due_at.get(name, math.inf))
            try:
                async with ticket.slot(deadline_s=10):
                    order.append(name)
                    if name == "first":
                        await gate.wait()
            finally:
                ticket.close()

        tasks = [asyncio.ensure_future(run("z", "first", 0))]
        await _until(lambda: order == ["first"])
        for arrival in arrivals:
            tasks.append(asyncio.ensure_future(run(*arrival)))
            await asyncio.sleep(0)
        gate.set()
        await asyncio.wait_for(asyncio.wait(tasks), 5)
        return order[1:]

    return asyncio.run(scenario())


def test_priority_comes_before_the_turn_and_fair_share_applies_within_one() -> None:
    arrivals = [("a", "a-low", 5), ("b", "b-low", 5), ("a", "a-high", 0), ("a", "a-high2", 0)]
    arrivals.append(("b", "b-high", 0))
    order = _admission_order(share(capacity=1), arrivals)
    # The high ones first, by turn (a, b, a); then the low ones, b's turn coming first
    # since a just went in.
    assert order == ["a-high", "b-high", "a-high2", "b-low", "a-low"]


def test_a_run_that_waited_aging_s_goes_ahead_of_any_priority() -> None:
    fair = FairShare(capacity=1, max_running=None, max_queued=8, max_waiting=64, aging_s=0.0)
    # With aging_s 0 every waiting run has aged: arrival (turn) order, whatever the priority.
    order = _admission_order(fair, [("a", "a-low", 9), ("b", "b-high", -9)])
    assert order == ["a-low", "b-high"]
    assert fair.waiting_ahead("c", 0) == 0


def test_a_run_admitted_by_its_predicted_wait_goes_ahead_once_it_is_due() -> None:
    """Admitted with a bound (ModelPool.promotion_at), a low run past its due time goes in
    before more urgent ones that came after it; one not yet due waits its priority."""
    arrivals = [("a", "a-due", 9), ("c", "c-later", 9), ("b", "b-high", 0), ("b", "b-high2", 0)]
    due = {"a-due": time.monotonic() - 1.0, "c-later": time.monotonic() + 3600.0}
    order = _admission_order(share(capacity=1), arrivals, due)
    assert order == ["a-due", "b-high", "b-high2", "c-later"]


def test_with_preempt_a_more_urgent_run_goes_into_a_full_pool_once_per_less_urgent_run() -> None:
    """The pool preempts for it (preempt_for_priority): one beyond capacity for each less
    urgent run in the pool, no more; an equally urgent run waits its turn."""

    async def scenario() -> tuple[list[str], int]:
        fair = FairShare(capacity=1, max_running=None, max_queued=8, max_waiting=64, preempt=True)
        order: list[str] = []
        gate = asyncio.Event()

        async def run(client: str, name: str, priority: int) -> None:
            ticket = fair.reserve(client, 1, priority=priority)
            try:
                async with ticket.slot(deadline_s=10):
                    order.append(name)
                    await gate.wait()
            finally:
                ticket.close()

        tasks = [asyncio.ensure_future(run("a", "low", 5))]
        await _until(lambda: order == ["low"])
        tasks.append(asyncio.ensure_future(run("b", "high", 0)))
        await _until(lambda: order == ["low", "high"])
        tasks.append(asyncio.ensure_future(run("c", "high2", 0)))
        tasks.append(asyncio.ensure_future(run("d", "low2", 5)))
        for _ in range(5):  # both had their chance to go in: they wait
            await asyncio.sleep(0)
        in_pool = fair.snapshot()["in_pool"]
        gate.set()
        await asyncio.wait_for(asyncio.wait(tasks), 5)
        return order, in_pool

    order, in_pool = asyncio.run(scenario())
    assert in_pool == 2, "the low run and the one urgent run it can give way to"
    assert order[:2] == ["low", "high"] and sorted(order[2:]) == ["high2", "low2"]


def test_with_preempt_a_client_may_preempt_its_own_background_run() -> None:
    async def scenario() -> list[str]:
        fair = FairShare(capacity=1, max_running=None, max_queued=8, max_waiting=64, preempt=True)
        order: list[str] = []
        gate = asyncio.Event()

        async def run(name: str, priority: int) -> None:
            ticket = fair.reserve("a", 1, priority=priority)
            try:
                async with ticket.slot(deadline_s=10):
                    order.append(name)
                    await gate.wait()
            finally:
                ticket.close()

        tasks = [asyncio.ensure_future(run("background", 5))]
        await _until(lambda: order == ["background"])
        tasks.append(asyncio.ensure_future(run("interactive", 0)))
        await _until(lambda: order == ["background", "interactive"])
        gate.set()
        await asyncio.wait_for(asyncio.wait(tasks), 5)
        return order

    assert asyncio.run(scenario()) == ["background", "interactive"]


def test_a_run_let_in_to_preempt_another_clients_is_charged_as_two() -> None:
    """Issue 58: b's urgent runs preempt a's; each is charged to b as itself and the run it
    displaced, so that b, whose share is the whole pool (2), preempts one at a time, and
    its second goes in only once its first has ended."""

    async def scenario() -> tuple[int, dict[str, int], list[str]]:
        fair = FairShare(capacity=2, max_running=None, max_queued=8, max_waiting=64, preempt=True)
        order: list[str] = []
        gates = {name: asyncio.Event() for name in ("low1", "low2", "urgent1", "urgent2")}

        async def run(client: str, name: str, priority: int) -> None:
            ticket = fair.reserve(client, 1, priority=priority)
            try:
                async with ticket.slot(deadline_s=10):
                    order.append(name)
                    await gates[name].wait()
            finally:
                ticket.close()

        tasks = [asyncio.ensure_future(run("a", name, 5)) for name in ("low1", "low2")]
        await _until(lambda: len(order) == 2)
        tasks += [asyncio.ensure_future(run("b", name, 0)) for name in ("urgent1", "urgent2")]
        await _until(lambda: "urgent1" in order)
        for _ in range(5):  # urgent2 had its chance to go in: it waits
            await asyncio.sleep(0)
        in_pool, snapshot = fair.snapshot()["in_pool"], fair.snapshot()
        gates["urgent1"].set()
        await _until(lambda: "urgent2" in order)
        for gate in gates.values():
            gate.set()
        await asyncio.wait_for(asyncio.wait(tasks), 5)
        return in_pool, snapshot, order

    in_pool, snapshot, order = asyncio.run(scenario())
    assert in_pool == 3, "a's two runs and one urgent run of b's, not two"
    assert snapshot["charged_preemptions"] == 1
    assert order == ["low1", "low2", "urgent1", "urgent2"]


def test_a_client_preempting_its_own_background_runs_is_not_charged() -> None:
    async def scenario() -> tuple[list[str], int]:
        fair = FairShare(capacity=2, max_running=None, max_queued=8, max_waiting=64, preempt=True)
        order: list[str] = []
        gate = asyncio.Event()

        async def run(name: str, priority: int) -> None:
            ticket = fair.reserve("a", 1, priority=priority)
            try:
                async with ticket.slot(deadline_s=10):
                    order.append(name)
                    await gate.wait()
            finally:
                ticket.close()

        tasks = [asyncio.ensure_future(run(name, 5)) for name in ("bg1", "bg2")]
        await _until(lambda: len(order) == 2)
        tasks += [asyncio.ensure_future(run(name, 0)) for name in ("fg1", "fg2")]
        await _until(lambda: len(order) == 4)
        charged = fair.snapshot()["charged_preemptions"]
        gate.set()
        await asyncio.wait_for(asyncio.wait(tasks), 5)
        return order, charged

    order, charged = asyncio.run(scenario())
    assert order == ["bg1", "bg2", "fg1", "fg2"] and charged == 0


def test_the_wait_ahead_counts_another_clients_backlog_once_per_round() -> None:
    """Issue 58: admission by predicted wait counts what round robin puts ahead of a new
    run: the client's own waiting runs, every more urgent one, and one of each other
    client's per turn of its own, not another client's whole backlog."""

    async def scenario() -> dict[str, int]:
        fair = share(capacity=1, max_queued=16)
        gate = asyncio.Event()

        async def run(client: str, priority: int) -> None:
            ticket = fair.reserve(client, 1, priority=priority)
            try:
                async with ticket.slot(deadline_s=10):
                    await gate.wait()
            finally:
                ticket.close()

        tasks = [asyncio.ensure_future(run("bob", 0)) for _ in range(7)]
        tasks.append(asyncio.ensure_future(run("carol", -1)))
        tasks.append(asyncio.ensure_future(run("dave", 0)))
        await _until(lambda: fair.snapshot()["waiting"] == 8)
        ahead = {
            # New, nothing running: carol's (more urgent), dave's (nothing running either,
            # first in turn), none of bob's (he has a run in the pool: a place is held
            # back for her).
            "alice": fair.waiting_ahead("alice", 0),
            "bob": fair.waiting_ahead("bob", 0),  # its own 6, carol's, and one of dave's
            "alice-low": fair.waiting_ahead("alice", 9),  # every one is more urgent
            "alice-urgent": fair.waiting_ahead("alice", -5),
        }
        gate.set()
        await asyncio.wait_for(asyncio.wait(tasks), 5)
        return ahead

    assert asyncio.run(scenario()) == {"alice": 2, "bob": 8, "alice-low": 8, "alice-urgent": 0}


def test_a_run_ages_from_its_requests_arrival_and_hands_that_to_the_pool() -> None:
    """One clock (issue 58): a run submitted to a pool in its slot ages there from when
    its request arrived in the fair share (``queueing.arrived_at``), not from when it
    reached the pool."""

    async def scenario() -> tuple[float, float, float, float]:
        fair = share(capacity=1)
        ticket = fair.reserve("a", 1)
        await asyncio.sleep(0.05)
        async with ticket.slot(deadline_s=10):
            inside = queueing.arrival(time.monotonic())
        ticket.close()
        return ticket.arrived_at, inside, queueing.arrival(123.0), time.monotonic()

    arrived, inside, outside, now = asyncio.run(scenario())
    assert inside == arrived and now - arrived >= 0.05
    assert outside == 123.0, "outside a slot a request arrives when it is submitted"


def test_a_client_holding_a_place_does_not_also_preempt_another_clients_run() -> None:
    """b holds one of two places; its urgent run would preempt a's run in the other and,
    charged as two, pass b's share (2): it waits for b's own run to end, so that b never
    holds the whole pool by preempting (the review: another tenant's p50 12x)."""

    async def scenario() -> tuple[int, list[str]]:
        fair = FairShare(capacity=2, max_running=None, max_queued=8, max_waiting=64, preempt=True)
        order: list[str] = []
        gates = {name: asyncio.Event() for name in ("b-first", "a-low", "b-urgent")}

        async def run(client: str, name: str, priority: int) -> None:
            ticket = fair.reserve(client, 1, priority=priority)
            try:
                async with ticket.slot(deadline_s=10):
                    order.append(name)
                    await gates[name].wait()
            finally:
                ticket.close()

        tasks = [asyncio.ensure_future(run("b", "b-first", 0))]
        await _until(lambda: order == ["b-first"])
        tasks.append(asyncio.ensure_future(run("a", "a-low", 5)))
        await _until(lambda: order == ["b-first", "a-low"])
        tasks.append(asyncio.ensure_future(run("b", "b-urgent", 0)))
        for _ in range(5):
            await asyncio.sleep(0)
        in_pool = fair.snapshot()["in_pool"]
        gates["b-first"].set()
        await _until(lambda: "b-urgent" in order)
        for gate in gates.values():
            gate.set()
        await asyncio.wait_for(asyncio.wait(tasks), 5)
        return in_pool, order

    in_pool, order = asyncio.run(scenario())
    assert in_pool == 2 and order == ["b-first", "a-low", "b-urgent"]
