"""OpenTelemetry traces from a real daemon to a real OTLP/HTTP receiver (docs, Tracing).

The receiver is a plain HTTP server on 127.0.0.1 that decodes what the exporter sends
(``ExportTraceServiceRequest``, protobuf). A request that hangs on its first worker is
timed out, its worker killed (SIGTERM ignored, then SIGKILL) and its memory release
checked, and it is retried on the other worker: its trace, a child of the caller's
``traceparent``, shows each of those steps.
"""

from __future__ import annotations

import gzip
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_support import daemon_config, start_daemon
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from helpers import slack, wait_until

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


class Receiver(http.server.ThreadingHTTPServer):
    """An OTLP/HTTP traces endpoint that keeps every span it is sent."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.spans: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1/traces"


class _Handler(http.server.BaseHTTPRequestHandler):
    server: Receiver

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        request = ExportTraceServiceRequest.FromString(body)
        spans = [
            {
                "name": span.name,
                "trace_id": span.trace_id.hex(),
                "span_id": span.span_id.hex(),
                "parent": span.parent_span_id.hex(),
                "start": span.start_time_unix_nano,
                "end": span.end_time_unix_nano,
                "attributes": {a.key: _value(a.value) for a in span.attributes},
            }
            for resource in request.resource_spans
            for scope in resource.scope_spans
            for span in scope.spans
        ]
        with self.server.lock:
            self.server.spans.extend(spans)
        answer = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, format: str, *args: Any) -> None:
        return None


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(item) for item in value.array_value.values]
    return getattr(value, kind)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    server = Receiver()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_a_killed_and_retried_request_is_one_trace_under_the_callers_span(
    receiver: Receiver, tmp_path: Path
) -> None:
    config = daemon_config(
        workers=2,
        deadline_s=slack(30),
        attempt_timeout_s=1.0,
        retry={"max_retries": 1},
        server={"otlp_traces_endpoint": receiver.url},
    )
    daemon = start_daemon(tmp_path / "daemon", config)
    try:
        flag = tmp_path / "hung-once"
        response = httpx.post(
            f"{daemon.url}/v1/completions",
            json={"prompt": f"hang_once:{flag}", "priority": 2},
            headers={"traceparent": f"00-{TRACE_ID}-{CALLER_SPAN}-01"},
            timeout=slack(30),
        )
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == "ok"

        def spans_named(name: str) -> list[dict[str, Any]]:
            with receiver.lock:
                return [span for span in receiver.spans if span["name"] == name]

        wait_until(lambda: spans_named("release_check"), timeout=slack(20), message="spans")
        streamed = httpx.post(
            f"{daemon.url}/v1/completions",
            json={"prompt": "tokens:3:0.01", "max_tokens": 3},
            timeout=slack(30),
        )
        assert streamed.status_code == 200
        wait_until(lambda: spans_named("decode"), timeout=slack(20), message="decode span")
    finally:
        assert daemon.stop() == 0, daemon.log()[-4000:]

    with receiver.lock:
        every = list(receiver.spans)
    # Without a traceparent a request starts a trace of its own, with its first token
    # known: prefill and decode under its attempt.
    (own,) = {span["trace_id"] for span in every} - {TRACE_ID}
    names = sorted(span["name"] for span in every if span["trace_id"] == own)
    assert names == sorted(["text_completion none", "queue", "attempt", "prefill", "decode"])
    spans = [span for span in every if span["trace_id"] == TRACE_ID]
    children: dict[str, list[dict[str, Any]]] = {}
    for span in spans:
        children.setdefault(span["parent"], []).append(span)
    (root,) = children[CALLER_SPAN]
    assert root["name"].startswith("text_completion ")
    assert root["attributes"]["modelpool.attempts"] == 2
    assert root["attributes"]["modelpool.priority"] == 2
    assert root["attributes"]["gen_ai.response.finish_reasons"] == ["stop"]
    assert "gen_ai.latency.time_in_queue" in root["attributes"]
    under_root = sorted(children[root["span_id"]], key=lambda span: span["start"])
    assert [span["name"] for span in under_root] == ["queue", "attempt", "retry", "attempt"]
    first, second = under_root[1], under_root[3]
    assert first["attributes"]["modelpool.attempt.outcome"] == "timeout"
    assert second["attributes"]["modelpool.attempt.outcome"] == "ok"
    first_pid = first["attributes"]["modelpool.worker.pid"]
    assert first_pid != second["attributes"]["modelpool.worker.pid"], "retried elsewhere"
    assert under_root[2]["attributes"]["modelpool.retry.after"] == "timeout"
    (kill,) = [span for span in children[first["span_id"]] if span["name"] == "kill"]
    assert kill["attributes"]["modelpool.kill.reason"] == "timeout"
    assert kill["attributes"]["modelpool.worker.pid"] == first_pid
    (release,) = children[kill["span_id"]]
    assert release["name"] == "release_check"
    assert release["attributes"]["modelpool.release.ok"] is True
    assert kill["start"] >= first["start"] and release["end"] == kill["end"]
    for span in spans:
        assert span["end"] >= span["start"], span


def test_embeddings_and_scores_carry_the_callers_traceparent(
    receiver: Receiver, tmp_path: Path
) -> None:
    # The pooling routes take the generation walk's admission step, traceparent included
    # (docs/architecture.md, "The daemon's walk"): each pool request is a child of the
    # caller's span, whatever route sent it.
    config = daemon_config(
        workers=1,
        deadline_s=slack(30),
        backend_options={"task": "embed"},
        server={"otlp_traces_endpoint": receiver.url},
    )
    daemon = start_daemon(tmp_path / "daemon", config)
    scores_trace = "5c0b7e3a9d1f4e2b8a6c4d2e0f1a3b5c"
    try:
        embedded = httpx.post(
            f"{daemon.url}/v1/embeddings",
            json={"input": ["first", "second"]},
            headers={"traceparent": f"00-{TRACE_ID}-{CALLER_SPAN}-01"},
            timeout=slack(30),
        )
        assert embedded.status_code == 200, embedded.text
        scored = httpx.post(
            f"{daemon.url}/v1/score",
            json={"text_1": "query", "text_2": ["a", "b"]},
            headers={"traceparent": f"00-{scores_trace}-{CALLER_SPAN}-01"},
            timeout=slack(30),
        )
        assert scored.status_code == 200, scored.text

        def roots() -> dict[str, dict[str, Any]]:
            with receiver.lock:
                return {
                    span["trace_id"]: span
                    for span in receiver.spans
                    if span["parent"] == CALLER_SPAN
                }

        wait_until(
            lambda: {TRACE_ID, scores_trace} <= set(roots()),
            timeout=slack(20),
            message="a span under the caller's, for each request",
        )
    finally:
        assert daemon.stop() == 0, daemon.log()[-4000:]
    for root in roots().values():
        assert root["attributes"]["modelpool.attempts"] == 1
