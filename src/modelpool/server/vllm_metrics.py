"""The daemon's metrics under vLLM's names, so that vLLM's Grafana dashboard reads them.

Beside modelpool's own families (``metrics.py``) the daemon exports the same figures
under the names vLLM's reference dashboard queries (``vllm:e2e_request_latency_seconds``,
``vllm:time_to_first_token_seconds``, ``vllm:num_requests_running`` ...; vLLM's
docs/design/metrics.md), each labelled ``model_name``. ``[server] vllm_metrics = false``
leaves them out. The per-request histograms and counters are fed by a pool observer
(``observe.RequestRecord``, on the dispatcher thread: a few observations per request);
the gauges are read from the same ``PoolStats`` snapshot as modelpool's own, per scrape::

    vllm = VllmMetrics(registry)
    pool.add_observer(on_request=vllm.observer("smollm2"))
    families = list(vllm.gauges({"smollm2": (stats, 0)}))   # from PoolMetrics' collector

What differs from vLLM, because the pool measures it differently: times run from the
pool's submit (the daemon's fair-share wait comes before it), prefill is the last
attempt's dispatch to its first token and decode the rest; the inter-token latency is
one observation per request, its mean gap; ``kv_cache_usage_perc`` is the share of batch
rows in use (workers do not report their KV capacity); the prefix cache's queries and
hits are counted in prompt tokens, as vLLM counts them.

LoRA adapters (docs/lora.md): vLLM's ``vllm:lora_requests_info`` gauge, one series per
base model (``model_name`` beside vLLM's labels): ``running_lora_adapters`` the adapters
with requests in the daemon (comma-separated; the daemon does not tell a queued request
from a running one, so ``waiting_lora_adapters`` stays empty), ``max_lora`` the base's
``max_loras``, the value the time of the scrape, as vLLM sets it. vLLM's per-request
series carry no ``lora_name``: an adapter's requests count under its base there, and by
adapter in ``modelpool_lora_request_duration_seconds``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

from modelpool.supervisor.observe import RequestRecord
from modelpool.supervisor.stats import PoolStats

# vLLM's own buckets (vllm/v1/metrics/loggers.py), so that quantiles compare.
LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)

# Our finish reasons under vLLM's: a cancel is its "abort", a failure its "error".
_FINISHED_REASONS = {"cancelled": "abort"}


def _finished_reason(record: RequestRecord) -> str:
    if record.status == "failed":
        return "error"
    if record.status == "cancelled" or record.finish_reason is None:
        return "abort"
    return _FINISHED_REASONS.get(record.finish_reason, record.finish_reason)


class VllmMetrics:
    """The ``vllm:`` families, registered in ``registry``; ``observer(model)`` feeds one
    model's series (one per pool: the daemon's, or each of a registry's)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def histogram(name: str, text: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, text, ["model_name"], buckets=buckets, registry=registry)

        def counter(name: str, text: str) -> Counter:
            return Counter(name, text, ["model_name"], registry=registry)

        self.histograms = {
            "e2e": histogram(
                "vllm:e2e_request_latency_seconds",
                "Request latency, submit to end.",
                LATENCY_BUCKETS,
            ),
            "ttft": histogram(
                "vllm:time_to_first_token_seconds", "Submit to the first token.", TTFT_BUCKETS
            ),
            "itl": histogram(
                "vllm:inter_token_latency_seconds",
                "Mean time between two tokens of a request (one observation per request).",
                ITL_BUCKETS,
            ),
            "queue": histogram(
                "vllm:request_queue_time_seconds", "Submit to the first dispatch.", LATENCY_BUCKETS
            ),
            "prefill": histogram(
                "vllm:request_prefill_time_seconds",
                "The last attempt's dispatch to its first token.",
                LATENCY_BUCKETS,
            ),
            "decode": histogram(
                "vllm:request_decode_time_seconds",
                "The last attempt's first token to its end.",
                LATENCY_BUCKETS,
            ),
            "inference": histogram(
                "vllm:request_inference_time_seconds",
                "The last attempt's dispatch to its end.",
                LATENCY_BUCKETS,
            ),
            "prompt_length": histogram(
                "vllm:request_prompt_tokens", "Prompt tokens per request.", TOKEN_BUCKETS
            ),
            "generation_length": histogram(
                "vllm:request_generation_tokens", "Generated tokens per request.", TOKEN_BUCKETS
            ),
            "max_generation": histogram(
                "vllm:request_max_num_generation_tokens",
                "The max_tokens each request asked for.",
                TOKEN_BUCKETS,
            ),
        }
        self.counters = {
            "prompt_tokens": counter("vllm:prompt_tokens", "Prompt tokens processed."),
            "generation_tokens": counter("vllm:generation_tokens", "Tokens generated."),
            "prefix_queries": counter(
                "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
            ),
            "prefix_hits": counter(
                "vllm:prefix_cache_hits", "Prompt tokens read from the prefix cache."
            ),
            "preemptions": counter(
                "vllm:num_preemptions", "Attempts preempted for a more urgent request."
            ),
        }
        # Per base model: adapters with requests in flight, max_loras (server.lora.in_flight).
        self.lora_info: Callable[[], Mapping[str, tuple[tuple[str, ...], int]]] | None = None
        self.success = Counter(
            "vllm:request_success",
            "Finished requests, by finish reason (abort: cancelled; error: failed).",
            ["model_name", "finished_reason"],
            registry=registry,
        )

    def observer(self, model_name: str) -> Callable[[RequestRecord], None]:
        """A pool observer for ``model_name``'s series (its children bound once here)."""
        return _ModelSeries(self, model_name).observe

    def gauges(self, pools: Mapping[str, tuple[PoolStats, int]]) -> Iterator[Metric]:
        """The scheduler gauges of each model: its snapshot, and the runs the daemon holds
        back for it (waiting in the fair share, not yet in the pool's queue)."""
        families = [
            GaugeMetricFamily(name, text, labels=["model_name"])
            for name, text in (
                ("vllm:num_requests_running", "Requests running in workers."),
                ("vllm:num_requests_waiting", "Requests waiting for a worker."),
                ("vllm:kv_cache_usage_perc", "Batch rows in use over the capacity (1 = full)."),
            )
        ]
        for model, (stats, held_back) in pools.items():
            values = (stats.running, stats.queue_depth + held_back, stats.batch_occupancy)
            for family, value in zip(families, values, strict=True):
                family.add_metric([model], value)
        yield from families
        if self.lora_info is not None:
            yield self._lora_family(self.lora_info())

    @staticmethod
    def _lora_family(info: Mapping[str, tuple[tuple[str, ...], int]]) -> Metric:
        family = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Running stats on LoRA requests (the value: when they were read).",
            labels=["model_name", "running_lora_adapters", "waiting_lora_adapters", "max_lora"],
        )
        now = time.time()
        for model, (running, max_loras) in info.items():
            family.add_metric([model, ",".join(running), "", str(max_loras)], now)
        return family


class _ModelSeries:
    """One model's bound children: no label lookup per request."""

    def __init__(self, metrics: VllmMetrics, model_name: str) -> None:
        self.model_name = model_name
        self.h = {key: family.labels(model_name) for key, family in metrics.histograms.items()}
        self.c = {key: family.labels(model_name) for key, family in metrics.counters.items()}
        self._success = metrics.success
        self._success_by_reason: dict[str, Counter] = {}

    def observe(self, record: RequestRecord) -> None:
        """One resolved request (a pool observer: runs on the dispatcher thread)."""
        h, c = self.h, self.c
        reason = _finished_reason(record)
        success = self._success_by_reason.get(reason)
        if success is None:
            success = self._success.labels(self.model_name, reason)
            self._success_by_reason[reason] = success
        success.inc()
        h["e2e"].observe(record.finished_at - record.submitted_at)
        h["queue"].observe(record.queue_s)
        if record.max_new_tokens is not None:
            h["max_generation"].observe(record.max_new_tokens)
        if record.first_token_at is not None:
            h["ttft"].observe(record.first_token_at - record.submitted_at)
        if len(record.attempts) > 1:
            preempted = sum(a.outcome == "preempted" for a in record.attempts)
            if preempted:
                c["preemptions"].inc(preempted)
        last = record.attempts[-1] if record.attempts else None
        if last is not None and last.ended_at is not None:
            h["inference"].observe(last.ended_at - last.started_at)
            if last.first_token_at is not None:
                h["prefill"].observe(last.first_token_at - last.started_at)
                decode_s = last.ended_at - last.first_token_at
                h["decode"].observe(decode_s)
                if record.completion_tokens and record.completion_tokens > 1:
                    h["itl"].observe(decode_s / (record.completion_tokens - 1))
        if record.prompt_tokens is not None:
            h["prompt_length"].observe(record.prompt_tokens)
            c["prompt_tokens"].inc(record.prompt_tokens)
            c["prefix_queries"].inc(record.prompt_tokens)
            c["prefix_hits"].inc(record.cached_tokens)
        if record.completion_tokens is not None:
            h["generation_length"].observe(record.completion_tokens)
            c["generation_tokens"].inc(record.completion_tokens)
