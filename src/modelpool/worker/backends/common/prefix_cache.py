"""The prefix cache's skeleton, shared by every backend: an LRU of finished requests'
token-id prefixes, their index, counters and report.

:class:`PrefixLRU` holds entries (token ids, the fingerprints the pool places by, and
their size in the cache's unit) least recently used first, under a bound in that unit;
each backend's cache is the part that differs: what an entry holds and how its storage
is freed (``hf.prefix_cache``: KV tensors, bounded in bytes; ``llama_cpp.prefix_cache``:
llama.cpp sequences, bounded in KV cells).

The index is a chain hash per ``BLOCK_TOKENS`` block of ids: a lookup walks the request's
blocks while some entry shares them, then compares the candidates' ids token by token,
so the longest prefix is found in time proportional to the prompt, not to the cache.
At least one prompt token is always left to prefill: its logits choose the first token.

Partitioned: every entry belongs to one partition (``prefixes.partition_of`` of its
request's ``cache_salt``; 0, the shared one, without), whose id seeds its chain of block
keys, and a lookup or insert of one partition never finds, frees or reports as held an
entry of another (the ids are compared only among entries of the same partition). So a
request's ``cached_tokens`` and its prefill time say nothing of another partition's
prompts; eviction is shared (one bound per worker), which says only how busy it is.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from modelpool.shared.protocol import PrefixCacheReport

BLOCK_TOKENS = 16
"""Index granularity; a cached prefix shorter than this is not worth a lookup's copy."""
MAX_REPORTED_FINGERPRINTS = 4096
"""Prefix fingerprints sent to the pool per report, most recently used entries first."""


@dataclass(eq=False)
class Held:
    """What every entry carries: its token ids, fingerprints, block keys, size and
    partition."""

    ids: tuple[int, ...]
    fingerprints: tuple[int, ...]
    block_keys: tuple[int, ...]
    size: int  # in the cache's unit (bytes, cells)
    partition: int = field(default=0, kw_only=True)


Entry = TypeVar("Entry", bound=Held)


class PrefixLRU(Generic[Entry]):
    """Token-id prefixes, least recently used out past ``limit`` (in the cache's unit;
    ``unit_bytes``: bytes of one unit, for the report). A subclass says what an entry
    holds and frees it in :meth:`_release`."""

    def __init__(self, limit: int, unit_bytes: int = 1) -> None:
        self.limit = limit
        self.unit_bytes = unit_bytes
        self._entries: collections.OrderedDict[int, Entry] = collections.OrderedDict()
        self._by_block: dict[int, set[int]] = {}
        self.size = 0
        self.hits = 0
        self.lookups = 0
        self.evictions = 0
        self.cached_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def _find(
        self, ids: list[int], partition: int = 0, compared: int | None = None
    ) -> tuple[Entry, int] | None:
        """The entry of ``partition`` holding the longest prefix of ``ids`` (at most all
        but its last id) and that prefix's length, made the most recently used; counts a
        lookup and a hit. ``compared``: at most this many candidates compared token by
        token."""
        self.lookups += 1
        found = longest_held(self._entries, self._by_block, ids, compared, partition)
        if found is None:
            return None
        key, length = found
        self._entries.move_to_end(key)
        self.hits += 1
        self.cached_tokens += length
        return self._entries[key], length

    def _holds(self, chain: tuple[int, ...], ids: list[int], partition: int = 0) -> bool:
        """Whether an entry of ``partition`` already holds ``ids`` (``chain``: their block
        keys); it is made the most recently used."""
        for key in self._sharing(chain):
            entry = self._entries[key]
            held = entry.ids
            if (
                entry.partition == partition
                and len(held) >= len(ids)
                and held[: len(ids)] == tuple(ids)
            ):
                self._entries.move_to_end(key)
                return True
        return False

    def _add(self, key: int, entry: Entry) -> None:
        """Keep ``entry`` (its size within the limit): entries whose ids are a prefix of
        its ids are freed (it holds all of their content), then the least recently used
        until it fits."""
        ids = list(entry.ids)
        for held_key in list(self._sharing(entry.block_keys)):
            other = self._entries[held_key]
            held = other.ids
            same = other.partition == entry.partition
            if same and len(held) < len(ids) and tuple(ids[: len(held)]) == held:
                self._release(self._forget(held_key))
        while self.size + entry.size > self.limit:
            self.evict()
        self._entries[key] = entry
        index(self._by_block, key, entry.block_keys)
        self.size += entry.size

    def evict(self) -> bool:
        """Free the least recently used entry; False when there is none."""
        if not self._entries:
            return False
        self._release(self._forget(next(iter(self._entries))))
        self.evictions += 1
        return True

    def clear(self) -> list[int]:
        """Forget every entry without freeing it (what held it is gone); their keys."""
        keys = list(self._entries)
        self._entries.clear()
        self._by_block.clear()
        self.size = 0
        return keys

    def report(self) -> PrefixCacheReport:
        return PrefixCacheReport(
            bytes=self.size * self.unit_bytes,
            limit_bytes=self.limit * self.unit_bytes,
            entries=len(self._entries),
            hits=self.hits,
            lookups=self.lookups,
            evictions=self.evictions,
            cached_tokens=self.cached_tokens,
            fingerprints=recent_fingerprints(self._entries.values()),
        )

    def _release(self, entry: Entry) -> None:
        """Free what ``entry`` holds (it has left the cache); nothing by default."""

    def _forget(self, key: int) -> Entry:
        entry = self._entries.pop(key)
        unindex(self._by_block, key, entry.block_keys)
        self.size -= entry.size
        return entry

    def _sharing(self, chain: tuple[int, ...]) -> set[int]:
        """Entries that share at least the first block with ids of these block keys."""
        return set(self._by_block.get(chain[0], ())) if chain else set()


class HeldPrefix(Protocol):
    """What the shared index functions read of an entry of either backend's cache."""

    @property
    def ids(self) -> tuple[int, ...]: ...

    @property
    def fingerprints(self) -> tuple[int, ...]: ...

    @property
    def partition(self) -> int: ...


def longest_held(
    entries: Mapping[int, HeldPrefix],
    by_block: Mapping[int, set[int]],
    ids: list[int],
    compared: int | None = None,
    partition: int = 0,
) -> tuple[int, int] | None:
    """The key of the entry of ``partition`` holding the longest prefix of ``ids`` (at
    most all but its last id: that one's logits choose the first new token) and the
    prefix's length; at most ``compared`` candidates are compared token by token (all
    when None)."""
    limit = len(ids) - 1
    candidates: set[int] = set()
    for block_key in block_keys(ids[:limit], partition):
        sharing = by_block.get(block_key)
        if not sharing:
            break
        candidates = sharing
    best: tuple[int, int] | None = None
    # Another partition's entry is never a candidate, even on a block-key collision.
    same = [key for key in candidates if entries[key].partition == partition]
    for key in same[:compared]:
        length = common_prefix(entries[key].ids, ids, limit)
        if length >= BLOCK_TOKENS and (best is None or length > best[1]):
            best = (key, length)
    return best


def index(by_block: dict[int, set[int]], key: int, chain: tuple[int, ...]) -> None:
    """Record entry ``key`` under each block key of its ids."""
    for block_key in chain:
        by_block.setdefault(block_key, set()).add(key)


def unindex(by_block: dict[int, set[int]], key: int, chain: tuple[int, ...]) -> None:
    """Forget entry ``key`` under each block key of its ids."""
    for block_key in chain:
        sharing = by_block.get(block_key)
        if sharing is not None:
            sharing.discard(key)
            if not sharing:
                del by_block[block_key]


def recent_fingerprints(entries: Iterable[HeldPrefix]) -> frozenset[int]:
    """The fingerprints a report carries: the most recently used entries' first, up to
    ``MAX_REPORTED_FINGERPRINTS`` (``entries`` in LRU order, oldest first)."""
    fingerprints: set[int] = set()
    for entry in reversed(list(entries)):
        if len(fingerprints) + len(entry.fingerprints) > MAX_REPORTED_FINGERPRINTS:
            break
        fingerprints.update(entry.fingerprints)
    return frozenset(fingerprints)


def block_keys(ids: list[int], partition: int = 0) -> tuple[int, ...]:
    """A chain hash per whole block: key k stands for ids[: (k + 1) * BLOCK_TOKENS] in
    ``partition`` (the chain's seed)."""
    keys = []
    previous = partition
    for start in range(0, len(ids) - len(ids) % BLOCK_TOKENS, BLOCK_TOKENS):
        previous = hash((previous, *ids[start : start + BLOCK_TOKENS]))
        keys.append(previous)
    return tuple(keys)


def common_prefix(held: tuple[int, ...], ids: list[int], limit: int) -> int:
    length = 0
    for mine, theirs in zip(held, ids[:limit], strict=False):
        if mine != theirs:
            break
        length += 1
    return length
