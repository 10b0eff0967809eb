"""The ``modelpool`` command's arguments: one subcommand each, and the flags that set one
configuration value each (``--workers``, ``--set KEY=VALUE``, ...)."""

from __future__ import annotations

import argparse

import modelpool
from modelpool.cli.commands import config_command, generate_command, prepare_model_command
from modelpool.cli.daemon import serve_command
from modelpool.cli.remote import DEFAULT_KEY_ENV, DEFAULT_URL, ps_command, stats_command
from modelpool.shared.config import CONFIG_ENV, DEFAULT_MODEL, PoolConfig, ServerConfig

# What the help text quotes as the built-in values.
_BUILT_IN = PoolConfig(model=DEFAULT_MODEL)

_BUILT_IN_SERVER = ServerConfig()

LOG_LEVELS = ("debug", "info", "warning", "error")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="modelpool",
        description="Serve a local model from a supervised pool of pre-warmed workers.",
    )
    parser.add_argument("--version", action="version", version=f"modelpool {modelpool.__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def with_logging(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("--log-level", choices=LOG_LEVELS, default="info")

    serve = commands.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP daemon",
        description="Run the OpenAI-compatible HTTP daemon. With no file and no flags it "
        f"serves {_BUILT_IN.model} with {_BUILT_IN.workers} workers on "
        f"{_BUILT_IN_SERVER.host}:{_BUILT_IN_SERVER.port}.",
    )
    _config_options(serve, server=True)
    with_logging(serve)
    serve.set_defaults(func=serve_command)

    generate = commands.add_parser(
        "generate",
        help="answer one prompt (a local pool, or a daemon with --url)",
        description="Answer one prompt, sent as a chat message (--raw: as plain text), "
        "through a local pool started for it, or through the daemon at --url. Prints the "
        "answer, a timing line and the pool's stats (--json: one JSON document).",
    )
    generate.add_argument("prompt")
    generate.add_argument("--url", help="send to the daemon at URL instead of starting a pool")
    generate.add_argument("--max-tokens", type=int, help="at most this many new tokens")
    generate.add_argument("--timeout", type=float, help="the request's deadline in seconds (--url)")
    generate.add_argument("--stream", action="store_true", help="print text as it is generated")
    generate.add_argument(
        "--raw", action="store_true", help="send the prompt as plain text, not as a chat message"
    )
    generate.add_argument("--json", action="store_true", help="print JSON")
    generate.add_argument(
        "--api-key-env",
        default=DEFAULT_KEY_ENV,
        help="environment variable holding the daemon's key (--url)",
    )
    _config_options(generate, server=False)
    with_logging(generate)
    generate.set_defaults(func=generate_command, log_level="warning")

    stats = commands.add_parser(
        "stats",
        help="show a daemon's workers and counters",
        description="Show the workers, counters and latency of the daemon at --url, "
        "as tables, per model for a daemon of [models.NAME] tables (--json: the raw "
        "/stats document).",
    )
    _daemon_arguments(stats, json_help="print the raw /stats JSON")
    stats.set_defaults(func=stats_command)

    ps = commands.add_parser(
        "ps",
        help="list a daemon's models: backend, state, memory, workers, idle time, unload",
        description="List the models of the daemon at --url, as `ollama ps` does: each "
        "model's backend (auto resolved), state, memory (its workers' RSS), workers "
        "started/configured, idle time and when an idle model unloads (--json: objects).",
    )
    _daemon_arguments(ps, json_help="print the rows as JSON")
    ps.set_defaults(func=ps_command)

    config = commands.add_parser(
        "config",
        help="print the effective configuration and where each value came from",
        description="Print the configuration `modelpool serve` would run with these flags, "
        "as TOML, each value followed by its source: built-in, file, environment or flag.",
    )
    config.add_argument(
        "--show", action="store_true", help="print it (what this command does; kept explicit)"
    )
    config.add_argument(
        "--json", action="store_true", help="print JSON: values, sources and origins"
    )
    _config_options(config, server=True)
    config.set_defaults(func=config_command)

    prepare = commands.add_parser(
        "prepare-model", help="prepare the embedded model; prints its directory last"
    )
    prepare.add_argument("name", nargs="?", default="smollm2-135m-instruct")
    with_logging(prepare)
    prepare.set_defaults(func=prepare_model_command)

    commands.add_parser("bench", help="where the benchmarks are", add_help=False)
    return parser


def _daemon_arguments(parser: argparse.ArgumentParser, *, json_help: str) -> None:
    """What every command that reads a running daemon takes: --url, --json, --api-key-env."""
    parser.add_argument("--url", default=DEFAULT_URL, help="daemon URL (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help=json_help)
    parser.add_argument(
        "--api-key-env",
        default=DEFAULT_KEY_ENV,
        help="environment variable holding the daemon's key",
    )


def _devices(text: str) -> list[str]:
    devices = [item.strip() for item in text.split(",") if item.strip()]
    if not devices:
        raise argparse.ArgumentTypeError("expected devices such as cpu or cuda:0,cuda:1")
    return devices


def _config_options(sub: argparse.ArgumentParser, *, server: bool) -> None:
    """--config and the flags that override one configuration value each."""
    sub.add_argument(
        "--config",
        metavar="FILE",
        help=f"TOML file layered on the built-in defaults (default: ${CONFIG_ENV}, else none; "
        "`modelpool config --show` prints the result)",
    )
    if server:
        sub.add_argument("--host", help="bind address (default: [server] host, 127.0.0.1)")
        sub.add_argument("--port", type=int, help="port (default: [server] port, 8000)")
    sub.add_argument(
        "--model",
        help=f"a local dir, a hub id or embedded:NAME (built-in: {_BUILT_IN.model}); "
        "generate --url: the name of one of the daemon's models",
    )
    sub.add_argument(
        "--backend",
        help="'auto' (the default: llama_cpp for a GGUF model on the CPU when installed, "
        "else hf), 'hf', 'llama_cpp', 'testing' or 'pkg.module:factory'",
    )
    sub.add_argument("--workers", type=int, help=f"serving workers (built-in: {_BUILT_IN.workers})")
    sub.add_argument(
        "--spares", type=int, help=f"pre-warmed spare workers (built-in: {_BUILT_IN.spares})"
    )
    sub.add_argument(
        "--max-batch-size",
        type=int,
        help=f"requests one worker decodes at once, batched (built-in: {_BUILT_IN.max_batch_size})",
    )
    sub.add_argument(
        "--devices", type=_devices, help="where workers run, comma-separated: cpu,cuda:0,auto"
    )
    sub.add_argument(
        "--deadline",
        type=float,
        metavar="SECONDS",
        help=f"a request's wall-clock budget, all attempts (built-in: {_BUILT_IN.deadline_s:g})",
    )
    sub.add_argument(
        "--max-model-len",
        type=int,
        metavar="TOKENS",
        help="context length, prompt and completion together (default: the model config's; "
        "sets backend_options.max_model_len)",
    )
    sub.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="any other value, VALUE in TOML: --set retry.max_retries=0 --set server.model_name=x",
    )
