"""Reads of a cancel flag between a transformer's layers, for forward passes long enough
to outlast the pool's ``cancel_grace_s`` (after which the supervisor kills the worker):
a prefill (``hf.generation.cancellable``) and a pooling model's micro-batch
(:class:`LayerStops`). Either then stops within one layer's time, not one pass's."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any


def transformer_layers(model: Any) -> list[Any]:
    """The model's transformer layers: the module list as long as its config's layer count
    (``model.layers`` on llama-like models, ``transformer.h`` on gpt2, ``encoder.layer``
    on BERT); [] if none is."""
    import torch

    count = getattr(model.config, "num_hidden_layers", None)
    if not count:
        return []
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == count:
            return list(module)
    return []


class ForwardCancelled(Exception):
    """A pooling forward pass was stopped before one of its layers: the flag it was read
    under (:meth:`LayerStops.reading`) said stop."""


class LayerStops:
    """A forward pre-hook on each of ``network``'s transformer layers, installed once (a
    hook added and removed around every pass would cost each pass the registration):
    inside :meth:`reading`, each layer first calls the given ``stop`` (one flag read) and
    raises :class:`ForwardCancelled` when it returns True; outside it a layer runs as it
    would with no hook. The hook reads nothing else and changes no input, so a pass that is
    not stopped computes exactly what it would without it."""

    def __init__(self, network: Any) -> None:
        self._stop: Callable[[], bool] | None = None
        self.layers = transformer_layers(network)
        for layer in self.layers:
            layer.register_forward_pre_hook(self._before_layer)

    def _before_layer(self, module: Any, args: tuple[Any, ...]) -> None:
        if self._stop is not None and self._stop():
            raise ForwardCancelled

    @contextlib.contextmanager
    def reading(self, stop: Callable[[], bool]) -> Iterator[None]:
        """Within the block, every layer's run first reads ``stop``."""
        self._stop = stop
        try:
            yield
        finally:
            self._stop = None
