"""Pool life cycle: scripts without a main guard, supervisor death, close, logs, backends."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from helpers import (
    FAR_DEADLINE_S,
    LONG,
    UNCAPPED,
    VENV_PYTHON,
    BackendModule,
    assert_outlasts,
    counters,
    describe,
    make_config,
    new_children,
    open_pool,
    pid_alive,
    slack,
    submit_with_chunks,
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
    ModelPool,
    PoolClosed,
    RetryPolicy,
    WorkerCrashed,
)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux processes")

NO_GUARD_SCRIPT = """\
from modelpool import ModelPool, PoolConfig

print("SCRIPT-START", flush=True)
config = PoolConfig(model="none", backend="testing", workers=2, devices=["cpu"], deadline_s=20)
with ModelPool(config) as pool:
    result = pool.generate("echo:hello")
    print("RESULT", result.text, flush=True)
print("SCRIPT-END", flush=True)
"""


def run_python(
    args: list[str], cwd: Path, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # the venv's editable install must be enough
    return subprocess.run(
        [VENV_PYTHON, *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
        env=env,
    )


def check_no_guard_output(proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("SCRIPT-START") == 1, proc.stdout
    assert proc.stdout.count("RESULT hello") == 1, proc.stdout
    assert proc.stdout.count("SCRIPT-END") == 1, proc.stdout


# ---- no __main__ guard -----------------------------------------------------------------------


def test_script_without_main_guard(tmp_path: Path) -> None:
    script = tmp_path / "no_guard.py"
    script.write_text(NO_GUARD_SCRIPT)
    check_no_guard_output(run_python([str(script)], cwd=tmp_path))


def test_python_dash_c(tmp_path: Path) -> None:
    check_no_guard_output(run_python(["-c", NO_GUARD_SCRIPT], cwd=tmp_path))


def test_script_on_stdin(tmp_path: Path) -> None:
    check_no_guard_output(run_python(["-"], cwd=tmp_path, stdin=NO_GUARD_SCRIPT))


# ---- the supervisor dies: test_supervisor_death.py (SIGKILL mid-load, idle and busy) ---------


ATEXIT_SCRIPT = """\
import json
from modelpool import ModelPool, PoolConfig

pool = ModelPool(PoolConfig(model="none", backend="testing", workers=2, devices=["cpu"])).start()
assert pool.generate("echo:x").text == "x"
print(json.dumps([w.pid for w in pool.stats().workers]), flush=True)
# no close(): the pool closes itself at interpreter exit
"""


def test_pool_closes_at_interpreter_exit(tmp_path: Path) -> None:
    proc = run_python(["-c", ATEXIT_SCRIPT], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    # An exit hook that raises is printed and ignored: the workers would then outlive
    # the pool until their lifeline ends them, and pass or fail the check below by a race.
    assert "Traceback" not in proc.stderr, proc.stderr
    pids = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(pids) == 2
    # close() at exit returns once the workers are reaped, so they are gone already.
    assert not any(pid_alive(pid) for pid in pids)


# ---- close ------------------------------------------------------------------------------------


def assert_clean() -> None:
    """Right after close(): no child process this test started, running or zombie (close
    reaps before it returns)."""
    left = new_children()
    assert left == [], describe(left)


def test_close_after_normal_use_leaves_no_child_and_no_zombie() -> None:
    with open_pool(workers=2) as pool:
        for i in range(20):
            assert pool.generate(f"echo:{i}").text == str(i)
        assert len(new_children()) == 2
    assert_clean()


def test_close_after_faults_leaves_no_child_and_no_zombie() -> None:
    with open_pool(
        workers=2, retry=RetryPolicy(max_retries=1), cancel_grace_s=0.2, term_grace_s=0.2
    ) as pool:
        with pytest.raises(DeadlineExceeded):
            pool.generate("hang", deadline_s=0.3)
        with pytest.raises(WorkerCrashed):
            pool.generate("segfault")
        with pytest.raises(WorkerCrashed):
            pool.generate("exit:1")
        with pytest.raises(BackendError):
            pool.generate("raise:boom")
        pool.submit("hang")  # still running at close
        wait_busy(pool, 1)
    assert_clean()


def test_close_is_idempotent_and_calls_after_close_raise_pool_closed() -> None:
    pool = ModelPool(make_config(workers=1))
    try:
        pool.start()
        pool.close()
        pool.close()
    finally:
        pool.close(drain=False)
    assert pool.stats().state == "closed"
    with pytest.raises(PoolClosed):
        pool.submit("echo:x")
    with pytest.raises(PoolClosed):
        pool.generate("echo:x")
    with pytest.raises(PoolClosed):
        pool.stream("echo:x")
    with pytest.raises(PoolClosed):
        asyncio.run(pool.agenerate("echo:x"))
    with pytest.raises(PoolClosed):
        pool.start()
    assert_clean()


def test_close_drain_lets_in_flight_requests_finish() -> None:
    with open_pool(workers=1) as pool:
        running = pool.submit("tokens:20:0.05")  # 1 s: still running at close (asserted)
        wait_busy(pool, 1)
        queued = pool.submit("echo:queued")
        assert not running.done(), "it ended before close: nothing was drained"
        started = time.monotonic()
        pool.close(drain=True, timeout=slack(10.0))
        print(f"close(drain=True) took {time.monotonic() - started:.2f}s")
        assert running.done() and queued.done()
        result = running.result()
        assert result.finish_reason == "stop"
        assert result.text == "".join(f"t{i} " for i in range(20))
        assert queued.result().text == "queued"
        assert pool.stats().counters["completed"] == 2
    assert_clean()


def test_close_without_drain_fails_in_flight_requests_promptly() -> None:
    with open_pool(workers=1, cancel_grace_s=0.3, term_grace_s=0.3) as pool:
        assert_outlasts(pool.config, LONG, 5, **UNCAPPED)  # still running at close
        running, first_chunk, _ = submit_with_chunks(pool, LONG, **UNCAPPED)
        assert first_chunk.wait(5)
        queued = pool.submit("echo:queued")
        started = time.monotonic()
        pool.close(drain=False)
        elapsed = time.monotonic() - started
        print(f"close(drain=False) took {elapsed:.2f}s")
        assert elapsed < slack(2.0), elapsed
        assert isinstance(running.exception(timeout=0), PoolClosed)
        assert isinstance(queued.exception(timeout=0), PoolClosed)
        snapshot = pool.stats()
        assert snapshot.counters["failed"] == 2
        assert snapshot.counters["completed"] == 0
    assert_clean()


def test_close_drain_timeout_fails_what_is_left() -> None:
    with open_pool(workers=1, cancel_grace_s=0.3, term_grace_s=0.3) as pool:
        # Longer than the drain, however late close() gets to end it.
        assert_outlasts(pool.config, LONG, 5 + slack(3.0), deadline_s=FAR_DEADLINE_S, **UNCAPPED)
        running = pool.submit(LONG, deadline_s=FAR_DEADLINE_S, **UNCAPPED)
        wait_busy(pool, 1)
        started = time.monotonic()
        pool.close(drain=True, timeout=0.3)
        elapsed = time.monotonic() - started
        assert 0.25 <= elapsed < slack(3.0), elapsed
        assert isinstance(running.exception(timeout=0), PoolClosed)
    assert_clean()


def test_a_worker_that_does_not_exit_when_asked_is_stopping_then_killed() -> None:
    # A worker frozen with SIGSTOP cannot read the stop message close() sends it: it shows
    # "stopping" until the ladder's stop timeout, then is killed, and close() still returns.
    with open_pool(workers=1, term_grace_s=0.2) as pool:
        frozen = wait_idle(pool, 1)[0]
        assert frozen.pid is not None
        os.kill(frozen.pid, signal.SIGSTOP)
        closer = threading.Thread(target=pool.close, kwargs={"drain": True, "timeout": 30})
        closer.start()
        try:
            wait_until(
                lambda: [w for w in workers(pool) if w.pid == frozen.pid and w.state == "stopping"],
                timeout=slack(5.0),
                message="the frozen worker shown as stopping",
            )
            closer.join(slack(30.0))
            assert not closer.is_alive(), "close() waited for a worker that never exits"
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(frozen.pid, signal.SIGCONT)
        assert not pid_alive(frozen.pid)
        assert pool.stats().kill_reasons.get("stop_timeout", 0) >= 1
    assert_clean()


# ---- back to N idle workers after each fault ---------------------------------------------------

FAULTS = [
    pytest.param("hang", DeadlineExceeded, id="hang"),
    pytest.param("segfault", WorkerCrashed, id="segfault"),
    pytest.param("exit:5", WorkerCrashed, id="exit"),
    pytest.param("raise:boom", BackendError, id="raise"),
]


@pytest.mark.parametrize(("prompt", "error"), FAULTS)
def test_pool_returns_to_n_idle_workers_after_a_fault(prompt: str, error: type) -> None:
    n = 2
    with open_pool(
        workers=n, retry=RetryPolicy(max_retries=0), cancel_grace_s=0.2, term_grace_s=0.2
    ) as pool:
        before = {w.pid for w in workers(pool)}
        with pytest.raises(error) as info:
            pool.generate(prompt, deadline_s=0.5)
        assert len(info.value.attempts) == 1
        failed_pid = info.value.attempts[0].worker_pid
        assert failed_pid in before
        idle = wait_idle(pool, n, timeout=5)
        assert all(pid_alive(w.pid) for w in idle)
        now = {w.pid for w in idle}
        if error is BackendError:
            assert now == before, "a backend exception keeps the worker"
            snapshot = counters(pool)
            assert snapshot["kills"] == snapshot["crashes"] == snapshot["respawns"] == 0
        else:
            assert failed_pid not in now
            wait_pids_gone([failed_pid], timeout=3)
            wait_counters(pool, respawns=1)
        assert pool.stats().state == "ready"
        results = [pool.submit(f"echo:{i}") for i in range(n * 4)]
        assert [f.result(timeout=10).text for f in results] == [str(i) for i in range(n * 4)]


# ---- worker logs, custom backends --------------------------------------------------------------

LOGGING_BACKEND = """
import logging

log = logging.getLogger("mp_logging_backend")


class Handler:
    def generate(self, call):
        log.warning("generating marker-GEN-%s", call.prompt)
        return "ok"


def factory(model="", device="cpu", **options):
    log.warning("factory loaded marker-LOAD")
    return Handler()
"""

VALIDATING_BACKEND = """
def validate(params):
    if "banana" in params:
        raise ValueError("banana is not a generation parameter")


class Handler:
    def generate(self, call):
        return "served:" + call.prompt


def factory(model="", device="cpu", **options):
    return Handler()
"""


def test_worker_log_lines_reach_the_supervisor_logger(
    backend_module: BackendModule, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="modelpool.worker")
    with open_pool(workers=1, backend=backend_module(LOGGING_BACKEND)) as pool:
        pid = workers(pool)[0].pid
        assert pool.generate("hello").text == "ok"
        # Log records travel on the same ordered channel as the result, so they are in.
        records = [r for r in caplog.records if r.name == "modelpool.worker"]
        messages = [r.getMessage() for r in records]
        load = [m for m in messages if "marker-LOAD" in m]
        gen = [m for m in messages if "marker-GEN-hello" in m]
        assert len(load) == 1, messages
        assert len(gen) == 1, messages
        assert "worker 0" in load[0]
        assert str(pid) in gen[0]
        assert all(r.levelno == logging.WARNING for r in records if "marker" in r.getMessage())


def test_custom_backend_validate_rejects_before_dispatch(
    backend_module: BackendModule,
) -> None:
    with open_pool(workers=1, backend=backend_module(VALIDATING_BACKEND)) as pool:
        with pytest.raises(InvalidRequest) as info:
            pool.submit("x", banana=1)
        assert "banana" in str(info.value)
        assert isinstance(info.value, ValueError)
        # The pool's own checks apply to a custom backend too.
        with pytest.raises(InvalidRequest):
            pool.submit("x", max_new_tokens=0)
        assert pool.generate("x", max_new_tokens=4).text == "served:x"
        snapshot = pool.stats()
        assert snapshot.counters["submitted"] == 1
        assert sum(w.requests for w in snapshot.workers) == 1
