"""The registry's records: its configuration, the stats it reports, a request's
``keep_alive``, each model's entry (state, pool, holders, measured memory, failures) and
a step (a swap or an unload), and the process-tree memory readings they are built from.

Everything here is data and small pure readings; the decisions are
:mod:`modelpool.supervisor.registry.core`'s and :mod:`modelpool.supervisor.registry.budget`'s.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import math
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import psutil

from modelpool.shared.config import ModelSpec, ServerConfig, check_model_names
from modelpool.shared.embedded import modelpool_home
from modelpool.shared.errors import ModelLoadFailed
from modelpool.shared.lora import AdapterSpec
from modelpool.shared.processes import describe_process
from modelpool.supervisor.devices import nvml_index_for
from modelpool.supervisor.gpu import GpuProbe
from modelpool.supervisor.pool import ModelPool
from modelpool.supervisor.stats import PoolStats

ModelState = Literal["unloaded", "loading", "loaded", "unloading", "failed"]


MODEL_STATES: tuple[ModelState, ...] = ("unloaded", "loading", "loaded", "unloading", "failed")


MEMORY = "memory"  # the host-RAM resource; GPUs are named "cuda:N"

# The file (in [server] state_dir) each model's measured need is kept in (registry.needs).
NEEDS_FILE = "model-needs.json"


# A request's keep_alive: seconds, None for forever, "default" for the model's ttl_s.
KeepAlive = float | None | Literal["default"]

# Where a model's need comes from: measured in this process, saved by an earlier one (the
# state file), or estimated from its files before it was ever measured.
NeedSource = Literal["measured", "saved", "estimated"]

# A client of the registry with no name of its own (a library call, the operator).
ANYONE = "-"
# The clients' uses of one model kept (its idle time is theirs): the most recent ones.
MAX_USES = 1024


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
    # Swaps that cannot storm (see modelpool.supervisor.registry.swaps): a model serves a client at
    # least this long after its last request before a client that owes swap time may
    # evict it; one client's swaps may take other clients' models away at most this
    # share of the time.
    min_residency_s: float = 3.0
    swap_share: float = 0.2
    # The file each model's measured need is kept in across restarts (None: not kept).
    needs_file: str | None = None
    # LoRA adapters ([models.NAME] with base and adapter), served by their base's pool.
    adapters: tuple[AdapterSpec, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "models", tuple(self.models))
        if not self.models:
            raise ValueError("a registry needs at least one model")
        check_model_names(self.models)
        names = {name for spec in self.models for name in (spec.name, *spec.aliases)}
        for adapter in self.adapters:
            if adapter.name in names:
                raise ValueError(f"models.{adapter.name}: the name is taken by another model")
            if adapter.base not in names:
                raise ValueError(
                    f"models.{adapter.name}: base {adapter.base!r} is not a model of [models]"
                )
            names.add(adapter.name)

    @classmethod
    def from_server(
        cls,
        models: tuple[ModelSpec, ...],
        server: ServerConfig,
        adapters: tuple[AdapterSpec, ...] = (),
    ) -> RegistryConfig:
        return cls(
            models=models,
            adapters=adapters,
            memory_budget_bytes=server.memory_budget_bytes,
            gpu_memory_budget_bytes=server.gpu_memory_budget_bytes,
            max_waiting=server.max_load_waiters,
            backoff_s=server.load_backoff_s,
            backoff_max_s=server.load_backoff_max_s,
            min_residency_s=server.min_residency_s,
            swap_share=server.swap_share,
            needs_file=needs_file(server.state_dir),
        )


def needs_file(state_dir: str | None) -> str | None:
    """The needs file in ``state_dir`` (None: ``$MODELPOOL_HOME/state``; "": none kept)."""
    if state_dir == "":
        return None
    folder = Path(state_dir).expanduser() if state_dir else modelpool_home() / "state"
    return str(folder / NEEDS_FILE)


@dataclass(frozen=True)
class ModelStats:
    """One model as :meth:`ModelRegistry.stats` saw it. Bytes are measured: ``rss_bytes``
    now (None unless loaded), ``need_bytes`` what a load of it is planned to take (None:
    not known; ``need_source`` says whether it was measured, saved by an earlier run or
    estimated from its files), ``gpu_bytes`` by GPU. ``keep_alive_s``: idle seconds
    after its last use before it unloads (None: never). ``host_tier_bytes``: the bytes of
    the host prefix cache tier the registry keeps for it while it is out (None: it keeps
    none, or the model is loaded: its pool's ``prefix_tiers`` show the tier)."""

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
    need_source: NeedSource | None = None
    pool: PoolStats | None = None
    # The bytes of the host prefix cache tier kept for it while it is out (None: none kept).
    host_tier_bytes: int | None = None


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


# The longest keep_alive a request may give: past it a date computed from it overflows.
MAX_KEEP_ALIVE_S = 10 * 365 * 24 * 3600.0


def parse_keep_alive(value: object) -> float | None:
    """Ollama's ``keep_alive``: seconds, or a duration ("30s", "5m", "1h", "1h30m");
    0 unloads once idle, a negative value keeps it loaded (returns None: forever)."""
    if isinstance(value, bool) or value is None:
        raise ValueError(f"keep_alive must be a number of seconds or a duration, got {value!r}")
    if isinstance(value, (int, float)):
        try:
            seconds = float(value)
        except OverflowError:
            raise ValueError(f"keep_alive must be finite, got {value!r}") from None
    elif isinstance(value, str):
        seconds = _duration(value.strip())
    else:
        raise ValueError(f"keep_alive must be a number of seconds or a duration, got {value!r}")
    if not math.isfinite(seconds):
        raise ValueError(f"keep_alive must be finite, got {value!r}")
    if seconds > MAX_KEEP_ALIVE_S:
        raise ValueError(
            f"keep_alive must be at most {MAX_KEEP_ALIVE_S:.0f} s (ten years; a negative "
            f"value keeps the model loaded), got {value!r}"
        )
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
class Lingering:
    """What an unloaded pool left holding memory: the processes measured as the model's
    (snapshotted before its pool closed) and still alive, and GPUs whose release the pool
    could not verify (device -> the bytes the model had there)."""

    processes: list[psutil.Process]
    pids: frozenset[int]
    gpus: dict[str, int]

    def check(self, probe: GpuProbe | None) -> dict[str, int]:
        """Drop what is gone; what is still held, by resource ({}: all of it is back)."""
        self.processes = [p for p in self.processes if holds_memory(p)]
        held: dict[str, int] = {}
        if self.processes:
            held[MEMORY] = max(1, sum(rss(p) for p in self.processes))
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
            f"{describe_process(p.pid)} holds {rss(p) / 2**20:.0f} MiB" for p in self.processes
        ]
        parts += [
            f"{device} not free again ({needed} bytes)" for device, needed in self.gpus.items()
        ]
        return "; ".join(parts) or "nothing left"


@dataclass(eq=False)
class Entry:
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
    # The same by client: the ones holding a lease, and the ones waiting for the load.
    holders: dict[str, int] = field(default_factory=dict)
    waiters: dict[str, int] = field(default_factory=dict)
    last_used: float = 0.0
    # Each client's last use and the keep_alive it asked for: a client's keep_alive counts
    # for its own use only (see idle_until).
    uses: dict[str, Use] = field(default_factory=dict)
    # The client whose request asked for the load under way (its payer if none waits).
    asked_by: str = ANYONE
    # An operator's /models/pin or /models/unpin; None: the spec's ``pin``.
    pin_set: bool | None = None
    # An operator's unload: drained (new requests wait for the reload) until unload_by.
    unload_requested: bool = False
    unload_by: float = 0.0
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
    # Measured now, by resource (MEMORY, "cuda:N"); the need: what a load is planned to
    # take (see modelpool.supervisor.registry.memory for how it settles).
    held: dict[str, int] = field(default_factory=dict)
    need: dict[str, int] | None = None
    need_source: NeedSource | None = None
    # The peak of its loads (their processes' high-water marks when ready) and this load's
    # readings since, each (time, holding): the need is the most of them in NEED_WINDOW_S.
    load_peak: dict[str, int] = field(default_factory=dict)
    readings: list[tuple[float, dict[str, int]]] = field(default_factory=list)
    # Left by an unload whose release was not verified; counted in ``held`` until gone.
    lingering: Lingering | None = None
    # Failed only because memory was not back: unloaded again once it is.
    held_back: bool = False
    # The bytes of its host prefix cache tier the registry keeps while it is out
    # (``host_tiers``); 0 while it loads or is loaded, when ``held`` counts the tier.
    tier_bytes: int = 0

    @property
    def idle(self) -> bool:
        return self.in_flight == 0 and self.waiting == 0

    @property
    def pinned(self) -> bool:
        return self.spec.pin if self.pin_set is None else self.pin_set

    def note_use(self, client: str, keep_alive: KeepAlive, now: float) -> None:
        """``client`` uses the model now, asking for ``keep_alive`` (lock held); the uses
        that no longer keep it loaded are forgotten."""
        self.last_used = now
        self.uses[client] = Use(now, keep_alive)
        ttl = self.spec.ttl_s or None
        for name, use in list(self.uses.items()):
            until = use.until(ttl)
            if until is not None and until < now:
                del self.uses[name]
        if len(self.uses) > MAX_USES:  # many clients of a model kept for ever: bounded
            del self.uses[min(self.uses, key=lambda name: self.uses[name].at)]

    def idle_until(self) -> float | None:
        """When the idle model unloads (monotonic); None: never (pinned, ``ttl_s`` 0).

        Each client's use keeps it for that client's keep_alive, at most ``ttl_s``: a
        request's keep_alive shortens the idle time of its own client's use only, so a
        model another client used within ``ttl_s`` stays; an operator's unload is at once."""
        if self.unload_requested:
            return self.last_used
        if self.pinned:
            return None
        ttl = self.spec.ttl_s or None
        if not self.uses:
            return None if ttl is None else self.last_used + ttl
        latest = 0.0
        for use in self.uses.values():
            until = use.until(ttl)
            if until is None:
                return None
            latest = max(latest, until)
        return latest

    def recent_users(self, since: float) -> set[str]:
        """The clients that used the model since ``since`` (monotonic)."""
        return {name for name, use in self.uses.items() if use.at >= since}


@dataclass(frozen=True)
class Use:
    """A client's last use of a model and the keep_alive it asked for."""

    at: float
    keep_alive: KeepAlive

    def until(self, ttl: float | None) -> float | None:
        """When this use stops keeping the model (None: never): its keep_alive, or the
        model's ``ttl`` (None: never) when it asked for none, and never past ``ttl``."""
        limit = ttl if self.keep_alive == "default" else self.keep_alive
        if limit is None:
            limit = ttl
        elif ttl is not None:
            limit = min(limit, ttl)
        return None if limit is None else self.at + limit


@dataclass(eq=False)
class Step:
    """What the supervisor runs on a step thread: unload ``victims``, then load ``entry``."""

    kind: Literal["swap", "unload"]
    entry: Entry | None
    victims: list[Entry]
    why: str
    # Models whose unverified release the load waits for, and until when (a swap's load
    # deadline from the step's start; an unload's RELEASE_TIMEOUT_S).
    awaits: list[Entry] = field(default_factory=list)
    release_by: float = 0.0
    # Until when the victims' running requests may finish (0: unload_timeout_s from the
    # unload's start); past it the unload goes on with them still running.
    drain_by: float = 0.0
    # The need the load was planned at when proven (``Budgets.proven_need``); None: not
    # known, nothing loads beside it.
    need: dict[str, int] | None = None
    # Out models' host tier directories to remove before anything else (``host_tiers``).
    drops: list[str] = field(default_factory=list)
    thread: threading.Thread | None = None
    loading: ModelPool | None = None
    deadline: float | None = None
    timed_out: bool = False
    abandoned: bool = False
    done: bool = False


def process_trees(pids: list[int]) -> list[psutil.Process]:
    """The processes ``pids`` and all their descendants now (ourselves never included)."""
    found: list[psutil.Process] = []
    for pid in pids:
        try:
            process = psutil.Process(pid)
            members = [process, *process.children(recursive=True)]
        except (psutil.Error, OSError):
            continue
        found += [m for m in members if m.pid != OWN_PID and m not in found]
    return found


def holds_memory(process: psutil.Process) -> bool:
    """Alive and not a zombie (a zombie holds no memory but its process-table entry)."""
    try:
        return bool(process.is_running()) and process.status() != psutil.STATUS_ZOMBIE
    except (psutil.Error, OSError):
        return False


def rss(process: psutil.Process) -> int:
    try:
        return int(process.memory_info().rss)
    except (psutil.Error, OSError):
        return 0


def tree_rss(pid: int) -> tuple[int, int]:
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
            peak += max(rss, peak_rss(member.pid))
    return total, peak


def peak_rss(pid: int) -> int:
    """The process's peak RSS (Linux's VmHWM; 0 where it cannot be read)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as status:
            for line in status:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


OWN_PID = os.getpid()
