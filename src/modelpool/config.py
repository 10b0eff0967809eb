"""Pool and server configuration: dataclasses, TOML loading, validation.

Every check names the offending key, so a typo in a TOML file reads as
``ValueError: unknown key 'wrokers' (known: ...)`` rather than a silent default::

    cfg = PoolConfig.from_toml("configs/default.toml")
    cfg = PoolConfig(model="./tiny", backend="hf", workers=2, deadline_s=30)
"""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modelpool.validation import check_generation_params, is_number

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

RETRY_REASONS = ("timeout", "crash", "error")
_DEVICE_PATTERN = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
_BACKEND_PATTERN = re.compile(r"^[A-Za-z_][\w.]*(:[A-Za-z_]\w*)?$")


def _check_number(name: str, value: object, *, allow_zero: bool, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not is_number(value):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):  # type: ignore[operator]
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be {bound}, got {value!r}")


def _check_int(name: str, value: object, *, minimum: int, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")


def _reject_unknown(table: str, given: Mapping[str, Any], known: set[str]) -> None:
    unknown = sorted(set(given) - known)
    if unknown:
        where = f" in [{table}]" if table else ""
        raise ValueError(f"unknown key {unknown[0]!r}{where} (known: {', '.join(sorted(known))})")


@dataclass(frozen=True)
class RetryPolicy:
    """When a failed attempt is tried again on another worker.

    ``on`` lists the attempt outcomes that are retried: "timeout" (deadline or
    stall of one attempt), "crash" (the worker died), "error" (the backend raised;
    off by default because a deterministic exception would just repeat).

    A "timeout" retry needs time left after the attempt: set ``attempt_timeout_s``
    below ``deadline_s`` (or a ``stall_timeout_s``), else the first attempt's
    deadline is the request's and there is nothing left to retry in.
    """

    max_retries: int = 2
    on: tuple[str, ...] = ("timeout", "crash")
    backoff_s: float = 0.0

    def __post_init__(self) -> None:
        _check_int("retry.max_retries", self.max_retries, minimum=0)
        _check_number("retry.backoff_s", self.backoff_s, allow_zero=True)
        if not isinstance(self.on, (list, tuple)) or not all(isinstance(r, str) for r in self.on):
            raise ValueError(f"retry.on must be a list of strings, got {self.on!r}")
        object.__setattr__(self, "on", tuple(self.on))
        for reason in self.on:
            if reason not in RETRY_REASONS:
                raise ValueError(f"retry.on: unknown reason {reason!r} (known: {RETRY_REASONS})")


@dataclass(frozen=True)
class PoolConfig:
    """How a :class:`~modelpool.ModelPool` is built; the README's Configuration section
    says what each field does."""

    model: str
    backend: str = "hf"
    backend_options: dict[str, Any] = field(default_factory=dict)
    workers: int = 2
    max_batch_size: int = 1
    spares: int = 0
    devices: tuple[str, ...] = ("auto",)
    deadline_s: float = 60.0
    attempt_timeout_s: float | None = None
    cancel_grace_s: float = 2.0
    term_grace_s: float = 2.0
    startup_timeout_s: float = 300.0
    stall_timeout_s: float | None = None
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    max_queue: int = 1024
    max_requests_per_worker: int | None = None
    max_worker_rss_mb: float | None = None
    max_worker_gpu_mb: float | None = None
    gpu_release_timeout_s: float = 15.0
    gpu_sample_interval_s: float = 2.0
    startup_failures_before_giving_up: int = 3
    generation_defaults: dict[str, Any] = field(default_factory=lambda: {"max_new_tokens": 128})

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a non-empty string, got {self.model!r}")
        if not isinstance(self.backend, str) or not _BACKEND_PATTERN.match(self.backend):
            raise ValueError(
                f"backend must be 'hf', 'testing' or 'pkg.module:factory', got {self.backend!r}"
            )
        if not isinstance(self.backend_options, Mapping):
            raise ValueError(f"backend_options must be a table, got {self.backend_options!r}")
        object.__setattr__(self, "backend_options", dict(self.backend_options))
        _check_int("workers", self.workers, minimum=1)
        _check_int("max_batch_size", self.max_batch_size, minimum=1)
        _check_int("spares", self.spares, minimum=0)
        devices = (self.devices,) if isinstance(self.devices, str) else self.devices
        if not isinstance(devices, (list, tuple)) or not devices:
            raise ValueError(f"devices must be a non-empty list, got {self.devices!r}")
        for device in devices:
            if not isinstance(device, str) or not _DEVICE_PATTERN.match(device):
                raise ValueError(f"devices: {device!r} is not 'auto', 'cpu', 'cuda' or 'cuda:N'")
        object.__setattr__(self, "devices", tuple(devices))
        _check_number("deadline_s", self.deadline_s, allow_zero=False)
        _check_number("attempt_timeout_s", self.attempt_timeout_s, allow_zero=False, optional=True)
        _check_number("cancel_grace_s", self.cancel_grace_s, allow_zero=True)
        _check_number("term_grace_s", self.term_grace_s, allow_zero=True)
        _check_number("startup_timeout_s", self.startup_timeout_s, allow_zero=False)
        _check_number("stall_timeout_s", self.stall_timeout_s, allow_zero=False, optional=True)
        if isinstance(self.retry, Mapping):
            object.__setattr__(
                self, "retry", RetryPolicy(**_known(self.retry, RetryPolicy, "retry"))
            )
        if not isinstance(self.retry, RetryPolicy):
            raise ValueError(f"retry must be a RetryPolicy, got {self.retry!r}")
        _check_int("max_queue", self.max_queue, minimum=1)
        _check_int(
            "max_requests_per_worker", self.max_requests_per_worker, minimum=1, optional=True
        )
        _check_number("max_worker_rss_mb", self.max_worker_rss_mb, allow_zero=False, optional=True)
        _check_number("max_worker_gpu_mb", self.max_worker_gpu_mb, allow_zero=False, optional=True)
        _check_number("gpu_release_timeout_s", self.gpu_release_timeout_s, allow_zero=True)
        _check_number("gpu_sample_interval_s", self.gpu_sample_interval_s, allow_zero=False)
        _check_int(
            "startup_failures_before_giving_up", self.startup_failures_before_giving_up, minimum=1
        )
        if not isinstance(self.generation_defaults, Mapping):
            raise ValueError(
                f"generation_defaults must be a table, got {self.generation_defaults!r}"
            )
        object.__setattr__(self, "generation_defaults", dict(self.generation_defaults))
        check_generation_params(self.generation_defaults, where="generation_defaults")

    @classmethod
    def from_toml(cls, path: str | Path) -> PoolConfig:
        """Read a pool configuration; the ``[server]`` table is left to :class:`ServerConfig`."""
        data = _read_toml(path)
        data.pop("server", None)
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PoolConfig:
        if "model" not in data:
            raise ValueError("missing key 'model'")
        return cls(**_known(data, cls, ""))

    def replace(self, **changes: Any) -> PoolConfig:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class ServerConfig:
    """The daemon's own settings, from the TOML ``[server]`` table."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key_env: str | None = None
    max_body_bytes: int = 1_048_576
    drain_timeout_s: float = 30.0
    max_request_timeout_s: float | None = None
    model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"server.host must be a non-empty string, got {self.host!r}")
        _check_int("server.port", self.port, minimum=0)
        if self.port > 65535:
            raise ValueError(f"server.port must be <= 65535, got {self.port!r}")
        if self.api_key_env is not None and not isinstance(self.api_key_env, str):
            raise ValueError(f"server.api_key_env must be a string, got {self.api_key_env!r}")
        _check_int("server.max_body_bytes", self.max_body_bytes, minimum=1)
        _check_number("server.drain_timeout_s", self.drain_timeout_s, allow_zero=True)
        _check_number(
            "server.max_request_timeout_s",
            self.max_request_timeout_s,
            allow_zero=False,
            optional=True,
        )
        if self.model_name is not None and not isinstance(self.model_name, str):
            raise ValueError(f"server.model_name must be a string, got {self.model_name!r}")

    @classmethod
    def from_toml(cls, path: str | Path) -> ServerConfig:
        table = _read_toml(path).get("server", {})
        if not isinstance(table, Mapping):
            raise ValueError("[server] must be a table")
        return cls(**_known(table, cls, "server"))


def _known(data: Mapping[str, Any], cls: type, table: str) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    _reject_unknown(table, data, names)
    return dict(data)


def _read_toml(path: str | Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: invalid TOML: {exc}") from exc
