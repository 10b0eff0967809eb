"""Health, readiness, /stats, /metrics, and the CLI's stats and generate commands."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import httpx
from e2e_support import Daemon, daemon_config, modelpool_command
from prometheus_client.parser import text_string_to_metric_families

from helpers import METRIC_FAMILIES, assert_documented_stats_keys


def test_health_and_readiness(http: httpx.Client) -> None:
    assert http.get("/healthz").json()["status"] == "ok"
    ready = http.get("/readyz")
    assert ready.status_code == 200
    assert ready.json()["ready_workers"] >= 1


def test_stats_is_the_pools_stats_dict(http: httpx.Client) -> None:
    """/stats carries PoolStats.to_dict() over the wire: the same documented keys (their
    values are checked against a pool in test_pool_core), the daemon's fair share and its
    check threads."""
    data = http.get("/stats").json()
    share_keys = {"capacity", "in_pool", "charged_preemptions", "waiting", "clients", "checking"}
    assert set(data.pop("fair_share")) == share_keys
    assert isinstance(data.pop("checks"), dict)
    assert set(data.pop("responses_store")) == {"entries", "bytes", "owners"}
    assert_documented_stats_keys(data)


def test_metrics_parse_and_name_everything(http: httpx.Client) -> None:
    http.post("/v1/completions", json={"prompt": "echo:x"})
    response = http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    assert set(families) >= METRIC_FAMILIES, sorted(families)
    outcomes = {s.labels["outcome"]: s.value for s in families["modelpool_requests"].samples}
    assert set(outcomes) == {"completed", "failed", "cancelled", "overloaded"}
    assert outcomes["completed"] >= 1
    states = {s.labels["state"] for s in families["modelpool_workers"].samples}
    assert {"idle", "busy", "starting", "spare"} <= states
    histogram = families["modelpool_request_duration_seconds"]
    assert histogram.type == "histogram"
    count = [s for s in histogram.samples if s.name.endswith("_count")]
    assert count and count[0].value >= 1


def _cli(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*modelpool_command(), *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def test_cli_stats_table_and_json(daemon: Daemon) -> None:
    pids = daemon.worker_pids()
    table = _cli("stats", "--url", daemon.url)
    assert table.returncode == 0, table.stderr
    assert "counters" in table.stdout and "workers" in table.stdout
    assert any(str(pid) in table.stdout for pid in pids)
    raw = _cli("stats", "--url", daemon.url, "--json")
    assert raw.returncode == 0, raw.stderr
    assert "counters" in json.loads(raw.stdout)


def test_cli_generate_against_the_daemon(daemon: Daemon) -> None:
    result = _cli("generate", "--url", daemon.url, "echo:over http")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == "over http"
    streamed = _cli("generate", "--url", daemon.url, "--stream", "--raw", "tokens:3")
    assert streamed.returncode == 0, streamed.stderr
    assert streamed.stdout.splitlines()[0] == "t0 t1 t2 "
    failed = _cli("generate", "--url", daemon.url, "--timeout", "0.3", "hang")
    assert failed.returncode == 1
    assert "HTTP 504" in failed.stderr


def test_cli_generate_with_a_local_pool(tmp_path: Path) -> None:
    config = tmp_path / "pool.toml"
    config.write_text(daemon_config())
    result = _cli("generate", "--config", str(config), "--workers", "1", "echo:local")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "local"
    assert "latency" in lines[1] and "worker pid" in lines[1]
    assert "counters" in result.stdout
    as_json = _cli("generate", "--config", str(config), "--json", "tokens:2")
    assert as_json.returncode == 0, as_json.stderr
    data = json.loads(as_json.stdout)
    assert data["text"] == "t0 t1 " and data["attempts"] == 1
    assert data["stats"]["counters"]["completed"] == 1
