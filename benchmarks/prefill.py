"""A long prompt admitted into a running batch: what the running rows pay (issue 26).

One hf worker batching up to 8 (the embedded SmolLM2, float32, one torch thread, as the
review measured it), three requests streaming; once they stream, a prompt of about
``--prompt-tokens`` tokens is submitted. Measured on the running rows:

- **inter-token latency**: the gaps between their chunks before the long prompt came
  (a normal step) and while it was prefilled (until its first token): p50 and max, and
  the max as a multiple of the normal step's p50 (the target is under 3x);
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
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import json
import statistics
import threading
import time
from collections.abc import Sequence
from typing import Any

from modelpool import ModelPool, PoolConfig, PoolError

Json = dict[str, Any]

SENTENCE = "The quick brown fox jumps over the lazy dog near the quiet river bank. "
RUNNING_ROWS = 3


def long_prompt(tokens: int) -> str:
    # About 15 tokens a sentence with SmolLM2's tokenizer; the worker reports the count.
    return SENTENCE * max(1, tokens // 15)


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


def _pool(model_dir: str, *, batch: int, stall_timeout_s: float | None = None) -> ModelPool:
    return ModelPool(
        PoolConfig(
            model=model_dir,
            backend="hf",
            backend_options={"dtype": "float32", "torch_threads": 1},
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


def _start_running(pool: ModelPool, count: int) -> list[Streamer]:
    """``count`` running requests, each past its first dozen chunks."""
    streamers = [Streamer(pool, index) for index in range(count)]
    for streamer in streamers:
        streamer.start()
    _wait_streaming(streamers, 12)
    return streamers


def _gaps(times: Sequence[float]) -> list[tuple[float, float]]:
    return list(itertools.pairwise(times))


def inter_token_latency(model_dir: str, prompt_tokens: int) -> Json:
    with _pool(model_dir, batch=8) as pool:
        streamers = _start_running(pool, RUNNING_ROWS)
        submitted = time.perf_counter()
        long = pool.stream(long_prompt(prompt_tokens), max_new_tokens=4)
        first: float | None = None
        for _ in long:
            first = first or time.perf_counter()
        first = first or time.perf_counter()
        _wait_streaming(streamers, max(len(s.times) for s in streamers) + 3)
        for streamer in streamers:
            streamer.stream.close()
        normal = [
            end - start
            for s in streamers
            for start, end in [gap for gap in _gaps(s.times) if gap[1] <= submitted][-10:]
        ]
        during = [
            end - start
            for s in streamers
            for start, end in _gaps(s.times)
            if end > submitted and start < first
        ]
        normal_p50 = statistics.median(normal)
        result = long.result
        return {
            "prompt_tokens": None if result is None else result.prompt_tokens,
            "normal_step_p50_s": normal_p50,
            "during_prefill_p50_s": statistics.median(during) if during else None,
            "during_prefill_max_s": max(during) if during else None,
            "max_over_normal": (max(during) / normal_p50) if during else None,
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


def run(model_dir: str, prompt_tokens: int, rounds: int, log: Any = print) -> Json:
    report: Json = {"rounds": []}
    for round_index in range(rounds):
        log(f"prefill: round {round_index + 1}: inter-token latency")
        itl = inter_token_latency(model_dir, prompt_tokens)
        log(f"prefill: round {round_index + 1}: cancel during a prefill")
        cancel = cancel_during_prefill(model_dir, prompt_tokens)
        log(f"prefill: round {round_index + 1}: an honest long prompt, stall_timeout_s=4")
        stall = honest_prompt_under_stall_clock(model_dir, prompt_tokens)
        report["rounds"].append({"itl": itl, "cancel": cancel, "stall": stall})
    return report


def markdown(report: Json) -> str:
    lines = [
        "| round | prompt tokens | normal step p50 | during prefill p50 / max | max / step "
        "| long TTFT | cancel to end | kills, innocents lost | stall_timeout_s=4 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for index, entry in enumerate(report["rounds"], 1):
        itl, cancel, stall = entry["itl"], entry["cancel"], entry["stall"]
        lines.append(
            f"| {index} | {itl['prompt_tokens']} | {itl['normal_step_p50_s'] * 1000:.0f} ms "
            f"| {_ms(itl['during_prefill_p50_s'])} / {_ms(itl['during_prefill_max_s'])} "
            f"| {itl['max_over_normal']:.1f}x | {itl['long_ttft_s']:.2f} s "
            f"| {cancel['cancel_to_end_s']:.2f} s | {cancel['kills']}, "
            f"{cancel['innocents_failed']} | {stall['outcome']} in {stall['seconds']:.1f} s, "
            f"{stall['stalls']} stalls |"
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
    args = parser.parse_args(argv)
    from modelpool.embedded import resolve_model

    report = run(resolve_model(args.model), args.prompt_tokens, args.rounds)
    print(markdown(report))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
