"""The batched hf loop's running rows, each on a KV cache of its own, stepped in one packed
forward pass (with a prefill slice riding on it when there is one).

Why not one left-padded cache: with rows of different lengths every row then pays for the
longest, in attention (a 50-token row reads the 1,200 masked columns of its neighbour) and in
memory, and transformers' ``DynamicCache`` concatenates, so every step copies the whole
cache once more. Measured on SmolLM2-135M in float32, two threads, one step: one row of 1,200
tokens with seven of 50 took 169-176 ms padded against 88-101 ms here; one with fifteen of
50, 261-303 ms against 149-156 ms; a batch of equal short rows costs the same either way.

:class:`RowCache` holds each row's keys and values in buffers of its own ([kv_heads,
capacity, dim] a layer, grown by half when full), with its length. A step is one forward
pass over a packed sequence: every running row's last token (then the slice's prompt tokens,
when one rides along), each at its own position. Only attention is split, by an attention
function registered with transformers' ``AttentionInterface`` and switched on for the pass
alone: each row's new key and value are written after its columns, then

- a row longer than :data:`GATHER_COLUMNS` attends to its own buffer alone (a view: nothing
  is copied);
- the shorter rows are gathered into one padded call (copying short rows costs less than a
  call of attention each);
- on the CPU outside float32, a row's query heads that share a key-value head are that
  head's query positions in the call (:func:`_decoding_attention`: torch's CPU kernel is
  slow on a single query position in bfloat16 and float16);
- the slice's keys and values are written into its request's own buffers (a
  :class:`RowKV` too, made for the whole prompt when its prefill starts), and it attends
  to their columns so far, causally.

A prompt read in slices thus never copies what it has read: each slice writes its
columns in place, and once the prompt is read the same buffers join the running rows as
they are. (A transformers ``DynamicCache`` concatenates: each slice would copy the whole
prompt so far, and the join copy it once more, in the step the running rows wait for.)
A slice read while no row is decoding runs the same pass with no rows.

A row's length grows only once the pass has succeeded, so a failed pass leaves every row
as it was: what it wrote past a row's length is never read.

A model whose layers do not all call this attention (attention not dispatched through the
interface), or that needs more than plain attention (a sliding window, soft capping),
raises :class:`FusionUnsupported`; the runner then moves its rows into the padded cache
(``hf.padded``) and reads slices in passes of their own.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

_ATTENTION_NAME = "modelpool_packed"

GATHER_COLUMNS = 256
"""Rows holding at most this many columns share one attention call; longer ones have one each."""

_HEADROOM = 32
"""Columns a row's buffers hold beyond its length when it joins (at most its ``limit``)."""


class FusionUnsupported(Exception):
    """This model cannot run a packed pass; it runs on the padded cache instead."""


def fusable(model: Any) -> bool:
    """Whether ``model`` may run packed passes: plain sdpa attention over full context."""
    config = model.config
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    if getattr(config, "sliding_window", None) is not None:
        return False
    if getattr(config, "v_head_dim", None) is not None:
        return False  # value heads sized apart from the queries' (MLA): not plain attention
    layer_types = getattr(config, "layer_types", None)
    return layer_types is None or all(kind == "full_attention" for kind in layer_types)


@dataclass(eq=False)
class RowKV:
    """One row's keys and values, a [kv_heads, capacity, dim] buffer a layer; ``length``
    columns of them are its tokens, ``limit`` the most it may come to hold (its prompt
    and every token it may generate: the buffers never grow past it).

    A prefilling row's buffers are made by its first pass, each layer's as that layer
    writes to it (their shapes are known then), ``planned`` columns wide."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    length: int
    limit: int
    planned: int = 0

    @classmethod
    def for_prompt(cls, prompt_tokens: int, limit: int, prefix: Any = None, read: int = 0) -> RowKV:
        """A prefilling row's: room for its whole prompt and a little of its answer; its
        first ``read`` columns copied from ``prefix`` (a ``DynamicCache``, from the prefix
        cache or from slices read before) when one is given."""
        planned = max(prompt_tokens, min(limit, prompt_tokens + _HEADROOM))
        row = cls([], [], 0, limit, planned)
        if prefix is not None and read:
            for layer in prefix.layers:
                row.keys.append(_grown(layer.keys[0], read, planned))
                row.values.append(_grown(layer.values[0], read, planned))
            row.length = read
        return row

    @property
    def capacity(self) -> int:
        return int(self.keys[0].shape[1]) if self.keys else self.planned

    def made(self, layer: int, key: torch.Tensor) -> None:
        """Make layer ``layer``'s buffers if they are not yet (``key``: a [1, kv_heads,
        tokens, dim] key of that layer, for the shape)."""
        if layer < len(self.keys):
            return
        if layer != len(self.keys):
            raise FusionUnsupported(f"layer {layer} ran before layer {len(self.keys)}")
        shape = (key.shape[1], self.planned, key.shape[3])
        self.keys.append(key.new_zeros(shape))
        self.values.append(key.new_zeros(shape))

    def as_dynamic(self) -> Any:
        """Its columns as a transformers ``DynamicCache`` (copied), for the padded form."""
        from transformers import DynamicCache

        if not self.length:
            return DynamicCache()
        return DynamicCache(
            ddp_cache_data=[
                (keys[None, :, : self.length].clone(), values[None, :, : self.length].clone())
                for keys, values in zip(self.keys, self.values, strict=True)
            ]
        )

    def reserve(self, columns: int) -> None:
        """Grow the buffers so that they hold ``columns``: by half at least, short of the
        row's limit (a copy of the row now and then, not at every step)."""
        if columns <= self.capacity:
            return
        capacity = max(columns, min(self.limit, self.capacity + self.capacity // 2))
        self.keys = [_grown(buffer, self.length, capacity) for buffer in self.keys]
        self.values = [_grown(buffer, self.length, capacity) for buffer in self.values]


def _grown(buffer: torch.Tensor, length: int, capacity: int) -> torch.Tensor:
    # Zeros, not empty memory: a gathered call reads columns past a row's length (masked
    # out), and a NaN there would still reach the output through a zero weight.
    grown = buffer.new_zeros((buffer.shape[0], capacity, buffer.shape[2]))
    grown[:, :length] = buffer[:, :length]
    return grown


class RowCache:
    """The running rows' caches, in the batch's row order."""

    def __init__(self) -> None:
        self.rows: list[RowKV] = []

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def tokens(self) -> int:
        """Columns held across rows (their tokens, not their spare capacity)."""
        return sum(row.length for row in self.rows)

    def add(self, cache: Any, columns: list[tuple[int, int]], limits: list[int]) -> None:
        """Rows of a prefill cache join: row ``i`` of ``cache`` holds its KV in columns
        ``columns[i]`` (start, end) and may come to hold ``limits[i]``."""
        for index, ((start, end), limit) in enumerate(zip(columns, limits, strict=True)):
            length = end - start
            capacity = max(length, min(limit, length + _HEADROOM))
            keys: list[torch.Tensor] = []
            values: list[torch.Tensor] = []
            for layer in cache.layers:
                for source, target in ((layer.keys, keys), (layer.values, values)):
                    buffer = source.new_zeros((source.shape[1], capacity, source.shape[3]))
                    buffer[:, :length] = source[index, :, start:end]
                    target.append(buffer)
            self.rows.append(RowKV(keys, values, length, limit))

    def adopt(self, row: RowKV) -> None:
        """A row whose prompt was read into buffers of its own joins, buffers and all."""
        self.rows.append(row)

    def select(self, keep: list[int]) -> None:
        """Keep rows ``keep`` (indices, in order); the others leave."""
        self.rows = [self.rows[index] for index in keep]

    def decode(
        self, model: Any, last_tokens: torch.Tensor, cache_keyword: str, extra: dict[str, int]
    ) -> torch.Tensor:
        """One decoding step of every row, a packed pass with no slice (the arguments
        after ``last_tokens`` are the padded form's, not needed here)."""
        return packed_forward(model, self, last_tokens)

    def row_layers(self, index: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Row ``index``'s KV, [1, kv_heads, length, dim] a layer (views)."""
        row = self.rows[index]
        return [
            (keys[None, :, : row.length], values[None, :, : row.length])
            for keys, values in zip(row.keys, row.values, strict=True)
        ]


@dataclass
class _Plan:
    """What the packed attention needs for one pass."""

    rows: list[RowKV]
    alone: list[int]  # rows attending to their own buffer alone
    gathered: list[int]  # rows sharing one padded call
    gathered_index: torch.Tensor | None
    gathered_mask: torch.Tensor | None  # [gathered, 1, 1, width], True where a row may attend
    slice_row: RowKV | None
    slice_mask: torch.Tensor | None  # [1, 1, slice, read + slice]; None: causal from column 0
    layers_called: int = 0
    gathered_width: int = 0


_PLAN: contextvars.ContextVar[_Plan | None] = contextvars.ContextVar(
    "modelpool_packed_plan", default=None
)


def packed_forward(
    model: Any,
    cache: RowCache,
    last_tokens: torch.Tensor,
    *,
    slice_row: RowKV | None = None,
    slice_ids: list[int] | None = None,
    slice_logits: bool = False,
) -> torch.Tensor:
    """One pass: a decoding step of every row in ``cache`` (``last_tokens``: each row's
    latest token; there may be none), and ``slice_ids`` when given, the next prompt tokens
    of a request whose prompt so far is in ``slice_row``. Returns the logits, one per row,
    then the slice's last position when ``slice_logits``.

    On success every row is one column longer and the slice is in ``slice_row``; on any
    failure, nothing has changed."""
    import torch

    _register()
    device = last_tokens.device
    slice_ids = slice_ids or []
    count = len(slice_ids)
    read = 0 if slice_row is None else slice_row.length
    if count and slice_row is None:
        raise ValueError("a slice needs the buffers it is read into")
    rows = cache.rows
    for row in rows:
        row.reserve(row.length + 1)
    gathered = [index for index, row in enumerate(rows) if row.length < GATHER_COLUMNS]
    alone = [index for index, row in enumerate(rows) if row.length >= GATHER_COLUMNS]
    gathered_index = gathered_mask = None
    width = 0
    if gathered:
        lengths = torch.tensor([rows[index].length for index in gathered], device=device)
        width = int(lengths.max()) + 1
        for index in gathered:
            rows[index].reserve(width)  # the gathered call reads ``width`` columns of each
        gathered_index = torch.tensor(gathered, device=device)
        gathered_mask = (torch.arange(width, device=device)[None, :] <= lengths[:, None])[
            :, None, None, :
        ]
    slice_mask = None
    if count and read:
        read_positions = torch.arange(read + count, device=device)
        slice_mask = (read_positions[None, :] <= read_positions[read:, None])[None, None]
    plan = _Plan(
        rows=rows,
        alone=alone,
        gathered=gathered,
        gathered_index=gathered_index,
        gathered_mask=gathered_mask,
        slice_row=slice_row if count else None,
        slice_mask=slice_mask,
        gathered_width=width,
    )
    positions = [row.length for row in rows]
    input_ids = torch.cat([last_tokens, torch.tensor(slice_ids, dtype=torch.long, device=device)])
    position_ids = torch.tensor(positions + list(range(read, read + count)), device=device)
    keep = list(range(len(rows))) + ([len(rows) + count - 1] if slice_logits and count else [])
    keep_index = torch.tensor(keep, dtype=torch.long, device=device)
    config = model.config
    implementation = config._attn_implementation
    token = _PLAN.set(plan)
    config._attn_implementation = _ATTENTION_NAME
    try:
        output = model(
            input_ids=input_ids[None, :],
            position_ids=position_ids[None, :],
            # Never read: the packed attention builds its own masks. A 4D mask is passed as
            # it is, so transformers builds none.
            attention_mask=torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device),
            use_cache=False,
            logits_to_keep=keep_index,
        )
        if plan.layers_called != _layer_count(config):
            raise FusionUnsupported(
                f"{plan.layers_called} of {_layer_count(config)} layers used the packed attention"
            )
    finally:
        config._attn_implementation = implementation
        _PLAN.reset(token)
    for row in rows:
        row.length += 1
    if slice_row is not None:
        slice_row.length = read + count
    logits: torch.Tensor = output.logits[0]
    return logits


def _layer_count(config: Any) -> int:
    text_config = getattr(config, "get_text_config", lambda: config)()
    return int(text_config.num_hidden_layers)


def _packed_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention for a packed [1, heads, rows + slice, dim] pass: each row against its own
    cache, the slice against its prompt's cache. Output [1, tokens, heads, dim], as
    transformers' sdpa gives it."""
    import torch
    from torch.nn.functional import scaled_dot_product_attention

    plan = _PLAN.get()
    if plan is None or kwargs.get("softcap") is not None or kwargs.get("sliding_window"):
        raise FusionUnsupported("attention beyond plain sdpa in a packed pass")
    plan.layers_called += 1
    layer, scale = module.layer_idx, kwargs.get("scaling")
    rows = len(plan.rows)
    for index, row in enumerate(plan.rows):
        row.keys[layer][:, row.length] = key[0, :, index]
        row.values[layer][:, row.length] = value[0, :, index]
    decoded = query.new_empty((1, query.shape[1], rows, query.shape[3]))
    for index in plan.alone:
        row = plan.rows[index]
        columns = row.length + 1
        decoded[:, :, index : index + 1] = _decoding_attention(
            query[:, :, index : index + 1],
            row.keys[layer][None, :, :columns],
            row.values[layer][None, :, :columns],
            None,
            scale,
        )
    if plan.gathered:
        width = plan.gathered_width
        keys = torch.stack([plan.rows[index].keys[layer][:, :width] for index in plan.gathered])
        values = torch.stack([plan.rows[index].values[layer][:, :width] for index in plan.gathered])
        # [1, heads, gathered, dim] -> [gathered, heads, 1, dim]: one query per row.
        queries = query[0][:, plan.gathered_index].transpose(0, 1).unsqueeze(2)
        answered = _decoding_attention(queries, keys, values, plan.gathered_mask, scale)
        decoded[0][:, plan.gathered_index] = answered[:, :, 0].transpose(0, 1)
    output = decoded.transpose(1, 2)
    target = plan.slice_row
    if target is None:
        return output, None
    target.made(layer, key)
    end = target.length + key.shape[2] - rows
    target.keys[layer][:, target.length : end] = key[0, :, rows:]
    target.values[layer][:, target.length : end] = value[0, :, rows:]
    sliced = scaled_dot_product_attention(
        query[:, :, rows:],
        target.keys[layer][None, :, :end],
        target.values[layer][None, :, :end],
        attn_mask=plan.slice_mask,
        is_causal=plan.slice_mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return torch.cat([output, sliced.transpose(1, 2)], dim=1), None


def _decoding_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None,
) -> torch.Tensor:
    """One query per row ([rows, heads, 1, dim]) against ``keys``/``values`` ([rows,
    kv_heads, columns, dim]); ``mask`` [rows, 1, 1, columns] or None.

    Outside float32 the query heads that share a key-value head are given to attention as
    that head's query positions ([rows, kv_heads, group, dim], none of them causal), which
    is the same arithmetic (query head ``h`` reads key-value head ``h // group``, as
    ``enable_gqa`` and transformers' ``repeat_kv`` have it): torch's CPU kernel runs a
    single query position 5-6x slower in bfloat16 and 2-3x in float16 than the same
    work as ``group`` positions (SmolLM2-135M's shapes, two threads: 8 rows of 121 columns
    383 against 67 us a layer in bfloat16), and in float32 it is the other way (52 against
    69 us), so float32 keeps ``enable_gqa``; so do other devices, whose kernels were not
    measured here."""
    from torch.nn.functional import scaled_dot_product_attention

    rows, heads, _, dim = query.shape
    kv_heads = keys.shape[1]
    if query.element_size() >= 4 or heads == kv_heads or query.device.type != "cpu":
        return scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
        )
    grouped = query.reshape(rows, kv_heads, heads // kv_heads, dim)
    answered = scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=scale)
    return answered.reshape(rows, heads, 1, dim)


def _register() -> None:
    from transformers import AttentionInterface

    if _ATTENTION_NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(_ATTENTION_NAME, _packed_attention)
