"""JSONSchemaBench end to end: real-world JSON schemas through the pool's structured outputs.

Given a checkout of guidance-ai/jsonschemabench (its ``data/`` holds the ten splits, about
10,000 schemas from GitHub, Kubernetes, Snowplow, JSON Schema Store, ...), each sampled
schema goes the way a user's would: the supervisor's check (:mod:`modelpool.shared.structured`,
which refuses what llguidance cannot honour, naming the keyword), then a request with
``response_format=schema`` to a pool of the embedded model (SmolLM2-135M-Instruct), and
its output is validated with ``jsonschema`` (formats checked). Per split:

- **refused**: refused before dispatch (the keywords most often to blame are listed);
- **valid**: generated, ended by the grammar, and valid under ``jsonschema``;
- **invalid**: generated, ended by the grammar, and *not* valid (must be 0);
- **cut**: stopped by ``max_tokens`` before the grammar was complete;
- **timeout**: the compilation outlasted ``grammar_compile_timeout_s`` or the deadline;
- **failed**: any other error (a worker's compile error, a crash);
- **unchecked**: valid JSON that ``jsonschema`` itself cannot check (a remote ``$ref``).

``--compile-only`` skips generation: each schema is checked and compiled against the
model's tokenizer in this process (what a worker does), which takes minutes for the whole
corpus rather than hours::

    python -m benchmarks.jsonschemabench /work/jsb                    # 30 a split, stratified
    python -m benchmarks.jsonschemabench /work/jsb --per-split 5 --max-tokens 256
    python -m benchmarks.jsonschemabench /work/jsb --all --compile-only

Results and the command behind them: docs/structured-outputs.md.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modelpool import ModelPool, PoolConfig
from modelpool.shared.errors import DeadlineExceeded, GrammarCompileTimeout, GrammarError, PoolError
from modelpool.shared.structured import grammar_for_response_format
from modelpool.supervisor.results import PoolFuture

STATUSES = ("refused", "valid", "invalid", "cut", "timeout", "failed", "unchecked")
# MaskBench's published counts (guidance-ai/jsonschemabench, maskbench/): 11,306 schemas.
MASKBENCH = {
    "llguidance": "8,909 passed, 0 segfaults, 0 timeouts of 11,306",
    "XGrammar": "8,122 passed, 37 segfaults, 241 timeouts, 1,408 invalid outputs",
}
PROMPT_SCHEMA_CHARS = 1500


@dataclass
class SplitTally:
    counts: Counter[str] = field(default_factory=Counter)
    reasons: Counter[str] = field(default_factory=Counter)
    invalid: list[str] = field(default_factory=list)


def sample(root: Path, per_split: int | None, seed: int) -> list[tuple[str, Path]]:
    """``per_split`` schemas of each split (all with None), the same ones for a seed."""
    chosen: list[tuple[str, Path]] = []
    for split_dir in sorted((root / "data").iterdir()):
        if not split_dir.is_dir():
            continue
        files = sorted(split_dir.glob("*.json"))
        if per_split is not None:
            files = random.Random(f"{seed}:{split_dir.name}").sample(
                files, min(per_split, len(files))
            )
        chosen += [(split_dir.name, path) for path in files]
    return chosen


def refusal_reason(error: GrammarError) -> str:
    if error.keyword:
        return error.keyword
    message = error.message.split(": ", 1)[-1]
    return message.split(":")[0][:48]


def prompt_for(schema: Any) -> list[dict[str, str]]:
    text = json.dumps(schema)
    if len(text) > PROMPT_SCHEMA_CHARS:
        text = text[:PROMPT_SCHEMA_CHARS] + " ..."
    return [
        {"role": "system", "content": "You answer with one JSON document and nothing else."},
        {"role": "user", "content": f"Write a short example document for this schema:\n{text}"},
    ]


def check_output(schema: Any, text: str) -> str:
    """The output's status: "valid", "invalid", or "unchecked" (jsonschema cannot check
    this schema)."""
    import jsonschema

    try:
        value = json.loads(text)
    except ValueError:
        return "invalid"
    try:
        validator_type = jsonschema.validators.validator_for(schema)
        validator = validator_type(schema, format_checker=validator_type.FORMAT_CHECKER)
        errors = list(validator.iter_errors(value))
    except Exception:
        return "unchecked"
    return "invalid" if errors else "valid"


def compile_only(chosen: list[tuple[str, Path]], model: str) -> dict[str, SplitTally]:
    """Check and compile each schema against the model's tokenizer, in this process."""
    from transformers import AutoTokenizer

    from modelpool.worker.backends.hf.grammars import LLGuidanceGrammars

    tokenizer = AutoTokenizer.from_pretrained(model)
    eos = frozenset([tokenizer.eos_token_id])
    grammars = LLGuidanceGrammars(tokenizer, len(tokenizer), eos)
    tallies: dict[str, SplitTally] = {}
    for split, path in chosen:
        tally = tallies.setdefault(split, SplitTally())
        schema = json.loads(path.read_text())
        try:
            grammar = grammar_for_response_format(schema)
            assert grammar is not None
        except GrammarError as exc:
            tally.counts["refused"] += 1
            tally.reasons[refusal_reason(exc)] += 1
            continue
        pending = grammars.compiler.start(grammar, 30.0)
        try:
            pending.wait(lambda: False)
            tally.counts["compiled"] += 1
        except GrammarCompileTimeout:
            tally.counts["timeout"] += 1
        except Exception as exc:
            tally.counts["failed"] += 1
            tally.reasons[f"compile: {str(exc)[:48]}"] += 1
    return tallies


def end_to_end(
    chosen: list[tuple[str, Path]], args: argparse.Namespace
) -> tuple[dict[str, SplitTally], float]:
    config = PoolConfig(
        model=args.model,
        backend="hf",
        workers=args.workers,
        max_batch_size=args.batch,
        devices=("cpu",),
        deadline_s=args.deadline_s,
        grammar_compile_timeout_s=args.compile_timeout_s,
        max_queue=len(chosen) + 1,
        backend_options={"dtype": "float32", "torch_threads": args.torch_threads},
    )
    tallies: dict[str, SplitTally] = {}
    # A few requests in flight per batch slot: each request's deadline then measures its own
    # compile and generation, not its wait behind the rest of the sample.
    window = args.workers * args.batch * 2
    started = time.perf_counter()
    with ModelPool(config) as pool:
        pending: collections.deque[tuple[str, str, Any, PoolFuture]] = collections.deque()
        for split, path in chosen:
            tally = tallies.setdefault(split, SplitTally())
            schema = json.loads(path.read_text())
            while len(pending) >= window:
                tally_result(tallies, *pending.popleft())
            try:
                future = pool.submit(
                    prompt_for(schema), response_format=schema, max_new_tokens=args.max_tokens
                )
            except GrammarError as exc:
                tally.counts["refused"] += 1
                tally.reasons[refusal_reason(exc)] += 1
                continue
            pending.append((split, path.name, schema, future))
        while pending:
            tally_result(tallies, *pending.popleft())
    return tallies, time.perf_counter() - started


def tally_result(
    tallies: dict[str, SplitTally], split: str, name: str, schema: Any, future: PoolFuture
) -> None:
    """Counts one generated answer: valid or invalid under ``jsonschema``, cut, timed out."""
    tally = tallies[split]
    try:
        result = future.result()
    except (GrammarCompileTimeout, DeadlineExceeded) as exc:
        tally.counts["timeout"] += 1
        tally.reasons[type(exc).__name__] += 1
        return
    except PoolError as exc:
        tally.counts["failed"] += 1
        tally.reasons[f"{type(exc).__name__}: {exc.message[:40]}"] += 1
        return
    if result.finish_reason == "length":
        tally.counts["cut"] += 1
        return
    status = check_output(schema, result.text)
    tally.counts[status] += 1
    if status == "invalid":
        tally.invalid.append(name)


def print_table(tallies: dict[str, SplitTally], columns: Sequence[str]) -> None:
    header = f"| split | schemas | {' | '.join(columns)} | why refused, timed out, failed (top 3) |"
    print(header)
    print("|" + "---|" * (len(columns) + 3))
    total: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    for split, tally in sorted(tallies.items()):
        count = sum(tally.counts.values())
        total.update(tally.counts)
        reasons.update(tally.reasons)
        top = ", ".join(f"{reason} {n}" for reason, n in tally.reasons.most_common(3))
        cells = " | ".join(str(tally.counts[column]) for column in columns)
        print(f"| {split} | {count} | {cells} | {top} |")
    top = ", ".join(f"{reason} {n}" for reason, n in reasons.most_common(5))
    cells = " | ".join(f"**{total[column]}**" for column in columns)
    print(f"| **all** | **{sum(total.values())}** | {cells} | {top} |")
    for split, tally in sorted(tallies.items()):
        if tally.invalid:
            print(f"INVALID in {split}: {', '.join(tally.invalid)}")
    print()
    for engine, counts in MASKBENCH.items():
        print(f"MaskBench (published), {engine}: {counts}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("checkout", type=Path, help="a checkout of guidance-ai/jsonschemabench")
    parser.add_argument("--per-split", type=int, default=30, help="schemas sampled per split")
    parser.add_argument("--all", action="store_true", help="every schema of every split")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--model", default="embedded:smollm2-135m-instruct")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--batch", type=int, default=8, help="max_batch_size")
    parser.add_argument("--deadline-s", type=float, default=600.0)
    parser.add_argument("--compile-timeout-s", type=float, default=5.0)
    parser.add_argument("--torch-threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    chosen = sample(args.checkout, None if args.all else args.per_split, args.seed)
    print(f"{len(chosen)} schemas from {args.checkout}")
    if args.compile_only:
        from modelpool.shared.embedded import resolve_model

        model = resolve_model(args.model) if args.model.startswith("embedded:") else args.model
        started = time.perf_counter()
        tallies = compile_only(chosen, model)
        print(f"checked and compiled in {time.perf_counter() - started:.1f} s\n")
        print_table(tallies, ("compiled", "refused", "timeout", "failed"))
        return 0
    tallies, seconds = end_to_end(chosen, args)
    print(
        f"generated in {seconds:.0f} s (max_tokens {args.max_tokens}, {args.workers} "
        f"worker(s), max_batch_size {args.batch})\n"
    )
    print_table(tallies, STATUSES)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
