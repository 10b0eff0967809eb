"""The llama_cpp backend's side of the prefix cache tiers (``shared.prefix_tier``): a cached
sequence's llama.cpp state written out of the worker, and read back into a new one.

As on hf (``hf.prefix_tier``): **written on insert, off the request's path.** A sequence
that becomes a prefix cache entry has its state copied out of the context at once (on the
worker loop's thread: llama.cpp's context is not shared with another thread; a memcpy of
its cells), then checksummed and written to the tiers by the worker's ``TierWriter``
(``common.tier_writer``: one thread, a bounded queue), so a worker killed the next
moment has already given its prefix away. Past the writer's bound an entry is not
written (nor copied).

**Restored on a miss.** A request whose prompt the worker's cache holds less of than a
tier may (at least a block more) looks the tier up; a hit's state is loaded into the
request's own sequence (``sequence_state.load_state``: llama.cpp reads the tier's buffer
in place) and trimmed to the prompt's shared prefix, and the request prefills only the
rest. The store has checked the entry's identity, partition, checksum and ids; llama.cpp
refusing it (no contiguous room in the context, another layout) is a prefill, not an
error.

The identity adds what a state depends on besides the weights: llama-cpp-python's
version (its state format), the GGUF file and the KV layout of the context.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Sequence
from typing import Any

from modelpool.shared.prefix_tier import PrefixTierStore, TierHit, TierSpec, model_identity
from modelpool.worker.backends.common.tier_writer import TierWriter

FORMAT = "llama-cpp-seq-1"
"""The payload: ``llama_state_seq_get_data``'s bytes of one sequence (positions 0..n-1)."""


class LlamaPrefixTiers:
    """The tiers one llama_cpp worker writes its cached sequences to and restores from."""

    def __init__(self, store: PrefixTierStore) -> None:
        self.store = store
        self.writer = TierWriter(store)

    @classmethod
    def open(
        cls, specs: Sequence[TierSpec], model: str, options: dict[str, Any], layout: str
    ) -> LlamaPrefixTiers | None:
        """The tiers of ``specs`` (None when none is on); ``layout`` names the context's
        KV (the cells' type and shape)."""
        try:
            version = importlib.metadata.version("llama_cpp_python")
        except importlib.metadata.PackageNotFoundError:
            version = "unknown"
        extra = {
            "gguf_file": options.get("gguf_file"),
            "format": FORMAT,
            "llama_cpp_python": version,
            "layout": layout,
        }
        identity = model_identity(model, backend="llama_cpp", dtype=None, extra=extra)
        store = PrefixTierStore.open(specs, identity)
        return cls(store) if store else None

    def wants(self, ids: Sequence[int], partition: int) -> bool:
        """Whether an entry of ``ids`` would be written now: the writer's queue has room
        and no tier holds it already (checked before its state is copied out of the
        context)."""
        return not self.writer.full() and not self.store.holds(ids, partition)

    def write(
        self, ids: Sequence[int], state: memoryview, fingerprints: Sequence[int], partition: int
    ) -> None:
        """Write the entry (``state``: a copy of the sequence's, owned by the writer) on the
        writer thread, unless its queue is full."""
        self.writer.submit(ids, partition, fingerprints, lambda: ([state], {"format": FORMAT}))

    def flush(self) -> None:
        """Wait for the writes submitted so far (tests, and a worker's orderly exit)."""
        self.writer.flush()

    def lookup(self, ids: Sequence[int], partition: int, held: int) -> TierHit | None:
        """The longest stored prefix of ``ids`` in ``partition`` written in this format and
        longer than ``held`` ids (what the worker's cache holds)."""
        hit = self.store.lookup(ids, partition, longer_than=held)
        if hit is None or hit.meta.get("format") != FORMAT:
            return None
        return hit
