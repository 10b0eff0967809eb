"""The llama_cpp backend's prefix cache: finished requests' KV cells kept as sequences.

Each request is its own llama.cpp sequence in one unified KV cache (see
``llama_cpp_engine``). When a request ends normally its sequence is not removed: it
becomes a cache entry, owned by :class:`SequencePrefixCache`, with the token ids its
cells hold (the prompt and the answer but its last token, which was never decoded). A
new request whose prompt starts with an entry's ids gets that prefix's cells into its
own sequence through ``llama_memory_seq_cp`` (in a unified cache the cells are shared,
not copied) and prefills only the rest; at least its last prompt token is always read,
for the logits that choose its first token.

Bounded in cells: the entries together hold at most ``limit_cells`` cells (the
``prefix_cache_tokens`` option), least recently used out first (``llama_memory_seq_rm``).
The cache never keeps room a request needs: the engine evicts entries, at once and
without waiting on anything, when a request needs cells or a sequence id, and the
bookkeeping (the token-id block index, the fingerprints the pool places by) is
``prefix_cache``'s, shared with the hf backend.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass

from modelpool.backends.prefix_cache import (
    BLOCK_TOKENS,
    block_keys,
    index,
    longest_held,
    recent_fingerprints,
    unindex,
)
from modelpool.protocol import PrefixCacheReport


@dataclass(eq=False)
class CachedSequence:
    """A cache entry: a sequence id whose cells hold the KV of ``ids``."""

    seq_id: int
    ids: tuple[int, ...]
    fingerprints: tuple[int, ...]
    block_keys: tuple[int, ...]


class SequencePrefixCache:
    """Token-id prefixes held as llama.cpp sequences, least recently used out past
    ``limit_cells``. ``free`` removes a sequence's cells and returns its id to the engine."""

    def __init__(self, limit_cells: int, cell_bytes: int, free: Callable[[int], None]) -> None:
        self.limit_cells = limit_cells
        self.cell_bytes = cell_bytes
        self._free = free
        self._entries: collections.OrderedDict[int, CachedSequence] = collections.OrderedDict()
        self._by_block: dict[int, set[int]] = {}
        self.cells = 0
        self.hits = 0
        self.lookups = 0
        self.evictions = 0
        self.cached_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, ids: list[int]) -> tuple[CachedSequence, int] | None:
        """The entry holding the longest prefix of ``ids`` (at most all but the last id)
        and that prefix's length; None when nothing useful is held. Counts a hit."""
        self.lookups += 1
        found = longest_held(self._entries, self._by_block, ids)
        if found is None:
            return None
        seq_id, length = found
        self._entries.move_to_end(seq_id)
        self.hits += 1
        self.cached_tokens += length
        return self._entries[seq_id], length

    def take(self, entry: CachedSequence) -> int:
        """Hand ``entry``'s sequence over to a request as it is (its cells stay): the
        request trims it to the prefix it uses. The entry leaves the cache."""
        self._forget(entry.seq_id)
        return entry.seq_id

    def insert(self, seq_id: int, ids: list[int], fingerprints: tuple[int, ...]) -> bool:
        """Keep sequence ``seq_id`` (its cells hold ``ids``) as an entry; True when the
        cache took it over, False when the caller should free it (too short or too long
        for the bound, or its ids already held). Entries whose ids are a prefix of these
        are freed: this one holds all of their cells' content."""
        if len(ids) < BLOCK_TOKENS or len(ids) > self.limit_cells:
            return False
        keys = block_keys(ids)
        sharing = set(self._by_block.get(keys[0], ()))
        for held_id in sharing:
            held = self._entries[held_id].ids
            if len(held) >= len(ids) and held[: len(ids)] == tuple(ids):
                self._entries.move_to_end(held_id)
                return False
        for held_id in sharing:
            held = self._entries[held_id].ids
            if tuple(ids[: len(held)]) == held:
                self._forget(held_id)
                self._free(held_id)
        while self.cells + len(ids) > self.limit_cells:
            self.evict()
        self._entries[seq_id] = CachedSequence(seq_id, tuple(ids), fingerprints, keys)
        index(self._by_block, seq_id, keys)
        self.cells += len(ids)
        return True

    def evict(self) -> bool:
        """Free the least recently used entry; False when there is none."""
        if not self._entries:
            return False
        seq_id = next(iter(self._entries))
        self._forget(seq_id)
        self._free(seq_id)
        self.evictions += 1
        return True

    def drop_all(self) -> list[int]:
        """Forget every entry (their cells are already gone: the context was cleared);
        their sequence ids, for the engine to reuse."""
        seq_ids = list(self._entries)
        self._entries.clear()
        self._by_block.clear()
        self.cells = 0
        return seq_ids

    def report(self) -> PrefixCacheReport:
        return PrefixCacheReport(
            bytes=self.cells * self.cell_bytes,
            limit_bytes=self.limit_cells * self.cell_bytes,
            entries=len(self._entries),
            hits=self.hits,
            lookups=self.lookups,
            evictions=self.evictions,
            cached_tokens=self.cached_tokens,
            fingerprints=recent_fingerprints(self._entries.values()),
        )

    def _forget(self, seq_id: int) -> None:
        entry = self._entries.pop(seq_id)
        unindex(self._by_block, seq_id, entry.block_keys)
        self.cells -= len(entry.ids)
