"""Many models in one registry: what a swap costs, and chaos on the registry.

    python -m benchmarks.models bench --seconds 60 --clients 6            # testing backend
    python -m benchmarks.models bench --kind real --seconds 120 --clients 4
    python -m benchmarks.models chaos --seconds 60 --seed 1

``bench``: three models, a budget that fits two (measured: each model is loaded alone
once and its RSS read, then the budget is the two largest together plus 10%), clients
sending a seeded random mix across the three for a bounded time. It reports swaps,
the time from a request for an unloaded model to its first token (and the load alone),
the p50/p99 latency of requests to loaded models while a swap runs against while none
does, the peak RSS of every worker (sampled here, independently of the registry, every
50 ms; a worker between fork and exec is not counted: it is this process, shared)
against the budget, and requests lost (any error). ``--kind testing``: three
testing-backend models whose load takes ``--load-s`` (a fast, deterministic stand-in);
``--kind real``: the embedded SmolLM2 on ``hf``, the same GGUF on ``llama_cpp`` and a
tiny random model on ``hf``.

``chaos``: three healthy models in a budget that fits two, one whose load always fails,
one whose load hangs (``load_timeout_s`` 2 s); clients send a random mix while an agent
SIGKILLs random worker processes (during loads, unloads and requests alike). Violations:
a request still unresolved past its deadline plus a grace, an error that is not a
``PoolError``, a failed model's error taking longer than a second while it backs off,
a model left ``loading`` past its load deadline, a healthy model that does not serve
once the agent stops, the measured peak above the budget, a process left after close.
One summary line each; ``--report FILE`` writes the raw figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import psutil

from modelpool import PoolConfig, PoolError
from modelpool.shared.config import ModelSpec
from modelpool.shared.errors import DeadlineExceeded, ModelUnavailable, WorkerCrashed
from modelpool.supervisor.registry import ModelRegistry, RegistryConfig
from modelpool.supervisor.stats import percentiles

_ME = psutil.Process()
_ME_CMDLINE = _ME.cmdline()


def tree_rss() -> int:
    """RSS of every descendant of this process (the workers), as psutil reads it.

    A child still running this program's command line is a worker between fork and exec
    (``subprocess.Popen``): its RSS is this process's pages, shared copy-on-write, for a
    moment. Counting it would add this process's size to the workers' once per spawn."""
    total = 0
    for child in _ME.children(recursive=True):
        try:
            if child.cmdline() == _ME_CMDLINE:
                continue
            total += child.memory_info().rss
        except psutil.Error:
            pass
    return total


class Sampler(threading.Thread):
    """Samples ``tree_rss`` and the registry's swap activity every ``interval_s``."""

    def __init__(self, registry: ModelRegistry, interval_s: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.registry = registry
        self.interval_s = interval_s
        self.peak_rss = 0
        self.swapping: list[tuple[float, float]] = []  # intervals with a load or unload
        # Samples with two or more loads whose workers were up at once (loads in parallel).
        self.parallel_loads = 0
        self.stop = threading.Event()

    def run(self) -> None:
        since: float | None = None
        while not self.stop.wait(self.interval_s):
            self.peak_rss = max(self.peak_rss, tree_rss())
            models = self.registry.stats(with_pools=False).models.values()
            states = {m.state for m in models}
            # A loading model holds memory only once its load's workers are up and measured.
            running = [m for m in models if m.state == "loading" and m.rss_bytes]
            self.parallel_loads += len(running) >= 2
            busy = bool(states & {"loading", "unloading"})
            now = time.monotonic()
            if busy and since is None:
                since = now
            elif not busy and since is not None:
                self.swapping.append((since, now))
                since = None
        if since is not None:
            self.swapping.append((since, time.monotonic()))

    def during_swap(self, start: float, end: float) -> bool:
        return any(s < end and start < e for s, e in self.swapping)


def _specs(kind: str, load_s: float) -> tuple[list[ModelSpec], str, dict[str, Any]]:
    """Three models, the prompt for each, and the generation keywords."""
    if kind == "testing":
        specs = [
            ModelSpec(
                name,
                PoolConfig(
                    model=name,
                    backend="testing",
                    workers=1,
                    devices=("cpu",),
                    backend_options={"load_delay_s": load_s},
                ),
            )
            for name in ("alpha", "beta", "gamma")
        ]
        return specs, "tokens:8:0.01", {}
    from modelpool.tinymodel import build_tiny_model

    tiny = build_tiny_model(os.path.join(os.environ.get("TMPDIR", "/tmp"), "modelpool-tiny"))
    common = {"workers": 1, "devices": ("cpu",), "deadline_s": 120.0}
    specs = [
        ModelSpec(
            "smollm2-hf",
            PoolConfig(
                model="embedded:smollm2-135m-instruct",
                backend="hf",
                backend_options={"dtype": "float32"},
                **common,  # type: ignore[arg-type]
            ),
        ),
        ModelSpec(
            "smollm2-gguf",
            PoolConfig(model="embedded:smollm2-135m-instruct", backend="llama_cpp", **common),  # type: ignore[arg-type]
        ),
        ModelSpec("tiny-hf", PoolConfig(model=str(tiny), backend="hf", **common)),  # type: ignore[arg-type]
    ]
    return specs, "The capital of France is", {"max_new_tokens": 16, "temperature": 0.0}


def _measure_needs(specs: list[ModelSpec]) -> dict[str, int]:
    """Each model loaded alone once: the RSS the registry measured for it."""
    registry = ModelRegistry(RegistryConfig(models=tuple(specs))).start()
    needs: dict[str, int] = {}
    try:
        for spec in specs:
            registry.acquire(spec.name, deadline_s=600).release()
            needs[spec.name] = registry.model_stats(spec.name).need_bytes or 0
            registry.unload(spec.name)
            deadline = time.monotonic() + 60
            while registry.model_stats(spec.name).state != "unloaded":
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{spec.name} did not unload")
                threading.Event().wait(0.05)
    finally:
        registry.close(timeout=10)
    return needs


@dataclass
class Record:
    model: str
    was_loaded: bool
    start: float
    end: float = 0.0
    first_token_s: float | None = None
    error: str | None = None


def bench(args: argparse.Namespace) -> dict[str, Any]:
    specs, prompt, params = _specs(args.kind, args.load_s)
    needs = _measure_needs(specs)
    two = sorted(needs.values())[-2:]
    budget = int(sum(two) * 1.1)
    assert budget < sum(needs.values()), (needs, budget)
    registry = ModelRegistry(
        RegistryConfig(models=tuple(specs), memory_budget_bytes=budget)
    ).start()
    sampler = Sampler(registry)
    sampler.start()
    rng = random.Random(args.seed)
    # Skewed, as real traffic is: the first model most, the last least.
    weights = [0.5, 0.3, 0.2]
    names = [spec.name for spec in specs]
    records: list[Record] = []
    lock = threading.Lock()
    stop_at = time.monotonic() + args.seconds

    def client(seed: int) -> None:
        own = random.Random(seed)
        while time.monotonic() < stop_at:
            name = own.choices(names, weights)[0]
            loaded = registry.model_stats(name).state == "loaded"
            record = Record(name, loaded, time.monotonic())
            try:
                with registry.use(name, deadline_s=300) as pool:
                    stream = pool.stream(prompt, **params)
                    for _ in stream:
                        if record.first_token_s is None:
                            record.first_token_s = time.monotonic() - record.start
            except PoolError as exc:
                record.error = f"{type(exc).__name__}: {exc}"
            record.end = time.monotonic()
            with lock:
                records.append(record)
            threading.Event().wait(own.uniform(0, args.think_s))

    with ThreadPoolExecutor(args.clients) as executor:
        list(executor.map(client, [rng.randrange(2**31) for _ in range(args.clients)]))
    sampler.stop.set()
    sampler.join()
    stats = registry.stats(with_pools=False)
    registry.close(timeout=10)

    hot = [r for r in records if r.was_loaded and r.error is None]
    during = [r.end - r.start for r in hot if sampler.during_swap(r.start, r.end)]
    without = [r.end - r.start for r in hot if not sampler.during_swap(r.start, r.end)]
    cold = [r.first_token_s for r in records if not r.was_loaded and r.first_token_s is not None]
    p_during, p_without = percentiles(during), percentiles(without)
    report = {
        "kind": args.kind,
        "seconds": args.seconds,
        "clients": args.clients,
        "needs_bytes": needs,
        "budget_bytes": budget,
        "requests": len(records),
        "lost": sum(1 for r in records if r.error is not None),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "swaps": stats.swaps,
        "loads": {n: m.loads for n, m in stats.models.items()},
        "evictions": {n: m.evictions for n, m in stats.models.items()},
        "load_s": {
            n: round(m.load_seconds_total / m.loads, 3) for n, m in stats.models.items() if m.loads
        },
        "unloaded_to_first_token_s": percentiles(cold),
        "cold_requests": len(cold),
        "loaded_during_swaps_s": p_during,
        "loaded_without_swaps_s": p_without,
        "loaded_counts": {"during": len(during), "without": len(without)},
        "peak_rss_sampled_bytes": sampler.peak_rss,
        "parallel_load_samples": sampler.parallel_loads,
        "peak_rss_registry_bytes": stats.peak_rss_bytes,
    }
    ratio = (
        (p_during["p99"] or 0) / p_without["p99"] if p_without["p99"] and p_during["p99"] else None
    )
    report["p99_ratio"] = None if ratio is None else round(ratio, 2)
    print(
        f"bench {args.kind}: {len(records)} requests, lost {report['lost']}, swaps "
        f"{stats.swaps}; unloaded->first token p50 {_ms(percentiles(cold)['p50'])} "
        f"(load {report['load_s']}); loaded p50/p99 during swaps {_ms(p_during['p50'])}/"
        f"{_ms(p_during['p99'])} vs without {_ms(p_without['p50'])}/{_ms(p_without['p99'])} "
        f"(x{report['p99_ratio']}); peak RSS {sampler.peak_rss / 2**20:.0f} MB sampled, "
        f"{stats.peak_rss_bytes / 2**20:.0f} MB registry, budget {budget / 2**20:.0f} MB"
    )
    return report


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


@dataclass
class ChaosState:
    kills: int = 0
    struck: list[float] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    outcomes: dict[str, int] = field(default_factory=dict)


def chaos(args: argparse.Namespace) -> dict[str, Any]:
    def model(name: str, **options: Any) -> PoolConfig:
        return PoolConfig(
            model=name,
            backend="testing",
            workers=1,
            devices=("cpu",),
            deadline_s=10.0,
            cancel_grace_s=0.2,
            term_grace_s=0.2,
            startup_timeout_s=20.0,
            backend_options={"load_delay_s": 0.3, **options},
        )

    healthy = ["one", "two", "three"]
    specs = [ModelSpec(name, model(name), load_timeout_s=15.0) for name in healthy]
    specs.append(ModelSpec("broken", model("broken", fail_load=True), load_timeout_s=15.0))
    specs.append(ModelSpec("hangs", model("hangs", load_delay_s=600), load_timeout_s=2.0))
    needs = _measure_needs(specs[:1])
    budget = int(needs["one"] * 2.6)
    children_before = {p.pid for p in _ME.children(recursive=True)}
    registry = ModelRegistry(
        RegistryConfig(
            models=tuple(specs), memory_budget_bytes=budget, backoff_s=0.5, backoff_max_s=4.0
        )
    ).start()
    sampler = Sampler(registry)
    sampler.start()
    state = ChaosState()
    lock = threading.Lock()
    rng = random.Random(args.seed)
    stop_at = time.monotonic() + args.seconds
    names = [spec.name for spec in specs]

    def agent() -> None:
        own = random.Random(args.seed + 1)
        while time.monotonic() < stop_at:
            threading.Event().wait(own.uniform(0.2, args.agent_interval))
            workers = [p for p in _ME.children(recursive=True) if p.pid not in children_before]
            if workers:
                victim = own.choice(workers)
                try:
                    victim.send_signal(signal.SIGKILL)
                    with lock:
                        state.kills += 1
                        state.struck.append(time.monotonic())
                except psutil.Error:
                    pass

    def note(kind: str) -> None:
        with lock:
            state.outcomes[kind] = state.outcomes.get(kind, 0) + 1

    def client(seed: int) -> None:
        own = random.Random(seed)
        while time.monotonic() < stop_at:
            name = own.choice(names)
            deadline = own.uniform(1.0, 8.0)
            before = registry.model_stats(name)
            backing_off = before.state == "failed" and (before.retry_in_s or 0) > 0.1
            started = time.monotonic()
            try:
                with registry.use(name, deadline_s=deadline) as pool:
                    text = pool.generate(f"echo:{name}", deadline_s=deadline).text
                if text != name:
                    state.violations.append(f"{name}: wrong text {text!r}")
                note(f"{name}:ok")
            except ModelUnavailable:
                note(f"{name}:unavailable")
                seconds = time.monotonic() - started
                if backing_off and seconds > 1.0:
                    state.violations.append(
                        f"{name}: failed and backing off, but its error took {seconds:.1f} s"
                    )
            except (DeadlineExceeded, WorkerCrashed, PoolError) as exc:
                note(f"{name}:{type(exc).__name__}")
            except Exception as exc:
                state.violations.append(f"{name}: not a PoolError: {exc!r}")
            took = time.monotonic() - started
            if took > 2 * deadline + 20:
                state.violations.append(
                    f"{name}: resolved after {took:.1f} s (deadline {deadline:.1f})"
                )

    threads = [threading.Thread(target=agent, daemon=True)]
    with ThreadPoolExecutor(args.clients) as executor:
        threads[0].start()
        list(executor.map(client, [rng.randrange(2**31) for _ in range(args.clients)]))
    threads[0].join()
    # Settled: nothing stuck in "loading"; each healthy model serves again.
    settle = time.monotonic() + 30
    while time.monotonic() < settle:
        if all(m.state != "loading" for m in registry.stats(with_pools=False).models.values()):
            break
        threading.Event().wait(0.1)
    else:
        state.violations.append("a model is stuck in loading")
    for name in healthy:
        try:
            with registry.use(name, deadline_s=30) as pool:
                if pool.generate(f"echo:{name}").text != name:
                    state.violations.append(f"{name}: wrong text after the chaos")
        except ModelUnavailable:
            # Struck at its last load: it backs off, then must load again.
            threading.Event().wait(4.5)
            try:
                with registry.use(name, deadline_s=30) as pool:
                    pool.generate(f"echo:{name}")
            except PoolError as exc:
                state.violations.append(f"{name} does not serve after the chaos: {exc}")
        except PoolError as exc:
            state.violations.append(f"{name} does not serve after the chaos: {exc}")
    final = registry.stats(with_pools=False)
    if final.models["hangs"].state == "loading":
        state.violations.append("hangs is stuck in loading")
    sampler.stop.set()
    sampler.join()
    registry.close(timeout=10)
    deadline = time.monotonic() + 15
    left: set[int] = set()
    while time.monotonic() < deadline:
        left = {
            p.pid
            for p in _ME.children(recursive=True)
            if p.pid not in children_before and p.status() != psutil.STATUS_ZOMBIE
        }
        if not left:
            break
        threading.Event().wait(0.1)
    if left:
        state.violations.append(f"processes left after close: {sorted(left)}")
    if final.peak_rss_bytes > budget:
        state.violations.append(
            f"registry-measured peak {final.peak_rss_bytes} above the budget {budget}"
        )
    report = {
        "seconds": args.seconds,
        "clients": args.clients,
        "budget_bytes": budget,
        "kills": state.kills,
        "outcomes": dict(sorted(state.outcomes.items())),
        "violations": state.violations,
        "loads": {n: m.loads for n, m in final.models.items()},
        "load_failures": {n: m.load_failures for n, m in final.models.items()},
        "evictions": {n: m.evictions for n, m in final.models.items()},
        "swaps": final.swaps,
        "peak_rss_registry_bytes": final.peak_rss_bytes,
        "peak_rss_sampled_bytes": sampler.peak_rss,
        "parallel_load_samples": sampler.parallel_loads,
        "states_at_end": {n: m.state for n, m in final.models.items()},
    }
    print(
        f"chaos: violations {len(state.violations)}; {sum(state.outcomes.values())} requests, "
        f"{state.kills} SIGKILLs, {final.swaps} swaps, {sampler.parallel_loads} samples with "
        f"loads in parallel; loads {report['loads']}; load failures "
        f"{report['load_failures']}; peak RSS {final.peak_rss_bytes / 2**20:.0f} MB (registry) / "
        f"{sampler.peak_rss / 2**20:.0f} MB (sampled, kills included) vs budget "
        f"{budget / 2**20:.0f} MB; states at end {report['states_at_end']}"
    )
    for violation in state.violations[:10]:
        print("  violation:", violation)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks.models", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name in ("bench", "chaos"):
        sub = commands.add_parser(name)
        sub.add_argument("--seconds", type=float, default=60.0)
        sub.add_argument("--clients", type=int, default=6)
        sub.add_argument("--seed", type=int, default=1)
        sub.add_argument("--report", help="write the figures as JSON here")
    commands.choices["bench"].add_argument("--kind", choices=("testing", "real"), default="testing")
    commands.choices["bench"].add_argument("--load-s", type=float, default=1.0)
    commands.choices["bench"].add_argument("--think-s", type=float, default=0.2)
    commands.choices["chaos"].add_argument("--agent-interval", type=float, default=1.5)
    args = parser.parse_args(argv)
    run: Callable[[argparse.Namespace], dict[str, Any]] = (
        bench if args.command == "bench" else chaos
    )
    report = run(args)
    if args.report:
        with open(args.report, "w") as handle:
            json.dump(report, handle, indent=2)
    if args.command == "chaos":
        return 1 if report["violations"] else 0
    return 1 if report["lost"] else 0


if __name__ == "__main__":
    sys.exit(main())
