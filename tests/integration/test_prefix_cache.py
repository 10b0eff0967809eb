"""The hf backend's prefix cache (backends/hf/prefix_cache.py) against real models.

The rule it holds: greedy output with the cache equals output without it (float32), on
the one-call path and in the batched loop, while the later turns of a conversation take
their prefix from the cache (``cached_tokens``). And it stays within its bound, however
many distinct prefixes go through it. Also here: the hf backend's ``ignore_eos`` and
``tokenize`` (issue 28's fields, on a real tokenizer).
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Sequence
from pathlib import Path

import psutil
import pytest

from helpers import Recorder, assert_oracle_blind, assert_oracle_leaks, cache_oracle
from modelpool.shared.protocol import Generation, Prompt
from modelpool.worker.backends.hf.handler import HFHandler, load
from modelpool.worker.backends.hf.prefix_cache import PrefixCache

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux processes")

SYSTEM = (
    "You are a careful assistant for a small shop. Answer in one short sentence. "
    "The shop sells apples, pears, plums and cherries; it opens at nine and closes at six. "
)


def run_batched(handler: HFHandler, calls: Sequence[Recorder]) -> list[Generation]:
    for call in calls:
        handler.admit(call)
    results: dict[int, Generation] = {}
    steps = 0
    while len(results) < len(calls):
        for call, outcome in handler.step():
            assert isinstance(outcome, Generation), outcome
            results[id(call)] = outcome
        steps += 1
        assert steps < 10_000
    return [results[id(call)] for call in calls]


def conversation_turns(
    handler: HFHandler, turns: int, batched: bool, max_new_tokens: int
) -> list[list[Generation]]:
    """Two conversations sharing a system prompt, ``turns`` turns each, every turn sent
    with the answers so far (as an agent does); both conversations' turns go together
    when ``batched``."""
    conversations: list[list[dict[str, str]]] = [
        [{"role": "system", "content": SYSTEM}] for _ in range(2)
    ]
    questions = ["When do you open?", "Do you sell pears?", "And plums?", "Thanks!"]
    answers: list[list[Generation]] = []
    for turn in range(turns):
        calls = []
        for number, messages in enumerate(conversations):
            messages.append({"role": "user", "content": f"{questions[turn]} ({number})"})
            calls.append(Recorder(list(messages), {"max_new_tokens": max_new_tokens}))
        if batched:
            results = run_batched(handler, calls)
        else:
            results = [handler.generate(call) for call in calls]
        for messages, result in zip(conversations, results, strict=True):
            messages.append({"role": "assistant", "content": result.text})
        answers.append(results)
    return answers


def assert_cache_changes_nothing(
    plain: HFHandler, cached: HFHandler, turns: int, max_new_tokens: int = 12
) -> None:
    for batched in (False, True):
        assert cached.prefix_cache is not None
        cached.prefix_cache.clear()
        without = conversation_turns(plain, turns, batched, max_new_tokens)
        with_cache = conversation_turns(cached, turns, batched, max_new_tokens)
        for turn, (expected, got) in enumerate(zip(without, with_cache, strict=True)):
            for one, other in zip(expected, got, strict=True):
                assert other.text == one.text, (batched, turn)
                assert other.completion_tokens == one.completion_tokens
                assert other.prompt_tokens == one.prompt_tokens
                assert one.cached_tokens == 0
            if turn > 0:
                # The conversation so far, the previous answer included, came from the cache.
                for one, previous in zip(got, with_cache[turn - 1], strict=True):
                    assert previous.prompt_tokens is not None and one.cached_tokens
                    assert one.cached_tokens >= previous.prompt_tokens, (batched, turn)


@pytest.fixture(scope="module")
def handlers(tiny_model_dir: Path) -> tuple[HFHandler, HFHandler]:
    plain = load(str(tiny_model_dir), dtype="float32", torch_threads=1, prefix_cache_bytes=0)
    cached = load(str(tiny_model_dir), dtype="float32", torch_threads=1, prefix_cache_bytes="64MiB")
    return plain, cached


def test_greedy_output_with_the_cache_equals_without_on_a_tiny_model(
    handlers: tuple[HFHandler, HFHandler],
) -> None:
    plain, cached = handlers
    assert plain.prefix_cache is None
    assert_cache_changes_nothing(plain, cached, turns=3)
    report = cached.prefix_cache_report()
    assert report is not None and report.hits >= 8 and report.fingerprints
    assert 0 < report.bytes <= report.limit_bytes == 64 * 2**20


@pytest.mark.slow
def test_greedy_output_with_the_cache_equals_without_on_smollm2() -> None:
    from modelpool.shared.embedded import prepare_model

    model = str(prepare_model(progress=False))
    plain = load(model, dtype="float32", torch_threads=2, prefix_cache_bytes=0)
    cached = load(model, dtype="float32", torch_threads=2, prefix_cache_bytes="256MiB")
    assert_cache_changes_nothing(plain, cached, turns=2, max_new_tokens=8)


def test_a_string_prompt_reuses_the_cached_prefix_and_counts_it(
    handlers: tuple[HFHandler, HFHandler],
) -> None:
    plain, cached = handlers
    assert cached.prefix_cache is not None
    cached.prefix_cache.clear()
    first = Recorder(SYSTEM * 2, {"max_new_tokens": 8})
    cached.generate(first)
    assert first.prompt_counts is not None and first.prompt_counts[1] == 0
    longer = SYSTEM * 2 + "Pears?"
    again = Recorder(longer, {"max_new_tokens": 8})
    result = cached.generate(again)
    assert again.prompt_counts == (result.prompt_tokens, result.cached_tokens)
    assert result.cached_tokens and result.cached_tokens > 30
    assert result.text == plain.generate(Recorder(longer, {"max_new_tokens": 8})).text
    # The same prompt again: all but its last token come from the cache.
    same = cached.generate(Recorder(longer, {"max_new_tokens": 8}))
    assert same.prompt_tokens is not None and same.cached_tokens == same.prompt_tokens - 1


@pytest.mark.parametrize("batched", [False, True], ids=["one-call", "batched"])
def test_a_request_never_sees_another_partitions_cached_prefix(
    handlers: tuple[HFHandler, HFHandler], batched: bool
) -> None:
    """Issue 40, review #4: the digit-guessing oracle on ``cached_tokens``, blind across
    partitions (another tenant's, another salt), still served within one."""
    _, cached = handlers

    def cached_tokens(prompt: Prompt, params: dict[str, object]) -> int:
        call = Recorder(prompt, {**params, "max_new_tokens": 2})
        result = run_batched(cached, [call])[0] if batched else cached.generate(call)
        return result.cached_tokens or 0

    assert cached.prefix_cache is not None
    for victim, attacker in (({}, {"cache_salt": "b"}), ({"cache_salt": "a"}, {})):
        cached.prefix_cache.clear()
        assert_oracle_blind(cache_oracle(cached_tokens, victim, attacker))
    for shared in ({}, {"cache_salt": "a"}):
        cached.prefix_cache.clear()
        assert_oracle_leaks(cache_oracle(cached_tokens, shared, shared))
    # Partitions apart, a lookup costs what it did: the report counts its entries together.
    report = cached.prefix_cache_report()
    assert report is not None and report.entries >= 2


def test_the_cache_stays_within_its_bound_over_thousands_of_prefixes() -> None:
    import torch

    limit = 8 * 2**20
    cache = PrefixCache(limit)
    process = psutil.Process()
    gc.collect()
    before = process.memory_info().rss
    tokens = 96
    for number in range(3000):
        ids = [number, *range(1, tokens)]
        layers = [(torch.randn(1, 2, tokens, 32), torch.randn(1, 2, tokens, 32)) for _ in range(4)]
        cache.insert(ids, layers, (number,))
        assert cache.bytes <= limit
        if number % 500 == 0:
            assert cache.lookup([number, *range(1, tokens), 7]) is not None
    entry_bytes = 4 * 2 * 2 * tokens * 32 * 4
    assert len(cache) == limit // entry_bytes
    assert cache.evictions == 3000 - len(cache)
    gc.collect()
    # What the process kept is the cache's bound, not 3000 entries (70 MB).
    assert process.memory_info().rss - before < limit + 16 * 2**20
    report = cache.report()
    assert report.bytes == cache.bytes and report.entries == len(cache)
    assert report.fingerprints == frozenset(range(3000 - len(cache), 3000))


def test_an_entry_larger_than_the_bound_is_not_kept_and_prefixes_are_merged() -> None:
    import torch

    cache = PrefixCache(2 * 4 * 64 * 4)  # one layer's keys and values for 64 tokens
    ids = list(range(100, 164))
    cache.insert(ids[:32], [(torch.zeros(1, 1, 32, 4), torch.zeros(1, 1, 32, 4))], (1,))
    assert len(cache) == 1
    # A longer entry holds the shorter one's prefix: the shorter one goes.
    cache.insert(ids, [(torch.ones(1, 1, 64, 4), torch.ones(1, 1, 64, 4))], (1, 2))
    assert len(cache) == 1 and cache.report().fingerprints == {1, 2}
    found = cache.lookup([*ids, 5])
    assert found is not None and found[1] == 64
    cache.insert(list(range(200)), [(torch.ones(1, 1, 200, 4), torch.ones(1, 1, 200, 4))], (3,))
    assert len(cache) == 1 and cache.evictions == 0
    # Shorter than a block, or sharing less than one: nothing to reuse.
    assert cache.lookup(ids[:10]) is None
    assert cache.lookup([999, *ids]) is None


def test_ignore_eos_generates_past_the_end_of_sequence(tiny_model_dir: Path) -> None:
    handler = load(str(tiny_model_dir), dtype="float32", torch_threads=1, prefix_cache_bytes=0)
    first = handler.model.generate(handler.encode("Hello"), max_new_tokens=1, do_sample=False)
    # The tiny model's first greedy token is made its end of sequence.
    eos = int(first[0, -1])
    handler.model.generation_config.eos_token_id = eos
    handler.eos_ids = frozenset({eos})
    ended = handler.generate(Recorder("Hello", {"max_new_tokens": 6}))
    assert (ended.finish_reason, ended.completion_tokens) == ("stop", 1)
    forced = handler.generate(Recorder("Hello", {"max_new_tokens": 6, "ignore_eos": True}))
    assert (forced.finish_reason, forced.completion_tokens) == ("length", 6)
    together = run_batched(
        handler,
        [
            Recorder("Hello", {"max_new_tokens": 6, "ignore_eos": True}),
            Recorder("Hello", {"max_new_tokens": 6}),
        ],
    )
    ends = [(g.finish_reason, g.completion_tokens) for g in together]
    assert ends == [("length", 6), ("stop", 1)]
    assert together[0].text == forced.text


def test_tokenize_is_what_a_generation_reads(handlers: tuple[HFHandler, HFHandler]) -> None:
    plain, _ = handlers
    chat: Prompt = [{"role": "user", "content": "Hi"}]
    ids = plain.tokenize(chat)
    assert ids == plain.encode(chat)[0].tolist()
    assert len(plain.tokenize(chat, add_generation_prompt=False)) < len(ids)
    assert plain.detokenize(plain.tokenize("Hello there")) == "Hello there"


def test_a_pool_sends_the_next_turn_where_its_conversation_is_cached(
    tiny_model_dir: Path,
) -> None:
    import os
    import signal

    from modelpool import ModelPool, PoolConfig

    config = PoolConfig(
        model=str(tiny_model_dir),
        backend="hf",
        workers=2,
        devices=["cpu"],
        deadline_s=120.0,
        backend_options={"dtype": "float32", "torch_threads": 1, "prefix_cache_bytes": "64MiB"},
    )
    with ModelPool(config) as pool:
        first_worker = pool.stats().workers[0].pid
        # A long answer holds the first worker, so the conversation starts on the second;
        # the pool's old tie-break (the first idle worker) would then move it back.
        hold = pool.submit("Once upon a time", max_new_tokens=400)
        turn = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]
        one = pool.generate(turn, max_new_tokens=8)
        assert one.worker_pid != first_worker and one.cached_tokens == 0
        hold.result()
        turn += [
            {"role": "assistant", "content": one.text},
            {"role": "user", "content": "Pears?"},
        ]
        two = pool.generate(turn, max_new_tokens=8)
        assert two.worker_pid == one.worker_pid
        assert one.prompt_tokens is not None and two.cached_tokens > one.prompt_tokens
        cached = {w.pid: w.prefix_cache for w in pool.stats().workers}
        report = cached[one.worker_pid]
        assert report is not None and report.hits >= 1 and report.bytes > 0
        # A killed worker takes its cache with it; the conversation goes on elsewhere.
        assert one.worker_pid is not None
        os.kill(one.worker_pid, signal.SIGKILL)
        turn += [
            {"role": "assistant", "content": two.text},
            {"role": "user", "content": "Plums?"},
        ]
        three = pool.generate(turn, max_new_tokens=8)
        assert three.worker_pid != one.worker_pid and three.cached_tokens == 0


def test_an_adopted_prefix_is_copied_once_and_never_written_by_its_request() -> None:
    import torch

    cache = PrefixCache(1 << 20)
    ids = list(range(300, 332))
    source = torch.arange(2 * 32 * 4, dtype=torch.float32).reshape(1, 2, 32, 4)
    viewed = torch.cat([source, source], dim=2)[:, :, :32]  # a view, as of a mapped entry
    request = cache.adopt(ids, [(viewed, viewed * 2)], (7,), 0)
    (layer,) = request.layers
    # The request's tensors are a compact copy of the view, counted as the entry's bytes.
    assert layer.keys.data_ptr() != viewed.data_ptr() and torch.equal(layer.keys, source)
    assert cache.bytes == 2 * source.nbytes
    # The request's first step concatenates into new tensors: the entry is unchanged.
    keys, _ = request.update(torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4), 0)
    assert keys.shape[2] == 35
    again = cache.lookup([*ids, 1])
    assert again is not None
    (kept,) = again[0].layers
    assert torch.equal(kept.keys, source) and torch.equal(kept.values, source * 2)
