"""LoRA adapters on one copy of the weights against the alternatives (issue 59, docs/lora.md).

In-process pools through the public API (``pool.stream``), the hf backend, greedy, a fixed
number of new tokens (end-of-sequence ignored), one batch of ``--batch`` requests sent at
once:

1. **mixed**: one pool, its requests spread over four adapters (``max_loras`` 4), each row
   with its own adapter in the same passes (``worker.backends.hf.lora``);
2. **base**: the same pool and batch, no adapter: what the adapters cost (target >= 0.8x);
3. **merged**: the four adapters merged into four full copies of the model
   (``merge_and_unload``), served as four pools of one worker each, the batch spread
   over them as over the adapters, the torch threads split between them;
4. **time to first token of a new adapter**: a fifth adapter's first request on the
   running pool, against starting a pool on that adapter merged into a copy of the model
   and its first token.

Adapters are made with PEFT (rank ``--rank`` on q, k, v and o) on ``--model`` (default:
the tiny random model, built in a second; ``--model embedded`` for SmolLM2-135M, prepared
as ``modelpool prepare-model`` does)::

    python -m benchmarks.lora                          # tiny model, batch of 8, 64 tokens
    python -m benchmarks.lora --model embedded --batch 8 --tokens 64 --threads 2
    python -m benchmarks.lora --device cuda:0 --model embedded --dtype bfloat16

Mixed and base take turns, ``--repeats`` runs each (a change in the machine's load falls on
both): their tokens/s are the medians, ``mixed_vs_base`` the median of each pair's ratio
with its lowest and highest, beside the load average. Prints one JSON object (tokens/s by
contender, ratios, the two times to first token); ``--no-merged`` stops after 2.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from modelpool import ModelPool, PoolConfig

QUESTIONS = (
    "What is the capital of France?",
    "Write two sentences about the sea and a small boat leaving the harbour.",
    "List three prime numbers.",
    "Explain in a few words why the sky is blue.",
)


def make_adapters(base: Path, folder: Path, count: int, rank: int) -> list[Path]:
    """``count`` PEFT LoRA adapters of ``base`` with random non-zero weights."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    made = []
    for seed in range(count):
        target = folder / f"adapter-{seed}"
        if not (target / "adapter_model.safetensors").exists():
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
            config = LoraConfig(
                r=rank,
                lora_alpha=2 * rank,
                target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                init_lora_weights=False,
            )
            peft_model: Any = get_peft_model(model, config)
            with torch.no_grad():
                for name, parameter in peft_model.named_parameters():
                    if "lora_" in name:
                        parameter.normal_(0.0, 0.02)
            peft_model.save_pretrained(str(target))
        made.append(target)
    return made


def merged_copy(base: Path, adapter: Path, folder: Path) -> Path:
    """``adapter`` merged into a full copy of ``base`` (what serving it without adapters
    takes), with the base's tokenizer."""
    import shutil

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    target = folder / f"merged-{adapter.name}"
    if not (target / "config.json").exists():
        model = AutoModelForCausalLM.from_pretrained(str(base))
        merged: Any = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
        merged.save_pretrained(str(target))
        for file in base.iterdir():
            if file.name.startswith(("tokenizer", "special_tokens", "generation_config")):
                shutil.copy(file, target / file.name)
    return target


def pool_config(model: Path, args: argparse.Namespace, threads: int) -> PoolConfig:
    return PoolConfig(
        model=str(model),
        backend="hf",
        workers=1,
        devices=(args.device,),
        max_batch_size=args.batch,
        deadline_s=600.0,
        startup_timeout_s=600.0,
        backend_options={
            "dtype": args.dtype,
            "torch_threads": threads,
            "max_loras": 4,
        },
    )


def lora_of(adapter: Path | None) -> dict[str, Any]:
    return {} if adapter is None else {"lora": {"name": adapter.name, "path": str(adapter)}}


def run_batch(jobs: Sequence[tuple[ModelPool, Path | None, str]], tokens: int) -> float:
    """Send every job at once; output tokens per second over the whole batch."""

    def one(job: tuple[ModelPool, Path | None, str]) -> int:
        pool, adapter, prompt = job
        result = pool.generate(
            prompt,
            max_new_tokens=tokens,
            ignore_eos=True,
            **lora_of(adapter),
        )
        return result.completion_tokens or 0

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as threads:
        produced = sum(threads.map(one, jobs))
    return produced / (time.perf_counter() - started)


def first_token_s(pool: ModelPool, adapter: Path | None, started: float) -> float:
    stream = pool.stream(QUESTIONS[0], max_new_tokens=8, **lora_of(adapter))
    for _ in stream:
        return time.perf_counter() - started
    return time.perf_counter() - started


def interleaved(
    repeats: int, first: Callable[[], float], second: Callable[[], float]
) -> tuple[list[float], list[float]]:
    """``repeats`` runs of each, taking turns (first, second, second, first, ...), so that
    a change in the machine's load falls on both alike rather than on one of them."""
    firsts: list[float] = []
    seconds: list[float] = []
    for index in range(repeats):
        order = ((firsts, first), (seconds, second))
        for results, measure in order if index % 2 == 0 else reversed(order):
            results.append(measure())
    return firsts, seconds


def ratio_summary(numerators: list[float], denominators: list[float]) -> dict[str, float]:
    """The median of the paired ratios (each repeat's pair ran back to back), and their
    spread (lowest, highest)."""
    ratios = sorted(n / d for n, d in zip(numerators, denominators, strict=True))
    return {"median": statistics.median(ratios), "min": ratios[0], "max": ratios[-1]}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help='"tiny", "embedded" or a directory')
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2, help="torch threads in all")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", default=None)
    parser.add_argument(
        "--no-merged", action="store_true", help="mixed against base only (3. and 4. left out)"
    )
    args = parser.parse_args(argv)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="modelpool-lora-bench-"))
    if args.model == "tiny":
        from modelpool.tinymodel import build_tiny_model

        base = build_tiny_model(workdir / "tiny")
    elif args.model == "embedded":
        from modelpool.shared.embedded import prepare_model

        base = Path(prepare_model())
    else:
        base = Path(args.model)
    adapters = make_adapters(base, workdir / "adapters", 5, args.rank)
    four, fresh = adapters[:4], adapters[4]
    prompts = [QUESTIONS[index % len(QUESTIONS)] for index in range(args.batch)]
    report: dict[str, Any] = {"model": str(base), "batch": args.batch, "tokens": args.tokens}
    report["load_average_at_start"] = os.getloadavg()[0]

    with ModelPool(pool_config(base, args, args.threads)) as pool:
        run_batch([(pool, four[0], prompts[0])], 4)  # warm: the adapters' hooks, the caches
        mixed = [(pool, four[index % 4], prompt) for index, prompt in enumerate(prompts)]
        plain = [(pool, None, prompt) for prompt in prompts]
        run_batch(mixed, args.tokens)
        mixed_runs, base_runs = interleaved(
            args.repeats,
            lambda: run_batch(mixed, args.tokens),
            lambda: run_batch(plain, args.tokens),
        )
        report["mixed_tok_s"] = statistics.median(mixed_runs)
        report["base_tok_s"] = statistics.median(base_runs)
        report["mixed_vs_base"] = ratio_summary(mixed_runs, base_runs)
        report["new_adapter_first_token_s"] = first_token_s(pool, fresh, time.perf_counter())

    report["load_average_after_mixed_and_base"] = os.getloadavg()[0]
    if args.no_merged:
        print(json.dumps(report, indent=2))
        return report
    merged = [merged_copy(base, adapter, workdir / "merged") for adapter in four]
    per_pool = max(1, args.threads // 4)
    pools = [ModelPool(pool_config(model, args, per_pool)) for model in merged]
    try:
        for each in pools:
            each.start()
        jobs = [(pools[index % 4], None, prompt) for index, prompt in enumerate(prompts)]
        run_batch(jobs, args.tokens)
        merged_runs = [run_batch(jobs, args.tokens) for _ in range(args.repeats)]
        report["merged_pools_tok_s"] = statistics.median(merged_runs)
    finally:
        for each in pools:
            each.close()

    started = time.perf_counter()
    # A new directory each run: merging is part of what serving a merged copy costs.
    fresh_merged = merged_copy(base, fresh, workdir / f"merged-{time.time_ns()}")
    report["merge_s"] = time.perf_counter() - started
    started = time.perf_counter()
    with ModelPool(pool_config(fresh_merged, args, args.threads)) as pool:
        report["merged_model_first_token_s"] = first_token_s(pool, None, started)
    report["mixed_vs_merged_pools"] = report["mixed_tok_s"] / report["merged_pools_tok_s"]
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
