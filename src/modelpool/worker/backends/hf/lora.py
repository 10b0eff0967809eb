"""LoRA adapters on one copy of an hf model's weights, each row of a batch with its own.

Every adapted ``nn.Linear`` of the base gets a forward hook (once, when the first adapter
that targets it is loaded); a pass sets which adapter each of its tokens uses
(:func:`tokens_use`, a context variable read by the hooks) and each hook adds, for every
adapter present in the pass, ``lora_B(lora_A(x)) * scale`` to that adapter's tokens only
(gathered, computed, added back with ``index_add_``: S-LoRA's and Punica's layout, without
their kernels). A pass whose tokens all use one adapter adds it to the whole output, and a
pass with none costs each hooked module one context-variable read.

Why hooks rather than PEFT's ``PeftModel`` with ``adapter_names``: the batched loop's
packed pass puts several rows' tokens in one sequence (``hf.packed``), so adapters differ
along a row, not only between rows, which ``adapter_names`` (one name per row) cannot say;
and a PEFT wrapper would change the module tree the packed attention and the prefix cache
count on. PEFT stays the reference the tests compare with: the same sum in the same order,
``result + lora_B(lora_A(x)) * scaling``.

:class:`Loras` holds at most ``max_loras`` adapters (the ``max_loras`` load option); the
least recently used one that no started row uses leaves for a new one. A request's adapter
is read and checked against the model (its modules and their shapes) when the request is
admitted, before any batch: a bad one fails that request alone with a message naming the
adapter. A request whose adapter finds every place taken by adapters that started rows use
waits, like one that finds no KV room.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modelpool.shared.errors import InvalidRequest
from modelpool.shared.lora import ADAPTER_WEIGHTS, LoraRef, inspect_adapter, split_lora_key

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

DEFAULT_MAX_LORAS = 8
"""Adapters one worker holds when the ``max_loras`` load option is not given."""

NO_ADAPTER = 0
"""The slot of a row that uses the base alone."""

TokenAdapters = int | list[tuple[int, "torch.Tensor"]]
"""A pass's adapters: one slot for every token, or each slot with the flat indices of its
tokens."""

_PASS: contextvars.ContextVar[TokenAdapters] = contextvars.ContextVar(
    "modelpool_lora_pass", default=NO_ADAPTER
)


@contextlib.contextmanager
def tokens_use(slots: Sequence[int], counts: Sequence[int], device: Any) -> Iterator[None]:
    """Within the block, a pass whose flat token ``i`` (rows' tokens in order, ``counts[r]``
    tokens of row ``r``) uses the adapter in ``slots[r]``."""
    import torch

    distinct = set(slots)
    if len(distinct) == 1:
        value: TokenAdapters = slots[0]
    else:
        flat = torch.repeat_interleave(torch.tensor(list(slots)), torch.tensor(list(counts)))
        value = [
            (slot, torch.nonzero(flat == slot).squeeze(1).to(device))
            for slot in sorted(distinct)
            if slot != NO_ADAPTER
        ]
    token = _PASS.set(value)
    try:
        yield
    finally:
        _PASS.reset(token)


@dataclass(eq=False)
class LoraWeights:
    """One adapter read from its directory: each adapted module's A and B, on the model's
    device and in its dtype."""

    ref: LoraRef
    # Each adapted module's A [r x in], B [out x r] and scale (lora_alpha / r).
    modules: dict[str, tuple[torch.Tensor, torch.Tensor, float]]


@dataclass(eq=False)
class _Held:
    weights: LoraWeights
    slot: int


@dataclass(eq=False)
class Loras:
    """The adapters one worker holds (see the module docstring). ``in_use``: the slots the
    started rows use now (they are never evicted)."""

    model: Any
    max_loras: int
    in_use: Callable[[], set[int]]
    _held: OrderedDict[LoraRef, _Held] = field(default_factory=OrderedDict)
    _slots: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor, float]]] = field(
        default_factory=dict
    )
    _hooked: set[str] = field(default_factory=set)
    _next_slot: int = 1

    @property
    def names(self) -> list[str]:
        """The adapters held, least recently used first."""
        return [ref.name for ref in self._held]

    def stage(self, ref: LoraRef) -> LoraWeights:
        """``ref``'s weights: the held ones, else read and checked now (InvalidRequest
        naming the adapter when it does not fit this model)."""
        held = self._held.get(ref)
        if held is not None:
            return held.weights
        return read_adapter(self.model, ref)

    def acquire(self, weights: LoraWeights) -> int | None:
        """The slot of ``weights``' adapter, installed if need be (the least recently used
        adapter no started row uses leaves when all ``max_loras`` places are taken); None
        when every place is taken by adapters in use."""
        ref = weights.ref
        held = self._held.get(ref)
        if held is not None:
            self._held.move_to_end(ref)
            return held.slot
        if len(self._held) >= self.max_loras:
            busy = self.in_use()
            victim = next((r for r, h in self._held.items() if h.slot not in busy), None)
            if victim is None:
                return None
            self._evict(victim)
        slot = self._next_slot
        self._next_slot += 1
        self._install(slot, weights)
        self._held[ref] = _Held(weights, slot)
        logger.info("LoRA adapter %s loaded (%d modules)", ref.name, len(weights.modules))
        return slot

    @contextlib.contextmanager
    def solo(self, ref: LoraRef | None) -> Iterator[None]:
        """A one-call request's adapter for every pass within the block."""
        if ref is None:
            yield
            return
        slot = self.acquire(self.stage(ref))
        assert slot is not None  # one request at a time: no adapter is in use
        token = _PASS.set(slot)
        try:
            yield
        finally:
            _PASS.reset(token)

    def _evict(self, ref: LoraRef) -> None:
        held = self._held.pop(ref)
        self._slots.pop(held.slot, None)
        logger.info("LoRA adapter %s unloaded (least recently used)", ref.name)

    def _install(self, slot: int, weights: LoraWeights) -> None:
        modules = dict(self.model.named_modules())
        for name in weights.modules:
            if name not in self._hooked:
                modules[name].register_forward_hook(self._hook(name))
                self._hooked.add(name)
        self._slots[slot] = weights.modules

    def _hook(self, name: str) -> Callable[[Any, tuple[Any, ...], Any], Any]:
        import torch

        slots = self._slots
        linear = torch.nn.functional.linear

        def add_adapters(module: Any, args: tuple[Any, ...], output: torch.Tensor) -> Any:
            active = _PASS.get()
            if active == NO_ADAPTER:
                return None
            x = args[0]
            if isinstance(active, int):
                pair = slots.get(active, {}).get(name)
                if pair is None:
                    return None
                a, b, scale = pair
                return output + linear(linear(x, a), b) * scale
            flat_x = x.reshape(-1, x.shape[-1])
            flat_out = output.reshape(-1, output.shape[-1])
            for slot, index in active:
                pair = slots.get(slot, {}).get(name)
                if pair is None:
                    continue
                a, b, scale = pair
                flat_out.index_add_(0, index, linear(linear(flat_x[index], a), b) * scale)
            return output

        return add_adapters


def read_adapter(model: Any, ref: LoraRef) -> LoraWeights:
    """Read the PEFT LoRA directory ``ref.path`` for ``model``: InvalidRequest naming the
    adapter when its files are bad or it does not fit the model's modules."""
    import torch
    from safetensors.torch import load_file

    info = inspect_adapter(ref.name, ref.path, None)

    def bad(why: str) -> InvalidRequest:
        return InvalidRequest(f"LoRA adapter {ref.name!r} ({ref.path}): {why}")

    folder = Path(ref.path)
    config = json.loads((folder / "adapter_config.json").read_text(encoding="utf-8"))
    alpha = float(config.get("lora_alpha", info.rank))
    try:
        tensors = load_file(str(folder / ADAPTER_WEIGHTS))
    except Exception as exc:
        raise bad(f"{ADAPTER_WEIGHTS} cannot be read: {exc}") from None
    matrices: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module_name, _, part = split_lora_key(key)
        matrices.setdefault(module_name, {})[part] = tensor
    modules = dict(model.named_modules())
    parameter = next(model.parameters())
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
    for name in info.modules:
        module = modules.get(name)
        if module is None:
            raise bad(f"target module {name} is not a module of the base model")
        if not isinstance(module, torch.nn.Linear):
            raise bad(f"target module {name} is a {type(module).__name__}, not a Linear")
        a, b = matrices[name]["lora_A"], matrices[name]["lora_B"]
        if a.shape[1] != module.in_features or b.shape[0] != module.out_features:
            raise bad(
                f"module {name}: the adapter is [{b.shape[0]} x {a.shape[1]}], the base's is "
                f"[{module.out_features} x {module.in_features}]: an adapter of another base"
            )
        rank = int(a.shape[0])
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise bad(f"module {name} holds values that are not finite")
        pairs[name] = (
            a.to(device=parameter.device, dtype=parameter.dtype),
            b.to(device=parameter.device, dtype=parameter.dtype),
            alpha / rank**0.5 if config.get("use_rslora") else alpha / rank,
        )
    return LoraWeights(ref, pairs)
