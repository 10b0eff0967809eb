"""A daemon with [models.NAME] tables: routing by name through the openai client, an
unknown name's 404, /v1/models statuses, the admin load/unload routes behind the key, a
failing model's typed error at once, a request whose deadline passes during its model's
load, keep_alive, per-model stats and metrics with a ``model`` label.

The docs, Many models in one daemon.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from e2e_support import Daemon, keyed_daemon, keyed_http, registry_config
from prometheus_client.parser import text_string_to_metric_families

from helpers import slack, wait_until

KEY = "test-models-key"

MODELS: dict[str, dict[str, Any]] = {
    "chat": {"model": "chat-weights", "preload": True, "pin": True, "aliases": ["gpt-4o-mini"]},
    "coder": {"model": "coder-weights", "workers": 1},
    "slow": {"model": "slow-weights", "workers": 1, "backend_options": {"load_delay_s": 2.0}},
    "broken": {"model": "broken-weights", "workers": 1, "backend_options": {"fail_load": True}},
}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    config = registry_config(MODELS, workers=2, server={"load_backoff_s": 30.0})
    yield from keyed_daemon(tmp_path_factory.mktemp("models"), config, KEY)


@pytest.fixture()
def http(daemon: Daemon) -> Iterator[httpx.Client]:
    with keyed_http(daemon, KEY, timeout=30.0) as client:
        yield client


@pytest.fixture()
def client(daemon: Daemon) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=daemon.url + "/v1", api_key=KEY, max_retries=0, timeout=30.0
    ) as client:
        yield client


def statuses(http: httpx.Client) -> dict[str, dict[str, Any]]:
    response = http.get("/v1/models")
    assert response.status_code == 200, response.text
    return {card["id"]: card for card in response.json()["data"]}


def test_models_list_every_configured_model_with_its_status(http: httpx.Client) -> None:
    cards = statuses(http)
    assert set(cards) == set(MODELS)
    assert cards["chat"]["status"] == "loaded" and cards["chat"]["memory_bytes"] > 0
    assert cards["chat"]["aliases"] == ["gpt-4o-mini"] and cards["chat"]["backend"] == "testing"
    assert cards["coder"]["status"] in ("unloaded", "loaded")
    assert http.get("/v1/models/gpt-4o-mini").json()["id"] == "chat"


def test_requests_are_routed_by_name_and_an_unknown_name_is_404(
    client: openai.OpenAI, http: httpx.Client
) -> None:
    chat = client.chat.completions.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "echo:hi"}]
    )
    assert chat.model == "chat"
    completion = client.completions.create(model="coder", prompt="echo:code")
    assert completion.choices[0].text == "code" and completion.model == "coder"
    assert statuses(http)["coder"]["status"] == "loaded"
    with pytest.raises(openai.NotFoundError) as refused:
        client.completions.create(model="nonexistent", prompt="echo:x")
    error = refused.value.body
    assert isinstance(error, dict) and error["code"] == "model_not_found"
    assert "chat" not in error["message"] and "coder" not in error["message"]
    tokens = http.post("/tokenize", json={"model": "coder", "prompt": "ab"})
    assert tokens.status_code == 200 and tokens.json()["tokens"] == [97, 98]
    assert http.post("/tokenize", json={"model": "nope", "prompt": "ab"}).status_code == 404


def test_a_failing_model_answers_a_typed_error_at_once_and_the_others_serve(
    http: httpx.Client, client: openai.OpenAI
) -> None:
    first = http.post("/v1/completions", json={"model": "broken", "prompt": "echo:x"})
    assert first.status_code == 503, first.text
    assert first.json()["error"]["code"] == "model_unavailable"
    started = time.monotonic()
    again = http.post("/v1/completions", json={"model": "broken", "prompt": "echo:x"})
    assert time.monotonic() - started < slack(1)
    assert again.status_code == 503 and int(again.headers["retry-after"]) > 1
    assert "load failed" in again.json()["error"]["reason"]
    assert statuses(http)["broken"]["status"] == "failed"
    assert statuses(http)["broken"]["reason"]
    answer = client.completions.create(model="chat", prompt="echo:still here")
    assert answer.choices[0].text == "still here"
    assert http.get("/healthz").status_code == 200


def test_a_deadline_that_passes_during_the_load_is_a_504_and_the_load_goes_on(
    http: httpx.Client,
) -> None:
    if statuses(http)["slow"]["status"] == "loaded":
        assert http.post("/models/unload", json={"model": "slow"}).status_code == 200
        wait_until(lambda: statuses(http)["slow"]["status"] == "unloaded", timeout=slack(5))
    late = http.post("/v1/completions", json={"model": "slow", "prompt": "echo:x", "timeout": 0.3})
    assert late.status_code == 504, late.text
    assert late.json()["error"]["code"] == "deadline_exceeded"
    patient = http.post("/v1/completions", json={"model": "slow", "prompt": "echo:waited"})
    assert patient.status_code == 200 and patient.json()["choices"][0]["text"] == "waited"


def test_admin_routes_load_and_unload_behind_the_key(daemon: Daemon, http: httpx.Client) -> None:
    assert httpx.post(daemon.url + "/models/load", json={"model": "coder"}).status_code == 401
    loaded = http.post("/models/load", json={"model": "coder"})
    assert loaded.status_code == 200 and loaded.json()["status"] == "loaded"
    assert http.post("/models/unload", json={"model": "coder"}).status_code == 200
    wait_until(lambda: statuses(http)["coder"]["status"] == "unloaded", timeout=slack(5))
    assert http.post("/models/load", json={"model": "missing"}).status_code == 404
    assert http.post("/models/load", json={"model": "coder", "x": 1}).status_code == 400


def test_keep_alive_zero_unloads_the_model_once_idle(http: httpx.Client) -> None:
    answer = http.post(
        "/v1/chat/completions",
        json={
            "model": "coder",
            "messages": [{"role": "user", "content": "echo:x"}],
            "keep_alive": 0,
        },
    )
    assert answer.status_code == 200, answer.text
    wait_until(lambda: statuses(http)["coder"]["status"] == "unloaded", timeout=slack(5))
    bad = http.post("/v1/completions", json={"model": "coder", "prompt": "x", "keep_alive": "soon"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "keep_alive"


def test_stats_and_metrics_are_per_model(http: httpx.Client) -> None:
    assert (
        http.post("/v1/completions", json={"model": "chat", "prompt": "echo:m"}).status_code == 200
    )
    stats = http.get("/stats").json()
    assert set(stats["models"]) == set(MODELS)
    chat = stats["models"]["chat"]
    assert chat["state"] == "loaded" and chat["loads"] == 1 and chat["pool"]["state"] == "ready"
    assert stats["rss_bytes"] > 0 and stats["peak_rss_bytes"] >= stats["rss_bytes"]
    families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    durations = families["modelpool_request_duration_seconds"].samples
    assert any(s.labels.get("model") == "chat" for s in durations)
    loads = {s.labels["model"]: s.value for s in families["modelpool_model_loads"].samples}
    assert loads["chat"] == 1
    requests = families["modelpool_requests"].samples
    assert {s.labels["model"] for s in requests} >= {"chat"}
    states = families["modelpool_model_state"].samples
    assert any(s.labels == {"model": "broken", "state": "failed"} and s.value == 1 for s in states)
    # chat was preloaded before the daemon added its observers: its requests are in the
    # vllm: series all the same.
    finished = families["vllm:request_success"].samples
    assert any(s.labels.get("model_name") == "chat" and s.value >= 1 for s in finished)


def test_fair_share_is_per_model(daemon: Daemon, http: httpx.Client) -> None:
    # Each model has its own workers, so each has its own share: a run of coder (1 worker)
    # takes coder's one place, not a place counted over every model's workers together.
    assert http.post("/models/load", json={"model": "coder"}).status_code == 200
    with httpx.Client(base_url=daemon.url, timeout=30.0, headers=http.headers) as other:
        body = {"model": "coder", "prompt": "tokens:40:0.05", "stream": True, "max_tokens": 40}
        with other.stream("POST", "/v1/completions", json=body) as streamed:
            assert streamed.status_code == 200
            lines = streamed.iter_lines()
            next(line for line in lines if '"text"' in line)  # its first token: running now
            shares = http.get("/stats").json()["fair_share_by_model"]
            assert shares["coder"]["capacity"] == 1 and shares["coder"]["in_pool"] == 1
            assert shares["chat"]["capacity"] == 2 and shares["chat"]["in_pool"] == 0
            assert set(shares) == set(MODELS)
            for _ in lines:
                pass
    wait_until(
        lambda: http.get("/stats").json()["fair_share_by_model"]["coder"]["in_pool"] == 0,
        message="coder's place back",
    )


def test_a_runtime_pin_behind_the_key_keeps_a_model_from_a_requests_keep_alive(
    daemon: Daemon, http: httpx.Client
) -> None:
    assert httpx.post(daemon.url + "/models/pin", json={"model": "coder"}).status_code == 401
    pinned = http.post("/models/pin", json={"model": "coder"})
    assert pinned.status_code == 200 and pinned.json()["pinned"] is True
    try:
        body = {"model": "coder", "prompt": "echo:x", "keep_alive": 0}
        assert http.post("/v1/completions", json=body).status_code == 200
        assert statuses(http)["coder"]["status"] == "loaded"
        assert http.get("/stats").json()["models"]["coder"]["keep_alive_s"] is None
    finally:
        unpinned = http.post("/models/unpin", json={"model": "coder"})
    assert unpinned.status_code == 200 and unpinned.json()["pinned"] is False


def test_a_request_while_an_unload_waits_for_a_running_one_is_served_after_the_reload(
    daemon: Daemon, http: httpx.Client
) -> None:
    # The review's 500 (AssertionError) with the unload dropped: now the new request waits
    # for the reload and the unload happens.
    assert http.post("/models/load", json={"model": "coder"}).status_code == 200
    unloads = http.get("/stats").json()["models"]["coder"]["unloads"]
    with httpx.Client(base_url=daemon.url, timeout=30.0, headers=http.headers) as other:
        body = {"model": "coder", "prompt": "tokens:20:0.05", "stream": True, "max_tokens": 20}
        with other.stream("POST", "/v1/completions", json=body) as streamed:
            lines = streamed.iter_lines()
            next(line for line in lines if '"text"' in line)  # running now
            unloading = http.post("/models/unload", json={"model": "coder"})
            assert unloading.json()["status"] == "unloading"
            after = http.post("/v1/completions", json={"model": "coder", "prompt": "echo:after"})
            for _ in lines:
                pass
    assert after.status_code == 200, after.text
    assert after.json()["choices"][0]["text"] == "after"
    assert http.get("/stats").json()["models"]["coder"]["unloads"] == unloads + 1
