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
the tracer's own: the dispatcher thread only hands a record over. A kill and its release
check usually end after the request (its retry has already answered): they join its
trace when they come, as children of the attempt they ended.
"""

from __future__ import annotations

import atexit
import collections
import logging
import queue
import random
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from modelpool.observe import AttemptRecord, RequestRecord, WorkerEvent

if TYPE_CHECKING:
    from modelpool.pool import ModelPool

logger = logging.getLogger(__name__)

# Attempts whose span context is kept for a kill or release check that comes later.
REMEMBERED_ATTEMPTS = 4096
_STOP = object()


class PoolTracer:
    """Traces ``pool``'s requests to ``endpoint`` (an OTLP/HTTP traces URL)."""

    def __init__(
        self,
        pool: ModelPool,
        endpoint: str,
        *,
        model_name: str,
        service_name: str = "modelpool",
        exporter: SpanExporter | None = None,
        schedule_delay_s: float = 1.0,
        sample_ratio: float = 1.0,
    ) -> None:
        """``sample_ratio``: the share of the requests that went well (one attempt, an
        answer) that are traced; every other one (retried, killed, failed, cancelled) is.
        A caller's ``traceparent`` decides for its request when it says sampled or not."""
        self.model_name = model_name
        self.sample_ratio = sample_ratio
        self._random = random.Random()
        self.provider = TracerProvider(
            resource=Resource.create({"service.name": service_name}), shutdown_on_exit=False
        )
        self.provider.add_span_processor(
            BatchSpanProcessor(
                exporter or OTLPSpanExporter(endpoint=endpoint),
                schedule_delay_millis=int(schedule_delay_s * 1000),
            )
        )
        self.tracer = self.provider.get_tracer("modelpool")
        # The pool's clock is monotonic; spans want Unix nanoseconds.
        self._offset_ns = time.time_ns() - time.monotonic_ns()
        self._inbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        # attempt id -> its span's context; kills waiting for their attempt's record or
        # for their release check (worker id -> kill, the contexts it goes under).
        self._attempts: collections.OrderedDict[int, Context] = collections.OrderedDict()
        self._kills_without_attempt: dict[int, WorkerEvent] = {}
        self._kills: dict[int, tuple[WorkerEvent, list[Context]]] = {}
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
        self.provider.shutdown()

    def force_flush(self, timeout_s: float = 5.0) -> None:
        """Wait until what was handed over so far is exported (tests)."""
        done = threading.Event()
        self._inbox.put(done)
        done.wait(timeout_s)
        self.provider.force_flush(int(timeout_s * 1000))

    # ---- the tracer's thread -----------------------------------------------------------

    def _run(self) -> None:
        while True:
            item = self._inbox.get()
            if item is _STOP:
                return
            try:
                if isinstance(item, RequestRecord):
                    self._request(item)
                elif isinstance(item, WorkerEvent) and item.kind == "kill":
                    self._kill(item)
                elif isinstance(item, WorkerEvent):
                    self._release(item)
                elif isinstance(item, threading.Event):
                    item.set()
            except Exception:
                logger.exception("tracing: a span could not be built")

    def _ns(self, monotonic_s: float) -> int:
        return int(monotonic_s * 1e9) + self._offset_ns

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
        parent = None
        if record.traceparent is not None:
            parent = TraceContextTextMapPropagator().extract({"traceparent": record.traceparent})
        attributes: dict[str, str | int | float | list[str]] = {
            "gen_ai.operation.name": "text_completion",
            "gen_ai.request.model": self.model_name,
            "gen_ai.response.model": self.model_name,
            "gen_ai.response.id": record.request_id,
            "gen_ai.latency.time_in_queue": record.queue_s,
            "modelpool.request_id": record.request_id,
            "modelpool.priority": record.priority,
            "modelpool.status": record.status,
            "modelpool.attempts": len(record.attempts),
        }
        if record.max_new_tokens is not None:
            attributes["gen_ai.request.max_tokens"] = record.max_new_tokens
        if record.finish_reason is not None:
            attributes["gen_ai.response.finish_reasons"] = [record.finish_reason]
        if record.prompt_tokens is not None:
            attributes["gen_ai.usage.input_tokens"] = record.prompt_tokens
        if record.completion_tokens is not None:
            attributes["gen_ai.usage.output_tokens"] = record.completion_tokens
        if record.first_token_at is not None:
            ttft = record.first_token_at - record.submitted_at
            attributes["gen_ai.latency.time_to_first_token"] = ttft
        attributes["gen_ai.latency.e2e"] = record.finished_at - record.submitted_at
        if record.error is not None:
            attributes["error.type"] = record.error
        root = self.tracer.start_span(
            f"text_completion {self.model_name}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes=attributes,
            start_time=self._ns(record.submitted_at),
        )
        if record.status == "failed":
            root.set_status(Status(StatusCode.ERROR, record.error_message or record.error))
        context = trace.set_span_in_context(root)
        self._span(
            "queue",
            context,
            record.submitted_at,
            record.first_dispatch_at or record.finished_at,
            {"modelpool.priority": record.priority},
        )
        previous: AttemptRecord | None = None
        for attempt in record.attempts:
            if previous is not None and previous.ended_at is not None:
                self._span(
                    "retry",
                    context,
                    previous.ended_at,
                    attempt.started_at,
                    {
                        "modelpool.retry.after": previous.outcome or "withdrawn",
                        "modelpool.worker.pid": previous.pid or 0,
                    },
                )
            self._attempt(context, attempt, record.finished_at)
            previous = attempt
        root.end(end_time=self._ns(record.finished_at))

    def _attempt(self, parent: Context, attempt: AttemptRecord, finished_at: float) -> None:
        ended_at = attempt.ended_at if attempt.ended_at is not None else finished_at
        span = self.tracer.start_span(
            "attempt",
            context=parent,
            attributes={
                "modelpool.attempt_id": attempt.attempt_id,
                "modelpool.worker.id": attempt.worker_id,
                "modelpool.worker.pid": attempt.pid or 0,
                "modelpool.attempt.outcome": attempt.outcome or "withdrawn",
            },
            start_time=self._ns(attempt.started_at),
        )
        if attempt.outcome not in ("ok", "cancelled", None):
            span.set_status(Status(StatusCode.ERROR, attempt.outcome))
        context = trace.set_span_in_context(span)
        if attempt.first_token_at is not None:
            self._span("prefill", context, attempt.started_at, attempt.first_token_at, {})
            self._span("decode", context, attempt.first_token_at, ended_at, {})
        span.end(end_time=self._ns(ended_at))
        self._attempts[attempt.attempt_id] = context
        while len(self._attempts) > REMEMBERED_ATTEMPTS:
            self._attempts.popitem(last=False)
        kill = self._kills_without_attempt.pop(attempt.attempt_id, None)
        if kill is not None:
            self._kill_under(kill, [context])

    def _kill(self, kill: WorkerEvent) -> None:
        contexts = [self._attempts[a] for a in kill.attempt_ids if a in self._attempts]
        for attempt_id in kill.attempt_ids:
            if attempt_id not in self._attempts:
                self._kills_without_attempt[attempt_id] = kill
                _bound(self._kills_without_attempt)
        self._kills[kill.worker_id] = (kill, contexts)
        if not contexts and not kill.attempt_ids:
            self._kills.pop(kill.worker_id)  # an idle worker's kill (recycling): no trace

    def _kill_under(self, kill: WorkerEvent, contexts: list[Context]) -> None:
        release = self._releases.pop(kill.worker_id, None)
        if release is not None:
            self._emit_kill(kill, contexts, release)
        else:
            known = self._kills.get(kill.worker_id, (kill, []))[1]
            self._kills[kill.worker_id] = (kill, [*known, *contexts])

    def _release(self, release: WorkerEvent) -> None:
        waiting = self._kills.pop(release.worker_id, None)
        if waiting is None:
            return
        kill, contexts = waiting
        if contexts:
            self._emit_kill(kill, contexts, release)
        elif any(a in self._kills_without_attempt for a in kill.attempt_ids):
            self._releases[release.worker_id] = release  # its attempt's record comes later
            _bound(self._releases)

    def _emit_kill(self, kill: WorkerEvent, contexts: list[Context], release: WorkerEvent) -> None:
        for context in contexts:
            span = self.tracer.start_span(
                "kill",
                context=context,
                attributes={
                    "modelpool.kill.reason": kill.reason,
                    "modelpool.kill.signal": kill.detail,
                    "modelpool.worker.pid": kill.pid or 0,
                },
                start_time=self._ns(kill.at),
            )
            checked_from = release.at - (release.seconds or 0.0)
            self._span(
                "release_check",
                trace.set_span_in_context(span),
                checked_from,
                release.at,
                {
                    "modelpool.release.ok": bool(release.ok),
                    "modelpool.release.method": release.detail,
                    "modelpool.worker.pid": release.pid or 0,
                },
            )
            span.end(end_time=self._ns(release.at))

    def _span(
        self,
        name: str,
        parent: Context,
        start_s: float,
        end_s: float,
        attributes: Mapping[str, str | int | float | bool],
    ) -> None:
        span = self.tracer.start_span(
            name, context=parent, attributes=attributes, start_time=self._ns(start_s)
        )
        span.end(end_time=self._ns(max(start_s, end_s)))


def _bound(pending: dict[int, WorkerEvent]) -> None:
    """Drop the oldest entries past REMEMBERED_ATTEMPTS: what waits for a record that
    never comes (its request's trace was not sampled) must not grow without end."""
    while len(pending) > REMEMBERED_ATTEMPTS:
        del pending[next(iter(pending))]
