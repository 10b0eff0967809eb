"""The llama_cpp backend against llama.cpp's own server, llama-cpp-python and the hf backend.

Same GGUF (the embedded SmolLM2-135M-Instruct, Q4_1), same threads, greedy, a fixed
number of new tokens (end-of-sequence suppressed on every contender), in one run:

1. **One stream**: tokens per second and time to first token of modelpool
   ``llama_cpp`` (one worker, streamed through ``pool.stream``), llama-cpp-python's
   ``Llama.create_completion(stream=True)`` in this process, llama.cpp's own
   ``llama-server`` (one slot, streamed over HTTP) and modelpool ``hf`` (one worker,
   the checkpoint's dtype). Rounds alternate the order; the ratio that matters is
   modelpool llama_cpp over llama-cpp-python in-process (target: 0.95 or more).
2. **Concurrent clients** (closed loop, ``benchmarks.batching``'s client), all over HTTP
   with the same streaming client: ``modelpool serve --backend llama_cpp`` (one worker
   batching up to 8), ``llama-server --parallel 8`` (its continuous batching) and
   ``modelpool serve`` on ``hf`` (one worker batching up to 8); tok/s and p50 latency.
3. **Cancel in a full batch** (llama_cpp): time from ``pool.cancel`` to the stream's end,
   against one decoding step.
4. **Kill to replacement** (llama_cpp): SIGKILL the worker; time until a request is
   answered again (a fresh worker loads the GGUF).

``llama-server`` is compiled by ``scripts/build-llama-server`` the first time (about 20
minutes on 2 cores; the same llama.cpp and flags as the backend's wheel), then cached.
Threads default to the usable cores, what the pool gives one worker. ggml's threads
busy-wait within a step: on a machine where other work needs the cores, run with fewer
(``--threads 1`` on 2 cores) or every contender's steps stall alike.

::

    python -m benchmarks.llama_cpp                     # everything, 1/4/8/16 clients
    python -m benchmarks.llama_cpp --concurrency 1 8 --rounds 3 --new-tokens 64
    python -m benchmarks.llama_cpp --no-llama-server   # without compiling it
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks.batching import (
    PromptMix,
    cancel_in_full_batch,
    chat_prompt,
    http_request,
    http_server,
    read_to_end,
    sweep,
    unused_port,
)
from modelpool import ModelPool, PoolConfig
from modelpool.supervisor.spawn import usable_cpus

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
        stream = pool.stream(
            [{"role": "user", "content": PROMPT}],
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
        )
        tokens, first = read_to_end(stream, began)
        return tokens, first or 0.0, time.perf_counter() - began

    return one


def in_process_stream(gguf: Path, threads: int, new_tokens: int) -> Stream:
    """llama-cpp-python's own high-level API, end-of-sequence suppressed as min_new_tokens
    does in modelpool."""
    import numpy as np

    from modelpool.worker.backends.llama_cpp.options import import_llama_cpp

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
    from modelpool.worker.backends.llama_cpp.handler import _compile_template

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


# ---- llama.cpp's own server -----------------------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent


def build_llama_server(log: Any) -> Path:
    """The llama-server binary, compiled by scripts/build-llama-server the first time."""
    log("llama-server: building it if it is not cached (about 20 minutes the first time)")
    done = subprocess.run(
        [str(ROOT / "scripts" / "build-llama-server")],
        check=True,
        stdout=subprocess.PIPE,
        text=True,
    )
    return Path(done.stdout.strip().splitlines()[-1])


@contextmanager
def llama_server(
    binary: Path, gguf: Path, *, threads: int, slots: int, context: int, scratch: Path
) -> Iterator[str]:
    """``llama-server`` on 127.0.0.1 with ``slots`` parallel sequences of ``context`` cells
    each; yields its chat completions URL."""
    port = unused_port()
    command = [
        str(binary), "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
        "--threads", str(threads), "--threads-batch", str(threads),
        "--parallel", str(slots), "--ctx-size", str(context * slots), "--no-webui",
    ]  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    with http_server(command, f"{base}/health", scratch / f"llama-server-{slots}.log"):
        yield f"{base}/v1/chat/completions"


@contextmanager
def modelpool_server(
    backend: str, model: str, *, threads: int, batch: int, scratch: Path
) -> Iterator[str]:
    """``modelpool serve`` with one worker batching up to ``batch``; yields its URL."""
    port = unused_port()
    threads_option = "threads" if backend == "llama_cpp" else "torch_threads"
    command = [
        sys.executable, "-m", "modelpool", "serve", "--model", model, "--backend", backend,
        "--workers", "1", "--max-batch-size", str(batch), "--devices", "cpu",
        "--deadline", "1800", "--port", str(port), "--log-level", "warning",
        "--set", f"backend_options.{threads_option}={threads}",
    ]  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    with http_server(command, f"{base}/readyz", scratch / f"modelpool-{backend}.log"):
        yield f"{base}/v1/chat/completions"


def chat_body(new_tokens: int, mix: PromptMix) -> Callable[[int], Json]:
    """Greedy, exactly ``new_tokens`` tokens (``ignore_eos``, which both servers take)."""

    def body(index: int) -> Json:
        return {
            "model": "bench",
            "messages": mix.chat(index) if index >= 0 else [{"role": "user", "content": PROMPT}],
            "max_tokens": new_tokens,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    return body


def http_stream(url: str, new_tokens: int) -> Stream:
    """One stream of the single-stream prompt over HTTP (index -1: ``PROMPT``)."""
    request = http_request(url, chat_body(new_tokens, PromptMix()))

    def one() -> tuple[int, float, float]:
        began = time.perf_counter()
        tokens, first = request(-1)
        return tokens, first or 0.0, time.perf_counter() - began

    return one


def run(args: argparse.Namespace) -> Json:
    from modelpool.shared.embedded import prepare_gguf

    def log(message: str) -> None:
        print(f"[llama_cpp bench] {message}", flush=True)

    gguf_dir = prepare_gguf()
    [gguf] = list(gguf_dir.glob("*.gguf"))
    binary = None if args.no_llama_server else build_llama_server(log)
    threads = args.threads
    report: Json = {"threads": threads, "new_tokens": args.new_tokens}
    with contextlib.ExitStack() as stack:
        scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-llama-")))
        llama_pool = stack.enter_context(started(pool_config("llama_cpp", gguf_dir, threads, 1)))
        hf_pool = stack.enter_context(started(pool_config("hf", gguf_dir, threads, 1)))
        contenders = {
            "modelpool llama_cpp": pool_stream(llama_pool, args.new_tokens),
            "llama-cpp-python in-process": in_process_stream(gguf, threads, args.new_tokens),
        }
        if binary is not None:
            url = stack.enter_context(
                llama_server(binary, gguf, threads=threads, slots=1, context=2048, scratch=scratch)
            )
            contenders["llama-server"] = http_stream(url, args.new_tokens)
        contenders["modelpool hf"] = pool_stream(hf_pool, args.new_tokens)
        report["single_stream"] = single_stream(contenders, args.rounds, log)
    with contextlib.ExitStack() as stack:
        scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-llama-")))
        urls = {
            "modelpool llama_cpp 1x8": stack.enter_context(
                modelpool_server(
                    "llama_cpp", str(gguf_dir), threads=threads, batch=8, scratch=scratch
                )
            ),
        }
        if binary is not None:
            urls["llama-server --parallel 8"] = stack.enter_context(
                llama_server(binary, gguf, threads=threads, slots=8, context=2048, scratch=scratch)
            )
        urls["modelpool hf 1x8"] = stack.enter_context(
            modelpool_server(
                "hf", "embedded:smollm2-135m-instruct", threads=threads, batch=8, scratch=scratch
            )
        )
        body = chat_body(args.new_tokens, PromptMix())
        requesters = {name: http_request(url, body) for name, url in urls.items()}
        for requester in requesters.values():
            requester(0)  # warm-up: the first request pays for lazy set-up
        report["concurrency"] = sweep(
            requesters, args.concurrency, args.requests_per_client, args.rounds, log, "clients"
        )
    with started(pool_config("llama_cpp", gguf_dir, threads, 8)) as llama_pool:
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
    concurrency = report["concurrency"]
    reference = concurrency.get("llama-server --parallel 8", {})
    lines += [
        "",
        "| clients | contender | tok/s | ÷ llama-server | p50 latency | TTFT p50 |",
        "|---|---|---|---|---|---|",
    ]
    for level in next(iter(concurrency.values())):
        for name, levels in concurrency.items():
            data = levels[level]
            base_rate = reference.get(level, {}).get("tokens_per_s")
            ratio = f"{data['tokens_per_s'] / base_rate:.2f}x" if base_rate else "-"
            lines.append(
                f"| {level} | {name} | {data['tokens_per_s']:.1f} | {ratio} | "
                f"{data['latency_p50_s']:.2f} s | {(data['ttft_p50_s'] or 0) * 1000:.0f} ms |"
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
    parser.add_argument("--threads", type=int, default=usable_cpus(), help="ggml and torch threads")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument(
        "--no-llama-server", action="store_true", help="leave llama-server out (no compile)"
    )
    parser.add_argument("--report", default=None, help="write the JSON report here")
    args = parser.parse_args(argv)
    report = run(args)
    print(markdown(report))
    if args.report:
        Path(args.report).write_text(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
