"""The hf backend's prefix cache: the KV of recent prompts and answers, one per worker.

Agents send the same long prefix every turn (a system prompt, tool definitions, the
conversation so far). :class:`PrefixCache` keeps the KV of the prompts (and, for chat,
of the answers, so the next turn's prefix includes them) of requests that finished,
under a memory bound (``prefix_cache_bytes``), least recently used first out. A new
request takes the KV of the longest cached prefix of its token ids and prefills only
the rest: on the one-call path through ``generate()``'s cache argument, in the batched
loop as the start of the request's own prefill cache.

Keyed by token ids and the request's partition (``common.prefix_cache``: a request
never sees another partition's entries), and by nothing more, because a cache belongs
to one loaded model: the same
weights, dtype and device, and the chat template is already in the ids. It is off for a
model with adapters (PEFT) loaded, whose KV depends on more than the ids, and for the
models the batched loop does not take (sliding-window layers: their caches are cropped).

Bounded and never in a request's way: ``bytes`` (the KV tensors it holds, each its own
storage) never exceeds ``limit_bytes``; an entry larger than the bound is not kept;
making room drops the least recently used entries' references, which costs nothing a
request waits for, and a lookup takes a copy (the request's cache grows on its own).
The LRU, its index and counters are every backend's (``common.prefix_cache``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from modelpool.worker.backends.common.prefix_cache import BLOCK_TOKENS, Held, PrefixLRU, block_keys

if TYPE_CHECKING:
    import torch

DEFAULT_PREFIX_CACHE_BYTES = 256 * 2**20
"""A worker's prefix cache bound when ``prefix_cache_bytes`` is not given: about 5,700
tokens of SmolLM2-135M's KV in float32 (46 KB a token), a few agent conversations."""
_CANDIDATES_COMPARED = 16


@dataclass(eq=False)
class _Entry(Held):
    layers: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [1, h, n, d]


class PrefixCache(PrefixLRU[_Entry]):
    """Token-id prefixes and their KV, least recently used out past ``limit_bytes``."""

    def __init__(self, limit_bytes: int) -> None:
        super().__init__(limit_bytes)
        self._next_key = 0

    @property
    def bytes(self) -> int:
        return self.size

    @property
    def limit_bytes(self) -> int:
        return self.limit

    def lookup(self, ids: list[int], partition: int = 0) -> tuple[Any, int] | None:
        """A DynamicCache holding the KV of the longest prefix of ``ids`` (at most all but
        the last id) cached in ``partition``, and that prefix's length; None when nothing
        useful is held."""
        found = self._find(ids, partition, _CANDIDATES_COMPARED)
        if found is None:
            return None
        entry, length = found
        return _request_cache(entry.layers, length), length

    def adopt(
        self,
        ids: list[int],
        layers: list[tuple[torch.Tensor, torch.Tensor]],
        fingerprints: tuple[int, ...],
        partition: int = 0,
    ) -> Any:
        """Keep a prefix restored from a tier (``layers`` hold exactly ``ids``, and may view
        the tier's mapped entry) as an entry, so the next turn finds it here, and a request
        cache starting from it.

        The request cache's copy of ``layers`` is the entry's too: a restore copies the
        prefix once, not once for the entry and again for the request (92 MB for 2,000
        tokens of SmolLM2: ~50 ms). The request never writes to them either: its first
        step's ``update`` concatenates into new tensors."""
        cache = _request_cache(layers, len(ids))
        copied = [(layer.keys, layer.values) for layer in cache.layers]
        self.insert(ids, copied, fingerprints, partition)
        return cache

    def insert(
        self,
        ids: list[int],
        layers: list[tuple[torch.Tensor, torch.Tensor]],
        fingerprints: tuple[int, ...],
        partition: int = 0,
    ) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Keep the KV of ``ids`` (``layers``: each [1, heads, len(ids), dim], taken over as
        they are if they own their storage, else copied) in ``partition``; the tensors
        kept (never written to: the tiers read them), or None when nothing new was kept.
        An entry of it whose ids are a prefix of these is dropped (this one holds all of
        it); ids already held are only touched."""
        if len(ids) < BLOCK_TOKENS or self.limit <= 0:
            return None
        chain = block_keys(ids, partition)
        if self._holds(chain, ids, partition):
            return None
        owned = [(_owned(keys), _owned(values)) for keys, values in layers]
        nbytes = sum(keys.nbytes + values.nbytes for keys, values in owned)
        if nbytes > self.limit:
            return None
        key = self._next_key
        self._next_key += 1
        entry = _Entry(tuple(ids), fingerprints, chain, nbytes, owned, partition=partition)
        self._add(key, entry)
        return owned


def _request_cache(layers: list[tuple[torch.Tensor, torch.Tensor]], length: int) -> Any:
    """A DynamicCache starting from the first ``length`` positions of ``layers``."""
    from transformers import DynamicCache

    # DynamicLayer.update copies into the request's own tensors: the entry is never
    # written to, and an eviction meanwhile frees nothing the request still needs.
    prefix = [(keys[:, :, :length], values[:, :, :length]) for keys, values in layers]
    return DynamicCache(ddp_cache_data=prefix)


def _owned(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` if it owns exactly its storage, else a compact copy: what the cache counts
    must be what it holds (a row sliced from the batch's cache would pin all of it)."""
    import torch

    if tensor.is_contiguous() and tensor.untyped_storage().nbytes() == tensor.nbytes:
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)
