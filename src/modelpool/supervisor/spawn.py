"""Starting one worker process, and the handle the event loop keeps for it.

:func:`start_worker_process` runs ``modelpool.worker.process.main`` in a new interpreter (never
``multiprocessing``: see ``worker.py``) in its own session and process group, with
three inherited descriptors: its end of a socket pair (the framed channel), the memfd
``ControlBlock`` (per-slot cancel flags, progress counters) and the read end of the pool's
lifeline pipe. It is three steps: :func:`build_env`, :func:`build_command`, then the
``Popen`` and a pidfd for the exit. The event loop registers the result with its
selector and sends ``("init", spec)``.
"""

from __future__ import annotations

import collections
import itertools
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from modelpool.shared.protocol import ControlBlock, FrameDecoder, frame_pieces
from modelpool.supervisor.records import do_nothing

PACKAGE_PARENT = str(Path(__file__).resolve().parent.parent)


def usable_cpus() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def build_env(device_env: Mapping[str, str], threads_per_worker: int) -> dict[str, str]:
    """The worker's environment: ours, its devices, and one share of the CPUs."""
    env = dict(os.environ)
    env.update(device_env)
    # Appended, so that the user's own PYTHONPATH entries keep precedence in workers
    # as they have in the supervisor; ours only makes sure modelpool itself imports.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), PACKAGE_PARENT) if p)
    threads = str(threads_per_worker)
    env.setdefault("OMP_NUM_THREADS", threads)
    env.setdefault("MKL_NUM_THREADS", threads)
    env.setdefault("MODELPOOL_TORCH_THREADS", threads)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Progress bars come from the supervisor alone (preparing or downloading the model):
    # one "Loading weights" bar per worker would interleave in the daemon's log.
    env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    return env


# ``python -m`` would put the current directory first on the worker's sys.path, where a
# stray psutil.py, queue.py or transformers/ in the directory someone runs the daemon
# from would replace the real module. ``-c`` puts "" there instead, which the bootstrap
# removes before anything else is imported; the caller's own sys.path arrives with the
# "init" message, as it is.
WORKER_BOOTSTRAP = (
    "import sys\n"
    "if sys.path[:1] == ['']:\n"
    "    del sys.path[0]\n"
    "from modelpool.worker.process import main\n"
    "main()\n"
)


def build_command(channel_fd: int, control_fd: int, lifeline_fd: int) -> list[str]:
    return [
        sys.executable,
        "-c",
        WORKER_BOOTSTRAP,
        "--channel",
        str(channel_fd),
        "--control",
        str(control_fd),
        "--lifeline",
        str(lifeline_fd),
        "--supervisor-pid",
        str(os.getpid()),
    ]


def start_worker_process(
    env: Mapping[str, str],
    lifeline_fd: int,
    on_backlog: Callable[[ProcessWorkerIO], None],
    slots: int = 1,
    on_queued: Callable[[ProcessWorkerIO], None] | None = None,
) -> ProcessWorkerIO:
    """Popen the worker with its three descriptors; the parent's ends are closed on failure.
    ``on_queued``: see :class:`ProcessWorkerIO`."""
    parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        control = ControlBlock.create(slots)
    except BaseException:
        parent_sock.close()
        child_sock.close()
        raise
    command = build_command(child_sock.fileno(), control.fd, lifeline_fd)
    try:
        popen = subprocess.Popen(
            command,
            pass_fds=(child_sock.fileno(), control.fd, lifeline_fd),
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            env=dict(env),
        )
    except BaseException:
        parent_sock.close()
        control.close()
        raise
    finally:
        child_sock.close()
    parent_sock.setblocking(False)
    pidfd: int | None = None
    if hasattr(os, "pidfd_open"):
        try:
            pidfd = os.pidfd_open(popen.pid)
        except OSError:
            pidfd = None
    return ProcessWorkerIO(popen, parent_sock, control, pidfd, on_backlog, on_queued)


# Pieces handed to one sendmsg: the kernel's IOV_MAX is 1024; a frame is a few.
_SEND_PIECES = 64


class Outbox:
    """What waits to be written to a worker's socket: frames as pieces (a large payload
    the object itself, never copied into one buffer), sent with sendmsg, consumed from
    the front as the socket takes them."""

    def __init__(self) -> None:
        self._pieces: collections.deque[memoryview] = collections.deque()

    def __bool__(self) -> bool:
        return bool(self._pieces)

    def extend(self, pieces: list[bytes]) -> None:
        self._pieces.extend(memoryview(piece) for piece in pieces if piece)

    def head(self) -> list[memoryview]:
        """The first pieces, for one sendmsg."""
        return list(itertools.islice(self._pieces, _SEND_PIECES))

    def consume(self, sent: int) -> None:
        """Drop the first ``sent`` bytes (whole pieces, then the front of one)."""
        pieces = self._pieces
        while sent:
            first = pieces[0]
            if sent < len(first):
                pieces[0] = first[sent:]
                return
            sent -= len(first)
            pieces.popleft()

    def clear(self) -> None:
        self._pieces.clear()


class ProcessWorkerIO:
    """One worker process as the event loop sees it.

    With ``on_queued``, :meth:`send` only queues the frame, and tells ``on_queued`` when
    the outbox was empty: the event loop then writes every worker's outbox once per turn,
    before it waits, so the requests one turn places on a batched worker cost it one
    write (and the worker one wake-up), not one each. Without it, every send is written
    at once."""

    def __init__(
        self,
        popen: subprocess.Popen[bytes],
        sock: socket.socket,
        control: ControlBlock,
        pidfd: int | None,
        on_backlog: Callable[[ProcessWorkerIO], None],
        on_queued: Callable[[ProcessWorkerIO], None] | None = None,
    ) -> None:
        self.popen = popen
        self.pid: int | None = popen.pid
        self.sock = sock
        self.control = control
        self.pidfd = pidfd
        self.decoder = FrameDecoder()
        self.outbox = Outbox()
        self.eof = False
        self.closed = False
        self._on_backlog = on_backlog
        self._on_queued = on_queued

    def send(self, message: tuple[Any, ...]) -> None:
        was_empty = not self.outbox
        self.outbox.extend(frame_pieces(message))
        if self._on_queued is None:
            self.flush()
        elif was_empty:
            # A non-empty outbox is already queued, or waits for the socket to drain.
            self._on_queued(self)

    def flush(self) -> None:
        while self.outbox:
            try:
                sent = self.sock.sendmsg(self.outbox.head())
            except BlockingIOError:
                self._on_backlog(self)
                return
            except OSError:
                self.outbox.clear()  # The worker is gone; its exit event will follow.
                return
            self.outbox.consume(sent)

    def request_cancel(self, slot: int, attempt_id: int) -> None:
        self.control.request_cancel(slot, attempt_id)

    def progress(self) -> int:
        return self.control.progress

    def signal_group(self, signum: int) -> None:
        try:
            os.killpg(self.popen.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._on_backlog = do_nothing  # it holds the worker: break the cycle at once
        self._on_queued = None
        self.sock.close()
        self.control.close()
        if self.pidfd is not None:
            os.close(self.pidfd)
