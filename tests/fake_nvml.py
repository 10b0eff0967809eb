"""A scripted stand-in for the ``pynvml`` module, shared by the GPU unit and pool tests."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

MIB = 1024 * 1024
GIB = 1024 * MIB


# ----------------------------------------------------------------------------- fake NVML


class FakeNVMLError(Exception):
    value = 999

    def __str__(self) -> str:
        return f"fake NVML error {self.value}"


# Named like pynvml's generated classes: the probe recognises errors by class name.
class NVMLError_LibraryNotFound(FakeNVMLError):
    value = 12


class NVMLError_DriverNotLoaded(FakeNVMLError):
    value = 9


class NVMLError_FunctionNotFound(FakeNVMLError):
    value = 13


class NVMLError_NoPermission(FakeNVMLError):
    value = 4


class NVMLLibraryMismatchError(Exception):
    pass


@dataclass
class FakeGpu:
    name: str | bytes = "NVIDIA Fake H100"
    uuid: str = "GPU-00000000-0000-0000-0000-000000000000"
    total: int = 80 * GIB
    used: int = 1 * GIB
    reserved: int = 500 * MIB
    compute: dict[int, int | None] = field(default_factory=dict)
    graphics: dict[int, int | None] = field(default_factory=dict)


class FakeNvml:
    """Module-like stand-in for pynvml whose state a test changes between polls."""

    NVMLError = FakeNVMLError
    NVMLError_LibraryNotFound = NVMLError_LibraryNotFound
    NVMLError_DriverNotLoaded = NVMLError_DriverNotLoaded
    NVMLError_FunctionNotFound = NVMLError_FunctionNotFound
    NVMLError_NoPermission = NVMLError_NoPermission
    NVMLLibraryMismatchError = NVMLLibraryMismatchError
    nvmlMemory_v2 = 0x02000028

    def __init__(
        self,
        gpus: list[FakeGpu] | None = None,
        *,
        init_error: BaseException | None = None,
        memory_v2: bool = True,
        compute_v3: bool = True,
    ) -> None:
        self.gpus = gpus if gpus is not None else []
        self.init_error = init_error
        self.memory_v2 = memory_v2
        self.compute_v3 = compute_v3
        self.calls: dict[str, int] = {}
        self.initialised = False

    def _count_call(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def _gpu(self, handle: Any) -> FakeGpu:
        assert self.initialised, "NVML call before nvmlInit"
        index: int = handle.index
        return self.gpus[index]

    def nvmlInit(self) -> None:
        self._count_call("nvmlInit")
        if self.init_error is not None:
            raise self.init_error
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self._count_call("nvmlShutdown")
        self.initialised = False

    def nvmlDeviceGetCount(self) -> int:
        self._count_call("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        self._count_call("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.gpus):
            raise FakeNVMLError()
        return SimpleNamespace(index=index)

    def nvmlDeviceGetName(self, handle: Any) -> str | bytes:
        return self._gpu(handle).name

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        return self._gpu(handle).uuid

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> Any:
        self._count_call("nvmlDeviceGetMemoryInfo")
        gpu = self._gpu(handle)
        if version:
            if not self.memory_v2:
                raise NVMLError_FunctionNotFound()
            assert version == self.nvmlMemory_v2
            return SimpleNamespace(
                version=version,
                total=gpu.total,
                reserved=gpu.reserved,
                free=gpu.total - gpu.used,
                used=gpu.used,
            )
        # v1 counts the reserved memory as used
        used = gpu.used + gpu.reserved
        return SimpleNamespace(total=gpu.total, free=gpu.total - used, used=used)

    @staticmethod
    def _procs(table: dict[int, int | None]) -> list[Any]:
        return [SimpleNamespace(pid=pid, usedGpuMemory=mem) for pid, mem in table.items()]

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]:
        self._count_call("nvmlDeviceGetComputeRunningProcesses")
        if not self.compute_v3:
            raise NVMLLibraryMismatchError("use a versioned function")
        return self._procs(self._gpu(handle).compute)

    def nvmlDeviceGetComputeRunningProcesses_v2(self, handle: Any) -> list[Any]:
        self._count_call("nvmlDeviceGetComputeRunningProcesses_v2")
        return self._procs(self._gpu(handle).compute)

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: Any) -> list[Any]:
        return self._procs(self._gpu(handle).graphics)
