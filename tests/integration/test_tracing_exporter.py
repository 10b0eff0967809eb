"""Tracing's export side (issue 58, the third review's findings 9 and 10): a daemon's
loads cost no thread and no exit hook (one exporter for every pool it loads), and a
collector that accepts connections and never answers costs a bounded queue, the records
past it dropped and counted in ``/stats`` and ``/metrics`` (docs, Tracing)."""

from __future__ import annotations

import atexit
import socket
import threading
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from helpers import make_config, open_pool, slack, wait_until
from modelpool.server import create_app
from modelpool.shared.config import ModelSpec, ServerConfig
from modelpool.supervisor import trace_export
from modelpool.supervisor.registry import ModelRegistry, RegistryConfig

LOOPBACK = "http://127.0.0.1"


class SilentCollector:
    """A TCP server on 127.0.0.1 that accepts every connection, reads what it is sent and
    never answers: a collector that hangs."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}/v1/traces"
        self.accepted: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> SilentCollector:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(5)
        for connection in self.accepted:
            connection.close()
        self._listener.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                connection, _ = self._listener.accept()
            except TimeoutError:
                continue
            self.accepted.append(connection)


def _tracing_threads() -> int:
    return sum(thread.name == "modelpool-tracing" for thread in threading.enumerate())


def _exit_hooks() -> int:
    count: int = atexit._ncallbacks()  # type: ignore[attr-defined]
    return count


@pytest.mark.slow
def test_loads_and_unloads_cost_no_thread_and_no_exit_hook() -> None:
    """Before, each load made a tracer with a thread and an exit hook of its own, never
    stopped: 201 loads, 5 -> 205 threads (the review)."""
    registry = ModelRegistry(RegistryConfig(models=(ModelSpec("m", make_config(workers=1)),)))
    registry.start()
    try:
        create_app(registry, ServerConfig(otlp_traces_endpoint="http://127.0.0.1:9/v1/traces"))

        def load_and_unload() -> None:
            registry.load("m")
            registry.unload("m")
            wait_until(
                lambda: registry.model_stats("m").state == "unloaded", slack(10), interval=0.02
            )

        load_and_unload()
        threads, hooks = threading.active_count(), _exit_hooks()
        assert _tracing_threads() == 1
        for _ in range(8):
            load_and_unload()
        assert _tracing_threads() == 1, "a tracing thread per load"
        assert _exit_hooks() == hooks, "an exit hook per load"
        assert threading.active_count() <= threads
    finally:
        registry.close(timeout=5.0)


@pytest.fixture
def small_queue(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """The exporter's queue bounded at 32 records, so that a few hundred requests pass it."""
    monkeypatch.setattr(trace_export, "MAX_QUEUED_RECORDS", 32)
    yield 32


@pytest.mark.slow
def test_a_collector_that_never_answers_costs_a_bounded_queue(small_queue: int) -> None:
    """Before, the records waited in an unbounded queue while the export waited for its
    10 s timeout: 65 -> 93 MB in 60 s at 500 requests/s (the review)."""
    with SilentCollector() as collector, open_pool(workers=1) as pool:
        app = create_app(pool, ServerConfig(otlp_traces_endpoint=collector.url), "tiny")
        client = TestClient(app, base_url=LOOPBACK)
        assert client.post("/v1/completions", json={"prompt": "echo:x"}).status_code == 200
        # The first export (within schedule_delay_s) holds the tracer's thread from now on.
        wait_until(lambda: collector.accepted, slack(5), interval=0.02)
        sent = 100
        for _ in range(sent):
            assert client.post("/v1/completions", json={"prompt": "echo:x"}).status_code == 200
        tracing = client.get("/stats").json()["tracing"]
        assert tracing["queued"] <= small_queue
        assert tracing["dropped"] >= sent - small_queue
        assert tracing["exported_spans"] == 0
        families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
        dropped = families["modelpool_trace_records_dropped"].samples[0].value
        assert dropped == tracing["dropped"]
        assert families["modelpool_trace_queue_depth"].samples[0].value <= small_queue
