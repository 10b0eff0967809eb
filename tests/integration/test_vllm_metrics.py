"""The ``vllm:`` names in /metrics: the same figures as modelpool's own, labelled
``model_name``, and gone with ``[server] vllm_metrics = false`` (docs, Metrics)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from helpers import make_config, open_pool
from modelpool.server import create_app
from modelpool.shared.config import ModelSpec, ServerConfig
from modelpool.supervisor.registry import ModelRegistry, RegistryConfig

LOOPBACK = "http://127.0.0.1"


def _values(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_vllm_names_carry_the_pools_figures() -> None:
    with open_pool(workers=1) as pool:
        client = TestClient(create_app(pool, ServerConfig(), "tiny"), base_url=LOOPBACK)
        for _ in range(2):
            answer = client.post("/v1/completions", json={"prompt": "tokens:5", "max_tokens": 4})
            assert answer.status_code == 200
        values = _values(client.get("/metrics").text)
        model = (("model_name", "tiny"),)
        length = (("finished_reason", "length"), *model)
        usage = answer.json()["usage"]
        assert values[("vllm:request_success_total", length)] == 2
        assert values[("vllm:generation_tokens_total", model)] == 2 * usage["completion_tokens"]
        assert values[("vllm:prompt_tokens_total", model)] == 2 * (usage["prompt_tokens"] or 0)
        assert values[("vllm:e2e_request_latency_seconds_count", model)] == 2
        assert values[("vllm:request_max_num_generation_tokens_sum", model)] == 8
        assert values[("vllm:num_requests_running", model)] == 0
        completed = values[("modelpool_requests_total", (("outcome", "completed"),))]
        assert completed == 2


def test_vllm_metrics_false_leaves_them_out() -> None:
    with open_pool(workers=1) as pool:
        app = create_app(pool, ServerConfig(vllm_metrics=False), "tiny")
        client = TestClient(app, base_url=LOOPBACK)
        assert client.post("/v1/completions", json={"prompt": "echo:x"}).status_code == 200
        text = client.get("/metrics").text
        assert "modelpool_requests_total" in text and "vllm:" not in text


def test_each_model_of_a_registry_has_its_own_model_name_series() -> None:
    specs = tuple(ModelSpec(name, make_config(workers=1)) for name in ("chat", "coder"))
    registry = ModelRegistry(RegistryConfig(models=specs)).start()
    try:
        client = TestClient(create_app(registry, ServerConfig()), base_url=LOOPBACK)
        for name in ("chat", "coder", "coder"):
            body = {"model": name, "prompt": "echo:x"}
            assert client.post("/v1/completions", json=body).status_code == 200
        values = _values(client.get("/metrics").text)
        for name, count in (("chat", 1), ("coder", 2)):
            model = (("model_name", name),)
            assert values[("vllm:e2e_request_latency_seconds_count", model)] == count
            assert values[("vllm:num_requests_running", model)] == 0
    finally:
        registry.close(timeout=5.0)


def test_lora_requests_info_names_the_adapters_with_requests_in_flight() -> None:
    from modelpool.server.lora import lora_table
    from modelpool.shared.lora import AdapterSpec

    config = make_config(workers=1, backend_options={"max_loras": 3})
    adapters = tuple(AdapterSpec(name, "chat", f"/adapters/{name}") for name in ("sql", "poet"))
    registry = ModelRegistry(
        RegistryConfig(models=(ModelSpec("chat", config),), adapters=adapters)
    ).start()
    try:
        client = TestClient(create_app(registry, ServerConfig()), base_url=LOOPBACK)

        def info() -> list[dict[str, str]]:
            return [
                sample.labels
                for family in text_string_to_metric_families(client.get("/metrics").text)
                for sample in family.samples
                if sample.name == "vllm:lora_requests_info"
            ]

        idle = {"model_name": "chat", "max_lora": "3", "waiting_lora_adapters": ""}
        assert info() == [{**idle, "running_lora_adapters": ""}]
        table = lora_table(registry)
        uses = [table.started("sql"), table.started("poet"), table.started("sql")]
        assert info() == [{**idle, "running_lora_adapters": "poet,sql"}]
        uses[1].release()
        uses[0].release()
        assert info() == [{**idle, "running_lora_adapters": "sql"}]
    finally:
        registry.close(timeout=5.0)
