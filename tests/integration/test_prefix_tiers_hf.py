"""The hf backend over the prefix cache tiers (backends/hf/prefix_tier.py), in process: a
worker whose prefix cache is empty (a respawned one) restores the conversation from the
tier and answers the same greedy text as a worker that prefilled it, on the one-call
path and in the batched loop; another partition gets nothing; a corrupted entry or one
of another model is ignored and counted."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from helpers import Recorder
from modelpool.shared.prefix_tier import ENTRY_SUFFIX, TierSpec
from modelpool.shared.protocol import ChatMessage, Generation
from modelpool.worker.backends.hf.handler import HFHandler, load

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux processes")

SYSTEM = (
    "You are a careful assistant for a small shop. Answer in one short sentence. "
    "The shop sells apples, pears, plums and cherries; it opens at nine and closes at six. "
)
QUESTIONS = ["When do you open?", "Do you sell pears?", "And plums?"]


@pytest.fixture(scope="module")
def handlers(tiny_model_dir: Path) -> tuple[HFHandler, HFHandler]:
    plain = load(str(tiny_model_dir), dtype="float32", torch_threads=1, prefix_cache_bytes=0)
    tiered = load(str(tiny_model_dir), dtype="float32", torch_threads=1, prefix_cache_bytes="64MiB")
    return plain, tiered


def attach(handler: HFHandler, directory: Path, model: Path) -> None:
    handler.attach_prefix_tiers(
        [TierSpec("host", str(directory), 256 * 2**20)], str(model), {"dtype": "float32"}
    )
    assert handler.prefix_tiers is not None


def run(
    handler: HFHandler, messages: list[ChatMessage], batched: bool, **params: object
) -> Generation:
    call = Recorder(list(messages), {"max_new_tokens": 10, **params})
    if not batched:
        return handler.generate(call)
    handler.admit(call)
    for _ in range(10_000):
        for done, outcome in handler.step():
            if done is call:
                assert isinstance(outcome, Generation), outcome
                return outcome
    raise AssertionError("the batched loop did not answer")


def converse(handler: HFHandler, turns: int, batched: bool, **params: object) -> list[Generation]:
    messages: list[ChatMessage] = [{"role": "system", "content": SYSTEM}]
    answers = []
    for question in QUESTIONS[:turns]:
        messages.append({"role": "user", "content": question})
        answer = run(handler, messages, batched, **params)
        messages.append({"role": "assistant", "content": answer.text})
        answers.append(answer)
    return answers


@pytest.mark.parametrize("batched", [False, True], ids=["one-call", "batched"])
def test_an_empty_worker_cache_restores_from_the_tier_and_answers_the_same(
    handlers: tuple[HFHandler, HFHandler], tiny_model_dir: Path, tmp_path: Path, batched: bool
) -> None:
    plain, tiered = handlers
    attach(tiered, tmp_path / "host", tiny_model_dir)
    assert tiered.prefix_cache is not None and tiered.prefix_tiers is not None
    tiered.prefix_cache.clear()
    expected = converse(plain, 3, batched)
    converse(tiered, 2, batched)
    tiered.prefix_tiers.flush()
    assert list((tmp_path / "host").glob("*" + ENTRY_SUFFIX))
    # What a respawned worker has: nothing in memory, the tier on the host.
    tiered.prefix_cache.clear()
    got = converse(tiered, 3, batched)
    assert [answer.text for answer in got] == [answer.text for answer in expected]
    previous = got[1].prompt_tokens
    assert previous is not None and got[2].cached_tokens >= previous
    (host,) = tiered.prefix_tiers.store.stats()
    assert host.restores >= 1 and host.rejected == 0


def test_another_partition_gets_no_tier_hit(
    handlers: tuple[HFHandler, HFHandler], tiny_model_dir: Path, tmp_path: Path
) -> None:
    _, tiered = handlers
    attach(tiered, tmp_path / "host", tiny_model_dir)
    assert tiered.prefix_cache is not None and tiered.prefix_tiers is not None
    tiered.prefix_cache.clear()
    messages: list[ChatMessage] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": QUESTIONS[0]},
    ]
    answer = run(tiered, messages, False, cache_salt="tenant-a")
    tiered.prefix_tiers.flush()
    turn = [*messages, {"role": "assistant", "content": answer.text}]
    turn.append({"role": "user", "content": QUESTIONS[1]})
    for salt in ("tenant-b", None):
        tiered.prefix_cache.clear()
        params = {} if salt is None else {"cache_salt": salt}
        assert run(tiered, turn, False, **params).cached_tokens == 0, salt
    assert tiered.prefix_tiers.store.stats()[0].hits == 0
    tiered.prefix_cache.clear()
    assert run(tiered, turn, False, cache_salt="tenant-a").cached_tokens > 0
    assert tiered.prefix_tiers.store.stats()[0].hits == 1


def second_turn(handler: HFHandler) -> list[ChatMessage]:
    messages: list[ChatMessage] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": QUESTIONS[0]},
    ]
    answer = run(handler, messages, False)
    return [
        *messages,
        {"role": "assistant", "content": answer.text},
        {"role": "user", "content": QUESTIONS[1]},
    ]


def test_corrupted_and_foreign_entries_are_ignored_and_counted(
    handlers: tuple[HFHandler, HFHandler], tiny_model_dir: Path, tmp_path: Path
) -> None:
    plain, tiered = handlers
    attach(tiered, tmp_path / "host", tiny_model_dir)
    assert tiered.prefix_cache is not None and tiered.prefix_tiers is not None
    tiered.prefix_cache.clear()
    turn = second_turn(tiered)
    expected = run(plain, turn, False)
    tiered.prefix_tiers.flush()
    # One file under several names (one a block): flip a byte of it once.
    (inode,) = {entry.stat().st_ino for entry in (tmp_path / "host").glob("*" + ENTRY_SUFFIX)}
    entry = next((tmp_path / "host").glob("*" + ENTRY_SUFFIX))
    with open(entry, "r+b") as file:
        file.seek(entry.stat().st_size // 2)
        byte = file.read(1)
        file.seek(-1, 1)
        file.write(bytes([byte[0] ^ 0x55]))
    tiered.prefix_cache.clear()
    got = run(tiered, turn, False)
    assert (got.text, got.cached_tokens) == (expected.text, 0)
    (host,) = tiered.prefix_tiers.store.stats()
    assert host.rejected >= 1 and host.restores == 0 and inode
    # An entry of another identity (here: another GGUF file) is never restored: its
    # names are seeded with the identity (an entry renamed is refused: the store's tests).
    tiered.prefix_cache.clear()
    turn = second_turn(tiered)
    tiered.prefix_tiers.flush()
    tiered.prefix_cache.clear()
    hits = tiered.prefix_tiers.store.stats()[0].hits
    tiered.attach_prefix_tiers(
        [TierSpec("host", str(tmp_path / "host"), 256 * 2**20)],
        str(tiny_model_dir),
        {"gguf_file": "another"},
    )
    assert run(tiered, turn, False).cached_tokens == 0
    assert tiered.prefix_tiers.store.stats()[0].hits == hits
