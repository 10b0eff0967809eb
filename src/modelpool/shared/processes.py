"""CPU-side process checks: a worker's own RSS, and whether a killed worker's process group is gone.

Nothing here touches a GPU or imports NVML, so the worker imports this module
(for :func:`process_rss_bytes`) and stays light.

A worker runs in its own process group. ``os.killpg(pgid, 0)`` failing with
``ProcessLookupError`` proves that no process of the group is left, zombies
included: a zombie keeps its group until it is reaped, so the group leader
must be reaped by whoever spawned it, and orphaned members by init or by a
child subreaper (see :func:`set_child_subreaper`).

Usage, after the leader has been killed and reaped::

    report = wait_process_group_gone(pgid, timeout_s=3.0)
    if not report.ok:
        log.error("left in group %d: %s", pgid, report.holders)
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Literal

import psutil

log = logging.getLogger(__name__)

MIB = 1024 * 1024

Clock = Callable[[], float]
Sleep = Callable[[float], None]
ReleaseMethod = Literal["pid", "delta", "psutil", "unavailable"]


@dataclass(frozen=True)
class ReleaseReport:
    """Outcome of a release check after a worker was killed.

    ``ok``: the memory (GPU) or the process group (CPU) is gone, or nothing
    could be verified (method "unavailable", see ``detail``).
    ``seconds``: from the start of the check to the verdict.
    ``held_bytes``: on success, what is left over (0 for "pid" and "psutil",
    the residual delta for "delta"); on failure, what is still held (None
    when unknown).
    ``method``: how the verdict was reached: "pid" (the worker's PID in the
    GPU's process list), "delta" (the GPU's used memory against a baseline),
    "psutil" (the CPU process group), or "unavailable" (nothing was verified;
    ``ok`` is True then unless NVML kept failing until the timeout).
    ``holders``: on failure, best-effort descriptions of who holds on.
    ``detail``: why a check was not verified, when it was not.
    """

    ok: bool
    seconds: float
    held_bytes: int | None
    method: ReleaseMethod
    holders: list[str] = field(default_factory=list)
    detail: str = ""

    def describe(self) -> str:
        """One line for a log message."""
        held = "?" if self.held_bytes is None else f"{self.held_bytes / MIB:.1f} MiB"
        if not self.ok:
            verdict = "NOT released"
        elif self.method == "unavailable":
            verdict = "release unverified"
        else:
            verdict = "released"
        text = f"{verdict} after {self.seconds:.3f}s (method {self.method}, held {held})"
        if self.detail:
            text += f": {self.detail}"
        if self.holders:
            text += "; holders: " + "; ".join(self.holders)
        return text


# ----------------------------------------------------------------------------- own RSS


def _page_size() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 4096


_PAGE_SIZE = _page_size()


# (pid, fd) of /proc/self/statm, kept open: every answer a worker sends carries its RSS,
# and one pread costs one system call where open, read and close cost five. The pid says
# whose file it is: a forked child opens its own.
_statm: tuple[int, int] | None = None


def process_rss_bytes() -> int:
    """RSS of the calling process: /proc/self/statm (cheap); peak RSS where there is no /proc."""
    global _statm
    try:
        pid = os.getpid()
        if _statm is None or _statm[0] != pid:
            _statm = (pid, os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC))
        return int(os.pread(_statm[1], 128, 0).split()[1]) * _PAGE_SIZE
    except (OSError, IndexError, ValueError):
        pass
    try:
        import resource
    except ImportError:
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


# ----------------------------------------------------------------------------- process groups


def _check_pgid(pgid: int) -> None:
    # killpg(0) would signal our own group and killpg(1) is meaningless here.
    if pgid <= 1:
        raise ValueError(f"refusing to act on process group {pgid}")


def process_group_exists(pgid: int) -> bool:
    """True while any process (zombies included) is in process group ``pgid``."""
    _check_pgid(pgid)
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def group_members(pgid: int) -> list[psutil.Process]:
    """The processes in group ``pgid`` now (zombies included), as psutil sees them."""
    members: list[psutil.Process] = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid:
                members.append(proc)
        except OSError:  # gone meanwhile (ProcessLookupError) or not ours to ask
            continue
    return members


def _rss(proc: psutil.Process) -> int:
    try:
        return int(proc.memory_info().rss)
    except (psutil.Error, OSError):
        return 0  # zombies have none; vanished processes neither


def _describe_member(proc: psutil.Process) -> str:
    try:
        status = proc.status()
    except psutil.ZombieProcess:
        status = "zombie"
    except (psutil.Error, OSError):
        status = "?"
    try:
        name = proc.name()
    except (psutil.Error, OSError):
        name = "?"
    return f"pid {proc.pid} ({name}) status={status}"


def started_by(pid: int, candidates: Collection[int]) -> int | None:
    """The one of ``candidates`` that ``pid`` descends from (a worker that started it,
    in its process group or not), or None; None too when ``pid`` is gone."""
    try:
        for parent in psutil.Process(pid).parents():
            if parent.pid in candidates:
                return int(parent.pid)
    except (psutil.Error, OSError):
        return None
    return None


def describe_process(pid: int) -> str:
    """ "pid N (name) status=S", as far as it can be read."""
    try:
        return _describe_member(psutil.Process(pid))
    except (psutil.Error, OSError):
        return f"pid {pid} (gone)"


def reap_group_children(pgid: int) -> int:
    """Reap our own exited children in group ``pgid``; returns how many were reaped.

    Only call it once the group leader's exit status has been collected by
    its owner (``Popen.wait``, ``Process.join``): it would steal it otherwise.
    """
    _check_pgid(pgid)
    reaped = 0
    while True:
        try:
            pid, _status = os.waitpid(-pgid, os.WNOHANG)
        except ChildProcessError:
            return reaped
        if pid == 0:
            return reaped
        reaped += 1


def wait_process_group_gone(
    pgid: int,
    *,
    timeout_s: float,
    poll_s: float = 0.005,
    reap: bool = False,
    clock: Clock = time.monotonic,
    sleep: Sleep = time.sleep,
) -> ReleaseReport:
    """Block until no process (zombies included) is left in group ``pgid``, or timeout.

    Reap the group leader first: its zombie keeps the group alive. Orphaned
    members are reaped by init (some container inits take seconds) or by a
    child subreaper; with ``reap=True`` this call reaps those that are our
    own children (see :func:`set_child_subreaper`, :func:`reap_group_children`).
    On timeout the report (method "psutil") lists the survivors (pid, name,
    status) and their summed RSS.
    """
    _check_pgid(pgid)
    started = clock()
    deadline = started + timeout_s
    while True:
        if reap:
            reap_group_children(pgid)
        if not process_group_exists(pgid):
            return ReleaseReport(True, max(0.0, clock() - started), 0, "psutil")
        if clock() >= deadline:
            break
        sleep(max(0.0, min(poll_s, deadline - clock())))
    members = group_members(pgid)
    if not members and not process_group_exists(pgid):
        return ReleaseReport(True, max(0.0, clock() - started), 0, "psutil")
    holders = [_describe_member(proc) for proc in members] or [
        f"process group {pgid} still exists (members not visible)"
    ]
    report = ReleaseReport(
        ok=False,
        seconds=max(0.0, clock() - started),
        held_bytes=sum(_rss(proc) for proc in members),
        method="psutil",
        holders=holders,
    )
    log.warning("process group %d: %s", pgid, report.describe())
    return report


_PR_SET_CHILD_SUBREAPER = 36


def set_child_subreaper(enabled: bool = True) -> bool:
    """Make this process the reaper of its orphaned descendants (Linux); False if not possible.

    With it, the members of a killed worker's group become our zombies
    instead of init's, and ``wait_process_group_gone(..., reap=True)`` can
    clear them at once instead of waiting on init. The pool itself does not
    call it: it would change how the host application's own orphans are reaped.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        result = libc.prctl(_PR_SET_CHILD_SUBREAPER, 1 if enabled else 0, 0, 0, 0)
    except (OSError, AttributeError):
        return False
    return int(result) == 0


__all__ = [
    "ReleaseReport",
    "group_members",
    "process_group_exists",
    "process_rss_bytes",
    "reap_group_children",
    "set_child_subreaper",
    "wait_process_group_gone",
]
