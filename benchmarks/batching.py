"""Scenario (g) of scripts/bench: in-worker batching against today's one-at-a-time pool.

Closed-loop clients (each sends its next request when the last one ends) at several
concurrencies, through the pool's public streaming API, on the same model, cores and
worker count; only ``max_batch_size`` differs between the contenders. Chat prompts of
mixed lengths, greedy, a fixed number of new tokens. For each contender and
concurrency: output tokens per second, request latency p50/p99 and time to first token
p50/p99; the batched pool's figures are printed beside the unbatched pool's with their
ratios. A static left-padded ``generate()`` batch in-process is the ceiling at the
highest concurrency::

    python -m benchmarks.batching --concurrency 1 2 4 8 16 --new-tokens 64
    scripts/bench --scenarios g

Not measured here yet: ``transformers serve --continuous-batching`` through HTTP beside
modelpool's daemon, and the GPU sweep.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from modelpool import ModelPool, PoolConfig

Json = dict[str, Any]

QUESTIONS = (
    "What is the capital of France?",
    "Write two sentences about the sea, the wind, and a small boat leaving the harbour.",
    "List three prime numbers.",
    "Explain in a few words why the sky is blue, and what happens to the colour at sunset "
    "when the light travels through more of the atmosphere.",
    "Name a fruit.",
    "Describe a quiet morning in a mountain village.",
)


def chat_prompt(index: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": QUESTIONS[index % len(QUESTIONS)]}]


def percentile(samples: Sequence[float], fraction: float) -> float | None:
    if not samples:
        return None
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def closed_loop(pool: ModelPool, concurrency: int, requests: int, new_tokens: int) -> Json:
    """``concurrency`` clients share ``requests`` requests; each streams to time its first
    token. Tokens per second: completion tokens over the wall time of the whole level."""
    tickets = iter(range(requests))
    lock = threading.Lock()
    latencies: list[float] = []
    first_tokens: list[float] = []
    tokens = [0]
    errors: list[str] = []

    def client() -> None:
        while True:
            with lock:
                index = next(tickets, None)
            if index is None:
                return
            began = time.perf_counter()
            first: float | None = None
            try:
                stream = pool.stream(
                    chat_prompt(index), max_new_tokens=new_tokens, min_new_tokens=new_tokens
                )
                for _ in stream:
                    if first is None:
                        first = time.perf_counter() - began
                result = stream.result
            except Exception as exc:  # a failed request is a result, not a crash of the run
                with lock:
                    errors.append(repr(exc))
                continue
            with lock:
                latencies.append(time.perf_counter() - began)
                if first is not None:
                    first_tokens.append(first)
                tokens[0] += (result.completion_tokens or 0) if result is not None else 0

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    return {
        "concurrency": concurrency,
        "requests": len(latencies),
        "errors": errors,
        "wall_s": wall,
        "tokens": tokens[0],
        "tokens_per_s": tokens[0] / wall if wall > 0 else None,
        "latency_p50_s": percentile(latencies, 0.5),
        "latency_p99_s": percentile(latencies, 0.99),
        "ttft_p50_s": percentile(first_tokens, 0.5),
        "ttft_p99_s": percentile(first_tokens, 0.99),
    }


def cancel_in_full_batch(pool: ModelPool, batch: int, workers: int) -> Json:
    """Fill every worker's batch with long streams, cancel one, and time until its stream
    ends, against the decoding step (the median gap between the others' chunks then)."""
    streams = [
        pool.stream(chat_prompt(index), max_new_tokens=200, min_new_tokens=200)
        for index in range(batch * workers)
    ]
    victim, others = streams[0], streams[1:]
    gaps: list[float] = []
    done = threading.Event()

    def watch(stream: Any) -> None:
        last: float | None = None
        try:
            for _ in stream:
                now = time.perf_counter()
                if last is not None and not done.is_set():
                    gaps.append(now - last)
                last = now
        except concurrent.futures.CancelledError:
            pass  # closed by the measurement once it is over

    watchers = [threading.Thread(target=watch, args=(s,), daemon=True) for s in others]
    for watcher in watchers:
        watcher.start()
    for _ in zip(range(3), victim, strict=False):
        pass  # three chunks: it is decoding inside the batch
    began = time.perf_counter()
    pool.cancel(victim.request_id)
    for _ in victim:
        pass
    cancel_s = time.perf_counter() - began
    done.set()
    for stream in others:
        stream.close()
    for watcher in watchers:
        watcher.join(30)
    step = percentile(gaps, 0.5)
    return {
        "batch": batch,
        "cancel_s": cancel_s,
        "step_s": step,
        "finish_reason": victim.result.finish_reason if victim.result else None,
        "within_step_plus_10ms": step is not None and cancel_s <= step + 0.010,
    }


def static_batch_ceiling(
    model_dir: str, batch: int, new_tokens: int, threads: int, dtype: str | None
) -> Json:
    """One left-padded batch of ``batch`` chat prompts through ``generate()``, in-process."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    kwargs: dict[str, Any] = {} if dtype is None else {"dtype": getattr(torch, dtype)}
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
    model.eval()
    texts = [
        tokenizer.apply_chat_template(chat_prompt(i), add_generation_prompt=True, tokenize=False)
        for i in range(batch)
    ]
    inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.inference_mode():
        model.generate(**inputs, max_new_tokens=2, do_sample=False)  # warm-up
        started = time.perf_counter()
        model.generate(
            **inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False
        )
        wall = time.perf_counter() - started
    return {"batch": batch, "wall_s": wall, "tokens_per_s": batch * new_tokens / wall}


def run(
    model_dir: str,
    *,
    workers: int,
    batch_sizes: Sequence[int],
    concurrencies: Sequence[int],
    new_tokens: int,
    requests_per_client: int,
    dtype: str | None,
    ceiling: bool,
    log: Any = print,
) -> Json:
    """Every concurrency level on every contender, the contenders interleaved per level."""
    options: dict[str, Any] = {} if dtype is None else {"dtype": dtype}
    pools: dict[int, ModelPool] = {}
    results: dict[str, dict[str, Json]] = {str(size): {} for size in batch_sizes}
    try:
        for size in batch_sizes:
            log(f"(g) starting {workers} worker(s) with max_batch_size={size}")
            pools[size] = ModelPool(
                PoolConfig(
                    model=model_dir,
                    backend="hf",
                    backend_options=options,
                    workers=workers,
                    max_batch_size=size,
                    devices=("cpu",),
                    deadline_s=1800.0,
                    max_queue=4096,
                )
            ).start()
            pools[size].generate(chat_prompt(0), max_new_tokens=2)
        for level, concurrency in enumerate(concurrencies):
            # The order flips every level so drift on a shared machine favours nobody.
            order = list(batch_sizes) if level % 2 == 0 else list(reversed(batch_sizes))
            for size in order:
                log(f"(g) concurrency {concurrency}, max_batch_size={size}")
                results[str(size)][str(concurrency)] = closed_loop(
                    pools[size], concurrency, concurrency * requests_per_client, new_tokens
                )
        batched = max(batch_sizes)
        cancel: Json | None = None
        if batched > 1:
            log(f"(g) cancel one request in a full batch of {batched}")
            cancel = cancel_in_full_batch(pools[batched], batched, workers)
    finally:
        for pool in pools.values():
            pool.close(drain=False, timeout=10.0)
    report: Json = {
        "workers": workers,
        "new_tokens": new_tokens,
        "requests_per_client": requests_per_client,
        "batch_sizes": list(batch_sizes),
        "concurrencies": list(concurrencies),
        "contenders": results,
        "cancel_in_batch": cancel,
    }
    if ceiling:
        from modelpool.spawn import usable_cpus

        top = max(concurrencies)
        log(f"(g) static generate() batch of {top}, in-process")
        report["static_batch"] = static_batch_ceiling(
            model_dir, top, new_tokens, usable_cpus(), dtype
        )
    return report


def _fmt(value: float | None, unit: str = "s") -> str:
    if value is None:
        return "-"
    return f"{value:.2f}{unit}" if unit == "s" else f"{value:.1f}"


def _ratio(value: float | None, reference: float | None) -> str:
    if value is None or not reference:
        return "-"
    return f"{value / reference:.2f}x"


def markdown(report: Mapping[str, Any]) -> str:
    """The side-by-side table: every batched contender against the first (unbatched) one."""
    sizes = [str(size) for size in report["batch_sizes"]]
    base, others = sizes[0], sizes[1:]
    contenders = report["contenders"]
    headers = ["clients", f"tok/s b{base}"]
    for size in others:
        headers += [f"tok/s b{size}", "ratio"]
    headers += [f"latency p50/p99 b{base}"] + [f"b{size}" for size in others]
    headers += [f"TTFT p50/p99 b{base}"] + [f"b{size}" for size in others]
    rows = []
    for concurrency in (str(c) for c in report["concurrencies"]):
        reference = contenders[base].get(concurrency, {})
        row = [concurrency, _fmt(reference.get("tokens_per_s"), "")]
        for size in others:
            entry = contenders[size].get(concurrency, {})
            row += [
                _fmt(entry.get("tokens_per_s"), ""),
                _ratio(entry.get("tokens_per_s"), reference.get("tokens_per_s")),
            ]

        def pair(entry: Mapping[str, Any], key: str) -> str:
            return f"{_fmt(entry.get(key + '_p50_s'))}/{_fmt(entry.get(key + '_p99_s'))}"

        row += [pair(reference, "latency")]
        row += [pair(contenders[size].get(concurrency, {}), "latency") for size in others]
        row += [pair(reference, "ttft")]
        row += [pair(contenders[size].get(concurrency, {}), "ttft") for size in others]
        rows.append(row)
    lines = [
        f"## (g) Batching: {report['workers']} worker(s), max_batch_size "
        f"{' vs '.join(sizes)}, {report['new_tokens']} new tokens, closed-loop clients",
        "",
        "| " + " | ".join(headers) + " |",
        "|" + "|".join("---" for _ in headers) + "|",
        *("| " + " | ".join(row) + " |" for row in rows),
    ]
    cancel = report.get("cancel_in_batch")
    if cancel:
        lines += [
            "",
            f"Cancel inside a full batch of {cancel['batch']}: the stream ended "
            f"{_fmt(cancel['cancel_s'])} after pool.cancel(), one decoding step then "
            f"{_fmt(cancel['step_s'])} (target: one step + 10 ms: "
            f"{'met' if cancel['within_step_plus_10ms'] else 'missed'}).",
        ]
    static = report.get("static_batch")
    if static:
        lines += [
            "",
            f"Ceiling: one static left-padded generate() batch of {static['batch']} in-process: "
            f"{static['tokens_per_s']:.1f} tok/s.",
        ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.batching", description=__doc__)
    parser.add_argument("--model", default="embedded:smollm2-135m-instruct")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--no-ceiling", action="store_true")
    parser.add_argument("--json", default=None, help="write the report here")
    args = parser.parse_args(argv)
    from modelpool.embedded import resolve_model

    report = run(
        resolve_model(args.model),
        workers=args.workers,
        batch_sizes=args.batch_sizes,
        concurrencies=args.concurrency,
        new_tokens=args.new_tokens,
        requests_per_client=args.requests_per_client,
        dtype=args.dtype,
        ceiling=not args.no_ceiling,
    )
    print(markdown(report))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
