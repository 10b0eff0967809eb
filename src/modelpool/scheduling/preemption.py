"""Preemption for priority: which running attempts give their slot to more urgent requests,
and how a preempted request's rerun continues its caller's stream.

With ``preempt_for_priority`` (the default), when requests are still queued after
``_pump`` placed what it could and no open worker has a free slot, the dispatcher asks
:func:`choose_victims` which running attempts to preempt: for each waiting request, most
urgent first, the least urgent running attempt of a strictly less urgent priority (of
those, the one preempted fewest times, then the one started last: it loses the least
work), never one promoted (by aging, or due: ``queueing.promoted``) nor one whose
deadline leaves too little time to run again (``min_time_left_s``, twice the measured
run, from the dispatcher: it would time out rather than answer), never more than the
waiting requests that a slot already on its way (a preempted attempt still winding
down, its slot not yet handed over) does not cover. The dispatcher soft-cancels each
victim, records its attempt as "preempted" (not charged to its retries) and queues its
request again first of its priority, and sends the waiting request it was chosen for to
the victim's worker at once, with the cancel (the slot is handed over, placement's rules
permitting: :func:`handover_capacity`): the worker lets the victim go at its next token
or step and starts the urgent request at the same point, a batched one in the same
step, rather than after a round trip through the pool. The victim and the request it
gives way to hold a cancel word each meanwhile (:func:`cancel_words`)::

    if worth_looking(priorities.waiting, workers.values()):
        pairs = choose_victims(waiting, workers.values(), now=clock(), aging_s=10.0)

A rerun starts again from the prompt (the prefix cache makes the prompt cheap to read
again). A request whose caller was shown text is preempted only when its rerun gives the
same text (greedy or seeded: ``Request.reproducible``); the dispatcher then drops what
the caller saw already (``Run.continue_stream``), so the stream reads as one answer, no
token twice and none lost; a rerun that says otherwise (a backend that is not
deterministic after all) is reported as diverged, and the dispatcher fails the request
rather than send a contradiction.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

from modelpool.scheduling import prefetch
from modelpool.scheduling.prefetch import MAX_PREFETCHED
from modelpool.scheduling.queueing import promoted
from modelpool.scheduling.views import RequestT, RunT, RunView, WorkerT, WorkerView
from modelpool.shared.config import PoolConfig


def cancel_words(slots: int) -> int:
    """The cancel words a worker of ``slots`` runs gets: a batched worker's rows and as
    many again for the requests handed the rows of preempted ones while those wind down;
    a one-call worker's run and its prefetched ones (``modelpool.scheduling.prefetch``), a request
    handed its slot being one of those."""
    return max(2 * slots, 1 + MAX_PREFETCHED)


def handover_capacity(
    worker: WorkerT, config: PoolConfig, retire_reason: Callable[[WorkerT], str | None]
) -> int:
    """The runs ``worker`` may hold when preempted runs hand their slots over: its slots
    and one for each run winding down there (preempted, or prefetched and taken back:
    the worker answers it unrun), within its cancel words. On a one-call worker the
    request handed the slot is a prefetched run behind the victim, so prefetch's rules
    hold as well (``prefetch.capacity``: none where the pool does not prefetch, nor
    behind a worker due to retire or behind its last request, which the victim may be)."""
    _, live = _tally(worker)
    held = min(worker.slots + len(worker.runs) - live, cancel_words(worker.slots))
    if worker.slots == 1:
        held = min(held, prefetch.capacity(worker, config, retire_reason, MAX_PREFETCHED))
    return held


def preemptible(run: RunView, *, now: float, aging_s: float, min_time_left_s: float = 0.0) -> bool:
    """May ``run`` give its slot to a more urgent request. Not when its deadline leaves
    less than ``min_time_left_s``: it would not finish a rerun, and preempting it would
    turn an answer almost done into a timeout."""
    request = run.request
    return (
        request is not None
        and request.deadline - now >= min_time_left_s
        and not run.cancel_sent
        and not run.alone
        and run.worker.state == "busy"
        and run.worker.role == "serving"
        and not promoted(request, now=now, aging_s=aging_s)  # it has waited enough
        and (request.reproducible or not request.streamed)
    )


def worth_looking(
    waiting_by_priority: Mapping[int, int], workers: Iterable[WorkerView[RunView]]
) -> bool:
    """Is a request waiting more urgent than one running (the cheap check, first)."""
    if not waiting_by_priority:
        return False
    most_urgent = min(waiting_by_priority)
    return any(
        run.request is not None and not run.prefetched and run.request.priority > most_urgent
        for worker in workers
        for run in worker.runs.values()
    )


def choose_victims(
    order: Sequence[RequestT],
    workers: Iterable[WorkerView[RunT]],
    *,
    now: float,
    aging_s: float,
    min_time_left_s: float = 0.0,
) -> list[tuple[RunT, RequestT]]:
    """The running attempts to preempt for the waiting requests ``order`` (in dispatch
    order; see the module docstring). The cost is the number of running attempts plus
    the victims, not the queue's length. Each victim comes with the waiting request it was
    chosen for."""
    workers = list(workers)
    running = [run for worker in workers for run in worker.runs.values() if not run.prefetched]
    freeing = sum(_unclaimed(worker) for worker in workers)  # slots already on their way
    candidates = sorted(
        (
            run
            for run in running
            if preemptible(run, now=now, aging_s=aging_s, min_time_left_s=min_time_left_s)
        ),
        key=_cost_order,
    )
    victims: list[tuple[RunT, RequestT]] = []
    for waiting in order:
        if not candidates:
            break
        aged = promoted(waiting, now=now, aging_s=aging_s)
        if _priority(candidates[-1]) <= waiting.priority:
            if aged:
                continue  # promoted ahead of its priority: the ones after it may preempt
            break  # the rest wait at the same priority or a less urgent one
        if waiting.isolated:
            continue  # it needs an empty worker: one freed slot does not make one
        if freeing > 0:
            freeing -= 1  # a slot on its way is this one's
            continue
        victims.append((candidates.pop(), waiting))
    return victims


def _unclaimed(worker: WorkerView[RunView]) -> int:
    """Slots of ``worker`` that preempted runs will free and no run was sent for yet (a
    run handed one over, or prefetched behind the victim, claims it)."""
    preempted, live = _tally(worker)
    return max(0, min(preempted, worker.slots - live))


def _tally(worker: WorkerView[RunView]) -> tuple[int, int]:
    """``worker``'s preempted runs, and its live ones: neither preempted nor taken back
    (prefetched runs count: each will take a slot)."""
    preempted = live = 0
    for run in worker.runs.values():
        if run.preempted:
            preempted += 1
        elif not run.recalled:
            live += 1
    return preempted, live


def _priority(run: RunView) -> int:
    assert run.request is not None
    return run.request.priority


def _cost_order(run: RunView) -> tuple[int, int, float]:
    """Sorted by this, the last is the first to preempt: the least urgent, then the one
    preempted fewest times (no request is preempted over and over while others run on),
    then the one started last (it loses the least work)."""
    assert run.request is not None
    request = run.request
    return (request.priority, -request.preemptions, run.started_at)
