"""What ``stats()`` says of a worker right after a request's answer holds that request's
effect: the worker sends its reports (prefix cache, KV room) before the answer, on the
one-call path and in the batched loop. The backend (tests/report_backends.py) takes
``REPORT_S`` to build each report, so a report sent after the answer is still on its
way when the caller reads ``stats()``."""

from __future__ import annotations

import sys

import pytest

from helpers import make_config
from modelpool import ModelPool
from report_backends import ROOM_TOKENS, SERVED_TOKENS

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux processes")


@pytest.mark.parametrize("max_batch_size", [1, 2], ids=["one-call", "batched"])
def test_stats_right_after_an_answer_include_its_prefix_cache_report(max_batch_size: int) -> None:
    config = make_config(
        workers=1, backend="report_backends:counting", max_batch_size=max_batch_size
    )
    with ModelPool(config) as pool:
        for served in (1, 2, 3):
            assert pool.generate("hello").text == "ok"
            (worker,) = pool.stats().workers
            assert worker.prefix_cache is not None, f"no report after answer {served}"
            assert (worker.prefix_cache.lookups, worker.prefix_cache.hits) == (served, served)


def test_stats_right_after_a_batched_answer_include_its_kv_room() -> None:
    config = make_config(workers=1, backend="report_backends:counting", max_batch_size=2)
    with ModelPool(config) as pool:
        for served in (1, 2, 3):
            assert pool.generate("hello").text == "ok"
            (worker,) = pool.stats().workers
            assert worker.kv_free_tokens == ROOM_TOKENS - SERVED_TOKENS * served
