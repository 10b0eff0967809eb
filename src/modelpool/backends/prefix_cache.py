"""The hf backend's prefix cache: the KV of recent prompts and answers, one per worker.

Agents send the same long prefix every turn (a system prompt, tool definitions, the
conversation so far). :class:`PrefixCache` keeps the KV of the prompts (and, for chat,
of the answers, so the next turn's prefix includes them) of requests that finished,
under a memory bound (``prefix_cache_bytes``), least recently used first out. A new
request takes the KV of the longest cached prefix of its token ids and prefills only
the rest: on the one-call path through ``generate()``'s cache argument, in the batched
loop as the start of the request's own prefill cache.

Keyed by token ids alone, because a cache belongs to one loaded model: the same
weights, dtype and device, and the chat template is already in the ids. It is off for a
model with adapters (PEFT) loaded, whose KV depends on more than the ids, and for the
models the batched loop does not take (sliding-window layers: their caches are cropped).

Bounded and never in a request's way: ``bytes`` (the KV tensors it holds, each its own
storage) never exceeds ``limit_bytes``; an entry larger than the bound is not kept;
making room drops the least recently used entries' references, which costs nothing a
request waits for, and a lookup takes a copy (the request's cache grows on its own).

The index is a chain hash per ``BLOCK_TOKENS`` block of ids: a lookup walks the request's
blocks while some entry shares them, then compares the candidates' ids token by token,
so the longest prefix is found in time proportional to the prompt, not to the cache.
At least one prompt token is always left to prefill: its logits choose the first token.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from modelpool.protocol import PrefixCacheReport

if TYPE_CHECKING:
    import torch

DEFAULT_PREFIX_CACHE_BYTES = 256 * 2**20
"""A worker's prefix cache bound when ``prefix_cache_bytes`` is not given: about 5,700
tokens of SmolLM2-135M's KV in float32 (46 KB a token), a few agent conversations."""
BLOCK_TOKENS = 16
"""Index granularity; a cached prefix shorter than this is not worth a lookup's copy."""
MAX_REPORTED_FINGERPRINTS = 4096
"""Prefix fingerprints sent to the pool per report, most recently used entries first."""
_CANDIDATES_COMPARED = 16


@dataclass(eq=False)
class _Entry:
    ids: tuple[int, ...]
    layers: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [1, h, n, d]
    nbytes: int
    fingerprints: tuple[int, ...]
    block_keys: tuple[int, ...]


class PrefixCache:
    """Token-id prefixes and their KV, least recently used out past ``limit_bytes``."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self._entries: collections.OrderedDict[int, _Entry] = collections.OrderedDict()
        self._by_block: dict[int, set[int]] = {}
        self._next_key = 0
        self.bytes = 0
        self.hits = 0
        self.lookups = 0
        self.evictions = 0
        self.cached_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, ids: list[int]) -> tuple[Any, int] | None:
        """A DynamicCache holding the KV of the longest cached prefix of ``ids`` (at most
        all but the last id), and that prefix's length; None when nothing useful is held."""
        from transformers import DynamicCache

        self.lookups += 1
        found = longest_held(self._entries, self._by_block, ids, _CANDIDATES_COMPARED)
        if found is None:
            return None
        key, length = found
        entry = self._entries[key]
        self._entries.move_to_end(key)
        self.hits += 1
        self.cached_tokens += length
        # DynamicLayer.update copies into the request's own tensors: the entry is never
        # written to, and an eviction meanwhile frees nothing the request still needs.
        prefix = [(keys[:, :, :length], values[:, :, :length]) for keys, values in entry.layers]
        cache = DynamicCache(ddp_cache_data=prefix)
        return cache, length

    def insert(
        self,
        ids: list[int],
        layers: list[tuple[torch.Tensor, torch.Tensor]],
        fingerprints: tuple[int, ...],
    ) -> None:
        """Keep the KV of ``ids`` (``layers``: each [1, heads, len(ids), dim], taken over as
        they are if they own their storage, else copied). An entry whose ids are a prefix
        of these is dropped (this one holds all of it); ids already held are only touched."""
        if len(ids) < BLOCK_TOKENS or self.limit_bytes <= 0:
            return
        chain = block_keys(ids)
        for key in self._sharing(chain):
            held = self._entries[key].ids
            if len(held) >= len(ids) and held[: len(ids)] == tuple(ids):
                self._entries.move_to_end(key)
                return
        owned = [(_owned(keys), _owned(values)) for keys, values in layers]
        nbytes = sum(keys.nbytes + values.nbytes for keys, values in owned)
        if nbytes > self.limit_bytes:
            return
        for key in list(self._sharing(chain)):
            held = self._entries[key].ids
            if len(held) < len(ids) and tuple(ids[: len(held)]) == held:
                self._remove(key)
        while self.bytes + nbytes > self.limit_bytes:
            self._remove(next(iter(self._entries)))
            self.evictions += 1
        key = self._next_key
        self._next_key += 1
        self._entries[key] = _Entry(tuple(ids), owned, nbytes, fingerprints, chain)
        index(self._by_block, key, chain)
        self.bytes += nbytes

    def clear(self) -> None:
        self._entries.clear()
        self._by_block.clear()
        self.bytes = 0

    def report(self) -> PrefixCacheReport:
        return PrefixCacheReport(
            bytes=self.bytes,
            limit_bytes=self.limit_bytes,
            entries=len(self._entries),
            hits=self.hits,
            lookups=self.lookups,
            evictions=self.evictions,
            cached_tokens=self.cached_tokens,
            fingerprints=recent_fingerprints(self._entries.values()),
        )

    def _sharing(self, block_keys: tuple[int, ...]) -> set[int]:
        """Entries that share at least the first block with ids of these block keys."""
        return set(self._by_block.get(block_keys[0], ())) if block_keys else set()

    def _remove(self, key: int) -> None:
        entry = self._entries.pop(key)
        unindex(self._by_block, key, entry.block_keys)
        self.bytes -= entry.nbytes


class HeldPrefix(Protocol):
    """What the shared index functions read of an entry of either backend's cache."""

    @property
    def ids(self) -> tuple[int, ...]: ...

    @property
    def fingerprints(self) -> tuple[int, ...]: ...


def longest_held(
    entries: Mapping[int, HeldPrefix],
    by_block: Mapping[int, set[int]],
    ids: list[int],
    compared: int | None = None,
) -> tuple[int, int] | None:
    """The key of the entry holding the longest prefix of ``ids`` (at most all but its last
    id: that one's logits choose the first new token) and the prefix's length; at most
    ``compared`` candidates are compared token by token (all when None)."""
    limit = len(ids) - 1
    candidates: set[int] = set()
    for block_key in block_keys(ids[:limit]):
        sharing = by_block.get(block_key)
        if not sharing:
            break
        candidates = sharing
    best: tuple[int, int] | None = None
    for key in list(candidates)[:compared]:
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


def block_keys(ids: list[int]) -> tuple[int, ...]:
    """A chain hash per whole block: key k stands for ids[: (k + 1) * BLOCK_TOKENS]."""
    keys = []
    previous = 0
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


def _owned(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` if it owns exactly its storage, else a compact copy: what the cache counts
    must be what it holds (a row sliced from the batch's cache would pin all of it)."""
    import torch

    if tensor.is_contiguous() and tensor.untyped_storage().nbytes() == tensor.nbytes:
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)
