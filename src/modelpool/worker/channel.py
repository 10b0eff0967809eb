"""The worker's end of its channel to the supervisor: a Unix socket of framed pickles
(``protocol.encode_frame``), read with an optional short poll and written under a lock,
several frames gathered into one write where a step ends."""

from __future__ import annotations

import contextlib
import os
import select
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

from modelpool.shared.protocol import encode_frame, recv_frame


class Channel:
    """The worker's end of the socket pair: blocking reads, locked writes.

    Inside :meth:`gathered` the thread that entered it queues its frames and writes them
    in one ``sendall`` at the end (other threads, a log record say, still write at once):
    the batched loop sends what a step ended (the room report, the prefix report, every
    answer) in one write, read by the supervisor in one wake-up. Chunks are written as
    they are emitted: a step that hangs after some rows streamed must not hold back text
    the pool keeps as their partial answers."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._send_lock = threading.Lock()
        self._gathering: int | None = None  # the thread id whose frames are held
        self._held = bytearray()
        self._poller = select.poll()
        self._poller.register(sock, select.POLLIN)
        self._waited = True  # whether the last message read had to be waited for

    def send(self, message: tuple[Any, ...]) -> None:
        frame = encode_frame(message)
        with self._send_lock:
            if self._gathering == threading.get_ident():
                self._held += frame
            else:
                self._sock.sendall(frame)

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        self._gathering = threading.get_ident()
        try:
            yield
        finally:
            with self._send_lock:
                self._gathering = None
                held, self._held = self._held, bytearray()
                if held:
                    self._sock.sendall(held)

    def recv(self, poll_s: float = 0.0) -> tuple[Any, ...] | None:
        """The next message; None at end of stream.

        With ``poll_s`` (``PoolConfig.worker_poll_s``), when nothing is there yet and the
        last message also had to be waited for, the socket is polled without sleeping for
        up to that long first: a request sent within it is read with no wake-up of this
        process, which on a virtual machine costs more than all the Python on a round
        trip. Not after a message that was already waiting: the pool is then sending
        work ahead (prefetch), and a worker polling while the supervisor catches up would
        take the CPU it needs. Each poll yields the CPU (``sched_yield``): a thread that is
        runnable on the same core (the dispatcher, its caller) runs at once instead of
        waiting for the spin's time slice to end, which set a sequential round trip's p99
        (0.38 ms with a plain spin, 0.14-0.16 yielding, on the project's 2-core VM)."""
        if poll_s <= 0:
            return recv_frame(self._sock)
        if self._poller.poll(0):
            self._waited = False
        else:
            if self._waited:
                give_up_at = time.monotonic() + poll_s
                while not self._poller.poll(0) and time.monotonic() < give_up_at:
                    os.sched_yield()
            self._waited = True
        return recv_frame(self._sock)

    def close(self) -> None:
        self._sock.close()
