"""How a request ends: its future resolved once, with an answer, a cancel or an error,
its records and timers let go, its counters and observers told.

Part of the dispatcher (``dispatcher.py``), on its thread: the dispatcher, its message
handlers (``worker_messages.py``) and its retries (``retries.py``) resolve every
request through one ``Resolution``, which alone moves a request to "done". A request
resolved twice (an answer racing its deadline) is resolved by the first and the second
is a no-op::

    resolution.succeed(request, generation, worker.pid)
    resolution.fail(request, DeadlineExceeded("..."))
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable

from modelpool.scheduling.queueing import PriorityCounts
from modelpool.shared.errors import PoolError
from modelpool.shared.protocol import Generation
from modelpool.supervisor.observe import Observers, RequestStatus
from modelpool.supervisor.records import Request, TimerHeap, request_record
from modelpool.supervisor.results import set_future
from modelpool.supervisor.stats import PoolStats


class Resolution:
    """Resolves requests for the dispatcher (see the module docstring); it shares the
    dispatcher's records: its live requests, queue, counters, timers and priorities."""

    def __init__(
        self,
        *,
        clock: Callable[[], float],
        live: dict[str, Request],
        queue: collections.OrderedDict[str, Request],
        priorities: PriorityCounts,
        timers: TimerHeap,
        counters: dict[str, int],
        latencies: collections.deque[float],
        observers: Observers,
        unpin: Callable[[Request], None],
        on_dequeued: Callable[[], None],
    ) -> None:
        self.clock = clock
        self.live = live
        self.queue = queue
        self.priorities = priorities
        self.timers = timers
        self.counters = counters
        self.latencies = latencies
        self.observers = observers
        self.unpin = unpin
        self.on_dequeued = on_dequeued

    def dequeued(self, request: Request) -> None:
        """``request`` no longer counts against ``max_queue`` (it runs, or it ended)."""
        if request.counted_as_queued:
            request.counted_as_queued = False
            self.on_dequeued()

    def succeed(self, request: Request, generation: Generation, worker_pid: int | None) -> None:
        if not self._finish(request):
            return
        PoolStats.count_completed(self.counters, generation.thinking_closed)
        result = request.result(generation, worker_pid, self.clock())
        self.latencies.append(result.latency_s)
        # Observed first: a caller that has its answer finds it in the metrics.
        self._observe(request, "completed", generation)
        set_future(request.future, result)

    def cancelled(
        self,
        request: Request,
        text: str,
        worker_pid: int | None,
        generation: Generation | None = None,
    ) -> None:
        """``request`` was cancelled: it resolves with ``text``, what exists of its answer."""
        if not self._finish(request):
            return
        self.counters["cancelled"] += 1
        if generation is None:
            generation = Generation(text, "cancelled")
        else:
            generation = dataclasses.replace(generation, text=text, finish_reason="cancelled")
        self._observe(request, "cancelled", generation)
        set_future(request.future, request.result(generation, worker_pid, self.clock()))

    def fail(self, request: Request, error: PoolError) -> None:
        if not self._finish(request):
            return
        error.request_id = request.request_id
        error.attempts = list(request.attempts)
        if request.caller_gone:
            self.counters["cancelled"] += 1
        else:
            self.counters["failed"] += 1
        self._observe(request, "cancelled" if request.caller_gone else "failed", error=error)
        set_future(request.future, error)

    def _finish(self, request: Request) -> bool:
        if request.state == "done":
            return False
        if request.state == "queued":
            self.priorities.queued(request.priority, -1, request.queued_work)
        if request.state in ("queued", "backoff"):
            self.queue.pop(request.request_id, None)
        request.state = "done"
        request.run = None
        self.timers.cancel(request.deadline_timer)
        self.unpin(request)
        self.live.pop(request.request_id, None)
        self.dequeued(request)
        return True

    def _observe(
        self,
        request: Request,
        status: RequestStatus,
        generation: Generation | None = None,
        error: PoolError | None = None,
    ) -> None:
        """Hand the resolved request's record to the observers, if there are any."""
        if self.observers.on_request:
            self.observers.request_done(
                request_record(request, status, self.clock(), generation, error)
            )
