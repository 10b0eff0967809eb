"""``/healthz`` is liveness that can fail: a wedged dispatcher, a failed pool, or the
HTTP server's own event loop running late each give 503 with the reason.

The app runs in-process on uvicorn (127.0.0.1, port 0) so that a test can wedge the
pool's dispatcher thread with a blocking done callback and block the server's loop
with a synchronous handler, as real bugs would.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn
from e2e_support import wait_for

from helpers import LONG, UNCAPPED, make_config
from modelpool import ModelPool, ServerConfig
from modelpool.server import create_app

HEARTBEAT_TIMEOUT_S = 1.0
MAX_LOOP_LAG_S = 0.5


class InProcessServer:
    def __init__(self, pool: ModelPool, server_config: ServerConfig) -> None:
        self.app = create_app(pool, server_config, "testing")
        self.blocked = threading.Event()

        @self.app.get("/test/block")
        async def block(seconds: float) -> dict[str, str]:
            self.blocked.set()
            time.sleep(seconds)  # synchronous on purpose: the bug this catches
            return {"status": "unblocked"}

        self.server = uvicorn.Server(
            uvicorn.Config(self.app, host="127.0.0.1", port=0, log_config=None, lifespan="off")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> InProcessServer:
        self.thread.start()
        wait_for(lambda: self.server.started, bool, 10, "uvicorn to start")
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture()
def pool() -> Iterator[ModelPool]:
    started = ModelPool(make_config(workers=1, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S))
    started.start()
    try:
        yield started
    finally:
        started.close(drain=False, timeout=5)


@pytest.fixture()
def served(pool: ModelPool) -> Iterator[InProcessServer]:
    config = ServerConfig(port=0, max_event_loop_lag_s=MAX_LOOP_LAG_S)
    with InProcessServer(pool, config) as server:
        yield server


def healthz(server: InProcessServer) -> httpx.Response:
    return httpx.get(server.url + "/healthz", timeout=10)


def test_healthz_is_ok_with_heartbeat_and_lag(served: InProcessServer) -> None:
    response = healthz(served)
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "ok"
    assert body["pool"] == "ready"
    assert 0 <= body["heartbeat_age_s"] < HEARTBEAT_TIMEOUT_S
    assert body["event_loop_lag_s"] < MAX_LOOP_LAG_S
    assert "reasons" not in body
    stats = httpx.get(served.url + "/stats", timeout=10).json()
    assert 0 <= stats["heartbeat_age_s"] < HEARTBEAT_TIMEOUT_S
    metrics = httpx.get(served.url + "/metrics", timeout=10).text
    assert "modelpool_heartbeat_age_seconds " in metrics


def test_healthz_fails_while_the_dispatcher_is_wedged(
    served: InProcessServer, pool: ModelPool
) -> None:
    release = threading.Event()
    entered = threading.Event()

    def block(_: Any) -> None:
        if threading.current_thread().name == "modelpool-dispatcher":
            entered.set()
            release.wait(30)

    # Attached while the request runs (it runs until cancelled: no race with its end), so
    # that the callback runs on the dispatcher thread when the cancel resolves it.
    future = pool.submit(LONG, **UNCAPPED)
    future.add_done_callback(block)
    assert pool.cancel(future.request_id)
    assert entered.wait(10)
    try:
        failed = wait_for(
            lambda: healthz(served), lambda r: r.status_code == 503, 5, "/healthz to fail"
        )
        body = failed.json()
        assert body["status"] == "unhealthy"
        assert body["heartbeat_age_s"] > HEARTBEAT_TIMEOUT_S
        assert any("wedged" in reason for reason in body["reasons"]), body
        assert "wedged" in body["reason"]
        # Liveness never waits on the wedged thread: it answers at once.
        assert failed.elapsed.total_seconds() < 1.0
    finally:
        release.set()
    recovered = wait_for(
        lambda: healthz(served), lambda r: r.status_code == 200, 5, "/healthz to recover"
    )
    assert recovered.json()["status"] == "ok"


def test_healthz_fails_when_the_server_loop_runs_late(served: InProcessServer) -> None:
    assert healthz(served).status_code == 200  # starts the loop watch
    blocker = threading.Thread(
        target=httpx.get, args=(served.url + "/test/block",), kwargs={"params": {"seconds": 2}}
    )
    blocker.start()
    try:
        assert served.blocked.wait(10)
        # Sent while the loop is blocked: answered when it is free again, with the lag.
        late = healthz(served)
        assert late.status_code == 503, late.json()
        assert any("event loop" in reason for reason in late.json()["reasons"])
        assert late.json()["event_loop_lag_s"] > MAX_LOOP_LAG_S
    finally:
        blocker.join(10)
    wait_for(lambda: healthz(served), lambda r: r.status_code == 200, 5, "/healthz to recover")


def test_healthz_fails_when_the_pool_failed(served: InProcessServer, pool: ModelPool) -> None:
    loop = pool._loop
    assert loop is not None

    def broken() -> None:
        raise RuntimeError("a bug in the dispatcher")

    loop.post(broken)
    failed = wait_for(
        lambda: healthz(served), lambda r: r.status_code == 503, 5, "/healthz to fail"
    )
    assert failed.json()["pool"] == "failed"
    assert any("failed" in reason for reason in failed.json()["reasons"])


def test_loop_watch_reports_a_blocked_loop() -> None:
    from modelpool.server.state import LoopWatch

    async def scenario() -> tuple[float, float]:
        watch = LoopWatch(interval_s=0.05)
        watch.ensure_started()
        await asyncio.sleep(0.2)
        before = watch.lag_s()
        time.sleep(0.5)  # block the loop
        return before, watch.lag_s()

    before, during = asyncio.run(scenario())
    assert before < 0.2
    assert during >= 0.4
