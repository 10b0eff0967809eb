"""The llama_cpp backend's loop and placement, on a scripted fake llama.cpp (no
llama-cpp-python needed): one decode per step over every row, chunked prefill, whole
characters streamed, sequences freed, a failed decode over several rows lost together,
and where the layers go for each device."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from helpers import Recorder
from modelpool.shared.context import fit_to_context
from modelpool.shared.protocol import Call, Generation, Prompt, RowsLost, TokenIds
from modelpool.worker.backends.common.sampling import Sampling
from modelpool.worker.backends.common.scheduler import Scheduler
from modelpool.worker.backends.llama_cpp.options import BackendUnavailable, Placement, placement
from modelpool.worker.backends.llama_cpp.runner import LlamaRow, LlamaRunner
from modelpool.worker.backends.llama_cpp.sampling import choose_token

END = 7
# Token -> bytes. 1 and 2 are the two halves of "€" (e2 82 | ac).
PIECES = {0: b"", 1: b"\xe2\x82", 2: b"\xac", 3: b"a", 4: b"b", 5: b" ", 6: b"x", END: b""}
VOCAB = len(PIECES)


@dataclass
class FakeRuntime:
    """Each sequence answers a script chosen by its prompt's first token."""

    scripts: dict[int, list[int]]
    decode_code: int = 0
    batches: list[list[tuple[int, int, int, bool]]] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    copies: list[tuple[int, int, int]] = field(default_factory=list)
    trims: list[tuple[int, int]] = field(default_factory=list)
    end_ids: Any = field(default_factory=lambda: np.array([END], dtype=np.int64))
    end_id_set: frozenset[int] = frozenset({END})
    n_vocab: int = 64
    _first: dict[int, int] = field(default_factory=dict)
    _said: dict[int, int] = field(default_factory=dict)

    def decode(
        self, tokens: list[int], positions: list[int], seq_ids: list[int], outputs: list[bool]
    ) -> int:
        self.batches.append(list(zip(tokens, positions, seq_ids, outputs, strict=True)))
        for token, position, seq_id in zip(tokens, positions, seq_ids, strict=True):
            if position == 0:
                self._first[seq_id] = token
                self._said[seq_id] = 0
        return self.decode_code

    def logits(self, index: int) -> Any:
        _, _, seq_id, _ = self.batches[-1][index]
        script = self.scripts[self._first[seq_id]]
        token = script[min(self._said[seq_id], len(script) - 1)]
        self._said[seq_id] += 1
        values = np.zeros(VOCAB, dtype=np.float32)
        values[token] = 10.0
        return values

    def remove_sequence(self, seq_id: int) -> None:
        self.removed.append(seq_id)

    def copy_prefix(self, source: int, target: int, length: int) -> None:
        self.copies.append((source, target, length))
        self._first[target] = self._first[source]
        self._said[target] = 0

    def trim_sequence(self, seq_id: int, length: int) -> None:
        self.trims.append((seq_id, length))
        self._said[seq_id] = 0

    def clear(self) -> None:
        self.removed.append(-1)

    def token_text(self, token_id: int) -> str:
        return PIECES[token_id].decode("utf-8", errors="replace")

    def decoder(self) -> Decoder:
        return Decoder(self)

    def decode_text(self, ids: list[int]) -> str:
        return b"".join(PIECES[i] for i in ids).decode("utf-8", errors="replace")


class Decoder:
    def __init__(self, runtime: FakeRuntime) -> None:
        self.runtime = runtime

    def decode(self, ids: list[int], **_: Any) -> str:
        return self.runtime.decode_text(ids)


class Encoder:
    max_model_len = 64

    def encode(
        self,
        prompt: Prompt,
        tools: list[dict[str, Any]] | None = None,
        *,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        assert isinstance(prompt, TokenIds)
        return list(prompt.ids)

    def fit_new_tokens(self, call: Call, params: dict[str, Any], prompt_tokens: int) -> int:
        return fit_to_context(
            prompt_tokens, params.get("max_new_tokens"), self.max_model_len, default=16
        )

    def grammars(self) -> Any:
        raise AssertionError("no grammar in these tests")


def engine_for(runtime: FakeRuntime, **options: Any) -> Scheduler[LlamaRow]:
    """The shared scheduler over a llama runner of ``runtime``, as the handler builds it."""
    settings = {"kv_cells": 64, "max_sequences": 4, "prefill_chunk_tokens": 512, **options}
    chunk = settings.pop("prefill_chunk_tokens")
    runner = LlamaRunner(runtime, Encoder(), **settings)
    return Scheduler(runner, settings["kv_cells"], chunk)


def runner_of(engine: Scheduler[LlamaRow]) -> LlamaRunner:
    runner = engine.runner
    assert isinstance(runner, LlamaRunner)
    return runner


def drain(engine: Scheduler[LlamaRow]) -> dict[int, Generation | Exception]:
    ended: dict[int, Generation | Exception] = {}
    for _ in range(100):
        for call, outcome in engine.step():
            ended[id(call)] = outcome
        if not (engine.waiting or engine.prefilling or engine.rows):
            return ended
    raise AssertionError("the engine did not finish")


def test_rows_share_one_decode_per_step_and_stream_whole_characters() -> None:
    runtime = FakeRuntime({3: [1, 2, 3, END], 4: [4, 4, 4, 4, 4]})
    engine = engine_for(runtime)
    euro = Recorder(TokenIds((3, 5)), {"max_new_tokens": 10})
    letters = Recorder(TokenIds((4,)), {"max_new_tokens": 5})
    engine.admit(euro)
    engine.admit(letters)
    ended = drain(engine)
    first, second = ended[id(euro)], ended[id(letters)]
    assert isinstance(first, Generation) and isinstance(second, Generation)
    assert first.text == "€a" and first.finish_reason == "stop" and first.completion_tokens == 4
    assert euro.chunks[0] == "€"  # never half of it
    assert second.text == "bbbbb" and second.finish_reason == "length"
    # Step 1 read both prompts in one batch; each later step decoded every live row at once.
    assert [len(batch) for batch in runtime.batches[:2]] == [3, 2]
    assert {seq for *_, seq, _ in runtime.batches[1]} == {0, 1}
    assert sorted(runtime.removed) == [0, 1]
    assert engine.room() == (64, [])


def test_long_prompt_is_read_in_slices_beside_a_decoding_row() -> None:
    runtime = FakeRuntime({4: [4] * 8, 6: [3, END]})
    engine = engine_for(runtime, prefill_chunk_tokens=3)
    decoding = Recorder(TokenIds((4,)), {"max_new_tokens": 8})
    engine.admit(decoding)
    engine.step()
    long_prompt = Recorder(TokenIds((6, 5, 5, 5, 5, 5, 5)), {"max_new_tokens": 4})
    engine.admit(long_prompt)
    ended = drain(engine)
    # 7 prompt tokens, 3 a step, each step beside the decoding row's one token.
    sliced = runtime.batches[1:4]
    assert [len(batch) for batch in sliced] == [4, 4, 2]
    assert long_prompt.prefilled_tokens == 7
    result = ended[id(long_prompt)]
    assert isinstance(result, Generation) and result.text == "a"


PREFIX = (3, *([5] * 19))  # 20 tokens: one whole index block and some


def test_prefix_cache_keeps_a_finished_sequence_and_copies_its_prefix() -> None:
    runtime = FakeRuntime({3: [4, 4, END]})
    engine = engine_for(runtime, prefix_cache_tokens=40)
    first = Recorder(TokenIds(PREFIX), {"max_new_tokens": 5})
    engine.admit(first)
    drain(engine)
    # Ended normally: its sequence stays, holding the prompt and the answer but "END".
    assert runtime.removed == [] and runner_of(engine).prefix_cache is not None
    assert runner_of(engine).prefix_cache.cells == 22
    assert engine.room() == (64, [])  # cached cells give way: they count as free
    second = Recorder(TokenIds((*PREFIX, 4, 4, 6)), {"max_new_tokens": 5})
    engine.admit(second)
    result = drain(engine)[id(second)]
    assert isinstance(result, Generation) and result.cached_tokens == 22
    assert runtime.copies == [(0, 1, 22)]
    # Only the rest of the prompt was read, from position 22 on, in the new sequence.
    assert [(pos, seq) for _, pos, seq, _ in runtime.batches[3]] == [(22, 1)]
    assert second.prefilled_tokens == 1
    # The second sequence holds all of the first's ids and more: the first is freed.
    assert runtime.removed == [0] and len(runner_of(engine).prefix_cache) == 1
    report = runner_of(engine).prefix_cache_report()
    assert report is not None and (report.hits, report.lookups) == (1, 2)
    assert report.cached_tokens == 22 and report.entries == 1


def test_prefix_cache_gives_way_to_requests_and_stays_in_its_bound() -> None:
    runtime = FakeRuntime({3: [4] * 40, 6: [END]})
    engine = engine_for(runtime, kv_cells=64, max_sequences=2, prefix_cache_tokens=45)
    cache = runner_of(engine).prefix_cache
    assert cache is not None
    for start in range(10):
        engine.admit(Recorder(TokenIds((6, start, *([5] * 20))), {"max_new_tokens": 1}))
        drain(engine)
        assert cache.cells <= 45
    assert len(cache) == 2 and cache.evictions == 8
    # A request reserving 40 cells: the cached 44 give way before it starts.
    engine.admit(Recorder(TokenIds((3, 3)), {"max_new_tokens": 38}))
    engine.step()
    assert engine.rows and cache.cells + 40 <= 64 and cache.evictions == 9
    drain(engine)
    # One sequence id and a cached prefix: the request takes the entry's own sequence.
    single = engine_for(FakeRuntime({3: [4, END]}), max_sequences=1, prefix_cache_tokens=40)
    for prompt in (PREFIX, (*PREFIX, 4, 6)):
        single.admit(Recorder(TokenIds(prompt), {"max_new_tokens": 4}))
        drain(single)
    runtime_one = runner_of(single).runtime
    assert isinstance(runtime_one, FakeRuntime)
    assert runtime_one.copies == [] and runtime_one.trims == [(0, 21)]


def test_ignore_eos_runs_a_row_to_max_new_tokens_past_its_end_token() -> None:
    runtime = FakeRuntime({3: [3, END, 4, END, 4, 4]})
    engine = engine_for(runtime)
    ignoring = Recorder(TokenIds((3,)), {"max_new_tokens": 5, "ignore_eos": True})
    stopping = Recorder(TokenIds((3, 5)), {"max_new_tokens": 5})
    engine.admit(ignoring)
    engine.admit(stopping)
    ended = drain(engine)
    longer, shorter = ended[id(ignoring)], ended[id(stopping)]
    assert isinstance(longer, Generation) and isinstance(shorter, Generation)
    assert longer.completion_tokens == 5 and longer.finish_reason == "length"
    assert shorter.completion_tokens == 2 and shorter.finish_reason == "stop"


def test_a_failed_decode_over_several_rows_loses_them_together() -> None:
    runtime = FakeRuntime({3: [3] * 10, 4: [4] * 10})
    engine = engine_for(runtime)
    calls = [Recorder(TokenIds((3,)), {"max_new_tokens": 10}), Recorder(TokenIds((4,)), {})]
    for call in calls:
        engine.admit(call)
    engine.step()
    waiting = Recorder(TokenIds((3,)), {"max_new_tokens": 60})  # no KV room beside them
    engine.admit(waiting)
    runtime.decode_code = -3
    with pytest.raises(RowsLost) as lost:
        engine.step()
    assert lost.value.calls == calls
    assert sorted(runtime.removed) == [0, 1]
    assert [row.call for row in engine.waiting + engine.prefilling] == [waiting]


def test_a_failed_decode_of_one_row_is_its_own_error() -> None:
    runtime = FakeRuntime({3: [3] * 10}, decode_code=1)
    engine = engine_for(runtime)
    call = Recorder(TokenIds((3,)), {"max_new_tokens": 4})
    engine.admit(call)
    [(ended_call, outcome)] = engine.step()
    assert ended_call is call and isinstance(outcome, RuntimeError)
    assert "no KV cache room" in str(outcome)


def test_sampling_keeps_min_tokens_and_penalties_per_row() -> None:
    logits = np.array([0, 0, 0, 5, 4, 0, 0, 9], dtype=np.float32)
    ends = np.array([END], dtype=np.int64)
    assert choose_token(logits, Sampling(), [], 0, ends, None) == END
    assert choose_token(logits, Sampling(min_new_tokens=2), [], 1, ends, None) == 3
    penalised = Sampling(min_new_tokens=2, repetition_penalty=2.0)
    assert choose_token(logits, penalised, [3], 1, ends, None) == 4
    rng = np.random.default_rng(0)
    picks = {
        choose_token(logits, Sampling(do_sample=True, top_k=2), [], 0, ends, rng) for _ in range(50)
    }
    assert picks <= {END, 3}


@pytest.mark.parametrize(
    ("device", "options", "expected"),
    [
        ("cpu", {}, Placement(0, 0, "none", ())),
        ("cuda:1", {}, Placement(-1, 1, "none", ())),
        ("cuda", {"n_gpu_layers": 12}, Placement(12, 0, "none", ())),
        ("cuda:0,cuda:1", {}, Placement(-1, 0, "layer", (1.0, 1.0))),
        ("cuda:1,cuda:3", {"tensor_split": [3, 1]}, Placement(-1, 1, "layer", (0, 3, 0, 1))),
        ("auto", {}, Placement(-1, 0, "none", ())),
    ],
)
def test_placement_for_devices(device: str, options: dict[str, Any], expected: Placement) -> None:
    assert placement(device, options, gpu_offload=True) == expected


def test_placement_refuses_what_cannot_run() -> None:
    assert placement("auto", {}, gpu_offload=False) == Placement(0, 0, "none", ())
    with pytest.raises(ValueError, match="needs a GPU device"):
        placement("cpu", {"n_gpu_layers": 4}, gpu_offload=True)
    with pytest.raises(BackendUnavailable, match="cannot offload to a GPU"):
        placement("cuda:0", {}, gpu_offload=False)
    with pytest.raises(ValueError, match="one proportion"):
        placement("cuda:0,cuda:1", {"tensor_split": [1]}, gpu_offload=True)


def test_openai_penalties_in_numpy_match_the_torch_definition() -> None:
    import torch

    from modelpool.worker.backends.common.penalties import Penalties

    penalties = Penalties(presence=0.5, frequency=0.25, bias=((1, -3.0), (4, 2.0)))
    logits = np.linspace(-1.0, 1.0, 6, dtype=np.float32)
    generated = [2, 2, 3]
    expected = penalties.apply(torch.tensor(logits), generated).numpy()
    assert np.allclose(penalties.apply_numpy(logits.copy(), generated), expected)
    ends = np.array([], dtype=np.int64)
    # Bias -100 bans the greedy token; the penalties count generated tokens, not the prompt.
    banned = Sampling(penalties=Penalties(bias=((5, -100.0),)))
    assert choose_token(logits, banned, [], 0, ends, None) == 4
    repeated = Sampling(penalties=Penalties(frequency=10.0))
    assert choose_token(logits, repeated, [5], 0, ends, None) == 5
    assert choose_token(logits, repeated, [0, 5], 1, ends, None) == 4
