"""Admission by predicted wait under overload: the mean-run rule against sizes (issue 57).

A pool of testing workers (``tokens:N:DELAY``, so a run's length is known) is offered
twice its capacity, Poisson arrivals of mixed sizes (most runs short, a few long), each
request with ``max_queue_time_s`` and a deadline. Twice in one run, each on a fresh pool
warmed with the same few runs: first with the rule before issue 57, every queued run
counted at the pool's mean run (``MeanRunPredictor``, kept here only, for the
comparison), then with the pool's own rule, each queued run from its own prompt and
expected output at the measured rates. Per rule: the share of the requests refused at
once (``QueueFull``), the share admitted but then timed out (``DeadlineExceeded``: a
late timeout), the share admitted whose first token came after their
``max_queue_time_s`` (the promise admission made), and the p50/p99 time to first token
of the answered ones::

    python -m benchmarks.admission                  # 60 s per rule: about 2.5 minutes
    python -m benchmarks.admission --seconds 20     # quicker, noisier
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from modelpool import DeadlineExceeded, ModelPool, PoolConfig, PoolFuture, QueueFull, Result
from modelpool.scheduling.prediction import MIN_SAMPLES, MIN_SHARE, WaitPredictor
from modelpool.scheduling.sizes import InFlight, RunSize, Work

TOKEN_S = 0.02  # the testing backend's delay before each token
SIZES = ((4, 0.8), (100, 0.2))  # (tokens, share of the requests): mean 20.8 tokens


class MeanRunPredictor(WaitPredictor):
    """The rule before issue 57, as it was: the ``ahead - free + 1``-th in line waits for
    that many runs to end, every one at the pool's mean run plus its spread whatever its
    size, then a mean time to first token."""

    def predict_ttft(
        self,
        *,
        ahead: Work,
        free: int,
        capacity: int,
        urgent_share: float = 0.0,
        size: RunSize | None = None,
        in_flight: InFlight | None = None,
        now: float = 0.0,
        spread: bool = True,
    ) -> float | None:
        if self.samples < MIN_SAMPLES or capacity <= 0:
            return None
        in_line = max(0, ahead.runs - free + 1)
        lost = self.preempted_share if urgent_share > 0 else 0.0
        left_for_it = max(1.0 - urgent_share - lost, MIN_SHARE)
        return in_line * self.mean_run_s() / (capacity * left_for_it) + self.ttft_s


@dataclass
class Outcome:
    rule: str
    sent: int = 0
    refused: int = 0
    late_timeouts: int = 0
    past_bound: int = 0
    answered: int = 0
    other_errors: int = 0
    ttft_s: list[float] = field(default_factory=list)

    def row(self) -> dict[str, Any]:
        admitted = max(1, self.sent - self.refused)
        ttft = sorted(self.ttft_s)
        return {
            "rule": self.rule,
            "sent": self.sent,
            "refused_early": round(self.refused / max(1, self.sent), 3),
            "late_timeouts": round(self.late_timeouts / max(1, self.sent), 3),
            "late_of_admitted": round(self.late_timeouts / admitted, 3),
            "past_bound_of_admitted": round(self.past_bound / admitted, 3),
            "answered": round(self.answered / max(1, self.sent), 3),
            "ttft_p50_s": round(statistics.median(ttft), 2) if ttft else None,
            "ttft_p99_s": round(ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))], 2)
            if ttft
            else None,
            "other_errors": self.other_errors,
        }


def _tokens(rng: random.Random) -> int:
    pick = rng.random()
    for tokens, share in SIZES:
        if pick < share:
            return tokens
        pick -= share
    return SIZES[-1][0]


def run_rule(
    rule: str, rule_class: type[WaitPredictor] | None, args: argparse.Namespace
) -> Outcome:
    config = PoolConfig(
        model="none",
        backend="testing",
        workers=args.workers,
        devices=("cpu",),
        max_queue_time_s=args.bound,
        deadline_s=args.deadline,
        max_queue=100_000,
    )
    outcome = Outcome(rule)
    lock = threading.Lock()
    pending: list[PoolFuture] = []
    with ModelPool(config) as pool:
        loop = pool._loop  # the benchmark's one reach inside: the rule to compare
        assert loop is not None
        if rule_class is not None:
            # The one predictor the dispatcher and its parts share, given the old rule.
            loop.dispatcher.predictor.__class__ = rule_class
        rng = random.Random(args.seed)
        for tokens in (4, 4, 100, 4, 4, 4):  # the same warm-up for both rules
            pool.generate(f"tokens:{tokens}:{TOKEN_S}", max_new_tokens=tokens)
        mean_tokens = sum(tokens * share for tokens, share in SIZES)
        capacity_per_s = args.workers / (mean_tokens * TOKEN_S)
        rate = args.load * capacity_per_s

        def done(future: Future[Result]) -> None:
            try:
                result = future.result()
            except DeadlineExceeded:
                with lock:
                    outcome.late_timeouts += 1
                return
            except Exception:
                with lock:
                    outcome.other_errors += 1
                return
            ttft = result.ttft_s if result.ttft_s is not None else result.latency_s
            with lock:
                outcome.answered += 1
                outcome.ttft_s.append(ttft)
                if ttft > args.bound:
                    outcome.past_bound += 1

        started = time.monotonic()
        next_at = started
        while next_at - started < args.seconds:
            time.sleep(max(0.0, next_at - time.monotonic()))
            tokens = _tokens(rng)
            outcome.sent += 1
            try:
                future = pool.submit(f"tokens:{tokens}:{TOKEN_S}", max_new_tokens=tokens)
            except QueueFull:
                outcome.refused += 1
            else:
                pending.append(future)
                future.add_done_callback(done)
            next_at += rng.expovariate(rate)
        for future in pending:
            try:
                future.result(timeout=args.deadline + 30)
            except Exception:
                pass  # counted by its callback
    return outcome


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="arrivals per rule")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--load", type=float, default=2.0, help="offered load / capacity")
    parser.add_argument("--bound", type=float, default=2.0, help="max_queue_time_s")
    parser.add_argument("--deadline", type=float, default=6.0, help="deadline_s")
    parser.add_argument("--seed", type=int, default=57)
    parser.add_argument("--json", action="store_true", help="print JSON lines only")
    args = parser.parse_args()
    rows = [
        run_rule("mean run (before)", MeanRunPredictor, args).row(),
        run_rule("sizes (now)", None, args).row(),
    ]
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return
    print(
        f"{args.workers} one-call testing workers, offered {args.load:g}x capacity for "
        f"{args.seconds:g} s per rule; runs of {' / '.join(str(t) for t, _ in SIZES)} tokens "
        f"at {TOKEN_S * 1000:g} ms; max_queue_time_s={args.bound:g}, "
        f"deadline_s={args.deadline:g}"
    )
    columns = list(rows[0])
    widths = [max(len(column), *(len(str(row[column])) for row in rows)) for column in columns]
    print("  ".join(column.ljust(width) for column, width in zip(columns, widths, strict=True)))
    for row in rows:
        cells = (
            str(row[column]).ljust(width) for column, width in zip(columns, widths, strict=True)
        )
        print("  ".join(cells))


if __name__ == "__main__":
    main()
