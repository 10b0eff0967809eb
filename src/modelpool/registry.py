"""Many models in one process: :class:`ModelRegistry`, a supervisor of :class:`ModelPool`\\ s.

Each model is a pool of its own, started on its first request (or at start with
``preload``), unloaded when idle past its ``ttl_s`` (or a request's ``keep_alive``), and
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
passed; until then its requests get :class:`~modelpool.errors.ModelUnavailable` at once.

Threads. The state of every model is guarded by one condition lock that no slow call is
made under. One supervising thread (``modelpool-registry``) makes every decision: it
starts one *step* at a time (a swap: unload the evicted models, then load; or one
unload) on a thread of its own, watches the step's deadline, measures memory, unloads
idle models, and notices a loaded pool that died. It wakes at least twice a second, so
its heartbeat (``health()``) shows a wedge; a step that outlives its deadline has its
pool killed and, if even that does not end it, is abandoned with the model ``failed``.

Memory is measured, not guessed: the RSS of each model's worker processes (and their
children) by psutil, and each worker's GPU memory by NVML (the pool's own per-PID
sampling), sampled while the model loads and every second after. A model's *need* is the
most it was ever measured to hold, its processes' peak RSS (the kernel's high-water mark)
included, so that a transient between two samples counts. A model that must load
evicts least-recently-used idle (no request in flight or waiting), unpinned models until
its need fits; a model never measured yet evicts every such model first, so the budget
holds from the first load. A swap whose victim still runs requests waits for them
outside the step, so the loads behind it are planned meanwhile (one that fits now and
after that swap goes first). An evicted model's release is verified before the next
model's workers start: every process measured as its own (the workers and their
children, whatever their process group) gone and its process groups gone (psutil), and
on a GPU the pool's own release checks passed and NVML no longer listing those
processes. A release not verified within the load's deadline holds the load back: its
workers do not start, its requests get :class:`~modelpool.errors.MemoryNotReleased`,
and what is left is measured and counted against the budget until it is gone (the
supervisor checks every second); then the models it held back are ``unloaded`` again
and load on their next request. Requests waiting for a model hold it: a model with
waiters is never idle, so two models that do not fit together alternate by demand
instead of evicting each other in a loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import psutil

from modelpool.config import ModelSpec, ServerConfig, check_model_names
from modelpool.devices import nvml_index_for
from modelpool.errors import (
    DeadlineExceeded,
    MemoryNotReleased,
    ModelLoadFailed,
    ModelNotFound,
    ModelTooLarge,
    ModelUnavailable,
    PoolClosed,
    PoolError,
    PoolOverloaded,
)
from modelpool.gpu import GpuProbe
from modelpool.pool import ModelPool
from modelpool.processes import describe_process, group_members, wait_process_group_gone
from modelpool.stats import PoolHealth, PoolStats

__all__ = [
    "ModelLease",
    "ModelRegistry",
    "ModelState",
    "ModelStats",
    "RegistryConfig",
    "RegistryStats",
    "parse_keep_alive",
]

logger = logging.getLogger(__name__)
_OWN_PID = os.getpid()

ModelState = Literal["unloaded", "loading", "loaded", "unloading", "failed"]
MODEL_STATES: tuple[ModelState, ...] = ("unloaded", "loading", "loaded", "unloading", "failed")
MEMORY = "memory"  # the host-RAM resource; GPUs are named "cuda:N"
# A request's keep_alive: seconds, None for forever, "default" for the model's ttl_s.
KeepAlive = float | None | Literal["default"]

# The supervisor wakes at least this often (its heartbeat), and samples memory this often.
TICK_S = 0.5
SAMPLE_S = 1.0
SAMPLE_WHILE_LOADING_S = 0.25
# A step that its pool's kill did not end within this is abandoned (its thread is stuck
# outside the pool, e.g. in a model download) and the model marked failed.
ABANDON_AFTER_S = 10.0
# An unloaded model's processes must be gone within this after its pool closed (an
# idle unload; a swap waits up to the deadline of the load it makes room for).
RELEASE_TIMEOUT_S = 10.0
# How often a release not yet verified is checked again while a load waits for it.
RELEASE_POLL_S = 0.1


@dataclass(frozen=True)
class RegistryConfig:
    """The models and the registry's rules (the daemon builds it from ``[models.NAME]``
    tables and ``[server]``: see :meth:`from_server`)."""

    models: tuple[ModelSpec, ...]
    memory_budget_bytes: int | None = None
    gpu_memory_budget_bytes: int | None = None
    max_waiting: int = 256
    backoff_s: float = 1.0
    backoff_max_s: float = 60.0
    unload_timeout_s: float = 30.0
    heartbeat_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "models", tuple(self.models))
        if not self.models:
            raise ValueError("a registry needs at least one model")
        check_model_names(self.models)

    @classmethod
    def from_server(cls, models: tuple[ModelSpec, ...], server: ServerConfig) -> RegistryConfig:
        return cls(
            models=models,
            memory_budget_bytes=server.memory_budget_bytes,
            gpu_memory_budget_bytes=server.gpu_memory_budget_bytes,
            max_waiting=server.max_load_waiters,
            backoff_s=server.load_backoff_s,
            backoff_max_s=server.load_backoff_max_s,
        )


@dataclass(frozen=True)
class ModelStats:
    """One model as :meth:`ModelRegistry.stats` saw it. Bytes are measured: ``rss_bytes``
    now (None unless loaded), ``need_bytes`` the most it was ever measured to hold (None
    before its first load), ``gpu_bytes`` by GPU."""

    name: str
    state: ModelState
    reason: str | None
    backend: str
    model: str
    aliases: tuple[str, ...]
    pinned: bool
    loads: int
    unloads: int
    evictions: int
    load_failures: int
    last_load_s: float | None
    load_seconds_total: float
    rss_bytes: int | None
    need_bytes: int | None
    gpu_bytes: dict[str, int]
    in_use: int
    waiting: int
    idle_s: float | None
    retry_in_s: float | None
    keep_alive_s: float | None
    pool: PoolStats | None = None


@dataclass(frozen=True)
class RegistryStats:
    models: dict[str, ModelStats]
    memory_budget_bytes: int | None
    gpu_memory_budget_bytes: int | None
    rss_bytes: int
    peak_rss_bytes: int
    gpu_bytes: dict[str, int]
    peak_gpu_bytes: dict[str, int]
    swaps: int
    waiting: int
    heartbeat_age_s: float | None

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        for name, model in self.models.items():
            data["models"][name]["pool"] = None if model.pool is None else model.pool.to_dict()
        return data


def parse_keep_alive(value: object) -> float | None:
    """Ollama's ``keep_alive``: seconds, or a duration ("30s", "5m", "1h", "1h30m");
    0 unloads once idle, a negative value keeps it loaded (returns None: forever)."""
    if isinstance(value, bool) or value is None:
        raise ValueError(f"keep_alive must be a number of seconds or a duration, got {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        seconds = _duration(value.strip())
    else:
        raise ValueError(f"keep_alive must be a number of seconds or a duration, got {value!r}")
    if not math.isfinite(seconds):
        raise ValueError(f"keep_alive must be finite, got {value!r}")
    return None if seconds < 0 else seconds


def _duration(text: str) -> float:
    units = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
    try:
        return float(text)
    except ValueError:
        pass
    sign = -1.0 if text.startswith("-") else 1.0
    rest, total, number = text.lstrip("+-"), 0.0, ""
    index = 0
    while index < len(rest):
        char = rest[index]
        if char.isdigit() or char == ".":
            number += char
            index += 1
            continue
        unit = "ms" if rest.startswith("ms", index) else char
        if unit not in units or not number:
            raise ValueError(f'keep_alive: cannot read {text!r} (e.g. 30, "90s", "5m", "1h")')
        total += float(number) * units[unit]
        number = ""
        index += len(unit)
    if number or not rest:
        raise ValueError(f'keep_alive: cannot read {text!r} (e.g. 30, "90s", "5m", "1h")')
    return sign * total


@dataclass(eq=False)
class _Lingering:
    """What an unloaded pool left holding memory: the processes measured as the model's
    (snapshotted before its pool closed) and still alive, and GPUs whose release the pool
    could not verify (device -> the bytes the model had there)."""

    processes: list[psutil.Process]
    pids: frozenset[int]
    gpus: dict[str, int]

    def check(self, probe: GpuProbe | None) -> dict[str, int]:
        """Drop what is gone; what is still held, by resource ({}: all of it is back)."""
        self.processes = [p for p in self.processes if _holds_memory(p)]
        held: dict[str, int] = {}
        if self.processes:
            held[MEMORY] = max(1, sum(_rss(p) for p in self.processes))
        for device, needed in list(self.gpus.items()):
            index = None if probe is None else nvml_index_for(device, probe)
            if probe is None or index is None or not probe.available:
                del self.gpus[device]  # nothing left to ask: as the pool's own watch does
                continue
            listed = probe.process_memory(index)
            mine = [used or 0 for pid, used in listed.items() if pid in self.pids]
            free = probe.free_bytes(index)
            if mine or (free is not None and free < needed):
                held[device] = sum(mine) or needed
            else:
                del self.gpus[device]
        return held

    def describe(self) -> str:
        parts = [
            f"{describe_process(p.pid)} holds {_rss(p) / 2**20:.0f} MiB" for p in self.processes
        ]
        parts += [
            f"{device} not free again ({needed} bytes)" for device, needed in self.gpus.items()
        ]
        return "; ".join(parts) or "nothing left"


@dataclass(eq=False)
class _Entry:
    """One model's mutable state; read and written under the registry's lock only."""

    spec: ModelSpec
    state: ModelState = "unloaded"
    pool: ModelPool | None = None
    # The load that waiting requests wait on: set with the pool, or an error.
    load: concurrent.futures.Future[ModelPool] | None = None
    # Requests holding the model: in flight (a lease) or waiting for its load. A model
    # either holds is not idle: it is not unloaded, nor evicted but by a drain.
    in_flight: int = 0
    waiting: int = 0
    last_used: float = 0.0
    keep_alive_s: float | None = None
    keep_alive_set: bool = False
    unload_requested: bool = False
    reason: str | None = None
    error: ModelLoadFailed | None = None
    failures: int = 0
    retry_at: float = 0.0
    loads: int = 0
    unloads: int = 0
    evictions: int = 0
    load_failures: int = 0
    last_load_s: float | None = None
    load_seconds_total: float = 0.0
    # Measured: now, and the most ever (the need), by resource (MEMORY, "cuda:N").
    held: dict[str, int] = field(default_factory=dict)
    need: dict[str, int] | None = None
    # Left by an unload whose release was not verified; counted in ``held`` until gone.
    lingering: _Lingering | None = None
    # Failed only because memory was not back: unloaded again once it is.
    held_back: bool = False

    @property
    def idle(self) -> bool:
        return self.in_flight == 0 and self.waiting == 0

    def idle_limit_s(self) -> float | None:
        """Idle seconds before an unload; None: never (pinned, ``ttl_s`` 0, keep_alive -1)."""
        if self.unload_requested:
            return 0.0
        if self.spec.pin:
            return None
        if self.keep_alive_set:
            return self.keep_alive_s
        return self.spec.ttl_s or None


@dataclass(eq=False)
class _Step:
    """What the supervisor runs on a step thread: unload ``victims``, then load ``entry``."""

    kind: Literal["swap", "unload"]
    entry: _Entry | None
    victims: list[_Entry]
    why: str
    # Models whose unverified release the load waits for, and until when (a swap's load
    # deadline from the step's start; an unload's RELEASE_TIMEOUT_S).
    awaits: list[_Entry] = field(default_factory=list)
    release_by: float = 0.0
    # Until when the victims' running requests may finish (0: unload_timeout_s from the
    # unload's start); past it the unload goes on with them still running.
    drain_by: float = 0.0
    thread: threading.Thread | None = None
    loading: ModelPool | None = None
    deadline: float | None = None
    timed_out: bool = False
    abandoned: bool = False
    done: bool = False


class ModelLease:
    """A model held for one use: its ``pool``, and the promise not to unload it until
    :meth:`release` (idempotent; ``with`` releases it)."""

    def __init__(self, registry: ModelRegistry, entry: _Entry, pool: ModelPool) -> None:
        self.name = entry.spec.name
        self.pool = pool
        self._registry = registry
        self._entry: _Entry | None = entry

    def release(self) -> None:
        entry, self._entry = self._entry, None
        if entry is not None:
            self._registry._release(entry)

    def __enter__(self) -> ModelPool:
        return self.pool

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def __del__(self) -> None:
        self.release()


class ModelRegistry:
    """Several :class:`ModelPool`\\ s by name; the module docstring has the rules."""

    def __init__(self, config: RegistryConfig, *, gpu_probe: GpuProbe | None = None) -> None:
        """``gpu_probe`` replaces the NVML probe of every model's pool and of the
        registry's own release checks (tests); by default each makes its own."""
        self.config = config
        self._gpu_probe = gpu_probe
        self._own_probe: GpuProbe | None = None
        # Re-entrant: a lease dropped unreleased releases itself in __del__, which the
        # garbage collector may run on a thread that holds the lock already.
        self._cond = threading.Condition(threading.RLock())
        self._entries = {spec.name: _Entry(spec) for spec in config.models}
        self._names = {
            name: self._entries[spec.name]
            for spec in config.models
            for name in (spec.name, *spec.aliases)
        }
        self._pending: deque[_Entry] = deque()
        # Swaps planned whose victims are still draining (their requests finishing): not
        # started until they are, so that the loads behind them are planned meanwhile.
        self._draining: list[_Step] = []
        self._step: _Step | None = None
        self._waiting = 0
        self._swaps = 0
        self._closing = False
        self._thread: threading.Thread | None = None
        self._heartbeat: float | None = None
        self._peak: dict[str, int] = {}
        self._next_sample = 0.0
        self._started_at = time.monotonic()

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
                if entry.spec.preload
            }
        if wait_preloads:
            for name, load in loads.items():
                failure = None if load is None else load.exception()
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
            step = self._step
            self._cond.notify_all()
        if step is not None and step.loading is not None:
            step.loading.close(drain=False, timeout=0.0)
        for thread in (self._thread, step.thread if step is not None else None):
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
        self, name: str, *, deadline_s: float | None = None, keep_alive: KeepAlive = "default"
    ) -> ModelLease:
        """The model, loaded (waiting for its load, within ``deadline_s``), held until the
        lease is released. ``keep_alive`` (seconds, None: forever) replaces ``ttl_s``
        from now on, as Ollama's per-request keep_alive does.

        Raises ``ModelNotFound``, ``ModelUnavailable`` (failed, backing off: at once),
        ``ModelTooLarge``, ``PoolOverloaded`` (too many waiting), ``DeadlineExceeded``
        (the load outlasted the deadline; it goes on for the others)."""
        entry, load, lease = self._reserve(name, keep_alive)
        if lease is not None:
            return lease
        assert load is not None
        bound = self._wait_bound(entry, deadline_s)
        try:
            pool = load.result(timeout=bound)
        except concurrent.futures.TimeoutError:
            raise self._gave_up(entry, bound) from None
        except BaseException as exc:
            self._unwait(entry, release=True)
            raise _fresh(exc) from None
        self._unwait(entry, release=False)
        return ModelLease(self, entry, pool)

    async def aacquire(
        self, name: str, *, deadline_s: float | None = None, keep_alive: KeepAlive = "default"
    ) -> ModelLease:
        """:meth:`acquire` for asyncio code: waits for a load without a thread."""
        entry, load, lease = self._reserve(name, keep_alive)
        if lease is not None:
            return lease
        assert load is not None
        bound = self._wait_bound(entry, deadline_s)
        try:
            pool = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(load)), bound)
        except TimeoutError:
            raise self._gave_up(entry, bound) from None
        except BaseException as exc:
            self._unwait(entry, release=True)
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise _fresh(exc) from None
        self._unwait(entry, release=False)
        return ModelLease(self, entry, pool)

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
        """Unload a model as soon as nothing holds it (pinned or not); returns at once."""
        entry = self._lookup(name)
        with self._cond:
            if entry.state in ("loaded", "loading"):
                entry.unload_requested = True
            self._cond.notify_all()
        return self.model_stats(name)

    # ---- observing ----------------------------------------------------------------------

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

    def stats(self, *, with_pools: bool = True) -> RegistryStats:
        """Every model (with its pool's own ``PoolStats`` when loaded and ``with_pools``),
        memory measured now and at its peak, swaps, requests waiting for a load."""
        now = time.monotonic()
        with self._cond:
            models = {name: self._entry_stats(e, now) for name, e in self._entries.items()}
            pools = {n: e.pool for n, e in self._entries.items() if e.state == "loaded" and e.pool}
            held = self._held_total()
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

    # ---- internals: reserving ------------------------------------------------------------

    def _lookup(self, name: str) -> _Entry:
        entry = self._names.get(name) if isinstance(name, str) else None
        if entry is None:
            raise ModelNotFound(
                f"The model {str(name)[:200]!r} does not exist", model=str(name)[:200]
            )
        return entry

    def _reserve(
        self, name: str, keep_alive: KeepAlive
    ) -> tuple[_Entry, concurrent.futures.Future[ModelPool] | None, ModelLease | None]:
        entry = self._lookup(name)
        now = time.monotonic()
        with self._cond:
            if self._closing or self._thread is None:
                raise PoolClosed("the registry is not running (start() it, or it was closed)")
            if keep_alive != "default":
                entry.keep_alive_s = keep_alive
                entry.keep_alive_set = True
            entry.last_used = now
            if entry.state == "loaded" and entry.pool is not None and not entry.unload_requested:
                entry.in_flight += 1
                return entry, None, ModelLease(self, entry, entry.pool)
            if entry.state == "failed" and (now < entry.retry_at or entry.pool is not None):
                raise self._unavailable(entry, now)
            if self._waiting >= self.config.max_waiting:
                raise PoolOverloaded(
                    f"{self._waiting} requests wait for models to load "
                    f"(max_load_waiters = {self.config.max_waiting})"
                )
            entry.unload_requested = False
            load = self._request_load(entry)
            assert load is not None
            entry.waiting += 1
            self._waiting += 1
            return entry, load, None

    def _request_load(self, entry: _Entry) -> concurrent.futures.Future[ModelPool] | None:
        """The load to wait on, asking for one if none is under way (lock held)."""
        if entry.state == "loaded":
            return None
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

    def _unavailable(self, entry: _Entry, now: float) -> ModelLoadFailed:
        if isinstance(entry.error, ModelTooLarge):
            return entry.error.copy()  # a wait would not make it fit: the numbers say why
        if isinstance(entry.error, ModelUnavailable):
            error = entry.error.copy()
            error.retry_after_s = round(max(0.0, entry.retry_at - now), 3)
            return error
        reason = entry.reason or "its last load failed"
        return ModelUnavailable(
            f"model {entry.spec.name!r} is failed: {reason}",
            model=entry.spec.name,
            reason=reason,
            retry_after_s=round(max(0.0, entry.retry_at - now), 3),
        )

    def _wait_bound(self, entry: _Entry, deadline_s: float | None) -> float:
        return entry.spec.pool.deadline_s if deadline_s is None else max(0.0, deadline_s)

    def _gave_up(self, entry: _Entry, bound: float) -> DeadlineExceeded:
        self._unwait(entry, release=True)
        return DeadlineExceeded(
            f"model {entry.spec.name!r} did not load within the request's deadline "
            f"({bound:g} s); its load goes on for the other requests"
        )

    def _unwait(self, entry: _Entry, *, release: bool) -> None:
        """A waiter is done waiting: it holds the model now, or (``release``) gave up."""
        with self._cond:
            entry.waiting -= 1
            self._waiting -= 1
            if not release:
                entry.in_flight += 1
            entry.last_used = time.monotonic()
            self._cond.notify_all()

    def _release(self, entry: _Entry) -> None:
        with self._cond:
            entry.in_flight -= 1
            entry.last_used = time.monotonic()
            self._cond.notify_all()

    # ---- internals: the supervisor --------------------------------------------------------

    def _supervise(self) -> None:
        while True:
            start: _Step | None = None
            with self._cond:
                now = time.monotonic()
                self._heartbeat = now
                if self._closing:
                    break
                self._watch_step(now)
                if self._step is None:
                    start = self._step = self._next_step(now)
                if start is None:
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

    def _watch_step(self, now: float) -> None:
        """A finished step is cleared; one past its deadline has its loading pool killed,
        then is abandoned (lock held)."""
        step = self._step
        if step is None:
            return
        if step.done:
            self._step = None
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
            self._step = None

    def _next_step(self, now: float) -> _Step | None:
        """The next supervised step, if one is due (lock held). In order: close a failed
        model's pool, a planned swap whose victims have drained, the first pending load
        that can be planned (with its evictions), an idle unload, an eviction back under
        the budget.

        A load that must drain a busy model is planned (its victims ``unloading``: no new
        request gets them) but starts only once they are idle, or ``unload_timeout_s``
        after; the loads behind it are planned meanwhile, and one that fits both now and
        once the drained swap is done starts at once instead of waiting its turn. So does
        one behind a load that cannot be planned yet: a wait is never the whole queue's."""
        for entry in self._entries.values():
            if entry.state == "loaded" and entry.pool is not None:
                health = entry.pool.health()
                if not health.alive and health.state in ("failed", "closed"):
                    self._fail(entry, health.reason or "its pool died", now)
        for entry in self._entries.values():
            if entry.state == "failed" and entry.pool is not None and entry.in_flight == 0:
                return _Step(
                    "unload",
                    None,
                    [entry],
                    f"closing failed model {entry.spec.name}",
                    release_by=now + RELEASE_TIMEOUT_S,
                )
        for step in self._draining:
            if now >= step.drain_by or all(v.in_flight == 0 for v in step.victims):
                self._draining.remove(step)
                assert step.entry is not None
                step.release_by = now + step.entry.spec.load_deadline_s
                return step
        for entry in list(self._pending):
            if entry.state != "loading" or entry.pool is not None:
                self._pending.remove(entry)
                continue
            try:
                plan = self._plan(entry)
            except ModelTooLarge as exc:
                self._pending.remove(entry)
                self._fail(entry, exc.message, now, error=exc)
                continue
            if plan is None:
                continue  # waits for memory not back yet; re-planned each round
            victims, awaits = plan
            self._pending.remove(entry)
            if victims:
                self._swaps += 1
            for victim in victims:
                victim.state = "unloading"
            why = f"loading {entry.spec.name}" + (
                f" (evicting {', '.join(v.spec.name for v in victims)})" if victims else ""
            )
            step = _Step(
                "swap", entry, victims, why, awaits, release_by=now + entry.spec.load_deadline_s
            )
            if any(v.in_flight for v in victims):
                step.drain_by = now + self.config.unload_timeout_s
                self._draining.append(step)
                logger.info("registry: %s: waiting for the evicted models to drain", why)
                continue
            return step
        for entry in self._entries.values():
            if entry.state != "loaded" or not entry.idle:
                continue
            limit = entry.idle_limit_s()
            if limit is not None and now - entry.last_used >= limit:
                entry.state = "unloading"
                why = f"unloading idle model {entry.spec.name}"
                return _Step("unload", None, [entry], why, release_by=now + RELEASE_TIMEOUT_S)
        if self._over_budget():
            idle = [v for v in self._candidates(None) if v.idle]
            if idle:
                idle[0].state = "unloading"
                why = f"evicting {idle[0].spec.name}: the models outgrew the budget"
                return _Step("unload", None, idle[:1], why, release_by=now + RELEASE_TIMEOUT_S)
        return None

    def _budget(self, resource: str) -> int | None:
        if resource == MEMORY:
            return self.config.memory_budget_bytes
        return self.config.gpu_memory_budget_bytes

    def _held_total(
        self, without: set[int] | None = None, *, at_peak: bool = False
    ) -> dict[str, int]:
        """What the models hold now, by resource; ``at_peak``: each model that holds
        anything counted at its need (the most it was measured to hold), since a model
        that holds less now may grow back to it while the next one loads."""
        total: dict[str, int] = {}
        for entry in self._entries.values():
            if without is not None and id(entry) in without:
                continue
            held = dict(entry.held)
            if at_peak and held and entry.need and entry.lingering is None:
                held = {r: max(held.get(r, 0), amount) for r, amount in entry.need.items()}
            for resource, amount in held.items():
                total[resource] = total.get(resource, 0) + amount
        return total

    def _over_budget(self) -> bool:
        return any(
            (budget := self._budget(resource)) is not None and amount > budget
            for resource, amount in self._held_total().items()
        )

    def _candidates(self, loading: _Entry | None) -> list[_Entry]:
        """Models that may be evicted: loaded, unpinned, nobody waiting for them (a model
        just loaded for its waiters is theirs first); idle ones first, each group least
        recently used first (lock held)."""
        found = [
            e
            for e in self._entries.values()
            if e.state == "loaded" and not e.spec.pin and e.waiting == 0 and e is not loading
        ]
        return sorted(found, key=lambda e: (not e.idle, e.last_used))

    def _plan(self, entry: _Entry) -> tuple[list[_Entry], list[_Entry]] | None:
        """The models to evict before ``entry`` loads ([]: none) and the models whose
        unverified release it must wait for ([]: none), or None to wait; raises
        ModelTooLarge when it cannot fit even beside the pinned models alone (lock held).

        A model in use is evicted by a drain (no new request gets it, the running ones
        finish, then it unloads) only when the idle ones do not free enough. Memory an
        unverified release left is counted as measured; the load waits for it (within
        its deadline) only when evicting what may be evicted does not make room."""
        if self.config.memory_budget_bytes is None and self.config.gpu_memory_budget_bytes is None:
            return [], []
        candidates = self._candidates(entry)
        movable = {id(e) for e in candidates}
        lingering = [e for e in self._entries.values() if e.lingering is not None]
        # A swap waiting for its victims to drain: their memory is its, and so is its need.
        draining = {id(v) for step in self._draining for v in step.victims}
        reserved: dict[str, int] = {}
        for step in self._draining:
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
            for e in self._entries.values()
        ):
            return None  # a model still unloading or failing: its memory is not back yet
        if entry.need is None:
            # Never measured: every model that may go goes, so that even the first load
            # stays within the budget whatever the model turns out to take.
            if self._draining or any(
                e.state == "loaded" and not e.spec.pin and id(e) not in movable
                for e in self._entries.values()
                if e is not entry
            ):
                return None
            return candidates, lingering
        too_large = self._too_large(entry, entry.need)
        if too_large is not None:
            raise too_large
        for wait in ([], lingering) if lingering else ([],):
            victims: list[_Entry] = []
            # The model's own lingering memory counts too: never two copies of it.
            gone = {id(e) for e in wait} | ({id(entry)} if entry.lingering is None else set())
            for victim in [None, *candidates]:
                if victim is not None:
                    victims.append(victim)
                    gone.add(id(victim))
                # It must fit now, and once the swaps waiting for a drain are done.
                now = self._held_total(without=gone, at_peak=True)
                after = self._held_total(without=gone | draining, at_peak=True)
                if all(
                    (budget := self._budget(r)) is None
                    or max(now.get(r, 0), after.get(r, 0) + reserved.get(r, 0)) + need <= budget
                    for r, need in entry.need.items()
                ):
                    return victims, wait
        return None  # models just loaded for their waiters are in the way: they go first

    def _too_large(self, entry: _Entry, need: dict[str, int]) -> ModelTooLarge | None:
        """The error if ``need`` does not fit a budget even beside the pinned models alone."""
        others = {id(e) for e in self._entries.values() if not e.spec.pin or e is entry}
        floor_by = self._held_total(without=others)
        for resource, amount in need.items():
            budget = self._budget(resource)
            if budget is None:
                continue
            floor = floor_by.get(resource, 0)
            if amount + floor > budget:
                return ModelTooLarge(
                    f"model {entry.spec.name!r} needs {amount} bytes of {resource} (measured "
                    f"when it loaded) but the budget is {budget} bytes"
                    + (f", {budget - floor} of them beside the pinned models" if floor else ""),
                    model=entry.spec.name,
                    resource=resource,
                    needed_bytes=amount,
                    available_bytes=budget - floor,
                    budget_bytes=budget,
                )
        return None

    def _fail(
        self, entry: _Entry, reason: str, now: float, *, error: ModelLoadFailed | None = None
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

    # ---- internals: steps (their own thread) -----------------------------------------------

    def _run_step(self, step: _Step) -> None:
        try:
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

    def _unload(self, entry: _Entry, *, evicted: bool, why: str, step: _Step) -> None:
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
        processes = _process_trees(pids)
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
        lingering = _Lingering(processes, frozenset(p.pid for p in processes), gpus)
        held = self._wait_released(lingering, until)
        logger.info(
            "registry: %s: %s unloaded in %.2f s", why, entry.spec.name, time.monotonic() - started
        )
        with self._cond:
            entry.pool = None
            entry.held = {}
            entry.unloads += 1
            entry.evictions += 1 if evicted else 0
            entry.unload_requested = False
            entry.keep_alive_set = False
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

    def _wait_released(self, lingering: _Lingering, until: float) -> dict[str, int]:
        """Poll ``lingering`` until all of it is back or ``until``; what is still held."""
        while True:
            held = lingering.check(self._probe() if lingering.gpus else None)
            if not held or time.monotonic() >= until:
                return held
            with self._cond:
                if self._cond.wait_for(lambda: self._closing, RELEASE_POLL_S):
                    return held

    def _await_release(self, step: _Step) -> bool:
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

    def _recheck(self, entries: list[_Entry]) -> None:
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

    def _probe(self) -> GpuProbe:
        """NVML for the registry's own release checks: the given probe, or one of its own."""
        if self._gpu_probe is not None:
            return self._gpu_probe
        with self._cond:
            if self._own_probe is None:
                self._own_probe = GpuProbe()
            return self._own_probe

    def _load(self, step: _Step) -> None:
        entry = step.entry
        assert entry is not None
        spec = entry.spec
        pool = ModelPool(spec.pool, gpu_probe=self._gpu_probe)
        started = time.monotonic()
        with self._cond:
            step.loading = pool
            step.deadline = started + spec.load_deadline_s
            if self._closing:
                pool.close(drain=False, timeout=0.0)
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
            if step.abandoned or self._closing or step.timed_out:
                if error is None:
                    threading.Thread(
                        target=pool.close, kwargs={"drain": False}, daemon=True
                    ).start()
                if step.timed_out and not step.abandoned and entry.state == "loading":
                    reason = f"its load did not finish within {spec.load_deadline_s:g} s"
                    self._fail(entry, reason + " (load_timeout_s)", now)
                return
            if error is not None:
                self._fail(entry, f"its load failed: {error}", now)
                return
            self._note_held(entry, held, peak)
            too_large = self._too_large(entry, entry.need or {})
            if too_large is not None:
                entry.held = {}
                threading.Thread(target=pool.close, kwargs={"drain": False}, daemon=True).start()
                self._fail(entry, too_large.message, now, error=too_large)
                return
            entry.pool = pool
            entry.state = "loaded"
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
        logger.info("registry: %s loaded in %.2f s", spec.name, seconds)

    # ---- internals: memory -----------------------------------------------------------------

    def _sample(self) -> None:
        """Measure every loaded (and loading) model's workers; off the lock."""
        now = time.monotonic()
        with self._cond:
            targets = [(e, e.pool) for e in self._entries.values() if e.pool is not None]
            step = self._step
            if step is not None and step.loading is not None and step.entry is not None:
                targets.append((step.entry, step.loading))
            loading = step is not None and step.loading is not None
        self._next_sample = now + (SAMPLE_WHILE_LOADING_S if loading else SAMPLE_S)
        readings = [(entry, pool, *self._measure(pool)) for entry, pool in targets]
        self._recheck(list(self._entries.values()))
        with self._cond:
            step = self._step
            for entry, pool, held, peak in readings:
                # Only a pool still the model's: one unloaded or failed meanwhile holds nothing.
                if entry.pool is pool or (step is not None and step.loading is pool):
                    self._note_held(entry, held, peak)
                if entry.pool is pool and entry.state == "loaded":
                    # Memory measured after the load (a GPU's is often taken lazily, at
                    # the first request) can show a model too large even alone: it is
                    # failed and closed once idle, not evicted and reloaded in a loop.
                    too_large = self._too_large(entry, entry.need or {})
                    if too_large is not None:
                        self._fail(entry, too_large.message, now, error=too_large)

    def _note_held(self, entry: _Entry, held: dict[str, int], peak_rss: int = 0) -> None:
        """Record a measurement: the model's holding now, its need (raised to its
        processes' peak RSS too), the registry's peak (lock held)."""
        if not held:
            return
        entry.held = held
        need = dict(entry.need or {})
        for resource, amount in held.items():
            need[resource] = max(need.get(resource, 0), amount)
        if MEMORY in held:
            need[MEMORY] = max(need[MEMORY], peak_rss)
        entry.need = need
        for resource, amount in self._held_total().items():
            self._peak[resource] = max(self._peak.get(resource, 0), amount)

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
        held: dict[str, int] = {MEMORY: 0}
        peak = 0
        for worker in stats.workers:
            if worker.pid is None:
                continue
            rss, high = _tree_rss(worker.pid)
            held[MEMORY] += rss
            peak += high
            for device, mb in worker.gpu_mb_by_device.items():
                if mb is not None:
                    held[device] = held.get(device, 0) + int(mb * 2**20)
        return held, peak

    def _entry_stats(self, entry: _Entry, now: float) -> ModelStats:
        spec = entry.spec
        return ModelStats(
            name=spec.name,
            state=entry.state,
            reason=entry.reason,
            backend=spec.pool.backend,
            model=spec.pool.model,
            aliases=spec.aliases,
            pinned=spec.pin,
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
            keep_alive_s=entry.idle_limit_s(),
        )


def _process_trees(pids: list[int]) -> list[psutil.Process]:
    """The processes ``pids`` and all their descendants now (ourselves never included)."""
    found: list[psutil.Process] = []
    for pid in pids:
        try:
            process = psutil.Process(pid)
            members = [process, *process.children(recursive=True)]
        except (psutil.Error, OSError):
            continue
        found += [m for m in members if m.pid != _OWN_PID and m not in found]
    return found


def _holds_memory(process: psutil.Process) -> bool:
    """Alive and not a zombie (a zombie holds no memory but its process-table entry)."""
    try:
        return bool(process.is_running()) and process.status() != psutil.STATUS_ZOMBIE
    except (psutil.Error, OSError):
        return False


def _rss(process: psutil.Process) -> int:
    try:
        return int(process.memory_info().rss)
    except (psutil.Error, OSError):
        return 0


def _tree_rss(pid: int) -> tuple[int, int]:
    """RSS of ``pid`` and its descendants now, and the sum of their peak RSS."""
    try:
        process = psutil.Process(pid)
        members = [process, *process.children(recursive=True)]
    except (psutil.Error, OSError):
        return 0, 0
    total = peak = 0
    for member in members:
        with contextlib.suppress(psutil.Error, OSError):
            rss = int(member.memory_info().rss)
            total += rss
            peak += max(rss, _peak_rss(member.pid))
    return total, peak


def _peak_rss(pid: int) -> int:
    """The process's peak RSS (Linux's VmHWM; 0 where it cannot be read)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as status:
            for line in status:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _fresh(exc: BaseException) -> BaseException:
    """A waiter's own copy of a load's error (each carries its own request state)."""
    if isinstance(exc, ModelLoadFailed):
        return exc.copy()
    if isinstance(exc, concurrent.futures.CancelledError):
        return PoolClosed("the model's load was cancelled")
    return exc
