"""Priority order of the pool's queue, and what is queued by priority.

The dispatcher's queue keeps arrival order (a retry goes to the front); ``dispatch_order``
gives the order requests are handed to workers in: lower ``priority`` first (vLLM's
meaning: an integer, lower runs first, default 0), arrival order within one priority.
Starvation is bounded by aging: a request that has waited ``aging_s`` goes ahead of
every request, of any priority, that has waited less, so it waits at most ``aging_s``
more than it would in a first-come-first-served queue. A caller that queues requests
before the pool (the daemon's fair share) submits them within ``arrived_at(when)``:
they age from ``when``, so that the wait there and the wait here are one wait, aged
once. A request admitted by its
predicted wait (``max_queue_time_s``) is promoted so, sooner, at its ``due_at``: a few
runs' time before its deadline, so that it does not time out in the queue when more
urgent requests keep coming after it (``WaitPredictor.promotion_lead_s``; admitted, it is never
refused later). Its deadline, not its bound: promoted at the bound, nearly every admitted
request would go ahead of the urgent ones (measured: a high-priority p99 of 2.0 s against
0.81 s, benchmarks/priority.py)::

    order = dispatch_order(queue.values(), now=clock(), aging_s=10.0)

The queued work by priority (``PriorityCounts``: how many, and how big, ``sizes.Work``)
is what admission reads (``admission.py``).
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from contextvars import ContextVar

from modelpool.scheduling.ordering import promotion_at, urgency
from modelpool.scheduling.sizes import NO_WORK, Work
from modelpool.scheduling.views import RequestT, RequestView

# Dispatches whose priorities say what share of the slots each priority takes.
RECENT_DISPATCHES = 256


# When the requests being submitted arrived at a caller that queued them first
# (``arrived_at``); None: they arrive when they are submitted.
_ARRIVED_AT: ContextVar[float | None] = ContextVar("modelpool_arrived_at", default=None)


@contextlib.contextmanager
def arrived_at(when: float) -> Iterator[None]:
    """Requests submitted to a pool in this block (this thread's or task's context) age
    from ``when`` (``time.monotonic()``), when they arrived at the caller."""
    token = _ARRIVED_AT.set(when)
    try:
        yield
    finally:
        _ARRIVED_AT.reset(token)


def arrival(now: float) -> float:
    """When a request submitted at ``now`` arrived: the caller's ``arrived_at``, else now."""
    when = _ARRIVED_AT.get()
    return now if when is None else min(when, now)


def promoted(request: RequestView, *, now: float, aging_s: float) -> bool:
    """Does ``request`` go ahead of every younger request, of any priority: it has waited
    ``aging_s`` since it arrived, or it was admitted by its predicted wait and its
    ``due_at`` came (``ordering``)."""
    return now >= promoted_at(request, aging_s=aging_s)


def promoted_at(request: RequestView, *, aging_s: float) -> float:
    """When ``request`` is promoted (``ordering.promotion_at``)."""
    return promotion_at(waiting_since=request.waiting_since, due_at=request.due_at, aging_s=aging_s)


def urgent_share(dispatched_by_priority: Mapping[int, int], priority: int) -> float:
    """The share of the recent dispatches that went to a more urgent priority."""
    total = sum(dispatched_by_priority.values())
    if total == 0:
        return 0.0
    urgent = sum(n for level, n in dispatched_by_priority.items() if level < priority)
    return urgent / total


def dispatch_order(
    queue: Iterable[RequestT], *, now: float, aging_s: float, priorities: int | None = None
) -> Iterable[RequestT]:
    """The queued requests in the order they go to workers (see the module docstring).
    ``priorities``: how many distinct priorities the queue holds, when the caller counts
    them (``PriorityCounts.waiting``). With one, the queue is returned as it is, unread:
    the dispatcher asks after every event, and a pass over a long queue each time (the
    set of its priorities) was most of its cost per request under a backlog."""
    if priorities is not None and priorities <= 1:
        return queue  # one priority: arrival order already (the common case)
    requests = list(queue)
    if len({request.priority for request in requests}) <= 1:
        return requests

    def key(request: RequestT) -> tuple[int, int]:
        return urgency(request.priority, promoted_at=promoted_at(request, aging_s=aging_s), now=now)

    return sorted(requests, key=key)  # stable: arrival order within one urgency


class PriorityCounts:
    """The queued requests by priority (``waiting``), their work (``work``: their sizes
    summed, ``sizes.Work``) and the priorities of the last RECENT_DISPATCHES dispatches by
    count (``dispatched``: the share of the slots each priority takes). The dispatcher
    thread replaces each dict whole on a change, so that a caller's thread reads one
    without a lock and never half-updated."""

    def __init__(self) -> None:
        self.waiting: dict[int, int] = {}
        self.work: dict[int, Work] = {}
        self.dispatched: dict[int, int] = {}
        self._recent: deque[int] = deque()

    def queued(self, priority: int, change: int, work: Work = NO_WORK) -> None:
        """A request of ``priority`` entered (+1) or left (-1) the queue; ``work``: what
        it added to the queued work (the same when it leaves)."""
        counts = dict(self.waiting)
        left = counts.get(priority, 0) + change
        works = dict(self.work)
        if left > 0:
            counts[priority] = left
            summed = works.get(priority, NO_WORK)
            works[priority] = summed + work if change > 0 else summed - work
        else:
            counts.pop(priority, None)
            works.pop(priority, None)
        self.waiting = counts
        self.work = works

    def dispatched_one(self, priority: int) -> None:
        counts = dict(self.dispatched)
        counts[priority] = counts.get(priority, 0) + 1
        self._recent.append(priority)
        if len(self._recent) > RECENT_DISPATCHES:
            oldest = self._recent.popleft()
            counts[oldest] -= 1
            if not counts[oldest]:
                del counts[oldest]
        self.dispatched = counts


def ahead_of(work_by_priority: Mapping[int, Work], priority: int) -> Work:
    """The queued work a new request of ``priority`` would wait behind."""
    ahead = NO_WORK
    for level, work in work_by_priority.items():
        if level <= priority:
            ahead += work
    return ahead
