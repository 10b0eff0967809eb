"""What structured outputs cost: constrained decoding's tokens/s over unconstrained, on the
same prompts, at batch 1 and batch 8; and the time to first token of a schema seen for the
first time against the same schema once cached.

Both sides generate exactly ``--tokens`` tokens per request: the unconstrained side with
``min_new_tokens`` (end-of-sequence suppressed), the constrained side under a schema that
cannot be complete sooner (``minItems`` far beyond the budget), so the ratio is the
grammar's cost per token (the mask, computed beside the forward pass in a batch, and its
application), not a difference in length. Rounds alternate between the two, to spread the
machine's noise over both.

::

    python -m benchmarks.structured_overhead                 # embedded SmolLM2, CPU
    python -m benchmarks.structured_overhead --tokens 64 --rounds 3

Results and the command behind them: docs/structured-outputs.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid
from collections.abc import Sequence
from typing import Any

from modelpool import ModelPool, PoolConfig

ITEM = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "name": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["fruit", "tool", "animal"]},
        "ok": {"type": "boolean"},
    },
    "required": ["id", "name", "kind", "ok"],
    "additionalProperties": False,
}
LONG_SCHEMA = {"type": "array", "items": ITEM, "minItems": 500}
QUESTIONS = (
    "List some things you can find in a kitchen.",
    "Name animals that live in the sea.",
    "Which fruits are red?",
    "Give me tools a carpenter uses.",
    "What can you see in a forest?",
    "Things found in a school bag.",
    "Write down some farm animals.",
    "Kinds of vegetables for a soup.",
)


def prompts(count: int) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(count)]


def tokens_per_s(pool: ModelPool, batch: int, tokens: int, constrained: bool) -> float:
    """Throughput of ``batch`` requests at once (one at a time for batch 1), 8 in all."""
    params: dict[str, Any] = {"max_new_tokens": tokens}
    if constrained:
        params["response_format"] = LONG_SCHEMA
    else:
        params["min_new_tokens"] = tokens
    generated = 0
    started = time.perf_counter()
    for offset in range(0, 8, batch):
        futures = [pool.submit(prompt, **params) for prompt in prompts(8)[offset : offset + batch]]
        for future in futures:
            result = future.result()
            generated += result.completion_tokens or 0
    return generated / (time.perf_counter() - started)


def first_token_s(pool: ModelPool, schema: dict[str, Any]) -> float:
    stream = pool.stream(prompts(1)[0], response_format=schema, max_new_tokens=4)
    started = time.perf_counter()
    next(iter(stream))
    seconds = time.perf_counter() - started
    for _ in stream:
        pass
    return seconds


def fresh_schema() -> dict[str, Any]:
    """A schema of some size, new to the worker's cache each time (a new property name)."""
    properties = {f"field_{index}": ITEM for index in range(20)}
    properties[f"unique_{uuid.uuid4().hex[:8]}"] = {"type": "string", "maxLength": 8}
    return {"type": "object", "properties": properties, "required": sorted(properties)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--model", default="embedded:smollm2-135m-instruct")
    parser.add_argument("--tokens", type=int, default=48, help="tokens per request")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--ttft-samples", type=int, default=5)
    parser.add_argument("--torch-threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    print(f"model {args.model}, {args.tokens} tokens a request, {args.rounds} rounds\n")
    first: list[float] = []
    cached: list[float] = []
    print("| batch | unconstrained tok/s | constrained tok/s | ratio |")
    print("|---|---|---|---|")
    for batch in (1, 8):
        config = PoolConfig(
            model=args.model,
            backend="hf",
            workers=1,
            max_batch_size=batch,
            devices=("cpu",),
            deadline_s=600.0,
            backend_options={"dtype": "float32", "torch_threads": args.torch_threads},
        )
        with ModelPool(config) as pool:
            tokens_per_s(pool, batch, 4, True)  # the tokenizer's llguidance view, once
            free: list[float] = []
            constrained: list[float] = []
            for _ in range(args.rounds):
                free.append(tokens_per_s(pool, batch, args.tokens, False))
                constrained.append(tokens_per_s(pool, batch, args.tokens, True))
            ratio = statistics.median(constrained) / statistics.median(free)
            print(
                f"| {batch} | {statistics.median(free):.1f} | "
                f"{statistics.median(constrained):.1f} | {ratio:.2f} |"
            )
            if batch == 1:
                first = [first_token_s(pool, fresh_schema()) for _ in range(args.ttft_samples)]
                cached_schema = fresh_schema()
                first_token_s(pool, cached_schema)
                cached = [first_token_s(pool, cached_schema) for _ in range(args.ttft_samples)]
    print()
    print("| time to first token (batch 1, p50) | seconds |")
    print("|---|---|")
    print(f"| schema seen for the first time | {statistics.median(first):.3f} |")
    print(f"| the same schema, cached | {statistics.median(cached):.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
