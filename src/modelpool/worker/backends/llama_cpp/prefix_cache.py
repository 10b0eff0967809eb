"""The llama_cpp backend's prefix cache: finished requests' KV cells kept as sequences.

Each request is its own llama.cpp sequence in one unified KV cache (see
``llama_cpp.runner``). When a request ends normally its sequence is not removed: it
becomes a cache entry, owned by :class:`SequencePrefixCache`, with the token ids its
cells hold (the prompt and the answer but its last token, which was never decoded). A
new request whose prompt starts with an entry's ids gets that prefix's cells into its
own sequence through ``llama_memory_seq_cp`` (in a unified cache the cells are shared,
not copied) and prefills only the rest; at least its last prompt token is always read,
for the logits that choose its first token.

Bounded in cells: the entries together hold at most ``limit_cells`` cells (the
``prefix_cache_tokens`` option), least recently used out first (``llama_memory_seq_rm``).
The cache never keeps room a request needs: the runner evicts entries, at once and
without waiting on anything, when a request needs cells or a sequence id, and the
bookkeeping (the LRU, the token-id block index, the counters, the fingerprints the
pool places by) is every backend's (``common.prefix_cache``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from modelpool.worker.backends.common.prefix_cache import BLOCK_TOKENS, Held, PrefixLRU, block_keys


@dataclass(eq=False)
class CachedSequence(Held):
    """A cache entry: a sequence id whose cells hold the KV of ``ids``."""

    seq_id: int


class SequencePrefixCache(PrefixLRU[CachedSequence]):
    """Token-id prefixes held as llama.cpp sequences, least recently used out past
    ``limit_cells``. ``free`` removes a sequence's cells and returns its id to the runner."""

    def __init__(self, limit_cells: int, cell_bytes: int, free: Callable[[int], None]) -> None:
        super().__init__(limit_cells, cell_bytes)
        self._free = free

    @property
    def cells(self) -> int:
        return self.size

    def lookup(self, ids: list[int], partition: int = 0) -> tuple[CachedSequence, int] | None:
        """The entry of ``partition`` holding the longest prefix of ``ids`` (at most all
        but the last id) and that prefix's length; None when nothing useful is held.
        Counts a hit."""
        return self._find(ids, partition)

    def take(self, entry: CachedSequence) -> int:
        """Hand ``entry``'s sequence over to a request as it is (its cells stay): the
        request trims it to the prefix it uses. The entry leaves the cache."""
        self._forget(entry.seq_id)
        return entry.seq_id

    def insert(
        self, seq_id: int, ids: list[int], fingerprints: tuple[int, ...], partition: int = 0
    ) -> bool:
        """Keep sequence ``seq_id`` (its cells hold ``ids``) as an entry of ``partition``;
        True when the cache took it over, False when the caller should free it (too short
        or too long for the bound, or its ids already held there). Entries of it whose ids
        are a prefix of these are freed: this one holds all of their cells' content."""
        if len(ids) < BLOCK_TOKENS or len(ids) > self.limit:
            return False
        chain = block_keys(ids, partition)
        if self._holds(chain, ids, partition):
            return False
        entry = CachedSequence(
            tuple(ids), fingerprints, chain, len(ids), seq_id, partition=partition
        )
        self._add(seq_id, entry)
        return True

    def _release(self, entry: CachedSequence) -> None:
        self._free(entry.seq_id)
