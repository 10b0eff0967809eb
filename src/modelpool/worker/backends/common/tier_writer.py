"""The thread that writes a worker's new prefix cache entries to the prefix cache tiers
(``shared.prefix_tier``), for every backend.

A finished request's entry is written at once, not when the worker's cache evicts it, so
that a worker killed the next moment has already given its prefix away; but never on the
request's path. One thread writes, so at most one entry's bytes are in flight; at most
``MAX_PENDING_WRITES`` wait, and past that an entry is not written (a burst of finished
requests never queues memory without bound)::

    writer = TierWriter(store)
    if not writer.full():
        writer.submit(ids, partition, fingerprints, lambda: ([payload], {"format": "..."}))
    writer.flush()  # tests, and an orderly exit

**At a low CPU priority** (``WRITER_NICENESS``, Linux's per-thread nice value): the write
is a copy and a checksum of the whole prefix (92 MB for 2,000 tokens of SmolLM2 in
float32, ~0.1 s of a core), and on a CPU-bound worker it ran beside the next turn's
forward passes, which it slowed by more than half as much again. The writer now takes what
the model leaves; under contention it still gets about a tenth of a core, so writes are
late, not lost.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from modelpool.shared.prefix_tier import PrefixTierStore

logger = logging.getLogger("modelpool.worker")

MAX_PENDING_WRITES = 4
WRITER_NICENESS = 10
"""Added to the writer thread's nice value: its weight against a nice-0 thread is ~1:9."""

Payload = Callable[[], tuple[Sequence[bytes | memoryview], Mapping[str, Any]]]
"""Builds an entry's buffers and meta, on the writer thread (after the check that no tier
holds the entry already)."""


class TierWriter:
    """One worker's writer of prefix tier entries."""

    def __init__(self, store: PrefixTierStore) -> None:
        self.store = store
        self._thread = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="prefix-tier", initializer=_lower_priority
        )
        self._pending = 0
        self._lock = threading.Lock()

    def full(self) -> bool:
        """Whether ``MAX_PENDING_WRITES`` are waiting (a submit now would be dropped)."""
        with self._lock:
            return self._pending >= MAX_PENDING_WRITES

    def submit(
        self, ids: Sequence[int], partition: int, fingerprints: Sequence[int], payload: Payload
    ) -> None:
        """Write the entry of ``ids`` unless a tier holds it already; not at all when
        ``MAX_PENDING_WRITES`` are waiting. ``payload`` must read only what nothing
        writes to any more (an entry's tensors, a copied state)."""
        with self._lock:
            if self._pending >= MAX_PENDING_WRITES:
                return
            self._pending += 1
        self._thread.submit(self._write, tuple(ids), partition, tuple(fingerprints), payload)

    def flush(self) -> None:
        """Wait for the writes submitted so far."""
        self._thread.submit(lambda: None).result()

    def _write(
        self, ids: tuple[int, ...], partition: int, fingerprints: tuple[int, ...], payload: Payload
    ) -> None:
        try:
            if not self.store.holds(ids, partition):
                buffers, meta = payload()
                self.store.store(ids, partition, buffers, meta, fingerprints)
        except Exception:
            # The tiers only save work: a failed write costs a later prefill, nothing more.
            logger.warning("could not write a prefix to the tiers", exc_info=True)
        finally:
            with self._lock:
                self._pending -= 1


def _lower_priority() -> None:
    """Lower the calling thread's CPU priority (Linux: nice values are per thread)."""
    with contextlib.suppress(OSError, AttributeError):
        thread = threading.get_native_id()
        niceness = os.getpriority(os.PRIO_PROCESS, thread) + WRITER_NICENESS
        os.setpriority(os.PRIO_PROCESS, thread, niceness)
