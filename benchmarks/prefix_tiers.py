"""Prefix cache tiers (issue 56): what a kill, a swap and a restart cost an agent, side by
side with a warm worker and with the tiers off.

An agent's conversation: a system prompt of about ``--prefix-tokens`` tokens, five turns,
each sent with the conversation so far, greedy, ``--new-tokens`` a turn. In one run:

1. **Kill**: one worker; between turns 3 and 4 the worker is SIGKILLed and the pool
   replaces it. Turn 4's time to first token with the host tier on, against the same turn
   on a warm worker (no kill) and against the tiers off (today: the whole prefill again).
   Target: at most 1.5x warm.
2. **Swap and restart**: turns 1-3 on one pool, which is closed; turn 4 on a new pool of
   the same model, as after a registry swap or a daemon restart: with the disk tier
   (``prefix_cache_dir``), with a host tier in a directory that outlives the pool
   (``prefix_cache_host_dir``, the swap case), and with no tier (cold), against warm.
3. **Swap through the registry**: turns 1-3 on a model of a :class:`ModelRegistry`, which
   then loads another model whose need is not known (so it evicts every model that may
   go); turn 4 asks for the first model again, which loads and answers: with the host
   tier the registry kept for it while it was out, and with no tier (cold), against the
   same turn on the model never evicted (warm). The reloaded pool serves a one-token
   "Hello" first, as the other parts do, so the TTFT is the turn's and not the new
   process's first call; the load's own time is reported apart.
4. **Cost on misses**: distinct prompts (nothing to restore, every answer written), one
   worker, tiers on vs off: tokens per second (target >= 0.97x).

::

    python -m benchmarks.prefix_tiers                                  # the tiny model
    python -m benchmarks.prefix_tiers --model embedded:smollm2-135m-instruct
    python -m benchmarks.prefix_tiers --backend llama_cpp
    python -m benchmarks.prefix_tiers --no-kill --no-move --no-misses   # the registry swap

TTFT is the median over ``--rounds`` conversations per mode.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import modelpool.supervisor.backend_choice
from benchmarks.batching import closed_loop, read_to_end, summarize
from modelpool import ModelPool, PoolConfig
from modelpool.shared.config import ModelSpec
from modelpool.supervisor.registry import ModelRegistry, RegistryConfig
from modelpool.tinymodel import build_tiny_model

Json = dict[str, Any]
TURNS = 5
KILLED_BEFORE = 4
QUESTIONS = (
    "Which berth is free this afternoon?",
    "When does the evening ferry leave?",
    "How strong is the wind at the harbour mouth?",
    "Please book a pilot for the cargo ship at six.",
    "Who is on the night shift on the small ferry?",
)


def system_prompt(tokens: int, chars_per_token: float) -> str:
    text = "You are the operations assistant of a small harbour town. Standing orders:\n"
    number = 1
    while len(text) < tokens * chars_per_token:
        text += (
            f"{number}. Log every vessel movement with its time, berth and pilot; report "
            f"anything unusual to the harbour master before the next tide.\n"
        )
        number += 1
    return text


def pool_config(args: argparse.Namespace, model: str, **tiers: Any) -> PoolConfig:
    options: Json = {"threads": args.threads}
    if args.backend == "hf":
        options = {"dtype": "float32", "torch_threads": args.threads}
    return PoolConfig(
        model=model,
        backend=args.backend,
        backend_options=options,
        workers=1,
        devices=("cpu",),
        deadline_s=1800.0,
        startup_timeout_s=600.0,
        **tiers,
    )


def start(args: argparse.Namespace, model: str, **tiers: Any) -> ModelPool:
    pool = ModelPool(pool_config(args, model, **tiers)).start()
    pool.generate("Hello", max_new_tokens=1)
    return pool


def turn(pool: ModelPool, messages: list[Json], number: int, new_tokens: int) -> Json:
    messages.append({"role": "user", "content": QUESTIONS[number % len(QUESTIONS)]})
    began = time.perf_counter()
    first: float | None = None
    stream = pool.stream(messages, max_new_tokens=new_tokens, ignore_eos=True)
    for _ in stream:
        if first is None:
            first = time.perf_counter() - began
    result = stream.result
    assert result is not None
    messages.append({"role": "assistant", "content": result.text})
    return {
        "ttft_s": first if first is not None else result.latency_s,
        "cached_tokens": result.cached_tokens,
        "prompt_tokens": result.prompt_tokens or 0,
        "text": result.text,
    }


def wait_for(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    pause = threading.Event()
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout_s} s")
        pause.wait(0.05)


def written(pool: ModelPool, count: int) -> None:
    """Until the tiers hold ``count`` writes (the worker writes after it answers)."""
    wait_for(
        lambda: all(tier.stores >= count for tier in pool.stats().prefix_tiers), 120, "tier write"
    )


def kill_worker(pool: ModelPool) -> None:
    (worker,) = pool.stats().workers
    assert worker.pid is not None
    os.kill(worker.pid, signal.SIGKILL)
    wait_for(
        lambda: any(w.state == "idle" and w.pid != worker.pid for w in pool.stats().workers),
        600,
        "replacement worker",
    )


def killed(args: argparse.Namespace, model: str, system: str, mode: str, tiers: Json) -> Json:
    """One conversation per round on one pool; the worker killed before turn 4 unless
    ``mode`` is "warm"."""
    pool = start(args, model, **tiers)
    rounds = []
    try:
        for number in range(args.rounds):
            messages: list[Json] = [{"role": "system", "content": f"({number}) {system}"}]
            records = []
            for index in range(TURNS):
                if index + 1 == KILLED_BEFORE and mode != "warm":
                    if tiers:
                        # Each turn writes one entry: the earlier rounds' and these three.
                        written(pool, TURNS * number + KILLED_BEFORE - 1)
                    kill_worker(pool)
                records.append(turn(pool, messages, index, args.new_tokens))
            rounds.append(records)
        stats = [vars(tier) for tier in pool.stats().prefix_tiers]
    finally:
        pool.close()
    return {"rounds": rounds, "tiers": stats}


def moved(args: argparse.Namespace, model: str, system: str, tiers: Json) -> Json:
    """Turns 1-3 on one pool, turn 4 on a new one over the same tiers (a swap, a
    restart): per round."""
    rounds = []
    for number in range(args.rounds):
        messages: list[Json] = [{"role": "system", "content": f"[{number}] {system}"}]
        pool = start(args, model, **tiers)
        try:
            # The tiers' counters outlive the pools: this round's three writes on top.
            before = [tier.stores for tier in pool.stats().prefix_tiers]
            for index in range(KILLED_BEFORE - 1):
                turn(pool, messages, index, args.new_tokens)
            if tiers:
                written(pool, min(before) + KILLED_BEFORE - 1)
        finally:
            pool.close()
        pool = start(args, model, **tiers)
        try:
            rounds.append([turn(pool, messages, KILLED_BEFORE - 1, args.new_tokens)])
        finally:
            pool.close()
    return {"rounds": rounds}


def swapped(
    args: argparse.Namespace, model: str, system: str, tiers: Json, *, evict: bool
) -> Json:
    """Turns 1-3 on the registry's ``agent``, then (``evict``) ``other`` loaded in its
    place and ``agent`` asked for again; turn 4: per round, with the reload's seconds."""
    rounds = []
    loads = []
    for number in range(args.rounds):
        messages: list[Json] = [{"role": "system", "content": f"[{number}] {system}"}]
        models = (
            ModelSpec("agent", pool_config(args, model, **tiers)),
            ModelSpec("other", PoolConfig(model="none", backend="testing", devices=("cpu",))),
        )
        # A budget: "other"'s need is not known, so its load evicts every model that may go.
        registry = ModelRegistry(RegistryConfig(models, memory_budget_bytes=2**40)).start()
        try:
            with registry.use("agent", deadline_s=1800.0) as pool:
                pool.generate("Hello", max_new_tokens=1)
                for index in range(KILLED_BEFORE - 1):
                    turn(pool, messages, index, args.new_tokens)
                if tiers:
                    written(pool, KILLED_BEFORE - 1)
            if evict:
                registry.acquire("other", deadline_s=600.0).release()
                assert registry.model_stats("agent").state == "unloaded"
            with registry.use("agent", deadline_s=1800.0) as pool:
                pool.generate("Hello", max_new_tokens=1)
                rounds.append([turn(pool, messages, KILLED_BEFORE - 1, args.new_tokens)])
            loads.append(registry.model_stats("agent").last_load_s)
        finally:
            registry.close()
    return {"rounds": rounds, "load_s": loads}


def misses(args: argparse.Namespace, model: str, contenders: dict[str, Json]) -> Json:
    """Distinct prompts on a pool of each contender (its tier settings), both up at once and
    their rounds interleaved, the order reversed each round, so that the machine's load
    falls on both alike; tokens/s per contender and the median of the rounds' ratios."""
    pools = {name: start(args, model, **tiers) for name, tiers in contenders.items()}

    def one_on(pool: ModelPool, offset: int) -> Callable[[int], tuple[int, float | None]]:
        def one(number: int) -> tuple[int, float | None]:
            index = offset + number
            prompt = [
                {"role": "system", "content": f"Session {index * 7919 % 10007}: " + "x" * 300},
                {"role": "user", "content": f"{QUESTIONS[index % len(QUESTIONS)]} (#{index})"},
            ]
            began = time.perf_counter()
            return read_to_end(pool.stream(prompt, max_new_tokens=args.new_tokens), began)

        return one

    runs: dict[str, list[Json]] = {name: [] for name in pools}
    try:
        names = list(pools)
        for round_index in range(args.rounds):
            for name in names if round_index % 2 == 0 else names[::-1]:
                # Each round its own prompts: nothing a round wrote is a later round's hit.
                one = one_on(pools[name], round_index * args.miss_requests)
                runs[name].append(closed_loop(one, 1, args.miss_requests))
    finally:
        for pool in pools.values():
            pool.close()
    ratios = [
        on["tokens"] / on["wall_s"] / (off["tokens"] / off["wall_s"])
        for on, off in zip(runs["on"], runs["off"], strict=True)
    ]
    return {
        "tokens_per_s": {name: summarize(done)["tokens_per_s"] for name, done in runs.items()},
        "round_ratios": ratios,
        "on_vs_off": statistics.median(ratios),
    }


def ttft(run: Json, turn_index: int) -> float:
    return float(statistics.median(records[turn_index]["ttft_s"] for records in run["rounds"]))


def run(args: argparse.Namespace, log: Any = print) -> Json:
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    model = args.model
    if model == "tiny":
        model = str(build_tiny_model(Path(args.workdir) / "tiny-4k", context_length=8192))
    model = modelpool.supervisor.backend_choice.prepared_model(model, args.backend)
    system = system_prompt(args.prefix_tokens, 1.0 if args.model == "tiny" else 4.2)
    host = {"prefix_cache_host_bytes": args.tier_mib * 2**20}
    report: Json = {"model": args.model, "backend": args.backend, "rounds": args.rounds}
    turn4 = KILLED_BEFORE - 1
    if not args.no_kill:
        for mode, tiers in (("warm", {}), ("killed_tiers_off", {}), ("killed_host_tier", host)):
            log(f"kill: {mode}")
            report[mode] = killed(args, model, system, mode, tiers)
        report["prefix_tokens"] = report["warm"]["rounds"][0][turn4]["prompt_tokens"]
        warm = ttft(report["warm"], turn4)
        report["kill"] = {
            "turn4_ttft_s": {mode: ttft(report[mode], turn4) for mode in
                             ("warm", "killed_tiers_off", "killed_host_tier")},
            "host_tier_vs_warm": ttft(report["killed_host_tier"], turn4) / warm,
            "tiers_off_vs_warm": ttft(report["killed_tiers_off"], turn4) / warm,
            # The replacement's second request: what is left once a fresh process has
            # served its first long prompt.
            "turn5_host_tier_vs_warm": ttft(report["killed_host_tier"], turn4 + 1)
            / ttft(report["warm"], turn4 + 1),
            "cached_tokens_turn4": report["killed_host_tier"]["rounds"][0][turn4]["cached_tokens"],
            "same_answers": [r["text"] for r in report["killed_host_tier"]["rounds"][0]]
            == [r["text"] for r in report["warm"]["rounds"][0]],
        }  # fmt: skip
        log(json.dumps(report["kill"], indent=1))
    if not args.no_move:
        with (
            tempfile.TemporaryDirectory(dir=args.workdir) as disk,
            tempfile.TemporaryDirectory(
                dir="/dev/shm" if os.path.isdir("/dev/shm") else None
            ) as kept,
        ):
            contenders = {
                "cold": {},
                "disk_tier": {"prefix_cache_dir": disk},
                "kept_host_tier": {**host, "prefix_cache_host_dir": kept},
            }
            for mode, tiers in contenders.items():
                log(f"swap/restart: {mode}")
                report[f"moved_{mode}"] = moved(args, model, system, tiers)
        warm_ttft = ttft(report["warm"], turn4) if "warm" in report else None
        firsts = {mode: ttft(report[f"moved_{mode}"], 0) for mode in contenders}
        report["move"] = {
            "first_turn_ttft_s": {**firsts, "warm": warm_ttft},
            "vs_warm": (
                {mode: value / warm_ttft for mode, value in firsts.items()} if warm_ttft else None
            ),
            "vs_cold": {mode: value / firsts["cold"] for mode, value in firsts.items()},
        }
        log(json.dumps(report["move"], indent=1))
    if not args.no_swap:
        swaps = {
            "warm": ({}, False),
            "cold": ({}, True),
            "host_tier": (host, True),
        }
        for mode, (tiers, evict) in swaps.items():
            log(f"registry swap: {mode}")
            report[f"swap_{mode}"] = swapped(args, model, system, tiers, evict=evict)
        firsts = {mode: ttft(report[f"swap_{mode}"], 0) for mode in swaps}
        report["swap"] = {
            "prefix_tokens": report["swap_warm"]["rounds"][0][0]["prompt_tokens"],
            "first_turn_ttft_s": firsts,
            "vs_warm": {mode: value / firsts["warm"] for mode, value in firsts.items()},
            "vs_cold": {mode: value / firsts["cold"] for mode, value in firsts.items()},
            "load_s": {
                mode: statistics.median(report[f"swap_{mode}"]["load_s"]) for mode in swaps
            },
            "cached_tokens": {
                mode: [r[0]["cached_tokens"] for r in report[f"swap_{mode}"]["rounds"]]
                for mode in swaps
            },
            "same_answers": [r[0]["text"] for r in report["swap_host_tier"]["rounds"]]
            == [r[0]["text"] for r in report["swap_warm"]["rounds"]],
        }
        log(json.dumps(report["swap"], indent=1))
    if not args.no_misses:
        with tempfile.TemporaryDirectory(dir=args.workdir) as disk:
            log("misses: tiers off and on, interleaved")
            contenders = {"off": {}, "on": {**host, "prefix_cache_dir": disk}}
            report["misses"] = misses(args, model, contenders)
        log(json.dumps(report["misses"], indent=1))
    return report


def markdown(report: Json) -> str:
    lines = [f"{report['model']} ({report['backend']}), median of {report['rounds']} rounds", ""]
    if "kill" in report:
        kill = report["kill"]
        times = kill["turn4_ttft_s"]
        lines += [
            f"Kill between turns 3 and 4 (prefix {report['prefix_tokens']} tokens):",
            "",
            "| turn 4 | TTFT | vs warm |",
            "|---|---|---|",
            f"| warm worker | {times['warm']:.3f} s | 1.00x |",
            f"| killed, tiers off | {times['killed_tiers_off']:.3f} s | "
            f"{kill['tiers_off_vs_warm']:.2f}x |",
            f"| killed, host tier | {times['killed_host_tier']:.3f} s | "
            f"{kill['host_tier_vs_warm']:.2f}x |",
            "",
            f"cached tokens after the kill: {kill['cached_tokens_turn4']}; same greedy "
            f"answers as warm: {kill['same_answers']}; turn 5, host tier vs warm: "
            f"{kill['turn5_host_tier_vs_warm']:.2f}x",
            "",
        ]
    if "move" in report:
        move = report["move"]
        lines += ["| turn 4 on a new pool | TTFT | vs warm | vs cold |", "|---|---|---|---|"]
        for mode, value in move["first_turn_ttft_s"].items():
            if value is None or mode == "warm":
                continue
            against = move["vs_warm"][mode] if move["vs_warm"] else float("nan")
            lines.append(
                f"| {mode} | {value:.3f} s | {against:.2f}x | {move['vs_cold'][mode]:.2f}x |"
            )
        lines.append("")
    if "swap" in report:
        swap = report["swap"]
        lines += [
            f"Turn 4 after a registry swap (prefix {swap['prefix_tokens']} tokens):",
            "",
            "| turn 4 | TTFT | vs warm | vs cold | load |",
            "|---|---|---|---|---|",
        ]
        for mode, value in swap["first_turn_ttft_s"].items():
            lines.append(
                f"| {mode} | {value:.3f} s | {swap['vs_warm'][mode]:.2f}x | "
                f"{swap['vs_cold'][mode]:.2f}x | {swap['load_s'][mode]:.2f} s |"
            )
        lines += [
            "",
            f"cached tokens: {swap['cached_tokens']}; same greedy answers (host tier and "
            f"warm): {swap['same_answers']}",
            "",
        ]
    if "misses" in report:
        misses_ = report["misses"]
        rates = misses_["tokens_per_s"]
        lines.append(
            f"Misses (distinct prompts): {rates['on']:.1f} tok/s tiers on vs {rates['off']:.1f} "
            f"off; the median of the interleaved rounds' ratios {misses_['on_vs_off']:.2f}x"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=["hf", "llama_cpp"], default="hf")
    parser.add_argument("--model", default="tiny", help='"tiny" (built here) or a model')
    parser.add_argument("--prefix-tokens", type=int, default=2000)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tier-mib", type=int, default=1024)
    parser.add_argument("--miss-requests", type=int, default=24)
    parser.add_argument("--workdir", default=tempfile.gettempdir())
    parser.add_argument("--no-kill", action="store_true")
    parser.add_argument("--no-move", action="store_true")
    parser.add_argument("--no-swap", action="store_true")
    parser.add_argument("--no-misses", action="store_true")
    parser.add_argument("--json", help="also write the whole report here")
    args = parser.parse_args(argv)
    report = run(args, log=lambda line: print(line, file=sys.stderr, flush=True))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
