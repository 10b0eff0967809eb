"""Embeddings per second over HTTP: a modelpool daemon against ``infinity-emb`` serving the
same model, side by side in one run (issue 37's HTTP leg; the library leg against
sentence-transformers in-process is ``benchmarks/embeddings.py``).

Both servers run on 127.0.0.1 with the same model directory (by default the packaged
``embedded:all-minilm-l6-v2``), on the CPU, with the same torch threads
(``OMP_NUM_THREADS`` = the cores, ``OMP_WAIT_POLICY=PASSIVE``). ``clients`` concurrent
clients each send one text per request, OpenAI's ``/embeddings`` body, for ``--seconds``
per cell; a short text is 16 tokens and a long one 256 (the model's own tokens, special
ones included). The servers take turns cell by cell, so that a busy machine slows both
alike; the table says embeddings/s for each, p50 latency, and modelpool's ratio to
infinity, with the load average before and after::

    python -m benchmarks.embeddings_http                        # modelpool only
    python -m benchmarks.embeddings_http --infinity /tmp/infinity-venv/bin/infinity_emb
    python -m benchmarks.embeddings_http --clients 1 8 --seconds 5 --json out.json

infinity-emb is not a dependency: it is installed in a venv of its own (its pins do not
fit this project's) and started from there; without ``--infinity`` only modelpool runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = "embedded:all-minilm-l6-v2"
LENGTHS = {"short": 16, "long": 256}
WORDS = (
    "the", "river", "runs", "past", "an", "old", "mill", "where", "children", "play",
    "each", "summer", "while", "their", "parents", "talk", "about", "weather", "markets",
    "music", "books", "travel", "gardens", "bread", "coffee", "and", "news",
)  # fmt: skip
BOUND_PORT = re.compile(r"Uvicorn running on http://[^\s:]+:(\d+)")
INFINITY_PORT_WAIT_S = 300.0
# Both servers get the same torch thread budget, and threads that sleep when idle (an
# idle server's spinning threads would steal the cores of the one whose turn it is).
THREADS_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": str(os.cpu_count() or 1)}


@dataclass(frozen=True)
class Cell:
    server: str
    length: str
    clients: int
    embeddings_per_s: float
    p50_ms: float
    requests: int
    errors: int


def texts_of(tokens: int, model_dir: str, count: int = 64) -> list[str]:
    """``count`` different texts of ``tokens`` tokens each in the model's tokenizer
    (special tokens included), cut word by word."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts: list[str] = []
    for start in range(count):
        words: list[str] = [f"item{start}"]
        position = start
        while len(tokenizer(" ".join(words))["input_ids"]) < tokens:
            words.append(WORDS[position % len(WORDS)])
            position += 7
        while len(tokenizer(" ".join(words))["input_ids"]) > tokens:
            words.pop()
        texts.append(" ".join(words))
    return texts


def start_modelpool(
    model: str, workdir: Path, max_batch_size: int, workers: int
) -> tuple[subprocess.Popen[bytes], str]:
    config = workdir / "modelpool.toml"
    config.write_text(
        f'model = "{model}"\nbackend = "hf"\nworkers = {workers}\ndevices = ["cpu"]\n'
        f"max_batch_size = {max_batch_size}\nmax_queue = 4096\ndeadline_s = 120.0\n\n"
        '[server]\nhost = "127.0.0.1"\nport = 0\nclient_max_running = 4096\n'
        "client_max_queued = 4096\n"
    )
    log = workdir / "modelpool.log"
    command = [sys.executable, "-m", "modelpool.cli", "serve", "--config", str(config)]
    with log.open("wb") as out:
        process = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env={**os.environ, **THREADS_ENV},
        )
    deadline = time.monotonic() + INFINITY_PORT_WAIT_S
    while time.monotonic() < deadline:
        found = BOUND_PORT.search(log.read_text(errors="replace"))
        if found:
            return process, f"http://127.0.0.1:{found.group(1)}/v1"
        if process.poll() is not None:
            raise SystemExit(f"modelpool exited:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    process.kill()
    raise SystemExit("modelpool did not start")


def start_infinity(
    executable: str, model_dir: str, workdir: Path, batch_size: int
) -> tuple[subprocess.Popen[bytes], str]:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = workdir / "infinity.log"
    command = [
        executable, "v2", "--model-id", model_dir, "--port", str(port), "--host", "127.0.0.1",
        "--device", "cpu", "--engine", "torch", "--batch-size", str(batch_size),
        "--no-model-warmup",
    ]  # fmt: skip
    env = {
        **os.environ,
        **THREADS_ENV,
        "HF_HUB_OFFLINE": "1",
        "INFINITY_ANONYMOUS_USAGE_STATS": "0",
    }
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + INFINITY_PORT_WAIT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"infinity exited:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    process.kill()
    raise SystemExit(f"infinity did not start:\n{log.read_text()[-3000:]}")


async def run_cell(
    server: str, url: str, model: str, texts: list[str], clients: int, seconds: float, length: str
) -> Cell:
    latencies: list[float] = []
    errors = 0
    stop_at = time.monotonic() + seconds

    async def client(number: int) -> None:
        nonlocal errors
        async with httpx.AsyncClient(base_url=url, timeout=120.0) as http:
            sent = number
            while time.monotonic() < stop_at:
                body = {"model": model, "input": [texts[sent % len(texts)]]}
                started = time.perf_counter()
                response = await http.post("/embeddings", json=body)
                if response.status_code == 200 and len(response.json()["data"]) == 1:
                    latencies.append(time.perf_counter() - started)
                else:
                    errors += 1
                sent += clients

    began = time.perf_counter()
    await asyncio.gather(*(client(number) for number in range(clients)))
    wall = time.perf_counter() - began
    return Cell(
        server=server,
        length=length,
        clients=clients,
        embeddings_per_s=round(len(latencies) / wall, 1),
        p50_ms=round(statistics.median(latencies) * 1000, 1) if latencies else float("nan"),
        requests=len(latencies),
        errors=errors,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="a model directory or embedded:NAME")
    parser.add_argument("--infinity", help="the infinity_emb executable (its own venv)")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--lengths", nargs="+", default=list(LENGTHS), choices=list(LENGTHS))
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--workers", type=int, default=1, help="modelpool's worker processes")
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args(argv)

    from modelpool.shared.embedded import resolve_model

    model_dir = resolve_model(args.model)
    texts = {length: texts_of(LENGTHS[length], model_dir) for length in args.lengths}
    report: dict[str, Any] = {"model": args.model, "load_average_before": os.getloadavg()}
    servers: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
    with tempfile.TemporaryDirectory(prefix="embeddings-http.") as scratch:
        workdir = Path(scratch)
        try:
            servers["modelpool"] = start_modelpool(
                model_dir, workdir, args.batch_size, args.workers
            )
            if args.infinity:
                servers["infinity"] = start_infinity(
                    args.infinity, model_dir, workdir, args.batch_size
                )
            cells: list[Cell] = []
            for length in args.lengths:
                for clients in args.clients:
                    for name, (_, url) in servers.items():
                        # Warm both up on the cell's texts before it is timed.
                        asyncio.run(
                            run_cell(name, url, model_dir, texts[length], clients, 1.0, length)
                        )
                        cell = asyncio.run(
                            run_cell(
                                name, url, model_dir, texts[length], clients, args.seconds, length
                            )
                        )
                        cells.append(cell)
                        print(json.dumps(asdict(cell)), flush=True)
        finally:
            for process, _ in servers.values():
                process.terminate()
                try:
                    process.wait(30)
                except subprocess.TimeoutExpired:
                    process.kill()
    report["load_average_after"] = os.getloadavg()
    report["cells"] = [asdict(cell) for cell in cells]
    before, after = report["load_average_before"], report["load_average_after"]
    print(f"\nload average before {before}, after {after}")
    header = f"{'length':>6} {'clients':>7} {'modelpool/s':>12} {'infinity/s':>11} {'ratio':>6}"
    print(header + "  p50 ms (modelpool / infinity)")
    for length in args.lengths:
        for clients in args.clients:
            row = {c.server: c for c in cells if c.length == length and c.clients == clients}
            ours = row["modelpool"]
            theirs = row.get("infinity")
            ratio = (
                f"{ours.embeddings_per_s / theirs.embeddings_per_s:.2f}"
                if theirs and theirs.embeddings_per_s
                else "-"
            )
            print(
                f"{length:>6} {clients:>7} {ours.embeddings_per_s:>12} "
                f"{theirs.embeddings_per_s if theirs else '-':>11} {ratio:>6}  "
                f"{ours.p50_ms} / {theirs.p50_ms if theirs else '-'}"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
