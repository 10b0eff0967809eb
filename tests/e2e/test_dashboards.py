"""Dashboards against a real daemon's /metrics: every series vLLM's reference Grafana
dashboard queries exists under its ``vllm:`` name with a ``model_name`` label (the list
of names is ``tests/fixtures/vllm_grafana_metrics.txt``), and every query of modelpool's
own dashboards (``deploy/grafana/``) names a metric the daemon exports: the supervision
one against a daemon of one model, the models one against the app of a registry."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from helpers import make_config
from modelpool.server import create_app
from modelpool.shared.config import ModelSpec, ServerConfig
from modelpool.supervisor.registry import ModelRegistry, RegistryConfig

ROOT = Path(__file__).resolve().parents[2]
VLLM_NAMES = ROOT / "tests" / "fixtures" / "vllm_grafana_metrics.txt"
SUPERVISION = ROOT / "deploy" / "grafana" / "modelpool-supervision.json"
MODELS = ROOT / "deploy" / "grafana" / "modelpool-models.json"
# A PromQL identifier; functions, keywords and label names are told apart below.
IDENTIFIER = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
LABELS = {"reason", "result", "state", "outcome", "model"}
PROMQL_WORDS = {
    "sum", "by", "rate", "increase", "histogram_quantile", "le", "without", "avg", "max",
    "min", "count", "irate", "delta", "on", "ignoring", "group_left", "group_right",
}  # fmt: skip


def _samples(http: httpx.Client) -> dict[str, list[dict[str, str]]]:
    """Sample name -> the label sets it was exported with, after one request."""
    found: dict[str, list[dict[str, str]]] = {}
    for family in _families(http):
        for sample in family.samples:
            found.setdefault(sample.name, []).append(dict(sample.labels))
    return found


def _families(http: httpx.Client) -> list[Metric]:
    assert http.post("/v1/completions", json={"prompt": "tokens:3", "max_tokens": 3}).is_success
    return list(text_string_to_metric_families(http.get("/metrics").text))


def _exported_names(families: list[Metric]) -> set[str]:
    """Every series name the families declare, with or without samples yet (a counter of
    kills has none before the first kill; its series name is still fixed)."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
    names: set[str] = set()
    for family in families:
        names.add(family.name)
        names.update(family.name + suffix for suffix in suffixes.get(family.type, ()))
    return names


def test_every_series_vllms_dashboard_queries_is_exported_with_model_name(
    http: httpx.Client,
) -> None:
    names = [
        line.strip()
        for line in VLLM_NAMES.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert len(names) >= 20
    samples = _samples(http)
    model = http.get("/v1/models").json()["data"][0]["id"]
    missing = [name for name in names if name not in samples]
    assert not missing, missing
    for name in names:
        assert any(labels.get("model_name") == model for labels in samples[name]), name
    reasons = {labels["finished_reason"] for labels in samples["vllm:request_success_total"]}
    assert reasons & {"stop", "length"}


def _queried(path: Path) -> set[str]:
    """The metric names ``path``'s panels query."""
    queried: set[str] = set()
    for panel in json.loads(path.read_text())["panels"]:
        for target in panel["targets"]:
            expr = re.sub(r"\[[^]]*\]|\"[^\"]*\"|\{[^}]*\}", "", target["expr"])
            words = {w for w in IDENTIFIER.findall(expr) if not w.startswith("$")}
            metrics = words - PROMQL_WORDS - LABELS
            assert metrics, f"{path.name}: {panel['title']} queries no metric"
            queried |= metrics
    return queried


def test_every_query_of_our_dashboard_names_an_exported_metric(http: httpx.Client) -> None:
    queried = _queried(SUPERVISION)
    unknown = sorted(queried - _exported_names(_families(http)))
    assert not unknown, unknown
    for needed in ("modelpool_worker_kills_total", "modelpool_gpu_releases_total"):
        assert needed in queried, f"the dashboard shows {needed}"


def test_every_query_of_the_models_dashboard_names_a_metric_a_registry_exports() -> None:
    specs = tuple(ModelSpec(name, make_config(workers=1)) for name in ("chat", "coder"))
    registry = ModelRegistry(RegistryConfig(models=specs)).start()
    try:
        app = create_app(registry, ServerConfig())
        with TestClient(app, base_url="http://127.0.0.1") as client:
            assert client.post("/v1/completions", json={"model": "chat", "prompt": "x"}).is_success
            text = client.get("/metrics").text
    finally:
        registry.close(timeout=5.0)
    queried = _queried(MODELS)
    unknown = sorted(queried - _exported_names(list(text_string_to_metric_families(text))))
    assert not unknown, unknown
    assert "modelpool_model_swaps_total" in queried
