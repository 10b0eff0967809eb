"""What the models hold: each model's workers measured (RSS by psutil, GPU memory by
NVML), and its *need*, what a load of it is planned to take.

The need settles: the peak of the model's loads (their processes' high-water marks when
they became ready: the transient of loading weights counts; the most over its loads, so
one load measured while a worker was being replaced does not understate it) and the
readings of the last ``NEED_WINDOW_S`` of this load, the most of them. So one request's
transient peak (a large rerank) raises the need for a while and no longer. A need saved
by an earlier run or estimated from the model's files (``needs``) counts only until its
load is measured. A load that does not become ready (failed, killed, timed out) leaves
the need as it found it: its readings are of the part of it that was up, and planning
the next load on them would let it pass the budget. A model whose holding now does not
fit the budget even beside the pinned models alone is failed and closed once idle; its
next load (after its backoff) is planned from what its loads took, and measured afresh.
"""

from __future__ import annotations

import time

from modelpool.shared.errors import PoolError
from modelpool.supervisor.pool import ModelPool
from modelpool.supervisor.registry.records import MEMORY, Entry, tree_rss
from modelpool.supervisor.registry.releases import Releases

# The readings after a load that the need is the most of (with the load's own peak).
NEED_WINDOW_S = 60.0
# The supervisor samples memory this often (more often while a model loads).
SAMPLE_S = 1.0
SAMPLE_WHILE_LOADING_S = 0.25


class Memory(Releases):
    """Memory readings and needs (see the module docstring)."""

    def _sample(self) -> None:
        """Measure every loaded (and loading) model's workers; off the lock."""
        now = time.monotonic()
        with self._cond:
            targets = [(e, e.pool) for e in self._entries.values() if e.pool is not None]
            loads = [(s.entry, s.loading) for s in self._steps if s.loading is not None]
            targets += [(entry, pool) for entry, pool in loads if entry is not None]
        self._next_sample = now + (SAMPLE_WHILE_LOADING_S if loads else SAMPLE_S)
        readings = [(entry, pool, *self._measure(pool)) for entry, pool in targets]
        self._recheck(list(self._entries.values()))
        with self._cond:
            pools = {id(s.loading) for s in self._steps if s.loading is not None}
            for entry, pool, held, peak in readings:
                loading = id(pool) in pools
                # Only a pool still the model's: one unloaded or failed meanwhile holds nothing.
                if entry.pool is pool or loading:
                    self._note_held(entry, held, now, load_peak=peak if loading else None)
                if entry.pool is pool and entry.state == "loaded":
                    # What it holds now (a GPU's is often taken lazily, at the first
                    # request) may not fit even alone: failed and closed once idle, not
                    # evicted and reloaded in a loop; its next load (after its backoff) is
                    # planned from what its last load took, and measured again.
                    too_large = self._budgets.too_large(entry, entry.held)
                    if too_large is not None:
                        entry.need = dict(entry.load_peak) or entry.need
                        entry.load_peak = {}  # its next load is measured afresh
                        self._fail(entry, too_large.message, now, error=too_large)

    def _note_held(
        self, entry: Entry, held: dict[str, int], now: float, *, load_peak: int | None = None
    ) -> None:
        """Record a reading (lock held): the model's holding now, and its need (see the
        module docstring); ``load_peak``: a reading of its load, with its processes' peak
        RSS. The registry's peak too."""
        if not held:
            return
        entry.held = held
        if load_peak is not None:
            reading = {**held, MEMORY: max(held.get(MEMORY, 0), load_peak)}
            for resource, amount in reading.items():
                entry.load_peak[resource] = max(entry.load_peak.get(resource, 0), amount)
        else:
            entry.readings.append((now, held))
        entry.readings = [(at, h) for at, h in entry.readings if at >= now - NEED_WINDOW_S]
        need = self._settled(entry)
        if entry.state == "loading" and entry.need:
            # Until the load is done its readings are partial: what was planned still counts.
            need = {r: max(need.get(r, 0), amount) for r, amount in {**need, **entry.need}.items()}
        entry.need, entry.need_source = need, "measured"
        for resource, amount in self._budgets.held_total().items():
            self._peak[resource] = max(self._peak.get(resource, 0), amount)

    @staticmethod
    def _settled(entry: Entry) -> dict[str, int]:
        """The need of this load: the most of its own peak and the readings kept since."""
        need = dict(entry.load_peak)
        for _, reading in entry.readings:
            for resource, amount in reading.items():
                need[resource] = max(need.get(resource, 0), amount)
        return need

    @staticmethod
    def _measure(pool: ModelPool) -> tuple[dict[str, int], int]:
        """RSS of the pool's worker processes and their children (psutil), and each
        worker's GPU memory by device (the pool's NVML sampling, by PID); with the sum of
        those processes' peak RSS (the kernel's high-water mark, so that a transient
        between two samples, a load's above all, counts in the model's need)."""
        try:
            stats = pool.stats()
        except PoolError:
            return {}, 0
        # The host tier's files are shared memory no worker's RSS shows: counted at their
        # bound, which they may fill at any moment (docs/prefix-tiers.md).
        host_tier = pool.config.prefix_cache_host_bytes
        held: dict[str, int] = {MEMORY: host_tier}
        peak = host_tier
        for worker in stats.workers:
            if worker.pid is None:
                continue
            rss, high = tree_rss(worker.pid)
            held[MEMORY] += rss
            peak += high
            for device, mb in worker.gpu_mb_by_device.items():
                if mb is not None:
                    held[device] = held.get(device, 0) + int(mb * 2**20)
        return held, peak
