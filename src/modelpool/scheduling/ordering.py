"""Who goes first: the one ordering rule of every queue in modelpool, written once.

Promoted first, then by priority, then by arrival. ``priority`` is vLLM's: an integer,
lower runs first, default 0. A request is *promoted*, ahead of every request not promoted
whatever its priority (in arrival order among the promoted), from its
:func:`promotion_at`: once it has waited ``aging_s`` since it arrived (no priority
starves another), or at its ``due_at`` if that comes first (a request admitted by its
predicted wait is due a few runs before its deadline, ``admission.promotion_at``, so that
more urgent requests arriving after it do not keep it past its bound).

Three queues order by it, each passing the plain values it holds; their sorts are stable,
so arrival order within one urgency is the order each queue keeps:

- the daemon's fair share between clients (``server.fair_share``): its waiting runs;
- the pool's queue (``queueing.dispatch_order``): its queued requests;
- a batched worker's scheduler (``worker.backends.common.scheduler``): the requests
  waiting there for KV room, and the prefill budget. The pool of a batched worker sends
  each request's promotion instant with its priority (``PROMOTED_AT_PARAM``;
  ``time.monotonic`` is the system-wide monotonic clock, the same in every process of
  the machine).

::

    at = promotion_at(waiting_since=arrived, due_at=due, aging_s=10.0)
    sorted(queue, key=lambda r: urgency(r.priority, promoted_at=r.at, now=now))
"""

from __future__ import annotations

import math

Urgency = tuple[int, int]
"""Sorted lowest first: ``PROMOTED``, else ``(1, priority)``."""

PROMOTED: Urgency = (0, 0)


def promotion_at(*, waiting_since: float, due_at: float = math.inf, aging_s: float) -> float:
    """When a request that arrived at ``waiting_since`` is promoted: ``aging_s`` later,
    or at its ``due_at`` if that comes first."""
    return min(due_at, waiting_since + aging_s)


def urgency(priority: int, *, promoted_at: float, now: float) -> Urgency:
    """The sort key, at ``now``, of a request of ``priority`` promoted from ``promoted_at``."""
    return PROMOTED if now >= promoted_at else (1, priority)
