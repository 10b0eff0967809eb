"""Unloads and their verified releases, on step threads.

A model's pool is drained (its running requests finish, within the step's bound) and
closed; its release is verified before the next model's workers start: every process
measured as its own (the workers and their children, whatever their process group)
gone and its process groups gone (psutil), and on a GPU the pool's own release checks
passed and NVML no longer listing those processes. What is not back in time is kept as
the model's ``lingering``, measured and counted against the budget (checked every
second) with the model ``failed``; a load that needs that memory waits for it within
its deadline, then is held back (``MemoryNotReleased``) until it is back, when the
models it held back are ``unloaded`` again and load on their next request.
"""

from __future__ import annotations

import time

from modelpool.shared.errors import MemoryNotReleased
from modelpool.shared.processes import group_members, wait_process_group_gone
from modelpool.supervisor.registry.base import RegistryBase, logger
from modelpool.supervisor.registry.records import Entry, Lingering, Step, process_trees

# An unloaded model's processes must be gone within this after its pool closed (an
# idle unload; a swap waits up to the deadline of the load it makes room for).
RELEASE_TIMEOUT_S = 10.0
# How often a release not yet verified is checked again while a load waits for it.
RELEASE_POLL_S = 0.1


class Releases(RegistryBase):
    """The unload half of a step (see the module docstring)."""

    def _unload(self, entry: Entry, *, evicted: bool, why: str, step: Step) -> None:
        """Drain ``entry`` (its running requests finish; new ones wait for its reload),
        close its pool, verify the release (until ``step.release_by`` at most): what is
        not back is kept as the model's ``lingering``, and the model ``failed``."""
        with self._cond:
            pool = entry.pool
            bound = step.drain_by - time.monotonic() if step.drain_by else None
            drain_s = self.config.unload_timeout_s if bound is None else max(0.0, bound)
            self._cond.wait_for(lambda: entry.in_flight == 0, drain_s)
            had = {**(entry.need or {}), **entry.held}
        if pool is None:
            return
        pids = [w.pid for w in pool.stats().workers if w.pid is not None]
        # Every process measured as the model's, whatever its process group: a child
        # that left the group (setsid) outlives the pool's kill of the group.
        processes = process_trees(pids)
        started = time.monotonic()
        pool.close(drain=True, timeout=self.config.unload_timeout_s)
        until = min(step.release_by, time.monotonic() + RELEASE_TIMEOUT_S)
        found: list[str] = []
        for pid in pids:
            report = wait_process_group_gone(pid, timeout_s=max(0.0, until - time.monotonic()))
            if not report.ok:
                # Watched with the rest: a zombie left in the group holds no memory.
                members = group_members(pid)
                processes += [p for p in members if p not in processes]
                if not members:
                    found.append(report.describe())  # a group whose members are not visible
        # The pool's own GPU checks: a GPU whose release failed stays blocked until free.
        gpus = {device: had.get(device, 0) for device in pool.stats().gpu.blocked_devices}
        lingering = Lingering(processes, frozenset(p.pid for p in processes), gpus)
        held = self._wait_released(lingering, until)
        # Its workers are gone: its kept host tier (if any) holds what it will while out.
        tier_bytes = self._host_tiers.measure(entry.spec)
        logger.info(
            "registry: %s: %s unloaded in %.2f s", why, entry.spec.name, time.monotonic() - started
        )
        with self._cond:
            entry.pool = None
            entry.held = {}
            entry.tier_bytes = tier_bytes
            entry.unloads += 1
            entry.evictions += 1 if evicted else 0
            entry.unload_requested = False
            entry.uses.clear()
            if held or found:
                reason = "its memory was not released: " + "; ".join(
                    [*found, lingering.describe()] if held else found
                )
                self._fail(entry, reason, time.monotonic())
                if held:
                    entry.lingering, entry.held, entry.held_back = lingering, held, True
            elif entry.state != "failed":
                entry.state = "unloaded"
                if entry.load is not None and not entry.load.done():
                    self._request_load(entry)  # requests came while it drained
            self._cond.notify_all()
        self._keep_need(entry)

    def _keep_tier(self, entry: Entry) -> None:
        """A load that did not end loaded: the model's kept host tier counts at its
        bytes from now on (unless its next load started meanwhile)."""
        tier_bytes = self._host_tiers.measure(entry.spec)
        with self._cond:
            if entry.pool is None and entry.state != "loading":
                entry.tier_bytes = tier_bytes
            self._cond.notify_all()

    def _wait_released(self, lingering: Lingering, until: float) -> dict[str, int]:
        """Poll ``lingering`` until all of it is back or ``until``; what is still held."""
        while True:
            held = lingering.check(self._probe() if lingering.gpus else None)
            if not held or time.monotonic() >= until:
                return held
            with self._cond:
                if self._cond.wait_for(lambda: self._closing, RELEASE_POLL_S):
                    return held

    def _await_release(self, step: Step) -> bool:
        """Wait (until ``step.release_by``) for the memory the load needs back from the
        models it evicted or waits for; False (the model failed with MemoryNotReleased,
        or the registry closing) when it is not back in time."""
        entry = step.entry
        assert entry is not None
        waits = [*step.victims, *step.awaits]
        while True:
            self._recheck(waits)
            with self._cond:
                left = [e for e in waits if e.lingering is not None]
                now = time.monotonic()
                if self._closing:
                    return False
                if not left:
                    return True
                if now >= step.release_by:
                    break
                self._cond.wait(RELEASE_POLL_S)
        with self._cond:
            names = tuple(e.spec.name for e in left)
            what = "; ".join(
                f"{e.spec.name}: {e.lingering.describe()}" for e in left if e.lingering is not None
            )
            reason = (
                f"memory not released: the memory of {', '.join(names)} was not verified "
                f"released within {entry.spec.load_deadline_s:g} s, so its workers were not "
                f"started ({what})"
            )
            error = MemoryNotReleased(
                f"model {entry.spec.name!r} was not loaded: {reason}",
                model=entry.spec.name,
                reason=reason,
                retry_after_s=0.0,
                held_by=names,
            )
            if entry.state == "loading":
                self._fail(entry, reason, now, error=error)
                entry.held_back = True
        return False

    def _recheck(self, entries: list[Entry]) -> None:
        """Check again what unverified releases left (off the lock); a model whose memory
        is all back holds nothing more, and the models held back by it are unloaded again."""
        with self._cond:
            targets = [(e, e.lingering) for e in entries if e.lingering is not None]
        if not targets:
            return
        readings = [
            (e, lingering, lingering.check(self._probe() if lingering.gpus else None))
            for e, lingering in targets
        ]
        with self._cond:
            for entry, lingering, held in readings:
                if entry.lingering is not lingering:
                    continue
                if held:
                    entry.held = held
                    continue
                entry.lingering, entry.held = None, {}
                logger.info("registry: the memory of %s is back", entry.spec.name)
            if not any(e.lingering is not None for e in self._entries.values()):
                for other in self._entries.values():
                    if other.held_back and other.state == "failed" and other.pool is None:
                        other.state, other.reason, other.error = "unloaded", None, None
                        other.retry_at, other.held_back = 0.0, False
            self._cond.notify_all()
