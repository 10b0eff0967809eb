"""The dispatcher: every decision about requests and workers, and no I/O.

``Dispatcher`` is the single owner of all worker and request state (the records in
``records.py``); it only runs on the dispatcher thread (``supervisor.EventLoop``) and so
needs no locks. It never touches a socket or a process itself: it asks its ``io`` (the
event loop in production, a recording fake in the property tests) to spawn, send, flag,
signal and check, and its clock is injected, so tests drive this very code with a fake
world.

The entry points come first, in the order of a request's life (``submit``, ``cancel``,
``on_message``, ``on_exit``, ``on_release_checked`` ...; the event loop calls
``run_due_timers`` and ``after_event`` on every turn); the helpers follow, grouped by
what they decide: handing requests to workers, what workers send, deadlines and the kill
ladder, retry or fail, resolution, slots and start-up, recycling, closing.

Batching (``max_batch_size`` above 1): a worker holds up to ``Worker.slots`` runs;
``_pump``/``_place`` fill the least-loaded worker first, give an isolated request an
empty worker and spread suspects one per worker. Deadlines and cancels act on one run
(its slot's cancel word); ``_worker_stalled`` (no token delivered), an ignored cancel or
a death settle the whole batch through ``_batch_lost`` (collateral retries, poison
isolation). The file is past 1,000 lines because these rules share every record with
the unbatched ones; splitting them out would mean a second owner of the same state.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import signal
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

from modelpool.config import PoolConfig
from modelpool.errors import (
    Attempt,
    BackendError,
    ContextLengthExceeded,
    CudaError,
    DeadlineExceeded,
    InvalidRequest,
    ModelLoadFailed,
    Outcome,
    OutOfMemory,
    PoisonRequest,
    PoolClosed,
    PoolError,
    WorkerCrashed,
)
from modelpool.gpu import group_devices
from modelpool.protocol import PROTOCOL_VERSION, Generation, WorkerSpec
from modelpool.records import (
    DispatcherIO,
    Request,
    Run,
    Timer,
    TimerHeap,
    Worker,
    describe_exit,
)
from modelpool.results import Result, set_future
from modelpool.stats import (
    COUNTER_NAMES,
    DeviceStats,
    GpuStats,
    PoolStats,
    ReleaseStats,
    WorkerStats,
    percentiles,
)

logger = logging.getLogger(__name__)
worker_logger = logging.getLogger("modelpool.worker")

_LATENCY_WINDOW = 2048
# A worker that dies on its own this soon after saying ready counts as a failed start
# (backoff, then ModelLoadFailed or an abandoned slot), like one that never got ready.
EARLY_DEATH_S = 5.0


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
    ) -> None:
        self.config = config
        self.io = io
        self.clock = clock
        self.devices = devices
        self.on_started = on_started
        self.on_dequeued = on_dequeued
        self.gpu_available = gpu_available
        self.gpu_reason = gpu_reason
        self.gpu_devices: list[DeviceStats] = []

        self.workers: dict[int, Worker] = {}
        self.queue: collections.OrderedDict[str, Request] = collections.OrderedDict()
        self.live: dict[str, Request] = {}
        self.counters: dict[str, int] = dict.fromkeys(COUNTER_NAMES, 0)
        self.counters["startup_failures"] = 0
        self.kill_reasons: collections.Counter[str] = collections.Counter()
        self.latencies: collections.deque[float] = collections.deque(maxlen=_LATENCY_WINDOW)
        self.releases = ReleaseStats()
        self.blocked_devices: dict[str, int] = {}  # GPU -> bytes it must have free again
        self.blocked_held: dict[str, int | None] = {}  # GPU -> bytes a dead worker still held
        self.blocked_holders: dict[str, list[str]] = {}  # GPU -> who holds them, as found
        self.abandoned_slots: set[int] = set()
        self.slot_not_before: dict[int, float] = {}
        self.slots_awaiting_release: set[int] = set()
        self.retire_waiting: set[int] = set()
        # worker id -> the retries that must not go back to it (their last failed worker):
        # so that finding them costs their number, not the length of the queue.
        self.retries_avoiding: dict[int, dict[str, Request]] = {}
        self.state = "starting"
        self.failure: ModelLoadFailed | None = None
        self.last_load_error: str | None = None
        # The model's context length as the workers report it (the smallest, should they
        # ever differ); kept when they leave, so stats still show it between respawns.
        self.max_model_len: int | None = None
        self.consecutive_startup_failures = 0
        self.closing = False
        self.finished = False
        self.crashed = False
        self.pending_release_checks = 0
        self.created_at = clock()

        self.timers = TimerHeap()
        self._worker_ids = itertools.count()
        self._attempt_ids = itertools.count(1)
        self._stall_timer: Timer | None = None
        self._started_reported = False

    def start(self) -> None:
        for slot in range(self.slot_count):
            self._spawn(slot, replacement=False)

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
        request.deadline_timer = self.timers.call_at(
            request.deadline, self._on_request_deadline, request
        )

    def count_overloaded(self) -> None:
        self.counters["overloaded"] += 1

    def cancel(self, request_id: str, caller_gone: bool) -> None:
        request = self.live.get(request_id)
        if request is None or request.state == "done":
            return
        request.caller_gone = request.caller_gone or caller_gone
        if request.state in ("queued", "backoff"):
            self.queue.pop(request_id, None)
            self._resolve_cancelled(request, "", None)
            return
        run = request.run
        if request.state != "running" or run is None or request.cancel_requested:
            return
        request.cancel_requested = True
        worker = run.worker
        self._soft_cancel(worker, run, "cancel")

    def on_message(self, worker: Worker, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "chunk":
            self._on_chunk(worker, message[1], message[2])
        elif kind == "done":
            self._on_done(worker, message[1], message[2], message[3])
        elif kind == "error":
            self._on_error(worker, *message[1:])
        elif kind == "log":
            _, levelno, name, text = message
            worker_logger.log(
                levelno, "[worker %d pid %s] %s: %s", worker.id, worker.pid, name, text
            )
        elif kind == "ready":
            self._on_ready(worker, *message[1:])
        elif kind == "load_failed":
            worker.load_error = message[1]
        else:
            logger.warning("worker %d sent an unknown message kind %r", worker.id, kind)

    def channel_closed(self, worker: Worker) -> None:
        """The worker's socket reached end of file. Its exit normally follows within
        milliseconds (and is then a crash or a kill as usual); one that stays alive
        without a channel can never answer again and is killed."""
        if worker.state == "dead":
            return
        if worker.state == "idle":
            worker.state = "killing"  # nothing more is sent to it
        self.timers.call_at(self.clock() + 1.0, self._kill_if_alive, worker, "channel_closed")

    def protocol_error(self, worker: Worker) -> None:
        """The worker sent what the pool cannot use: it is no longer trusted."""
        self._signal(worker, signal.SIGKILL, "protocol")

    def on_exit(self, worker: Worker, returncode: int | None) -> None:
        if worker.state == "dead":
            return
        previous_state = worker.state
        worker.state = "dead"
        worker.exit_code = returncode
        self.timers.cancel(worker.ladder_timer)
        self.timers.cancel(worker.startup_timer)
        reason = describe_exit(returncode, signalled_by_pool=worker.signalled)
        if previous_state == "starting":
            if not self.closing:
                self._startup_failed(worker)
        elif worker.signalled:
            logger.info(
                "worker %d (pid %s) stopped (%s, %s)",
                worker.id,
                worker.pid,
                worker.kill_reason,
                reason,
            )
        elif worker.stopping and returncode == 0:
            logger.debug("worker %d (pid %s) exited cleanly", worker.id, worker.pid)
        else:
            self.counters["crashes"] += 1
            logger.warning("worker %d (pid %s) died: %s", worker.id, worker.pid, reason)
            alive_for = self.clock() - (worker.ready_at or worker.started_at)
            if not worker.runs and worker.requests == 0 and alive_for < EARLY_DEATH_S:
                # Ready, then dead at once without a request to blame (a backend that exits
                # after loading): refilling the slot at once would reload the model in a
                # tight loop. A request that kills workers is the retry policy's business.
                worker.load_error = (
                    f"worker {worker.id} {reason} {alive_for:.2f}s after it was ready"
                )
                if not self.closing:
                    self._startup_failed(worker)
        outcome: Outcome = "timeout" if worker.kill_reason in ("timeout", "stall") else "crash"
        if worker.slots > 1 and worker.runs:
            self._batch_lost(worker, outcome, f"worker pid {worker.pid} {reason}", returncode)
        runs = list(worker.runs.values())
        worker.runs.clear()
        for lost in runs:
            self.timers.cancel(lost.deadline_timer)
            self.timers.cancel(lost.grace_timer)
        run = runs[0] if runs else None
        if run is not None and run.request is not None:
            request = self._end_attempt(run, outcome)
            error = WorkerCrashed(
                f"worker pid {worker.pid} {reason} while running the request",
                exit_code=returncode,
            )
            self._attempt_failed(request, worker, outcome, error)
        if previous_state != "starting" or worker.pid is not None:
            self.pending_release_checks += 1
            if self.gpu_available and worker.device.startswith("cuda"):
                # A GPU slot is refilled only once the old worker's memory is known to be back:
                # a replacement loading beside memory that is still held can run out of it.
                self.slots_awaiting_release.add(worker.slot)
            self.io.check_release(worker)
        self._publish_gpu_workers()
        self._fill_slots()

    def on_release_checked(
        self,
        worker_id: int,
        ok: bool,
        seconds: float,
        method: str,
        freed_bytes: int | None,
        held_bytes: int | None,
        held_by_device: Mapping[str, int | None] | None = None,
        holders: Mapping[str, list[str]] | None = None,
    ) -> None:
        """A dead worker's release is known. ``held_by_device``: the GPUs of its group that
        still hold memory (GPU -> bytes); without it a failure blocks every GPU of the group.
        ``holders``: GPU -> the processes found holding it, for stats."""
        self.pending_release_checks -= 1
        releases = self.releases
        self.releases = ReleaseStats(
            checked=releases.checked + 1,
            ok=releases.ok + int(ok),
            failed=releases.failed + int(not ok),
            last_ms=seconds * 1000.0,
            last_method=method,
            last_freed_mb=None if freed_bytes is None else freed_bytes / 2**20,
        )
        worker = self.workers.get(worker_id)
        if worker is None:
            return
        if not self.closing:
            # Keep the dead worker's record only until its release is known.
            del self.workers[worker_id]
        self.slots_awaiting_release.discard(worker.slot)
        if ok or not worker.device.startswith("cuda"):
            self._fill_slots()
            return
        if not held_by_device:
            held_by_device = dict.fromkeys(group_devices(worker.device), held_bytes)
        for device, held in held_by_device.items():
            # Room for what the worker had on this GPU (or, unknown, what is still held there).
            needed = worker.gpu_bytes_by_device.get(device) or held or 0
            logger.error(
                "GPU memory of worker %d (pid %s) on %s not released: %s bytes still held; "
                "no worker of the group %s starts until it is free",
                worker.id,
                worker.pid,
                device,
                held,
                worker.device,
            )
            self.blocked_devices[device] = needed
            self.blocked_held[device] = held
            self.blocked_holders[device] = list((holders or {}).get(device, []))
            self.io.watch_device_free(device, needed)

    def on_device_free(self, device: str) -> None:
        self.blocked_held.pop(device, None)
        self.blocked_holders.pop(device, None)
        if self.blocked_devices.pop(device, None) is not None:
            logger.info("%s has room for a worker again", device)
        self._fill_slots()

    def on_gpu_sample(
        self,
        per_worker: Mapping[int, tuple[int | None, str, Mapping[str, int | None]]],
        devices: list[DeviceStats],
    ) -> None:
        """NVML's readings: per worker (the sum over its GPUs, the method, each GPU's figure)."""
        self.gpu_devices = devices
        for worker_id, (used, method, by_device) in per_worker.items():
            worker = self.workers.get(worker_id)
            if worker is None or worker.state == "dead":
                continue
            worker.gpu_bytes = used
            worker.gpu_method = method
            worker.gpu_bytes_by_device = dict(by_device)
            limit = self.config.max_worker_gpu_mb
            if limit is not None and used is not None and used > limit * 2**20:
                self._maybe_retire(worker)

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
        for worker in self.workers.values():
            if worker.io is not None and worker.state != "dead":
                worker.io.signal_group(signal.SIGKILL)
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
        for worker_id in list(self.retire_waiting):
            waiting = self.workers.get(worker_id)
            if waiting is None or waiting.state == "dead":
                self.retire_waiting.discard(worker_id)
            else:
                self._maybe_retire(waiting)
        self._rebalance()
        self._pump()
        if (
            not self._started_reported
            and self.failure is None
            and self._ready_count() >= self.slot_count - len(self.abandoned_slots) > 0
        ):
            self._report_started(None)
        if self.closing:
            self._shutdown_workers()
            self.finished = (
                all(w.state == "dead" for w in self.workers.values())
                and self.pending_release_checks == 0
            )
        self.state = self._current_state()

    def snapshot(self) -> PoolStats:
        now = self.clock()
        workers = []
        # Copies first: ModelPool.stats() builds a snapshot off the dispatcher thread when
        # that thread does not answer, and a dict must not change size under iteration.
        for worker in list(self.workers.values()):
            if worker.state == "dead":
                continue
            shown: str = worker.state
            if worker.state == "idle" and worker.role == "spare":
                shown = "spare"
            workers.append(
                WorkerStats(
                    id=worker.id,
                    pid=worker.pid,
                    state=shown,
                    role=worker.role,
                    device=worker.device,
                    requests=worker.requests,
                    uptime_s=round(now - worker.started_at, 3),
                    rss_mb=None if worker.rss_bytes is None else round(worker.rss_bytes / 2**20, 1),
                    gpu_mb=None if worker.gpu_bytes is None else round(worker.gpu_bytes / 2**20, 1),
                    gpu_mb_method=worker.gpu_method,
                    max_model_len=worker.max_model_len,
                    slots=worker.slots,
                    running=[
                        run.request.request_id
                        for run in list(worker.runs.values())
                        if run.request is not None
                    ],
                    gpu_mb_by_device={
                        device: None if used is None else round(used / 2**20, 1)
                        for device, used in worker.gpu_bytes_by_device.items()
                    },
                )
            )
        return PoolStats(
            state=self.state,
            workers=workers,
            queue_depth=len(self.queue),
            counters=self.counters.copy(),
            latency_s=percentiles(list(self.latencies)),
            gpu=GpuStats(
                available=self.gpu_available,
                reason=self.gpu_reason,
                devices=list(self.gpu_devices),
                releases=self.releases,
                blocked_devices=sorted(self.blocked_devices),
                blocked_held_mb={
                    device: None if held is None else round(held / 2**20, 1)
                    for device, held in sorted(self.blocked_held.items())
                },
                blocked_holders={
                    device: list(lines) for device, lines in sorted(self.blocked_holders.items())
                },
            ),
            uptime_s=round(now - self.created_at, 3),
            last_load_error=self.last_load_error,
            kill_reasons=dict(self.kill_reasons),
            max_model_len=self.max_model_len,
            # workers x slots, as the workers report them (a one-call backend has one)
            capacity=self.config.workers
            * max(
                (w.slots for w in list(self.workers.values()) if w.ready_at is not None),
                default=self.config.max_batch_size,
            ),
            running=sum(len(worker.running) for worker in workers),
        )

    # ---- requests to workers -------------------------------------------------------------

    def _pump(self) -> None:
        if not self.queue:
            return
        open_workers = [
            w
            for w in self.workers.values()
            if w.state in ("idle", "busy")
            and w.role == "serving"
            and len(w.runs) < w.slots
            and not any(run.alone for run in w.runs.values())
            and not (w.slots > 1 and self._retire_reason(w) is not None)
        ]
        if not open_workers:
            return
        # Least loaded first: a new request starts at once in the emptiest batch.
        open_workers.sort(key=lambda w: len(w.runs))
        free = {w.id: w.slots - len(w.runs) for w in open_workers}
        suspects = {w.id for w in open_workers if any(r.owner.suspect for r in w.runs.values())}
        assignments: list[tuple[Request, Worker]] = []
        # In queue order, stopping as soon as the free slots are spoken for: the cost is
        # the number of free slots, not the length of the queue.
        for request in self.queue.values():
            choice = self._place(request, open_workers, free, suspects)
            if choice is None:
                if request.isolated:
                    # It waits for an empty worker: let one drain rather than starve it.
                    reserved = next((w for w in open_workers if free[w.id] > 0), None)
                    if reserved is not None:
                        free[reserved.id] = 0
                continue
            # An isolated request runs alone: nothing else goes to its worker meanwhile.
            free[choice.id] = 0 if choice.slots > 1 and request.isolated else free[choice.id] - 1
            if request.suspect:
                suspects.add(choice.id)
            assignments.append((request, choice))
            if not any(free.values()):
                break
        for request, worker in assignments:
            del self.queue[request.request_id]
            self._dispatch(request, worker)

    def _place(
        self,
        request: Request,
        open_workers: list[Worker],
        free: dict[int, int],
        suspects: set[int],
    ) -> Worker | None:
        """The worker ``request`` goes to now, if any. On batched workers an isolated
        request needs an empty worker, and suspects are spread one per worker (see
        ``_batch_lost``)."""
        for worker in open_workers:
            if free[worker.id] <= 0 or worker.id == request.last_failed_worker:
                continue
            if worker.slots > 1:
                if request.isolated and (worker.runs or free[worker.id] < worker.slots):
                    continue
                if request.suspect and worker.id in suspects:
                    continue
            return worker
        return None

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
        self._dequeued(request)
        request.state = "running"
        request.run = run
        worker.state = "busy"
        worker.runs[run.attempt_id] = run
        worker.io.send(("run", run.attempt_id, run.slot, request.payload))
        run.deadline_timer = self.timers.call_at(
            attempt_deadline, self._attempt_timed_out, run, "timeout"
        )
        if self.config.stall_timeout_s is not None and self._stall_timer is None:
            self._arm_stall_check()

    def _dequeued(self, request: Request) -> None:
        if request.counted_as_queued:
            request.counted_as_queued = False
            self.on_dequeued()

    # ---- what workers send ---------------------------------------------------------------

    def _on_ready(
        self,
        worker: Worker,
        version: int,
        pid: int,
        rss_bytes: int,
        max_model_len: int | None = None,  # absent from an older worker, refused just below
        slots: int = 1,
    ) -> None:
        if worker.state != "starting" or worker.signalled:
            return  # A "ready" that crossed the start-up timeout's SIGKILL: it is dying.
        self.timers.cancel(worker.startup_timer)
        if version != PROTOCOL_VERSION:
            worker.load_error = (
                f"worker speaks protocol {version}, supervisor {PROTOCOL_VERSION}: "
                "mixed modelpool installations"
            )
            self._signal(worker, signal.SIGKILL, "protocol")
            return
        worker.state = "idle"
        worker.slots = max(1, min(int(slots), self.config.max_batch_size))
        # Without spares every worker serves; with them, _rebalance decides.
        worker.role = "spare" if self.config.spares else "serving"
        worker.pid = pid
        worker.ready_at = self.clock()
        worker.rss_bytes = rss_bytes
        worker.max_model_len = max_model_len
        if max_model_len is not None and (
            self.max_model_len is None or max_model_len < self.max_model_len
        ):
            self.max_model_len = max_model_len
        # The crash-loop count is cleared once this worker has outlived EARLY_DEATH_S, not
        # at "ready": a worker that says ready and dies at once must still count.
        worker.startup_timer = self.timers.call_at(
            worker.ready_at + EARLY_DEATH_S, self._settled, worker
        )
        logger.info(
            "worker %d (pid %d) ready on %s in %.2fs",
            worker.id,
            pid,
            worker.device,
            worker.ready_at - worker.started_at,
        )
        self._publish_gpu_workers()

    def _settled(self, worker: Worker) -> None:
        if worker.state != "dead":
            self.consecutive_startup_failures = 0

    def _ready_count(self) -> int:
        return sum(w.state in ("idle", "busy") for w in self.workers.values())

    def _current_run(self, worker: Worker, attempt_id: int) -> Run | None:
        return worker.runs.get(attempt_id)

    def _on_chunk(self, worker: Worker, attempt_id: int, text: str) -> None:
        run = self._current_run(worker, attempt_id)
        if run is None:
            return
        run.chunks.append(text)
        if run.request is not None:
            self._deliver_chunk(run.request, text)

    def _deliver_chunk(self, request: Request, text: str) -> None:
        if request.on_chunk is None or request.caller_gone:
            return
        request.streamed = True
        try:
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
        worker.requests += 1
        self._run_ended(worker, run)
        request = run.request
        if request is None:
            return
        cancelled = request.cancel_requested or generation.finish_reason == "cancelled"
        self._end_attempt(run, "cancelled" if cancelled else "ok")
        if cancelled:
            self._resolve_cancelled(request, generation.text, worker.pid, generation)
            return
        if request.on_chunk is not None:
            # A backend may return text it never emitted; a stream still gets all of it.
            sent = run.partial_text()
            if len(generation.text) > len(sent) and generation.text.startswith(sent):
                self._deliver_chunk(request, generation.text[len(sent) :])
        self._succeed(request, generation, worker.pid)

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
        if kind == "cuda_error":
            self._retire_after_cuda_error(worker, text)
        elif kind == "oom":
            self.counters["cuda_oom"] += 1
            if details.get("recycle"):
                worker.retire_reason = (
                    f"{details.get('allocated_bytes')} bytes still allocated after a CUDA "
                    f"out-of-memory (post-load baseline {details.get('baseline_bytes')})"
                )
        self._run_ended(worker, run)
        request = run.request
        if request is None:
            return
        if kind in ("invalid", "context_length"):
            # A refusal is the request's fault, not the attempt's: no failed attempt is
            # recorded and nothing is retried (another worker would refuse it the same way).
            self._end_attempt(run, None)
            self._fail(request, _refusal(text, detail if isinstance(detail, tuple) else None))
            return
        outcome, error = _typed_backend_error(worker, kind, text, remote_traceback, details)
        self._end_attempt(run, outcome)
        self._attempt_failed(request, worker, outcome, error)

    def _retire_after_cuda_error(self, worker: Worker, text: str) -> None:
        """Its CUDA context is unusable: kill it now, before it could be handed anything
        else; its memory release is checked, and its slot refilled, as after any kill."""
        self.counters["cuda_errors"] += 1
        logger.error(
            "worker %d (pid %s) on %s hit a sticky CUDA error; replacing it: %s",
            worker.id,
            worker.pid,
            worker.device,
            text.strip().splitlines()[0] if text.strip() else "?",
        )
        self._signal(worker, signal.SIGKILL, "cuda_error")

    def _run_ended(self, worker: Worker, run: Run) -> None:
        """The worker answered ``run``: its slot is free; with none left running the worker
        is warm and idle again, unless on its way out."""
        self.timers.cancel(run.deadline_timer)
        self.timers.cancel(run.grace_timer)
        worker.runs.pop(run.attempt_id, None)
        if worker.state not in ("busy", "cancelling"):
            return
        if worker.runs:
            self._update_busy_state(worker)
            return
        worker.state = "idle"
        if self.slot_count == 1:
            self._fail_pinned_retries(worker)
        self._maybe_retire(worker)

    def _update_busy_state(self, worker: Worker) -> None:
        """ "cancelling" once every running attempt on it was asked to stop, else "busy"."""
        if worker.state in ("busy", "cancelling"):
            cancelling = all(run.cancel_sent for run in worker.runs.values())
            worker.state = "cancelling" if cancelling else "busy"

    def _kill_if_alive(self, worker: Worker, reason: str) -> None:
        if worker.state != "dead":
            self._signal(worker, signal.SIGKILL, reason)

    # ---- deadlines, stalls, the kill ladder ----------------------------------------------

    def _on_request_deadline(self, request: Request) -> None:
        if request.state in ("queued", "backoff"):
            self.queue.pop(request.request_id, None)
            self.counters["timeouts"] += 1
            self._fail(
                request,
                DeadlineExceeded(
                    "deadline passed before a worker could finish the request",
                    partial_text=request.last_partial,
                ),
            )
        elif request.state == "running" and request.run is not None:
            self._attempt_timed_out(request.run, "timeout")

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
        self._attempt_failed(request, worker, "timeout", error)

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
        if worker.slots > 1:
            self._batch_lost(
                worker,
                "timeout",
                f"worker pid {worker.pid} ignored a cancel for {self.config.cancel_grace_s}s",
                None,
            )
        self._signal(worker, signal.SIGTERM, reason)

    def _signal(self, worker: Worker, signum: int, reason: str) -> None:
        if worker.state == "dead" or worker.io is None:
            return
        if not worker.signalled:
            worker.signalled = True
            worker.kill_reason = reason
            self.counters["kills"] += 1
            self.kill_reasons[reason] += 1
        if worker.state != "starting":
            worker.state = "killing"
        worker.io.signal_group(signum)
        if signum == signal.SIGTERM:
            self._rearm_ladder(
                worker, self.config.term_grace_s, self._signal, signal.SIGKILL, reason
            )
        else:
            self.timers.cancel(worker.ladder_timer)
            worker.ladder_timer = None

    def _rearm_ladder(
        self, worker: Worker, delay: float, step: Callable[..., None], *args: Any
    ) -> None:
        """The worker's next ladder step, in ``delay`` seconds, replaces the one pending."""
        self.timers.cancel(worker.ladder_timer)
        worker.ladder_timer = self.timers.call_at(self.clock() + delay, step, worker, *args)

    def _arm_stall_check(self) -> None:
        assert self.config.stall_timeout_s is not None
        interval = max(0.005, self.config.stall_timeout_s / 4)
        self._stall_timer = self.timers.call_at(self.clock() + interval, self._check_stalls)

    def _check_stalls(self) -> None:
        self._stall_timer = None
        assert self.config.stall_timeout_s is not None
        now = self.clock()
        busy = False
        for worker in list(self.workers.values()):
            watched = worker.state == "busy" or (worker.slots > 1 and worker.state == "cancelling")
            attached = [run for run in worker.runs.values() if run.request is not None]
            if not attached or not watched or worker.io is None:
                continue
            busy = True
            progress = worker.io.progress()
            if progress != worker.progress_seen:
                worker.progress_seen = progress
                worker.progress_at = now
            elif (
                worker.progress_at is not None
                and now - worker.progress_at >= self.config.stall_timeout_s
            ):
                logger.warning(
                    "worker %d (pid %s) stalled: no progress for %.2fs (%d running)",
                    worker.id,
                    worker.pid,
                    now - worker.progress_at,
                    len(worker.runs),
                )
                if worker.slots > 1:
                    self._worker_stalled(worker)
                else:
                    self._attempt_timed_out(attached[0], "stall")
        if busy:
            self._arm_stall_check()

    def _worker_stalled(self, worker: Worker) -> None:
        """A batched worker delivered no token to any of its requests for stall_timeout_s
        (tokens, not loop turns: a livelocked loop still counts as stalled). Its requests
        are settled as lost with the batch, and the ladder starts at SIGTERM."""
        self.counters["stalls"] += 1
        self._batch_lost(
            worker,
            "timeout",
            f"worker pid {worker.pid} made no progress for {self.config.stall_timeout_s}s",
            None,
        )
        self._signal(worker, signal.SIGTERM, "stall")

    def _batch_lost(
        self, worker: Worker, outcome: Outcome, reason: str, exit_code: int | None
    ) -> None:
        """The batched worker died or is being killed: settle every request it held.

        Every request on it is marked as having been in a failed batch (or as having
        failed alone, when it was the only one). A request whose caller has seen nothing
        is retried at once elsewhere as outcome "collateral", not charged to its retry
        budget (its deadline keeps running); one that already streamed text fails typed,
        as without batching. A request in two failed batches, or that failed alone, runs
        alone from then on, and one that then fails alone fails with PoisonRequest. So a
        poison request takes down at most two batches: at most 2 x (max_batch_size - 1)
        innocent requests are re-run, and none is lost.
        """
        runs = list(worker.runs.values())
        alone = len(runs) == 1
        for run in runs:
            owner = run.owner
            was_isolated = owner.isolated
            if not run.lost:
                # Once per run: a worker killed for an ignored cancel is settled then and
                # again at its exit.
                run.lost = True
                if alone:
                    owner.alone_failures += 1
                else:
                    owner.batch_failures += 1
            if run.request is None:
                continue
            streamed = run.request.streamed
            if alone and was_isolated:
                request = self._end_attempt(run, outcome)
                self.counters["poison_requests"] += 1
                self._fail(
                    request,
                    PoisonRequest(
                        f"{reason}; this request is the suspect: it failed again running "
                        f"alone after {owner.batch_failures} failed batch(es) and "
                        f"{owner.alone_failures - 1} failure(s) alone, and is not retried",
                        exit_code=exit_code,
                    ),
                )
                continue
            request = self._end_attempt(run, outcome if alone or streamed else "collateral")
            error: PoolError
            if outcome == "timeout":
                error = DeadlineExceeded(reason, partial_text=request.last_partial)
            else:
                error = WorkerCrashed(f"{reason} while running the request", exit_code=exit_code)
            if alone or streamed:
                self._attempt_failed(request, worker, outcome, error)
            else:
                self._retry_collateral(request, worker, error)

    def _retry_collateral(self, request: Request, worker: Worker, error: PoolError) -> None:
        retry = (
            not request.cancel_requested
            and not request.caller_gone
            and not self.closing
            and self.failure is None
            and self.clock() < request.deadline
            and self._another_worker_exists(worker)
        )
        if not retry:
            self._fail(request, error)
            return
        self.counters["collateral_retries"] += 1
        self._unpin(request)
        request.last_failed_worker = worker.id
        self.retries_avoiding.setdefault(worker.id, {})[request.request_id] = request
        request.last_error = error
        self._requeue(request)

    # ---- retry or fail -------------------------------------------------------------------

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
        self.timers.cancel(run.deadline_timer)
        if outcome is not None:
            request.attempts.append(Attempt(run.worker.pid, outcome, self.clock() - run.started_at))
        request.last_partial = run.partial_text()
        return request

    def _attempt_failed(
        self, request: Request, worker: Worker, outcome: Outcome, error: PoolError
    ) -> None:
        now = self.clock()
        policy = self.config.retry
        if outcome == "oom":
            # A prompt too long for the device's memory fails everywhere: few tries.
            allowed = sum(a.outcome == "oom" for a in request.attempts) <= policy.oom_retries
        else:
            allowed = outcome in policy.on
        charged = sum(attempt.outcome != "collateral" for attempt in request.attempts)
        retry = (
            allowed
            and charged <= policy.max_retries
            and not request.streamed
            and not request.cancel_requested
            and not request.caller_gone
            and not self.closing
            and self.failure is None
            and now + policy.backoff_s < request.deadline
            and self._another_worker_exists(worker)
        )
        if not retry:
            self._fail(request, error)
            return
        self.counters["retries"] += 1
        self._unpin(request)
        request.last_failed_worker = worker.id
        self.retries_avoiding.setdefault(worker.id, {})[request.request_id] = request
        request.last_error = error
        logger.info(
            "request %s: attempt %d %s on worker pid %s; retrying",
            request.request_id,
            len(request.attempts),
            outcome,
            worker.pid,
        )
        if policy.backoff_s > 0:
            request.state = "backoff"
            self.timers.call_at(now + policy.backoff_s, self._requeue, request)
        else:
            self._requeue(request)

    def _fail_pinned_retries(self, worker: Worker) -> None:
        """The only worker came back warm: a retry waiting for another worker has none."""
        for request in list(self.retries_avoiding.get(worker.id, {}).values()):
            if request.state == "queued" and request.last_error is not None:
                self._fail(request, request.last_error)

    def _unpin(self, request: Request) -> None:
        if request.last_failed_worker is None:
            return
        avoiding = self.retries_avoiding.get(request.last_failed_worker)
        if avoiding is not None:
            avoiding.pop(request.request_id, None)
            if not avoiding:
                del self.retries_avoiding[request.last_failed_worker]

    def _requeue(self, request: Request) -> None:
        if request.state == "done":
            return
        request.state = "queued"
        self.queue[request.request_id] = request
        self.queue.move_to_end(request.request_id, last=False)

    def _another_worker_exists(self, failed: Worker) -> bool:
        """Can some worker other than ``failed`` ever take a retry?

        A retry never goes back to the worker that just failed it. Other live workers
        can take it; so can a replacement, in any slot that may still be filled, and
        in the failed worker's own slot if that worker is on its way out.
        """
        if any(w is not failed and w.state != "dead" for w in self.workers.values()):
            return True
        leaving = failed.state in ("cancelling", "killing", "dead")
        for slot in range(self.slot_count):
            if slot in self.abandoned_slots:
                continue
            if self._group_blocked(self.devices[slot % len(self.devices)]):
                continue
            if slot != failed.slot or leaving:
                return True
        return False

    # ---- resolution ----------------------------------------------------------------------

    def _finish(self, request: Request) -> bool:
        if request.state == "done":
            return False
        if request.state in ("queued", "backoff"):
            self.queue.pop(request.request_id, None)
        request.state = "done"
        request.run = None
        self.timers.cancel(request.deadline_timer)
        self._unpin(request)
        self.live.pop(request.request_id, None)
        self._dequeued(request)
        return True

    def _succeed(self, request: Request, generation: Generation, worker_pid: int | None) -> None:
        if not self._finish(request):
            return
        self.counters["completed"] += 1
        result = self._result(request, generation, worker_pid)
        self.latencies.append(result.latency_s)
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
        set_future(request.future, self._result(request, generation, worker_pid))

    def _result(self, request: Request, generation: Generation, worker_pid: int | None) -> Result:
        now = self.clock()
        return Result(
            text=generation.text,
            finish_reason=generation.finish_reason,
            request_id=request.request_id,
            attempts=len(request.attempts),
            worker_pid=worker_pid,
            latency_s=now - request.submitted_at,
            queue_s=(request.first_dispatch_at or now) - request.submitted_at,
            prompt_tokens=generation.prompt_tokens,
            completion_tokens=generation.completion_tokens,
            logprobs=generation.logprobs,
            prompt_logprobs=generation.prompt_logprobs,
        )

    def _fail(self, request: Request, error: PoolError) -> None:
        if not self._finish(request):
            return
        error.request_id = request.request_id
        error.attempts = list(request.attempts)
        if request.caller_gone:
            self.counters["cancelled"] += 1
        else:
            self.counters["failed"] += 1
        set_future(request.future, error)

    # ---- slots and start-up --------------------------------------------------------------

    @property
    def slot_count(self) -> int:
        return self.config.workers + self.config.spares

    def _spawn(self, slot: int, *, replacement: bool) -> None:
        device = self.devices[slot % len(self.devices)]
        now = self.clock()
        worker = Worker(id=next(self._worker_ids), slot=slot, device=device, started_at=now)
        self.workers[worker.id] = worker
        spec = WorkerSpec(
            model=self.config.model,
            backend=self.config.backend,
            backend_options=self.config.backend_options,
            device=device,
            sys_path=list(sys.path),
            log_level=logging.getLogger("modelpool").getEffectiveLevel(),
            generation_defaults=self.config.generation_defaults,
            max_batch_size=self.config.max_batch_size,
        )
        if replacement:
            self.counters["respawns"] += 1
        try:
            worker.io = self.io.spawn(worker, spec)
        except Exception as exc:
            # Whatever the cause (no memory for a process, a device that cannot be mapped),
            # it is this worker's failed start, never the dispatcher's death.
            logger.error("worker %d: could not start a process: %s", worker.id, exc)
            worker.load_error = f"could not start a worker process: {exc}"
            del self.workers[worker.id]
            self._startup_failed(worker)
            return
        worker.pid = worker.io.pid
        worker.startup_timer = self.timers.call_at(
            now + self.config.startup_timeout_s, self._on_startup_timeout, worker
        )
        logger.debug("worker %d (pid %s) starting on %s", worker.id, worker.pid, device)

    def _group_blocked(self, label: str) -> bool:
        """A GPU that still holds a dead worker's memory blocks every group it belongs to."""
        return any(device in self.blocked_devices for device in group_devices(label))

    def _slot_filled(self, slot: int) -> bool:
        return any(w.slot == slot and w.state != "dead" for w in self.workers.values())

    def _fill_slots(self) -> None:
        if self.closing or self.failure is not None:
            return
        now = self.clock()
        for slot in range(self.slot_count):
            if (
                slot in self.abandoned_slots
                or slot in self.slots_awaiting_release
                or self._slot_filled(slot)
            ):
                continue
            if self._group_blocked(self.devices[slot % len(self.devices)]):
                continue
            not_before = self.slot_not_before.get(slot, 0.0)
            if not_before > now:
                continue
            self.slot_not_before.pop(slot, None)
            self._spawn(slot, replacement=True)

    def _on_startup_timeout(self, worker: Worker) -> None:
        if worker.state != "starting":
            return
        worker.load_error = (
            f"worker {worker.id} was not ready within startup_timeout_s="
            f"{self.config.startup_timeout_s}"
        )
        self._signal(worker, signal.SIGKILL, "startup_timeout")

    def _startup_failed(self, worker: Worker) -> None:
        self.counters["startup_failures"] += 1
        self.consecutive_startup_failures += 1
        error_text = worker.load_error or (
            f"worker {worker.id} {describe_exit(worker.exit_code)} before it was ready"
        )
        self.last_load_error = error_text
        logger.error(
            "worker %d failed to start: %s", worker.id, error_text.strip().splitlines()[-1]
        )
        limit = self.config.startup_failures_before_giving_up
        if self.consecutive_startup_failures < limit:
            backoff = min(30.0, 0.25 * 2 ** (self.consecutive_startup_failures - 1))
            when = self.clock() + backoff
            self.slot_not_before[worker.slot] = when
            self.timers.call_at(when, self._fill_slots)
            return
        if any(w.state not in ("starting", "dead") for w in self.workers.values()):
            # Others serve: keep them, give up on this slot, and say so in the state.
            self.abandoned_slots.add(worker.slot)
            logger.error(
                "giving up on worker slot %d after %d start-up failures in a row",
                worker.slot,
                self.consecutive_startup_failures,
            )
            return
        self.failure = ModelLoadFailed(
            f"workers failed to start {self.consecutive_startup_failures} times in a row; "
            f"last error: {error_text.strip().splitlines()[-1] if error_text.strip() else '?'}",
            worker_traceback=error_text,
        )
        self.state = "failed"
        for request in list(self.live.values()):
            if request.state in ("queued", "backoff"):
                self._fail(request, self.failure.copy())
        for other in self.workers.values():
            if other.state == "starting":
                self._signal(other, signal.SIGKILL, "startup_abandoned")
        self._report_started(self.failure)

    def _report_started(self, error: BaseException | None) -> None:
        if not self._started_reported:
            self._started_reported = True
            self.on_started(error)

    # ---- recycling and roles -------------------------------------------------------------

    def _retire_reason(self, worker: Worker) -> str | None:
        if worker.retire_reason is not None:
            return worker.retire_reason
        config = self.config
        if (
            config.max_requests_per_worker is not None
            and worker.requests >= config.max_requests_per_worker
        ):
            return f"served {worker.requests} requests"
        if (
            config.max_worker_rss_mb is not None
            and worker.rss_bytes is not None
            and worker.rss_bytes > config.max_worker_rss_mb * 2**20
        ):
            return f"RSS {worker.rss_bytes / 2**20:.0f} MB > {config.max_worker_rss_mb} MB"
        if (
            config.max_worker_gpu_mb is not None
            and worker.gpu_bytes is not None
            and worker.gpu_bytes > config.max_worker_gpu_mb * 2**20
        ):
            return f"GPU memory {worker.gpu_bytes / 2**20:.0f} MB > {config.max_worker_gpu_mb} MB"
        return None

    def _maybe_retire(self, worker: Worker) -> None:
        """Retire an idle worker that crossed a recycling limit.

        With spares configured, a serving worker is retired only once an idle spare
        can take its place, so serving capacity never dips; until then it keeps serving.
        """
        if worker.state != "idle" or self.closing:
            return
        reason = self._retire_reason(worker)
        if reason is None:
            return
        if self.config.spares and worker.role == "serving":
            successor = next(
                (w for w in self.workers.values() if w.state == "idle" and w.role == "spare"),
                None,
            )
            if successor is None:
                self.retire_waiting.add(worker.id)
                return
            # Claimed now: a second worker waiting to retire must not count the same spare.
            successor.role = "serving"
        self.retire_waiting.discard(worker.id)
        logger.info("recycling worker %d (pid %s): %s", worker.id, worker.pid, reason)
        self.counters["recycled"] += 1
        self._stop_worker(worker)

    def _stop_worker(self, worker: Worker) -> None:
        assert worker.io is not None
        worker.stopping = True
        worker.state = "stopping"
        worker.io.send(("stop",))
        self._rearm_ladder(
            worker, max(self.config.term_grace_s, 1.0), self._signal, signal.SIGTERM, "stop_timeout"
        )

    def _rebalance(self) -> None:
        """Keep ``workers`` serving: promote idle spares into gaps, demote extras back."""
        if not self.config.spares:
            return
        alive = [w for w in self.workers.values() if w.state in ("idle", "busy")]
        serving = [w for w in alive if w.role == "serving"]
        spares = [w for w in alive if w.role == "spare" and w.state == "idle"]
        while len(serving) < self.config.workers and spares:
            promoted = spares.pop(0)
            promoted.role = "serving"
            serving.append(promoted)
        surplus = len(serving) - self.config.workers
        for worker in serving:
            if surplus <= 0:
                break
            if worker.state == "idle":
                worker.role = "spare"
                surplus -= 1

    # ---- closing -------------------------------------------------------------------------

    def _abort_all(self) -> None:
        for request in list(self.live.values()):
            run = request.run
            if run is not None and run.worker.runs.get(run.attempt_id) is run:
                run.request = None
                self._soft_cancel(run.worker, run, "close")
            self._fail(request, PoolClosed("the pool closed before the request finished"))

    def _shutdown_workers(self) -> None:
        """Once nothing is in flight: idle workers are asked to exit, starting ones killed;
        busy ones are already on their cancel ladder and are asked once they answer."""
        if not self.closing or self.live:
            return
        for worker in list(self.workers.values()):
            if worker.state == "idle":
                self._stop_worker(worker)
            elif worker.state == "starting" and not worker.signalled:
                self._signal(worker, signal.SIGKILL, "close")

    # ---- pool state ----------------------------------------------------------------------

    def _current_state(self) -> str:
        if self.closing:
            return "closed"
        if self.failure is not None or self.crashed:
            return "failed"
        if not self._started_reported:
            return "starting"
        if self.blocked_devices or self.abandoned_slots:
            return "degraded"
        return "ready"

    def _publish_gpu_workers(self) -> None:
        if not self.gpu_available:
            return
        self.io.gpu_workers_changed(
            [
                (w.id, w.pid, w.device)
                for w in self.workers.values()
                if w.pid is not None and w.state != "dead" and w.device.startswith("cuda")
            ]
        )


def _refusal(text: str, detail: tuple[int, int | None, int] | None) -> InvalidRequest:
    """The typed error for a worker's refusal; ``detail`` carries a context refusal's numbers."""
    if detail is None:
        return InvalidRequest(text)
    prompt_tokens, max_new_tokens, max_model_len = detail
    return ContextLengthExceeded(
        text,
        prompt_tokens=prompt_tokens,
        max_new_tokens=max_new_tokens,
        max_model_len=max_model_len,
    )


def _typed_backend_error(
    worker: Worker, kind: str, text: str, remote_traceback: str, details: Mapping[str, Any]
) -> tuple[Outcome, BackendError]:
    """The attempt's outcome and the typed error for what a worker's backend raised."""
    if kind == "oom":
        device = pool_device(worker, details.get("device"))
        return "oom", OutOfMemory(
            f"CUDA out of memory on worker pid {worker.pid} ({device or worker.device}): {text}",
            remote_traceback=remote_traceback,
            device=device,
            bytes_requested=details.get("bytes_requested"),
        )
    if kind == "cuda_error":
        return "cuda_error", CudaError(
            f"CUDA error on worker pid {worker.pid} ({worker.device}); the worker was "
            f"replaced: {text}",
            remote_traceback=remote_traceback,
        )
    return "error", BackendError(
        f"the backend raised on worker pid {worker.pid}: {text}",
        remote_traceback=remote_traceback,
    )


def pool_device(worker: Worker, local: object) -> str | None:
    """The pool's name for a GPU the worker named in its own numbering ("cuda:1" of a
    group "cuda:2,cuda:3" is "cuda:3"); without one, the worker's GPU if it has one."""
    members = group_devices(worker.device)
    if not isinstance(local, str) or not local.startswith("cuda"):
        return worker.device if len(members) == 1 and worker.device != "cpu" else None
    if worker.device == "cpu":
        return local  # a rehearsal (the testing backend) on a CPU worker
    ordinal = int(local.partition(":")[2] or 0)
    return members[ordinal] if ordinal < len(members) else local
