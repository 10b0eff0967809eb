"""What reading tool calls in each family's own syntax costs: time to first token and
tokens/s of a streamed chat with the family's tool parser on (``tools`` offered,
``tool_choice: auto``: every streamed piece goes through the family's reader, and the
family's grammar is attached) against the same request without tools (parser off).

One daemon on 127.0.0.1, one model per family (a tiny model directory carrying the
family's chat template and special tokens, ``tool_parser = "auto"``), served by the
``testing`` backend: ``tokens:N:DELAY`` streams N tokens DELAY seconds apart, so what
differs is the daemon's own work. Rounds interleave on and off, family by family. Also
the reader alone: microseconds per streamed piece, against the decode step it rides on.
Also what a tools request's checks cost before it runs (the same for every parser) and
what binding the family's syntax adds to them. Prints medians and on/off ratios (target
>= 0.97x)::

    python -m benchmarks.tool_formats                  # 15 rounds of 64 tokens, ~2 min
    python -m benchmarks.tool_formats --rounds 5 --tokens 32
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
KEY = "bench-tool-formats"
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def measure(client: httpx.Client, model: str, prompt: str, tools: bool) -> tuple[float, float]:
    """(seconds to the first content delta, content deltas per second after it)."""
    body: dict[str, Any] = {
        "model": model,
        "stream": True,
        "max_tokens": 4096,
        "messages": [{"role": "user", "content": prompt}],
    }
    if tools:
        body["tools"] = [TOOL]
    started = time.perf_counter()
    first: float | None = None
    count = 0
    with client.stream("POST", "/v1/chat/completions", json=body) as answer:
        answer.raise_for_status()
        for line in answer.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[len("data: ") :]).get("choices") or [{}]
            if choices[0].get("delta", {}).get("content"):
                count += 1
                if first is None:
                    first = time.perf_counter()
    end = time.perf_counter()
    assert first is not None, f"{model}: no text"
    rate = (count - 1) / (end - first) if count > 1 and end > first else 0.0
    return first - started, rate


def reader_cost_us(parser: str, tokens: int) -> float:
    """Microseconds the family's reader takes per streamed piece of plain text."""
    from modelpool.shared.tools import CallReader, parse_tool_request

    plan = parse_tool_request({"tools": [TOOL]})
    assert plan is not None
    bound = plan.bound(parser, "bench", ())
    pieces = [f"t{index} " for index in range(tokens)]
    rounds = 200
    started = time.perf_counter()
    for _ in range(rounds):
        reader = CallReader(bound)
        for piece in pieces:
            reader.feed(piece)
        reader.finish()
    return (time.perf_counter() - started) / (rounds * tokens) * 1e6


def check_costs_ms(parser: str) -> tuple[float, float]:
    """Milliseconds of a tools request's checks before it runs (parse, schema checks and
    grammar validation: the same with any parser) and of the part this parser adds
    (binding it: the grammar rewritten in its syntax), medians of 20."""
    from modelpool.server.core.generation_body import parse_chat
    from modelpool.server.generation import bind_tool_syntax
    from modelpool.shared.config import PoolConfig
    from modelpool.shared.structured import constrain

    config = PoolConfig(model="none", tool_parser=parser)
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [TOOL]}
    checks, binds = [], []
    for _ in range(20):
        started = time.perf_counter()
        job = parse_chat(body)
        parsed = time.perf_counter()
        bind_tool_syntax(job, config, "bench")
        bound = time.perf_counter()
        constrain(dict(job.params), 5.0)
        checks.append((time.perf_counter() - bound) + (parsed - started))
        binds.append(bound - parsed)
    return statistics.median(checks) * 1e3, statistics.median(binds) * 1e3


def main() -> int:
    options = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    options.add_argument("--rounds", type=int, default=15)
    options.add_argument("--tokens", type=int, default=64)
    options.add_argument("--delay", type=float, default=0.005)
    args = options.parse_args()
    sys.path.insert(0, str(ROOT / "tests" / "e2e"))
    sys.path.insert(0, str(ROOT / "tests"))
    from e2e_support import registry_config, start_daemon  # type: ignore[import-not-found]

    from tool_families import FAMILIES, build_family_model  # type: ignore[import-not-found]

    prompt = f"tokens:{args.tokens}:{args.delay}"
    with tempfile.TemporaryDirectory(prefix="modelpool-tool-formats-") as scratch:
        root = Path(scratch)
        models = {
            parser: {"model": str(build_family_model(root, family)), "preload": True}
            for parser, family in FAMILIES.items()
        }
        config = registry_config(models, workers=1, server={"max_request_timeout_s": 60.0})
        daemon = start_daemon(
            root / "daemon", config, env={**os.environ, "MODELPOOL_TEST_KEY": KEY}
        )
        samples: dict[tuple[str, bool], list[tuple[float, float]]] = {
            (parser, tools): [] for parser in FAMILIES for tools in (False, True)
        }
        try:
            headers = {"Authorization": f"Bearer {KEY}"}
            with httpx.Client(base_url=daemon.url, timeout=60.0, headers=headers) as client:
                for parser, tools in samples:  # warm-up, not counted
                    measure(client, parser, prompt, tools)
                for _ in range(args.rounds):
                    for parser, tools in samples:
                        samples[(parser, tools)].append(measure(client, parser, prompt, tools))
        finally:
            daemon.stop()
    print(
        f"{args.rounds} rounds, {args.tokens} tokens {args.delay * 1000:g} ms apart, "
        "testing backend, chat streamed; on = tools offered (tool_choice auto), off = none"
    )
    print(
        f"{'parser':<13}{'TTFT off ms':>12}{'TTFT on ms':>12}{'TTFT on/off':>13}"
        f"{'tok/s off':>11}{'tok/s on':>10}{'tok/s on/off':>14}{'reader us/piece':>17}"
        f"{'checks ms':>11}{'bind ms':>9}"
    )
    for parser in FAMILIES:
        off_ttft = statistics.median(t for t, _ in samples[(parser, False)])
        on_ttft = statistics.median(t for t, _ in samples[(parser, True)])
        off_rate = statistics.median(r for _, r in samples[(parser, False)])
        on_rate = statistics.median(r for _, r in samples[(parser, True)])
        checks_ms, bind_ms = check_costs_ms(parser)
        print(
            f"{parser:<13}{off_ttft * 1000:>12.2f}{on_ttft * 1000:>12.2f}"
            f"{off_ttft / on_ttft:>13.3f}{off_rate:>11.1f}{on_rate:>10.1f}"
            f"{on_rate / off_rate:>14.3f}{reader_cost_us(parser, args.tokens):>17.2f}"
            f"{checks_ms:>11.2f}{bind_ms:>9.3f}"
        )
    print(
        "TTFT on/off is off's time over on's (higher is better, like tok/s on/off); checks: "
        "a tools request's parse, schema checks and grammar validation (any parser, Hermes "
        "before this change too); bind: what choosing the family's syntax adds to them"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
