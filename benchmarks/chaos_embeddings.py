"""Embedding requests in the chaos mix (``scripts/chaos --embeddings``).

Beside the generation pool, as a chat model and an embedding model are served together, a
second pool of the fault-injection backend with ``task = "embed"`` (see
:mod:`modelpool.worker.backends.testing_embeddings`)
takes a seeded mix of embed and score requests from
threads and asyncio tasks while an agent of its own SIGKILLs and SIGSTOPs its workers:

=============  =====================================  ======================================
kind           inputs                                 expected outcome
=============  =====================================  ======================================
embed          1-6 unique texts (or token ids)        the vectors the backend computes for
                                                      them, exactly
dimensions     as embed, ``dimensions=4``             those vectors cut and renormalised
score          a query and 1-6 documents              the cosines, exactly
slow           a text, ``embed_sleep:0.05``           the vectors
sleep_past     ``embed_sleep:30`` (honest, slow)      ``DeadlineExceeded`` on time
hang           ``embed_hang`` (ignores SIGTERM)       ``DeadlineExceeded`` on time
segfault       ``embed_segfault``                     ``WorkerCrashed`` after every retry
crash_once     ``embed_crash_once:PATH``, a text      the vectors, on the retry
hang_once      ``embed_hang_once:PATH``, a text       the vectors, after the attempt timeout
cancel         ``embed_sleep:1``, the task cancelled  ``CancelledError`` (or the vectors)
invalid        empty input, empty string, bad         ``InvalidRequest`` (before dispatch,
               or too many dimensions                 or the worker's refusal)
=============  =====================================  ======================================

A request may deviate from its expected outcome only where the agent struck a worker of
one of its attempts. At the end: no request late or unresolved, the pool back to full
strength, its counters consistent, and after ``close()`` none of its workers' process
groups left.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from benchmarks.chaos import ATTEMPT_TIMEOUT_S, FAULT_DEADLINE_S, LATE_SLACK_S, Agent
from modelpool.shared.config import PoolConfig, RetryPolicy
from modelpool.shared.embeddings import cosine, cut_and_normalise
from modelpool.shared.errors import DeadlineExceeded, InvalidRequest, PoolError, WorkerCrashed
from modelpool.shared.processes import process_group_exists
from modelpool.supervisor.pool import ModelPool
from modelpool.worker.backends.testing_embeddings import DIMENSIONS, vector

EMBEDDING_MIX: dict[str, float] = {
    "embed": 35,
    "dimensions": 8,
    "score": 15,
    "slow": 8,
    "sleep_past": 3,
    "hang": 3,
    "segfault": 3,
    "crash_once": 5,
    "hang_once": 4,
    "cancel": 8,
    "invalid": 8,
}
LONG_DEADLINE_S = 20.0
RECOVERY_BOUND_S = 30.0


@dataclass
class EmbeddingSpec:
    index: int
    kind: str
    api: str  # embed | aembed | score | ascore
    inputs: Any
    query: str = ""
    dimensions: int | None = None
    deadline_s: float = LONG_DEADLINE_S
    expected: list[list[float]] | list[float] | None = None
    expected_error: type[BaseException] | None = None


@dataclass
class EmbeddingRecord:
    index: int
    kind: str
    outcome: str = "unresolved"
    latency_s: float = 0.0
    struck_attempts: bool = False
    violation: str | None = None
    attempts: list[tuple[int | None, str]] = field(default_factory=list)


def _vectors(inputs: list[str | tuple[int, ...]], dimensions: int | None) -> list[list[float]]:
    """What the fault backend gives ``inputs`` (a command's vector is its text's)."""
    return [cut_and_normalise(vector(item), dimensions or DIMENSIONS) for item in inputs]


def make_embedding_spec(seed: int, index: int, tmpdir: str) -> EmbeddingSpec:
    rng = random.Random(seed * 2_000_003 + index)
    kind = rng.choices(list(EMBEDDING_MIX), weights=list(EMBEDDING_MIX.values()))[0]
    asynchronous = rng.random() < 0.5
    api = "aembed" if asynchronous else "embed"
    texts: list[str | tuple[int, ...]] = [
        f"e{seed}-{index}-{n} {rng.getrandbits(24):06x}" for n in range(rng.randint(1, 6))
    ]
    if rng.random() < 0.2:
        texts[0] = tuple(rng.randrange(1000) for _ in range(rng.randint(1, 8)))
    spec = EmbeddingSpec(index, kind, api, texts)
    if kind == "dimensions":
        spec.dimensions = 4
    elif kind == "score":
        spec.api = "ascore" if asynchronous else "score"
        spec.query = f"q{seed}-{index}"
        spec.inputs = [text if isinstance(text, str) else "ids" for text in texts]
    elif kind == "slow":
        spec.inputs = [*texts, "embed_sleep:0.05"]
    elif kind in ("sleep_past", "hang"):
        spec.inputs = ["embed_sleep:30" if kind == "sleep_past" else "embed_hang"]
        spec.deadline_s, spec.expected_error = FAULT_DEADLINE_S, DeadlineExceeded
    elif kind == "segfault":
        spec.inputs, spec.expected_error = ["embed_segfault"], WorkerCrashed
    elif kind in ("crash_once", "hang_once"):
        spec.inputs = [f"embed_{kind}:{tmpdir}/embed-once-{index}", *texts]
    elif kind == "cancel":
        spec.api, spec.inputs = "aembed", ["embed_sleep:1", *texts]
    elif kind == "invalid":
        spec.inputs, spec.dimensions = rng.choice(
            [([], None), ([""], None), ("", None), (texts, 0), (texts, DIMENSIONS + 1)]
        )
        spec.expected_error = InvalidRequest
    if spec.expected_error is None:
        if kind == "score":
            query = vector(spec.query)
            spec.expected = [cosine(query, vector(document)) for document in spec.inputs]
        else:
            spec.expected = _vectors(spec.inputs, spec.dimensions)
    return spec


def build_embedding_config(args: argparse.Namespace) -> PoolConfig:
    return PoolConfig(
        model="chaos-embeddings",
        backend="testing",
        backend_options={"task": "embed"},
        workers=2,
        spares=1,
        devices=("cpu",),
        deadline_s=LONG_DEADLINE_S,
        attempt_timeout_s=ATTEMPT_TIMEOUT_S,
        cancel_grace_s=0.2,
        term_grace_s=0.2,
        startup_timeout_s=30.0,
        retry=RetryPolicy(max_retries=2, on=("timeout", "crash")),
        max_queue=100_000,
        max_requests_per_worker=40,
        gpu_release_timeout_s=2.0,
        startup_failures_before_giving_up=5,
    )


class EmbeddingChaos:
    """The embedding pool, its clients and its agent, run beside the generation chaos."""

    def __init__(self, args: argparse.Namespace, tmpdir: str, requests: int) -> None:
        self.args = args
        self.tmpdir = tmpdir
        self.requests = requests
        self.config = build_embedding_config(args)
        self.pool = ModelPool(self.config).start()
        self.agent = Agent(
            self.pool, random.Random(args.seed ^ 0xE3BED), args.agent_interval, args.stop_share
        )
        self.records: list[EmbeddingRecord] = []
        self.next_index = 0
        self.lock = threading.Lock()
        self.seen_pids = {w.pid for w in self.pool.stats().workers if w.pid is not None}
        self.threads = [
            threading.Thread(target=self._thread_client, name=f"chaos-embed-{n}", daemon=True)
            for n in range(2)
        ]
        self.threads.append(
            threading.Thread(target=lambda: asyncio.run(self._tasks()), name="chaos-embed-aio")
        )

    def start(self) -> None:
        if self.args.agent_interval > 0:
            self.agent.thread.start()
        for thread in self.threads:
            thread.start()

    def _take(self) -> EmbeddingSpec | None:
        with self.lock:
            if self.next_index >= self.requests:
                return None
            index, self.next_index = self.next_index, self.next_index + 1
        return make_embedding_spec(self.args.seed, index, self.tmpdir)

    def _thread_client(self) -> None:
        while (spec := self._take()) is not None:
            record = EmbeddingRecord(spec.index, spec.kind)
            started = time.monotonic()
            try:
                if spec.api in ("score", "ascore"):
                    answer: Any = self.pool.score(
                        spec.query, spec.inputs, deadline_s=spec.deadline_s
                    )
                else:
                    answer = self.pool.embed(
                        spec.inputs, dimensions=spec.dimensions, deadline_s=spec.deadline_s
                    )
                self._settle(spec, record, started, answer, None)
            except BaseException as exc:
                self._settle(spec, record, started, None, exc)

    async def _tasks(self) -> None:
        async def client() -> None:
            while (spec := self._take()) is not None:
                record = EmbeddingRecord(spec.index, spec.kind)
                started = time.monotonic()
                if spec.api in ("score", "ascore"):
                    call: Any = self.pool.ascore(
                        spec.query, spec.inputs, deadline_s=spec.deadline_s
                    )
                else:
                    call = self.pool.aembed(
                        spec.inputs, dimensions=spec.dimensions, deadline_s=spec.deadline_s
                    )
                task = asyncio.ensure_future(call)
                if spec.kind == "cancel":
                    loop = asyncio.get_running_loop()
                    loop.call_later(random.Random(spec.index).uniform(0.0, 0.5), task.cancel)
                try:
                    self._settle(spec, record, started, await task, None)
                except BaseException as exc:
                    self._settle(spec, record, started, None, exc)

        await asyncio.gather(*(client() for _ in range(2)))

    def _settle(
        self,
        spec: EmbeddingSpec,
        record: EmbeddingRecord,
        started: float,
        answer: Any,
        error: BaseException | None,
    ) -> None:
        record.latency_s = time.monotonic() - started
        if isinstance(error, PoolError):
            record.attempts = [(a.worker_pid, a.outcome) for a in error.attempts]
            record.struck_attempts = any(pid in self.agent.struck for pid, _ in record.attempts)
        if error is None:
            record.outcome = "ok"
            got = answer.scores if spec.kind == "score" else answer.vectors
            if spec.expected is None:
                record.violation = f"expected {spec.expected_error}, got an answer"
            elif got != spec.expected:
                record.violation = "wrong vectors or scores"
        else:
            record.outcome = type(error).__name__
            cancelled = spec.kind == "cancel" and isinstance(error, asyncio.CancelledError)
            expected = spec.expected_error is not None and isinstance(error, spec.expected_error)
            if not (cancelled or expected or record.struck_attempts):
                record.violation = f"unexpected {record.outcome}: {str(error)[:120]}"
        if record.latency_s > spec.deadline_s + LATE_SLACK_S:
            record.violation = f"late: {record.latency_s:.1f}s past a {spec.deadline_s}s deadline"
        with self.lock:
            self.records.append(record)

    def finish(self) -> tuple[str, list[str], dict[str, Any]]:
        """Wait for the clients, check, close; the summary, the violations, the figures."""
        violations: list[str] = []
        bound = time.monotonic() + self.requests * 0.5 + 120
        for thread in self.threads:
            thread.join(max(0.0, bound - time.monotonic()))
            if thread.is_alive():
                violations.append(f"embedding client {thread.name} stuck")
        self.agent.halt.set()
        if self.agent.thread.is_alive():
            self.agent.thread.join(10)
        violations.extend(f"embedding agent failed: {e}" for e in self.agent.errors)
        recovered = time.monotonic() + RECOVERY_BOUND_S
        slots = self.config.workers + self.config.spares
        while time.monotonic() < recovered:
            self.agent.release_frozen_idle(0.0)
            stats = self.pool.stats()
            self.seen_pids.update(w.pid for w in stats.workers if w.pid is not None)
            ready = [w for w in stats.workers if w.state in ("idle", "spare")]
            if len(ready) == slots:
                break
            time.sleep(0.1)
        else:
            violations.append(f"the embedding pool not back to {slots} workers")
        counters = self.pool.stats().counters
        resolved = counters["completed"] + counters["failed"] + counters["cancelled"]
        if resolved != counters["submitted"]:
            violations.append(f"embedding counters: {resolved} resolved of {counters['submitted']}")
        self.pool.close(drain=True, timeout=10.0)
        final = self.pool.stats()
        groups = sorted(pid for pid in self.seen_pids if process_group_exists(pid))
        if groups:
            violations.append(f"embedding workers' process groups left: {groups}")
        if len(self.records) != self.requests:
            violations.append(f"embedding requests resolved {len(self.records)} of {self.requests}")
        violations.extend(
            f"embedding request {r.index} ({r.kind}): {r.violation}"
            for r in self.records
            if r.violation
        )
        outcomes = Counter(r.outcome for r in self.records)
        fc = final.counters
        kills = sum(
            1 for a in self.agent.actions if a["action"] != "sigstop" and a["result"] == "sent"
        )
        stops = sum(
            1 for a in self.agent.actions if a["action"] == "sigstop" and a["result"] == "sent"
        )
        summary = (
            f"embeddings requests={len(self.records)} ok={outcomes['ok']} "
            f"failed={sum(v for k, v in outcomes.items() if k != 'ok')} | agent kills={kills} "
            f"stops={stops} | crashes={fc['crashes']} kills={fc['kills']} "
            f"timeouts={fc['timeouts']} retries={fc['retries']} respawns={fc['respawns']} | "
            f"violations={len(violations)}"
        )
        figures = {
            "requests": len(self.records),
            "outcomes": dict(outcomes),
            "by_kind": {
                kind: dict(Counter(r.outcome for r in self.records if r.kind == kind))
                for kind in EMBEDDING_MIX
            },
            "counters_final": dict(fc),
            "agent_kills": kills,
            "agent_stops": stops,
        }
        return summary, violations, figures
