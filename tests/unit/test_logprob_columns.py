"""logprob_columns.TokenLogprobs: a run's logprobs as columns, what crosses a worker's pipe
(issue 25: 20,000 echoed prompt tokens with 5 alternatives each were 100,000 objects that
the dispatcher thread unpickled in one GIL-holding call of ~100-200 ms, and the answer
built from them held ten times its own size in Python objects)."""

from __future__ import annotations

import dataclasses
import json
import pickle
import pickletools
import time
import tracemalloc

import pytest

from modelpool.server.core.job import Job
from modelpool.server.http import json_bytes
from modelpool.server.openai.format import response_body
from modelpool.shared.logprob_columns import TokenLogprobs
from modelpool.shared.protocol import (
    FrameDecoder,
    Generation,
    PooledAnswer,
    TokenLogprob,
    encode_frame,
)
from modelpool.supervisor.results import Result
from modelpool.worker.answers import normalise

ENTRIES = [
    TokenLogprob(1, "Hé", None),
    TokenLogprob(2, ' "q"\n', -0.5, ((2, ' "q"\n', -0.5), (3, "\ud800", -1.25))),
    TokenLogprob(-4, "", -2.0, ((5, "x", -0.1),)),
]


def scored_prompt(count: int, top: int = 5) -> list[TokenLogprob]:
    """A prompt of ``count`` tokens, each with ``top`` alternatives (the first unscored)."""
    entries = [TokenLogprob(0, "p", None)]
    for index in range(1, count):
        alternatives = tuple((rank, f"<t{rank}>", -1.0 - rank) for rank in range(top))
        entries.append(TokenLogprob(index, f"w{index % 50} ", -0.5, alternatives))
    return entries


def test_columns_read_back_as_the_entries_they_were_made_of() -> None:
    columns = TokenLogprobs.of(ENTRIES)
    assert columns == ENTRIES and list(columns) == ENTRIES and len(columns) == 3
    assert [columns[0], columns[-1]] == [ENTRIES[0], ENTRIES[-1]]
    assert columns[1:] == ENTRIES[1:]
    with pytest.raises(IndexError):
        columns[3]
    assert columns.tokens() == ["Hé", ' "q"\n', ""]
    assert columns.logprob_values() == [None, -0.5, -2.0]
    assert columns.text() == 'Hé "q"\n'
    assert columns.summed_logprob() == -2.5
    assert pickle.loads(pickle.dumps(columns)) == columns
    assert TokenLogprobs.of([]) == [] and list(TokenLogprobs.of([]).windows(2)) == []
    with pytest.raises(TypeError, match="TokenLogprob"):
        TokenLogprobs.of([("not", "an", "entry")])  # type: ignore[list-item]


def test_windows_keep_every_entry_in_order() -> None:
    entries = scored_prompt(1000, top=3) + ENTRIES
    columns = TokenLogprobs.of(entries)
    windows = list(columns.windows(256))
    assert [len(window) for window in windows] == [256, 256, 256, 235]
    assert [entry for window in windows for entry in window] == entries
    assert [columns[position] for position in range(len(columns))] == entries


def test_a_workers_result_crosses_the_pipe_in_a_few_pickle_operations() -> None:
    entries = scored_prompt(20_000)
    frame = encode_frame(("done", 7, normalise(Generation("", prompt_logprobs=entries)), 0))
    # Objects would be several operations per entry and alternative: 600,000 or so.
    assert sum(1 for _ in pickletools.genops(frame[4:])) < 200
    (message,) = FrameDecoder().feed(frame)
    received = message[2].prompt_logprobs
    assert isinstance(received, TokenLogprobs) and received == entries


def test_every_field_of_a_generation_crosses_the_pipe_and_the_class_is_named_once() -> None:
    generation = Generation(
        "text",
        "length",
        prompt_tokens=3,
        completion_tokens=4,
        logprobs=TokenLogprobs.of(ENTRIES),
        prompt_logprobs=TokenLogprobs.of(ENTRIES[:1]),
        cached_tokens=2,
        token_ids=[1, 2],
        stop_sequence="\n",
        pooled=PooledAnswer(vectors=[[0.5]], method="cosine"),
        reasoning_tokens=5,
        thinking_closed="budget",
    )
    assert {field.name for field in dataclasses.fields(Generation)} == {
        name for name, value in vars(generation).items() if value is not None
    }, "a field left unset here is not checked below"
    frame = encode_frame(("done", 7, generation, 0))
    (message,) = FrameDecoder().feed(frame)
    assert message[2] == generation
    # Its fields go as a constructor's arguments, not as a dict of their names.
    assert b"stop_sequence" not in frame


def test_a_long_echoed_answer_is_built_without_holding_an_object_per_entry() -> None:
    entries = scored_prompt(4000)
    prompt = "".join(entry.token for entry in entries)
    result = Result("", "length", "r", 1, 1, 0.1, 0.0, 4000, 0, [], TokenLogprobs.of(entries))
    job = Job(prompts=[prompt], params={}, logprobs=5, echo=True)
    tracemalloc.start()
    try:
        started = time.perf_counter()
        answer = json_bytes(response_body(job, {0: result}, "m", 0))
        built_s = time.perf_counter() - started
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    logprobs = json.loads(answer)["choices"][0]["logprobs"]
    assert logprobs["tokens"] == [entry.token for entry in entries]
    assert logprobs["top_logprobs"][1] == {f"<t{rank}>": -1.0 - rank for rank in range(5)} | {
        "w1 ": -0.5
    }
    assert logprobs["text_offset"][:3] == [0, 1, 4]
    # The answer's pieces, joined and encoded: three times its size, not ten (a dict per
    # entry and every alternative's text held at once).
    assert peak < 4 * len(answer), (peak, len(answer), built_s)


@dataclasses.dataclass
class _BackendsGeneration(Generation):
    backend_note: str = ""


def test_a_subclass_or_an_added_attribute_still_pickles_whole() -> None:
    subclassed = _BackendsGeneration("text", backend_note="kept")
    assert pickle.loads(pickle.dumps(subclassed)) == subclassed
    noted = Generation("text")
    noted.trace = "kept"  # type: ignore[attr-defined]
    assert pickle.loads(pickle.dumps(noted)).trace == "kept"
