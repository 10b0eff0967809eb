"""The core pool's own figures, each measured side by side in one run.

    scripts/measure-core [--quick] [--json FILE]

- dispatch round trip through the pool (testing echo), p50/p99;
- attempt deadline -> retry served by a spare, both graces 0;
- per-worker GPU sampling on vs off: dispatch p50 ratio (a fake NVML sampled
  every 10 ms stands in for the driver), and the cost of the RSS read each
  result carries;
- kill -> release verified on the CPU (psutil);
- cancel latency against one decoding step, on the tiny model and SmolLM2;
- time to first chunk: pool.stream vs an in-process TextIteratorStreamer;
- the supervisor's own throughput: echo requests per second pipelined (all submitted,
  then all awaited) through 1 and 2 workers with 1,000 and 20,000 queued, beside
  ProcessPoolExecutor's figure for the same echo in the same run.

The comprehensive comparison with other executors is scripts/bench; this
script is what the core issues' closing notes quote.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from logging import LogRecord
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # fake_nvml, the scripted NVML stand-in

from fake_nvml import GIB, FakeGpu, FakeNvml  # noqa: E402
from modelpool import ModelPool, PoolConfig, RetryPolicy  # noqa: E402
from modelpool.shared.processes import process_rss_bytes  # noqa: E402
from modelpool.supervisor import worker_manager  # noqa: E402
from modelpool.supervisor.gpu import GpuProbe  # noqa: E402

ECHO = {"model": "none", "backend": "testing", "generation_defaults": {}}


def pct(samples: list[float], fraction: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


def wait_for(predicate: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        pause.wait(0.001)


def round_trips(pool: ModelPool, count: int) -> list[float]:
    samples = []
    for _ in range(count):
        started = time.perf_counter()
        pool.generate("echo:x")
        samples.append(time.perf_counter() - started)
    return samples


def dispatch(calls: int) -> dict[str, float]:
    with ModelPool(PoolConfig(**ECHO, workers=1)) as pool:
        round_trips(pool, 200)
        samples = round_trips(pool, calls)
    return {"calls": calls, "p50_ms": ms(pct(samples, 0.5)), "p99_ms": ms(pct(samples, 0.99))}


def _echo(text: str) -> str:
    return text


def pipelined_rate(pool: ModelPool, count: int) -> float:
    """Requests per second: ``count`` echo requests submitted at once, then all awaited."""
    started = time.perf_counter()
    futures = [pool.submit("echo:x") for _ in range(count)]
    for future in futures:
        future.result()
    return count / (time.perf_counter() - started)


def throughput(queued_counts: tuple[int, ...], repeats: int) -> dict[str, Any]:
    """The supervisor must never be the bottleneck, however deep its queue."""
    from concurrent.futures import ProcessPoolExecutor

    result: dict[str, Any] = {}
    for workers in (1, 2):
        config = PoolConfig(**ECHO, workers=workers, max_queue=max(queued_counts) + 1)
        with ModelPool(config) as pool:
            pipelined_rate(pool, 2000)  # warm-up: imports, first frames, allocator
            for queued in queued_counts:
                rates = [pipelined_rate(pool, queued) for _ in range(repeats)]
                result[f"pool_w{workers}_q{queued}_per_s"] = round(statistics.median(rates))
        low, high = min(queued_counts), max(queued_counts)
        result[f"pool_w{workers}_ratio_q{high}_vs_q{low}"] = round(
            result[f"pool_w{workers}_q{high}_per_s"] / result[f"pool_w{workers}_q{low}_per_s"], 2
        )
    # With one request per worker at a time the figure is bounded by each worker's round
    # trip; with batching several are in flight per worker, which shows the dispatcher's own.
    batched = PoolConfig(**ECHO, workers=2, max_batch_size=8, max_queue=max(queued_counts) + 1)
    with ModelPool(batched) as pool:
        pipelined_rate(pool, 2000)
        for queued in queued_counts:
            rates = [pipelined_rate(pool, queued) for _ in range(repeats)]
            result[f"pool_w2_batch8_q{queued}_per_s"] = round(statistics.median(rates))
    with ProcessPoolExecutor(2) as executor:
        list(executor.map(_echo, ["x"] * 2000))
        count = max(queued_counts)
        rates = []
        for _ in range(repeats):
            started = time.perf_counter()
            futures = [executor.submit(_echo, "x") for _ in range(count)]
            for future in futures:
                future.result()
            rates.append(count / (time.perf_counter() - started))
        result[f"ppe_w2_q{count}_per_s"] = round(statistics.median(rates))
    result["pool_w2_vs_ppe"] = round(
        result[f"pool_w2_q{count}_per_s"] / result[f"ppe_w2_q{count}_per_s"], 2
    )
    return result


def deadline_to_retry(trials: int) -> dict[str, float]:
    attempt_timeout = 0.3
    config = PoolConfig(
        **ECHO,
        workers=1,
        spares=1,
        attempt_timeout_s=attempt_timeout,
        cancel_grace_s=0.0,
        term_grace_s=0.0,
        retry=RetryPolicy(max_retries=1),
    )
    gaps = []
    markers = tempfile.mkdtemp(prefix="measure-core-")
    with ModelPool(config) as pool:
        for trial in range(trials):
            wait_for(lambda: sum(w.state in ("idle", "spare") for w in pool.stats().workers) == 2)
            result = pool.generate(f"hang_once:{markers}/{trial}")
            assert result.attempts == 2
            gaps.append(result.latency_s - attempt_timeout)
    return {
        "trials": trials,
        "median_ms": ms(statistics.median(gaps)),
        "max_ms": ms(max(gaps)),
        "note": "attempt deadline -> retry finished on the spare (an upper bound on -> started)",
    }


def sampling_overhead(batches: int, calls: int) -> dict[str, float]:
    nvml = FakeNvml([FakeGpu(total=80 * GIB, used=1 * GIB)])
    sampled = ModelPool(
        PoolConfig(**ECHO, workers=1, devices=["cuda:0"], gpu_sample_interval_s=0.01),
        gpu_probe=GpuProbe(nvml=nvml),
    )
    plain = ModelPool(PoolConfig(**ECHO, workers=1))
    with sampled, plain:
        on: list[float] = []
        off: list[float] = []
        round_trips(sampled, 200)
        round_trips(plain, 200)
        for _ in range(batches):
            on += round_trips(sampled, calls)
            off += round_trips(plain, calls)
        samples_taken = nvml.calls.get("nvmlDeviceGetMemoryInfo", 0)
    started = time.perf_counter()
    for _ in range(10000):
        process_rss_bytes()
    rss_read = (time.perf_counter() - started) / 10000
    return {
        "p50_on_ms": ms(pct(on, 0.5)),
        "p50_off_ms": ms(pct(off, 0.5)),
        "ratio_on_off": round(pct(on, 0.5) / pct(off, 0.5), 3),
        "nvml_memory_reads": samples_taken,
        "rss_read_us": round(rss_read * 1e6, 2),
    }


@contextlib.contextmanager
def own_kills_unlogged() -> Iterator[None]:
    """The SIGKILLs here are this script's own: the pool's warning for each, "not sent by
    the pool: possibly the kernel OOM killer", would be a false alarm every time."""
    worker_log = worker_manager.logger  # where the pool logs how a worker ended

    def not_a_sigkill(record: LogRecord) -> bool:
        return "killed by SIGKILL" not in record.getMessage()

    worker_log.addFilter(not_a_sigkill)
    try:
        yield
    finally:
        worker_log.removeFilter(not_a_sigkill)


def kill_to_release(trials: int) -> dict[str, float]:
    times = []
    with own_kills_unlogged(), ModelPool(PoolConfig(**ECHO, workers=1)) as pool:
        for _ in range(trials):
            wait_for(lambda: [w for w in pool.stats().workers if w.state == "idle"])
            checked = pool.stats().gpu.releases.checked
            pid = pool.stats().workers[0].pid
            started = time.perf_counter()
            os.kill(pid, signal.SIGKILL)
            wait_for(lambda checked=checked: pool.stats().gpu.releases.checked > checked)
            times.append(time.perf_counter() - started)
        releases = pool.stats().gpu.releases
    return {
        "trials": trials,
        "median_ms": ms(statistics.median(times)),
        "max_ms": ms(max(times)),
        "ok": releases.ok,
        "failed": releases.failed,
        "note": "SIGKILL from outside -> pool's release check done (polled every 1 ms)",
    }


def _first_chunk_and_step(pool: ModelPool, prompt: Any, tokens: int) -> tuple[float, float]:
    started = time.perf_counter()
    stream = pool.stream(prompt, max_new_tokens=tokens, min_new_tokens=tokens)
    first = None
    for _ in stream:
        if first is None:
            first = time.perf_counter() - started
    total = time.perf_counter() - started
    assert first is not None
    return first, (total - first) / (tokens - 1)


def cancel_and_ttft(model_dir: str, label: str, trials: int) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TextIteratorStreamer

    prompt = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]
    threads = max(1, len(os.sched_getaffinity(0)))
    config = PoolConfig(model=model_dir, backend="hf", workers=1, deadline_s=120.0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    torch.set_num_threads(threads)
    text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    input_ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]

    def direct_first_chunk() -> float:
        streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        started = time.perf_counter()
        worker = threading.Thread(
            target=model.generate,
            kwargs={
                "input_ids": input_ids,
                "attention_mask": torch.ones_like(input_ids),
                "max_new_tokens": 8,
                "min_new_tokens": 8,
                "do_sample": False,
                "streamer": streamer,
            },
        )
        worker.start()
        first = None
        for piece in streamer:
            if piece and first is None:
                first = time.perf_counter() - started
        worker.join()
        assert first is not None
        return first

    with ModelPool(config) as pool:
        _first_chunk_and_step(pool, prompt, 8)
        direct_first_chunk()
        pool_first, direct_first, steps, cancels = [], [], [], []
        for _ in range(trials):
            first, step = _first_chunk_and_step(pool, prompt, 24)
            pool_first.append(first)
            steps.append(step)
            direct_first.append(direct_first_chunk())
            stream = pool.stream(prompt, max_new_tokens=400, min_new_tokens=400)
            for index, _ in enumerate(stream):
                if index == 5:
                    break
            started = time.perf_counter()
            pool.cancel(stream.request_id)
            result = stream.future.result()
            cancels.append(time.perf_counter() - started)
            assert result.finish_reason == "cancelled"
            stream.close()
    step = statistics.median(steps)
    cancel = statistics.median(cancels)
    return {
        "model": label,
        "decode_step_ms": ms(step),
        "cancel_median_ms": ms(cancel),
        "cancel_max_ms": ms(max(cancels)),
        "cancel_minus_step_ms": ms(cancel - step),
        "ttft_pool_ms": ms(statistics.median(pool_first)),
        "ttft_direct_ms": ms(statistics.median(direct_first)),
        "ttft_ratio": round(statistics.median(pool_first) / statistics.median(direct_first), 3),
        "torch_threads": threads,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--only", help="comma-separated step names (dispatch, throughput, ...); default all"
    )
    args = parser.parse_args(argv)
    scale = 1 if args.quick else 3

    from modelpool.shared.embedded import prepare_model
    from modelpool.tinymodel import build_tiny_model

    tiny = str(build_tiny_model(Path(tempfile.mkdtemp(prefix="measure-core-")) / "tiny"))
    smollm = str(prepare_model())
    results: dict[str, Any] = {"load_average": os.getloadavg()}
    steps = [
        ("dispatch", lambda: dispatch(1000)),
        ("throughput", lambda: throughput((1000, 20000), scale)),
        ("deadline_to_retry", lambda: deadline_to_retry(10 * scale)),
        ("sampling_overhead", lambda: sampling_overhead(4 * scale, 250)),
        ("kill_to_release", lambda: kill_to_release(10 * scale)),
        ("cancel_ttft_tiny", lambda: cancel_and_ttft(tiny, "tiny", 5 * scale)),
        ("cancel_ttft_smollm2", lambda: cancel_and_ttft(smollm, "SmolLM2-135M", 3 * scale)),
    ]
    wanted = set(args.only.split(",")) if args.only else None
    for name, run in steps:
        if wanted is not None and name not in wanted:
            continue
        results[name] = run()
        print(f"{name:<22} {json.dumps(results[name])}", flush=True)
    results["load_average_after"] = os.getloadavg()
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
