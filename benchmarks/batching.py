"""Scenario (g) of scripts/bench: in-worker batching against today's one-at-a-time pool.

Closed-loop clients (each sends its next request when the last one ends) at several
concurrencies, on the same model and cores; chat prompts of mixed lengths, greedy, a
fixed number of new tokens (end-of-sequence suppressed), and for every contender and
level: output tokens per second, request latency p50/p99 and time to first token
p50/p99, with ratios against the first contender. In one run:

1. **In-process pools** through the public streaming API (``pool.stream``):
   ``1x1`` (one worker owning every core, ``max_batch_size`` 1: today), ``1x8`` (the
   same worker batching up to 8) and ``2x1`` (two unbatched workers sharing the cores,
   today's best use of them without batching).
2. **The HTTP pair**: modelpool's daemon (``modelpool serve``, one worker,
   ``max_batch_size`` 8) beside ``transformers serve --continuous-batching``, the
   anchor users would otherwise pick, both streamed over HTTP by the same client.
3. **Cancel** one request inside a full batch: time to its end against one step.
4. **A hang inside a full batch** (the testing backend, a warm spare): what the
   innocent requests pay (attempts, re-prefills, added latency).
5. **The ceiling**: one static left-padded ``generate()`` batch, in-process.

::

    python -m benchmarks.batching                       # the whole sweep, 1..16 clients
    python -m benchmarks.batching --concurrency 1 8 --no-http
    python -m benchmarks.batching --long-every 4      # every 4th prompt ~1,000 tokens long
    python -m benchmarks.batching --contenders 1x8:4096 1x8 --concurrency 8 --long-every 4
                                                      # chunked prefill off, then on
    scripts/bench --scenarios g

Results and the command behind them: docs/benchmarks.md, scenario (g).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modelpool import ModelPool, PoolConfig, PoolError, PoolStream

Json = dict[str, Any]

QUESTIONS = (
    "What is the capital of France?",
    "Write two sentences about the sea, the wind, and a small boat leaving the harbour.",
    "List three prime numbers.",
    "Explain in a few words why the sky is blue, and what happens to the colour at sunset "
    "when the light travels through more of the atmosphere.",
    "Name a fruit.",
    "Describe a quiet morning in a mountain village.",
)


def chat_prompt(index: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": QUESTIONS[index % len(QUESTIONS)]}]


LONG_CONTEXT = (
    "Background notes for the assistant: the harbour opens at dawn, the ferries run every "
    "hour, the market sells fish, bread and fruit, and the lighthouse keeper logs the wind. "
)


@dataclass(frozen=True)
class PromptMix:
    """The sweep's prompts: the chat questions, and every ``long_every``-th one behind a
    system message of about ``long_tokens`` tokens (0: none), so that long prefills join
    running batches as they do in real traffic."""

    long_every: int = 0
    long_tokens: int = 1000

    def chat(self, index: int) -> list[dict[str, str]]:
        messages = chat_prompt(index)
        if self.long_every and index % self.long_every == self.long_every - 1:
            # About 38 tokens a repetition with SmolLM2's tokenizer.
            context = LONG_CONTEXT * max(1, self.long_tokens // 38)
            messages = [{"role": "system", "content": context}, *messages]
        return messages


def percentile(samples: Sequence[float], fraction: float) -> float | None:
    if not samples:
        return None
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


@dataclass(frozen=True)
class Contender:
    """An in-process pool: ``workers`` x ``max_batch_size``, named like ``1x8``; ``1x8:4096``
    also sets ``prefill_chunk_tokens`` (4096: whole prompts read at once, no chunked
    prefill), so that the loop with and without it run side by side."""

    workers: int
    batch: int
    prefill_chunk_tokens: int | None = None

    @property
    def name(self) -> str:
        chunk = "" if self.prefill_chunk_tokens is None else f":{self.prefill_chunk_tokens}"
        return f"{self.workers}x{self.batch}{chunk}"

    @classmethod
    def parse(cls, text: str) -> Contender:
        shape, _, chunk = text.partition(":")
        workers, _, batch = shape.partition("x")
        return cls(int(workers), int(batch), int(chunk) if chunk else None)


OneRequest = Callable[[int], tuple[int, "float | None"]]
"""Runs request ``index`` to its end; returns (completion tokens, seconds to first token)."""


def closed_loop(one_request: OneRequest, concurrency: int, requests: int) -> Json:
    """``concurrency`` clients share ``requests`` requests, each sending its next one when
    the last ends. Tokens per second: completion tokens over the wall time of the level."""
    tickets = iter(range(requests))
    lock = threading.Lock()
    latencies: list[float] = []
    first_tokens: list[float] = []
    tokens = [0]
    errors: list[str] = []

    def client() -> None:
        while True:
            with lock:
                index = next(tickets, None)
            if index is None:
                return
            began = time.perf_counter()
            try:
                count, first = one_request(index)
            except Exception as exc:  # a failed request is a result, not a crash of the run
                with lock:
                    errors.append(repr(exc))
                continue
            with lock:
                latencies.append(time.perf_counter() - began)
                if first is not None:
                    first_tokens.append(first)
                tokens[0] += count

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {
        "concurrency": concurrency,
        "wall_s": time.perf_counter() - started,
        "tokens": tokens[0],
        "errors": errors,
        "latencies_s": latencies,
        "first_tokens_s": first_tokens,
    }


def summarize(runs: Sequence[Json]) -> Json:
    """Rounds of one contender at one level, pooled: tokens over wall time, percentiles
    over every request."""
    wall = sum(run["wall_s"] for run in runs)
    tokens = sum(run["tokens"] for run in runs)
    latencies = [value for run in runs for value in run["latencies_s"]]
    first_tokens = [value for run in runs for value in run["first_tokens_s"]]
    return {
        "rounds": len(runs),
        "requests": len(latencies),
        "errors": [error for run in runs for error in run["errors"]],
        "wall_s": wall,
        "tokens": tokens,
        "tokens_per_s": tokens / wall if wall > 0 else None,
        "latency_p50_s": percentile(latencies, 0.5),
        "latency_p99_s": percentile(latencies, 0.99),
        "ttft_p50_s": percentile(first_tokens, 0.5),
        "ttft_p99_s": percentile(first_tokens, 0.99),
        "runs": list(runs),
    }


def sweep(
    requesters: Mapping[str, OneRequest],
    concurrencies: Sequence[int],
    requests_per_client: int,
    rounds: int,
    log: Any,
    label: str,
) -> dict[str, dict[str, Json]]:
    """Every level on every contender, ``rounds`` times; the contenders' order flips at
    every level and round so that drift on a shared machine favours nobody."""
    runs: dict[str, dict[str, list[Json]]] = {name: {} for name in requesters}
    turn = 0
    for round_index in range(rounds):
        for concurrency in concurrencies:
            names = list(requesters) if turn % 2 == 0 else list(requesters)[::-1]
            turn += 1
            for name in names:
                log(f"(g) {label} {name}, concurrency {concurrency}, round {round_index + 1}")
                runs[name].setdefault(str(concurrency), []).append(
                    closed_loop(requesters[name], concurrency, concurrency * requests_per_client)
                )
    return {
        name: {level: summarize(level_runs) for level, level_runs in levels.items()}
        for name, levels in runs.items()
    }


def read_to_end(stream: PoolStream, began: float) -> tuple[int, float | None]:
    """Read a ``pool.stream`` to its end: its completion tokens, and the seconds from
    ``began`` to its first chunk (None when none came)."""
    first: float | None = None
    for _ in stream:
        if first is None:
            first = time.perf_counter() - began
    result = stream.result
    return (result.completion_tokens or 0) if result is not None else 0, first


def pool_request(pool: ModelPool, new_tokens: int, mix: PromptMix) -> OneRequest:
    def one(index: int) -> tuple[int, float | None]:
        began = time.perf_counter()
        stream = pool.stream(mix.chat(index), max_new_tokens=new_tokens, min_new_tokens=new_tokens)
        return read_to_end(stream, began)

    return one


def http_request(url: str, body: Callable[[int], Json]) -> OneRequest:
    """One streamed chat completion; tokens from the usage the server reports."""
    import httpx

    local = threading.local()

    def one(index: int) -> tuple[int, float | None]:
        if not hasattr(local, "client"):
            local.client = httpx.Client(timeout=httpx.Timeout(1800.0, connect=10.0))
        began = time.perf_counter()
        first: float | None = None
        tokens = 0
        with local.client.stream("POST", url, json=body(index)) as response:
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {response.read()[:300]!r}")
            for line in response.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise RuntimeError(f"stream error: {chunk['error']}")
                if chunk.get("usage"):
                    tokens = int(chunk["usage"]["completion_tokens"])
                for choice in chunk.get("choices") or ():
                    if first is None and (choice.get("delta") or {}).get("content"):
                        first = time.perf_counter() - began
        if tokens == 0:
            raise RuntimeError(f"{url}: the stream ended without a usage chunk to count tokens by")
        return tokens, first

    return one


def cancel_in_full_batch(pool: ModelPool, batch: int, workers: int) -> Json:
    """Fill every worker's batch with long streams, cancel one, and time until its stream
    ends, against the decoding step (the median gap between the others' chunks then)."""
    streams = [
        pool.stream(chat_prompt(index), max_new_tokens=200, min_new_tokens=200)
        for index in range(batch * workers)
    ]
    victim, others = streams[0], streams[1:]
    gaps: list[float] = []
    done = threading.Event()

    def watch(stream: Any) -> None:
        last: float | None = None
        try:
            for _ in stream:
                now = time.perf_counter()
                if last is not None and not done.is_set():
                    gaps.append(now - last)
                last = now
        except concurrent.futures.CancelledError:
            pass  # closed by the measurement once it is over

    watchers = [threading.Thread(target=watch, args=(s,), daemon=True) for s in others]
    for watcher in watchers:
        watcher.start()
    for _ in zip(range(3), victim, strict=False):
        pass  # three chunks: it is decoding inside the batch
    began = time.perf_counter()
    pool.cancel(victim.request_id)
    for _ in victim:
        pass
    cancel_s = time.perf_counter() - began
    done.set()
    for stream in others:
        stream.close()
    for watcher in watchers:
        watcher.join(30)
    step = percentile(gaps, 0.5)
    return {
        "batch": batch,
        "cancel_s": cancel_s,
        "step_s": step,
        "finish_reason": victim.result.finish_reason if victim.result else None,
        "within_step_plus_10ms": step is not None and cancel_s <= step + 0.010,
    }


def static_batch_ceiling(
    model_dir: str, batch: int, new_tokens: int, threads: int, dtype: str | None
) -> Json:
    """One left-padded batch of ``batch`` chat prompts through ``generate()``, in-process."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    kwargs: dict[str, Any] = {} if dtype is None else {"dtype": getattr(torch, dtype)}
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
    model.eval()
    texts = [
        tokenizer.apply_chat_template(chat_prompt(i), add_generation_prompt=True, tokenize=False)
        for i in range(batch)
    ]
    inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.inference_mode():
        model.generate(**inputs, max_new_tokens=2, do_sample=False)  # warm-up
        started = time.perf_counter()
        model.generate(
            **inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False
        )
        wall = time.perf_counter() - started
    return {"batch": batch, "wall_s": wall, "tokens_per_s": batch * new_tokens / wall}


def hang_in_full_batch(batch: int, tokens: int, delay_s: float, stall_timeout_s: float) -> Json:
    """The testing backend (every fault can be rehearsed inside a batch): ``batch - 1``
    innocent requests decode beside one that hangs the step, on one worker with a warm
    spare. Each innocent's re-prefills are its attempts after the first; its added
    latency is measured against the same requests in a batch without the hang."""
    pool = ModelPool(
        PoolConfig(
            model="none",
            backend="testing",
            workers=1,
            spares=1,
            max_batch_size=batch,
            stall_timeout_s=stall_timeout_s,
            deadline_s=120.0,
            devices=("cpu",),
        )
    ).start()
    prompt = f"tokens:{tokens}:{delay_s}"
    try:
        clean = [pool.submit(prompt) for _ in range(batch - 1)]
        clean_latencies = [future.result(timeout=120).latency_s for future in clean]
        began = time.perf_counter()
        futures = [pool.submit(prompt) for _ in range(batch - 1)]
        culprit = pool.submit("hang")
        outcome = "no error"
        try:
            culprit.result(timeout=120)
        except PoolError as error:
            outcome = type(error).__name__
        results = [future.result(timeout=120) for future in futures]
        wall = time.perf_counter() - began
        snapshot = pool.stats()
    finally:
        pool.close(drain=False, timeout=10.0)
    expected = "".join(f"t{index} " for index in range(tokens))
    re_prefills = [result.attempts - 1 for result in results]
    return {
        "batch": batch,
        "tokens": tokens,
        "step_s": delay_s,
        "stall_timeout_s": stall_timeout_s,
        "innocents": len(results),
        "innocents_correct": sum(result.text == expected for result in results),
        "re_prefills_max": max(re_prefills),
        "re_prefills_total": sum(re_prefills),
        "clean_latency_p50_s": percentile(clean_latencies, 0.5),
        "hang_latency_p50_s": percentile([r.latency_s for r in results], 0.5),
        "hang_latency_max_s": max(result.latency_s for result in results),
        "culprit": outcome,
        "wall_s": wall,
        "collateral_retries": snapshot.counters["collateral_retries"],
        "stalls": snapshot.counters["stalls"],
    }


# ---- the HTTP pair ------------------------------------------------------------------------


def unused_port() -> int:
    """A port free a moment ago; ``transformers serve`` cannot bind 0 and say which it got."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.contextmanager
def http_server(
    command: Sequence[str], ready_url: str, log_path: Path, ready_timeout_s: float = 600.0
) -> Iterator[None]:
    """Start a server, wait for ``ready_url`` to answer 200, stop it (SIGTERM) at the end."""
    import httpx

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            list(command), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        deadline = time.monotonic() + ready_timeout_s
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{command[0]} exited: {log_path.read_text()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(ready_url, timeout=2.0).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"not ready in {ready_timeout_s}s: {' '.join(command)}")
            time.sleep(0.2)  # polling a server we do not own for readiness
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def http_pair(
    model_dir: str,
    *,
    batch: int,
    concurrencies: Sequence[int],
    new_tokens: int,
    requests_per_client: int,
    rounds: int,
    vocab_size: int,
    mix: PromptMix,
    log: Any = print,
) -> Json:
    """modelpool's daemon and ``transformers serve --continuous-batching`` through HTTP,
    interleaved per level. Both get greedy decoding and exactly ``new_tokens`` tokens:
    modelpool through ``min_tokens``, transformers through a ``generation_config`` whose
    end-of-sequence id is one the model cannot produce (its vocabulary size)."""
    mp_port, tf_port = unused_port(), unused_port()
    transformers_cli = Path(sys.executable).with_name("transformers")

    def modelpool_body(index: int) -> Json:
        return {
            "model": "bench",
            "messages": mix.chat(index),
            "max_tokens": new_tokens,
            "min_tokens": new_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    generation = {"max_new_tokens": new_tokens, "do_sample": False, "eos_token_id": vocab_size}

    def transformers_body(index: int) -> Json:
        return {
            "model": model_dir,
            "messages": mix.chat(index),
            "stream": True,
            "stream_options": {"include_usage": True},
            "generation_config": json.dumps(generation),
        }

    contenders = {
        "modelpool": (f"http://127.0.0.1:{mp_port}/v1/chat/completions", modelpool_body),
        "transformers": (f"http://127.0.0.1:{tf_port}/v1/chat/completions", transformers_body),
    }
    with tempfile.TemporaryDirectory(prefix="bench-http-") as scratch:
        modelpool_command = [
            sys.executable, "-m", "modelpool", "serve", "--model", model_dir,
            "--workers", "1", "--max-batch-size", str(batch), "--devices", "cpu",
            "--deadline", "1800", "--port", str(mp_port), "--log-level", "warning",
        ]  # fmt: skip
        transformers_command = [
            str(transformers_cli), "serve", model_dir, "--continuous-batching",
            "--device", "cpu", "--host", "127.0.0.1", "--port", str(tf_port),
        ]  # fmt: skip
        log(f"(g) HTTP: modelpool serve (1 worker, max_batch_size {batch}) and transformers serve")
        with (
            http_server(
                modelpool_command,
                f"http://127.0.0.1:{mp_port}/readyz",
                Path(scratch, "modelpool.log"),
            ),
            http_server(
                transformers_command,
                f"http://127.0.0.1:{tf_port}/health",
                Path(scratch, "transformers.log"),
            ),
        ):
            requesters = {name: http_request(*contender) for name, contender in contenders.items()}
            for requester in requesters.values():
                requester(0)  # warm-up: the first request pays for lazy set-up
            results = sweep(requesters, concurrencies, requests_per_client, rounds, log, "HTTP")
    return {"batch": batch, "contenders": results}


# ---- the whole scenario -------------------------------------------------------------------

DEFAULT_CONTENDERS = (Contender(1, 1), Contender(1, 8), Contender(2, 1))


def run(
    model_dir: str,
    *,
    contenders: Sequence[Contender] = DEFAULT_CONTENDERS,
    concurrencies: Sequence[int],
    new_tokens: int,
    requests_per_client: int,
    dtype: str | None,
    ceiling: bool,
    rounds: int = 1,
    backend_options: Mapping[str, Any] | None = None,
    http: bool = True,
    hang: bool = True,
    mix: PromptMix = PromptMix(),
    log: Any = print,
) -> Json:
    """Every concurrency level on every contender, the contenders interleaved per level."""
    common_options: dict[str, Any] = dict(backend_options or {})
    if dtype is not None:
        common_options["dtype"] = dtype
    results: dict[str, dict[str, Json]] = {}
    cancel: Json | None = None
    pools: dict[str, ModelPool] = {}
    try:
        for contender in contenders:
            log(f"(g) starting pool {contender.name} (workers x max_batch_size)")
            options = dict(common_options)
            if contender.prefill_chunk_tokens is not None:
                options["prefill_chunk_tokens"] = contender.prefill_chunk_tokens
            pools[contender.name] = ModelPool(
                PoolConfig(
                    model=model_dir,
                    backend="hf",
                    backend_options=options,
                    workers=contender.workers,
                    max_batch_size=contender.batch,
                    devices=("cpu",),
                    deadline_s=1800.0,
                    max_queue=4096,
                )
            ).start()
            pools[contender.name].generate(chat_prompt(0), max_new_tokens=2)
        results = sweep(
            {
                contender.name: pool_request(pools[contender.name], new_tokens, mix)
                for contender in contenders
            },
            concurrencies,
            requests_per_client,
            rounds,
            log,
            "pool",
        )
        batched = max(contenders, key=lambda contender: contender.batch)
        if batched.batch > 1:
            log(f"(g) cancel one request in a full batch of {batched.batch}")
            cancel = cancel_in_full_batch(pools[batched.name], batched.batch, batched.workers)
    finally:
        for pool in pools.values():
            pool.close(drain=False, timeout=10.0)
    top_batch = max(contender.batch for contender in contenders)
    report: Json = {
        "new_tokens": new_tokens,
        "requests_per_client": requests_per_client,
        "rounds": rounds,
        "contender_names": [contender.name for contender in contenders],
        "concurrencies": list(concurrencies),
        "long_every": mix.long_every,
        "backend_options": common_options,
        "long_tokens": mix.long_tokens,
        "contenders": results,
        "cancel_in_batch": cancel,
    }
    if http and top_batch > 1:
        from transformers import AutoConfig

        report["http"] = http_pair(
            model_dir,
            batch=top_batch,
            concurrencies=concurrencies,
            new_tokens=new_tokens,
            requests_per_client=requests_per_client,
            rounds=rounds,
            vocab_size=int(AutoConfig.from_pretrained(model_dir).vocab_size),
            mix=mix,
            log=log,
        )
    if hang and top_batch > 1:
        log(f"(g) a hang inside a full batch of {top_batch} (testing backend, warm spare)")
        report["hang_in_batch"] = hang_in_full_batch(
            top_batch, tokens=40, delay_s=0.02, stall_timeout_s=0.5
        )
    if ceiling:
        from modelpool.supervisor.spawn import usable_cpus

        top = max(concurrencies)
        log(f"(g) static generate() batch of {top}, in-process")
        report["static_batch"] = static_batch_ceiling(
            model_dir, top, new_tokens, usable_cpus(), dtype
        )
    return report


def _fmt(value: float | None, unit: str = "s") -> str:
    if value is None:
        return "-"
    return f"{value:.2f}{unit}" if unit == "s" else f"{value:.1f}"


def _ratio(value: float | None, reference: float | None) -> str:
    if value is None or not reference:
        return "-"
    return f"{value / reference:.2f}x"


def _table(title: str, names: Sequence[str], levels: Sequence[str], data: Json) -> list[str]:
    """One row per level: tok/s of each contender (ratio against the first), then
    latency and TTFT p50/p99 of each."""
    base = names[0]
    headers = ["clients", f"tok/s {base}"]
    for name in names[1:]:
        headers += [f"tok/s {name}", "ratio"]
    headers += [f"latency p50/p99 {name}" for name in names]
    headers += [f"TTFT p50/p99 {name}" for name in names]

    def pair(entry: Mapping[str, Any], key: str) -> str:
        return f"{_fmt(entry.get(key + '_p50_s'))}/{_fmt(entry.get(key + '_p99_s'))}"

    rows = []
    for level in levels:
        reference = data[base].get(level, {})
        row = [level, _fmt(reference.get("tokens_per_s"), "")]
        for name in names[1:]:
            entry = data[name].get(level, {})
            row += [
                _fmt(entry.get("tokens_per_s"), ""),
                _ratio(entry.get("tokens_per_s"), reference.get("tokens_per_s")),
            ]
        row += [pair(data[name].get(level, {}), "latency") for name in names]
        row += [pair(data[name].get(level, {}), "ttft") for name in names]
        rows.append(row)
    errors = sum(
        len(data[name].get(level, {}).get("errors", ())) for name in names for level in levels
    )
    return [
        title,
        "",
        "| " + " | ".join(headers) + " |",
        "|" + "|".join("---" for _ in headers) + "|",
        *("| " + " | ".join(row) + " |" for row in rows),
        "",
        f"Failed requests: {errors}.",
    ]


def markdown(report: Mapping[str, Any]) -> str:
    """The side-by-side tables: every contender against the first."""
    levels = [str(level) for level in report["concurrencies"]]
    lines = _table(
        f"## (g) Batching: in-process pools (workers x max_batch_size), "
        f"{report['new_tokens']} new tokens, closed-loop clients, "
        f"{report.get('rounds', 1)} round(s) pooled",
        report["contender_names"],
        levels,
        report["contenders"],
    )
    http = report.get("http")
    if http:
        lines.append("")
        lines += _table(
            f"### Through HTTP: modelpool serve (1 worker, max_batch_size {http['batch']}) "
            "against transformers serve --continuous-batching",
            ["transformers", "modelpool"],
            levels,
            http["contenders"],
        )
    cancel = report.get("cancel_in_batch")
    if cancel:
        lines += [
            "",
            f"Cancel inside a full batch of {cancel['batch']}: the stream ended "
            f"{cancel['cancel_s'] * 1000:.1f} ms after pool.cancel(), one decoding step then "
            f"{(cancel['step_s'] or 0) * 1000:.1f} ms (target: one step + 10 ms: "
            f"{'met' if cancel['within_step_plus_10ms'] else 'missed'}).",
        ]
    hang = report.get("hang_in_batch")
    if hang:
        lines += [
            "",
            f"A hang inside a full batch of {hang['batch']} (testing backend, "
            f"{hang['tokens']} tokens at {hang['step_s'] * 1000:.0f} ms a step, stall_timeout_s "
            f"{hang['stall_timeout_s']}, a warm spare): {hang['innocents_correct']} of "
            f"{hang['innocents']} innocent requests correct, at most {hang['re_prefills_max']} "
            f"re-prefill each ({hang['re_prefills_total']} in all); their latency p50 "
            f"{_fmt(hang['hang_latency_p50_s'])} against {_fmt(hang['clean_latency_p50_s'])} "
            f"without the hang; the hanging request: {hang['culprit']}.",
        ]
    static = report.get("static_batch")
    if static:
        lines += [
            "",
            f"Ceiling: one static left-padded generate() batch of {static['batch']} in-process: "
            f"{static['tokens_per_s']:.1f} tok/s.",
        ]
    return "\n".join(lines)


def _backend_option(text: str) -> tuple[str, Any]:
    key, _, value = text.partition("=")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.batching",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default="embedded:smollm2-135m-instruct")
    parser.add_argument(
        "--contenders",
        nargs="+",
        default=[contender.name for contender in DEFAULT_CONTENDERS],
        help="in-process pools as WORKERSxMAX_BATCH_SIZE; the first is the reference",
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument(
        "--rounds", type=int, default=1, help="repeat the sweep, interleaved, and pool the rounds"
    )
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--no-ceiling", action="store_true")
    parser.add_argument("--no-http", action="store_true", help="skip the HTTP pair")
    parser.add_argument("--no-hang", action="store_true", help="skip the hang in a batch")
    parser.add_argument(
        "--long-every",
        type=int,
        default=0,
        help="every Nth prompt carries a long system message (0: none)",
    )
    parser.add_argument("--long-tokens", type=int, default=1000)
    parser.add_argument(
        "--backend-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a backend option for every in-process pool, VALUE in JSON where it parses "
        "(e.g. prefix_cache_bytes=0: every long prompt read in full)",
    )
    parser.add_argument("--json", default=None, help="write the report here")
    args = parser.parse_args(argv)
    from modelpool.shared.embedded import resolve_model

    report = run(
        resolve_model(args.model),
        contenders=[Contender.parse(text) for text in args.contenders],
        concurrencies=args.concurrency,
        new_tokens=args.new_tokens,
        requests_per_client=args.requests_per_client,
        rounds=args.rounds,
        dtype=args.dtype,
        ceiling=not args.no_ceiling,
        http=not args.no_http,
        hang=not args.no_hang,
        mix=PromptMix(args.long_every, args.long_tokens),
        backend_options=dict(_backend_option(text) for text in args.backend_option),
    )
    print(markdown(report))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
