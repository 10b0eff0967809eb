"""The tracer's sampling, decided once a request is over (``PoolTracer(sample_ratio=)``):
whatever went wrong is traced, the caller's flag decides for its own request, and of the
rest ``sample_ratio`` are; the export requests kept and decoded, records made up."""

from __future__ import annotations

import time
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from modelpool.supervisor.observe import AttemptRecord, RequestRecord
from modelpool.supervisor.tracing import PoolTracer


class FakePool:
    def add_observer(self, **observers: Any) -> None:
        self.observers = observers


def _record(request_id: str, *, retried: bool = False, traceparent: str | None = None) -> Any:
    now = time.monotonic()
    attempts = [AttemptRecord(2, 1, 101, now - 0.2, now, now - 0.1, "ok")]
    if retried:
        attempts.insert(0, AttemptRecord(1, 0, 100, now - 0.3, now - 0.2, None, "timeout"))
    return RequestRecord(
        request_id=request_id,
        priority=0,
        submitted_at=now - 0.3,
        finished_at=now,
        status="completed",
        first_dispatch_at=now - 0.3,
        first_token_at=now - 0.1,
        attempts=attempts,
        finish_reason="stop",
        traceparent=traceparent,
    )


def test_only_what_went_wrong_or_was_asked_for_is_traced_at_ratio_zero() -> None:
    bodies: list[bytes] = []
    pool = FakePool()
    tracer = PoolTracer(
        pool,  # type: ignore[arg-type]
        "http://127.0.0.1:9/v1/traces",
        model_name="m",
        export=bodies.append,
        sample_ratio=0.0,
    )
    caller = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7"
    for record in (
        _record("plain"),
        _record("retried", retried=True),
        _record("asked", traceparent=caller + "-01"),
        _record("declined", traceparent=caller + "-00"),
    ):
        pool.observers["on_request"](record)
    tracer.force_flush()
    spans = [
        span
        for body in bodies
        for resource in ExportTraceServiceRequest.FromString(body).resource_spans
        for scope in resource.scope_spans
        for span in scope.spans
    ]
    roots = {
        attribute.value.string_value
        for span in spans
        for attribute in span.attributes
        if attribute.key == "modelpool.request_id"
    }
    assert roots == {"retried", "asked"}
    tracer.shutdown()
