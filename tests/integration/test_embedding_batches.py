"""Cross-request batching of embed and score requests on the testing backend (``task =
"embed"``, ``batch_log``; see ``modelpool.worker.backends.testing_embeddings``): concurrent clients'
requests are answered in one step of one worker, with the per-request guarantees of
batched generation (a deadline withdraws one row, a crashing batch's innocents are
retried and answered).

Each test holds a batch open with ``embed_wait:PATH`` until every request it sends is
in the worker (``stats().running``), so the batching it sees is by construction.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from helpers import open_pool, slack, wait_until
from modelpool import DeadlineExceeded, EmbeddingResult, ModelPool
from modelpool.worker.backends.testing_embeddings import vector


def _steps(log: Path) -> list[int]:
    return [int(line) for line in log.read_text().split()] if log.exists() else []


@contextmanager
def _held_batch(
    pool: ModelPool, log: Path, gate: Path
) -> Iterator[concurrent.futures.Future[EmbeddingResult]]:
    """A request whose step waits for ``gate``: what is sent meanwhile batches behind it."""
    earlier = _steps(log)  # the steps of requests sent before this one
    with concurrent.futures.ThreadPoolExecutor(1) as executor:
        held = executor.submit(pool.embed, f"embed_wait:{gate}", deadline_s=slack(30))
        wait_until(lambda: _steps(log) == [*earlier, 1], timeout=slack(5), message="the held step")
        yield held


def _send(
    executor: concurrent.futures.ThreadPoolExecutor, calls: list[Callable[[], Any]]
) -> list[concurrent.futures.Future[Any]]:
    return [executor.submit(call) for call in calls]


def _open_batched(tmp_path: Path, **overrides: Any) -> Any:
    backend_options = {"task": "embed", "batch_log": str(tmp_path / "steps")}
    return open_pool(workers=1, max_batch_size=16, backend_options=backend_options, **overrides)


def test_concurrent_embeds_are_answered_in_one_step_with_their_solo_vectors(
    tmp_path: Path,
) -> None:
    log, gate = tmp_path / "steps", tmp_path / "gate"
    texts = [f"text number {index}" for index in range(8)]
    with _open_batched(tmp_path) as pool, concurrent.futures.ThreadPoolExecutor(8) as executor:
        with _held_batch(pool, log, gate) as held:
            futures = _send(executor, [lambda text=text: pool.embed(text) for text in texts])
            wait_until(lambda: pool.stats().running == 9, timeout=slack(5), message="9 runs")
            gate.touch()
            results = [future.result(timeout=slack(10)) for future in futures]
            assert len(held.result(timeout=slack(10)).vectors) == 1
        # Eight clients, one step (after the held one): fewer steps than requests.
        assert _steps(log) == [1, 8]
        assert [pool.embed(text).vectors for text in texts[:2]] == [
            result.vectors for result in results[:2]
        ]
        for text, result in zip(texts, results, strict=True):
            assert result.vectors[0] == pytest.approx(vector(text))
        assert _steps(log) == [1, 8, 1, 1]
        assert pool.stats().counters["completed"] == 11


def test_scores_batch_with_embeds(tmp_path: Path) -> None:
    log, gate = tmp_path / "steps", tmp_path / "gate"
    with _open_batched(tmp_path) as pool, concurrent.futures.ThreadPoolExecutor(4) as executor:
        solo = pool.score("a b", ["a b", "c"]).scores
        with _held_batch(pool, log, gate):
            futures = _send(
                executor,
                [lambda: pool.score("a b", ["a b", "c"]), lambda: pool.embed(["x", "y"])],
            )
            wait_until(lambda: pool.stats().running == 3, timeout=slack(5), message="3 runs")
            gate.touch()
            scored, embedded = (future.result(timeout=slack(10)) for future in futures)
        assert scored.scores == solo and len(embedded.vectors) == 2
        assert _steps(log)[-1] == 2


@pytest.mark.slow
def test_a_deadline_on_one_row_does_not_fail_the_others(tmp_path: Path) -> None:
    log, gate = tmp_path / "steps", tmp_path / "gate"
    with (
        _open_batched(tmp_path, cancel_grace_s=slack(2)) as pool,
        concurrent.futures.ThreadPoolExecutor(4) as executor,
    ):
        with _held_batch(pool, log, gate):
            slow = executor.submit(pool.embed, "embed_sleep:60", deadline_s=slack(1))
            others = _send(executor, [lambda i=i: pool.embed(f"other {i}") for i in range(3)])
            wait_until(lambda: pool.stats().running == 5, timeout=slack(5), message="5 runs")
            gate.touch()
            with pytest.raises(DeadlineExceeded):
                slow.result(timeout=slack(10))
            answered = [future.result(timeout=slack(10)) for future in others]
        for index, result in enumerate(answered):
            assert result.vectors[0] == pytest.approx(vector(f"other {index}"))
        counters = pool.stats().counters
        # The worker read the flag between rows: no kill, no respawn, nothing retried.
        assert counters["timeouts"] == 1 and counters["kills"] == 0
        assert counters["respawns"] == 0 and counters["retries"] == 0


@pytest.mark.slow
def test_a_crashing_batch_loses_its_innocents_and_they_are_retried(tmp_path: Path) -> None:
    log, gate, marker = tmp_path / "steps", tmp_path / "gate", tmp_path / "crashed"
    inputs = ["first", f"embed_crash_once:{marker}", "third", "fourth"]
    with _open_batched(tmp_path) as pool, concurrent.futures.ThreadPoolExecutor(4) as executor:
        with _held_batch(pool, log, gate):
            futures = _send(
                executor,
                [lambda text=text: pool.embed(text, deadline_s=slack(30)) for text in inputs],
            )
            wait_until(lambda: pool.stats().running == 5, timeout=slack(5), message="5 runs")
            gate.touch()
            results = [future.result(timeout=slack(30)) for future in futures]
        assert marker.exists()
        assert [len(result.vectors) for result in results] == [1, 1, 1, 1]
        assert results[0].vectors[0] == pytest.approx(vector("first"))
        counters = pool.stats().counters
        assert counters["crashes"] == 1 and counters["collateral_retries"] == 4
        # The crashed step held all four; the retries ran in later steps.
        assert 4 in _steps(log) and len(_steps(log)) > 2


@pytest.mark.slow
def test_a_hung_batch_is_killed_and_its_innocents_are_answered(tmp_path: Path) -> None:
    log, gate, marker = tmp_path / "steps", tmp_path / "gate", tmp_path / "hung"
    # The second input hangs its step the first time (never reading the cancel flag,
    # ignoring SIGTERM): four clients' requests are frozen in one step.
    inputs = ["first", f"embed_hang_once:{marker}", "third", "fourth"]
    with (
        _open_batched(tmp_path, stall_timeout_s=slack(1), term_grace_s=0.2) as pool,
        concurrent.futures.ThreadPoolExecutor(4) as executor,
    ):
        with _held_batch(pool, log, gate):
            futures = _send(
                executor,
                [lambda text=text: pool.embed(text, deadline_s=slack(30)) for text in inputs],
            )
            wait_until(lambda: pool.stats().running == 5, timeout=slack(5), message="5 runs")
            gate.touch()
            results = [future.result(timeout=slack(30)) for future in futures]
        assert marker.exists()
        for text, result in zip(inputs, results, strict=True):
            assert result.vectors[0] == pytest.approx(vector(text))
        counters = pool.stats().counters
        # One kill (the ladder's SIGKILL: SIGTERM is ignored), the batch's four retried.
        assert counters["kills"] == 1 and counters["stalls"] == 1
        assert counters["collateral_retries"] == 4
        assert 4 in _steps(log) and len(_steps(log)) > 2


@pytest.mark.parametrize(
    ("overrides", "capacity"),
    [
        ({"backend_options": {"task": "embed"}}, 32),
        ({"backend_options": {"task": "score"}, "max_batch_size": 4}, 4),
        ({"backend_options": {"task": "embed"}, "pooling_batch_size": 1}, 1),
        ({}, 1),
    ],
)
def test_a_pooling_model_batches_by_default(overrides: dict[str, Any], capacity: int) -> None:
    with open_pool(workers=1, **overrides) as pool:
        assert pool.config.max_batch_size == capacity
        wait_until(lambda: pool.stats().capacity == capacity, timeout=slack(5), message="ready")
