"""CUDA faults as a worker sees them: which exceptions they are, and what the worker does after.

Runs in the worker and imports no torch itself (``worker.py`` must not, so that
``CUDA_VISIBLE_DEVICES`` is in place before the backend's first ``import torch``);
it reaches torch through ``sys.modules`` only when the backend already imported it.

Two kinds of fault, told apart by :func:`classify`:

* ``"oom"``: ``torch.OutOfMemoryError`` (``torch.cuda.OutOfMemoryError``), or a
  "CUDA out of memory" / "CUDA error: out of memory" / ``CUBLAS_STATUS_ALLOC_FAILED``
  message. The CUDA context stays usable. The worker lets go of the request (the
  exception and its traceback's frames hold its tensors), empties the caching
  allocator, and compares the memory still allocated with what it held right after
  loading (:class:`MemoryBaseline`); more than ``BASELINE_TOLERANCE_BYTES`` above
  it and the worker asks to be recycled.
* ``"cuda_error"``: an error that leaves the context unusable, after which every
  call fails the same way: an illegal memory access, a device-side assert, a
  launch failure (``torch.AcceleratorError`` and those messages), or any other
  "CUDA error: ..." that a small probe on the device repeats. The worker reports
  it and the pool kills and replaces the worker at once.

A backend may offer three optional hooks on its handler, used instead of torch's
global calls (the testing backend uses them to rehearse both faults without a GPU)::

    handler.device_memory_allocated() -> int | None   # bytes its tensors hold now
    handler.release_device_cache() -> None            # torch.cuda.empty_cache()
    handler.check_device() -> None                    # raises while the context is unusable
"""

from __future__ import annotations

import gc
import re
import sys
from dataclasses import dataclass
from typing import Any, Literal

FaultKind = Literal["oom", "cuda_error"]

BASELINE_TOLERANCE_BYTES = 64 * 1024 * 1024
"""Memory still allocated after an out-of-memory, above the post-load baseline, that is
taken as the allocator's own rounding rather than as something the request left behind."""

_OOM_MESSAGES = ("cuda out of memory", "cuda error: out of memory", "cublas_status_alloc_failed")
_STICKY_MESSAGES = (
    "illegal memory access",
    "illegal address",
    "device-side assert",
    "unspecified launch failure",
    "misaligned address",
    "illegal instruction",
    "cudaerrorillegaladdress",
    "cudaerrorassert",
    "cudaerrorlaunchfailure",
)
_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
_ASKED = re.compile(r"Tried to allocate ([\d.]+) ?(B|KiB|MiB|GiB|TiB)")
_GPU = re.compile(r"GPU (\d+)")


@dataclass(frozen=True)
class CudaFault:
    """One CUDA fault: its kind, and for an out-of-memory what torch said was asked, where.

    ``device`` is in the worker's own numbering ("cuda:1" is the second GPU of its group).
    """

    kind: FaultKind
    device: str | None = None
    bytes_requested: int | None = None


def classify(exc: BaseException, handler: object = None) -> CudaFault | None:
    """The CUDA fault ``exc`` is, or None for any other exception.

    An unfamiliar "CUDA error: ..." is sticky only if the device still fails a probe
    (``handler.check_device()``, else a tiny computation and a synchronise through
    torch): some CUDA errors (an invalid argument) leave the context usable.
    """
    names = {cls.__name__ for cls in type(exc).__mro__}
    text = str(exc)
    lowered = text.lower()
    if "OutOfMemoryError" in names or any(m in lowered for m in _OOM_MESSAGES):
        return CudaFault("oom", *_oom_details(text))
    if any(m in lowered for m in _STICKY_MESSAGES):
        return CudaFault("cuda_error")
    suspect = "AcceleratorError" in names or "cuda error" in lowered
    if suspect and not device_usable(handler):
        return CudaFault("cuda_error")
    return None


def _oom_details(text: str) -> tuple[str | None, int | None]:
    asked = _ASKED.search(text)
    gpu = _GPU.search(text)
    bytes_requested = int(float(asked.group(1)) * _UNITS[asked.group(2)]) if asked else None
    return (f"cuda:{gpu.group(1)}" if gpu else None), bytes_requested


def _torch() -> Any:
    """torch, if the backend imported it and CUDA was initialised in this process."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        return torch if torch.cuda.is_initialized() else None
    except Exception:
        return None


def device_memory_allocated(handler: object) -> int | None:
    """Bytes the worker's tensors hold on its GPUs now (None: not on a GPU, or unknown)."""
    hook = getattr(handler, "device_memory_allocated", None)
    if hook is not None:
        value = hook()
        return None if value is None else int(value)
    torch = _torch()
    if torch is None:
        return None
    return sum(int(torch.cuda.memory_allocated(n)) for n in range(torch.cuda.device_count()))


def release_device_cache(handler: object) -> None:
    """Hand the caching allocator's unused blocks back to the driver."""
    hook = getattr(handler, "release_device_cache", None)
    if hook is not None:
        hook()
        return
    torch = _torch()
    if torch is not None:
        torch.cuda.empty_cache()


def device_usable(handler: object) -> bool:
    """False when the worker's CUDA context fails a small probe (a sticky error)."""
    try:
        hook = getattr(handler, "check_device", None)
        if hook is not None:
            hook()
            return True
        torch = _torch()
        if torch is None:
            return True
        for n in range(torch.cuda.device_count()):
            probe = torch.ones(1, device=f"cuda:{n}") + 1
            torch.cuda.synchronize(n)
            del probe
    except Exception:
        return False
    return True


@dataclass(frozen=True)
class MemoryBaseline:
    """What the worker's tensors held on the device right after loading (and warming up)."""

    allocated_bytes: int | None

    @classmethod
    def measure(cls, handler: object) -> MemoryBaseline:
        return cls(device_memory_allocated(handler))

    def recover_after_oom(self, handler: object, fault: CudaFault) -> dict[str, Any]:
        """Empty the cache and compare with the baseline; call it once the request's
        exception (and with it the tensors its frames held) is gone.

        Returns the details the worker sends with its "oom" error: the device and the
        bytes asked (when torch said), the bytes allocated before and after, and
        ``recycle``: True when the memory did not come back near the baseline.
        """
        gc.collect()  # tensors a reference cycle still holds (frames of the failed call)
        release_device_cache(handler)
        allocated = device_memory_allocated(handler)
        recycle = (
            allocated is not None
            and self.allocated_bytes is not None
            and allocated - self.allocated_bytes > BASELINE_TOLERANCE_BYTES
        )
        return {
            "device": fault.device,
            "bytes_requested": fault.bytes_requested,
            "baseline_bytes": self.allocated_bytes,
            "allocated_bytes": allocated,
            "recycle": recycle,
        }
