"""What Ollama's wire format costs: TTFT and tokens/s through ``/api/chat`` (NDJSON)
against ``/v1/chat/completions`` (server-sent events), the same prompts (issue 60).

One daemon on 127.0.0.1 serving the embedded SmolLM2 (``--model``, the hf backend, greedy,
a fixed ``num_predict``/``max_tokens`` so that both routes write the same tokens), or the
``testing`` backend (``--model testing``: ``tokens:N:DELAY`` streams N tokens DELAY
seconds apart, so what differs is the daemon's own work). Each prompt is streamed through
both routes in turn, round after round (interleaved, so that a busy machine slows both
alike; each route first every other round). Time to first token is to the first line or
event that carries text; tokens/s counts the text pieces after it. Prints each route's
medians and ratio to chat, and the median of the pairs' ratios (the same prompt through
both routes back to back: the steadier figure on a shared machine); target >= 0.95x for
tokens/s, TTFT within 5%::

    python -m benchmarks.ollama_api                      # SmolLM2, 5 rounds x 4 prompts
    python -m benchmarks.ollama_api --model testing --rounds 20
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
EMBEDDED = "embedded:smollm2-135m-instruct"
PROMPTS = (
    "Write a short poem about the sea.",
    "Explain what a hash table is.",
    "List three uses of a paper clip.",
    "Describe a sunrise over the mountains.",
)


def _chat_body(prompt: str, tokens: int) -> dict[str, Any]:
    return {
        "model": "m",
        "stream": True,
        "max_tokens": tokens,
        "temperature": 0,
        "messages": [{"role": "user", "content": prompt}],
    }


def _ollama_body(prompt: str, tokens: int) -> dict[str, Any]:
    return {
        "model": "m",
        "options": {"num_predict": tokens, "temperature": 0},
        "messages": [{"role": "user", "content": prompt}],
    }


def _chat_text(line: str) -> bool:
    if not line.startswith("data: ") or line == "data: [DONE]":
        return False
    choices = json.loads(line[len("data: ") :]).get("choices") or [{}]
    return bool(choices[0].get("delta", {}).get("content"))


def _ollama_text(line: str) -> bool:
    return bool(line) and bool(json.loads(line).get("message", {}).get("content"))


ROUTES: dict[str, tuple[str, Callable[[str, int], dict[str, Any]], Callable[[str], bool]]] = {
    "chat": ("/v1/chat/completions", _chat_body, _chat_text),
    "ollama": ("/api/chat", _ollama_body, _ollama_text),
}


def measure(client: httpx.Client, route: str, prompt: str, tokens: int) -> tuple[float, float]:
    """(seconds to the first piece of text, pieces per second after it)."""
    path, body, is_text = ROUTES[route]
    started = time.perf_counter()
    first: float | None = None
    count = 0
    with client.stream("POST", path, json=body(prompt, tokens)) as answer:
        answer.raise_for_status()
        for line in answer.iter_lines():
            if is_text(line):
                count += 1
                if first is None:
                    first = time.perf_counter()
    end = time.perf_counter()
    assert first is not None, f"{route}: no text"
    rate = (count - 1) / (end - first) if count > 1 and end > first else 0.0
    return first - started, rate


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=EMBEDDED, help=f"{EMBEDDED} (default) or testing")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--delay", type=float, default=0.005, help="testing backend only")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "tests" / "e2e"))
    sys.path.insert(0, str(ROOT / "tests"))
    from e2e_support import daemon_config, start_daemon  # type: ignore[import-not-found]

    testing = args.model == "testing"
    if testing:
        config = daemon_config(workers=1)
        prompts: tuple[str, ...] = (f"tokens:{args.tokens}:{args.delay}",)
    else:
        config = daemon_config(model=args.model, backend="hf", workers=1, deadline_s=120.0)
        prompts = PROMPTS
    with tempfile.TemporaryDirectory(prefix="modelpool-ollama-api-") as scratch:
        daemon = start_daemon(Path(scratch), config, ready_timeout=600.0)
        try:
            samples: dict[str, list[tuple[float, float]]] = {route: [] for route in ROUTES}
            with httpx.Client(base_url=daemon.url, timeout=120.0) as client:
                for route in ROUTES:  # warm-up, not counted
                    measure(client, route, prompts[0], args.tokens)
                for number in range(args.rounds):
                    for prompt in prompts:
                        # Each route first every other round: neither gains by its place.
                        order = list(ROUTES) if number % 2 == 0 else list(reversed(ROUTES))
                        for route in order:
                            samples[route].append(measure(client, route, prompt, args.tokens))
        finally:
            daemon.stop()
    medians = {
        route: (
            statistics.median(t for t, _ in values),
            statistics.median(r for _, r in values),
        )
        for route, values in samples.items()
    }
    chat_ttft, chat_rate = medians["chat"]
    model = f"testing backend, {args.delay * 1000:g} ms apart" if testing else args.model
    print(
        f"{args.rounds} rounds x {len(prompts)} prompt(s), {args.tokens} tokens, {model}, "
        f"{len(samples['chat'])} runs per route"
    )
    print(f"{'route':<10}{'TTFT ms':>10}{'tok/s':>10}{'TTFT x chat':>14}{'tok/s x chat':>14}")
    for route, (ttft, rate) in medians.items():
        print(
            f"{route:<10}{ttft * 1000:>10.2f}{rate:>10.1f}"
            f"{ttft / chat_ttft:>14.3f}{rate / chat_rate:>14.3f}"
        )
    # The same prompt through both routes back to back, pair by pair: what a load that
    # drifts over the run does to both medians cancels out of each pair's ratio.
    pairs = list(zip(samples["chat"], samples["ollama"], strict=True))
    ttft_ratio = statistics.median(o[0] / c[0] for c, o in pairs)
    rate_ratio = statistics.median(o[1] / c[1] for c, o in pairs if c[1] > 0)
    print(f"paired medians: /api/chat TTFT {ttft_ratio:.3f}x chat, tokens/s {rate_ratio:.3f}x chat")
    return 0


if __name__ == "__main__":
    sys.exit(main())
