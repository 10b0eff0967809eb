"""A backend whose per-worker reports are slow to build, for the tests that read
``stats()`` right after an answer (tests/integration/test_stats_after_answer.py).

``counting`` answers every prompt with "ok" and counts it as a prefix-cache lookup and
hit, and as ``SERVED_TOKENS`` tokens of KV room taken; building either report takes
``REPORT_S``, as fingerprinting a large cache does. ``max_batch_size`` above 1 serves
it in the batched form, one request finished per step.
"""

from __future__ import annotations

import threading
from typing import Any

from modelpool.shared.protocol import BatchCall, Call, Finished, Generation, PrefixCacheReport

REPORT_S = 0.3
ROOM_TOKENS = 10_000
SERVED_TOKENS = 100


class _Counting:
    def __init__(self) -> None:
        self.served = 0
        self._waiting: list[BatchCall] = []
        self._pause = threading.Event()

    def generate(self, call: Call) -> Generation:
        self.served += 1
        return Generation("ok", "stop", 1, 1)

    def prefix_cache_report(self) -> PrefixCacheReport:
        self._pause.wait(REPORT_S)
        return PrefixCacheReport(entries=self.served, hits=self.served, lookups=self.served)

    def admit(self, call: BatchCall) -> None:
        self._waiting.append(call)

    def step(self) -> list[Finished]:
        if not self._waiting:
            return []
        call = self._waiting.pop(0)
        return [(call, self.generate(call))]

    def retire(self, call: BatchCall) -> Generation:
        if call in self._waiting:
            self._waiting.remove(call)
        return Generation("", "cancelled", None, 0)

    def abort(self) -> None:
        self._waiting.clear()

    def room(self) -> tuple[int, list[BatchCall]]:
        self._pause.wait(REPORT_S)
        return ROOM_TOKENS - SERVED_TOKENS * self.served, []


def counting(model: str = "", device: str = "cpu", **options: Any) -> _Counting:
    return _Counting()
