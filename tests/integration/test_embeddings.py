"""Embed and score requests through real workers on the testing backend (``task = "embed"``
or ``"score"``; see ``modelpool.worker.backends.testing_embeddings``): the API's forms and
refusals, and
the per-request guarantees as for generation (deadline, kill, retry, stats).

The hf backend's own pooling models are in ``test_hf_embeddings.py``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from helpers import open_pool, slack, wait_until
from modelpool import (
    ContextLengthExceeded,
    DeadlineExceeded,
    EmbeddingResult,
    InvalidRequest,
    ScoreResult,
    WrongTask,
)
from modelpool.worker.backends.testing_embeddings import DIMENSIONS


def _norm(vector: list[float]) -> float:
    return math.sqrt(sum(value * value for value in vector))


def test_embed_gives_one_unit_vector_per_input_and_counts_tokens() -> None:
    with open_pool(workers=1, backend_options={"task": "embed"}) as pool:
        assert pool.task == "embed"
        assert pool.stats().task == "embed"
        result = pool.embed(["hello there", "general kenobi", "hello there"])
        assert isinstance(result, EmbeddingResult)
        assert result.dimensions == DIMENSIONS and len(result.vectors) == 3
        assert result.prompt_tokens == 6
        assert result.vectors[0] == result.vectors[2] != result.vectors[1]
        assert all(abs(_norm(vector) - 1.0) < 1e-9 for vector in result.vectors)
        assert pool.embed("hello there").vectors == [result.vectors[0]]
        assert pool.stats().counters["completed"] == 2


def test_embed_takes_token_ids_and_lists_of_them() -> None:
    with open_pool(workers=1, backend_options={"task": "embed"}) as pool:
        one = pool.embed([5, 6, 7])
        assert len(one.vectors) == 1 and one.prompt_tokens == 3
        many = pool.embed([[5, 6, 7], [8]])
        assert many.vectors[0] == one.vectors[0] and len(many.vectors) == 2
        assert many.prompt_tokens == 4


def test_dimensions_cut_and_renormalise() -> None:
    with open_pool(workers=1, backend_options={"task": "embed"}) as pool:
        full = pool.embed("some text").vectors[0]
        cut = pool.embed("some text", dimensions=3)
        assert cut.dimensions == 3
        scale = _norm(full[:3])
        assert cut.vectors[0] == pytest.approx([value / scale for value in full[:3]])
        assert abs(_norm(cut.vectors[0]) - 1.0) < 1e-9
        with pytest.raises(InvalidRequest, match="dimensions"):
            pool.embed("some text", dimensions=DIMENSIONS + 1)
        assert pool.stats().state == "ready"


@pytest.mark.parametrize(
    ("inputs", "field"),
    [
        ([], "input"),
        ("", "input"),
        (["fine", ""], r"input\[1\]"),
        ([[1, 2], []], r"input\[1\]"),
        ([[1, -2]], r"input\[0\]"),
        ([3.5], "input"),
        (b"bytes", "input"),
    ],
)
def test_bad_inputs_are_refused_before_dispatch_naming_the_field(
    inputs: object, field: str
) -> None:
    with open_pool(workers=1, backend_options={"task": "embed"}) as pool:
        with pytest.raises(InvalidRequest, match=field):
            pool.embed(inputs)  # type: ignore[arg-type]
        assert pool.stats().counters["submitted"] == 0
    with (
        open_pool(workers=1, backend_options={"task": "embed"}) as pool,
        pytest.raises(InvalidRequest, match="dimensions"),
    ):
        pool.embed("text", dimensions=0)


def test_context_is_refused_unless_truncate() -> None:
    options = {"task": "embed", "max_model_len": 4}
    with open_pool(workers=1, backend_options=options) as pool:
        with pytest.raises(ContextLengthExceeded) as caught:
            pool.embed(["short", "one two three four five six"])
        assert caught.value.max_model_len == 4 and caught.value.prompt_tokens == 6
        assert "input[1]" in str(caught.value)
        truncated = pool.embed(["short", "one two three four five six"], truncate=True)
        assert truncated.prompt_tokens == 1 + 4
        assert truncated.vectors[1] == pool.embed("one two three four").vectors[0]


def test_wrong_task_is_a_typed_refusal_both_ways() -> None:
    with open_pool(workers=1) as pool:
        assert pool.task == "generate"
        with pytest.raises(WrongTask, match="embed") as caught:
            pool.embed("text")
        assert caught.value.task == "generate"
        with pytest.raises(WrongTask):
            pool.score("query", ["doc"])
        assert pool.generate("echo:still fine").text == "still fine"
    with open_pool(workers=1, backend_options={"task": "embed"}) as pool:
        with pytest.raises(WrongTask, match="generate") as caught:
            pool.generate("echo:hello")
        assert caught.value.task == "embed"
    with open_pool(workers=1, backend_options={"task": "score"}) as pool:
        with pytest.raises(WrongTask, match="embed"):
            pool.embed("text")
        assert pool.score("query", ["doc"]).method == "cross-encoder"


def test_worker_refuses_the_wrong_task_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pool's own check bypassed (a request that reached the worker anyway): the
    worker's refusal is the same typed error, and the worker stays."""
    monkeypatch.setattr("modelpool.supervisor.pool.check_task", lambda *args: None)
    with open_pool(workers=1) as pool:
        with pytest.raises(WrongTask) as caught:
            pool.embed("text")
        assert caught.value.task == "generate"
        with pytest.raises(WrongTask):
            pool.score("query", ["doc"])
        assert pool.stats().counters["failed"] == 2
    with open_pool(workers=1, backend_options={"task": "embed"}) as pool:
        with pytest.raises(WrongTask) as caught:
            pool.generate("echo:hello")
        assert caught.value.task == "embed"
        assert pool.stats().counters["crashes"] == 0


def test_score_by_cross_encoder_and_by_cosine() -> None:
    documents = ["paris is the capital of france", "bananas are yellow", "capital city"]
    with open_pool(workers=1, backend_options={"task": "score"}) as pool:
        result = pool.score("the capital of france", documents)
        assert isinstance(result, ScoreResult) and result.method == "cross-encoder"
        assert max(range(3), key=result.scores.__getitem__) == 0
        assert all(0.0 < score < 1.0 for score in result.scores)
        raw = pool.score("the capital of france", documents, raw_scores=True)
        assert raw.scores[0] == pytest.approx(3.5)
        assert result.scores[0] == pytest.approx(1 / (1 + math.exp(-3.5)))
    with open_pool(workers=1, backend_options={"task": "embed"}) as pool:
        cosine = pool.score("the capital of france", documents)
        assert cosine.method == "cosine"
        query, *vectors = pool.embed(["the capital of france", *documents]).vectors
        expected = [sum(a * b for a, b in zip(query, vector, strict=True)) for vector in vectors]
        assert cosine.scores == pytest.approx(expected)
        with pytest.raises(InvalidRequest, match="documents"):
            pool.score("query", [])
        with pytest.raises(InvalidRequest, match=r"documents\[1\]"):
            pool.score("query", ["fine", ""])
        with pytest.raises(InvalidRequest, match="query"):
            pool.score("", ["doc"])


def test_async_embed_and_score() -> None:
    async def both() -> tuple[EmbeddingResult, ScoreResult, list[EmbeddingResult]]:
        with open_pool(workers=2, backend_options={"task": "embed"}) as pool:
            embedded = await pool.aembed(["a b", "c"])
            scored = await pool.ascore("a b", ["a b", "z"])
            many = await asyncio.gather(*(pool.aembed(f"text {n}") for n in range(8)))
            return embedded, scored, list(many)

    embedded, scored, many = asyncio.run(both())
    assert len(embedded.vectors) == 2 and embedded.prompt_tokens == 3
    assert scored.scores[0] == pytest.approx(1.0)
    assert len({tuple(result.vectors[0]) for result in many}) == 8


def test_embed_and_score_take_the_queueing_keywords_and_no_others() -> None:
    # What the daemon's admission step sends with each micro-batch (docs/architecture.md,
    # "The daemon's walk"): judged already, with the caller's trace context.
    queue = {"admitted": True, "traceparent": f"00-{'ab' * 16}-{'cd' * 8}-01"}
    with open_pool(workers=1, backend_options={"task": "embed"}) as pool:
        assert len(pool.embed(["a", "b"], priority=2, **queue).vectors) == 2
        assert len(pool.score("a", ["a", "b"], max_queue_time_s=5.0).scores) == 2
        with pytest.raises(TypeError, match="temperature"):
            pool.embed("a", temperature=0.5)
        with pytest.raises(InvalidRequest, match="traceparent"):
            pool.score("a", ["b"], traceparent="not one")
        assert pool.stats().counters["completed"] == 2


@pytest.mark.slow
def test_a_deadline_on_a_slow_embedding_is_met_without_killing_the_honest_worker() -> None:
    with open_pool(workers=1, backend_options={"task": "embed"}, cancel_grace_s=slack(2)) as pool:
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            pool.embed(["fast", "embed_sleep:60"], deadline_s=0.5)
        assert time.monotonic() - started < 0.5 + slack(1)
        # The worker read its cancel flag between inputs: it answers the next request
        # itself, with no kill and no respawn.
        assert len(pool.embed("after").vectors) == 1
        counters = pool.stats().counters
        assert counters["timeouts"] == 1
        assert counters["kills"] == 0 and counters["respawns"] == 0


@pytest.mark.slow
def test_a_worker_killed_mid_embedding_is_replaced_and_the_request_retried(
    tmp_path: Path,
) -> None:
    marker = tmp_path / "started"
    with open_pool(workers=1, backend_options={"task": "embed"}) as pool:
        pid = pool.stats().workers[0].pid
        assert pid is not None
        future: concurrent.futures.Future[EmbeddingResult] = concurrent.futures.Future()

        def embed() -> None:
            try:
                future.set_result(pool.embed(["one", f"embed_hang_once:{marker}", "three"]))
            except BaseException as exc:
                future.set_exception(exc)

        threading.Thread(target=embed, daemon=True).start()
        wait_until(marker.exists, timeout=slack(5), message="the embedding to start")
        os.kill(pid, signal.SIGKILL)
        result = future.result(timeout=slack(20))
        assert len(result.vectors) == 3
        stats = pool.stats()
        assert stats.counters["crashes"] == 1 and stats.counters["retries"] == 1
        assert stats.workers[0].pid != pid


@pytest.mark.slow
def test_a_hung_embedding_is_killed_by_the_ladder_and_retried(tmp_path: Path) -> None:
    marker = tmp_path / "hung"
    with open_pool(workers=2, backend_options={"task": "embed"}, attempt_timeout_s=1.0) as pool:
        started = time.monotonic()
        result = pool.embed(["one", f"embed_hang_once:{marker}"], deadline_s=slack(10))
        assert len(result.vectors) == 2
        assert time.monotonic() - started < slack(10)
        assert pool.stats().counters["retries"] == 1
        # The hung worker ignored its cancel flag and SIGTERM: the ladder ends in SIGKILL.
        wait_until(
            lambda: pool.stats().counters["kills"] == 1,
            timeout=slack(10),
            message="the hung worker's kill",
        )
        assert pool.stats().counters["timeouts"] == 1


@pytest.mark.slow
def test_a_crashing_embedding_fails_typed_and_the_pool_lives() -> None:
    with open_pool(workers=1, backend_options={"task": "embed"}) as pool:
        with pytest.raises(Exception) as caught:
            pool.embed(["embed_segfault"], deadline_s=slack(20))
        assert type(caught.value).__name__ in ("WorkerCrashed", "PoisonRequest")
        assert len(pool.embed("alive").vectors) == 1
