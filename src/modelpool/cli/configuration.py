"""What every local command starts from: the configuration its flags layer over the
built-ins, the file and the environment; the logging; whether the embedded model it would
serve can be prepared with what is installed."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import sys
from typing import Any

from modelpool.cli.errors import CliError
from modelpool.shared.config import (
    ConfigError,
    EffectiveConfig,
    PoolConfig,
    ServerConfig,
    layered_config,
    parse_assignment,
)

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


def effective_config(args: argparse.Namespace) -> EffectiveConfig:
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


def load_configs(args: argparse.Namespace) -> tuple[PoolConfig, ServerConfig]:
    effective = effective_config(args)
    return effective.pool, effective.server


def _installed(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it (accelerate imports torch)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def check_embedded_extra(model: str, backend: str = "hf") -> None:
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


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
