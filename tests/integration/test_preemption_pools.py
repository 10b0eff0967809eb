"""Preemption for priority, in real pools of testing workers (one-call and batched).

The docs, Priority and queue-time bounds: with every slot taken by less urgent requests, a
more urgent one preempts the least urgent running request (``preempt_for_priority``, on
by default); the preempted request is queued again, first of its priority, runs again
from its prompt, and its caller's stream reads as one answer, no token twice and none
lost. A request whose rerun might give other text (sampled, no seed) that has streamed
is never preempted.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from helpers import open_pool, slack, wait_until
from modelpool import ModelPool, PoolFuture

pytestmark = pytest.mark.slow  # each runs a few seconds of tokens

LONG = "tokens:30:0.1"  # 3 s of tokens "t0 " .. "t29 "
EXPECTED = "".join(f"t{i} " for i in range(30))


class Streamed:
    """A request's chunks as its caller got them, and when it finished."""

    def __init__(self) -> None:
        self.chunks: list[str] = []
        self.first_at: float | None = None
        self.done_at: float | None = None
        self.lock = threading.Lock()

    def on_chunk(self, text: str) -> None:
        with self.lock:
            if self.first_at is None:
                self.first_at = time.monotonic()
            self.chunks.append(text)

    def watch(self, future: PoolFuture) -> PoolFuture:
        future.add_done_callback(lambda f: setattr(self, "done_at", time.monotonic()))
        return future


def _submit_lows(pool: ModelPool, count: int, **params: Any) -> list[tuple[Streamed, PoolFuture]]:
    lows = []
    for _ in range(count):
        streamed = Streamed()
        future = pool.submit(LONG, priority=5, on_chunk=streamed.on_chunk, **params)
        lows.append((streamed, streamed.watch(future)))
    # Every slot is taken, and each has streamed some of its answer.
    wait_until(lambda: all(len(s.chunks) >= 2 for s, _ in lows) or None, slack(10))
    return lows


@pytest.mark.parametrize("batch", [1, 2], ids=["one-call", "batched"])
def test_an_urgent_request_preempts_a_full_pool_of_long_low_runs(batch: int) -> None:
    workers = 2 if batch == 1 else 1
    with open_pool(workers=workers, max_batch_size=batch, deadline_s=slack(30)) as pool:
        lows = _submit_lows(pool, 2)
        sent = time.monotonic()
        high = Streamed()
        urgent = high.watch(pool.submit("tokens:3:0.01", priority=0, on_chunk=high.on_chunk))
        assert urgent.result(timeout=slack(10)).text == "t0 t1 t2 "
        assert high.first_at is not None and high.done_at is not None
        # Without preemption it waits for a slot: the 2.8 s the lows still had to run.
        assert high.first_at - sent < min(slack(0.5), 2.0)
        assert all(s.done_at is None or s.done_at > high.done_at for s, _ in lows)
        for streamed, future in lows:
            result = future.result(timeout=slack(30))
            assert result.text == EXPECTED and result.finish_reason in ("stop", "length")
            assert "".join(streamed.chunks) == EXPECTED, "a token twice, or one lost"
        counters = pool.stats().counters
        assert counters["preemptions"] == 1
        assert counters["retries"] == 0 and counters["failed"] == 0
        preempted = [f.result() for _, f in lows if f.result().attempts == 2]
        assert len(preempted) == 1, "one low request ran twice: preempted, then again"


def test_without_preempt_for_priority_the_urgent_request_waits_for_a_slot() -> None:
    with open_pool(workers=1, deadline_s=slack(30), preempt_for_priority=False) as pool:
        ((low, low_future),) = _submit_lows(pool, 1)
        high = Streamed()
        urgent = high.watch(pool.submit("echo:urgent", priority=0, on_chunk=high.on_chunk))
        assert urgent.result(timeout=slack(10)).text == "urgent"
        assert low_future.done() and low.done_at is not None and high.done_at is not None
        assert low.done_at <= high.done_at
        assert low_future.result().attempts == 1
        assert pool.stats().counters["preemptions"] == 0


def test_a_sampled_request_that_streamed_is_not_preempted() -> None:
    """Its rerun could give other text than its caller saw: it runs to its end."""
    with open_pool(workers=1, deadline_s=slack(30)) as pool:
        ((low, low_future),) = _submit_lows(pool, 1, temperature=0.8)
        urgent = pool.submit("echo:urgent", priority=0)
        assert urgent.result(timeout=slack(10)).text == "urgent"
        assert low_future.result().attempts == 1 and "".join(low.chunks) == EXPECTED
        assert pool.stats().counters["preemptions"] == 0


def test_a_request_that_streamed_nothing_yet_is_preempted_even_if_sampled() -> None:
    with open_pool(workers=1, deadline_s=slack(30)) as pool:
        quiet = pool.submit(LONG, priority=5, temperature=0.8)  # no stream
        wait_until(lambda: pool.stats().running == 1 or None, slack(10))
        urgent = pool.submit("echo:urgent", priority=0)
        assert urgent.result(timeout=slack(10)).text == "urgent"
        assert not quiet.done(), "preempted and queued again, not run to its end first"
        assert quiet.result(timeout=slack(30)).text == EXPECTED
        assert quiet.result().attempts == 2
        assert pool.stats().counters["preemptions"] == 1
