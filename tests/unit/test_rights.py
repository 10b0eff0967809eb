"""Who is an operator (``tenants.Keys.operates``) and what an ordinary tenant sees of a
model's failure (``server.rights``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from modelpool.server.rights import UNAVAILABLE, short_reason, tenant_stats
from modelpool.server.tenants import Keys


def _keys(tmp_path: Path, text: str) -> Keys:
    path = tmp_path / "keys.toml"
    path.write_text(text)
    return Keys.configured(str(path), "sk-default-0123456789")


def test_with_a_keys_file_only_tenants_marked_admin_operate(tmp_path: Path) -> None:
    keys = _keys(
        tmp_path,
        '[tenants.ops]\nkey = "sk-ops-0123456789abc"\nadmin = true\n'
        '[tenants.alice]\nkey = "sk-alice-0123456789a"\n',
    )
    ops = keys.tenant(b"Bearer sk-ops-0123456789abc")
    alice = keys.tenant(b"Bearer sk-alice-0123456789a")
    default = keys.tenant(b"Bearer sk-default-0123456789")
    assert ops is not None and alice is not None and default is not None
    assert keys.operates(ops)
    assert not keys.operates(alice) and not keys.operates(default) and not keys.operates(None)


def test_without_a_keys_file_whoever_gets_in_operates() -> None:
    assert Keys.configured(None, "sk-one-0123456789abc").operates(None)
    assert Keys.configured(None, None).operates(None)


def test_a_file_tenant_may_not_share_the_api_key_tenants_name(tmp_path: Path) -> None:
    # Stored responses and cache partitions are a tenant's name's: a file's "default"
    # would share them with every holder of the api_key_env key.
    with pytest.raises(ValueError, match=r"tenants\.default is the name of the api_key_env"):
        _keys(tmp_path, '[tenants.default]\nkey = "sk-mine-0123456789abc"\n')
    path = tmp_path / "alone.toml"
    path.write_text('[tenants.default]\nkey = "sk-mine-0123456789abc"\n')
    assert Keys.configured(str(path), None).tenant(b"Bearer sk-mine-0123456789abc") is not None


def test_admin_must_be_true_or_false(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"tenants\.ops\.admin must be true or false"):
        _keys(tmp_path, '[tenants.ops]\nkey = "sk-ops-0123456789abc"\nadmin = "yes"\n')


@pytest.mark.parametrize(
    ("reason", "short"),
    [
        (
            "its load failed: RuntimeError: /srv/models/x/weights.bin (token hf_XYZ)",
            "its load failed",
        ),
        ("its load did not finish within 30 s (load_timeout_s)", "its load timed out"),
        (
            "memory not released: the memory of a was not verified released",
            "memory was not released",
        ),
        ("its pool died", "its workers stopped"),
        (
            "model 'm' needs 1091473408 bytes of memory but the budget is 800000000",
            "too large for the memory budget",
        ),
        ("worker 0 exited with -9 at /srv/models/x", UNAVAILABLE),
        (None, None),
    ],
)
def test_a_tenant_sees_the_class_of_a_failure(reason: str | None, short: str | None) -> None:
    assert short_reason(reason) == short


def test_a_tenants_stats_carry_no_path_nor_error_text() -> None:
    secret = "/srv/models/customer-globex-secret"
    stats = {
        "models": {
            "chat": {
                "model": secret,
                "state": "failed",
                "reason": f"its load failed: {secret}",
                "pool": {"last_load_error": secret, "backend_reason": secret, "workers": []},
            }
        },
        "swaps": 3,
    }
    seen = tenant_stats(stats)
    assert secret not in repr(seen)
    assert seen["models"]["chat"]["reason"] == "its load failed" and seen["swaps"] == 3
    assert secret in repr(stats), "the operator's copy is kept"
