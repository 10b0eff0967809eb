"""The ``modelpool`` command's configuration, built in layers, each on top of the one
before: the built-in defaults (the schemas' defaults, serving the embedded default model),
a TOML file, environment variables, flags::

    effective = layered_config("my.toml", flags={"workers": 4}, environ=os.environ)
    effective.pool, effective.server        # PoolConfig, ServerConfig
    effective.sources["workers"]            # "flag"
    print(effective.to_toml())              # every value, with where it came from
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from modelpool.shared.config.schema import (
    MODEL_KEYS,
    ModelSpec,
    PoolConfig,
    RetryPolicy,
    ServerConfig,
    check_model_names,
    known_fields,
    read_toml,
)
from modelpool.shared.lora import is_adapter_table
from modelpool.shared.toml_text import toml_key, toml_value

# The layers, a later one winning: built-in < file < environment < flag.
Source = Literal["built-in", "file", "environment", "flag"]

# What `modelpool serve` runs with no configuration at all.
DEFAULT_MODEL = "embedded:smollm2-135m-instruct"
# The embedded checkpoint is stored in bfloat16, which decodes several times slower than
# float32 on CPUs; at 135M parameters float32 costs ~0.5 GB. Applied to an embedded:
# model on the hf backend unless a layer sets backend_options.dtype itself (by
# layered_config for backend = "hf", by ModelPool.start() when "auto" chose hf).
EMBEDDED_BACKEND_OPTIONS: Mapping[str, Any] = {"dtype": "float32"}

# A config file to read when no --config is given.
CONFIG_ENV = "MODELPOOL_CONFIG"

# The tables of a config file; every other key is a top-level PoolConfig field.
_TABLES = ("generation_defaults", "backend_options", "retry", "image_limits", "server")


def _split_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def _parse_int(text: str) -> int:
    return int(text.strip())


def _parse_float(text: str) -> float:
    return float(text.strip())


# Environment variables that set one value each, and how their text is read.
ENVIRONMENT: Mapping[str, tuple[str, Any]] = {
    "MODELPOOL_MODEL": ("model", str),
    "MODELPOOL_BACKEND": ("backend", str),
    "MODELPOOL_WORKERS": ("workers", _parse_int),
    "MODELPOOL_SPARES": ("spares", _parse_int),
    "MODELPOOL_DEVICES": ("devices", _split_list),
    "MODELPOOL_DEADLINE_S": ("deadline_s", _parse_float),
    "MODELPOOL_HOST": ("server.host", str),
    "MODELPOOL_PORT": ("server.port", _parse_int),
}


class ConfigError(ValueError):
    """A configuration that cannot be used; the message says which layer and key."""


@dataclass(frozen=True)
class EffectiveConfig:
    """The configuration the layers add up to, and where each value came from.

    ``sources`` and ``origins`` are keyed by dotted name ("workers", "retry.on",
    "server.port", "backend_options.dtype"); ``origins`` says more than the kind
    where there is more to say (the file's path, the variable's name).
    """

    pool: PoolConfig
    server: ServerConfig
    sources: dict[str, Source]
    origins: dict[str, str]
    config_path: Path | None
    # The [models.NAME] tables, each a pool of its own (empty: one model, as always), and
    # each table as the file gave it (what to_toml writes back).
    models: tuple[ModelSpec, ...] = ()
    model_tables: dict[str, dict[str, Any]] = field(default_factory=dict)

    def values(self) -> dict[str, Any]:
        """Every value as plain data, in the shape of a config file."""
        data = _flatten(_as_tables(self.pool, self.server))
        values = _unflatten(data)
        if self.model_tables:
            values["models"] = {name: dict(table) for name, table in self.model_tables.items()}
        return values

    def to_toml(self) -> str:
        """A config file holding every effective value, each with its source as a comment.

        Reading it back gives the same configuration (unset optional values are
        comments, as TOML has no null)."""
        flat = _flatten(_as_tables(self.pool, self.server))
        layers = ["built-in"]
        if self.config_path is not None:
            layers.append(f"file {self.config_path}")
        layers += ["environment", "flag"]
        lines = [
            "# The effective modelpool configuration, each value with where it came from.",
            "# Layers, a later one winning: " + " < ".join(layers) + ".",
            "",
        ]
        for key, value in flat.items():
            if "." not in key:
                lines.append(self._line(key, key, value))
        for table in _TABLES:
            keys = [key for key in flat if key.startswith(table + ".")]
            lines += ["", f"[{table}]"]
            if not keys:
                lines.append("# (empty)")
            for key in keys:
                lines.append(self._line(key, key[len(table) + 1 :], flat[key]))
        for name, model_table in self.model_tables.items():
            lines += ["", f"[models.{toml_key(name)}]"]
            for key, value in model_table.items():
                lines.append(f"{toml_key(key)} = {toml_value(value)}  # file {self.config_path}")
        return "\n".join(lines) + "\n"

    def _line(self, key: str, name: str, value: Any) -> str:
        origin = self.origins.get(key, self.sources.get(key, "built-in"))
        if value is None:
            return f"# {toml_key(name)} = (unset)  # {origin}"
        return f"{toml_key(name)} = {toml_value(value)}  # {origin}"


def layered_config(
    config_path: str | Path | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> EffectiveConfig:
    """Built-in defaults, then the file, then the environment, then ``flags``.

    ``config_path`` None reads ``$MODELPOOL_CONFIG`` when it is set, else no
    file. ``flags`` is keyed by dotted name (``{"server.port": 9000}``); a None
    value is a flag not given. Raises :class:`ConfigError` naming the file, the
    variable or the key at fault; a named file that does not exist is one.
    """
    environ = {} if environ is None else environ
    flat = _flatten(_as_tables(PoolConfig(model=DEFAULT_MODEL), ServerConfig()))
    sources: dict[str, Source] = dict.fromkeys(flat, "built-in")
    origins: dict[str, str] = {}

    path = _config_file(config_path, environ)
    model_tables: dict[str, dict[str, Any]] = {}
    if path is not None:
        try:
            data = read_toml(path)
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        model_tables = _model_tables(data.pop("models", {}), str(path))
        file_values = _flatten_layer(data, str(path))
        _apply(
            flat, sources, origins, file_values, "file", dict.fromkeys(file_values, f"file {path}")
        )
        _build(flat, str(path))

    env_values: dict[str, Any] = {}
    env_origins: dict[str, str] = {}
    for variable, (key, parse) in ENVIRONMENT.items():
        text = environ.get(variable)
        if text is None or not text.strip():
            continue
        try:
            env_values[key] = parse(text)
        except ValueError:
            raise ConfigError(f"{variable}: cannot read {text!r} as {key}") from None
        env_origins[key] = f"environment {variable}"
    _apply(flat, sources, origins, env_values, "environment", env_origins)
    _build(flat, "environment")

    flag_values = {key: value for key, value in (flags or {}).items() if value is not None}
    _apply(flat, sources, origins, _flatten_layer(_unflatten(flag_values), "flags"), "flag", {})
    pool, server = _build(flat, "command line")
    # Before the top-level model's own embedded defaults, which are not the models' to inherit.
    models = _model_specs(model_tables, flat, str(path))

    embedded = _embedded_defaults(pool)
    if embedded:
        _apply(flat, sources, origins, embedded, "built-in", {})
        pool, server = _build(flat, "built-in")
    return EffectiveConfig(pool, server, sources, origins, path, models, model_tables)


def _model_tables(tables: object, where: str) -> dict[str, dict[str, Any]]:
    if not isinstance(tables, Mapping) or not all(isinstance(t, Mapping) for t in tables.values()):
        raise ConfigError(f"{where}: [models] must hold tables, one per model: [models.NAME]")
    return {str(name): dict(table) for name, table in tables.items()}


def _model_specs(
    tables: Mapping[str, Mapping[str, Any]], flat: Mapping[str, Any], where: str
) -> tuple[ModelSpec, ...]:
    """Each [models.NAME] table over the top-level pool keys (every layer's), key by key:
    a model names its own ``model``; what it leaves out (workers, devices, deadline_s, a
    table's keys) is the top level's."""
    specs: list[ModelSpec] = []
    base = {key: value for key, value in flat.items() if not key.startswith("server.")}
    base.pop("model", None)
    for name, table in tables.items():
        if is_adapter_table(table):
            continue  # a LoRA adapter, served by its base's pool (shared.lora.adapter_specs)
        own = {key: table[key] for key in MODEL_KEYS if key in table}
        pool_table = {key: value for key, value in table.items() if key not in MODEL_KEYS}
        context = f"{where}: [models.{name}]"
        if "model" not in pool_table:
            raise ConfigError(f"{context}: missing key 'model' (the model this name serves)")
        if "server" in pool_table or "models" in pool_table:
            raise ConfigError(f"{context}: a model's table holds pool keys, not [server]")
        try:
            merged = {**base, **_flatten_layer(pool_table, context)}
            pool = PoolConfig.from_dict(_unflatten(merged))
            embedded = _embedded_defaults(pool)
            if embedded:
                pool = PoolConfig.from_dict(_unflatten({**merged, **embedded}))
            specs.append(ModelSpec(name=name, pool=pool, **own))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{context}: {exc}") from None
    try:
        check_model_names(tuple(specs))
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    return tuple(specs)


def parse_assignment(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` from the command line: VALUE is a TOML value, or else a plain string.

    ``workers=4`` -> ("workers", 4); ``retry.on=["crash"]`` -> ("retry.on", ["crash"]);
    ``model=./my-model`` -> ("model", "./my-model").
    """
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--set expects KEY=VALUE, got {text!r}")
    parts = key.split(".")
    if len(parts) > 2 or not all(re.fullmatch(r"[A-Za-z0-9_-]+", part) for part in parts):
        raise ConfigError(f"--set: {key!r} is not a key such as 'workers' or 'retry.max_retries'")
    if len(parts) == 1 and key in _TABLES:
        raise ConfigError(f"--set: {key!r} is a table; set one of its keys ('{key}.NAME=VALUE')")
    if len(parts) == 2 and parts[0] not in _TABLES:
        raise ConfigError(f"--set: {parts[0]!r} is not a table (tables: {', '.join(_TABLES)})")
    try:
        value = tomllib.loads(f"value = {raw.strip()}")["value"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return key, value


def _config_file(config_path: str | Path | None, environ: Mapping[str, str]) -> Path | None:
    if config_path is not None:
        named_by = "--config"
    elif environ.get(CONFIG_ENV):
        config_path, named_by = environ[CONFIG_ENV], CONFIG_ENV
    else:
        return None
    path = Path(config_path).expanduser()
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "not found"
        raise ConfigError(f"config file {what}: {path} (named by {named_by})")
    return path.resolve()


def _as_tables(pool: PoolConfig, server: ServerConfig) -> dict[str, Any]:
    data = {f.name: getattr(pool, f.name) for f in dataclasses.fields(pool)}
    data["retry"] = {f.name: getattr(pool.retry, f.name) for f in dataclasses.fields(RetryPolicy)}
    data["image_limits"] = dataclasses.asdict(pool.image_limits)
    data["server"] = {f.name: getattr(server, f.name) for f in dataclasses.fields(server)}
    # Tables last, as a TOML file must have them.
    return {key: data[key] for key in sorted(data, key=lambda key: key in _TABLES)}


def _flatten(data: Mapping[str, Any]) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if key in _TABLES:
            for inner, item in value.items():
                flat[f"{key}.{inner}"] = list(item) if isinstance(item, tuple) else item
        else:
            flat[key] = list(value) if isinstance(value, tuple) else value
    return flat


def _flatten_layer(data: Mapping[str, Any], where: str) -> dict[str, Any]:
    for table in _TABLES:
        if table in data and not isinstance(data[table], Mapping):
            raise ConfigError(f"{where}: {table} must be a table, got {data[table]!r}")
    return _flatten(data)


def _unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
    data: dict[str, Any] = {}
    for key, value in flat.items():
        table, dot, inner = key.partition(".")
        if dot:
            data.setdefault(table, {})[inner] = value
        else:
            data[key] = value
    return data


def _apply(
    flat: dict[str, Any],
    sources: dict[str, Source],
    origins: dict[str, str],
    values: Mapping[str, Any],
    source: Source,
    origin_of: Mapping[str, str],
) -> None:
    """Lay ``values`` over ``flat``; a key's origin is the new layer's, or just its kind."""
    for key, value in values.items():
        flat[key] = value
        sources[key] = source
        if key in origin_of:
            origins[key] = origin_of[key]
        else:
            origins.pop(key, None)


def _build(flat: Mapping[str, Any], where: str) -> tuple[PoolConfig, ServerConfig]:
    data = _unflatten(flat)
    server_table = data.pop("server", {})
    try:
        pool = PoolConfig.from_dict(data)
        server = ServerConfig(**known_fields(server_table, ServerConfig, "server"))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from None
    return pool, server


def _embedded_defaults(pool: PoolConfig) -> dict[str, Any]:
    """The embedded model's own backend options that no layer set, by dotted key."""
    return {
        f"backend_options.{name}": value
        for name, value in embedded_backend_options(pool.model, pool.backend, {}).items()
        if name not in pool.backend_options
    }


def embedded_backend_options(
    model: str, backend: str, options: Mapping[str, Any]
) -> dict[str, Any]:
    """``options`` with the embedded model's own backend options added where unset."""
    if backend != "hf" or not model.startswith("embedded:"):
        return dict(options)
    return {**EMBEDDED_BACKEND_OPTIONS, **options}
