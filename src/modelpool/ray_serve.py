"""Ray Serve: replicas that each own a whole ModelPool and serve the daemon's routes.

For teams already on Ray. A replica is one :class:`~modelpool.ModelPool` (its
workers, spares, kill ladder and NVML checks stay inside the replica) behind the
same FastAPI app as ``modelpool serve`` (``server.create_app``: no second
implementation of the OpenAI routes). Ray routes requests to replicas, replaces a
replica that dies or fails ``check_health`` (pool failed, or its dispatcher's
heartbeat stale), and on a graceful stop the replica drains its pool::

    from ray import serve
    from modelpool import PoolConfig
    from modelpool.ray_serve import build_app

    app = build_app(PoolConfig(model="embedded:smollm2-135m-instruct"), num_replicas=2)
    serve.run(app)         # POST http://127.0.0.1:8000/v1/chat/completions

or from a shell, with a daemon's TOML config (its ``[server]`` table is read for the
API key, body limit and model name; Ray's proxy owns host and port)::

    serve run modelpool.ray_serve:app_builder config=configs/default.toml num_replicas=2

A client that disconnects, or Ray's ``request_timeout_s``, cancels the request's
task in the replica; the route's ``await`` on the pool passes that on, and the pool
cancels the generation in the worker. Needs the ``ray`` extra
(``pip install 'modelpool[ray]'``).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ray import serve
from ray.serve import Application

from modelpool.shared.config import PoolConfig, ServerConfig
from modelpool.supervisor.pool import ModelPool

logger = logging.getLogger(__name__)

# Ray's own defaults (health check every 10 s, 30 s timeout, 3 failures) leave a
# wedged replica in service for about 90 s; the pool's heartbeat makes a failed check
# cheap and certain, so it can be asked often.
HEALTH_CHECK_PERIOD_S = 2.0
HEALTH_CHECK_TIMEOUT_S = 5.0


AppConfig = PoolConfig | Mapping[str, Any] | str | os.PathLike[str]


def _load(config: AppConfig) -> tuple[PoolConfig, ServerConfig]:
    if isinstance(config, PoolConfig):
        return config, ServerConfig()
    if isinstance(config, Mapping):
        server = config.get("server", {})
        pool = {key: value for key, value in config.items() if key != "server"}
        return PoolConfig.from_dict(pool), ServerConfig(**server)
    path = Path(config)
    return PoolConfig.from_toml(path), ServerConfig.from_toml(path)


def default_deployment_options(
    pool_config: PoolConfig, server_config: ServerConfig
) -> dict[str, Any]:
    """What ``build_app`` passes to ``serve.deployment`` unless told otherwise."""
    shutdown_s = (
        server_config.drain_timeout_s
        + pool_config.cancel_grace_s
        + pool_config.term_grace_s
        + pool_config.gpu_release_timeout_s
    )
    gpus = _gpus_named(pool_config)
    return {
        "name": "modelpool",
        # Each worker busy and one request queued behind it; the rest wait at Ray's
        # router, which can still send them to a less loaded replica.
        "max_ongoing_requests": 2 * pool_config.workers,
        "health_check_period_s": HEALTH_CHECK_PERIOD_S,
        "health_check_timeout_s": HEALTH_CHECK_TIMEOUT_S,
        # Ray waits this long for requests in flight, then calls __del__, which drains
        # and closes the pool: its worst case is the same sum as the Kubernetes grace.
        "graceful_shutdown_timeout_s": shutdown_s,
        "ray_actor_options": {"num_gpus": gpus} if gpus else {},
    }


def _gpus_named(pool_config: PoolConfig) -> int:
    """GPUs a replica must be given: every GPU its workers name, a group's included
    ("auto" and "cpu" ask Ray for none)."""
    gpus: set[int] = set()
    for entry in pool_config.devices:
        for device in (entry,) if isinstance(entry, str) else entry:
            if device.startswith("cuda"):
                gpus.add(int(device.partition(":")[2] or 0))
    return len(gpus)


class PoolReplica:
    """One Ray Serve replica: a started ModelPool and the daemon's FastAPI app on it.

    ``build_app`` wraps this class with ``serve.ingress`` and ``serve.deployment``; the
    ASGI app comes from a builder that Ray calls after ``__init__``.
    """

    def __init__(self, pool_config: PoolConfig, server_config: ServerConfig) -> None:
        from modelpool.server import api_key_from_env

        self.pool = ModelPool(pool_config)
        self.server_config = server_config
        # Read once, as the daemon does: the workers started below never see the key.
        self.api_key = api_key_from_env(server_config)
        if server_config.api_key_env:
            os.environ.pop(server_config.api_key_env, None)
        # Blocks this replica's construction until every worker is ready: Ray sends it
        # no request before that, exactly like the daemon, whose port opens then.
        self.pool.start()
        logger.info("replica pid %d: pool ready (%d workers)", os.getpid(), pool_config.workers)

    def check_health(self) -> None:
        """Ray's health check: raise when the pool is not alive (failed, closed, wedged)."""
        health = self.pool.health()
        if not health.alive:
            raise RuntimeError(f"modelpool replica unhealthy: {health.reason}")

    async def drain(self) -> None:
        """Finish what is in flight (up to ``drain_timeout_s``), then stop every worker."""
        await asyncio.to_thread(self.pool.close, True, self.server_config.drain_timeout_s)


def build_app(
    config: AppConfig,
    *,
    server: ServerConfig | None = None,
    **deployment_options: Any,
) -> Application:
    """A Ray Serve application serving ``config``'s pool, one whole pool per replica.

    ``config`` is a :class:`PoolConfig`, the path of a daemon TOML config, or the same
    as a dict (its ``server`` table is used unless ``server`` is given).
    ``deployment_options`` go to ``serve.deployment`` over
    :func:`default_deployment_options` (``num_replicas``, ``ray_actor_options``,
    ``max_ongoing_requests``, ``health_check_period_s``...).
    """
    from modelpool.cli import served_model_name
    from modelpool.server import create_app

    pool_config, server_config = _load(config)
    if server is not None:
        server_config = server
    model_name = served_model_name(pool_config, server_config)
    options = {**default_deployment_options(pool_config, server_config), **deployment_options}

    class ModelPoolDeployment(PoolReplica):
        def __serve_build_asgi_app__(self) -> Any:
            return create_app(self.pool, self.server_config, model_name, api_key=self.api_key)

        async def __del__(self) -> None:
            # Ray calls this on a graceful stop, once the replica has no request left
            # or its graceful_shutdown_timeout_s ran out.
            await self.drain()

    deployment: serve.Deployment = serve.deployment(**options)(serve.ingress()(ModelPoolDeployment))
    return deployment.bind(pool_config, server_config)


def app_builder(args: Mapping[str, str]) -> Application:
    """For ``serve run modelpool.ray_serve:app_builder config=PATH [num_replicas=N]``."""
    if "config" not in args:
        raise ValueError("pass config=PATH (a modelpool TOML config) to serve run")
    options: dict[str, Any] = {}
    if "num_replicas" in args:
        options["num_replicas"] = int(args["num_replicas"])
    unknown = sorted(set(args) - {"config", "num_replicas"})
    if unknown:
        raise ValueError(f"unknown argument {unknown[0]!r} (known: config, num_replicas)")
    return build_app(args["config"], **options)
