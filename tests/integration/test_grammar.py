"""Constrained decoding in the worker (modelpool.shared.grammar): a tiny random model, whose free
text is gibberish, writes schema-valid JSON under a grammar, alone and in a batch beside
unconstrained rows; a compilation past its bound fails its request typed and leaves the
worker warm and its batch decoding; a compilation that crashes or wedges the worker is a
crash like any other (poison isolation, collateral retries)."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from helpers import Recorder, counters, open_pool, step_until_answered, workers
from modelpool import ModelPool, PoisonRequest, PoolConfig
from modelpool.shared.errors import GrammarCompileTimeout, GrammarError
from modelpool.shared.protocol import Generation
from modelpool.shared.structured import grammar_for_body, grammar_for_response_format
from modelpool.worker.backends.hf.handler import HFHandler, load

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux processes")

# Every string is bounded: a random model would otherwise write one until max_new_tokens.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "size": {"enum": ["small", "large"]},
        "tags": {
            "type": "array",
            "items": {"type": "string", "maxLength": 4},
            "maxItems": 2,
        },
        "note": {"type": "string", "maxLength": 6},
    },
    "required": ["ok", "size", "tags", "note"],
    "additionalProperties": False,
}
GRAMMAR = grammar_for_response_format(SCHEMA)


@pytest.fixture(scope="module")
def handler(tiny_model_dir: Path) -> HFHandler:
    return load(str(tiny_model_dir), dtype="float32")


def run_batch(handler: HFHandler, calls: list[Recorder]) -> dict[int, Generation | Exception]:
    for call in calls:
        handler.admit(call)
    outcomes: dict[int, Generation | Exception] = step_until_answered(handler, len(calls))
    return outcomes


def assert_valid(generation: Generation | Exception) -> Any:
    assert isinstance(generation, Generation), generation
    assert generation.finish_reason == "stop", generation
    value = json.loads(generation.text)
    jsonschema.validate(value, SCHEMA)
    return value


def test_a_random_model_writes_schema_valid_json_alone_and_in_a_batch(
    handler: HFHandler,
) -> None:
    params = {"max_new_tokens": 80, "grammar": GRAMMAR}
    alone = handler.generate(Recorder("Describe a cat", dict(params)))
    assert_valid(alone)
    sampled = handler.generate(
        Recorder("Describe a cat", {**params, "temperature": 1.2, "seed": 1})
    )
    assert_valid(sampled)

    calls = [
        Recorder("Describe a cat", dict(params)),
        Recorder("Describe a cat", {"max_new_tokens": 40}),
        Recorder(
            "Another prompt, longer than the first", {**params, "temperature": 1.5, "seed": 7}
        ),
        Recorder("x", {**params, "repetition_penalty": 1.3}),
    ]
    outcomes = run_batch(handler, calls)
    for index in (0, 2, 3):
        assert_valid(outcomes[id(calls[index])])
    # Greedy in a batch, in float32: the tokens it gets alone.
    first = outcomes[id(calls[0])]
    assert isinstance(first, Generation) and first.text == alone.text
    # The unconstrained row is the model's gibberish, not JSON.
    free = outcomes[id(calls[1])]
    assert isinstance(free, Generation) and free.finish_reason == "length"
    with pytest.raises(ValueError):
        json.loads(free.text)
    # Streamed chunks are the text; one compilation served every request (cached by text).
    assert "".join(calls[0].chunks) == first.text
    assert handler.grammars.compiler.compilations == 1


def test_regex_and_choice_end_when_the_grammar_is_complete(handler: HFHandler) -> None:
    regex = grammar_for_body({"structured_outputs": {"regex": "[a-c]{3}-[0-9]{2}"}})
    choice = grammar_for_body({"guided_choice": ["alpha", "beta"]})
    calls = [
        Recorder("code:", {"max_new_tokens": 50, "grammar": regex}),
        Recorder("pick", {"max_new_tokens": 50, "grammar": choice}),
    ]
    outcomes = run_batch(handler, calls)
    by_regex, by_choice = (outcomes[id(call)] for call in calls)
    assert isinstance(by_regex, Generation) and isinstance(by_choice, Generation)
    assert re.fullmatch("[a-c]{3}-[0-9]{2}", by_regex.text), by_regex.text
    assert by_regex.finish_reason == "stop" and by_regex.completion_tokens is not None
    assert by_regex.completion_tokens <= 6
    assert by_choice.text in ("alpha", "beta") and by_choice.finish_reason == "stop"


def test_a_grammar_the_engine_refuses_fails_its_row_alone(handler: HFHandler) -> None:
    broken = Recorder("x", {"max_new_tokens": 5, "grammar": "start: undefined_rule"})
    fine = Recorder("x", {"max_new_tokens": 5})
    outcomes = run_batch(handler, [broken, fine])
    assert isinstance(outcomes[id(broken)], GrammarError)
    assert isinstance(outcomes[id(fine)], Generation)


# ---- the pool: bounds, crashes and wedges (testing backend) ---------------------------------


@pytest.fixture(scope="module", params=[1, 4], ids=["solo", "batched"])
def pool(request: pytest.FixtureRequest) -> Iterator[ModelPool]:
    with open_pool(
        workers=1, max_batch_size=request.param, grammar_compile_timeout_s=0.3, deadline_s=30
    ) as started:
        yield started


def test_a_compilation_past_its_bound_fails_typed_and_the_worker_stays_warm(
    pool: ModelPool,
) -> None:
    pid = pool.generate("pid").text
    with pytest.raises(GrammarCompileTimeout) as caught:
        pool.generate("echo:x", grammar='start: "compile_hang"')
    assert caught.value.bound_s == 0.3
    assert "grammar_compile_timeout_s" in str(caught.value)
    # Beside it, an ordinary request and a slow but honest compilation both finish.
    hanging = pool.submit("tokens:5:0.02", grammar='start: "compile_hang" | "again"')
    beside = pool.submit("tokens:5:0.02")
    slow = pool.submit("echo:compiled", grammar='start: "compile_sleep:0.1"')
    assert beside.result(timeout=20).text == "t0 t1 t2 t3 t4 "
    assert slow.result(timeout=20).text == "compiled"
    with pytest.raises(GrammarCompileTimeout):
        hanging.result(timeout=20)
    with pytest.raises(GrammarError, match="rehearsed"):
        pool.generate("echo:x", grammar='start: "compile_error"')
    assert pool.generate("pid").text == pid, "the same warm worker"
    assert counters(pool)["kills"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("culprit", ["compile_segfault", "compile_wedge"])
def test_a_compilation_that_kills_or_wedges_its_worker_is_isolated_as_poison(
    culprit: str,
) -> None:
    config: dict[str, Any] = {"stall_timeout_s": 0.5} if culprit == "compile_wedge" else {}
    with open_pool(workers=1, spares=1, max_batch_size=4, deadline_s=60, **config) as pool:
        innocents = [pool.submit("tokens:60:0.01") for _ in range(2)]
        innocents.append(pool.submit("echo:fine", grammar='start: "fine"'))
        poison = pool.submit("echo:x", grammar=f'start: "{culprit}"')
        with pytest.raises(PoisonRequest):
            poison.result(timeout=45)
        assert [future.result(timeout=30).text for future in innocents] == [
            "".join(f"t{index} " for index in range(60)),
            "".join(f"t{index} " for index in range(60)),
            "fine",
        ]
        snapshot = counters(pool)
        assert snapshot["poison_requests"] == 1
        assert snapshot["collateral_retries"] >= 3, "the batch-mates were retried"
        assert snapshot["failed"] == 1 and snapshot["completed"] == 3
        assert all(w.state != "failed" for w in workers(pool))


def test_the_pool_refuses_an_unhonourable_schema_before_dispatch() -> None:
    config = PoolConfig(model="none", backend="testing", workers=1)
    pool = ModelPool(config)  # never started: the refusal comes first
    with pytest.raises(GrammarError) as caught:
        pool.submit(
            "echo:x",
            response_format={"type": "object", "properties": {"a": {"uniqueItems": True}}},
        )
    assert caught.value.param == "response_format.properties.a.uniqueItems"
