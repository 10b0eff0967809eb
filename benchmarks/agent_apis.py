"""What the Responses and Anthropic Messages translations cost: TTFT and tokens/s through
``/v1/responses`` and ``/v1/messages`` against ``/v1/chat/completions`` (issue 36).

One daemon on 127.0.0.1 (the ``testing`` backend: ``tokens:N:DELAY`` streams N tokens
DELAY seconds apart, so what differs between the routes is the daemon's own work), the
same prompt streamed through each route in turn, round after round (interleaved, so
that a busy machine slows all three alike). Time to first token is to the first event
that carries text; tokens/s counts the text events after it. Prints medians and each
route's ratio to chat (target >= 0.95x for tokens/s, TTFT within 5%)::

    python -m benchmarks.agent_apis                 # 20 rounds of 64 tokens, ~1 min
    python -m benchmarks.agent_apis --rounds 5 --tokens 32
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


def _chat_text(event: dict[str, Any]) -> bool:
    choices = event.get("choices") or [{}]
    return bool(choices[0].get("delta", {}).get("content"))


def _responses_text(event: dict[str, Any]) -> bool:
    return event.get("type") == "response.output_text.delta"


def _messages_text(event: dict[str, Any]) -> bool:
    return event.get("type") == "content_block_delta"


ROUTES: dict[str, tuple[str, Callable[[str], dict[str, Any]], Callable[[dict[str, Any]], bool]]] = {
    "chat": (
        "/v1/chat/completions",
        lambda p: {
            "model": "m",
            "stream": True,
            "max_tokens": 4096,
            "messages": [{"role": "user", "content": p}],
        },
        _chat_text,
    ),
    "responses": (
        "/v1/responses",
        lambda p: {"model": "m", "stream": True, "max_output_tokens": 4096, "input": p},
        _responses_text,
    ),
    "messages": (
        "/v1/messages",
        lambda p: {
            "model": "m",
            "stream": True,
            "max_tokens": 4096,
            "messages": [{"role": "user", "content": p}],
        },
        _messages_text,
    ),
}


def measure(client: httpx.Client, route: str, prompt: str) -> tuple[float, float]:
    """(seconds to the first text event, text events per second after it)."""
    path, body, is_text = ROUTES[route]
    started = time.perf_counter()
    first: float | None = None
    count = 0
    with client.stream("POST", path, json=body(prompt)) as answer:
        answer.raise_for_status()
        for line in answer.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if is_text(json.loads(line[len("data: ") :])):
                count += 1
                if first is None:
                    first = time.perf_counter()
    end = time.perf_counter()
    assert first is not None, f"{route}: no text"
    rate = (count - 1) / (end - first) if count > 1 and end > first else 0.0
    return first - started, rate


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--delay", type=float, default=0.005)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "tests" / "e2e"))
    sys.path.insert(0, str(ROOT / "tests"))
    from e2e_support import daemon_config, start_daemon  # type: ignore[import-not-found]

    prompt = f"tokens:{args.tokens}:{args.delay}"
    with tempfile.TemporaryDirectory(prefix="modelpool-agent-apis-") as scratch:
        daemon = start_daemon(Path(scratch), daemon_config(workers=1))
        try:
            samples: dict[str, list[tuple[float, float]]] = {route: [] for route in ROUTES}
            with httpx.Client(base_url=daemon.url, timeout=60.0) as client:
                for route in ROUTES:  # warm-up, not counted
                    measure(client, route, prompt)
                for _ in range(args.rounds):
                    for route in ROUTES:
                        samples[route].append(measure(client, route, prompt))
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
    print(
        f"{args.rounds} rounds, {args.tokens} tokens {args.delay * 1000:g} ms apart, "
        "testing backend"
    )
    print(f"{'route':<12}{'TTFT ms':>10}{'tok/s':>10}{'TTFT x chat':>14}{'tok/s x chat':>14}")
    for route, (ttft, rate) in medians.items():
        print(
            f"{route:<12}{ttft * 1000:>10.2f}{rate:>10.1f}"
            f"{ttft / chat_ttft:>14.3f}{rate / chat_rate:>14.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
