"""Liveness: the dispatcher's heartbeat, ``ModelPool.health()`` and ``stats().heartbeat_age_s``.

The wedge is real: a future's done callback runs on the dispatcher thread, and one
that blocks stops that thread's loop exactly as a bug there would.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from helpers import (
    LONG,
    UNCAPPED,
    assert_no_children,
    make_config,
    open_pool,
    slack,
    wait_until,
)
from modelpool import ModelPool, PoolConfig
from modelpool.supervisor.faults import run_on_dispatcher

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux processes")

HEARTBEAT_TIMEOUT_S = 1.0


@pytest.fixture()
def pool() -> Iterator[ModelPool]:
    with open_pool(workers=1, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S) as started:
        yield started


def wedge_dispatcher(pool: ModelPool) -> threading.Event:
    """Block the dispatcher thread in a done callback until the returned event is set."""
    release = threading.Event()
    entered = threading.Event()

    def block(_: Any) -> None:
        if threading.current_thread().name != "modelpool-dispatcher":
            return  # The request finished before the callback was added: no wedge.
        entered.set()
        release.wait(30)

    # Attached while the request runs (it runs until cancelled: no race with its end),
    # so that the callback runs on the dispatcher thread when the cancel resolves it.
    future = pool.submit(LONG, **UNCAPPED)
    future.add_done_callback(block)
    assert pool.cancel(future.request_id)
    assert entered.wait(10), "the callback never ran on the dispatcher thread"
    return release


def test_an_idle_pool_keeps_a_fresh_heartbeat(pool: ModelPool) -> None:
    # Several heartbeat bounds of idleness: the loop wakes by itself to stamp it.
    ages = []
    window_end = time.monotonic() + 3 * HEARTBEAT_TIMEOUT_S
    while time.monotonic() < window_end:
        health = pool.health()
        assert health.alive, health.reason
        assert health.heartbeat_age_s is not None
        ages.append(health.heartbeat_age_s)
        time.sleep(0.05)
    assert max(ages) < HEARTBEAT_TIMEOUT_S / 2, max(ages)
    snapshot = pool.stats()
    assert snapshot.heartbeat_age_s is not None
    assert 0 <= snapshot.heartbeat_age_s < HEARTBEAT_TIMEOUT_S
    assert snapshot.to_dict()["heartbeat_age_s"] == snapshot.heartbeat_age_s


def test_a_wedged_dispatcher_fails_health_then_recovers(pool: ModelPool) -> None:
    release = wedge_dispatcher(pool)
    try:
        started = time.monotonic()
        health = wait_until(
            lambda: next((h for h in [pool.health()] if not h.alive), None),
            timeout=HEARTBEAT_TIMEOUT_S + 3,
            message="health() to report the wedge",
        )
        detected_after = time.monotonic() - started
        assert "wedged" in (health.reason or ""), health.reason
        assert health.heartbeat_age_s is not None
        assert health.heartbeat_age_s > HEARTBEAT_TIMEOUT_S
        assert detected_after < HEARTBEAT_TIMEOUT_S + 1.5
        # stats() cannot get a snapshot from the wedged thread; it answers with the
        # last one it can build and the age measured now.
        snapshot = pool.stats()
        assert snapshot.heartbeat_age_s is not None
        assert snapshot.heartbeat_age_s > HEARTBEAT_TIMEOUT_S
    finally:
        release.set()
    wait_until(lambda: pool.health().alive, timeout=5, message="health() to recover")
    assert pool.generate("echo:after", deadline_s=5).text == "after"


def test_a_failed_pool_is_not_alive() -> None:
    pool = ModelPool(make_config(workers=1))
    pool.start()
    try:

        def broken() -> None:
            raise RuntimeError("a bug in the dispatcher")

        dispatcher_thread = run_on_dispatcher(pool, broken)
        dispatcher_thread.join(slack(5.0))
        assert not dispatcher_thread.is_alive()
        health = pool.health()
        assert not health.alive
        assert health.state == "failed"
        assert "failed" in (health.reason or "")
    finally:
        pool.close(drain=False, timeout=2)
    assert_no_children()


def test_health_before_start_and_after_close() -> None:
    pool = ModelPool(make_config(workers=1))
    assert not pool.health().alive
    assert pool.health().heartbeat_age_s is None
    pool.start()
    assert pool.health().alive
    pool.close(drain=False, timeout=2)
    health = pool.health()
    assert not health.alive
    assert "closed" in (health.reason or "")


def test_heartbeat_timeout_is_validated() -> None:
    with pytest.raises(ValueError, match="heartbeat_timeout_s"):
        PoolConfig(model="none", backend="testing", heartbeat_timeout_s=0)
    assert PoolConfig(model="none").heartbeat_timeout_s == 10.0
