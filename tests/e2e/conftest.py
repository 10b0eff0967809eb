"""Fixtures for the end-to-end tests (helpers in ``e2e_support``)."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import httpx
import pytest
from e2e_support import Daemon, daemon_config, start_daemon

from helpers import FAR_DEADLINE_S

# Real processes, POSIX signals and /proc: Linux only.
if not sys.platform.startswith("linux"):
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A daemon per test module (2 testing workers, no retries, 64 KiB body limit), so that
    none outlives its module into suites that check for leftover processes. Its deadline
    is past every (slack-scaled) wait of the tests that hold a request until they let go
    of it (``Daemon.assert_outlasts``); a test that wants a deadline sends ``timeout``."""
    server = start_daemon(
        tmp_path_factory.mktemp("daemon"), daemon_config(deadline_s=FAR_DEADLINE_S)
    )
    yield server
    assert server.stop() == 0, server.log()[-4000:]


@pytest.fixture()
def http(daemon: Daemon) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=daemon.url, timeout=30.0) as client:
        yield client
