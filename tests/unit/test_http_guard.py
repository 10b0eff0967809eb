"""server.guard's pure parts: which Host names a daemon serves by default, what counts as
a JSON body, how the access log writes a path (issue 25)."""

from __future__ import annotations

import pytest

from modelpool.server.guard import BrowserGuard, log_path, require_json
from modelpool.server.http import ApiError
from modelpool.shared.config import ServerConfig


@pytest.mark.parametrize("bind", ["127.0.0.1", "127.0.0.5", "::1", "[::1]", "localhost"])
def test_a_daemon_on_loopback_serves_loopback_names_only(bind: str) -> None:
    guard = BrowserGuard(ServerConfig(host=bind))
    for host in ("localhost:8000", "LOCALHOST", "a.localhost", "127.0.0.1:1", "[::1]:8000"):
        assert guard.host_allowed(host), host
    for host in ("rebind.attacker.example:8000", "localhost.evil.example", "10.0.0.1"):
        assert not guard.host_allowed(host), host


def test_a_daemon_bound_elsewhere_or_configured_serves_what_it_is_told() -> None:
    assert BrowserGuard(ServerConfig(host="0.0.0.0")).host_allowed("pod-10-0-0-7:8000")
    named = BrowserGuard(ServerConfig(allowed_hosts=("models.example:8000",)))
    assert named.host_allowed("models.example") and not named.host_allowed("localhost")
    assert BrowserGuard(ServerConfig(allowed_hosts=("*",))).host_allowed("anything.example")


def test_only_json_media_types_pass() -> None:
    for ok in ("application/json", "application/json; charset=utf-8", "application/x+json"):
        require_json(ok)
    for refused in (None, "", "text/plain;charset=UTF-8", "multipart/form-data", "json"):
        with pytest.raises(ApiError) as info:
            require_json(refused)
        assert info.value.status == 415


def test_the_logged_path_is_percent_encoded() -> None:
    assert log_path("/v1/completions") == "/v1/completions"
    assert log_path("/x\n2026 INFO forged\x1b[2J") == "/x%0A2026%20INFO%20forged%1B%5B2J"
