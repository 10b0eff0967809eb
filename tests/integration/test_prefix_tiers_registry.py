"""The registry's host prefix cache tiers, through real hf pools: a model evicted for
another keeps its host tier while it is out (counted in the registry's memory), restores
its conversation from it when it is loaded again (no disk tier: same greedy answer,
``cached_tokens`` > 0), and the tier is removed when the registry closes; a load that
needs the tier's room drops it instead of failing or evicting."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

from helpers import greedy_conversation, make_config, wait_until
from modelpool import ModelPool
from modelpool.shared.config import ModelSpec, PoolConfig
from modelpool.shared.protocol import ChatMessage
from modelpool.supervisor.registry import ModelRegistry, RegistryConfig
from modelpool.supervisor.registry.needs import NeedStore
from modelpool.supervisor.registry.records import MEMORY
from modelpool.worker.backends.hf.handler import HFHandler, load

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux processes"),
    pytest.mark.slow,
]

SYSTEM = "You answer questions about an orchard in one sentence. " * 6
QUESTIONS = ["Which tree fruits first?", "And which one last?"]
OPTIONS = {"dtype": "float32", "torch_threads": 1}
HOST_TIER_BYTES = 64 * 2**20


@pytest.fixture(scope="module")
def plain(tiny_model_dir: Path) -> HFHandler:
    handler = load(str(tiny_model_dir), prefix_cache_bytes=0, dtype="float32", torch_threads=1)
    assert isinstance(handler, HFHandler)
    return handler


def reference(plain: HFHandler) -> list[str]:
    """The greedy answers of the conversation's turns, every prefix prefilled."""
    return greedy_conversation(plain, SYSTEM, QUESTIONS)


def orchard(model: Path, **overrides: Any) -> PoolConfig:
    """An hf pool with a host tier and no disk tier."""
    return make_config(
        model=str(model),
        backend="hf",
        workers=1,
        backend_options=dict(OPTIONS),
        deadline_s=120.0,
        startup_timeout_s=180.0,
        prefix_cache_host_bytes=HOST_TIER_BYTES,
        **overrides,
    )


def ask(pool: ModelPool, messages: list[ChatMessage], question: str) -> tuple[str, int]:
    messages.append({"role": "user", "content": question})
    result = pool.generate(list(messages), max_new_tokens=8)
    messages.append({"role": "assistant", "content": result.text})
    return result.text, result.cached_tokens


def first_turn(registry: ModelRegistry, messages: list[ChatMessage]) -> tuple[str, str]:
    """The first turn on ``orchard``, written to its host tier: the answer and the tier."""
    with registry.use("orchard", deadline_s=300.0) as pool:
        answer, _ = ask(pool, messages, QUESTIONS[0])
        wait_until(
            lambda: pool.stats().prefix_tiers[0].stores >= 1,
            60.0,
            message=lambda: f"a tier write ({pool.stats().prefix_tiers})",
        )
        host = pool.config.prefix_cache_host_dir
    assert host is not None and os.path.isdir(host)
    return answer, host


def test_a_model_evicted_for_another_restores_from_the_host_tier_the_registry_kept(
    tiny_model_dir: Path, plain: HFHandler
) -> None:
    expected = reference(plain)
    models = (
        ModelSpec("orchard", orchard(tiny_model_dir)),
        # Its need is not known: its load evicts every model that may go.
        ModelSpec("other", make_config(workers=1)),
    )
    registry = ModelRegistry(RegistryConfig(models, memory_budget_bytes=2**40)).start()
    try:
        messages: list[ChatMessage] = [{"role": "system", "content": SYSTEM}]
        answer, host = first_turn(registry, messages)
        registry.acquire("other", deadline_s=120.0).release()
        stats = registry.stats(with_pools=False)
        out = stats.models["orchard"]
        assert out.state == "unloaded" and out.evictions == 1
        assert os.path.isdir(host), "the registry keeps the tier of a model that is out"
        assert out.host_tier_bytes is not None and out.host_tier_bytes > 0
        # Counted in the registry's memory while the model is out.
        other = stats.models["other"].rss_bytes
        assert other is not None and stats.rss_bytes == other + out.host_tier_bytes
        with registry.use("orchard", deadline_s=300.0) as pool:
            assert pool.config.prefix_cache_host_dir == host
            text, cached = ask(pool, messages, QUESTIONS[1])
            # The pool's tier stats are read on its watch thread, a moment behind the worker.
            tier = wait_until(
                lambda: next((t for t in pool.stats().prefix_tiers if t.restores), None),
                60.0,
                message=lambda: f"a restore in the tier's stats ({pool.stats().prefix_tiers})",
            )
        assert registry.model_stats("orchard").host_tier_bytes is None  # loaded: the pool's
    finally:
        registry.close(timeout=10.0)
    assert [answer, text] == expected
    assert cached > 0
    assert tier.tier == "host" and tier.restores >= 1 and tier.rejected == 0
    assert not os.path.exists(host), "the registry removes its tiers when it closes"


def test_a_load_that_needs_the_room_drops_the_host_tier_of_a_model_that_is_out(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    budget = 8 * 2**30
    big = ModelSpec("big", make_config(workers=1))
    needs_file = str(tmp_path / "needs.json")
    # Planned (as an earlier run measured it) to take all but 1,000 bytes of the budget.
    NeedStore(needs_file).save(big, {MEMORY: budget - 1000})
    models = (ModelSpec("orchard", orchard(tiny_model_dir)), big)
    config = RegistryConfig(models, memory_budget_bytes=budget, needs_file=needs_file)
    registry = ModelRegistry(config).start()
    try:
        messages: list[ChatMessage] = [{"role": "system", "content": SYSTEM}]
        _, host = first_turn(registry, messages)
        registry.unload("orchard")
        wait_until(
            lambda: registry.model_stats("orchard").state == "unloaded", 60.0, message="unload"
        )
        kept = registry.model_stats("orchard").host_tier_bytes
        assert kept is not None and kept > 1000 and os.path.isdir(host)
        registry.acquire("big", deadline_s=120.0).release()
        stats = registry.stats(with_pools=False)
        assert stats.models["big"].state == "loaded"
        assert stats.models["orchard"].host_tier_bytes is None
        assert not os.path.exists(host), "dropped before the load that needed its room"
        assert stats.rss_bytes == stats.models["big"].rss_bytes
    finally:
        registry.close(timeout=10.0)
