"""Cancellation, streaming and asyncio against real worker processes."""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import sys
import threading
import time
from pathlib import Path

import pytest

from helpers import (
    FAR_DEADLINE_S,
    IGNORES_FLAG_AND_SIGTERM,
    LONG,
    LONG_TOKENS,
    UNCAPPED,
    BackendModule,
    assert_outlasts,
    counters,
    open_pool,
    pid_alive,
    settled,
    slack,
    submit_with_chunks,
    wait_busy,
    wait_counters,
    wait_idle,
    wait_pids_gone,
    wait_until,
    worker_by_pid,
    workers,
)
from modelpool import DeadlineExceeded, RetryPolicy, WorkerCrashed

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux processes")

# A backend for the streaming-crash cases: "emit2_exit" streams two chunks and dies;
# "crash_first:PATH" dies before any chunk the first time (PATH marks it), then streams.
STREAM_CRASH_BACKEND = """
import os


class Handler:
    def generate(self, call):
        command, _, argument = call.prompt.partition(":")
        if command == "emit2_exit":
            call.emit("a ")
            call.emit("b ")
            os._exit(1)
        if command == "crash_first":
            if not os.path.exists(argument):
                open(argument, "x").close()
                os._exit(1)
            call.emit("x ")
            call.emit("y ")
            return "x y "
        return call.prompt


def factory(model="", device="cpu", **options):
    return Handler()
"""

EMIT_HANG_BACKEND = IGNORES_FLAG_AND_SIGTERM

# "silent:SECONDS" reports no progress at all for SECONDS (a long prefill), then streams
# a few tokens and returns.
SILENT_BACKEND = """
import threading


class Handler:
    def generate(self, call):
        command, _, argument = call.prompt.partition(":")
        threading.Event().wait(float(argument))
        for index in range(3):
            call.emit(f"t{index} ")
        return "t0 t1 t2 "


def factory(model="", device="cpu", **options):
    return Handler()
"""


# ---- pool.cancel / future.cancel ------------------------------------------------------------


def test_pool_cancel_of_running_request_keeps_worker_warm() -> None:
    with open_pool(workers=1) as pool:
        assert_outlasts(pool.config, LONG, 5 + 5, **UNCAPPED)  # the waits before the cancel
        future, first_chunk, _ = submit_with_chunks(pool, LONG, **UNCAPPED)
        assert first_chunk.wait(5), "no chunk within 5 s"
        busy_pid = wait_busy(pool, 1)[0].pid
        before = counters(pool)

        started = time.monotonic()
        assert pool.cancel(future.request_id) is True
        result = future.result(timeout=5)
        latency = time.monotonic() - started
        print(f"pool.cancel latency: {latency * 1000:.1f} ms")

        assert result.finish_reason == "cancelled"
        assert result.text.startswith("t0 ")
        assert len(result.text.split()) < LONG_TOKENS
        assert result.request_id == future.request_id
        assert result.worker_pid == busy_pid
        assert latency < slack(0.2), latency
        assert pid_alive(busy_pid)
        idle = wait_idle(pool, 1, timeout=slack(1.0))
        assert idle[0].pid == busy_pid
        after = wait_counters(pool, cancelled=before["cancelled"] + 1)
        assert after["kills"] == before["kills"]
        assert after["cancel_escalations"] == 0
        assert after["failed"] == 0
        assert pool.cancel(future.request_id) is False, "already finished"
        assert pool.generate("pid").text == str(busy_pid)


def test_pool_cancel_of_unknown_request_is_false() -> None:
    with open_pool(workers=1) as pool:
        assert pool.cancel("req-does-not-exist") is False
        assert pool.generate("echo:x").text == "x"


def test_future_cancel_while_running() -> None:
    with open_pool(workers=1) as pool:
        assert_outlasts(pool.config, LONG, 5, **UNCAPPED)  # wait_busy, then the cancel
        future = pool.submit(LONG, **UNCAPPED)
        busy_pid = wait_busy(pool, 1)[0].pid
        started = time.monotonic()
        assert future.cancel() is True
        assert future.cancelled()
        with pytest.raises(concurrent.futures.CancelledError):
            future.result(timeout=1)
        idle = wait_idle(pool, 1, timeout=slack(1.0))
        print(f"future.cancel -> worker idle: {(time.monotonic() - started) * 1000:.1f} ms")
        assert idle[0].pid == busy_pid
        snapshot = wait_counters(pool, cancelled=1)
        assert snapshot["kills"] == 0
        assert pool.generate("pid").text == str(busy_pid)


def test_asyncio_task_cancel_reaches_the_worker() -> None:
    with open_pool(workers=1) as pool:
        assert_outlasts(pool.config, LONG, 5, **UNCAPPED)  # wait_busy, then the cancel

        async def scenario() -> float:
            task = asyncio.create_task(pool.agenerate(LONG, **UNCAPPED))
            await asyncio.sleep(0)  # let the task submit
            busy_pid = wait_busy(pool, 1)[0].pid
            started = time.monotonic()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            deadline = time.monotonic() + slack(0.5)
            while True:
                worker = worker_by_pid(pool, busy_pid)
                if worker is not None and worker.state == "idle":
                    break
                assert time.monotonic() < deadline, f"worker not idle: {workers(pool)}"
                await asyncio.sleep(0.005)
            return time.monotonic() - started

        seconds = asyncio.run(scenario())
        print(f"asyncio cancel -> worker idle: {seconds * 1000:.1f} ms")
        snapshot = wait_counters(pool, cancelled=1)
        assert snapshot["kills"] == 0
        assert snapshot["completed"] == 0


# ---- streams that stop early ----------------------------------------------------------------


def test_breaking_out_of_stream_cancels_the_request() -> None:
    with open_pool(workers=1, deadline_s=FAR_DEADLINE_S) as pool:
        # Still running when the stream is left (else it completes, not cancelled).
        assert_outlasts(pool.config, LONG, slack(1.0), **UNCAPPED)
        pid = workers(pool)[0].pid
        received = []
        for chunk in pool.stream(LONG, **UNCAPPED):
            received.append(chunk)
            if len(received) == 3:
                break
        started = time.monotonic()
        assert received == ["t0 ", "t1 ", "t2 "]
        idle = wait_idle(pool, 1, timeout=slack(1.0))
        print(f"stream break -> worker idle: {(time.monotonic() - started) * 1000:.1f} ms")
        assert idle[0].pid == pid
        snapshot = wait_counters(pool, cancelled=1)
        assert snapshot["kills"] == 0
        assert snapshot["completed"] == 0


@pytest.mark.parametrize("how", ["aclose", "break"])
def test_leaving_async_stream_cancels_the_request(how: str) -> None:
    with open_pool(workers=1, deadline_s=FAR_DEADLINE_S) as pool:
        # Still running when the stream is left (else it completes, not cancelled).
        assert_outlasts(pool.config, LONG, slack(1.0), **UNCAPPED)
        pid = workers(pool)[0].pid

        async def scenario() -> list[str]:
            received: list[str] = []
            if how == "aclose":
                stream = pool.astream(LONG, **UNCAPPED)
                async for chunk in stream:
                    received.append(chunk)
                    if len(received) == 3:
                        break
                await stream.aclose()
            else:
                async for chunk in pool.astream(LONG, **UNCAPPED):
                    received.append(chunk)
                    if len(received) == 3:
                        break
            # Stay in the loop (finalizers of abandoned async generators run here) until the
            # worker is idle again.
            deadline = time.monotonic() + slack(1.0)
            while True:
                worker = worker_by_pid(pool, pid)
                if worker is not None and worker.state == "idle":
                    return received
                assert time.monotonic() < deadline, f"worker not idle: {workers(pool)}"
                await asyncio.sleep(0.005)

        received = asyncio.run(scenario())
        assert received == ["t0 ", "t1 ", "t2 "]
        snapshot = wait_counters(pool, cancelled=1)
        assert snapshot["kills"] == 0
        assert snapshot["completed"] == 0


# ---- many cancellations ---------------------------------------------------------------------


def test_hundred_requests_cancelled_all_resolve() -> None:
    with open_pool(workers=2, max_queue=200) as pool:
        # The two running must not finish before their cancel: wait_busy, then 100 cancels.
        assert_outlasts(pool.config, LONG, 5 + 5, **UNCAPPED)
        futures = [pool.submit(LONG, **UNCAPPED) for _ in range(100)]
        wait_busy(pool, 2)
        # Newest first, so the two running ones go last and nothing queued gets dispatched
        # in between; even indices through pool.cancel, odd ones through future.cancel.
        for index in reversed(range(100)):
            future = futures[index]
            if index % 2 == 0:
                assert pool.cancel(future.request_id) is True
            else:
                assert future.cancel() is True
        # Polled with done(), not concurrent.futures.wait(): see the test below for why.
        wait_until(lambda: all(f.done() for f in futures), 5, message="all futures done")
        reached_a_worker = 0
        for index, future in enumerate(futures):
            if index % 2:
                assert future.cancelled()
                continue
            result = future.result()
            assert result.finish_reason == "cancelled"
            if result.worker_pid is not None:
                reached_a_worker += 1
        idle = wait_idle(pool, 2, timeout=slack(2.0))
        snapshot = wait_until(
            lambda: (s := pool.stats()).counters["submitted"] == 100 and settled(s) and s,
            5,
            message="completed+failed+cancelled == submitted == 100",
        )
        assert snapshot.counters["cancelled"] == 100
        assert snapshot.counters["completed"] == 0
        assert snapshot.queue_depth == 0
        served = sum(w.requests for w in idle)
        assert served <= 2 + reached_a_worker, (served, reached_a_worker)
        assert served == 2, "only the two running requests ever reached a worker"


def test_future_cancelled_while_running_is_seen_by_concurrent_futures_wait() -> None:
    # concurrent.futures.wait()/as_completed() only count a cancelled future as done once it
    # is CANCELLED_AND_NOTIFIED (set_running_or_notify_cancel); a plain Future.cancel() leaves
    # it CANCELLED, so a caller waiting on a cancelled PoolFuture would wait forever.
    with open_pool(workers=1) as pool:
        assert_outlasts(pool.config, LONG, 5, **UNCAPPED)  # wait_busy, then the cancel
        running = pool.submit(LONG, **UNCAPPED)
        queued = pool.submit(LONG, **UNCAPPED)
        wait_busy(pool, 1)
        assert running.cancel() is True
        assert queued.cancel() is True
        _, not_done = concurrent.futures.wait([running, queued], timeout=slack(2))
        assert not not_done, "cancelled futures never counted as done by wait()"
        done = set(concurrent.futures.as_completed([running, queued], timeout=slack(2)))
        assert done == {running, queued}


@pytest.mark.parametrize("prompt", ["stall:1", "emit_hang"])
def test_cancel_of_a_backend_that_ignores_the_flag_is_escalated(
    prompt: str, backend_module: BackendModule
) -> None:
    # Both emit "t0 " (so the test knows the worker is inside generate()), then block without
    # checking the cancel flag; "emit_hang" also ignores SIGTERM, so it takes SIGKILL.
    backend = "testing" if prompt.startswith("stall") else backend_module(EMIT_HANG_BACKEND)
    cancel_grace, term_grace = 0.3, 0.3
    with open_pool(
        workers=1,
        backend=backend,
        cancel_grace_s=cancel_grace,
        term_grace_s=term_grace,
        # The ladder climbed must be the cancel's: no deadline within the waits below.
        deadline_s=FAR_DEADLINE_S,
    ) as pool:
        assert pool.config.deadline_s > 5 + 5 + 5
        future, first_chunk, _ = submit_with_chunks(pool, prompt)
        assert first_chunk.wait(5)
        pid = wait_busy(pool, 1)[0].pid
        started = time.monotonic()
        assert pool.cancel(future.request_id) is True
        result = future.result(timeout=5)
        latency = time.monotonic() - started
        print(f"escalated cancel latency ({prompt}): {latency * 1000:.1f} ms")
        assert result.finish_reason == "cancelled"
        assert result.text == "t0 "
        assert cancel_grace <= latency + 0.01, "the flag is given its grace first"
        assert latency < cancel_grace + slack(0.5), latency
        wait_pids_gone([pid], timeout=term_grace + 2.0)
        idle = wait_idle(pool, 1, timeout=5)
        assert idle[0].pid != pid
        snapshot = wait_counters(pool, cancel_escalations=1, kills=1, respawns=1)
        assert snapshot["crashes"] == 0
        assert snapshot["cancelled"] == 1
        assert snapshot["failed"] == 0


# ---- stalls ---------------------------------------------------------------------------------


def test_stall_ends_the_request_long_before_its_deadline() -> None:
    # A deadline past the bound below, whatever the slack: only the stall may end it in time.
    assert slack(2.0) < FAR_DEADLINE_S
    with open_pool(
        workers=1,
        stall_timeout_s=0.3,
        deadline_s=FAR_DEADLINE_S,
        retry=RetryPolicy(max_retries=0),
    ) as pool:
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded) as info:
            pool.generate("stall:3")
        elapsed = time.monotonic() - started
        print(f"stall detected after {elapsed:.2f}s")
        assert 0.3 <= elapsed < slack(2.0), elapsed
        assert info.value.partial_text == "t0 t1 t2 "
        assert [a.outcome for a in info.value.attempts] == ["timeout"]
        snapshot = wait_counters(pool, stalls=1)
        assert snapshot["timeouts"] == 0
        wait_idle(pool, 1)


def test_silent_prefill_is_not_a_stall(backend_module: BackendModule) -> None:
    with open_pool(
        workers=1,
        backend=backend_module(SILENT_BACKEND),
        stall_timeout_s=0.3,
        deadline_s=10.0,
        retry=RetryPolicy(max_retries=0),
    ) as pool:
        result = pool.generate("silent:1.0")
        assert result.text == "t0 t1 t2 "
        assert result.finish_reason == "stop"
        assert result.latency_s >= 1.0
        snapshot = counters(pool)
        assert snapshot["stalls"] == 0
        assert snapshot["timeouts"] == 0


def test_hang_without_progress_runs_to_the_deadline_not_the_stall_timeout() -> None:
    with open_pool(
        workers=1, stall_timeout_s=0.3, deadline_s=1.0, retry=RetryPolicy(max_retries=0)
    ) as pool:
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            pool.generate("hang:term")
        elapsed = time.monotonic() - started
        assert 0.9 <= elapsed < slack(1.8), elapsed
        snapshot = wait_counters(pool, timeouts=1)
        assert snapshot["stalls"] == 0


# ---- streaming ------------------------------------------------------------------------------


def test_stream_chunks_join_to_the_generated_text() -> None:
    with open_pool(workers=2) as pool:
        chunks = list(pool.stream("tokens:20"))
        assert len(chunks) == 20
        assert "".join(chunks) == pool.generate("tokens:20").text


def test_stream_of_a_backend_that_returns_without_emitting_yields_its_text() -> None:
    # The testing backend's "echo" returns its text without emitting chunks; a stream consumer
    # (and the daemon's SSE route) must still receive the text, not an empty stream.
    with open_pool(workers=1) as pool:
        assert pool.generate("echo:hello").text == "hello"
        assert "".join(pool.stream("echo:hello")) == "hello"


def test_stream_that_yielded_is_not_retried_after_a_crash(backend_module: BackendModule) -> None:
    with open_pool(
        workers=2, backend=backend_module(STREAM_CRASH_BACKEND), retry=RetryPolicy(max_retries=2)
    ) as pool:
        received = []
        with pytest.raises(WorkerCrashed) as info:
            for chunk in pool.stream("emit2_exit"):
                received.append(chunk)
        assert received == ["a ", "b "]
        assert [a.outcome for a in info.value.attempts] == ["crash"]
        snapshot = wait_counters(pool, crashes=1, failed=1)
        assert snapshot["retries"] == 0
        wait_idle(pool, 2)


def test_stream_that_crashed_before_any_chunk_is_retried(
    tmp_path: Path, backend_module: BackendModule
) -> None:
    marker = tmp_path / "crashed"
    with open_pool(
        workers=2, backend=backend_module(STREAM_CRASH_BACKEND), retry=RetryPolicy(max_retries=2)
    ) as pool:
        received = list(pool.stream(f"crash_first:{marker}"))
        assert received == ["x ", "y "]
        assert marker.exists()
        snapshot = wait_counters(pool, crashes=1, retries=1, completed=1)
        assert snapshot["failed"] == 0


def test_stream_of_crash_once_testing_prompt_is_retried(tmp_path: Path) -> None:
    marker = tmp_path / "crashed"
    with open_pool(workers=2) as pool:
        stream = pool.stream(f"crash_once:{marker}")
        assert "".join(stream) == "ok"  # retried after the crash, not raised
        assert stream.result is not None and stream.result.attempts == 2
        snapshot = wait_counters(pool, crashes=1, retries=1, completed=1)
        assert snapshot["failed"] == 0


def test_stream_deadline_raises_after_the_chunks_it_yielded() -> None:
    with open_pool(workers=1) as pool:
        # Only the 0.3 s deadline may end it, however late it fires within the bound below.
        assert_outlasts(pool.config, LONG, slack(1.0), deadline_s=math.inf, **UNCAPPED)
        received: list[str] = []
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded) as info:
            for chunk in pool.stream(LONG, deadline_s=0.3, **UNCAPPED):
                received.append(chunk)
        assert time.monotonic() - started < slack(1.0)
        assert len(received) >= 2
        assert info.value.partial_text.startswith("".join(received))
        assert [a.outcome for a in info.value.attempts] == ["timeout"]
        wait_idle(pool, 1)


def test_astream_yields_chunks_and_raises_typed_errors() -> None:
    with open_pool(workers=1, retry=RetryPolicy(max_retries=0)) as pool:

        async def scenario() -> list[str]:
            chunks = [chunk async for chunk in pool.astream("tokens:5")]
            with pytest.raises(WorkerCrashed):
                async for _ in pool.astream("exit:4"):
                    pass
            return chunks

        assert asyncio.run(scenario()) == ["t0 ", "t1 ", "t2 ", "t3 ", "t4 "]
        wait_counters(pool, completed=1, failed=1, crashes=1)


# ---- many awaiting tasks --------------------------------------------------------------------


def test_thousands_of_awaiting_tasks_are_cheap() -> None:
    count = 3000
    with open_pool(workers=2, max_queue=count, deadline_s=60.0) as pool:
        threads_before = threading.active_count()

        async def scenario() -> tuple[list[str], int]:
            tasks = [asyncio.create_task(pool.agenerate(f"echo:{i}")) for i in range(count)]
            await asyncio.sleep(0)  # every task has submitted and awaits now
            threads_during = threading.active_count()
            results = await asyncio.gather(*tasks)
            return [r.text for r in results], threads_during

        started = time.monotonic()
        texts, threads_during = asyncio.run(scenario())
        elapsed = time.monotonic() - started
        print(
            f"{count} asyncio requests in {elapsed:.2f}s; threads {threads_before} -> "
            f"{threads_during} -> {threading.active_count()}"
        )
        assert texts == [str(i) for i in range(count)]
        assert threads_during - threads_before <= 3
        assert threading.active_count() - threads_before <= 3
        snapshot = wait_counters(pool, completed=count, submitted=count)
        assert snapshot["failed"] == 0
