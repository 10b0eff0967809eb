"""The daemon's metrics under vLLM's names, so that vLLM's Grafana dashboard reads them.

Beside modelpool's own families (``metrics.py``) the daemon exports the same figures
under the names vLLM's reference dashboard queries (``vllm:e2e_request_latency_seconds``,
``vllm:time_to_first_token_seconds``, ``vllm:num_requests_running`` ...; vLLM's
docs/design/metrics.md), each labelled ``model_name``. ``[server] vllm_metrics = false``
leaves them out. The per-request histograms and counters are fed by a pool observer
(``observe.RequestRecord``, on the dispatcher thread: a few observations per request);
the gauges are read from the same ``PoolStats`` snapshot as modelpool's own, per scrape::

    vllm = VllmMetrics("smollm2", registry)
    pool.add_observer(on_request=vllm.observe)
    families = list(vllm.gauges(stats))          # from PoolMetrics' collector

What differs from vLLM, because the pool measures it differently: times run from the
pool's submit (the daemon's fair-share wait comes before it), prefill is the last
attempt's dispatch to its first token and decode the rest; the inter-token latency is
one observation per request, its mean gap; ``kv_cache_usage_perc`` is the share of batch
rows in use (workers do not report their KV capacity); the prefix cache's queries and
hits are counted in prompt tokens, as vLLM counts them.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

from modelpool.observe import RequestRecord
from modelpool.stats import PoolStats

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
    """The ``vllm:`` families of one model, registered in ``registry``."""

    def __init__(self, model_name: str, registry: CollectorRegistry) -> None:
        self.model_name = model_name
        labels = ["model_name"]

        def histogram(name: str, text: str, buckets: tuple[float, ...]) -> Histogram:
            family = Histogram(name, text, labels, buckets=buckets, registry=registry)
            return family.labels(model_name)  # bound once: no label lookup per request

        def counter(name: str, text: str) -> Counter:
            return Counter(name, text, labels, registry=registry).labels(model_name)

        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Request latency, submit to end.", LATENCY_BUCKETS
        )
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Submit to the first token.", TTFT_BUCKETS
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Mean time between two tokens of a request (one observation per request).",
            ITL_BUCKETS,
        )
        self.queue = histogram(
            "vllm:request_queue_time_seconds", "Submit to the first dispatch.", LATENCY_BUCKETS
        )
        self.prefill = histogram(
            "vllm:request_prefill_time_seconds",
            "The last attempt's dispatch to its first token.",
            LATENCY_BUCKETS,
        )
        self.decode = histogram(
            "vllm:request_decode_time_seconds",
            "The last attempt's first token to its end.",
            LATENCY_BUCKETS,
        )
        self.inference = histogram(
            "vllm:request_inference_time_seconds",
            "The last attempt's dispatch to its end.",
            LATENCY_BUCKETS,
        )
        self.prompt_length = histogram(
            "vllm:request_prompt_tokens", "Prompt tokens per request.", TOKEN_BUCKETS
        )
        self.generation_length = histogram(
            "vllm:request_generation_tokens", "Generated tokens per request.", TOKEN_BUCKETS
        )
        self.max_generation = histogram(
            "vllm:request_max_num_generation_tokens",
            "The max_tokens each request asked for.",
            TOKEN_BUCKETS,
        )
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.")
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_hits = counter(
            "vllm:prefix_cache_hits", "Prompt tokens read from the prefix cache."
        )
        self._success = Counter(
            "vllm:request_success",
            "Finished requests, by finish reason (abort: cancelled; error: failed).",
            ["model_name", "finished_reason"],
            registry=registry,
        )
        self._success_by_reason: dict[str, Counter] = {}

    def observe(self, record: RequestRecord) -> None:
        """One resolved request (a pool observer: runs on the dispatcher thread)."""
        reason = _finished_reason(record)
        success = self._success_by_reason.get(reason)
        if success is None:
            success = self._success.labels(self.model_name, reason)
            self._success_by_reason[reason] = success
        success.inc()
        self.e2e.observe(record.finished_at - record.submitted_at)
        self.queue.observe(record.queue_s)
        if record.max_new_tokens is not None:
            self.max_generation.observe(record.max_new_tokens)
        if record.first_token_at is not None:
            self.ttft.observe(record.first_token_at - record.submitted_at)
        last = record.attempts[-1] if record.attempts else None
        if last is not None and last.ended_at is not None:
            self.inference.observe(last.ended_at - last.started_at)
            if last.first_token_at is not None:
                self.prefill.observe(last.first_token_at - last.started_at)
                decode_s = last.ended_at - last.first_token_at
                self.decode.observe(decode_s)
                if record.completion_tokens and record.completion_tokens > 1:
                    self.itl.observe(decode_s / (record.completion_tokens - 1))
        if record.prompt_tokens is not None:
            self.prompt_length.observe(record.prompt_tokens)
            self.prompt_tokens.inc(record.prompt_tokens)
            self.prefix_queries.inc(record.prompt_tokens)
            self.prefix_hits.inc(record.cached_tokens)
        if record.completion_tokens is not None:
            self.generation_length.observe(record.completion_tokens)
            self.generation_tokens.inc(record.completion_tokens)

    def gauges(self, stats: PoolStats, held_back: int = 0) -> Iterator[Metric]:
        """The scheduler gauges, from one snapshot; ``held_back``: runs waiting in the
        daemon's fair share, not yet in the pool's queue."""
        waiting = stats.queue_depth + held_back
        for name, text, value in (
            ("vllm:num_requests_running", "Requests running in workers.", stats.running),
            ("vllm:num_requests_waiting", "Requests waiting for a worker.", waiting),
            (
                "vllm:kv_cache_usage_perc",
                "Batch rows in use over the serving capacity (1 = full).",
                stats.batch_occupancy,
            ),
        ):
            family = GaugeMetricFamily(name, text, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
