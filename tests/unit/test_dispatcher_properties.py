"""Property-based tests of the dispatcher's bookkeeping: the REAL ``Dispatcher``.

A hypothesis state machine drives ``modelpool.supervisor.dispatcher.Dispatcher`` through
random interleavings of what the event loop feeds it: submits and cancels
(``pool.cancel`` and ``future.cancel``, posted as commands the way
``ModelPool`` posts them), worker ready / chunk / done / error messages for the
current attempt, for stale attempts (a result after its attempt timed out or
its worker was signalled, a duplicate) and for bogus ids, worker exits (crash,
clean, after a signal), clock advances that fire deadlines and ladder steps,
release-check results and ``begin_close``. Its ``io`` is a recording fake, its
clock a number the test advances.

After every step: each future resolved at most once, no worker double-booked
or sent a run while busy / not ready / signalled / told to stop, a retry never
on the worker that just failed it, the counters balance (``submitted ==
completed + failed + cancelled + live``), the max_queue accounting
(``on_dequeued``) balances, every record points the right way. At the end of
each example every deadline is passed and every worker exits: each request is
then resolved exactly once, and ``begin_close`` finishes.
"""

from __future__ import annotations

import concurrent.futures
import pickle
import signal
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from modelpool.shared.config import PoolConfig, RetryPolicy
from modelpool.shared.protocol import PROTOCOL_VERSION, Generation, WorkerSpec, encode_request
from modelpool.supervisor.dispatcher import Dispatcher
from modelpool.supervisor.records import GpuWorker, Request, Run, Worker
from modelpool.supervisor.results import PoolFuture

MB = 2**20
FAR = 1000.0  # seconds: beyond every deadline, grace, backoff and start-up timeout below


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class CountingFuture(PoolFuture):
    """A PoolFuture that counts the dispatcher's attempts to resolve it."""

    def __init__(self, request_id: str, on_cancel: Callable[[str], None]) -> None:
        super().__init__(request_id, on_cancel)
        self.resolutions = 0
        self.callbacks = 0
        self.add_done_callback(self._count)

    def _count(self, _: object) -> None:
        self.callbacks += 1

    def set_result(self, result: Any) -> None:
        self.resolutions += 1
        super().set_result(result)

    def set_exception(self, exception: BaseException | None) -> None:
        self.resolutions += 1
        super().set_exception(exception)


class FakeProc:
    """One worker process as the dispatcher's ``WorkerIO`` sees it; records everything."""

    def __init__(self, machine: DispatcherMachine, worker: Worker, pid: int) -> None:
        self.machine = machine
        self.worker = worker
        self.pid: int | None = pid
        self.alive = True
        self.ready = False
        self.eof = False  # its socket reached end of file: it says nothing more
        self.stop_received = False
        self.runs: list[int] = []  # attempt ids received, in order
        self.unanswered: int | None = None  # the attempt it is working on
        self.cancel_flags: list[int] = []
        self.signals: list[int] = []
        self.progress_count = 0

    def send(self, message: tuple[Any, ...]) -> None:
        self.machine.on_send(self, message)

    def request_cancel(self, slot: int, attempt_id: int) -> None:
        self.cancel_flags.append(attempt_id)

    def progress(self) -> int:
        return self.progress_count

    def signal_group(self, signum: int) -> None:
        self.signals.append(signum)


class FakeIO:
    def __init__(self, machine: DispatcherMachine) -> None:
        self.machine = machine

    def spawn(self, worker: Worker, spec: WorkerSpec) -> FakeProc:
        return self.machine.on_spawn(worker, spec)

    def check_release(self, worker: Worker) -> None:
        self.machine.on_check_release(worker)

    def watch_device_free(self, device: str, needed_bytes: int) -> None:
        return None

    def gpu_workers_changed(self, workers: list[GpuWorker]) -> None:
        return None


class CheckedDispatcher(Dispatcher):
    """The real Dispatcher; on its way into ``_dispatch`` it must believe the worker idle,
    serving and free, and the request queued."""

    def _dispatch(self, request: Request, worker: Worker) -> None:
        assert worker.state == "idle", f"dispatch to a {worker.state} worker"
        assert worker.role == "serving", "dispatch to a spare"
        assert not worker.runs, "dispatch to a worker with a current attempt"
        assert not worker.signalled and not worker.stopping, "dispatch to a worker on its way out"
        assert request.state == "queued" and request.run is None, request.state
        assert request.request_id not in self.queue, "dispatched but still queued"
        super()._dispatch(request, worker)


def current_run(worker: Worker) -> Run | None:
    """The worker's one attempt (these machines run max_batch_size=1)."""
    assert len(worker.runs) <= 1, f"{len(worker.runs)} attempts on a one-slot worker"
    return next(iter(worker.runs.values()), None)


def proc_eof(worker: Worker) -> bool:
    return isinstance(worker.io, FakeProc) and worker.io.eof


class DispatcherMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.procs: list[FakeProc] = []
        self.next_pid = 10_000
        self.pending_releases: list[int] = []
        self.released: set[int] = set()
        self.commands: list[tuple[Callable[..., None], tuple[Any, ...]]] = []
        self.requests: list[tuple[Request, CountingFuture]] = []
        self.delivered: set[str] = set()
        self.cancelled_before_delivery: set[str] = set()
        self.dequeued = 0
        self.history: dict[str, list[int]] = {}  # request id -> worker ids of its runs
        self.attempt_owner: dict[int, str] = {}
        self.batch_roll = 1
        self.dispatcher: Dispatcher | None = None

    # ---- the fake world ---------------------------------------------------------------------

    def on_spawn(self, worker: Worker, spec: WorkerSpec) -> FakeProc:
        assert self.dispatcher is not None
        assert not self.dispatcher.closing, "spawned a worker while closing"
        assert spec.device == worker.device
        self.next_pid += 1
        proc = FakeProc(self, worker, self.next_pid)
        self.procs.append(proc)
        return proc

    def on_check_release(self, worker: Worker) -> None:
        assert worker.state == "dead", f"release check of a live worker ({worker.state})"
        assert worker.id not in self.released and worker.id not in self.pending_releases, (
            f"worker {worker.id}: release checked twice"
        )
        self.pending_releases.append(worker.id)

    def on_send(self, proc: FakeProc, message: tuple[Any, ...]) -> None:
        assert proc.alive, f"sent {message[0]!r} to an exited worker"
        if message[0] == "stop":
            assert proc.unanswered is None, "told a busy worker to stop"
            proc.stop_received = True
            return
        assert message[0] == "run", message
        _, attempt_id, _slot, payload = message
        prompt, _params = pickle.loads(payload)
        worker = proc.worker
        assert not proc.eof, "run sent to a worker whose channel is closed"
        assert proc.ready, "run sent to a worker that never said ready"
        assert not proc.stop_received, "run sent to a worker told to stop"
        assert proc.unanswered is None, (
            f"double-booked: run {attempt_id} sent while {proc.unanswered} is unanswered"
        )
        assert not proc.signals, f"run sent to a worker already signalled {proc.signals}"
        run = current_run(worker)
        assert worker.state == "busy" and run is not None, worker.state
        assert run.attempt_id == attempt_id
        assert worker.role == "serving", "run sent to a spare"
        assert attempt_id not in self.attempt_owner, "attempt id reused"
        runs = self.history.setdefault(prompt, [])
        if runs:
            assert runs[-1] != worker.id, "retry on the worker that just failed it"
        config = self.config
        assert len(runs) < config.retry.max_retries + 1, "more attempts than max_retries + 1"
        runs.append(worker.id)
        self.attempt_owner[attempt_id] = prompt
        proc.runs.append(attempt_id)
        proc.unanswered = attempt_id

    def on_cancel_from_future(self, request_id: str) -> None:
        assert self.dispatcher is not None
        self.commands.append((self.dispatcher.cancel, (request_id, True)))

    def on_dequeued(self) -> None:
        self.dequeued += 1

    @property
    def d(self) -> Dispatcher:
        assert self.dispatcher is not None
        return self.dispatcher

    def after(self) -> None:
        """The event loop's bookkeeping step (after commands and due timers)."""
        self.d.after_event()

    # ---- set-up -------------------------------------------------------------------------------

    @initialize(
        workers=st.integers(1, 3),
        spares=st.integers(0, 2),
        attempt_timeout=st.sampled_from([None, 1.0, 3.0]),
        max_retries=st.sampled_from([0, 1, 2, 2]),
        retry_on=st.sampled_from(
            [("timeout", "crash"), ("timeout", "crash", "error"), ("timeout", "crash", "error"), ()]
        ),
        backoff=st.sampled_from([0.0, 0.3]),
        stall=st.sampled_from([None, None, 1.0]),
        max_requests=st.sampled_from([None, None, 2]),
        max_rss=st.sampled_from([None, 100.0]),
        give_up=st.sampled_from([1, 3, 5]),
        startup_timeout=st.sampled_from([1.0, 5.0]),
        ready_at_start=st.sampled_from([True, True, False]),
    )
    def setup(
        self,
        workers: int,
        spares: int,
        attempt_timeout: float | None,
        max_retries: int,
        retry_on: tuple[str, ...],
        backoff: float,
        stall: float | None,
        max_requests: int | None,
        max_rss: float | None,
        give_up: int,
        startup_timeout: float,
        ready_at_start: bool,
    ) -> None:
        self.config = PoolConfig(
            model="m",
            backend="testing",
            workers=workers,
            spares=spares,
            devices=("cpu",),
            deadline_s=5.0,
            attempt_timeout_s=attempt_timeout,
            cancel_grace_s=0.5,
            term_grace_s=0.5,
            startup_timeout_s=startup_timeout,
            stall_timeout_s=stall,
            retry=RetryPolicy(max_retries=max_retries, on=retry_on, backoff_s=backoff),
            max_requests_per_worker=max_requests,
            max_worker_rss_mb=max_rss,
            startup_failures_before_giving_up=give_up,
            # The machine's fake worker holds one run at a time; a one-call worker's
            # prefetched run is tests/unit/test_prefetch.py's.
            prefetch=False,
        )
        self.dispatcher = CheckedDispatcher(
            self.config,
            FakeIO(self),
            devices=["cpu"],
            clock=self.clock,
            on_dequeued=self.on_dequeued,
        )
        self.d.start()
        self.after()
        if ready_at_start:
            for proc in list(self.procs):
                self._ready(proc)

    # ---- callers ------------------------------------------------------------------------------

    @rule(
        deadline=st.sampled_from([0.4, 1.5, 5.0, 30.0]),
        stream=st.booleans(),
        cancel_at_once=st.sampled_from([False, False, False, True]),
        deliver=st.sampled_from([True, True, False]),
    )
    def submit(self, deadline: float, stream: bool, cancel_at_once: bool, deliver: bool) -> None:
        """As ModelPool._submit: a request record and a future, posted to the dispatcher."""
        now = self.clock()
        request_id = f"req-{len(self.requests)}"
        future = CountingFuture(request_id, self.on_cancel_from_future)
        chunks: list[str] = []
        request = Request(
            request_id=request_id,
            payload=encode_request(request_id, {"max_new_tokens": 8}),
            future=future,
            submitted_at=now,
            deadline=now + deadline,
            on_chunk=chunks.append if stream else None,
        )
        self.requests.append((request, future))
        self.commands.append((self._deliver_submit, (request,)))
        if cancel_at_once:
            future.cancel()
        if deliver:
            self.run_commands()

    def _deliver_submit(self, request: Request) -> None:
        self.delivered.add(request.request_id)
        if request.future.done():
            self.cancelled_before_delivery.add(request.request_id)
        self.d.submit(request)

    @rule()
    def run_commands(self) -> None:
        """The event loop's _run_commands: everything posted so far, then its bookkeeping."""
        commands, self.commands = self.commands, []
        for action, args in commands:
            action(*args)
        self.after()

    @precondition(lambda self: self.requests)
    @rule(index=st.integers(0, 63))
    def pool_cancel(self, index: int) -> None:
        request, future = self.requests[index % len(self.requests)]
        if not future.done():  # as ModelPool.cancel
            self.commands.append((self.d.cancel, (request.request_id, False)))

    @precondition(lambda self: self.requests)
    @rule(index=st.integers(0, 63))
    def future_cancel(self, index: int) -> None:
        _, future = self.requests[index % len(self.requests)]
        future.cancel()

    # ---- workers ------------------------------------------------------------------------------

    def _alive(self, predicate: Callable[[FakeProc], bool] = lambda p: True) -> list[FakeProc]:
        return [p for p in self.procs if p.alive and predicate(p)]

    def _exit(self, proc: FakeProc, code: int) -> None:
        proc.alive = False
        self.d.on_exit(proc.worker, code)
        self.after()

    def _ready(self, proc: FakeProc, good_version: bool = True) -> None:
        proc.ready = True
        version = PROTOCOL_VERSION if good_version else PROTOCOL_VERSION + 100
        assert proc.pid is not None
        self.d.on_message(proc.worker, ("ready", version, proc.pid, 20 * MB, 2048))
        self.after()

    def _say(self, proc: FakeProc, what: str, attempt_id: int, finish: str, rss: int) -> None:
        message: tuple[Any, ...]
        if what == "chunk":
            proc.progress_count += 1
            message = ("chunk", attempt_id, "x")
        elif what == "done":
            generation = Generation("text", finish, 1, 1)  # type: ignore[arg-type]
            message = ("done", attempt_id, generation, rss)
        elif what == "invalid" and attempt_id % 2:
            detail = (6000, 4000, 8192)  # a context-length refusal, with its numbers
            message = ("error", attempt_id, "context_length", "too long", "", rss, detail)
        else:
            kind = "invalid" if what == "invalid" else "backend"
            message = ("error", attempt_id, kind, "RuntimeError: boom", "Traceback", rss)
        if what != "chunk" and attempt_id == proc.unanswered:
            proc.unanswered = None
        self.d.on_message(proc.worker, message)
        if self.batch_roll % 4:  # else: more messages arrive before the loop's bookkeeping
            self.after()

    @precondition(lambda self: any(p.alive for p in self.procs))
    @rule(
        index=st.integers(0, 63),
        roll=st.integers(0, 99),
        finish=st.sampled_from(["stop", "stop", "length", "cancelled"]),
        rss_mb=st.sampled_from([20, 20, 20, 150]),
        salt=st.integers(0, 63),
    )
    def worker_event(self, index: int, roll: int, finish: str, rss_mb: int, salt: int) -> None:
        """What one worker process does next, weighted by where it is.

        Starting: says ready (rarely with a foreign protocol), fails its load, or dies.
        Signalled or told to stop: obeys (SIGTERM may be ignored), or carries on.
        Busy: streams a chunk, finishes, raises, rejects, repeats an old attempt id
        (a stale or duplicate message), sends an id never issued, or dies.
        Idle: sends a stale or bogus message, or dies.
        """
        candidates = self._alive()
        proc = candidates[index % len(candidates)]
        rss = rss_mb * MB
        if proc.eof:  # nothing more comes from it but its exit (or it lingers, and is killed)
            if roll < 50:
                self._exit(proc, (-signal.SIGKILL if proc.signals else 1))
            return
        if roll >= 97:
            proc.eof = True  # the socket reached end of file (exit normally follows)
            self.d.channel_closed(proc.worker)
            self.after()
            return
        if roll == 96 and proc.ready:
            self.d.protocol_error(proc.worker)  # an undecodable frame
            self.after()
            return
        stale = proc.runs[salt % len(proc.runs)] if proc.runs else 1_000_000 + salt
        bogus = 1_000_000 + salt
        self.batch_roll = salt
        if not proc.ready:
            if roll < 85:
                self._ready(proc, good_version=roll >= 2)
            elif roll < 93:
                self.d.on_message(proc.worker, ("load_failed", "Traceback: no model"))
                self.after()
                self._exit(proc, 3)
            else:
                self._exit(proc, -signal.SIGSEGV)
            return
        if (proc.signals or proc.stop_received) and roll < 60:
            if signal.SIGKILL in proc.signals:
                self._exit(proc, -signal.SIGKILL)
            elif signal.SIGTERM in proc.signals and roll < 40:
                self._exit(proc, -signal.SIGTERM)  # else: SIGTERM ignored, like "hang"
            elif proc.stop_received:
                self._exit(proc, 0)
            return
        roll = (roll * 7 + salt) % 100  # a fresh roll for what follows
        if proc.unanswered is not None:
            current = proc.unanswered
            if roll < 36:
                self._say(proc, "done", current, finish, rss)
            elif roll < 56:
                self._say(proc, "chunk", current, finish, rss)
            elif roll < 66:
                self._say(proc, "error", current, finish, rss)
            elif roll < 69:
                self._say(proc, "invalid", current, finish, rss)
            elif roll < 75:
                proc.progress_count += 1  # checked its cancel flag: progress without output
            elif roll < 84:
                self._say(proc, ("done", "chunk", "error")[salt % 3], stale, finish, rss)
            elif roll < 87:
                self._say(proc, "done", bogus, finish, rss)
            else:
                self._exit(proc, (-signal.SIGSEGV, -signal.SIGKILL, 1, 0)[salt % 4])
            return
        if roll < 45:
            self._say(proc, ("done", "chunk", "error")[salt % 3], stale, finish, rss)
        elif roll < 60:
            self._say(proc, "done", bogus, finish, rss)
        elif roll < 75:
            self._exit(proc, (-signal.SIGSEGV, -signal.SIGKILL, 1, 0)[salt % 4])

    @precondition(lambda self: self.pending_releases)
    @rule(index=st.integers(0, 63), ok=st.sampled_from([True, True, True, False]))
    def release_checked(self, index: int, ok: bool) -> None:
        worker_id = self.pending_releases.pop(index % len(self.pending_releases))
        self.released.add(worker_id)
        self.d.worker_manager.on_release_checked(
            worker_id, ok, 0.01, "psutil", 20 * MB, None if ok else MB
        )
        self.after()

    # ---- time and closing ---------------------------------------------------------------------

    @rule(dt=st.sampled_from([0.01, 0.1, 0.3, 0.5, 1.0, 2.5, 6.0]))
    def advance(self, dt: float) -> None:
        self.clock.now += dt
        self.d.run_due_timers()
        self.after()
        # Every request is resolved when its deadline passes, wherever it is (queued, in
        # backoff, running on a worker that never answers).
        overdue = [r.request_id for r in self.d.live.values() if r.deadline <= self.clock.now]
        assert not overdue, f"requests past their deadline still unresolved: {overdue}"

    @rule(drain=st.booleans(), timeout=st.sampled_from([0.0, 1.0, 10.0]), roll=st.integers(0, 15))
    def begin_close(self, drain: bool, timeout: float, roll: int) -> None:
        if roll:
            return  # closing ends the interesting part of an example: keep it rare
        self.d.begin_close(drain, self.clock() + timeout)
        self.after()

    # ---- invariants ---------------------------------------------------------------------------

    @invariant()
    def futures_resolved_at_most_once(self) -> None:
        for request, future in self.requests:
            assert future.resolutions <= 1, f"{request.request_id} resolved {future.resolutions}x"
            assert future.callbacks <= 1, f"{request.request_id}: {future.callbacks} callbacks"
            if future.resolutions:
                assert request.request_id not in self.d.live

    @invariant()
    def counters_balance(self) -> None:
        if self.dispatcher is None:
            return
        c = self.d.counters
        live = len(self.d.live)
        assert c["submitted"] == len(self.delivered)
        assert c["completed"] + c["failed"] + c["cancelled"] + live == c["submitted"], c
        # max_queue accounting: each request leaves the count exactly once
        still_counted = sum(r.counted_as_queued for r in self.d.live.values())
        assert self.dequeued == len(self.delivered) - still_counted, (
            self.dequeued,
            len(self.delivered),
            still_counted,
        )
        snapshot = self.d.snapshot()
        assert snapshot.queue_depth == len(self.d.queue) >= 0
        assert snapshot.max_model_len in (None, 2048)

    @invariant()
    def records_point_the_right_way(self) -> None:
        if self.dispatcher is None:
            return
        d = self.d
        for request_id, request in d.queue.items():
            assert d.live.get(request_id) is request
            assert request.state == "queued" and request.run is None
        busy_workers: set[int] = set()
        for request in d.live.values():
            assert request.state in ("queued", "backoff", "running"), request.state
            if request.state == "backoff":
                assert request.request_id not in d.queue
            if request.state == "running":
                run = request.run
                assert run is not None and run.request is request
                assert current_run(run.worker) is run, "a running request whose worker moved on"
                # or being killed with the request attached (protocol error, closed channel):
                # the exit that a SIGKILL guarantees resolves it
                assert run.worker.state in ("busy", "cancelling") or (
                    run.worker.state == "killing" and run.worker.signalled
                ), run.worker.state
                assert run.worker.id not in busy_workers, "two requests on one worker"
                busy_workers.add(run.worker.id)
        per_slot: dict[int, int] = {}
        for worker in d.workers.values():
            if worker.state == "idle":
                assert current_run(worker) is None
            if worker.state in ("busy", "cancelling"):
                assert current_run(worker) is not None
            if worker.state == "killing":
                assert worker.signalled or proc_eof(worker), "killing an unsignalled worker"
            if worker.state != "dead":
                per_slot[worker.slot] = per_slot.get(worker.slot, 0) + 1
        assert all(n == 1 for n in per_slot.values()), f"two live workers in a slot {per_slot}"
        assert len(per_slot) <= d.slot_count

    # ---- the end: every deadline passes, every worker exits ------------------------------------

    def _settle(self, rounds: int = 40) -> None:
        for _ in range(rounds):
            self.run_commands()
            for proc in self._alive(lambda p: bool(p.signals) or p.stop_received or p.eof):
                if proc.signals or proc.eof:
                    self._exit(proc, -signal.SIGKILL)
                else:
                    self._exit(proc, 0)
            while self.pending_releases:
                self.release_checked(0, True)
            self.clock.now += FAR
            self.d.run_due_timers()
            self.after()

    def teardown(self) -> None:
        if self.dispatcher is None:
            return
        self._settle()
        for request, future in self.requests:
            expected = 0 if request.request_id in self.cancelled_before_delivery else 1
            assert future.resolutions == expected, (
                f"{request.request_id} resolved {future.resolutions}x, expected {expected}"
            )
            assert future.done()
        assert not self.d.live and not self.d.queue
        c = self.d.counters
        assert c["completed"] + c["failed"] + c["cancelled"] == c["submitted"], c
        assert self.dequeued == len(self.delivered)
        # Closing ends with every worker gone and every release checked.
        self.d.begin_close(False, self.clock())
        self.after()
        for _ in range(10):
            self._settle(1)
            for proc in self._alive(lambda p: p.worker.state == "starting"):
                self._exit(proc, -signal.SIGKILL)  # killed by close (or not yet asked to be)
            if self.d.finished:
                break
        assert self.d.finished, [(w.id, w.state) for w in self.d.workers.values()]
        assert not self._alive(), "a worker process outlived close"


DispatcherMachine.TestCase.settings = settings(
    max_examples=500,
    stateful_step_count=50,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestDispatcherProperties = DispatcherMachine.TestCase


# --------------------------------------------------------------------------------------------
# Focused regressions for what the machine (and the chaos harness) found.


def test_cancelled_future_is_done_for_concurrent_futures_wait() -> None:
    """``concurrent.futures.wait`` / ``as_completed`` must see a cancelled PoolFuture as done.

    ``Future.cancel()`` only moves a pending future to CANCELLED; ``wait`` counts
    CANCELLED_AND_NOTIFIED, which an executor sets when its worker reaches the item
    (``set_running_or_notify_cancel``). Nothing does that for a PoolFuture, so
    ``wait([f])`` after ``f.cancel()`` blocks until its timeout (forever without one).
    """
    future = PoolFuture("req-x", lambda request_id: None)
    assert future.cancel()
    done, _ = concurrent.futures.wait([future], timeout=0.2)
    assert future in done
    assert list(concurrent.futures.as_completed([future], timeout=0.2)) == [future]


def test_ready_after_startup_kill_is_not_dispatched_to() -> None:
    """The start-up timeout SIGKILLs a starting worker; its "ready" was already on the way
    (the event loop reads the socket before it sees the pidfd). The dispatcher must not
    make that worker idle and hand it a request: the run is lost to a process that is
    being killed, and the attempt is recorded as a "timeout" of a healthy request."""
    machine = DispatcherMachine()
    machine.setup(
        workers=1,
        spares=0,
        attempt_timeout=None,
        max_retries=2,
        retry_on=("timeout", "crash"),
        backoff=0.0,
        stall=None,
        max_requests=None,
        max_rss=None,
        give_up=3,
        startup_timeout=1.0,
        ready_at_start=False,
    )
    machine.advance(1.0)  # start-up timeout: SIGKILL sent, the exit not yet seen
    (proc,) = machine.procs
    assert proc.signals == [signal.SIGKILL]
    machine.submit(deadline=30.0, stream=False, cancel_at_once=False, deliver=True)
    machine._ready(proc)  # AssertionError from on_send: "run sent to a worker already signalled"
    assert proc.unanswered is None, "the request went to a worker being killed"
    # The kill lands; a replacement starts (after the start-up backoff) and serves it.
    machine._exit(proc, -signal.SIGKILL)
    while len(machine.procs) == 1:
        machine.advance(0.1)
    replacement = machine.procs[1]
    machine._ready(replacement)
    attempt = replacement.unanswered
    assert attempt is not None, "the replacement was not given the request"
    machine._say(replacement, "done", attempt, "stop", 20 * MB)
    [(_, future)] = machine.requests
    result = future.result(timeout=0)
    assert result.attempts == 1 and result.worker_pid == replacement.pid


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-q"])
