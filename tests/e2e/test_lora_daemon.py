"""LoRA adapters through the daemon: ``[models.NAME]`` with ``base`` and ``adapter``,
listed by ``/v1/models`` with their ``parent``; the openai client with ``model=ADAPTER``
gets PEFT's own greedy answer with that adapter, alone and among concurrent requests of
other adapters and of the base (one pool, one copy of the weights); a bad adapter is a 400
naming it, one whose read hangs a 503 within ``lora_check_timeout_s``, while the others
answer; vLLM's load and unload routes, limited to ``lora_dirs`` and behind the key, and an
unload that waits for its adapter's running request.

docs/lora.md; the in-process side is tests/integration/test_lora.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from e2e_support import Daemon, keyed_daemon, keyed_http, registry_config
from prometheus_client.parser import text_string_to_metric_families

from lora_adapters import broken_adapter, make_adapter, peft_answers
from modelpool.tinymodel import build_tiny_model

pytestmark = pytest.mark.slow

KEY = "test-lora-key"
NEW_TOKENS = 10
PROMPTS = [[1, 72, 101, 108, 108, 111], [1, 300, 200, 100, 50, 25, 12], [1, 40, 41, 42]]
FAULTS = ("truncated", "corrupt", "shape", "target", "rank")


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    base = build_tiny_model(root / "tiny")
    served = root / "served"
    found = {"base": base, "served": served, "outside": root / "outside"}
    for index, name in enumerate(("sql", "poet", "late")):
        found[name] = make_adapter(base, served / name, seed=index)
    found["outside"] = make_adapter(base, root / "outside", seed=9)
    for fault in (*FAULTS, "hang"):
        found[fault] = broken_adapter(found["sql"], root / "bad" / fault, fault)
    return found


@pytest.fixture(scope="module")
def expected(files: dict[str, Path]) -> dict[str, list[str]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(files["base"]))
    answers = {}
    for name in ("base", "sql", "poet", "late"):
        adapter = None if name == "base" else files[name]
        tokens = peft_answers(files["base"], adapter, PROMPTS, NEW_TOKENS)
        answers[name] = [tokenizer.decode(t, skip_special_tokens=True) for t in tokens]
    return answers


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, files: dict[str, Path]) -> Iterator[Daemon]:
    models: dict[str, dict[str, Any]] = {
        "tiny": {
            "model": str(files["base"]),
            "backend": "hf",
            "max_batch_size": 8,
            "deadline_s": 60.0,
            "backend_options": {"dtype": "float32", "torch_threads": 1, "max_loras": 2},
        },
        "sql": {"base": "tiny", "adapter": str(files["sql"])},
        "poet": {"base": "tiny", "adapter": str(files["poet"])},
    }
    for fault in (*FAULTS, "hang"):
        models[f"bad-{fault}"] = {"base": "tiny", "adapter": str(files[fault])}
    server = {"lora_dirs": [str(files["served"])], "lora_check_timeout_s": 3.0}
    config = registry_config(models, workers=1, server=server)
    yield from keyed_daemon(tmp_path_factory.mktemp("daemon"), config, KEY)


@pytest.fixture()
def http(daemon: Daemon) -> Iterator[httpx.Client]:
    with keyed_http(daemon, KEY, timeout=60.0) as client:
        yield client


@pytest.fixture()
def client(daemon: Daemon) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=daemon.url + "/v1", api_key=KEY, max_retries=0, timeout=60.0
    ) as client:
        yield client


def complete(client: openai.OpenAI, model: str, prompt: list[int]) -> str:
    answer = client.completions.create(
        model=model, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0
    )
    return answer.choices[0].text


def test_models_lists_each_adapter_with_its_parent(http: httpx.Client) -> None:
    cards = {card["id"]: card for card in http.get("/v1/models").json()["data"]}
    assert cards["sql"]["parent"] == "tiny"
    assert cards["poet"]["parent"] == "tiny"
    assert "parent" not in cards["tiny"]
    assert http.get("/v1/models/sql").json()["parent"] == "tiny"


def test_each_adapter_answers_as_peft_alone_and_mixed(
    client: openai.OpenAI, expected: dict[str, list[str]]
) -> None:
    names = {"base": "tiny", "sql": "sql", "poet": "poet"}
    for key, model in names.items():
        assert complete(client, model, PROMPTS[0]) == expected[key][0], model
    jobs = [(key, index) for index in range(len(PROMPTS)) for key in names] * 2
    with ThreadPoolExecutor(len(jobs)) as threads:
        answers = list(
            threads.map(lambda job: complete(client, names[job[0]], PROMPTS[job[1]]), jobs)
        )
    for (key, index), answer in zip(jobs, answers, strict=True):
        assert answer == expected[key][index], (key, index)


def test_metrics_count_an_adapters_requests_by_lora_name(
    http: httpx.Client, client: openai.OpenAI
) -> None:
    complete(client, "poet", PROMPTS[2])
    text = http.get("/metrics").text
    counts = [
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "modelpool_lora_request_duration_seconds_count"
        and sample.labels == {"model_name": "tiny", "lora_name": "poet"}
    ]
    assert counts and counts[0] >= 1, text[-2000:]


def test_the_chat_route_takes_an_adapter(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": "Hello"}]
    base = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=NEW_TOKENS, temperature=0
    )
    adapted = client.chat.completions.create(
        model="sql", messages=messages, max_tokens=NEW_TOKENS, temperature=0
    )
    assert adapted.model == "sql"
    assert adapted.choices[0].message.content != base.choices[0].message.content


@pytest.mark.parametrize("fault", FAULTS)
def test_a_bad_adapter_is_a_400_naming_it_while_the_others_answer(
    client: openai.OpenAI, expected: dict[str, list[str]], fault: str
) -> None:
    with ThreadPoolExecutor(2) as threads:
        good = threads.submit(complete, client, "poet", PROMPTS[1])
        with pytest.raises(openai.BadRequestError, match=f"LoRA adapter 'bad-{fault}'"):
            complete(client, f"bad-{fault}", PROMPTS[0])
        assert good.result() == expected["poet"][1]


def test_an_adapter_whose_read_hangs_is_a_503_within_its_bound(
    client: openai.OpenAI, expected: dict[str, list[str]]
) -> None:
    started = time.monotonic()
    with pytest.raises(openai.InternalServerError) as raised:
        complete(client, "bad-hang", PROMPTS[0])
    assert raised.value.status_code == 503
    assert "bad-hang" in str(raised.value)
    assert time.monotonic() - started < 30.0
    assert complete(client, "sql", PROMPTS[0]) == expected["sql"][0]


def test_load_and_unload_at_run_time(
    daemon: Daemon,
    http: httpx.Client,
    client: openai.OpenAI,
    files: dict[str, Path],
    expected: dict[str, list[str]],
) -> None:
    body = {"lora_name": "late", "lora_path": str(files["late"]), "base_model_name": "tiny"}
    anonymous = httpx.post(daemon.url + "/v1/load_lora_adapter", json=body, timeout=30.0)
    assert anonymous.status_code == 401
    outside = {**body, "lora_path": str(files["outside"])}
    refused = http.post("/v1/load_lora_adapter", json=outside)
    assert refused.status_code == 400 and "lora_dirs" in refused.text
    escaping = {**body, "lora_path": str(files["served"] / ".." / "outside")}
    assert http.post("/v1/load_lora_adapter", json=escaping).status_code == 400
    with pytest.raises(openai.NotFoundError):
        complete(client, "late", PROMPTS[0])
    loaded = http.post("/v1/load_lora_adapter", json=body)
    assert loaded.status_code == 200, loaded.text
    assert http.post("/v1/load_lora_adapter", json=body).status_code == 400  # the name is taken
    for index, prompt in enumerate(PROMPTS):
        assert complete(client, "late", prompt) == expected["late"][index]
    assert {card["id"] for card in http.get("/v1/models").json()["data"]} >= {"late", "sql"}

    # An unload waits for the adapter's running request, which answers whole.
    stream = client.completions.create(
        model="late",
        prompt=PROMPTS[0],
        max_tokens=400,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    first = next(chunks)
    unloaded: list[tuple[float, int]] = []

    def unload() -> None:
        response = http.post("/v1/unload_lora_adapter", json={"lora_name": "late"})
        unloaded.append((time.monotonic(), response.status_code))

    unloading = threading.Thread(target=unload)
    unloading.start()
    # The unload has reached the daemon once the name is gone (new requests get 404);
    # it must not answer while the stream still runs.
    gone_by = time.monotonic() + 30.0
    while "late" in {card["id"] for card in http.get("/v1/models").json()["data"]}:
        assert time.monotonic() < gone_by, "the unload never took the name away"
    answered_while_streaming = bool(unloaded)
    rest = list(chunks)
    unloading.join(timeout=60.0)
    assert unloaded and unloaded[0][1] == 200
    assert not answered_while_streaming, "the unload did not wait for the running request"
    assert rest[-1].choices[0].finish_reason == "length", first
    with pytest.raises(openai.NotFoundError):
        complete(client, "late", PROMPTS[0])
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "late"}).status_code == 404
