"""Priority and admission under overload, and what the observability costs (issue 38).

``load``: a pool of testing workers (``tokens:N:DELAY``, so a run's length is known) is
offered twice its capacity, Poisson arrivals, 20 % of them high priority, three times in
one run: first all at priority 0 (first come, first served: the "FIFO" figures), then
with the two priorities, then with the two priorities and ``max_queue_time_s``. Before
that, the same requests at a fifth of capacity give the unloaded time to first token.
Per phase and class: p50/p99 TTFT of the answered requests, requests refused at once
(``QueueFull``) and requests that timed out (``DeadlineExceeded``; "in the queue" when
no attempt ran)::

    python -m benchmarks.priority load --seconds 30        # about 2 minutes in all

``overhead``: the daemon's CPU per request (the server process's CPU time, workers
excluded) over sequential requests, with the ``vllm:`` names on and off, and requests
per second with tracing on (to a local OTLP receiver) and off::

    python -m benchmarks.priority overhead --requests 400
"""

from __future__ import annotations

import argparse
import http.server
import json
import random
import statistics
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

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
from modelpool.config import ServerConfig

HIGH, LOW = 0, 10


@dataclass
class Phase:
    name: str
    ttft: dict[int, list[float]] = field(default_factory=lambda: {HIGH: [], LOW: []})
    refused: dict[int, int] = field(default_factory=lambda: {HIGH: 0, LOW: 0})
    timed_out_queued: dict[int, int] = field(default_factory=lambda: {HIGH: 0, LOW: 0})
    timed_out_running: dict[int, int] = field(default_factory=lambda: {HIGH: 0, LOW: 0})
    sent: dict[int, int] = field(default_factory=lambda: {HIGH: 0, LOW: 0})

    def row(self, klass: int) -> dict[str, Any]:
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
        klass = HIGH if rng.random() < 0.2 else LOW
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
                elif isinstance(error, DeadlineExceeded):
                    bucket = phase.timed_out_running if error.attempts else phase.timed_out_queued
                    bucket[klass] += 1

        future.add_done_callback(done)
        pending.append(future)
    for future in pending:
        try:
            future.result()
        except Exception:
            pass  # counted by its callback


def load(args: argparse.Namespace) -> list[dict[str, Any]]:
    config = PoolConfig(
        model="none",
        backend="testing",
        workers=args.workers,
        devices=("cpu",),
        deadline_s=args.deadline_s,
        retry=RetryPolicy(max_retries=0),
        priority_aging_s=args.aging_s,
    )
    prompt = f"tokens:{args.tokens}:{args.delay_s}"
    run_s = args.tokens * args.delay_s
    capacity = args.workers / run_s  # requests per second
    rows: list[dict[str, Any]] = []
    with ModelPool(config) as pool:
        phases = [
            ("unloaded", 0.2, True, None),
            ("fifo", 2.0, False, None),
            ("priority", 2.0, True, None),
            ("priority+max_queue_time_s", 2.0, True, args.max_queue_time_s),
        ]
        for index, (name, load_factor, priorities, bound) in enumerate(phases):
            phase = Phase(name)
            seconds = args.seconds
            _offer(
                pool,
                phase,
                rate=capacity * load_factor,
                seconds=seconds,
                prompt=prompt,
                priorities=priorities,
                bound_s=bound,
                seed=index,
            )
            rows += [phase.row(HIGH), phase.row(LOW)]
            print(json.dumps(rows[-2]), json.dumps(rows[-1]), sep="\n", flush=True)
    return rows


class _Sink(http.server.BaseHTTPRequestHandler):
    """An OTLP/HTTP endpoint that accepts and drops what it is sent."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        return None


def _cpu_per_request(server_config: ServerConfig, requests: int) -> tuple[float, float]:
    """(server CPU ms per request, requests per second) over ``requests`` sequential ones
    through the app in process (the dispatcher thread and the observers included)."""
    from starlette.testclient import TestClient

    from modelpool.server import create_app

    config = PoolConfig(model="none", backend="testing", workers=2, devices=("cpu",))
    with ModelPool(config) as pool:
        client = TestClient(create_app(pool, server_config, "bench"), base_url="http://127.0.0.1")
        body = {"prompt": "tokens:8", "max_tokens": 8}
        for _ in range(20):  # warm
            client.post("/v1/completions", json=body)
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(requests):
            assert client.post("/v1/completions", json=body).status_code == 200
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        client.get("/metrics")
    return cpu / requests * 1000, requests / wall


def overhead(args: argparse.Namespace) -> list[dict[str, Any]]:
    sink = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    threading.Thread(target=sink.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{sink.server_address[1]}/v1/traces"
    variants = {
        "vllm_off": ServerConfig(vllm_metrics=False),
        "vllm_on": ServerConfig(vllm_metrics=True),
        "tracing_on": ServerConfig(vllm_metrics=True, otlp_traces_endpoint=endpoint),
    }
    figures: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    for _ in range(args.rounds):  # interleaved: a busy machine slows each alike
        for name, server_config in variants.items():
            figures[name].append(_cpu_per_request(server_config, args.requests))
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
    sink.shutdown()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("load")
    run.add_argument("--seconds", type=float, default=30.0, help="each loaded phase")
    run.add_argument("--workers", type=int, default=2)
    run.add_argument("--tokens", type=int, default=10)
    run.add_argument("--delay-s", type=float, default=0.02)
    run.add_argument("--deadline-s", type=float, default=5.0)
    run.add_argument("--max-queue-time-s", type=float, default=2.0)
    run.add_argument("--aging-s", type=float, default=10.0)
    cost = commands.add_parser("overhead")
    cost.add_argument("--requests", type=int, default=400)
    cost.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    load(args) if args.command == "load" else overhead(args)


if __name__ == "__main__":
    main()
