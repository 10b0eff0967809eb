"""Recycling: workers retire after their current request, never mid-request."""

from __future__ import annotations

import sys

import pytest

from helpers import make_config, wait_until
from modelpool import ModelPool

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux processes")


def serving_workers(pool: ModelPool) -> int:
    """Workers in the serving role that can take a request now or are taking one."""
    return sum(w.state in ("idle", "busy") and w.role == "serving" for w in pool.stats().workers)


def test_recycling_by_request_count_with_a_spare_keeps_capacity() -> None:
    with ModelPool(make_config(workers=1, spares=1, max_requests_per_worker=3)) as pool:
        pids = []
        for index in range(10):
            result = pool.generate(f"echo:{index}")
            assert result.text == str(index)
            pids.append(result.worker_pid)
            # The retiring worker's place was taken by the spare in the same step.
            assert serving_workers(pool) >= 1
            # Let the replacement spare come up (a worker over its limit keeps serving
            # until a spare can take its place, so a faster pace only delays retirement).
            wait_until(
                lambda: (
                    all(w.state in ("idle", "spare") for w in pool.stats().workers)
                    and len(pool.stats().workers) == 2
                ),
                timeout=10,
            )
        counters = pool.stats().counters
        assert counters["failed"] == 0
        # 10 requests at 3 per worker: three workers retire after 3 each, the fourth serves 1.
        assert counters["recycled"] == 3
        assert counters["kills"] == 0 and counters["crashes"] == 0
        assert [pids.count(pid) for pid in dict.fromkeys(pids)] == [3, 3, 3, 1], pids


def test_recycling_by_rss_after_the_request_that_grew_it() -> None:
    with ModelPool(make_config(workers=1, spares=0, max_worker_rss_mb=120)) as pool:
        before = pool.stats().workers[0]
        assert before.rss_mb is not None and before.rss_mb < 120
        grown = pool.generate("leak:150")
        assert grown.text == "ok"  # the request that crossed the limit still completes
        assert grown.worker_pid == before.pid
        replacement = wait_until(
            lambda: [w for w in pool.stats().workers if w.state == "idle" and w.pid != before.pid],
            timeout=10,
            message="a replacement worker",
        )
        assert replacement[0].rss_mb is not None and replacement[0].rss_mb < 120
        counters = pool.stats().counters
        assert counters["recycled"] == 1 and counters["failed"] == 0
        assert counters["respawns"] == 1
        assert pool.generate("echo:after").text == "after"
        releases = wait_until(
            lambda: (r := pool.stats().gpu.releases).checked and r,
            timeout=10,
            message="the retired worker's release check",
        )
        assert releases.checked == releases.ok == 1


def test_a_worker_over_its_limit_serves_on_until_a_spare_is_ready() -> None:
    # A 5 s load: the third request surely arrives while the replacement spare loads.
    config = make_config(
        workers=1, spares=1, max_requests_per_worker=1, backend_options={"load_delay_s": 5.0}
    )
    with ModelPool(config) as pool:
        first = pool.generate("echo:a").worker_pid
        second = pool.generate("echo:b").worker_pid  # the promoted spare
        third = pool.generate("echo:c").worker_pid  # its replacement spare is still loading
        assert first != second
        assert third == second
        assert serving_workers(pool) == 1
        assert pool.stats().counters["failed"] == 0
