"""The registry's memory budget: what the models hold against it, which of them may be
evicted, and what a load must evict first (or wait for).

:class:`Budgets` reads the registry's records (each ``Entry``: held and needed memory,
state, pin, waiters) and the swaps waiting for their victims to drain; it decides, and
the registry carries the decision out. Every call is made with the registry's lock held.

Out models' host prefix cache tiers (``host_tiers``) count at their bytes, and are the
first room a load takes: before a loaded model is evicted, the tiers of models that are
out are dropped, least recently used first (a tier is a faster reload, a loaded model
serves requests now); a loaded model is evicted only when they are not enough, and then
the tiers that still fit beside the load are kept. They never make a load impossible: a
model too large for the budget is judged without them.
"""

from __future__ import annotations

from modelpool.shared.errors import ModelTooLarge
from modelpool.supervisor.registry.host_tiers import HostTiers
from modelpool.supervisor.registry.records import ANYONE, MEMORY, Entry, RegistryConfig, Step
from modelpool.supervisor.registry.swaps import SwapLedger

# A plan: the models to evict, the unverified releases to wait for, and the out models
# whose host tiers are dropped first.
Plan = tuple[list[Entry], list[Entry], list[Entry]]


class Budgets:
    """The host-RAM and per-GPU budgets of one registry; see the module docstring."""

    def __init__(
        self,
        config: RegistryConfig,
        entries: dict[str, Entry],
        draining: list[Step],
        ledger: SwapLedger,
        steps: list[Step],
        host_tiers: HostTiers,
    ) -> None:
        self.config = config
        self.entries = entries
        # The swaps planned while their victims drain, and the steps running (the
        # registry's own lists).
        self.draining = draining
        self.ledger = ledger
        self.steps = steps
        self.host_tiers = host_tiers

    def loading(self) -> dict[int, dict[str, int] | None]:
        """The models a running step is loading (ids), each with the need its load was
        planned at (``Step.need``): each counts at the most of that, its need now and what
        it holds, until its step is done (its pool closed, its processes gone)."""
        return {id(s.entry): s.need for s in self.steps if s.entry is not None and not s.done}

    @staticmethod
    def proven_need(entry: Entry) -> dict[str, int] | None:
        """What ``entry``'s load may be planned at beside other loads: a need measured by
        a load that became ready (this run's, never below its loads' peaks, or an earlier
        run's saved), None otherwise. A load that never became ready (killed, failed,
        timed out) measured only the part of it that was up: an estimate or such a
        reading may be far below what the load takes, so nothing loads beside it."""
        if entry.need is None:
            return None
        if entry.need_source == "saved" or (entry.need_source == "measured" and entry.loads):
            return dict(entry.need)
        return None

    def unbounded(self) -> bool:
        """No budget at all: any load fits beside any other."""
        return (
            self.config.memory_budget_bytes is None and self.config.gpu_memory_budget_bytes is None
        )

    def budget(self, resource: str) -> int | None:
        if resource == MEMORY:
            return self.config.memory_budget_bytes
        return self.config.gpu_memory_budget_bytes

    def held_total(
        self, without: set[int] | None = None, *, at_peak: bool = False, tiers: bool = True
    ) -> dict[str, int]:
        """What the models hold now, by resource; ``at_peak``: each model that holds
        anything counted at its need (the most it was measured to hold), since a model
        that holds less now may grow back to it while the next one loads; ``tiers``: with
        the host tiers kept for out models and those being dropped."""
        total: dict[str, int] = {}
        if tiers and (dropping := self.host_tiers.dropping_bytes()):
            total[MEMORY] = dropping
        loading = self.loading() if at_peak else {}
        for entry in self.entries.values():
            if without is not None and id(entry) in without:
                continue
            held = dict(entry.held)
            if tiers and entry.tier_bytes:
                held[MEMORY] = held.get(MEMORY, 0) + entry.tier_bytes
            counted = held or id(entry) in loading
            if at_peak and counted and entry.lingering is None:
                for need in (entry.need, loading.get(id(entry))):
                    for resource, amount in (need or {}).items():
                        held[resource] = max(held.get(resource, 0), amount)
            for resource, amount in held.items():
                total[resource] = total.get(resource, 0) + amount
        return total

    def over_budget(self) -> bool:
        return any(
            (budget := self.budget(resource)) is not None and amount > budget
            for resource, amount in self.held_total().items()
        )

    def candidates(
        self, loading: Entry | None, client: str = ANYONE, now: float = 0.0
    ) -> list[Entry]:
        """Models that may be evicted: loaded, unpinned, nobody waiting for them (a model
        just loaded for its waiters is theirs first) and, for ``client``'s load, not kept
        from it by what it owes in swap time (``swaps``); idle ones first, each group
        least recently used first (the registry's lock held)."""
        found = [
            e
            for e in self.entries.values()
            if e.state == "loaded"
            and not e.pinned
            and e.waiting == 0
            and e is not loading
            and (loading is None or self.ledger.may_evict(e, client, now))
        ]
        return sorted(found, key=lambda e: (not e.idle, e.last_used))

    def kept_tiers(self, loading: Entry | None) -> list[Entry]:
        """Out models whose host tiers may be dropped (not ``loading``, nor a model whose
        load is asked for), least recently used first."""
        found = [
            e
            for e in self.entries.values()
            if e.tier_bytes
            and e.pool is None
            and e.state in ("unloaded", "failed")
            and e is not loading
        ]
        return sorted(found, key=lambda e: e.last_used)

    def plan(self, entry: Entry, client: str = ANYONE, now: float = 0.0) -> Plan | None:
        """The models to evict before ``entry`` loads ([]: none), the models whose
        unverified release it must wait for ([]: none) and the out models whose host
        tiers are dropped first ([]: none), or None to wait; raises
        ModelTooLarge when it cannot fit even beside the pinned models alone. ``client``:
        who the load is for (the models it may evict: ``candidates``).

        Victims are taken idle first, least recently used first, until the model fits;
        then each one whose eviction turns out not to be needed (it fits beside) stays.

        A model in use is evicted by a drain (no new request gets it, the running ones
        finish, then it unloads) only when the idle ones do not free enough. Memory an
        unverified release left is counted as measured; the load waits for it (within
        its deadline) only when evicting what may be evicted does not make room."""
        if self.unbounded():
            return [], [], []
        tiers = self.kept_tiers(entry)
        candidates = self.candidates(entry, client, now)
        movable = {id(e) for e in candidates}
        lingering = [e for e in self.entries.values() if e.lingering is not None]
        # A swap waiting for its victims to drain: their memory is its, and so is its need.
        draining = {id(v) for step in self.draining for v in step.victims}
        loading = {key: need for key, need in self.loading().items() if key != id(entry)}
        if any(need is None for need in loading.values()):
            return None  # a load under way whose need is not proven: nothing beside it
        reserved: dict[str, int] = {}
        for step in self.draining:
            assert step.entry is not None
            if step.entry.need is None:
                return None  # what it will take is not known: nothing may pass it
            for resource, amount in step.entry.need.items():
                reserved[resource] = reserved.get(resource, 0) + amount
        if any(
            e.held
            and id(e) not in movable
            and e.state != "loaded"
            and e is not entry
            and e.lingering is None
            and id(e) not in draining
            and id(e) not in loading
            for e in self.entries.values()
        ):
            return None  # a model still unloading or failing: its memory is not back yet
        need = entry.need
        if need is not None and entry.need_source == "estimated" and self.too_large(entry, need):
            need = None  # an estimate never refuses a model: its load measures it
        if need is None:
            # Not known: every model that may go goes, so that even the first load stays
            # within the budget whatever the model turns out to take.
            if (
                self.draining
                or loading
                or any(
                    e.state == "loaded" and not e.pinned and id(e) not in movable
                    for e in self.entries.values()
                    if e is not entry
                )
            ):
                return None
            return candidates, lingering, tiers
        too_large = self.too_large(entry, need)
        if too_large is not None:
            raise too_large
        known = need

        def fits(gone: set[int]) -> bool:
            # It must fit now, and once the swaps waiting for a drain are done.
            held = self.held_total(without=gone, at_peak=True)
            after = self.held_total(without=gone | draining, at_peak=True)
            return all(
                (budget := self.budget(r)) is None
                or max(held.get(r, 0), after.get(r, 0) + reserved.get(r, 0)) + amount <= budget
                for r, amount in known.items()
            )

        for wait in ([], lingering) if lingering else ([],):
            victims: list[Entry] = []
            # The model's own lingering memory counts too: never two copies of it.
            gone = {id(e) for e in wait} | ({id(entry)} if entry.lingering is None else set())
            # The out models' tiers first, so kept back last where they turn out not needed.
            for victim in [None, *tiers, *candidates]:
                if victim is not None:
                    victims.append(victim)
                    gone.add(id(victim))
                if fits(gone):
                    for kept in reversed(victims[:-1]):
                        if fits(gone - {id(kept)}):
                            victims.remove(kept)
                            gone.discard(id(kept))
                    drops = [v for v in victims if v in tiers]
                    return [v for v in victims if v not in tiers], wait, drops
        return None  # models just loaded for their waiters are in the way: they go first

    def too_large(self, entry: Entry, need: dict[str, int]) -> ModelTooLarge | None:
        """The error if ``need`` does not fit a budget even beside the pinned models alone."""
        others = {id(e) for e in self.entries.values() if not e.pinned or e is entry}
        floor_by = self.held_total(without=others, tiers=False)
        for resource, amount in need.items():
            budget = self.budget(resource)
            if budget is None:
                continue
            floor = floor_by.get(resource, 0)
            if amount + floor > budget:
                how = {"saved": "measured by an earlier run", "estimated": "estimated"}
                return ModelTooLarge(
                    f"model {entry.spec.name!r} needs {amount} bytes of {resource} "
                    f"({how.get(entry.need_source or '', 'measured')}) but the budget is "
                    f"{budget} bytes"
                    + (f", {budget - floor} of them beside the pinned models" if floor else ""),
                    model=entry.spec.name,
                    resource=resource,
                    needed_bytes=amount,
                    available_bytes=budget - floor,
                    budget_bytes=budget,
                )
        return None
