"""What a registry says of itself: its health (the supervisor's heartbeat), each model's
stats and the registry's, the pools loaded now, and the hooks that observe each pool it
makes (the daemon's ``vllm:`` metrics and tracing). None of it waits on a load."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from modelpool.supervisor.pool import ModelPool
from modelpool.supervisor.registry.base import RegistryBase
from modelpool.supervisor.registry.records import MEMORY, Entry, ModelStats, RegistryStats
from modelpool.supervisor.stats import PoolHealth


class Observing(RegistryBase):
    """The observing half of :class:`~modelpool.supervisor.registry.core.ModelRegistry`'s
    API (read under the lock, the pools' own stats outside it)."""

    def health(self) -> PoolHealth:
        """Alive unless the supervisor thread stopped or its heartbeat is older than
        ``heartbeat_timeout_s`` (a wedged registry). Never waits on the lock."""
        thread, beat = self._thread, self._heartbeat
        if thread is None or beat is None:
            state = "closed" if self._closing else "starting"
            return PoolHealth(False, state, None, f"the registry is {state}")
        age = round(max(0.0, time.monotonic() - beat), 3)
        if self._closing or not thread.is_alive():
            return PoolHealth(False, "closed", age, "the registry's supervisor has stopped")
        bound = self.config.heartbeat_timeout_s
        if age > bound:
            return PoolHealth(
                False,
                "wedged",
                age,
                f"the registry's supervisor has not gone round its loop for {age:.1f} s "
                f"(bound {bound:g} s): it is wedged",
            )
        return PoolHealth(True, "running", age)

    def model_stats(self, name: str, *, with_pool: bool = False) -> ModelStats:
        entry = self._lookup(name)
        with self._cond:
            stats = self._entry_stats(entry, time.monotonic())
            pool = entry.pool if entry.state == "loaded" else None
        if with_pool and pool is not None:
            stats = dataclasses.replace(stats, pool=pool.stats())
        return stats

    def add_pool_hook(self, hook: Callable[[str, ModelPool], None]) -> None:
        """Call ``hook(model name, pool)`` with each pool the registry makes, before it
        starts (the daemon adds its ``vllm:`` metrics and tracing as observers), and now
        with each pool already made (a ``preload`` model loaded before the daemon added
        its observers): no pool goes unobserved, whenever its hook came."""
        with self._cond:
            self._pool_hooks = [*self._pool_hooks, hook]
            made = [(e.spec.name, e.pool) for e in self._entries.values() if e.pool is not None]
            made += [
                (step.entry.spec.name, step.loading)
                for step in self._steps
                if step.entry is not None and step.loading is not None
            ]
        for name, pool in made:
            hook(name, pool)

    def stats(self, *, with_pools: bool = True) -> RegistryStats:
        """Every model (with its pool's own ``PoolStats`` when loaded and ``with_pools``),
        memory measured now and at its peak, swaps, requests waiting for a load."""
        now = time.monotonic()
        with self._cond:
            models = {name: self._entry_stats(e, now) for name, e in self._entries.items()}
            pools = {n: e.pool for n, e in self._entries.items() if e.state == "loaded" and e.pool}
            held = self._budgets.held_total()
            peak = dict(self._peak)
            swaps, waiting = self._swaps, self._waiting
        if with_pools:
            for name, pool in pools.items():
                models[name] = dataclasses.replace(models[name], pool=pool.stats())
        beat = self._heartbeat
        return RegistryStats(
            models=models,
            memory_budget_bytes=self.config.memory_budget_bytes,
            gpu_memory_budget_bytes=self.config.gpu_memory_budget_bytes,
            rss_bytes=held.get(MEMORY, 0),
            peak_rss_bytes=peak.get(MEMORY, 0),
            gpu_bytes={k: v for k, v in held.items() if k != MEMORY},
            peak_gpu_bytes={k: v for k, v in peak.items() if k != MEMORY},
            swaps=swaps,
            waiting=waiting,
            heartbeat_age_s=None if beat is None else round(max(0.0, now - beat), 3),
        )

    def loaded_pools(self) -> dict[str, ModelPool]:
        """The pools of the models loaded now, by name (for a scrape: never held)."""
        with self._cond:
            return {n: e.pool for n, e in self._entries.items() if e.state == "loaded" and e.pool}

    def _entry_stats(self, entry: Entry, now: float) -> ModelStats:
        spec = entry.spec
        until = entry.idle_until()
        return ModelStats(
            name=spec.name,
            state=entry.state,
            reason=entry.reason,
            backend=spec.pool.backend,
            model=spec.pool.model,
            aliases=spec.aliases,
            pinned=entry.pinned,
            loads=entry.loads,
            unloads=entry.unloads,
            evictions=entry.evictions,
            load_failures=entry.load_failures,
            last_load_s=entry.last_load_s,
            load_seconds_total=round(entry.load_seconds_total, 3),
            rss_bytes=entry.held.get(MEMORY) if entry.held else None,
            need_bytes=None if entry.need is None else entry.need.get(MEMORY),
            gpu_bytes={k: v for k, v in entry.held.items() if k != MEMORY},
            in_use=entry.in_flight,
            waiting=entry.waiting,
            idle_s=round(now - entry.last_used, 3)
            if entry.state == "loaded" and entry.idle
            else None,
            retry_in_s=round(entry.retry_at - now, 3)
            if entry.state == "failed" and entry.retry_at > now
            else None,
            keep_alive_s=None if until is None else round(max(0.0, until - entry.last_used), 3),
            need_source=entry.need_source if entry.need is not None else None,
            host_tier_bytes=entry.tier_bytes
            if entry.pool is None
            and entry.state != "loading"
            and self._host_tiers.directory(spec.name) is not None
            else None,
        )
