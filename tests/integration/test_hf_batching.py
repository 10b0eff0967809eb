"""The hf backend's batched form (the shared scheduler over hf.runner.HFRunner) against
real models.

The rule it holds: greedy decoding of a prompt inside a batch, admitted at any step,
gives the same tokens as the same prompt alone through ``HFHandler.generate``, in
float32. Checked on a tiny random model (behaviour) and on the embedded SmolLM2
(output), then through a real pool of worker processes.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from helpers import Recorder, step_until_answered
from modelpool import ModelPool, PoolConfig
from modelpool.shared.errors import ContextLengthExceeded
from modelpool.shared.protocol import Generation, Prompt
from modelpool.worker.backends.hf.handler import HFHandler, load

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux processes")

PROMPTS: list[Prompt] = [
    "The capital of France is",
    "1, 2, 3, 4,",
    "Once upon a time, in a land far away, there lived a dragon who",
    "Hi",
]


def run_batched(
    handler: HFHandler, calls: Sequence[Recorder], admit_every: int = 2
) -> tuple[dict[int, Generation], int]:
    """Admit two calls, then one more every ``admit_every`` steps; step until all end.
    Returns each call's Generation and the largest number of rows seen at once."""
    pending = list(calls)
    results: dict[int, Generation] = {}
    for call in pending[:2]:
        handler.admit(call)
    pending = pending[2:]
    steps = widest = 0
    while len(results) < len(calls):
        if pending and steps % admit_every == admit_every - 1:
            handler.admit(pending.pop(0))
        for call, outcome in handler.step():
            assert isinstance(outcome, Generation), outcome
            results[id(call)] = outcome
        widest = max(widest, len(handler.scheduler.rows))
        steps += 1
        assert steps < 10_000
    return results, widest


def assert_same_as_alone(
    handler: HFHandler, params: dict[str, Any], prompts: Sequence[Prompt] = PROMPTS
) -> None:
    alone = [handler.generate(Recorder(prompt, dict(params))) for prompt in prompts]
    calls = [Recorder(prompt, dict(params)) for prompt in prompts]
    batched, widest = run_batched(handler, calls)
    assert widest >= 3, "the requests were not batched"
    for call, solo in zip(calls, alone, strict=True):
        together = batched[id(call)]
        assert together.text == solo.text, (call.prompt, solo.text, together.text)
        assert together.finish_reason == solo.finish_reason
        assert together.completion_tokens == solo.completion_tokens
        assert together.prompt_tokens == solo.prompt_tokens
        assert "".join(call.chunks) == together.text
        assert call.tokens == together.completion_tokens


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> HFHandler:
    return load(str(tiny_model_dir), dtype="float32", torch_threads=1)


def test_batched_greedy_equals_alone_on_a_tiny_model(tiny: HFHandler) -> None:
    assert_same_as_alone(tiny, {"max_new_tokens": 24})


@pytest.mark.slow
def test_batched_greedy_equals_alone_on_smollm2() -> None:
    from modelpool.shared.embedded import prepare_model

    smollm = load(str(prepare_model(progress=False)), dtype="float32", torch_threads=2)
    chat: Prompt = [{"role": "user", "content": "What is the capital of France?"}]
    assert_same_as_alone(smollm, {"max_new_tokens": 10}, [*PROMPTS[:3], chat])


def test_per_request_parameters_in_one_batch(tiny: HFHandler) -> None:
    reference = tiny.generate(Recorder(PROMPTS[0], {"max_new_tokens": 24}))
    stop = reference.text[6:9]
    assert stop and stop in reference.text
    stopped_alone = tiny.generate(Recorder(PROMPTS[0], {"max_new_tokens": 24, "stop": [stop]}))
    sampled = {"max_new_tokens": 16, "temperature": 0.9, "top_p": 0.9, "top_k": 20, "seed": 7}
    calls = [
        Recorder(PROMPTS[0], {"max_new_tokens": 24, "stop": [stop]}),
        Recorder(PROMPTS[1], {"max_new_tokens": 3}),
        Recorder(PROMPTS[2], dict(sampled)),
        Recorder(PROMPTS[3], {"max_new_tokens": 24, "repetition_penalty": 1.3}),
    ]
    results, _ = run_batched(tiny, calls)
    stopped, short, seeded, penalised = (results[id(call)] for call in calls)
    assert stopped.text == stopped_alone.text and stopped.finish_reason == "stop"
    assert stopped.stop_sequence == stopped_alone.stop_sequence == stop
    assert short.stop_sequence is None
    assert stop not in stopped.text
    assert short.finish_reason == "length" and short.completion_tokens == 3
    assert penalised.completion_tokens is not None and penalised.completion_tokens > 0
    # A seed gives the same sample whatever else is in the batch.
    again, _ = run_batched(
        tiny, [Recorder(PROMPTS[1], {"max_new_tokens": 5}), Recorder(PROMPTS[2], dict(sampled))]
    )
    assert seeded.text in [g.text for g in again.values()]


def test_batched_top_k_equals_alone(tiny: HFHandler) -> None:
    seeded = {"max_new_tokens": 12, "temperature": 1.5, "seed": 3}
    assert_same_as_alone(tiny, {**seeded, "top_k": 5})
    # top_k 1 leaves only the greedy token, batched as alone.
    greedy = [tiny.generate(Recorder(prompt, {"max_new_tokens": 12})) for prompt in PROMPTS]
    calls = [Recorder(prompt, {**seeded, "top_k": 1}) for prompt in PROMPTS]
    batched, _ = run_batched(tiny, calls)
    assert [batched[id(call)].text for call in calls] == [g.text for g in greedy]


def test_kv_cache_bound_limits_the_batch_not_the_answers(tiny_model_dir: Path) -> None:
    bounded = load(str(tiny_model_dir), dtype="float32", torch_threads=1, kv_cache_tokens=120)
    params = {"max_new_tokens": 30}
    alone = [bounded.generate(Recorder(prompt, dict(params))) for prompt in PROMPTS]
    calls = [Recorder(prompt, dict(params)) for prompt in PROMPTS]
    for call in calls:
        bounded.admit(call)
    results: dict[int, Generation] = {}
    while len(results) < len(calls):
        for call, outcome in bounded.step():
            assert isinstance(outcome, Generation)
            results[id(call)] = outcome
        if len(bounded.scheduler.rows) > 1:
            assert bounded.runner.cache_tokens <= 120
        assert len(bounded.scheduler.rows) < len(calls), "the bound let every request in"
    for call, solo in zip(calls, alone, strict=True):
        assert results[id(call)].text == solo.text


def test_retire_leaves_the_others_unchanged(tiny: HFHandler) -> None:
    params = {"max_new_tokens": 20}
    alone = [tiny.generate(Recorder(prompt, dict(params))) for prompt in PROMPTS[:3]]
    calls = [Recorder(prompt, dict(params)) for prompt in PROMPTS[:3]]
    for call in calls:
        tiny.admit(call)
    for _ in range(4):
        assert tiny.step() == []
    dropped = tiny.retire(calls[1])
    assert dropped.finish_reason == "cancelled"
    assert dropped.text == "".join(calls[1].chunks)
    results: dict[int, Generation] = {}
    while len(results) < 2:
        for call, outcome in tiny.step():
            assert isinstance(outcome, Generation)
            results[id(call)] = outcome
    assert results[id(calls[0])].text == alone[0].text
    assert results[id(calls[2])].text == alone[2].text


def test_pool_of_batching_hf_workers_answers_like_one_at_a_time(tiny_model_dir: Path) -> None:
    options = {"dtype": "float32", "torch_threads": 1}
    common = {
        "model": str(tiny_model_dir),
        "backend": "hf",
        "backend_options": options,
        "devices": ("cpu",),
    }
    expected = [
        load(str(tiny_model_dir), **options).generate(Recorder(p, {"max_new_tokens": 16})).text
        for p in PROMPTS
    ]
    with ModelPool(PoolConfig(**common, workers=1, max_batch_size=4, deadline_s=120)) as pool:
        futures = [pool.submit(prompt, max_new_tokens=16) for prompt in PROMPTS]
        texts = [future.result(timeout=120).text for future in futures]
        long = pool.submit(PROMPTS[2], max_new_tokens=60)
        short = pool.submit(PROMPTS[3], max_new_tokens=2)
        assert short.result(timeout=60).completion_tokens == 2
        assert not long.done(), "the short request waited for the long one"
        assert long.result(timeout=120).completion_tokens == 60
        assert pool.stats().workers[0].slots == 4
        # A cancel in a full batch: that request stops, the others keep their text.
        streams = [
            pool.stream(prompt, max_new_tokens=400 if index == 1 else 16)
            for index, prompt in enumerate(PROMPTS)
        ]
        next(iter(streams[1]))
        pool.cancel(streams[1].request_id)
        others = ["".join(stream) for index, stream in enumerate(streams) if index != 1]
        for _ in streams[1]:
            pass
        assert streams[1].result is not None
        assert streams[1].result.finish_reason == "cancelled"
    assert texts == expected
    assert others == [text for index, text in enumerate(expected) if index != 1]


def test_a_batched_request_past_the_context_is_refused_alone(tiny_model_dir: Path) -> None:
    options = {"dtype": "float32", "torch_threads": 1, "max_model_len": 48}
    config = PoolConfig(
        model=str(tiny_model_dir),
        backend="hf",
        backend_options=options,
        workers=1,
        max_batch_size=4,
        deadline_s=120,
        devices=("cpu",),
    )
    with ModelPool(config) as pool:
        short = pool.submit(PROMPTS[0], max_new_tokens=8)
        long = pool.submit("word " * 200, max_new_tokens=8)
        with pytest.raises(ContextLengthExceeded):
            long.result(timeout=60)
        assert short.result(timeout=60).completion_tokens == 8
        assert pool.stats().counters["kills"] == 0


# ---- chunked prefill, row isolation, generation_config (issue 26) -------------------------

LONG_PROMPT = " ".join(f"word{index}" for index in range(60))


def test_a_long_prompt_is_prefilled_in_slices_while_the_batch_keeps_decoding(
    tiny_model_dir: Path,
) -> None:
    handler = load(str(tiny_model_dir), dtype="float32", torch_threads=1, prefill_chunk_tokens=8)
    long_ids = handler.encode(LONG_PROMPT)[0].tolist()
    assert len(long_ids) > 4 * 8, "the premise: the prompt needs several slices"
    running = Recorder(PROMPTS[0], {"max_new_tokens": 64})
    handler.admit(running)
    handler.step()
    assert running.tokens == 2, "prefilled, merged and one decoding step"
    long = Recorder(LONG_PROMPT, {"max_new_tokens": 8})
    handler.admit(long)
    passes = count_passes(handler)
    slices = 0
    while not long.tokens:
        before = running.tokens
        handler.step()
        slices += 1
        assert running.tokens == before + 1, "a running row gets a token at every slice"
        assert long.prefilled_tokens == min(8 * slices, len(long_ids))
        assert passes() == slices, "each slice rides on the decoding step's pass"
    assert slices == -(-len(long_ids) // 8)
    results: dict[int, Generation] = {}
    while len(results) < 2:
        for call, outcome in handler.step():
            assert isinstance(outcome, Generation), outcome
            results[id(call)] = outcome
    alone = handler.generate(Recorder(LONG_PROMPT, {"max_new_tokens": 8}))
    assert results[id(long)].text == alone.text, "a sliced prefill decodes as one read whole"
    assert (
        results[id(running)].text
        == handler.generate(Recorder(PROMPTS[0], {"max_new_tokens": 64})).text
    )


def count_passes(handler: HFHandler) -> Callable[[], int]:
    """Count the model's forward passes from now on (the handler's model is wrapped)."""
    model = handler.model
    original = model.forward
    calls: list[dict[str, Any]] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return original(*args, **kwargs)

    model.forward = counted
    return lambda: len(calls)


def test_a_failed_packed_pass_is_undone_and_read_apart(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from modelpool.worker.backends.hf import runner as runner_module

    handler = load(str(tiny_model_dir), dtype="float32", torch_threads=1, prefill_chunk_tokens=8)
    running = Recorder(PROMPTS[2], {"max_new_tokens": 24})
    long = Recorder(LONG_PROMPT, {"max_new_tokens": 8})
    handler.admit(running)
    handler.step()
    handler.admit(long)
    model = handler.model
    original = model.forward
    packed_forward = runner_module.packed_forward
    failed: list[int] = []
    fused: list[bool] = [False]

    def noting_fused_passes(model: Any, cache: Any, *args: Any, **kwargs: Any) -> Any:
        # A packed pass with running rows and a slice on it (not a slice read apart).
        fused[0] = len(cache) > 0 and bool(kwargs.get("slice_ids"))
        try:
            return packed_forward(model, cache, *args, **kwargs)
        finally:
            fused[0] = False

    def fused_pass_fails_every_other_time(*args: Any, **kwargs: Any) -> Any:
        # It fails after some layers have written to the rows' and the slice's buffers.
        if not fused[0]:
            return original(*args, **kwargs)
        if len(failed) % 2 == 0:
            failed.append(1)
            layers = model.model.layers
            layer_forward = layers[-1].forward

            def broken(*layer_args: Any, **layer_kwargs: Any) -> Any:
                raise RuntimeError("out of memory in the last layer")

            layers[-1].forward = broken
            try:
                return original(*args, **kwargs)
            finally:
                layers[-1].forward = layer_forward
        failed.append(0)
        return original(*args, **kwargs)

    monkeypatch.setattr(runner_module, "packed_forward", noting_fused_passes)
    model.forward = fused_pass_fails_every_other_time
    results: dict[int, Generation] = {}
    try:
        while len(results) < 2:
            for call, outcome in handler.step():
                assert isinstance(outcome, Generation), outcome
                results[id(call)] = outcome
    finally:
        model.forward = original
    assert failed.count(1) >= 2 and failed.count(0) >= 1, "the premise: some packed passes failed"
    for call in (running, long):
        alone = handler.generate(Recorder(call.prompt, dict(call.params)))
        assert results[id(call)].text == alone.text, call.prompt


def test_a_prompt_whose_buffers_cannot_be_made_fails_alone(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from modelpool.worker.backends.hf.packed import RowKV

    handler = load(str(tiny_model_dir), dtype="float32", torch_threads=1, prefill_chunk_tokens=8)
    running = Recorder(PROMPTS[2], {"max_new_tokens": 16})
    handler.admit(running)
    handler.step()

    def out_of_memory(*args: Any, **kwargs: Any) -> RowKV:
        raise RuntimeError("out of memory (simulated) making a prompt's buffers")

    # Made before the pass that carries the slice beside the running row: an error there
    # (a prefix cache hit copies its columns in) is the long request's, not the batch's.
    monkeypatch.setattr(RowKV, "for_prompt", out_of_memory)
    long = Recorder(LONG_PROMPT, {"max_new_tokens": 8})
    handler.admit(long)
    outcomes = step_until_answered(handler, 2, steps=64)
    assert isinstance(outcomes[id(long)], RuntimeError), outcomes
    finished = outcomes[id(running)]
    assert isinstance(finished, Generation) and finished.completion_tokens == 16, finished


def test_a_request_cancelled_during_its_prefill_leaves_at_once(tiny_model_dir: Path) -> None:
    handler = load(str(tiny_model_dir), dtype="float32", torch_threads=1, prefill_chunk_tokens=8)
    long = Recorder(LONG_PROMPT, {"max_new_tokens": 8})
    handler.admit(long)
    handler.step()
    assert 0 < long.prefilled_tokens < len(handler.encode(LONG_PROMPT)[0])
    retired = handler.retire(long)
    assert retired.finish_reason == "cancelled" and retired.text == ""
    assert handler.step() == [] and handler.room()[0] == handler.scheduler.kv_tokens


def test_a_prefill_that_raises_fails_its_own_request_alone(tmp_path: Path) -> None:
    from modelpool.tinymodel import build_tiny_model

    # Learned positions: a prompt past the model's 64 positions fails in its prefill (an
    # IndexError, as an out-of-memory on a long prompt would on a GPU). max_model_len lets
    # it through to the backend.
    directory = build_tiny_model(tmp_path / "gpt2", arch="gpt2", context_length=64)
    handler = load(str(directory), dtype="float32", torch_threads=1, max_model_len=4096)
    innocents = [
        Recorder(PROMPTS[0], {"max_new_tokens": 8}),
        Recorder(PROMPTS[1], {"max_new_tokens": 8}),
    ]
    culprit = Recorder(" ".join(["word"] * 100), {"max_new_tokens": 8})
    for call in [innocents[0], culprit, innocents[1]]:
        handler.admit(call)
    outcomes = step_until_answered(handler, 3, steps=64)
    assert isinstance(outcomes[id(culprit)], Exception)
    for call in innocents:
        result = outcomes[id(call)]
        assert isinstance(result, Generation) and result.completion_tokens == 8, result


def test_a_failed_decoding_pass_loses_its_rows_and_keeps_the_waiting_ones(
    tiny_model_dir: Path,
) -> None:
    from modelpool.shared.protocol import RowsLost

    handler = load(str(tiny_model_dir), dtype="float32", torch_threads=1, kv_cache_tokens=64)
    running = Recorder(PROMPTS[2], {"max_new_tokens": 40})
    handler.admit(running)
    handler.step()
    waiting = Recorder(PROMPTS[0], {"max_new_tokens": 40})
    handler.admit(waiting)
    handler.step()
    waiting_calls = handler.room()[1]
    assert waiting_calls == [waiting], "the premise: it waits for KV room"
    model = handler.model
    original = model.forward

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the decoding pass failed")

    model.forward = broken
    try:
        with pytest.raises(RowsLost) as caught:
            handler.step()
    finally:
        model.forward = original
    assert caught.value.calls == [running]
    assert handler.room()[1] == [waiting], "the waiting request was not touched"
    results = []
    while not results:
        results = handler.step()
    assert results[0][0] is waiting and isinstance(results[0][1], Generation)


def test_the_models_generation_config_applies_in_the_batch(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    import json
    import shutil

    directory = tmp_path / "penalised"
    shutil.copytree(tiny_model_dir, directory)
    config_path = directory / "generation_config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    config.update({"repetition_penalty": 1.3, "no_repeat_ngram_size": 2})
    config_path.write_text(json.dumps(config))
    handler = load(str(directory), dtype="float32", torch_threads=1)
    assert handler.batched
    assert_same_as_alone(handler, {"max_new_tokens": 30})
    plain = [
        handler.generate(
            Recorder(
                p, {"max_new_tokens": 30, "repetition_penalty": 1.0, "no_repeat_ngram_size": 0}
            )
        )
        for p in PROMPTS
    ]
    penalised = [handler.generate(Recorder(p, {"max_new_tokens": 30})) for p in PROMPTS]
    assert [g.text for g in plain] != [g.text for g in penalised], (
        "the premise: the config changes the text"
    )

    config.update({"suppress_tokens": [5]})
    config_path.write_text(json.dumps(config))
    assert not load(str(directory), dtype="float32", torch_threads=1).batched, (
        "a processor the loop does not apply: one request at a time, never different text"
    )


@pytest.mark.slow
def test_a_short_request_never_waits_for_kv_room_behind_a_long_one(tiny_model_dir: Path) -> None:
    from helpers import submit_with_chunks

    # The review's reproduction: two workers, a KV bound a long generation nearly fills.
    # Placed beside it, a short request would wait in that worker for all of it.
    config = PoolConfig(
        model=str(tiny_model_dir),
        backend="hf",
        backend_options={"dtype": "float32", "torch_threads": 1, "kv_cache_tokens": 250},
        workers=2,
        max_batch_size=4,
        devices=("cpu",),
        deadline_s=120,
    )
    with ModelPool(config) as pool:
        long, decoding, _ = submit_with_chunks(
            pool, PROMPTS[0], max_new_tokens=230, min_new_tokens=230
        )
        assert decoding.wait(60)  # its worker's KV room is nearly gone now
        shorts = [pool.submit(PROMPTS[3], max_new_tokens=5) for _ in range(3)]
        for future in shorts:
            assert future.result(timeout=60).completion_tokens == 5
        assert not long.done(), "a short request waited for the long generation"
        assert long.result(timeout=60).completion_tokens == 230
        assert all(not w.waiting_for_room for w in pool.stats().workers)


def step_to_the_end(
    handler: HFHandler, count: int, check: Callable[[list[Any]], None]
) -> dict[int, Generation]:
    """Step until ``count`` calls have ended; ``check`` sees the running rows after each
    step that has more than one."""
    results: dict[int, Generation] = {}
    while len(results) < count:
        for call, outcome in handler.step():
            assert isinstance(outcome, Generation), outcome
            results[id(call)] = outcome
        if len(handler.runner.batch) > 1:
            check(handler.runner.batch)
    return results


def test_rows_of_different_lengths_each_hold_only_their_own_columns(
    tiny_model_dir: Path,
) -> None:
    from modelpool.worker.backends.hf.packed import GATHER_COLUMNS

    handler = load(str(tiny_model_dir), dtype="float32", torch_threads=1)
    longer = " ".join(f"word{index}" for index in range(120))
    assert len(handler.encode(longer)[0]) > GATHER_COLUMNS, "the premise: a row attends alone"
    prompts: list[Prompt] = [longer, *PROMPTS]
    params = {"max_new_tokens": 12, "min_new_tokens": 12}
    alone = [handler.generate(Recorder(prompt, dict(params))) for prompt in prompts]
    calls = [Recorder(prompt, dict(params)) for prompt in prompts]
    for call in calls:
        handler.admit(call)
    compared = 0

    def holds_each_rows_own_tokens(rows: list[Any]) -> None:
        nonlocal compared
        held = [len(row.prompt_ids) + row.generated - 1 for row in rows]
        # Each row's own tokens, not rows x the longest as a padded cache would hold.
        assert handler.runner.cache_tokens == sum(held) < len(rows) * max(held)
        compared += 1

    results = step_to_the_end(handler, len(calls), holds_each_rows_own_tokens)
    assert compared, "the premise: rows of different lengths ran together"
    for call, solo in zip(calls, alone, strict=True):
        assert results[id(call)].text == solo.text, call.prompt


def test_a_model_that_cannot_run_packed_passes_moves_to_one_padded_cache(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from modelpool.worker.backends.hf import packed

    handler = load(str(tiny_model_dir), dtype="float32", torch_threads=1, prefill_chunk_tokens=8)
    params = {"max_new_tokens": 16}
    prompts: list[Prompt] = [PROMPTS[0], PROMPTS[2], LONG_PROMPT]
    alone = [handler.generate(Recorder(prompt, dict(params))) for prompt in prompts]
    calls = [Recorder(prompt, dict(params)) for prompt in prompts]
    handler.admit(calls[0])
    handler.admit(calls[1])
    handler.step()
    handler.step()
    assert handler.runner.slices_ride_on_decode and len(handler.runner.batch) == 2
    # As a model whose layers do not all dispatch to the packed attention: a pass notices
    # only once it has run (and written to the rows' buffers).
    layers = packed._layer_count(handler.model.config)
    monkeypatch.setattr(packed, "_layer_count", lambda config: layers + 1)
    handler.admit(calls[2])

    def holds_one_padded_cache(rows: list[Any]) -> None:
        widest = max(len(row.prompt_ids) + row.generated - 1 for row in rows)
        assert handler.runner.cache_tokens == len(rows) * widest, "one padded cache"

    results = step_to_the_end(handler, len(calls), holds_one_padded_cache)
    assert not handler.runner.slices_ride_on_decode
    for call, solo in zip(calls, alone, strict=True):
        assert results[id(call)].text == solo.text, call.prompt
