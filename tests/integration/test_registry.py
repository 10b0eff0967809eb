"""ModelRegistry over real testing-backend pools: load on demand, aliases, idle unloads,
keep_alive, each waiter's own deadline, the bounded wait, failures that stay one model's
with backoff, a hanging load, and eviction within a measured budget.

The docs, Many models: the rules these tests check, one by one.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

import psutil
import pytest

from helpers import make_config, slack, wait_until
from modelpool.shared.config import ModelSpec
from modelpool.shared.errors import (
    DeadlineExceeded,
    MemoryNotReleased,
    ModelNotFound,
    ModelTooLarge,
    ModelUnavailable,
    PoolOverloaded,
)
from modelpool.supervisor.registry import ModelRegistry, RegistryConfig, parse_keep_alive

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux processes")


def spec(name: str, *, workers: int = 1, **options: Any) -> ModelSpec:
    """A testing-backend model; ``options`` are ModelSpec fields or backend options."""
    own = {
        k: options.pop(k)
        for k in ("ttl_s", "pin", "preload", "aliases", "load_timeout_s")
        if k in options
    }
    pool = make_config(workers=workers, backend_options=options)
    return ModelSpec(name, pool, **own)


@pytest.fixture
def registry_of() -> Iterator[Any]:
    made: list[ModelRegistry] = []

    def build(*specs: ModelSpec, **config: Any) -> ModelRegistry:
        registry = ModelRegistry(RegistryConfig(models=specs, **config)).start()
        made.append(registry)
        return registry

    yield build
    for registry in made:
        registry.close(timeout=5.0)


def pids_of(registry: ModelRegistry, name: str) -> set[int]:
    stats = registry.model_stats(name, with_pool=True)
    return {w.pid for w in (stats.pool.workers if stats.pool else []) if w.pid is not None}


def gone(pids: set[int]) -> bool:
    return not any(
        psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie" for pid in pids
    )


def test_models_load_on_first_use_by_name_or_alias_and_unknown_names_are_refused(
    registry_of: Any,
) -> None:
    registry = registry_of(spec("chat", aliases=["gpt-4o"]), spec("coder"))
    assert {m.state for m in registry.stats().models.values()} == {"unloaded"}
    with registry.use("gpt-4o") as pool:
        assert pool.generate("echo:hi").text == "hi"
    stats = registry.stats()
    assert stats.models["chat"].state == "loaded" and stats.models["chat"].loads == 1
    assert stats.models["coder"].state == "unloaded"
    assert stats.models["chat"].rss_bytes and stats.models["chat"].need_bytes
    assert stats.models["chat"].pool is not None and stats.models["chat"].pool.state == "ready"
    with pytest.raises(ModelNotFound) as refused:
        registry.acquire("nonexistent")
    assert refused.value.model == "nonexistent" and "chat" not in str(refused.value)
    with registry.use("coder") as pool:
        assert pool.generate("echo:code").text == "code"
    assert registry.stats().models["coder"].loads == 1


def test_idle_models_unload_after_ttl_and_keep_alive_zero_unloads_once_idle(
    registry_of: Any,
) -> None:
    registry = registry_of(spec("short", ttl_s=0.5), spec("kept"))
    with registry.use("short"):
        pids = pids_of(registry, "short")
    wait_until(lambda: registry.model_stats("short").state == "unloaded", timeout=slack(5))
    assert gone(pids) and registry.model_stats("short").unloads == 1

    lease = registry.acquire("kept", keep_alive=0.0)
    kept = pids_of(registry, "kept")
    assert registry.model_stats("kept").state == "loaded"  # in use: not unloaded under it
    lease.release()
    wait_until(lambda: registry.model_stats("kept").state == "unloaded", timeout=slack(5))
    assert gone(kept)
    # keep_alive=None (Ollama's -1) keeps it as long as its ttl_s allows, never longer.
    registry.acquire("short", keep_alive=None).release()
    assert registry.model_stats("short").keep_alive_s == 0.5
    registry.acquire("kept", keep_alive=None).release()
    assert registry.model_stats("kept").keep_alive_s is None


def test_keep_alive_reads_seconds_and_durations() -> None:
    assert parse_keep_alive(30) == 30.0
    assert parse_keep_alive("5m") == 300.0
    assert parse_keep_alive("1h30m") == 5400.0
    assert parse_keep_alive("250ms") == 0.25
    assert parse_keep_alive(0) == 0.0
    assert parse_keep_alive(-1) is None and parse_keep_alive("-1m") is None
    # Past ten years a date computed from it overflows (/api/ps answered 500 for everyone).
    for bad in ("soon", "5x", True, [], "", "m", 10**400, "1000000000h", 1e12):
        with pytest.raises(ValueError):
            parse_keep_alive(bad)


def test_a_waiter_whose_deadline_passes_gets_deadline_exceeded_and_the_load_goes_on(
    registry_of: Any,
) -> None:
    registry = registry_of(spec("slow", load_delay_s=1.5))
    patient = concurrent.futures.ThreadPoolExecutor(1).submit(
        registry.acquire, "slow", deadline_s=30
    )
    wait_until(lambda: registry.model_stats("slow").state == "loading", message="loading")
    with pytest.raises(DeadlineExceeded, match="did not load within"):
        registry.acquire("slow", deadline_s=0.2)
    lease = patient.result(timeout=slack(10))
    assert lease.pool.generate("echo:late").text == "late"
    lease.release()
    assert registry.model_stats("slow").loads == 1  # one load served both


def test_the_wait_during_a_load_is_bounded(registry_of: Any) -> None:
    registry = registry_of(spec("slow", load_delay_s=1.5), max_waiting=1)
    first = concurrent.futures.ThreadPoolExecutor(1).submit(registry.acquire, "slow", deadline_s=30)
    wait_until(lambda: registry.stats().waiting == 1, message="one waiter")
    with pytest.raises(PoolOverloaded, match="max_load_waiters"):
        registry.acquire("slow", deadline_s=30)
    first.result(timeout=slack(10)).release()


def test_a_failing_model_fails_at_once_backs_off_and_leaves_the_others_serving(
    registry_of: Any,
) -> None:
    registry = registry_of(spec("broken", fail_load=True), spec("good"), backoff_s=30.0)
    with pytest.raises(ModelUnavailable) as first:
        registry.acquire("broken", deadline_s=20)
    assert "load failed" in first.value.reason
    stats = registry.model_stats("broken")
    assert stats.state == "failed" and stats.load_failures == 1 and stats.retry_in_s
    started = threading.Event()
    started.set()
    with pytest.raises(ModelUnavailable) as again:
        registry.acquire("broken", deadline_s=20)  # within the backoff: at once, no new load
    assert again.value.retry_after_s > 20
    assert registry.model_stats("broken").load_failures == 1
    with registry.use("good") as pool:
        assert pool.generate("echo:fine").text == "fine"


def test_the_backoff_doubles_between_loads(registry_of: Any) -> None:
    registry = registry_of(spec("broken", fail_load=True), backoff_s=0.2, backoff_max_s=10)
    for attempt in range(1, 4):
        wait_until(
            lambda: (registry.model_stats("broken").retry_in_s or 0) <= 0,
            timeout=slack(5),
            message="the backoff to pass",
        )
        with pytest.raises(ModelUnavailable) as failed:
            registry.acquire("broken", deadline_s=20)
        assert failed.value.retry_after_s == pytest.approx(0.2 * 2 ** (attempt - 1), abs=0.1)
    assert registry.model_stats("broken").load_failures == 3


def test_a_hanging_load_is_stopped_at_its_deadline_and_leaves_no_process(
    registry_of: Any,
) -> None:
    registry = registry_of(spec("hangs", load_delay_s=600, load_timeout_s=1.0), spec("good"))
    children_before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ModelUnavailable, match="load_timeout_s"):
        registry.acquire("hangs", deadline_s=30)
    assert registry.model_stats("hangs").state == "failed"
    wait_until(
        lambda: {p.pid for p in psutil.Process().children(recursive=True)} <= children_before,
        timeout=slack(5),
        message="the hanging workers to be gone",
    )
    with registry.use("good") as pool:
        assert pool.generate("echo:ok").text == "ok"


def measured_need() -> int:
    """What one 1-worker testing model measures, loaded and idle (to size budgets)."""
    registry = ModelRegistry(RegistryConfig(models=(spec("probe"),))).start()
    try:
        registry.acquire("probe").release()
        need = registry.model_stats("probe").need_bytes
        assert need
        return need
    finally:
        registry.close(timeout=5.0)


def test_a_budget_that_fits_two_evicts_the_least_recently_used_idle_model(
    registry_of: Any,
) -> None:
    need = measured_need()
    registry = registry_of(spec("a"), spec("b"), spec("c"), memory_budget_bytes=int(need * 2.6))
    for name in ("a", "b", "c", "a", "b", "c", "a"):
        with registry.use(name) as pool:
            assert pool.generate(f"echo:{name}").text == name
    stats = registry.stats()
    loaded = [n for n, m in stats.models.items() if m.state == "loaded"]
    assert len(loaded) <= 2 and "a" in loaded
    assert stats.peak_rss_bytes <= int(need * 2.6), (stats.peak_rss_bytes, need)
    assert sum(m.evictions for m in stats.models.values()) >= 4
    assert stats.swaps >= 4


def test_a_pinned_model_is_never_evicted(registry_of: Any) -> None:
    need = measured_need()
    registry = registry_of(
        spec("pinned", pin=True, preload=True),
        spec("b"),
        spec("c"),
        memory_budget_bytes=int(need * 2.6),
    )
    assert registry.model_stats("pinned").state == "loaded"
    for name in ("b", "c", "b", "c"):
        registry.acquire(name).release()
    stats = registry.stats().models
    assert stats["pinned"].state == "loaded" and stats["pinned"].evictions == 0
    assert stats["b"].evictions + stats["c"].evictions >= 3


def test_a_model_too_large_even_alone_is_refused_naming_both_numbers(registry_of: Any) -> None:
    registry = registry_of(spec("big"), spec("small"), memory_budget_bytes=1_000_000)
    with pytest.raises(ModelTooLarge) as refused:
        registry.acquire("big", deadline_s=20)
    error = refused.value
    assert error.budget_bytes == 1_000_000 and error.needed_bytes > 1_000_000
    assert str(error.needed_bytes) in str(error) and "1000000" in str(error)
    assert registry.model_stats("big").state == "failed"
    wait_until(lambda: registry.stats().rss_bytes == 0, message="nothing left measured")


def test_a_failed_load_holds_no_budget_so_the_next_model_still_loads(registry_of: Any) -> None:
    # The hanging load was measured while it loaded; once it failed, that reading must
    # not keep counting against the budget (it left every later load waiting, for ever).
    need = measured_need()
    registry = registry_of(
        spec("hangs", load_delay_s=600, load_timeout_s=1.5),
        spec("good"),
        memory_budget_bytes=int(need * 1.5),
    )
    with pytest.raises(ModelUnavailable):
        registry.acquire("hangs", deadline_s=30)
    with registry.use("good", deadline_s=slack(5)) as pool:
        assert pool.generate("echo:ok").text == "ok"
    assert registry.stats().models["hangs"].rss_bytes is None


def test_a_release_not_verified_holds_back_the_next_load_until_the_memory_is_back(
    registry_of: Any,
) -> None:
    # Issue 35: an evicted model's release is verified before the new model's workers
    # start. A child that left its worker's process group (setsid) outlives the pool's
    # kill of the group: its memory is not back, so the load it made room for waits for
    # it within its deadline, then is refused naming why; once it is gone, it loads.
    need = measured_need()
    registry = registry_of(
        spec("a"),
        spec("b", load_timeout_s=1.5),
        memory_budget_bytes=int(need * 1.5),
        backoff_s=30.0,
    )
    with registry.use("a") as pool:
        child = int(pool.generate("detach:600").text)
    try:
        ours = {p.pid for p in psutil.Process().children(recursive=True)}
        with pytest.raises(MemoryNotReleased) as refused:
            registry.acquire("b", deadline_s=slack(30))
        error = refused.value
        assert error.model == "b" and error.held_by == ("a",)
        assert error.reason.startswith("memory not released") and f"pid {child}" in error.reason
        stats = registry.stats().models
        assert not any(m.state == "loading" for m in stats.values())
        assert stats["b"].state == "failed" and stats["b"].loads == 0
        assert stats["a"].state == "failed" and "not released" in (stats["a"].reason or "")
        assert stats["a"].rss_bytes, "the leftover is measured against the budget"
        # b's workers never started: no process of ours but what was there before.
        assert {p.pid for p in psutil.Process().children(recursive=True)} <= ours
        with pytest.raises(MemoryNotReleased):
            registry.acquire("b", deadline_s=slack(30))  # still held back, not loading
    finally:
        os.kill(child, signal.SIGKILL)
    wait_until(
        lambda: registry.model_stats("a").state == "unloaded",
        timeout=slack(5),
        message="the registry to see a's memory back",
    )
    assert registry.model_stats("a").rss_bytes is None
    assert registry.model_stats("b").state == "unloaded"  # its backoff was for the memory
    with registry.use("b", deadline_s=slack(20)) as pool:
        assert pool.generate("echo:b").text == "b"
    assert registry.model_stats("b").loads == 1


def test_a_load_waiting_for_a_busy_model_to_drain_does_not_hold_up_one_that_fits(
    registry_of: Any,
) -> None:
    # "big" must evict "busy", whose request runs on: its swap waits for the drain. "small"
    # fits both now and once that swap is done, so it loads at once, not behind it.
    need, extra = measured_need(), 100 * 2**20
    budget = 3 * need + int(1.5 * extra)
    registry = registry_of(
        spec("pinned", pin=True, preload=True),
        spec("busy"),
        spec("big"),
        spec("small"),
        memory_budget_bytes=budget,
        unload_timeout_s=600.0,  # the drain waits for the request, however long it runs
    )

    def measured(name: str, leak: bool) -> None:
        with registry.use(name) as pool:
            if leak:
                pool.generate(f"leak:{extra >> 20}")
        wait_until(
            lambda: (registry.model_stats(name).need_bytes or 0) >= 0.9 * (need + extra * leak),
            timeout=slack(5),
            message=f"{name} measured",
        )
        registry.unload(name)
        wait_until(lambda: registry.model_stats(name).state == "unloaded", timeout=slack(5))

    measured("big", leak=True)
    measured("small", leak=False)
    lease = registry.acquire("busy")
    try:
        lease.pool.generate(f"leak:{extra >> 20}")
        wait_until(
            lambda: (registry.model_stats("busy").need_bytes or 0) >= 0.9 * (need + extra),
            timeout=slack(5),
            message="busy measured",
        )
        waiting = concurrent.futures.ThreadPoolExecutor(1).submit(
            registry.acquire, "big", deadline_s=slack(60)
        )
        wait_until(
            lambda: registry.model_stats("busy").state == "unloading",
            message="big's swap planned, busy draining",
        )
        with registry.use("small", deadline_s=10.0) as pool:
            assert pool.generate("echo:small").text == "small"
        assert registry.model_stats("big").state == "loading" and not waiting.done()
    finally:
        lease.release()
    waiting.result(timeout=slack(20)).release()
    stats = registry.stats()
    assert {n: m.state for n, m in stats.models.items()} == {
        "pinned": "loaded",
        "busy": "unloaded",
        "big": "loaded",
        "small": "loaded",
    }
    assert stats.models["busy"].evictions == 1
    assert stats.peak_rss_bytes <= budget, (stats.peak_rss_bytes, budget)
