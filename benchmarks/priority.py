"""Priority and admission under overload, and what the observability costs (issue 38).

``load``: a pool of testing workers (``tokens:N:DELAY``, so a run's length is known) is
offered twice its capacity, Poisson arrivals, 20 % of them high priority, three times in
one run: first all at priority 0 (first come, first served: the "FIFO" figures), then
with the two priorities, then with the two priorities and ``max_queue_time_s``. Before
that, the same requests at a fifth of capacity give the unloaded time to first token.
All of it three times, side by side: one-call workers (two of them), one batched worker
(``max_batch_size`` 2: the same capacity), and one wide batched worker (8 rows, four times
the capacity: where a batch's capacity lies in its rows, as in vLLM, the high-priority
arrivals alone do not queue behind each other). Per phase and class: p50/p99 TTFT of the
answered requests, requests refused at once (``QueueFull``), requests that timed out
(``DeadlineExceeded``; "in the queue" when no attempt ran but preempted ones), the
requests preempted (``preempt_for_priority``), and the load average::

    python -m benchmarks.priority load       # 120 s phases with priorities: about 15 minutes

``overhead``: three daemons side by side (``vllm:`` names off, on, and on with tracing to
a local OTLP receiver that drops what it gets), sequential requests to each in turn:
the daemon process's CPU time per request (its workers excluded) and requests per
second::

    python -m benchmarks.priority overhead --requests 400
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from benchmarks import bench
from modelpool import (
    DeadlineExceeded,
    ModelPool,
    PoolConfig,
    PoolFuture,
    QueueFull,
    Result,
    RetryPolicy,
)
from modelpool.supervisor.observe import AttemptRecord, RequestRecord

ROOT = Path(__file__).resolve().parents[1]

HIGH, LOW = 0, 10


@dataclass
class Phase:
    name: str
    ttft: dict[int, list[float]] = field(default_factory=lambda: {HIGH: [], LOW: []})
    refused: dict[int, int] = field(default_factory=lambda: {HIGH: 0, LOW: 0})
    timed_out_queued: dict[int, int] = field(default_factory=lambda: {HIGH: 0, LOW: 0})
    timed_out_running: dict[int, int] = field(default_factory=lambda: {HIGH: 0, LOW: 0})
    preempted: dict[int, int] = field(default_factory=lambda: {HIGH: 0, LOW: 0})
    sent: dict[int, int] = field(default_factory=lambda: {HIGH: 0, LOW: 0})
    load_average: float = 0.0

    def row(self, klass: int | None) -> dict[str, Any]:
        """The figures of one class, or (None) of both together."""
        if klass is None:
            both = Phase(self.name, load_average=self.load_average)
            for field_name in ("refused", "timed_out_queued", "timed_out_running", "preempted"):
                counts = getattr(self, field_name)
                getattr(both, field_name)[HIGH] = counts[HIGH] + counts[LOW]
            both.ttft[HIGH] = self.ttft[HIGH] + self.ttft[LOW]
            both.sent[HIGH] = self.sent[HIGH] + self.sent[LOW]
            return {**both.row(HIGH), "class": "all"}
        samples = self.ttft[klass]

        def rank(q: float) -> float | None:
            return round(bench.percentile(samples, q), 3) if samples else None

        return {
            "phase": self.name,
            "class": "high" if klass == HIGH else "low",
            "sent": self.sent[klass],
            "answered": len(samples),
            "ttft_p50_s": rank(50),
            "ttft_p99_s": rank(99),
            "refused_early": self.refused[klass],
            "timed_out_in_queue": self.timed_out_queued[klass],
            "timed_out_running": self.timed_out_running[klass],
            "preempted": self.preempted[klass],
            "load_average": round(self.load_average, 2),
        }


def _offer(
    pool: ModelPool,
    phase: Phase,
    *,
    rate: float,
    seconds: float,
    prompt: str,
    priorities: bool,
    bound_s: float | None,
    seed: int,
    high_share: float = 0.2,
) -> None:
    """Poisson arrivals at ``rate`` per second for ``seconds``; waits for every answer."""
    rng = random.Random(seed)
    lock = threading.Lock()
    pending: list[PoolFuture] = []
    end = time.monotonic() + seconds
    at = time.monotonic()
    while at < end:
        at += rng.expovariate(rate)
        time.sleep(max(0.0, at - time.monotonic()))
        klass = HIGH if rng.random() < high_share else LOW
        phase.sent[klass] += 1
        sent = time.monotonic()
        first: list[float] = []

        def on_chunk(text: str, first: list[float] = first, sent: float = sent) -> None:
            if not first:
                first.append(time.monotonic() - sent)

        try:
            future = pool.submit(
                prompt,
                on_chunk=on_chunk,
                priority=klass if priorities else 0,
                max_queue_time_s=bound_s if bound_s is not None else float("inf"),
            )
        except QueueFull:
            phase.refused[klass] += 1
            continue

        def done(f: Future[Result], klass: int = klass, first: list[float] = first) -> None:
            error = f.exception()
            with lock:
                if error is None and first:
                    phase.ttft[klass].append(first[0])
                    phase.preempted[klass] += f.result().attempts > 1
                elif isinstance(error, DeadlineExceeded):
                    # Preempted attempts and then the queue: it timed out waiting there.
                    ran = any(a.outcome != "preempted" for a in error.attempts)
                    bucket = phase.timed_out_running if ran else phase.timed_out_queued
                    bucket[klass] += 1
                    phase.preempted[klass] += any(a.outcome == "preempted" for a in error.attempts)

        future.add_done_callback(done)
        pending.append(future)
    for future in pending:
        try:
            future.result()
        except Exception:
            pass  # counted by its callback


def load(args: argparse.Namespace) -> list[dict[str, Any]]:
    prompt = f"tokens:{args.tokens}:{args.delay_s}"
    run_s = args.tokens * args.delay_s
    rows: list[dict[str, Any]] = []
    # One-call workers, one batched worker of as many rows (the same capacity), and one
    # batched worker of --wide-rows.
    shapes = {
        "one-call": (args.workers, 1),
        "batched": (1, args.workers),
        "wide": (1, args.wide_rows),
    }
    for shape in args.shapes.split(","):
        workers, batch = shapes[shape]
        config = PoolConfig(
            model="none",
            backend="testing",
            workers=workers,
            max_batch_size=batch,
            devices=("cpu",),
            deadline_s=args.deadline_s,
            retry=RetryPolicy(max_retries=0),
            priority_aging_s=args.aging_s,
        )
        capacity = workers * batch / run_s  # requests per second
        # (name, seconds, offered load, priorities, max_queue_time_s, high share). "high
        # alone" offers only the high-priority arrivals of the loaded phases (0.2 x 2): the
        # wait the high requests make each other, with no low request at all.
        phases = [
            ("unloaded", args.unloaded_seconds, 0.2, True, None, 0.2),
            ("high alone", args.unloaded_seconds, 0.4, True, None, 1.0),
            ("fifo", args.fifo_seconds, 2.0, False, None, 0.2),
            ("priority", args.seconds, 2.0, True, None, 0.2),
            ("priority+max_queue_time_s", args.seconds, 2.0, True, args.max_queue_time_s, 0.2),
        ]
        with ModelPool(config) as pool:
            for index, (name, seconds, load_factor, priorities, bound, share) in enumerate(phases):
                phase = Phase(f"{shape}, {name}")
                _offer(
                    pool,
                    phase,
                    rate=capacity * load_factor,
                    seconds=seconds,
                    prompt=prompt,
                    priorities=priorities,
                    bound_s=bound,
                    seed=index,
                    high_share=share,
                )
                phase.load_average = os.getloadavg()[0]
                # Unloaded, the classes share one figure: what "its unloaded value" is.
                new = [phase.row(None)] if name == "unloaded" else []
                new += [phase.row(HIGH), phase.row(LOW)]
                print(*(json.dumps(row) for row in new), sep="\n", flush=True)
                rows += new
    print(_markdown(rows))
    return rows


def _markdown(rows: list[dict[str, Any]]) -> str:
    """The rows as docs/priority.md's table."""
    keys = [
        "phase",
        "class",
        "sent",
        "answered",
        "ttft_p50_s",
        "ttft_p99_s",
        "refused_early",
        "timed_out_in_queue",
        "timed_out_running",
        "preempted",
        "load_average",
    ]
    lines = ["| " + " | ".join(keys) + " |", "|" + " --- |" * len(keys)]
    lines += ["| " + " | ".join(str(row[key]) for key in keys) + " |" for row in rows]
    return "\n".join(lines)


class _Sink(http.server.BaseHTTPRequestHandler):
    """An OTLP/HTTP endpoint that accepts and drops what it is sent."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        return None


def _daemon_cpu_s(daemon: Any) -> float:
    """CPU seconds of the daemon's own process (its workers are other processes)."""
    times = psutil.Process(daemon.process.pid).cpu_times()
    return float(times.user + times.system)


def _record(number: int) -> RequestRecord:
    """A request of two attempts (a timeout, then an answer), as the dispatcher hands it."""
    now = time.monotonic()
    return RequestRecord(
        request_id=f"req-{number}",
        priority=0,
        submitted_at=now - 0.3,
        finished_at=now,
        status="completed",
        first_dispatch_at=now - 0.29,
        first_token_at=now - 0.1,
        attempts=[
            AttemptRecord(1, 0, 100, now - 0.29, now - 0.2, None, "timeout"),
            AttemptRecord(2, 1, 101, now - 0.2, now, now - 0.1, "ok"),
        ],
        finish_reason="stop",
        prompt_tokens=40,
        completion_tokens=32,
        max_new_tokens=64,
    )


def observer_cost(endpoint: str, records: int) -> dict[str, float]:
    """CPU microseconds per request of the two observers, alone: the ``vllm:`` series'
    observation (on the dispatcher thread) and the tracer's spans, built and exported
    (the local receiver's CPU included: it runs in this process)."""
    from prometheus_client import CollectorRegistry

    from modelpool.server.vllm_metrics import VllmMetrics
    from modelpool.supervisor.tracing import PoolTracer

    sample = [_record(n) for n in range(records)]
    observe = VllmMetrics(CollectorRegistry()).observer("bench")
    cpu = time.process_time()
    for record in sample:
        observe(record)
    vllm_us = (time.process_time() - cpu) / records * 1e6

    class _Pool:
        def add_observer(self, **observers: Any) -> None:
            self.observers = observers

    pool = _Pool()
    tracer = PoolTracer(pool, endpoint, model_name="bench", schedule_delay_s=0.2)  # type: ignore[arg-type]
    cpu = time.process_time()
    for record in sample:
        pool.observers["on_request"](record)
    tracer.force_flush(timeout_s=60.0)
    tracing_us = (time.process_time() - cpu) / records * 1e6
    tracer.shutdown()
    figures = {"vllm_observe_us": round(vllm_us, 1), "tracing_us": round(tracing_us, 1)}
    print(json.dumps(figures), flush=True)
    return figures


def overhead(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Three daemons side by side, requests sent to each in turn, round after round; and
    the observers' own cost per request, measured alone."""
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "e2e")]  # the test helpers
    from e2e_support import daemon_config, start_daemon  # type: ignore[import-not-found]

    sink = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    threading.Thread(target=sink.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{sink.server_address[1]}/v1/traces"
    variants: dict[str, dict[str, Any]] = {
        "vllm_off": {"vllm_metrics": False},
        "vllm_on": {"vllm_metrics": True},
        "tracing_on": {"vllm_metrics": True, "otlp_traces_endpoint": endpoint},
    }
    costs = observer_cost(endpoint, args.records)
    figures: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    body = {"prompt": f"tokens:{args.tokens}", "max_tokens": args.tokens}
    with tempfile.TemporaryDirectory() as workdir:
        daemons = {
            name: start_daemon(Path(workdir) / name, daemon_config(workers=2, server=server))
            for name, server in variants.items()
        }
        try:
            clients = {
                name: httpx.Client(base_url=d.url, timeout=30.0) for name, d in daemons.items()
            }
            for client in clients.values():  # warm
                for _ in range(20):
                    client.post("/v1/completions", json=body)
            for _ in range(args.rounds):  # interleaved: a busy machine slows each alike
                for name, client in clients.items():
                    cpu, wall = _daemon_cpu_s(daemons[name]), time.perf_counter()
                    for _ in range(args.requests):
                        assert client.post("/v1/completions", json=body).status_code == 200
                    cpu = _daemon_cpu_s(daemons[name]) - cpu
                    wall = time.perf_counter() - wall
                    figures[name].append((cpu / args.requests * 1000, args.requests / wall))
                    client.get("/metrics")
        finally:
            for daemon in daemons.values():
                daemon.stop()
    rows: list[dict[str, Any]] = []
    for name, samples in figures.items():
        rows.append(
            {
                "variant": name,
                "cpu_ms_per_request": round(statistics.median(s[0] for s in samples), 3),
                "requests_per_s": round(statistics.median(s[1] for s in samples), 1),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    base_cpu, base_rate = rows[0]["cpu_ms_per_request"], rows[0]["requests_per_s"]
    for row in rows[1:]:
        cpu = float(row["cpu_ms_per_request"]) / float(base_cpu)
        rate = float(row["requests_per_s"]) / float(base_rate)
        print(f"{row['variant']}: CPU {cpu:.3f}x, throughput {rate:.3f}x of vllm_off")
    for name, key in (("vllm:", "vllm_observe_us"), ("tracing", "tracing_us")):
        share = costs[key] / 1000 / float(base_cpu)
        print(f"{name} observer alone: {costs[key]} us per request, {share:.1%} of vllm_off's CPU")
    sink.shutdown()
    return [*rows, costs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("load")
    run.add_argument("--seconds", type=float, default=120.0, help="each phase with priorities")
    run.add_argument("--fifo-seconds", type=float, default=20.0)
    run.add_argument("--unloaded-seconds", type=float, default=20.0)
    run.add_argument("--shapes", default="one-call,batched,wide")
    run.add_argument("--workers", type=int, default=2)
    run.add_argument("--wide-rows", type=int, default=8)
    run.add_argument("--tokens", type=int, default=10)
    run.add_argument("--delay-s", type=float, default=0.02)
    run.add_argument("--deadline-s", type=float, default=5.0)
    run.add_argument("--max-queue-time-s", type=float, default=2.0)
    run.add_argument("--aging-s", type=float, default=10.0)
    cost = commands.add_parser("overhead")
    cost.add_argument("--requests", type=int, default=400)
    cost.add_argument("--tokens", type=int, default=8)
    cost.add_argument("--records", type=int, default=5000, help="for the observers alone")
    cost.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    load(args) if args.command == "load" else overhead(args)


if __name__ == "__main__":
    main()
