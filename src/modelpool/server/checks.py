"""Request checks off the event loop: parsing a body, its schemas and its budget, in a few
threads shared round robin between clients.

Every body is parsed and checked in one of ``CHECK_THREADS`` threads, whatever its size:
a schema check is the grammar engine's work (bounded, see :mod:`modelpool.shared.structured`,
but up to a couple of seconds), and Python's parsing of a body of many small items takes
the GIL for as long, so neither may run on the loop that serves every client. A client
has at most one thread at a time; others wait their turn round robin (the machinery of
:class:`~modelpool.server.fair_share.FairShare`), and a request waiting or being checked
counts against its client's share of the pool, so that nobody can queue unbounded work
here::

    checks = Checks(share, max_waiting=1024)
    body, job = await checks.run("10.0.0.7", None, 30.0, parse, raw)   # or ApiError 429
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from modelpool.server.fair_share import FairShare, Limits
from modelpool.shared.structured import checked_inline

T = TypeVar("T")

CHECK_THREADS = 2
# A body larger than this (images: a 20 MB data URL takes ~0.1-0.4 s to parse and decode)
# is checked in a lane of its own, one thread, so that the small bodies of every other
# client never wait behind a flood of large ones for a check thread.
LARGE_BODY_BYTES = 1_048_576
LARGE_BODY_THREADS = 1


class Checks:
    """Bounded check threads, round robin between clients, counted in their share."""

    def __init__(self, share: FairShare, *, max_waiting: int, threads: int = CHECK_THREADS):
        self._share = share
        self.threads = threads
        # One thread per client at a time; the pool's waiting bound for all together.
        self._turns = FairShare(
            capacity=threads, max_running=1, max_queued=max_waiting, max_waiting=max_waiting
        )
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="modelpool-check")
        self._large_turns = FairShare(
            capacity=LARGE_BODY_THREADS,
            max_running=1,
            max_queued=max_waiting,
            max_waiting=max_waiting,
        )
        self._large_executor = ThreadPoolExecutor(
            LARGE_BODY_THREADS, thread_name_prefix="modelpool-check-large"
        )

    async def run(
        self,
        client: str,
        limits: Limits | None,
        deadline_s: float,
        work: Callable[..., T],
        *args: Any,
        large: bool = False,
    ) -> T:
        """``work(*args)`` in a check thread when ``client``'s turn comes (within
        ``deadline_s``, else DeadlineExceeded), its grammar checks inline there;
        ``limits``: the client's own share (a tenant's); ``large``: a body over
        ``LARGE_BODY_BYTES``, checked in the large bodies' lane."""
        turns, executor = (
            (self._large_turns, self._large_executor) if large else (self._turns, self._executor)
        )
        with self._share.checking(client, limits):
            ticket = turns.reserve(client, 1)
            try:
                async with ticket.slot(deadline_s):
                    loop = asyncio.get_running_loop()
                    done = loop.run_in_executor(executor, checked_inline, work, *args)
                    try:
                        return await asyncio.shield(done)
                    except asyncio.CancelledError:
                        # The thread cannot be stopped: its place is held until it ends
                        # (CHECK_BOUND_S at most), so that the threads are never
                        # over-committed by clients that went away.
                        await asyncio.wait({done})
                        raise
            finally:
                ticket.close()

    def snapshot(self) -> dict[str, Any]:
        return self._turns.snapshot()

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._large_executor.shutdown(wait=False, cancel_futures=True)
