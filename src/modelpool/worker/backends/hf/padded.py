"""The batched hf loop's running rows on one shared, left-padded KV cache: the form for a
model the packed pass (``hf.packed``) does not fit (attention not dispatched through
transformers' interface, a sliding window, soft capping).

Rows are the cache's batch dimension; a row shorter than the longest is left-padded with
columns its attention mask hides, so every row pays for the longest in each step. A row
joining copies the whole cache once (both left-padded to the wider width, one above the
other); a row leaving takes its cache row out, and any leading columns that are padding
in every row left.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from modelpool.worker.backends.hf.packed import RowCache


class PaddedRows:
    """The running rows' shared left-padded cache and its mask, in the batch's row order."""

    def __init__(self) -> None:
        self.cache: Any = None  # a transformers DynamicCache, [rows, heads, columns, dim] a layer
        self.mask: torch.Tensor | None = None  # [rows, columns], 1 where a real token is

    def __len__(self) -> int:
        return 0 if self.mask is None else int(self.mask.shape[0])

    @property
    def tokens(self) -> int:
        """Rows x columns of the padded cache (what its memory holds)."""
        return 0 if self.mask is None else int(self.mask.numel())

    def add(self, cache: Any, columns: list[tuple[int, int]], limits: list[int]) -> None:
        """Rows of a prefill cache join: row ``i`` of ``cache`` holds its KV in columns
        ``columns[i]`` (start, end), its last columns (a prefill cache is left-padded);
        ``limits``, what each may come to hold, is the per-row form's (not needed here)."""
        import torch

        keys = cache.layers[0].keys
        width = int(keys.shape[-2])
        mask = torch.zeros((len(columns), width), dtype=torch.long, device=keys.device)
        for index, (start, end) in enumerate(columns):
            mask[index, start:end] = 1
        if self.cache is None or self.mask is None:
            self.cache, self.mask = cache, mask
            self._trim()
            return
        old_width = int(self.mask.shape[1])
        joined_width = max(old_width, width)
        for old_layer, new_layer in zip(self.cache.layers, cache.layers, strict=True):
            old_layer.keys = _stacked(old_layer.keys, new_layer.keys, joined_width)
            old_layer.values = _stacked(old_layer.values, new_layer.values, joined_width)
        pad = torch.nn.functional.pad
        self.mask = torch.cat(
            [pad(self.mask, (joined_width - old_width, 0)), pad(mask, (joined_width - width, 0))]
        )

    @classmethod
    def of(cls, rows: RowCache) -> PaddedRows:
        """The rows of a per-row cache, in the same order, as one padded cache."""
        from transformers import DynamicCache

        padded = cls()
        for index in range(len(rows)):
            layers = rows.row_layers(index)
            length = int(layers[0][0].shape[-2])
            padded.add(DynamicCache(ddp_cache_data=layers), [(0, length)], [length])
        return padded

    def select(self, keep: list[int]) -> None:
        """Keep rows ``keep`` (indices, in order); the others leave."""
        import torch

        if not keep:
            self.cache = self.mask = None
            return
        assert self.mask is not None
        kept = torch.tensor(keep, device=self.mask.device)
        self.cache.batch_select_indices(kept)
        self.mask = self.mask[kept]
        self._trim()

    def row_layers(self, index: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Row ``index``'s KV, [1, kv_heads, length, dim] a layer (views)."""
        assert self.mask is not None
        held = int(self.mask[index].sum())
        start = int(self.mask.shape[1]) - held  # left-padded: its columns are the last
        row_columns = (slice(index, index + 1), slice(None), slice(start, None))
        return [(layer.keys[row_columns], layer.values[row_columns]) for layer in self.cache.layers]

    def decode(
        self, model: Any, last_tokens: torch.Tensor, cache_keyword: str, extra: dict[str, int]
    ) -> torch.Tensor:
        """One decoding step of every row (``last_tokens``: each row's latest token): the
        logits, one row each. The mask takes its new column only once the pass succeeded."""
        import torch

        assert self.mask is not None
        mask = torch.nn.functional.pad(self.mask, (0, 1), value=1)
        output = model(
            input_ids=last_tokens[:, None],
            attention_mask=mask,
            position_ids=mask.sum(-1, keepdim=True) - 1,
            use_cache=True,
            **{cache_keyword: self.cache},
            **extra,
        )
        self.mask = mask
        logits: torch.Tensor = output.logits[:, -1, :]
        return logits

    def _trim(self) -> None:
        """Drop leading columns that are padding in every row (the longest request left)."""
        assert self.mask is not None
        real = self.mask.any(dim=0).nonzero()
        start = int(real[0]) if real.numel() else 0
        if start == 0:
            return
        for layer in self.cache.layers:
            layer.keys = layer.keys[:, :, start:, :]
            layer.values = layer.values[:, :, start:, :]
        self.mask = self.mask[:, start:]


def _stacked(old: torch.Tensor, new: torch.Tensor, width: int) -> torch.Tensor:
    """[rows, heads, columns, dim] cache tensors one above the other, each left-padded with
    zeros to ``width`` columns: written once into the result, where padding each and then
    concatenating wrote every byte twice."""
    stacked = old.new_zeros((old.shape[0] + new.shape[0], old.shape[1], width, old.shape[3]))
    stacked[: old.shape[0], :, width - old.shape[2] :] = old
    stacked[old.shape[0] :, :, width - new.shape[2] :] = new
    return stacked
