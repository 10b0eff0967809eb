"""The supervisor's own cost per request, against ``ProcessPoolExecutor(2)`` and pebble.

::

    python -m benchmarks.supervisor [--requests 5000] [--rounds 3] [--batch 1] [--profile]
                                    [--worker-poll-s 0]   # workers sleep as soon as idle

Every contender runs an echo of one short string with two worker processes: modelpool
on the testing backend (``echo:x``), ``concurrent.futures.ProcessPoolExecutor(2)`` and
``pebble.ProcessPool(2)`` on a module-level function. Two figures each, interleaved
round by round (A B C A B C ...) because the machine is shared:

- pipelined throughput: ``--requests`` submitted at once, then all awaited (req/s);
- dispatch round trip: one request at a time, p50 and p99 (ms).

``--profile`` adds one more modelpool run under ``cProfile`` on the dispatcher thread
alone, and prints the function calls per request there (a figure the machine's load
does not move) and the functions that take its time. The load average is printed
before and after; ratios are against modelpool (above 1: modelpool is faster).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import cProfile
import dataclasses
import functools
import json
import os
import pstats
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from modelpool import ModelPool, PoolConfig

_WARM_UP = 1000  # pipelined requests per contender before the rounds: imports, allocators


def echo(text: str) -> str:
    return text


def _pool_config(requests: int, batch: int, worker_poll_s: float | None = None) -> PoolConfig:
    config = PoolConfig(
        model="none",
        backend="testing",
        workers=2,
        max_batch_size=batch,
        max_queue=max(requests, _WARM_UP) + 1,
        devices=("cpu",),
        generation_defaults={},
    )
    if worker_poll_s is None:
        return config
    return dataclasses.replace(config, worker_poll_s=worker_poll_s)


def _percentile(samples: list[float], fraction: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def _timed(submit: Callable[[], Any], wait: Callable[[Any], Any], count: int) -> float:
    started = time.perf_counter()
    futures = [submit() for _ in range(count)]
    for future in futures:
        wait(future)
    return count / (time.perf_counter() - started)


def _one(submit: Callable[[], Any], wait: Callable[[Any], Any]) -> Any:
    return wait(submit())


def _round_trips(call: Callable[[], Any], count: int) -> list[float]:
    samples = []
    for _ in range(count):
        started = time.perf_counter()
        call()
        samples.append(time.perf_counter() - started)
    return samples


def profile_dispatcher(requests: int, batch: int, top: int) -> dict[str, Any]:
    """One pipelined run with the dispatcher thread (only) under cProfile."""
    profiler = cProfile.Profile()
    with ModelPool(_pool_config(requests, batch)) as pool:
        _timed(lambda: pool.submit("echo:x"), lambda f: f.result(), 500)  # warm-up
        # Enabled and disabled by commands the dispatcher thread runs: cProfile profiles
        # the thread that enables it, so only that thread is measured.
        started = threading.Event()

        def enable() -> None:
            profiler.enable()
            started.set()

        assert pool._loop is not None
        pool._loop.post(enable)
        started.wait(5)
        rate = _timed(lambda: pool.submit("echo:x"), lambda f: f.result(), requests)
        stopped = threading.Event()

        def disable() -> None:
            profiler.disable()
            stopped.set()

        pool._loop.post(disable)
        stopped.wait(5)
    stats = pstats.Stats(profiler)
    total_calls = stats.total_calls  # type: ignore[attr-defined]
    entries = stats.stats  # type: ignore[attr-defined]
    rows = sorted(entries.items(), key=lambda item: item[1][2], reverse=True)[:top]
    return {
        "requests": requests,
        "rate_per_s_profiled": round(rate),
        "calls_per_request": round(total_calls / requests, 1),
        "seconds_per_request_us_profiled": round(stats.total_tt / requests * 1e6, 1),  # type: ignore[attr-defined]
        "top_by_own_time": [
            {
                "function": f"{os.path.basename(file)}:{line}:{name}",
                "calls_per_request": round(calls / requests, 2),
                "own_us_per_request": round(own / requests * 1e6, 2),
            }
            for (file, line, name), (_, calls, own, _cum, _callers) in rows
        ],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=5000, help="pipelined per round")
    parser.add_argument("--round-trips", type=int, default=500, help="sequential per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=1, help="modelpool's max_batch_size")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument(
        "--worker-poll-s", type=float, help="modelpool's worker_poll_s (default: the pool's)"
    )
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args(argv)
    import pebble

    result: dict[str, Any] = {
        "load_average_before": os.getloadavg(),
        "batch": args.batch,
        "worker_poll_s": _pool_config(1, 1, args.worker_poll_s).worker_poll_s,
    }
    rates: dict[str, list[float]] = {"modelpool": [], "ppe": [], "pebble": []}
    trips: dict[str, list[float]] = {"modelpool": [], "ppe": [], "pebble": []}
    with (
        ModelPool(_pool_config(args.requests, args.batch, args.worker_poll_s)) as pool,
        concurrent.futures.ProcessPoolExecutor(2) as ppe,
        pebble.ProcessPool(2) as peb,
    ):
        calls: dict[str, tuple[Callable[[], Any], Callable[[Any], Any]]] = {
            "modelpool": (lambda: pool.submit("echo:x"), lambda f: f.result()),
            "ppe": (lambda: ppe.submit(echo, "x"), lambda f: f.result()),
            "pebble": (lambda: peb.schedule(echo, args=("x",)), lambda f: f.result()),
        }
        for submit, wait in calls.values():  # warm-up: imports, first frames, allocators
            _timed(submit, wait, _WARM_UP)
        for _ in range(args.rounds):
            for name, (submit, wait) in calls.items():
                rates[name].append(_timed(submit, wait, args.requests))
                trips[name] += _round_trips(functools.partial(_one, submit, wait), args.round_trips)
    for name in rates:
        result[name] = {
            "per_s": round(statistics.median(rates[name])),
            "per_s_rounds": [round(rate) for rate in rates[name]],
            "dispatch_p50_ms": round(_percentile(trips[name], 0.5) * 1000, 3),
            "dispatch_p99_ms": round(_percentile(trips[name], 0.99) * 1000, 3),
        }
    for other in ("ppe", "pebble"):
        result[f"throughput_modelpool_vs_{other}"] = round(
            result["modelpool"]["per_s"] / result[other]["per_s"], 2
        )
        result[f"dispatch_p50_modelpool_vs_{other}"] = round(
            result["modelpool"]["dispatch_p50_ms"] / result[other]["dispatch_p50_ms"], 2
        )
    if args.profile:
        result["profile"] = profile_dispatcher(args.requests, args.batch, args.top)
    result["load_average_after"] = os.getloadavg()
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as handle:
            handle.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
