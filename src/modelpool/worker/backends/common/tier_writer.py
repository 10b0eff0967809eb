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

**Not at a lower CPU priority**, though the write (a copy and a checksum of the whole
prefix: 92 MB for 2,000 tokens of SmolLM2 in float32, ~0.1 s of a core) runs beside the
next turn's forward passes. Tried: the thread niced by 10 (Linux nice values are per
thread) gave the next turn its CPU on a quiet machine; but a thread that holds the GIL
or the tier's lock and waits for a core stops the worker's other threads with it, and
in one run, when another process took the cores midway, requests that miss went from
1.01-1.07x the tokens per second of the tiers off to 0.28-0.35x.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from modelpool.shared.prefix_tier import PrefixTierStore

logger = logging.getLogger("modelpool.worker")

MAX_PENDING_WRITES = 4

Payload = Callable[[], tuple[Sequence[bytes | memoryview], Mapping[str, Any]]]
"""Builds an entry's buffers and meta, on the writer thread (after the check that no tier
holds the entry already)."""


class TierWriter:
    """One worker's writer of prefix tier entries."""

    def __init__(self, store: PrefixTierStore) -> None:
        self.store = store
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefix-tier")
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

