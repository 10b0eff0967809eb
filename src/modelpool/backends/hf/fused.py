"""A decoding step and a prefill slice in one forward pass (the batched hf loop's chunked prefill).

On a CPU a forward pass has a fixed cost, reading every weight once, of about a whole
decoding step (SmolLM2-135M, one thread: about 80 ms for one token, 3 ms for each more
prompt token). Read as passes of their own, the slices of a long prompt each pay it
again, which is what chunked prefill cost in throughput. Fused, the slice rides on the
decoding step's pass: the running rows' tokens and the slice's tokens go through the
weights together as one packed sequence, and only attention is split: each running row
attends to its own columns of the shared left-padded cache (as a plain decoding step
does), the slice to the prompt's own cache, causally.

The split is done by an attention function registered with transformers'
``AttentionInterface`` and switched on for the fused pass alone; it reads the two caches
from :data:`_PLAN`. A model whose layers do not all call it (attention not dispatched
through the interface), or that needs more than plain attention (a sliding window, soft
capping), raises :class:`FusionUnsupported` and the runner reads its slices in passes of
their own, as before.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

_ATTENTION_NAME = "modelpool_fused"


class FusionUnsupported(Exception):
    """This model cannot run a fused pass; its slices are read in passes of their own."""


@dataclass
class FusedPlan:
    """What the fused attention needs: both caches and both masks, for one pass."""

    batch_cache: Any  # the running rows' shared cache (DynamicCache)
    decode_mask: torch.Tensor  # [rows, 1, 1, columns + 1], True where a row may attend
    slice_cache: Any  # the prompt's own cache (DynamicCache)
    slice_mask: torch.Tensor  # [1, 1, slice, read + slice]
    rows: int
    layers_called: int = 0


_PLAN: contextvars.ContextVar[FusedPlan | None] = contextvars.ContextVar(
    "modelpool_fused_plan", default=None
)


def fusable(model: Any) -> bool:
    """Whether ``model`` may run fused passes: plain sdpa attention over full context."""
    config = model.config
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    if getattr(config, "sliding_window", None) is not None:
        return False
    layer_types = getattr(config, "layer_types", None)
    return layer_types is None or all(kind == "full_attention" for kind in layer_types)


def fused_forward(
    model: Any,
    *,
    batch_cache: Any,
    batch_mask: torch.Tensor,
    last_tokens: torch.Tensor,
    slice_cache: Any,
    read: int,
    slice_ids: list[int],
    slice_logits: bool,
) -> torch.Tensor:
    """One pass: a decoding step of every running row and ``slice_ids``, the next prompt
    tokens of a request that has ``read`` of them in ``slice_cache``. ``batch_mask`` is the
    running rows' mask with the new column. Returns the logits, one per running row, then
    the slice's last position when ``slice_logits``.

    Appends to both caches. On any failure, what was appended is taken out again (the
    caller then reads the slice and runs the step in passes of their own, so that a fault
    is still one request's or the batch's)."""
    import torch

    _register()
    device = batch_mask.device
    rows, count = int(last_tokens.shape[0]), len(slice_ids)
    batch_width = int(batch_mask.shape[1]) - 1
    read_positions = torch.arange(read + count, device=device)
    plan = FusedPlan(
        batch_cache=batch_cache,
        decode_mask=batch_mask.bool()[:, None, None, :],
        slice_cache=slice_cache,
        slice_mask=(read_positions[None, :] <= read_positions[read:, None])[None, None],
        rows=rows,
    )
    input_ids = torch.cat([last_tokens, torch.tensor(slice_ids, device=device)])[None, :]
    position_ids = torch.cat(
        [batch_mask.sum(-1) - 1, torch.arange(read, read + count, device=device)]
    )[None, :]
    keep = list(range(rows)) + ([rows + count - 1] if slice_logits else [])
    config = model.config
    implementation = config._attn_implementation
    token = _PLAN.set(plan)
    config._attn_implementation = _ATTENTION_NAME
    try:
        output = model(
            input_ids=input_ids,
            position_ids=position_ids,
            # Never read: the fused attention builds its own masks. A 4D mask is passed as
            # it is, so transformers builds none.
            attention_mask=torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device),
            use_cache=False,
            logits_to_keep=torch.tensor(keep, device=device),
        )
        if plan.layers_called != _layer_count(config):
            raise FusionUnsupported(
                f"{plan.layers_called} of {_layer_count(config)} layers used the fused attention"
            )
    except BaseException:
        _crop(batch_cache, batch_width)
        _crop(slice_cache, read)
        raise
    finally:
        config._attn_implementation = implementation
        _PLAN.reset(token)
    logits: torch.Tensor = output.logits[0]
    return logits


def _layer_count(config: Any) -> int:
    text_config = getattr(config, "get_text_config", lambda: config)()
    return int(text_config.num_hidden_layers)


def _crop(cache: Any, columns: int) -> None:
    """Take out the columns after the first ``columns`` that a failed pass appended."""
    for layer in cache.layers:
        keys = getattr(layer, "keys", None)
        if keys is not None and keys.dim() == 4 and keys.shape[-2] > columns:
            layer.keys = keys[:, :, :columns, :]
            layer.values = layer.values[:, :, :columns, :]


def _fused_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention for a packed [1, heads, rows + slice, dim] pass: each running row against
    its own cache row, the slice against its prompt's cache. Output [1, tokens, heads, dim],
    as transformers' sdpa gives it."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    plan = _PLAN.get()
    if plan is None or kwargs.get("softcap") is not None or kwargs.get("sliding_window"):
        raise FusionUnsupported("attention beyond plain sdpa in a fused pass")
    plan.layers_called += 1
    rows, layer = plan.rows, module.layer_idx

    def per_row(states: torch.Tensor) -> torch.Tensor:
        # [1, heads, rows, dim] -> [rows, heads, 1, dim]: one query per cache row.
        return states[0, :, :rows].transpose(0, 1).unsqueeze(2)

    keys, values = plan.batch_cache.update(per_row(key), per_row(value), layer)
    decoded, _ = sdpa_attention_forward(
        module, per_row(query), keys, values, plan.decode_mask, **kwargs
    )
    keys, values = plan.slice_cache.update(key[:, :, rows:], value[:, :, rows:], layer)
    sliced, _ = sdpa_attention_forward(
        module, query[:, :, rows:], keys, values, plan.slice_mask, **kwargs
    )
    return torch.cat([decoded.transpose(0, 1), sliced], dim=1), None


def _register() -> None:
    from transformers import AttentionInterface

    if _ATTENTION_NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(_ATTENTION_NAME, _fused_attention)
