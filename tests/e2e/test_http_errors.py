"""Bad input gets a clear 4xx, failures get their DESIGN status code, never a dead worker."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from e2e_support import Daemon

from helpers import slack

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
JSON = {"Content-Type": "application/json"}


def _error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error: dict[str, Any] = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert "type" in error and "code" in error
    return error


def test_malformed_json_is_400(http: httpx.Client) -> None:
    for raw in (b"{bad", b"", b"\xff\xfe\x00", b"[1, 2]", b'{"prompt": NaN}', b"[" * 60_000):
        error = _error(http.post(COMPLETIONS, content=raw, headers=JSON), 400)
        assert error["code"] == "invalid_json"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (COMPLETIONS, {"prompt": 5}, "prompt"),
        (COMPLETIONS, {}, "prompt"),
        (COMPLETIONS, {"prompt": "x", "max_tokens": "5"}, "max_tokens"),
        (COMPLETIONS, {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        (COMPLETIONS, {"prompt": "x", "temperature": "hot"}, "temperature"),
        (COMPLETIONS, {"prompt": "x", "top_p": 2}, "top_p"),
        (COMPLETIONS, {"prompt": "x", "stream": "yes"}, "stream"),
        (COMPLETIONS, {"prompt": "x", "stop": [1]}, "stop"),
        (COMPLETIONS, {"prompt": "x", "seed": 1.5}, "seed"),
        (COMPLETIONS, {"prompt": "x", "timeout": -1}, "timeout"),
        (COMPLETIONS, {"prompt": "x", "model": 3}, "model"),
        (COMPLETIONS, {"prompt": ["a", 1]}, "prompt"),
        (COMPLETIONS, {"prompt": [1, -2, 3]}, "prompt"),
        (CHAT, {"messages": "hello"}, "messages"),
        (CHAT, {"messages": []}, "messages"),
        (CHAT, {"messages": [{"role": "user"}]}, "messages[0].content"),
        (CHAT, {"messages": [{"role": 1, "content": "x"}]}, "messages[0].role"),
        (CHAT, {"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
        (
            CHAT,
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content[0]",
        ),
    ],
)
def test_wrong_types_are_400_naming_the_field(
    http: httpx.Client, path: str, body: dict[str, Any], param: str
) -> None:
    error = _error(http.post(path, json=body), 400)
    assert error["param"] == param
    assert param.split("[")[0].split(".")[0] in error["message"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 0),
        ("logprobs", "yes"),
        ("top_logprobs", 3),  # without logprobs: true
        ("top_logprobs", 21),
        ("tools", [{"type": "function", "function": {"name": "f"}}]),
        ("tool_choice", "auto"),
        (
            "response_format",
            {"type": "json_schema", "json_schema": {"schema": {"properties": {"a": {"not": {}}}}}},
        ),
        ("response_format", {"type": "xml"}),
        ("presence_penalty", 0.5),
        ("logit_bias", {"50256": -100}),
        ("stream_options", {"include_obfuscation": True}),
        ("no_such_field", 1),
    ],
)
def test_fields_that_cannot_be_honoured_are_400(http: httpx.Client, field: str, value: Any) -> None:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "echo:x"}], field: value}
    if field == "stream_options":
        body["stream"] = True
    error = _error(http.post(CHAT, json=body), 400)
    assert error["param"].startswith(field)
    assert field in error["message"]


def test_completion_only_fields_are_400(http: httpx.Client) -> None:
    for field, value in (("echo", 1), ("best_of", 0), ("suffix", "end"), ("logprobs", 21)):
        error = _error(http.post(COMPLETIONS, json={"prompt": "x", field: value}), 400)
        assert error["param"] == field


def test_body_too_large_is_413(http: httpx.Client) -> None:
    big = {"prompt": "echo:" + "x" * 70_000}
    error = _error(http.post(COMPLETIONS, json=big), 413)
    assert error["code"] == "request_too_large"

    def chunked() -> Iterator[bytes]:  # No Content-Length: the limit applies while reading.
        yield b'{"prompt": "echo:'
        for _ in range(20):
            yield b"x" * 8192
        yield b'"}'

    _error(http.post(COMPLETIONS, content=chunked(), headers=JSON), 413)
    assert http.post(COMPLETIONS, json={"prompt": "echo:still fine"}).status_code == 200


def test_unknown_route_is_404_json(http: httpx.Client) -> None:
    assert _error(http.get("/v1/nope"), 404)["code"] == "not_found"
    assert _error(http.get("/v1/models/other-model"), 404)["param"] == "model"


def test_wrong_method_is_405_json(http: httpx.Client) -> None:
    response = http.get(COMPLETIONS)
    assert _error(response, 405)["code"] == "method_not_allowed"
    assert "POST" in response.headers["allow"]


def test_hung_request_is_504_within_its_deadline(http: httpx.Client, daemon: Daemon) -> None:
    daemon.wait_settled(2)
    started = time.monotonic()
    response = http.post(COMPLETIONS, json={"prompt": "hang", "timeout": 1})
    elapsed = time.monotonic() - started
    error = _error(response, 504)
    assert error["code"] == "deadline_exceeded"
    assert error["attempts"][0]["outcome"] == "timeout"
    assert 0.9 <= elapsed < slack(2.0), elapsed

    started = time.monotonic()
    response = http.post(
        CHAT,
        json={"messages": [{"role": "user", "content": "hang"}]},
        headers={"X-Request-Timeout": "0.5"},
    )
    assert _error(response, 504)["code"] == "deadline_exceeded"
    assert 0.45 <= time.monotonic() - started < slack(1.5)


def test_crashed_worker_is_502(http: httpx.Client, daemon: Daemon) -> None:
    daemon.wait_settled(2)
    crashes = daemon.stats()["counters"]["crashes"]
    error = _error(http.post(COMPLETIONS, json={"prompt": "segfault"}), 502)
    assert error["code"] == "worker_crashed"
    assert "SIGSEGV" in error["message"]
    assert daemon.stats()["counters"]["crashes"] == crashes + 1


def test_backend_exception_is_500_backend_error(http: httpx.Client) -> None:
    error = _error(http.post(COMPLETIONS, json={"prompt": "raise:boom"}), 500)
    assert error["type"] == "backend_error"
    assert "boom" in error["message"]


def test_cuda_out_of_memory_is_507_with_the_device_and_bytes(http: httpx.Client) -> None:
    # The daemon of this module retries nothing: one attempt, on a CPU worker (rehearsal).
    error = _error(http.post(COMPLETIONS, json={"prompt": f"cuda_oom:{2**30}"}), 507)
    assert error["type"] == "insufficient_memory_error"
    assert error["code"] == "out_of_memory"
    assert error["bytes_requested"] == 2**30
    assert error["device"] == "cuda:0"
    assert [a["outcome"] for a in error["attempts"]] == ["oom"]


def test_sticky_cuda_error_is_502_and_the_worker_is_replaced(
    http: httpx.Client, daemon: Daemon
) -> None:
    before = daemon.wait_settled(2)
    error = _error(http.post(COMPLETIONS, json={"prompt": "cuda_sticky"}), 502)
    assert error["code"] == "cuda_error"
    assert "illegal memory access" in error["message"]
    after = daemon.wait_settled(2)
    assert after["counters"]["cuda_errors"] == before["counters"]["cuda_errors"] + 1
    assert after["kill_reasons"].get("cuda_error", 0) >= 1
    poisoned = error["attempts"][0]["worker_pid"]
    assert poisoned not in {w["pid"] for w in after["workers"]}


def test_rejected_requests_kill_no_worker(http: httpx.Client, daemon: Daemon) -> None:
    before = daemon.wait_settled(2)
    for body in ({"prompt": 1}, {"prompt": "x", "n": 0}, {"prompt": "x", "max_tokens": -1}):
        http.post(COMPLETIONS, json=body)
    http.post(COMPLETIONS, content=b"{", headers=JSON)
    after = daemon.stats()
    assert {w["pid"] for w in after["workers"]} == {w["pid"] for w in before["workers"]}
    assert after["counters"]["kills"] == before["counters"]["kills"]
    assert after["counters"]["submitted"] == before["counters"]["submitted"]
