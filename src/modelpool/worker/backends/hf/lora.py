"""LoRA adapters on one copy of an hf model's weights, each row of a batch with its own.

Every adapted ``nn.Linear`` of the base gets a forward hook (once, when the first adapter
that targets it is loaded); a pass sets which adapter each of its tokens uses
(:func:`tokens_use`, a context variable read by the hooks) and each hook adds, for every
token, ``lora_B(lora_A(x)) * scale`` of that token's adapter. A pass whose tokens all use
one adapter adds it to the whole output, in PEFT's order of operations; a pass with none
costs each hooked module one context-variable read. A mixed pass costs each hooked module
two matrix products whatever the number of adapters: the held adapters' A matrices are
stacked (r rows each, zeros where an adapter leaves the module alone), every token goes
through all of them, a per-token mask keeps its own adapter's columns (times its scale),
and the stacked B matrices sum them back (the mask is one gather a pass, of rows made when
an adapter comes or goes). That is the sum of the held ranks in work, where
gathering each adapter's tokens apart (Punica's and S-LoRA's layout, without their
kernels) costs four small operations per adapter and module: on a CPU, and on small
models, the number of operations is what costs.

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

NO_ADAPTER = 0
"""The slot of a row that uses the base alone."""


@dataclass(eq=False)
class MixedPass:
    """A pass whose tokens use several adapters: each flat token's slot, and the per-token
    column mask the hooks share (made by the first one)."""

    slots: torch.Tensor
    mask: torch.Tensor | None = None


TokenAdapters = int | MixedPass
"""A pass's adapters: one slot for every token, or one slot per token."""

_PASS: contextvars.ContextVar[TokenAdapters] = contextvars.ContextVar(
    "modelpool_lora_pass", default=NO_ADAPTER
)


@contextlib.contextmanager
def tokens_use(slots: Sequence[int], counts: Sequence[int], device: Any) -> Iterator[None]:
    """Within the block, a pass whose flat token ``i`` (rows' tokens in order, ``counts[r]``
    tokens of row ``r``) uses the adapter in ``slots[r]``."""
    import torch

    value: TokenAdapters
    if len(set(slots)) == 1:
        value = slots[0]
    elif all(count == 1 for count in counts):
        # A decode step (one token a row): the rows' slots are the tokens' slots.
        value = MixedPass(torch.tensor(list(slots), device=device))
    else:
        flat = torch.repeat_interleave(torch.tensor(list(slots)), torch.tensor(list(counts)))
        value = MixedPass(flat.to(device))
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
    # The stacked layout (module docstring): each slot's columns, each hooked module's
    # stacked A [sum r x in] and B [out x sum r], and each column's scale by module.
    _columns: dict[int, tuple[int, int]] = field(default_factory=dict)
    _stacked: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    _scales: dict[str, torch.Tensor] = field(default_factory=dict)
    _width: int = 0
    # Each column's scale when every module has the same (one lora_alpha / r an adapter,
    # the usual case): folded into the pass's mask, one product fewer per module.
    _column_scale: torch.Tensor | None = None
    # Each slot's mask row (row 0, the base's, all zero): a pass's mask is one gather.
    _mask_rows: torch.Tensor | None = None

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
        self._stack()
        logger.info("LoRA adapter %s unloaded (least recently used)", ref.name)

    def _install(self, slot: int, weights: LoraWeights) -> None:
        modules = dict(self.model.named_modules())
        for name in weights.modules:
            if name not in self._hooked:
                modules[name].register_forward_hook(self._hook(name))
                self._hooked.add(name)
        self._slots[slot] = weights.modules
        self._stack()

    def _stack(self) -> None:
        """The stacked layout of the adapters held now, for mixed passes."""
        self._columns.clear()
        ranks = {
            slot: max(a.shape[0] for a, _, _ in modules.values())
            for slot, modules in self._slots.items()
        }
        start = 0
        for slot, rank in ranks.items():
            self._columns[slot] = (start, start + rank)
            start += rank
        modules = dict(self.model.named_modules())
        for name in self._hooked:
            linear = modules[name]
            like = linear.weight
            stacked_a = like.new_zeros((start, linear.in_features))
            stacked_b = like.new_zeros((linear.out_features, start))
            scales = like.new_zeros((start,))
            for slot, (first, _) in self._columns.items():
                found = self._slots[slot].get(name)
                if found is None:
                    continue
                a, b, scale = found
                rank = a.shape[0]
                stacked_a[first : first + rank] = a
                stacked_b[:, first : first + rank] = b
                scales[first : first + rank] = scale
            self._stacked[name] = (stacked_a, stacked_b)
            self._scales[name] = scales
        self._width = start
        scales_seen = list(self._scales.values())
        same = all(bool((other == scales_seen[0]).all()) for other in scales_seen[1:])
        self._column_scale = scales_seen[0] if scales_seen and same else None
        rows = next(self.model.parameters()).new_zeros((max(self._columns, default=0) + 1, start))
        for slot, (first, end) in self._columns.items():
            rows[slot, first:end] = (
                1 if self._column_scale is None else self._column_scale[first:end]
            )
        self._mask_rows = rows

    def _mask(self, active: MixedPass) -> torch.Tensor:
        """Per token, 1 in its adapter's columns (or their scale, when every module has the
        same), 0 elsewhere: made once a pass."""
        if active.mask is None:
            assert self._mask_rows is not None  # a mixed pass comes after an install
            active.mask = self._mask_rows.index_select(0, active.slots)
        return active.mask

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
            stacked_a, stacked_b = self._stacked[name]
            mask = self._mask(active)
            if self._column_scale is None:
                mask = mask * self._scales[name]
            flat_x = x.reshape(-1, x.shape[-1])
            flat_out = output.reshape(-1, output.shape[-1])
            delta = torch.addmm(flat_out, linear(flat_x, stacked_a) * mask, stacked_b.t())
            return delta.view(output.shape)

        return add_adapters


def read_adapter(model: Any, ref: LoraRef) -> LoraWeights:
    """Read the PEFT LoRA directory ``ref.path`` for ``model``: InvalidRequest naming the
    adapter when its files are bad or it does not fit the model's modules."""
    import torch
    from safetensors.torch import load_file

    info = inspect_adapter(ref.name, ref.path, None)

    def bad(why: str) -> InvalidRequest:
        return InvalidRequest(f"LoRA adapter {ref.name!r}: {why}")

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
