"""Priority order of the pool's queue, and the wait a new request can expect in it.

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
urgent requests keep coming after it (``promotion_lead_s``; admitted, it is never
refused later). Its deadline, not its bound: promoted at the bound, nearly every admitted
request would go ahead of the urgent ones (measured: a high-priority p99 of 2.0 s against
0.81 s, benchmarks/priority.py)::

    order = dispatch_order(queue.values(), now=clock(), aging_s=10.0)

``WaitPredictor`` is the admission side (``max_queue_time_s``): moving averages of what
finished runs measured (time from dispatch to the first token, time from dispatch to the
end and its spread, prefill and decode tokens per second) and, from them, a new request's
predicted time to first token given the requests ahead of it, and the share of the slots
that more urgent requests took of the last dispatches (they will pass it too), and of
the slot time lost to runs they preempted. It is meant to err long: a run is counted at
its mean plus its mean deviation, so that a request it admits meets its bound even when
the runs ahead of it are long ones::

    predictor.observe(run_s=0.8, ttft_s=0.1, prompt_tokens=40, completion_tokens=32)
    predictor.predict_ttft(ahead=6, free=0, capacity=4)   # 6 ahead, 4 slots busy
    predictor.predict_ttft(ahead=6, free=0, capacity=4, urgent_share=0.2)

The dispatcher thread writes it, callers' threads read it: every field is one float,
replaced whole, so a reader sees each one either old or new, never torn.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from contextvars import ContextVar

from modelpool.supervisor.records import Request

# Weight of the newest run in the moving averages: about the last 20 runs count.
EWMA_WEIGHT = 0.1
# Runs measured before a prediction is trusted (a first run pays warm-up costs).
MIN_SAMPLES = 3
# The share of the measured decode rate a request without a maximum leaves unspent when
# its deadline bounds its length (WaitPredictor.tokens_within).
DECODE_MARGIN = 0.2
# The least share of the slots a priority is predicted to get, however busy the more
# urgent ones keep them (aging promotes it after priority_aging_s anyway).
MIN_SHARE = 0.05
# Dispatches whose priorities say what share of the slots each priority takes.
RECENT_DISPATCHES = 256
# Weight of the newest dispatch or preemption in the share of runs preempted.
PREEMPTED_WEIGHT = 1 / RECENT_DISPATCHES
# A request admitted by its predicted wait is promoted this many runs (mean plus spread)
# before its deadline: one for a slot to free, the others for promoted requests ahead.
DUE_RUNS = 3


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


def promoted(request: Request, *, now: float, aging_s: float) -> bool:
    """Does ``request`` go ahead of every younger request, of any priority: it has waited
    ``aging_s`` since it arrived, or it was admitted by its predicted wait and its
    ``due_at`` came."""
    arrived = request.submitted_at if request.arrived_at is None else request.arrived_at
    return now >= request.due_at or now - arrived >= aging_s


def urgent_share(dispatched_by_priority: Mapping[int, int], priority: int) -> float:
    """The share of the recent dispatches that went to a more urgent priority."""
    total = sum(dispatched_by_priority.values())
    if total == 0:
        return 0.0
    urgent = sum(n for level, n in dispatched_by_priority.items() if level < priority)
    return urgent / total


def dispatch_order(
    queue: Iterable[Request], *, now: float, aging_s: float, priorities: int | None = None
) -> Iterable[Request]:
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

    def key(request: Request) -> tuple[int, int]:
        if promoted(request, now=now, aging_s=aging_s):
            return (0, 0)  # ahead of every request not promoted, in arrival order
        return (1, request.priority)

    return sorted(requests, key=key)  # stable: arrival order within one key


class PriorityCounts:
    """The queued requests by priority (``waiting``) and the priorities of the last
    RECENT_DISPATCHES dispatches by count (``dispatched``: the share of the slots each
    priority takes). The dispatcher thread replaces each dict whole on a change, so that
    a caller's thread reads one without a lock and never half-updated."""

    def __init__(self) -> None:
        self.waiting: dict[int, int] = {}
        self.dispatched: dict[int, int] = {}
        self._recent: deque[int] = deque()

    def queued(self, priority: int, change: int) -> None:
        """A request of ``priority`` entered (+1) or left (-1) the queue."""
        counts = dict(self.waiting)
        left = counts.get(priority, 0) + change
        if left > 0:
            counts[priority] = left
        else:
            counts.pop(priority, None)
        self.waiting = counts

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


def ahead_of(waiting_by_priority: Mapping[int, int], priority: int) -> int:
    """Requests waiting that a new one of ``priority`` would wait behind."""
    return sum(count for level, count in waiting_by_priority.items() if level <= priority)


class WaitPredictor:
    """Moving averages of finished runs, and the time to first token they predict."""

    def __init__(self) -> None:
        self.samples = 0
        self.run_s = 0.0
        self.run_spread_s = 0.0  # the moving mean of |run - its moving average|
        # Of the recent dispatches and preemptions, the share that were preemptions: the
        # slot time lost to runs that will run again (preempt_for_priority).
        self.preempted_share = 0.0
        self.ttft_s = 0.0
        self.prefill_tokens_per_s = 0.0
        self.decode_tokens_per_s = 0.0
        # Totals over every answered run (the status page's tokens per second).
        self.prompt_tokens = 0
        self.completion_tokens = 0

    def observe(
        self,
        *,
        run_s: float,
        ttft_s: float | None,
        prompt_tokens: int | None,
        completion_tokens: int | None,
    ) -> None:
        """A run that ended with an answer: dispatch to end ``run_s``, dispatch to first
        token ``ttft_s`` (None: it streamed nothing before its answer)."""
        first = ttft_s if ttft_s is not None else run_s
        self.prompt_tokens += prompt_tokens or 0
        self.completion_tokens += completion_tokens or 0
        if self.samples:
            self.run_spread_s = self._mix(self.run_spread_s, abs(run_s - self.run_s))
        self.run_s = self._mix(self.run_s, run_s)
        self.ttft_s = self._mix(self.ttft_s, first)
        if prompt_tokens and first > 0:
            self.prefill_tokens_per_s = self._mix(self.prefill_tokens_per_s, prompt_tokens / first)
        decode_s = run_s - first
        if completion_tokens and completion_tokens > 1 and decode_s > 0:
            self.decode_tokens_per_s = self._mix(
                self.decode_tokens_per_s, (completion_tokens - 1) / decode_s
            )
        self.samples += 1

    def dispatched(self, *, preempted: bool) -> None:
        """A run was dispatched (False) or preempted (True)."""
        self.preempted_share += PREEMPTED_WEIGHT * (float(preempted) - self.preempted_share)

    def _mix(self, old: float, new: float) -> float:
        return new if self.samples == 0 else old + EWMA_WEIGHT * (new - old)

    def predict_ttft(
        self, *, ahead: int, free: int, capacity: int, urgent_share: float = 0.0
    ) -> float | None:
        """Seconds until a new request's first token: the ``ahead - free + 1``-th request
        in line leaves the queue once that many runs ended, ``capacity`` runs of
        ``run_s + run_spread_s`` each ending at once, of which ``urgent_share`` go to
        more urgent requests that arrive meanwhile and pass it, and, when there are such,
        ``preempted_share`` are lost to runs they preempt (those run again, first); then
        its own time to first token. None until measured."""
        if self.samples < MIN_SAMPLES or capacity <= 0:
            return None
        in_line = max(0, ahead - free + 1)
        lost = self.preempted_share if urgent_share > 0 else 0.0
        left_for_it = max(1.0 - urgent_share - lost, MIN_SHARE)
        run_s = self.run_s + self.run_spread_s
        return in_line * run_s / (capacity * left_for_it) + self.ttft_s

    def tokens_within(self, seconds: float) -> int | None:
        """How many tokens a run may decode and still answer within ``seconds``: the
        measured decode rate over what is left after a time to first token, less
        ``DECODE_MARGIN`` (a run decodes slower than the moving mean about half the time).
        At least one; None until measured."""
        if self.samples < MIN_SAMPLES or self.decode_tokens_per_s <= 0:
            return None
        decoding_s = max(0.0, seconds - self.ttft_s)
        return max(1, int(decoding_s * self.decode_tokens_per_s * (1 - DECODE_MARGIN)))

    def promotion_lead_s(self) -> float:
        """How long before its bound a request admitted by its predicted wait is promoted
        (``Request.due_at``): DUE_RUNS runs of mean plus spread, and a time to first token."""
        return DUE_RUNS * (self.run_s + self.run_spread_s) + self.ttft_s

    def to_dict(self) -> dict[str, float | int]:
        """What stats show under ``throughput``."""
        return {
            "samples": self.samples,
            "run_s": round(self.run_s, 4),
            "run_spread_s": round(self.run_spread_s, 4),
            "preempted_share": round(self.preempted_share, 4),
            "ttft_s": round(self.ttft_s, 4),
            "prefill_tokens_per_s": round(self.prefill_tokens_per_s, 1),
            "decode_tokens_per_s": round(self.decode_tokens_per_s, 1),
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
        }
