"""The local commands: ``generate`` (a pool started for one prompt; ``--url`` goes to
:mod:`modelpool.cli.remote`), ``config``, ``prepare-model`` and ``bench``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from modelpool.cli.configuration import (
    check_embedded_extra,
    effective_config,
    load_configs,
    setup_logging,
)
from modelpool.cli.errors import CliError
from modelpool.cli.remote import generate_remote
from modelpool.cli.tables import print_stats, timing_line


def generate_command(args: argparse.Namespace) -> int:
    if args.url:
        return generate_remote(args)
    setup_logging(args.log_level)
    pool_config, _ = load_configs(args)
    check_embedded_extra(pool_config.model, pool_config.backend)
    from modelpool.shared.errors import PoolError, PreflightError
    from modelpool.supervisor.pool import ModelPool

    prompt: Any = args.prompt if args.raw else [{"role": "user", "content": args.prompt}]
    params: dict[str, Any] = {}
    if args.max_tokens is not None:
        params["max_new_tokens"] = args.max_tokens
    pool = ModelPool(pool_config)
    try:
        started = time.monotonic()
        pool.start()
        startup_s = time.monotonic() - started
        if args.stream:
            sent = time.monotonic()
            chunks = []
            for chunk in pool.stream(prompt, **params):
                chunks.append(chunk)
                if not args.json:
                    print(chunk, end="", flush=True)
            # stream() yields text only: the attempts and worker are not known here.
            timing: dict[str, Any] = {"latency_s": time.monotonic() - sent}
            answer = "".join(chunks)
        else:
            result = pool.generate(prompt, **params)
            answer = result.text
            timing = {
                key: getattr(result, key)
                for key in (
                    "latency_s",
                    "queue_s",
                    "attempts",
                    "worker_pid",
                    "finish_reason",
                    "request_id",
                    "prompt_tokens",
                    "completion_tokens",
                )
            }
        stats = pool.stats().to_dict()
    except PreflightError as exc:
        # Before any worker started: the one line of any other configuration error.
        raise CliError(str(exc)) from None
    except PoolError as exc:
        print(f"modelpool: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        pool.close()
    if args.json:
        print(
            json.dumps({"text": answer, **timing, "startup_s": startup_s, "stats": stats}, indent=2)
        )
        return 0
    print("" if args.stream else answer)  # a streamed answer is already out, unterminated
    print(timing_line({**timing, "startup_s": startup_s}))
    print_stats(stats)
    return 0


def config_command(args: argparse.Namespace) -> int:
    effective = effective_config(args)
    if args.json:
        document = {
            "config_file": None if effective.config_path is None else str(effective.config_path),
            "values": effective.values(),
            "sources": effective.sources,
            "origins": effective.origins,
        }
        print(json.dumps(document, indent=2))
    else:
        print(effective.to_toml(), end="")
    return 0


def prepare_model_command(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    from modelpool.shared.embedded import EMBEDDED_SCHEME, EmbeddedModelError, prepare_model

    name = args.name.removeprefix(EMBEDDED_SCHEME)
    check_embedded_extra(EMBEDDED_SCHEME + name)
    try:
        path = prepare_model(name)
    except (EmbeddedModelError, ValueError) as exc:
        raise CliError(str(exc)) from None
    print(path)
    return 0


def bench_command(argv: list[str]) -> int:
    raise CliError(
        "the benchmarks are repository tooling, not part of the installed package: "
        "run scripts/bench (or scripts/chaos, scripts/measure-core) from a checkout"
    )
