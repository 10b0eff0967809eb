"""The stall watch: a busy worker whose progress word has not moved for ``stall_timeout_s``.

A worker bumps its ``ControlBlock`` progress word at every token it delivers. While any
worker has requests attached, :class:`StallWatch` reads those words every quarter of
``stall_timeout_s`` on the dispatcher's timer heap; a worker whose word stood still for
the whole timeout is hung (a loop that spins without delivering counts too). What then
happens is the dispatcher's: a one-call worker's run times out as any attempt does
(``Dispatcher._attempt_timed_out``, the kill ladder from its cancel flag); a batched
worker (:meth:`StallWatch.batch_stalled`) is sent SIGTERM and its whole batch settled as
lost (``Retries.batch_lost``).

When the clock starts: a one-call worker's at its first progress after it became busy
(a long prefill is bounded by the deadline alone); a batched worker's when it got work,
since its requests must see a token within the timeout, prefill included
(``Dispatcher._dispatch`` sets ``Worker.progress_at``).
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable, Mapping

from modelpool.shared.config import PoolConfig
from modelpool.supervisor.records import Run, Timer, TimerHeap, Worker

logger = logging.getLogger("modelpool.dispatcher")


class StallWatch:
    """Reads the busy workers' progress words on a timer; see the module docstring."""

    def __init__(
        self,
        config: PoolConfig,
        *,
        clock: Callable[[], float],
        timers: TimerHeap,
        workers: Mapping[int, Worker],
        counters: dict[str, int],
        run_stalled: Callable[[Run], None],
        send_signal: Callable[[Worker, int, str], None],
        batch_lost: Callable[[Worker, str], None],
    ) -> None:
        self.config = config
        self.clock = clock
        self.timers = timers
        self.workers = workers
        self.counters = counters
        self.run_stalled = run_stalled
        self.send_signal = send_signal
        self.batch_lost = batch_lost
        self._timer: Timer | None = None

    def watch(self) -> None:
        """Work was dispatched: check from now on, while any worker has some."""
        if self.config.stall_timeout_s is not None and self._timer is None:
            self._arm()

    def _arm(self) -> None:
        assert self.config.stall_timeout_s is not None
        interval = max(0.005, self.config.stall_timeout_s / 4)
        self._timer = self.timers.call_at(self.clock() + interval, self._check)

    def _check(self) -> None:
        self._timer = None
        timeout_s = self.config.stall_timeout_s
        assert timeout_s is not None
        now = self.clock()
        busy = False
        for worker in list(self.workers.values()):
            watched = worker.state == "busy" or (worker.slots > 1 and worker.state == "cancelling")
            attached = [
                run
                for run in worker.runs.values()
                if run.request is not None and not run.prefetched
            ]
            if not attached or not watched or worker.io is None:
                continue
            busy = True
            progress = worker.io.progress()
            if progress != worker.progress_seen:
                worker.progress_seen = progress
                worker.progress_at = now
            elif worker.progress_at is not None and now - worker.progress_at >= timeout_s:
                logger.warning(
                    "worker %d (pid %s) stalled: no progress for %.2fs (%d running)",
                    worker.id,
                    worker.pid,
                    now - worker.progress_at,
                    len(worker.runs),
                )
                if worker.slots > 1:
                    self.batch_stalled(worker)
                else:
                    self.run_stalled(attached[0])
        if busy:
            self._arm()

    def batch_stalled(self, worker: Worker) -> None:
        """A batched worker delivered no token to any of its requests for
        ``stall_timeout_s``. Signalled first, so that its replacement counts as another
        worker for their retries; then its requests are settled as lost with the batch."""
        self.counters["stalls"] += 1
        self.send_signal(worker, signal.SIGTERM, "stall")
        self.batch_lost(
            worker,
            f"worker pid {worker.pid} made no progress for {self.config.stall_timeout_s}s",
        )
