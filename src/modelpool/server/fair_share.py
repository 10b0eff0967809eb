"""Fair share of the pool between the daemon's clients.

The pool's queue is first come, first served: one request with ``n=128`` puts 128 runs
ahead of everyone else's, and a client that keeps sending such requests starves the
others. So the daemon lets at most the pool's capacity (workers x max_batch_size) of
runs into the pool at once and holds the rest here; whenever a run ends, the next run
of the next client in turn goes in (round robin between clients, first come first
served within one). A client is its address: every client shares the one API key.

Priority (the request's ``priority``, lower first) comes before the turn: the next run
in is one of the lowest priority waiting, and fair share applies between the clients
that have one of that priority. A run that has waited ``aging_s`` counts as the most
urgent (the pool's ``priority_aging_s``), so that no priority starves another, and so
does a run admitted by its predicted wait once its ``due_at`` came (``ModelPool.
promotion_at``, a few runs before its deadline): an accepted run must not time out
waiting. A run ages on one clock, from its request's arrival here: its slot hands that
time to the pool (``queueing.arrived_at``), which ages it from then too, so that its wait
is bounded by ``aging_s`` end to end, not by ``aging_s`` here and again in the pool.

With ``preempt`` (the pool's ``preempt_for_priority``) a run more urgent than some run
in the pool goes in even when the pool is full, one beyond capacity for each less urgent
run in the pool: the pool then preempts one of those for it (``preemption.py``); the
share lets in at most as many such runs as there are less urgent ones to preempt. Such
a run is charged to its client as two runs while it holds its place, itself and the run
it displaces (which must run again), unless the run the pool will preempt is likely its
client's own (its client has a run of the least urgent priority in the pool): it goes
in only where its client's ``max_running`` has room for both (or its client holds
nothing: a pool of one may still be preempted once), so that a client whose urgent runs
preempt others pays for the preempted work, and with the default share (the whole
pool) holds at most half of it while it preempts.

Round robin alone would let a client whose runs are long
fill every worker between two requests of a client whose runs are short, which would
then wait a whole long run each time. So a free place in the pool is held back for each
other active client that has nothing running (one that sent a request within
``ACTIVE_WINDOW_S``): a client with runs in the pool takes another only when more
places are free than that. A client alone uses the whole pool.

Each client may hold ``max_running`` runs in the pool and ``max_queued`` more waiting;
a request that would take it past that is refused at once (429 ``client_limit``, with
Retry-After), and so is one that would make the runs waiting here, all clients
together, more than the pool's ``max_queue`` (429 ``pool_overloaded``)::

    share = FairShare(capacity=2, max_running=None, max_queued=256, max_waiting=1024)
    ticket = share.reserve("10.0.0.7", runs=4)        # or ApiError 429
    try:
        async with ticket.slot(deadline_s=30.0) as left_s:
            await pool.agenerate(prompt, deadline_s=left_s)
    finally:
        ticket.close()                               # unused reservations go back
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

from modelpool.scheduling.ordering import Urgency, promotion_at, urgency
from modelpool.scheduling.queueing import arrived_at
from modelpool.server.http import ApiError
from modelpool.shared.errors import DeadlineExceeded

# A client's own (max_running, max_queued); None in either is the share's.
Limits = tuple[int | None, int | None]
# Seconds a refused client should wait: runs of the testing or a real model end quickly.
RETRY_AFTER_S = 1
# A client that sent a request this recently counts as active though it has nothing in
# flight now (a client sending one request after another is between two of them).
ACTIVE_WINDOW_S = 1.0


class FairShare:
    """Round-robin admission of runs into the pool, with per-client bounds."""

    def __init__(
        self,
        *,
        capacity: int,
        max_running: int | None,
        max_queued: int,
        max_waiting: int,
        aging_s: float = 10.0,
        preempt: bool = False,
    ) -> None:
        self.capacity = capacity
        self.preempt = preempt
        # The runs in the pool by priority (all, and each client's): what a more urgent
        # run could preempt.
        self._in_pool_by_priority: collections.Counter[int] = collections.Counter()
        self._client_priorities: dict[str, collections.Counter[int]] = {}
        self._max_running_asked = max_running
        self.max_running = min(max_running or capacity, capacity)
        self.max_queued = max_queued
        self.max_waiting = max_waiting
        self._running: collections.Counter[str] = collections.Counter()
        # Runs let in to preempt another client's: each counts once more against its
        # client's max_running while it holds its place (the work it displaced).
        self._charged: collections.Counter[str] = collections.Counter()
        self._reserved: collections.Counter[str] = collections.Counter()
        # Requests still being parsed and checked (server.checks): each counts as a run.
        self._checking: collections.Counter[str] = collections.Counter()
        self.aging_s = aging_s
        # Clients with runs waiting, in turn order; each with its runs, oldest first.
        self._waiters: dict[str, collections.deque[_Waiter]] = {}
        self._in_pool = 0
        self._last_active: dict[str, float] = {}
        # Clients with limits of their own (tenants): (max_running, max_queued), None for
        # the share's.
        self._limits: dict[str, Limits] = {}
        self._recheck: asyncio.TimerHandle | None = None

    def reserve(
        self,
        client: str,
        runs: int,
        limits: Limits | None = None,
        priority: int = 0,
        due_at: float = math.inf,
    ) -> Ticket:
        """Room for ``runs`` more runs of ``client``, or a 429 saying which bound it met;
        ``limits`` are the client's own (a tenant's), else the share's. From ``due_at``
        (monotonic) on, its waiting runs count as the most urgent."""
        held = self._running[client] + self._reserved[client] + self._checking[client]
        if held + runs > self._bound(client, limits):
            raise ApiError(
                429,
                f"this client has {held} runs in flight or waiting; {runs} more would pass "
                f"its share ({self.max_running} running + {self.max_queued} waiting: "
                "[server] client_max_running, client_max_queued)",
                type="rate_limit_error",
                code="client_limit",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        waiting = sum(self._reserved.values())
        if waiting + runs > self.max_waiting + self.capacity - self._in_pool:
            raise ApiError(
                429,
                f"{waiting} runs are waiting for a worker; {runs} more would pass max_queue "
                f"({self.max_waiting})",
                type="overloaded_error",
                code="pool_overloaded",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        self._reserved[client] += runs
        self._last_active[client] = time.monotonic()
        return Ticket(self, client, runs, priority, due_at)

    def waiting_ahead(self, client: str, priority: int) -> int:
        """Runs waiting here that a new run of ``client`` at ``priority`` would wait
        behind: its client's own of that priority or a more urgent one, every more urgent
        (or promoted) one of the others, and of each other client's of the same priority
        one per turn of its client's ahead of it (round robin), none for the first turn
        of a client with nothing running while the other has runs in the pool (a place
        is held back for it): another client's backlog delays it by at most one run per
        round, not by the whole backlog."""
        now = time.monotonic()
        mine = urgency(priority, promoted_at=math.inf, now=now)
        own = sum(
            waiter.urgency(now, self.aging_s) <= mine for waiter in self._waiters.get(client, ())
        )
        idle = self._running[client] == 0
        ahead = own
        for other, waiters in self._waiters.items():
            if other == client:
                continue
            turns = own + (0 if idle and self._running[other] > 0 else 1)
            urgencies = [waiter.urgency(now, self.aging_s) for waiter in waiters]
            ahead += sum(urgency < mine for urgency in urgencies)
            ahead += min(sum(urgency == mine for urgency in urgencies), turns)
        return ahead

    def _bound(self, client: str, limits: Limits | None) -> int:
        """What ``client`` may hold (running and waiting), remembering its own limits."""
        if limits is not None:
            self._limits[client] = limits
        queued = self._limits.get(client, (None, None))[1]
        return self._max_running(client) + (self.max_queued if queued is None else queued)

    def _max_running(self, client: str) -> int:
        running = self._limits.get(client, (None, None))[0]
        return self.max_running if running is None else min(running, self.capacity)

    @contextlib.contextmanager
    def checking(self, client: str, limits: Limits | None = None) -> Iterator[None]:
        """One request of ``client`` being parsed and checked: held against its share
        like a run (429 ``client_limit`` past it), so that a client cannot queue
        unbounded work in the check threads either."""
        held = self._running[client] + self._reserved[client] + self._checking[client]
        if held + 1 > self._bound(client, limits):
            raise ApiError(
                429,
                f"this client has {held} runs and requests in flight or waiting; one more "
                f"would pass its share ({self.max_running} running + {self.max_queued} "
                "waiting: [server] client_max_running, client_max_queued)",
                type="rate_limit_error",
                code="client_limit",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        self._checking[client] += 1
        self._last_active[client] = time.monotonic()
        try:
            yield
        finally:
            self._checking[client] -= 1
            if self._checking[client] <= 0:
                del self._checking[client]

    def snapshot(self) -> dict[str, Any]:
        """What ``/stats`` shows under ``fair_share``."""
        return {
            "capacity": self.capacity,
            "in_pool": self._in_pool,
            "charged_preemptions": sum(self._charged.values()),
            "waiting": sum(len(waiters) for waiters in self._waiters.values()),
            "clients": len(set(self._running) | set(self._reserved) | set(self._checking)),
            "checking": sum(self._checking.values()),
        }

    def _unreserve(self, client: str, runs: int) -> None:
        self._reserved[client] -= runs
        if self._reserved[client] <= 0:
            del self._reserved[client]

    async def _acquire(self, client: str, priority: int, due_at: float, since: float) -> bool:
        """Wait for a place of ``client``'s run that arrived at ``since``; whether its
        place is charged as two (it went in to preempt another client's run)."""
        if client not in self._waiters and self._may_run(client, priority):
            return self._take(client, priority)
        turn: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        waiter = _Waiter(priority, since, turn, due_at)
        self._waiters.setdefault(client, collections.deque()).append(waiter)
        try:
            return await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self._release(client, priority, turn.result())  # admitted as it was cancelled
            else:
                waiters = self._waiters.get(client)
                if waiters is not None and waiter in waiters:
                    waiters.remove(waiter)
                    if not waiters:
                        del self._waiters[client]
            raise

    def _may_run(self, client: str, priority: int) -> bool:
        free = self.capacity - self._in_pool
        running = self._running[client]
        if free <= 0:
            return self.preempt and self._may_preempt(client, priority)
        if running + self._charged[client] >= self._max_running(client):
            return False
        return running == 0 or free > self._held_back(client)

    def _may_preempt(self, client: str, priority: int) -> bool:
        """The pool is full: is there a less urgent run in it that a run of ``priority``
        would preempt, and that no run let in beyond capacity already claimed. The
        client's own bound counts its less urgent runs as the ones to give way (a client
        may preempt its own background work)."""
        less_urgent = sum(n for level, n in self._in_pool_by_priority.items() if level > priority)
        own = self._client_priorities.get(client, collections.Counter())
        own_less_urgent = sum(n for level, n in own.items() if level > priority)
        held = self._running[client] + self._charged[client]
        cost = 2 if self._displaces_another(client) else 1
        return less_urgent > self._in_pool - self.capacity and (
            held + cost <= self._max_running(client) + own_less_urgent or held == 0
        )

    def _displaces_another(self, client: str) -> bool:
        """Would a run of ``client`` let in to preempt likely displace another client's
        run: the pool preempts its least urgent runs, and none of those is this client's."""
        least_urgent = max(self._in_pool_by_priority, default=None)
        own = self._client_priorities.get(client, collections.Counter())
        return least_urgent is not None and own[least_urgent] == 0

    def _held_back(self, client: str) -> int:
        """Places kept free for the other active clients that have nothing running."""
        now = time.monotonic()
        held = 0
        for other, seen in list(self._last_active.items()):
            if other in self._running or other in self._reserved:
                held += other != client and other not in self._running
            elif now - seen > ACTIVE_WINDOW_S:
                del self._last_active[other]
            else:
                held += other != client
        return held

    def _take(self, client: str, priority: int) -> bool:
        """A place for ``client``'s run; whether it is charged as two: it goes in beyond
        capacity, to preempt, and the pool's least urgent runs are none of its client's."""
        charged = self._in_pool >= self.capacity and self._displaces_another(client)
        if charged:
            self._charged[client] += 1
        self._running[client] += 1
        self._in_pool += 1
        self._in_pool_by_priority[priority] += 1
        self._client_priorities.setdefault(client, collections.Counter())[priority] += 1
        return charged

    def _release(self, client: str, priority: int, charged: bool) -> None:
        if charged:
            self._charged[client] -= 1
            if self._charged[client] <= 0:
                del self._charged[client]
        self._running[client] -= 1
        if self._running[client] <= 0:
            del self._running[client]
        self._in_pool -= 1
        self._in_pool_by_priority[priority] -= 1
        if self._in_pool_by_priority[priority] <= 0:
            del self._in_pool_by_priority[priority]
        own = self._client_priorities[client]
        own[priority] -= 1
        if own[priority] <= 0:
            del own[priority]
            if not own:
                del self._client_priorities[client]
        self._last_active[client] = time.monotonic()
        self._admit()

    def fit_to_pool(self, capacity: int) -> None:
        """Resize to the pool's real capacity, known only once it started: a registry's
        share is sized from the configuration before the load, and a pooling model's
        batch (``pooling_batch_size``) is chosen when its pool starts."""
        if capacity == self.capacity:
            return
        self.capacity = capacity
        self.max_running = min(self._max_running_asked or capacity, capacity)
        self._admit()

    def _admit(self) -> None:
        while self._in_pool < self.capacity or (self.preempt and self._waiters):
            client, waiter = self._next_waiter()
            if client is None or waiter is None:
                if self._waiters and self._recheck is None and self._in_pool < self.capacity:
                    # Held back for clients that may have gone: look again once they
                    # no longer count as active.
                    self._recheck = asyncio.get_running_loop().call_later(
                        ACTIVE_WINDOW_S, self._recheck_now
                    )
                return
            waiters = self._waiters.pop(client)
            waiters.remove(waiter)
            if waiters:
                self._waiters[client] = waiters  # to the back of the turn order
            turn = waiter.turn
            if turn.cancelled():
                # Its task was cancelled and has not run since: it takes no place.
                continue
            turn.set_result(self._take(client, waiter.priority))

    def _next_waiter(self) -> tuple[str | None, _Waiter | None]:
        """The client whose run goes in next, and that run: the most urgent run of the
        clients that may run (the first in turn order among equals), each client's
        runs taken most urgent first, oldest first within one urgency."""
        now = time.monotonic()
        best: tuple[Urgency, str, _Waiter] | None = None
        for client, waiters in self._waiters.items():
            waiter = min(waiters, key=lambda w: w.urgency(now, self.aging_s))
            if not self._may_run(client, waiter.priority):
                continue
            urgency = waiter.urgency(now, self.aging_s)
            if best is None or urgency < best[0]:
                best = (urgency, client, waiter)
        return (None, None) if best is None else (best[1], best[2])

    def _recheck_now(self) -> None:
        self._recheck = None
        self._admit()


class _Waiter:
    """One run waiting for its turn: its priority, since when, the future it awaits, and
    when it is due (promoted however long it waited)."""

    __slots__ = ("due_at", "priority", "since", "turn")

    def __init__(
        self, priority: int, since: float, turn: asyncio.Future[bool], due_at: float
    ) -> None:
        self.priority = priority
        self.since = since
        self.turn = turn
        self.due_at = due_at

    def urgency(self, now: float, aging_s: float) -> Urgency:
        """Lower goes first: aged or due runs, then by priority (``ordering``)."""
        at = promotion_at(waiting_since=self.since, due_at=self.due_at, aging_s=aging_s)
        return urgency(self.priority, promoted_at=at, now=now)


class Ticket:
    """One request's reserved runs; each run takes one ``slot``."""

    def __init__(
        self,
        share: FairShare,
        client: str,
        runs: int,
        priority: int = 0,
        due_at: float = math.inf,
    ) -> None:
        self._share = share
        self._client = client
        self._unclaimed = runs
        self.priority = priority
        self.due_at = due_at
        # The one clock its runs age on, here and in the pool.
        self.arrived_at = time.monotonic()

    @contextlib.asynccontextmanager
    async def slot(self, deadline_s: float) -> AsyncIterator[float]:
        """Wait for this client's turn, then hold a place in the pool; yields the seconds
        left of ``deadline_s`` (the wait counts). DeadlineExceeded if none are left. A
        request submitted to a pool within it ages from the ticket's ``arrived_at``."""
        started = time.monotonic()
        share = self._share
        try:
            async with asyncio.timeout(deadline_s):
                charged = await share._acquire(
                    self._client, self.priority, self.due_at, self.arrived_at
                )
        except TimeoutError:
            raise DeadlineExceeded(
                f"the deadline ({deadline_s:g} s) passed while the request waited for its "
                "turn (fair share between clients)"
            ) from None
        self._claim()
        try:
            with arrived_at(self.arrived_at):
                yield max(deadline_s - (time.monotonic() - started), 0.001)
        finally:
            share._release(self._client, self.priority, charged)

    def _claim(self) -> None:
        if self._unclaimed > 0:
            self._unclaimed -= 1
            self._share._unreserve(self._client, 1)

    def close(self) -> None:
        """Give back the runs that never took a slot (the request ended first)."""
        if self._unclaimed > 0:
            self._share._unreserve(self._client, self._unclaimed)
            self._unclaimed = 0
