"""What the README's Library, Errors and Stats sections promise, each against a real pool.

One test per promise that had none: streams' ``request_id`` and ``result``, cancelling
the task that consumes an ``astream``, ``astats()``, ``generation_defaults``,
``retry.backoff_s``, a timeout a retry recovers from, a stream that yielded and then
timed out, a backend's ``handler.validate`` in the worker, ``kill_reasons`` by reason,
and the ``hf`` backend through a pool.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import psutil
import pytest

from helpers import (
    FAR_DEADLINE_S,
    IGNORES_FLAG_AND_SIGTERM,
    LONG,
    UNCAPPED,
    BackendModule,
    assert_outlasts,
    open_pool,
    slack,
    submit_with_chunks,
    wait_counters,
    wait_idle,
    wait_until,
    workers,
)
from modelpool import DeadlineExceeded, InvalidRequest, ModelPool, PoolConfig, RetryPolicy
from modelpool.supervisor.stats import PoolStats

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux processes")


# ---- PoolStream / AsyncPoolStream -----------------------------------------------------------


def test_stream_request_id_at_once_and_result_once_exhausted() -> None:
    with open_pool(workers=1) as pool:
        stream = pool.stream("tokens:5", max_new_tokens=3)
        assert stream.request_id.startswith("req-")  # before the first chunk
        assert stream.result is None
        assert "".join(stream) == "t0 t1 t2 "
        result = stream.result
        assert result is not None
        assert result.request_id == stream.request_id
        assert result.finish_reason == "length"
        assert result.completion_tokens == 3
        assert result.text == "t0 t1 t2 "


def test_astream_request_id_at_once_and_result_once_exhausted() -> None:
    with open_pool(workers=1) as pool:

        async def scenario() -> None:
            stream = pool.astream("tokens:4")
            request_id = stream.request_id
            assert request_id.startswith("req-") and stream.result is None
            chunks = [chunk async for chunk in stream]
            assert chunks == ["t0 ", "t1 ", "t2 ", "t3 "]
            assert stream.result is not None
            assert stream.result.request_id == request_id
            assert stream.result.finish_reason == "stop"
            assert stream.result.completion_tokens == 4

        asyncio.run(scenario())


def test_cancelling_the_task_that_consumes_an_astream_cancels_the_request() -> None:
    with open_pool(workers=1, deadline_s=FAR_DEADLINE_S) as pool:
        # Still running when the task is cancelled (else it completes): the first chunk's wait.
        assert_outlasts(pool.config, LONG, slack(5), **UNCAPPED)
        pid = workers(pool)[0].pid

        async def scenario() -> list[str]:
            received: list[str] = []
            first = asyncio.Event()

            async def consume() -> None:
                async for chunk in pool.astream(LONG, **UNCAPPED):
                    received.append(chunk)
                    first.set()

            task = asyncio.create_task(consume())
            await asyncio.wait_for(first.wait(), slack(5))
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return received

        received = asyncio.run(scenario())
        assert received and received[0] == "t0 "
        snapshot = wait_counters(pool, cancelled=1)
        assert snapshot["kills"] == 0 and snapshot["completed"] == 0
        assert wait_idle(pool, 1)[0].pid == pid  # stopped at the flag, still warm


def test_astats_is_stats_without_blocking_the_event_loop() -> None:
    with open_pool(workers=2) as pool:
        pool.generate("echo:x")

        async def scenario() -> tuple[int, PoolStats]:
            ticks = 0

            async def ticker() -> None:
                nonlocal ticks
                while True:
                    ticks += 1
                    await asyncio.sleep(0)

            running = asyncio.create_task(ticker())
            snapshot = await pool.astats()
            running.cancel()
            return ticks, snapshot

        ticks, snapshot = asyncio.run(scenario())
        assert ticks >= 1, "the event loop ran nothing while astats() waited"
        blocking = pool.stats()
        assert snapshot.state == blocking.state == "ready"
        assert snapshot.counters == blocking.counters
        assert [w.pid for w in snapshot.workers] == [w.pid for w in blocking.workers]
    closed = asyncio.run(pool.astats())
    assert closed.state == "closed"


# ---- configuration that shapes a request ------------------------------------------------------


def test_generation_defaults_apply_and_a_request_overrides_them() -> None:
    with open_pool(workers=1, generation_defaults={"max_new_tokens": 3}) as pool:
        default = pool.generate("tokens:10")
        assert (default.text, default.finish_reason) == ("t0 t1 t2 ", "length")
        override = pool.generate("tokens:10", max_new_tokens=5)
        assert override.completion_tokens == 5 and override.finish_reason == "length"
        assert pool.generate("tokens:2").finish_reason == "stop"  # under the default


def test_retry_backoff_delays_the_retry(tmp_path: Path) -> None:
    backoff = 0.6
    with open_pool(
        workers=2, spares=0, retry=RetryPolicy(max_retries=1, backoff_s=backoff)
    ) as pool:
        result = pool.generate(f"crash_once:{tmp_path / 'crashed'}")
        assert result.text == "ok" and result.attempts == 2
        assert result.latency_s >= backoff, result.latency_s
    with open_pool(workers=2, spares=0, retry=RetryPolicy(max_retries=1)) as pool:
        quick = pool.generate(f"crash_once:{tmp_path / 'crashed-again'}")
        assert quick.attempts == 2
        assert quick.latency_s < backoff  # without backoff the warm worker takes it at once


def test_a_timeout_that_a_retry_recovers_from(tmp_path: Path) -> None:
    """hang_once: the first attempt hangs (ignoring SIGTERM) until its attempt timeout, the
    retry on another worker succeeds, and the caller sees a plain Result."""
    with open_pool(
        workers=2,
        attempt_timeout_s=0.4,
        cancel_grace_s=0.2,
        term_grace_s=0.2,
        deadline_s=20.0,
        retry=RetryPolicy(max_retries=1),
    ) as pool:
        result = pool.generate(f"hang_once:{tmp_path / 'hung'}")
        assert result.text == "ok"
        assert result.attempts == 2
        assert result.latency_s >= 0.4
        snapshot = wait_counters(pool, timeouts=1, retries=1, completed=1, kills=1)
        assert snapshot["failed"] == 0


def test_a_stream_that_yielded_is_not_retried_after_an_attempt_timeout() -> None:
    with open_pool(
        workers=2, attempt_timeout_s=0.3, deadline_s=10.0, retry=RetryPolicy(max_retries=2)
    ) as pool:
        received: list[str] = []
        with pytest.raises(DeadlineExceeded) as info:
            for chunk in pool.stream(LONG, **UNCAPPED):  # until its attempt timeout
                received.append(chunk)
        assert received, "the stream yielded nothing before the timeout"
        assert [a.outcome for a in info.value.attempts] == ["timeout"]
        assert info.value.partial_text.startswith("".join(received))
        snapshot = wait_counters(pool, timeouts=1, failed=1)
        assert snapshot["retries"] == 0


# ---- a backend's validate, before dispatch and in the worker -----------------------------------

TWO_VALIDATORS = """
from modelpool import InvalidRequest

def validate(params):
    if "banana" in params:
        raise ValueError("banana is refused before dispatch")

class Handler:
    def validate(self, params):
        if "cherry" in params:
            raise InvalidRequest("cherry is refused by the worker")

    def generate(self, call):
        return "served"

def factory(model="", device="cpu", **options):
    return Handler()
"""


def test_handler_validate_runs_in_the_worker_as_well(backend_module: BackendModule) -> None:
    with open_pool(workers=1, backend=backend_module(TWO_VALIDATORS)) as pool:
        pid = workers(pool)[0].pid
        with pytest.raises(InvalidRequest, match="before dispatch"):
            pool.submit("x", banana=1)
        assert pool.stats().counters["submitted"] == 0
        with pytest.raises(InvalidRequest, match="refused by the worker") as info:
            pool.generate("x", cherry=1)
        assert info.value.request_id is not None
        assert pool.generate("x").text == "served"
        assert workers(pool)[0].pid == pid  # a refused request does not cost the worker
        assert pool.stats().counters["crashes"] == 0


# ---- Stats: kill_reasons ----------------------------------------------------------------------


def test_kill_reasons_count_the_workers_signalled_by_reason() -> None:
    ladder = {"cancel_grace_s": 0.2, "term_grace_s": 0.2, "retry": RetryPolicy(max_retries=0)}
    with open_pool(workers=1, stall_timeout_s=0.3, **ladder) as pool:
        assert pool.stats().kill_reasons == {}
        with pytest.raises(DeadlineExceeded):
            pool.generate("hang", deadline_s=0.5)
        wait_counters(pool, kills=1, respawns=1)
        with pytest.raises(DeadlineExceeded):
            pool.generate("stall:1", deadline_s=10.0)
        wait_counters(pool, kills=2, respawns=2)
        assert pool.stats().kill_reasons == {"timeout": 1, "stall": 1}
    with open_pool(workers=1, deadline_s=FAR_DEADLINE_S, **ladder) as pool:
        # Emits "t0 " (so the backend is running), then ignores the flag: the cancel escalates.
        # The kill is the cancel's only if the deadline does not come first.
        assert_outlasts(pool.config, "stall:1", slack(5) + slack(5))
        future, first_chunk, _ = submit_with_chunks(pool, "stall:1")
        assert first_chunk.wait(slack(5))
        assert pool.cancel(future.request_id)
        assert future.result(timeout=slack(5)).finish_reason == "cancelled"
        wait_counters(pool, kills=1, respawns=1, cancel_escalations=1)
        assert pool.stats().kill_reasons == {"cancel": 1}


# ---- the hf backend through a pool --------------------------------------------------------------


@pytest.mark.slow
def test_hf_backend_through_a_pool(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hf backend in worker processes on the tiny model: prompt and completion token
    counts reach the Result, an unknown keyword is refused before dispatch, and each
    worker is told to use cores // workers torch threads (MODELPOOL_TORCH_THREADS, which
    hf.load applies: test_hf_backend.test_threads_come_from_the_environment)."""
    for variable in ("MODELPOOL_TORCH_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(variable, raising=False)
    config = PoolConfig(
        model=str(tiny_model_dir),
        backend="hf",
        workers=2,
        devices=["cpu"],
        startup_timeout_s=300.0,
        deadline_s=60.0,
        retry=RetryPolicy(max_retries=0),
    )
    with ModelPool(config) as pool:
        from transformers import AutoTokenizer

        expected = str(max(1, len(os.sched_getaffinity(0)) // 2))
        for worker in pool.stats().workers:
            assert worker.pid is not None
            assert psutil.Process(worker.pid).environ()["MODELPOOL_TORCH_THREADS"] == expected

        tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
        result = pool.generate("Hello", max_new_tokens=4)
        assert result.prompt_tokens == len(tokenizer("Hello")["input_ids"])
        assert result.completion_tokens == 4 and result.finish_reason == "length"
        with pytest.raises(InvalidRequest, match="max_tokens"):
            pool.generate("Hello", max_tokens=3)  # not an hf keyword
        assert pool.stats().counters["submitted"] == 1


# ---- Stats: worker states on the ladder, the latency window -------------------------------------


def test_a_worker_on_the_ladder_shows_cancelling_then_killing(
    backend_module: BackendModule,
) -> None:
    with open_pool(
        workers=1,
        backend=backend_module(IGNORES_FLAG_AND_SIGTERM),
        cancel_grace_s=1.0,
        term_grace_s=1.0,
        # Past the waits below, so that the ladder climbed is the cancel's, not a deadline's.
        deadline_s=FAR_DEADLINE_S,
    ) as pool:
        assert pool.config.deadline_s > 3 * slack(5)
        future, first_chunk, _ = submit_with_chunks(pool, "x")
        assert first_chunk.wait(slack(5))
        pid = workers(pool)[0].pid
        assert workers(pool)[0].state == "busy"
        assert pool.cancel(future.request_id)
        seen: list[str] = []

        def state_of_pid() -> str | None:
            now = next((w.state for w in workers(pool) if w.pid == pid), None)
            if now is not None and (not seen or seen[-1] != now):
                seen.append(now)
            return None if now in ("busy", "cancelling", "killing") else "gone"

        wait_until(state_of_pid, timeout=slack(5), interval=0.05, message=lambda: f"{seen}")
        assert seen[seen.index("cancelling") :] == ["cancelling", "killing"], seen
        assert future.result(timeout=slack(5)).finish_reason == "cancelled"


@pytest.mark.slow
def test_latency_percentiles_cover_the_last_2048_requests() -> None:
    slow = 25  # ~0.3 s each, more than 1% of the window: they decide p99 while in it

    def run(prompts: list[str]) -> None:
        for start in range(0, len(prompts), 2):  # one per worker: latency without queueing
            for future in [pool.submit(p) for p in prompts[start : start + 2]]:
                future.result(timeout=60)

    with open_pool(workers=2) as pool:
        run(["tokens:3:0.1"] * slow)
        run([f"echo:{i}" for i in range(2048 - slow)])
        full = pool.stats().latency_s
        assert full["p50"] is not None and full["p95"] is not None and full["p99"] is not None
        assert full["p50"] <= full["p95"] <= full["p99"]
        assert full["p99"] >= 0.3, full
        run([f"echo:{i}" for i in range(slow)])
        moved = pool.stats().latency_s  # the slow ones just left the window
        assert moved["p99"] is not None and moved["p99"] < 0.3, moved
