"""Embeddings per second and rerank latency: modelpool's library against sentence-transformers
in this process, side by side in one run, on the packaged all-MiniLM-L6-v2.

Same model directory (``embedded:all-minilm-l6-v2``, prepared once), same torch threads,
float32 on the CPU. Texts are short (16 tokens) or long (256 tokens, the model's
``max_seq_length``), counted with the model's tokenizer, special tokens included.

1. **Concurrent clients** (1, 8, 32): modelpool is one worker, each client a thread
   calling ``pool.embed(text)`` with one text per request; sentence-transformers is
   ``SentenceTransformer.encode`` over the same texts with ``batch_size`` = the clients
   (what an in-process server batching that many concurrent requests at once could do).
2. **Batch 32**: one client, 32 texts per call: ``pool.embed(texts)`` against
   ``encode(texts, batch_size=32)`` (the target: 0.9x or better through the library).
3. **Rerank**: 100 documents against one query, p50 latency: ``pool.score(query, docs)``
   (cosine, the bi-encoder) against ``encode([query, *docs])`` and ``cos_sim``.

Each figure is the median of ``--rounds`` rounds, the two sides alternating; the load
average is printed before and after (other work on the machine shows there)::

    python -m benchmarks.embeddings                      # everything
    python -m benchmarks.embeddings --texts 128 --rounds 3 --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

from modelpool.shared.config import PoolConfig
from modelpool.shared.embedded import EMBEDDING_NAME, prepare_model
from modelpool.supervisor.pool import ModelPool

_WORDS = [
    "river",
    "mountain",
    "quiet",
    "evening",
    "market",
    "window",
    "garden",
    "letter",
    "morning",
    "station",
    "yellow",
    "simple",
    "history",
    "science",
    "village",
    "kitchen",
    "winter",
    "summer",
    "people",
    "bright",
    "engine",
    "signal",
    "forest",
    "harbor",
    "pencil",
    "silver",
    "thunder",
    "island",
    "candle",
    "doctor",
]


@dataclass
class Row:
    case: str
    texts: str
    library_per_s: float
    reference_per_s: float

    @property
    def ratio(self) -> float:
        return self.library_per_s / self.reference_per_s if self.reference_per_s else 0.0


def texts_of(tokenizer: Any, tokens: int, count: int, seed: int) -> list[str]:
    """``count`` distinct texts of exactly ``tokens`` tokens (special tokens included)."""
    rng = random.Random(seed)
    texts: list[str] = []
    while len(texts) < count:
        words: list[str] = []
        while len(tokenizer(" ".join(words))["input_ids"]) < tokens:
            words.append(rng.choice(_WORDS))
        while len(tokenizer(" ".join(words))["input_ids"]) > tokens:
            words.pop()
        if len(tokenizer(" ".join(words))["input_ids"]) == tokens:
            texts.append(" ".join(words))
    return texts


def clients_rate(pool: ModelPool, texts: list[str], clients: int) -> float:
    """Texts per second with ``clients`` threads each embedding one text per request."""
    queue = list(texts)
    lock = threading.Lock()

    def client() -> None:
        while True:
            with lock:
                if not queue:
                    return
                text = queue.pop()
            pool.embed(text)

    started = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return len(texts) / (time.perf_counter() - started)


def _embed_each(pool: ModelPool, chunks: list[list[str]]) -> None:
    for chunk in chunks:
        pool.embed(chunk)


def timed(action: Callable[[], object], count: int) -> float:
    started = time.perf_counter()
    action()
    return count / (time.perf_counter() - started)


def p50_s(action: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from sentence_transformers import SentenceTransformer, util

    torch.set_num_threads(args.threads)
    path = str(prepare_model(EMBEDDING_NAME))
    reference = SentenceTransformer(path, device="cpu")
    tokenizer = reference.tokenizer
    texts = {
        "short": texts_of(tokenizer, 16, args.texts, 1),
        "long": texts_of(tokenizer, 256, max(32, args.texts // 4), 2),
    }
    documents = texts_of(tokenizer, 64, 100, 3)
    query = "which village by the river has a market in the evening"
    load_before = os.getloadavg()
    config = PoolConfig(
        model=path,
        workers=1,
        devices=("cpu",),
        deadline_s=600.0,
        max_queue=10_000,
        backend_options={"torch_threads": args.threads},
    )
    rows: list[Row] = []
    rerank: dict[str, float] = {}
    with ModelPool(config) as pool:
        pool.embed(texts["short"][:32])
        reference.encode(texts["short"][:32], batch_size=32)
        for kind, batch in texts.items():
            for clients in args.clients:
                library, ours = [], []
                for _ in range(args.rounds):
                    library.append(clients_rate(pool, batch, clients))
                    ours.append(
                        timed(partial(reference.encode, batch, batch_size=clients), len(batch))
                    )
                case = f"{clients} clients"
                rows.append(Row(case, kind, statistics.median(library), statistics.median(ours)))
                _progress(rows[-1])
            chunks = [batch[i : i + 32] for i in range(0, len(batch), 32)]
            library, ours = [], []
            for _ in range(args.rounds):
                library.append(timed(partial(_embed_each, pool, chunks), len(batch)))
                ours.append(timed(partial(reference.encode, batch, batch_size=32), len(batch)))
            rows.append(Row("batch 32", kind, statistics.median(library), statistics.median(ours)))
            _progress(rows[-1])

        def reference_rerank() -> object:
            vectors = reference.encode([query, *documents], batch_size=32, convert_to_tensor=True)
            return util.cos_sim(vectors[0], vectors[1:])

        best = max(range(100), key=pool.score(query, documents).scores.__getitem__)
        expected = int(reference_rerank().argmax())  # type: ignore[attr-defined]
        rerank = {
            "library_p50_s": p50_s(lambda: pool.score(query, documents), args.rerank_repeats),
            "reference_p50_s": p50_s(reference_rerank, args.rerank_repeats),
            "same_top_document": float(best == expected),
        }
    load_after = os.getloadavg()
    return {
        "threads": args.threads,
        "rounds": args.rounds,
        "load_before": load_before,
        "load_after": load_after,
        "rows": [{**asdict(row), "ratio": row.ratio} for row in rows],
        "rerank": rerank,
    }


def _progress(row: Row) -> None:
    """Each row as it is measured (on stderr), so that a run cut short still tells."""
    print(
        f"measured {row.case} {row.texts}: {row.library_per_s:.1f}/s vs "
        f"{row.reference_per_s:.1f}/s ({row.ratio:.2f})",
        file=sys.stderr,
        flush=True,
    )


def show(report: dict[str, Any]) -> None:
    print(
        f"all-MiniLM-L6-v2, {report['threads']} torch threads, median of {report['rounds']} "
        f"rounds; load average before {report['load_before'][0]:.2f}, "
        f"after {report['load_after'][0]:.2f}"
    )
    print(f"{'case':<12} {'texts':<6} {'modelpool/s':>12} {'s-t/s':>10} {'ratio':>7}")
    for row in report["rows"]:
        print(
            f"{row['case']:<12} {row['texts']:<6} {row['library_per_s']:>12.1f} "
            f"{row['reference_per_s']:>10.1f} {row['ratio']:>7.2f}"
        )
    rerank = report["rerank"]
    print(
        f"rerank 100 docs p50: modelpool {rerank['library_p50_s'] * 1000:.1f} ms, "
        f"sentence-transformers {rerank['reference_p50_s'] * 1000:.1f} ms, ratio "
        f"{rerank['reference_p50_s'] / rerank['library_p50_s']:.2f} (same top document: "
        f"{bool(rerank['same_top_document'])})"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.embeddings", description=__doc__)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--texts", type=int, default=256, help="short texts per round")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rerank-repeats", type=int, default=10)
    parser.add_argument("--json", default=None, help="write the report here")
    args = parser.parse_args(argv)
    report = run(args)
    show(report)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
