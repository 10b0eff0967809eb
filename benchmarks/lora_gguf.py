"""LoRA GGUF adapters on the llama_cpp backend (docs/lora.md): what grouping by adapter
costs. One in-process pool of one worker on the embedded SmolLM2 GGUF, greedy, a fixed
number of new tokens (end-of-sequence ignored), one batch of ``--batch`` requests sent
at once: **base**, every row without an adapter; **mixed**, the same rows spread over
``--adapters`` LoRA GGUFs (rank 8 on every layer's attn_q, written with the ``gguf``
package). llama.cpp applies one adapter per decode, so the mixed batch's steps take the
groups in turn::

    python -m benchmarks.lora_gguf --batch 8 --tokens 32 --adapters 4

Mixed and base take turns, ``--repeats`` runs each. Prints one JSON object (the median
tokens/s of each, the median of the paired ratios with its lowest and highest, the load
average).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.lora import QUESTIONS, interleaved, ratio_summary, run_batch
from modelpool import ModelPool, PoolConfig
from modelpool.shared.embedded import prepare_gguf


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from lora_adapters import make_gguf_adapter  # type: ignore[import-not-found]

    base = prepare_gguf()
    with tempfile.TemporaryDirectory(prefix="lora-gguf-bench-") as scratch:
        model_file = next(base.glob("*.gguf"))
        adapters = [
            make_gguf_adapter(model_file, Path(scratch) / f"a{index}.gguf", seed=index)
            for index in range(args.adapters)
        ]
        config = PoolConfig(
            model=str(base),
            backend="llama_cpp",
            workers=1,
            devices=("cpu",),
            max_batch_size=args.batch,
            deadline_s=600.0,
            backend_options={
                "threads": args.threads,
                "max_loras": args.adapters,
                "prefix_cache_tokens": 0,
            },
        )
        prompts = [QUESTIONS[index % len(QUESTIONS)] for index in range(args.batch)]
        with ModelPool(config) as pool:
            base_jobs = [(pool, None, prompt) for prompt in prompts]
            mixed_jobs = [
                (pool, adapters[index % len(adapters)], prompt)
                for index, prompt in enumerate(prompts)
            ]
            run_batch(mixed_jobs, 2)  # every adapter read once, as a running pool has them
            mixed_runs, base_runs = interleaved(
                args.repeats,
                lambda: run_batch(mixed_jobs, args.tokens),
                lambda: run_batch(base_jobs, args.tokens),
            )
    report = {
        "batch": args.batch,
        "tokens": args.tokens,
        "adapters": args.adapters,
        "base_tok_s": round(statistics.median(base_runs), 1),
        "mixed_tok_s": round(statistics.median(mixed_runs), 1),
        "mixed_over_base": ratio_summary(mixed_runs, base_runs),
        "load_average": os.getloadavg()[0],
    }
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
