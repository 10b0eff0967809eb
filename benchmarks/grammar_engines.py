"""Which grammar engine: llguidance against XGrammar on the same JSONSchemaBench schemas,
each engine in a child process of its own (a segfault or a hang is counted, not suffered).

Per engine: schemas compiled, refused at compile time, segfaults (the child died),
timeouts (past ``--timeout-s``), compile time p50/p99 and the first mask's time p50, all
against the embedded model's tokenizer. What a refusal means differs: llguidance refuses a
keyword it does not implement; XGrammar ignores many (its ``strict_mode`` only tightens
``additionalProperties``), which this compile-only count cannot see and MaskBench counts
as invalid outputs (1,408 of 11,306 for XGrammar)::

    python -m benchmarks.grammar_engines /work/jsb --per-split 30
    python -m benchmarks.grammar_engines /work/jsb --engines llguidance   # without XGrammar

XGrammar is not a dependency of modelpool: install it beside (``pip install xgrammar``).
Results and the command behind them: docs/architecture.md, "Structured outputs".
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.jsonschemabench import sample

Compile = Callable[[str], float]  # schema text -> first mask's seconds; raises when refused


def llguidance_engine(model: str) -> Compile:
    import llguidance
    import llguidance.hf
    import torch
    from transformers import AutoTokenizer

    tokenizer: Any = AutoTokenizer.from_pretrained(model)
    llg_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))
    bitmask = torch.zeros((1, (len(tokenizer) + 31) // 32), dtype=torch.int32)

    def compile_one(schema: str) -> float:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False}
        )
        matcher = llguidance.LLMatcher(llg_tokenizer, grammar)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        started = time.perf_counter()
        matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * 4)
        return time.perf_counter() - started

    return compile_one


def xgrammar_engine(model: str) -> Compile:
    import xgrammar
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    bitmask = xgrammar.allocate_token_bitmask(1, len(tokenizer))

    def compile_one(schema: str) -> float:
        compiled = compiler.compile_json_schema(schema, any_whitespace=False)
        matcher = xgrammar.GrammarMatcher(compiled)
        started = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        return time.perf_counter() - started

    return compile_one


ENGINES = {"llguidance": llguidance_engine, "xgrammar": xgrammar_engine}


def child(engine: str, model: str) -> None:
    """Compile the schema on each stdin line; one JSON answer per line on stdout."""
    compile_one = ENGINES[engine](model)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        started = time.perf_counter()
        try:
            mask_s = compile_one(Path(line.strip()).read_text())
            answer: dict[str, Any] = {"status": "compiled", "mask_s": mask_s}
        except Exception as exc:
            answer = {"status": "refused", "reason": str(exc).strip()[:80]}
        answer["compile_s"] = time.perf_counter() - started - answer.get("mask_s", 0.0)
        print(json.dumps(answer), flush=True)


class Child:
    def __init__(self, engine: str, model: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.grammar_engines", "--child", engine, model],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
        )
        self.read(300.0)

    def read(self, timeout_s: float) -> dict[str, Any] | None:
        """The next answer; None when the child died or said nothing in time."""
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], timeout_s)
        line = self.process.stdout.readline() if ready else ""
        answer: dict[str, Any] | None = json.loads(line) if line else None
        return answer

    def ask(self, path: Path, timeout_s: float) -> dict[str, Any] | None:
        assert self.process.stdin is not None
        self.process.stdin.write(f"{path}\n")
        self.process.stdin.flush()
        return self.read(timeout_s)

    def close(self) -> int | None:
        self.process.kill()
        return self.process.wait()


def run_engine(engine: str, model: str, paths: list[Path], timeout_s: float) -> dict[str, Any]:
    counts: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    compile_s: list[float] = []
    mask_s: list[float] = []
    worker = Child(engine, model)
    for path in paths:
        answer = worker.ask(path, timeout_s)
        if answer is None:
            code = worker.process.poll()
            counts["timeout" if code is None else "segfault" if code < 0 else "died"] += 1
            worker.close()
            worker = Child(engine, model)
            continue
        counts[answer["status"]] += 1
        if answer["status"] == "compiled":
            compile_s.append(answer["compile_s"])
            mask_s.append(answer["mask_s"])
        else:
            reasons[answer["reason"].split(":")[0][:40]] += 1
    worker.close()
    return {"counts": counts, "reasons": reasons, "compile_s": compile_s, "mask_s": mask_s}


def quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["--child"]:
        child(arguments[1], arguments[2])
        return 0
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("checkout", type=Path)
    parser.add_argument("--per-split", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=30.0)
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    parser.add_argument("--model", default="embedded:smollm2-135m-instruct")
    args = parser.parse_args(arguments)
    from modelpool.shared.embedded import resolve_model

    model = resolve_model(args.model)
    paths = [path for _, path in sample(args.checkout, args.per_split, args.seed)]
    print(f"{len(paths)} schemas, compile timeout {args.timeout_s:g} s, tokenizer of {model}\n")
    print(
        "| engine | compiled | refused | segfaults | timeouts | compile p50 | compile p99 "
        "| first mask p50 | refused for (top 3) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for engine in args.engines:
        result = run_engine(engine, model, paths, args.timeout_s)
        counts = result["counts"]
        top = ", ".join(f"{reason} {n}" for reason, n in result["reasons"].most_common(3))
        compile_s = result["compile_s"]
        print(
            f"| {engine} | {counts['compiled']} | {counts['refused']} | {counts['segfault']} "
            f"| {counts['timeout']} | {statistics.median(compile_s) * 1e3:.1f} ms "
            f"| {quantile(compile_s, 0.99) * 1e3:.1f} ms "
            f"| {statistics.median(result['mask_s']) * 1e6:.0f} µs | {top} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
