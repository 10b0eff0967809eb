"""fair_share.FairShare in one event loop: round robin between clients, places held back,
bounds, and nothing leaked by a run cancelled while it waits (issue 25)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from modelpool.errors import DeadlineExceeded
from modelpool.server.fair_share import FairShare
from modelpool.server.http import ApiError


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
    assert snapshot == {"capacity": 1, "in_pool": 0, "waiting": 0, "clients": 0, "checking": 0}


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
