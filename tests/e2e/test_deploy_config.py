"""The config the container image runs (deploy/modelpool-cpu.toml), served for real on
loopback: the probe paths the manifests use answer without a key, everything else
needs the key the Secret provides, and SIGTERM ends within the manifest's
terminationGracePeriodSeconds.
"""

from __future__ import annotations

import signal
import time

import httpx
import pytest
from e2e_support import REPO, prepare_embedded_model, start_daemon

yaml = pytest.importorskip("yaml")

pytestmark = pytest.mark.slow

KEY = "test-key-from-the-secret"


def termination_grace_s() -> float:
    manifest = REPO / "deploy" / "kubernetes" / "modelpool.yaml"
    for doc in yaml.safe_load_all(manifest.read_text()):
        if doc and doc["kind"] == "Deployment":
            return float(doc["spec"]["template"]["spec"]["terminationGracePeriodSeconds"])
    raise AssertionError("no Deployment in the manifest")


def test_the_image_config_serves_probes_and_stops_within_the_grace(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    prepare_embedded_model()

    daemon = start_daemon(
        tmp_path_factory.mktemp("image-config"),
        None,
        # The image listens on 0.0.0.0 inside its pod; here loopback stands in for it.
        args=("--host", "127.0.0.1"),
        config_path=REPO / "deploy" / "modelpool-cpu.toml",
        env={"MODELPOOL_API_KEY": KEY},
        ready_timeout=600.0,
    )
    try:
        assert daemon.get("/healthz").json()["status"] == "ok"
        assert daemon.get("/readyz").status_code == 200
        assert daemon.get("/metrics").status_code == 401
        metrics = daemon.get("/metrics", headers={"Authorization": f"Bearer {KEY}"})
        assert metrics.status_code == 200
        assert "modelpool_heartbeat_age_seconds" in metrics.text
        reply = httpx.post(
            daemon.url + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4},
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=120,
        )
        assert reply.status_code == 200, reply.text
    finally:
        started = time.monotonic()
        code = daemon.stop(signal.SIGTERM, timeout=termination_grace_s())
        stopped_s = time.monotonic() - started
    assert code == 0, daemon.log()[-4000:]
    assert stopped_s < termination_grace_s()
