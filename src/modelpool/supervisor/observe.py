"""What the pool tells observers: a record per finished request, an event per worker step.

The dispatcher keeps timestamps (its monotonic clock) as a request moves: submitted,
each attempt's dispatch, first token and end on a worker (pid, outcome), resolution.
When the request is resolved it hands one :class:`RequestRecord` (made by
``records.request_record``) to every observer; a worker the pool signals, and its
memory release check, are :class:`WorkerEvent` s.
Observers are the daemon's ``vllm:`` metrics (``server/vllm_metrics.py``) and the
OpenTelemetry exporter (``tracing.py``); the last events are also kept for stats
(``recent_events``, which the ``/ui`` page shows)::

    pool.add_observer(on_request=lambda record: print(record.request_id, record.status))

Observers run on the dispatcher thread, as future callbacks do: they must be quick
(one that does more hands the record to its own thread); one that raises is logged.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

logger = logging.getLogger(__name__)

RECENT_EVENTS = 64
"""Worker events and retries kept for stats (``PoolStats.recent_events``)."""

RequestStatus = Literal["completed", "failed", "cancelled"]


@dataclass
class AttemptRecord:
    """One attempt on a worker; times on the pool's monotonic clock. ``outcome`` None: the
    worker gave it back unstarted (withdrawn) or refused it."""

    attempt_id: int
    worker_id: int
    pid: int | None
    started_at: float
    ended_at: float | None = None
    first_token_at: float | None = None
    outcome: str | None = None


@dataclass
class RequestRecord:
    """A resolved request, as observers get it. ``error``: the error's class name."""

    request_id: str
    priority: int
    submitted_at: float
    finished_at: float
    status: RequestStatus
    first_dispatch_at: float | None
    first_token_at: float | None
    attempts: list[AttemptRecord] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    error_message: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int = 0
    max_new_tokens: int | None = None
    # The caller's W3C trace context (``traceparent``), when it gave one.
    traceparent: str | None = None

    @property
    def queue_s(self) -> float:
        """Submitted to the first dispatch (the whole life, if it never ran)."""
        return (self.first_dispatch_at or self.finished_at) - self.submitted_at


@dataclass(frozen=True)
class WorkerEvent:
    """``kind``: "kill" (the pool signalled the worker: ``reason``, the attempts it ran),
    "exit" (reaped: ``detail`` says how), "release" (its memory release check: ``ok``,
    ``seconds``), or "retry" (``attempt_ids`` holds the failed attempt, ``request_id``
    the request queued again, ``reason`` its outcome)."""

    kind: Literal["kill", "exit", "release", "retry"]
    at: float
    worker_id: int
    pid: int | None
    reason: str = ""
    attempt_ids: tuple[int, ...] = ()
    request_id: str | None = None
    ok: bool | None = None
    seconds: float | None = None
    detail: str = ""
    # The pool slot the worker held: its replacement takes the same one.
    pool_slot: int = -1

    def to_dict(self, wall_offset: float) -> dict[str, Any]:
        """For stats: ``at`` as Unix time (``wall_offset``: wall clock minus monotonic)."""
        return {
            "kind": self.kind,
            "at": round(self.at + wall_offset, 3),
            "worker_id": self.worker_id,
            "pool_slot": self.pool_slot,
            "pid": self.pid,
            "reason": self.reason,
            "request_id": self.request_id,
            "ok": self.ok,
            "seconds": None if self.seconds is None else round(self.seconds, 4),
            "detail": self.detail,
        }


class Observers:
    """The observers of one pool, and its recent worker events."""

    def __init__(self) -> None:
        self.on_request: list[Callable[[RequestRecord], None]] = []
        self.on_worker: list[Callable[[WorkerEvent], None]] = []
        self.recent: collections.deque[WorkerEvent] = collections.deque(maxlen=RECENT_EVENTS)

    def request_done(self, record: RequestRecord) -> None:
        for observer in self.on_request:
            try:
                observer(record)
            except Exception:
                logger.exception("a request observer failed")

    def worker_event(self, event: WorkerEvent) -> None:
        self.recent.append(event)
        for observer in self.on_worker:
            try:
                observer(event)
            except Exception:
                logger.exception("a worker observer failed")
