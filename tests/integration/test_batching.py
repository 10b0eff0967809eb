"""Batching inside a worker (max_batch_size > 1) against real worker processes.

The testing backend batches: every admitted request gets one token per step, and each
fault happens inside the batch (see modelpool.worker.backends.testing). These tests hold the issue's
per-request guarantees: cancel and deadline take one request out and leave the batch and
the warm worker alone; a hang or crash kills the worker, the innocent requests are
retried as "collateral" and succeed, and the culprit fails typed as the suspect.
"""

from __future__ import annotations

import sys

import pytest

from helpers import (
    FAR_DEADLINE_S,
    LONG,
    UNCAPPED,
    BackendModule,
    assert_outlasts,
    counters,
    open_pool,
    slack,
    submit_with_chunks,
    wait_until,
    workers,
)
from modelpool import (
    BackendError,
    DeadlineExceeded,
    PoisonRequest,
    PoolConfig,
    WorkerCrashed,
)
from modelpool.server.metrics import PoolMetrics

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux processes")


def expected_text(count: int) -> str:
    return "".join(f"t{index} " for index in range(count))


def running_ids(pool_stats_workers: list[object]) -> list[str]:
    return [rid for w in pool_stats_workers for rid in w.running]  # type: ignore[attr-defined]


def wait_running(pool: object, count: int, timeout: float = 10.0) -> None:
    wait_until(
        lambda: len(running_ids(workers(pool))) >= count,  # type: ignore[arg-type]
        timeout,
        message=f"{count} requests running",
    )


def test_config_default_is_one_and_rejects_zero() -> None:
    assert PoolConfig(model="x").max_batch_size == 1
    with pytest.raises(ValueError, match="max_batch_size"):
        PoolConfig(model="x", max_batch_size=0)


def test_one_worker_runs_a_full_batch_and_stats_show_it() -> None:
    with open_pool(workers=1, max_batch_size=4) as pool:
        # All five still there when the stats are read (tokens:400:0.01 was 1.28 s: capped
        # by the 128-token default).
        assert_outlasts(pool.config, LONG, 10, **UNCAPPED)
        futures = [pool.submit(LONG, **UNCAPPED) for _ in range(5)]
        wait_running(pool, 4)
        snapshot = pool.stats()
        (worker,) = snapshot.workers
        assert worker.slots == 4
        assert sorted(worker.running) == sorted(f.request_id for f in futures[:4])
        assert snapshot.capacity == 4
        assert snapshot.running == 4
        assert snapshot.batch_occupancy == 1.0
        assert snapshot.queue_depth == 1, "the fifth waits: capacity is workers x batch"
        assert snapshot.to_dict()["workers"][0]["running"] == worker.running
        metrics = PoolMetrics(lambda: snapshot).render().decode()
        assert "modelpool_batch_occupancy 1.0" in metrics
        assert "modelpool_capacity 4.0" in metrics
        for future in futures:
            future.cancel()


def test_short_request_admitted_between_steps_finishes_first() -> None:
    with open_pool(workers=1, max_batch_size=4) as pool:
        long, started, _ = submit_with_chunks(pool, "tokens:120:0.02")
        assert started.wait(10)
        short = pool.submit("tokens:5:0.01")
        result = short.result(timeout=10)
        assert result.text == expected_text(5)
        assert not long.done(), "the short request waited for the long one"
        assert long.result(timeout=30).text == expected_text(120)
        assert counters(pool)["kills"] == 0


def test_cancel_in_a_full_batch_stops_it_and_the_others_go_on_unchanged() -> None:
    with open_pool(workers=1, max_batch_size=4, deadline_s=FAR_DEADLINE_S) as pool:
        # The others run until the test ends them, so they are still in the batch however
        # long the cancel takes (60 tokens, 0.6 s, were not on a busy machine).
        assert_outlasts(pool.config, LONG, 10 + 10 + 5 + slack(5), **UNCAPPED)
        others = [submit_with_chunks(pool, LONG, **UNCAPPED) for _ in range(3)]
        victim, started, _received = submit_with_chunks(pool, LONG, **UNCAPPED)
        wait_running(pool, 4)
        assert started.wait(10)
        pid = workers(pool)[0].pid
        assert pool.cancel(victim.request_id)
        result = victim.result(timeout=5)
        assert result.finish_reason == "cancelled"
        assert not any(f.done() for f, _, _ in others), "the cancel waited for the batch to end"
        # They go on getting tokens in the batch after it, and lose or repeat none.
        seen = [len(received) for _, _, received in others]
        wait_until(
            lambda: all(len(r) > n + 2 for (_, _, r), n in zip(others, seen, strict=True)),
            slack(5),
            message="the others to go on after the cancel",
        )
        for future, _, _ in others:
            assert pool.cancel(future.request_id)
        for future, _, _ in others:
            other = future.result(timeout=slack(5))
            assert other.finish_reason == "cancelled"
            assert other.text == expected_text(len(other.text.split()))
        assert result.text == expected_text(len(result.text.split())) and result.text
        assert workers(pool)[0].pid == pid
        assert counters(pool)["kills"] == 0


def test_one_deadline_leaves_the_batch_and_the_worker_alone() -> None:
    with open_pool(workers=1, max_batch_size=4) as pool:
        others = [pool.submit("tokens:80:0.01") for _ in range(3)]
        # Only its deadline ends it (80 tokens: a deadline that came 0.5 s late missed it).
        late = pool.submit(LONG, deadline_s=0.3, **UNCAPPED)
        with pytest.raises(DeadlineExceeded):
            late.result(timeout=10)
        for future in others:
            result = future.result(timeout=10)
            assert result.text == expected_text(80)
            assert result.attempts == 1
        snapshot = counters(pool)
        assert snapshot["timeouts"] == 1
        assert snapshot["kills"] == 0
        assert snapshot["collateral_retries"] == 0


def test_a_raise_fails_only_its_own_request() -> None:
    with open_pool(workers=1, max_batch_size=4, deadline_s=FAR_DEADLINE_S) as pool:
        # Still in the batch when the raise joins it (30 tokens, 0.3 s, could be over first,
        # and the test then passed without a batch): they run until the test ends them.
        assert_outlasts(pool.config, LONG, 10 + 30 + slack(5), **UNCAPPED)
        others = [pool.submit(LONG, **UNCAPPED) for _ in range(3)]
        wait_running(pool, 3)
        with pytest.raises(BackendError, match="boom"):
            pool.generate("raise:boom")
        assert not any(future.done() for future in others)
        for future in others:
            assert pool.cancel(future.request_id)
        for future in others:
            other = future.result(timeout=slack(5))
            assert other.finish_reason == "cancelled"
            assert other.text == expected_text(len(other.text.split())) and other.text
        assert counters(pool)["kills"] == 0


@pytest.mark.parametrize("culprit", ["hang", "segfault", "exit:3"])
def test_fault_in_a_batch_innocents_succeed_culprit_is_the_suspect(culprit: str) -> None:
    # One serving worker and a warm spare: the batch is on one worker, the spare takes over.
    with open_pool(
        workers=1, spares=1, max_batch_size=4, stall_timeout_s=0.5, deadline_s=60
    ) as pool:
        first_pid = next(w.pid for w in workers(pool) if w.role == "serving")
        # Still in the batch when the culprit joins it, or they finish in one attempt: 1 s
        # (30 tokens, 0.3 s, left little on a busy machine), not longer, as they run twice.
        innocents = [pool.submit("tokens:100:0.01") for _ in range(3)]
        wait_running(pool, 3)
        poison = pool.submit(culprit)
        with pytest.raises(PoisonRequest) as caught:
            poison.result(timeout=45)
        assert "suspect" in str(caught.value)
        for future in innocents:
            result = future.result(timeout=30)
            assert result.text == expected_text(100)
            assert result.attempts == 2  # the lost batch, then a success elsewhere
        snapshot = counters(pool)
        assert snapshot["collateral_retries"] >= 3
        assert snapshot["poison_requests"] == 1
        assert snapshot["completed"] == 3 and snapshot["failed"] == 1
        assert all(w.pid != first_pid for w in workers(pool)), "the batch's worker was replaced"
        outcomes = [attempt.outcome for attempt in caught.value.attempts]
        assert outcomes[0] == "collateral" and len(outcomes) <= 3, outcomes
        if culprit == "hang":
            assert snapshot["stalls"] >= 1


def test_a_stream_that_showed_text_fails_typed_when_its_batch_dies() -> None:
    with open_pool(workers=1, spares=1, max_batch_size=4, deadline_s=FAR_DEADLINE_S) as pool:
        # Still streaming when the crash comes (400 tokens were 1.28 s under the default).
        assert_outlasts(pool.config, LONG, 10 + 10 + 30, **UNCAPPED)
        streamed, started, received = submit_with_chunks(pool, LONG, **UNCAPPED)
        assert started.wait(10)
        quiet = pool.submit("tokens:30:0.01")
        wait_running(pool, 2)
        pool.submit("segfault")
        with pytest.raises(WorkerCrashed) as caught:
            streamed.result(timeout=30)
        assert not isinstance(caught.value, PoisonRequest)
        assert received, "it had streamed text before the crash"
        assert quiet.result(timeout=30).text == expected_text(30)


def test_a_livelocked_loop_is_a_stall_tokens_not_iterations() -> None:
    # "spin" keeps the batch loop turning without delivering a token.
    with open_pool(workers=1, spares=1, max_batch_size=4, stall_timeout_s=0.4) as pool:
        with pytest.raises(PoisonRequest):
            pool.generate("spin", deadline_s=30)
        snapshot = counters(pool)
        assert snapshot["stalls"] == 2  # once alone, then once more alone: the suspect
        assert snapshot["kills"] >= 2


def test_max_batch_size_one_is_todays_pool() -> None:
    with open_pool(workers=1) as pool:
        # The first runs until the test ends it, so that the other two are surely queued
        # behind it when the running requests are counted.
        assert_outlasts(pool.config, LONG, 10, **UNCAPPED)
        first = pool.submit(LONG, **UNCAPPED)
        futures = [pool.submit("tokens:20:0.005") for _ in range(2)]
        wait_running(pool, 1)
        assert running_ids(workers(pool)) == [first.request_id]
        assert pool.cancel(first.request_id)
        for future in futures:
            assert future.result(timeout=10).text == expected_text(20)
        assert pool.stats().capacity == 1


ONE_CALL_BACKEND = """
import threading


class Handler:
    def generate(self, call):
        pause = threading.Event()
        for _ in range(20):
            if call.cancelled():
                return ""
            pause.wait(0.01)
        return call.prompt


def factory(model="", device="cpu", **options):
    return Handler()
"""


def test_a_one_call_backend_keeps_one_request_per_worker(
    backend_module: BackendModule,
) -> None:
    one_call = backend_module(ONE_CALL_BACKEND)
    with open_pool(workers=1, max_batch_size=4, backend=one_call) as pool:
        futures = [pool.submit(f"p{index}") for index in range(3)]
        wait_running(pool, 1)
        snapshot = pool.stats()
        assert snapshot.workers[0].slots == 1 and snapshot.capacity == 1
        assert len(running_ids(snapshot.workers)) == 1
        assert [future.result(timeout=10).text for future in futures] == ["p0", "p1", "p2"]


# Every way a batch is lost, on the three shapes of pool: one worker and no spare (the
# replacement is what retries the innocents), one worker and a spare, two workers.
TOPOLOGIES = [
    pytest.param(1, 0, id="one-worker-no-spare"),
    pytest.param(1, 1, id="one-worker-and-a-spare"),
    pytest.param(2, 0, id="two-workers"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("worker_count", "spares"), TOPOLOGIES)
@pytest.mark.parametrize("fault", ["hang", "segfault", "ignored_cancel", "batch_raise:boom"])
def test_no_innocent_is_lost_with_its_batch_on_any_pool_shape(
    worker_count: int, spares: int, fault: str
) -> None:
    # The stall clock is what ends "hang"; an ignored cancel is left to cancel_grace_s.
    stall = None if fault == "ignored_cancel" else 0.5
    with open_pool(
        workers=worker_count,
        spares=spares,
        max_batch_size=4,
        stall_timeout_s=stall,
        cancel_grace_s=0.3,
        deadline_s=60,
    ) as pool:
        # About a second each: a wide margin for the culprit to join their batch first.
        innocents = [pool.submit("tokens:100:0.01") for _ in range(3)]
        wait_running(pool, 3)
        if fault == "ignored_cancel":
            # One token (so the worker has admitted it: a cancel that reaches a worker
            # first is answered without a start), then it hangs in its batch, freezing its
            # batch-mates, and ignores its cancel.
            culprit, started, _ = submit_with_chunks(pool, "stall:1")
            assert started.wait(10)
            culprit.cancel()
        else:
            culprit = pool.submit(fault)
        results = [future.result(timeout=45) for future in innocents]
        assert all(result.text == expected_text(100) for result in results)
        assert all(result.attempts <= 2 for result in results)
        # The premise: the culprit shared a batch with at least one of them.
        assert any(result.attempts == 2 for result in results), "no batch-mate was re-run"
        snapshot = counters(pool)
        if fault == "ignored_cancel":
            assert snapshot["cancel_escalations"] == 1
        elif fault.startswith("batch_raise"):
            # The step failed in a worker that goes on: its own error once alone, no kill.
            with pytest.raises(BackendError, match="boom"):
                culprit.result(timeout=45)
            assert snapshot["kills"] == 0
        else:
            with pytest.raises(PoisonRequest, match="suspect"):
                culprit.result(timeout=45)
        assert counters(pool)["completed"] == 3
