"""Swaps that cannot storm: what a client's swaps cost it, and which models its loads may
evict.

A *swap* is a load that evicts models. Its cost (the predicted seconds of its own load
and of the evicted models' reloads: each one's last load time, ``DEFAULT_LOAD_S`` before
its first) is charged to the client whose request asked for the load: the client then
*owes* swap time, ``cost / swap_share`` seconds from now (added to what it still owes).
A client that owes swap time may not evict a model another client is using (a request
in flight or waiting, or one within ``min_residency_s`` of its last request): its load
waits until it owes nothing, or its request is answered at once (429 with Retry-After)
when that is past its deadline. A client that owes nothing may evict any unpinned model
nobody waits for, and a client may always evict the models only it uses.

So one client alone cannot keep another's model away more than ``swap_share`` of the
time, however its requests are spread (the swap storm: one small request at a time to a
model that does not fit beside the other tenant's), while a client whose model was
evicted gets it back at once, and a model loaded for a client serves it at least
``min_residency_s`` after its last request before a client that keeps swapping may take
its place. Evictions are chosen so that a model that fits beside the loading one stays
(see :meth:`modelpool.supervisor.registry.budget.Budgets.plan`).
"""

from __future__ import annotations

from modelpool.supervisor.registry.records import ANYONE, Entry

# The predicted seconds of a load never timed yet (a swap's cost before it is known).
DEFAULT_LOAD_S = 1.0


class SwapLedger:
    """What each client owes in swap time (read and written under the registry's lock)."""

    def __init__(self, min_residency_s: float, swap_share: float) -> None:
        self.min_residency_s = min_residency_s
        self.swap_share = swap_share
        # Client -> the monotonic time until which it owes swap time.
        self._owed_until: dict[str, float] = {}

    def owes(self, client: str, now: float) -> float:
        """Seconds of swap time ``client`` still owes (0: none; never the operator's or a
        library call's, ``ANYONE``)."""
        if client == ANYONE:
            return 0.0
        return max(0.0, self._owed_until.get(client, 0.0) - now)

    def charge(self, client: str, entry: Entry, victims: list[Entry], now: float) -> float:
        """Charge ``client`` for loading ``entry`` over ``victims``; the cost in seconds."""
        cost = sum((e.last_load_s or DEFAULT_LOAD_S) for e in (entry, *victims))
        start = max(now, self._owed_until.get(client, now))
        self._owed_until[client] = start + cost / self.swap_share
        for name, until in list(self._owed_until.items()):
            if until <= now:
                del self._owed_until[name]
        return cost

    def used_by_others(self, victim: Entry, client: str, now: float) -> bool:
        """Whether a client other than ``client`` is using ``victim`` now."""
        counts = (*victim.holders.items(), *victim.waiters.items())
        using = {name for name, count in counts if count}
        using |= victim.recent_users(now - self.min_residency_s)
        return bool(using - {client})

    def may_evict(self, victim: Entry, client: str, now: float) -> bool:
        """Whether ``client``'s load may evict ``victim`` now (see the module docstring)."""
        return self.owes(client, now) <= 0 or not self.used_by_others(victim, client, now)

    def payer(self, waiting: dict[str, int], now: float) -> str | None:
        """The client a load is charged to: of those waiting for it, the one that owes
        least (None: no one waits, an operator's load)."""
        clients = [name for name, count in waiting.items() if count > 0]
        return min(clients, key=lambda name: self.owes(name, now)) if clients else None
