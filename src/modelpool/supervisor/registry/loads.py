"""A supervised step, on a thread of its own: the evicted models unloaded (``releases``),
their release awaited, then the load: the pool made (the pool hooks called before it
starts), started within the model's load deadline, measured (``memory``), and given to
the requests waiting for it, or failed with the reason. The supervisor
(:class:`~modelpool.supervisor.registry.core.ModelRegistry`) plans the steps and watches
their deadlines; the step's thread makes every slow call, outside the lock."""

from __future__ import annotations

import time

from modelpool.supervisor.pool import ModelPool
from modelpool.supervisor.registry.base import logger
from modelpool.supervisor.registry.memory import Memory
from modelpool.supervisor.registry.records import Entry, Step


class Loads(Memory):
    """The steps' own threads (see the module docstring)."""

    def _run_step(self, step: Step) -> None:
        try:
            for directory in step.drops:
                self._host_tiers.remove(directory)
            for victim in step.victims:
                self._unload(victim, evicted=step.kind == "swap", why=step.why, step=step)
            if step.entry is not None and self._await_release(step):
                self._load(step)
        except BaseException:  # a bug here must not leave a model "loading" for ever
            logger.exception("registry: %s failed", step.why)
            with self._cond:
                if step.entry is not None and step.entry.state == "loading":
                    self._fail(
                        step.entry, "the registry's load step failed; see the log", time.monotonic()
                    )
        finally:
            with self._cond:
                step.done = True
                self._cond.notify_all()

    def _load(self, step: Step) -> None:
        entry = step.entry
        assert entry is not None
        spec = entry.spec
        # Its host tier is the registry's: kept from its last load, and after this one.
        pool = self._pool_class(self._host_tiers.pool_config(spec), gpu_probe=self._gpu_probe)
        started = time.monotonic()
        with self._cond:
            # Counted in what the loading pool holds from now on, at its bound.
            entry.tier_bytes = 0
            # The readings of requests are this load's own (the memory module's docstring).
            entry.readings = []
            # What it was planned at: a load that does not become ready measured only the
            # part of it that was up, and leaves the need as it found it.
            planned = entry.need, entry.need_source
            # Read with step.loading set, under one lock: add_pool_hook applies a later hook.
            hooks = self._pool_hooks
            step.loading = pool
            step.deadline = started + spec.load_deadline_s
            if self._closing:
                pool.close(drain=False, timeout=0.0)
        for hook in hooks:
            hook(spec.name, pool)
        error: BaseException | None = None
        try:
            pool.start()
        except BaseException as exc:
            error = exc
        seconds = time.monotonic() - started
        held, peak = self._measure(pool) if error is None else ({}, 0)
        with self._cond:
            now = time.monotonic()
            step.loading = None
            if error is not None or step.abandoned or self._closing or step.timed_out:
                entry.need, entry.need_source = planned
            if step.abandoned or self._closing or step.timed_out:
                if step.timed_out and not step.abandoned and entry.state == "loading":
                    reason = f"its load did not finish within {spec.load_deadline_s:g} s"
                    self._fail(entry, reason + " (load_timeout_s)", now)
                discard = error is None
            elif error is not None:
                self._fail(entry, f"its load failed: {error}", now)
                discard = False
            else:
                self._note_held(entry, held, now, load_peak=peak)
                entry.need = self._settled(entry) or entry.need
                too_large = self._budgets.too_large(entry, entry.need or {})
                discard = too_large is not None
                if too_large is not None:
                    entry.held = {}
                    self._fail(entry, too_large.message, now, error=too_large)
                else:
                    self._loaded(entry, pool, seconds, now)
        if error is not None or discard:
            if discard:
                # Closed on this step's thread: until its processes are gone (close
                # returns then) the step runs, and the load counts at its need beside
                # other loads.
                pool.close(drain=False, timeout=0.0)
            self._keep_tier(entry)
            return
        logger.info("registry: %s loaded in %.2f s", spec.name, seconds)
        self._keep_need(entry)

    def _loaded(self, entry: Entry, pool: ModelPool, seconds: float, now: float) -> None:
        """``entry``'s load is done: the pool is its, its waiters get it (lock held)."""
        entry.pool = pool
        # An operator's unload asked for while it loaded: its waiters are served, then
        # it unloads (the supervisor's first step once they are done).
        entry.state = "unloading" if entry.unload_requested else "loaded"
        entry.reason = None
        entry.error = None
        entry.failures = 0
        entry.held_back = False
        entry.loads += 1
        entry.last_load_s = round(seconds, 3)
        entry.load_seconds_total += seconds
        entry.last_used = now
        if entry.load is not None and not entry.load.done():
            entry.load.set_result(pool)
        self._cond.notify_all()
