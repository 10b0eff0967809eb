"""A one-call worker's next request, sent while it runs one: the rules, as pure functions.

A worker with ``max_batch_size = 1`` runs one request at a time. Sent its next request
only once the pool has read its answer, it waits a round trip between two requests (its
answer to the supervisor, the supervisor's wake-up, the next request back), which is
what held the pool under ``ProcessPoolExecutor`` (which queues the next task in the
worker's pipe ahead). With ``PoolConfig.prefetch`` a busy one-call worker holds one run
more, ``Run.prefetched``: it waits in the worker's socket, and the worker reads it as
soon as it has answered the current one (``worker.serve`` needs nothing more). The
dispatcher keeps these rules:

- How many (:func:`depth`): one, and more when the pool's runs are so short that a
  worker would answer its prefetched one before the next reached it (an echo, a short
  embedding): then it holds as many as fill ``PREFETCH_WINDOW_S`` of measured runs, up
  to ``MAX_PREFETCHED``. Otherwise it sleeps between two batches, and waking a sleeping
  process costs more than such a run (the supervisor's ``send`` pays for it); several
  runs sent in one turn also go in one write. While runs stay that short, a request
  waits about that window behind the runs ahead of it on its worker; the mean is the
  pool's, so after a burst of tiny requests a long one can have a few behind it until
  an idle worker takes them back (:func:`recalls`, newest first).

- Which worker takes one (:func:`capacity`): a serving one-call worker that is not due
  to retire, nor would be after its current run (``max_requests_per_worker``).
- A prefetched run has not started: it gets its attempt deadline and the stall clock
  when the current run's answer arrives (``Dispatcher._promote``). Its request's deadline
  and its caller's cancel end it at once through its cancel word, which the worker reads
  before it starts a request (``worker._read_attempt`` answers "cancelled" without
  running it); the worker is never signalled for it.
- It is never charged: a worker that dies with it puts it back at the front of the queue.
- It is taken back (:func:`recalls`) when a worker could start it now (one is idle, with
  nothing queued for it), when a more urgent request is queued, and when its worker may
  no longer take one (retiring, a spare, stopping): a request must not wait behind
  another's generation while a worker stands idle, nor ahead of one that goes first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from modelpool.scheduling.queueing import promoted
from modelpool.scheduling.views import RunT, WorkerT
from modelpool.shared.config import PoolConfig

# Prefetched work a one-call worker may hold behind its current run, in measured runs.
PREFETCH_WINDOW_S = 0.001
MAX_PREFETCHED = 4


def depth(run_s: float) -> int:
    """How many runs a busy one-call worker holds behind its current one, from the pool's
    moving mean run time (``WaitPredictor.run_s``; 0 before any run ended): one, or as
    many as fill ``PREFETCH_WINDOW_S``, at most ``MAX_PREFETCHED``.

    >>> depth(0.0), depth(0.02), depth(0.0004), depth(0.00005)
    (1, 1, 2, 4)
    """
    if run_s <= 0:
        return 1
    return max(1, min(MAX_PREFETCHED, int(PREFETCH_WINDOW_S / run_s)))


def capacity(
    worker: WorkerT,
    config: PoolConfig,
    retire_reason: Callable[[WorkerT], str | None],
    prefetched: int = 1,
) -> int:
    """The runs ``worker`` may hold now: its slots, and on a one-call worker
    ``prefetched`` more (:func:`depth`), as many as it may still serve."""
    if not config.prefetch or worker.slots != 1 or not _may_hold_one(worker, retire_reason):
        return worker.slots
    held = worker.slots + prefetched
    limit = config.max_requests_per_worker
    if limit is not None:
        # Its requests left before it retires: nothing may wait behind its last one.
        held = min(held, limit - worker.requests)
    return max(worker.slots, held)


def recalls(
    prefetched: Iterable[RunT],
    workers: Iterable[WorkerT],
    retire_reason: Callable[[WorkerT], str | None],
    most_urgent_queued: int | None,
    *,
    queued: int,
    now: float,
    aging_s: float,
) -> list[RunT]:
    """The prefetched runs to take back now, newest first (see the module docstring):
    the ones furthest from starting on their worker go first to an idle one, and put
    back at the front of the queue one by one in this order they keep their own.
    ``most_urgent_queued``: the lowest priority number in the queue (None: it is empty);
    ``queued``: how many requests the queue holds, which idle workers take first (taking
    one back costs a round trip, and a worker that answered two requests in one read is
    idle for a moment under a full queue: it must not pull work off the others).
    A promoted request (past ``aging_s``, or due: ``queueing.promoted``) is not taken back
    for a more urgent one: it goes ahead of every younger request anyway
    (``queueing.dispatch_order``), and would come straight back."""
    waiting = list(prefetched)[::-1]
    if not waiting:
        return []
    by_id = {worker.id: worker for worker in workers}
    idle = -queued + sum(
        1
        for worker in by_id.values()
        if worker.state == "idle"
        and not worker.runs
        and _may_hold_one(worker, retire_reason)
        and not worker.stopping
    )
    taken: list[RunT] = []
    for run in waiting:
        outranked = (
            most_urgent_queued is not None
            and most_urgent_queued < run.owner.priority
            and not promoted(run.owner, now=now, aging_s=aging_s)
        )
        worker = by_id.get(run.worker.id)
        if outranked or worker is None or not _may_hold_one(worker, retire_reason):
            taken.append(run)
        elif idle > 0:
            idle -= 1
            taken.append(run)
    return taken


def _may_hold_one(worker: WorkerT, retire_reason: Callable[[WorkerT], str | None]) -> bool:
    return (
        worker.role == "serving"
        and not worker.stopping
        and not worker.signalled
        and retire_reason(worker) is None
    )
