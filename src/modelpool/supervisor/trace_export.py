"""The export side of tracing: one thread, a bounded queue, OTLP/HTTP (extra ``tracing``).

A :class:`TraceExporter` owns the thread that builds spans and sends them; any number of
:class:`~modelpool.supervisor.tracing.PoolTracer` share it (a daemon makes one, and a tracer per
pool it loads: a model loaded and unloaded a thousand times costs no thread and no exit
hook). A pool's dispatcher thread only hands a record over (:meth:`TraceExporter.hand`);
the exporter's thread has it built into the next export request, sent as one POST per
``schedule_delay_s`` (or per ``MAX_BATCH_SPANS``) by :class:`OtlpHttpSender`.

What waits for the thread is bounded: past ``max_queued`` records (a collector that
hangs holds the thread in its export for ``timeout_s`` at a time), a record handed over
is dropped and counted, as OpenTelemetry's batch processor does, rather than growing the
daemon's memory without end (the third review: 65 to 93 MB in 60 s at 500 requests/s).
An export that fails is logged, and its spans counted, and dropped::

    exporter = TraceExporter("http://collector:4318/v1/traces")
    PoolTracer(pool, exporter, model_name="smollm2")    # as many as there are pools
    exporter.snapshot()      # {"queued": 0, "dropped": 0, "exported_spans": 12, ...}
    exporter.shutdown()      # flushes what is left (also at exit)
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import time
import urllib.parse
import urllib.request
import weakref
from collections.abc import Callable
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, InstrumentationScope, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans

logger = logging.getLogger("modelpool.tracing")

# Spans past which an export is sent before its interval is over.
MAX_BATCH_SPANS = 4096
# Records waiting for the thread past which new ones are dropped: a few MB (a record is
# about 1 KB), several seconds of a busy daemon's requests.
MAX_QUEUED_RECORDS = 4096
# What a control item (a flush, the stop) waits for room in a full queue.
CONTROL_WAIT_S = 5.0
_STOP = object()

Build = Callable[[object], None]
"""What makes a record's spans, on the exporter's thread (a tracer's)."""


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


class TraceExporter:
    """One thread building and exporting the spans of every tracer handed to it."""

    def __init__(
        self,
        endpoint: str,
        *,
        service_name: str = "modelpool",
        export: Callable[[bytes], None] | None = None,
        schedule_delay_s: float = 1.0,
        max_queued: int | None = None,
    ) -> None:
        """``export``: what sends a serialized ``ExportTraceServiceRequest`` (default: an
        :class:`OtlpHttpSender` to ``endpoint``); ``max_queued``: the records that may
        wait for the thread (None: ``MAX_QUEUED_RECORDS``, read now)."""
        self.schedule_delay_s = schedule_delay_s
        self._export = export or OtlpHttpSender(endpoint)
        service = KeyValue(key="service.name", value=AnyValue(string_value=service_name))
        self._resource = Resource(attributes=[service])
        self._scope = InstrumentationScope(name="modelpool")
        # The next export request; tracers add spans into ``spans`` in place.
        self._batch, self.spans = self._new_batch()
        # The pools' clock is monotonic; spans want Unix nanoseconds.
        self.offset_ns = time.time_ns() - time.monotonic_ns()
        bound = MAX_QUEUED_RECORDS if max_queued is None else max_queued
        self._inbox: queue.Queue[object] = queue.Queue(bound)
        self._dropped_lock = threading.Lock()
        self.dropped = 0
        self.exported_spans = 0
        self.failed_spans = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="modelpool-tracing", daemon=True)
        self._thread.start()
        _LIVE.add(self)

    def hand(self, build: Build, item: object) -> None:
        """Have ``build(item)`` run on the exporter's thread; dropped (and counted) when
        the queue is full. Quick: it runs on a pool's dispatcher thread."""
        try:
            self._inbox.put_nowait((build, item))
        except queue.Full:
            with self._dropped_lock:
                self.dropped += 1

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Export what was handed over and stop the thread."""
        if self._closed:
            return
        self._closed = True
        _LIVE.discard(self)
        try:
            self._inbox.put(_STOP, timeout=min(timeout_s, CONTROL_WAIT_S))
        except queue.Full:
            logger.warning("tracing: the export queue stayed full; stopped without a flush")
            return
        self._thread.join(timeout_s)

    def force_flush(self, timeout_s: float = 5.0) -> None:
        """Wait until what was handed over so far is exported (tests)."""
        done = threading.Event()
        self._inbox.put(done, timeout=timeout_s)
        done.wait(timeout_s)

    def snapshot(self) -> dict[str, int]:
        """What ``/stats`` shows under ``tracing`` (and ``/metrics`` as modelpool_trace_*)."""
        return {
            "queued": self._inbox.qsize(),
            "dropped": self.dropped,
            "exported_spans": self.exported_spans,
            "failed_spans": self.failed_spans,
        }

    # ---- the exporter's thread ---------------------------------------------------------

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
            if isinstance(item, tuple):
                build, record = item
                try:
                    build(record)
                except Exception:
                    logger.exception("tracing: a span could not be built")
            if isinstance(item, threading.Event):
                self._flush()
                item.set()
            elif len(self.spans) >= MAX_BATCH_SPANS or time.monotonic() >= flush_at:
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
        count = len(self.spans)
        if not count:
            return
        body = self._batch.SerializeToString()
        self._batch, self.spans = self._new_batch()
        try:
            self._export(body)
        except Exception as exc:
            self.failed_spans += count
            logger.warning("tracing: %d spans could not be exported: %r", count, exc)
        else:
            self.exported_spans += count


# The exporters not shut down yet: one exit hook flushes them all, so that an exporter
# (a library user's tracer makes its own) adds no hook of its own.
_LIVE: weakref.WeakSet[TraceExporter] = weakref.WeakSet()


@atexit.register
def _shutdown_live() -> None:
    for exporter in list(_LIVE):
        exporter.shutdown()
