"""Where queued requests run: the placement rules, as pure functions over worker records.

The dispatcher calls :func:`open_workers` and :func:`assign` from ``_pump`` after every
batch of events, and :func:`room_elsewhere` on a batched worker's room report (to ask
back a request that waits there for KV room). Nothing here changes a record; the
dispatcher dispatches what :func:`assign` returns.

The rules, in order of precedence:

- Only warm serving workers with a free slot take requests (a busy one-call worker has
  one more, for a prefetched request: ``modelpool.scheduling.prefetch``); a batched worker is closed
  while an isolated request runs alone on it, while it is due for retirement, and while
  requests sent to it wait there for KV room (a new one would wait behind them: it waits
  in the pool instead, where stats show it, and goes to the first worker with room).
- A retry never goes back to the worker it last failed on (``last_failed_worker``).
- On batched workers an isolated request needs an empty worker (and reserves the next
  one to drain, so it is not starved), and the suspects of a lost batch are spread one
  per worker (see ``Retries.batch_lost``).
- Otherwise the worker whose prefix cache holds the longest part of the request's prompt
  (its last report's fingerprints, ``modelpool.shared.prefixes``), unless it runs more than
  ``PREFIX_LOAD_SLACK`` requests beyond the least loaded; then the least loaded first,
  counting what this round already placed, then the most free KV room: a new request
  starts at once in the emptiest batch, and requests placed together spread over idle
  workers. The workers report their fingerprints after every change, evictions
  included, so the pool never prefers a worker for what it has dropped; a worker that
  is replaced starts with no report, as its cache starts empty.
- The prefix cache tiers (``shared.prefix_tier``: host memory, disk) hold prefixes any
  worker of the model restores: what they hold of the prompt (``tier_fingerprints``, their
  entries' fingerprints, of every partition: a chain matches only its own) counts as
  held by every worker, so a worker's own hit beats the least loaded only where it is
  longer than the tiers'. A busy holder of a prefix the tiers hold is then no better than
  an idle worker, which restores it instead of the request sharing the holder's batch;
  at equal load, a worker's own hit still wins (a memory hit, no restore).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from modelpool.scheduling.views import RequestT, RequestView, RunView, WorkerT, WorkerView
from modelpool.shared.prefixes import matched_units

PREFIX_LOAD_SLACK = 1
"""A worker holding a request's prefix takes it while running at most this many requests
more than the least loaded one: the prefill it saves is worth a slot, not a queue."""


def open_workers(
    workers: Iterable[WorkerT],
    retire_reason: Callable[[WorkerT], str | None],
    capacity: Callable[[WorkerT], int] = lambda worker: worker.slots,
) -> list[WorkerT]:
    """The workers that may take a request now. ``capacity``: the runs a worker may hold,
    its slots and any prefetched one (``modelpool.scheduling.prefetch``)."""
    return [
        worker
        for worker in workers
        if worker.state in ("idle", "busy")
        and worker.role == "serving"
        and len(worker.runs) < capacity(worker)
        and not any(run.alone for run in worker.runs.values())
        and not (worker.slots > 1 and retire_reason(worker) is not None)
        # One with requests waiting for KV room has rows running, which will leave.
        and not worker.waiting_attempts
    ]


def assign(
    queue: Iterable[RequestT],
    candidates: list[WorkerT],
    capacity: Callable[[WorkerT], int] = lambda worker: worker.slots,
    tier_fingerprints: frozenset[int] = frozenset(),
) -> list[tuple[RequestT, WorkerT]]:
    """Queued requests and the worker each goes to, in queue order, stopping as soon as
    the free slots are spoken for: the cost is the number of free slots, not the length
    of the queue. ``tier_fingerprints``: what the prefix cache tiers hold, for every
    worker."""
    size = {w.id: capacity(w) for w in candidates}
    free = {w.id: size[w.id] - len(w.runs) for w in candidates}
    suspects = {w.id for w in candidates if any(r.owner.suspect for r in w.runs.values())}
    assignments: list[tuple[RequestT, WorkerT]] = []
    for request in queue:
        choice = _choose(request, candidates, size, free, suspects, tier_fingerprints)
        if choice is None:
            if request.isolated:
                # It waits for an empty worker: let one drain rather than starve it.
                reserved = next((w for w in candidates if free[w.id] > 0), None)
                if reserved is not None:
                    free[reserved.id] = 0
            continue
        # An isolated request runs alone: nothing else goes to its worker meanwhile.
        free[choice.id] = 0 if choice.slots > 1 and request.isolated else free[choice.id] - 1
        if request.suspect:
            suspects.add(choice.id)
        assignments.append((request, choice))
        if not any(free.values()):
            break
    return assignments


def room_elsewhere(
    worker: WorkerT, workers: Iterable[WorkerT], retire_reason: Callable[[WorkerT], str | None]
) -> bool:
    """Could another worker take a request now (see :func:`open_workers`)?"""
    return any(other is not worker for other in open_workers(workers, retire_reason))


def prefix_held(request: RequestView, worker: WorkerView[RunView]) -> int:
    """How many leading units of the request's prompt (messages, text or id blocks: see
    ``modelpool.shared.prefixes``) the worker's prefix cache holds, as it last reported."""
    report = worker.prefix_cache
    if report is None or not request.prefix_fingerprints:
        return 0
    return matched_units(request.prefix_fingerprints, report.fingerprints)


def tier_held(request: RequestView, tier_fingerprints: frozenset[int]) -> int:
    """How many leading units of the request's prompt the prefix cache tiers hold, as
    their latest walk found them (``supervisor.tier_watch``): any worker restores them."""
    if not tier_fingerprints or not request.prefix_fingerprints:
        return 0
    return matched_units(request.prefix_fingerprints, tier_fingerprints)


def _choose(
    request: RequestView,
    candidates: list[WorkerT],
    size: dict[int, int],
    free: dict[int, int],
    suspects: set[int],
    tier_fingerprints: frozenset[int],
) -> WorkerT | None:
    """The worker ``request`` goes to now, if any (see the module docstring)."""
    eligible = []
    for worker in candidates:
        if free[worker.id] <= 0 or worker.id == request.last_failed_worker:
            continue
        if worker.slots > 1:
            if request.isolated and (worker.runs or free[worker.id] < worker.slots):
                continue
            if request.suspect and worker.id in suspects:
                continue
        eligible.append(worker)
    if not eligible:
        return None
    least = min(size[worker.id] - free[worker.id] for worker in eligible)
    in_tiers = tier_held(request, tier_fingerprints)

    def preference(worker: WorkerT) -> tuple[int, int, int, int]:
        load = size[worker.id] - free[worker.id]
        # A one-call worker's prefix counts only if it would start the request now, not
        # hold it prefetched behind another while a worker is idle.
        starts_now = load < worker.slots
        own = held = 0
        if load <= least + PREFIX_LOAD_SLACK and starts_now:
            own = prefix_held(request, worker)
            held = max(own, in_tiers)
        return (-held, load, -own, -(worker.kv_free_tokens or 0))

    return min(eligible, key=preference)
