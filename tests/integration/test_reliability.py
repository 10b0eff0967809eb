"""Regression tests for the adversarial review's defects (one section per defect).

Each test fails on the code the review ran against and passes after the fix. Where a
defect would hang the test process itself (a deadlock, a wait with no deadline), the
scenario runs in a child interpreter with a wall-clock bound, so a regression is a
clean failure with the child's output, not a stuck suite.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_script(source: str, *, timeout: float = 120.0) -> str:
    """Run ``source`` in a fresh interpreter (cwd: the repository root); return stdout."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(source)],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=ROOT,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the scenario did not finish within {timeout}s (deadlock?): {exc.stdout!r}")
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr[-4000:]}"
    return done.stdout


# ---- 0: a signal handler or a finalizer that uses the pool -----------------------------------

POOL_SETUP = """
    import gc, os, signal, sys, time
    from modelpool import ModelPool, PoolConfig
    pool = ModelPool(PoolConfig(model="m", backend="testing", workers=2, devices=["cpu"],
                                max_queue=100_000, deadline_s=60))
    pool.start()
"""


def test_a_signal_handler_that_calls_stats_during_submits_never_deadlocks() -> None:
    out = run_script(
        POOL_SETUP
        + """
    calls, inside = [0], [False]
    def on_alarm(signum, frame):
        if inside[0]:
            return  # stats() waits, and a wait lets the next alarm in: no recursion
        inside[0] = True
        calls[0] += 1
        pool.stats()
        pool.cancel("req-unknown")
        inside[0] = False
    signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, 0.0005, 0.0005)
    futures = [pool.submit(f"echo:{i}") for i in range(4000)]
    signal.setitimer(signal.ITIMER_REAL, 0, 0)
    texts = [f.result(timeout=60).text for f in futures]
    assert texts == [f"echo:{i}"[5:] for i in range(4000)], "wrong answers"
    pool.close()
    print("handler calls", calls[0])
    """
    )
    handler_calls = int(out.split()[-1])
    assert handler_calls > 20, out  # the handler really ran during the submits


def test_a_finalizer_that_uses_the_pool_during_a_collection_never_deadlocks() -> None:
    run_script(
        POOL_SETUP
        + """
    def during_collection(phase, info):
        if phase == "start":
            pool.stats()
            stream = pool.stream("tokens:50:0.001")
            del stream  # its __del__ cancels the request: a post from inside a post
    gc.callbacks.append(during_collection)
    gc.set_threshold(50)
    futures = []
    for i in range(3000):
        futures.append(pool.submit(f"echo:{i}"))
        junk = [[] for _ in range(5)]; junk.append(junk)  # cycles: collections keep running
    gc.callbacks.remove(during_collection)
    gc.set_threshold(700)
    assert [f.result(timeout=60).text for f in futures][-1] == "2999"
    pool.close()
    print("ok")
    """
    )


# ---- 7: a forked child that uses its parent's pool -------------------------------------------


def test_a_forked_child_gets_a_typed_error_at_once_and_the_parent_pool_is_unaffected() -> None:
    out = run_script(
        POOL_SETUP
        + """
    from modelpool import PoolClosed
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:
        outcome = "no error"
        started = time.monotonic()
        try:
            pool.generate("echo:from-child", deadline_s=1)
        except PoolClosed as exc:
            outcome = "PoolClosed" if "belongs to process" in str(exc) else repr(exc)
        except BaseException as exc:
            outcome = repr(exc)
        try:
            pool.stats()
        except PoolClosed:
            outcome += " stats:PoolClosed"
        pool.close()  # must not touch the parent's workers
        os.write(write_end, f"{outcome} {time.monotonic() - started:.3f}".encode())
        os._exit(0)
    os.close(write_end)
    _, status = os.waitpid(child, 0)
    report = os.read(read_end, 4096).decode()
    print("child:", report)
    assert pool.generate("echo:parent", deadline_s=10).text == "parent"
    assert pool.stats().state == "ready"
    pool.close()
    print("parent ok")
    """
    )
    child_line = next(line for line in out.splitlines() if line.startswith("child:"))
    _, outcome, stats_outcome, seconds = child_line.split()
    assert outcome == "PoolClosed", child_line
    assert stats_outcome == "stats:PoolClosed", child_line
    assert float(seconds) < 1.0, child_line
    assert "parent ok" in out
