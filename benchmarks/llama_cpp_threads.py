"""The llama_cpp engine's decode rate by ggml thread count and batch size, in one run.

Where the batched throughput of ``benchmarks.llama_cpp`` goes: one handler per thread
count (the embedded SmolLM2 GGUF), driven in this process through ``admit``/``step``
(no pool, no pipes), each batch of rows decoding a fixed number of tokens. Rounds
interleave the thread counts so that a machine whose load moves affects them alike;
the report gives the median tok/s of each and its ratio to the first thread count,
and the share of the wall time spent inside ``llama_decode`` (the rest is the
per-row Python: token choice, text, stop strings)::

    python -m benchmarks.llama_cpp_threads                       # threads 1 2, batch 1 8
    python -m benchmarks.llama_cpp_threads --threads 1 2 4 --batch 1 4 8 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from modelpool.shared.protocol import Generation, Prompt
from modelpool.worker.backends.llama_cpp.handler import LlamaCppHandler, load_generation


@dataclass(eq=False)
class _Call:
    """A BatchCall that keeps nothing: the benchmark reads the Generation."""

    prompt: Prompt
    params: dict[str, Any]
    chunks: list[str] = field(default_factory=list)

    def cancelled(self) -> bool:
        return False

    def emit(self, text: str) -> None:
        self.chunks.append(text)

    def delivered(self, tokens: int = 1) -> None:
        del tokens

    def prefilled(self, tokens: int) -> None:
        del tokens


@dataclass
class _Timed:
    """The handler's runtime with its ``decode`` timed."""

    decode_s: float = 0.0


def one_batch(handler: LlamaCppHandler, batch: int, new_tokens: int) -> tuple[float, float]:
    """tok/s of ``batch`` rows decoding ``new_tokens`` each (the prompts' prefill
    included), and the share of the wall time inside ``llama_decode``."""
    runtime = handler.runtime
    timed = _Timed()
    decode = runtime.decode

    def timed_decode(*args: Any) -> int:
        began = time.perf_counter()
        try:
            return decode(*args)
        finally:
            timed.decode_s += time.perf_counter() - began

    runtime.decode = timed_decode  # type: ignore[method-assign,assignment]
    params = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens}
    calls = [
        _Call(f"Write a short story about lighthouse keeper {n}.", params) for n in range(batch)
    ]
    began = time.perf_counter()
    for call in calls:
        handler.admit(call)
    tokens = 0
    ended = 0
    try:
        while ended < batch:
            for _call, outcome in handler.step():
                assert isinstance(outcome, Generation), outcome
                ended += 1
                tokens += outcome.completion_tokens or 0
    finally:
        runtime.decode = decode  # type: ignore[method-assign]
    wall = time.perf_counter() - began
    return tokens / wall, timed.decode_s / wall


def run(args: argparse.Namespace) -> dict[str, Any]:
    from modelpool.shared.embedded import prepare_gguf

    gguf_dir = str(prepare_gguf())
    handlers = {threads: load_generation(gguf_dir, threads=threads) for threads in args.threads}
    rates: dict[tuple[int, int], list[float]] = {}
    decode_shares: dict[tuple[int, int], list[float]] = {}
    for round_index in range(args.rounds):
        order = list(args.threads) if round_index % 2 == 0 else list(reversed(args.threads))
        for batch in args.batch:
            for threads in order:
                rate, share = one_batch(handlers[threads], batch, args.new_tokens)
                rates.setdefault((threads, batch), []).append(rate)
                decode_shares.setdefault((threads, batch), []).append(share)
    first = args.threads[0]
    report: dict[str, Any] = {"load_average": os.getloadavg(), "rows": []}
    for batch in args.batch:
        base = statistics.median(rates[(first, batch)])
        for threads in args.threads:
            rate = statistics.median(rates[(threads, batch)])
            row = {
                "threads": threads,
                "batch": batch,
                "tok_s": round(rate, 1),
                f"ratio_to_{first}_threads": round(rate / base, 2),
                "decode_share": round(statistics.median(decode_shares[(threads, batch)]), 3),
            }
            report["rows"].append(row)
            print(json.dumps(row), flush=True)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--report", default=None, help="write the JSON report here")
    args = parser.parse_args()
    report = run(args)
    print(f"load average: {report['load_average']}")
    if args.report:
        with open(args.report, "w") as handle:
            json.dump(report, handle, indent=2)


if __name__ == "__main__":
    main()
