"""Measure the daemon: HTTP overhead, requests per second, and SIGTERM-to-exit time.

Run through ``scripts/http-load``. Without ``--url`` it starts its own daemon
(``modelpool serve``, the fault-injection echo backend, ``--workers`` workers) as a
second process on a free loopback port, then:

1. overhead: ``--calls`` sequential requests, alternating a direct
   ``pool.generate()`` on an in-process pool with the same config and a POST to
   ``/v1/completions`` over one keep-alive httpx connection; prints both p50s
   and their difference (the HTTP overhead);
2. throughput: ``--requests`` requests from ``--concurrency`` concurrent clients
   (httpx async, one process), requests per second and the error count;
3. shutdown: SIGTERM with nothing in flight, time until the process has exited.

With ``--url`` only step 2 runs, against that daemon. Exits 1 if any request failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]

CONFIG = """\
model = "none"
backend = "testing"
workers = {workers}
devices = ["cpu"]
deadline_s = 30.0

[generation_defaults]
max_new_tokens = 64

[server]
host = "127.0.0.1"
port = {port}
drain_timeout_s = 10.0
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _quantiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)

    def at(fraction: float) -> float:
        return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]

    return {
        "p50_ms": at(0.50) * 1000,
        "p90_ms": at(0.90) * 1000,
        "p99_ms": at(0.99) * 1000,
        "mean_ms": statistics.fmean(ordered) * 1000,
    }


def start_daemon(config_path: Path, port: int, log_path: Path) -> subprocess.Popen[bytes]:
    modelpool = Path(sys.executable).parent / "modelpool"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [
                str(modelpool),
                "serve",
                "--config",
                str(config_path),
                "--port",
                str(port),
                "--log-level",
                "warning",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the daemon exited:\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                return process
        except httpx.TransportError:
            pass  # not listening yet: the pool starts before the port opens
        time.sleep(0.05)
    process.kill()
    raise SystemExit("the daemon was not ready within 60 s")


def measure_overhead(url: str, config_path: Path, calls: int, prompt: str) -> dict[str, Any]:
    from modelpool import ModelPool, PoolConfig

    body = {"model": "m", "prompt": prompt}
    direct: list[float] = []
    http: list[float] = []
    with (
        ModelPool(PoolConfig.from_toml(config_path)) as pool,
        httpx.Client(base_url=url, timeout=30) as client,
    ):
        for _ in range(50):  # warm both paths: imports, connection, first dispatch
            pool.generate(prompt)
            client.post("/v1/completions", json=body).raise_for_status()
        for _ in range(calls):
            started = time.perf_counter()
            pool.generate(prompt)
            direct.append(time.perf_counter() - started)
            started = time.perf_counter()
            response = client.post("/v1/completions", json=body)
            http.append(time.perf_counter() - started)
            response.raise_for_status()
    direct_q, http_q = _quantiles(direct), _quantiles(http)
    return {
        "calls": calls,
        "direct": direct_q,
        "http": http_q,
        "overhead_p50_ms": http_q["p50_ms"] - direct_q["p50_ms"],
    }


async def _load(url: str, total: int, concurrency: int, prompt: str) -> dict[str, Any]:
    body = {"model": "m", "prompt": prompt}
    latencies: list[float] = []
    errors: dict[str, int] = {}
    next_index = 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:

        async def one_client() -> None:
            nonlocal next_index
            while next_index < total:
                next_index += 1
                started = time.perf_counter()
                try:
                    response = await client.post("/v1/completions", json=body)
                    outcome = "ok" if response.status_code == 200 else str(response.status_code)
                except httpx.HTTPError as exc:
                    outcome = type(exc).__name__
                latencies.append(time.perf_counter() - started)
                if outcome != "ok":
                    errors[outcome] = errors.get(outcome, 0) + 1

        await asyncio.gather(*(client.get("/healthz") for _ in range(concurrency)))
        started = time.perf_counter()
        await asyncio.gather(*(one_client() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    return {
        "requests": total,
        "concurrency": concurrency,
        "seconds": elapsed,
        "requests_per_s": total / elapsed,
        "errors": errors,
        "latency": _quantiles(latencies),
    }


def _cpu_seconds(pid: int) -> dict[str, float]:
    """CPU time used so far by the daemon's own process and by its workers together."""
    daemon = psutil.Process(pid)
    own = daemon.cpu_times()
    workers = 0.0
    for child in daemon.children(recursive=True):
        try:
            times = child.cpu_times()
        except psutil.NoSuchProcess:
            continue
        workers += times.user + times.system
    return {"server": own.user + own.system, "workers": workers, "client": sum(os.times()[:2])}


def measure_shutdown(process: subprocess.Popen[bytes]) -> float:
    started = time.perf_counter()
    process.send_signal(signal.SIGTERM)
    code = process.wait(60)
    elapsed = time.perf_counter() - started
    if code != 0:
        raise SystemExit(f"the daemon exited with {code} after SIGTERM")
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(prog="scripts/http-load", description=__doc__.split("\n")[0])
    parser.add_argument("--url", help="an already running daemon (only the load runs)")
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--calls", type=int, default=1000, help="overhead: calls per path")
    parser.add_argument("--prompt", default="echo:hello")
    parser.add_argument("--json", action="store_true", help="print one JSON summary")
    args = parser.parse_args()

    report: dict[str, Any] = {}
    if args.url:
        report["load"] = asyncio.run(_load(args.url, args.requests, args.concurrency, args.prompt))
    else:
        with tempfile.TemporaryDirectory(prefix="modelpool-http-load-") as scratch:
            port = _free_port()
            config_path = Path(scratch) / "echo.toml"
            config_path.write_text(CONFIG.format(workers=args.workers, port=port))
            process = start_daemon(config_path, port, Path(scratch) / "daemon.log")
            url = f"http://127.0.0.1:{port}"
            try:
                report["daemon_pid"] = process.pid
                report["overhead"] = measure_overhead(url, config_path, args.calls, args.prompt)
                before = _cpu_seconds(process.pid)
                report["load"] = asyncio.run(
                    _load(url, args.requests, args.concurrency, args.prompt)
                )
                after = _cpu_seconds(process.pid)
                report["load"]["cpu_ms_per_request"] = {
                    key: (after[key] - before[key]) * 1000 / args.requests for key in after
                }
                report["stats_after"] = httpx.get(url + "/stats").json()["counters"]
                report["sigterm_to_exit_ms"] = measure_shutdown(process) * 1000
            finally:
                if process.poll() is None:
                    process.kill()
                    process.wait()

    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print(report)
    return 1 if report["load"]["errors"] else 0


def _print(report: dict[str, Any]) -> None:
    cpus = os.cpu_count()
    if "overhead" in report:
        overhead = report["overhead"]
        direct, http = overhead["direct"], overhead["http"]
        print(f"overhead ({overhead['calls']} sequential calls each, echo backend, {cpus} CPUs)")
        print(
            f"  direct pool.generate  p50 {direct['p50_ms']:.3f} ms  "
            f"p90 {direct['p90_ms']:.3f} ms  p99 {direct['p99_ms']:.3f} ms"
        )
        print(
            f"  HTTP /v1/completions  p50 {http['p50_ms']:.3f} ms  "
            f"p90 {http['p90_ms']:.3f} ms  p99 {http['p99_ms']:.3f} ms"
        )
        print(f"  HTTP overhead at p50: {overhead['overhead_p50_ms']:.3f} ms")
    load = report["load"]
    latency = load["latency"]
    print(
        f"load: {load['requests']} requests, {load['concurrency']} concurrent clients: "
        f"{load['requests_per_s']:.0f} req/s in {load['seconds']:.2f} s, "
        f"errors {sum(load['errors'].values())} {load['errors'] or ''}"
    )
    print(
        f"  latency p50 {latency['p50_ms']:.2f} ms  p90 {latency['p90_ms']:.2f} ms  "
        f"p99 {latency['p99_ms']:.2f} ms"
    )
    if "cpu_ms_per_request" in load:
        print(
            "  CPU per request: "
            + ", ".join(
                f"{key} {value:.2f} ms" for key, value in load["cpu_ms_per_request"].items()
            )
        )
    if "sigterm_to_exit_ms" in report:
        print(f"SIGTERM to exit, nothing in flight: {report['sigterm_to_exit_ms']:.0f} ms")


if __name__ == "__main__":
    sys.exit(main())
