"""Core pool behaviour against real worker processes (testing backend unless stated)."""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from helpers import (
    FAR_DEADLINE_S,
    LONG,
    UNCAPPED,
    BackendModule,
    assert_documented_stats_keys,
    assert_no_children,
    assert_outlasts,
    counters,
    make_config,
    open_pool,
    pid_alive,
    slack,
    wait_busy,
    wait_counters,
    wait_idle,
    wait_pids_gone,
    wait_until,
    workers,
)
from modelpool import (
    BackendError,
    DeadlineExceeded,
    InvalidRequest,
    ModelLoadFailed,
    ModelPool,
    PoolConfig,
    PoolOverloaded,
    RetryPolicy,
    WorkerCrashed,
)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux processes")


# ---- normal generation ----------------------------------------------------------------------


def test_submit_returns_future_with_request_id_and_result_fields() -> None:
    with open_pool(workers=2) as pool:
        pids = {w.pid for w in workers(pool)}
        future = pool.submit("tokens:5")
        assert isinstance(future, concurrent.futures.Future)
        assert isinstance(future.request_id, str) and future.request_id
        result = future.result(timeout=10)
        assert result.request_id == future.request_id
        assert result.text == "t0 t1 t2 t3 t4 "
        assert result.finish_reason == "stop"
        assert result.attempts == 1
        assert result.worker_pid in pids
        assert pid_alive(result.worker_pid)
        assert result.latency_s >= result.queue_s >= 0
        assert result.completion_tokens == 5

        other = pool.submit("echo:x")
        assert other.request_id != future.request_id
        assert other.result(timeout=10).text == "x"


def test_generate_length_and_chat_prompt() -> None:
    with open_pool(workers=1) as pool:
        limited = pool.generate("tokens:50", max_new_tokens=3)
        assert limited.text == "t0 t1 t2 "
        assert limited.finish_reason == "length"
        chat = pool.generate(
            [{"role": "system", "content": "x"}, {"role": "user", "content": "echo:hi"}]
        )
        assert chat.text == "hi"
        snapshot = pool.stats()
        assert snapshot.counters["submitted"] == 2
        assert snapshot.counters["completed"] == 2
        assert sum(w.requests for w in snapshot.workers) == 2
        assert snapshot.state == "ready"


@pytest.mark.parametrize("batch", [1, 4])
def test_result_names_the_stop_string_that_ended_it(batch: int) -> None:
    with open_pool(workers=1, max_batch_size=batch) as pool:
        stopped = pool.generate("tokens:9", stop=["zz", "t3", "t2"])
        assert (stopped.text, stopped.finish_reason) == ("t0 t1 ", "stop")
        assert stopped.stop_sequence == "t2"
        echoed = pool.generate("echo:one. two", stop=".")
        assert (echoed.text, echoed.stop_sequence) == ("one", ".")
        plain = pool.generate("tokens:3", stop=["zz"])
        assert (plain.finish_reason, plain.stop_sequence) == ("stop", None)
        assert pool.generate("tokens:9", max_new_tokens=2, stop=["t5"]).stop_sequence is None


# ---- hangs and deadlines --------------------------------------------------------------------


def test_hang_ends_in_deadline_exceeded_within_deadline() -> None:
    with open_pool(workers=2, cancel_grace_s=0.2, term_grace_s=0.2) as pool:
        deadline = 0.5
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded) as info:
            pool.generate("hang", deadline_s=deadline)
        elapsed = time.monotonic() - started
        assert isinstance(info.value, TimeoutError)
        assert elapsed < deadline + slack(0.5), elapsed
        assert [a.outcome for a in info.value.attempts] == ["timeout"]
        pid = info.value.attempts[0].worker_pid
        assert pid is not None
        wait_pids_gone([pid], timeout=0.2 + 0.2 + 1.0 + 1.0)
        wait_idle(pool, 2)
        wait_counters(pool, kills=1, timeouts=1, failed=1, crashes=0, respawns=1)


@pytest.mark.parametrize(
    ("prompt", "error_type", "outcome"),
    [
        ("hang", DeadlineExceeded, "timeout"),
        ("segfault", WorkerCrashed, "crash"),
        ("raise:boom", BackendError, "error"),
    ],
)
def test_an_error_names_its_request_and_each_attempt(
    prompt: str, error_type: type[Exception], outcome: str
) -> None:
    """The docs, Errors: every error carries the request's id and its attempts, each with the
    worker's pid, the outcome and how long it ran."""
    with open_pool(workers=2, retry=RetryPolicy(max_retries=0), deadline_s=0.5) as pool:
        pids = {w.pid for w in workers(pool)}
        other = pool.submit("echo:other")  # a second id, so a mix-up would show
        future = pool.submit(prompt)
        started = time.monotonic()
        error = future.exception(timeout=slack(5))
        elapsed = time.monotonic() - started
        assert isinstance(error, error_type), repr(error)
        assert error.request_id == future.request_id != other.request_id
        [attempt] = error.attempts
        assert attempt.outcome == outcome
        assert attempt.worker_pid in pids
        assert 0 < attempt.seconds <= elapsed + 0.05
        if outcome == "timeout":
            assert attempt.seconds >= 0.5 - 0.05, "a timeout attempt ran to its deadline"
        assert other.result(timeout=5).request_id == other.request_id


def test_hang_with_attempt_timeout_retries_once_then_kills_both() -> None:
    cancel_grace, term_grace = 0.2, 0.2
    with open_pool(
        workers=2,
        attempt_timeout_s=0.4,
        cancel_grace_s=cancel_grace,
        term_grace_s=term_grace,
        retry=RetryPolicy(max_retries=1),
    ) as pool:
        deadline = 3.0
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded) as info:
            pool.generate("hang", deadline_s=deadline)
        elapsed = time.monotonic() - started
        # Two attempts of ~0.4 s each, not the whole deadline.
        assert elapsed < min(deadline, slack(2.0)), elapsed
        attempts = info.value.attempts
        assert [a.outcome for a in attempts] == ["timeout", "timeout"]
        pids = [a.worker_pid for a in attempts]
        assert None not in pids
        assert pids[0] != pids[1], "a retry must not land on the worker that just failed"
        wait_pids_gone(pids, timeout=cancel_grace + term_grace + 1.0 + 1.0)  # +1 s load slack
        idle = wait_idle(pool, 2)
        assert not {w.pid for w in idle} & set(pids)
        wait_counters(pool, kills=2, timeouts=2, retries=1, failed=1, crashes=0)


def test_deadline_on_a_cooperative_backend_keeps_the_worker_warm() -> None:
    with open_pool(workers=1) as pool:
        pid = workers(pool)[0].pid
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded) as info:
            # Uncapped: the generation default ended it in 1.28 s, a deadline that came
            # that late on a busy machine found it finished.
            pool.generate(LONG, deadline_s=0.3, **UNCAPPED)
        assert time.monotonic() - started < slack(0.8)
        assert info.value.partial_text.startswith("t0 t1 ")
        assert [a.outcome for a in info.value.attempts] == ["timeout"]
        idle = wait_idle(pool, 1, timeout=2)
        assert idle[0].pid == pid, "a worker that stopped at the flag stays warm"
        snapshot = wait_counters(pool, timeouts=1, failed=1)
        assert snapshot["kills"] == 0
        assert snapshot["respawns"] == 0
        assert pool.generate("pid").text == str(pid)


def test_cooperative_attempt_timeout_is_retried_on_another_warm_worker() -> None:
    with open_pool(
        workers=2, attempt_timeout_s=0.3, retry=RetryPolicy(max_retries=1), deadline_s=5.0
    ) as pool:
        pids = {w.pid for w in workers(pool)}
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded) as info:
            pool.generate(LONG, **UNCAPPED)  # every attempt runs to its timeout
        assert time.monotonic() - started < slack(2.0)
        attempts = info.value.attempts
        assert [a.outcome for a in attempts] == ["timeout", "timeout"]
        assert {a.worker_pid for a in attempts} == pids
        idle = wait_idle(pool, 2, timeout=2)
        assert {w.pid for w in idle} == pids
        snapshot = wait_counters(pool, timeouts=2, retries=1, failed=1)
        assert snapshot["kills"] == 0


def test_single_worker_hang_is_retried_on_the_replacement() -> None:
    # One slot: the hung worker is killed and replaced; the replacement is "another worker",
    # and 4+ s of deadline plus one retry remain, so the request must get its second attempt.
    # The deadline is scaled like any bound: on a busy machine the replacement can take
    # seconds to start, and the second attempt's timeout, not the deadline, ends the test.
    with open_pool(
        workers=1,
        attempt_timeout_s=0.3,
        cancel_grace_s=0.2,
        term_grace_s=0.2,
        retry=RetryPolicy(max_retries=1),
        deadline_s=slack(5.0),
    ) as pool:
        with pytest.raises(DeadlineExceeded) as info:
            pool.generate("hang")
        attempts = info.value.attempts
        assert [a.outcome for a in attempts] == ["timeout", "timeout"], attempts
        assert attempts[0].worker_pid != attempts[1].worker_pid


def test_request_that_times_out_in_the_queue() -> None:
    with open_pool(workers=1, deadline_s=FAR_DEADLINE_S) as pool:
        # The worker stays busy until the test cancels it: through wait_busy and the bound.
        assert_outlasts(pool.config, LONG, 5 + slack(0.8), **UNCAPPED)
        busy = pool.submit(LONG, **UNCAPPED)
        wait_busy(pool, 1)
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded) as info:
            pool.generate("echo:late", deadline_s=0.3)
        elapsed = time.monotonic() - started
        assert 0.25 <= elapsed < slack(0.8), elapsed
        assert info.value.attempts == []
        assert pool.cancel(busy.request_id)
        assert busy.result(timeout=5).finish_reason == "cancelled"
        wait_counters(pool, timeouts=1, failed=1, cancelled=1)
        assert sum(w.requests for w in pool.stats().workers) == 1


def test_backend_error_is_not_retried_by_default_and_keeps_the_traceback() -> None:
    with open_pool(workers=2) as pool:
        pids = {w.pid for w in workers(pool)}
        with pytest.raises(BackendError) as info:
            pool.generate("raise:kaboom")
        assert "kaboom" in str(info.value)
        assert "RuntimeError: kaboom" in info.value.remote_traceback
        assert "Traceback" in info.value.remote_traceback
        assert [a.outcome for a in info.value.attempts] == ["error"]
        assert {w.pid for w in wait_idle(pool, 2)} == pids
        snapshot = counters(pool)
        assert snapshot["retries"] == snapshot["kills"] == snapshot["crashes"] == 0


def test_backend_error_is_retried_when_the_policy_says_so() -> None:
    with open_pool(workers=2, retry=RetryPolicy(max_retries=2, on=("error",))) as pool:
        with pytest.raises(BackendError) as info:
            pool.generate("raise:kaboom")
        attempts = info.value.attempts
        assert [a.outcome for a in attempts] == ["error"] * 3
        assert all(a.worker_pid != b.worker_pid for a, b in itertools.pairwise(attempts))
        wait_counters(pool, retries=2, failed=1)


def test_stats_dict_has_the_documented_keys() -> None:
    with open_pool(workers=2) as pool:
        pool.generate("echo:x")
        data = pool.stats().to_dict()
        json.dumps(data)
        assert_documented_stats_keys(data)
        assert data["state"] == "ready"
        assert data["queue_depth"] == 0
        assert len(data["workers"]) == 2
        for worker in data["workers"]:
            assert worker["state"] == "idle" and worker["role"] == "serving"
            assert worker["device"] == "cpu" and worker["rss_mb"] > 0
        assert data["counters"]["completed"] == data["counters"]["submitted"] == 1
        assert data["latency_s"]["p50"] > 0
        assert data["uptime_s"] > 0
        assert data["last_load_error"] is None and data["kill_reasons"] == {}


# ---- crashes and retries --------------------------------------------------------------------


def test_transient_crash_succeeds_on_retry(tmp_path: Path) -> None:
    marker = tmp_path / "crashed-once"
    with open_pool(workers=2) as pool:
        result = pool.generate(f"crash_once:{marker}")
        assert result.text == "ok"
        assert result.finish_reason == "stop"
        assert result.attempts == 2
        assert marker.exists()
        snapshot = counters(pool)
        assert snapshot["crashes"] == 1
        assert snapshot["retries"] == 1
        assert snapshot["completed"] == 1
        assert snapshot["failed"] == 0
        assert snapshot["kills"] == 0
        wait_idle(pool, 2)
        wait_counters(pool, respawns=1)


@pytest.mark.parametrize(
    ("prompt", "exit_code", "words"),
    [("segfault", -signal.SIGSEGV, "SIGSEGV"), ("exit:3", 3, "code 3")],
)
def test_poison_request_stops_after_max_retries(prompt: str, exit_code: int, words: str) -> None:
    max_retries = 2
    with open_pool(workers=2, retry=RetryPolicy(max_retries=max_retries)) as pool:
        with pytest.raises(WorkerCrashed) as info:
            pool.generate(prompt)
        error = info.value
        assert [a.outcome for a in error.attempts] == ["crash"] * (max_retries + 1)
        pids = [a.worker_pid for a in error.attempts]
        assert all(pid is not None for pid in pids)
        assert len(set(pids)) == max_retries + 1, "each attempt on a different worker"
        assert words in str(error), str(error)
        assert error.exit_code == exit_code
        wait_idle(pool, 2)
        wait_counters(
            pool,
            crashes=max_retries + 1,
            retries=max_retries,
            failed=1,
            kills=0,
            respawns=max_retries + 1,
        )
        assert pool.generate("echo:alive").text == "alive"


def test_normal_requests_succeed_beside_crashes() -> None:
    threads_n, per_thread, crash_n = 8, 50, 5
    with open_pool(workers=2, retry=RetryPolicy(max_retries=0), deadline_s=30.0) as pool:
        errors: list[BaseException] = []
        crash_errors: list[BaseException] = []
        go = threading.Barrier(threads_n + 1)

        def normal(thread_index: int) -> None:
            go.wait()
            for i in range(per_thread):
                text = f"{thread_index}-{i}"
                try:
                    result = pool.generate(f"echo:{text}")
                    if result.text != text:
                        errors.append(AssertionError(f"{result.text!r} != {text!r}"))
                except BaseException as exc:
                    errors.append(exc)

        def crasher() -> None:
            go.wait()
            for _ in range(crash_n):
                try:
                    pool.generate("exit:1")
                except WorkerCrashed as exc:
                    crash_errors.append(exc)

        threads = [threading.Thread(target=normal, args=(i,)) for i in range(threads_n)]
        threads.append(threading.Thread(target=crasher))
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
            assert not thread.is_alive()
        assert errors == []
        assert len(crash_errors) == crash_n
        wait_idle(pool, 2)
        snapshot = wait_counters(pool, crashes=crash_n, failed=crash_n)
        assert snapshot["completed"] == threads_n * per_thread
        assert snapshot["submitted"] == threads_n * per_thread + crash_n


# ---- validation before dispatch -------------------------------------------------------------

INVALID_CALLS = [
    pytest.param((123,), {}, id="prompt-int"),
    pytest.param((None,), {}, id="prompt-none"),
    pytest.param((b"echo:x",), {}, id="prompt-bytes"),
    pytest.param(([],), {}, id="prompt-empty-list"),
    pytest.param(([{"role": "user"}],), {}, id="prompt-message-without-content"),
    pytest.param(([{"role": "user", "content": 3}],), {}, id="prompt-content-int"),
    pytest.param((["echo:x"],), {}, id="prompt-list-of-str"),
    pytest.param(("echo:x",), {"deadline_s": 0}, id="deadline-0"),
    pytest.param(("echo:x",), {"deadline_s": -1}, id="deadline-negative"),
    pytest.param(("echo:x",), {"max_new_tokens": 0}, id="max_new_tokens-0"),
    pytest.param(("echo:x",), {"max_new_tokens": -1}, id="max_new_tokens-negative"),
    pytest.param(("echo:x",), {"max_new_tokens": True}, id="max_new_tokens-bool"),
    pytest.param(("echo:x",), {"max_new_tokens": "3"}, id="max_new_tokens-str"),
    pytest.param(("echo:x",), {"temperature": -1}, id="temperature-negative"),
    pytest.param(("echo:x",), {"top_p": 0}, id="top_p-0"),
    pytest.param(("echo:x",), {"top_p": 1.5}, id="top_p-1.5"),
    pytest.param(("echo:x",), {"frobnicate": 1}, id="unknown-kwarg"),
]


@pytest.fixture(scope="module")
def shared_pool() -> Iterator[ModelPool]:
    """One pool for every invalid call below (each checks it was left untouched)."""
    with open_pool(workers=2) as pool:
        yield pool


@pytest.mark.parametrize(("args", "kwargs"), INVALID_CALLS)
def test_invalid_input_never_reaches_a_worker(
    shared_pool: ModelPool, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    pool = shared_pool
    before = pool.stats()
    before_requests = {w.pid: w.requests for w in before.workers}
    for call in (pool.submit, pool.generate, pool.stream):
        with pytest.raises(InvalidRequest) as info:
            call(*args, **kwargs)
        assert isinstance(info.value, ValueError)
    # A valid request afterwards is the only one counted and the only one served.
    assert pool.generate("echo:ok").text == "ok"
    after = pool.stats()
    assert after.counters["submitted"] == before.counters["submitted"] + 1
    assert sum(w.requests for w in after.workers) == sum(before_requests.values()) + 1
    assert {w.pid for w in after.workers} == set(before_requests)


# ---- spares, idle deaths --------------------------------------------------------------------


def test_spare_is_promoted_at_once_after_a_crash() -> None:
    with open_pool(workers=1, spares=1, retry=RetryPolicy(max_retries=0)) as pool:
        snapshot = workers(pool)
        assert sorted(w.state for w in snapshot) == ["idle", "spare"]
        serving_pid = next(w.pid for w in snapshot if w.state == "idle")
        spare_pid = next(w.pid for w in snapshot if w.state == "spare")
        assert pool.generate("pid").text == str(serving_pid), "a spare must not serve"

        with pytest.raises(WorkerCrashed):
            pool.generate("exit:1")
        result = pool.generate("pid")
        assert result.text == str(spare_pid)
        assert result.worker_pid == spare_pid
        # Served by an already-warm process: no start-up in the queue time.
        assert result.queue_s < slack(0.5), result.queue_s

        def new_spare() -> bool:
            now = workers(pool)
            return any(
                w.state == "spare" and w.pid not in (serving_pid, spare_pid) for w in now
            ) and any(w.state == "idle" and w.pid == spare_pid for w in now)

        wait_until(new_spare, 10, message=lambda: f"a new spare (now {workers(pool)})")
        assert not pid_alive(serving_pid)
        wait_counters(pool, crashes=1, respawns=1)


def test_idle_worker_death_is_just_a_respawn() -> None:
    with open_pool(workers=2) as pool:
        victim = workers(pool)[0].pid
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        wait_counters(pool, respawns=1, crashes=1)
        idle = wait_idle(pool, 2)
        assert victim not in {w.pid for w in idle}
        assert pool.generate("echo:fine").text == "fine"
        snapshot = counters(pool)
        assert snapshot["failed"] == 0
        assert snapshot["kills"] == 0


# ---- backpressure ---------------------------------------------------------------------------


def test_backpressure_raises_pool_overloaded_at_once() -> None:
    with open_pool(workers=1, max_queue=1) as pool:
        # The worker stays busy until the test cancels it (else "queued" runs and there is room).
        assert_outlasts(pool.config, LONG, 5 + slack(0.1), **UNCAPPED)
        busy = pool.submit(LONG, **UNCAPPED)
        wait_busy(pool, 1)
        queued = pool.submit("echo:queued")
        started = time.monotonic()
        with pytest.raises(PoolOverloaded):
            pool.submit("echo:too-many")
        assert time.monotonic() - started < slack(0.1)
        assert counters(pool)["overloaded"] == 1
        assert not queued.done()
        assert pool.cancel(busy.request_id)
        assert busy.result(timeout=5).finish_reason == "cancelled"
        assert queued.result(timeout=5).text == "queued"
        # Room again once the queue drained.
        assert pool.generate("echo:again").text == "again"


# ---- start-up failures ----------------------------------------------------------------------


def start_fails(pool: ModelPool) -> tuple[ModelLoadFailed, float]:
    """Start ``pool``, which must fail with ModelLoadFailed; the error and the seconds it
    took. The pool is closed either way, so no worker outlives a test that went wrong."""
    started = time.monotonic()
    try:
        with pytest.raises(ModelLoadFailed) as info:
            pool.start()
        return info.value, time.monotonic() - started
    finally:
        pool.close(drain=False, timeout=5.0)


@pytest.mark.parametrize("limit", [1, 3])
@pytest.mark.parametrize(
    ("options", "shown"),
    [({"fail_load": "boom"}, "boom"), ({"exit_on_load": 7}, "code 7")],
    ids=["raises", "exits"],
)
def test_model_load_failed_after_exactly_n_startup_failures_with_backoff(
    options: dict[str, Any], shown: str, limit: int
) -> None:
    """The docs: a worker that dies during start-up is respawned with exponential backoff
    (0.25 s, 0.5 s, ...); after startup_failures_before_giving_up in a row, the pool
    fails with ModelLoadFailed carrying the worker's traceback."""
    pool = ModelPool(
        make_config(workers=1, startup_failures_before_giving_up=limit, backend_options=options)
    )
    error, elapsed = start_fails(pool)
    assert f"failed to start {limit} times in a row" in str(error)
    assert shown in error.worker_traceback or shown in str(error)
    backoff = sum(0.25 * 2**i for i in range(limit - 1))  # between the failures
    assert backoff <= elapsed < backoff + slack(10), elapsed
    snapshot = pool.stats()
    assert snapshot.counters["startup_failures"] == limit
    assert snapshot.last_load_error is not None and shown in snapshot.last_load_error
    assert_no_children()


FAIL_FIRST_LOAD = """
import os

class Handler:
    def generate(self, call):
        return "up"

def factory(model="", device="cpu", marker="", **options):
    if not os.path.exists(marker):
        open(marker, "w").close()
        raise RuntimeError("first load fails on purpose")
    return Handler()
"""


def test_a_transient_startup_failure_below_the_limit_recovers(
    tmp_path: Path, backend_module: BackendModule
) -> None:
    config = make_config(
        workers=1,
        backend=backend_module(FAIL_FIRST_LOAD),
        backend_options={"marker": str(tmp_path / "loaded-once")},
        startup_failures_before_giving_up=3,
    )
    with ModelPool(config) as pool:
        assert pool.generate("x").text == "up"
        snapshot = pool.stats()
        assert snapshot.state == "ready"
        assert snapshot.counters["startup_failures"] == 1
        assert snapshot.last_load_error is not None
        assert "first load fails on purpose" in snapshot.last_load_error


def test_missing_model_path_with_hf_backend() -> None:
    config = PoolConfig(
        model="/nonexistent/model",
        backend="hf",
        workers=1,
        devices=("cpu",),
        startup_timeout_s=60.0,
    )
    pool = ModelPool(config)
    error, elapsed = start_fails(pool)
    # Found by the preflight, before any worker imports torch (tests/integration/
    # test_preflight.py has the other model-source mistakes).
    assert elapsed < slack(0.5), elapsed
    assert "model directory '/nonexistent/model' does not exist" in str(error)
    assert pool.stats().counters["startup_failures"] == 0
    assert_no_children()


def test_no_worker_processes_outlive_a_pool() -> None:
    with open_pool(workers=2) as pool:
        pids = [w.pid for w in workers(pool)]
        assert all(pid is not None and psutil.pid_exists(pid) for pid in pids)
    wait_pids_gone(pids, 5)
    assert_no_children()
