"""A one-call worker's prefetched request (``modelpool.scheduling.prefetch``) on real worker
processes:
it is sent while the worker runs another, and its cancel, its deadline and its worker's
death act on it as on a queued request: at once, without signalling the worker, and
never charged."""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

import pytest

from helpers import counters, open_pool, slack, submit_with_chunks, wait_until, workers
from modelpool import DeadlineExceeded

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux processes")


def long_request(seconds: float) -> dict[str, Any]:
    """Tokens 50 ms apart for ``seconds`` (slack included), honouring the cancel flag."""
    tokens = max(1, round(slack(seconds) / 0.05))
    return {
        "prompt": f"tokens:{tokens}:0.05",
        "max_new_tokens": tokens + 1,
        "deadline_s": slack(3 * seconds),
    }


def test_a_prefetched_request_is_cancelled_and_timed_out_without_waiting_or_a_kill() -> None:
    with open_pool(workers=1) as pool:
        (worker,) = workers(pool)
        running, started, _ = submit_with_chunks(pool, **long_request(3.0))
        assert started.wait(slack(5.0))
        cancelled = pool.submit("echo:never")
        # Prefetched: out of the queue, on the worker behind the running request.
        wait_until(lambda: pool.stats().queue_depth == 0, timeout=slack(2.0))
        assert pool.cancel(cancelled.request_id)
        assert cancelled.result(timeout=slack(1.0)).finish_reason == "cancelled"
        assert not running.done(), "the cancel waited for the running request"

        began = time.monotonic()
        late = pool.submit("echo:late", deadline_s=0.3)
        with pytest.raises(DeadlineExceeded):
            late.result(timeout=slack(2.0))
        assert time.monotonic() - began < slack(1.5)
        assert not running.done(), "the deadline waited for the running request"

        # Neither was given a grace to answer in: the worker was never signalled for them.
        assert pool.cancel(running.request_id)
        assert running.result(timeout=slack(2.0)).finish_reason == "cancelled"
        assert [w.pid for w in workers(pool)] == [worker.pid]
        seen = counters(pool)
        assert seen["crashes"] == 0 and seen["cancel_escalations"] == 0
        assert pool.generate("echo:after", deadline_s=slack(5.0)).text == "after"


def test_a_prefetched_request_on_a_worker_that_dies_is_retried_uncharged() -> None:
    with open_pool(workers=1, startup_timeout_s=slack(30.0)) as pool:
        (worker,) = workers(pool)
        assert worker.pid is not None
        running, started, _ = submit_with_chunks(pool, **long_request(5.0))
        assert started.wait(slack(5.0))
        waiting = pool.submit("echo:survived", deadline_s=slack(30.0))
        wait_until(lambda: pool.stats().queue_depth == 0, timeout=slack(2.0))
        os.kill(worker.pid, signal.SIGKILL)

        result = waiting.result(timeout=slack(30.0))
        assert result.text == "survived"
        assert result.attempts == 1, "the prefetched request was charged its worker's death"
        assert result.worker_pid != worker.pid
        running.exception(timeout=slack(30.0))  # streamed, so not retried: it fails
        assert counters(pool)["crashes"] == 1


def test_an_idle_worker_takes_back_what_waits_behind_a_long_request() -> None:
    with open_pool(workers=2) as pool:
        slow, slow_started, _ = submit_with_chunks(pool, **long_request(4.0))
        assert slow_started.wait(slack(5.0))
        quick = pool.submit("tokens:3:0.2")
        behind = pool.submit("echo:behind")  # prefetched on one of the two busy workers
        assert quick.result(timeout=slack(5.0)).text
        # Whichever worker it waited on, it did not wait for the 4 s request.
        assert behind.result(timeout=slack(2.0)).text == "behind"
        assert not slow.done()
        slow.cancel()
