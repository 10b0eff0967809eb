"""OpenTelemetry traces of the pool's requests, exported over OTLP/HTTP (extra ``tracing``).

One trace per request (a child of the caller's span when it sent a W3C ``traceparent``):
a request span with the ``gen_ai.*`` attributes that exist (model, max tokens, finish
reason, token usage) and vLLM's latency ones, and under it a ``queue`` span, one
``attempt`` span per attempt (worker pid, outcome) with ``prefill`` and ``decode``
children where the first token is known, a ``retry`` span from a failed attempt to the
next, and, when the pool killed the worker an attempt ran on, a ``kill`` span (signal
to memory release check) with its ``release_check``::

    tracer = PoolTracer(pool, "http://collector:4318/v1/traces", model_name="smollm2")
    ...                                             # requests are traced as they end
    tracer.shutdown()                               # flushes what is left

Spans are built after the fact from the pool's records (``observe.py``), on a thread of
the tracer's own: the dispatcher thread only hands a record over. They are built
straight into OTLP's protobuf messages (``opentelemetry-proto``), with no SDK span
objects, processors or per-span locks (those cost eight times as much per request:
issue 38), and sent as one export request per ``schedule_delay_s`` (or per
``MAX_BATCH_SPANS``) by :class:`OtlpHttpSender` (a POST of ``application/x-protobuf``,
with the headers of ``OTEL_EXPORTER_OTLP_TRACES_HEADERS`` or
``OTEL_EXPORTER_OTLP_HEADERS``); an export that fails is logged and dropped. A kill and
its release check usually end after the request (its retry has already answered): they
join its trace when they come, as children of the attempt they ended.
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import queue
import random
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import (
    AnyValue,
    ArrayValue,
    InstrumentationScope,
    KeyValue,
)
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span, Status

from modelpool.observe import AttemptRecord, RequestRecord, WorkerEvent

if TYPE_CHECKING:
    from modelpool.pool import ModelPool

logger = logging.getLogger(__name__)

# Attempts whose span is remembered for a kill or release check that comes later.
REMEMBERED_ATTEMPTS = 4096
# Spans past which an export is sent before its interval is over.
MAX_BATCH_SPANS = 4096
_STOP = object()
_SERVER = Span.SpanKind.SPAN_KIND_SERVER
_INTERNAL = Span.SpanKind.SPAN_KIND_INTERNAL
# OTLP's span flags: the parent's remoteness is known; the parent is remote.
_HAS_IS_REMOTE, _IS_REMOTE = 0x100, 0x200

SpanRef = tuple[bytes, bytes]
"""A span's trace id and span id: what a later child (a kill) needs of it."""


class OtlpHttpSender:
    """POSTs an export request's bytes to an OTLP/HTTP traces endpoint."""

    def __init__(self, endpoint: str, *, timeout_s: float = 10.0) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        headers = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_HEADERS") or os.environ.get(
            "OTEL_EXPORTER_OTLP_HEADERS", ""
        )
        self.headers = {"Content-Type": "application/x-protobuf", **_parse_headers(headers)}

    def __call__(self, body: bytes) -> None:
        request = urllib.request.Request(
            self.endpoint, data=body, headers=self.headers, method="POST"
        )
        with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
            response.read()


def _parse_headers(text: str) -> dict[str, str]:
    """OTel's header list: ``key=value,key2=value2``, values URL-encoded."""
    headers = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if sep and key.strip():
            headers[key.strip()] = urllib.parse.unquote(value.strip())
    return headers


def _str(key: str, value: str) -> KeyValue:
    return KeyValue(key=key, value=AnyValue(string_value=value))


def _int(key: str, value: int) -> KeyValue:
    return KeyValue(key=key, value=AnyValue(int_value=value))


def _float(key: str, value: float) -> KeyValue:
    return KeyValue(key=key, value=AnyValue(double_value=value))


def _bool(key: str, value: bool) -> KeyValue:
    return KeyValue(key=key, value=AnyValue(bool_value=value))


_REPEATED: dict[tuple[str, object], KeyValue] = {}
"""Attributes whose values repeat from span to span (model, priority, pid, outcome ...),
built once: a message copied into a span costs a third of one built afresh."""


def _repeated(key: str, value: str | int) -> KeyValue:
    attribute = _REPEATED.get((key, value))
    if attribute is None:
        if len(_REPEATED) >= REMEMBERED_ATTEMPTS:
            _REPEATED.clear()  # bounded: pids and ids are not an endless set, but close
        attribute = _str(key, value) if isinstance(value, str) else _int(key, value)
        _REPEATED[(key, value)] = attribute
    return attribute


def _finish_reasons(reason: str) -> KeyValue:
    attribute = _REPEATED.get(("gen_ai.response.finish_reasons", reason))
    if attribute is None:
        reasons = ArrayValue(values=[AnyValue(string_value=reason)])
        attribute = KeyValue(
            key="gen_ai.response.finish_reasons", value=AnyValue(array_value=reasons)
        )
        _REPEATED[("gen_ai.response.finish_reasons", reason)] = attribute
    return attribute


class PoolTracer:
    """Traces ``pool``'s requests to ``endpoint`` (an OTLP/HTTP traces URL)."""

    def __init__(
        self,
        pool: ModelPool,
        endpoint: str,
        *,
        model_name: str,
        service_name: str = "modelpool",
        export: Callable[[bytes], None] | None = None,
        schedule_delay_s: float = 1.0,
        sample_ratio: float = 1.0,
    ) -> None:
        """``sample_ratio``: the share of the requests that went well (one attempt, an
        answer) that are traced; every other one (retried, killed, failed, cancelled) is.
        A caller's ``traceparent`` decides for its request when it says sampled or not.
        ``export``: what sends a serialized ``ExportTraceServiceRequest`` (default: an
        :class:`OtlpHttpSender` to ``endpoint``)."""
        self.model_name = model_name
        self.sample_ratio = sample_ratio
        self.schedule_delay_s = schedule_delay_s
        self._export = export or OtlpHttpSender(endpoint)
        self._random = random.Random()
        self._resource = Resource(attributes=[_str("service.name", service_name)])
        self._scope = InstrumentationScope(name="modelpool")
        # The next export request; spans are added into it in place (no copy at export).
        self._batch, self._spans = self._new_batch()
        # The pool's clock is monotonic; spans want Unix nanoseconds.
        self._offset_ns = time.time_ns() - time.monotonic_ns()
        self._inbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        # attempt id -> its span; kills waiting for their attempt's record or for their
        # release check (worker id -> kill, the attempt spans it goes under).
        self._attempts: collections.OrderedDict[int, SpanRef] = collections.OrderedDict()
        self._kills_without_attempt: dict[int, WorkerEvent] = {}
        self._kills: dict[int, tuple[WorkerEvent, list[SpanRef]]] = {}
        self._releases: dict[int, WorkerEvent] = {}
        self._thread = threading.Thread(target=self._run, name="modelpool-tracing", daemon=True)
        self._thread.start()
        self._closed = False
        pool.add_observer(on_request=self._inbox.put, on_worker=self._on_worker)
        atexit.register(self.shutdown)

    def _on_worker(self, event: WorkerEvent) -> None:
        if event.kind in ("kill", "release"):
            self._inbox.put(event)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Export what was recorded and stop."""
        if self._closed:
            return
        self._closed = True
        self._inbox.put(_STOP)
        self._thread.join(timeout_s)

    def force_flush(self, timeout_s: float = 5.0) -> None:
        """Wait until what was handed over so far is exported (tests)."""
        done = threading.Event()
        self._inbox.put(done)
        done.wait(timeout_s)

    # ---- the tracer's thread -----------------------------------------------------------

    def _run(self) -> None:
        flush_at = time.monotonic() + self.schedule_delay_s
        while True:
            try:
                item = self._inbox.get(timeout=max(0.0, flush_at - time.monotonic()))
            except queue.Empty:
                item = None
            if item is _STOP:
                self._flush()
                return
            try:
                if isinstance(item, RequestRecord):
                    self._request(item)
                elif isinstance(item, WorkerEvent) and item.kind == "kill":
                    self._kill(item)
                elif isinstance(item, WorkerEvent):
                    self._release(item)
            except Exception:
                logger.exception("tracing: a span could not be built")
            if isinstance(item, threading.Event):
                self._flush()
                item.set()
            elif len(self._spans) >= MAX_BATCH_SPANS or time.monotonic() >= flush_at:
                self._flush()
                flush_at = time.monotonic() + self.schedule_delay_s

    def _new_batch(self) -> tuple[ExportTraceServiceRequest, Any]:
        """An empty export request, and its spans' repeated field to add to."""
        batch = ExportTraceServiceRequest(
            resource_spans=[
                ResourceSpans(resource=self._resource, scope_spans=[ScopeSpans(scope=self._scope)])
            ]
        )
        return batch, batch.resource_spans[0].scope_spans[0].spans

    def _flush(self) -> None:
        """One export request of every span built since the last."""
        count = len(self._spans)
        if not count:
            return
        body = self._batch.SerializeToString()
        self._batch, self._spans = self._new_batch()
        try:
            self._export(body)
        except Exception as exc:
            logger.warning("tracing: %d spans could not be exported: %r", count, exc)

    def _ns(self, monotonic_s: float) -> int:
        return int(monotonic_s * 1e9) + self._offset_ns

    def _span_id(self) -> bytes:
        return (self._random.getrandbits(64) or 1).to_bytes(8, "big")

    def _sampled(self, record: RequestRecord) -> bool:
        """Decided once the request is over, which head sampling cannot do: whatever went
        wrong is kept; of the rest, the caller's flag, else ``sample_ratio`` of them."""
        if record.status != "completed" or len(record.attempts) > 1:
            return True
        if record.traceparent is not None:
            return record.traceparent.endswith("1")  # the flags' sampled bit (01)
        return self.sample_ratio >= 1.0 or self._random.random() < self.sample_ratio

    def _request(self, record: RequestRecord) -> None:
        if not self._sampled(record):
            return
        if record.traceparent is not None:  # checked by the pool: 00-TRACE-PARENT-FLAGS
            _, trace_hex, parent_hex, _ = record.traceparent.split("-")
            trace_id, parent = bytes.fromhex(trace_hex), bytes.fromhex(parent_hex)
            flags = _HAS_IS_REMOTE | _IS_REMOTE
        else:
            trace_id = self._random.getrandbits(128).to_bytes(16, "big")
            parent, flags = b"", _HAS_IS_REMOTE
        model = self.model_name
        attributes = [
            _repeated("gen_ai.operation.name", "text_completion"),
            _repeated("gen_ai.request.model", model),
            _repeated("gen_ai.response.model", model),
            _str("gen_ai.response.id", record.request_id),
            _float("gen_ai.latency.time_in_queue", record.queue_s),
            _str("modelpool.request_id", record.request_id),
            _repeated("modelpool.priority", record.priority),
            _repeated("modelpool.status", record.status),
            _repeated("modelpool.attempts", len(record.attempts)),
            _float("gen_ai.latency.e2e", record.finished_at - record.submitted_at),
        ]
        if record.max_new_tokens is not None:
            attributes.append(_repeated("gen_ai.request.max_tokens", record.max_new_tokens))
        if record.finish_reason is not None:
            attributes.append(_finish_reasons(record.finish_reason))
        if record.prompt_tokens is not None:
            attributes.append(_int("gen_ai.usage.input_tokens", record.prompt_tokens))
        if record.completion_tokens is not None:
            attributes.append(_int("gen_ai.usage.output_tokens", record.completion_tokens))
        if record.first_token_at is not None:
            ttft = record.first_token_at - record.submitted_at
            attributes.append(_float("gen_ai.latency.time_to_first_token", ttft))
        status = None
        if record.error is not None:
            attributes.append(_str("error.type", record.error))
        if record.status == "failed":
            message = record.error_message or record.error or ""
            status = Status(code=Status.StatusCode.STATUS_CODE_ERROR, message=message)
        root = self._span_id()
        self._spans.add(
            trace_id=trace_id,
            span_id=root,
            parent_span_id=parent,
            name=f"text_completion {model}",
            kind=_SERVER,
            start_time_unix_nano=self._ns(record.submitted_at),
            end_time_unix_nano=self._ns(record.finished_at),
            attributes=attributes,
            status=status,
            flags=flags,
        )
        self._span(
            "queue",
            trace_id,
            root,
            record.submitted_at,
            record.first_dispatch_at or record.finished_at,
            [_repeated("modelpool.priority", record.priority)],
        )
        previous: AttemptRecord | None = None
        for attempt in record.attempts:
            if previous is not None and previous.ended_at is not None:
                self._span(
                    "retry",
                    trace_id,
                    root,
                    previous.ended_at,
                    attempt.started_at,
                    [
                        _repeated("modelpool.retry.after", previous.outcome or "withdrawn"),
                        _repeated("modelpool.worker.pid", previous.pid or 0),
                    ],
                )
            self._attempt(trace_id, root, attempt, record.finished_at)
            previous = attempt

    def _attempt(
        self, trace_id: bytes, parent: bytes, attempt: AttemptRecord, finished_at: float
    ) -> None:
        ended_at = attempt.ended_at if attempt.ended_at is not None else finished_at
        status = None
        if attempt.outcome not in ("ok", "cancelled", "preempted", None):
            status = Status(code=Status.StatusCode.STATUS_CODE_ERROR, message=attempt.outcome)
        span = self._span(
            "attempt",
            trace_id,
            parent,
            attempt.started_at,
            ended_at,
            [
                _int("modelpool.attempt_id", attempt.attempt_id),
                _repeated("modelpool.worker.id", attempt.worker_id),
                _repeated("modelpool.worker.pid", attempt.pid or 0),
                _repeated("modelpool.attempt.outcome", attempt.outcome or "withdrawn"),
            ],
            status,
        )
        if attempt.first_token_at is not None:
            self._span("prefill", trace_id, span, attempt.started_at, attempt.first_token_at)
            self._span("decode", trace_id, span, attempt.first_token_at, ended_at)
        self._attempts[attempt.attempt_id] = (trace_id, span)
        while len(self._attempts) > REMEMBERED_ATTEMPTS:
            self._attempts.popitem(last=False)
        kill = self._kills_without_attempt.pop(attempt.attempt_id, None)
        if kill is not None:
            self._kill_under(kill, [(trace_id, span)])

    def _kill(self, kill: WorkerEvent) -> None:
        attempts = [self._attempts[a] for a in kill.attempt_ids if a in self._attempts]
        for attempt_id in kill.attempt_ids:
            if attempt_id not in self._attempts:
                self._kills_without_attempt[attempt_id] = kill
                _bound(self._kills_without_attempt)
        self._kills[kill.worker_id] = (kill, attempts)
        if not attempts and not kill.attempt_ids:
            self._kills.pop(kill.worker_id)  # an idle worker's kill (recycling): no trace

    def _kill_under(self, kill: WorkerEvent, attempts: list[SpanRef]) -> None:
        release = self._releases.pop(kill.worker_id, None)
        if release is not None:
            self._emit_kill(kill, attempts, release)
        else:
            known = self._kills.get(kill.worker_id, (kill, []))[1]
            self._kills[kill.worker_id] = (kill, [*known, *attempts])

    def _release(self, release: WorkerEvent) -> None:
        waiting = self._kills.pop(release.worker_id, None)
        if waiting is None:
            return
        kill, attempts = waiting
        if attempts:
            self._emit_kill(kill, attempts, release)
        elif any(a in self._kills_without_attempt for a in kill.attempt_ids):
            self._releases[release.worker_id] = release  # its attempt's record comes later
            _bound(self._releases)

    def _emit_kill(self, kill: WorkerEvent, attempts: list[SpanRef], release: WorkerEvent) -> None:
        for trace_id, attempt in attempts:
            span = self._span(
                "kill",
                trace_id,
                attempt,
                kill.at,
                release.at,
                [
                    _str("modelpool.kill.reason", kill.reason),
                    _str("modelpool.kill.signal", kill.detail),
                    _int("modelpool.worker.pid", kill.pid or 0),
                ],
            )
            self._span(
                "release_check",
                trace_id,
                span,
                release.at - (release.seconds or 0.0),
                release.at,
                [
                    _bool("modelpool.release.ok", bool(release.ok)),
                    _str("modelpool.release.method", release.detail),
                    _int("modelpool.worker.pid", release.pid or 0),
                ],
            )

    def _span(
        self,
        name: str,
        trace_id: bytes,
        parent: bytes,
        start_s: float,
        end_s: float,
        attributes: list[KeyValue] | None = None,
        status: Status | None = None,
    ) -> bytes:
        """Add an internal span under ``parent``; its id."""
        span_id = self._span_id()
        self._spans.add(
            trace_id=trace_id,
            span_id=span_id,
            parent_span_id=parent,
            name=name,
            kind=_INTERNAL,
            start_time_unix_nano=self._ns(start_s),
            end_time_unix_nano=self._ns(max(start_s, end_s)),
            attributes=attributes,
            status=status,
            flags=_HAS_IS_REMOTE,
        )
        return span_id


def _bound(pending: dict[int, WorkerEvent]) -> None:
    """Drop the oldest entries past REMEMBERED_ATTEMPTS: what waits for a record that
    never comes (its request's trace was not sampled) must not grow without end."""
    while len(pending) > REMEMBERED_ATTEMPTS:
        del pending[next(iter(pending))]
