"""ModelPool: dispatch, deadlines, kill/respawn, retry, stats.

Data flow::

    caller threads / asyncio tasks
      |  submit(): validate, count against max_queue, make a PoolFuture
      v
    command deque + wake-up pipe ----------------------------+
      |                                                      |
      v                                                      |
    dispatcher thread (_EventLoop + Dispatcher)              |  monitor threads
      one selector over: the wake-up pipe, every worker's    |  (release checks,
      socket, every worker's pidfd (exit sentinel)           |   GPU sampling) post
      one timer heap: attempt deadlines, kill-ladder steps,  |   their results back
      start-up timeouts, stall checks, respawn backoff       |   as commands
      |                                                   <--+
      |  ("run", attempt_id, prompt, params) over the worker's socket
      v
    worker processes (python -m modelpool.worker, own process group)
      |  ("chunk" ...)*, then ("done" ...) or ("error" ...)
      v
    Dispatcher: the attempt id must match the worker's current attempt, else the
    message is stale and dropped; the request's PoolFuture is resolved once.

``Dispatcher`` is the single owner of all worker and request state; it only
runs on the dispatcher thread and so needs no locks. It is pure bookkeeping:
it never touches a socket or a process itself but asks its ``io`` (the
``_EventLoop`` in production, a recording fake in the property tests) to
spawn, send, flag, signal and check, and its clock is injected, so tests
drive the very same code with a fake world.

Future callbacks (``add_done_callback``, ``on_chunk``) run on the dispatcher
thread, as in ``concurrent.futures``: they must be quick and must not wait on
the pool (``generate()`` refuses to run there).

A worker that dies is a normal, named event (``Dispatcher.on_exit``), never an
exception: its attempt is recorded as a crash (or a kill, if the pool had
signalled it), its memory release is checked, its slot is refilled, and its
request is retried elsewhere or failed with a typed error.

The deadline ladder for a busy worker: the attempt deadline sets the cancel
flag (the backend stops at its next token and the worker stays warm); after
``cancel_grace_s`` SIGTERM goes to its process group; after ``term_grace_s``
SIGKILL. The request does not wait for the ladder: at the attempt deadline it
is retried on another worker (a warm spare takes it at once) or failed.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import concurrent.futures
import dataclasses
import heapq
import importlib
import itertools
import logging
import os
import queue
import secrets
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import modelpool
from modelpool import gpu
from modelpool.config import PoolConfig
from modelpool.errors import (
    Attempt,
    BackendError,
    DeadlineExceeded,
    InvalidRequest,
    ModelLoadFailed,
    Outcome,
    PoolClosed,
    PoolError,
    PoolOverloaded,
    WorkerCrashed,
)
from modelpool.protocol import (
    PROTOCOL_VERSION,
    ControlBlock,
    FinishReason,
    FrameDecoder,
    Generation,
    Prompt,
    WorkerSpec,
    encode_frame,
    encode_request,
)
from modelpool.stats import (
    COUNTER_NAMES,
    DeviceStats,
    GpuStats,
    PoolStats,
    ReleaseStats,
    WorkerStats,
    percentiles,
)
from modelpool.validation import check_deadline, check_generation_params, check_prompt
from modelpool.worker import resolve_backend

logger = logging.getLogger(__name__)
worker_logger = logging.getLogger("modelpool.worker")

_END = object()
_LATENCY_WINDOW = 2048
# epoll takes its timeout as a C int of milliseconds (about 24.8 days): wake up at
# least this often so that a far deadline ("never", in practice) cannot overflow it.
_LONGEST_WAIT_S = 3600.0


@dataclass(frozen=True)
class Result:
    """A finished request. ``attempts`` counts the tries it took."""

    text: str
    finish_reason: FinishReason
    request_id: str
    attempts: int
    worker_pid: int | None
    latency_s: float
    queue_s: float
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


class PoolFuture(concurrent.futures.Future[Result]):
    """A ``concurrent.futures.Future`` for one request, with its ``request_id``.

    Unlike a plain executor future, ``cancel()`` succeeds while the request runs:
    the worker is told to stop at its next token and the caller gets
    ``CancelledError``. ``running()`` is always False; the pool does not report
    the moment a worker picks a request up through the future.
    """

    def __init__(self, request_id: str, on_cancel: Callable[[str], None]) -> None:
        super().__init__()
        self.request_id = request_id
        self._on_cancel = on_cancel

    def cancel(self) -> bool:
        if self.done():
            return self.cancelled()
        cancelled = super().cancel()
        if cancelled:
            # CANCELLED_AND_NOTIFIED is what concurrent.futures.wait()/as_completed() count
            # as done; plain CANCELLED is only reached by executors that later notify.
            self.set_running_or_notify_cancel()
            self._on_cancel(self.request_id)
        return cancelled


# --------------------------------------------------------------------------------------------
# Bookkeeping records, owned by the dispatcher thread.


@dataclass(eq=False)
class _Request:
    request_id: str
    payload: bytes  # pickle of (prompt, params): see protocol.encode_request
    future: PoolFuture
    submitted_at: float
    deadline: float
    on_chunk: Callable[[str], None] | None = None
    state: str = "new"  # new | queued | backoff | running | done
    attempts: list[Attempt] = field(default_factory=list)
    run: _Run | None = None
    last_failed_worker: int | None = None
    first_dispatch_at: float | None = None
    streamed: bool = False
    cancel_requested: bool = False
    caller_gone: bool = False
    counted_as_queued: bool = True
    last_partial: str = ""
    deadline_timer: _Timer | None = None
    last_error: PoolError | None = None


@dataclass(eq=False)
class _Run:
    """One attempt of a request on a worker. ``request`` is None once detached."""

    attempt_id: int
    request: _Request | None
    worker: _Worker
    started_at: float
    deadline: float
    chunks: list[str] = field(default_factory=list)
    progress_seen: int = 0
    progress_at: float | None = None
    deadline_timer: _Timer | None = None

    def partial_text(self) -> str:
        return "".join(self.chunks)


class WorkerIO(Protocol):
    """What the dispatcher may do to one worker process."""

    pid: int | None

    def send(self, message: tuple[Any, ...]) -> None: ...

    def request_cancel(self, attempt_id: int) -> None: ...

    def progress(self) -> int: ...

    def signal_group(self, signum: int) -> None: ...


@dataclass(eq=False)
class _Worker:
    id: int
    slot: int
    device: str
    started_at: float
    io: WorkerIO | None = None
    state: str = "starting"  # starting idle busy cancelling killing stopping dead
    role: str = "spare"  # serving | spare (decided by Dispatcher._rebalance)
    pid: int | None = None
    ready_at: float | None = None
    requests: int = 0
    rss_bytes: int | None = None
    gpu_bytes: int | None = None
    gpu_method: str | None = None
    gpu_baseline: int | None = None
    run: _Run | None = None
    signalled: bool = False
    stopping: bool = False
    kill_reason: str | None = None
    load_error: str | None = None
    ladder_timer: _Timer | None = None
    startup_timer: _Timer | None = None
    exit_code: int | None = None


class _Timer:
    __slots__ = ("action", "args", "cancelled", "when")

    def __init__(self, when: float, action: Callable[..., None], args: tuple[Any, ...]) -> None:
        self.when = when
        self.action = action
        self.args = args
        self.cancelled = False


class DispatcherIO(Protocol):
    """What the dispatcher asks of the outside world (processes, threads, the clock)."""

    def spawn(self, worker: _Worker, spec: WorkerSpec) -> WorkerIO: ...

    def check_release(self, worker: _Worker) -> None: ...

    def watch_device_free(self, device: str, needed_bytes: int) -> None: ...

    def gpu_workers_changed(self, workers: list[tuple[int, int, str, int | None]]) -> None: ...


def _do_nothing(*args: Any) -> None:
    return None


def describe_exit(returncode: int | None, *, signalled_by_pool: bool = False) -> str:
    """A readable reason for an exit status (an unexplained ``-9`` may be the OOM killer)."""
    if returncode is None:
        return "exit status unknown"
    if returncode < 0:
        signum = -returncode
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        text = f"killed by {name} ({signum})"
        if signum == signal.SIGKILL and not signalled_by_pool:
            text += " (not sent by the pool: possibly the kernel OOM killer)"
        return text
    return f"exited with code {returncode}"


# --------------------------------------------------------------------------------------------
# The dispatcher: all state, all decisions.


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

        self.workers: dict[int, _Worker] = {}
        self.queue: collections.OrderedDict[str, _Request] = collections.OrderedDict()
        self.live: dict[str, _Request] = {}
        self.counters: dict[str, int] = dict.fromkeys(COUNTER_NAMES, 0)
        self.counters["startup_failures"] = 0
        self.kill_reasons: collections.Counter[str] = collections.Counter()
        self.latencies: collections.deque[float] = collections.deque(maxlen=_LATENCY_WINDOW)
        self.releases = ReleaseStats()
        self.blocked_devices: dict[str, int] = {}
        self.abandoned_slots: set[int] = set()
        self.slot_not_before: dict[int, float] = {}
        self.slots_awaiting_release: set[int] = set()
        self.retire_waiting: set[int] = set()
        self.state = "starting"
        self.failure: ModelLoadFailed | None = None
        self.last_load_error: str | None = None
        self.consecutive_startup_failures = 0
        self.closing = False
        self.finished = False
        self.crashed = False
        self.pending_release_checks = 0
        self.created_at = clock()

        self._timers: list[tuple[float, int, _Timer]] = []
        self._cancelled_timers = 0
        self._timer_seq = itertools.count()
        self._worker_ids = itertools.count()
        self._attempt_ids = itertools.count(1)
        self._stall_timer: _Timer | None = None
        self._started_reported = False

    # ---- timers -------------------------------------------------------------------------

    def call_at(self, when: float, action: Callable[..., None], *args: Any) -> _Timer:
        timer = _Timer(when, action, args)
        heapq.heappush(self._timers, (when, next(self._timer_seq), timer))
        return timer

    def next_timer_at(self) -> float | None:
        while self._timers and self._timers[0][2].cancelled:
            heapq.heappop(self._timers)
        return self._timers[0][0] if self._timers else None

    def run_due_timers(self) -> None:
        now = self.clock()
        while self._timers and self._timers[0][0] <= now:
            _, _, timer = heapq.heappop(self._timers)
            if not timer.cancelled:
                action, args = timer.action, timer.args
                self._cancel_timer(timer)
                action(*args)

    def _cancel_timer(self, timer: _Timer | None) -> None:
        if timer is None or timer.cancelled:
            return
        timer.cancelled = True
        # A cancelled entry waits in the heap until its time; it must not keep a finished
        # request (its prompt, its text) alive that long.
        timer.action = _do_nothing
        timer.args = ()
        self._cancelled_timers += 1
        # Finished requests leave their deadline entries behind; drop them in bulk so the
        # heap stays proportional to what is in flight, not to the request rate.
        if self._cancelled_timers > 1024 and self._cancelled_timers * 2 > len(self._timers):
            self._timers = [entry for entry in self._timers if not entry[2].cancelled]
            heapq.heapify(self._timers)
            self._cancelled_timers = 0

    # ---- start-up and slots -------------------------------------------------------------

    @property
    def slot_count(self) -> int:
        return self.config.workers + self.config.spares

    def start(self) -> None:
        for slot in range(self.slot_count):
            self._spawn(slot, replacement=False)

    def _spawn(self, slot: int, *, replacement: bool) -> None:
        device = self.devices[slot % len(self.devices)]
        now = self.clock()
        worker = _Worker(id=next(self._worker_ids), slot=slot, device=device, started_at=now)
        self.workers[worker.id] = worker
        spec = WorkerSpec(
            worker_id=worker.id,
            model=self.config.model,
            backend=self.config.backend,
            backend_options=self.config.backend_options,
            device=device,
            sys_path=list(sys.path),
            log_level=logging.getLogger("modelpool").getEffectiveLevel(),
            supervisor_pid=os.getpid(),
        )
        if replacement:
            self.counters["respawns"] += 1
        try:
            worker.io = self.io.spawn(worker, spec)
        except OSError as exc:
            logger.error("worker %d: could not start a process: %s", worker.id, exc)
            worker.load_error = f"could not start a worker process: {exc}"
            del self.workers[worker.id]
            self._startup_failed(worker)
            return
        worker.pid = worker.io.pid
        worker.startup_timer = self.call_at(
            now + self.config.startup_timeout_s, self._on_startup_timeout, worker
        )
        logger.debug("worker %d (pid %s) starting on %s", worker.id, worker.pid, device)

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
            device = self.devices[slot % len(self.devices)]
            if device in self.blocked_devices:
                continue
            not_before = self.slot_not_before.get(slot, 0.0)
            if not_before > now:
                continue
            self.slot_not_before.pop(slot, None)
            self._spawn(slot, replacement=True)

    def _on_startup_timeout(self, worker: _Worker) -> None:
        if worker.state != "starting":
            return
        worker.load_error = (
            f"worker {worker.id} was not ready within startup_timeout_s="
            f"{self.config.startup_timeout_s}"
        )
        self._signal(worker, signal.SIGKILL, "startup_timeout")

    def _startup_failed(self, worker: _Worker) -> None:
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
            self.call_at(when, self._fill_slots)
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
                self._fail(
                    request, ModelLoadFailed(self.failure.message, worker_traceback=error_text)
                )
        for other in self.workers.values():
            if other.state == "starting":
                self._signal(other, signal.SIGKILL, "startup_abandoned")
        self._report_started(self.failure)

    def _report_started(self, error: BaseException | None) -> None:
        if not self._started_reported:
            self._started_reported = True
            self.on_started(error)

    # ---- requests in ----------------------------------------------------------------------

    def submit(self, request: _Request) -> None:
        self.counters["submitted"] += 1
        if request.future.done():  # cancelled by its caller before we saw it
            self.counters["cancelled"] += 1
            request.state = "done"
            self._dequeued(request)
            return
        self.live[request.request_id] = request
        if self.failure is not None:
            self._fail(
                request,
                ModelLoadFailed(
                    self.failure.message, worker_traceback=self.failure.worker_traceback
                ),
            )
            return
        if self.closing:
            self._fail(request, PoolClosed("the pool is closing"))
            return
        request.state = "queued"
        self.queue[request.request_id] = request
        request.deadline_timer = self.call_at(request.deadline, self._on_request_deadline, request)

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

    # ---- dispatching ----------------------------------------------------------------------

    def _pump(self) -> None:
        if not self.queue:
            return
        idle = [w for w in self.workers.values() if w.state == "idle" and w.role == "serving"]
        if not idle:
            return
        assignments = []
        # In queue order, stopping as soon as the idle workers are spoken for: the cost is
        # the number of idle workers, not the length of the queue.
        for request in self.queue.values():
            choice = next((w for w in idle if w.id != request.last_failed_worker), None)
            if choice is None:
                continue
            idle.remove(choice)
            assignments.append((request, choice))
            if not idle:
                break
        for request, worker in assignments:
            del self.queue[request.request_id]
            self._dispatch(request, worker)

    def _dispatch(self, request: _Request, worker: _Worker) -> None:
        now = self.clock()
        attempt_deadline = request.deadline
        if self.config.attempt_timeout_s is not None:
            attempt_deadline = min(attempt_deadline, now + self.config.attempt_timeout_s)
        assert worker.io is not None
        run = _Run(
            attempt_id=next(self._attempt_ids),
            request=request,
            worker=worker,
            started_at=now,
            deadline=attempt_deadline,
            progress_seen=worker.io.progress(),
        )
        if request.first_dispatch_at is None:
            request.first_dispatch_at = now
        self._dequeued(request)
        request.state = "running"
        request.run = run
        worker.state = "busy"
        worker.run = run
        worker.io.send(("run", run.attempt_id, request.payload))
        run.deadline_timer = self.call_at(attempt_deadline, self._attempt_timed_out, run, "timeout")
        if self.config.stall_timeout_s is not None and self._stall_timer is None:
            self._arm_stall_check()

    def _dequeued(self, request: _Request) -> None:
        if request.counted_as_queued:
            request.counted_as_queued = False
            self.on_dequeued()

    # ---- messages from workers -------------------------------------------------------------

    def on_message(self, worker: _Worker, message: tuple[Any, ...]) -> None:
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
            self._on_ready(worker, message[1], message[2], message[3])
        elif kind == "load_failed":
            worker.load_error = message[1]
        else:
            logger.warning("worker %d sent an unknown message kind %r", worker.id, kind)

    def _on_ready(self, worker: _Worker, version: int, pid: int, rss_bytes: int) -> None:
        if worker.state != "starting" or worker.signalled:
            return  # A "ready" that crossed the start-up timeout's SIGKILL: it is dying.
        self._cancel_timer(worker.startup_timer)
        if version != PROTOCOL_VERSION:
            worker.load_error = (
                f"worker speaks protocol {version}, supervisor {PROTOCOL_VERSION}: "
                "mixed modelpool installations"
            )
            self._signal(worker, signal.SIGKILL, "protocol")
            return
        worker.state = "idle"
        # Without spares every worker serves; with them, _rebalance decides.
        worker.role = "spare" if self.config.spares else "serving"
        worker.pid = pid
        worker.ready_at = self.clock()
        worker.rss_bytes = rss_bytes
        self.consecutive_startup_failures = 0
        logger.info(
            "worker %d (pid %d) ready on %s in %.2fs",
            worker.id,
            pid,
            worker.device,
            worker.ready_at - worker.started_at,
        )
        self._publish_gpu_workers()

    def _ready_count(self) -> int:
        return sum(w.state in ("idle", "busy") for w in self.workers.values())

    def _current_run(self, worker: _Worker, attempt_id: int) -> _Run | None:
        run = worker.run
        return run if run is not None and run.attempt_id == attempt_id else None

    def _on_chunk(self, worker: _Worker, attempt_id: int, text: str) -> None:
        run = self._current_run(worker, attempt_id)
        if run is None:
            return
        run.chunks.append(text)
        if run.request is not None:
            self._deliver_chunk(run.request, text)

    def _deliver_chunk(self, request: _Request, text: str) -> None:
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
        self, worker: _Worker, attempt_id: int, generation: Generation, rss_bytes: int
    ) -> None:
        worker.rss_bytes = rss_bytes
        run = self._current_run(worker, attempt_id)
        if run is None:
            return
        worker.requests += 1
        self._worker_free(worker)
        request = run.request
        if request is None:
            return
        now = self.clock()
        cancelled = request.cancel_requested or generation.finish_reason == "cancelled"
        request.attempts.append(
            Attempt(worker.pid, "cancelled" if cancelled else "ok", now - run.started_at)
        )
        request.run = None
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
        worker: _Worker,
        attempt_id: int,
        kind: str,
        text: str,
        remote_traceback: str,
        rss_bytes: int,
    ) -> None:
        worker.rss_bytes = rss_bytes
        run = self._current_run(worker, attempt_id)
        if run is None:
            return
        worker.requests += 1
        self._worker_free(worker)
        request = run.request
        if request is None:
            return
        request.attempts.append(Attempt(worker.pid, "error", self.clock() - run.started_at))
        request.run = None
        request.last_partial = run.partial_text()
        if kind == "invalid":
            self._fail(request, InvalidRequest(text))
            return
        error = BackendError(
            f"the backend raised on worker pid {worker.pid}: {text}",
            remote_traceback=remote_traceback,
        )
        self._attempt_failed(request, worker, "error", error)

    def _worker_free(self, worker: _Worker) -> None:
        """The worker answered its current attempt: warm and idle again, unless on its way out."""
        if worker.run is not None:
            self._cancel_timer(worker.run.deadline_timer)
        worker.run = None
        if worker.state in ("busy", "cancelling"):
            self._cancel_timer(worker.ladder_timer)
            worker.ladder_timer = None
            worker.state = "idle"
            if self.slot_count == 1:
                self._fail_pinned_retries(worker)
            self._maybe_retire(worker)

    def channel_closed(self, worker: _Worker) -> None:
        """The worker's socket reached end of file. Its exit normally follows within
        milliseconds (and is then a crash or a kill as usual); one that stays alive
        without a channel can never answer again and is killed."""
        if worker.state == "dead":
            return
        if worker.state == "idle":
            worker.state = "killing"  # nothing more is sent to it
        self.call_at(self.clock() + 1.0, self._kill_if_alive, worker, "channel_closed")

    def protocol_error(self, worker: _Worker) -> None:
        """The worker sent what the pool cannot use: it is no longer trusted."""
        self._signal(worker, signal.SIGKILL, "protocol")

    def _kill_if_alive(self, worker: _Worker, reason: str) -> None:
        if worker.state != "dead":
            self._signal(worker, signal.SIGKILL, reason)

    # ---- deadlines, stalls, the kill ladder ------------------------------------------------

    def _on_request_deadline(self, request: _Request) -> None:
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

    def _attempt_timed_out(self, run: _Run, reason: str) -> None:
        request = run.request
        worker = run.worker
        if request is None or worker.run is not run:
            return
        now = self.clock()
        run.request = None
        request.run = None
        request.attempts.append(Attempt(worker.pid, "timeout", now - run.started_at))
        request.last_partial = run.partial_text()
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

    def _soft_cancel(self, worker: _Worker, run: _Run, reason: str) -> None:
        """Set the cancel flag; if the worker has not answered after the grace, escalate."""
        assert worker.io is not None
        worker.io.request_cancel(run.attempt_id)
        if worker.state == "busy":
            worker.state = "cancelling"
        self._cancel_timer(worker.ladder_timer)
        worker.ladder_timer = self.call_at(
            self.clock() + self.config.cancel_grace_s,
            self._on_cancel_grace_over,
            worker,
            run,
            reason,
        )

    def _on_cancel_grace_over(self, worker: _Worker, run: _Run, reason: str) -> None:
        if worker.run is not run or worker.state == "dead":
            return
        request = run.request
        if request is not None:
            # A user's cancel the backend did not honour: the caller gets what exists now.
            self.counters["cancel_escalations"] += 1
            run.request = None
            request.run = None
            request.attempts.append(Attempt(worker.pid, "cancelled", self.clock() - run.started_at))
            self._resolve_cancelled(request, run.partial_text(), worker.pid)
        logger.warning(
            "worker %d (pid %s) ignored the cancel flag for %.1fs (%s): terminating",
            worker.id,
            worker.pid,
            self.config.cancel_grace_s,
            reason,
        )
        self._signal(worker, signal.SIGTERM, reason)

    def _signal(self, worker: _Worker, signum: int, reason: str) -> None:
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
        self._cancel_timer(worker.ladder_timer)
        worker.ladder_timer = None
        if signum == signal.SIGTERM:
            worker.ladder_timer = self.call_at(
                self.clock() + self.config.term_grace_s,
                self._signal,
                worker,
                signal.SIGKILL,
                reason,
            )

    def _arm_stall_check(self) -> None:
        assert self.config.stall_timeout_s is not None
        interval = max(0.005, self.config.stall_timeout_s / 4)
        self._stall_timer = self.call_at(self.clock() + interval, self._check_stalls)

    def _check_stalls(self) -> None:
        self._stall_timer = None
        assert self.config.stall_timeout_s is not None
        now = self.clock()
        busy = False
        for worker in list(self.workers.values()):
            run = worker.run
            if run is None or run.request is None or worker.state != "busy" or worker.io is None:
                continue
            busy = True
            progress = worker.io.progress()
            if progress != run.progress_seen:
                run.progress_seen = progress
                run.progress_at = now
            elif (
                run.progress_at is not None and now - run.progress_at >= self.config.stall_timeout_s
            ):
                logger.warning(
                    "worker %d (pid %s) stalled: no progress for %.2fs",
                    worker.id,
                    worker.pid,
                    now - run.progress_at,
                )
                self._attempt_timed_out(run, "stall")
        if busy:
            self._arm_stall_check()

    # ---- retry or fail ---------------------------------------------------------------------

    def _attempt_failed(
        self, request: _Request, worker: _Worker, outcome: Outcome, error: PoolError
    ) -> None:
        now = self.clock()
        policy = self.config.retry
        retry = (
            outcome in policy.on
            and len(request.attempts) <= policy.max_retries
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
        request.last_failed_worker = worker.id
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
            self.call_at(now + policy.backoff_s, self._requeue, request)
        else:
            self._requeue(request)

    def _fail_pinned_retries(self, worker: _Worker) -> None:
        """The only worker came back warm: a retry waiting for another worker has none."""
        for request in list(self.queue.values()):
            if request.last_failed_worker == worker.id and request.last_error is not None:
                self._fail(request, request.last_error)

    def _requeue(self, request: _Request) -> None:
        if request.state == "done":
            return
        request.state = "queued"
        self.queue[request.request_id] = request
        self.queue.move_to_end(request.request_id, last=False)

    def _another_worker_exists(self, failed: _Worker) -> bool:
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
            if self.devices[slot % len(self.devices)] in self.blocked_devices:
                continue
            if slot != failed.slot or leaving:
                return True
        return False

    # ---- resolution ------------------------------------------------------------------------

    def _finish(self, request: _Request) -> bool:
        if request.state == "done":
            return False
        if request.state in ("queued", "backoff"):
            self.queue.pop(request.request_id, None)
        request.state = "done"
        request.run = None
        self._cancel_timer(request.deadline_timer)
        self.live.pop(request.request_id, None)
        self._dequeued(request)
        return True

    def _succeed(self, request: _Request, generation: Generation, worker_pid: int | None) -> None:
        if not self._finish(request):
            return
        self.counters["completed"] += 1
        result = self._result(request, generation, worker_pid)
        self.latencies.append(result.latency_s)
        _set_future(request.future, result)

    def _resolve_cancelled(
        self,
        request: _Request,
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
        _set_future(request.future, self._result(request, generation, worker_pid))

    def _result(self, request: _Request, generation: Generation, worker_pid: int | None) -> Result:
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
        )

    def _fail(self, request: _Request, error: PoolError) -> None:
        if not self._finish(request):
            return
        error.request_id = request.request_id
        error.attempts = list(request.attempts)
        if request.caller_gone:
            self.counters["cancelled"] += 1
        else:
            self.counters["failed"] += 1
        _set_future(request.future, error)

    # ---- workers leaving ------------------------------------------------------------------

    def on_exit(self, worker: _Worker, returncode: int | None) -> None:
        if worker.state == "dead":
            return
        previous_state = worker.state
        worker.state = "dead"
        worker.exit_code = returncode
        self._cancel_timer(worker.ladder_timer)
        self._cancel_timer(worker.startup_timer)
        run, worker.run = worker.run, None
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
        if run is not None and run.request is not None:
            request = run.request
            outcome: Outcome = "timeout" if worker.kill_reason in ("timeout", "stall") else "crash"
            request.attempts.append(Attempt(worker.pid, outcome, self.clock() - run.started_at))
            request.run = None
            request.last_partial = run.partial_text()
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
    ) -> None:
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
        needed = worker.gpu_bytes or held_bytes or 0
        logger.error(
            "GPU memory of worker %d (pid %s) on %s not released: %s bytes still held; "
            "no new worker goes there until it is free",
            worker.id,
            worker.pid,
            worker.device,
            held_bytes,
        )
        self.blocked_devices[worker.device] = needed
        self.io.watch_device_free(worker.device, needed)

    def on_device_free(self, device: str) -> None:
        if self.blocked_devices.pop(device, None) is not None:
            logger.info("%s has room for a worker again", device)
        self._fill_slots()

    def on_gpu_sample(
        self, per_worker: Mapping[int, tuple[int | None, str]], devices: list[DeviceStats]
    ) -> None:
        self.gpu_devices = devices
        for worker_id, (used, method) in per_worker.items():
            worker = self.workers.get(worker_id)
            if worker is None or worker.state == "dead":
                continue
            worker.gpu_bytes = used
            worker.gpu_method = method
            limit = self.config.max_worker_gpu_mb
            if limit is not None and used is not None and used > limit * 2**20:
                self._maybe_retire(worker)

    # ---- recycling --------------------------------------------------------------------------

    def _retire_reason(self, worker: _Worker) -> str | None:
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

    def _maybe_retire(self, worker: _Worker) -> None:
        """Retire an idle worker that crossed a recycling limit.

        With spares configured, a serving worker is retired only once an idle spare
        can take its place, so serving capacity never dips; until then it keeps serving.
        """
        if worker.state != "idle" or self.closing:
            return
        reason = self._retire_reason(worker)
        if reason is None:
            return
        spare_ready = any(w.state == "idle" and w.role == "spare" for w in self.workers.values())
        if self.config.spares and worker.role == "serving" and not spare_ready:
            self.retire_waiting.add(worker.id)
            return
        self.retire_waiting.discard(worker.id)
        logger.info("recycling worker %d (pid %s): %s", worker.id, worker.pid, reason)
        self.counters["recycled"] += 1
        self._stop_worker(worker)

    def _stop_worker(self, worker: _Worker) -> None:
        assert worker.io is not None
        worker.stopping = True
        worker.state = "stopping"
        worker.io.send(("stop",))
        self._cancel_timer(worker.ladder_timer)
        worker.ladder_timer = self.call_at(
            self.clock() + max(self.config.term_grace_s, 1.0),
            self._signal,
            worker,
            signal.SIGTERM,
            "stop_timeout",
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

    # ---- closing ------------------------------------------------------------------------------

    def begin_close(self, drain: bool, deadline: float) -> None:
        if self.closing:
            return
        self.closing = True
        self.state = "closed"
        self._report_started(PoolClosed("the pool was closed while starting"))
        if drain:
            self.call_at(deadline, self._abort_all)
        else:
            self._abort_all()

    def _abort_all(self) -> None:
        for request in list(self.live.values()):
            run = request.run
            if run is not None and run.worker.run is run:
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

    # ---- after every event --------------------------------------------------------------------

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
                (w.id, w.pid, w.device, w.gpu_baseline)
                for w in self.workers.values()
                if w.pid is not None and w.state != "dead" and w.device.startswith("cuda")
            ]
        )

    # ---- stats -------------------------------------------------------------------------------

    def snapshot(self) -> PoolStats:
        now = self.clock()
        workers = []
        # Copies first: ModelPool.stats() builds a snapshot off the dispatcher thread when
        # that thread does not answer, and a dict must not change size under iteration.
        for worker in list(self.workers.values()):
            if worker.state == "dead":
                continue
            shown = worker.state
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
            ),
            uptime_s=round(now - self.created_at, 3),
            last_load_error=self.last_load_error,
            kill_reasons=dict(self.kill_reasons),
        )


def _set_future(future: PoolFuture, outcome: Result | PoolError) -> None:
    try:
        if isinstance(outcome, Result):
            future.set_result(outcome)
        else:
            future.set_exception(outcome)
    except concurrent.futures.InvalidStateError:
        pass  # The caller cancelled the future in the meantime; the request is still counted.


# --------------------------------------------------------------------------------------------
# The dispatcher thread: processes, sockets, the selector.


class _ProcessWorkerIO:
    """One worker process as the event loop sees it."""

    def __init__(
        self,
        popen: subprocess.Popen[bytes],
        sock: socket.socket,
        control: ControlBlock,
        pidfd: int | None,
        on_backlog: Callable[[_ProcessWorkerIO], None],
    ) -> None:
        self.popen = popen
        self.pid: int | None = popen.pid
        self.sock = sock
        self.control = control
        self.pidfd = pidfd
        self.decoder = FrameDecoder()
        self.outbox = bytearray()
        self.eof = False
        self.closed = False
        self._on_backlog = on_backlog

    def send(self, message: tuple[Any, ...]) -> None:
        self.outbox += encode_frame(message)
        self.flush()

    def flush(self) -> None:
        while self.outbox:
            try:
                sent = self.sock.send(self.outbox)
            except BlockingIOError:
                self._on_backlog(self)
                return
            except OSError:
                self.outbox.clear()  # The worker is gone; its exit event will follow.
                return
            del self.outbox[:sent]

    def request_cancel(self, attempt_id: int) -> None:
        self.control.cancel_attempt = attempt_id

    def progress(self) -> int:
        return self.control.progress

    def signal_group(self, signum: int) -> None:
        try:
            os.killpg(self.popen.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._on_backlog = _do_nothing  # it holds the worker: break the cycle at once
        self.sock.close()
        self.control.close()
        if self.pidfd is not None:
            os.close(self.pidfd)


_PACKAGE_PARENT = str(Path(modelpool.__file__).resolve().parent.parent)


class _EventLoop:
    """Runs the Dispatcher on its own thread and does its I/O."""

    def __init__(
        self, pool: ModelPool, config: PoolConfig, devices: list[str], probe: gpu.GpuProbe
    ) -> None:
        self.config = config
        self.probe = probe
        self.selector = selectors.DefaultSelector()
        self.commands: collections.deque[tuple[Callable[..., None], tuple[Any, ...]]] = (
            collections.deque()
        )
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._wake_pending = False
        self._post_lock = threading.Lock()
        self.stopped = False
        self.selector.register(self._wake_r, selectors.EVENT_READ, ("wake", None))
        self._lifeline_r, self._lifeline_w = os.pipe()
        _lifeline_writers.add(self._lifeline_w)
        self._eof_without_exit: list[_Worker] = []
        self._gpu_workers: list[tuple[int, int, str, int | None]] = []
        self._stop_monitor = threading.Event()
        self.dispatcher = Dispatcher(
            config,
            self,
            devices=devices,
            on_started=pool._on_started,
            on_dequeued=pool._on_dequeued,
            gpu_available=probe.available,
            gpu_reason=probe.reason,
        )
        self.thread = threading.Thread(target=self._run, name="modelpool-dispatcher", daemon=True)
        self._monitor = threading.Thread(
            target=self._sample_gpu, name="modelpool-gpu-sampler", daemon=True
        )
        self._threads_per_worker = max(1, _usable_cpus() // config.workers)

    # ---- cross-thread entry points ---------------------------------------------------------

    def post(self, action: Callable[..., None], *args: Any) -> bool:
        """Queue work for the dispatcher thread; False once the loop has stopped."""
        with self._post_lock:
            # Under the lock so that the wake-up descriptor cannot be closed, and its
            # number reused by someone else's file, between the check and the write.
            if self.stopped:
                return False
            self.commands.append((action, args))
            if not self._wake_pending:
                self._wake_pending = True
                try:
                    os.write(self._wake_w, b"\0")
                except BlockingIOError:
                    pass  # The pipe is full of wake-ups already.
        return True

    def start(self) -> None:
        self.thread.start()
        if self.probe.available:
            self._monitor.start()

    # ---- DispatcherIO ----------------------------------------------------------------------

    def spawn(self, worker: _Worker, spec: WorkerSpec) -> WorkerIO:
        gpu_env, worker_device = gpu.worker_env_for(worker.device, self.probe)
        env = dict(os.environ)
        env.update(gpu_env)
        # Appended, so that the user's own PYTHONPATH entries keep precedence in workers
        # as they have in the supervisor; ours only makes sure modelpool itself imports.
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (env.get("PYTHONPATH", ""), _PACKAGE_PARENT) if p
        )
        threads = str(self._threads_per_worker)
        env.setdefault("OMP_NUM_THREADS", threads)
        env.setdefault("MKL_NUM_THREADS", threads)
        env.setdefault("MODELPOOL_TORCH_THREADS", threads)
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        index = gpu.nvml_index_for(worker.device, self.probe)
        if index is not None:
            worker.gpu_baseline = self.probe.used_bytes(index)
        parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            control = ControlBlock.create()
        except BaseException:
            parent_sock.close()
            child_sock.close()
            raise
        command = [
            sys.executable,
            "-m",
            "modelpool.worker",
            "--channel",
            str(child_sock.fileno()),
            "--control",
            str(control.fd),
            "--lifeline",
            str(self._lifeline_r),
            "--supervisor-pid",
            str(os.getpid()),
        ]
        try:
            popen = subprocess.Popen(
                command,
                pass_fds=(child_sock.fileno(), control.fd, self._lifeline_r),
                start_new_session=True,
                stdin=subprocess.DEVNULL,
                env=env,
            )
        except BaseException:
            parent_sock.close()
            control.close()
            raise
        finally:
            child_sock.close()
        parent_sock.setblocking(False)
        pidfd: int | None = None
        if hasattr(os, "pidfd_open"):
            try:
                pidfd = os.pidfd_open(popen.pid)
            except OSError:
                pidfd = None
        io = _ProcessWorkerIO(
            popen, parent_sock, control, pidfd, lambda io: self._want_write(worker, io)
        )
        try:
            self.selector.register(parent_sock, selectors.EVENT_READ, ("sock", worker))
            if pidfd is not None:
                self.selector.register(pidfd, selectors.EVENT_READ, ("exit", worker))
            io.send(("init", dataclasses.replace(spec, device=worker_device)))
        except BaseException:
            io.signal_group(signal.SIGKILL)
            popen.wait()
            for fd in (parent_sock, pidfd):
                if fd is not None:
                    try:
                        self.selector.unregister(fd)
                    except (KeyError, ValueError):
                        pass
            io.close()
            raise
        return io

    def check_release(self, worker: _Worker) -> None:
        threading.Thread(
            target=self._check_release,
            args=(worker.id, worker.pid, worker.device, worker.gpu_baseline, worker.rss_bytes),
            name=f"modelpool-release-{worker.id}",
            daemon=True,
        ).start()

    def watch_device_free(self, device: str, needed_bytes: int) -> None:
        threading.Thread(
            target=self._wait_device_free,
            args=(device, needed_bytes),
            name=f"modelpool-watch-{device}",
            daemon=True,
        ).start()

    def gpu_workers_changed(self, workers: list[tuple[int, int, str, int | None]]) -> None:
        self._gpu_workers = workers

    # ---- background checks (their own threads; results come back as commands) -------------

    def _check_release(
        self,
        worker_id: int,
        pid: int | None,
        device: str,
        baseline: int | None,
        rss_bytes: int | None,
    ) -> None:
        started = time.monotonic()
        ok, method, held = True, "psutil", None
        if pid is not None:
            # Orphaned members of the group are reaped by init, which in some containers
            # takes a couple of seconds; the pool does not make itself a subreaper because
            # that would change how the host application's own orphans are reaped.
            report = gpu.wait_process_group_gone(pid, timeout_s=max(3.0, self.config.term_grace_s))
            ok = report.ok
            if not ok:
                logger.error("worker pid %s: processes left in its group: %s", pid, report.holders)
            index = gpu.nvml_index_for(device, self.probe)
            if index is not None and self.probe.available:
                gpu_report = self.probe.wait_released(
                    index, pid, baseline, timeout_s=self.config.gpu_release_timeout_s
                )
                ok = ok and gpu_report.ok
                method, held = gpu_report.method, gpu_report.held_bytes
                if not gpu_report.ok:
                    logger.error(
                        "worker pid %s: %s bytes still held on %s after %.1fs; holders: %s",
                        pid,
                        gpu_report.held_bytes,
                        device,
                        gpu_report.seconds,
                        gpu_report.holders,
                    )
        self.post(
            self.dispatcher.on_release_checked,
            worker_id,
            ok,
            time.monotonic() - started,
            method,
            rss_bytes,
            held,
        )

    def _wait_device_free(self, device: str, needed_bytes: int) -> None:
        index = gpu.nvml_index_for(device, self.probe)
        while index is not None and not self._stop_monitor.wait(0.5):
            free = self.probe.free_bytes(index)
            if free is None or free >= needed_bytes:
                break
        self.post(self.dispatcher.on_device_free, device)

    def _sample_gpu(self) -> None:
        interval = self.config.gpu_sample_interval_s
        while not self._stop_monitor.wait(interval):
            per_worker: dict[int, tuple[int | None, str]] = {}
            for worker_id, pid, device, baseline in self._gpu_workers:
                index = gpu.nvml_index_for(device, self.probe)
                if index is None:
                    continue
                reading = self.probe.worker_memory(index, pid, baseline)
                per_worker[worker_id] = (reading.bytes, reading.method)
            devices = [
                DeviceStats(d.index, d.name, d.used_mb, d.total_mb)
                for d in self.probe.devices(self.probe.visible_device_indices())
            ]
            self.post(self.dispatcher.on_gpu_sample, per_worker, devices)

    # ---- the loop ----------------------------------------------------------------------------

    def _want_write(self, worker: _Worker, io: _ProcessWorkerIO) -> None:
        """The worker's socket buffer is full: finish sending when it can take more."""
        try:
            self.selector.modify(
                io.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, ("sock", worker)
            )
        except (KeyError, ValueError):
            pass

    def _run(self) -> None:
        dispatcher = self.dispatcher
        try:
            dispatcher.start()
            while True:
                self._run_commands()
                dispatcher.run_due_timers()
                dispatcher.after_event()
                if dispatcher.finished:
                    break
                next_at = dispatcher.next_timer_at()
                timeout = None
                if next_at is not None:
                    timeout = min(max(0.0, next_at - time.monotonic()), _LONGEST_WAIT_S)
                if self._eof_without_exit:
                    timeout = 0.005 if timeout is None else min(timeout, 0.005)
                for key, mask in self.selector.select(timeout):
                    kind, worker = key.data
                    if kind == "wake":
                        self._drain_wake()
                    elif kind == "sock":
                        if mask & selectors.EVENT_WRITE:
                            self._flush(worker)
                        if mask & selectors.EVENT_READ:
                            self._read(worker)
                    else:
                        self._reap(worker)
                self._poll_eof_workers()
        except BaseException as exc:
            logger.critical("the modelpool dispatcher failed; failing every request", exc_info=True)
            dispatcher.crash(exc)
        finally:
            self._stop_accepting()
            self._stop_monitor.set()
            self._teardown()

    def _run_commands(self) -> None:
        self._wake_pending = False
        commands = self.commands
        while commands:
            action, args = commands.popleft()
            action(*args)

    def _stop_accepting(self) -> None:
        """No command is taken after this; submissions already queued fail instead of hanging."""
        with self._post_lock:
            self.stopped = True
        while self.commands:
            action, args = self.commands.popleft()
            if action == self.dispatcher.submit:
                _set_future(args[0].future, PoolClosed("the pool stopped before the request ran"))

    def _drain_wake(self) -> None:
        # One read suffices: a writer only writes while no wake-up is pending.
        try:
            os.read(self._wake_r, 4096)
        except BlockingIOError:
            pass

    def _flush(self, worker: _Worker) -> None:
        io = worker.io
        if not isinstance(io, _ProcessWorkerIO):
            return
        io.flush()
        if not io.outbox:
            try:
                self.selector.modify(io.sock, selectors.EVENT_READ, ("sock", worker))
            except (KeyError, ValueError):
                pass

    def _read(self, worker: _Worker, *, until_eof: bool = False) -> None:
        io = worker.io
        if not isinstance(io, _ProcessWorkerIO) or io.eof:
            return
        while True:
            try:
                data = io.sock.recv(1 << 18)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                self._stop_reading(worker, io)
                self.dispatcher.channel_closed(worker)
                return
            try:
                for message in io.decoder.feed(data):
                    self.dispatcher.on_message(worker, message)
            except Exception:
                # One broken worker (or a backend that sent what the pool cannot read)
                # must not take the dispatcher, and with it every other request, down.
                logger.exception(
                    "worker %d (pid %s) sent a message the pool cannot use; killing it",
                    worker.id,
                    worker.pid,
                )
                self._stop_reading(worker, io)
                self.dispatcher.protocol_error(worker)
                return
            if len(data) < (1 << 18) and not until_eof:
                return

    def _stop_reading(self, worker: _Worker, io: _ProcessWorkerIO) -> None:
        io.eof = True
        self.selector.unregister(io.sock)
        if io.pidfd is None:
            self._eof_without_exit.append(worker)

    def _poll_eof_workers(self) -> None:
        for worker in list(self._eof_without_exit):
            io = worker.io
            if isinstance(io, _ProcessWorkerIO) and io.popen.poll() is not None:
                self._eof_without_exit.remove(worker)
                self._reap(worker)

    def _reap(self, worker: _Worker) -> None:
        io = worker.io
        if not isinstance(io, _ProcessWorkerIO) or worker.state == "dead":
            return
        # A last result or traceback may be waiting behind the exit.
        self._read(worker, until_eof=True)
        # Whatever the worker started dies with it. Sent before the leader is reaped: its
        # zombie keeps the group id from being reused by a new process group meanwhile.
        io.signal_group(signal.SIGKILL)
        returncode = io.popen.wait()
        if not io.eof:
            self.selector.unregister(io.sock)
        if io.pidfd is not None:
            self.selector.unregister(io.pidfd)
        io.close()
        self.dispatcher.on_exit(worker, returncode)

    def kill_all_workers(self) -> None:
        """Last resort when the dispatcher is wedged: take every worker down without it."""
        for worker in list(self.dispatcher.workers.values()):
            io = worker.io
            if isinstance(io, _ProcessWorkerIO) and not io.closed:
                io.signal_group(signal.SIGKILL)

    def _teardown(self) -> None:
        for worker in list(self.dispatcher.workers.values()):
            io = worker.io
            if isinstance(io, _ProcessWorkerIO) and not io.closed:
                try:
                    io.signal_group(signal.SIGKILL)
                    io.popen.wait()
                finally:
                    io.close()
                    worker.state = "dead"
        self.selector.close()
        _lifeline_writers.discard(self._lifeline_w)
        with self._post_lock:
            for fd in (self._wake_r, self._wake_w, self._lifeline_r, self._lifeline_w):
                try:
                    os.close(fd)
                except OSError:
                    pass


# The write ends of every live pool's lifeline. A child forked without exec (the
# multiprocessing "fork" context, say) would otherwise hold them open and keep the
# workers alive after the supervisor died, for as long as that child lives.
_lifeline_writers: set[int] = set()


def _close_lifelines_in_child() -> None:
    for fd in _lifeline_writers:
        try:
            os.close(fd)
        except OSError:
            pass
    _lifeline_writers.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_lifelines_in_child)


def _usable_cpus() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


# --------------------------------------------------------------------------------------------
# The public face.

_live_pools: weakref.WeakSet[ModelPool] = weakref.WeakSet()


@atexit.register
def _close_live_pools() -> None:
    for pool in list(_live_pools):
        pool.close(drain=False, timeout=5.0)


class ModelPool:
    """A supervised pool of pre-warmed worker processes serving one model.

        with ModelPool(PoolConfig(model="./tiny", workers=2)) as pool:
            result = pool.generate("Hello", max_new_tokens=16)
            future = pool.submit("Hello")          # concurrent.futures.Future
            for chunk in pool.stream("Hello"):     # text as it is generated
                print(chunk, end="")

    ``start()`` returns once every worker has loaded the model and said ready.
    Every call resolves within its deadline with a :class:`Result` or a
    :class:`~modelpool.errors.PoolError`.
    """

    def __init__(
        self,
        config: PoolConfig | None = None,
        /,
        *,
        gpu_probe: gpu.GpuProbe | None = None,
        **overrides: Any,
    ) -> None:
        """``overrides`` are PoolConfig fields; ``gpu_probe`` replaces the NVML probe (tests)."""
        if config is None:
            config = PoolConfig(**overrides)
        elif overrides:
            config = config.replace(**overrides)
        self.config = config
        self._backend_validate = _backend_validator(config.backend)
        self._futures: weakref.WeakValueDictionary[str, PoolFuture] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()
        self._queued = 0
        self._closed = False
        self._loop: _EventLoop | None = None
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._last_snapshot: PoolStats | None = None
        self._gpu_probe = gpu_probe
        # Ids unique across pools and restarts without a uuid (a system call) per request.
        self._id_prefix = f"{secrets.token_hex(5)}-"
        self._request_numbers = itertools.count(1)

    # ---- life cycle ------------------------------------------------------------------------

    def start(self) -> ModelPool:
        """Start every worker and wait until all are ready; raise ``ModelLoadFailed`` if not."""
        if self._closed:
            raise PoolClosed("the pool is closed")
        if self._loop is None:
            # Slow work (preparing an embedded model, probing NVML) outside the lock, so
            # that a close() from another thread is not stuck behind it.
            config = self.config
            model = _resolve_model(config.model)
            if model != config.model:
                config = config.replace(model=model)
            probe = self._gpu_probe or gpu.GpuProbe()
            devices = gpu.resolve_devices(config.devices, probe)
            with self._lock:
                if self._closed:
                    raise PoolClosed("the pool is closed")
                if self._loop is None:
                    self.config = config
                    self._loop = _EventLoop(self, config, devices, probe)
                    _live_pools.add(self)
                    self._loop.start()
        try:
            self._started.wait()
        except BaseException:
            self.close(drain=False, timeout=5.0)  # Ctrl-C while the model loads
            raise
        if self._start_error is not None:
            error = self._start_error
            self.close(drain=False, timeout=5.0)
            raise error
        return self

    def _on_started(self, error: BaseException | None) -> None:
        self._start_error = error
        self._started.set()

    def close(self, drain: bool = True, timeout: float = 30.0) -> None:
        """Stop accepting requests, finish (``drain``) or fail in-flight ones, stop every worker.

        Idempotent. Returns when every worker process is gone and reaped.
        """
        with self._lock:
            self._closed = True
            loop = self._loop
        if loop is None:
            return
        loop.post(loop.dispatcher.begin_close, drain, time.monotonic() + timeout)
        if threading.current_thread() is loop.thread:
            return  # Called from a callback: the dispatcher finishes the close after it.
        if loop.thread.is_alive():
            bound = (
                timeout
                + self.config.cancel_grace_s
                + 2 * self.config.term_grace_s
                + self.config.gpu_release_timeout_s
                + 10.0
            )
            loop.thread.join(bound)
            if loop.thread.is_alive():
                logger.error("the dispatcher did not stop within %.0fs; killing workers", bound)
                loop.kill_all_workers()
        self._last_snapshot = loop.dispatcher.snapshot() if not loop.thread.is_alive() else None
        _live_pools.discard(self)

    def __enter__(self) -> ModelPool:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- requests --------------------------------------------------------------------------

    def submit(
        self, prompt: Prompt, *, deadline_s: float | None = None, **gen_kwargs: Any
    ) -> PoolFuture:
        """Queue a request; returns a future with ``request_id``. Validation errors raise here."""
        return self._submit(prompt, deadline_s, gen_kwargs, None)

    def generate(
        self, prompt: Prompt, *, deadline_s: float | None = None, **gen_kwargs: Any
    ) -> Result:
        """Run one request and wait for it. Raises a ``PoolError`` subclass on failure."""
        loop = self._loop
        if loop is not None and threading.current_thread() is loop.thread:
            # Future callbacks run on the dispatcher thread; waiting there would stop it.
            raise PoolError("generate() called from a future callback; use submit() there")
        future = self._submit(prompt, deadline_s, gen_kwargs, None)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    def cancel(self, request_id: str) -> bool:
        """Stop a request; its future resolves with ``finish_reason="cancelled"`` and the text
        so far. False if the request is unknown or already finished."""
        loop = self._loop
        future = self._futures.get(request_id)
        if loop is None or future is None or future.done():
            return False
        loop.post(loop.dispatcher.cancel, request_id, False)
        return True

    def stream(
        self, prompt: Prompt, *, deadline_s: float | None = None, **gen_kwargs: Any
    ) -> PoolStream:
        """Text chunks as the worker produces them; leaving the loop early cancels.

        stream = pool.stream("Hello", max_new_tokens=32)
        for chunk in stream:
            print(chunk, end="")
        stream.result.finish_reason, stream.request_id
        """
        chunks: queue.SimpleQueue[object] = queue.SimpleQueue()
        future = self._submit(prompt, deadline_s, gen_kwargs, chunks.put)
        future.add_done_callback(lambda _: chunks.put(_END))
        return PoolStream(future, chunks.get)

    async def agenerate(
        self, prompt: Prompt, *, deadline_s: float | None = None, **gen_kwargs: Any
    ) -> Result:
        """asyncio version of :meth:`generate`; cancelling the task stops the worker."""
        future = self._submit(prompt, deadline_s, gen_kwargs, None)
        return await asyncio.wrap_future(future)

    def astream(
        self, prompt: Prompt, *, deadline_s: float | None = None, **gen_kwargs: Any
    ) -> AsyncPoolStream:
        """asyncio version of :meth:`stream`: ``async for chunk in pool.astream(...)``.

        No thread per stream: chunks reach the event loop through
        ``call_soon_threadsafe``. Cancelling the consuming task cancels the request.
        """
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue[object] = asyncio.Queue()

        def deliver(item: object) -> None:
            try:
                loop.call_soon_threadsafe(chunks.put_nowait, item)
            except RuntimeError:
                pass  # The event loop is closed; nobody is listening any more.

        future = self._submit(prompt, deadline_s, gen_kwargs, deliver)
        future.add_done_callback(lambda _: deliver(_END))
        return AsyncPoolStream(future, chunks)

    async def astats(self) -> PoolStats:
        """:meth:`stats` for asyncio code: awaits the dispatcher's snapshot without a thread."""
        loop = self._loop
        if loop is None or not loop.thread.is_alive():
            return self.stats()
        running = asyncio.get_running_loop()
        snapshot: asyncio.Future[PoolStats] = running.create_future()

        def build() -> None:
            stats = loop.dispatcher.snapshot()
            try:
                running.call_soon_threadsafe(_set_if_pending, snapshot, stats)
            except RuntimeError:
                pass  # The caller's event loop is gone.

        if not loop.post(build):
            return self.stats()
        try:
            return await asyncio.wait_for(asyncio.shield(snapshot), 5.0)
        except asyncio.TimeoutError:
            return self._last_snapshot or loop.dispatcher.snapshot()

    def stats(self) -> PoolStats:
        """A consistent snapshot, built by the dispatcher thread; never waits on a worker."""
        loop = self._loop
        if loop is None:
            return Dispatcher(self.config, _NoIO(), devices=[]).snapshot()
        if not loop.thread.is_alive() or threading.current_thread() is loop.thread:
            return self._last_snapshot or loop.dispatcher.snapshot()
        holder: list[PoolStats] = []
        ready = threading.Event()

        def build() -> None:
            holder.append(loop.dispatcher.snapshot())
            ready.set()

        if loop.post(build) and ready.wait(5.0):
            return holder[0]
        return self._last_snapshot or loop.dispatcher.snapshot()

    # ---- internals -----------------------------------------------------------------------------

    def _submit(
        self,
        prompt: Prompt,
        deadline_s: float | None,
        gen_kwargs: dict[str, Any],
        on_chunk: Callable[[Any], None] | None,
    ) -> PoolFuture:
        prompt = check_prompt(prompt)
        if deadline_s is None:
            deadline_s = self.config.deadline_s
        else:
            check_deadline(deadline_s)
        params = {**self.config.generation_defaults, **gen_kwargs}
        check_generation_params(params)
        if self._backend_validate is not None:
            try:
                self._backend_validate(params)
            except InvalidRequest:
                raise
            except (ValueError, TypeError) as exc:
                raise InvalidRequest(str(exc)) from exc
        try:
            payload = encode_request(prompt, params)
        except Exception as exc:
            raise InvalidRequest(f"the request cannot be sent to a worker: {exc!r}") from exc
        loop = self._loop
        with self._lock:
            if self._closed:
                raise PoolClosed("the pool is closed")
            if loop is None:
                raise PoolError(
                    "the pool is not started: call start() or use `with ModelPool(...)`"
                )
            failure = loop.dispatcher.failure
            if failure is not None:
                raise ModelLoadFailed(failure.message, worker_traceback=failure.worker_traceback)
            if loop.dispatcher.crashed:
                raise PoolError("the pool's dispatcher failed; see the log")
            if self._queued >= self.config.max_queue:
                loop.post(loop.dispatcher.count_overloaded)
                raise PoolOverloaded(f"the queue is full ({self.config.max_queue} waiting)")
            self._queued += 1
        now = time.monotonic()
        request_id = f"req-{self._id_prefix}{next(self._request_numbers):x}"
        future = PoolFuture(request_id, self._cancel_from_future)
        request = _Request(
            request_id=request_id,
            payload=payload,
            future=future,
            submitted_at=now,
            deadline=now + deadline_s,
            on_chunk=on_chunk,
        )
        self._futures[request_id] = future
        if not loop.post(loop.dispatcher.submit, request):
            self._on_dequeued()
            raise PoolClosed("the pool has stopped")
        return future

    def _on_dequeued(self) -> None:
        with self._lock:
            self._queued -= 1

    def _cancel_from_future(self, request_id: str) -> None:
        loop = self._loop
        if loop is not None:
            loop.post(loop.dispatcher.cancel, request_id, True)


class _Stream:
    """What :class:`PoolStream` and :class:`AsyncPoolStream` share: the request's id, its
    final result, and cancelling it when the consumer stops early."""

    def __init__(self, future: PoolFuture) -> None:
        self.future = future
        self.request_id = future.request_id
        self.result: Result | None = None
        self._finished = False

    def _accept(self, item: object) -> str | None:
        """The chunk; None at the end, where ``result`` is set or the typed error raised."""
        if item is _END:
            self._finished = True
            self.result = self.future.result()
            return None
        assert isinstance(item, str)
        return item

    def close(self) -> None:
        self._finished = True
        if not self.future.done():
            self.future.cancel()

    def __del__(self) -> None:
        self.close()


class PoolStream(_Stream, Iterator[str]):
    """The chunks of one request (``ModelPool.stream``).

    ``request_id`` is known at once; ``result`` is the final :class:`Result` once
    the iterator is exhausted (a failed request raises its typed error instead).
    ``close()``, leaving a ``with`` block, or dropping the stream unfinished
    cancels the request in its worker.
    """

    def __init__(self, future: PoolFuture, next_item: Callable[[], object]) -> None:
        super().__init__(future)
        self._next_item = next_item

    def __iter__(self) -> PoolStream:
        return self

    def __next__(self) -> str:
        if self._finished:
            raise StopIteration
        try:
            item = self._next_item()
        except BaseException:
            self.close()  # KeyboardInterrupt while waiting: the worker should stop too.
            raise
        chunk = self._accept(item)
        if chunk is None:
            raise StopIteration
        return chunk

    def __enter__(self) -> PoolStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AsyncPoolStream(_Stream, AsyncIterator[str]):
    """The chunks of one request (``ModelPool.astream``); see :class:`PoolStream`."""

    def __init__(self, future: PoolFuture, chunks: asyncio.Queue[object]) -> None:
        super().__init__(future)
        self._chunks = chunks

    def __aiter__(self) -> AsyncPoolStream:
        return self

    async def __anext__(self) -> str:
        if self._finished:
            raise StopAsyncIteration
        try:
            item = await self._chunks.get()
        except BaseException:
            self.close()  # The consuming task was cancelled: so is the request.
            raise
        chunk = self._accept(item)
        if chunk is None:
            raise StopAsyncIteration
        return chunk

    async def aclose(self) -> None:
        self.close()

    async def __aenter__(self) -> AsyncPoolStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()


def _set_if_pending(future: asyncio.Future[PoolStats], stats: PoolStats) -> None:
    if not future.done():
        future.set_result(stats)


def _resolve_model(model: str) -> str:
    """``embedded:NAME`` is prepared (once) and becomes its local directory."""
    if not model.startswith("embedded:"):
        return model
    from modelpool.embedded import resolve_model

    return resolve_model(model)


def _backend_validator(backend: str) -> Callable[[dict[str, Any]], None] | None:
    """The backend module's light ``validate(params)``, if it has one (DESIGN: Backends)."""
    module_name = resolve_backend(backend).partition(":")[0]
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        if backend in ("hf", "testing"):
            raise
        return None  # A custom backend may only be importable inside a worker.
    validate: Callable[[dict[str, Any]], None] | None = getattr(module, "validate", None)
    return validate


class _NoIO:
    """A DispatcherIO for a pool that has not started: it has nothing to do."""

    def spawn(self, worker: _Worker, spec: WorkerSpec) -> WorkerIO:
        raise PoolError("the pool is not started")

    def check_release(self, worker: _Worker) -> None:
        return None

    def watch_device_free(self, device: str, needed_bytes: int) -> None:
        return None

    def gpu_workers_changed(self, workers: list[tuple[int, int, str, int | None]]) -> None:
        return None
