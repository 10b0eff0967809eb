"""CPU release checks against real process groups (kill, reap, verify gone)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from helpers import read_line, slack, wait_until
from modelpool.shared.processes import (
    process_group_exists,
    reap_group_children,
    wait_process_group_gone,
)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux process groups")

# The leader starts a child (in its group), reports both PIDs, then blocks on stdin: no sleeps.
LEADER = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                         stdin=subprocess.PIPE)
print(f"{child.pid}", flush=True)
sys.stdin.read()
"""


def start_group() -> tuple[subprocess.Popen[str], int]:
    leader = subprocess.Popen(
        [sys.executable, "-c", LEADER],
        start_new_session=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    child_pid = int(read_line(leader))
    assert os.getpgid(child_pid) == leader.pid
    return leader, child_pid


def kill_and_reap_leader(leader: subprocess.Popen[str]) -> None:
    os.killpg(leader.pid, signal.SIGKILL)
    leader.wait(timeout=10)
    for pipe in (leader.stdin, leader.stdout):
        if pipe is not None:
            pipe.close()


def test_killed_group_is_gone_promptly(subreaper: None) -> None:
    leader, child_pid = start_group()
    assert process_group_exists(leader.pid)
    group_rss = sum(psutil.Process(pid).memory_info().rss for pid in (leader.pid, child_pid))
    assert group_rss > 1024 * 1024  # two Python interpreters
    started = time.monotonic()
    kill_and_reap_leader(leader)
    report = wait_process_group_gone(leader.pid, timeout_s=5.0, reap=True)
    elapsed = time.monotonic() - started
    assert report.ok, report.describe()
    assert report.method == "psutil"
    assert report.holders == []
    assert report.seconds < slack(1.0) and elapsed < slack(1.0), (report, elapsed)
    assert not process_group_exists(leader.pid)
    with pytest.raises(ProcessLookupError):
        os.kill(child_pid, 0)


def test_group_of_our_own_children_needs_no_reaper() -> None:
    # A new group in our session (setpgid cannot join a group of another session).
    leader = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"],
        process_group=0,
        stdin=subprocess.PIPE,
    )
    member = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"],
        process_group=leader.pid,
        stdin=subprocess.PIPE,
    )
    try:
        assert os.getpgid(member.pid) == leader.pid
        os.killpg(leader.pid, signal.SIGKILL)
        leader.wait(timeout=10)
        member.wait(timeout=10)
        report = wait_process_group_gone(leader.pid, timeout_s=1.0)
        assert report.ok and report.seconds < slack(1.0), report.describe()
    finally:
        for proc in (leader, member):
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
            assert proc.stdin is not None
            proc.stdin.close()


def test_live_group_is_reported_with_survivors(subreaper: None) -> None:
    leader, child_pid = start_group()
    try:
        report = wait_process_group_gone(leader.pid, timeout_s=0.2)
        assert not report.ok
        assert report.method == "psutil"
        assert report.seconds >= 0.2
        assert report.held_bytes is not None and report.held_bytes > 0
        described = "\n".join(report.holders)
        assert f"pid {leader.pid} " in described
        assert f"pid {child_pid} " in described
        assert "status=" in described
    finally:
        kill_and_reap_leader(leader)
        cleanup = wait_process_group_gone(leader.pid, timeout_s=10.0, reap=True)
        assert cleanup.ok, cleanup.describe()


def test_unreaped_zombie_keeps_the_group(subreaper: None) -> None:
    leader = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"],
        start_new_session=True,
        stdin=subprocess.PIPE,
    )
    os.killpg(leader.pid, signal.SIGKILL)
    try:
        # SIGKILL takes effect when the leader next runs, which on a loaded machine can be
        # later than the 0.2 s looked at below.
        wait_until(
            lambda: psutil.Process(leader.pid).status() == psutil.STATUS_ZOMBIE,
            timeout=10.0,
            message="the killed leader to become a zombie",
        )
        # Not reaped yet: a zombie still belongs to its group.
        report = wait_process_group_gone(leader.pid, timeout_s=0.2)
        assert not report.ok
        assert any(
            f"pid {leader.pid} " in line and "status=zombie" in line for line in report.holders
        ), report.holders
    finally:
        leader.wait(timeout=10)  # the owner reaps the leader
        assert leader.stdin is not None
        leader.stdin.close()
    assert reap_group_children(leader.pid) == 0
    report = wait_process_group_gone(leader.pid, timeout_s=1.0)
    assert report.ok, report.describe()


def test_refuses_our_own_or_init_group() -> None:
    with pytest.raises(ValueError):
        wait_process_group_gone(0, timeout_s=0.1)
    with pytest.raises(ValueError):
        process_group_exists(1)
