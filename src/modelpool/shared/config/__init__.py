"""Pool and server configuration, in two concerns:

- :mod:`~modelpool.shared.config.schema`: the dataclasses and their validation
  (:class:`PoolConfig`, :class:`ServerConfig`, :class:`ModelSpec`, :class:`RetryPolicy`),
  with the device layouts checked in :mod:`~modelpool.shared.config.devices`;
- :mod:`~modelpool.shared.config.layers`: how the ``modelpool`` command adds them up from
  the built-in defaults, a TOML file, the environment and flags (:func:`layered_config`,
  :class:`EffectiveConfig` and its ``to_toml``).

Every public name is importable from here::

    from modelpool.shared.config import PoolConfig, layered_config
"""

from modelpool.shared.config.devices import DeviceEntry
from modelpool.shared.config.layers import (
    CONFIG_ENV,
    DEFAULT_MODEL,
    EMBEDDED_BACKEND_OPTIONS,
    ENVIRONMENT,
    ConfigError,
    EffectiveConfig,
    Source,
    embedded_backend_options,
    layered_config,
    parse_assignment,
)
from modelpool.shared.config.schema import (
    MODEL_KEYS,
    RETRY_REASONS,
    ModelSpec,
    PoolConfig,
    RetryPolicy,
    ServerConfig,
    check_model_names,
)

__all__ = [
    "CONFIG_ENV",
    "DEFAULT_MODEL",
    "EMBEDDED_BACKEND_OPTIONS",
    "ENVIRONMENT",
    "MODEL_KEYS",
    "RETRY_REASONS",
    "ConfigError",
    "DeviceEntry",
    "EffectiveConfig",
    "ModelSpec",
    "PoolConfig",
    "RetryPolicy",
    "ServerConfig",
    "Source",
    "check_model_names",
    "embedded_backend_options",
    "layered_config",
    "parse_assignment",
]
