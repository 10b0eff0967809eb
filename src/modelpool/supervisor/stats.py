"""The pool's stats snapshot.

``ModelPool.stats()`` returns a :class:`PoolStats` built by the dispatcher
thread (the one owner of the state it describes), so a snapshot is always
self-consistent and taking one never waits on a busy worker::

    snapshot = pool.stats()
    snapshot.counters["timeouts"], snapshot.to_dict()["workers"][0]["rss_mb"]
    snapshot.max_model_len          # the model's context length, once a worker is ready
    snapshot.task                   # "generate", "embed" or "score" (protocol.Task)
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from modelpool.shared.prefix_tier import TierStats

COUNTER_NAMES = (
    "submitted",
    "completed",
    "failed",
    "cancelled",
    "timeouts",
    "crashes",
    "kills",
    "retries",
    "respawns",
    "overloaded",
    "stalls",
    "cancel_escalations",
    "recycled",
    "collateral_retries",
    "poison_requests",
    "withdrawn",
    "cuda_oom",
    "cuda_errors",
    "queue_full",
    "preemptions",
    # A reasoning model's thinking the worker closed, by why (docs/reasoning.md).
    "thinking_closed_budget",
    "thinking_closed_reserve",
    "thinking_closed_loop",
    "thinking_closed_deadline",
)


@dataclass(frozen=True)
class PrefixCacheStats:
    """A worker's prefix cache as it last reported it (hf backend; see docs/batching.md)."""

    bytes: int
    limit_bytes: int
    entries: int
    hits: int
    lookups: int
    evictions: int
    cached_tokens: int


@dataclass(frozen=True)
class WorkerStats:
    id: int
    pid: int | None
    state: str
    role: str
    device: str
    requests: int
    uptime_s: float
    rss_mb: float | None
    gpu_mb: float | None
    gpu_mb_method: str | None = None
    max_model_len: int | None = None
    slots: int = 1
    running: list[str] = field(default_factory=list)
    # The pool slot it fills (0 .. workers + spares - 1): a replacement takes the same one.
    pool_slot: int = 0
    gpu_mb_by_device: dict[str, float | None] = field(default_factory=dict)
    # Batched workers: requests sent to it that wait there for KV room (not in ``running``)
    # and its free KV room in tokens, as the worker last reported it.
    waiting_for_room: list[str] = field(default_factory=list)
    kv_free_tokens: int | None = None
    # None: its backend keeps no prefix cache, or has not reported one yet.
    prefix_cache: PrefixCacheStats | None = None


@dataclass(frozen=True)
class ReleaseStats:
    """Memory release checks after worker exits. ``last_freed_mb``: the last checked
    worker's resident memory (RSS) when it was last sampled, freed with its process; GPU
    memory still held after an exit is in ``GpuStats.blocked_held_mb`` instead."""

    checked: int = 0
    ok: int = 0
    failed: int = 0
    last_ms: float | None = None
    last_method: str | None = None
    last_freed_mb: float | None = None


@dataclass(frozen=True)
class DeviceStats:
    index: int
    name: str
    used_mb: float
    total_mb: float


@dataclass(frozen=True)
class GpuStats:
    available: bool
    reason: str | None
    devices: list[DeviceStats] = field(default_factory=list)
    releases: ReleaseStats = field(default_factory=ReleaseStats)
    blocked_devices: list[str] = field(default_factory=list)
    blocked_held_mb: dict[str, float | None] = field(default_factory=dict)
    blocked_holders: dict[str, list[str]] = field(default_factory=dict)


@dataclass(frozen=True)
class PoolStats:
    state: str
    workers: list[WorkerStats]
    queue_depth: int
    counters: dict[str, int]
    latency_s: dict[str, float | None]
    gpu: GpuStats
    uptime_s: float
    last_load_error: str | None = None
    kill_reasons: dict[str, int] = field(default_factory=dict)
    # The model's context length in tokens, as the workers report it (None: not known).
    max_model_len: int | None = None
    # Seconds since the dispatcher thread last went round its loop (None before start()).
    heartbeat_age_s: float | None = None
    capacity: int = 0
    running: int = 0
    # Moving averages of finished runs (scheduling.prediction.WaitPredictor), the queued requests by
    # priority, and the last kills, exits, release checks and retries (observe.WorkerEvent).
    throughput: dict[str, float | int] = field(default_factory=dict)
    queue_by_priority: dict[str, int] = field(default_factory=dict)
    recent_events: list[dict[str, Any]] = field(default_factory=list)
    # The backend the workers run ("auto" until start() chose one) and why, in a sentence.
    backend: str = ""
    backend_reason: str | None = None
    # What the model does, as the workers report it: "generate", "embed" or "score".
    task: str = "generate"
    # The prefix cache tiers' bytes and counters, host first (docs/prefix-tiers.md).
    prefix_tiers: list[TierStats] = field(default_factory=list)

    @property
    def batch_occupancy(self) -> float:
        """Requests running in workers over the serving capacity (workers x batch slots)."""
        return self.running / self.capacity if self.capacity else 0.0

    @staticmethod
    def count_completed(counters: dict[str, int], closed: str | None) -> None:
        """A request completed (the dispatcher's ``counters``); ``closed``: why the worker
        closed its thinking, if it did."""
        counters["completed"] += 1
        if closed is not None:
            key = f"thinking_closed_{closed}"
            counters[key] = counters.get(key, 0) + 1

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: the keys docs/observability.md's Stats section lists."""
        data = asdict(self)
        data["batch_occupancy"] = self.batch_occupancy
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


@dataclass(frozen=True)
class PoolHealth:
    """Is the pool alive? ``ModelPool.health()``; ``/healthz`` and Ray's ``check_health``.

    Alive is not ready: a pool that is starting, or degraded with no ready worker, is
    alive. ``reason`` says what is wrong when ``alive`` is false.
    """

    alive: bool
    state: str
    heartbeat_age_s: float | None
    reason: str | None = None


def percentiles(samples: list[float]) -> dict[str, float | None]:
    """Nearest-rank p50/p95/p99 of ``samples`` (None when there are none)."""
    if not samples:
        return {"p50": None, "p95": None, "p99": None}
    ordered = sorted(samples)
    last = len(ordered) - 1

    def rank(fraction: float) -> float:
        return ordered[min(last, round(fraction * last))]

    return {"p50": rank(0.50), "p95": rank(0.95), "p99": rank(0.99)}
