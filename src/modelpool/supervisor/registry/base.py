"""The registry's state and the few rules every part of it uses: a model failing (with its
backoff), a load asked for, and the registry's own NVML probe.

:class:`~modelpool.supervisor.registry.core.ModelRegistry` is built on this, with its release
checks (``releases``) and its memory readings (``memory``) as the other bases.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from modelpool.shared.errors import ModelLoadFailed, ModelNotFound, ModelUnavailable
from modelpool.supervisor.gpu import GpuProbe
from modelpool.supervisor.pool import ModelPool
from modelpool.supervisor.registry.budget import Budgets
from modelpool.supervisor.registry.host_tiers import HostTiers
from modelpool.supervisor.registry.needs import NeedStore, estimate, identity
from modelpool.supervisor.registry.records import Entry, RegistryConfig, Step
from modelpool.supervisor.registry.swaps import SwapLedger

logger = logging.getLogger("modelpool.registry")


def waited_on(load: concurrent.futures.Future[ModelPool]) -> asyncio.Future[ModelPool]:
    """``load`` as the event loop's future, whose outcome is read even when every waiter
    gave up on it (a shielded wait that times out): a load that then fails would
    otherwise log "Future exception was never retrieved" once per waiter, at ERROR."""
    waiting = asyncio.wrap_future(load)
    waiting.add_done_callback(lambda done: done.cancelled() or done.exception())
    return waiting


class RegistryBase:
    """The records of one registry, guarded by ``_cond`` (see the core module docstring)."""

    def __init__(
        self,
        config: RegistryConfig,
        *,
        gpu_probe: GpuProbe | None = None,
        pool_class: type[ModelPool] = ModelPool,
    ) -> None:
        """``gpu_probe`` replaces the NVML probe of every model's pool and of the
        registry's own release checks, and ``pool_class`` the pools (tests); by default
        each makes its own."""
        self.config = config
        self._gpu_probe = gpu_probe
        self._pool_class = pool_class
        self._own_probe: GpuProbe | None = None
        # Re-entrant: a lease dropped unreleased releases itself in __del__, which the
        # garbage collector may run on a thread that holds the lock already.
        self._cond = threading.Condition(threading.RLock())
        self._entries = {spec.name: Entry(spec) for spec in config.models}
        self._names = {
            name: self._entries[spec.name]
            for spec in config.models
            for name in (spec.name, *spec.aliases)
        }
        self._pending: deque[Entry] = deque()
        # Swaps planned whose victims are still draining (their requests finishing): not
        # started until they are, so that the loads behind them are planned meanwhile.
        self._draining: list[Step] = []
        self._swaps_ledger = SwapLedger(config.min_residency_s, config.swap_share)
        # The steps running, each on its thread: one of any kind, or several loads that
        # evict nothing (loads in parallel where memory allows).
        self._steps: list[Step] = []
        # Each model's host prefix cache tier, kept while it is out (``host_tiers``).
        self._host_tiers = HostTiers()
        # The budgets read the records, the draining swaps, the running steps and the
        # kept tiers; their decisions are ours.
        self._budgets = Budgets(
            config,
            self._entries,
            self._draining,
            self._swaps_ledger,
            self._steps,
            self._host_tiers,
        )
        self._waiting = 0
        self._waiting_by: dict[str, int] = {}
        self._swaps = 0
        self._closing = False
        # Called with each pool before it starts (the daemon's observers: add_pool_hook).
        self._pool_hooks: list[Callable[[str, ModelPool], None]] = []
        self._thread: threading.Thread | None = None
        self._heartbeat: float | None = None
        self._peak: dict[str, int] = {}
        self._next_sample = 0.0
        self._started_at = time.monotonic()
        self._needs = NeedStore(config.needs_file)
        saved = self._needs.load()
        for entry in self._entries.values():
            need = saved.get(identity(entry.spec))
            if need:
                entry.need, entry.need_source = need, "saved"
            elif (guess := self._estimate(entry)) is not None:
                entry.need, entry.need_source = guess, "estimated"

    def _lookup(self, name: str) -> Entry:
        """The model a name or alias reaches; ``ModelNotFound`` otherwise."""
        entry = self._names.get(name) if isinstance(name, str) else None
        if entry is None:
            raise ModelNotFound(
                f"The model {str(name)[:200]!r} does not exist", model=str(name)[:200]
            )
        return entry

    def _estimate(self, entry: Entry) -> dict[str, int] | None:
        """An estimate of host memory only: a model that may take a GPU under a GPU budget
        has none (its GPU share is not known), so its first load evicts what it may."""
        devices = entry.spec.pool.devices
        if self.config.gpu_memory_budget_bytes is not None and devices != ("cpu",):
            return None
        return estimate(entry.spec)

    def _request_load(self, entry: Entry) -> concurrent.futures.Future[ModelPool]:
        """The load to wait on, asking for one if none is under way (lock held; the model
        is not loaded)."""
        if entry.load is None or entry.load.done():
            entry.load = concurrent.futures.Future()
        if entry.state in ("unloaded", "failed"):
            entry.state = "loading"
            entry.reason = None
            if entry not in self._pending:
                self._pending.append(entry)
            self._cond.notify_all()
        # "loading": already queued or under way; "unloading": queued once the unload ends.
        return entry.load

    def _fail(
        self, entry: Entry, reason: str, now: float, *, error: ModelLoadFailed | None = None
    ) -> None:
        """``entry`` is failed; its waiters get the error; its next load backs off (lock held)."""
        entry.failures += 1
        entry.load_failures += 1
        backoff = min(self.config.backoff_max_s, self.config.backoff_s * 2 ** (entry.failures - 1))
        entry.retry_at = now + backoff
        entry.state = "failed"
        entry.reason = reason
        if entry.pool is None:
            entry.held = {}  # a failed load's workers are gone (or being killed) with it
            # An unload asked for during the load is done: nothing is loaded. Kept, it
            # would unload the next load, much later, under its requests.
            entry.unload_requested = False
        if isinstance(error, ModelUnavailable):
            error.retry_after_s = backoff
        entry.error = error or ModelUnavailable(
            f"model {entry.spec.name!r} is failed: {reason}",
            model=entry.spec.name,
            reason=reason,
            retry_after_s=backoff,
        )
        logger.error(
            "registry: model %s failed (next load in %.1f s): %s", entry.spec.name, backoff, reason
        )
        if entry.load is not None and not entry.load.done():
            entry.load.set_exception(entry.error.copy())

    def _drop_tiers(self, entries: list[Entry]) -> list[str]:
        """Take the out models' kept host tiers from them, to be removed by a step (lock
        held): counted until they are gone, and each model's next load makes a new one."""
        directories = []
        for entry in entries:
            directory = self._host_tiers.detach(entry.spec.name, entry.tier_bytes)
            entry.tier_bytes = 0
            if directory is not None:
                directories.append(directory)
                logger.info("registry: dropping the host tier of %s", entry.spec.name)
        return directories

    def _keep_need(self, entry: Entry) -> None:
        """Save the model's measured need for the next start (off the lock: a file)."""
        with self._cond:
            need = dict(entry.need or {}) if entry.need_source == "measured" else {}
        if need:
            self._needs.save(entry.spec, need)

    def _probe(self) -> GpuProbe:
        """NVML for the registry's own release checks: the given probe, or one of its own."""
        if self._gpu_probe is not None:
            return self._gpu_probe
        with self._cond:
            if self._own_probe is None:
                self._own_probe = GpuProbe()
            return self._own_probe
