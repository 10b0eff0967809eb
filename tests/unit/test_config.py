"""PoolConfig / RetryPolicy / ServerConfig validation, from kwargs and from TOML files."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from modelpool import InvalidRequest, ModelPool, PoolConfig, RetryPolicy, ServerConfig


def write_toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "pool.toml"
    path.write_text(text)
    return path


# ---- defaults and kwargs ---------------------------------------------------------------------


def test_defaults_are_valid_and_match_the_design() -> None:
    cfg = PoolConfig(model="m")
    assert cfg.backend == "auto"
    assert cfg.workers == 2
    assert cfg.spares == 0
    assert cfg.devices == ("auto",)
    assert cfg.deadline_s == 60.0
    assert cfg.attempt_timeout_s is None
    assert cfg.cancel_grace_s == 2.0
    assert cfg.term_grace_s == 2.0
    assert cfg.max_queue == 1024
    assert cfg.retry == RetryPolicy(max_retries=2, on=("timeout", "crash"), backoff_s=0.0)
    # None: a request that asks for no maximum gets the worker's own (128 new tokens, or
    # with fit_to_context, as the daemon's requests have, all the room the context leaves).
    assert cfg.generation_defaults == {}


def test_kwargs_are_normalised() -> None:
    cfg = PoolConfig(
        model="m",
        backend="pkg.module:factory",
        devices="cpu",  # type: ignore[arg-type]
        retry={"max_retries": 5, "on": ["crash"]},  # type: ignore[arg-type]
    )
    assert cfg.devices == ("cpu",)
    assert cfg.retry == RetryPolicy(max_retries=5, on=("crash",))
    assert isinstance(cfg.retry.on, tuple)
    assert PoolConfig(model="m", devices=["cuda:0", "cuda:1", "cpu"]).devices == (
        "cuda:0",
        "cuda:1",
        "cpu",
    )


INVALID_KWARGS = [
    ("workers", 0),
    ("workers", -1),
    ("workers", 1.5),
    ("workers", True),
    ("spares", -1),
    ("deadline_s", 0),
    ("deadline_s", -1.0),
    ("deadline_s", math.nan),
    ("deadline_s", math.inf),
    ("deadline_s", "10"),
    ("attempt_timeout_s", 0),
    ("attempt_timeout_s", -2),
    ("cancel_grace_s", -0.1),
    ("term_grace_s", -1),
    ("startup_timeout_s", 0),
    ("stall_timeout_s", -1),
    ("max_queue", 0),
    ("max_requests_per_worker", 0),
    ("max_worker_rss_mb", -5),
    ("max_worker_gpu_mb", 0),
    ("gpu_release_timeout_s", -1),
    ("worker_poll_s", -0.001),
    ("worker_poll_s", 0.5),
    ("devices", ["gpu"]),
    ("devices", []),
    ("backend", "not a backend!"),
    ("model", ""),
    ("backend_options", [1, 2]),
    ("generation_defaults", "max_new_tokens=3"),
]


@pytest.mark.parametrize(("key", "value"), INVALID_KWARGS, ids=lambda v: repr(v))
def test_invalid_kwarg_value_is_a_value_error_naming_the_key(key: str, value: Any) -> None:
    kwargs: dict[str, Any] = {"model": "m", key: value}
    with pytest.raises(ValueError, match=key):
        PoolConfig(**kwargs)


def test_invalid_generation_defaults_name_the_key() -> None:
    with pytest.raises(ValueError, match=r"generation_defaults\.max_new_tokens") as info:
        PoolConfig(model="m", generation_defaults={"max_new_tokens": 0})
    assert isinstance(info.value, InvalidRequest)
    with pytest.raises(ValueError, match=r"generation_defaults\.top_p"):
        PoolConfig(model="m", generation_defaults={"top_p": 2})


def test_unknown_key_from_a_dict_is_a_value_error_naming_it() -> None:
    with pytest.raises(ValueError, match="wrokers") as info:
        PoolConfig.from_dict({"model": "m", "wrokers": 2})
    assert "workers" in str(info.value), "the message lists the known keys"


def test_unknown_kwarg_names_the_key() -> None:
    # A dataclass constructor reports an unknown keyword as TypeError; either way the key
    # must be named and nothing is built.
    with pytest.raises((TypeError, ValueError), match="wrokers"):
        PoolConfig(model="m", wrokers=2)  # type: ignore[call-arg]
    with pytest.raises((TypeError, ValueError), match="wrokers"):
        ModelPool(model="m", backend="testing", wrokers=2)


def test_missing_model_is_named() -> None:
    with pytest.raises(ValueError, match="model"):
        PoolConfig.from_dict({"workers": 2})


def test_replace_and_pool_overrides_are_validated() -> None:
    cfg = PoolConfig(model="m", backend="testing")
    assert cfg.replace(workers=3).workers == 3
    with pytest.raises(ValueError, match="workers"):
        cfg.replace(workers=0)
    with pytest.raises(ValueError, match="deadline_s"):
        ModelPool(cfg, deadline_s=-1)
    with pytest.raises(ValueError, match="workers"):
        ModelPool(model="m", backend="testing", workers=0)


# ---- RetryPolicy -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"max_retries": -1}, "retry.max_retries"),
        ({"max_retries": 1.5}, "retry.max_retries"),
        ({"max_retries": True}, "retry.max_retries"),
        ({"backoff_s": -0.5}, "retry.backoff_s"),
        ({"on": "timeout"}, "retry.on"),
        ({"on": ("timeout", 3)}, "retry.on"),
    ],
)
def test_retry_policy_validation(kwargs: dict[str, Any], key: str) -> None:
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        RetryPolicy(**kwargs)


def test_retry_on_unknown_reason_is_named() -> None:
    with pytest.raises(ValueError, match="explode") as info:
        RetryPolicy(on=("timeout", "explode"))
    assert "retry.on" in str(info.value)
    assert RetryPolicy(on=("timeout", "crash", "error")).on == ("timeout", "crash", "error")
    assert RetryPolicy(on=()).on == ()


# ---- TOML ------------------------------------------------------------------------------------

FULL_TOML = """
model = "/models/tiny"
backend = "testing"
workers = 3
spares = 1
devices = ["cpu"]
deadline_s = 12.5
attempt_timeout_s = 4
cancel_grace_s = 0.5
max_queue = 64

[retry]
max_retries = 1
on = ["crash"]
backoff_s = 0.1

[generation_defaults]
max_new_tokens = 32
temperature = 0.0

[backend_options]
load_delay_s = 0.0

[server]
host = "0.0.0.0"
port = 9000
api_key_env = "MODELPOOL_KEY"
max_body_bytes = 4096
drain_timeout_s = 5
max_request_timeout_s = 30
model_name = "served-name"
"""


def test_full_toml_file(tmp_path: Path) -> None:
    path = write_toml(tmp_path, FULL_TOML)
    cfg = PoolConfig.from_toml(path)
    assert cfg.model == "/models/tiny"
    assert cfg.backend == "testing"
    assert cfg.workers == 3
    assert cfg.spares == 1
    assert cfg.devices == ("cpu",)
    assert cfg.deadline_s == 12.5
    assert cfg.attempt_timeout_s == 4
    assert cfg.retry == RetryPolicy(max_retries=1, on=("crash",), backoff_s=0.1)
    assert cfg.generation_defaults == {"max_new_tokens": 32, "temperature": 0.0}
    assert cfg.backend_options == {"load_delay_s": 0.0}
    assert not hasattr(cfg, "server")

    server = ServerConfig.from_toml(path)
    assert server.host == "0.0.0.0"
    assert server.port == 9000
    assert server.api_key_env == "MODELPOOL_KEY"
    assert server.max_body_bytes == 4096
    assert server.drain_timeout_s == 5
    assert server.max_request_timeout_s == 30
    assert server.model_name == "served-name"


def test_server_table_is_ignored_by_pool_config_and_validated_by_server_config(
    tmp_path: Path,
) -> None:
    path = write_toml(tmp_path, 'model = "m"\n[server]\nport = 70000\nbogus = 1\n')
    assert PoolConfig.from_toml(path).model == "m"
    with pytest.raises(ValueError, match="bogus") as info:
        ServerConfig.from_toml(path)
    assert "[server]" in str(info.value)
    path = write_toml(tmp_path, 'model = "m"\n[server]\nport = 70000\n')
    with pytest.raises(ValueError, match=r"server\.port"):
        ServerConfig.from_toml(path)


def test_server_config_without_server_table_is_the_default(tmp_path: Path) -> None:
    path = write_toml(tmp_path, 'model = "m"\n')
    assert ServerConfig.from_toml(path) == ServerConfig()
    assert ServerConfig().host == "127.0.0.1"


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('model = "m"\nwrokers = 2\n', "wrokers"),
        ('model = "m"\nworkers = 0\n', "workers"),
        ('model = "m"\ndeadline_s = -1\n', "deadline_s"),
        ('model = "m"\nterm_grace_s = -0.5\n', "term_grace_s"),
        ('model = "m"\n[retry]\nmax_retrys = 1\n', "max_retrys"),
        ('model = "m"\n[retry]\nmax_retries = -1\n', r"retry\.max_retries"),
        ('model = "m"\n[retry]\non = ["timeout", "oom"]\n', "oom"),
        ('model = "m"\n[generation_defaults]\nmax_new_tokens = 0\n', "max_new_tokens"),
        ("workers = 2\n", "model"),
    ],
)
def test_bad_toml_values_name_the_key(tmp_path: Path, text: str, key: str) -> None:
    path = write_toml(tmp_path, text)
    with pytest.raises(ValueError, match=key):
        PoolConfig.from_toml(path)


def test_unknown_key_in_retry_table_names_the_table(tmp_path: Path) -> None:
    path = write_toml(tmp_path, 'model = "m"\n[retry]\nmax_retrys = 1\n')
    with pytest.raises(ValueError, match=r"\[retry\]"):
        PoolConfig.from_toml(path)


def test_invalid_toml_is_a_value_error_naming_the_file(tmp_path: Path) -> None:
    path = write_toml(tmp_path, 'model = "m"\nworkers = = 2\n')
    with pytest.raises(ValueError, match="invalid TOML") as info:
        PoolConfig.from_toml(path)
    assert str(path) in str(info.value)
    with pytest.raises(ValueError, match="invalid TOML"):
        ServerConfig.from_toml(path)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("allowed_hosts", "localhost"),
        ("allowed_hosts", [""]),
        ("cors_allowed_origins", [1]),
        ("max_request_tokens", 0),
        ("client_max_running", 0),
        ("client_max_queued", -1),
        ("send_timeout_s", 0),
        ("header_timeout_s", -1.0),
        ("body_timeout_s", "20"),
        ("max_header_bytes", 100),
        ("max_headers", 2),
        ("max_connections", 0),
        ("max_pending_body_bytes", 0),
        # Under max_body_bytes (32 MiB), one whole body would be refused.
        ("max_pending_body_bytes", 65_536),
    ],
)
def test_the_daemons_limits_are_validated_naming_the_key(key: str, value: Any) -> None:
    with pytest.raises(ValueError, match=f"server.{key}"):
        ServerConfig(**{key: value})


def test_host_and_origin_lists_read_from_toml_as_tuples(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[server]\nallowed_hosts = ["a.example"]\ncors_allowed_origins = []\n')
    server = ServerConfig.from_toml(path)
    assert server.allowed_hosts == ("a.example",) and server.cors_allowed_origins == ()
