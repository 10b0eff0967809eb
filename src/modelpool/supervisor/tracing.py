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

Spans are built after the fact from the pool's records (``observe.py``), on the thread
of a :class:`~modelpool.supervisor.trace_export.TraceExporter`: the dispatcher thread only hands a
record over (dropped and counted when the exporter's queue is full). A tracer given a
URL makes its own exporter; a daemon makes one exporter and gives it to the tracer of
each pool it loads, so that loads cost no thread. Spans are built straight into OTLP's
protobuf messages (``opentelemetry-proto``), with no SDK span objects, processors or
per-span locks (those cost eight times as much per request: issue 38), and sent as one
export request per ``schedule_delay_s`` (a POST of ``application/x-protobuf``, with the
headers of ``OTEL_EXPORTER_OTLP_TRACES_HEADERS`` or ``OTEL_EXPORTER_OTLP_HEADERS``); an
export that fails is logged and dropped. A kill and its release check usually end
after the request (its retry has already answered): they join its trace when they
come, as children of the attempt they ended.
"""

from __future__ import annotations

import collections
import random
from collections.abc import Callable
from typing import TYPE_CHECKING

from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from modelpool.supervisor.observe import AttemptRecord, RequestRecord, WorkerEvent
from modelpool.supervisor.trace_export import OtlpHttpSender, TraceExporter

if TYPE_CHECKING:
    from modelpool.supervisor.pool import ModelPool

__all__ = ["OtlpHttpSender", "PoolTracer", "TraceExporter"]

# Attempts whose span is remembered for a kill or release check that comes later.
REMEMBERED_ATTEMPTS = 4096
_SERVER = Span.SpanKind.SPAN_KIND_SERVER
_INTERNAL = Span.SpanKind.SPAN_KIND_INTERNAL
# OTLP's span flags: the parent's remoteness is known; the parent is remote.
_HAS_IS_REMOTE, _IS_REMOTE = 0x100, 0x200

SpanRef = tuple[bytes, bytes]
"""A span's trace id and span id: what a later child (a kill) needs of it."""


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
    """Traces ``pool``'s requests to ``target``: an OTLP/HTTP traces URL (the tracer makes
    an exporter of its own, stopped by :meth:`shutdown`), or a :class:`TraceExporter`
    shared with other tracers (a daemon's: one thread, whatever the number of pools)."""

    def __init__(
        self,
        pool: ModelPool,
        target: str | TraceExporter,
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
        ``service_name``, ``export`` and ``schedule_delay_s``: the exporter's, when the
        tracer makes its own (see :class:`TraceExporter`)."""
        self.model_name = model_name
        self.sample_ratio = sample_ratio
        self._owns_exporter = isinstance(target, str)
        if isinstance(target, str):
            target = TraceExporter(
                target,
                service_name=service_name,
                export=export,
                schedule_delay_s=schedule_delay_s,
            )
        self.exporter = target
        self._random = random.Random()
        # attempt id -> its span; kills waiting for their attempt's record or for their
        # release check (worker id -> kill, the attempt spans it goes under).
        self._attempts: collections.OrderedDict[int, SpanRef] = collections.OrderedDict()
        self._kills_without_attempt: dict[int, WorkerEvent] = {}
        self._kills: dict[int, tuple[WorkerEvent, list[SpanRef]]] = {}
        self._releases: dict[int, WorkerEvent] = {}
        self._closed = False
        pool.add_observer(on_request=self._on_request, on_worker=self._on_worker)

    def _on_request(self, record: RequestRecord) -> None:
        if not self._closed:
            self.exporter.hand(self._build, record)

    def _on_worker(self, event: WorkerEvent) -> None:
        if event.kind in ("kill", "release") and not self._closed:
            self.exporter.hand(self._build, event)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Trace no more; export what was recorded (and stop the exporter if it is the
        tracer's own)."""
        if self._closed:
            return
        self._closed = True
        if self._owns_exporter:
            self.exporter.shutdown(timeout_s)
        else:
            self.exporter.force_flush(timeout_s)

    def force_flush(self, timeout_s: float = 5.0) -> None:
        """Wait until what was handed over so far is exported (tests)."""
        self.exporter.force_flush(timeout_s)

    # ---- the exporter's thread -----------------------------------------------------------

    def _build(self, item: object) -> None:
        if isinstance(item, RequestRecord):
            self._request(item)
        elif isinstance(item, WorkerEvent) and item.kind == "kill":
            self._kill(item)
        elif isinstance(item, WorkerEvent):
            self._release(item)

    def _ns(self, monotonic_s: float) -> int:
        return int(monotonic_s * 1e9) + self.exporter.offset_ns

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
        self.exporter.spans.add(
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
        self.exporter.spans.add(
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
