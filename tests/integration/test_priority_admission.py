"""Priority and admission by predicted wait, in a real pool of testing workers.

The docs, Priority and queue-time bounds: ``priority`` (an int, lower first) orders the
queue; ``max_queue_time_s`` refuses at once (``QueueFull``, with how long to wait) a
request whose predicted time to first token passes it, and never drops one it accepted;
the observers get a record of each resolved request.
"""

from __future__ import annotations

import math
import threading
from pathlib import Path

import pytest

from helpers import open_pool, slack, wait_busy
from modelpool import InvalidRequest, QueueFull
from modelpool.supervisor.observe import RequestRecord


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("priority", "high"),
        ("priority", 1.5),
        ("priority", True),
        ("priority", 2**40),
        ("max_queue_time_s", 0),
        ("max_queue_time_s", "1"),
        ("traceparent", "00-xyz"),
    ],
)
def test_bad_queueing_fields_are_refused_naming_the_field(field: str, value: object) -> None:
    with open_pool(workers=1) as pool, pytest.raises(InvalidRequest, match=field):
        pool.submit("echo:x", **{field: value})


def test_a_higher_priority_request_runs_before_lower_ones_that_waited_longer() -> None:
    with open_pool(workers=1) as pool:
        finished: list[str] = []
        lock = threading.Lock()

        def note(name: str) -> None:
            with lock:
                finished.append(name)

        blocker = pool.submit("tokens:10:0.05", priority=-5)  # none preempts it
        wait_busy(pool, 1)
        futures = [pool.submit(f"echo:low{i}", priority=5) for i in range(3)]
        futures.append(pool.submit("echo:high", priority=-1))
        for future in futures:
            future.add_done_callback(lambda f: note(f.result().text))
        blocker.result(timeout=slack(10))
        for future in futures:
            future.result(timeout=slack(10))
        assert finished == ["high", "low0", "low1", "low2"]


def test_queue_full_refuses_early_and_never_drops_what_it_accepted() -> None:
    records: list[RequestRecord] = []
    with open_pool(workers=1, max_queue_time_s=0.05) as pool:
        pool.add_observer(on_request=records.append)
        for _ in range(3):  # measured runs of about 0.4 s: the predictor's samples
            pool.generate("tokens:4:0.1", max_queue_time_s=math.inf)
        assert pool.stats().throughput["samples"] == 3
        # Even on a free worker its first token is predicted ~0.1 s away: no bound for it.
        accepted = pool.submit("tokens:4:0.1", max_queue_time_s=math.inf)
        wait_busy(pool, 1)
        with pytest.raises(QueueFull) as refused:
            pool.submit("echo:late")
        assert refused.value.predicted_ttft_s > 0.05
        assert refused.value.retry_after_s == pytest.approx(refused.value.predicted_ttft_s - 0.05)
        # Its own bound, or none, wins over the pool's: queued, and served.
        patient = pool.submit("echo:patient", max_queue_time_s=60.0)
        assert accepted.result(timeout=slack(10)).finish_reason in ("stop", "length")
        assert patient.result(timeout=slack(10)).text == "patient"
        counters = pool.stats().counters
        assert counters["queue_full"] == 1 and counters["overloaded"] == 1
        assert counters["submitted"] == 5, "a refused request is never submitted"
    served = [record for record in records if record.request_id == accepted.request_id]
    assert served and served[0].status == "completed"
    attempt = served[0].attempts[0]
    assert attempt.outcome == "ok" and attempt.pid is not None
    assert attempt.first_token_at is not None and attempt.ended_at is not None
    assert attempt.started_at <= attempt.first_token_at <= attempt.ended_at


def test_a_request_past_its_own_deadline_is_refused_when_a_bound_is_set() -> None:
    with open_pool(workers=1) as pool:
        for _ in range(3):
            pool.generate("tokens:4:0.1")
        blocker = pool.submit("tokens:10:0.1")
        wait_busy(pool, 1)
        with pytest.raises(QueueFull, match="deadline"):
            pool.submit("echo:x", deadline_s=0.05, max_queue_time_s=30.0)
        blocker.result(timeout=slack(10))


def test_an_admitted_request_is_not_judged_again_and_is_promoted_before_its_deadline() -> None:
    # ``admitted=True`` is what the daemon passes for a request it judged and accepted.
    with open_pool(workers=1, max_queue_time_s=0.05) as pool:
        for _ in range(3):  # measured runs of about 0.4 s: the predictor's samples
            pool.generate("tokens:4:0.1", max_queue_time_s=math.inf)
        blocker = pool.submit("tokens:4:0.1", max_queue_time_s=math.inf)
        wait_busy(pool, 1)
        # The pool's own bound would refuse it (its predicted wait is ~0.4 s): not here.
        low = pool.submit("echo:low", priority=5, admitted=True, deadline_s=slack(4))
        # More urgent work than its deadline holds, all of it sent after it.
        urgent = [
            pool.submit("tokens:4:0.1", priority=0, max_queue_time_s=math.inf, deadline_s=slack(60))
            for _ in range(int(slack(4) / 0.2) + 4)  # runs of 0.3-0.4 s: past its deadline
        ]
        assert low.result(timeout=slack(10)).text == "low"
        assert not all(future.done() for future in urgent), "it went ahead of younger ones"
        blocker.result(timeout=slack(10))
        for future in urgent:
            future.cancel()
        assert pool.stats().counters["queue_full"] == 0
    with open_pool(workers=1) as pool, pytest.raises(InvalidRequest, match="admitted"):
        pool.submit("echo:x", admitted="yes")


@pytest.mark.slow
def test_priority_reaches_a_batched_hf_worker_and_its_answers(tiny_model_dir: Path) -> None:
    """The worker's scheduler reads ``priority`` (tests/unit/test_scheduler_priority.py
    has the ordering); here: a real hf worker takes the parameter, batched and alone."""
    for batch in (1, 4):
        with open_pool(
            model=str(tiny_model_dir), backend="hf", workers=1, max_batch_size=batch
        ) as pool:
            futures = [pool.submit("Hello", max_new_tokens=4, priority=p) for p in (5, -1, 0, 5)]
            for future in futures:
                assert future.result(timeout=slack(60)).completion_tokens == 4


def test_long_requests_queued_after_short_history_refuse_the_next_early() -> None:
    """Issue 57's case: one worker, ``max_queue_time_s=2`` after a few short runs, three
    requests of 60 tokens at 50 ms (about 3 s each) queued. Counted at the pool's mean
    run (0.1 s) a fourth was admitted and answered after about 12 s; counted from each
    queued run's own size it is refused at once, with the wait it would have had."""
    with open_pool(workers=1, max_queue_time_s=2.0, deadline_s=60.0) as pool:
        for _ in range(4):  # short runs: two tokens, cut at their maximum
            pool.generate("tokens:60:0.05", max_new_tokens=2, max_queue_time_s=math.inf)
        long_runs = [
            pool.submit("tokens:60:0.05", max_new_tokens=60, max_queue_time_s=math.inf)
            for _ in range(3)
        ]
        wait_busy(pool, 1)
        with pytest.raises(QueueFull) as refused:
            pool.submit("tokens:60:0.05", max_new_tokens=60)
        # At least one run of ~3 s still queued ahead of it, on one slot (the worker holds
        # the next one prefetched); at the mean run that was 0.1 s a run.
        assert refused.value.predicted_ttft_s > 2.5
        assert not any(future.done() for future in long_runs[1:]), "refused early"
        short = pool.submit("tokens:60:0.05", max_new_tokens=2, max_queue_time_s=math.inf)
        for future in long_runs:
            future.cancel()
        assert short.result(timeout=slack(10)).completion_tokens == 2
