"""Many models in one process: :class:`ModelRegistry`, a supervisor of :class:`ModelPool`\\ s.

Each model is a pool of its own, started on its first request (or at start with
``preload``), unloaded when idle past its ``ttl_s`` (or its clients' ``keep_alive``), and
swapped within a measured memory budget::

    registry = ModelRegistry(RegistryConfig(
        models=(
            ModelSpec("chat", PoolConfig(model="embedded:smollm2-135m-instruct"), pin=True),
            ModelSpec("coder", PoolConfig(model="./coder", workers=1), ttl_s=300),
        ),
        memory_budget_bytes=8 * 2**30,
    )).start()
    with registry.use("coder") as pool:          # loads it if need be; waits its turn
        pool.generate([{"role": "user", "content": "def fib(n):"}])
    async with registry.ause("chat", deadline_s=30) as pool:
        await pool.agenerate("Hello")
    registry.stats().models["coder"].state       # "loaded"
    registry.close()

States of a model: ``unloaded`` → ``loading`` → ``loaded`` → ``unloading`` → ``unloaded``,
and ``failed`` (its load failed, it does not fit, or its pool died) from which a later
request tries again once its backoff (doubling, ``backoff_s`` to ``backoff_max_s``) has
passed; until then its requests get :class:`~modelpool.shared.errors.ModelUnavailable` at once.

Threads. The state of every model is guarded by one condition lock that no slow call is
made under (``base``). One supervising thread (``modelpool-registry``) makes every
decision: it starts *steps* (a swap: unload the evicted models, then load; or one
unload) on threads of their own (``loads``), loads that evict nothing beside each
other where the budget holds them all (``_next_step``); it watches each step's
deadline, measures memory (``memory``), unloads idle models, and notices a loaded pool
that died. It wakes at least twice a second, so its heartbeat (``health()``, in
``observing`` with the stats) shows a wedge; a step that
outlives its deadline has its pool killed and, if even that does not end it, is
abandoned with the model ``failed``.

Memory is measured, not guessed (``memory``: a model's need, and how it settles; kept
across restarts and estimated from files before a first load: ``needs``). A model that
must load evicts least-recently-used idle (no request in flight or waiting), unpinned
models until its need fits, keeping those that fit beside it (``budget``); one whose
need is not known at all evicts every such model first, so the budget holds from the
first load. A swap is charged to the client that asked for it, and a client that owes
swap time does not evict another client's model in use (``swaps``). A swap whose victim
still runs requests waits for them outside the step, so the loads behind it are planned
meanwhile (one that fits now and after that swap goes first). An evicted model's
release is verified before the next model's workers start (``releases``); a release not
verified within the load's deadline holds the load back (its requests get
:class:`~modelpool.shared.errors.MemoryNotReleased`) until the memory is back. Requests
waiting for a model hold it: a model with waiters is never idle, so two models that do
not fit together alternate by demand instead of evicting each other in a loop. A
client's ``keep_alive`` counts for its own use only (``records.Entry.idle_until``); the
operator unloads, loads and pins.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Iterator

from modelpool.shared.config import ModelSpec
from modelpool.shared.errors import (
    DeadlineExceeded,
    ModelLoadFailed,
    ModelTooLarge,
    PoolClosed,
    PoolOverloaded,
)
from modelpool.supervisor.pool import ModelPool
from modelpool.supervisor.registry.admission import Admission
from modelpool.supervisor.registry.base import logger, waited_on
from modelpool.supervisor.registry.loads import Loads
from modelpool.supervisor.registry.observing import Observing
from modelpool.supervisor.registry.records import ANYONE, Entry, KeepAlive, ModelStats, Step, Use
from modelpool.supervisor.registry.releases import RELEASE_TIMEOUT_S

# The supervisor wakes at least this often (its heartbeat).
TICK_S = 0.5
# A step that its pool's kill did not end within this is abandoned (its thread is stuck
# outside the pool, e.g. in a model download) and the model marked failed.
ABANDON_AFTER_S = 10.0
# One client holds at most this share of the load-waiter places (max_waiting).
CLIENT_WAITING_SHARE = 0.25


class ModelLease:
    """A model held for one use: its ``pool``, and the promise not to unload it until
    :meth:`release` (idempotent; ``with`` releases it)."""

    def __init__(
        self,
        registry: ModelRegistry,
        entry: Entry,
        pool: ModelPool,
        client: str = ANYONE,
        keep_alive: KeepAlive = "default",
    ) -> None:
        self.name = entry.spec.name
        self.pool = pool
        self._registry = registry
        self._entry: Entry | None = entry
        self._client = client
        self._keep_alive = keep_alive

    def release(self) -> None:
        entry, self._entry = self._entry, None
        if entry is not None:
            self._registry._release(entry, self._client, self._keep_alive)

    def __enter__(self) -> ModelPool:
        return self.pool

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def __del__(self) -> None:
        self.release()


class ModelRegistry(Admission, Loads, Observing):
    """Several :class:`ModelPool`\\ s by name; the module docstring has the rules (the
    state is :class:`~modelpool.supervisor.registry.base.RegistryBase`'s; the steps'
    threads are ``loads``'s, the stats and health ``observing``'s)."""

    # ---- life cycle ---------------------------------------------------------------------

    def start(self, *, wait_preloads: bool = True) -> ModelRegistry:
        """Start the supervisor and the ``preload`` models; with ``wait_preloads``, return
        once each has loaded or failed (a failure is logged: it stays that model's)."""
        with self._cond:
            if self._closing:
                raise PoolClosed("the registry is closed")
            if self._thread is None:
                self._heartbeat = time.monotonic()
                self._thread = threading.Thread(
                    target=self._supervise, name="modelpool-registry", daemon=True
                )
                self._thread.start()
            loads = {
                entry.spec.name: self._request_load(entry)
                for entry in self._entries.values()
                if entry.spec.preload and entry.state != "loaded"
            }
        if wait_preloads:
            for name, load in loads.items():
                failure = load.exception()
                if failure is not None:
                    logger.error("registry: preloading %s failed: %s", name, failure)
        return self

    def close(self, timeout: float = 30.0) -> None:
        """Stop the supervisor, then close every pool (draining up to ``timeout``). Idempotent."""
        with self._cond:
            self._closing = True
            for entry in self._entries.values():
                if entry.load is not None and not entry.load.done():
                    entry.load.set_exception(PoolClosed("the registry closed"))
            steps = list(self._steps)
            self._cond.notify_all()
        for step in steps:
            if step.loading is not None:
                step.loading.close(drain=False, timeout=0.0)
        for thread in (self._thread, *(step.thread for step in steps)):
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout + ABANDON_AFTER_S)
        with self._cond:
            pools = [e.pool for e in self._entries.values() if e.pool is not None]
            for entry in self._entries.values():
                entry.pool = None
                if entry.state != "failed":
                    entry.state = "unloaded"
        for pool in pools:
            pool.close(drain=True, timeout=timeout)
        self._host_tiers.close()  # its pools are closed: nobody writes the tiers now
        if self._own_probe is not None:
            self._own_probe.close()

    def __enter__(self) -> ModelRegistry:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- using a model ------------------------------------------------------------------

    def names(self) -> list[str]:
        """The configured models' names (aliases not included), in configuration order."""
        return list(self._entries)

    def spec(self, name: str) -> ModelSpec:
        """The model a name or alias reaches; ``ModelNotFound`` otherwise."""
        return self._lookup(name).spec

    def acquire(
        self,
        name: str,
        *,
        deadline_s: float | None = None,
        keep_alive: KeepAlive = "default",
        client: str = ANYONE,
    ) -> ModelLease:
        """The model, loaded (waiting for its load, within ``deadline_s``), held until the
        lease is released. ``client``: who asks (a tenant or an address: what its swaps
        cost it, its share of the waiting places, its use of the model); ``keep_alive``
        (seconds, None: as long as ``ttl_s`` allows): how long this client's use keeps the
        model loaded once idle, at most ``ttl_s`` (Ollama's per-request keep_alive, for
        the requester's own use only: another client's use keeps it for its own time).

        Raises ``ModelNotFound``, ``ModelUnavailable`` (failed, backing off: at once),
        ``ModelTooLarge``, ``PoolOverloaded`` (too many waiting), ``QueueFull`` (the swap
        it needs is the client's to wait for past ``deadline_s``: at once, with when to try
        again), ``DeadlineExceeded`` (the load outlasted the deadline; it goes on for the
        others). A refused request changes nothing of the model's."""
        bound_s = self._wait_bound(self._lookup(name), deadline_s)
        entry, load = self._reserve(name, keep_alive, client, bound_s)
        if isinstance(load, ModelLease):
            return load
        try:
            pool = load.result(timeout=bound_s)
        except concurrent.futures.TimeoutError:
            raise self._gave_up(entry, bound_s, client) from None
        except BaseException as exc:
            self._unwait(entry, client)
            raise _fresh(exc) from None
        return self._granted(entry, client, pool, keep_alive)

    async def aacquire(
        self,
        name: str,
        *,
        deadline_s: float | None = None,
        keep_alive: KeepAlive = "default",
        client: str = ANYONE,
    ) -> ModelLease:
        """:meth:`acquire` for asyncio code: waits for a load without a thread."""
        bound_s = self._wait_bound(self._lookup(name), deadline_s)
        entry, load = self._reserve(name, keep_alive, client, bound_s)
        if isinstance(load, ModelLease):
            return load
        try:
            pool = await asyncio.wait_for(asyncio.shield(waited_on(load)), bound_s)
        except TimeoutError:
            raise self._gave_up(entry, bound_s, client) from None
        except BaseException as exc:
            self._unwait(entry, client)
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise _fresh(exc) from None
        return self._granted(entry, client, pool, keep_alive)

    @contextlib.contextmanager
    def use(self, name: str, *, deadline_s: float | None = None) -> Iterator[ModelPool]:
        """``with registry.use("chat") as pool:``: :meth:`acquire`, released on leaving."""
        lease = self.acquire(name, deadline_s=deadline_s)
        try:
            yield lease.pool
        finally:
            lease.release()

    @contextlib.asynccontextmanager
    async def ause(self, name: str, *, deadline_s: float | None = None) -> AsyncIterator[ModelPool]:
        """``async with registry.ause("chat") as pool:``."""
        lease = await self.aacquire(name, deadline_s=deadline_s)
        try:
            yield lease.pool
        finally:
            lease.release()

    def load(self, name: str, *, deadline_s: float | None = None) -> ModelStats:
        """Load a model now (an admin's call) and return its stats once it is loaded."""
        self.acquire(name, deadline_s=deadline_s).release()
        return self.model_stats(name)

    def unload(self, name: str) -> ModelStats:
        """Unload a model (pinned or not: an operator's call); returns at once. A loaded
        model is ``unloading`` from now: its running requests finish (within
        ``unload_timeout_s``), a request that comes meanwhile waits for its reload; a
        loading one serves the requests waiting for it, then unloads the same way."""
        entry = self._lookup(name)
        with self._cond:
            if entry.state in ("loaded", "loading") and not entry.unload_requested:
                entry.unload_requested = True
                entry.unload_by = time.monotonic() + self.config.unload_timeout_s
                if entry.state == "loaded":
                    entry.state = "unloading"
            self._cond.notify_all()
        return self.model_stats(name)

    def let_go(self, name: str, client: str) -> ModelStats:
        """``client``'s use of the model ends now (a tenant's keep_alive 0 without a run,
        Ollama's unload): it unloads once idle unless another client's use keeps it."""
        entry = self._lookup(name)
        with self._cond:
            if client in entry.uses:
                entry.uses[client] = Use(time.monotonic(), 0.0)
            self._cond.notify_all()
        return self.model_stats(name)

    def pin(self, name: str, pinned: bool = True) -> ModelStats:
        """Pin a model (never evicted nor unloaded when idle; an operator's call), or with
        ``pinned=False`` unpin it, whatever its ``pin`` setting; it is not loaded by this
        (``load`` does), and an unpinned model idle past its time unloads."""
        entry = self._lookup(name)
        with self._cond:
            entry.pin_set = pinned
            self._cond.notify_all()
        return self.model_stats(name)

    # ---- internals: reserving ------------------------------------------------------------

    def _reserve(
        self, name: str, keep_alive: KeepAlive, client: str, bound_s: float
    ) -> tuple[Entry, concurrent.futures.Future[ModelPool] | ModelLease]:
        """A lease on the loaded model, or the load to wait for (counted as waiting)."""
        entry = self._lookup(name)
        now = time.monotonic()
        with self._cond:
            if self._closing or self._thread is None:
                raise PoolClosed("the registry is not running (start() it, or it was closed)")
            if entry.state == "loaded" and entry.pool is not None:
                return entry, self._hold(entry, entry.pool, client, keep_alive, now)
            if entry.state == "failed" and (now < entry.retry_at or entry.pool is not None):
                raise self._unavailable(entry, now)
            share = max(1, int(self.config.max_waiting * CLIENT_WAITING_SHARE))
            mine = self._waiting_by.get(client, 0)
            if self._waiting >= self.config.max_waiting or mine >= share:
                raise PoolOverloaded(
                    f"{self._waiting} requests wait for models to load, {mine} of them this "
                    f"client's (max_load_waiters = {self.config.max_waiting}, a client "
                    f"{share} of them)"
                )
            self._refuse_a_swap_past(entry, client, bound_s, now)
            if entry.state in ("unloaded", "failed"):
                entry.asked_by = client
            load = self._request_load(entry)
            self._refuse_a_load_past(entry, bound_s, now)
            entry.waiting += 1
            entry.waiters[client] = entry.waiters.get(client, 0) + 1
            self._waiting += 1
            self._waiting_by[client] = mine + 1
            return entry, load

    def _wait_bound(self, entry: Entry, deadline_s: float | None) -> float:
        return entry.spec.pool.deadline_s if deadline_s is None else max(0.0, deadline_s)

    def _gave_up(self, entry: Entry, bound: float, client: str) -> DeadlineExceeded:
        self._unwait(entry, client)
        return DeadlineExceeded(
            f"model {entry.spec.name!r} did not load within the request's deadline "
            f"({bound:g} s); its load goes on for the other requests"
        )

    def _unwait(self, entry: Entry, client: str) -> None:
        """A waiter is done waiting (it gave up, or holds the model: ``_granted``)."""
        with self._cond:
            entry.waiting -= 1
            self._waiting -= 1
            for counts in (entry.waiters, self._waiting_by):
                counts[client] -= 1
                if not counts[client]:
                    del counts[client]
            self._cond.notify_all()

    def _granted(
        self, entry: Entry, client: str, pool: ModelPool, keep_alive: KeepAlive
    ) -> ModelLease:
        """A waiter's load is done: it holds the model now."""
        with self._cond:
            self._unwait(entry, client)
            return self._hold(entry, pool, client, keep_alive, time.monotonic())

    def _hold(
        self, entry: Entry, pool: ModelPool, client: str, keep_alive: KeepAlive, now: float
    ) -> ModelLease:
        """The lease of one request of ``client`` (lock held): it holds the model, and its
        use (with its keep_alive) is the model's from now."""
        entry.in_flight += 1
        entry.holders[client] = entry.holders.get(client, 0) + 1
        entry.note_use(client, keep_alive, now)
        return ModelLease(self, entry, pool, client, keep_alive)

    def _release(self, entry: Entry, client: str, keep_alive: KeepAlive) -> None:
        with self._cond:
            entry.in_flight -= 1
            entry.holders[client] -= 1
            if not entry.holders[client]:
                del entry.holders[client]
            entry.note_use(client, keep_alive, time.monotonic())
            self._cond.notify_all()

    # ---- internals: the supervisor --------------------------------------------------------

    def _supervise(self) -> None:
        while True:
            start: Step | None = None
            with self._cond:
                now = time.monotonic()
                self._heartbeat = now
                if self._closing:
                    break
                for step in list(self._steps):
                    self._watch_step(step, now)
                start = self._next_step(now, busy=bool(self._steps))
                if start is not None:
                    self._steps.append(start)
                else:
                    self._cond.wait(TICK_S)
            if start is not None:
                start.thread = threading.Thread(
                    target=self._run_step,
                    args=(start,),
                    name=f"modelpool-registry-{start.kind}",
                    daemon=True,
                )
                start.thread.start()
            self._heartbeat = time.monotonic()
            if time.monotonic() >= self._next_sample:
                self._sample()
        self._heartbeat = time.monotonic()

    def _watch_step(self, step: Step, now: float) -> None:
        """A finished step is cleared; one past its deadline has its loading pool killed,
        then is abandoned (lock held)."""
        if step.done:
            self._steps.remove(step)
            return
        if step.deadline is None or now < step.deadline:
            return
        if not step.timed_out:
            step.timed_out = True
            pool = step.loading
            logger.error("registry: %s outlived its deadline; stopping it", step.why)
            if pool is not None:
                threading.Thread(
                    target=pool.close, kwargs={"drain": False, "timeout": 0.0}, daemon=True
                ).start()
            step.deadline = now + ABANDON_AFTER_S
        elif not step.abandoned:
            step.abandoned = True
            entry = step.entry
            if entry is not None and entry.state == "loading":
                reason = (
                    f"its load did not end within {entry.spec.load_deadline_s:g} s "
                    "and could not be stopped"
                )
                self._fail(entry, reason, now)
            self._steps.remove(step)

    def _next_step(self, now: float, *, busy: bool) -> Step | None:
        """The next supervised step, if one is due (lock held). In order: close a failed
        model's pool, an operator's unload once its model is idle (or past its drain), a
        planned swap whose victims have drained, the first pending load that can be
        planned (with its evictions, charged to a client waiting for it: ``swaps``), an
        idle unload, an eviction back under the budget.

        A load that must drain a busy model is planned (its victims ``unloading``: no new
        request gets them) but starts only once they are idle, or ``unload_timeout_s``
        after; the loads behind it are planned meanwhile, and one that fits both now and
        once the drained swap is done starts at once instead of waiting its turn. So does
        one behind a load that cannot be planned yet: a wait is never the whole queue's.

        While steps run (``busy``), a load that evicts nothing and waits for no release
        starts beside them: a slow or failing load holds no other model's. Under a
        budget only where its need and every running load's are proven (measured by a
        load that became ready, ``Budgets.proven_need``) and they fit together, each
        load counted at the most of its planned need, its need now and what it holds
        until its step ends, its processes gone."""
        for entry in self._entries.values():
            if entry.state == "loaded" and entry.pool is not None:
                health = entry.pool.health()
                if not health.alive and health.state in ("failed", "closed"):
                    self._fail(entry, health.reason or "its pool died", now)
        if busy:
            return self._next_load(now, busy=True)
        for entry in self._entries.values():
            if entry.state == "failed" and entry.pool is not None and entry.in_flight == 0:
                return Step(
                    "unload",
                    None,
                    [entry],
                    f"closing failed model {entry.spec.name}",
                    release_by=now + RELEASE_TIMEOUT_S,
                )
        for entry in self._entries.values():
            if (
                entry.state == "unloading"
                and entry.unload_requested
                and entry.pool is not None
                and (entry.in_flight == 0 or now >= entry.unload_by)
            ):
                why = f"unloading {entry.spec.name} (asked for)"
                step = Step("unload", None, [entry], why, release_by=now + RELEASE_TIMEOUT_S)
                step.drain_by = now
                return step
        for step in self._draining:
            if now >= step.drain_by or all(v.in_flight == 0 for v in step.victims):
                self._draining.remove(step)
                assert step.entry is not None
                step.release_by = now + step.entry.spec.load_deadline_s
                return step
        load = self._next_load(now, busy=False)
        if load is not None:
            return load
        for entry in self._entries.values():
            if entry.state != "loaded" or not entry.idle:
                continue
            until = entry.idle_until()
            if until is not None and now >= until:
                entry.state = "unloading"
                why = f"unloading idle model {entry.spec.name}"
                return Step("unload", None, [entry], why, release_by=now + RELEASE_TIMEOUT_S)
        if self._budgets.over_budget():
            tiers = self._budgets.kept_tiers(None)
            if tiers:  # an out model's kept tier goes before a loaded model does
                why = f"dropping the host tier of {tiers[0].spec.name}: over the budget"
                drops = self._drop_tiers(tiers[:1])
                return Step("unload", None, [], why, release_by=now, drops=drops)
            idle = [v for v in self._budgets.candidates(None) if v.idle]
            if idle:
                idle[0].state = "unloading"
                why = f"evicting {idle[0].spec.name}: the models outgrew the budget"
                return Step("unload", None, idle[:1], why, release_by=now + RELEASE_TIMEOUT_S)
        return None

    def _next_load(self, now: float, *, busy: bool) -> Step | None:
        """The first pending load that can be planned (see ``_next_step``; lock held)."""
        for entry in list(self._pending):
            if entry.state != "loading" or entry.pool is not None:
                self._pending.remove(entry)
                continue
            # Whoever waits and owes least pays; with no one waiting, who asked for it.
            payer = self._swaps_ledger.payer(entry.waiters, now) or entry.asked_by
            try:
                plan = self._budgets.plan(entry, payer, now)
            except ModelTooLarge as exc:
                self._pending.remove(entry)
                self._fail(entry, exc.message, now, error=exc)
                continue
            need = self._budgets.proven_need(entry)
            alone = need is None and not self._budgets.unbounded()
            if plan is None or (busy and (plan[0] or plan[1] or plan[2] or alone)):
                continue  # waits for memory not back yet, or its turn; re-planned each round
            victims, awaits, tiers = plan
            self._pending.remove(entry)
            if victims:
                self._swaps += 1
                cost = self._swaps_ledger.charge(payer, entry, victims, now)
                logger.info("registry: a swap of %.1f s charged to %s", cost, payer)
            for victim in victims:
                victim.state = "unloading"
            why = f"loading {entry.spec.name}" + (
                f" (evicting {', '.join(v.spec.name for v in victims)})" if victims else ""
            )
            step = Step(
                "swap",
                entry,
                victims,
                why,
                awaits,
                release_by=now + entry.spec.load_deadline_s,
                need=need,
                drops=self._drop_tiers(tiers),
            )
            if any(v.in_flight for v in victims):
                step.drain_by = now + self.config.unload_timeout_s
                self._draining.append(step)
                logger.info("registry: %s: waiting for the evicted models to drain", why)
                continue
            return step
        return None


def _fresh(exc: BaseException) -> BaseException:
    """A waiter's own copy of a load's error (each carries its own request state)."""
    if isinstance(exc, ModelLoadFailed):
        return exc.copy()
    if isinstance(exc, concurrent.futures.CancelledError):
        return PoolClosed("the model's load was cancelled")
    return exc
