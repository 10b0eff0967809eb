"""Prefix cache tiers through a real pool of hf workers: a worker SIGKILLed between two
turns is replaced by one that restores the conversation from the host tier (same greedy
answer, ``cached_tokens`` > 0); a new pool over the same disk tier (a daemon restart)
restores it too; the pool's host tier is gone after close; the stats show the tiers."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from helpers import Recorder, greedy_conversation, make_config, wait_until, workers
from modelpool import ModelPool
from modelpool.shared.prefix_tier import TierStats
from modelpool.shared.protocol import ChatMessage
from modelpool.worker.backends.hf.handler import HFHandler, load

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux processes"),
    pytest.mark.slow,
]

SYSTEM = "You answer questions about a garden in one sentence. " * 6
QUESTIONS = ["What grows by the wall?", "And near the pond?", "Which flowers bloom first?"]
OPTIONS = {"dtype": "float32", "torch_threads": 1}


@pytest.fixture(scope="module")
def plain(tiny_model_dir: Path) -> HFHandler:
    handler = load(str(tiny_model_dir), prefix_cache_bytes=0, dtype="float32", torch_threads=1)
    assert isinstance(handler, HFHandler)
    return handler


def reference(plain: HFHandler, turns: int) -> list[str]:
    """The greedy answers of the conversation's turns, every prefix prefilled."""
    return greedy_conversation(plain, SYSTEM, QUESTIONS[:turns])


def tiered_pool(model: Path, **overrides: Any) -> ModelPool:
    values: dict[str, Any] = {
        "model": str(model),
        "backend": "hf",
        "workers": 1,
        "backend_options": dict(OPTIONS),
        "deadline_s": 120.0,
        "startup_timeout_s": 180.0,
    }
    return ModelPool(make_config(**{**values, **overrides})).start()


def ask(pool: ModelPool, messages: list[ChatMessage], question: str) -> tuple[str, int]:
    messages.append({"role": "user", "content": question})
    result = pool.generate(list(messages), max_new_tokens=8)
    messages.append({"role": "assistant", "content": result.text})
    return result.text, result.cached_tokens


def stored(pool: ModelPool, tier: int, count: int) -> None:
    """Wait until the tier holds ``count`` writes (a worker writes after it answers) and
    the pool has seen them (``supervisor.tier_watch``)."""
    wait_until(
        lambda: pool.stats().prefix_tiers[tier].stores >= count,
        60.0,
        message=lambda: f"{count} tier writes ({pool.stats().prefix_tiers})",
    )


def tier_shows(pool: ModelPool, check: Callable[[TierStats], bool]) -> TierStats:
    """The pool's only tier, once its stats (walked off the dispatcher thread, a moment
    behind the workers) pass ``check``."""
    return wait_until(
        lambda: next((tier for tier in pool.stats().prefix_tiers if check(tier)), None),
        60.0,
        message=lambda: f"the tier's stats ({pool.stats().prefix_tiers})",
    )


@pytest.mark.parametrize("batch", [1, 2], ids=["one-call", "batched"])
def test_a_worker_killed_between_turns_is_replaced_by_one_that_restores(
    tiny_model_dir: Path, plain: HFHandler, batch: int
) -> None:
    expected = reference(plain, 3)
    pool = tiered_pool(tiny_model_dir, prefix_cache_host_bytes=64 * 2**20, max_batch_size=batch)
    host = pool.config.prefix_cache_host_dir
    try:
        assert host is not None and os.path.isdir(host)
        messages: list[ChatMessage] = [{"role": "system", "content": SYSTEM}]
        answers = [ask(pool, messages, question)[0] for question in QUESTIONS[:2]]
        stored(pool, 0, 2)
        (victim,) = workers(pool)
        assert victim.pid is not None
        os.kill(victim.pid, signal.SIGKILL)
        wait_until(
            lambda: [w for w in workers(pool) if w.state == "idle" and w.pid != victim.pid],
            120.0,
            message="a replacement worker",
        )
        text, cached = ask(pool, messages, QUESTIONS[2])
        assert [*answers, text] == expected
        assert cached > 0
        tier = tier_shows(pool, lambda tier: tier.restores >= 1)
        assert tier.tier == "host" and tier.bytes > 0
        assert tier.rejected == 0
    finally:
        pool.close(drain=False, timeout=10.0)
    assert not os.path.exists(host), "the pool's host tier is removed at close"


@pytest.mark.parametrize("tiers", [True, False], ids=["host-tier", "no-tier"])
def test_a_busy_holder_of_a_prefix_the_tier_holds_leaves_the_next_turn_to_an_idle_worker(
    tiny_model_dir: Path, plain: HFHandler, tiers: bool
) -> None:
    """Two batched workers, one holding the conversation and busy with a long answer:
    the next turn joins its batch for the prefix (placement's slack), unless the host
    tier holds that prefix too: then the idle worker restores it and starts at once."""
    expected = reference(plain, 2)
    overrides: dict[str, Any] = {"prefix_cache_host_bytes": 64 * 2**20} if tiers else {}
    pool = tiered_pool(tiny_model_dir, workers=2, max_batch_size=2, **overrides)
    long = None
    try:
        messages: list[ChatMessage] = [{"role": "system", "content": SYSTEM}]
        messages.append({"role": "user", "content": QUESTIONS[0]})
        first = pool.generate(list(messages), max_new_tokens=8)
        messages.append({"role": "assistant", "content": first.text})
        holder = first.worker_pid
        wait_until(
            lambda: any(
                w.pid == holder and w.prefix_cache and w.prefix_cache.entries for w in workers(pool)
            ),
            60.0,
            message="the holder's prefix cache report",
        )
        if tiers:
            stored(pool, 0, 1)
        # The holder takes a long answer to the same conversation (its own hit) and stays
        # busy with it.
        aside = [*messages, {"role": "user", "content": "Tell me everything."}]
        long = pool.submit(aside, max_new_tokens=500, ignore_eos=True)
        (busy,) = wait_until(lambda: [w for w in workers(pool) if w.running], 60.0)
        assert busy.pid == holder
        messages.append({"role": "user", "content": QUESTIONS[1]})
        second = pool.generate(list(messages), max_new_tokens=8)
        if tiers:
            assert second.worker_pid != holder, "the idle worker restores the prefix"
            assert second.cached_tokens > 0
            assert [first.text, second.text] == expected
        else:
            assert second.worker_pid == holder, "the holder took it into its batch"
    finally:
        if long is not None:
            long.cancel()
        pool.close(drain=False, timeout=10.0)


def test_a_new_pool_restores_from_the_disk_tier(
    tiny_model_dir: Path, plain: HFHandler, tmp_path: Path
) -> None:
    expected = reference(plain, 2)
    messages: list[ChatMessage] = [{"role": "system", "content": SYSTEM}]
    with tiered_pool(tiny_model_dir, prefix_cache_dir=str(tmp_path)) as first:
        first_answer, _ = ask(first, messages, QUESTIONS[0])
        stored(first, 0, 1)
    with tiered_pool(tiny_model_dir, prefix_cache_dir=str(tmp_path)) as second:
        text, cached = ask(second, messages, QUESTIONS[1])
        tier = tier_shows(second, lambda tier: tier.restores >= 1)
    assert [first_answer, text] == expected
    assert cached > 0
    assert tier.tier == "disk" and tier.restores == 1 and tier.entries >= 1


def test_kills_during_writes_and_restores_a_full_tier_and_a_corrupted_file_change_no_answer(
    tiny_model_dir: Path, plain: HFHandler
) -> None:
    expected = reference(plain, 3) + reference_more(plain)
    # About two entries' worth: every write past the second evicts.
    pool = tiered_pool(tiny_model_dir, prefix_cache_host_bytes=240_000)
    try:
        host = pool.config.prefix_cache_host_dir
        assert host is not None
        messages: list[ChatMessage] = [{"role": "system", "content": SYSTEM}]
        answers = [ask(pool, messages, QUESTIONS[0])[0]]
        # Killed as it answers: its write may be under way, done or not begun.
        kill_and_replace(pool)
        answers.append(ask(pool, messages, QUESTIONS[1])[0])
        stored(pool, 0, 1)
        for entry in {path.stat().st_ino: path for path in Path(host).glob("*.kv")}.values():
            with open(entry, "r+b") as file:
                file.seek(entry.stat().st_size - 7)
                file.write(b"garbage")
        # Killed while it restores or prefills: the request is retried on its replacement.
        messages.append({"role": "user", "content": QUESTIONS[2]})
        future = pool.submit(list(messages), max_new_tokens=8)
        wait_until(lambda: future.done() or [w for w in workers(pool) if w.state == "busy"], 60.0)
        kill_and_replace(pool, wait=False)
        answers.append(future.result(timeout=300).text)
        messages.append({"role": "assistant", "content": answers[-1]})
        for question in MORE:
            answers.append(ask(pool, messages, question)[0])
        assert answers == expected
        tier = tier_shows(pool, lambda tier: tier.evictions >= 1)
        assert tier.bytes <= tier.limit_bytes
        pid_files = [path.name for path in Path(host).glob(".tmp-*")]
        live = {str(w.pid) for w in workers(pool)}
        assert all(name.split("-")[1] in live for name in pid_files), pid_files
    finally:
        pool.close(drain=False, timeout=10.0)


MORE = ["Is the pond deep?", "What should I plant in autumn?"]


def reference_more(plain: HFHandler) -> list[str]:
    messages: list[ChatMessage] = [{"role": "system", "content": SYSTEM}]
    answers = []
    for question in [*QUESTIONS, *MORE]:
        messages.append({"role": "user", "content": question})
        text = plain.generate(Recorder(list(messages), {"max_new_tokens": 8})).text
        messages.append({"role": "assistant", "content": text})
        answers.append(text)
    return answers[len(QUESTIONS) :]


def kill_and_replace(pool: ModelPool, wait: bool = True) -> None:
    (victim,) = [w for w in workers(pool) if w.pid is not None]
    assert victim.pid is not None
    os.kill(victim.pid, signal.SIGKILL)
    if wait:
        wait_until(
            lambda: [w for w in workers(pool) if w.state == "idle" and w.pid != victim.pid],
            300.0,
            message="a replacement worker",
        )


def test_a_model_unloaded_by_the_registry_restores_when_loaded_again(
    tiny_model_dir: Path, plain: HFHandler, tmp_path: Path
) -> None:
    from modelpool.shared.config import ModelSpec
    from modelpool.supervisor.registry import ModelRegistry, RegistryConfig

    expected = reference(plain, 2)
    config = make_config(
        model=str(tiny_model_dir),
        backend="hf",
        workers=1,
        backend_options=dict(OPTIONS),
        deadline_s=120.0,
        startup_timeout_s=180.0,
        prefix_cache_dir=str(tmp_path),
    )
    registry = ModelRegistry(RegistryConfig(models=(ModelSpec("garden", config),))).start()
    try:
        messages: list[ChatMessage] = [{"role": "system", "content": SYSTEM}]
        with registry.use("garden") as pool:
            answers = [ask(pool, messages, QUESTIONS[0])[0]]
            stored(pool, 0, 1)
        registry.unload("garden")
        wait_until(
            lambda: registry.model_stats("garden").state == "unloaded", 60.0, message="unload"
        )
        with registry.use("garden", deadline_s=300.0) as pool:
            text, cached = ask(pool, messages, QUESTIONS[1])
    finally:
        registry.close(timeout=10.0)
    assert [*answers, text] == expected
    assert cached > 0
