"""Chaos and soak harness: nothing is lost, nothing is left behind.

``scripts/chaos --requests 2000 --seed 1 --report chaos.json`` drives a pool of
the fault-injection backend (:mod:`modelpool.worker.backends.testing`) from many threads and
asyncio tasks at once with a seeded mix of requests, while an outside agent
SIGKILLs random busy and idle workers and now and then SIGSTOPs a busy one.
Every request's outcome is checked against what its fault should give:

===========  ===========================  ==========================================
kind         prompt                       expected outcome
===========  ===========================  ==========================================
normal       ``echo:<unique id>``         ``Result.text`` == the id
slow         ``tokens:N:0.005``           the N tokens, ``finish_reason`` "stop"
stream       ``tokens:N:0.005``           joined chunks == the N tokens
cancel       ``tokens:150:0.005``         cancelled after a random short delay by
                                          ``pool.cancel`` / ``future.cancel`` /
                                          ``task.cancel`` / closing the stream
hang         ``hang`` (ignores SIGTERM)   ``DeadlineExceeded``
hog          ``hog:50``                   ``DeadlineExceeded``
segfault     ``segfault``                 ``WorkerCrashed`` after max_retries+1 crashes
exit         ``exit:CODE``                ``WorkerCrashed`` after max_retries+1 crashes
raise        ``raise:MSG``                ``BackendError`` (not retried)
batch_raise  ``batch_raise:MSG``          batched: the step fails (no one row to blame),
                                          its rows are a lost batch on a warm worker; it
                                          ends ``BackendError`` alone (or the suspect)
leak         ``leak:25``                  "ok" (and the worker is recycled on RSS)
crash_once   ``crash_once:PATH``          "ok" on the retry
invalid      bad parameters / prompt      ``InvalidRequest`` before dispatch
===========  ===========================  ==========================================

``--grammar`` mixes structured-output compilations in (the testing backend rehearses
them, see :mod:`modelpool.worker.backends.testing`):

================  ==================================  ====================================
grammar           ``echo:<id>``, a grammar that       the id (compiled off the loop,
                  compiles in 10 ms (shared or new)   cached or not)
grammar_hang      a grammar whose compilation hangs   ``GrammarCompileTimeout`` past
                                                      ``grammar_compile_timeout_s``, not
                                                      retried, the worker still warm
grammar_segfault  a compilation that segfaults        as ``segfault``
================  ==================================  ====================================

``--backend llama_cpp`` runs the same harness on a real model (the embedded SmolLM2
GGUF on the llama_cpp backend) with the kinds that need no fault injection: normal,
slow, stream and cancel requests count greedily ("1, 2, 3, 4,") up to a stop string, and
their expected texts are decoded once in-process before the load; invalid requests as
above. The agent's SIGKILLs and SIGSTOPs, cancels and deadlines are the same.

A request may deviate from its expected outcome only where the agent struck
the workers of its attempts (the pids it killed or stopped are recorded and
compared with the error's ``attempts``). At the end the harness checks: no
request unresolved or resolved twice (done-callbacks counted per future), no
wrong result, the pool back to full strength, the counters consistent, every
departed worker's release check done, no child process, zombie, process group
or frozen worker left after ``close()``, and the supervisor's RSS not growing
(least-squares slope over the second half of the load). It prints one summary
line, writes a JSON report with ``--report``, and exits 1 on any violation.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import queue
import random
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from modelpool.shared.config import PoolConfig, RetryPolicy
from modelpool.shared.errors import (
    BackendError,
    DeadlineExceeded,
    GrammarCompileTimeout,
    InvalidRequest,
    PoolError,
    WorkerCrashed,
)
from modelpool.shared.processes import process_group_exists
from modelpool.supervisor.pool import ModelPool, PoolFuture, Result
from modelpool.supervisor.stats import PoolStats, ReleaseStats

logger = logging.getLogger("modelpool.chaos")

# Kind -> weight in the seeded mix (percent-ish; they need not sum to 100).
MIX: dict[str, float] = {
    "normal": 30,
    "slow": 12,
    "stream": 12,
    "cancel": 13,
    "hang": 3,
    "hog": 2,
    "segfault": 3,
    "exit": 3,
    "raise": 5,
    "batch_raise": 3,
    "leak": 5,
    "crash_once": 4,
    "invalid": 3,
}
GRAMMAR_MIX: dict[str, float] = {"grammar": 8, "grammar_hang": 3, "grammar_segfault": 2}
GRAMMAR_COMPILE_TIMEOUT_S = 0.3
FAULT_DEADLINE_S = 2.0  # the pool's default deadline: what hang and hog requests run under
LONG_DEADLINE_S = 20.0  # everything that should finish gets room for queueing and retries
ATTEMPT_TIMEOUT_S = 2.0  # catches a frozen (SIGSTOPped) worker; a normal request is retried
LATE_SLACK_S = 2.0  # a request resolved later than deadline + this is a violation
RECOVERY_BOUND_S = 30.0  # after the load stops, full strength must be back within this
STUCK_BOUND_S = 30.0  # a client that makes no progress for deadline + this is stuck
RSS_SAMPLE_S = 0.5
# Supervisor RSS growth that counts as a leak: a least-squares slope over the second half of
# the load above RSS_SLOPE_LIMIT_MB_MIN *and* a fitted growth over that half above
# RSS_GROWTH_FLOOR_MB. Measured (2 cores, default mix, ~15 requests/s): RSS warms up by ~6 MB
# over the first ~1000 requests (malloc arenas of the client, release-check and dispatcher
# threads), then stays flat (second-half slope of a 2000-request run: +0.2 MB/min). The most
# warm-up a second half can contain is ~3.2 MB (a run as long as the warm-up), below the
# floor; a leak of 1 KB per request at that rate is ~0.9 MB/min, one of a worker record per
# respawn a few MB/min: a 10 000-request soak (its second half ~5 min) catches either.
RSS_SLOPE_LIMIT_MB_MIN = 1.0
RSS_GROWTH_FLOOR_MB = 5.0


def tokens(count: int) -> str:
    """What ``tokens:COUNT:DELAY`` returns."""
    return "".join(f"t{index} " for index in range(count))


@dataclass
class Spec:
    """One request of the seeded mix (derived from seed and index alone)."""

    index: int
    kind: str
    side: str  # "thread" or "task"
    api: str  # submit | generate | stream | wrap | agenerate | astream
    prompt: Any
    expected: str | None
    deadline_s: float
    params: dict[str, Any] = field(default_factory=dict)
    pass_deadline: bool = True
    cancel_how: str | None = None  # pool | future | task | close
    cancel_after_s: float = 0.0


@dataclass(slots=True)
class Record:
    """What happened to one request (kept small: a soak keeps 10 000 of them)."""

    index: int
    kind: str
    api: str
    cancel_how: str | None
    deadline_s: float
    started: float = 0.0
    latency: float | None = None
    outcome: str | None = None  # ok | length | cancelled | CancelledError | closed | <error>
    text: str | None = None  # kept only when wrong (see digest)
    text_match: str | None = None  # full | prefix | wrong, against the expected text
    text_len: int | None = None
    n_attempts: int | None = None
    attempts: list[tuple[int | None, str]] = field(default_factory=list)
    worker_pid: int | None = None
    callbacks: int | None = None  # done-callbacks seen on the future or task, where we hold one
    cancel_returned: bool | None = None
    request_id: str | None = None
    message: str | None = None
    violation: str | None = None


def mix_for(args: argparse.Namespace) -> dict[str, float]:
    if getattr(args, "backend", "testing") == "llama_cpp":
        return LLAMA_MIX
    return {**MIX, **GRAMMAR_MIX} if getattr(args, "grammar", False) else MIX


# --backend llama_cpp: the kinds a real model can be asked for, each a greedy count.
LLAMA_MIX: dict[str, float] = {"normal": 40, "slow": 15, "stream": 15, "cancel": 20, "invalid": 10}
COUNT_PROMPT = "1, 2, 3, 4,"
STOP_AT = (6, 8, 10, 12, 16)  # normal, slow and stream requests stop at " N,"
CANCEL_STOP_AT = 40  # long enough to be cancelled on the way
# A real count takes seconds on a loaded CPU, and a collateral retry starts it again; a
# cancel is honoured at the next decoding step, which can take longer than the fault
# backend's 0.2 s grace when the cores are shared.
LLAMA_ATTEMPT_TIMEOUT_S = 30.0
LLAMA_DEADLINE_S = 60.0
LLAMA_CANCEL_GRACE_S = 2.0


def real_texts(model_dir: str) -> dict[int, str]:
    """The greedy count up to each stop string, decoded once in this process."""
    from modelpool.worker.backends.llama_cpp import load_generation

    handler = load_generation(model_dir, threads=1)
    texts: dict[int, str] = {}
    for stop_at in (*STOP_AT, CANCEL_STOP_AT):
        call = _CountCall(COUNT_PROMPT, {"max_new_tokens": 200, "stop": [f" {stop_at},"]})
        generation = handler.generate(call)
        if generation.finish_reason != "stop":
            raise RuntimeError(f"the model did not count to {stop_at}: {generation.text!r}")
        texts[stop_at] = generation.text
    return texts


@dataclass
class _CountCall:
    prompt: Any
    params: dict[str, Any]

    def cancelled(self) -> bool:
        return False

    def emit(self, text: str) -> None:
        pass


def spec_for(args: argparse.Namespace, index: int, tmpdir: str) -> Spec:
    """Request ``index`` of the run: the seeded mix, as a real count on a real model."""
    spec = make_spec(args.seed, index, tmpdir, mix_for(args))
    texts: dict[int, str] | None = getattr(args, "real_texts", None)
    if texts is None or spec.kind == "invalid":
        return spec
    rng = random.Random(args.seed * 7_919 + index)
    stop_at = CANCEL_STOP_AT if spec.kind == "cancel" else rng.choice(STOP_AT)
    spec.prompt = COUNT_PROMPT
    spec.params = {"max_new_tokens": 200, "stop": [f" {stop_at},"]}
    spec.expected = texts[stop_at]
    spec.deadline_s = LLAMA_DEADLINE_S
    return spec


def make_spec(seed: int, index: int, tmpdir: str, mix: dict[str, float]) -> Spec:
    rng = random.Random(seed * 1_000_003 + index)
    kind = rng.choices(list(mix), weights=list(mix.values()))[0]
    side = "thread" if rng.random() < 0.5 else "task"
    plain = ("submit", "generate") if side == "thread" else ("agenerate", "wrap")
    api = rng.choice(plain)
    spec = Spec(
        index=index,
        kind=kind,
        side=side,
        api=api,
        prompt="",
        expected=None,
        deadline_s=LONG_DEADLINE_S,
    )
    if kind == "normal":
        ident = f"c{seed}-{index}-{rng.getrandbits(32):08x}"
        spec.prompt, spec.expected = f"echo:{ident}", ident
    elif kind in ("slow", "stream"):
        count = rng.randint(5, 60)
        spec.prompt, spec.expected = f"tokens:{count}:0.005", tokens(count)
        if kind == "stream":
            spec.api = "stream" if side == "thread" else "astream"
    elif kind == "cancel":
        spec.prompt, spec.expected = "tokens:150:0.005", tokens(150)
        spec.params = {"max_new_tokens": 200}
        spec.cancel_after_s = round(rng.uniform(0.0, 0.5), 3)
        if side == "thread":
            spec.cancel_how = rng.choice(("pool", "future", "close"))
            spec.api = "stream" if spec.cancel_how == "close" else "submit"
        else:
            spec.cancel_how = rng.choice(("task", "task", "close"))
            spec.api = "astream" if spec.cancel_how == "close" else "agenerate"
    elif kind in ("hang", "hog"):
        spec.prompt = "hang" if kind == "hang" else "hog:50"
        spec.deadline_s, spec.pass_deadline = FAULT_DEADLINE_S, False
    elif kind == "segfault":
        spec.prompt = "segfault"
    elif kind == "grammar":
        ident = f"g{seed}-{index}-{rng.getrandbits(32):08x}"
        spec.prompt, spec.expected = f"echo:{ident}", ident
        # Half share one text (the worker's cache answers), half are new to it.
        text = "shared" if rng.random() < 0.5 else ident
        spec.params = {"grammar": f'start: "compile_sleep:0.01 {text}"'}
    elif kind == "grammar_hang":
        spec.prompt = "echo:x"
        spec.params = {"grammar": f'start: "compile_hang {index}"'}
    elif kind == "grammar_segfault":
        spec.prompt = "echo:x"
        spec.params = {"grammar": f'start: "compile_segfault {index}"'}
    elif kind == "exit":
        spec.prompt = f"exit:{rng.choice((0, 1, 3, 7, 42))}"
    elif kind == "raise":
        spec.prompt = f"raise:chaos-{index}"
    elif kind == "batch_raise":
        spec.prompt = f"batch_raise:chaos-{index}"
    elif kind == "leak":
        spec.prompt, spec.expected = "leak:25", "ok"
    elif kind == "crash_once":
        spec.prompt, spec.expected = f"crash_once:{tmpdir}/once-{index}", "ok"
    elif kind == "invalid":
        invalid: list[tuple[Any, dict[str, Any]]] = [
            ("echo:x", {"temperature": -1.0}),
            ("echo:x", {"top_p": 2}),
            ("echo:x", {"max_new_tokens": 0}),
            ("echo:x", {"no_such_parameter": 1}),
            ([{"role": "user"}], {}),
            ([], {}),
            (42, {}),
        ]
        spec.prompt, spec.params = rng.choice(invalid)
    else:  # pragma: no cover - the mix names only the kinds above
        raise ValueError(f"unknown kind {kind!r}")
    return spec


def match_text(text: str | None, expected: str | None) -> str | None:
    """How a request's text compares with what its kind should give."""
    if text is None:
        return None
    if text == (expected or ""):
        return "full"
    return "prefix" if (expected or "").startswith(text) else "wrong"


def digest(record: Record, expected: str | None) -> None:
    """Keep the verdict on the text, not the text: a soak holds 10 000 records, and the
    supervisor's RSS slope must measure the pool, not the harness."""
    if record.text is None:
        return
    record.text_match = match_text(record.text, expected)
    record.text_len = len(record.text)
    record.text = record.text[:120] if record.text_match == "wrong" else None


def _error_record(record: Record, error: BaseException) -> None:
    record.outcome = type(error).__name__
    record.message = str(error)[:160]
    if isinstance(error, PoolError):
        record.attempts = [(a.worker_pid, a.outcome) for a in error.attempts]
        record.n_attempts = len(error.attempts)
        record.request_id = error.request_id


def _result_record(record: Record, result: Result) -> None:
    record.outcome = "ok" if result.finish_reason == "stop" else result.finish_reason
    record.text = result.text
    record.n_attempts = result.attempts
    record.worker_pid = result.worker_pid
    record.request_id = result.request_id


# --------------------------------------------------------------------------------------------
# The outside agent: kills and freezes workers it does not own.


class Agent:
    def __init__(
        self, pool: ModelPool, rng: random.Random, interval_s: float, stop_share: float
    ) -> None:
        self.pool = pool
        self.rng = rng
        self.interval_s = interval_s
        self.stop_share = stop_share
        self.actions: list[dict[str, Any]] = []
        self.struck: set[int] = set()
        self.stopped: dict[int, float] = {}  # frozen pid -> when
        self.halt = threading.Event()
        self.started = time.monotonic()
        self.thread = threading.Thread(target=self._run, name="chaos-agent", daemon=True)
        self.errors: list[str] = []

    def _ours(self, pid: int | None) -> bool:
        if pid is None:
            return False
        try:
            proc = psutil.Process(pid)
            return bool(proc.ppid() == os.getpid() and proc.status() != psutil.STATUS_ZOMBIE)
        except psutil.Error:
            return False

    def strike(self, pid: int, signum: int, action: str, state: str) -> None:
        self.struck.add(pid)  # before the signal: any attempt it ends is already attributed
        try:
            os.kill(pid, signum)
            result = "sent"
        except ProcessLookupError:
            result = "gone"
        if signum == signal.SIGSTOP and result == "sent":
            self.stopped[pid] = time.monotonic()
        self.actions.append(
            {
                "t": round(time.monotonic() - self.started, 3),
                "action": action,
                "pid": pid,
                "state": state,
                "result": result,
            }
        )

    def frozen_alive(self) -> list[int]:
        alive = []
        for pid in self.stopped:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.Error:
                continue
        return alive

    def release_frozen_idle(self, grace_s: float) -> None:
        """A frozen worker the pool sees idle cannot be caught by a deadline (there is none
        while idle, by design): once it has been idle-and-frozen longer than a ladder, kill it."""
        frozen = self.frozen_alive()
        if not frozen:
            return
        states = {w.pid: w.state for w in self.pool.stats().workers}
        now = time.monotonic()
        for pid in frozen:
            state = states.get(pid)
            if state in ("idle", "spare") and now - self.stopped[pid] > grace_s:
                self.strike(pid, signal.SIGKILL, "kill_frozen_idle", state)

    def _run(self) -> None:
        config = self.pool.config
        ladder = ATTEMPT_TIMEOUT_S + config.cancel_grace_s + config.term_grace_s + 1.0
        try:
            while not self.halt.wait(self.rng.uniform(0.5, 1.5) * self.interval_s):
                workers = self.pool.stats().workers
                frozen = set(self.frozen_alive())
                # A frozen worker is left to the pool: its deadline must catch it.
                mine = [w for w in workers if w.pid not in frozen and self._ours(w.pid)]
                busy = [w for w in mine if w.state == "busy"]
                idle = [w for w in mine if w.state in ("idle", "spare")]
                roll = self.rng.random()
                # Freeze a busy worker, or an idle serving one (the next request it is given
                # must be caught by its attempt deadline and retried elsewhere).
                freezable = busy + [w for w in idle if w.state == "idle"]
                # The first chance to freeze is always taken: a short run makes some twenty
                # actions, and at a 0.15 share one run in thirty would leave the frozen-worker
                # path unexercised by the dice alone.
                first_freeze = self.stop_share > 0 and not self.stopped
                if (roll < self.stop_share or first_freeze) and freezable and not frozen:
                    target = self.rng.choice(freezable)
                    assert target.pid is not None
                    self.strike(target.pid, signal.SIGSTOP, "sigstop", target.state)
                else:
                    pool_of = busy if (self.rng.random() < 0.5 and busy) or not idle else idle
                    if pool_of:
                        target = self.rng.choice(pool_of)
                        assert target.pid is not None
                        self.strike(target.pid, signal.SIGKILL, "sigkill", target.state)
                self.release_frozen_idle(ladder)
        except Exception as exc:  # pragma: no cover - reported as a violation
            self.errors.append(repr(exc))


# --------------------------------------------------------------------------------------------
# The clients: threads and asyncio tasks pulling specs from the producer.


class Harness:
    def __init__(self, args: argparse.Namespace, pool: ModelPool, tmpdir: str) -> None:
        self.args = args
        self.pool = pool
        self.tmpdir = tmpdir
        # Finished records go to a JSON-lines spool, not to memory: over a soak they would
        # grow the very RSS the harness measures (~0.5 KB a request). In flight: by index.
        self.in_flight: dict[int, Record] = {}
        self.records_lock = threading.Lock()
        self.spool_path = os.path.join(tmpdir, "records.jsonl")
        self.spool = open(self.spool_path, "w", encoding="utf-8")  # noqa: SIM115
        self.thread_q: queue.Queue[Spec | None] = queue.Queue(maxsize=2 * args.threads)
        self.task_q: queue.Queue[Spec | None] = queue.Queue(maxsize=2 * args.tasks)
        self.progress = 0  # bumped by every client after every request
        self.halt = threading.Event()
        self.load_started = 0.0

    # ---- producing ----------------------------------------------------------------------

    def produce(self) -> None:
        args = self.args
        end = self.load_started + args.duration if args.duration else None
        index = 0
        while not self.halt.is_set():
            if args.requests is not None and index >= args.requests:
                break
            if end is not None and time.monotonic() >= end:
                break
            spec = spec_for(args, index, self.tmpdir)
            target = self.thread_q if spec.side == "thread" else self.task_q
            while not self.halt.is_set():
                try:
                    target.put(spec, timeout=0.5)
                    break
                except queue.Full:
                    continue
            index += 1
        for _ in range(self.args.threads):
            self.thread_q.put(None)
        for _ in range(self.args.tasks):
            self.task_q.put(None)

    def _new_record(self, spec: Spec) -> Record:
        record = Record(
            index=spec.index,
            kind=spec.kind,
            api=spec.api,
            cancel_how=spec.cancel_how,
            deadline_s=spec.deadline_s,
        )
        with self.records_lock:
            self.in_flight[record.index] = record
        record.started = time.monotonic()
        return record

    def _finish_record(self, spec: Spec, record: Record) -> None:
        record.latency = time.monotonic() - record.started
        digest(record, spec.expected)
        line = json.dumps(asdict(record))
        with self.records_lock:
            if self.spool.closed:
                return  # a client unblocked only by close(): it was reported unresolved
            self.in_flight.pop(record.index, None)
            self.spool.write(line + "\n")
        self.progress += 1

    def close_spool(self) -> None:
        with self.records_lock:
            self.spool.close()

    def load_records(self) -> list[Record]:
        """Every record: the spooled ones, and those still in flight (never resolved)."""
        with self.records_lock:
            self.spool.flush()
            stuck = list(self.in_flight.values())
        records = []
        with open(self.spool_path, encoding="utf-8") as handle:
            for line in handle:
                data = json.loads(line)
                data["attempts"] = [tuple(a) for a in data["attempts"]]
                records.append(Record(**data))
        return sorted(records + stuck, key=lambda r: r.index)

    def _kwargs(self, spec: Spec) -> dict[str, Any]:
        kwargs = dict(spec.params)
        if spec.pass_deadline:
            kwargs["deadline_s"] = spec.deadline_s
        return kwargs

    @staticmethod
    def _count_callbacks(record: Record, future: PoolFuture) -> None:
        record.callbacks = 0
        record.request_id = future.request_id

        def done(_: object) -> None:
            record.callbacks = (record.callbacks or 0) + 1

        future.add_done_callback(done)

    def _bound(self, spec: Spec) -> float:
        return spec.deadline_s + LATE_SLACK_S + STUCK_BOUND_S

    # ---- threads ------------------------------------------------------------------------

    def thread_client(self) -> None:
        while True:
            spec = self.thread_q.get()
            if spec is None:
                return
            record = self._new_record(spec)
            try:
                self._run_sync(spec, record)
            except GrammarCompileTimeout as exc:  # a refusal after dispatch, by the worker
                _error_record(record, exc)
            except InvalidRequest as exc:
                record.outcome = "rejected:InvalidRequest"
                record.message = str(exc)[:160]
            except Exception as exc:
                _error_record(record, exc)
            except BaseException as exc:  # CancelledError is a BaseException
                record.outcome = type(exc).__name__
            self._finish_record(spec, record)

    def _run_sync(self, spec: Spec, record: Record) -> None:
        pool = self.pool
        if spec.api == "generate":
            _result_record(record, pool.generate(spec.prompt, **self._kwargs(spec)))
            return
        if spec.api == "stream":
            chunks: list[str] = []
            stream = pool.stream(spec.prompt, **self._kwargs(spec))
            assert isinstance(stream, Iterator)
            try:
                for chunk in stream:
                    chunks.append(chunk)
                    if (
                        spec.cancel_how == "close"
                        and time.monotonic() - record.started >= spec.cancel_after_s
                    ):
                        record.outcome = "closed"
                        break
                else:
                    record.outcome = "ok"
            except PoolError as exc:
                _error_record(record, exc)
            finally:
                close = getattr(stream, "close", None)
                if close is not None:
                    close()
                record.text = "".join(chunks)
            return
        future = pool.submit(spec.prompt, **self._kwargs(spec))
        self._count_callbacks(record, future)
        if spec.cancel_how is not None:
            time.sleep(spec.cancel_after_s)
            if spec.cancel_how == "pool":
                record.cancel_returned = pool.cancel(future.request_id)
            else:
                record.cancel_returned = future.cancel()
        # future.exception(timeout) raises on a wait that timed out, and returns (does not
        # raise) a DeadlineExceeded: the two TimeoutErrors cannot be mixed up.
        try:
            error = future.exception(timeout=self._bound(spec))
        except concurrent.futures.CancelledError:
            record.outcome = "CancelledError"
            return
        except concurrent.futures.TimeoutError:
            record.violation = "unresolved: no outcome within deadline + bounds"
            try:
                error = future.exception()
            except concurrent.futures.CancelledError:
                record.outcome = "CancelledError"
                return
        if error is not None:
            _error_record(record, error)
        else:
            _result_record(record, future.result())

    # ---- asyncio tasks -----------------------------------------------------------------

    def run_tasks(self) -> None:
        asyncio.run(self._tasks_main())

    async def _tasks_main(self) -> None:
        loop = asyncio.get_running_loop()
        workers = [asyncio.create_task(self._task_client(loop)) for _ in range(self.args.tasks)]
        await asyncio.gather(*workers)

    async def _task_client(self, loop: asyncio.AbstractEventLoop) -> None:
        while True:
            spec = await loop.run_in_executor(None, self.task_q.get)
            if spec is None:
                return
            record = self._new_record(spec)
            try:
                await self._run_async(spec, record)
            except GrammarCompileTimeout as exc:  # a refusal after dispatch, by the worker
                _error_record(record, exc)
            except InvalidRequest as exc:
                record.outcome = "rejected:InvalidRequest"
                record.message = str(exc)[:160]
            except Exception as exc:
                _error_record(record, exc)
            self._finish_record(spec, record)

    async def _settle(self, spec: Spec, record: Record, task: asyncio.Future[Any]) -> None:
        await asyncio.wait({task}, timeout=self._bound(spec))
        if not task.done():
            record.violation = "unresolved: no outcome within deadline + bounds"
            await asyncio.wait({task})

    async def _run_async(self, spec: Spec, record: Record) -> None:
        pool = self.pool
        task: asyncio.Future[Any]
        if spec.api == "astream":
            chunks: list[str] = []

            async def consume() -> None:
                stream = pool.astream(spec.prompt, **self._kwargs(spec))
                assert isinstance(stream, AsyncIterator)
                async for chunk in stream:
                    chunks.append(chunk)

            task = asyncio.ensure_future(consume())
            if spec.cancel_how == "close":
                await asyncio.wait({task}, timeout=spec.cancel_after_s)
                if not task.done():
                    task.cancel()
            await self._settle(spec, record, task)
            record.text = "".join(chunks)
            if task.cancelled():
                record.outcome = "closed"
            elif task.exception() is not None:
                error = task.exception()
                assert error is not None
                if isinstance(error, InvalidRequest):
                    raise error
                _error_record(record, error)
            else:
                record.outcome = "ok"
            return
        if spec.api == "wrap":
            future = pool.submit(spec.prompt, **self._kwargs(spec))
            self._count_callbacks(record, future)
            task = asyncio.wrap_future(future)
        else:
            task = asyncio.ensure_future(pool.agenerate(spec.prompt, **self._kwargs(spec)))
            record.callbacks = 0

            def done(_: object) -> None:
                record.callbacks = (record.callbacks or 0) + 1

            task.add_done_callback(done)
        if spec.cancel_how == "task":
            await asyncio.wait({task}, timeout=spec.cancel_after_s)
            record.cancel_returned = task.cancel()
        await self._settle(spec, record, task)
        if task.cancelled():
            record.outcome = "CancelledError"
            return
        error = task.exception()
        if isinstance(error, InvalidRequest):
            raise error
        if error is not None:
            _error_record(record, error)
        else:
            _result_record(record, task.result())


# --------------------------------------------------------------------------------------------
# Checks.


BATCH_FAULT_KINDS = frozenset({"hang", "hog", "segfault", "exit", "crash_once", "grammar_segfault"})
"""Kinds whose worker dies or is killed: with batching, every request beside them may lose
an attempt there (retried as "collateral", or failed typed once it streamed text)."""
LOST_STEP_KINDS = frozenset({"batch_raise"})
"""Kinds that fail a batched step on a worker that goes on: every request beside them may
lose an attempt there too."""


def check_request(
    record: Record,
    expected: str | None,
    struck: set[int],
    max_attempts: int,
    fault_pids: Mapping[int, set[str]] | None = None,
) -> str | None:
    """Why this request's outcome is wrong for its kind (``expected``: its text), or None.

    ``fault_pids`` (batching only): the workers fault requests ran on, each with those
    requests' kinds. A request may lose an attempt on one of them as it may on a worker the
    agent struck; a fault request itself may end as the suspect (PoisonRequest) after
    collateral attempts. A batch_raise beside a hang or hog times out with its batch, and
    beside a segfault dies with it, as any other request there would."""
    batched = fault_pids is not None
    if fault_pids is not None and record.kind not in BATCH_FAULT_KINDS:
        excused = BATCH_FAULT_KINDS if record.kind in LOST_STEP_KINDS else None
        struck = struck | {
            pid for pid, kinds in fault_pids.items() if excused is None or kinds & excused
        }
    if record.violation:
        return record.violation
    if record.outcome is None:
        return "unresolved: the client recorded no outcome"
    if record.callbacks is not None and record.callbacks != 1:
        return f"resolved {record.callbacks} times (done-callbacks)"
    if record.kind == "invalid":
        return (
            None
            if record.outcome == "rejected:InvalidRequest"
            else (f"invalid request not rejected before dispatch: {record.outcome}")
        )
    if record.outcome.startswith("rejected"):
        return f"valid request rejected: {record.message}"
    if record.latency is not None and record.latency > record.deadline_s + LATE_SLACK_S:
        return f"late: resolved after {record.latency:.2f}s (deadline {record.deadline_s}s)"
    attempts = record.attempts
    mine = [a for a in attempts if a[0] not in struck]  # attempts the agent did not touch
    all_struck = bool(attempts) and not mine
    last_struck = bool(attempts) and attempts[-1][0] in struck
    outcome, kind = record.outcome, record.kind
    match = record.text_match or match_text(record.text, expected)
    shown = repr(record.text)[:80]
    is_error = outcome not in ("ok", "length", "cancelled", "CancelledError", "closed")
    typed: tuple[str, ...] = ("WorkerCrashed", "DeadlineExceeded", "BackendError")
    if batched:
        typed += ("PoisonRequest",)
    if record.kind == "grammar_hang":
        typed += ("GrammarCompileTimeout",)
    if is_error and outcome not in typed:
        return f"untyped or unexpected error {outcome}: {record.message}"
    if batched and kind in BATCH_FAULT_KINDS and (kind != "crash_once" or is_error):
        return _check_batched_fault(record, mine, last_struck)

    if kind in ("normal", "slow", "leak", "stream", "grammar"):
        if outcome == "ok":
            return None if match == "full" else f"wrong result {shown}"
        if is_error:
            if kind == "stream" and match == "wrong":
                return f"wrong partial stream {shown}"
            return None if all_struck else f"{outcome} though not every attempt was struck"
        return f"unexpected outcome {outcome}"
    if kind == "cancel":
        if outcome in ("CancelledError", "closed", "cancelled"):
            if outcome == "CancelledError" and record.cancel_how == "pool":
                return "pool.cancel gave CancelledError instead of a cancelled Result"
            return None if match != "wrong" else f"wrong partial {shown}"
        if outcome == "ok":
            if record.cancel_returned and record.cancel_how in ("future", "task"):
                return "cancel() returned True but the request completed"
            return None if match == "full" else f"wrong result {shown}"
        if is_error:
            return None if all_struck else f"{outcome} though not every attempt was struck"
        return f"unexpected outcome {outcome}"
    if kind in ("hang", "hog"):
        if outcome == "DeadlineExceeded":
            return None if all(a[1] == "timeout" for a in mine) else f"attempts {attempts}"
        if outcome == "WorkerCrashed" and last_struck:
            return None
        return f"expected DeadlineExceeded, got {outcome}"
    if kind == "grammar_hang":
        if outcome == "GrammarCompileTimeout":
            return None if not mine else f"a compile timeout charged attempts {attempts}"
        if is_error and last_struck:
            return None
        return f"expected GrammarCompileTimeout, got {outcome}"
    if kind in ("segfault", "exit", "grammar_segfault"):
        if any(a[1] != "crash" for a in mine):
            return f"a crash request had a non-crash attempt: {attempts}"
        if len(attempts) != max_attempts:
            return f"expected {max_attempts} crash attempts, got {len(attempts)}"
        if outcome == "WorkerCrashed" or (outcome == "DeadlineExceeded" and last_struck):
            return None
        return f"expected WorkerCrashed, got {outcome}"
    if kind == "batch_raise" and batched:
        return _check_lost_step(record, mine, all_struck)
    if kind in ("raise", "batch_raise"):
        if outcome == "BackendError":
            if (
                not attempts
                or attempts[-1][1] != "error"
                or any(a[0] not in struck for a in attempts[:-1])
            ):
                return f"BackendError with attempts {attempts}"
            return (
                None
                if f"chaos-{record.index}" in (record.message or "")
                else (f"BackendError without the raised message: {record.message}")
            )
        if is_error and all_struck:
            return None
        return f"expected BackendError, got {outcome}"
    if kind == "crash_once":
        if outcome == "ok":
            if match != "full":
                return f"wrong result {shown}"
            return (
                None
                if (record.n_attempts or 0) >= 2
                else (f"crash_once succeeded in {record.n_attempts} attempt(s)")
            )
        if is_error and len(mine) <= 1 and all(a[1] == "crash" for a in mine):
            return None
        return f"crash_once failed: {outcome} {attempts}"
    return f"unknown kind {kind}"


def _check_lost_step(
    record: Record, mine: list[tuple[int | None, str]], all_struck: bool
) -> str | None:
    """A batch_raise under batching: its batches are lost (collateral, on a warm worker)
    until it runs alone, where its own error is its answer; after two lost batches it
    runs isolated and fails as the suspect."""
    outcome, attempts = record.outcome, record.attempts
    if outcome == "BackendError":
        if not attempts or attempts[-1][1] != "error":
            return f"BackendError with attempts {attempts}"
        if any(a[1] != "collateral" for a in mine if a is not attempts[-1]):
            return f"a lost step charged a non-collateral attempt: {attempts}"
        if f"chaos-{record.index}" not in (record.message or ""):
            return f"BackendError without the raised message: {record.message}"
        return None
    if outcome == "PoisonRequest":
        if any(a[1] not in ("collateral", "error") for a in mine):
            return f"a lost step's suspect had attempts {record.attempts}"
        return None
    if outcome in ("WorkerCrashed", "DeadlineExceeded") and all_struck:
        return None
    return f"expected BackendError or PoisonRequest, got {outcome}"


def _check_batched_fault(
    record: Record, mine: list[tuple[int | None, str]], last_struck: bool
) -> str | None:
    """A hang, hog, segfault or exit request under batching: it fails typed, as the suspect
    or by its deadline, having lost at most two batches and two runs alone."""
    outcome = record.outcome
    if any(a[1] not in ("crash", "timeout", "collateral") for a in mine):
        return f"a fault request had an attempt that did not fail: {record.attempts}"
    if len(mine) > 4:
        return f"a fault request took down {len(mine)} workers: {record.attempts}"
    if outcome in ("PoisonRequest", "WorkerCrashed", "DeadlineExceeded"):
        return None
    if last_struck and outcome in ("ok", "cancelled"):
        return None
    return f"expected a typed failure, got {outcome}"


def rss_slope_mb_per_min(samples: list[tuple[float, int]]) -> tuple[float, float]:
    """Least-squares slope (MB/min) and fitted growth (MB) over the second half of samples."""
    if len(samples) < 4:
        return 0.0, 0.0
    start, end = samples[0][0], samples[-1][0]
    half = [(t, rss) for t, rss in samples if t >= (start + end) / 2]
    if len(half) < 3:
        return 0.0, 0.0
    n = len(half)
    mean_t = sum(t for t, _ in half) / n
    mean_r = sum(r for _, r in half) / n
    var = sum((t - mean_t) ** 2 for t, _ in half)
    if var <= 0:
        return 0.0, 0.0
    slope = sum((t - mean_t) * (r - mean_r) for t, r in half) / var  # bytes per second
    span = half[-1][0] - half[0][0]
    return slope * 60 / 2**20, slope * span / 2**20


# --------------------------------------------------------------------------------------------
# The end checks: each takes what the run observed and returns the violations it finds, so
# that a test can feed each one a failing input (tests/integration/test_chaos.py).


def strength_problem(stats: PoolStats, slot_count: int, unusable_pids: set[int]) -> str | None:
    """None when the pool is back to full strength: ready, nothing queued, ``slot_count``
    workers all idle or spare and usable (``unusable_pids``: stopped, zombie or gone), and a
    release check done for every worker that left."""
    usable = [
        w
        for w in stats.workers
        if w.state in ("idle", "spare") and w.pid is not None and w.pid not in unusable_pids
    ]
    departed = slot_count + stats.counters["respawns"] - len(stats.workers)
    if (
        len(usable) == slot_count
        and len(stats.workers) == slot_count
        and stats.state == "ready"
        and stats.queue_depth == 0
        and stats.gpu.releases.checked >= departed
    ):
        return None
    return (
        f"pool not back to full strength: state {stats.state}, workers "
        f"{[(w.pid, w.state) for w in stats.workers]} ({len(usable)} of {slot_count} usable), "
        f"queue {stats.queue_depth}, releases checked {stats.gpu.releases.checked} of "
        f"{departed} departed"
    )


def counter_problems(counters: dict[str, int], accepted: int) -> list[str]:
    """The pool's counters add up, and agree with the requests the clients had accepted."""
    problems = []
    resolved = counters["completed"] + counters["failed"] + counters["cancelled"]
    if resolved != counters["submitted"]:
        problems.append(
            f"counters: completed+failed+cancelled={resolved} != submitted={counters['submitted']}"
        )
    if counters["submitted"] != accepted:
        problems.append(
            f"counters: submitted={counters['submitted']} but the clients had "
            f"{accepted} requests accepted"
        )
    return problems


def release_problems(releases: ReleaseStats, spawned_workers: int) -> list[str]:
    """Every worker ever spawned had its release check, and none failed."""
    problems = []
    if releases.checked < spawned_workers:
        problems.append(f"release checks: {releases.checked} of {spawned_workers} workers")
    if releases.failed:
        problems.append(f"release checks failed: {releases.failed}")
    return problems


def leftover_problems(
    leftovers: list[tuple[int, str]], groups: list[int], frozen: list[int], state: str
) -> list[str]:
    """Nothing is left after ``close()``: processes ((pid, status), zombies included),
    worker process groups, SIGSTOPped workers; and the pool says "closed"."""
    problems = []
    if leftovers:
        problems.append(f"processes left after close(): {leftovers}")
    if groups:
        problems.append(f"worker process groups left after close(): {groups}")
    if frozen:
        problems.append(f"SIGSTOPped workers alive after close(): {frozen}")
    if state != "closed":
        problems.append(f"pool state after close(): {state}")
    return problems


def rss_problem(slope_mb_per_min: float, growth_mb: float) -> str | None:
    """The supervisor's RSS grows: both the slope and the fitted growth are over their limits
    (see RSS_SLOPE_LIMIT_MB_MIN)."""
    if slope_mb_per_min > RSS_SLOPE_LIMIT_MB_MIN and growth_mb > RSS_GROWTH_FLOOR_MB:
        return (
            f"supervisor RSS grows {slope_mb_per_min:.2f} MB/min ({growth_mb:.1f} MB over the "
            f"second half of the load)"
        )
    return None


def _descendants() -> list[psutil.Process]:
    try:
        return list(psutil.Process().children(recursive=True))
    except psutil.Error:
        return []


def _pid_status(pid: int) -> str:
    try:
        return _status(psutil.Process(pid))
    except psutil.Error:
        return "gone"


def _status(proc: psutil.Process) -> str:
    try:
        return str(proc.status())
    except psutil.ZombieProcess:
        return str(psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return "gone"


# --------------------------------------------------------------------------------------------
# The run.


def build_config(args: argparse.Namespace) -> PoolConfig:
    config = PoolConfig(
        model="chaos",
        backend="testing",
        workers=args.workers,
        spares=args.spares,
        devices=("cpu",),
        deadline_s=FAULT_DEADLINE_S,
        attempt_timeout_s=ATTEMPT_TIMEOUT_S,
        cancel_grace_s=0.2,
        term_grace_s=0.2,
        startup_timeout_s=30.0,
        max_batch_size=args.max_batch_size,
        retry=RetryPolicy(max_retries=2, on=("timeout", "crash")),
        max_queue=100_000,
        max_requests_per_worker=40,
        grammar_compile_timeout_s=GRAMMAR_COMPILE_TIMEOUT_S,
        max_worker_rss_mb=60.0,
        gpu_release_timeout_s=2.0,
        startup_failures_before_giving_up=5,
    )
    if args.backend == "llama_cpp":
        config = config.replace(
            model=args.model_dir,
            backend="llama_cpp",
            backend_options={"threads": 1},
            attempt_timeout_s=LLAMA_ATTEMPT_TIMEOUT_S,
            cancel_grace_s=LLAMA_CANCEL_GRACE_S,
            max_worker_rss_mb=None,  # a real model's worker is far above the fault backend's
        )
    return config


def run(args: argparse.Namespace, out: Callable[[str], None]) -> dict[str, Any]:
    wall_started = time.monotonic()
    violations: list[str] = []
    if args.backend == "llama_cpp":
        from modelpool.shared.embedded import prepare_gguf

        args.model_dir = str(prepare_gguf())
        args.real_texts = real_texts(args.model_dir)
    config = build_config(args)
    max_attempts = config.retry.max_retries + 1
    slot_count = config.workers + config.spares
    me = psutil.Process()
    tmp = tempfile.TemporaryDirectory(prefix="modelpool-chaos-")
    rss_samples: list[tuple[float, int]] = []
    seen_pids: set[int] = set()
    sampling = threading.Event()

    pool = ModelPool(config)
    pool.start()
    embedding_chaos = None
    if args.embeddings:
        from benchmarks.chaos_embeddings import EmbeddingChaos

        embedding_chaos = EmbeddingChaos(args, tmp.name, args.embedding_requests)
        embedding_chaos.start()
    started_stats = pool.stats()
    seen_pids.update(w.pid for w in started_stats.workers if w.pid is not None)
    harness = Harness(args, pool, tmp.name)
    agent = Agent(pool, random.Random(args.seed ^ 0x5EED), args.agent_interval, args.stop_share)

    def sample() -> None:
        t0 = time.monotonic()
        while not sampling.wait(RSS_SAMPLE_S):
            rss_samples.append((round(time.monotonic() - t0, 3), me.memory_info().rss))
            seen_pids.update(p.pid for p in _descendants())

    sampler = threading.Thread(target=sample, name="chaos-rss", daemon=True)
    harness.load_started = time.monotonic()
    sampler.start()
    if args.agent_interval > 0:
        agent.thread.start()
    producer = threading.Thread(target=harness.produce, name="chaos-producer", daemon=True)
    clients = [
        threading.Thread(target=harness.thread_client, name=f"chaos-client-{i}", daemon=True)
        for i in range(args.threads)
    ]
    clients.append(threading.Thread(target=harness.run_tasks, name="chaos-asyncio", daemon=True))
    producer.start()
    for client in clients:
        client.start()

    # Wait for the load; a client that makes no progress for longer than any request may
    # take is stuck, and so are its requests.
    stuck_after = LONG_DEADLINE_S + LATE_SLACK_S + 2 * STUCK_BOUND_S
    last_progress, last_change = -1, time.monotonic()
    while any(c.is_alive() for c in clients) or producer.is_alive():
        for client in clients:
            client.join(0.5)
        if harness.progress != last_progress:
            last_progress, last_change = harness.progress, time.monotonic()
        elif time.monotonic() - last_change > stuck_after:
            violations.append(f"stuck: no client progress for {stuck_after:.0f}s")
            harness.halt.set()
            break
    load_s = time.monotonic() - harness.load_started
    records = harness.load_records()
    sampling.set()
    sampler.join()
    agent.halt.set()
    if agent.thread.is_alive():
        agent.thread.join(10)
    violations.extend(f"agent failed: {e}" for e in agent.errors)
    embedding_summary, embedding_figures = "", dict[str, Any]()
    if embedding_chaos is not None:
        # Closed before the leftover checks below, which count every child of this process.
        embedding_summary, embedding_violations, embedding_figures = embedding_chaos.finish()
        violations.extend(embedding_violations)

    # ---- back to full strength --------------------------------------------------------
    recovery_started = time.monotonic()
    strength_s: float | None = None
    weak: str | None = "not checked"
    stats = pool.stats()
    while time.monotonic() - recovery_started < RECOVERY_BOUND_S:
        agent.release_frozen_idle(0.0 if time.monotonic() - recovery_started > 5.0 else 1e9)
        stats = pool.stats()
        seen_pids.update(w.pid for w in stats.workers if w.pid is not None)
        unusable = {
            w.pid
            for w in stats.workers
            if w.pid is not None
            and _pid_status(w.pid) in (psutil.STATUS_STOPPED, "gone", psutil.STATUS_ZOMBIE)
        }
        weak = strength_problem(stats, slot_count, unusable)
        if weak is None:
            strength_s = time.monotonic() - recovery_started
            break
        time.sleep(0.1)
    before_close = stats
    if strength_s is None:
        violations.append(f"after {RECOVERY_BOUND_S:.0f}s: {weak}")

    counters = before_close.counters
    accepted = sum(1 for r in records if not (r.outcome or "").startswith("rejected"))
    resolved = counters["completed"] + counters["failed"] + counters["cancelled"]
    violations.extend(counter_problems(counters, accepted))

    # ---- close: nothing left behind ----------------------------------------------------
    close_started = time.monotonic()
    pool.close(drain=True, timeout=10.0)
    close_s = time.monotonic() - close_started
    final = pool.stats()
    spawned_total = slot_count + final.counters["respawns"]
    releases = final.gpu.releases
    violations.extend(release_problems(releases, spawned_total))
    leftovers = [(p.pid, _status(p)) for p in _descendants()]
    zombies = [pid for pid, status in leftovers if status == psutil.STATUS_ZOMBIE]
    groups = sorted(pid for pid in seen_pids if pid > 1 and process_group_exists(pid))
    frozen_left = agent.frozen_alive()
    violations.extend(leftover_problems(leftovers, groups, frozen_left, final.state))

    # ---- every request -----------------------------------------------------------------
    struck = set(agent.struck)
    fault_pids: dict[int, set[str]] | None = None
    if config.max_batch_size > 1:
        fault_pids = {}
        for record in records:
            if record.kind in BATCH_FAULT_KINDS | LOST_STEP_KINDS:
                for pid, _ in record.attempts:
                    if pid is not None:
                        fault_pids.setdefault(pid, set()).add(record.kind)
        # A crash_once that then succeeded reports no attempts; its marker names the
        # worker it took down.
        for marker in Path(tmp.name).glob("once-*"):
            text = marker.read_text().strip()
            if text.isdigit():
                fault_pids.setdefault(int(text), set()).add("crash_once")
    bad: Counter[str] = Counter()
    for record in records:
        expected = spec_for(args, record.index, tmp.name).expected
        problem = check_request(record, expected, struck, max_attempts, fault_pids)
        record.violation = problem
        if problem:
            bad[problem.split(" ")[0].rstrip(":")] += 1
            violations.append(
                f"request {record.index} ({record.kind}/{record.api}"
                f"/{record.cancel_how}): {problem}"
            )

    slope, growth = rss_slope_mb_per_min(rss_samples)
    growing = rss_problem(slope, growth)
    if growing is not None:
        violations.append(growing)
    harness.close_spool()
    tmp.cleanup()

    outcomes: Counter[str] = Counter(r.outcome or "none" for r in records)
    by_kind: dict[str, Counter[str]] = {}
    for record in records:
        by_kind.setdefault(record.kind, Counter())[record.outcome or "none"] += 1
    kills = sum(1 for a in agent.actions if a["action"] != "sigstop" and a["result"] == "sent")
    stops = sum(1 for a in agent.actions if a["action"] == "sigstop" and a["result"] == "sent")
    stopped_pids = {a["pid"] for a in agent.actions if a["action"] == "sigstop"}
    agent_killed = {a["pid"] for a in agent.actions if a["action"] != "sigstop"}
    # frozen workers the pool itself caught (deadline ladder), not the agent's clean-up
    caught = len(stopped_pids - agent_killed)
    frozen_attempts = Counter(a[1] for r in records for a in r.attempts if a[0] in stopped_pids)
    wrong = sum(1 for r in records if r.violation and "wrong" in r.violation)
    unresolved = sum(1 for r in records if r.violation and r.violation.startswith("unresolved"))
    double = sum(1 for r in records if r.callbacks is not None and r.callbacks > 1)
    late = sum(1 for r in records if r.violation and r.violation.startswith("late"))
    unexpected = sum(1 for r in records if r.violation) - wrong - unresolved - double - late
    rss_start = rss_samples[0][1] / 2**20 if rss_samples else 0.0
    rss_end = rss_samples[-1][1] / 2**20 if rss_samples else 0.0
    wall = time.monotonic() - wall_started
    fc = final.counters
    summary = (
        f"chaos seed={args.seed} requests={len(records)} batch={config.max_batch_size} "
        f"ok={outcomes['ok'] + outcomes['length']} "
        f"cancelled={outcomes['cancelled'] + outcomes['CancelledError'] + outcomes['closed']} "
        f"failed={sum(v for k, v in outcomes.items() if k in _ERROR_NAMES)} "
        f"rejected={outcomes['rejected:InvalidRequest']} | "
        f"unresolved={unresolved} double={double} wrong={wrong} unexpected={unexpected} "
        f"late={late} | strength={'ok' if strength_s is not None else 'NO'}"
        f"({(strength_s or 0):.1f}s) counters="
        f"{'ok' if resolved == counters['submitted'] == accepted else 'BAD'}"
        f"(sub={counters['submitted']} done={counters['completed']} "
        f"fail={counters['failed']} canc={counters['cancelled']}) | "
        f"agent kills={kills} stops={stops} (caught by the pool {caught}) | "
        f"crashes={fc['crashes']} kills={fc['kills']} "
        f"respawns={fc['respawns']} recycled={fc.get('recycled', 0)} "
        f"retries={fc['retries']} collateral={fc['collateral_retries']} "
        f"poison={fc['poison_requests']} stalls={fc['stalls']} | "
        f"releases={releases.checked}/{spawned_total} "
        f"failed={releases.failed} | left: procs={len(leftovers)} zombies={len(zombies)} "
        f"groups={len(groups)} frozen={len(frozen_left)} | rss {rss_start:.1f}->"
        f"{rss_end:.1f}MB slope={slope:+.2f}MB/min | close={close_s:.1f}s "
        f"load={load_s:.1f}s wall={wall:.1f}s | violations={len(violations)}"
    )
    out(summary)
    if embedding_summary:
        out(embedding_summary)
    return {
        "summary": summary,
        "ok": not violations,
        "violations": violations,
        "args": vars(args),
        "config": {k: v for k, v in asdict(config).items()},
        "mix": mix_for(args),
        "figures": {
            "requests": len(records),
            "outcomes": dict(outcomes),
            "by_kind": by_kind,
            "agent_kills": kills,
            "agent_stops": stops,
            "struck_pids": len(struck),
            "request_violations_by_category": dict(bad),
            "frozen_caught_by_pool": caught,
            "attempts_on_frozen": dict(frozen_attempts),
            "counters_before_close": counters,
            "counters_final": dict(fc),
            "kill_reasons": final.kill_reasons,
            "releases": asdict(releases),
            "spawned_workers": spawned_total,
            "time_to_full_strength_s": strength_s,
            "close_s": close_s,
            "load_s": load_s,
            "wall_s": wall,
            "rss_start_mb": rss_start,
            "rss_end_mb": rss_end,
            "rss_slope_mb_per_min": slope,
            "rss_growth_second_half_mb": growth,
            "latency_s": before_close.latency_s,
            "embeddings": embedding_figures,
        },
        "requests": [asdict(r) for r in sorted(records, key=lambda r: r.index)],
        "rss_samples": rss_samples,
        "agent": agent.actions,
        "stats_before_close": before_close.to_dict(),
        "stats_final": final.to_dict(),
    }


_ERROR_NAMES = frozenset(
    {
        "WorkerCrashed",
        "PoisonRequest",
        "DeadlineExceeded",
        "BackendError",
        "PoolClosed",
        "PoolError",
        "PoolOverloaded",
        "ModelLoadFailed",
    }
)
assert {c.__name__ for c in (WorkerCrashed, DeadlineExceeded, BackendError)} <= _ERROR_NAMES


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="scripts/chaos", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--requests",
        type=int,
        default=None,
        help="requests to run (default 300, unlimited with --duration)",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--duration",
        type=float,
        default=None,
        help="stop producing requests after SECONDS (and --requests, if given)",
    )
    parser.add_argument("--report", default=None, help="write the JSON report here")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--spares", type=int, default=1)
    parser.add_argument(
        "--max-batch-size",
        type=int,
        default=1,
        help="requests per worker at once (batching; the fault backend batches too)",
    )
    parser.add_argument(
        "--grammar",
        action="store_true",
        help="mix structured-output compilations in: honest, hanging and crashing ones",
    )
    parser.add_argument(
        "--embeddings",
        action="store_true",
        help="beside the generation pool, an embedding pool under its own agent and mix "
        "(benchmarks/chaos_embeddings.py)",
    )
    parser.add_argument(
        "--embedding-requests",
        type=int,
        default=200,
        help="embed and score requests with --embeddings",
    )
    parser.add_argument(
        "--backend",
        choices=("testing", "llama_cpp"),
        default="testing",
        help="the fault-injection backend, or the embedded GGUF on llama.cpp (real counts)",
    )
    parser.add_argument("--threads", type=int, default=8, help="client threads")
    parser.add_argument("--tasks", type=int, default=8, help="client asyncio tasks")
    parser.add_argument(
        "--agent-interval",
        type=float,
        default=0.6,
        help="mean seconds between agent actions (0: no agent)",
    )
    parser.add_argument(
        "--stop-share",
        type=float,
        default=0.15,
        help="share of agent actions that SIGSTOP a busy worker",
    )
    parser.add_argument(
        "--log",
        default=None,
        help="file for the pool's and workers' stderr (default: a temp file; '-' keeps stderr)",
    )
    args = parser.parse_args(argv)
    if args.requests is None and args.duration is None:
        args.requests = 300
    if args.requests is not None and args.requests < 0:
        parser.error("--requests must be >= 0")
    if args.threads < 1 or args.tasks < 1:
        parser.error("--threads and --tasks must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stdout = sys.stdout
    saved_stderr: int | None = None
    log_path = args.log
    if log_path != "-":
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix=f"chaos-{args.seed}-", suffix=".log")
            os.close(fd)
        sys.stderr.flush()
        saved_stderr = os.dup(2)
        log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log_fd, 2)  # workers inherit it: segfault tracebacks go to the log too
        os.close(log_fd)
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )

    def out(line: str) -> None:
        print(line, file=stdout, flush=True)

    try:
        report = run(args, out)
    finally:
        if saved_stderr is not None:
            sys.stderr.flush()
            os.dup2(saved_stderr, 2)
            os.close(saved_stderr)
    report["log"] = log_path
    for line in report["violations"][:30]:
        print(f"violation: {line}", file=sys.stderr)
    if len(report["violations"]) > 30:
        print(f"violation: ... and {len(report['violations']) - 30} more", file=sys.stderr)
    if log_path and log_path != "-":
        print(f"chaos: pool and worker log in {log_path}", file=sys.stderr)
    if args.report:
        with open(args.report, "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=1, default=str)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
    sys.exit(130)
