"""The daemon's app and metrics in process, over a real pool: what a running daemon cannot
show (the port opens only once the pool has started, and closes when a drain begins).

The docs, The daemon: /readyz is 503 while the pool starts or the daemon drains, with
Retry-After; a request that arrives while draining is a 503 with Retry-After; /metrics
names every family, the pool state among them, and counts kills by reason.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from helpers import METRIC_FAMILIES, make_config, open_pool, slack, wait_counters, wait_until
from modelpool import DeadlineExceeded, ModelPool, RetryPolicy
from modelpool.server import create_app
from modelpool.server.metrics import PoolMetrics
from modelpool.shared.config import ServerConfig

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux processes")
LOOPBACK = "http://127.0.0.1"


def client_for(pool: ModelPool) -> TestClient:
    # A loopback Host: the daemon refuses other names (DNS rebinding).
    return TestClient(create_app(pool, ServerConfig(), "test-model"), base_url=LOOPBACK)


@pytest.fixture
def starting_pool() -> Iterator[ModelPool]:
    """A pool whose workers take 3 s to load, started in a thread: it is "starting"."""
    pool = ModelPool(make_config(workers=1, backend_options={"load_delay_s": 3.0}))
    starter = threading.Thread(target=pool.start, daemon=True)
    starter.start()
    try:
        yield pool
    finally:
        pool.close(drain=False, timeout=5.0)
        starter.join(10)


def test_readyz_is_503_with_retry_after_while_the_pool_starts(starting_pool: ModelPool) -> None:
    client = client_for(starting_pool)
    wait_until(lambda: starting_pool.stats().workers, timeout=slack(2), message="a worker")
    response = client.get("/readyz")
    assert response.status_code == 503
    assert int(response.headers["retry-after"]) >= 1
    assert response.json()["pool"] == "starting" and response.json()["ready_workers"] == 0
    assert starting_pool.stats().workers[0].state == "starting"
    wait_until(lambda: client.get("/readyz").status_code == 200, timeout=slack(10))


def test_draining_is_503_with_retry_after_for_readyz_and_requests() -> None:
    with open_pool(workers=1) as pool:
        app = create_app(pool, ServerConfig(), "test-model")
        client = TestClient(app, base_url=LOOPBACK)
        assert client.get("/readyz").status_code == 200
        app.state.modelpool.draining = True  # what the first SIGTERM/SIGINT sets
        ready = client.get("/readyz")
        assert ready.status_code == 503 and ready.json()["draining"] is True
        assert int(ready.headers["retry-after"]) >= 1
        refused = client.post("/v1/completions", json={"prompt": "echo:x"})
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "draining"
        assert int(refused.headers["retry-after"]) >= 1
        assert pool.stats().counters["submitted"] == 0


def families(text: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """Family name -> {label set: value} of each sample (histogram parts under their name)."""
    found: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        samples = found.setdefault(family.name, {})
        for sample in family.samples:
            samples[(("sample", sample.name), *sorted(sample.labels.items()))] = sample.value
    return found


def value(
    found: dict[str, dict[tuple[tuple[str, str], ...], float]], name: str, **labels: str
) -> float:
    matches = [
        v
        for key, v in found[name].items()
        if all(pair in key for pair in labels.items()) and not key[0][1].endswith("_created")
    ]
    assert len(matches) == 1, (name, labels, found[name])
    return matches[0]


def test_metrics_name_every_family_and_count_kills_by_reason() -> None:
    with open_pool(
        workers=1, cancel_grace_s=0.2, term_grace_s=0.2, retry=RetryPolicy(max_retries=0)
    ) as pool:
        client = client_for(pool)
        assert client.post("/v1/completions", json={"prompt": "echo:x"}).status_code == 200
        with pytest.raises(DeadlineExceeded):
            pool.generate("hang", deadline_s=0.3)  # a kill, reason "timeout"
        wait_counters(pool, kills=1, respawns=1)
        wait_until(lambda: pool.stats().gpu.releases.checked == 1, message="the release check")
        assert client.post("/v1/completions", json={"prompt": "segfault"}).status_code == 502
        wait_counters(pool, crashes=1, respawns=2)
        wait_until(lambda: pool.stats().gpu.releases.checked == 2, message="the release check")

        response = client.get("/metrics")
        assert response.status_code == 200
        found = families(response.text)
        assert set(found) >= METRIC_FAMILIES, sorted(found)
        assert value(found, "modelpool_worker_kills", reason="timeout") == 1
        assert value(found, "modelpool_worker_crashes") == 1
        assert value(found, "modelpool_worker_respawns") == 2
        assert value(found, "modelpool_gpu_releases", result="ok") == 2
        assert value(found, "modelpool_gpu_releases", result="failed") == 0
        assert value(found, "modelpool_gpu_release_seconds") >= 0
        assert value(found, "modelpool_requests", outcome="completed") == 1
        assert value(found, "modelpool_requests", outcome="failed") == 2
        assert value(found, "modelpool_pool_state", state="ready") == 1
        assert value(found, "modelpool_pool_state", state="degraded") == 0
        count = value(
            found,
            "modelpool_request_duration_seconds",
            sample="modelpool_request_duration_seconds_count",
        )
        assert count == 2  # the two HTTP generation requests, not the library call


def test_pool_metrics_render_without_a_daemon() -> None:
    """metrics.PoolMetrics renders a pool's stats for any embedding code, no server needed."""
    with open_pool(workers=2) as pool:
        pool.generate("echo:x")
        found = families(PoolMetrics(pool.stats).render().decode())
    assert set(found) >= METRIC_FAMILIES
    assert value(found, "modelpool_workers", state="idle") == 2
    assert value(found, "modelpool_pool_state", state="ready") == 1
    assert value(found, "modelpool_requests", outcome="completed") == 1
