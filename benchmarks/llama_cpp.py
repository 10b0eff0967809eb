"""The llama_cpp backend against llama-cpp-python in-process and the hf backend, in one run.

Same GGUF (the embedded SmolLM2-135M-Instruct, Q4_1), same threads, greedy, a fixed
number of new tokens (end-of-sequence suppressed on every contender):

1. **One stream**: tokens per second and time to first token of modelpool
   ``llama_cpp`` (one worker, streamed through ``pool.stream``), llama-cpp-python's
   ``Llama.create_completion(stream=True)`` in this process, and modelpool ``hf``
   (one worker, float32). Rounds alternate the order; the ratio that matters is
   modelpool llama_cpp over llama-cpp-python in-process (target: 0.95 or more).
2. **Concurrent clients** (closed loop, ``benchmarks.batching``): modelpool
   ``llama_cpp`` and ``hf``, one worker batching up to 8; tok/s and p50 latency.
3. **Cancel in a full batch** (llama_cpp): time from ``pool.cancel`` to the stream's end,
   against one decoding step.
4. **Kill to replacement** (llama_cpp): SIGKILL the worker; time until a request is
   answered again (a fresh worker loads the GGUF).

::

    python -m benchmarks.llama_cpp                     # everything, 1/4/8 clients
    python -m benchmarks.llama_cpp --concurrency 1 8 --rounds 3 --new-tokens 64

llama.cpp's own ``llama-server`` is not among the contenders (see the README).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks.batching import (
    PromptMix,
    cancel_in_full_batch,
    chat_prompt,
    pool_request,
    sweep,
)
from modelpool import ModelPool, PoolConfig

Json = dict[str, Any]
PROMPT = "Write a short story about a lighthouse keeper and a storm at sea."


def pool_config(backend: str, gguf_dir: Path, threads: int, batch: int) -> PoolConfig:
    options: dict[str, Any]
    if backend == "llama_cpp":
        model, options = str(gguf_dir), {"threads": threads}
    else:
        model, options = "embedded:smollm2-135m-instruct", {"torch_threads": threads}
    return PoolConfig(
        model=model,
        backend=backend,
        backend_options=options,
        workers=1,
        max_batch_size=batch,
        devices=("cpu",),
        deadline_s=600.0,
        startup_timeout_s=600.0,
    )


@contextmanager
def started(config: PoolConfig) -> Iterator[ModelPool]:
    pool = ModelPool(config)
    pool.start()
    try:
        yield pool
    finally:
        pool.close(drain=False, timeout=10.0)


Stream = Callable[[], tuple[int, float, float]]
"""One stream to its end: (tokens, seconds to the first token, seconds in all)."""


def pool_stream(pool: ModelPool, new_tokens: int) -> Stream:
    def one() -> tuple[int, float, float]:
        began = time.perf_counter()
        first = 0.0
        stream = pool.stream(
            [{"role": "user", "content": PROMPT}],
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
        )
        for _ in stream:
            if not first:
                first = time.perf_counter() - began
        total = time.perf_counter() - began
        result = stream.result
        return (result.completion_tokens or 0) if result else 0, first, total

    return one


def in_process_stream(gguf: Path, threads: int, new_tokens: int) -> Stream:
    """llama-cpp-python's own high-level API, end-of-sequence suppressed as min_new_tokens
    does in modelpool."""
    import numpy as np

    from modelpool.backends.llama_cpp import import_llama_cpp

    llama_cpp = import_llama_cpp()
    llm = llama_cpp.Llama(
        model_path=str(gguf), n_threads=threads, n_threads_batch=threads, n_ctx=2048,
        verbose=False,
    )  # fmt: skip
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    end_ids = [t for t in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, t)]

    def no_end(input_ids: Any, scores: Any) -> Any:
        scores[end_ids] = -np.inf
        return scores

    processors = llama_cpp.LogitsProcessorList([no_end])
    prompt = llm.tokenize(_render(llm, PROMPT).encode(), add_bos=False, special=True)

    def one() -> tuple[int, float, float]:
        llm.reset()  # no prefix reuse: every contender reads the prompt
        began = time.perf_counter()
        first = 0.0
        tokens = 0
        for _ in llm.create_completion(
            prompt, max_tokens=new_tokens, temperature=0.0, stream=True,
            logits_processor=processors,
        ):  # fmt: skip
            tokens += 1
            if not first:
                first = time.perf_counter() - began
        return tokens, first, time.perf_counter() - began

    return one


def _render(llm: Any, content: str) -> str:
    from modelpool.backends.llama_cpp import _compile_template

    template = llm.metadata["tokenizer.chat_template"]
    text: str = _compile_template(template)(
        messages=[{"role": "user", "content": content}],
        add_generation_prompt=True,
        bos_token="",
        eos_token="",
    )
    return text


def single_stream(contenders: dict[str, Stream], rounds: int, log: Any) -> Json:
    samples: dict[str, list[tuple[int, float, float]]] = {name: [] for name in contenders}
    for name, one in contenders.items():
        one()  # warm
        log(f"single stream: {name} warmed")
    for round_index in range(rounds):
        names = list(contenders) if round_index % 2 == 0 else list(contenders)[::-1]
        for name in names:
            samples[name].append(contenders[name]())
    report: Json = {}
    for name, runs in samples.items():
        decode_rates = [
            (tokens - 1) / (total - first) for tokens, first, total in runs if tokens > 1
        ]
        report[name] = {
            "tokens_per_s": statistics.median(decode_rates) if decode_rates else None,
            "ttft_s": statistics.median(first for _, first, _ in runs),
            "runs": runs,
        }
    return report


def kill_to_replacement(pool: ModelPool) -> Json:
    pool.generate(chat_prompt(0), max_new_tokens=4)
    [worker] = [w for w in pool.stats().workers if w.pid]
    assert worker.pid is not None
    began = time.perf_counter()
    os.kill(worker.pid, signal.SIGKILL)
    result = pool.generate(chat_prompt(1), max_new_tokens=4)
    return {"seconds": time.perf_counter() - began, "answered": bool(result.text)}


def run(args: argparse.Namespace) -> Json:
    from modelpool.embedded import prepare_gguf

    def log(message: str) -> None:
        print(f"[llama_cpp bench] {message}", flush=True)

    gguf_dir = prepare_gguf()
    [gguf] = list(gguf_dir.glob("*.gguf"))
    report: Json = {"threads": args.threads, "new_tokens": args.new_tokens}
    with (
        started(pool_config("llama_cpp", gguf_dir, args.threads, 1)) as llama_pool,
        started(pool_config("hf", gguf_dir, args.threads, 1)) as hf_pool,
    ):
        contenders = {
            "modelpool llama_cpp": pool_stream(llama_pool, args.new_tokens),
            "llama-cpp-python in-process": in_process_stream(gguf, args.threads, args.new_tokens),
            "modelpool hf": pool_stream(hf_pool, args.new_tokens),
        }
        report["single_stream"] = single_stream(contenders, args.rounds, log)
    with (
        started(pool_config("llama_cpp", gguf_dir, args.threads, 8)) as llama_pool,
        started(pool_config("hf", gguf_dir, args.threads, 8)) as hf_pool,
    ):
        requesters = {
            "modelpool llama_cpp 1x8": pool_request(llama_pool, args.new_tokens, PromptMix()),
            "modelpool hf 1x8": pool_request(hf_pool, args.new_tokens, PromptMix()),
        }
        report["concurrency"] = sweep(
            requesters, args.concurrency, args.requests_per_client, args.rounds, log, "clients"
        )
        log("cancel in a full batch")
        report["cancel"] = cancel_in_full_batch(llama_pool, 8, 1)
        log("kill to replacement")
        report["kill_to_replacement"] = kill_to_replacement(llama_pool)
    return report


def markdown(report: Json) -> str:
    lines = [f"threads {report['threads']}, {report['new_tokens']} new tokens, greedy", ""]
    single = report["single_stream"]
    base = single["llama-cpp-python in-process"]["tokens_per_s"]
    lines += ["| one stream | tok/s | ratio to in-process | TTFT |", "|---|---|---|---|"]
    for name, data in single.items():
        rate = data["tokens_per_s"]
        ratio = f"{rate / base:.2f}x" if rate and base else "-"
        lines.append(f"| {name} | {rate:.1f} | {ratio} | {data['ttft_s'] * 1000:.0f} ms |")
    lines += ["", "| clients | contender | tok/s | p50 latency |", "|---|---|---|---|"]
    for name, levels in report["concurrency"].items():
        for level, data in levels.items():
            lines.append(
                f"| {level} | {name} | {data['tokens_per_s']:.1f} | {data['latency_p50_s']:.2f} s |"
            )
    cancel = report["cancel"]
    lines += [
        "",
        f"cancel in a full batch of 8: {cancel['cancel_s'] * 1000:.0f} ms "
        f"(one step: {(cancel['step_s'] or 0) * 1000:.0f} ms)",
        f"kill to replacement answering: {report['kill_to_replacement']['seconds']:.2f} s",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--report", default=None, help="write the JSON report here")
    args = parser.parse_args(argv)
    report = run(args)
    print(markdown(report))
    if args.report:
        Path(args.report).write_text(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
