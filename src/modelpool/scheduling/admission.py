"""Admission by predicted wait (``max_queue_time_s``), and when an admitted request is
promoted: the arithmetic the pool's ``check_admission`` and the daemon apply.

A new request is refused at once (``QueueFull``, a 429 in the daemon) when its predicted
time to first token (``prediction.WaitPredictor.predict_ttft``) passes its bound: the
lower of ``max_queue_time_s`` and its deadline. The prediction counts each queued run
ahead of it from its own size (``sizes``): its prompt at the measured prefill rate, its
expected output at the measured decode rate, over the pool's slots. An admitted request
is due (promoted ahead of every younger request, ``ordering``) a few runs before its
deadline, so that more urgent requests arriving after it do not keep it past its bound.
Pure functions over what the dispatcher publishes for callers' threads
(:class:`QueueState`)::

    due_in_s = judge(state, capacity=4, priority=0, limit_s=2.0, deadline_s=30.0)
    due_at = promotion_at(state.predictor, now, due_in_s)
"""

from __future__ import annotations

import math
from typing import Protocol

from modelpool.scheduling.prediction import WaitPredictor
from modelpool.scheduling.queueing import PriorityCounts, ahead_of, urgent_share
from modelpool.scheduling.sizes import InFlight, RunSize, Work
from modelpool.shared.errors import QueueFull


class QueueState(Protocol):
    """What the dispatcher publishes for callers' threads: each field replaced whole."""

    @property
    def predictor(self) -> WaitPredictor: ...

    @property
    def priorities(self) -> PriorityCounts: ...

    @property
    def free_slots(self) -> int: ...

    @property
    def in_flight(self) -> InFlight: ...

    def clock(self) -> float: ...


def predicted_ttft(
    state: QueueState,
    *,
    capacity: int,
    priority: int,
    also_waiting: int = 0,
    size: RunSize | None = None,
    spread: bool = True,
) -> float | None:
    """Seconds a new request of ``priority`` (and ``size``, when known) would wait for its
    first token: what is left of the runs on workers, the work queued ahead of it (lower
    or equal priority), plus
    ``also_waiting`` runs held elsewhere (the daemon's fair share, of unknown size: at the
    mean run), over the share of the slots that recent dispatches left to its priority;
    with ``spread``, plus the mean deviation of such predictions. None before enough runs
    were measured."""
    priorities = state.priorities
    return state.predictor.predict_ttft(
        ahead=ahead_of(priorities.work, priority) + Work(unsized=also_waiting),
        free=state.free_slots,
        capacity=capacity,
        urgent_share=urgent_share(priorities.dispatched, priority),
        size=size,
        in_flight=state.in_flight,
        now=state.clock(),
        spread=spread,
    )


def judge(
    state: QueueState,
    *,
    capacity: int,
    priority: int,
    limit_s: float | None,
    deadline_s: float,
    also_waiting: int = 0,
    size: RunSize | None = None,
) -> float | None:
    """Raise ``QueueFull`` if a new request's predicted time to first token passes
    ``limit_s`` (``max_queue_time_s``) or ``deadline_s``. No bound, or no prediction
    yet: nothing is refused. Returns the seconds by which the request, admitted by its
    prediction, is to leave the queue, its deadline (None when none was judged): the
    ``due_in_s`` of :func:`promotion_at`. Not ``limit_s``: admitted ones are promoted only
    to keep them from timing out; promoting them at the bound would put nearly every one
    ahead of the more urgent requests."""
    if limit_s is None or limit_s == math.inf:
        return None
    predicted = predicted_ttft(
        state, capacity=capacity, priority=priority, also_waiting=also_waiting, size=size
    )
    if predicted is None:
        return None
    bound = min(limit_s, deadline_s)
    if predicted <= bound:
        return deadline_s
    which = "max_queue_time_s" if limit_s <= deadline_s else "the deadline"
    raise QueueFull(
        f"the predicted time to first token ({predicted:.2f} s) passes {which} "
        f"({bound:g} s): not queued",
        predicted_ttft_s=predicted,
        retry_after_s=predicted - bound,
    )


def promotion_at(predictor: WaitPredictor, now: float, due_in_s: float | None) -> float:
    """When a request admitted at ``now`` with ``due_in_s`` (:func:`judge`) is promoted
    ahead of every younger request: its deadline, less a few runs' time for it to reach a
    slot and answer (``WaitPredictor.promotion_lead_s``). Never, without a bound."""
    if due_in_s is None:
        return math.inf
    return now + max(0.0, due_in_s - predictor.promotion_lead_s())
