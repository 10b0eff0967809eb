"""Many models under attack and after a restart (issue 61), on the testing backend:

    python -m benchmarks.swap_storm --seconds 30 --load-s 1 --report swap_storm.json

``storm``: models a, b, c (1 worker each, loads of ``--load-s``), a budget of 1.6 times
one model's measured need (one model at a time). Alice (2 clients, think 0.1 s) loops
on a, alone for ``--before-s``, then while bob sends one ``max_tokens: 1`` request at
a time alternating b and c for ``--seconds`` (a 429 he gets he retries 50 ms later, as
an attacker would). Reported: swaps, evictions, alice's p50 during the attack against
before (target < 2x), bob's requests served and refused.

``fit``: a small model (``hold_mb`` 0) and two big ones (``hold_mb`` ``--big-mb``), each
with a weights file on disk of its size (so its need is estimated before it is ever
measured), a budget that holds the small one beside either big one but not both big
ones; three clients send a seeded random mix for ``--seconds``. Reported: loads,
evictions, and evictions of the small model, which always fits (target 0).

``restart``: the same three models, a budget that holds all three; the small one
preloaded; a client sends a seeded random mix for ``--restart-s`` after a first start
(no needs file) and again after a restart (the needs the first run saved). Reported:
loads and evictions of each run (the first: every model never measured evicts every
other; the second: none).

Each client is the registry's ``client`` (a tenant in the daemon): the rules are the
registry's, so this drives it in-process, without HTTP, on the 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modelpool import PoolConfig
from modelpool.shared.config import ModelSpec
from modelpool.shared.errors import PoolError, QueueFull
from modelpool.supervisor.registry import ModelRegistry, RegistryConfig
from modelpool.supervisor.stats import percentiles


def model(
    name: str, *, load_s: float, hold_mb: int = 0, path: str = "none", **own: Any
) -> ModelSpec:
    options: dict[str, Any] = {"load_delay_s": load_s}
    if hold_mb:
        options["hold_mb"] = hold_mb
    pool = PoolConfig(
        model=path,
        backend="testing",
        workers=1,
        devices=("cpu",),
        deadline_s=30.0,
        startup_timeout_s=60.0,
        backend_options=options,
    )
    return ModelSpec(name, pool, **own)


def one_need(load_s: float) -> int:
    """The measured need of one testing model (to size the budgets)."""
    with ModelRegistry(RegistryConfig((model("probe", load_s=load_s),))) as registry:
        registry.acquire("probe", deadline_s=60).release()
        need = registry.model_stats("probe").need_bytes
        assert need
        return need


@dataclass
class Client:
    """One client's loop: its latencies (s) by phase, and its refusals."""

    name: str
    latencies: dict[str, list[float]] = field(default_factory=dict)
    refused: int = 0
    failed: int = 0

    def call(self, registry: ModelRegistry, name: str, phase: str) -> bool:
        started = time.monotonic()
        try:
            with registry.acquire(name, client=self.name, deadline_s=30) as pool:
                pool.generate("echo:x", max_new_tokens=1)
        except QueueFull:
            self.refused += 1
            return False
        except PoolError:
            self.failed += 1
            return False
        self.latencies.setdefault(phase, []).append(time.monotonic() - started)
        return True


def storm(args: argparse.Namespace) -> dict[str, Any]:
    need = one_need(args.load_s)
    specs = tuple(model(n, load_s=args.load_s) for n in ("a", "b", "c"))
    config = RegistryConfig(specs, memory_budget_bytes=int(need * 1.6))
    alice = Client("alice")
    bob = Client("bob")
    phase = ["before"]
    stop = threading.Event()
    with ModelRegistry(config) as registry:
        registry.acquire("a", deadline_s=60).release()

        def alice_loop() -> None:
            while not stop.is_set():
                alice.call(registry, "a", phase[0])
                stop.wait(0.1)

        def bob_loop() -> None:
            turn = 0
            while not stop.is_set():
                if bob.call(registry, "bc"[turn % 2], "attack"):
                    turn += 1
                else:
                    stop.wait(0.05)

        threads = [threading.Thread(target=alice_loop) for _ in range(2)]
        for thread in threads:
            thread.start()
        time.sleep(args.before_s)
        before = registry.stats()
        phase[0] = "attack"
        attacker = threading.Thread(target=bob_loop)
        attacker.start()
        time.sleep(args.seconds)
        stop.set()
        for thread in [*threads, attacker]:
            thread.join()
        after = registry.stats()
    p50 = {p: percentiles(alice.latencies.get(p, []))["p50"] or 0.0 for p in ("before", "attack")}
    return {
        "need_bytes": need,
        "swaps": after.swaps - before.swaps,
        "evictions": sum(m.evictions for m in after.models.values())
        - sum(m.evictions for m in before.models.values()),
        "alice_p50_before_s": p50["before"],
        "alice_p50_attack_s": p50["attack"],
        "alice_p50_ratio": round(p50["attack"] / max(p50["before"], 1e-6), 2),
        "alice_answers": {p: len(v) for p, v in alice.latencies.items()},
        "bob_served": len(bob.latencies.get("attack", [])),
        "bob_refused": bob.refused,
        "failed": alice.failed + bob.failed,
    }


def sized_models(folder: Path, args: argparse.Namespace) -> tuple[ModelSpec, ...]:
    """small, big1, big2: each with a (sparse) weights file of its size on disk."""
    specs = []
    for name, mb in (("small", 1), ("big1", args.big_mb), ("big2", args.big_mb)):
        path = folder / name
        path.mkdir(exist_ok=True)
        with open(path / "model.safetensors", "wb") as weights:
            weights.truncate(mb * 2**20)
        hold = 0 if name == "small" else args.big_mb
        specs.append(model(name, load_s=args.load_s, hold_mb=hold, path=str(path)))
    return tuple(specs)


def mix(registry: ModelRegistry, clients: int, seconds: float, seed: int) -> dict[str, int]:
    """Clients sending a seeded random mix across the three models for ``seconds``."""
    stop = threading.Event()
    counts = {"requests": 0, "failed": 0}

    def loop(number: int) -> None:
        chooser = random.Random(seed * 100 + number)
        client = Client(f"client{number}")
        while not stop.is_set():
            client.call(registry, chooser.choice(("small", "big1", "big2")), "mix")
            stop.wait(chooser.uniform(0.05, 0.5))
        counts["requests"] += sum(len(v) for v in client.latencies.values())
        counts["failed"] += client.failed + client.refused

    threads = [threading.Thread(target=loop, args=(n,)) for n in range(clients)]
    for thread in threads:
        thread.start()
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join()
    stats = registry.stats().models
    return {
        **counts,
        "loads": sum(m.loads for m in stats.values()),
        "evictions": sum(m.evictions for m in stats.values()),
        "evictions_of_small": stats["small"].evictions,
    }


def fit(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    need = one_need(args.load_s)
    big = need + args.big_mb * 2**20
    budget = int((need + big) * 1.3)
    config = RegistryConfig(sized_models(folder, args), memory_budget_bytes=budget)
    with ModelRegistry(config) as registry:
        return {"budget_bytes": budget, **mix(registry, 3, args.seconds, args.seed)}


def restart(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    need = one_need(args.load_s)
    budget = int((3 * need + 2 * args.big_mb * 2**20) * 1.1)
    needs_file = str(folder / "state" / "model-needs.json")
    # No weights on disk: no estimate, as a hub or embedded model has none.
    specs = (
        model("small", load_s=args.load_s, preload=True),
        model("big1", load_s=args.load_s, hold_mb=args.big_mb),
        model("big2", load_s=args.load_s, hold_mb=args.big_mb),
    )
    runs = {}
    for run in ("first start", "after restart"):
        config = RegistryConfig(specs, memory_budget_bytes=budget, needs_file=needs_file)
        with ModelRegistry(config) as registry:
            runs[run] = mix(registry, 2, args.restart_s, args.seed)
    return {"budget_bytes": budget, **runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--before-s", type=float, default=10.0)
    parser.add_argument("--restart-s", type=float, default=60.0)
    parser.add_argument("--load-s", type=float, default=1.0)
    parser.add_argument("--big-mb", type=int, default=60)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--only", choices=("storm", "fit", "restart"), default=None)
    parser.add_argument("--report", default=None)
    args = parser.parse_args()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="swap-storm-") as folder:
        if args.only in (None, "storm"):
            results["storm"] = storm(args)
        if args.only in (None, "fit"):
            results["fit"] = fit(args, Path(folder))
        if args.only in (None, "restart"):
            results["restart"] = restart(args, Path(folder))
    for name, figures in results.items():
        print(name, json.dumps(figures, default=str))
    if args.report:
        Path(args.report).write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
