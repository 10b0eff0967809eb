"""Retry or fail: what becomes of a request whose attempt failed, alone or with its batch.

The dispatcher (``dispatcher.py``) owns requests, attempts and runs; when an attempt
ends badly it hands the request here. :meth:`Retries.attempt_failed` applies the
retry policy to one failure (outcome, retries charged, deadline, another worker to go
to) and either fails the request or queues it again, away from the worker that failed
it. :meth:`Retries.batch_lost` settles every request of a batched worker that died, was
killed or failed a step: innocents are retried as "collateral" (not charged), suspects
are tracked so that a poison request takes down at most two batches, and a request that
fails alone after that fails with ``PoisonRequest``.

It owns one piece of state, ``avoiding``: for each worker, the retries that must not go
back to it. It runs on the dispatcher thread, with the dispatcher's clock, timers,
counters and queue, and calls back ``fail`` and ``end_attempt`` for the parts that are
the dispatcher's own (resolution, attempt records).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable

from modelpool.shared.config import PoolConfig
from modelpool.shared.errors import (
    DeadlineExceeded,
    Outcome,
    PoisonRequest,
    PoolError,
    WorkerCrashed,
)
from modelpool.supervisor.observe import WorkerEvent
from modelpool.supervisor.records import FailedBatch, Request, Run, TimerHeap, Worker

logger = logging.getLogger("modelpool.dispatcher")


class Retries:
    """The retry policy and the lost-batch rules; see the module docstring."""

    def __init__(
        self,
        config: PoolConfig,
        *,
        clock: Callable[[], float],
        timers: TimerHeap,
        counters: dict[str, int],
        queue: collections.OrderedDict[str, Request],
        fail: Callable[[Request, PoolError], None],
        end_attempt: Callable[[Run, Outcome | None], Request],
        may_retry: Callable[[], bool],
        another_worker_exists: Callable[[Worker], bool],
        queued: Callable[[Request], None] = lambda request: None,
        note: Callable[[WorkerEvent], None] = lambda event: None,
    ) -> None:
        self.config = config
        self.clock = clock
        self.timers = timers
        self.counters = counters
        self.queue = queue
        self.fail = fail
        self.end_attempt = end_attempt
        self.may_retry = may_retry
        self.another_worker_exists = another_worker_exists
        # A request entered the queue (the dispatcher counts them by priority); a retry
        # is an event for observers (observe.WorkerEvent).
        self.queued = queued
        self.note = note
        # worker id -> the retries that must not go back to it (their last failed worker):
        # so that finding them costs their number, not the length of the queue.
        self.avoiding: dict[int, dict[str, Request]] = {}

    def batch_lost(
        self,
        worker: Worker,
        outcome: Outcome,
        reason: str,
        exit_code: int | None,
        *,
        runs: list[Run] | None = None,
        backend_error: Callable[[], PoolError] | None = None,
    ) -> None:
        """The batched worker died or is being killed: settle every request it held
        (``runs``: only those of a step that failed in a worker that goes on).

        Every request on it is marked as having been in a failed batch (or as having
        failed alone, when it was the only one). A request whose caller has seen nothing
        is retried at once elsewhere as outcome "collateral", not charged to its retry
        budget (its deadline keeps running); one that already streamed text fails typed,
        as without batching. A request in two failed batches, or that failed alone, runs
        alone from then on, and one that then fails alone fails with PoisonRequest. So a
        poison request takes down at most two batches: at most 2 x (max_batch_size - 1)
        innocent requests are re-run, and none is lost. The suspects of one failed batch
        are spread one per worker (``placement.assign``); the first of them to fail alone is the
        culprit and clears the others of that batch, which may then share a worker again
        (``_clear_batch_peers``).
        """
        runs = list(worker.runs.values()) if runs is None else runs
        alone = len(runs) == 1
        failed_batch = FailedBatch([run.owner for run in runs if not run.lost])
        for run in runs:
            owner = run.owner
            was_isolated = owner.isolated
            if not run.lost:
                # Once per run: a worker killed for an ignored cancel is settled then and
                # again at its exit.
                run.lost = True
                if alone:
                    owner.alone_failures += 1
                    self._clear_batch_peers(owner)
                else:
                    owner.batch_failures += 1
                    owner.suspected_in.append(failed_batch)
            if run.request is None:
                continue
            streamed = run.request.streamed
            if alone and was_isolated:
                request = self.end_attempt(run, outcome)
                self.counters["poison_requests"] += 1
                self.fail(
                    request,
                    PoisonRequest(
                        f"{reason}; this request is the suspect: it failed again running "
                        f"alone after {owner.batch_failures} failed batch(es) and "
                        f"{owner.alone_failures - 1} failure(s) alone, and is not retried",
                        exit_code=exit_code,
                    ),
                )
                continue
            request = self.end_attempt(run, outcome if alone or streamed else "collateral")
            error: PoolError
            if backend_error is not None:
                error = backend_error()
            elif outcome == "timeout":
                error = DeadlineExceeded(reason, partial_text=request.last_partial)
            else:
                error = WorkerCrashed(f"{reason} while running the request", exit_code=exit_code)
            if alone or streamed:
                self.attempt_failed(request, worker, outcome, error)
            else:
                self._retry_collateral(request, worker, error)

    def _clear_batch_peers(self, culprit: Request) -> None:
        """``culprit`` failed alone: that explains the failed batches it was in, so the
        other requests of those batches are no longer suspects for them and may share a
        worker again. Without this a batch of N that died for one request would re-run its
        N - 1 innocents one per worker, one after the other on a pool of one worker. Their
        ``batch_failures`` stay: two poison requests in one batch must not be able to clear
        each other of the count that isolates them."""
        for batch in culprit.suspected_in:
            for peer in batch.members:
                if peer is not culprit and batch in peer.suspected_in:
                    peer.suspected_in.remove(batch)

    def _retry_collateral(self, request: Request, worker: Worker, error: PoolError) -> None:
        """Retry a request its batch took down. Away from a worker on its way out (so it
        needs another, or that worker's replacement); a worker that goes on, after a step
        that failed in it, may take it back."""
        leaving = worker.signalled or worker.state in ("killing", "dead")
        retry = (
            not request.cancel_requested
            and not request.caller_gone
            and self.may_retry()
            and self.clock() < request.deadline
            and (not leaving or self.another_worker_exists(worker))
        )
        if not retry:
            self.fail(request, error)
            return
        self.counters["collateral_retries"] += 1
        if leaving:
            self._pin_away_from(request, worker, error)
        self.requeue(request)

    def attempt_failed(
        self, request: Request, worker: Worker, outcome: Outcome, error: PoolError
    ) -> None:
        now = self.clock()
        policy = self.config.retry
        if outcome == "oom":
            # A prompt too long for the device's memory fails everywhere: few tries.
            allowed = sum(a.outcome == "oom" for a in request.attempts) <= policy.oom_retries
        else:
            allowed = outcome in policy.on
        charged = sum(
            attempt.outcome not in ("collateral", "preempted") for attempt in request.attempts
        )
        retry = (
            allowed
            and charged <= policy.max_retries
            and not request.streamed
            and not request.cancel_requested
            and not request.caller_gone
            and self.may_retry()
            and now + policy.backoff_s < request.deadline
            and self.another_worker_exists(worker)
        )
        if not retry:
            self.fail(request, error)
            return
        self.counters["retries"] += 1
        self._pin_away_from(request, worker, error)
        last = request.attempt_log[-1].attempt_id if request.attempt_log else 0
        self.note(
            WorkerEvent(
                "retry",
                now,
                worker.id,
                worker.pid,
                outcome,
                attempt_ids=(last,),
                request_id=request.request_id,
                detail=error.message,
                pool_slot=worker.slot,
            )
        )
        logger.info(
            "request %s: attempt %d %s on worker pid %s; retrying",
            request.request_id,
            len(request.attempts),
            outcome,
            worker.pid,
        )
        if policy.backoff_s > 0:
            request.state = "backoff"
            self.timers.call_at(now + policy.backoff_s, self.requeue, request)
        else:
            self.requeue(request)

    def fail_pinned_retries(self, worker: Worker) -> None:
        """The only worker came back warm: a retry waiting for another worker has none."""
        for request in list(self.avoiding.get(worker.id, {}).values()):
            if request.state == "queued" and request.last_error is not None:
                self.fail(request, request.last_error)

    def _pin_away_from(self, request: Request, worker: Worker, error: PoolError) -> None:
        """The retry must not go back to ``worker``; ``error`` is what it fails with if no
        other worker can ever take it."""
        self.unpin(request)
        request.last_failed_worker = worker.id
        self.avoiding.setdefault(worker.id, {})[request.request_id] = request
        request.last_error = error

    def unpin(self, request: Request) -> None:
        if request.last_failed_worker is None:
            return
        avoiding = self.avoiding.get(request.last_failed_worker)
        if avoiding is not None:
            avoiding.pop(request.request_id, None)
            if not avoiding:
                del self.avoiding[request.last_failed_worker]

    def requeue(self, request: Request) -> None:
        """A retry goes to the front of the queue: it has waited once already. An isolated
        request goes to the back: it is the likely culprit of a failure, and the requests it
        took down run first (it reserves the next worker to drain, so it is not starved)."""
        if request.state == "done":
            return
        if request.state != "queued":
            self.queued(request)
        request.state = "queued"
        self.queue[request.request_id] = request
        if not request.isolated:
            self.queue.move_to_end(request.request_id, last=False)
