"""Prefix caching for agents (issue 28): a backend's prefix cache, side by side.

An agent-like workload: a system prompt of about 1,000 tokens (instructions and tool
definitions), ``--clients`` clients each running a ``--turns``-turn conversation, every
turn sent with the conversation so far, streamed, greedy, a fixed answer length
(``ignore_eos``), up to ``--think-s`` seconds of tool time between turns. In one run:

1. **Cache on vs off**, one batched worker: time to first token and total latency per
   turn, the ratio on/off for turns 2 and later (target <= 0.25), and the hit rate
   (turns with cached tokens; cached over prompt tokens).
2. **Two workers**, cache on: the share of turns 2+ that land where their conversation
   is cached (its previous turn's prompt read from the cache; target >= 0.8), with
   placement that follows the cache against cache-blind placement (the same pool with
   the requests' prefix fingerprints withheld).
3. **Cost when it cannot help**: the batching sweep's closed loop (benchmarks.batching)
   on one worker batching 8, every prompt distinct from its first tokens, cache on vs
   off: output tokens per second (target: within 5 %).

::

    python -m benchmarks.prefix_cache                     # all three, a few minutes on CPU
    python -m benchmarks.prefix_cache --clients 2 --turns 3 --no-sweep
    python -m benchmarks.prefix_cache --backend llama_cpp --no-placement --no-sweep

``--backend llama_cpp`` runs the embedded model's GGUF with its default prefix cache
bound (half of the KV cells) against ``prefix_cache_tokens=0``.

Results and the command behind them: docs/benchmarks.md, prefix caching.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import modelpool.supervisor.backend_choice
from benchmarks.batching import closed_loop, read_to_end, summarize
from modelpool import ModelPool, PoolConfig

Json = dict[str, Any]

INSTRUCTIONS = (
    "You are the operations assistant of a small harbour town. You answer the harbour "
    "master, the ferry crews and visitors. Keep every answer short and factual, name the "
    "tool you would call when one applies, and never invent timetables or prices. "
)
TOOLS = [
    {
        "name": name,
        "description": description,
        "parameters": {
            "type": "object",
            "properties": {
                field: {"type": "string", "description": f"The {field} to use for {name}."}
                for field in fields
            },
            "required": list(fields[:1]),
        },
    }
    for name, description, fields in (
        ("ferry_timetable", "Departures of a ferry line on a given day.", ("line", "day")),
        ("berth_status", "Whether a berth is free, and until when.", ("berth", "time")),
        ("weather_report", "Wind, waves and visibility at the harbour mouth.", ("hours",)),
        ("book_pilot", "Book a pilot for a vessel entering the harbour.", ("vessel", "eta")),
        ("market_prices", "Today's fish and fruit prices at the market.", ("item",)),
        ("lighthouse_log", "Entries of the lighthouse keeper's log.", ("date", "topic")),
        ("tide_table", "High and low tides for a date.", ("date",)),
        ("crew_roster", "Who is on duty on which ferry.", ("ferry", "shift")),
    )
]
QUESTIONS = (
    "When does the first ferry to the island leave tomorrow?",
    "Is berth 4 free this afternoon?",
    "How strong is the wind at the harbour mouth?",
    "Please book a pilot for the cargo ship arriving at six.",
    "What does cod cost at the market today?",
    "Who is on the night shift on the small ferry?",
)


def system_prompt(target_chars: int = 4_200) -> str:
    """Instructions and the tool definitions as the prompt carries them, padded with the
    harbour's standing orders to about ``target_chars`` (about 1,000 SmolLM2 tokens)."""
    text = INSTRUCTIONS + "\n\nTools:\n" + json.dumps(TOOLS, indent=1) + "\n\nStanding orders:\n"
    number = 1
    while len(text) < target_chars:
        text += (
            f"{number}. Log every vessel movement with its time, berth and pilot; report "
            f"anything unusual to the harbour master before the next tide. "
        )
        number += 1
    return text


def conversation(
    pool: ModelPool, client: int, turns: int, system: str, new_tokens: int, think_s: float
) -> list[Json]:
    """One client's turns, each sent with the conversation so far; per turn: time to
    first token, latency, prompt and cached tokens, the worker that answered. Between
    turns the agent "runs a tool" for 0 to ``think_s`` seconds (a fixed pattern), so the
    clients do not move in lockstep."""
    messages = [{"role": "system", "content": system}]
    records = []
    for turn in range(turns):
        if turn:
            time.sleep(think_s * ((client * 7 + turn * 3) % 4) / 3)
        question = QUESTIONS[(client + turn) % len(QUESTIONS)]
        messages.append({"role": "user", "content": f"(client {client}) {question}"})
        began = time.perf_counter()
        first: float | None = None
        stream = pool.stream(messages, max_new_tokens=new_tokens, ignore_eos=True)
        for _ in stream:
            if first is None:
                first = time.perf_counter() - began
        result = stream.result
        assert result is not None
        records.append(
            {
                "client": client,
                "turn": turn + 1,
                "ttft_s": first if first is not None else result.latency_s,
                "latency_s": time.perf_counter() - began,
                "prompt_tokens": result.prompt_tokens or 0,
                "cached_tokens": result.cached_tokens,
                "worker_pid": result.worker_pid,
            }
        )
        messages.append({"role": "assistant", "content": result.text})
    return records


def agents(
    pool: ModelPool, clients: int, turns: int, system: str, new_tokens: int, think_s: float
) -> Json:
    """``clients`` conversations at once; every turn's record, and the wall time."""
    records: list[Json] = []
    lock = threading.Lock()

    def client(number: int) -> None:
        found = conversation(pool, number, turns, system, new_tokens, think_s)
        with lock:
            records.extend(found)

    threads = [threading.Thread(target=client, args=(n,)) for n in range(clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {"wall_s": time.perf_counter() - started, "turns": records}


def per_turn(run: Json) -> dict[int, Json]:
    """Mean time to first token and latency of each turn number, over the clients."""
    table: dict[int, Json] = {}
    for number in sorted({record["turn"] for record in run["turns"]}):
        rows = [record for record in run["turns"] if record["turn"] == number]
        table[number] = {
            "ttft_s": statistics.mean(row["ttft_s"] for row in rows),
            "latency_s": statistics.mean(row["latency_s"] for row in rows),
            "cached_tokens": statistics.mean(row["cached_tokens"] for row in rows),
            "prompt_tokens": statistics.mean(row["prompt_tokens"] for row in rows),
        }
    return table


def later_turns(run: Json, key: str) -> float:
    return statistics.fmean(record[key] for record in run["turns"] if record["turn"] > 1)


def hit_rate(run: Json) -> Json:
    turns = run["turns"]
    return {
        "turns_with_hits": sum(1 for t in turns if t["cached_tokens"] > 0) / len(turns),
        "cached_share_of_prompt_tokens": sum(t["cached_tokens"] for t in turns)
        / max(1, sum(t["prompt_tokens"] for t in turns)),
    }


def landed_on_cache(run: Json) -> float:
    """Share of turns 2+ whose previous turn's prompt came from the cache where they ran."""
    by_client: dict[int, dict[int, Json]] = {}
    for record in run["turns"]:
        by_client.setdefault(record["client"], {})[record["turn"]] = record
    hits = total = 0
    for turns in by_client.values():
        for number, record in turns.items():
            if number == 1:
                continue
            total += 1
            hits += record["cached_tokens"] >= turns[number - 1]["prompt_tokens"]
    return hits / total if total else 0.0


@contextmanager
def cache_blind() -> Iterator[None]:
    """Requests submitted meanwhile carry no prefix fingerprints: placement cannot see
    the cache (the workers still keep and use one)."""
    original = getattr(modelpool.supervisor.pool, "prompt_fingerprints")  # noqa: B009
    setattr(modelpool.supervisor.pool, "prompt_fingerprints", lambda prompt: ())  # noqa: B010
    try:
        yield
    finally:
        setattr(modelpool.supervisor.pool, "prompt_fingerprints", original)  # noqa: B010


def start_pool(
    backend: str, model: str, workers: int, batch: int, cache_bytes: int, threads: int
) -> ModelPool:
    options: Json = {
        "dtype": "float32",
        "prefix_cache_bytes": cache_bytes,
        "torch_threads": threads,
    }
    if backend == "llama_cpp":
        # On: the backend's default bound (half of the KV cells); off: none.
        options = {"threads": threads} | ({} if cache_bytes else {"prefix_cache_tokens": 0})
    pool = ModelPool(
        PoolConfig(
            model=model,
            backend=backend,
            backend_options=options,
            workers=workers,
            max_batch_size=batch,
            devices=("cpu",),
            deadline_s=1800.0,
            max_queue=4096,
        )
    ).start()
    pool.generate("Hello", max_new_tokens=1)
    return pool


def distinct_request(pool: ModelPool, new_tokens: int) -> Any:
    """The sweep's request with nothing shared between prompts past their first tokens."""

    def one(index: int) -> tuple[int, float | None]:
        prompt = [
            {"role": "system", "content": f"Session {index * 7919 % 10007}."},
            {"role": "user", "content": f"{QUESTIONS[index % len(QUESTIONS)]} (#{index})"},
        ]
        began = time.perf_counter()
        return read_to_end(pool.stream(prompt, max_new_tokens=new_tokens, ignore_eos=True), began)

    return one


def run(args: argparse.Namespace, log: Any = print) -> Json:
    model = modelpool.supervisor.backend_choice.prepared_model(args.model, args.backend)
    system = system_prompt(args.system_chars)
    report: Json = {"clients": args.clients, "turns": args.turns, "new_tokens": args.new_tokens}
    on_bytes = args.cache_mib * 2**20

    def workload(pool: ModelPool) -> Json:
        return agents(pool, args.clients, args.turns, system, args.new_tokens, args.think_s)

    for name, cache_bytes in () if args.no_agents else (("off", 0), ("on", on_bytes)):
        log(f"agents, one worker x {args.clients}, cache {name}")
        pool = start_pool(args.backend, model, 1, args.clients, cache_bytes, args.threads)
        try:
            system_message = [{"role": "system", "content": system}]
            report["system_prompt_tokens"] = len(pool.tokenize(system_message))
            run_data = workload(pool)
            report[f"one_worker_cache_{name}"] = {
                **run_data,
                "per_turn": per_turn(run_data),
                "hits": hit_rate(run_data),
                "stats": pool.stats().workers[0].prefix_cache,
            }
        finally:
            pool.close()
    if not args.no_agents:
        off, on = report["one_worker_cache_off"], report["one_worker_cache_on"]
        report["ttft_ratio_turns_2_plus"] = later_turns(on, "ttft_s") / later_turns(off, "ttft_s")
        report["latency_ratio_turns_2_plus"] = later_turns(on, "latency_s") / later_turns(
            off, "latency_s"
        )

    if not args.no_placement:
        for name in ("blind", "aware"):
            log(f"agents, two workers, cache on, placement {name}")
            pool = start_pool(args.backend, model, 2, args.clients, on_bytes, 1)
            try:
                if name == "blind":
                    with cache_blind():
                        run_data = workload(pool)
                else:
                    run_data = workload(pool)
            finally:
                pool.close()
            report[f"two_workers_{name}"] = {
                **run_data,
                "landed_on_cache": landed_on_cache(run_data),
                "ttft_turns_2_plus_s": later_turns(run_data, "ttft_s"),
            }

    if not args.no_sweep:
        pools = {
            name: start_pool(args.backend, model, 1, 8, cache_bytes, args.threads)
            for name, cache_bytes in (("off", 0), ("on", on_bytes))
        }
        try:
            runs: dict[str, list[Json]] = {"off": [], "on": []}
            for round_index in range(args.rounds):
                for concurrency in args.concurrency:
                    order = ["off", "on"] if round_index % 2 == 0 else ["on", "off"]
                    for name in order:
                        log(f"sweep, distinct prompts, cache {name}, concurrency {concurrency}")
                        one = distinct_request(pools[name], args.sweep_tokens)
                        runs[name].append(closed_loop(one, concurrency, concurrency * 2))
            sweep = {name: summarize(level_runs) for name, level_runs in runs.items()}
            report["sweep"] = {
                name: {key: value for key, value in data.items() if key != "runs"}
                for name, data in sweep.items()
            }
            report["sweep_throughput_ratio"] = (
                sweep["on"]["tokens_per_s"] / sweep["off"]["tokens_per_s"]
            )
        finally:
            for pool in pools.values():
                pool.close()
    return report


def markdown(report: Json) -> str:
    lines = [
        f"Agents: {report['clients']} clients x {report['turns']} turns, "
        f"{report['new_tokens']} new tokens a turn",
    ]
    if "one_worker_cache_on" in report:
        lines += _agents_table(report)
    return "\n".join(lines + _rest(report))


def _agents_table(report: Json) -> list[str]:
    off, on = report["one_worker_cache_off"], report["one_worker_cache_on"]
    lines = [
        f"System prompt {report['system_prompt_tokens']} tokens; one worker batching "
        f"{report['clients']}",
        "",
        "| turn | TTFT off | TTFT on | ratio | latency off | latency on | cached tokens on |",
        "|---|---|---|---|---|---|---|",
    ]
    for turn, row in on["per_turn"].items():
        base = off["per_turn"][turn]
        lines.append(
            f"| {turn} | {base['ttft_s']:.2f} s | {row['ttft_s']:.2f} s | "
            f"{row['ttft_s'] / base['ttft_s']:.2f}x | {base['latency_s']:.2f} s | "
            f"{row['latency_s']:.2f} s | {row['cached_tokens']:.0f} of "
            f"{row['prompt_tokens']:.0f} |"
        )
    lines += [
        "",
        f"Turns 2+: TTFT on/off {report['ttft_ratio_turns_2_plus']:.2f}x, latency "
        f"{report['latency_ratio_turns_2_plus']:.2f}x; hits: "
        f"{on['hits']['turns_with_hits']:.0%} of turns, "
        f"{on['hits']['cached_share_of_prompt_tokens']:.0%} of prompt tokens cached; "
        f"wall {off['wall_s']:.1f} s off, {on['wall_s']:.1f} s on",
    ]
    return lines


def _rest(report: Json) -> list[str]:
    lines: list[str] = []
    if "two_workers_aware" in report:
        aware, blind = report["two_workers_aware"], report["two_workers_blind"]
        lines.append(
            f"Two workers: turns 2+ landing where their prefix is cached "
            f"{aware['landed_on_cache']:.0%} (cache-aware) vs {blind['landed_on_cache']:.0%} "
            f"(cache-blind); TTFT turns 2+ {aware['ttft_turns_2_plus_s']:.2f} s vs "
            f"{blind['ttft_turns_2_plus_s']:.2f} s"
        )
    if "sweep" in report:
        sweep = report["sweep"]
        lines.append(
            f"Distinct prompts, 1x8 sweep: {sweep['on']['tokens_per_s']:.1f} tok/s cache on vs "
            f"{sweep['off']['tokens_per_s']:.1f} off ({report['sweep_throughput_ratio']:.2f}x)"
        )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=["hf", "llama_cpp"], default="hf")
    parser.add_argument("--model", default="embedded:smollm2-135m-instruct")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=12)
    parser.add_argument("--system-chars", type=int, default=4_200)
    parser.add_argument("--cache-mib", type=int, default=512)
    parser.add_argument(
        "--think-s", type=float, default=2.0, help="an agent's tool time between turns, at most"
    )
    parser.add_argument("--threads", type=int, default=2, help="CPU threads of one worker")
    parser.add_argument("--no-agents", action="store_true", help="skip cache on vs off")
    parser.add_argument("--no-placement", action="store_true", help="skip the two workers")
    parser.add_argument("--no-sweep", action="store_true", help="skip the distinct sweep")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--sweep-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", help="also write the whole report here")
    args = parser.parse_args(argv)
    report = run(args, log=lambda text: print(f"[{time.strftime('%X')}] {text}", flush=True))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=1, default=str)
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
