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

The commands that talk to a daemon (``--url``, ``stats``, ``ps``) are in
:mod:`modelpool.cli_remote`. Only ``serve`` and the ``--url`` modes need the ``server``
extra (fastapi, uvicorn, httpx); ``generate`` without ``--url`` runs on the core
install, and uses rich for its table only when it is installed. Those imports are therefore
made inside the functions that need them, and a missing one is reported with
the extra that provides it.
"""

from __future__ import annotations

import argparse
import errno
import importlib.util
import ipaddress
import json
import logging
import math
import os
import signal
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import modelpool
from modelpool.cli_remote import (
    DEFAULT_KEY_ENV,
    DEFAULT_URL,
    CliError,
    generate_remote,
    print_stats,
    ps_command,
    stats_command,
    timing_line,
)
from modelpool.shared.config import (
    CONFIG_ENV,
    DEFAULT_MODEL,
    ConfigError,
    EffectiveConfig,
    PoolConfig,
    ServerConfig,
    layered_config,
    parse_assignment,
)

if TYPE_CHECKING:
    from modelpool.server import DrainingServer

logger = logging.getLogger(__name__)

# What the help text quotes as the built-in values.
_BUILT_IN = PoolConfig(model=DEFAULT_MODEL)
_BUILT_IN_SERVER = ServerConfig()
LOG_LEVELS = ("debug", "info", "warning", "error")
# The daemon's GIL switch interval (seconds): see _serve.
GIL_SWITCH_INTERVAL_S = 0.001


class _StopRequested(BaseException):
    """SIGTERM/SIGINT while the pool starts: unwind, close the pool, exit 0.

    A BaseException so that no ``except Exception`` on the way swallows it."""


# --------------------------------------------------------------------------------------------
# Configuration


# Flags that set one configuration value each: (dest, dotted key).
_POOL_FLAGS = (
    ("model", "model"),
    ("backend", "backend"),
    ("workers", "workers"),
    ("spares", "spares"),
    ("max_batch_size", "max_batch_size"),
    ("devices", "devices"),
    ("deadline", "deadline_s"),
    ("max_model_len", "backend_options.max_model_len"),
)
_SERVER_FLAGS = (("host", "server.host"), ("port", "server.port"))


def _effective_config(args: argparse.Namespace) -> EffectiveConfig:
    """The built-ins, the config file, the environment and this command's flags, layered."""
    flags: dict[str, Any] = {}
    for assignment in getattr(args, "set", None) or ():
        key, value = parse_assignment(assignment)
        flags[key] = value
    for dest, key in (*_POOL_FLAGS, *_SERVER_FLAGS):
        value = getattr(args, dest, None)
        if value is not None:
            flags[key] = value
    try:
        return layered_config(args.config, environ=os.environ, flags=flags)
    except ConfigError as exc:
        raise CliError(str(exc)) from None


def _load_configs(args: argparse.Namespace) -> tuple[PoolConfig, ServerConfig]:
    effective = _effective_config(args)
    return effective.pool, effective.server


def _installed(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it (accelerate imports torch)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _check_embedded_extra(model: str, backend: str = "hf") -> None:
    """An embedded model that still has to be prepared for transformers needs the embedded
    extra (gguf); llama_cpp (and "auto" where llama-cpp-python is installed, which picks
    it on a CPU) reads the GGUF file as it is."""
    from modelpool.shared.embedded import EMBEDDED_SCHEME, MARKER_FILE, MODELS, modelpool_home
    from modelpool.supervisor.backend_choice import AUTO, installed_llama_cpp

    name = model.removeprefix(EMBEDDED_SCHEME)
    if not model.startswith(EMBEDDED_SCHEME) or name not in MODELS:
        return
    if MODELS[name].directory_member:
        return  # extracted as it is: nothing to convert
    if backend == "llama_cpp" or (backend == AUTO and installed_llama_cpp() is not None):
        return
    if (modelpool_home() / "models" / name / MARKER_FILE).is_file():
        return
    missing = [module for module in ("gguf", "accelerate") if not _installed(module)]
    if missing:
        raise CliError(
            f"preparing {model} needs {', '.join(missing)}: pip install 'modelpool[embedded]'"
            " (or pass --model DIR_OR_HUB_ID)"
        )


def served_model_name(pool_config: PoolConfig, server_config: ServerConfig) -> str:
    """What ``/v1/models`` lists: the configured name, else a readable form of ``model``."""
    if server_config.model_name:
        return server_config.model_name
    model = pool_config.model
    if model.startswith("embedded:"):
        return model[len("embedded:") :]
    if os.path.isdir(model):
        return Path(model).resolve().name
    return model


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


# --------------------------------------------------------------------------------------------
# serve


def _serve(args: argparse.Namespace) -> int:
    _setup_logging(args.log_level)
    effective = _effective_config(args)
    pool_config, server_config = effective.pool, effective.server
    try:
        import uvicorn

        from modelpool.server import DrainingServer, api_key_from_env, create_app
        from modelpool.server.guard import raise_open_files_limit, uvicorn_options
        from modelpool.supervisor.pool import ModelPool
    except ImportError as exc:
        raise CliError(
            f"serve needs the server extra: pip install 'modelpool[server]' ({exc})"
        ) from None
    for served in [spec.pool for spec in effective.models] or [pool_config]:
        _check_embedded_extra(served.model, served.backend)
    from modelpool.shared.embedded import EmbeddedModelError
    from modelpool.shared.errors import PoolError, PreflightError

    api_key = api_key_from_env(server_config)
    if server_config.api_key_env:
        # Read once, here: the workers (and whatever a model's code runs) never see it.
        os.environ.pop(server_config.api_key_env, None)
    raise_open_files_limit(server_config.max_connections)
    # Threads building large answers, and the dispatcher thread, hold the GIL for up to
    # this long before the event loop may take it back: 5 ms by default, which a request
    # that waits on the GIL a dozen times pays a dozen times.
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    # Bound now, listening only once the pool is ready: a port in use is said before
    # the workers load (minutes for a large model), not after.
    listener = _bind_port(server_config.host, server_config.port)
    if api_key is None and not _is_loopback(server_config.host):
        env = server_config.api_key_env
        hint = f"set {env}" if env else "set [server] api_key_env and that variable"
        print(
            f"modelpool: WARNING: listening on {server_config.host} without an API key: "
            f"anyone who can reach it can use it ({hint})",
            file=sys.stderr,
        )

    if effective.models:
        return _serve_models(effective, listener, api_key)
    pool = ModelPool(pool_config)
    previous = _on_signals(_raise_stop)
    server: DrainingServer | None = None
    preflight_failed = False
    try:
        try:
            # The port opens only after every worker is ready, so a load balancer or a
            # client never reaches a daemon that cannot answer yet.
            pool.start()
        except PreflightError as exc:
            # Before any worker started: the one line of any other configuration error.
            preflight_failed = True
            raise CliError(str(exc)) from None
        except (PoolError, EmbeddedModelError) as exc:
            logger.error("the pool did not start: %s", exc)
            return 1
        # The configured model, not the path start() resolved it to: the embedded model's
        # name is the same on every backend (its GGUF directory is NAME-gguf).
        model_name = served_model_name(pool_config, server_config)
        app = create_app(pool, server_config, model_name, api_key=api_key)
        logger.info(
            "pool ready (%d workers, model %s); opening http://%s:%d",
            pool.config.workers,
            model_name,
            server_config.host,
            listener.getsockname()[1],
        )
        server = DrainingServer(
            uvicorn.Config(
                app,
                host=server_config.host,
                port=server_config.port,
                log_config=None,  # keep our logging setup; uvicorn's loggers propagate to it
                access_log=False,  # modelpool.access writes one richer line per request
                lifespan="off",
                # Header size, count and read timeouts, body read timeouts, the cap on
                # connections (server.guard.guarded_protocol), and proxy headers only
                # from forwarded_allow_ips; keep-alive stays 5 s.
                **uvicorn_options(server_config, app.state.modelpool.keys),
                # uvicorn takes whole seconds here; round up so a drain is never cut short.
                timeout_graceful_shutdown=math.ceil(server_config.drain_timeout_s),
            ),
            app.state.modelpool,
        )
        server.run(sockets=[listener])
    except _StopRequested:
        logger.info("stopped while starting")
    finally:
        _on_signals(_ignore_during_close)
        drain = server is not None and not server.forced
        # Drained already when uvicorn waited for its connections; a forced stop
        # fails whatever is left at once.
        pool.close(drain=drain, timeout=5.0 if drain else 0.0)
        listener.close()
        _restore_signals(previous)
        if not preflight_failed:
            logger.info("stopped")
    return 0


def _serve_models(effective: EffectiveConfig, listener: socket.socket, api_key: str | None) -> int:
    """``serve`` with ``[models.NAME]`` tables: a ModelRegistry; the port opens once the
    ``preload`` models have loaded or failed (a failure stays that model's)."""
    import uvicorn

    from modelpool.server import DrainingServer, create_app
    from modelpool.server.guard import guarded_protocol
    from modelpool.shared.lora import adapter_specs
    from modelpool.supervisor import gpu
    from modelpool.supervisor.registry import ModelRegistry, RegistryConfig
    from modelpool.supervisor.registry.preflight import ModelCheckFailed, check_models

    server_config = effective.server
    try:
        # Every table checked (and an embedded model prepared) before the port opens:
        # a mistake is one line here, not a 503 to whoever asks for that model first.
        specs = check_models(effective.models, gpu.GpuProbe())
    except ModelCheckFailed as exc:
        listener.close()
        raise CliError(str(exc)) from None
    try:
        adapters = adapter_specs(effective.model_tables, str(effective.config_path))
        registry_config = RegistryConfig.from_server(specs, server_config, adapters)
    except ValueError as exc:
        listener.close()
        raise CliError(str(exc)) from None
    registry = ModelRegistry(registry_config)
    previous = _on_signals(_raise_stop)
    server: DrainingServer | None = None
    try:
        registry.start()
        app = create_app(registry, server_config, api_key=api_key)
        logger.info(
            "registry ready (%d models: %s); opening http://%s:%d",
            len(effective.models),
            ", ".join(spec.name for spec in effective.models),
            server_config.host,
            listener.getsockname()[1],
        )
        server = DrainingServer(
            uvicorn.Config(
                app,
                host=server_config.host,
                port=server_config.port,
                log_config=None,
                access_log=False,
                lifespan="off",
                http=guarded_protocol(server_config),
                timeout_graceful_shutdown=math.ceil(server_config.drain_timeout_s),
            ),
            app.state.modelpool,
        )
        server.run(sockets=[listener])
    except _StopRequested:
        logger.info("stopped while starting")
    finally:
        _on_signals(_ignore_during_close)
        drain = server is not None and not server.forced
        registry.close(timeout=5.0 if drain else 0.0)
        listener.close()
        _restore_signals(previous)
        logger.info("stopped")
    return 0


def _bind_port(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (not listening yet), or a one-line CliError."""
    # As uvicorn binds: IPv6 for an address with a colon, and a port held only by the
    # TIME_WAIT of a previous run counts as free.
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError as exc:
        listener.close()
        hint = (
            "stop what uses it, or choose another with --port"
            if exc.errno == errno.EADDRINUSE
            else "check --host and --port"
        )
        raise CliError(f"cannot listen on {host}:{port}: {exc.strerror}: {hint}") from None
    return listener


_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    raise _StopRequested


def _ignore_during_close(signum: int, frame: FrameType | None) -> None:
    # pool.close() is bounded (grace periods, then SIGKILL) and the workers also die
    # with this process, so a further signal has nothing faster to offer.
    os.write(2, b"modelpool: already stopping the workers\n")


def _on_signals(handler: Any) -> dict[int, Any]:
    return {sig: signal.signal(sig, handler) for sig in _SIGNALS}


def _restore_signals(previous: Mapping[int, Any]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


# --------------------------------------------------------------------------------------------
# generate


def _generate(args: argparse.Namespace) -> int:
    if args.url:
        return generate_remote(args)
    _setup_logging(args.log_level)
    pool_config, _ = _load_configs(args)
    _check_embedded_extra(pool_config.model, pool_config.backend)
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


# --------------------------------------------------------------------------------------------
# config


def _config(args: argparse.Namespace) -> int:
    effective = _effective_config(args)
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


# --------------------------------------------------------------------------------------------
# prepare-model, bench


def _prepare_model(args: argparse.Namespace) -> int:
    _setup_logging(args.log_level)
    from modelpool.shared.embedded import EMBEDDED_SCHEME, EmbeddedModelError, prepare_model

    name = args.name.removeprefix(EMBEDDED_SCHEME)
    _check_embedded_extra(EMBEDDED_SCHEME + name)
    try:
        path = prepare_model(name)
    except (EmbeddedModelError, ValueError) as exc:
        raise CliError(str(exc)) from None
    print(path)
    return 0


def _bench(argv: list[str]) -> int:
    raise CliError(
        "the benchmarks are repository tooling, not part of the installed package: "
        "run scripts/bench (or scripts/chaos, scripts/measure-core) from a checkout"
    )


# --------------------------------------------------------------------------------------------
# argument parsing


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
    serve.set_defaults(func=_serve)

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
    generate.set_defaults(func=_generate, log_level="warning")

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
    config.set_defaults(func=_config)

    prepare = commands.add_parser(
        "prepare-model", help="prepare the embedded model; prints its directory last"
    )
    prepare.add_argument("name", nargs="?", default="smollm2-135m-instruct")
    with_logging(prepare)
    prepare.set_defaults(func=_prepare_model)

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


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    try:
        if arguments[:1] == ["bench"]:
            # Everything after "bench" belongs to the bench program, --help included.
            return _bench(arguments[1:])
        args = build_parser().parse_args(arguments)
        status: int = args.func(args)
        return status
    except CliError as exc:
        print(f"modelpool: {exc}", file=sys.stderr)
        return exc.status
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
