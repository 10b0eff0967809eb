"""LoRA GGUF adapters on one llama.cpp model: at most ``max_loras`` held, least recently
used out, never one that a started row uses.

llama.cpp applies adapters to a whole context, not per sequence, so rows of different
adapters cannot share one ``llama_decode``: the runner groups a step's rows by adapter
and decodes one group a step, taking the groups in turn (``LlamaRunner.run``).

An adapter is read (``llama_adapter_lora_init``) when its first request is admitted,
before it reaches a batch: a file llama.cpp refuses is that request's 400 naming the
adapter. When every place is taken by adapters that started rows use, the adapter read
to check it is freed again, and the row waits before it starts, as for KV room::

    loras = GgufLoras(runtime, max_loras=4)
    loras.check(ref)            # InvalidRequest naming the adapter; at admission
    key = loras.acquire(ref)    # None: every place in use, wait; as the row starts
    runtime.use_adapter(loras.handle(key))
    loras.release(key)          # the row ended
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol

from modelpool.shared.errors import InvalidRequest
from modelpool.shared.lora import LoraRef


class AdapterRuntime(Protocol):
    """What :class:`GgufLoras` needs of the model (``runtime.Runtime``)."""

    def load_adapter(self, path: str) -> Any: ...

    def free_adapter(self, handle: Any) -> None: ...


@dataclass(eq=False)
class _Held:
    handle: Any
    users: int = 0


class GgufLoras:
    """The adapters one worker holds, by path."""

    def __init__(self, runtime: AdapterRuntime, max_loras: int) -> None:
        self.runtime = runtime
        self.max_loras = max_loras
        self.held: OrderedDict[str, _Held] = OrderedDict()

    def check(self, ref: LoraRef) -> None:
        """Read the adapter unless held (InvalidRequest naming it when llama.cpp refuses
        it); kept when there is a place for it."""
        if ref.path in self.held:
            self.held.move_to_end(ref.path)
            return
        handle = self._load(ref)
        if self._make_room():
            self.held[ref.path] = _Held(handle)
        else:
            self.runtime.free_adapter(handle)

    def acquire(self, ref: LoraRef) -> str | None:
        """The adapter held for one more started row; None when every place is in use."""
        held = self.held.get(ref.path)
        if held is None:
            if not self._make_room():
                return None
            held = _Held(self._load(ref))
            self.held[ref.path] = held
        self.held.move_to_end(ref.path)
        held.users += 1
        return ref.path

    def handle(self, key: str) -> Any:
        return self.held[key].handle

    def release(self, key: str) -> None:
        held = self.held.get(key)
        if held is not None:
            held.users = max(0, held.users - 1)

    def _make_room(self) -> bool:
        """Free the least recently used unused adapters until one more fits."""
        for key in list(self.held):
            if len(self.held) < self.max_loras:
                break
            if self.held[key].users == 0:
                self.runtime.free_adapter(self.held.pop(key).handle)
        return len(self.held) < self.max_loras

    def _load(self, ref: LoraRef) -> Any:
        handle = self.runtime.load_adapter(ref.path)
        if handle is None:
            # The adapter's name, never its path: a tenant reads this.
            raise InvalidRequest(
                f"LoRA adapter {ref.name!r}: llama.cpp cannot apply it to this model (not a "
                "LoRA GGUF, another architecture or base, or a truncated file)"
            )
        return handle
