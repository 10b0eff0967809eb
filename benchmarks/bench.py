"""Benchmarks: modelpool side by side with what people use today, in one run.

::

    scripts/bench [--quick] [--out DIR] [--scenarios abcdef]   # from a checkout

Contenders, all serving the same model (the embedded default, through its chat
template, greedy, the same ``max_new_tokens``, every worker loading it with
``modelpool.worker.backends.hf.load`` so the per-token work is identical):

1. in-process direct call (the floor), 2. a new ``spawn`` process per request
(the naive fix), 3. ``asyncio.wait_for`` over ``run_in_executor``,
4. ``pebble.ProcessPool``, 5. ``loky``'s reusable executor,
6. ``concurrent.futures.ProcessPoolExecutor`` (spawn), 7. modelpool.

Scenarios: (a) per-request latency, (b) dispatch round trip of a no-op,
(c) a hung request and the request after it, (d) cancel latency,
(e) throughput under 8 callers with 1 and 2 workers, (f) peak memory.
The machine is shared and noisy, so contenders run interleaved (A B A B ...)
and every figure is also given as a ratio against modelpool; ``DIR/bench.json``
keeps every raw sample, ``DIR/bench.md`` the tables, ``DIR/bench.png`` the plots.

This is repository tooling, not part of the installed package (as gunicorn keeps its
benchmarks): ``scripts/bench`` runs it as ``python -m benchmarks.bench`` from the
checkout's root. Importing it is light (no torch, no pool): pool workers import it for
:func:`hang_backend` (they get the caller's ``sys.path``) and spawned contender
processes for the task functions.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import datetime
import functools
import importlib.metadata
import itertools
import json
import math
import multiprocessing
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modelpool.worker.backends.common.params import THREADS_ENV
from modelpool.worker.backends.hf import handler as hf

if TYPE_CHECKING:
    from multiprocessing.context import SpawnContext
    from multiprocessing.queues import Queue

    import pebble

    from modelpool.shared.protocol import Call, Generation, Prompt
    from modelpool.supervisor.pool import ModelPool

Json = dict[str, Any]
Params = dict[str, Any]

PROMPT: list[dict[str, str]] = [
    {"role": "user", "content": "Tell me a story about a lighthouse keeper."}
]
# The request after a hang or a cancel: one token, so that what is left of its time
# is the contender's recovery, not generation.
SHORT_PARAMS: Params = {"max_new_tokens": 1}
CANCEL_PARAMS: Params = {"max_new_tokens": 64, "min_new_tokens": 64}
HANG_MARKER = "modelpool-bench: hang"
HANG_PROMPT: list[dict[str, str]] = [{"role": "user", "content": HANG_MARKER}]
SCENARIOS = "abcdefg"
REFERENCE = "modelpool"
# The asyncio contender's "hung" request is a runaway generation: long enough to
# outlive every measurement, ended by the harness through its cancel flag.
RUNAWAY_TOKENS = 4096
# A 7B model for the naive spawn-per-request projection (stated in bench.md).
SEVEN_B_LOAD_S = (15.0, 30.0)  # from local NVMe: ~14 GB of fp16 weights plus init
SEVEN_B_GPU_STEP_S = 0.03  # one decoding step on a datacenter GPU
SEVEN_B_CPU_STEP_S = 0.25  # one decoding step on a many-core server CPU

LABELS = {
    "inprocess": "in-process direct call",
    "naive": "naive spawn per request",
    "asyncio": "asyncio.wait_for + run_in_executor",
    "pebble": "pebble.ProcessPool",
    "loky": "loky reusable executor",
    "ppe": "ProcessPoolExecutor (spawn)",
    "modelpool": "modelpool",
    "pipe": "raw Pipe ping-pong (floor)",
}


# ============================================================================================
# Worker side: runs in contender processes, in pool workers, and for the in-process floor.


class BenchCall:
    """The per-request object ``HFHandler.generate`` takes, outside the pool.

    Identical per-token work to a pool worker's call (a flag check and an emit
    per token), so contenders differ only in how the request reaches the model.
    """

    def __init__(
        self,
        prompt: Prompt,
        params: Params,
        stop: threading.Event | None = None,
        on_emit: Callable[[str], None] | None = None,
    ) -> None:
        self.prompt = prompt
        self.params = params
        self._stop = stop
        self._on_emit = on_emit

    def cancelled(self) -> bool:
        return self._stop is not None and self._stop.is_set()

    def emit(self, text: str) -> None:
        if self._on_emit is not None:
            self._on_emit(text)


@dataclass(frozen=True)
class Reply:
    """What every contender's generate returns, whatever its transport."""

    pid: int | None
    tokens: int | None
    text: str


_worker_handler: hf.HFHandler | None = None


def worker_threads(cores: int, workers: int) -> int:
    """Torch threads per worker: what the pool gives its workers (cores // workers)."""
    return max(1, cores // workers)


def init_worker(model_dir: str, threads: int, options: Mapping[str, Any]) -> None:
    """Initializer of the pebble, loky and ProcessPoolExecutor contenders: load once."""
    global _worker_handler
    # The pool sets this in its workers' environment; the same here keeps tokenizers alike.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _worker_handler = hf.load_generation(model_dir, "cpu", torch_threads=threads, **options)


def generate_with(handler: hf.HFHandler, prompt: Prompt, params: Params) -> Reply:
    generation = handler.generate(BenchCall(prompt, params))
    return Reply(os.getpid(), generation.completion_tokens, generation.text)


def task_generate(prompt: Prompt, params: Params) -> Reply:
    """One request in a contender process whose initializer loaded the model."""
    if _worker_handler is None:
        raise RuntimeError("init_worker did not run in this process")
    return generate_with(_worker_handler, prompt, params)


def task_noop() -> None:
    """The dispatch scenario's task: nothing, so only the round trip is measured."""


def task_pid() -> int:
    # A short sleep keeps the task busy long enough that a pool hands the next one
    # to another worker, so warming up reaches every worker.
    time.sleep(0.05)
    return os.getpid()


def task_hang() -> None:
    """A hung request: ignores SIGTERM and never returns (like the testing backend's hang)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Event().wait()


class HangingHandler:
    """The hf handler, except that the prompt ``HANG_MARKER`` hangs ignoring SIGTERM."""

    def __init__(self, inner: hf.HFHandler) -> None:
        self._inner = inner

    def validate(self, params: Mapping[str, Any]) -> None:
        hf.validate(params)

    def generate(self, call: Call) -> Generation:
        prompt = call.prompt
        if isinstance(prompt, list) and prompt and prompt[-1].get("content") == HANG_MARKER:
            task_hang()
        return self._inner.generate(call)


def hang_backend(model: str, device: str = "cpu", **options: Any) -> HangingHandler:
    """Pool backend ``benchmarks.bench:hang_backend``: the real model, plus a hang on demand.

    The hung-request scenario needs the real model in the pool's workers, so
    that a replacement worker pays the real load time.
    """
    return HangingHandler(hf.load_generation(model, device, **options))


def naive_child(
    out: Queue[Json],
    model_dir: str,
    threads: int,
    options: Mapping[str, Any],
    prompt: Prompt,
    params: Params,
) -> None:
    """The naive contender's per-request process; wall-clock stamps split its cost."""
    entered = time.time()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch  # noqa: F401  (the import is what this phase measures)
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    imported = time.time()
    handler = hf.load_generation(model_dir, "cpu", torch_threads=threads, **options)
    loaded = time.time()
    reply = generate_with(handler, prompt, params)
    out.put(
        {
            "entered": entered,
            "imported": imported,
            "loaded": loaded,
            "generated": time.time(),
            "tokens": reply.tokens,
            "text": reply.text,
            "peak_rss_mb": peak_rss_mb(os.getpid()),
        }
    )


def pipe_echo(conn: Connection) -> None:
    """The physical floor of (b): bytes in, bytes out, no pickling, no scheduling."""
    while True:
        try:
            data = conn.recv_bytes()
        except EOFError:
            return
        conn.send_bytes(data)


def peak_rss_mb(pid: int) -> float | None:
    """The kernel's high-water mark of a process's resident memory (``VmHWM``), in MiB."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return None


# ============================================================================================
# Pure parts: statistics, ratios, tables.


def percentile(samples: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile ``q`` (0-100) of a non-empty sample."""
    if not samples:
        raise ValueError("percentile of an empty sample")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    ordered = sorted(samples)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(samples: Sequence[float]) -> Json:
    """n, p50, p90, p99, mean, min, max of a sample (only n when it is empty)."""
    if not samples:
        return {"n": 0}
    return {
        "n": len(samples),
        "p50": percentile(samples, 50),
        "p90": percentile(samples, 90),
        "p99": percentile(samples, 99),
        "mean": statistics.fmean(samples),
        "min": min(samples),
        "max": max(samples),
    }


def ratio(value: float | None, reference: float | None) -> float | None:
    """value / reference, or None where either is missing or the reference is not positive."""
    if value is None or reference is None or reference <= 0:
        return None
    return value / reference


def fmt_seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 1e-3:
        return f"{value * 1e6:.0f} µs"
    if value < 1.0:
        return f"{value * 1e3:.1f} ms" if value < 0.1 else f"{value * 1e3:.0f} ms"
    return f"{value:.2f} s"


def fmt_ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def fmt_mb(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} MiB"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub markdown table; ``|`` inside cells is escaped."""

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(str(cell).replace("|", "\\|") for cell in cells) + " |"

    for row in rows:
        if len(row) != len(headers):
            raise ValueError(f"row {row!r} has {len(row)} cells, expected {len(headers)}")
    return "\n".join([line(headers), line(["---"] * len(headers)), *(line(r) for r in rows)])


def _p50(entry: Json | None) -> float | None:
    if not entry:
        return None
    value = entry.get("summary", {}).get("p50")
    return float(value) if value is not None else None


def _get(data: Json, *keys: str) -> Any:
    value: Any = data
    for key in keys:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value


# ---- result builders: raw samples in, the scenario's JSON out (pure, tested) -------------


def build_dispatch(samples: Mapping[str, Sequence[float]], block: int) -> Json:
    """(b): per contender, every round-trip sample (seconds) and its summary."""
    contenders: Json = {
        key: {"label": LABELS.get(key, key), "samples_s": list(values),
              "summary": summarize(values)}
        for key, values in samples.items()
    }
    reference = _p50(contenders.get(REFERENCE))
    for entry in contenders.values():
        entry["p50_vs_modelpool"] = ratio(entry["summary"].get("p50"), reference)
        entry["p99_vs_modelpool"] = ratio(
            entry["summary"].get("p99"), _get(contenders, REFERENCE, "summary", "p99")
        )
    return {"block": block, "contenders": contenders}


def build_latency(
    tokens: int,
    samples: Mapping[str, Sequence[float]],
    texts: Mapping[str, str],
    setup: Mapping[str, Json],
    naive_phases: Sequence[Json] = (),
) -> Json:
    """(a) for one token count: per contender samples, summary, ratio against modelpool."""
    reference_text = texts.get("inprocess")
    contenders: Json = {}
    for key, values in samples.items():
        contenders[key] = {
            "label": LABELS.get(key, key),
            **setup.get(key, {}),
            "samples_s": list(values),
            "summary": summarize(values),
            "same_text_as_inprocess": (
                None if reference_text is None or key not in texts else texts[key] == reference_text
            ),
        }
    reference = _p50(contenders.get(REFERENCE))
    for entry in contenders.values():
        entry["p50_vs_modelpool"] = ratio(_p50(entry), reference)
    result: Json = {"max_new_tokens": tokens, "contenders": contenders}
    result["modelpool_vs_inprocess"] = ratio(reference, _p50(contenders.get("inprocess")))
    result["naive_vs_modelpool"] = ratio(_p50(contenders.get("naive")), reference)
    if naive_phases:
        result["naive_phases"] = naive_breakdown(naive_phases)
    return result


def naive_breakdown(phases: Sequence[Json]) -> Json:
    """Medians of the naive request's phases and its limit (everything) / generate."""
    names = ("spawn", "import", "load", "generate", "return", "exit", "total")
    medians = {name: statistics.median(float(p[name]) for p in phases) for name in names}
    limit = ratio(medians["total"], medians["generate"])
    fixed = medians["spawn"] + medians["import"]
    projections = []
    for where, step in (("GPU", SEVEN_B_GPU_STEP_S), ("CPU", SEVEN_B_CPU_STEP_S)):
        tokens = int(phases[0].get("tokens") or 16)
        generate = step * tokens
        low, high = ((fixed + load + generate) / generate for load in SEVEN_B_LOAD_S)
        projections.append(
            {"device": where, "generate_s": generate, "limit_low": low, "limit_high": high}
        )
    return {
        "samples": list(phases),
        "median_s": medians,
        "limit": limit,
        "seven_b": {
            "load_s": list(SEVEN_B_LOAD_S),
            "spawn_import_s": fixed,
            "projections": projections,
        },
    }


def build_throughput(runs: Mapping[str, Mapping[int, Json]]) -> Json:
    """(e): requests/s per contender and worker count, the 2-vs-1 ratio, against modelpool."""
    contenders: Json = {}
    for key, by_workers in runs.items():
        entry: Json = {"label": LABELS.get(key, key), "runs": {}}
        for count, run in by_workers.items():
            entry["runs"][str(count)] = dict(run)
        one = _get(entry, "runs", "1", "requests_per_s")
        two = _get(entry, "runs", "2", "requests_per_s")
        entry["two_vs_one"] = ratio(two, one)
        contenders[key] = entry
    for entry in contenders.values():
        for workers in ("1", "2"):
            run = entry["runs"].get(workers)
            if run is not None:
                run["vs_modelpool"] = ratio(
                    run.get("requests_per_s"),
                    _get(contenders, REFERENCE, "runs", workers, "requests_per_s"),
                )
    return {"contenders": contenders}


def evaluate_targets(scenarios: Json) -> list[Json]:
    """The design's targets against the measured values (met: None where not measured)."""
    targets: list[Json] = []

    def add(name: str, goal: str, value: float | None, met: bool | None, shown: str) -> None:
        targets.append(
            {"name": name, "target": goal, "value": value, "met": met, "measured": shown}
        )

    a16 = _get(scenarios, "a", "by_tokens", "16")
    value = _get(a16, "modelpool_vs_inprocess") if a16 else None
    add("a: modelpool vs in-process (16 tokens, ratio of medians)", "< 1.05", value,
        None if value is None else value < 1.05, fmt_ratio(value))
    value = _get(a16, "naive_vs_modelpool") if a16 else None
    add("a: naive spawn-per-request vs modelpool (16 tokens)", ">= 5x slower", value,
        None if value is None else value >= 5.0, fmt_ratio(value))

    dispatch = _get(scenarios, "b", "contenders") or {}
    mine = _p50(dispatch.get(REFERENCE))
    others = [p for k in ("pebble", "loky", "ppe") if (p := _p50(dispatch.get(k))) is not None]
    best = min(others) if others else None
    add("b: dispatch p50 at or below the fastest of pebble/loky/PPE",
        f"<= {fmt_seconds(best)}" if best is not None else "<= fastest",
        mine, None if mine is None or best is None else mine <= best, fmt_seconds(mine))
    add("b: dispatch p50, the design target", "<= 0.2 ms", mine,
        None if mine is None else mine <= 0.2e-3, fmt_seconds(mine))

    hung = _get(scenarios, "c", "contenders") or {}
    spare_starts = [
        float(v) for k, e in hung.items()
        if k.startswith("modelpool") and e.get("spares") == 1
        and (v := e.get("next_started_after_error_s")) is not None
    ]
    worst = max(spare_starts) if spare_starts else None
    add("c: next request starts within 100 ms of the timeout, with a spare", "< 100 ms",
        worst, None if worst is None else worst < 0.1, fmt_seconds(worst))
    retry = _get(scenarios, "c", "retry_on_spare", "summary")
    value = _get(retry, "p50") if retry else None
    add("c: attempt deadline -> retry on a spare, graces 0 (p50)", "< 10 ms", value,
        None if value is None else value < 0.01,
        f"{fmt_seconds(value)} (max {fmt_seconds(_get(retry, 'max'))})" if retry else "-")

    value = _get(scenarios, "e", "contenders", REFERENCE, "two_vs_one")
    add("e: modelpool throughput, 2 workers vs 1", ">= 1.7x", value,
        None if value is None else value >= 1.7, fmt_ratio(value))
    return targets


# ============================================================================================
# Settings and the machine.


@dataclass(frozen=True)
class Settings:
    """How much of each scenario to run; ``--quick`` fits 5 minutes on 2 cores."""

    quick: bool
    out: Path
    scenarios: str
    dtype: str
    model: str
    dispatch_calls: int = 2000
    dispatch_block: int = 100
    latency_tokens: tuple[int, ...] = (16, 64)
    latency_rounds: Mapping[int, tuple[int, int]] = field(
        default_factory=lambda: {16: (10, 40), 64: (5, 12)}
    )  # tokens -> (minimum, maximum) interleaved rounds
    latency_budget_s: Mapping[int, float] = field(default_factory=lambda: {16: 300.0, 64: 400.0})
    naive_samples: Mapping[int, int] = field(default_factory=lambda: {16: 5, 64: 3})
    hang_timeout_s: float = 2.0
    wedge_cap_s: float = 10.0
    cpu_sample_s: float = 1.0
    retry_reps: int = 20
    retry_attempt_timeout_s: float = 0.3
    cancel_reps: int = 10
    cancel_reps_killing: int = 2
    throughput_requests: int = 16
    throughput_rounds: tuple[int, int] = (2, 4)  # (minimum, maximum) interleaved rounds
    throughput_budget_s: float = 300.0
    callers: int = 8

    @classmethod
    def for_run(
        cls, *, quick: bool, out: Path, scenarios: str, dtype: str, model: str,
        dispatch_calls: int | None,
    ) -> Settings:
        if not quick:
            return cls(quick=False, out=out, scenarios=scenarios, dtype=dtype, model=model,
                       dispatch_calls=dispatch_calls or 2000)
        return cls(
            quick=True, out=out, scenarios=scenarios, dtype=dtype, model=model,
            dispatch_calls=dispatch_calls or 2000,
            latency_tokens=(16,),
            latency_rounds={16: (5, 10)},
            latency_budget_s={16: 45.0},
            naive_samples={16: 2},
            wedge_cap_s=3.0,
            retry_reps=5,
            cancel_reps=3,
            cancel_reps_killing=1,
            throughput_requests=8,
            throughput_rounds=(1, 2),
            throughput_budget_s=40.0,
        )

    @property
    def backend_options(self) -> dict[str, Any]:
        return {} if self.dtype == "checkpoint" else {"dtype": self.dtype}


def usable_cpus() -> int:
    """Cores this process may run on: what the pool divides among its workers."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def machine_info() -> Json:
    cpu = platform.processor() or "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    versions: dict[str, str | None] = {}
    for package in ("torch", "transformers", "pebble", "loky", "psutil", "modelpool"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return {
        "cpu": cpu,
        "cores": usable_cpus(),
        "logical_cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": versions,
        "git": git_commit(),
    }


def git_commit() -> Json:
    """The checkout's commit, and whether the working tree differs from it."""
    root = Path(__file__).resolve().parents[2]

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                                  timeout=10, check=False)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return {"commit": "uncommitted", "dirty": True}
    status = git("status", "--porcelain")
    return {"commit": commit, "dirty": bool(status)}


def load_average() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def machine_busy_seconds() -> float | None:
    """CPU seconds every process on the machine has used since boot (``/proc/stat``)."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except (OSError, IndexError):
        return None
    # user nice system idle iowait irq softirq steal ...: all but idle and iowait are busy.
    ticks = [int(x) for x in fields[:8]]
    busy = sum(ticks) - ticks[3] - ticks[4]
    return busy / os.sysconf("SC_CLK_TCK")


def own_busy_seconds() -> float:
    """CPU seconds of this process and of its children that have been reaped."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


# ============================================================================================
# Process bookkeeping: every contender is registered for cleanup as it is created.


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def spawn_context() -> SpawnContext:
    return multiprocessing.get_context("spawn")


def kill_leftover_children() -> list[int]:
    """SIGKILL every descendant still alive (ours by construction); returns their pids.

    multiprocessing's and loky's resource trackers are left alone: they live until this
    process exits and then end by themselves, and killing one makes it relaunch.
    """
    import psutil

    leftovers = []
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if any("resource_tracker" in part for part in child.cmdline()):
                continue
            leftovers.append(child)
    for child in leftovers:
        with contextlib.suppress(psutil.Error):
            child.kill()
    psutil.wait_procs(leftovers, timeout=5)
    return [child.pid for child in leftovers]


def close_quietly(close: Callable[..., object], *args: Any, **kwargs: Any) -> None:
    """Run one cleanup step; a failure is logged so that the steps after it still run."""
    try:
        close(*args, **kwargs)
    except Exception:
        log(f"cleanup {getattr(close, '__qualname__', close)!s} failed:\n"
            f"{traceback.format_exc()}")


def children_pids() -> set[int]:
    import psutil

    return {child.pid for child in psutil.Process().children(recursive=True)}


def close_pebble(pool: pebble.ProcessPool) -> None:
    pool.stop()  # type: ignore[no-untyped-call]
    pool.join(timeout=10)


def close_ppe(executor: concurrent.futures.ProcessPoolExecutor) -> None:
    # A ProcessPoolExecutor cannot stop a running task, and its shutdown waits for it:
    # give it a moment, then kill what is left so the harness can exit.
    processes = list((getattr(executor, "_processes", None) or {}).values())
    executor.shutdown(wait=False, cancel_futures=True)
    deadline = time.monotonic() + 5.0
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join(5.0)


def ppe_pids(executor: concurrent.futures.ProcessPoolExecutor) -> list[int]:
    processes = getattr(executor, "_processes", None) or {}
    return [p.pid for p in processes.values() if p.pid is not None]


def loky_executor(workers: int, initargs: tuple[Any, ...] | None) -> Any:
    """loky's reusable executor, as its users get it: same arguments, same executor.

    loky keeps it per thread, so call this on the harness's main thread and hand
    the object to other threads.
    """
    import loky  # type: ignore[import-untyped]

    kwargs: Json = {"max_workers": workers, "timeout": 3600}
    # timeout: loky stops workers idle for 10 s by default, which would reload the model
    # between scenarios; a benchmark must not charge that to any request.
    if initargs is not None:
        kwargs.update(initializer=init_worker, initargs=initargs)
    return loky.get_reusable_executor(**kwargs)


def close_loky(executor: Any) -> None:
    executor.shutdown(wait=True, kill_workers=True)


def warm_pids(submit: Callable[[], concurrent.futures.Future[int]], workers: int,
              timeout: float = 600.0) -> list[int]:
    """Submit pid tasks until every worker has answered one (loading the model first)."""
    seen: set[int] = set()
    deadline = time.monotonic() + timeout
    while len(seen) < workers:
        futures = [submit() for _ in range(workers * 2)]
        for future in futures:
            seen.add(future.result(timeout=max(1.0, deadline - time.monotonic())))
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(seen)} of {workers} workers answered")
    return sorted(seen)


def run_concurrently(jobs: Mapping[str, Callable[[], Any]]) -> dict[str, Any]:
    """Run start-up jobs (model loads) side by side; re-raise the first failure after all end."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(jobs))) as threads:
        futures = {name: threads.submit(job) for name, job in jobs.items()}
        concurrent.futures.wait(futures.values())
    return {name: future.result() for name, future in futures.items()}


@dataclass
class Contender:
    """One way of serving the model, as (a), (d) and (e) drive it."""

    workers: int
    threads: int
    generate: Callable[[Params], Reply]

    @property
    def setup(self) -> Json:
        return {"workers": self.workers, "torch_threads": self.threads}


class Harness:
    """Shared state of one run: settings, the model, live contenders, their cleanup."""

    def __init__(self, settings: Settings, stack: contextlib.ExitStack,
                 model_dir: str | None = None) -> None:
        self.settings = settings
        self.stack = stack
        self.cores = usable_cpus()
        self._model_dir = model_dir
        self._single: dict[str, Contender] | None = None
        self._inprocess: hf.HFHandler | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._threads: concurrent.futures.ThreadPoolExecutor | None = None
        self._pebble: pebble.ProcessPool | None = None
        self._ppe: concurrent.futures.ProcessPoolExecutor | None = None
        self._pool: ModelPool | None = None
        self._loky: Any = None

    @property
    def model_dir(self) -> str:
        if self._model_dir is None:
            from modelpool.shared.embedded import resolve_model

            log(f"preparing {self.settings.model}")
            self._model_dir = resolve_model(self.settings.model)
        return self._model_dir

    def initargs(self, workers: int) -> tuple[Any, ...]:
        return (self.model_dir, worker_threads(self.cores, workers),
                self.settings.backend_options)

    def pool_config(self, workers: int, spares: int = 0, backend: str = "hf",
                    **overrides: Any) -> Any:
        from modelpool import PoolConfig

        return PoolConfig(model=self.model_dir, backend=backend,
                          backend_options=self.settings.backend_options, workers=workers,
                          spares=spares, devices=("cpu",), deadline_s=600.0, **overrides)

    def start_pool(self, config: Any) -> ModelPool:
        from modelpool import ModelPool

        pool = ModelPool(config)
        self.stack.callback(close_quietly, pool.close, drain=False, timeout=10.0)
        return pool.start()

    def start_pebble(self, workers: int, initargs: tuple[Any, ...] | None) -> pebble.ProcessPool:
        import pebble

        if initargs is None:
            pool = pebble.ProcessPool(max_workers=workers, context=spawn_context())
        else:
            pool = pebble.ProcessPool(max_workers=workers, initializer=init_worker,
                                      initargs=initargs, context=spawn_context())
        self.stack.callback(close_quietly, close_pebble, pool)
        return pool

    def start_ppe(self, workers: int,
                  initargs: tuple[Any, ...] | None) -> concurrent.futures.ProcessPoolExecutor:
        if initargs is None:
            executor = concurrent.futures.ProcessPoolExecutor(workers, mp_context=spawn_context())
        else:
            executor = concurrent.futures.ProcessPoolExecutor(
                workers, mp_context=spawn_context(), initializer=init_worker, initargs=initargs)
        self.stack.callback(close_quietly, close_ppe, executor)
        return executor

    def start_loky(self, workers: int, initargs: tuple[Any, ...] | None) -> Any:
        executor = loky_executor(workers, initargs)
        self.stack.callback(close_quietly, close_loky, executor)
        return executor

    def start_loky_private(self, workers: int, initargs: tuple[Any, ...]) -> Any:
        """A loky executor of its own (not the per-thread reusable one)."""
        import loky

        executor = loky.ProcessPoolExecutor(max_workers=workers, initializer=init_worker,
                                            initargs=initargs)
        self.stack.callback(close_quietly, close_loky, executor)
        return executor

    def inprocess_handler(self) -> hf.HFHandler:
        if self._inprocess is None:
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
            self._inprocess = hf.load_generation(self.model_dir, "cpu",
                                      torch_threads=worker_threads(self.cores, 1),
                                      **self.settings.backend_options)
        return self._inprocess

    def asyncio_parts(
        self,
    ) -> tuple[asyncio.AbstractEventLoop, concurrent.futures.ThreadPoolExecutor]:
        """An event loop and the executor behind its run_in_executor (the default's shape)."""
        if self._loop is None or self._threads is None:
            self._loop = asyncio.new_event_loop()
            # Several threads, like the default executor: a timed-out call keeps one busy.
            self._threads = concurrent.futures.ThreadPoolExecutor(
                max_workers=4, thread_name_prefix="bench-asyncio")
            self.stack.callback(close_quietly, self._loop.close)
            self.stack.callback(close_quietly, self._threads.shutdown, wait=False,
                                cancel_futures=True)
        return self._loop, self._threads

    def single_worker_contenders(self) -> dict[str, Contender]:
        """in-process, asyncio, modelpool, pebble, loky and PPE, each with one worker, warm."""
        if self._single is not None:
            return self._single
        threads = worker_threads(self.cores, 1)
        initargs = self.initargs(1)
        log(f"starting single-worker contenders ({threads} torch threads each)")
        self._pebble = pebble_pool = self.start_pebble(1, initargs)
        self._ppe = ppe = self.start_ppe(1, initargs)
        loky = self.start_loky(1, initargs)
        run_concurrently({
            "modelpool": lambda: self._set_pool(self.start_pool(self.pool_config(1))),
            "pebble": lambda: warm_pids(lambda: pebble_pool.schedule(task_pid), 1),
            "loky": lambda: warm_pids(lambda: loky.submit(task_pid), 1),
            "ppe": lambda: warm_pids(lambda: ppe.submit(task_pid), 1),
            "inprocess": self.inprocess_handler,
        })
        handler = self.inprocess_handler()
        loop, executor = self.asyncio_parts()
        pool = self._require_pool()

        def via_asyncio(params: Params) -> Reply:
            work = functools.partial(generate_with, handler, PROMPT, params)
            return loop.run_until_complete(
                asyncio.wait_for(loop.run_in_executor(executor, work), timeout=600.0))

        def via_pool(params: Params) -> Reply:
            result = pool.generate(PROMPT, **params)
            return Reply(result.worker_pid, result.completion_tokens, result.text)

        self._loky = loky
        self._single = {
            "inprocess": Contender(1, threads, functools.partial(generate_with, handler, PROMPT)),
            "asyncio": Contender(1, threads, via_asyncio),
            "modelpool": Contender(1, threads, via_pool),
            "pebble": Contender(
                1, threads,
                lambda params: pebble_pool.schedule(task_generate, args=(PROMPT, params)).result()),
            "loky": Contender(
                1, threads, lambda params: loky.submit(task_generate, PROMPT, params).result()),
            "ppe": Contender(
                1, threads, lambda params: ppe.submit(task_generate, PROMPT, params).result()),
        }
        return self._single

    def _set_pool(self, pool: ModelPool) -> ModelPool:
        self._pool = pool
        return pool

    def _require_pool(self) -> ModelPool:
        if self._pool is None:
            raise RuntimeError("the single-worker pool is not started")
        return self._pool

    @property
    def pebble_pool(self) -> pebble.ProcessPool:
        self.single_worker_contenders()
        assert self._pebble is not None
        return self._pebble

    @property
    def ppe(self) -> concurrent.futures.ProcessPoolExecutor:
        self.single_worker_contenders()
        assert self._ppe is not None
        return self._ppe

    @property
    def pool(self) -> ModelPool:
        self.single_worker_contenders()
        return self._require_pool()

    @property
    def loky(self) -> Any:
        self.single_worker_contenders()
        return self._loky


def pool_pids(pool: ModelPool) -> list[int]:
    return [int(w["pid"]) for w in pool.stats().to_dict()["workers"] if w.get("pid")]


def ready_workers(pool: ModelPool) -> int:
    return sum(1 for w in pool.stats().to_dict()["workers"] if w["state"] in ("idle", "spare"))


def wait_ready(pool: ModelPool, count: int, timeout: float) -> float | None:
    """Seconds until ``count`` workers are idle or spare (None if not within ``timeout``)."""
    started = time.perf_counter()
    while time.perf_counter() - started < timeout:
        if ready_workers(pool) >= count:
            return time.perf_counter() - started
        time.sleep(0.01)
    return None


# ============================================================================================
# (b) dispatch round trip.


def scenario_dispatch(harness: Harness) -> Json:
    settings = harness.settings
    ctx = spawn_context()
    parent, child = ctx.Pipe()
    echo = ctx.Process(target=pipe_echo, args=(child,), daemon=True)
    echo.start()
    child.close()

    def stop_echo() -> None:
        parent.close()
        echo.join(5.0)
        if echo.is_alive():
            echo.kill()

    harness.stack.callback(close_quietly, stop_echo)

    def ping() -> None:
        parent.send_bytes(b"x")
        parent.recv_bytes()

    pebble_pool = harness.start_pebble(1, None)
    ppe = harness.start_ppe(1, None)
    loky = harness.start_loky(1, None)
    from modelpool import PoolConfig

    # The testing backend's echo with the pool's default configuration otherwise.
    pool = harness.start_pool(PoolConfig(model="none", backend="testing", workers=1,
                                         devices=("cpu",)))
    calls: dict[str, Callable[[], object]] = {
        "pipe": ping,
        "pebble": lambda: pebble_pool.schedule(task_noop).result(),
        "loky": lambda: loky.submit(task_noop).result(),
        "ppe": lambda: ppe.submit(task_noop).result(),
        "modelpool": lambda: pool.generate("echo:x"),
    }
    for key, call in calls.items():
        log(f"(b) warming {key}")
        for _ in range(100):
            call()
    samples: dict[str, list[float]] = {key: [] for key in calls}
    block = settings.dispatch_block
    # Blocks of calls, contenders in turn: drift hits all, caches stay warm within a block.
    while any(len(v) < settings.dispatch_calls for v in samples.values()):
        for key, call in calls.items():
            n = min(block, settings.dispatch_calls - len(samples[key]))
            record = samples[key].append
            for _ in range(n):
                started = time.perf_counter_ns()
                call()
                record((time.perf_counter_ns() - started) / 1e9)
    return build_dispatch(samples, block)


# ============================================================================================
# (a) per-request latency.


def naive_request(harness: Harness, params: Params) -> tuple[float, Json]:
    """One request the naive way: spawn, load, generate, return through a Queue, join."""
    ctx = spawn_context()
    out: Queue[Json] = ctx.Queue()
    process = ctx.Process(
        target=naive_child,
        args=(out, harness.model_dir, worker_threads(harness.cores, 1),
              harness.settings.backend_options, PROMPT, params),
    )
    started_wall = time.time()
    started = time.perf_counter()
    process.start()
    try:
        reply = out.get(timeout=600.0)
        received = time.perf_counter() - started
        process.join(timeout=30.0)
    finally:
        if process.is_alive():
            process.kill()
            process.join()
        out.close()
        out.join_thread()
    elapsed = time.perf_counter() - started
    phases = {
        "spawn": reply["entered"] - started_wall,
        "import": reply["imported"] - reply["entered"],
        "load": reply["loaded"] - reply["imported"],
        "generate": reply["generated"] - reply["loaded"],
        "return": started_wall + received - reply["generated"],
        # join(): the child's interpreter shutdown, which the naive pattern waits for too.
        "exit": elapsed - received,
        "total": elapsed,
        "tokens": reply["tokens"],
        "text": reply["text"],
        "peak_rss_mb": reply["peak_rss_mb"],
    }
    return elapsed, phases


def scenario_latency(harness: Harness) -> Json:
    settings = harness.settings
    contenders = harness.single_worker_contenders()
    order = list(contenders)
    by_tokens: Json = {}
    for tokens in settings.latency_tokens:
        params = {"max_new_tokens": tokens, "min_new_tokens": tokens}
        if tokens == settings.latency_tokens[0]:
            log("(a) warm-up: one request per contender")
            for contender in contenders.values():
                contender.generate(params)
        samples: dict[str, list[float]] = {key: [] for key in order}
        texts: dict[str, str] = {}
        naive: list[Json] = []
        naive_wanted = settings.naive_samples.get(tokens, 0)
        low, high = settings.latency_rounds[tokens]
        budget_end = time.monotonic() + settings.latency_budget_s[tokens]
        for round_index in range(high):
            if round_index >= low and time.monotonic() > budget_end:
                break
            # Rotate the order every round so that no contender always follows the same one.
            shift = round_index % len(order)
            rotation = order[shift:] + order[:shift]
            if len(naive) < naive_wanted:
                rotation.append("naive")
            for key in rotation:
                if key == "naive":
                    elapsed, phases = naive_request(harness, params)
                    if phases["tokens"] != tokens:
                        raise RuntimeError(f"naive generated {phases['tokens']} tokens")
                    naive.append(phases)
                    samples.setdefault("naive", []).append(elapsed)
                    texts.setdefault("naive", str(phases["text"]))
                    continue
                started = time.perf_counter()
                reply = contenders[key].generate(params)
                samples[key].append(time.perf_counter() - started)
                if reply.tokens != tokens:
                    raise RuntimeError(f"{key} generated {reply.tokens} tokens, not {tokens}")
                texts.setdefault(key, reply.text)
            log(f"(a) {tokens} tokens: round {round_index + 1} done")
        setup = {key: c.setup for key, c in contenders.items()}
        setup["naive"] = {"workers": 1, "torch_threads": worker_threads(harness.cores, 1)}
        by_tokens[str(tokens)] = build_latency(tokens, samples, texts, setup, naive)
    return {"by_tokens": by_tokens, "prompt": PROMPT}


# ============================================================================================
# (d) cancel latency.


def scenario_cancel(harness: Harness) -> Json:
    contenders = harness.single_worker_contenders()
    pool = harness.pool
    # Decoding-step time on the same worker, from the stream's chunk arrivals.
    stamps: list[float] = []
    started = time.perf_counter()
    for _ in pool.stream(PROMPT, **CANCEL_PARAMS):
        stamps.append(time.perf_counter())
    intervals = [b - a for a, b in itertools.pairwise(stamps)]
    step = statistics.median(intervals)
    first_chunk = stamps[0] - started
    # Cancel once decoding is well under way: past the prefill and a few steps.
    lead = first_chunk + 4 * step
    log(f"(d) step {step * 1e3:.1f} ms; cancelling {lead:.2f} s after submit")
    return {
        "step_s": step, "step_samples_s": intervals, "first_chunk_s": first_chunk,
        "cancel_after_s": lead,
        "contenders": {
            "modelpool": guarded(lambda: cancel_modelpool(harness, lead, step)),
            "pebble": guarded(lambda: cancel_pebble(harness, contenders["pebble"], lead)),
            "loky": guarded(lambda: cancel_refused(
                lambda: harness.loky.submit(task_generate, PROMPT, CANCEL_PARAMS), lead)),
            "ppe": guarded(lambda: cancel_refused(
                lambda: harness.ppe.submit(task_generate, PROMPT, CANCEL_PARAMS), lead)),
            "asyncio": guarded(lambda: cancel_asyncio(harness, lead)),
            "naive": {
                "can_cancel": None,
                "how": "Process.kill() stops it, and every request pays a full spawn and "
                       "load anyway (a)",
            },
            "inprocess": {
                "can_cancel": False, "how": "the call blocks its caller; nothing else can stop it",
            },
        },
    }


def cancel_modelpool(harness: Harness, lead: float, step: float) -> Json:
    pool = harness.pool
    baseline = _baseline(lambda: pool.generate(PROMPT, **SHORT_PARAMS))
    trials: list[dict[str, float]] = []
    for _ in range(harness.settings.cancel_reps):
        future = pool.submit(PROMPT, **CANCEL_PARAMS)
        time.sleep(lead)
        began = time.perf_counter()
        if not pool.cancel(future.request_id):
            raise RuntimeError("pool.cancel refused a running request")
        outcome = future.result(timeout=60.0)
        resolved = time.perf_counter() - began
        if outcome.finish_reason != "cancelled":
            raise RuntimeError(f"a cancelled request finished with {outcome.finish_reason!r}")
        began = time.perf_counter()
        following = pool.generate(PROMPT, **SHORT_PARAMS)
        trials.append({"cancel_s": resolved, "steps": resolved / step,
                       "tokens": float(outcome.completion_tokens or 0),
                       "next_s": time.perf_counter() - began,
                       "next_queue_s": following.queue_s})
    return {
        "can_cancel": True, "trials": trials, "baseline_next_s": baseline,
        "cancel_s": statistics.median(t["cancel_s"] for t in trials),
        "next_s": statistics.median(t["next_s"] for t in trials),
        "how": "pool.cancel(request_id): the worker stops at its next token and stays warm",
    }


def cancel_pebble(harness: Harness, contender: Contender, lead: float) -> Json:
    pool = harness.pebble_pool
    trials: list[Json] = []
    for _ in range(harness.settings.cancel_reps_killing):
        before = pool.schedule(task_pid).result()
        future = pool.schedule(task_generate, args=(PROMPT, CANCEL_PARAMS))
        time.sleep(lead)
        began = time.perf_counter()
        accepted = future.cancel()  # type: ignore[no-untyped-call]
        resolved = time.perf_counter() - began
        began = time.perf_counter()
        reply = contender.generate(SHORT_PARAMS)
        trials.append({"accepted": accepted, "cancel_s": resolved,
                       "next_s": time.perf_counter() - began, "new_process": reply.pid != before})
    return {
        "can_cancel": True, "trials": trials,
        "cancel_s": statistics.median(float(t["cancel_s"]) for t in trials),
        "next_s": statistics.median(float(t["next_s"]) for t in trials),
        "reloads": any(t["new_process"] for t in trials),
        "how": "future.cancel() kills the worker; its replacement reloads the model",
    }


def cancel_refused(submit: Callable[[], concurrent.futures.Future[Reply]], lead: float) -> Json:
    """loky and ProcessPoolExecutor: a running task's future refuses to cancel."""
    future = submit()
    time.sleep(lead)
    began = time.perf_counter()
    accepted = future.cancel()
    future.result(timeout=600.0)
    return {
        "can_cancel": False, "accepted": accepted, "ran_on_s": time.perf_counter() - began,
        "how": "future.cancel() returns False once the task runs; it runs to the end",
    }


def cancel_asyncio(harness: Harness, lead: float) -> Json:
    loop, threads = harness.asyncio_parts()
    handler = harness.inprocess_handler()
    finished = threading.Event()

    def generate_then_flag() -> Reply:
        try:
            return generate_with(handler, PROMPT, CANCEL_PARAMS)
        finally:
            finished.set()

    async def cancel_task() -> float:
        task = asyncio.ensure_future(loop.run_in_executor(threads, generate_then_flag))
        await asyncio.sleep(lead)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return time.perf_counter()

    cancelled_at = loop.run_until_complete(cancel_task())
    running_after = not finished.is_set()
    finished.wait(600.0)
    return {
        "can_cancel": False, "thread_running_after_cancel": running_after,
        "ran_on_s": time.perf_counter() - cancelled_at,
        "how": "task.cancel() ends the await; the executor thread generates on to the end",
    }


# ============================================================================================
# (e) throughput.


def measure_throughput(call: Callable[[], Any], requests: int, callers: int) -> Json:
    """``requests`` calls from ``callers`` threads; wall time from first start to last end."""
    tickets = itertools.count()
    latencies: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()

    def caller() -> None:
        while next(tickets) < requests:
            began = time.perf_counter()
            try:
                call()
            except Exception as exc:  # a failed request is a result, not a crash of the run
                with lock:
                    errors.append(repr(exc))
                continue
            with lock:
                latencies.append(time.perf_counter() - began)

    threads = [threading.Thread(target=caller, name=f"bench-caller-{i}") for i in range(callers)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    return {"requests": requests, "callers": callers, "wall_s": wall,
            "requests_per_s": len(latencies) / wall if wall > 0 else None,
            "latencies_s": latencies, "errors": errors}


def scenario_throughput(harness: Harness) -> Json:
    settings = harness.settings
    single = harness.single_worker_contenders()
    params = {"max_new_tokens": 16, "min_new_tokens": 16}
    initargs2 = harness.initargs(2)
    threads = {1: worker_threads(harness.cores, 1), 2: worker_threads(harness.cores, 2)}
    log(f"(e) starting two-worker contenders ({threads[2]} torch threads each)")
    pebble2 = harness.start_pebble(2, initargs2)
    ppe2 = harness.start_ppe(2, initargs2)
    # loky's reusable executor is one per thread and already serves the single-worker
    # runs; its two-worker twin is the same executor class, made directly.
    loky2 = harness.start_loky_private(2, initargs2)
    started = run_concurrently({
        "modelpool": lambda: harness.start_pool(harness.pool_config(2)),
        "pebble": lambda: warm_pids(lambda: pebble2.schedule(task_pid), 2),
        "loky": lambda: warm_pids(lambda: loky2.submit(task_pid), 2),
        "ppe": lambda: warm_pids(lambda: ppe2.submit(task_pid), 2),
    })
    pool2: ModelPool = started["modelpool"]

    def pool2_call() -> Reply:
        result = pool2.generate(PROMPT, **params)
        return Reply(result.worker_pid, result.completion_tokens, result.text)

    calls: dict[tuple[str, int], Callable[[], Any]] = {
        ("modelpool", 1): lambda: single["modelpool"].generate(params),
        ("modelpool", 2): pool2_call,
        ("pebble", 1): lambda: single["pebble"].generate(params),
        ("pebble", 2): lambda: pebble2.schedule(task_generate, args=(PROMPT, params)).result(),
        ("loky", 1): lambda: single["loky"].generate(params),
        ("loky", 2): lambda: loky2.submit(task_generate, PROMPT, params).result(),
        ("ppe", 1): lambda: single["ppe"].generate(params),
        ("ppe", 2): lambda: ppe2.submit(task_generate, PROMPT, params).result(),
    }
    for (_, workers), call in calls.items():
        for _ in range(workers):  # one untimed request per worker
            call()
    measured: dict[tuple[str, int], list[Json]] = {config: [] for config in calls}
    low, high = settings.throughput_rounds
    budget_end = time.monotonic() + settings.throughput_budget_s
    for round_index in range(high):
        if round_index >= low and time.monotonic() > budget_end:
            break
        # Each contender's 1- and 2-worker runs side by side; the order flips every round
        # so that drift on a shared machine does not favour whoever goes first.
        order = list(calls) if round_index % 2 == 0 else list(reversed(calls))
        for config in order:
            log(f"(e) round {round_index + 1}: {config[0]} with {config[1]} worker(s)")
            measured[config].append(measure_throughput(
                calls[config], settings.throughput_requests, settings.callers))
    runs: dict[str, dict[int, Json]] = {}
    for (key, workers), rounds in measured.items():
        runs.setdefault(key, {})[workers] = combine_rounds(rounds, threads[workers])
    result = build_throughput(runs)
    result["max_new_tokens"] = 16
    return result


def combine_rounds(rounds: Sequence[Json], torch_threads: int) -> Json:
    """Throughput over several rounds: all completed requests over all their wall time."""
    wall = sum(float(r["wall_s"]) for r in rounds)
    latencies = [x for r in rounds for x in r["latencies_s"]]
    return {
        "rounds": len(rounds), "requests": sum(int(r["requests"]) for r in rounds),
        "callers": rounds[0]["callers"] if rounds else None, "wall_s": wall,
        "requests_per_s": len(latencies) / wall if wall > 0 else None,
        "round_requests_per_s": [r["requests_per_s"] for r in rounds],
        "latencies_s": latencies, "errors": [e for r in rounds for e in r["errors"]],
        "torch_threads": torch_threads,
    }


# ============================================================================================
# (c) a hung request, then a normal one.


class StatsSampler:
    """Records the pool's worker states every few ms, for the failover timeline."""

    def __init__(self, pool: ModelPool, origin: float, interval: float = 0.02) -> None:
        self._pool = pool
        self._origin = origin
        self._interval = interval
        self._stop = threading.Event()
        self.samples: list[tuple[float, list[tuple[int | None, str]]]] = []
        self._thread = threading.Thread(target=self._run, name="bench-stats", daemon=True)

    def __enter__(self) -> StatsSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(5.0)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            workers = self._pool.stats().to_dict()["workers"]
            self.samples.append((time.perf_counter() - self._origin,
                                 [(w.get("pid"), str(w["state"])) for w in workers]))

    def segments(self, lane_prefix: str) -> list[Json]:
        """Consecutive samples of one worker in one state, merged into timeline segments."""
        open_segments: dict[int | None, Json] = {}
        done: list[Json] = []
        for moment, workers in self.samples:
            present = set()
            for pid, state in workers:
                present.add(pid)
                current = open_segments.get(pid)
                if current is not None and current["kind"] == state:
                    current["end"] = moment
                    continue
                if current is not None:
                    done.append(current)
                open_segments[pid] = {"lane": f"{lane_prefix} worker {pid}", "start": moment,
                                      "end": moment, "kind": state}
            for pid in list(open_segments):
                if pid not in present:
                    done.append(open_segments.pop(pid))
        return done + list(open_segments.values())


def _hang_then_next(
    hang: Callable[[], None], next_call: Callable[[], Reply], baseline: float, timeout_s: float,
    wedge_cap_s: float, origin: float | None = None,
) -> Json:
    """Run the hung request until its timeout error, then a normal one right after it.

    Times are relative to ``origin`` (default: now), the moment the hung request is sent.
    """
    origin = time.perf_counter() if origin is None else origin
    raised = None
    try:
        hang()
    except Exception as exc:  # each contender raises its own TimeoutError flavour
        raised = type(exc).__name__
    errored = time.perf_counter() - origin
    outcome: Json = {"raised": raised, "timeout_error_s": errored, "baseline_next_s": baseline,
                     "timeout_s": timeout_s}
    try:
        reply = next_call()
    except (TimeoutError, concurrent.futures.TimeoutError):
        outcome.update(wedged=True, next_done_after_error_s=None,
                       waited_s=time.perf_counter() - origin - errored, wedge_cap_s=wedge_cap_s)
        return outcome
    done = time.perf_counter() - origin - errored
    outcome.update(wedged=False, next_done_after_error_s=done, failover_overhead_s=done - baseline,
                   next_pid=reply.pid)
    return outcome


def _timeline(lane: str, outcome: Json) -> list[Json]:
    end_hang = float(outcome["timeout_error_s"])
    segments = [{"lane": f"{lane}: request", "start": 0.0, "end": end_hang, "kind": "hung"}]
    if outcome.get("wedged"):
        segments.append({"lane": f"{lane}: request", "start": end_hang,
                         "end": end_hang + float(outcome["waited_s"]), "kind": "wedged"})
    elif outcome.get("next_done_after_error_s") is not None:
        segments.append({"lane": f"{lane}: request", "start": end_hang,
                         "end": end_hang + float(outcome["next_done_after_error_s"]),
                         "kind": "next"})
    restart = outcome.get("restart")
    if restart:
        start = float(restart["at_s"])
        segments.append({"lane": f"{lane}: request", "start": start,
                         "end": start + float(restart["served_after_s"]), "kind": "restart"})
    return segments


def _baseline(call: Callable[[], Any]) -> float:
    """Median of three warm calls: what the request after a hang would cost without one."""
    return statistics.median(_timed(call) for _ in range(3))


def scenario_hung(harness: Harness) -> Json:
    timeout_s = harness.settings.hang_timeout_s
    result: Json = {"timeout_s": timeout_s, "normal_request": "1 new token", "contenders": {},
                    "timeline": []}
    contenders = result["contenders"]
    timeline: list[Json] = result["timeline"]
    for spares, graces in ((1, 0.0), (0, 0.0), (1, None), (0, None)):
        key = f"modelpool s{spares} " + ("graces 0" if graces == 0.0 else "default graces")
        contenders[key] = guarded(functools.partial(hung_modelpool, harness, key, spares, graces))
        timeline.extend(contenders[key].pop("segments", []))
    result["retry_on_spare"] = guarded(functools.partial(retry_on_spare, harness))
    for key, run in (("pebble", hung_pebble), ("loky", hung_loky), ("ppe", hung_ppe),
                     ("asyncio", hung_asyncio)):
        log(f"(c) {key}")
        contenders[key] = guarded(functools.partial(run, harness))
        if "error" not in contenders[key]:
            timeline.extend(_timeline(key, contenders[key]))
    contenders["naive"] = {
        "cannot": True,
        "how": "join(timeout=2) also covers spawn + import + load (see (a)), so every "
               "request would time out; with a longer timeout the next request pays a full "
               "spawn and load, and terminate() does not stop a process that ignores SIGTERM",
    }
    contenders["inprocess"] = {"cannot": True, "how": "a direct call has no timeout at all"}
    return result


def guarded(part: Callable[[], Json]) -> Json:
    """One contender's part of a scenario; its failure is recorded and the others still run."""
    try:
        return part()
    except Exception:
        error = traceback.format_exc()
        log(f"part failed:\n{error}")
        return {"error": error}


def hung_modelpool(harness: Harness, key: str, spares: int, graces: float | None) -> Json:
    """modelpool with the hang backend: DeadlineExceeded, then the next request."""
    from modelpool import DeadlineExceeded, Result

    log(f"(c) {key}")
    timeout_s = harness.settings.hang_timeout_s
    overrides: Json = {} if graces is None else {"cancel_grace_s": graces, "term_grace_s": graces}
    pool = harness.start_pool(harness.pool_config(
        1, spares=spares, backend="benchmarks.bench:hang_backend", **overrides))
    served: list[Result] = []

    def next_request() -> Reply:
        outcome = pool.generate(PROMPT, max_new_tokens=1)
        served.append(outcome)
        return Reply(outcome.worker_pid, outcome.completion_tokens, outcome.text)

    def hang() -> None:
        pool.generate(HANG_PROMPT, deadline_s=timeout_s, max_new_tokens=1)

    baseline = _baseline(next_request)
    before = pool_pids(pool)
    origin = time.perf_counter()
    with StatsSampler(pool, origin) as sampler:
        outcome = _hang_then_next(hang, next_request, baseline, timeout_s,
                                  harness.settings.wedge_cap_s, origin)
        restored = wait_ready(pool, 1 + spares, timeout=120.0)
        restored_at = time.perf_counter() - origin
    if outcome["raised"] != DeadlineExceeded.__name__:
        raise RuntimeError(f"{key}: the hung request ended with {outcome['raised']}")
    last = served[-1]
    outcome.update(
        spares=spares, cancel_grace_s=pool.config.cancel_grace_s,
        term_grace_s=pool.config.term_grace_s,
        # Submitted right at the error, so its queue time is error -> start on a worker.
        next_started_after_error_s=last.queue_s,
        restored_after_error_s=(
            None if restored is None else restored_at - outcome["timeout_error_s"]),
        reloads=last.worker_pid not in before,
        how="DeadlineExceeded at the deadline; the worker is killed and replaced",
    )
    pool.close(drain=False, timeout=10.0)
    outcome["segments"] = _timeline(key, outcome) + sampler.segments(key)
    return outcome


def hung_pebble(harness: Harness) -> Json:
    """pebble: schedule(timeout=) kills the worker; the replacement reloads the model."""
    pool = harness.pebble_pool
    timeout_s = harness.settings.hang_timeout_s
    before = pool.schedule(task_pid).result()

    def next_request() -> Reply:
        return pool.schedule(task_generate, args=(PROMPT, SHORT_PARAMS)).result(
            timeout=600.0)

    def hang() -> None:
        pool.schedule(task_hang, timeout=timeout_s).result()

    outcome = _hang_then_next(hang, next_request, _baseline(next_request), timeout_s,
                              harness.settings.wedge_cap_s)
    outcome.update(reloads=outcome.get("next_pid") != before,
                   how="schedule(timeout=) raises TimeoutError and kills the worker "
                       "(SIGTERM, 3 s, SIGKILL); the new one reloads the model")
    return outcome


def _hung_executor(harness: Harness, executor: Any) -> Json:
    """loky and ProcessPoolExecutor: result(timeout=) only stops the caller waiting."""
    timeout_s = harness.settings.hang_timeout_s
    cap = harness.settings.wedge_cap_s

    def request(timeout: float) -> Reply:
        reply: Reply = executor.submit(task_generate, PROMPT, SHORT_PARAMS).result(
            timeout=timeout)
        return reply

    def hang() -> None:
        executor.submit(task_hang).result(timeout=timeout_s)

    baseline = _baseline(lambda: request(600.0))
    # After the hang, waiting for the next request is capped: it may never be served.
    origin = time.perf_counter()
    outcome = _hang_then_next(hang, lambda: request(cap), baseline, timeout_s, cap, origin)
    outcome["origin"] = origin
    return outcome


def hung_loky(harness: Harness) -> Json:
    initargs = harness.initargs(1)
    executor = harness.start_loky(1, initargs)
    warm_pids(lambda: executor.submit(task_pid), 1)
    outcome = _hung_executor(harness, executor)
    # What a loky user can do: kill the executor's workers and get a fresh executor.
    restart_at = time.perf_counter() - outcome.pop("origin")
    executor.shutdown(wait=True, kill_workers=True)
    began = time.perf_counter()
    harness.start_loky(1, initargs).submit(
        task_generate, PROMPT, SHORT_PARAMS).result(timeout=600.0)
    outcome.update(
        restart={"at_s": restart_at, "served_after_s": time.perf_counter() - began},
        reloads=True,
        how="result(timeout=) raises, the task runs on and the next request waits behind "
            "it; shutdown(kill_workers=True) and a new executor recover, reloading the model",
    )
    return outcome


def hung_ppe(harness: Harness) -> Json:
    executor = harness.ppe
    outcome = _hung_executor(harness, executor)
    del outcome["origin"]
    workers = ppe_pids(executor)
    executor.shutdown(wait=False, cancel_futures=True)
    time.sleep(0.5)
    alive = [pid for pid in workers if Path(f"/proc/{pid}").exists()]
    # Only the harness can end it: by pid, as nothing in the executor's API will.
    for pid in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    outcome.update(
        worker_alive_after_shutdown=bool(alive),
        reloads=None,
        how="result(timeout=) raises, the task runs on, the next request waits behind it, "
            "and no API stops the worker (shutdown(cancel_futures=True) leaves it running)",
    )
    return outcome


def retry_on_spare(harness: Harness) -> Json:
    """Issue 2: attempt deadline -> retry on a spare (testing backend, both graces 0)."""
    from modelpool import PoolConfig, RetryPolicy

    settings = harness.settings
    attempt = settings.retry_attempt_timeout_s
    pool = harness.start_pool(PoolConfig(
        model="none", backend="testing", workers=1, spares=1, devices=("cpu",),
        attempt_timeout_s=attempt, deadline_s=30.0, cancel_grace_s=0.0, term_grace_s=0.0,
        retry=RetryPolicy(max_retries=1)))
    lateness: list[float] = []
    attempts: list[int] = []
    with tempfile.TemporaryDirectory(prefix="modelpool-bench-") as scratch:
        for index in range(settings.retry_reps):
            if wait_ready(pool, 2, timeout=30.0) is None:
                raise RuntimeError("the testing pool did not get its spare back within 30 s")
            outcome = pool.generate(f"hang_once:{scratch}/{index}")
            # latency minus the attempt timeout: the deadline firing, the retry's dispatch
            # to the spare, its "ok" and the reply; an upper bound of deadline -> retry start.
            lateness.append(outcome.latency_s - attempt)
            attempts.append(outcome.attempts)
    pool.close(drain=False, timeout=10.0)
    return {"attempt_timeout_s": attempt, "samples_s": lateness, "attempts": attempts,
            "summary": summarize(lateness)}


def hung_asyncio(harness: Harness) -> Json:
    """asyncio.wait_for over run_in_executor: the timeout fires, the work does not stop."""
    import psutil

    timeout_s = harness.settings.hang_timeout_s
    loop, threads = harness.asyncio_parts()
    handler = harness.inprocess_handler()
    stop = threading.Event()
    finished = threading.Event()
    runaway_params = {"max_new_tokens": RUNAWAY_TOKENS, "min_new_tokens": RUNAWAY_TOKENS}

    def runaway() -> None:
        try:
            handler.generate(BenchCall(PROMPT, runaway_params, stop=stop))
        finally:
            finished.set()

    def short() -> Reply:
        work = functools.partial(generate_with, handler, PROMPT, SHORT_PARAMS)
        return loop.run_until_complete(asyncio.wait_for(loop.run_in_executor(threads, work), 600))

    baseline = _baseline(short)
    process = psutil.Process()
    try:
        origin = time.perf_counter()
        raised = None
        try:
            loop.run_until_complete(
                asyncio.wait_for(loop.run_in_executor(threads, runaway), timeout_s))
        except TimeoutError as exc:
            raised = type(exc).__name__
        errored = time.perf_counter() - origin
        # The next request goes to another executor thread at once, beside the runaway.
        began = time.perf_counter()
        short()
        next_done = time.perf_counter() - began
        # Then, with nothing else asked of this process, what is still running.
        cpu_before = process.cpu_times()
        time.sleep(harness.settings.cpu_sample_s)
        cpu_after = process.cpu_times()
        running = not finished.is_set()
        busy = ((cpu_after.user + cpu_after.system) - (cpu_before.user + cpu_before.system)
                ) / harness.settings.cpu_sample_s
    finally:
        stop.set()
        finished.wait(60.0)
    return {
        "raised": raised, "timeout_error_s": errored, "baseline_next_s": baseline,
        "thread_running_after_timeout": running, "cpu_cores_busy_after_timeout": busy,
        "cpu_sample_s": harness.settings.cpu_sample_s, "wedged": False,
        "next_done_after_error_s": next_done, "failover_overhead_s": next_done - baseline,
        "reloads": False,
        "how": "wait_for raises TimeoutError; the executor thread keeps generating and "
               "burning CPU; the next request shares the cores with it",
    }


def _timed(call: Callable[[], Any]) -> float:
    began = time.perf_counter()
    call()
    return time.perf_counter() - began


# ============================================================================================
# (f) memory: each contender in a process of its own, so its supervisor is measured alone.

_PROBE_CODE = (
    "import json, sys; from benchmarks.bench import memory_probe; "
    "print(json.dumps(memory_probe(sys.argv[1], sys.argv[2], sys.argv[3])))"
)
PROBES = ("inprocess", "naive", "pebble", "loky", "ppe", "modelpool", "modelpool+spare")


def memory_probe(kind: str, model_dir: str, dtype: str) -> Json:
    """Serve one 16-token request with contender ``kind``; report peak RSS of every process.

    Runs in a fresh interpreter (see ``scenario_memory``): the calling process is
    the contender's supervisor, and its ``VmHWM`` is the supervisor's peak.
    """
    settings = Settings.for_run(quick=True, out=Path("."), scenarios="f", dtype=dtype,
                                model=model_dir, dispatch_calls=None)
    options = settings.backend_options
    params = {"max_new_tokens": 16, "min_new_tokens": 16}
    workers: list[int] = []
    helpers: dict[int, float | None] = {}
    worker_peaks: list[float | None] = []

    def record(worker_pids: list[int]) -> None:
        workers.extend(worker_pids)
        worker_peaks.extend(peak_rss_mb(pid) for pid in worker_pids)
        for pid in children_pids() - set(worker_pids):
            helpers[pid] = peak_rss_mb(pid)

    with contextlib.ExitStack() as stack:
        harness = Harness(settings, stack, model_dir)
        initargs = harness.initargs(1)
        if kind == "inprocess":
            handler = hf.load_generation(model_dir, "cpu", torch_threads=harness.cores, **options)
            generate_with(handler, PROMPT, params)
        elif kind == "naive":
            ctx = spawn_context()
            out: Queue[Json] = ctx.Queue()
            process = ctx.Process(target=naive_child,
                                  args=(out, *initargs, PROMPT, params))
            process.start()
            reply = out.get(timeout=600.0)
            process.join(30.0)
            worker_peaks.append(reply["peak_rss_mb"])
        elif kind == "pebble":
            pool = harness.start_pebble(1, initargs)
            pool.schedule(task_generate, args=(PROMPT, params)).result()
            record([pool.schedule(task_pid).result()])
        elif kind == "loky":
            executor = harness.start_loky(1, initargs)
            executor.submit(task_generate, PROMPT, params).result()
            record([executor.submit(task_pid).result()])
        elif kind == "ppe":
            ppe = harness.start_ppe(1, initargs)
            ppe.submit(task_generate, PROMPT, params).result()
            record(ppe_pids(ppe))
        elif kind in ("modelpool", "modelpool+spare"):
            pool_ = harness.start_pool(
                harness.pool_config(1, spares=1 if kind == "modelpool+spare" else 0))
            pool_.generate(PROMPT, **params)
            record(pool_pids(pool_))
        else:
            raise ValueError(f"unknown memory probe {kind!r}")
    return {"kind": kind, "supervisor_mb": peak_rss_mb(os.getpid()), "worker_pids": workers,
            "workers_mb": worker_peaks, "helpers_mb": list(helpers.values())}


def scenario_memory(harness: Harness) -> Json:
    env = dict(os.environ)
    source_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [source_root, env.get("PYTHONPATH")]))
    log(f"(f) {len(PROBES)} memory probes, side by side")
    probes: dict[str, subprocess.Popen[str]] = {}
    try:
        for kind in PROBES:
            probes[kind] = subprocess.Popen(
                [sys.executable, "-c", _PROBE_CODE, kind, harness.model_dir,
                 harness.settings.dtype],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        results: Json = {}
        for kind, probe in probes.items():
            try:
                stdout, stderr = probe.communicate(timeout=300.0)
            except subprocess.TimeoutExpired:
                probe.kill()
                stdout, stderr = probe.communicate()
            lines = stdout.strip().splitlines()
            if probe.returncode != 0 or not lines:
                results[kind] = {"error": "\n".join(stderr.strip().splitlines()[-5:])}
                continue
            entry = json.loads(lines[-1])
            entry["label"] = LABELS.get(kind.split("+")[0], kind)
            total = (entry["supervisor_mb"] or 0) + sum(x or 0 for x in entry["workers_mb"])
            entry["total_mb"] = total + sum(x or 0 for x in entry["helpers_mb"])
            results[kind] = entry
    finally:
        for probe in probes.values():
            if probe.poll() is None:
                probe.kill()
                probe.wait()
    return {"contenders": results,
            "note": "VmHWM (kernel peak RSS) per process; each contender in its own supervisor "
                    "process serving one 16-token request; helpers are other children "
                    "(e.g. resource trackers)"}


# ============================================================================================
# Report: markdown, plot, JSON.


def render_markdown(report: Json) -> str:
    machine = report.get("machine", {})
    versions = machine.get("versions", {})
    git = machine.get("git", {})
    commit = git.get("commit", "uncommitted")
    if commit != "uncommitted" and git.get("dirty"):
        commit = f"{commit[:12]} + uncommitted changes"
    elif commit != "uncommitted":
        commit = commit[:12]
    loads = report.get("load_average", {})
    shared = report.get("shared_machine")
    others = report.get("other_processes_cores")
    parts = [
        "# modelpool benchmarks",
        "",
        f"Machine: {machine.get('cpu')}, {machine.get('cores')} cores, Python "
        f"{machine.get('python')}, torch {versions.get('torch')}, transformers "
        f"{versions.get('transformers')}, pebble {versions.get('pebble')}, loky "
        f"{versions.get('loky')}; commit {commit}.",
        f"Load average at start {loads.get('start')}, at end {loads.get('end')}"
        + ("" if others is None else
           f"; other processes used {others:.2f} cores on average during the run")
        + (" (shared machine: other work ran alongside, absolute times are noisy, read the "
           "ratios)." if shared else "."),
        "",
        f"Command: `{report.get('command')}` ({report.get('wall_s', 0):.0f} s). Model: "
        f"{report.get('settings', {}).get('model')} ({report.get('settings', {}).get('dtype')}), "
        "chat template, greedy. Torch threads per worker = cores // workers, as the pool "
        "sets them, for every contender. Ratios: contender ÷ modelpool (above 1: modelpool "
        "is faster).",
    ]
    scenarios = report.get("scenarios", {})
    for letter, renderer in (("a", _md_latency), ("b", _md_dispatch), ("c", _md_hung),
                             ("d", _md_cancel), ("e", _md_throughput), ("f", _md_memory),
                             ("g", _md_batching)):
        data = scenarios.get(letter)
        if data is None:
            continue
        parts.append("")
        if "error" in data:
            parts.append(f"## ({letter}) failed\n\n```\n{data['error']}\n```")
            continue
        parts.append(renderer(data))
    targets = report.get("targets") or []
    if targets:
        rows = [[t["name"], t["target"], t["measured"],
                 {True: "met", False: "missed", None: "not measured"}[t["met"]]]
                for t in targets]
        parts += ["", "## Targets", "", markdown_table(["target", "goal", "measured", ""], rows)]
    return "\n".join(parts) + "\n"


def _last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else ""


def _md_latency(data: Json) -> str:
    parts = ["## (a) Per-request latency"]
    for tokens, block in data["by_tokens"].items():
        rows = []
        for entry in block["contenders"].values():
            summary = entry["summary"]
            same = entry.get("same_text_as_inprocess")
            rows.append([
                entry["label"], f"{entry.get('workers', '-')} x {entry.get('torch_threads', '-')}",
                str(summary["n"]), fmt_seconds(summary.get("p50")),
                fmt_seconds(summary.get("p90")), fmt_ratio(entry.get("p50_vs_modelpool")),
                "-" if same is None else ("yes" if same else "NO"),
            ])
        parts += ["", f"### {tokens} new tokens", "", markdown_table(
            ["contender", "workers x threads", "n", "p50", "p90", "p50 ÷ modelpool",
             "same text"], rows)]
        parts.append("")
        parts.append(f"modelpool ÷ in-process (ratio of medians): "
                     f"{fmt_ratio(block.get('modelpool_vs_inprocess'))}; naive ÷ modelpool: "
                     f"{fmt_ratio(block.get('naive_vs_modelpool'))}.")
        phases = block.get("naive_phases")
        if phases:
            medians = phases["median_s"]
            parts += ["", markdown_table(
                ["naive phase", "spawn", "import", "load", "generate", "return", "exit", "total",
                 "limit (total ÷ generate)"],
                [["median", *(fmt_seconds(medians[k]) for k in
                              ("spawn", "import", "load", "generate", "return", "exit", "total")),
                  fmt_ratio(phases.get("limit"))]])]
            seven = phases["seven_b"]
            lines = [
                f"{p['device']}: {fmt_ratio(p['limit_low'])}-{fmt_ratio(p['limit_high'])} "
                f"(generate ≈ {fmt_seconds(p['generate_s'])})" for p in seven["projections"]]
            parts += ["", "For a 7B model the naive limit is (spawn + import + load + generate) "
                      f"÷ generate with load {seven['load_s'][0]:.0f}-{seven['load_s'][1]:.0f} s "
                      "from local NVMe (assumed: ~14 GB fp16 plus init), spawn + import "
                      f"{fmt_seconds(seven['spawn_import_s'])} (measured here), and "
                      f"{SEVEN_B_GPU_STEP_S * 1e3:.0f} ms/token on a GPU or "
                      f"{SEVEN_B_CPU_STEP_S * 1e3:.0f} ms/token on a server CPU (assumed): "
                      + "; ".join(lines) + "."]
    return "\n".join(parts)


def _md_dispatch(data: Json) -> str:
    rows = []
    for entry in data["contenders"].values():
        summary = entry["summary"]
        rows.append([entry["label"], str(summary["n"]), fmt_seconds(summary.get("p50")),
                     fmt_seconds(summary.get("p99")), fmt_ratio(entry.get("p50_vs_modelpool")),
                     fmt_ratio(entry.get("p99_vs_modelpool"))])
    return "\n".join([
        "## (b) Dispatch round trip (each contender's no-op; modelpool: testing echo)", "",
        f"Interleaved in blocks of {data['block']} calls, one worker each.", "",
        markdown_table(["contender", "n", "p50", "p99", "p50 ÷ modelpool", "p99 ÷ modelpool"],
                       rows)])


HUNG_REFERENCE = "modelpool s1 default graces"


def _md_hung(data: Json) -> str:
    rows = []
    reference = _get(data, "contenders", HUNG_REFERENCE, "next_done_after_error_s")
    for key, entry in data["contenders"].items():
        label = key if key.startswith("modelpool") else LABELS.get(key, key)
        if "error" in entry:
            rows.append([label, "error", "-", "-", "-", "-", _last_line(entry["error"])])
            continue
        if entry.get("cannot"):
            rows.append([label, "cannot", "cannot", "-", "-", "-", entry["how"]])
            continue
        versus = fmt_ratio(ratio(entry.get("next_done_after_error_s"), reference))
        if entry.get("wedged"):
            capped = ratio(entry["wedge_cap_s"], reference)
            versus = "-" if capped is None else f"> {fmt_ratio(capped)}"
            next_cell = f"wedged (not served in {fmt_seconds(entry['wedge_cap_s'])})"
            restart = entry.get("restart")
            if restart:
                next_cell += (f"; after shutdown(kill_workers) + new executor: "
                              f"{fmt_seconds(restart['served_after_s'])}")
        else:
            next_cell = fmt_seconds(entry.get("next_done_after_error_s"))
            started = entry.get("next_started_after_error_s")
            if started is not None:
                next_cell += f" (started after {fmt_seconds(started)})"
        reloads = entry.get("reloads")
        notes = entry["how"]
        if "thread_running_after_timeout" in entry:
            notes += (f"; after the timeout: thread still running = "
                      f"{entry['thread_running_after_timeout']}, CPU "
                      f"{entry['cpu_cores_busy_after_timeout'] * 100:.0f}% of a core")
        if entry.get("worker_alive_after_shutdown") is not None:
            notes += f"; worker alive after shutdown: {entry['worker_alive_after_shutdown']}"
        restored = entry.get("restored_after_error_s")
        if restored is not None:
            notes += f"; all workers ready {fmt_seconds(restored)} after the error"
        rows.append([label, fmt_seconds(entry.get("timeout_error_s")), next_cell, versus,
                     fmt_seconds(entry.get("baseline_next_s")),
                     "-" if reloads is None else ("yes" if reloads else "no"), notes])
    parts = [
        f"## (c) A hung request (ignores SIGTERM) with a {data['timeout_s']:.0f} s timeout, "
        f"then a normal one ({data['normal_request']})", "",
        "Ratios: the next request's time after the error ÷ the same for modelpool with a spare "
        "and default graces.", "",
        markdown_table(["contender", "timeout error after", "next request done after the error",
                        "÷ modelpool", "next request when warm", "reloads model", "notes"],
                       rows)]
    retry = data.get("retry_on_spare")
    if retry and "error" in retry:
        parts += ["", f"modelpool retry on a spare: error: {_last_line(retry['error'])}"]
    elif retry:
        summary = retry["summary"]
        parts += ["", f"modelpool, attempt deadline → retry on a spare (testing backend, "
                  f"graces 0, attempt timeout {retry['attempt_timeout_s']} s, n = "
                  f"{summary['n']}): p50 {fmt_seconds(summary.get('p50'))}, max "
                  f"{fmt_seconds(summary.get('max'))} (latency minus the attempt timeout: an "
                  "upper bound that includes the retry's own run and reply)."]
    return "\n".join(parts)


def _md_cancel(data: Json) -> str:
    rows = []
    step = data["step_s"]
    reference = _get(data, "contenders", REFERENCE, "next_s")
    for key, entry in data["contenders"].items():
        label = LABELS.get(key, key)
        can = entry.get("can_cancel")
        if "error" in entry:
            rows.append([label, "error", "-", "-", "-", "-", _last_line(entry["error"])])
        elif can:
            cancel = entry["cancel_s"]
            rows.append([label, "yes", fmt_seconds(cancel), f"{cancel / step:.1f}",
                         fmt_seconds(entry.get("next_s")),
                         fmt_ratio(ratio(entry.get("next_s"), reference)), entry["how"]])
        elif can is None:
            rows.append([label, "kill only", "-", "-", "-", "-", entry["how"]])
        else:
            ran = entry.get("ran_on_s")
            how = entry["how"] + (f" ({fmt_seconds(ran)} more)" if ran is not None else "")
            rows.append([label, "cannot", "-", "-", "-", "-", how])
    return "\n".join([
        "## (d) Cancel a running 64-token generation", "",
        f"One decoding step here: {fmt_seconds(step)} (median gap between streamed chunks "
        f"on the modelpool worker, same run); cancel sent {fmt_seconds(data['cancel_after_s'])} "
        "after submit.", "",
        markdown_table(["contender", "can cancel", "cancel → resolved", "in steps",
                        "next 1-token request served after", "÷ modelpool", "how"], rows)])


def _md_throughput(data: Json) -> str:
    rows = []
    for entry in data["contenders"].values():
        runs = entry["runs"]

        def cell(workers: str, runs: Json = runs) -> str:
            run = runs.get(workers)
            if run is None:
                return "-"
            rps = run.get("requests_per_s")
            failed = f", {len(run['errors'])} failed" if run.get("errors") else ""
            return f"{rps:.2f}{failed}" if rps is not None else "-"

        rows.append([entry["label"], cell("1"), cell("2"), fmt_ratio(entry.get("two_vs_one")),
                     fmt_ratio(_get(runs, "1", "vs_modelpool")),
                     fmt_ratio(_get(runs, "2", "vs_modelpool"))])
    sample = next(iter(data["contenders"].values()))["runs"]
    one = next(iter(sample.values()))
    rounds = one.get("rounds", 1)
    return "\n".join([
        f"## (e) Throughput: {one['callers']} concurrent callers, {one['requests']} requests of "
        f"{data.get('max_new_tokens', 16)} new tokens", "",
        f"Requests/s over {rounds} interleaved round(s) (every configuration in turn, the order "
        "reversed each round); one worker has as many torch threads as cores, two workers "
        "half as many each.", "",
        markdown_table(["contender", "1 worker", "2 workers", "2 ÷ 1", "1w ÷ modelpool",
                        "2w ÷ modelpool"], rows)])


def _md_memory(data: Json) -> str:
    rows = []
    reference = _get(data, "contenders", REFERENCE, "total_mb")
    for kind, entry in data["contenders"].items():
        if "error" in entry:
            rows.append([kind, "error", "-", "-", "-", _last_line(entry["error"])])
            continue
        label = entry["label"] + (" (w1 + 1 spare)" if kind.endswith("+spare") else "")
        workers = ", ".join(fmt_mb(x) for x in entry["workers_mb"]) or "- (in the supervisor)"
        helpers = ", ".join(fmt_mb(x) for x in entry["helpers_mb"]) or "-"
        rows.append([label, fmt_mb(entry["supervisor_mb"]), workers, helpers,
                     fmt_mb(entry["total_mb"]), fmt_ratio(ratio(entry["total_mb"], reference))])
    return "\n".join(["## (f) Peak memory (RSS high-water mark)", "", data["note"] + ".", "",
                      markdown_table(["contender", "supervisor", "workers", "helpers", "total",
                                      "total ÷ modelpool"], rows)])


_COLORS = {"hung": "#d62728", "wedged": "#7f7f7f", "next": "#2ca02c", "restart": "#ff7f0e",
           "starting": "#c7c7c7", "idle": "#98df8a", "spare": "#aec7e8", "busy": "#ffbb78",
           "cancelling": "#ff9896", "killing": "#d62728", "stopping": "#c49c94"}


def render_plot(report: Json, path: Path) -> bool:
    """Latency distributions per contender and the failover timelines; False if no data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = report.get("scenarios", {})
    panels: list[tuple[str, Json]] = []
    for tokens, block in (_get(scenarios, "a", "by_tokens") or {}).items():
        panels.append((f"(a) latency, {tokens} new tokens (s, log)", block["contenders"]))
    dispatch = _get(scenarios, "b", "contenders")
    if dispatch:
        panels.append(("(b) dispatch round trip (s, log)", dispatch))
    timeline = _get(scenarios, "c", "timeline") or []
    if not panels and not timeline:
        return False
    lanes = list(dict.fromkeys(segment["lane"] for segment in timeline))
    heights = [3.0] * len(panels) + ([max(3.0, 0.28 * len(lanes))] if lanes else [])
    figure, axes = plt.subplots(len(heights), 1, figsize=(11, sum(heights) + 1.0),
                                gridspec_kw={"height_ratios": heights}, squeeze=False)
    for axis, (title, contenders) in zip(axes[:, 0], panels, strict=False):
        names = [entry["label"] for entry in contenders.values()]
        # Every sample as a dot (spread vertically by its rank so dense runs stay visible),
        # and the median as a bar: small samples read better so than as box plots.
        for row, entry in enumerate(contenders.values()):
            values = sorted(entry["samples_s"])
            if not values:
                continue
            spread = [row + 0.3 * (i / max(1, len(values) - 1) - 0.5) for i in range(len(values))]
            axis.scatter(values, spread, s=6, alpha=0.5)
            axis.plot([statistics.median(values)] * 2, [row - 0.3, row + 0.3], color="black")
        axis.set_yticks(range(len(names)), names, fontsize=8)
        axis.set_title(title, fontsize=10)
        axis.set_xscale("log")
    if lanes:
        axis = axes[-1, 0]
        for segment in timeline:
            row = lanes.index(segment["lane"])
            width = max(segment["end"] - segment["start"], 0.02)
            axis.barh(row, width, left=segment["start"], height=0.6,
                      color=_COLORS.get(segment["kind"], "#17becf"))
        axis.set_yticks(range(len(lanes)), lanes, fontsize=7)
        axis.invert_yaxis()
        axis.set_xlabel("seconds since the hung request was sent")
        axis.set_title("(c) failover timelines: request (red hung, green next, grey wedged, "
                       "orange restart); modelpool workers by state", fontsize=10)
        handles = [matplotlib.patches.Patch(color=color, label=kind)
                   for kind, color in _COLORS.items()]
        axis.legend(handles=handles, fontsize=6, loc="lower right", ncol=4)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def write_json(path: Path, report: Json) -> None:
    path.write_text(json.dumps(report, indent=1, default=_json_default) + "\n")


def write_markdown(path: Path, report: Json) -> str:
    text = render_markdown(report)
    path.write_text(text)
    return text


def _json_default(value: object) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, Reply):
        return {"pid": value.pid, "tokens": value.tokens, "text": value.text}
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


# ============================================================================================
# Entry point.

def scenario_batching(harness: Harness) -> Json:
    """(g) max_batch_size 1 against 8, in-process and through HTTP beside ``transformers
    serve --continuous-batching``: see benchmarks/batching.py."""
    from benchmarks import batching

    quick = harness.settings.quick
    return batching.run(
        harness.model_dir,
        concurrencies=(1, 4, 8) if quick else (1, 2, 4, 8, 16),
        new_tokens=16 if quick else 64,
        requests_per_client=1 if quick else 2,
        dtype=harness.settings.backend_options.get("dtype"),
        ceiling=True,
        http=not quick,
        log=log,
    )


_RUNNERS: dict[str, Callable[[Harness], Json]] = {
    "b": scenario_dispatch,
    "a": scenario_latency,
    "d": scenario_cancel,
    "e": scenario_throughput,
    # Last among the live ones: it kills, wedges and restarts contenders.
    "c": scenario_hung,
    "f": scenario_memory,
    "g": scenario_batching,
}


def _md_batching(data: Json) -> str:
    from benchmarks import batching

    return batching.markdown(data)


def _has_error(data: object) -> bool:
    if isinstance(data, dict):
        return "error" in data or any(_has_error(value) for value in data.values())
    return False


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="scripts/bench",
        description="Benchmark modelpool against in-process, naive spawn, asyncio, pebble, "
                    "loky and ProcessPoolExecutor; writes bench.json, bench.md, bench.png.")
    parser.add_argument("--quick", action="store_true", help="fewer samples; under 5 minutes")
    parser.add_argument("--out", type=Path, default=Path("bench-out"),
                        help="output directory (default: bench-out)")
    parser.add_argument("--scenarios", default=SCENARIOS,
                        help="which scenarios to run, as letters (default: abcdefg)")
    parser.add_argument("--dispatch-calls", type=int, default=None,
                        help="calls per contender in (b) (default 2000)")
    parser.add_argument("--model", default="embedded:smollm2-135m-instruct",
                        help="model for (a) and (c)-(f): embedded:NAME or a local directory")
    # float32, as configs/default.toml: the checkpoint's bfloat16 decodes several times
    # slower on this kind of CPU. Every contender gets the same.
    parser.add_argument("--dtype", default="float32",
                        help="torch dtype for every contender, or 'checkpoint' (default float32)")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.scenarios) - set(SCENARIOS))
    if unknown or not args.scenarios:
        parser.error(f"--scenarios takes letters from {SCENARIOS!r}, got {args.scenarios!r}")
    if args.dispatch_calls is not None and args.dispatch_calls < 1:
        parser.error("--dispatch-calls must be at least 1")
    return args


@contextlib.contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C, so every contender is still cleaned up."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handle(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handle)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    settings = Settings.for_run(quick=args.quick, out=args.out, scenarios=args.scenarios,
                                dtype=args.dtype, model=args.model,
                                dispatch_calls=args.dispatch_calls)
    # The pool keeps an inherited thread count; drop any so that it computes cores // workers
    # exactly as the other contenders are told to.
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", THREADS_ENV):
        os.environ.pop(name, None)
    # Contenders take turns while all stay loaded: an idle OpenMP team that spins after its
    # turn (the default wait policy) would steal cores from whichever contender runs next.
    # Every process here, in-process contenders included, inherits this before torch loads.
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    settings.out.mkdir(parents=True, exist_ok=True)
    command = " ".join(["scripts/bench", *(sys.argv[1:] if argv is None else argv)])
    report: Json = {
        "version": 1, "command": command,
        "started_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(), "load_average": {"start": load_average()},
        "settings": {"quick": settings.quick, "scenarios": settings.scenarios,
                     "model": settings.model, "dtype": settings.dtype,
                     "dispatch_calls": settings.dispatch_calls,
                     "latency_rounds": {str(k): v for k, v in settings.latency_rounds.items()},
                     "throughput_requests": settings.throughput_requests,
                     "callers": settings.callers, "hang_timeout_s": settings.hang_timeout_s},
        "scenarios": {},
    }
    started = time.perf_counter()
    machine_busy, own_busy = machine_busy_seconds(), own_busy_seconds()
    failed = False
    with _sigterm_as_exit():
        try:
            with contextlib.ExitStack() as stack:
                harness = Harness(settings, stack)
                for letter, runner in _RUNNERS.items():
                    if letter not in settings.scenarios:
                        continue
                    log(f"scenario ({letter})")
                    began = time.perf_counter()
                    try:
                        data = runner(harness)
                    except Exception:
                        failed = True
                        data = {"error": traceback.format_exc()}
                        log(f"scenario ({letter}) failed:\n{data['error']}")
                    data["wall_s"] = time.perf_counter() - began
                    report["scenarios"][letter] = data
                    # A contender's part may fail while the scenario carries on; still a failure.
                    failed = failed or _has_error(data)
        finally:
            leftovers = kill_leftover_children()
            if leftovers:
                log(f"killed leftover child processes: {leftovers}")
            report["leftover_children"] = leftovers
    report["wall_s"] = time.perf_counter() - started
    report["load_average"]["end"] = load_average()
    # Every child is reaped by now, so what the machine used beyond this process tree is
    # other people's work: how much of the machine the benchmark did not have.
    machine_after = machine_busy_seconds()
    others = None
    if machine_busy is not None and machine_after is not None:
        others = max(0.0, (machine_after - machine_busy) - (own_busy_seconds() - own_busy))
        others /= report["wall_s"]
    report["other_processes_cores"] = others
    report["shared_machine"] = (report["load_average"]["start"][:1] or [0.0])[0] > 1.5 or (
        others is not None and others > 0.25)
    report["scenarios"] = {k: report["scenarios"][k] for k in SCENARIOS
                           if k in report["scenarios"]}
    report["targets"] = evaluate_targets(report["scenarios"])
    write_json(settings.out / "bench.json", report)
    text = write_markdown(settings.out / "bench.md", report)
    if render_plot(report, settings.out / "bench.png"):
        log(f"wrote {settings.out / 'bench.png'}")
    print(text)
    log(f"wrote {settings.out / 'bench.json'} and bench.md in {report['wall_s']:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    # Run through the package's name, so that the functions handed to other processes
    # pickle as benchmarks.bench.* rather than __main__.*.
    from benchmarks import bench as _bench

    raise SystemExit(_bench.main())
