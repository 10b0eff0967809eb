"""The pool's schedule, one step at a time: what the dispatcher's ``_pump`` applies after
every batch of events (vLLM's ``schedule()`` and its ``SchedulerOutput``, one level up).

Each step reads the records as the previous step's plan left them once applied, and
returns a plan; the dispatcher applies it (it alone writes the records):

1. :func:`take_back`: the prefetched runs to take back (``prefetch.recalls``), which the
   dispatcher puts back at the front of the queue;
2. :func:`place`: the queued requests and the worker each goes to, in dispatch order
   (``queueing.dispatch_order``, ``placement.assign``), and whether to look for runs to
   preempt: every open worker full and a waiting request more urgent than a running one;
3. :func:`victims`: the running attempts that give way to the requests still waiting
   (``preemption.choose_victims``), never one whose deadline leaves less than two mean
   runs (it would time out rather than answer);
4. :func:`hand_over`: those requests sent at once into the slots their victims let go
   (``preemption.handover_capacity``), placement's rules permitting.

::

    placed = place(queue.values(), workers, config=config, retire_reason=retire, ...)
    for request, worker in placed.dispatch: ...
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Generic

from modelpool.scheduling import placement, preemption, prefetch
from modelpool.scheduling.queueing import dispatch_order
from modelpool.scheduling.views import RequestT, RunT, WorkerT, WorkerView
from modelpool.shared.config import PoolConfig


@dataclass(frozen=True)
class Placed(Generic[RequestT, WorkerT]):
    """Step 2's plan: the requests to dispatch, each with its worker; the order they
    were considered in (step 3 reads it, once they left the queue); and whether step 3
    is to run."""

    dispatch: list[tuple[RequestT, WorkerT]]
    order: Iterable[RequestT]
    look_for_victims: bool


def take_back(
    prefetched: Iterable[RunT],
    workers: Iterable[WorkerT],
    retire_reason: Callable[[WorkerT], str | None],
    waiting_by_priority: Mapping[int, int],
    *,
    queued: int,
    now: float,
    aging_s: float,
) -> list[RunT]:
    """Step 1: the prefetched runs to take back now, newest first (``prefetch.recalls``)."""
    most_urgent = min(waiting_by_priority) if waiting_by_priority else None
    return prefetch.recalls(
        prefetched, workers, retire_reason, most_urgent, queued=queued, now=now, aging_s=aging_s
    )


def place(
    queue: Iterable[RequestT],
    workers: Collection[WorkerT],
    *,
    config: PoolConfig,
    retire_reason: Callable[[WorkerT], str | None],
    waiting_by_priority: Mapping[int, int],
    run_s: float,
    now: float,
    tier_fingerprints: frozenset[int] = frozenset(),
) -> Placed[RequestT, WorkerT]:
    """Step 2 (see the module docstring). ``run_s``: the pool's mean run, which sets how
    many runs a one-call worker holds prefetched (``prefetch.depth``);
    ``tier_fingerprints``: what the prefix cache tiers hold (``placement.assign``)."""
    may_preempt = config.preempt_for_priority and preemption.worth_looking(
        waiting_by_priority, workers
    )
    # While a waiting request could preempt, nothing is prefetched: an urgent request
    # held behind a less urgent run would wait for it instead of taking its slot.
    capacity = _slots_only if may_preempt else _capacities(workers, config, retire_reason, run_s)
    open_workers = placement.open_workers(workers, retire_reason, capacity)
    if not open_workers and not may_preempt:
        return Placed([], (), False)
    order = dispatch_order(
        queue, now=now, aging_s=config.priority_aging_s, priorities=len(waiting_by_priority)
    )
    dispatch = placement.assign(order, open_workers, capacity, tier_fingerprints)
    sent = {worker.id: 0 for worker in open_workers}
    for _, worker in dispatch:
        sent[worker.id] += 1
    # A free slot left: what still waits waits for a rule, not a slot.
    full = all(len(w.runs) + sent[w.id] >= w.slots for w in open_workers)
    return Placed(dispatch, order, may_preempt and full)


def victims(
    placed: Placed[RequestT, WorkerT],
    workers: Iterable[WorkerView[RunT]],
    *,
    still_waiting: Callable[[RequestT], bool],
    now: float,
    aging_s: float,
    run_s: float,
) -> list[tuple[RunT, RequestT]]:
    """Step 3: the running attempts to preempt for the requests of ``placed.order`` that
    ``still_waiting`` (each with the request it gives way to)."""
    if not placed.look_for_victims:
        return []
    waiting = [request for request in placed.order if still_waiting(request)]
    return preemption.choose_victims(
        waiting, workers, now=now, aging_s=aging_s, min_time_left_s=2 * run_s
    )


def hand_over(
    workers: Iterable[WorkerT],
    requests: Iterable[RequestT],
    *,
    config: PoolConfig,
    retire_reason: Callable[[WorkerT], str | None],
) -> list[tuple[RequestT, WorkerT]]:
    """Step 4: ``requests`` and the worker of a run just preempted for each, into the
    slots those runs let go (``preemption.handover_capacity``); a request a worker may
    not take there waits for a slot as before."""

    def capacity(worker: WorkerT) -> int:
        return preemption.handover_capacity(worker, config, retire_reason)

    open_workers = placement.open_workers(dict.fromkeys(workers), retire_reason, capacity)
    return placement.assign(requests, open_workers, capacity)


def _capacities(
    workers: Iterable[WorkerT],
    config: PoolConfig,
    retire_reason: Callable[[WorkerT], str | None],
    run_s: float,
) -> Callable[[WorkerT], int]:
    """The runs each worker may hold now (``prefetch.capacity``), worked out once for a
    step: placement asks it for every worker, more than once."""
    prefetched = prefetch.depth(run_s)
    held = {
        worker.id: prefetch.capacity(worker, config, retire_reason, prefetched)
        for worker in workers
    }
    return lambda worker: held[worker.id]


def _slots_only(worker: WorkerView[RunT]) -> int:
    """The runs ``worker`` may hold when nothing is to be prefetched: its slots."""
    return worker.slots
