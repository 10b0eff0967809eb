"""Prefix cache tiers on the llama_cpp backend (issue 56): a kill that costs no context.

The embedded model's GGUF, one worker, greedy, streamed. In one run:

1. **A kill between turns**: a five-turn agent conversation over a growing prefix of
   about ``--system-chars`` / 4 tokens (the harbour assistant of
   ``benchmarks.prefix_cache``), its worker SIGKILLed between turns 3 and 4 (after turn
   3's sequence reached the host tier), a new one started by the pool. Turn 4's time to
   first token three ways: the warm worker (no kill, tiers on), the killed worker with
   the host tier, and the killed worker without tiers (today: the whole prompt
   prefilled). Target: killed-with-tiers at most 1.5x warm.
2. **Cost on misses**: ``--miss-requests`` requests whose prompts share nothing (a
   distinct session number first, then the six questions, about 120 tokens), each a
   new tier entry, output tokens per second (``--miss-new-tokens`` each) with the host
   tier on against off, one request at a time, the two pools alternated. Target:
   >= 0.97x.

::

    python -m benchmarks.prefix_tiers_llama_cpp                 # a few minutes on CPU
    python -m benchmarks.prefix_tiers_llama_cpp --repeats 1 --miss-requests 8

Each figure is the median over ``--repeats`` conversations (each its own system prompt).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import modelpool.supervisor.backend_choice
from benchmarks.batching import read_to_end
from benchmarks.prefix_cache import QUESTIONS, system_prompt
from modelpool import ModelPool, PoolConfig
from modelpool.shared.prefix_tier import PrefixTierStore, TierSpec

Json = dict[str, Any]
TURNS = 5
KILL_AFTER_TURN = 3


def start_pool(model: str, threads: int, host_dir: str | None, host_bytes: int) -> ModelPool:
    pool = ModelPool(
        PoolConfig(
            model=model,
            backend="llama_cpp",
            backend_options={"threads": threads, "kv_cache_tokens": 8192},
            workers=1,
            max_batch_size=4,
            devices=("cpu",),
            deadline_s=1800.0,
            prefix_cache_host_bytes=host_bytes,
            prefix_cache_host_dir=host_dir,
        )
    ).start()
    pool.generate("Hello", max_new_tokens=1)
    return pool


def stores(directory: str | None) -> int:
    """Entries written to the host tier so far (its counter, every worker's)."""
    if directory is None:
        return 0
    store = PrefixTierStore.open([TierSpec("host", directory, 1)], "")
    return store.stats()[0].stores


def wait_for(condition: Any, what: str, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s} s for {what}")
        time.sleep(0.02)


def kill_worker(pool: ModelPool, pid: int) -> None:
    """SIGKILL worker ``pid`` and wait for the pool's new worker to be idle."""
    os.kill(pid, signal.SIGKILL)

    def replaced() -> bool:
        workers = pool.stats().workers
        return any(w.pid not in (None, pid) and w.state == "idle" for w in workers)

    wait_for(replaced, "the replacement worker")


def conversation(
    pool: ModelPool, system: str, new_tokens: int, kill: bool, host_dir: str | None
) -> list[Json]:
    """Five turns over the growing conversation; the worker killed after turn 3 when
    ``kill`` (once the tier holds that turn's entry, when there is a tier)."""
    messages = [{"role": "system", "content": system}]
    records = []
    before = stores(host_dir)
    for turn in range(1, TURNS + 1):
        messages.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
        began = time.perf_counter()
        stream = pool.stream(messages, max_new_tokens=new_tokens, ignore_eos=True)
        _, first = read_to_end(stream, began)
        result = stream.result
        assert result is not None
        records.append(
            {
                "turn": turn,
                "ttft_s": first,
                "prompt_tokens": result.prompt_tokens,
                "cached_tokens": result.cached_tokens,
                "text": result.text,
            }
        )
        messages.append({"role": "assistant", "content": result.text})
        if kill and turn == KILL_AFTER_TURN:
            if host_dir is not None:
                # One entry per turn.
                wait_for(
                    lambda: stores(host_dir) >= before + KILL_AFTER_TURN, "turn 3's tier entry"
                )
            assert result.worker_pid is not None
            kill_worker(pool, result.worker_pid)
    return records


def kill_runs(args: argparse.Namespace, model: str, log: Any) -> Json:
    runs: dict[str, list[list[Json]]] = {"warm": [], "killed_tiers": [], "killed_off": []}
    for name in runs:
        with tempfile.TemporaryDirectory(dir="/dev/shm") as tier_dir:
            host_dir = None if name == "killed_off" else tier_dir
            pool = start_pool(model, args.threads, host_dir, 0 if host_dir is None else 2**30)
            try:
                for repeat in range(args.repeats):
                    # The same conversations in every mode (each mode has its own pool
                    # and tier), so that their answers compare.
                    system = f"Shift log {repeat}.\n" + system_prompt(args.system_chars)
                    kill = name != "warm"
                    records = conversation(pool, system, args.new_tokens, kill, host_dir)
                    runs[name].append(records)
                    turn4 = records[KILL_AFTER_TURN]
                    log(
                        f"{name} #{repeat}: turn 4 ttft {turn4['ttft_s']:.3f} s, "
                        f"cached {turn4['cached_tokens']}/{turn4['prompt_tokens']}"
                    )
            finally:
                pool.close()
    table: Json = {}
    for name, conversations in runs.items():
        table[name] = {
            str(turn): statistics.median(c[turn - 1]["ttft_s"] for c in conversations)
            for turn in range(1, TURNS + 1)
        }
        table[name + "_turn4_cached_tokens"] = [c[3]["cached_tokens"] for c in conversations]
        table[name + "_turn4_prompt_tokens"] = [c[3]["prompt_tokens"] for c in conversations]
    same = all(
        [r["text"] for r in a] == [r["text"] for r in b]
        for a, b in zip(runs["killed_tiers"], runs["killed_off"], strict=True)
    )
    warm4, tiers4, off4 = (table[name]["4"] for name in ("warm", "killed_tiers", "killed_off"))
    table["turn4_killed_tiers_over_warm"] = tiers4 / warm4
    table["turn4_killed_off_over_warm"] = off4 / warm4
    table["turn4_killed_tiers_over_killed_off"] = tiers4 / off4
    table["answers_equal_with_and_without_tiers"] = same
    return table


def miss_runs(args: argparse.Namespace, model: str, log: Any) -> Json:
    """Output tokens per second over distinct prompts, host tier on and off (alternated
    by round, so that a drift of the machine hits both)."""
    body = " ".join(QUESTIONS)
    totals = {"on": [0.0, 0], "off": [0.0, 0]}
    with tempfile.TemporaryDirectory(dir="/dev/shm") as tier_dir:
        pools = {
            "on": start_pool(model, args.threads, tier_dir, 2**30),
            "off": start_pool(model, args.threads, None, 0),
        }
        try:
            for index in range(args.miss_requests):
                for name in ("on", "off") if index % 2 else ("off", "on"):
                    prompt = [
                        {"role": "system", "content": f"Session {index}-{name}.\n{body}"},
                        {"role": "user", "content": QUESTIONS[index % len(QUESTIONS)]},
                    ]
                    began = time.perf_counter()
                    stream = pools[name].stream(
                        prompt, max_new_tokens=args.miss_new_tokens, ignore_eos=True
                    )
                    tokens, _ = read_to_end(stream, began)
                    totals[name][0] += time.perf_counter() - began
                    totals[name][1] += tokens
        finally:
            for pool in pools.values():
                pool.close()
    rates = {name: count / seconds for name, (seconds, count) in totals.items()}
    log(f"misses: {rates['on']:.1f} tok/s with the tier, {rates['off']:.1f} without")
    return {
        "tokens_per_s_on": rates["on"],
        "tokens_per_s_off": rates["off"],
        "on_over_off": rates["on"] / rates["off"],
        "tier_entries_written": args.miss_requests,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="embedded:smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--system-chars", type=int, default=8_000, help="about 2,000 tokens")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--miss-requests", type=int, default=12)
    parser.add_argument("--miss-new-tokens", type=int, default=64)
    parser.add_argument("--no-misses", action="store_true")
    parser.add_argument("--report", help="write the JSON report here")
    args = parser.parse_args(argv)
    model = modelpool.supervisor.backend_choice.prepared_model(args.model, "llama_cpp")

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    report: Json = {"kill": kill_runs(args, model, log)}
    if not args.no_misses:
        report["misses"] = miss_runs(args, model, log)
    text = json.dumps(report, indent=2)
    print(text)
    if args.report:
        Path(args.report).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
