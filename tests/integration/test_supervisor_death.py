"""Workers die with their supervisor.

A child process owns a pool and is SIGKILLed: mid-load (workers still in the
backend's ``load_delay_s``), once idle, and while busy on a request that ignores
SIGTERM. Every worker, found beforehand as the child's children with psutil,
must be gone within 1 s of the kill, times the machine slack (the lifeline pipe
reads EOF the moment the kernel closes the dead supervisor's end).

(When the dispatcher *thread* dies inside a living supervisor:
test_pool_robustness.py.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from helpers import pid_alive, read_line, slack, wait_until

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux processes")

WORKERS, SPARES = 2, 1
GONE_WITHIN_S = 1.0  # the design figure; asserted with the machine slack

OWNER = textwrap.dedent(f"""
    import sys, threading, time
    from modelpool import ModelPool, PoolConfig

    mode, load_delay = sys.argv[1], float(sys.argv[2])
    pool = ModelPool(PoolConfig(
        model="none", backend="testing", workers={WORKERS}, spares={SPARES}, devices=["cpu"],
        backend_options={{"load_delay_s": load_delay}}, startup_timeout_s=120.0,
        deadline_s=600.0,
    ))
    if mode == "loading":
        threading.Thread(target=pool.start, daemon=True).start()
        print("spawning", flush=True)
    else:
        pool.start()
        if mode == "busy":
            futures = [pool.submit("hang", deadline_s=600.0) for _ in range({WORKERS})]
            while sum(w.state == "busy" for w in pool.stats().workers) < {WORKERS}:
                time.sleep(0.01)
        print("ready", flush=True)
    threading.Event().wait()
""")


def worker_children(owner_pid: int) -> list[psutil.Process]:
    try:
        children = psutil.Process(owner_pid).children()
    except psutil.NoSuchProcess:
        return []
    found = []
    for child in children:
        try:
            if "modelpool.worker" in " ".join(child.cmdline()):
                found.append(child)
        except psutil.Error:
            continue
    return found


def lifeline_running(proc: psutil.Process) -> bool:
    """The worker runs its lifeline thread (a second thread): it is past its start-up
    checks and would notice its supervisor's death."""
    try:
        return proc.num_threads() >= 2
    except psutil.Error:
        return False


def reap(pids: list[int]) -> list[int]:
    """Collect the exit of each of ``pids`` that is our child (we are their subreaper);
    returns those still running, which may become our zombies later."""
    running = []
    for pid in pids:
        try:
            reaped, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            continue  # not ours, or already collected
        if reaped == 0:
            running.append(pid)
    return running


def kill_owner_and_time_workers(mode: str, load_delay_s: float) -> float:
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, mode, str(load_delay_s)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
    )
    pids: list[int] = []
    try:
        line = read_line(owner)
        assert line == ("spawning" if mode == "loading" else "ready"), line
        workers = wait_until(
            lambda: (
                found
                if len(found := worker_children(owner.pid)) == WORKERS + SPARES
                and all(lifeline_running(w) for w in found)
                else None
            ),
            timeout=30.0,
            message=lambda: f"{WORKERS + SPARES} workers of pid {owner.pid}",
        )
        pids = [w.pid for w in workers]
        if mode == "loading":
            # Still inside load_delay_s, so none can have finished loading: killed mid-load.
            ages = [time.time() - w.create_time() for w in workers]
            assert max(ages) < load_delay_s, ages
        started = time.monotonic()
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=10)

        def all_gone() -> bool:
            reap(pids)
            return not any(pid_alive(pid) for pid in pids)

        wait_until(
            all_gone,
            timeout=10.0,
            interval=0.002,
            message=lambda: f"workers {[p for p in pids if pid_alive(p)]} gone",
        )
        return time.monotonic() - started
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait(timeout=10)
        for pid in pids:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        # Until each is collected: one that died after an earlier reap() would otherwise stay
        # our zombie and be counted as a leftover by the next test.
        wait_until(lambda: not reap(pids), timeout=5.0, message="the orphaned workers reaped")
        if owner.stdout is not None:
            owner.stdout.close()


@pytest.mark.parametrize(
    ("mode", "load_delay_s"),
    [("loading", 60.0), ("idle", 0.0), ("busy", 0.0)],
    ids=["mid-load", "idle", "busy-ignoring-SIGTERM"],
)
def test_workers_die_with_a_sigkilled_supervisor(
    subreaper: None, mode: str, load_delay_s: float
) -> None:
    elapsed = kill_owner_and_time_workers(mode, load_delay_s)
    assert elapsed < slack(GONE_WITHIN_S), f"workers outlived their supervisor by {elapsed:.3f}s"
