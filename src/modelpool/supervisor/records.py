"""The dispatcher's records: requests, attempts, workers, timers, and the I/O seams; and
the record of a resolved request that observers get (``request_record``).

Everything here is owned by the dispatcher thread (see ``supervisor``) and needs no
locks. The states are ``Literal`` types so that a typo is a type error:

- a request is ``new`` (posted, not yet seen), ``queued``, ``backoff`` (waiting to be
  queued again after a failed attempt), ``running`` (one :class:`Run` on a worker) or
  ``done`` (its future is resolved);
- a worker is ``starting`` (loading the model), ``idle``, ``busy`` (at least one run),
  ``cancelling`` (every run on it was asked to stop), ``killing`` (signalled by the
  pool), ``stopping`` (asked to exit after recycling or close) or ``dead`` (reaped); its
  ``role`` says whether an idle worker takes requests (``serving``) or waits as a warm
  ``spare``. A worker holds up to ``slots`` runs at once (``max_batch_size``).
"""

from __future__ import annotations

import heapq
import itertools
import math
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from modelpool.scheduling.sizes import NO_WORK, UNKNOWN_SIZE, RunSize, Work
from modelpool.shared.errors import Attempt, PoolError
from modelpool.shared.protocol import Generation, PrefixCacheReport, WorkerSpec
from modelpool.supervisor.observe import AttemptRecord, RequestRecord, RequestStatus
from modelpool.supervisor.results import PoolFuture, Result

RequestState = Literal["new", "queued", "backoff", "running", "done"]
WorkerState = Literal["starting", "idle", "busy", "cancelling", "killing", "stopping", "dead"]
WorkerRole = Literal["serving", "spare"]
GpuWorker = tuple[int, int, str]
"""(worker id, pid, device label) of a live worker on GPUs, for the GPU monitors."""


@dataclass(eq=False)
class FailedBatch:
    """The requests of one batch of several that died together (poison isolation). When one
    of them then fails alone, that failure explains the batch's: the others are cleared of
    it (``Retries._clear_batch_peers``)."""

    members: list[Request]


@dataclass(eq=False)
class Request:
    request_id: str
    payload: bytes  # pickle of (prompt, the caller's params): see protocol.encode_request
    future: PoolFuture
    submitted_at: float
    deadline: float
    on_chunk: Callable[..., None] | None = None
    # The prompt's prefix fingerprints (modelpool.shared.prefixes), for placement by prefix cache.
    prefix_fingerprints: tuple[int, ...] = ()
    counted_chunks: bool = False  # on_chunk(text, TokenCounts | None) rather than on_chunk(text)
    # Lower runs first (queueing.dispatch_order); the caller's max_new_tokens, if it said;
    # its W3C trace context. For observers (observe.RequestRecord): each attempt's times.
    priority: int = 0
    # When it is promoted ahead of younger requests of every priority before it has
    # waited priority_aging_s: a request admitted by its predicted wait must leave the
    # queue within its bound (queueing.promoted).
    due_at: float = math.inf
    # When it arrived at a caller that queued it before the pool (a daemon's fair share,
    # ``queueing.arrived_at``): it ages from then, once. None: from submitted_at.
    arrived_at: float | None = None
    max_new_tokens: int | None = None
    # Its size (prompt, maximum), and what it added to the queued work when it was last
    # queued (taken away as it leaves: WaitPredictor.work_of).
    size: RunSize = UNKNOWN_SIZE
    queued_work: Work = NO_WORK
    predicted_ttft_s: float | None = None  # admitted by its predicted wait: that prediction
    traceparent: str | None = None
    attempt_log: list[AttemptRecord] = field(default_factory=list)
    first_token_at: float | None = None
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
    # Poison isolation (batched workers only): failed batches of more than one request it
    # was in, the ones of those it is still suspected for, and failures while it ran alone.
    # See Retries.batch_lost.
    batch_failures: int = 0
    suspected_in: list[FailedBatch] = field(default_factory=list)
    alone_failures: int = 0
    # Preemption (Dispatcher._preempt): may it run again from the start and be sure to
    # give the same text (greedy or seeded), and the text its caller was already shown
    # by attempts a more urgent request preempted, which a rerun does not stream again.
    reproducible: bool = True
    shown: str = ""
    preemptions: int = 0

    @property
    def waiting_since(self) -> float:
        """When it arrived, at its caller or here: it ages from then."""
        return self.submitted_at if self.arrived_at is None else self.arrived_at

    @property
    def isolated(self) -> bool:
        """Runs only alone on a worker from now on."""
        return self.batch_failures >= 2 or self.alone_failures >= 1

    @property
    def suspect(self) -> bool:
        """Was in a batch that failed, not yet explained: at most one such request per
        worker."""
        return bool(self.suspected_in)

    def result(self, generation: Generation, worker_pid: int | None, now: float) -> Result:
        """What the request resolves with: ``generation`` and its own times and attempts."""
        return Result(
            text=generation.text,
            finish_reason=generation.finish_reason,
            request_id=self.request_id,
            attempts=len(self.attempts),
            worker_pid=worker_pid,
            latency_s=now - self.submitted_at,
            queue_s=(self.first_dispatch_at or now) - self.submitted_at,
            prompt_tokens=generation.prompt_tokens,
            completion_tokens=generation.completion_tokens,
            logprobs=generation.logprobs,
            prompt_logprobs=generation.prompt_logprobs,
            cached_tokens=generation.cached_tokens or 0,
            token_ids=generation.token_ids,
            stop_sequence=generation.stop_sequence,
            pooled=generation.pooled,
            ttft_s=None if self.first_token_at is None else self.first_token_at - self.submitted_at,
            reasoning_tokens=generation.reasoning_tokens,
            thinking_closed=generation.thinking_closed,
        )


def request_record(
    request: Request,
    status: RequestStatus,
    now: float,
    generation: Generation | None = None,
    error: PoolError | None = None,
) -> RequestRecord:
    """The record of ``request`` that observers get (``observe``), resolved at ``now``
    (the dispatcher's clock)."""
    return RequestRecord(
        request_id=request.request_id,
        priority=request.priority,
        submitted_at=request.submitted_at,
        finished_at=now,
        status=status,
        first_dispatch_at=request.first_dispatch_at,
        first_token_at=request.first_token_at,
        attempts=list(request.attempt_log),
        finish_reason=None if generation is None else generation.finish_reason,
        error=None if error is None else type(error).__name__,
        error_message=None if error is None else error.message,
        prompt_tokens=None if generation is None else generation.prompt_tokens,
        completion_tokens=None if generation is None else generation.completion_tokens,
        cached_tokens=0 if generation is None else generation.cached_tokens or 0,
        max_new_tokens=request.max_new_tokens,
        traceparent=request.traceparent,
    )


@dataclass(eq=False)
class Run:
    """One attempt of a request on a worker, in batch slot ``slot``.

    ``request`` is None once detached (timed out, cancelled and resolved, lost with its
    batch); ``owner`` keeps the request for poison accounting either way.
    """

    attempt_id: int
    request: Request | None
    owner: Request
    worker: Worker
    slot: int
    started_at: float
    deadline: float
    alone: bool = False  # an isolated request: nothing else is admitted beside it
    chunks: list[str] = field(default_factory=list)
    cancel_sent: bool = False
    withdraw_sent: bool = False  # asked back from a worker where it waits for KV room
    # Sent to a one-call worker behind the run it is busy with (modelpool.scheduling.prefetch): not
    # started, so no attempt deadline or stall clock yet, and never charged if it is lost.
    prefetched: bool = False
    recalled: bool = False  # dropped while prefetched: the worker answers it unrun
    lost: bool = False  # counted against its owner as a failed batch or a failure alone
    deadline_timer: Timer | None = None
    grace_timer: Timer | None = None
    first_token_at: float | None = None
    record: AttemptRecord | None = None  # its entry in the owner's attempt_log
    preempted: bool = False  # cancelled for a more urgent request: its slot is on its way
    # A rerun after a preemption: the text its caller was shown already (not streamed
    # again), and how much of its own text has arrived.
    skip: str = ""
    produced: int = 0
    work: Work = NO_WORK  # its request's queued work, in the pool's work in flight

    def partial_text(self) -> str:
        return "".join(self.chunks)

    def continue_stream(self, text: str) -> tuple[Literal["send", "diverged"], str]:
        """What of a rerun's chunk ``text`` its caller has not seen: ("send", the unseen part,
        maybe ""), or ("diverged", "") when the rerun's text is not what was shown."""
        start = self.produced
        self.produced += len(text)
        shown = self.skip
        if start >= len(shown):
            return "send", text
        overlap = min(len(text), len(shown) - start)
        if text[:overlap] != shown[start : start + overlap]:
            return "diverged", ""
        if self.produced >= len(shown):
            self.skip = ""  # caught up: from here on its chunks go straight through
            self.produced = 0
        return "send", text[overlap:]


class WorkerIO(Protocol):
    """What the dispatcher may do to one worker process."""

    pid: int | None

    def send(self, message: tuple[Any, ...]) -> None: ...

    def request_cancel(self, slot: int, attempt_id: int) -> None: ...

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
    role: WorkerRole = "spare"  # decided by WorkerManager.rebalance
    slots: int = 1  # runs at once: min(max_batch_size, what its backend can)
    pid: int | None = None
    ready_at: float | None = None
    requests: int = 0
    rss_bytes: int | None = None
    gpu_bytes: int | None = None  # the sum over its GPUs
    gpu_method: str | None = None
    gpu_bytes_by_device: dict[str, int | None] = field(default_factory=dict)
    gpu_baselines: dict[str, int | None] = field(default_factory=dict)  # each GPU's used memory
    retire_reason: str | None = None  # the worker itself asked to be replaced (after a CUDA OOM)
    runs: dict[int, Run] = field(default_factory=dict)  # by attempt id
    progress_seen: int = 0  # the control block's progress word at the last stall check
    progress_at: float | None = None  # when it last moved (None: the clock has not started)
    signalled: bool = False  # the pool sent it a signal: its death is a kill, not a crash
    stopping: bool = False  # asked to exit: a clean exit is expected, not a crash
    kill_reason: str | None = None
    load_error: str | None = None
    ladder_timer: Timer | None = None
    startup_timer: Timer | None = None
    exit_code: int | None = None
    max_model_len: int | None = None
    # A batched backend's last room report: free KV room in tokens (None: never reported),
    # and the attempts it admitted that wait for room before their prefill.
    kv_free_tokens: int | None = None
    waiting_attempts: frozenset[int] = frozenset()
    # Its backend's prefix cache as last reported (None: it has none, or said nothing yet).
    prefix_cache: PrefixCacheReport | None = None

    def free_slot(self) -> int:
        """The lowest cancel word no run of it holds. A worker never holds more runs than
        it has words (``preemption.cancel_words``): a batched worker its rows, and a
        request handed the row of each preempted run still winding down; a one-call worker
        its run and its prefetched ones."""
        if not self.runs:
            return 0
        used = {run.slot for run in self.runs.values()}
        return next(slot for slot in range(len(self.runs) + 1) if slot not in used)


class DispatcherIO(Protocol):
    """What the dispatcher asks of the outside world (processes, threads, the clock)."""

    def spawn(self, worker: Worker, spec: WorkerSpec) -> WorkerIO: ...

    def check_release(self, worker: Worker) -> None: ...

    def watch_device_free(self, device: str, needed_bytes: int) -> None: ...

    def gpu_workers_changed(self, workers: list[GpuWorker]) -> None: ...


class NoIO:
    """A DispatcherIO for a pool that has not started: it has nothing to do."""

    def spawn(self, worker: Worker, spec: WorkerSpec) -> WorkerIO:
        raise PoolError("the pool is not started")

    def check_release(self, worker: Worker) -> None:
        return None

    def watch_device_free(self, device: str, needed_bytes: int) -> None:
        return None

    def gpu_workers_changed(self, workers: list[GpuWorker]) -> None:
        return None


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
