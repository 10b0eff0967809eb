"""Prometheus metrics for the daemon, rendered from a
:class:`~modelpool.supervisor.stats.PoolStats`.

The pool's counters live in the dispatcher; copying them into prometheus-client
counters would mean two sources of truth that drift. Instead a custom collector
reads one fresh ``PoolStats`` per scrape and renders it, so ``/metrics`` and
``/stats`` always agree. Only the request-duration histogram is observed here,
by the HTTP server, because the pool keeps percentiles, not buckets::

    metrics = PoolMetrics(pool.stats)
    metrics.observe_request(0.012)
    body = metrics.render()                     # text/plain; version=0.0.4

This module is the only one that imports ``prometheus_client`` (the
``server`` extra), so the core package installs without it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from modelpool.server.vllm_metrics import VllmMetrics
from modelpool.supervisor.stats import PoolStats

if TYPE_CHECKING:
    from modelpool.supervisor.registry import RegistryStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Every state a worker can show in stats(); each is exported (as 0 when empty) so that a
# dashboard query never sees a series appear and disappear.
WORKER_STATES = ("starting", "idle", "busy", "cancelling", "killing", "stopping", "spare")
POOL_STATES = ("starting", "ready", "degraded", "failed", "closed")
REQUEST_OUTCOMES = ("completed", "failed", "cancelled", "overloaded")

# Generation requests on CPU range from a millisecond (echo) to minutes (a long
# completion on a big model); the default buckets stop at 10 s.
DURATION_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)

_MIB = 2**20


class PoolCollector(Collector):
    """Renders the snapshot ``stats_source()`` returns, once per scrape (and, with
    ``vllm``, its gauges under vLLM's names; ``waiting``: runs the daemon holds back)."""

    def __init__(
        self,
        stats_source: Callable[[], PoolStats],
        vllm: VllmMetrics | None = None,
        model: str = "",
        waiting: Callable[[], int] = lambda: 0,
    ) -> None:
        self._stats_source = stats_source
        self._vllm = vllm
        self._model = model
        self._waiting = waiting

    def collect(self) -> Iterator[Metric]:
        stats = self._stats_source()
        yield from stats_families(stats)
        if self._vllm is not None:
            yield from self._vllm.gauges({self._model: (stats, self._waiting())})


def stats_families(stats: PoolStats) -> Iterator[Metric]:
    """The metric families for one snapshot (everything but the request histogram)."""
    counters = stats.counters

    requests = CounterMetricFamily(
        "modelpool_requests",
        "Requests the pool finished or turned away, by outcome.",
        labels=["outcome"],
    )
    for outcome in REQUEST_OUTCOMES:
        requests.add_metric([outcome], counters.get(outcome, 0))
    yield requests

    yield from _counters(counters, REQUEST_COUNTERS)
    closed = CounterMetricFamily(
        "modelpool_thinking_closed",
        "Reasoning models' thinking closed by the worker, by reason (docs/reasoning.md).",
        labels=["reason"],
    )
    for reason in ("budget", "reserve", "loop", "deadline"):
        closed.add_metric([reason], counters.get(f"thinking_closed_{reason}", 0))
    yield closed

    yield _gauge("modelpool_queue_depth", "Requests waiting for a worker.", stats.queue_depth)
    yield _gauge("modelpool_running_requests", "Requests running in workers.", stats.running)
    yield _gauge(
        "modelpool_capacity",
        "Requests the serving workers can run at once (workers x max_batch_size).",
        stats.capacity,
    )
    yield _gauge(
        "modelpool_batch_occupancy",
        "Running requests over capacity: 1.0 when every batch slot is in use.",
        stats.batch_occupancy,
    )

    state = GaugeMetricFamily(
        "modelpool_pool_state",
        "1 for the pool's current state, 0 for the others.",
        labels=["state"],
    )
    for name in _with_extra(POOL_STATES, [stats.state]):
        state.add_metric([name], 1.0 if name == stats.state else 0.0)
    yield state

    by_state: dict[str, int] = dict.fromkeys(WORKER_STATES, 0)
    for worker in stats.workers:
        by_state[worker.state] = by_state.get(worker.state, 0) + 1
    workers = GaugeMetricFamily(
        "modelpool_workers", "Worker processes, by state.", labels=["state"]
    )
    for name, count in by_state.items():
        workers.add_metric([name], count)
    yield workers

    rss = GaugeMetricFamily(
        "modelpool_worker_resident_memory_bytes",
        "Resident memory of each worker, as it last reported it.",
        labels=["worker", "device"],
    )
    for worker in stats.workers:
        if worker.rss_mb is not None:
            rss.add_metric([str(worker.id), worker.device], worker.rss_mb * _MIB)
    yield rss

    yield from _prefix_cache_families(stats)
    yield from _prefix_tier_families(stats)

    kills = CounterMetricFamily(
        "modelpool_worker_kills",
        "Workers the pool signalled to stop, by reason.",
        labels=["reason"],
    )
    for reason, count in sorted(stats.kill_reasons.items()):
        kills.add_metric([reason], count)
    yield kills

    yield from _counters(counters, WORKER_COUNTERS)

    gpu = stats.gpu
    yield _gauge(
        "modelpool_gpu_available", "1 when NVML answers, else 0.", 1.0 if gpu.available else 0.0
    )
    used = GaugeMetricFamily(
        "modelpool_gpu_memory_bytes",
        "Memory in use on each GPU (all processes).",
        labels=["device"],
    )
    total = GaugeMetricFamily(
        "modelpool_gpu_memory_total_bytes", "Memory of each GPU.", labels=["device"]
    )
    for device in gpu.devices:
        label = f"cuda:{device.index}"
        used.add_metric([label], device.used_mb * _MIB)
        total.add_metric([label], device.total_mb * _MIB)
    yield used
    yield total
    per_worker = GaugeMetricFamily(
        "modelpool_worker_gpu_memory_bytes",
        "GPU memory of each worker on each GPU of its group, where NVML lists its PID.",
        labels=["worker", "device"],
    )
    for worker in stats.workers:
        for device_name, mb in sorted(worker.gpu_mb_by_device.items()):
            if mb is not None:
                per_worker.add_metric([str(worker.id), device_name], mb * _MIB)
    yield per_worker
    blocked = GaugeMetricFamily(
        "modelpool_gpu_blocked_held_bytes",
        "Memory a dead worker still holds on a GPU that blocks its group (NaN: unknown).",
        labels=["device"],
    )
    for device_name, held_mb in sorted(gpu.blocked_held_mb.items()):
        blocked.add_metric([device_name], float("nan") if held_mb is None else held_mb * _MIB)
    yield blocked

    releases = gpu.releases
    last = GaugeMetricFamily(
        "modelpool_gpu_release_seconds",
        "How long the last check that a stopped worker's memory was released took.",
    )
    # No sample before the first check: a made-up 0 would read as "instant".
    if releases.last_ms is not None:
        last.add_metric([], releases.last_ms / 1000.0)
    yield last
    results = CounterMetricFamily(
        "modelpool_gpu_releases",
        "Checks that a stopped worker's memory was released, by result.",
        labels=["result"],
    )
    results.add_metric(["ok"], releases.ok)
    results.add_metric(["failed"], releases.failed)
    yield results

    yield _gauge("modelpool_uptime_seconds", "Seconds since the pool was created.", stats.uptime_s)
    if stats.heartbeat_age_s is not None:
        yield _gauge(
            "modelpool_heartbeat_age_seconds",
            "Seconds since the dispatcher thread last went round its loop (liveness).",
            stats.heartbeat_age_s,
        )


class RegistryCollector(Collector):
    """Renders a :class:`~modelpool.supervisor.registry.ModelRegistry`'s snapshot once per
    scrape: each
    loaded model's pool families with a ``model`` label, and the registry's own."""

    def __init__(
        self, stats_source: Callable[[], RegistryStats], vllm: VllmMetrics | None = None
    ) -> None:
        self._stats_source = stats_source
        self._vllm = vllm

    def collect(self) -> Iterator[Metric]:
        stats = self._stats_source()
        if self._vllm is not None:
            loaded = {n: (m.pool, 0) for n, m in stats.models.items() if m.pool is not None}
            yield from self._vllm.gauges(loaded)
        merged: dict[str, Metric] = {}
        for name, model in stats.models.items():
            if model.pool is None:
                continue
            for family in stats_families(model.pool):
                into = merged.get(family.name)
                if into is None:
                    into = merged[family.name] = Metric(
                        family.name, family.documentation, family.type
                    )
                for sample in family.samples:
                    into.add_sample(sample.name, {**sample.labels, "model": name}, sample.value)
        yield from merged.values()
        yield from registry_families(stats)


def registry_families(stats: RegistryStats) -> Iterator[Metric]:
    """The registry's families: each model's state, loads, unloads, evictions, load
    failures and times, measured memory; the budget, the peak, swaps, waiters."""
    from modelpool.supervisor.registry import MODEL_STATES

    state = GaugeMetricFamily(
        "modelpool_model_state", "1 for each model's current state.", labels=["model", "state"]
    )
    counts = {
        key: CounterMetricFamily(f"modelpool_model_{key}", text, labels=["model"])
        for key, text in (
            ("loads", "Loads of each model that ended with every worker ready."),
            ("unloads", "Unloads of each model (idle, evicted, asked for, or failed)."),
            ("evictions", "Unloads of each model to make room for another."),
            ("load_failures", "Loads of each model that failed, or pools of it that died."),
        )
    }
    load_time = CounterMetricFamily(
        "modelpool_model_load_seconds", "Seconds spent loading each model.", labels=["model"]
    )
    last_load = GaugeMetricFamily(
        "modelpool_model_last_load_seconds",
        "How long each model's last load took.",
        labels=["model"],
    )
    memory = GaugeMetricFamily(
        "modelpool_model_memory_bytes",
        "RSS of each loaded model's worker processes, as psutil measured it last.",
        labels=["model"],
    )
    need = GaugeMetricFamily(
        "modelpool_model_memory_need_bytes",
        "The most RSS each model was ever measured to hold (what it needs to load).",
        labels=["model"],
    )
    for name, model in stats.models.items():
        for option in MODEL_STATES:
            state.add_metric([name, option], 1.0 if model.state == option else 0.0)
        for key, family in counts.items():
            family.add_metric([name], getattr(model, key))
        load_time.add_metric([name], model.load_seconds_total)
        if model.last_load_s is not None:
            last_load.add_metric([name], model.last_load_s)
        memory.add_metric([name], model.rss_bytes or 0)
        if model.need_bytes is not None:
            need.add_metric([name], model.need_bytes)
    yield state
    yield from counts.values()
    yield from (load_time, last_load, memory, need)
    yield _gauge("modelpool_models_memory_bytes", "RSS of every model's workers.", stats.rss_bytes)
    yield _gauge(
        "modelpool_models_peak_memory_bytes",
        "The most RSS every model's workers held together, as measured.",
        stats.peak_rss_bytes,
    )
    if stats.memory_budget_bytes is not None:
        yield _gauge(
            "modelpool_memory_budget_bytes",
            "[server] memory_budget_bytes.",
            stats.memory_budget_bytes,
        )
    yield CounterMetricFamily(
        "modelpool_model_swaps", "Loads that evicted another model first.", value=stats.swaps
    )
    yield _gauge("modelpool_model_load_waiters", "Requests waiting for a model.", stats.waiting)


class PoolMetrics:
    """A private registry: the pool collector (or a model registry's) plus the
    request-duration histogram, labelled by ``model``.

    Private rather than the global default registry so that two apps in one
    process (tests) do not collide, and so that no process metrics are mixed in
    by accident.
    """

    def __init__(
        self,
        stats_source: Callable[[], PoolStats] | None = None,
        *,
        model: str = "",
        registry_source: Callable[[], RegistryStats] | None = None,
        vllm: bool = False,
        waiting: Callable[[], int] = lambda: 0,
    ) -> None:
        """``vllm``: also export vLLM's names (``self.vllm``, whose ``observer(model)`` the
        caller adds to each pool); ``waiting``: runs the daemon holds back, for them."""
        self.registry = CollectorRegistry(auto_describe=False)
        self.model = model
        self.request_duration = Histogram(
            "modelpool_request_duration_seconds",
            "Wall-clock time of completion requests as the HTTP server saw them, any status.",
            labelnames=["model"],
            buckets=DURATION_BUCKETS,
            registry=self.registry,
        )
        # An adapter's requests (docs/lora.md) by its base (model_name) and itself (lora_name).
        self.lora_duration = Histogram(
            "modelpool_lora_request_duration_seconds",
            "Wall-clock time of the completion requests that named a LoRA adapter, any status.",
            labelnames=["model_name", "lora_name"],
            buckets=DURATION_BUCKETS,
            registry=self.registry,
        )
        self.vllm = VllmMetrics(self.registry) if vllm else None
        if registry_source is not None:
            self.registry.register(RegistryCollector(registry_source, self.vllm))
        else:
            assert stats_source is not None, "a pool's stats or a registry's"
            self.request_duration.labels(model=model)  # the series exists before a request
            self.registry.register(PoolCollector(stats_source, self.vllm, model, waiting))

    def observe_request(
        self, seconds: float, model: str | None = None, lora: str | None = None
    ) -> None:
        """One generation request's time; ``model`` the one it named (a registry's), else
        the served model; ``lora`` the adapter it named (``model`` is then its base)."""
        self.request_duration.labels(model=model or self.model).observe(seconds)
        if lora is not None:
            self.lora_duration.labels(model_name=model or self.model, lora_name=lora).observe(
                seconds
            )

    def add_tracing(self, snapshot: Callable[[], Mapping[str, int]]) -> None:
        """Also export the trace exporter's counters (``TraceExporter.snapshot``)."""
        self.registry.register(TracingCollector(snapshot))

    def render(self) -> bytes:
        """The exposition text. Calls ``stats_source`` once, which may block briefly."""
        return generate_latest(self.registry)


class TracingCollector(Collector):
    """The trace exporter's queue and counters, as ``modelpool_trace_*``."""

    def __init__(self, snapshot: Callable[[], Mapping[str, int]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        tracing = self._snapshot()
        yield from _counters(tracing, TRACING_COUNTERS)
        yield _gauge(
            "modelpool_trace_queue_depth",
            "Records (a request's trace, a worker event) waiting for the trace exporter.",
            tracing["queued"],
        )


TRACING_COUNTERS = (
    (
        "modelpool_trace_records_dropped",
        "Records not traced: the trace exporter's queue was full (a collector that is slow "
        "or hangs).",
        "dropped",
    ),
    ("modelpool_trace_spans_exported", "Spans the collector took.", "exported_spans"),
    (
        "modelpool_trace_spans_failed",
        "Spans in exports that failed (logged and dropped).",
        "failed_spans",
    ),
)


# (metric name, help, PoolStats counter): plain counters rendered one to one.
REQUEST_COUNTERS = (
    ("modelpool_requests_submitted", "Requests the pool accepted.", "submitted"),
    ("modelpool_request_timeouts", "Attempts that ran past their deadline.", "timeouts"),
    ("modelpool_request_retries", "Attempts retried on another worker.", "retries"),
    (
        "modelpool_collateral_retries",
        "Requests retried, uncharged, after their batch's worker died or was killed.",
        "collateral_retries",
    ),
    (
        "modelpool_poison_requests",
        "Requests failed as the suspect of repeated batch failures (PoisonRequest).",
        "poison_requests",
    ),
    (
        "modelpool_requests_withdrawn",
        "Requests asked back, unstarted, from a worker where they waited for KV room.",
        "withdrawn",
    ),
    (
        "modelpool_requests_queue_full",
        "Requests refused at once: their predicted wait passed max_queue_time_s or their "
        "deadline (also counted as overloaded).",
        "queue_full",
    ),
)
WORKER_COUNTERS = (
    ("modelpool_worker_crashes", "Workers that died on their own.", "crashes"),
    (
        "modelpool_worker_respawns",
        "Workers started to replace one that left (kill, crash or recycling).",
        "respawns",
    ),
    (
        "modelpool_worker_stalls",
        "Busy workers caught delivering no token before their deadline.",
        "stalls",
    ),
    (
        "modelpool_worker_recycles",
        "Workers retired by max_requests_per_worker, a memory limit, or memory not back "
        "after a CUDA out-of-memory.",
        "recycled",
    ),
    ("modelpool_cuda_oom", "Requests that ran out of CUDA memory on a worker.", "cuda_oom"),
    (
        "modelpool_cuda_errors",
        "Sticky CUDA errors: each worker was killed and replaced.",
        "cuda_errors",
    ),
)


def _prefix_cache_families(stats: PoolStats) -> Iterator[Metric]:
    """Each worker's prefix cache (hf backend), as it last reported it."""
    held = GaugeMetricFamily(
        "modelpool_prefix_cache_bytes",
        "KV bytes each worker's prefix cache holds.",
        labels=["worker"],
    )
    counters = {
        name: CounterMetricFamily(f"modelpool_prefix_cache_{name}", text, labels=["worker"])
        for name, text in (
            ("lookups", "Requests that looked for a cached prefix, by worker."),
            ("hits", "Requests that reused a cached prefix, by worker."),
            ("evictions", "Entries dropped to stay within the bound, by worker."),
            ("cached_tokens", "Prompt tokens read from the prefix cache, by worker."),
        )
    }
    for worker in stats.workers:
        cache = worker.prefix_cache
        if cache is None:
            continue
        held.add_metric([str(worker.id)], cache.bytes)
        for name, family in counters.items():
            family.add_metric([str(worker.id)], getattr(cache, name))
    yield held
    yield from counters.values()


def _prefix_tier_families(stats: PoolStats) -> Iterator[Metric]:
    """The prefix cache tiers (docs/prefix-tiers.md), every worker's counts together."""
    gauges = {
        name: GaugeMetricFamily(f"modelpool_prefix_tier_{name}", text, labels=["tier"])
        for name, text in (
            ("bytes", "Bytes each prefix cache tier holds."),
            ("limit_bytes", "Each prefix cache tier's bound in bytes."),
        )
    }
    counters = {
        name: CounterMetricFamily(f"modelpool_prefix_tier_{name}", text, labels=["tier"])
        for name, text in (
            ("hits", "Lookups a tier answered with a stored prefix."),
            ("misses", "Lookups a tier held nothing for."),
            ("restores", "Prefixes restored from a tier into a worker."),
            ("restore_seconds", "Seconds spent reading and checking restored prefixes."),
            ("stores", "Prefixes written to a tier."),
            ("rejected", "Entries refused (torn, corrupted, another model's) and removed."),
            ("evictions", "Entries removed to stay within the tier's bound."),
        )
    }
    for tier in stats.prefix_tiers:
        for name, gauge in gauges.items():
            gauge.add_metric([tier.tier], getattr(tier, name))
        for name, counter in counters.items():
            counter.add_metric([tier.tier], getattr(tier, name))
    yield from gauges.values()
    yield from counters.values()


def _counters(
    counters: Mapping[str, int], table: tuple[tuple[str, str, str], ...]
) -> Iterator[CounterMetricFamily]:
    for name, documentation, key in table:
        yield CounterMetricFamily(name, documentation, value=counters.get(key, 0))


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def _with_extra(known: tuple[str, ...], seen: list[str]) -> list[str]:
    return [*known, *(name for name in seen if name not in known)]
