"""The dispatcher: every decision about requests and workers, and no I/O.

``Dispatcher`` is the single owner of all worker and request state (the records in
``records.py``); it only runs on the dispatcher thread (``supervisor.EventLoop``) and so
needs no locks. It never touches a socket or a process itself: it asks its ``io`` (the
event loop in production, a recording fake in the property tests) to spawn, send, flag,
signal and check, and its clock is injected, so tests drive this very code with a fake
world.

Its parts, as pebble splits its pool into a task manager and a worker manager: this
file keeps requests, attempts and runs, and applies the schedule; its ``worker_manager``
(``worker_manager.py``, an object it owns and that calls back only ``give_up_loading``)
keeps the worker records and the decisions about processes: slots and start-up,
recycling and roles, signals, memory release checks; its ``messages``
(``worker_messages.py``) handle what workers send; its ``resolution``
(``resolution.py``) ends requests (futures, counters, observers); its ``retries``
(``retries.py``) decide retry or fail for a failed attempt and settle a lost batch; its
``stalls`` (``stalls.py``) find the busy workers whose progress stands still. All run on
the same thread and share the clock, the timer heap and the counters. Every scheduling
rule is a pure function in ``modelpool.scheduling``: this file asks and applies.

The entry points come first, in the order of a request's life (``submit``, ``cancel``,
``on_message``, ``on_exit``, ``on_device_free`` ...; the event loop calls
``run_due_timers`` and ``after_event`` on every turn); the helpers follow, grouped by
what they decide: handing requests to workers, attempts' end, deadlines and the run end
of the kill ladder, closing.

Batching (``max_batch_size`` above 1): a worker holds up to ``Worker.slots`` runs (and
beside them the preempted ones still winding down); ``_pump`` applies
``scheduling.plan`` (least loaded, then most free KV room; an isolated request gets an
empty worker; suspects are spread one per worker; a worker whose requests wait there for
KV room takes no more), and a room report asks back a request that waits for room while
another worker has some. Deadlines and cancels act on one run (its slot's cancel word);
a stall (``StallWatch.batch_stalled``: no token delivered), an ignored cancel or a death
settle the whole batch through ``Retries.batch_lost`` (collateral retries, poison
isolation), after signalling the worker, so that its replacement counts as another
worker.

Preemption (``preempt_for_priority``): ``scheduling.plan.victims`` names the running
attempts that give way to more urgent requests once no open worker has a slot;
``_preempt`` cancels each and queues its request again, ``plan.hand_over`` sends the
urgent one into the slot, and a rerun does not stream again what its caller saw
(``Run.continue_stream``).

Prefetch (``max_batch_size`` 1, ``scheduling.prefetch``): a busy one-call worker holds
one run more (several when runs are far shorter than a wake-up), not started;
``_promote`` starts the next when the worker answers, ``_drop_prefetched`` ends one unrun
(cancel, deadline, taken back by ``plan.take_back``), ``on_exit`` requeues them.
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
import signal
import time
from collections.abc import Callable, Mapping
from typing import Any

from modelpool.scheduling import admission, plan
from modelpool.scheduling.prediction import WaitPredictor
from modelpool.scheduling.queueing import PriorityCounts
from modelpool.scheduling.sizes import NOTHING_IN_FLIGHT
from modelpool.shared.config import PoolConfig
from modelpool.shared.errors import (
    Attempt,
    DeadlineExceeded,
    ModelLoadFailed,
    Outcome,
    PoolClosed,
    PoolError,
    WorkerCrashed,
)
from modelpool.supervisor.observe import (
    AttemptRecord,
    Observers,
    WorkerEvent,
)
from modelpool.supervisor.records import (
    DispatcherIO,
    Request,
    Run,
    TimerHeap,
    Worker,
)
from modelpool.supervisor.resolution import Resolution
from modelpool.supervisor.retries import Retries
from modelpool.supervisor.stalls import StallWatch
from modelpool.supervisor.stats import COUNTER_NAMES, DeviceStats, PoolStats, percentiles
from modelpool.supervisor.tier_watch import TierState
from modelpool.supervisor.worker_manager import WorkerManager
from modelpool.supervisor.worker_messages import WorkerMessages

logger = logging.getLogger(__name__)

_LATENCY_WINDOW = 2048


class Dispatcher:
    """Owns every worker and request record; see the module docstring."""

    def __init__(
        self,
        config: PoolConfig,
        io: DispatcherIO,
        *,
        devices: list[str],
        clock: Callable[[], float] = time.monotonic,
        on_started: Callable[[BaseException | None], None] = lambda error: None,
        on_dequeued: Callable[[], None] = lambda: None,
        gpu_available: bool = False,
        gpu_reason: str | None = "not probed",
        observers: Observers | None = None,
    ) -> None:
        self.config = config
        self.io = io
        self.clock = clock
        self.devices = devices
        self.on_started = on_started
        self.on_dequeued = on_dequeued

        self.timers = TimerHeap()
        self.queue: collections.OrderedDict[str, Request] = collections.OrderedDict()
        self.live: dict[str, Request] = {}
        self.counters: dict[str, int] = dict.fromkeys(COUNTER_NAMES, 0)
        self.counters["startup_failures"] = 0
        self.latencies: collections.deque[float] = collections.deque(maxlen=_LATENCY_WINDOW)
        self.state = "starting"
        self.failure: ModelLoadFailed | None = None
        self.closing = False
        self.finished = False
        self.crashed = False
        self.created_at = clock()
        self._attempt_ids = itertools.count(1)
        # Attached runs sent to one-call workers behind their current one (prefetch.py),
        # by attempt id in dispatch order.
        self.prefetched: dict[int, Run] = {}
        self.prefix_tiers = TierState(config)  # the latest walk of the tiers (tier_watch.py)
        self._started_reported = False
        # Observers of finished requests and worker events (observe.py), the moving
        # averages that predict a new request's wait (scheduling.prediction), and the queued
        # requests by priority: replaced whole on each change, for callers' threads to read.
        self.observers = observers or Observers()
        self.predictor = WaitPredictor()
        self.priorities = PriorityCounts()
        self.in_flight = NOTHING_IN_FLIGHT  # the runs on workers: their work (sizes.py)

        # How requests end: futures, counters, observers (resolution.py).
        self.resolution = Resolution(
            clock=clock,
            live=self.live,
            queue=self.queue,
            priorities=self.priorities,
            timers=self.timers,
            counters=self.counters,
            latencies=self.latencies,
            observers=self.observers,
            unpin=lambda request: self.retries.unpin(request),
            on_dequeued=on_dequeued,
        )
        # The worker side: slots, start-up, recycling, signals, memory (worker_manager.py). It
        # shares the clock, the timers and the counters, and holds the worker records.
        self.worker_manager = WorkerManager(
            config,
            io,
            self,
            devices=devices,
            clock=clock,
            timers=self.timers,
            counters=self.counters,
            gpu_available=gpu_available,
            gpu_reason=gpu_reason,
        )
        self.workers = self.worker_manager.workers
        # Retry or fail, and the lost-batch rules (retries.py).
        self.retries = Retries(
            config,
            clock=clock,
            timers=self.timers,
            counters=self.counters,
            queue=self.queue,
            fail=self.resolution.fail,
            end_attempt=self._end_attempt,
            may_retry=lambda: not self.closing and self.failure is None,
            another_worker_exists=self.worker_manager.another_worker_exists,
            queued=self._count_queued,
            note=self.observers.worker_event,
        )
        # What workers send: chunks, answers, errors, room reports (worker_messages.py).
        self.messages = WorkerMessages(
            clock=clock,
            counters=self.counters,
            workers=self.workers,
            predictor=self.predictor,
            resolution=self.resolution,
            retries=self.retries,
            worker_manager=self.worker_manager,
            end_attempt=self._end_attempt,
            run_ended=self._run_ended,
            soft_cancel=self._soft_cancel,
        )
        # A busy worker whose progress word stands still (stalls.py): its run times out,
        # or its whole batch is lost.
        self.stalls = StallWatch(
            config,
            clock=clock,
            timers=self.timers,
            workers=self.workers,
            counters=self.counters,
            run_stalled=lambda run: self._attempt_timed_out(run, "stall"),
            send_signal=self.worker_manager.send_signal,
            batch_lost=lambda worker, message: self.retries.batch_lost(
                worker, "timeout", message, None
            ),
        )

    @property
    def slot_count(self) -> int:
        return self.worker_manager.slot_count

    @property
    def last_load_error(self) -> str | None:
        return self.worker_manager.last_load_error

    def start(self) -> None:
        self.worker_manager.start()

    def submit(self, request: Request) -> None:
        self.counters["submitted"] += 1
        if request.future.done():  # cancelled by its caller before we saw it
            self.counters["cancelled"] += 1
            request.state = "done"
            self.resolution.dequeued(request)
            return
        self.live[request.request_id] = request
        failure = self.load_failure()
        if failure is not None:
            self.resolution.fail(request, failure)
            return
        if self.closing:
            self.resolution.fail(request, PoolClosed("the pool is closing"))
            return
        if request.due_at != math.inf:  # admitted by its predicted wait: note the prediction
            request.predicted_ttft_s = admission.predicted_ttft(
                self,
                capacity=self.config.workers * self.config.max_batch_size,
                priority=request.priority,
                size=request.size,
                spread=False,
            )
        request.state = "queued"
        self.queue[request.request_id] = request
        self._count_queued(request)
        request.deadline_timer = self.timers.call_at(
            request.deadline, self._on_request_deadline, request
        )

    def _count_queued(self, request: Request) -> None:
        """``request`` entered the queue: counted by priority, with its work as sized now."""
        request.queued_work = self.predictor.work_of(request.size)
        self.priorities.queued(request.priority, 1, request.queued_work)

    def count_overloaded(self, queue_full: bool = False) -> None:
        self.counters["overloaded"] += 1
        if queue_full:
            self.counters["queue_full"] += 1

    @property
    def free_slots(self) -> int:
        """Slots no request holds, as callers' threads may read it (no iteration over
        records another thread changes): capacity less the live requests not queued."""
        capacity = self.config.workers * self.config.max_batch_size
        queued = sum(self.priorities.waiting.values())
        return max(0, capacity - (len(self.live) - queued))

    def cancel(self, request_id: str, caller_gone: bool) -> None:
        request = self.live.get(request_id)
        if request is None or request.state == "done":
            return
        request.caller_gone = request.caller_gone or caller_gone
        if request.state in ("queued", "backoff"):
            self.queue.pop(request_id, None)
            # A preempted request waiting to run again has shown its caller this much.
            self.resolution.cancelled(request, request.shown, None)
            return
        run = request.run
        if request.state != "running" or run is None or request.cancel_requested:
            return
        if run.prefetched:
            self.resolution.cancelled(self._drop_prefetched(run), "", None)
            return
        request.cancel_requested = True
        worker = run.worker
        self._soft_cancel(worker, run, "cancel")

    def on_message(self, worker: Worker, message: tuple[Any, ...]) -> None:
        self.messages.on_message(worker, message)

    def channel_closed(self, worker: Worker) -> None:
        """The worker's socket reached end of file. Its exit normally follows within
        milliseconds (and is then a crash or a kill as usual); one that stays alive
        without a channel can never answer again and is killed."""
        self.worker_manager.channel_closed(worker)

    def protocol_error(self, worker: Worker) -> None:
        """The worker sent what the pool cannot use: it is no longer trusted."""
        self.worker_manager.send_signal(worker, signal.SIGKILL, "protocol")

    def on_exit(self, worker: Worker, returncode: int | None) -> None:
        if worker.state == "dead":
            return
        previous_state = worker.state
        worker.state = "dead"
        worker.exit_code = returncode
        self.timers.cancel(worker.ladder_timer)
        self.timers.cancel(worker.startup_timer)
        reason = self.worker_manager.record_exit(worker, previous_state)
        self.observers.worker_event(
            WorkerEvent(
                "exit",
                self.clock(),
                worker.id,
                worker.pid,
                worker.kill_reason or "",
                detail=reason,
                pool_slot=worker.slot,
            )
        )
        outcome: Outcome = "timeout" if worker.kill_reason in ("timeout", "stall") else "crash"
        if worker.slots > 1 and worker.runs:
            self.retries.batch_lost(
                worker, outcome, f"worker pid {worker.pid} {reason}", returncode
            )
        runs = list(worker.runs.values())
        worker.runs.clear()
        for lost in runs:
            self.timers.cancel(lost.deadline_timer)
            self.timers.cancel(lost.grace_timer)
        for waiting in reversed([lost for lost in runs if lost.prefetched]):
            # Never started there: back to the front of the queue, uncharged.
            if waiting.request is not None:
                self.retries.requeue(self._end_attempt(waiting, None))
        run = runs[0] if runs and not runs[0].prefetched else None
        if run is not None and run.request is not None:
            request = self._end_attempt(run, outcome)
            error = WorkerCrashed(
                f"worker pid {worker.pid} {reason} while running the request",
                exit_code=returncode,
            )
            self.retries.attempt_failed(request, worker, outcome, error)
        self.worker_manager.after_exit(worker, previous_state)

    def on_device_free(self, device: str) -> None:
        self.worker_manager.on_device_free(device)

    def on_gpu_sample(
        self,
        per_worker: Mapping[int, tuple[int | None, str, Mapping[str, int | None]]],
        devices: list[DeviceStats],
    ) -> None:
        """NVML's readings: per worker (the sum over its GPUs, the method, each GPU's figure)."""
        self.worker_manager.on_gpu_sample(per_worker, devices)

    def begin_close(self, drain: bool, deadline: float) -> None:
        if self.closing:
            return
        self.closing = True
        self.state = "closed"
        self._report_started(PoolClosed("the pool was closed while starting"))
        if drain:
            self.timers.call_at(deadline, self._abort_all)
        else:
            self._abort_all()

    def crash(self, error: BaseException) -> None:
        """The dispatcher itself failed: fail everything and take the workers down.

        The event loop stops taking commands right after, so nothing new waits on it.
        """
        for request in list(self.live.values()):
            self.resolution.fail(request, PoolError(f"the pool's dispatcher failed: {error!r}"))
        self.worker_manager.kill_all()
        self.crashed = True
        self.state = "failed"
        self._report_started(PoolError(f"the pool's dispatcher failed: {error!r}"))

    def load_failure(self) -> ModelLoadFailed | None:
        """The pool's start-up failure, as a fresh error for one more request, if it failed."""
        return None if self.failure is None else self.failure.copy()

    def next_timer_at(self) -> float | None:
        return self.timers.next_at()

    def run_due_timers(self) -> None:
        self.timers.run_due(self.clock())

    def after_event(self) -> None:
        """Bookkeeping after a batch of events: retirements, roles, dispatch, pool state."""
        self.worker_manager.retry_retirements()
        self.worker_manager.rebalance()
        self._pump()
        if (
            not self._started_reported
            and self.failure is None
            and self.worker_manager.ready_count()
            >= self.slot_count - len(self.worker_manager.abandoned_slots)
            > 0
        ):
            self._report_started(None)
        if self.closing:
            self._shutdown_workers()
            self.finished = (
                all(w.state == "dead" for w in self.workers.values())
                and self.worker_manager.pending_release_checks == 0
            )
        self.state = self._current_state()

    def snapshot(self) -> PoolStats:
        now = self.clock()
        workers = self.worker_manager.worker_stats(now)
        return PoolStats(
            state=self.state,
            workers=workers,
            queue_depth=len(self.queue),
            counters=self.counters.copy(),
            latency_s=percentiles(list(self.latencies)),
            gpu=self.worker_manager.gpu_stats(),
            uptime_s=round(now - self.created_at, 3),
            last_load_error=self.worker_manager.last_load_error,
            kill_reasons=dict(self.worker_manager.kill_reasons),
            max_model_len=self.worker_manager.max_model_len,
            task=self.worker_manager.task,
            # workers x slots, as the workers report them (a one-call backend has one)
            capacity=self.config.workers
            * max(
                (w.slots for w in list(self.workers.values()) if w.ready_at is not None),
                default=self.config.max_batch_size,
            ),
            running=sum(len(worker.running) for worker in workers),
            throughput=self.predictor.to_dict(),
            queue_by_priority={str(p): n for p, n in sorted(self.priorities.waiting.items())},
            recent_events=[event.to_dict(time.time() - now) for event in self.observers.recent],
            backend=self.config.backend,
            prefix_tiers=list(self.prefix_tiers.view.stats),
        )

    # ---- requests to workers -------------------------------------------------------------

    def _pump(self) -> None:
        """Apply the schedule (``scheduling.plan``), step by step: take back the
        prefetched runs that should not wait where they are, hand queued requests to
        workers, and with every slot taken preempt for the more urgent ones that still
        wait, handing each the slot of its victim."""
        config, retire_reason = self.config, self.worker_manager.retire_reason
        if self.prefetched:
            for run in plan.take_back(
                self.prefetched.values(),
                self.workers.values(),
                retire_reason,
                self.priorities.waiting,
                queued=len(self.queue),
                now=self.clock(),
                aging_s=config.priority_aging_s,
            ):
                self.retries.requeue(self._drop_prefetched(run))
        if not self.queue:
            return
        now = self.clock()
        placed = plan.place(
            self.queue.values(),
            list(self.workers.values()),
            config=config,
            retire_reason=retire_reason,
            waiting_by_priority=self.priorities.waiting,
            run_s=self.predictor.run_s,
            now=now,
            tier_fingerprints=self.prefix_tiers.view.fingerprints,
        )
        self._dispatch_all(placed.dispatch)
        pairs = plan.victims(
            placed,
            self.workers.values(),
            still_waiting=lambda request: request.state == "queued",
            now=now,
            aging_s=config.priority_aging_s,
            run_s=self.predictor.run_s,
        )
        for run, _ in pairs:
            self._preempt(run)
        if pairs:
            self._dispatch_all(
                plan.hand_over(
                    [run.worker for run, _ in pairs],
                    [request for _, request in pairs],
                    config=config,
                    retire_reason=retire_reason,
                )
            )

    def _dispatch_all(self, assignments: list[tuple[Request, Worker]]) -> None:
        for request, worker in assignments:
            del self.queue[request.request_id]
            self._dispatch(request, worker)

    def _preempt(self, run: Run) -> None:
        """Give ``run``'s slot to a more urgent request: cancel it, record the attempt as
        "preempted" (not charged) and queue its request again, first of its priority."""
        worker = run.worker
        run.preempted = True
        self.counters["preemptions"] += 1
        self.predictor.dispatched(preempted=True)
        self._soft_cancel(worker, run, "preempt")
        request = self._end_attempt(run, "preempted")
        request.preemptions += 1
        if request.streamed and len(request.last_partial) > len(request.shown):
            request.shown = request.last_partial  # what its caller has seen (rerun: all of it)
        self.retries.requeue(request)

    def _dispatch(self, request: Request, worker: Worker) -> None:
        now = self.clock()
        attempt_deadline = request.deadline
        if self.config.attempt_timeout_s is not None:
            attempt_deadline = min(attempt_deadline, now + self.config.attempt_timeout_s)
        assert worker.io is not None
        run = Run(
            attempt_id=next(self._attempt_ids),
            request=request,
            owner=request,
            worker=worker,
            slot=worker.free_slot(),
            started_at=now,
            deadline=attempt_deadline,
            alone=worker.slots > 1 and request.isolated,
            skip=request.shown,
            prefetched=worker.slots == 1 and bool(worker.runs),
            work=request.queued_work,
        )
        started_at = None if run.prefetched else now
        self.in_flight = self.in_flight.sent(run.work, started_at=started_at)
        if not worker.runs:
            # One-call workers: the stall clock starts at the first progress after the worker
            # became busy (a long prefill is not a stall). A batched worker's starts now: its
            # requests must see a token within stall_timeout_s, prefill included, or a request
            # that hangs before its first token would only ever meet its deadline.
            worker.progress_seen = worker.io.progress()
            worker.progress_at = now if worker.slots > 1 else None
        if request.first_dispatch_at is None:
            request.first_dispatch_at = now
        run.record = AttemptRecord(run.attempt_id, worker.id, worker.pid, now)
        request.attempt_log.append(run.record)
        if not run.prefetched:  # a prefetched one still counts against max_queue
            self.resolution.dequeued(request)
        self.priorities.queued(request.priority, -1, request.queued_work)
        self.priorities.dispatched_one(request.priority)
        self.predictor.dispatched(preempted=False)
        request.state = "running"
        request.run = run
        worker.state = "busy"
        worker.runs[run.attempt_id] = run
        worker.io.send(("run", run.attempt_id, run.slot, request.payload))
        if run.prefetched:
            self.prefetched[run.attempt_id] = run  # its attempt deadline starts in _promote
        elif attempt_deadline < request.deadline:
            run.deadline_timer = self.timers.call_at(
                attempt_deadline, self._attempt_timed_out, run, "timeout"
            )
        # Else the request's own deadline timer ends the attempt (_on_request_deadline),
        # at the same time and the same way: one timer per request, not two.
        self.stalls.watch()

    def _drop_prefetched(self, run: Run) -> Request:
        """Detach a prefetched run, unstarted and uncharged: its cancel word makes the worker
        answer it "cancelled" without running it, an answer nobody waits for."""
        assert run.worker.io is not None
        run.worker.io.request_cancel(run.slot, run.attempt_id)
        run.cancel_sent = run.recalled = True
        request = run.request
        assert request is not None
        partial = request.last_partial  # an earlier attempt's text, not this empty one's
        self._end_attempt(run, None)
        request.last_partial = partial
        return request

    def _promote(self, worker: Worker) -> None:
        """The one-call worker answered its current run and goes on to its prefetched one:
        that attempt starts now (its deadline, its stall clock)."""
        run = next(iter(worker.runs.values()))
        if not run.prefetched:
            return
        run.prefetched = False
        self.prefetched.pop(run.attempt_id, None)
        now = run.started_at = self.clock()
        self.in_flight = self.in_flight.started_one(now)
        if run.record is not None:
            run.record.started_at = now
        assert worker.io is not None
        worker.progress_seen = worker.io.progress()
        worker.progress_at = None
        self.stalls.watch()  # the checks stop when no run is attached: this one is now
        request = run.request
        if request is None:
            return
        self.resolution.dequeued(request)  # out of max_queue's count now that it runs
        if self.config.attempt_timeout_s is not None:
            run.deadline = min(request.deadline, now + self.config.attempt_timeout_s)
            if run.deadline < request.deadline:
                run.deadline_timer = self.timers.call_at(
                    run.deadline, self._attempt_timed_out, run, "timeout"
                )

    def _run_ended(self, worker: Worker, run: Run) -> None:
        """The worker answered ``run``: its slot is free; with none left running the worker
        is warm and idle again, unless on its way out."""
        self.timers.cancel(run.deadline_timer)
        self.timers.cancel(run.grace_timer)
        worker.runs.pop(run.attempt_id, None)
        if run.attempt_id in worker.waiting_attempts:
            worker.waiting_attempts = worker.waiting_attempts - {run.attempt_id}
        if worker.state not in ("busy", "cancelling"):
            return
        if worker.runs:
            if not run.prefetched:
                self._promote(worker)
            self._update_busy_state(worker)
            return
        worker.state = "idle"
        if self.slot_count == 1:
            self.retries.fail_pinned_retries(worker)
        self.worker_manager.maybe_retire(worker)

    def _update_busy_state(self, worker: Worker) -> None:
        """ "cancelling" once every running attempt on it was asked to stop, else "busy".
        A preempted run does not count: its worker stays open for the urgent request."""
        if worker.state in ("busy", "cancelling"):
            runs = [run for run in worker.runs.values() if not run.preempted and not run.prefetched]
            cancelling = bool(runs) and all(run.cancel_sent for run in runs)
            worker.state = "cancelling" if cancelling else "busy"

    # ---- deadlines, stalls, the kill ladder ----------------------------------------------

    def _on_request_deadline(self, request: Request) -> None:
        run = request.run
        if request.state == "running" and run is not None and not run.prefetched:
            self._attempt_timed_out(run, "timeout")
            return
        if request.state == "running" and run is not None:
            self._drop_prefetched(run)  # on a worker, not started: as if still queued
        elif request.state in ("queued", "backoff"):
            self.queue.pop(request.request_id, None)
        else:
            return
        self.counters["timeouts"] += 1
        message = "deadline passed before a worker could finish the request"
        self.resolution.fail(request, DeadlineExceeded(message, partial_text=request.last_partial))

    def _attempt_timed_out(self, run: Run, reason: str) -> None:
        request = run.request
        worker = run.worker
        if request is None or worker.runs.get(run.attempt_id) is not run:
            return
        now = self.clock()
        self._end_attempt(run, "timeout")
        self.counters["stalls" if reason == "stall" else "timeouts"] += 1
        self._soft_cancel(worker, run, reason)
        if reason == "stall":
            message = f"worker pid {worker.pid} made no progress for {self.config.stall_timeout_s}s"
        elif now >= request.deadline:
            message = f"deadline of the request passed after {now - request.submitted_at:.3f}s"
        else:
            message = f"attempt timed out after {self.config.attempt_timeout_s}s"
        error = DeadlineExceeded(message, partial_text=request.last_partial)
        self.retries.attempt_failed(request, worker, "timeout", error)

    def _soft_cancel(self, worker: Worker, run: Run, reason: str) -> None:
        """Set the run's cancel flag; if the worker has not answered after the grace, escalate.

        In a batch only that request leaves (at the worker's next step); the others and
        the warm worker go on."""
        assert worker.io is not None
        worker.io.request_cancel(run.slot, run.attempt_id)
        run.cancel_sent = True
        self._update_busy_state(worker)
        self.timers.cancel(run.grace_timer)
        run.grace_timer = self.timers.call_at(
            self.clock() + self.config.cancel_grace_s,
            self._on_cancel_grace_over,
            worker,
            run,
            reason,
        )

    def _on_cancel_grace_over(self, worker: Worker, run: Run, reason: str) -> None:
        if worker.runs.get(run.attempt_id) is not run or worker.state == "dead":
            return
        if worker.signalled:
            return  # already on its way down
        request = run.request
        if request is not None:
            # A user's cancel the backend did not honour: the caller gets what exists now.
            self.counters["cancel_escalations"] += 1
            self._end_attempt(run, "cancelled")
            self.resolution.cancelled(request, run.partial_text(), worker.pid)
        logger.warning(
            "worker %d (pid %s) ignored the cancel flag for %.1fs (%s): terminating",
            worker.id,
            worker.pid,
            self.config.cancel_grace_s,
            reason,
        )
        # Signalled first: a worker on its way out is what tells ``another_worker_exists``
        # that a replacement will take its slot, so that with one worker and no spare its
        # batch-mates are retried rather than failed.
        self.worker_manager.send_signal(worker, signal.SIGTERM, reason)
        if worker.slots > 1:
            self.retries.batch_lost(
                worker,
                "timeout",
                f"worker pid {worker.pid} ignored a cancel for {self.config.cancel_grace_s}s",
                None,
            )

    # ---- attempts end (retry or fail is retries.py) -----------------------------------

    def _end_attempt(self, run: Run, outcome: Outcome | None) -> Request:
        """Close ``run``'s attempt: record it on its request, detach the two, keep its text.
        Outcome None: the worker refused the request, which records no attempt.

        The attempt's deadline timer goes with it: a timer must not keep a request that
        already moved on (to a retry, or to its caller) alive until the old deadline.
        """
        request = run.request
        assert request is not None
        run.request = None
        request.run = None
        started_at = None if run.prefetched else run.started_at
        self.in_flight = self.in_flight.ended(run.work, started_at=started_at)
        self.prefetched.pop(run.attempt_id, None)
        self.timers.cancel(run.deadline_timer)
        if run.record is not None:
            run.record.ended_at = self.clock()
            run.record.outcome = outcome
        if outcome is not None:
            request.attempts.append(Attempt(run.worker.pid, outcome, self.clock() - run.started_at))
        request.last_partial = run.partial_text()
        return request

    def _abort_all(self) -> None:
        for request in list(self.live.values()):
            run = request.run
            if run is not None and run.worker.runs.get(run.attempt_id) is run:
                run.request = None
                self.prefetched.pop(run.attempt_id, None)
                self._soft_cancel(run.worker, run, "close")
            self.resolution.fail(request, PoolClosed("the pool closed before the request finished"))

    def _shutdown_workers(self) -> None:
        """Once nothing is in flight: idle workers are asked to exit, starting ones killed;
        busy ones are already on their cancel ladder and are asked once they answer."""
        if not self.closing or self.live:
            return
        for worker in list(self.workers.values()):
            if worker.state == "idle":
                self.worker_manager.stop_worker(worker)
            elif worker.state == "starting" and not worker.signalled:
                self.worker_manager.send_signal(worker, signal.SIGKILL, "close")

    # ---- pool state ----------------------------------------------------------------------

    def _current_state(self) -> str:
        if self.closing:
            return "closed"
        if self.failure is not None or self.crashed:
            return "failed"
        if not self._started_reported:
            return "starting"
        if self.worker_manager.blocked_devices or self.worker_manager.abandoned_slots:
            return "degraded"
        return "ready"

    def give_up_loading(self, failure: ModelLoadFailed) -> None:
        """Workers failed to start too often and none serves (``WorkerManager.startup_failed``):
        the pool has failed, and so does every request still waiting for a worker."""
        self.failure = failure
        self.state = "failed"
        for request in list(self.live.values()):
            if request.state in ("queued", "backoff"):
                self.resolution.fail(request, self.failure.copy())
        for other in self.workers.values():
            if other.state == "starting":
                self.worker_manager.send_signal(other, signal.SIGKILL, "startup_abandoned")
        self._report_started(self.failure)

    def _report_started(self, error: BaseException | None) -> None:
        if not self._started_reported:
            self._started_reported = True
            self.on_started(error)
