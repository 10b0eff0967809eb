"""What the worker's bound on thinking does, and what it costs (docs/reasoning.md).

1. Precision: 100 requests, each with a random ``thinking_token_budget``: the thinking
   tokens against the budget (target: never more than the budget, the end of thinking
   then forced). On the testing backend's scripted thinker the thinking tokens are
   counted independently, as the words of the returned reasoning; on the tiny random
   DeepSeek-R1-like model (hf, batched) by the worker's own count.
2. A looping thinker (the scripted ``think:loop`` at 2 ms a token, and the tiny model,
   whose greedy thinking repeats itself): the tokens until the forced close and the time
   to the answer's first token, against the same request with ``reasoning_parser =
   "none"`` (no bound: it thinks until ``max_tokens``, and no answer comes).
3. Cost: the tracker's and the split's own time per token, in process; and tokens/s and
   time to the first token of the tiny model with the bound on against off, on the same
   sampled tokens (rounds alternate), both through the scheduler (``max_batch_size`` 2,
   one request at a time). With ``max_batch_size`` 1 the bound sends a reasoning
   model's requests through the scheduler rather than transformers' ``generate()``, a
   different decoding loop, which is not the bound's cost.

::

    python -m benchmarks.reasoning                      # CPU, about two minutes
    python -m benchmarks.reasoning --only cost --rounds 15
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from modelpool import ModelPool, PoolConfig
from modelpool.shared.reasoning.detect import family_named
from modelpool.shared.reasoning.parsers import ThinkTagParser, split_reasoning
from modelpool.tinymodel import build_thinking_model
from modelpool.worker.backends.common.thinking import ThinkingModel, ThinkingTracker

CHAT = [{"role": "user", "content": "Hello"}]


def _pool(model: str, backend: str, parser: str = "auto", batch: int = 4) -> ModelPool:
    return ModelPool(
        PoolConfig(
            model=model,
            backend=backend,
            workers=1,
            devices=("cpu",),
            max_batch_size=batch,
            deadline_s=120.0,
            reasoning_parser=parser,
        )
    )


def precision_scripted(requests: int) -> dict[str, Any]:
    rng = random.Random(0)
    over = []
    with _pool("none", "testing") as pool:
        for _ in range(requests):
            budget = rng.randint(0, 200)
            result = pool.generate(
                "think:400:done", max_new_tokens=1000, thinking_token_budget=budget
            )
            reasoning, _ = split_reasoning(result.text)
            counted = len((reasoning or "").split())
            over.append(counted - budget)
    return {"requests": requests, "max_over_budget": max(over), "exactly_at_budget": over.count(0)}


def precision_model(model: str, requests: int) -> dict[str, Any]:
    rng = random.Random(1)
    over, closed = [], []
    with _pool(model, "hf") as pool:
        futures = []
        for index in range(requests):
            budget = rng.randint(0, 60)
            params: dict[str, Any] = {"max_new_tokens": 100, "thinking_token_budget": budget}
            # Sampled, so that no thinking is a loop closed before its budget.
            params.update(temperature=1.0, seed=index, reasoning_answer_reserve=0)
            futures.append((budget, pool.submit(CHAT, **params)))
        for budget, future in futures:
            result = future.result()
            over.append((result.reasoning_tokens or 0) - budget)
            closed.append(result.thinking_closed)
    return {
        "requests": requests,
        "max_over_budget": max(over),
        "exactly_at_budget": over.count(0),
        "closed_by_budget": closed.count("budget"),
    }


def looping(model: str, backend: str, prompt: Any, max_tokens: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for parser in ("auto", "none"):
        with _pool(model, backend, parser, batch=1) as pool:
            started = time.perf_counter()
            first_answer: float | None = None
            text = ""
            stream = pool.stream(prompt, max_new_tokens=max_tokens)
            for chunk in stream:
                text += chunk
                if first_answer is None and "</think>" in text:
                    first_answer = time.perf_counter() - started
            result = stream.result
            assert result is not None
            _, answer = split_reasoning(text)
            out[parser] = {
                "tokens": result.completion_tokens,
                "thinking_tokens": result.reasoning_tokens,
                "closed_by": result.thinking_closed,
                "answer_s": None if first_answer is None else round(first_answer, 3),
                "total_s": round(time.perf_counter() - started, 3),
                "answer": answer[:24] if "</think>" in text else None,
                "finish_reason": result.finish_reason,
            }
    return out


def cost(model: str, rounds: int, tokens: int) -> dict[str, Any]:
    rates: dict[str, list[float]] = {"auto": [], "none": []}
    firsts: dict[str, list[float]] = {"auto": [], "none": []}
    pools = {parser: _pool(model, "hf", parser, batch=2) for parser in rates}
    params: dict[str, Any] = {"max_new_tokens": tokens, "min_new_tokens": tokens}
    params.update(temperature=1.0, thinking_token_budget=1 << 20, reasoning_answer_reserve=0)
    try:
        for pool in pools.values():
            pool.start()
            pool.generate(CHAT, **params, seed=0)  # warm
        for round_ in range(rounds):
            # Each side goes first every other round: the machine's drift hits both.
            order = list(pools.items())[:: 1 if round_ % 2 else -1]
            for parser, pool in order:
                started = time.perf_counter()
                first: float | None = None
                stream = pool.stream(CHAT, **params, seed=round_)
                for _ in stream:
                    if first is None:
                        first = time.perf_counter() - started
                elapsed = time.perf_counter() - started
                result = stream.result
                assert result is not None and first is not None
                rates[parser].append((result.completion_tokens or 0) / elapsed)
                firsts[parser].append(first)
    finally:
        for pool in pools.values():
            pool.close()
    on, off = statistics.median(rates["auto"]), statistics.median(rates["none"])
    first_on, first_off = statistics.median(firsts["auto"]), statistics.median(firsts["none"])
    return {
        "tokens_per_s_on": round(on, 1),
        "tokens_per_s_off": round(off, 1),
        "ratio": round(on / off, 3),
        "first_token_ms_on": round(first_on * 1000, 1),
        "first_token_ms_off": round(first_off * 1000, 1),
    }


def overhead(tokens: int = 200_000) -> dict[str, Any]:
    """The bound's and the split's own cost per token, in process: a tracker fed a thinker
    that never repeats (the loop detector's worst case: no run ends early) and a
    ``ThinkTagParser`` fed one token's text at a time."""
    model = ThinkingModel(family_named("deepseek_r1"), (1,), (2,))
    tracker = ThinkingTracker(model, True, {}, tokens * 2)
    started = time.perf_counter()
    for token in range(3, tokens + 3):
        tracker.take(token)
    take_us = (time.perf_counter() - started) / tokens * 1e6
    parser = ThinkTagParser(started=True)
    started = time.perf_counter()
    for token in range(tokens):
        parser.feed(f" w{token}")
    feed_us = (time.perf_counter() - started) / tokens * 1e6
    return {"tracker_us_per_token": round(take_us, 2), "split_us_per_token": round(feed_us, 2)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--only", choices=("precision", "looping", "cost", "overhead"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        model = str(build_thinking_model(Path(scratch) / "deepseek", "deepseek_r1"))
        if args.only in (None, "precision"):
            print("precision, scripted thinker:", precision_scripted(args.requests))
            print("precision, tiny model:", precision_model(model, args.requests))
        if args.only in (None, "looping"):
            scripted = looping("none", "testing", "think:loop:the answer:0.002", 2000)
            print("looping scripted thinker:", scripted)
            print("looping tiny model:", looping(model, "hf", CHAT, 1000))
        if args.only in (None, "overhead"):
            print("overhead per token:", overhead())
        if args.only in (None, "cost"):
            print("cost, tiny model:", cost(model, args.rounds, args.tokens))


if __name__ == "__main__":
    main()
