"""The dispatcher's records: requests, attempts, workers, timers, and the I/O seams.

Everything here is owned by the dispatcher thread (see ``supervisor``) and needs no
locks. The states are ``Literal`` types so that a typo is a type error:

- a request is ``new`` (posted, not yet seen), ``queued``, ``backoff`` (waiting to be
  queued again after a failed attempt), ``running`` (one :class:`Run` on a worker) or
  ``done`` (its future is resolved);
- a worker is ``starting`` (loading the model), ``idle``, ``busy``, ``cancelling`` (its
  cancel flag is set), ``killing`` (signalled by the pool), ``stopping`` (asked to exit
  after recycling or close) or ``dead`` (reaped); its ``role`` says whether an idle
  worker takes requests (``serving``) or waits as a warm ``spare``.
"""

from __future__ import annotations

import heapq
import itertools
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from modelpool.errors import Attempt, PoolError
from modelpool.protocol import WorkerSpec
from modelpool.results import PoolFuture

RequestState = Literal["new", "queued", "backoff", "running", "done"]
WorkerState = Literal["starting", "idle", "busy", "cancelling", "killing", "stopping", "dead"]
WorkerRole = Literal["serving", "spare"]
GpuWorker = tuple[int, int, str]
"""(worker id, pid, device label) of a live worker on GPUs, for the GPU monitors."""


@dataclass(eq=False)
class Request:
    request_id: str
    payload: bytes  # pickle of (prompt, the caller's params): see protocol.encode_request
    future: PoolFuture
    submitted_at: float
    deadline: float
    on_chunk: Callable[[str], None] | None = None
    state: RequestState = "new"
    attempts: list[Attempt] = field(default_factory=list)
    run: Run | None = None
    last_failed_worker: int | None = None
    first_dispatch_at: float | None = None
    streamed: bool = False
    cancel_requested: bool = False
    caller_gone: bool = False
    counted_as_queued: bool = True
    last_partial: str = ""
    deadline_timer: Timer | None = None
    last_error: PoolError | None = None


@dataclass(eq=False)
class Run:
    """One attempt of a request on a worker. ``request`` is None once detached."""

    attempt_id: int
    request: Request | None
    worker: Worker
    started_at: float
    deadline: float
    chunks: list[str] = field(default_factory=list)
    progress_seen: int = 0
    progress_at: float | None = None
    deadline_timer: Timer | None = None

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
class Worker:
    id: int
    slot: int
    device: str
    started_at: float
    io: WorkerIO | None = None
    state: WorkerState = "starting"
    role: WorkerRole = "spare"  # decided by Dispatcher._rebalance
    pid: int | None = None
    ready_at: float | None = None
    requests: int = 0
    rss_bytes: int | None = None
    gpu_bytes: int | None = None  # the sum over its GPUs
    gpu_method: str | None = None
    gpu_bytes_by_device: dict[str, int | None] = field(default_factory=dict)
    gpu_baselines: dict[str, int | None] = field(default_factory=dict)  # each GPU's used memory
    retire_reason: str | None = None  # the worker itself asked to be replaced (after a CUDA OOM)
    run: Run | None = None
    signalled: bool = False  # the pool sent it a signal: its death is a kill, not a crash
    stopping: bool = False  # asked to exit: a clean exit is expected, not a crash
    kill_reason: str | None = None
    load_error: str | None = None
    ladder_timer: Timer | None = None
    startup_timer: Timer | None = None
    exit_code: int | None = None
    max_model_len: int | None = None


class DispatcherIO(Protocol):
    """What the dispatcher asks of the outside world (processes, threads, the clock)."""

    def spawn(self, worker: Worker, spec: WorkerSpec) -> WorkerIO: ...

    def check_release(self, worker: Worker) -> None: ...

    def watch_device_free(self, device: str, needed_bytes: int) -> None: ...

    def gpu_workers_changed(self, workers: list[GpuWorker]) -> None: ...


def do_nothing(*args: Any) -> None:
    return None


class Timer:
    __slots__ = ("action", "args", "cancelled", "when")

    def __init__(self, when: float, action: Callable[..., None], args: tuple[Any, ...]) -> None:
        self.when = when
        self.action = action
        self.args = args
        self.cancelled = False


class TimerHeap:
    """Every timer of the dispatcher in one heap: attempt and request deadlines, kill-ladder
    steps, start-up timeouts, stall checks, respawn backoff. The event loop sleeps until
    :meth:`next_at` and then calls :meth:`run_due`."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Timer]] = []
        self._cancelled = 0
        self._sequence = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def call_at(self, when: float, action: Callable[..., None], *args: Any) -> Timer:
        timer = Timer(when, action, args)
        heapq.heappush(self._heap, (when, next(self._sequence), timer))
        return timer

    def next_at(self) -> float | None:
        while self._heap and self._heap[0][2].cancelled:
            heapq.heappop(self._heap)
        return self._heap[0][0] if self._heap else None

    def run_due(self, now: float) -> None:
        while self._heap and self._heap[0][0] <= now:
            _, _, timer = heapq.heappop(self._heap)
            if not timer.cancelled:
                action, args = timer.action, timer.args
                self.cancel(timer)
                action(*args)

    def cancel(self, timer: Timer | None) -> None:
        if timer is None or timer.cancelled:
            return
        timer.cancelled = True
        # A cancelled entry waits in the heap until its time; it must not keep a finished
        # request (its prompt, its text) alive that long.
        timer.action = do_nothing
        timer.args = ()
        self._cancelled += 1
        # Finished requests leave their deadline entries behind; drop them in bulk so the
        # heap stays proportional to what is in flight, not to the request rate.
        if self._cancelled > 1024 and self._cancelled * 2 > len(self._heap):
            self._heap = [entry for entry in self._heap if not entry[2].cancelled]
            heapq.heapify(self._heap)
            self._cancelled = 0


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
