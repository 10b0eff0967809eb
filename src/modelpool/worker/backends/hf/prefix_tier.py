"""The hf backend's side of the prefix cache tiers (``shared.prefix_tier``): the KV of a
prefix written out of the worker, and read back into a new one.

**Written on insert, off the request's path.** Each entry that enters the worker's
prefix cache (``hf.prefix_cache``) is written to the tiers at once, not when it is
evicted: a worker killed the next moment (its deadline, a neighbour's hang, a recycle, a
swap) has already given it away, so its kill costs the next turn a restore, not a
prefill. The write runs on the worker's ``TierWriter`` (``common.tier_writer``: one
thread, a bounded queue): the entry's tensors are never written to once cached, so the
thread reads them while the next request runs, and the checksum and the file's write
release the GIL.

**Restored on a miss.** A request whose prompt the worker's cache holds less of than a
tier looks the tier up; a hit's tensors (raw bytes, their dtype and shapes in the entry's
``meta``) are viewed in place, moved to the model's device and dtype, kept in the
worker's cache (so the next turn is a memory hit) and start the request's cache, which
prefills only the rest of the prompt.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from modelpool.shared.prefix_tier import PrefixTierStore, TierHit, TierSpec, model_identity
from modelpool.worker.backends.common.tier_writer import TierWriter

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("modelpool.worker")

FORMAT = "hf-kv-1"
"""The payload's layout: per layer keys then values, each [1, heads, tokens, dim]."""

Layers = list[tuple["torch.Tensor", "torch.Tensor"]]


class HFPrefixTiers:
    """The tiers one hf worker writes its prefix cache's entries to and restores from."""

    def __init__(self, store: PrefixTierStore, dtype: torch.dtype, device: torch.device) -> None:
        self.store = store
        self.dtype = dtype
        self.device = device
        self.writer = TierWriter(store)

    @classmethod
    def open(
        cls, specs: Sequence[TierSpec], model: str, options: dict[str, Any], loaded: Any
    ) -> HFPrefixTiers | None:
        """The tiers of ``specs`` for the loaded model ``loaded`` (None when none is on).
        The identity names what its KV depends on besides the ids: the weights' files,
        the dtype, and a GGUF file inside the model."""
        dtype = loaded.dtype
        extra = {"gguf_file": options.get("gguf_file"), "layout": FORMAT}
        identity = model_identity(model, backend="hf", dtype=str(dtype), extra=extra)
        store = PrefixTierStore.open(specs, identity)
        return cls(store, dtype, loaded.device) if store else None

    def write(
        self, ids: Sequence[int], layers: Layers, fingerprints: Sequence[int], partition: int
    ) -> None:
        """Write the entry (``layers``: tensors never written to again) on the writer
        thread, unless its queue is full."""
        self.writer.submit(ids, partition, fingerprints, lambda: _buffers(layers))

    def flush(self) -> None:
        """Wait for the writes submitted so far (tests, and a worker's orderly exit)."""
        self.writer.flush()

    def restore(
        self, ids: Sequence[int], partition: int, held: int
    ) -> tuple[TierHit, Layers] | None:
        """The longest stored prefix of ``ids`` in ``partition`` longer than ``held`` ids
        (what the worker's cache holds) and its KV on the model's device and dtype, each
        [1, heads, hit.length, dim] (None: no tier holds one, or the entry does not fit
        this model's layout). On the CPU the tensors may view the mapped entry: copy
        them before keeping them."""
        hit = self.store.lookup(ids, partition, longer_than=held)
        if hit is None:
            return None
        try:
            return hit, _tensors(hit, self.dtype, self.device)
        except (KeyError, TypeError, ValueError, RuntimeError):
            logger.warning("a prefix tier entry does not fit this model; ignored", exc_info=True)
            return None


def _buffers(layers: Layers) -> tuple[list[memoryview], dict[str, Any]]:
    """Each tensor's bytes (viewed, not copied, when it is on the CPU and contiguous) and
    the meta that reads them back."""
    import torch

    buffers = []
    shapes = []
    dtype = ""
    for pair in layers:
        for tensor in pair:
            flat = tensor.detach().to("cpu").contiguous().reshape(-1)
            buffers.append(flat.view(torch.uint8).numpy().data)
            shapes.append(list(tensor.shape))
            dtype = str(tensor.dtype).removeprefix("torch.")
    return buffers, {"format": FORMAT, "dtype": dtype, "shapes": shapes}


def _tensors(hit: TierHit, dtype: torch.dtype, device: torch.device) -> Layers:
    """The hit's layers, cut to its length, on ``device`` in ``dtype`` (views of the
    hit's payload where no copy was needed to get them there)."""
    import torch

    meta = hit.meta
    if meta["format"] != FORMAT:
        raise ValueError(f"unknown prefix tier layout {meta['format']!r}")
    stored = getattr(torch, str(meta["dtype"]))
    if not isinstance(stored, torch.dtype):
        raise ValueError(f"unknown dtype {meta['dtype']!r}")
    raw = torch.frombuffer(hit.payload, dtype=torch.uint8)
    size = torch.empty((), dtype=stored).element_size()
    offset = 0
    tensors = []
    for shape in meta["shapes"]:
        count = 1
        for extent in shape:
            count *= int(extent)
        part = raw[offset : offset + count * size].view(stored).reshape(shape)
        offset += count * size
        # On the CPU in its own dtype, a view of the mapped entry: the request's cache
        # copies it into its own tensors (``PrefixCache.adopt``), one copy in all.
        tensors.append(part[:, :, : hit.length].to(device=device, dtype=dtype))
    if offset != len(raw) or len(tensors) % 2:
        raise ValueError("the payload's size does not match its shapes")
    return [(tensors[index], tensors[index + 1]) for index in range(0, len(tensors), 2)]
