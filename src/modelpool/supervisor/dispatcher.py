"""The dispatcher: every decision about requests and workers, and no I/O.

``Dispatcher`` is the single owner of all worker and request state (the records in
``records.py``); it only runs on the dispatcher thread (``supervisor.EventLoop``) and so
needs no locks. It never touches a socket or a process itself: it asks its ``io`` (the
event loop in production, a recording fake in the property tests) to spawn, send, flag,
signal and check, and its clock is injected, so tests drive this very code with a fake
world.

Four parts, as pebble splits its pool into a task manager and a worker manager: this
file keeps requests, attempts and runs; its ``worker_manager`` (``worker_manager.py``, an
object it owns and that calls back only ``give_up_loading``) keeps the worker records
and the decisions about processes: slots and start-up, recycling and roles, signals,
memory release checks; its ``retries`` (``retries.py``) decide retry or fail for a
failed attempt and settle a lost batch; its ``stalls`` (``stalls.py``) find the busy
workers whose progress stands still. All run on the same thread and share the clock,
the timer heap and the counters.

The entry points come first, in the order of a request's life (``submit``, ``cancel``,
``on_message``, ``on_exit``, ``on_device_free`` ...; the event loop calls
``run_due_timers`` and ``after_event`` on every turn); the helpers follow, grouped by
what they decide: handing requests to workers, what workers send, deadlines and the run
end of the kill ladder, attempts' end, resolution, closing.

Batching (``max_batch_size`` above 1): a worker holds up to ``Worker.slots`` runs (and
beside them the preempted ones still winding down: ``_hand_over``);
``_pump`` hands the queue to the rules of ``placement.py`` (least loaded, then most free
KV room; an isolated request gets an empty worker; suspects are spread one per worker;
a worker whose requests wait there for KV room takes no more), and ``_on_room`` asks
back a request that waits for room while another worker has some. Deadlines and
cancels act on one run (its slot's cancel word); a stall (``StallWatch.batch_stalled``:
no token delivered), an ignored cancel or a death settle the whole batch through
``Retries.batch_lost`` (collateral retries, poison isolation), after signalling the
worker, so that its replacement counts as another worker; ``_on_batch_error`` settles
the rows of a step that failed in a worker that goes on the same way.

Preemption (``preempt_for_priority``): ``_pump`` asks ``preemption.py`` which running
attempts give way to more urgent requests once no open worker has a slot; ``_preempt``
cancels each and queues its request again, and ``_on_chunk`` / ``_on_done`` keep a
rerun from streaming again what its caller saw (``Run.skip``).

Prefetch (``max_batch_size`` 1, ``prefetch.py``): a busy one-call worker holds one run
more (several when runs are far shorter than a wake-up), not started; ``_promote``
starts the next when the worker answers, ``_drop_prefetched`` ends one unrun (cancel,
deadline, taken back in ``_pump``), ``on_exit`` requeues them.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import signal
import time
from collections.abc import Callable, Mapping
from typing import Any

from modelpool.scheduling import placement, preemption, prefetch
from modelpool.scheduling.queueing import PriorityCounts, WaitPredictor, dispatch_order
from modelpool.shared.config import PoolConfig
from modelpool.shared.errors import (
    Attempt,
    BackendError,
    DeadlineExceeded,
    ModelLoadFailed,
    Outcome,
    PoolClosed,
    PoolError,
    WorkerCrashed,
)
from modelpool.shared.protocol import Generation, PrefixCacheReport, TokenCounts
from modelpool.supervisor.observe import (
    AttemptRecord,
    Observers,
    RequestStatus,
    WorkerEvent,
)
from modelpool.supervisor.records import (
    DispatcherIO,
    Request,
    Run,
    TimerHeap,
    Worker,
    request_record,
)
from modelpool.supervisor.results import set_future
from modelpool.supervisor.retries import Retries
from modelpool.supervisor.stalls import StallWatch
from modelpool.supervisor.stats import COUNTER_NAMES, DeviceStats, PoolStats, percentiles
from modelpool.supervisor.worker_errors import typed_backend_error, worker_refusal
from modelpool.supervisor.worker_manager import WorkerManager

logger = logging.getLogger(__name__)
worker_logger = logging.getLogger("modelpool.worker")

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
        self._started_reported = False
        # Observers of finished requests and worker events (observe.py), the moving
        # averages that predict a new request's wait (queueing.py), and the queued
        # requests by priority: replaced whole on each change, for callers' threads to read.
        self.observers = observers or Observers()
        self.predictor = WaitPredictor()
        self.priorities = PriorityCounts()

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
            fail=self._fail,
            end_attempt=self._end_attempt,
            may_retry=lambda: not self.closing and self.failure is None,
            another_worker_exists=self.worker_manager.another_worker_exists,
            queued=lambda request: self.priorities.queued(request.priority, 1),
            note=self.observers.worker_event,
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
            self._dequeued(request)
            return
        self.live[request.request_id] = request
        failure = self.load_failure()
        if failure is not None:
            self._fail(request, failure)
            return
        if self.closing:
            self._fail(request, PoolClosed("the pool is closing"))
            return
        request.state = "queued"
        self.queue[request.request_id] = request
        self.priorities.queued(request.priority, 1)
        request.deadline_timer = self.timers.call_at(
            request.deadline, self._on_request_deadline, request
        )

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
            self._resolve_cancelled(request, request.shown, None)
            return
        run = request.run
        if request.state != "running" or run is None or request.cancel_requested:
            return
        if run.prefetched:
            self._resolve_cancelled(self._drop_prefetched(run), "", None)
            return
        request.cancel_requested = True
        worker = run.worker
        self._soft_cancel(worker, run, "cancel")

    def on_message(self, worker: Worker, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "chunk":
            self._on_chunk(worker, *message[1:])
        elif kind == "done":
            self._on_done(worker, message[1], message[2], message[3])
        elif kind == "error":
            self._on_error(worker, *message[1:])
        elif kind == "batch_error":
            self._on_batch_error(worker, *message[1:])
        elif kind == "room":
            self._on_room(worker, message[1], message[2])
        elif kind == "withdrawn":
            self._on_withdrawn(worker, message[1])
        elif kind == "prefix_cache" and isinstance(message[1], PrefixCacheReport):
            worker.prefix_cache = message[1]
        elif kind == "log":
            _, levelno, name, text = message
            worker_logger.log(
                levelno, "[worker %d pid %s] %s: %s", worker.id, worker.pid, name, text
            )
        elif kind == "ready":
            self.worker_manager.on_ready(worker, *message[1:])
        elif kind == "load_failed":
            worker.load_error = message[1]
        else:
            logger.warning("worker %d sent an unknown message kind %r", worker.id, kind)

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
            self._fail(request, PoolError(f"the pool's dispatcher failed: {error!r}"))
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
        )

    # ---- requests to workers -------------------------------------------------------------

    def _pump(self) -> None:
        """Hand queued requests to workers, by the rules of ``placement.py``, after taking
        back the prefetched runs that should not wait where they are (``prefetch.py``);
        with every slot taken, preempt for the more urgent ones that still wait
        (``preemption.py``)."""
        if self.prefetched:
            by_priority = self.priorities.waiting
            for run in prefetch.recalls(
                self.prefetched.values(),
                self.workers.values(),
                self.worker_manager.retire_reason,
                min(by_priority) if by_priority else None,
                queued=len(self.queue),
                now=self.clock(),
                aging_s=self.config.priority_aging_s,
            ):
                self.retries.requeue(self._drop_prefetched(run))
        if not self.queue:
            return
        may_preempt = self.config.preempt_for_priority and preemption.worth_looking(
            self.priorities.waiting, self.workers.values()
        )
        # While a waiting request could preempt, nothing is prefetched: an urgent request
        # held behind a less urgent run would wait for it instead of taking its slot.
        capacity = _slots_only if may_preempt else self._capacities()
        open_workers = placement.open_workers(
            self.workers.values(), self.worker_manager.retire_reason, capacity
        )
        if not open_workers and not may_preempt:
            return
        now = self.clock()
        order = dispatch_order(
            self.queue.values(),
            now=now,
            aging_s=self.config.priority_aging_s,
            priorities=len(self.priorities.waiting),
        )
        for request, worker in placement.assign(order, open_workers, capacity):
            del self.queue[request.request_id]
            self._dispatch(request, worker)
        if not may_preempt or any(len(w.runs) < w.slots for w in open_workers):
            return  # a free slot left: what still waits waits for a rule, not a slot
        waiting = [request for request in order if request.state == "queued"]
        pairs = preemption.choose_victims(
            waiting,
            self.workers.values(),
            now=now,
            aging_s=self.config.priority_aging_s,
            min_time_left_s=2 * self.predictor.run_s,
        )
        for run, _ in pairs:
            self._preempt(run)
        if pairs:
            self._hand_over([run.worker for run, _ in pairs], [request for _, request in pairs])

    def _hand_over(self, workers: list[Worker], requests: list[Request]) -> None:
        """Send ``requests`` to the workers of the runs just preempted for them, now, into
        the slots those runs are letting go (``preemption.handover_capacity``), by
        placement's rules: a request a worker may not take there waits for a slot as before."""
        retire_reason = self.worker_manager.retire_reason

        def capacity(worker: Worker) -> int:
            return preemption.handover_capacity(worker, self.config, retire_reason)

        open_workers = placement.open_workers(dict.fromkeys(workers), retire_reason, capacity)
        for request, worker in placement.assign(requests, open_workers, capacity):
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

    def _capacities(self) -> Callable[[Worker], int]:
        """The runs each worker may hold now (``prefetch.capacity``), worked out once for
        a pump: placement asks it for every worker, more than once."""
        prefetched = prefetch.depth(self.predictor.run_s)
        retire_reason = self.worker_manager.retire_reason
        held = {
            worker.id: prefetch.capacity(worker, self.config, retire_reason, prefetched)
            for worker in self.workers.values()
        }
        return lambda worker: held[worker.id]

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
        )
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
            self._dequeued(request)
        self.priorities.queued(request.priority, -1)
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

    def _dequeued(self, request: Request) -> None:
        if request.counted_as_queued:
            request.counted_as_queued = False
            self.on_dequeued()

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
        if run.record is not None:
            run.record.started_at = now
        assert worker.io is not None
        worker.progress_seen = worker.io.progress()
        worker.progress_at = None
        self.stalls.watch()  # the checks stop when no run is attached: this one is now
        request = run.request
        if request is None:
            return
        self._dequeued(request)  # out of max_queue's count now that it runs
        if self.config.attempt_timeout_s is not None:
            run.deadline = min(request.deadline, now + self.config.attempt_timeout_s)
            if run.deadline < request.deadline:
                run.deadline_timer = self.timers.call_at(
                    run.deadline, self._attempt_timed_out, run, "timeout"
                )

    # ---- what workers send ---------------------------------------------------------------

    def _current_run(self, worker: Worker, attempt_id: int) -> Run | None:
        return worker.runs.get(attempt_id)

    def _on_chunk(
        self, worker: Worker, attempt_id: int, text: str, counts: TokenCounts | None = None
    ) -> None:
        run = self._current_run(worker, attempt_id)
        if run is None:
            return
        run.chunks.append(text)
        if run.first_token_at is None:
            run.first_token_at = now = self.clock()
            if run.record is not None:
                run.record.first_token_at = now
            if run.owner.first_token_at is None:
                run.owner.first_token_at = now
        if run.request is None:
            return
        if run.skip:  # a rerun after a preemption: what its caller saw is not sent twice
            verdict, text = preemption.continue_stream(run, text)
            if verdict == "diverged":
                self._soft_cancel(worker, run, "diverged")
                self._rerun_diverged(run)
                return
            if not text:
                return
        self._deliver_chunk(run.request, text, counts)

    def _rerun_diverged(self, run: Run) -> None:
        """A preempted request's rerun gave other text than its caller was shown: its
        stream cannot go on as one answer, so the request fails (and is not retried)."""
        request = self._end_attempt(run, "error")
        message = f"preempted, then rerun on worker pid {run.worker.pid} with other text"
        self._fail(request, BackendError(f"{message} than it had streamed (not deterministic)"))

    def _deliver_chunk(
        self, request: Request, text: str, counts: TokenCounts | None = None
    ) -> None:
        if request.on_chunk is None or request.caller_gone:
            return
        request.streamed = True
        try:
            if request.counted_chunks:
                request.on_chunk(text, counts)
            else:
                request.on_chunk(text)
        except Exception:
            logger.exception(
                "request %s: the stream consumer's callback failed", request.request_id
            )

    def _on_done(
        self, worker: Worker, attempt_id: int, generation: Generation, rss_bytes: int
    ) -> None:
        worker.rss_bytes = rss_bytes
        run = self._current_run(worker, attempt_id)
        if run is None:
            return
        if not run.recalled or generation.finish_reason != "cancelled":
            # Taken back but already started there (its cancel word came too late): a
            # request it served all the same, for max_requests_per_worker.
            worker.requests += 1
        self._run_ended(worker, run)
        request = run.request
        if request is None:
            return
        cancelled = request.cancel_requested or generation.finish_reason == "cancelled"
        if not cancelled and run.skip and not generation.text.startswith(run.skip):
            self._rerun_diverged(run)
            return
        self._end_attempt(run, "cancelled" if cancelled else "ok")
        if not cancelled:
            self.predictor.observe(
                run_s=self.clock() - run.started_at,
                ttft_s=None if run.first_token_at is None else run.first_token_at - run.started_at,
                prompt_tokens=generation.prompt_tokens,
                completion_tokens=generation.completion_tokens,
            )
        if cancelled:
            self._resolve_cancelled(request, generation.text, worker.pid, generation)
            return
        if request.on_chunk is not None:
            # A backend may return text it never emitted; a stream still gets all of it.
            sent = run.skip or run.partial_text()
            if len(generation.text) > len(sent) and generation.text.startswith(sent):
                self._deliver_chunk(request, generation.text[len(sent) :])
        self._succeed(request, generation, worker.pid)

    def _on_room(self, worker: Worker, kv_free_tokens: int, waiting: list[int]) -> None:
        """A batched worker's room report. A request that waits there for KV room while
        another worker has a free slot and nobody waiting is asked back, to be placed
        again: it must not wait behind another request's generation."""
        worker.kv_free_tokens = kv_free_tokens
        worker.waiting_attempts = frozenset(waiting)
        if not waiting or worker.io is None:
            return
        if not placement.room_elsewhere(
            worker, self.workers.values(), self.worker_manager.retire_reason
        ):
            return
        for attempt_id in waiting:
            run = worker.runs.get(attempt_id)
            if run is not None and run.request is not None and not run.withdraw_sent:
                run.withdraw_sent = True
                worker.io.send(("withdraw", attempt_id))

    def _on_withdrawn(self, worker: Worker, attempt_id: int) -> None:
        """The worker gave back an unstarted attempt: no attempt is recorded, the request
        goes back to the front of the queue, to another worker than that one."""
        run = self._current_run(worker, attempt_id)
        if run is None:
            return
        self._run_ended(worker, run)
        request = run.request
        if request is None:
            return
        self._end_attempt(run, None)
        self.counters["withdrawn"] += 1
        request.last_failed_worker = worker.id
        self.retries.requeue(request)

    def _on_error(
        self,
        worker: Worker,
        attempt_id: int,
        kind: str,
        text: str,
        remote_traceback: str,
        rss_bytes: int,
        detail: tuple[int, int | None, int] | Mapping[str, Any] | None = None,
    ) -> None:
        worker.rss_bytes = rss_bytes
        run = self._current_run(worker, attempt_id)
        if run is None:
            return
        worker.requests += 1
        details: Mapping[str, Any] = detail if isinstance(detail, Mapping) else {}
        self.worker_manager.after_backend_error(worker, kind, text, details)
        self._run_ended(worker, run)
        request = run.request
        if request is None:
            return
        if kind in ("invalid", "context_length", "grammar"):
            # A refusal is the request's fault, not the attempt's: no failed attempt is
            # recorded and nothing is retried (another worker would refuse it the same way).
            self._end_attempt(run, None)
            self._fail(request, worker_refusal(text, detail))
            return
        outcome, error = typed_backend_error(worker, kind, text, remote_traceback, details)
        self._end_attempt(run, outcome)
        self.retries.attempt_failed(request, worker, outcome, error)

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
        self._fail(request, DeadlineExceeded(message, partial_text=request.last_partial))

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
            self._resolve_cancelled(request, run.partial_text(), worker.pid)
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

    def _on_batch_error(
        self,
        worker: Worker,
        attempt_ids: list[int],
        kind: str,
        text: str,
        remote_traceback: str,
        rss_bytes: int,
        details: Mapping[str, Any],
    ) -> None:
        """A batched step failed and the worker could not blame one request: those that
        were in it are a lost batch (retried as collateral, suspects tracked, as after a
        death), never each one's charged error. The worker stays warm for the rest."""
        worker.rss_bytes = rss_bytes
        runs = [run for i in attempt_ids if (run := self._current_run(worker, i)) is not None]
        if not runs:
            return
        worker.requests += len(runs)
        self.worker_manager.after_backend_error(worker, kind, text, details)
        self.retries.batch_lost(
            worker,
            typed_backend_error(worker, kind, text, remote_traceback, details)[0],
            f"a batched step failed on worker pid {worker.pid}: {text}",
            None,
            runs=runs,
            backend_error=lambda: typed_backend_error(
                worker, kind, text, remote_traceback, details
            )[1],
        )
        for run in runs:
            self._run_ended(worker, run)

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
        self.prefetched.pop(run.attempt_id, None)
        self.timers.cancel(run.deadline_timer)
        if run.record is not None:
            run.record.ended_at = self.clock()
            run.record.outcome = outcome
        if outcome is not None:
            request.attempts.append(Attempt(run.worker.pid, outcome, self.clock() - run.started_at))
        request.last_partial = run.partial_text()
        return request

    # ---- resolution ----------------------------------------------------------------------

    def _finish(self, request: Request) -> bool:
        if request.state == "done":
            return False
        if request.state == "queued":
            self.priorities.queued(request.priority, -1)
        if request.state in ("queued", "backoff"):
            self.queue.pop(request.request_id, None)
        request.state = "done"
        request.run = None
        self.timers.cancel(request.deadline_timer)
        self.retries.unpin(request)
        self.live.pop(request.request_id, None)
        self._dequeued(request)
        return True

    def _succeed(self, request: Request, generation: Generation, worker_pid: int | None) -> None:
        if not self._finish(request):
            return
        PoolStats.count_completed(self.counters, generation.thinking_closed)
        result = request.result(generation, worker_pid, self.clock())
        self.latencies.append(result.latency_s)
        # Observed first: a caller that has its answer finds it in the metrics.
        self._observe(request, "completed", generation)
        set_future(request.future, result)

    def _resolve_cancelled(
        self,
        request: Request,
        text: str,
        worker_pid: int | None,
        generation: Generation | None = None,
    ) -> None:
        if not self._finish(request):
            return
        self.counters["cancelled"] += 1
        if generation is None:
            generation = Generation(text, "cancelled")
        else:
            generation = dataclasses.replace(generation, text=text, finish_reason="cancelled")
        self._observe(request, "cancelled", generation)
        set_future(request.future, request.result(generation, worker_pid, self.clock()))

    def _fail(self, request: Request, error: PoolError) -> None:
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

    def _abort_all(self) -> None:
        for request in list(self.live.values()):
            run = request.run
            if run is not None and run.worker.runs.get(run.attempt_id) is run:
                run.request = None
                self.prefetched.pop(run.attempt_id, None)
                self._soft_cancel(run.worker, run, "close")
            self._fail(request, PoolClosed("the pool closed before the request finished"))

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
                self._fail(request, self.failure.copy())
        for other in self.workers.values():
            if other.state == "starting":
                self.worker_manager.send_signal(other, signal.SIGKILL, "startup_abandoned")
        self._report_started(self.failure)

    def _report_started(self, error: BaseException | None) -> None:
        if not self._started_reported:
            self._started_reported = True
            self.on_started(error)


def _slots_only(worker: Worker) -> int:
    """The runs ``worker`` may hold when nothing is to be prefetched: its slots."""
    return worker.slots
