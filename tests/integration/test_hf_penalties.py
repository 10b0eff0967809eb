"""OpenAI's presence_penalty, frequency_penalty and logit_bias in the hf backend, alone
and in the batched loop, on the tiny random model (float32, greedy)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from modelpool.shared.errors import InvalidRequest
from modelpool.worker.backends.common.penalties import Penalties
from modelpool.worker.backends.hf.handler import HFHandler, load
from tests.integration.test_hf_batching import PROMPTS, Recorder, assert_same_as_alone

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux processes")


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> HFHandler:
    return load(str(tiny_model_dir), dtype="float32", torch_threads=1)


def _token_ids(handler: HFHandler, prompt: str, **params: Any) -> list[int]:
    generation = handler.generate(Recorder(prompt, {"logprobs": 0, **params}))
    assert generation.logprobs is not None
    return [entry.token_id for entry in generation.logprobs]


def test_penalties_as_openai_defines_them() -> None:
    scores = torch.zeros(6)
    # Token 1 generated three times, token 4 once: frequency x count + presence once.
    Penalties(presence=0.5, frequency=0.25, bias=((2, -100.0), (5, 3.0))).apply(
        scores, [1, 4, 1, 1]
    )
    assert scores.tolist() == [0.0, -1.25, -100.0, 0.0, -0.75, 3.0]


def test_logit_bias_bans_and_forces_a_greedy_token(tiny: HFHandler) -> None:
    first = _token_ids(tiny, PROMPTS[0], max_new_tokens=1)[0]
    banned = _token_ids(tiny, PROMPTS[0], max_new_tokens=1, logit_bias={first: -100})
    assert banned[0] != first
    forced_id = 70 if first != 70 else 71
    forced = _token_ids(tiny, PROMPTS[0], max_new_tokens=4, logit_bias={str(forced_id): 100})
    assert forced == [forced_id] * 4


def test_frequency_and_presence_penalties_change_greedy_repetition(tiny: HFHandler) -> None:
    plain = _token_ids(tiny, PROMPTS[1], max_new_tokens=24)
    assert len(set(plain)) < len(plain), "the premise: greedy decoding repeats a token"
    for name in ("frequency_penalty", "presence_penalty"):
        penalised = _token_ids(tiny, PROMPTS[1], max_new_tokens=24, **{name: 2.0})
        assert penalised != plain, name
        # Only tokens already generated are penalised: the answers part where the plain
        # one repeats a token, and the penalised one does not take it.
        step = next(i for i, (a, b) in enumerate(zip(plain, penalised, strict=True)) if a != b)
        assert plain[step] in plain[:step], name


def test_batched_equals_alone_with_penalties(tiny: HFHandler) -> None:
    first = _token_ids(tiny, PROMPTS[0], max_new_tokens=1)[0]
    assert_same_as_alone(
        tiny,
        {
            "max_new_tokens": 16,
            "presence_penalty": 0.7,
            "frequency_penalty": 1.1,
            "logit_bias": {first: -100, 65: 2.5},
        },
    )


@pytest.mark.parametrize(
    "params",
    [
        {"presence_penalty": 2.5},
        {"frequency_penalty": -2.01},
        {"logit_bias": {"x": 1}},
        {"logit_bias": {5: 101}},
        {"logit_bias": {10**9: 1}},  # outside the vocabulary: known in the worker
    ],
)
def test_out_of_range_penalties_are_refused(tiny: HFHandler, params: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequest, match=r"logit_bias|penalty"):
        tiny.generate(Recorder(PROMPTS[0], {"max_new_tokens": 2, **params}))
