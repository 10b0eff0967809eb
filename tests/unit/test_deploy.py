"""deploy/: the Kubernetes manifests are valid and agree with the config the image runs.

There is no cluster here (and ``kubectl --dry-run=client`` still asks a server for
its API list), so the manifests are checked offline against the Kubernetes OpenAPI
schemas that the pinned ``kubernetes-validate`` ships, in strict mode (an unknown
field, e.g. a misspelt probe setting, is an error). Then the numbers: probe paths
and port, the startup budget and the termination grace arithmetic are recomputed
from the TOML config that deploy/Dockerfile copies into the image.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from modelpool.shared.config import PoolConfig, ServerConfig

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
KUBERNETES_VERSION = "1.32"
# The manifest and the config its image is built with (deploy/Dockerfile's header).
VARIANTS = {
    "modelpool.yaml": ("modelpool-cpu.toml", "cpu"),
    "modelpool-gpu.yaml": ("modelpool-gpu.toml", "cuda"),
}
# modelpool.cli.daemon closes the pool with timeout=5.0 after uvicorn's drain.
POOL_CLOSE_TIMEOUT_S = 5.0
# The promise: with the default heartbeat bound, a wedge ends in a restart
# within 30 s.
WEDGE_RESTART_BOUND_S = 30.0


def documents(name: str) -> dict[str, dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all((DEPLOY / "kubernetes" / name).read_text()) if d]
    return {doc["kind"]: doc for doc in docs}


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    result: dict[str, Any] = containers[0]
    return result


def test_every_manifest_file_is_covered() -> None:
    assert {p.name for p in (DEPLOY / "kubernetes").glob("*.yaml")} == set(VARIANTS)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_manifests_validate_against_the_kubernetes_schema(name: str) -> None:
    docs = documents(name)
    assert set(docs) == {"Deployment", "Service", "PodDisruptionBudget"}
    for doc in docs.values():
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_schema_check_catches_a_misspelt_field() -> None:
    deployment = documents("modelpool.yaml")["Deployment"]
    container(deployment)["livenessProbe"]["periodSecond"] = 5
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_manifest_agrees_with_the_image_config(name: str) -> None:
    config_name, device = VARIANTS[name]
    pool = PoolConfig.from_toml(DEPLOY / config_name)
    server = ServerConfig.from_toml(DEPLOY / config_name)
    docs = documents(name)
    deployment = docs["Deployment"]
    pod = deployment["spec"]["template"]
    spec = pod["spec"]
    main = container(deployment)

    assert pool.devices == (device,)
    assert server.host == "0.0.0.0", "a pod must listen beyond loopback"
    ports = {p["name"]: p["containerPort"] for p in main["ports"]}
    assert ports == {"http": server.port}

    probes = {kind: main[kind] for kind in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert probes["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert probes["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert probes["startupProbe"]["httpGet"]["path"] in ("/healthz", "/readyz")
    for probe in probes.values():
        assert probe["httpGet"]["port"] in ("http", server.port)

    startup = probes["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= pool.startup_timeout_s
    liveness = probes["livenessProbe"]
    assert (
        pool.heartbeat_timeout_s + liveness["periodSeconds"] * liveness["failureThreshold"]
        <= WEDGE_RESTART_BOUND_S - liveness["periodSeconds"]
    )
    # A probe that gives up before the server's own lag bound would restart a pod
    # that /healthz still calls alive.
    assert liveness["timeoutSeconds"] >= server.max_event_loop_lag_s

    pre_stop = main["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    pre_stop_s = float(pre_stop[1])
    shutdown_s = (
        pre_stop_s
        + server.drain_timeout_s
        + pool.cancel_grace_s
        + pool.term_grace_s
        + pool.gpu_release_timeout_s
    )
    grace = spec["terminationGracePeriodSeconds"]
    assert grace >= shutdown_s + POOL_CLOSE_TIMEOUT_S
    text = (DEPLOY / "kubernetes" / name).read_text()
    total = re.search(r"^\s*#\s*= (\d+) s", text, re.MULTILINE)
    assert total is not None, "the grace arithmetic comment is missing"
    assert float(total.group(1)) == shutdown_s, "the comment's sum is stale"

    env = {e["name"]: e for e in main["env"]}
    assert server.api_key_env in env
    assert env[server.api_key_env]["valueFrom"]["secretKeyRef"]["name"]

    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(server.port)
    assert annotations["prometheus.io/path"] == "/metrics"

    labels = pod["metadata"]["labels"]
    for selector in (
        deployment["spec"]["selector"]["matchLabels"],
        docs["Service"]["spec"]["selector"],
        docs["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"],
    ):
        assert selector.items() <= labels.items()
    assert docs["Service"]["spec"]["ports"][0]["targetPort"] in ("http", server.port)

    limits = main["resources"]["limits"]
    if device == "cuda":
        assert limits["nvidia.com/gpu"] == 1
        assert main["resources"]["requests"]["nvidia.com/gpu"] == 1
    else:
        assert "nvidia.com/gpu" not in limits


def test_dockerfile_runs_the_config_the_manifests_are_checked_against() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    default = re.search(r"^ARG MODELPOOL_CONFIG=(\S+)$", text, re.MULTILINE)
    assert default is not None and default.group(1) == "deploy/modelpool-cpu.toml"
    assert "--build-arg MODELPOOL_CONFIG=deploy/modelpool-gpu.toml" in text
    copied = re.search(r"^COPY \$\{MODELPOOL_CONFIG\} (\S+)$", text, re.MULTILINE)
    assert copied is not None
    assert f'"--config", "{copied.group(1)}"' in text
    server = ServerConfig.from_toml(DEPLOY / "modelpool-cpu.toml")
    assert re.search(rf"^EXPOSE {server.port}$", text, re.MULTILINE)
    ignored = (DEPLOY / "Dockerfile.dockerignore").read_text()
    for config_name, _ in VARIANTS.values():
        assert f"!deploy/{config_name}" in ignored
