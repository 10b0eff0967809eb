"""The ``modelpool`` command: serve, generate, stats, ps, config, prepare-model, bench.

    modelpool serve [--config FILE] [--host H --port P --workers N --set KEY=VALUE ...]
    modelpool generate "Name the capital of France." [--url http://127.0.0.1:8000 --model M]
    modelpool stats [--url URL] [--json]
    modelpool ps [--url URL] [--json]       # the models a daemon serves, as `ollama ps`
    modelpool config --show [--config FILE] [flags]   # the effective configuration, as TOML
    modelpool prepare-model
    modelpool bench                        # says where the benchmarks are (scripts/bench)
    modelpool --version                    # also: python -m modelpool ...

No file is needed: the built-in defaults serve the embedded model on
127.0.0.1:8000, and a file (``--config`` or ``$MODELPOOL_CONFIG``), environment
variables and flags are layered on top of them (see :mod:`modelpool.shared.config`).

The package, by concern: :mod:`~modelpool.cli.parser` (the arguments),
:mod:`~modelpool.cli.configuration` (the layered configuration every local command reads),
:mod:`~modelpool.cli.daemon` (``serve``: start-up and signals),
:mod:`~modelpool.cli.commands` (``generate``, ``config``, ``prepare-model``, ``bench``),
:mod:`~modelpool.cli.remote` (the HTTP client of ``--url``, ``stats`` and ``ps``) and
:mod:`~modelpool.cli.tables` (what they print).

Only ``serve`` and the ``--url`` modes need the ``server`` extra (fastapi, uvicorn, httpx);
``generate`` without ``--url`` runs on the core install, and uses rich for its table only
when it is installed. Those imports are therefore made inside the functions that need them,
and a missing one is reported with the extra that provides it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from modelpool.cli.commands import bench_command
from modelpool.cli.daemon import served_model_name
from modelpool.cli.errors import CliError
from modelpool.cli.parser import build_parser

__all__ = ["CliError", "build_parser", "main", "served_model_name"]


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    try:
        if arguments[:1] == ["bench"]:
            # Everything after "bench" belongs to the bench program, --help included.
            return bench_command(arguments[1:])
        args = build_parser().parse_args(arguments)
        status: int = args.func(args)
        return status
    except CliError as exc:
        print(f"modelpool: {exc}", file=sys.stderr)
        return exc.status
    except KeyboardInterrupt:
        return 130
