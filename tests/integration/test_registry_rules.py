"""The registry's reliability and fairness rules (issue 61): an operator's unload racing
requests, a request's keep_alive for its own client's use only, runtime pins, needs kept
across restarts and estimated from files, a request's peak that does not fail a model
for good, evictions that keep what fits, swaps charged to the client that causes them,
and load-waiter places shared between clients.

The docs, Many models: the rules these tests check.
"""

from __future__ import annotations

import concurrent.futures
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from helpers import make_config, slack, wait_until
from modelpool.shared.config import ModelSpec
from modelpool.shared.errors import ModelTooLarge, ModelUnavailable, PoolOverloaded, QueueFull
from modelpool.supervisor.pool import ModelPool
from modelpool.supervisor.registry import ModelRegistry, RegistryConfig

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux processes")


def spec(name: str, *, workers: int = 1, model: str = "none", **options: Any) -> ModelSpec:
    """A testing-backend model; ``options`` are ModelSpec fields or backend options."""
    own = {k: options.pop(k) for k in ("ttl_s", "pin", "preload") if k in options}
    pool = make_config(workers=workers, model=model, backend_options=options)
    return ModelSpec(name, pool, **own)


class InstantPool(ModelPool):
    """A pool that starts no worker: the registry's own rules, run thousands of times."""

    def start(self) -> InstantPool:
        return self


@pytest.fixture
def registry_of() -> Iterator[Any]:
    made: list[ModelRegistry] = []

    def build(*specs: ModelSpec, pool_class: type[ModelPool] = ModelPool, **config: Any) -> Any:
        registry = ModelRegistry(RegistryConfig(models=specs, **config), pool_class=pool_class)
        made.append(registry.start())
        return registry

    yield build
    for registry in made:
        registry.close(timeout=5.0)


def measured_need() -> int:
    """What one 1-worker testing model measures, loaded and idle (to size budgets)."""
    with ModelRegistry(RegistryConfig(models=(spec("probe"),))) as registry:
        registry.acquire("probe").release()
        need = registry.model_stats("probe").need_bytes
        assert need
        return need


# ---- 1. an unload racing requests -------------------------------------------------------


def test_a_request_while_an_unload_waits_gets_the_reloaded_model(registry_of: Any) -> None:
    # The review's reproduction: a request runs, /models/unload, then a request: it was a
    # 500 (AssertionError) and the unload was dropped.
    registry = registry_of(spec("c"))
    running = registry.acquire("c")
    first = registry.model_stats("c", with_pool=True).pool
    assert registry.unload("c").state == "unloading"
    waiting = concurrent.futures.ThreadPoolExecutor(1).submit(registry.acquire, "c", deadline_s=30)
    wait_until(lambda: registry.model_stats("c").waiting == 1, message="the request to wait")
    assert running.pool.generate("echo:still").text == "still"  # the running one finishes
    running.release()
    lease = waiting.result(timeout=slack(20))
    try:
        assert lease.pool is not running.pool and lease.pool.generate("echo:new").text == "new"
    finally:
        lease.release()
    stats = registry.model_stats("c")
    assert stats.unloads == 1 and stats.loads == 2 and first is not None


@pytest.mark.slow
def test_unloads_racing_requests_thousands_of_times_never_fail_one_nor_are_lost(
    registry_of: Any,
) -> None:
    registry = registry_of(spec("c"), pool_class=InstantPool, max_waiting=100)
    rounds = 2000

    def unload(start: threading.Barrier) -> None:
        start.wait()
        registry.unload("c")

    def request(start: threading.Barrier) -> Any:
        start.wait()
        return registry.acquire("c", deadline_s=10)

    for round_ in range(rounds):
        holder = registry.acquire("c", deadline_s=10)
        start = threading.Barrier(2)
        with concurrent.futures.ThreadPoolExecutor(2) as threads:
            unloading = threads.submit(unload, start)
            requested = threads.submit(request, start)
            unloading.result()
            holder.release()
            requested.result().release()  # a lease, never an error
        wait_until(
            lambda n=round_: registry.model_stats("c").unloads == n + 1,
            timeout=slack(5),
            message="the unload done, not dropped",
        )
    stats = registry.model_stats("c")
    assert stats.unloads == rounds and stats.load_failures == 0


# ---- 2. keep_alive is the requester's own; runtime pins ----------------------------------


def test_a_clients_keep_alive_never_unloads_a_model_another_client_uses(
    registry_of: Any,
) -> None:
    registry = registry_of(spec("shared", ttl_s=300), spec("own", ttl_s=300))
    registry.acquire("shared", client="alice").release()
    registry.acquire("shared", client="bob", keep_alive=0.0).release()
    registry.acquire("own", client="bob", keep_alive=0.0).release()
    # bob's keep_alive 0 unloads the model only bob used, once idle...
    wait_until(lambda: registry.model_stats("own").state == "unloaded", timeout=slack(5))
    # ...and the one alice used stays for her ttl_s (the supervisor has gone round since).
    assert registry.model_stats("shared").state == "loaded"
    assert registry.model_stats("shared").keep_alive_s == pytest.approx(300, abs=5)
    # A keep_alive longer than ttl_s is held to it: no tenant keeps a model for ever.
    registry.acquire("own", client="bob", keep_alive=None).release()
    assert registry.model_stats("own").keep_alive_s == 300


def test_a_client_letting_go_unloads_only_a_model_no_other_client_keeps(registry_of: Any) -> None:
    # Ollama's keep_alive 0 without a run, from a tenant: its own use ends, no more.
    registry = registry_of(spec("shared", ttl_s=300), spec("own", ttl_s=300))
    registry.acquire("shared", client="alice").release()
    registry.acquire("shared", client="bob").release()
    registry.acquire("own", client="bob").release()
    registry.let_go("shared", "bob")
    registry.let_go("own", "bob")
    wait_until(lambda: registry.model_stats("own").state == "unloaded", timeout=slack(5))
    assert registry.model_stats("shared").state == "loaded"


def test_a_runtime_pin_keeps_a_model_from_keep_alive_and_eviction(registry_of: Any) -> None:
    need = measured_need()
    registry = registry_of(
        spec("a", ttl_s=300), spec("b"), memory_budget_bytes=int(need * 1.6), backoff_s=0.1
    )
    registry.acquire("a").release()
    assert registry.pin("a").pinned
    registry.acquire("a", client="bob", keep_alive=0.0).release()
    assert registry.model_stats("a").keep_alive_s is None
    with pytest.raises(ModelTooLarge, match="beside the pinned models"):
        registry.acquire("b", deadline_s=5)  # a pinned does not go for it: b cannot fit
    assert registry.model_stats("a").state == "loaded"
    assert not registry.pin("a", False).pinned
    wait_until(lambda: (registry.model_stats("b").retry_in_s or 0) <= 0, message="backoff")
    registry.acquire("b", deadline_s=slack(20)).release()
    assert registry.model_stats("a").evictions == 1


# ---- 3. needs kept, estimated, settled ------------------------------------------------------


def test_a_restart_plans_from_the_needs_the_last_run_measured(tmp_path: Path) -> None:
    need = measured_need()
    needs_file = str(tmp_path / "state" / "needs.json")
    models = (spec("a"), spec("b"))
    config = RegistryConfig(models, memory_budget_bytes=int(need * 2.6), needs_file=needs_file)
    with ModelRegistry(config) as first:
        first.acquire("a").release()
        first.acquire("b").release()
    with ModelRegistry(config) as second:
        stats = second.stats().models
        assert stats["a"].need_source == "saved" and stats["b"].need_source == "saved"
        assert stats["a"].need_bytes == pytest.approx(need, rel=0.5)
        second.acquire("a").release()
        second.acquire("b").release()  # fits beside a: a stays
        stats = second.stats().models
        assert stats["a"].state == "loaded" and stats["a"].evictions == 0
        assert stats["b"].need_source == "measured"
    # Another configuration is another identity: nothing saved for it.
    other = RegistryConfig((spec("a", workers=2),), needs_file=needs_file)
    assert ModelRegistry(other).model_stats("a").need_source is None


def test_a_model_never_measured_is_estimated_from_its_files_and_evicts_nothing_it_fits_beside(
    registry_of: Any, tmp_path: Path
) -> None:
    need = measured_need()
    weights = tmp_path / "small-model"
    weights.mkdir()
    (weights / "model.safetensors").write_bytes(b"\0" * 2**20)
    registry = registry_of(
        spec("a"), spec("small", model=str(weights)), memory_budget_bytes=int(need * 3)
    )
    estimated = registry.model_stats("small")
    assert estimated.need_source == "estimated"
    assert estimated.need_bytes == int(2**20 * 1.2) + 32 * 2**20
    registry.acquire("a").release()
    registry.acquire("small").release()
    stats = registry.stats().models
    assert stats["a"].state == "loaded" and stats["a"].evictions == 0
    assert stats["small"].need_source == "measured"


def test_one_requests_peak_does_not_make_a_model_too_large_for_good(registry_of: Any) -> None:
    need = measured_need()
    budget = int(need * 2)
    registry = registry_of(spec("m"), memory_budget_bytes=budget, backoff_s=0.2)
    with registry.use("m") as pool:
        pool.generate(f"leak:{budget >> 20}")  # held for the worker's life: over the budget
    wait_until(lambda: registry.model_stats("m").state == "failed", timeout=slack(5))
    wait_until(
        lambda: (registry.model_stats("m").retry_in_s or 0) <= 0,
        timeout=slack(5),
        message="the backoff to pass",
    )
    with registry.use("m", deadline_s=slack(20)) as pool:  # loaded again, measured afresh
        assert pool.generate("echo:back").text == "back"
    stats = registry.model_stats("m")
    assert stats.state == "loaded" and stats.need_bytes is not None and stats.need_bytes < budget


# ---- 4. swaps ----------------------------------------------------------------------------


def test_an_eviction_keeps_a_model_that_fits_beside_the_one_loading(registry_of: Any) -> None:
    need, extra = measured_need(), 100 * 2**20
    budget = 3 * need + int(1.5 * extra)
    registry = registry_of(spec("small"), spec("big1"), spec("big2"), memory_budget_bytes=budget)
    for big in ("big1", "big2"):  # each measured once, then unloaded
        with registry.use(big) as pool:
            pool.generate(f"leak:{extra >> 20}")
        wait_until(lambda b=big: (registry.model_stats(b).need_bytes or 0) >= need + extra * 0.9)
        registry.unload(big)
        wait_until(lambda b=big: registry.model_stats(b).state == "unloaded", timeout=slack(5))
    registry.acquire("small").release()
    with registry.use("big1") as pool:
        pool.generate(f"leak:{extra >> 20}")
    wait_until(lambda: (registry.model_stats("big1").rss_bytes or 0) >= need + extra * 0.9)
    registry.acquire("big2", deadline_s=slack(20)).release()
    stats = registry.stats().models
    assert stats["small"].state == "loaded" and stats["small"].evictions == 0
    assert stats["big1"].evictions == 1


def test_a_client_that_keeps_swapping_waits_its_turn_and_the_other_does_not(
    registry_of: Any,
) -> None:
    need = measured_need()
    registry = registry_of(
        spec("a"), spec("b"), spec("c"), memory_budget_bytes=int(need * 1.6), swap_share=0.2
    )
    registry.acquire("a", client="alice").release()
    registry.acquire("b", client="bob", deadline_s=slack(20)).release()  # bob's first: at once
    registry.acquire("a", client="alice", deadline_s=slack(20)).release()  # alice's back: at once
    with pytest.raises(QueueFull) as refused:
        registry.acquire("c", client="bob", deadline_s=1.0)
    assert refused.value.retry_after_s > 1.0
    stats = registry.stats().models
    assert stats["a"].state == "loaded" and stats["c"].state == "unloaded"


def test_a_request_whose_deadline_the_load_cannot_meet_is_answered_at_once_and_the_load_goes_on(
    registry_of: Any,
) -> None:
    registry = registry_of(spec("slow", load_delay_s=1.5))
    registry.acquire("slow", deadline_s=slack(30)).release()  # its load time is known now
    registry.unload("slow")
    wait_until(lambda: registry.model_stats("slow").state == "unloaded", timeout=slack(5))
    with pytest.raises(QueueFull) as refused:
        registry.acquire("slow", deadline_s=0.5)
    last = registry.model_stats("slow").last_load_s
    assert last is not None and refused.value.retry_after_s == pytest.approx(last, abs=0.2)
    assert registry.model_stats("slow").state == "loading"  # asked for: it goes on
    wait_until(lambda: registry.model_stats("slow").state == "loaded", timeout=slack(10))
    registry.acquire("slow", deadline_s=0.5).release()


# ---- 5. loads in parallel; waiting places ------------------------------------------------


@pytest.mark.slow
def test_a_quick_load_does_not_wait_behind_a_slow_or_failing_one(registry_of: Any) -> None:
    registry = registry_of(
        spec("slow", load_delay_s=8.0), spec("broken", fail_load=True), spec("quick")
    )
    with concurrent.futures.ThreadPoolExecutor(2) as threads:
        slow = threads.submit(registry.acquire, "slow", deadline_s=slack(60))
        wait_until(lambda: registry.model_stats("slow").state == "loading")
        broken = threads.submit(registry.acquire, "broken", deadline_s=slack(60))
        with registry.use("quick", deadline_s=slack(30)) as pool:
            assert pool.generate("echo:quick").text == "quick"
        assert not slow.done(), "the quick load waited behind the slow one"
        with pytest.raises(ModelUnavailable):
            broken.result(timeout=slack(30))
        slow.result(timeout=slack(60)).release()


@pytest.mark.slow
def test_under_a_budget_a_load_that_fits_does_not_wait_behind_a_slow_one(
    registry_of: Any,
) -> None:
    need = measured_need()
    budget = int(2.5 * need)  # two fit, three do not
    registry = registry_of(
        spec("slow", load_delay_s=5.0), spec("quick"), spec("third"), memory_budget_bytes=budget
    )
    for name in ("slow", "quick", "third"):  # each measured by a load that became ready
        registry.acquire(name, deadline_s=slack(30)).release()
        registry.unload(name)
        wait_until(lambda n=name: registry.model_stats(n).state == "unloaded", timeout=slack(5))
    with concurrent.futures.ThreadPoolExecutor(2) as threads:
        slow = threads.submit(registry.acquire, "slow", deadline_s=slack(60))
        wait_until(lambda: registry.model_stats("slow").state == "loading")
        with registry.use("quick", deadline_s=slack(30)) as pool:
            assert pool.generate("echo:quick").text == "quick"
        assert not slow.done(), "the quick load waited behind the slow one"
        # third does not fit beside both: it waits for slow's load, then evicts quick.
        third = threads.submit(registry.acquire, "third", deadline_s=slack(60))
        slow.result(timeout=slack(60)).release()
        third.result(timeout=slack(60)).release()
    stats = registry.stats()
    assert stats.models["quick"].evictions == 1 and stats.models["slow"].state == "loaded"
    assert stats.peak_rss_bytes <= budget


@pytest.mark.slow
def test_a_load_that_never_became_ready_leaves_no_partial_need_to_plan_on(
    registry_of: Any,
) -> None:
    # Its readings were of the part of it that was up: planned on them, its next load
    # would keep models beside it that it does not fit beside (the chaos benchmark's
    # budget violation).
    pool = make_config(workers=1, model="none", backend_options={"load_delay_s": 600.0})
    hangs = ModelSpec("hangs", pool, load_timeout_s=slack(3.0))
    registry = registry_of(hangs, memory_budget_bytes=4 * measured_need())
    with concurrent.futures.ThreadPoolExecutor(1) as threads:
        load = threads.submit(registry.acquire, "hangs", deadline_s=slack(30))
        wait_until(lambda: registry.model_stats("hangs").need_bytes, message="a reading")
        with pytest.raises(ModelUnavailable):
            load.result(timeout=slack(30))
    stats = registry.model_stats("hangs")
    assert stats.state == "failed" and stats.need_bytes is None


def test_one_client_holds_at_most_a_quarter_of_the_load_waiting_places(registry_of: Any) -> None:
    registry = registry_of(spec("slow", load_delay_s=1.0), spec("other"), max_waiting=8)
    with concurrent.futures.ThreadPoolExecutor(3) as threads:
        waiting = [
            threads.submit(registry.acquire, "slow", client="bob", deadline_s=30) for _ in range(2)
        ]
        wait_until(lambda: registry.stats().waiting == 2, message="bob's two waiting")
        with pytest.raises(PoolOverloaded, match="2 of them this client's"):
            registry.acquire("slow", client="bob", deadline_s=30)
        registry.acquire("other", client="alice", deadline_s=slack(20)).release()
        for future in waiting:
            future.result(timeout=slack(20)).release()
