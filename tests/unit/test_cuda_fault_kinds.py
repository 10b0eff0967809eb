"""Which exceptions are CUDA faults, and the worker's recovery after an out-of-memory.

torch's own exception classes (CPU build) carry the messages a CUDA build raises;
the device probe and the memory readings go through a handler's hooks.
"""

from __future__ import annotations

import pytest
import torch

from modelpool.server.errors import pool_error_to_api
from modelpool.shared.errors import CudaError, OutOfMemory
from modelpool.worker.cuda_faults import (
    BASELINE_TOLERANCE_BYTES,
    CudaFault,
    MemoryBaseline,
    classify,
)

MIB = 2**20

TORCH_OOM = (
    "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 1 has a total capacity of 79.15 GiB "
    "of which 3.12 MiB is free. Including non-PyTorch memory, this process has 79.14 GiB "
    "memory in use."
)
OLD_TORCH_OOM = (
    "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 15.78 GiB total capacity; "
    "13.02 GiB already allocated)"
)


class Device:
    """A handler with the hooks: simulated allocation, cache releases, a breakable context."""

    def __init__(self, allocated: int = 100 * MIB, broken: bool = False) -> None:
        self.allocated = allocated
        self.broken = broken
        self.releases = 0

    def device_memory_allocated(self) -> int:
        return self.allocated

    def release_device_cache(self) -> None:
        self.releases += 1

    def check_device(self) -> None:
        if self.broken:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_torch_out_of_memory_names_the_device_and_the_bytes() -> None:
    assert classify(torch.OutOfMemoryError(TORCH_OOM)) == CudaFault("oom", "cuda:1", 20 * MIB)
    assert classify(RuntimeError(OLD_TORCH_OOM)) == CudaFault("oom", "cuda:0", 2 * 1024 * MIB)


@pytest.mark.parametrize(
    "message",
    [
        "CUDA error: out of memory",
        "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate",
    ],
)
def test_out_of_memory_inside_a_library_is_an_oom_without_figures(message: str) -> None:
    assert classify(RuntimeError(message)) == CudaFault("oom")


@pytest.mark.parametrize(
    "message",
    [
        "CUDA error: an illegal memory access was encountered",
        "CUDA error: device-side assert triggered\nCompile with `TORCH_USE_CUDA_DSA`",
        "CUDA error: unspecified launch failure",
        "cudaErrorIllegalAddress",
    ],
)
def test_errors_that_poison_the_context_are_sticky_without_a_probe(message: str) -> None:
    # The device reads as usable: these messages alone say the context is gone.
    assert classify(torch.AcceleratorError(message), Device()) == CudaFault("cuda_error")


def test_another_cuda_error_is_sticky_only_if_the_device_fails_a_probe() -> None:
    error = RuntimeError("CUDA error: invalid argument")
    assert classify(error, Device(broken=False)) is None
    assert classify(error, Device(broken=True)) == CudaFault("cuda_error")


def test_ordinary_exceptions_are_not_cuda_faults() -> None:
    assert classify(ValueError("bad"), Device(broken=True)) is None
    assert classify(RuntimeError("shape mismatch")) is None


def test_after_an_oom_the_cache_is_emptied_and_memory_compared_with_the_baseline() -> None:
    device = Device()
    baseline = MemoryBaseline.measure(device)
    fault = CudaFault("oom", "cuda:0", 4096)
    details = baseline.recover_after_oom(device, fault)
    assert device.releases == 1
    assert details == {
        "device": "cuda:0",
        "bytes_requested": 4096,
        "baseline_bytes": 100 * MIB,
        "allocated_bytes": 100 * MIB,
        "recycle": False,
    }
    device.allocated += BASELINE_TOLERANCE_BYTES  # within the tolerance
    assert not baseline.recover_after_oom(device, fault)["recycle"]
    device.allocated += 1
    assert baseline.recover_after_oom(device, fault)["recycle"]


def test_without_a_device_nothing_is_measured_and_nothing_recycled() -> None:
    # A CPU backend with no hooks and no CUDA initialised in this process.
    details = MemoryBaseline.measure(object()).recover_after_oom(object(), CudaFault("oom"))
    assert details["allocated_bytes"] is None and details["recycle"] is False


def test_http_status_of_cuda_faults() -> None:
    oom = pool_error_to_api(OutOfMemory("oom", device="cuda:1", bytes_requested=2**30))
    assert oom.status == 507
    assert oom.body()["error"]["code"] == "out_of_memory"
    assert oom.body()["error"]["bytes_requested"] == 2**30
    assert "Retry-After" not in oom.headers
    sticky = pool_error_to_api(CudaError("sticky"))
    assert (sticky.status, sticky.body()["error"]["code"]) == (502, "cuda_error")
