"""``modelpool serve``: the daemon's start-up and its signals.

The port is bound first (a port in use is said before the workers load), the pool or the
registry started, and only then is the port opened; SIGTERM or SIGINT while starting
unwinds and closes the pool; once serving, the first signal drains and a second stops
(:class:`~modelpool.server.DrainingServer`).
"""

from __future__ import annotations

import argparse
import errno
import ipaddress
import logging
import math
import os
import signal
import socket
import sys
from collections.abc import Mapping
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from modelpool.cli.configuration import check_embedded_extra, effective_config, setup_logging
from modelpool.cli.errors import CliError
from modelpool.shared.config import EffectiveConfig, PoolConfig, ServerConfig

if TYPE_CHECKING:
    from modelpool.server import DrainingServer

logger = logging.getLogger(__name__)

# The daemon's GIL switch interval (seconds): see serve_command.
GIL_SWITCH_INTERVAL_S = 0.001


class _StopRequested(BaseException):
    """SIGTERM/SIGINT while the pool starts: unwind, close the pool, exit 0.

    A BaseException so that no ``except Exception`` on the way swallows it."""


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


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve_command(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    effective = effective_config(args)
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
        check_embedded_extra(served.model, served.backend)
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
    if api_key is None and not is_loopback(server_config.host):
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
