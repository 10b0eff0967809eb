"""A long prompt admitted into a running batch: what the running rows pay (issue 26).

One hf worker batching up to ``--batch`` (8; the embedded SmolLM2, float32,
``--threads`` torch threads, default one, as the review measured it; 0: the pool's
default, cores // workers), ``--rows`` requests streaming (3); once each has streamed
``--after`` chunks (12), a prompt of about ``--prompt-tokens`` tokens is submitted
with ``--long-tokens`` to generate (4). Measured on the running rows:

- **inter-token latency**: the gaps between their chunks before the long prompt came
  (a normal step), while it was prefilled (until its first token), and after it joined
  the batch (until it ended: the merge of its cache, and steps over its padded width):
  p50 and max of each, and the worst as a multiple of the normal step's p50 (the target
  is under 3x);
- **cancel during the prefill**: one running request is cancelled while the long prompt
  is being read; the time to its end, and whether the worker was killed for it (an
  ignored cancel) and an innocent lost;
- **an honest long prompt under a stall clock** (``stall_timeout_s=4``): it must
  succeed, with no stall and no kill.

Only the public API is used, so the same script measures any checkout: run it with
``PYTHONPATH=<checkout>/src`` for a before/after pair on one machine.

::

    python -m benchmarks.prefill                       # 3 rounds, about 1,000 tokens
    python -m benchmarks.prefill --rounds 1 --prompt-tokens 300
    # issue 41's held-out check: batch 4, default threads, one row 15 tokens in
    python -m benchmarks.prefill --only itl --batch 4 --threads 0 --rows 1 --after 15 \
        --prompt-tokens 1100
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import itertools
import json
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from modelpool import ModelPool, PoolConfig, PoolError

Json = dict[str, Any]

SENTENCE = "The quick brown fox jumps over the lazy dog near the quiet river bank. "
RUNNING_ROWS = 3


def long_prompt(tokens: int) -> str:
    # About 15 tokens a sentence with SmolLM2's tokenizer; the worker reports the count.
    return SENTENCE * max(1, tokens // 15)


@dataclass(frozen=True)
class Setup:
    """What the pool and the running rows look like (see the module docstring)."""

    batch: int = 8
    threads: int = 1  # 0: the pool's default
    rows: int = RUNNING_ROWS
    after: int = 12
    long_tokens: int = 4


class Streamer(threading.Thread):
    """One running request: streams until closed, recording when each chunk came."""

    def __init__(self, pool: ModelPool, index: int) -> None:
        super().__init__(daemon=True)
        self.stream = pool.stream(
            f"Request {index}: count slowly from one to five hundred.",
            max_new_tokens=2000,
            min_new_tokens=2000,
        )
        self.times: list[float] = []
        self.ended_at: float | None = None
        self.error: str | None = None

    def run(self) -> None:
        try:
            for _ in self.stream:
                self.times.append(time.perf_counter())
        except PoolError as exc:
            self.error = type(exc).__name__
        except concurrent.futures.CancelledError:
            pass  # closed by the benchmark once it has what it measures
        self.ended_at = time.perf_counter()


def _pool(
    model_dir: str, *, batch: int, threads: int = 1, stall_timeout_s: float | None = None
) -> ModelPool:
    options: dict[str, Any] = {"dtype": "float32"}
    if threads:
        options["torch_threads"] = threads
    return ModelPool(
        PoolConfig(
            model=model_dir,
            backend="hf",
            backend_options=options,
            workers=1,
            max_batch_size=batch,
            devices=("cpu",),
            deadline_s=600.0,
            stall_timeout_s=stall_timeout_s,
        )
    ).start()


def _wait_streaming(streamers: Sequence[Streamer], chunks: int) -> None:
    """Until each has ``chunks`` chunks or has ended (a request lost with its worker)."""
    deadline = time.monotonic() + 300
    while any(len(s.times) < chunks and s.ended_at is None for s in streamers):
        if time.monotonic() > deadline:
            raise RuntimeError("the running requests did not stream")
        time.sleep(0.01)


def _start_running(pool: ModelPool, count: int, after: int = 12) -> list[Streamer]:
    """``count`` running requests, each past its first ``after`` chunks."""
    streamers = [Streamer(pool, index) for index in range(count)]
    for streamer in streamers:
        streamer.start()
    _wait_streaming(streamers, after)
    return streamers


def _gaps(times: Sequence[float]) -> list[tuple[float, float]]:
    return list(itertools.pairwise(times))


def inter_token_latency(model_dir: str, prompt_tokens: int, setup: Setup = Setup()) -> Json:
    with _pool(model_dir, batch=setup.batch, threads=setup.threads) as pool:
        streamers = _start_running(pool, setup.rows, setup.after)
        submitted = time.perf_counter()
        long = pool.stream(long_prompt(prompt_tokens), max_new_tokens=setup.long_tokens)
        first: float | None = None
        for _ in long:
            first = first or time.perf_counter()
        ended = time.perf_counter()
        first = first or ended
        _wait_streaming(streamers, max(len(s.times) for s in streamers) + 3)
        for streamer in streamers:
            streamer.stream.close()
        normal = [
            end - start
            for s in streamers
            for start, end in [gap for gap in _gaps(s.times) if gap[1] <= submitted][-10:]
        ]
        all_gaps = [gap for s in streamers for gap in _gaps(s.times)]
        during = [end - start for start, end in all_gaps if end > submitted and start < first]
        # After its first token: the step that merged its cache into the batch's, and the
        # steps the running rows take at its width until it ends.
        joined = [end - start for start, end in all_gaps if end > first and start < ended]
        normal_p50 = statistics.median(normal)
        worst = max(during + joined, default=None)
        result = long.result
        return {
            "prompt_tokens": None if result is None else result.prompt_tokens,
            "normal_step_p50_s": normal_p50,
            "during_prefill_p50_s": statistics.median(during) if during else None,
            "during_prefill_max_s": max(during) if during else None,
            "max_over_normal": (max(during) / normal_p50) if during else None,
            "after_join_p50_s": statistics.median(joined) if joined else None,
            "after_join_max_s": max(joined) if joined else None,
            "worst_over_normal": None if worst is None else worst / normal_p50,
            "long_ttft_s": first - submitted,
        }


def cancel_during_prefill(model_dir: str, prompt_tokens: int) -> Json:
    with _pool(model_dir, batch=8) as pool:
        streamers = _start_running(pool, RUNNING_ROWS)
        long = pool.submit(long_prompt(prompt_tokens), max_new_tokens=4)
        # A benchmark may place an event in time: a quarter of a second into the prefill.
        time.sleep(0.25)
        victim = streamers[0]
        cancelled_at = time.perf_counter()
        pool.cancel(victim.stream.request_id)
        victim.join(timeout=120)
        cancel_s = (victim.ended_at or time.perf_counter()) - cancelled_at
        long_ok = True
        try:
            long.result(timeout=300)
        except PoolError:
            long_ok = False
        _wait_streaming(streamers[1:], max(len(s.times) for s in streamers[1:]) + 3)
        for streamer in streamers[1:]:
            streamer.stream.close()
            streamer.join(timeout=60)
        counters = pool.stats().counters
        return {
            "cancel_to_end_s": cancel_s,
            "kills": counters["kills"],
            "innocents_failed": sum(s.error is not None for s in streamers[1:]),
            "long_ok": long_ok,
        }


def honest_prompt_under_stall_clock(model_dir: str, prompt_tokens: int) -> Json:
    with _pool(model_dir, batch=4, stall_timeout_s=4.0) as pool:
        streamers = _start_running(pool, 2)
        began = time.perf_counter()
        outcome = "ok"
        try:
            pool.generate(long_prompt(prompt_tokens), max_new_tokens=4)
        except PoolError as exc:
            outcome = type(exc).__name__
        elapsed = time.perf_counter() - began
        for streamer in streamers:
            streamer.stream.close()
            streamer.join(timeout=60)
        counters = pool.stats().counters
        return {
            "outcome": outcome,
            "seconds": elapsed,
            "stalls": counters["stalls"],
            "kills": counters["kills"],
        }


def run(
    model_dir: str,
    prompt_tokens: int,
    rounds: int,
    log: Any = print,
    setup: Setup = Setup(),
    only_itl: bool = False,
) -> Json:
    report: Json = {"rounds": [], "setup": dataclasses.asdict(setup)}
    for round_index in range(rounds):
        log(f"prefill: round {round_index + 1}: inter-token latency")
        itl = inter_token_latency(model_dir, prompt_tokens, setup)
        if only_itl:
            report["rounds"].append({"itl": itl})
            continue
        log(f"prefill: round {round_index + 1}: cancel during a prefill")
        cancel = cancel_during_prefill(model_dir, prompt_tokens)
        log(f"prefill: round {round_index + 1}: an honest long prompt, stall_timeout_s=4")
        stall = honest_prompt_under_stall_clock(model_dir, prompt_tokens)
        report["rounds"].append({"itl": itl, "cancel": cancel, "stall": stall})
    return report


def markdown(report: Json) -> str:
    if any("cancel" not in entry for entry in report["rounds"]):
        return _itl_markdown(report)
    lines = [
        "| round | prompt tokens | normal step p50 | during prefill p50 / max | max / step "
        "| after it joined max | worst / step "
        "| long TTFT | cancel to end | kills, innocents lost | stall_timeout_s=4 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for index, entry in enumerate(report["rounds"], 1):
        itl, cancel, stall = entry["itl"], entry["cancel"], entry["stall"]
        lines.append(
            f"| {index} | {itl['prompt_tokens']} | {itl['normal_step_p50_s'] * 1000:.0f} ms "
            f"| {_ms(itl['during_prefill_p50_s'])} / {_ms(itl['during_prefill_max_s'])} "
            f"| {itl['max_over_normal']:.1f}x | {_ms(itl['after_join_max_s'])} "
            f"| {itl['worst_over_normal']:.1f}x | {itl['long_ttft_s']:.2f} s "
            f"| {cancel['cancel_to_end_s']:.2f} s | {cancel['kills']}, "
            f"{cancel['innocents_failed']} | {stall['outcome']} in {stall['seconds']:.1f} s, "
            f"{stall['stalls']} stalls |"
        )
    return "\n".join(lines)


def _itl_markdown(report: Json) -> str:
    lines = [
        "| round | prompt tokens | normal step p50 | during prefill p50 / max "
        "| after it joined p50 / max | worst / step | long TTFT |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for index, entry in enumerate(report["rounds"], 1):
        itl = entry["itl"]
        worst = itl["worst_over_normal"]
        lines.append(
            f"| {index} | {itl['prompt_tokens']} | {itl['normal_step_p50_s'] * 1000:.0f} ms "
            f"| {_ms(itl['during_prefill_p50_s'])} / {_ms(itl['during_prefill_max_s'])} "
            f"| {_ms(itl['after_join_p50_s'])} / {_ms(itl['after_join_max_s'])} "
            f"| {'-' if worst is None else f'{worst:.1f}x'} | {itl['long_ttft_s']:.2f} s |"
        )
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f} ms"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.prefill",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default="embedded:smollm2-135m-instruct")
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None, help="write the report here")
    parser.add_argument("--batch", type=int, default=Setup.batch, help="max_batch_size")
    parser.add_argument(
        "--threads", type=int, default=Setup.threads, help="torch threads (0: the pool's default)"
    )
    parser.add_argument("--rows", type=int, default=Setup.rows, help="running requests")
    parser.add_argument(
        "--after", type=int, default=Setup.after, help="their chunks before the long prompt"
    )
    parser.add_argument("--long-tokens", type=int, default=Setup.long_tokens)
    parser.add_argument("--only", choices=["itl"], help="the inter-token latency alone")
    args = parser.parse_args(argv)
    from modelpool.shared.embedded import resolve_model

    setup = Setup(args.batch, args.threads, args.rows, args.after, args.long_tokens)
    report = run(
        resolve_model(args.model),
        args.prompt_tokens,
        args.rounds,
        setup=setup,
        only_itl=args.only == "itl",
    )
    print(markdown(report))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
