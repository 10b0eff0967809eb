"""``modelpool.ray_serve`` on a local Ray (2 CPUs, the testing backend): requests
through Ray's HTTP proxy, a replica's SIGKILL (its workers die with it, Ray serves
again), and Ray's request timeout cancelling the generation in the worker.

One Ray session for the module keeps this short; every test leaves the replica
serving for the next.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import psutil
import pytest
from e2e_support import free_port, wait_for

from helpers import assert_no_children, make_config, wait_pids_gone

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from modelpool.ray_serve import build_app  # noqa: E402

REQUEST_TIMEOUT_S = 3.0
# Measured on the 2-core CI machine under load: about 10 s; Ray's own replica
# restart (actor start, imports, pool start) is most of it.
SERVING_AGAIN_BOUND_S = 60.0

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def proxy_url() -> Iterator[str]:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Loopback only: Ray would otherwise bind its node services on the host's address.
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        _node_ip_address="127.0.0.1",
    )
    try:
        port = free_port()
        serve.start(
            http_options={
                "host": "127.0.0.1",
                "port": port,
                "request_timeout_s": REQUEST_TIMEOUT_S,
            }
        )
        app = build_app(
            make_config(workers=1, heartbeat_timeout_s=2.0),
            health_check_period_s=1.0,
            health_check_timeout_s=2.0,
        )
        serve.run(app, name="modelpool", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
    # Every replica's pool is gone with Ray: no worker process of ours is left.
    assert_no_children(timeout=10)


def stats(url: str) -> dict[str, Any]:
    response = httpx.get(url + "/stats", timeout=10)
    response.raise_for_status()
    data: dict[str, Any] = response.json()
    return data


def complete(url: str, prompt: str, timeout: float = 10) -> httpx.Response:
    return httpx.post(
        url + "/v1/completions", json={"prompt": prompt, "max_tokens": 500}, timeout=timeout
    )


def test_routes_through_rays_proxy(proxy_url: str) -> None:
    response = complete(proxy_url, "echo:through ray")
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == "through ray"
    body = {
        "messages": [{"role": "user", "content": "tokens:5:0.01"}],
        "max_tokens": 5,
        "stream": True,
    }
    with httpx.stream("POST", proxy_url + "/v1/chat/completions", json=body, timeout=10) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    text = "".join(
        json.loads(line[6:])["choices"][0]["delta"].get("content") or "" for line in lines[:-1]
    )
    assert text.split() == [f"t{i}" for i in range(5)]
    health = httpx.get(proxy_url + "/healthz", timeout=10)
    assert health.status_code == 200
    assert health.json()["heartbeat_age_s"] < 2.0
    assert stats(proxy_url)["state"] == "ready"


def test_rays_request_timeout_cancels_the_generation(proxy_url: str) -> None:
    before = stats(proxy_url)["counters"]["cancelled"]
    started = time.monotonic()
    # 400 tokens 20 ms apart: 8 s, past Ray's 3 s request timeout.
    response = complete(proxy_url, "tokens:400:0.02", timeout=30)
    assert response.status_code >= 400
    assert time.monotonic() - started < REQUEST_TIMEOUT_S + 3
    after = wait_for(
        lambda: stats(proxy_url),
        lambda s: s["counters"]["cancelled"] == before + 1,
        5,
        "the pool to count the cancel",
    )
    assert after["counters"]["timeouts"] == 0  # cancelled in the worker, not timed out
    wait_for(
        lambda: stats(proxy_url),
        lambda s: [w["state"] for w in s["workers"]] == ["idle"],
        5,
        "the worker to be free again",
    )


def test_a_sigkilled_replica_takes_its_workers_and_ray_replaces_it(proxy_url: str) -> None:
    workers = {w["pid"] for w in stats(proxy_url)["workers"]}
    (replica_pid,) = {psutil.Process(pid).ppid() for pid in workers}
    killed_at = time.monotonic()
    os.kill(replica_pid, signal.SIGKILL)
    workers_gone_s = wait_pids_gone(workers, timeout=5)
    assert workers_gone_s < 1.0, workers_gone_s

    def served() -> bool:
        try:
            return complete(proxy_url, "echo:again", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(served, bool, SERVING_AGAIN_BOUND_S, "Ray to serve again")
    back_s = time.monotonic() - killed_at
    print(f"ray: replica SIGKILL -> workers gone {workers_gone_s:.3f} s, serving {back_s:.1f} s")
    new_workers = {w["pid"] for w in stats(proxy_url)["workers"]}
    assert not new_workers & workers


def test_check_health_fails_on_a_wedged_or_failed_pool() -> None:
    """``PoolReplica`` as Ray's controller sees it, without Ray: its ``check_health``."""
    import threading

    from modelpool import ServerConfig
    from modelpool.ray_serve import PoolReplica

    replica = PoolReplica(make_config(workers=1, heartbeat_timeout_s=1.0), ServerConfig())
    try:
        replica.check_health()
        release, entered = threading.Event(), threading.Event()

        def block(_: Any) -> None:
            if threading.current_thread().name == "modelpool-dispatcher":
                entered.set()
                release.wait(30)

        replica.pool.submit("tokens:3:0.1").add_done_callback(block)
        assert entered.wait(10)
        try:

            def unhealthy() -> str | None:
                try:
                    replica.check_health()
                except RuntimeError as exc:
                    return str(exc)
                return None

            reason = wait_for(unhealthy, bool, 5, "check_health to fail")
            assert "wedged" in reason
        finally:
            release.set()
        wait_for(lambda: replica.pool.health().alive, bool, 5, "the pool to recover")
        replica.check_health()
    finally:
        import asyncio

        asyncio.run(replica.drain())  # what Ray's __del__ calls on a graceful stop
    assert not replica.pool.health().alive
    with pytest.raises(RuntimeError, match="closed"):
        replica.check_health()


def test_a_graceful_stop_finishes_the_request_in_flight_then_drains(proxy_url: str) -> None:
    """Last in this module: it deletes the application."""
    import threading

    workers = {w["pid"] for w in stats(proxy_url)["workers"]}
    answers: list[httpx.Response] = []
    # 1.5 s of tokens, well within the 3 s request timeout.
    request = threading.Thread(
        target=lambda: answers.append(complete(proxy_url, "tokens:30:0.05", timeout=30))
    )
    request.start()
    wait_for(
        lambda: stats(proxy_url),
        lambda s: [w["state"] for w in s["workers"]] == ["busy"],
        5,
        "the request to run",
    )
    serve.delete("modelpool")
    request.join(30)
    assert answers and answers[0].status_code == 200, answers
    assert answers[0].json()["choices"][0]["text"].split()[-1] == "t29"
    wait_pids_gone(workers, timeout=10)


def test_app_builder_reads_a_daemon_config(tmp_path: Any) -> None:
    """``serve run modelpool.ray_serve:app_builder config=PATH num_replicas=N``."""
    from ray.serve import Application

    from modelpool.ray_serve import app_builder

    config = tmp_path / "modelpool.toml"
    config.write_text('model = "none"\nbackend = "testing"\n[server]\ndrain_timeout_s = 3.0\n')
    assert isinstance(app_builder({"config": str(config), "num_replicas": "2"}), Application)
    as_dict = {"model": "none", "backend": "testing", "server": {"drain_timeout_s": 3.0}}
    assert isinstance(build_app(as_dict, num_replicas=1), Application)
    with pytest.raises(ValueError, match="config=PATH"):
        app_builder({})
    with pytest.raises(ValueError, match="unknown argument 'replicas'"):
        app_builder({"config": str(config), "replicas": "2"})
