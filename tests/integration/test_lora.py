"""LoRA adapters on the hf backend, in process: each adapter's greedy answers equal PEFT's
own ``generate`` with that adapter, alone and in a batch mixing adapters and the base;
``max_loras`` holds the least recently used out; a bad adapter fails its own request,
named, while the rows beside it answer; the prefix cache never gives one adapter another's
KV. The daemon's side is tests/e2e/test_lora_daemon.py.

docs/lora.md.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from helpers import Recorder, step_until_answered
from lora_adapters import broken_adapter, make_adapter, peft_answers
from modelpool.shared.errors import InvalidRequest
from modelpool.shared.lora import inspect_adapter
from modelpool.shared.protocol import Generation
from modelpool.worker.backends.hf.handler import HFHandler, load

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux processes"),
    pytest.mark.slow,
]

PROMPTS = [
    "The capital of France is",
    "1, 2, 3, 4,",
    "Once upon a time, in a land far away, there lived a dragon who",
]
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    folder = tmp_path_factory.mktemp("adapters")
    return [
        make_adapter(tiny_model_dir, folder / f"adapter-{seed}", seed=seed) for seed in range(3)
    ]


@pytest.fixture(scope="module")
def handler(tiny_model_dir: Path) -> HFHandler:
    return load(str(tiny_model_dir), dtype="float32", torch_threads=1, max_loras=2)


@pytest.fixture(scope="module")
def expected(
    tiny_model_dir: Path, handler: HFHandler, adapters: list[Path]
) -> dict[Path | None, list[str]]:
    """PEFT's answer to each prompt, by adapter (None: the base alone)."""
    ids = [[int(t) for t in handler.encode(prompt)[0].tolist()] for prompt in PROMPTS]
    answers = {}
    for adapter in [None, *adapters]:
        tokens = peft_answers(tiny_model_dir, adapter, ids, NEW_TOKENS)
        answers[adapter] = [handler.tokenizer.decode(t, skip_special_tokens=True) for t in tokens]
    return answers


def params(adapter: Path | None) -> dict[str, Any]:
    chosen: dict[str, Any] = {"max_new_tokens": NEW_TOKENS}
    if adapter is not None:
        chosen["lora"] = {"name": adapter.name, "path": str(adapter)}
    return chosen


def test_the_adapters_change_the_answers(expected: dict[Path | None, list[str]]) -> None:
    answers = [tuple(texts) for texts in expected.values()]
    assert len(set(answers)) == len(answers), "an adapter left the base's answers as they were"


def test_each_adapter_alone_answers_as_peft(
    handler: HFHandler, adapters: list[Path], expected: dict[Path | None, list[str]]
) -> None:
    for adapter in [None, *adapters]:
        for prompt, want in zip(PROMPTS, expected[adapter], strict=True):
            answer = handler.generate(Recorder(prompt, params(adapter)))
            assert answer.text == want, (adapter, prompt)


def test_a_batch_mixing_adapters_answers_as_peft(
    handler: HFHandler, adapters: list[Path], expected: dict[Path | None, list[str]]
) -> None:
    # Three adapters and the base over two places: the third waits for a place, then the
    # least recently used adapter no running row uses leaves.
    calls = [
        (Recorder(prompt, params(adapter)), adapter, index)
        for index, prompt in enumerate(PROMPTS)
        for adapter in [None, *adapters]
    ]
    for call, _, _ in calls:
        handler.admit(call)
    widest = 0
    outcomes: dict[int, Any] = {}
    while len(outcomes) < len(calls):
        for call, outcome in handler.step():
            outcomes[id(call)] = outcome
        rows = handler.scheduler.rows
        widest = max(widest, len({row.state.lora for row in rows}))
    assert widest >= 3, "no step mixed the base and two adapters"
    for call, adapter, index in calls:
        outcome = outcomes[id(call)]
        assert isinstance(outcome, Generation), outcome
        assert outcome.text == expected[adapter][index], (adapter, call.prompt)
    assert len(handler.loras.names) == 2


@pytest.mark.parametrize(
    ("fault", "why"),
    [
        ("truncated", "truncated"),
        ("corrupt", "corrupt header"),
        ("shape", "an adapter of another base"),
        ("target", "qq_proj is not a weight of the base"),
        ("rank", "the config says r = 8"),
    ],
)
def test_a_bad_adapter_fails_its_request_alone(
    handler: HFHandler,
    adapters: list[Path],
    expected: dict[Path | None, list[str]],
    tiny_model_dir: Path,
    tmp_path: Path,
    fault: str,
    why: str,
) -> None:
    bad = broken_adapter(adapters[0], tmp_path / f"bad-{fault}", fault)
    with pytest.raises(InvalidRequest, match=why):
        inspect_adapter(bad.name, str(bad), str(tiny_model_dir))
    good = Recorder(PROMPTS[0], params(adapters[1]))
    base = Recorder(PROMPTS[1], params(None))
    handler.admit(good)
    handler.admit(base)
    with pytest.raises(InvalidRequest, match=f"LoRA adapter 'bad-{fault}'"):
        handler.admit(Recorder(PROMPTS[2], params(bad)))
    outcomes = step_until_answered(handler, 2)
    assert outcomes[id(good)].text == expected[adapters[1]][0]
    assert outcomes[id(base)].text == expected[None][1]


def test_the_prefix_cache_never_shares_kv_between_adapters(
    handler: HFHandler, adapters: list[Path]
) -> None:
    assert handler.prefix_cache is not None
    prompt = "A prompt no other test sends, long enough for the prefix cache to keep it whole."

    def cached_tokens(adapter: Path | None) -> int:
        call = Recorder(prompt, params(adapter))
        handler.admit(call)
        step_until_answered(handler, 1)
        assert call.prompt_counts is not None
        return call.prompt_counts[1]

    assert cached_tokens(None) == 0
    assert cached_tokens(None) > 0, "the base's second request found nothing cached"
    assert cached_tokens(adapters[2]) == 0, "an adapter read the base's KV"
    assert cached_tokens(adapters[2]) > 0, "the adapter's second request found nothing cached"
    assert cached_tokens(adapters[1]) == 0, "an adapter read another adapter's KV"


def test_a_pool_prefers_the_worker_that_served_the_adapter(
    tiny_model_dir: Path, adapters: list[Path], expected: dict[Path | None, list[str]]
) -> None:
    from modelpool import ModelPool, PoolConfig

    config = PoolConfig(
        model=str(tiny_model_dir),
        backend="hf",
        workers=2,
        devices=["cpu"],
        max_batch_size=4,
        deadline_s=120.0,
        backend_options={"dtype": "float32", "torch_threads": 1, "max_loras": 2},
    )
    with ModelPool(config) as pool:
        # Sent together, the two first requests spread over the two idle workers.
        firsts = {adapter: pool.submit(PROMPTS[2], **params(adapter)) for adapter in adapters[:2]}
        homes = {}
        for adapter, future in firsts.items():
            first = future.result()
            assert first.text == expected[adapter][2]
            homes[adapter] = first.worker_pid
        assert len(set(homes.values())) == 2, "both adapters' first requests went to one worker"
        for _ in range(3):
            for index, adapter in enumerate(adapters[:2]):
                # A short prompt: only the adapter's own unit of the chain can match.
                again = pool.generate("Hi", **params(adapter))
                assert again.worker_pid == homes[adapter], (index, homes)
