"""A scripted stand-in for the ``pynvml`` module, shared by the GPU unit and pool tests.

A device is a :class:`FakeGpu`; a test changes its fields between polls (used
memory, the PIDs in each process list). A GPU in MIG mode carries
:class:`FakeMig` instances, reached as pynvml reaches them: by UUID
(``nvmlDeviceGetHandleByUUID``), then to the parent with
``nvmlDeviceGetDeviceHandleFromMigDeviceHandle``. MPS clients are listed only
by ``nvmlDeviceGetMPSComputeRunningProcesses``, as on a real driver.
"""

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


class NVMLError_NotFound(FakeNVMLError):
    value = 6


class NVMLLibraryMismatchError(Exception):
    pass


@dataclass
class FakeMig:
    """One MIG instance of a :class:`FakeGpu`."""

    uuid: str = "MIG-00000000-0000-0000-0000-000000000000"
    total: int = 10 * GIB
    used: int = 100 * MIB
    compute: dict[int, int | None] = field(default_factory=dict)


@dataclass
class FakeGpu:
    name: str | bytes = "NVIDIA Fake H100"
    uuid: str = "GPU-00000000-0000-0000-0000-000000000000"
    total: int = 80 * GIB
    used: int = 1 * GIB
    reserved: int = 500 * MIB
    compute: dict[int, int | None] = field(default_factory=dict)
    graphics: dict[int, int | None] = field(default_factory=dict)
    mps: dict[int, int | None] = field(default_factory=dict)
    migs: list[FakeMig] = field(default_factory=list)
    memory_error: BaseException | None = None
    """Raised by memory-info reads of the whole GPU (a MIG parent without privileges)."""


class FakeNvml:
    """Module-like stand-in for pynvml whose state a test changes between polls."""

    NVMLError = FakeNVMLError
    NVMLError_LibraryNotFound = NVMLError_LibraryNotFound
    NVMLError_DriverNotLoaded = NVMLError_DriverNotLoaded
    NVMLError_FunctionNotFound = NVMLError_FunctionNotFound
    NVMLError_NoPermission = NVMLError_NoPermission
    NVMLError_NotFound = NVMLError_NotFound
    NVMLLibraryMismatchError = NVMLLibraryMismatchError
    nvmlMemory_v2 = 0x02000028

    def __init__(
        self,
        gpus: list[FakeGpu] | None = None,
        *,
        init_error: BaseException | None = None,
        memory_v2: bool = True,
        compute_v3: bool = True,
        driver_version: str = "580.65.06",
    ) -> None:
        self.gpus = gpus if gpus is not None else []
        self.init_error = init_error
        self.memory_v2 = memory_v2
        self.compute_v3 = compute_v3
        self.driver_version = driver_version
        self.calls: dict[str, int] = {}
        self.initialised = False

    def _count_call(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def _gpu(self, handle: Any) -> FakeGpu:
        assert self.initialised, "NVML call before nvmlInit"
        index: int = handle.index
        return self.gpus[index]

    def _target(self, handle: Any) -> FakeGpu | FakeMig:
        """The GPU, or the MIG instance a MIG handle stands for."""
        gpu = self._gpu(handle)
        mig: int | None = getattr(handle, "mig", None)
        return gpu if mig is None else gpu.migs[mig]

    def nvmlInit(self) -> None:
        self._count_call("nvmlInit")
        if self.init_error is not None:
            raise self.init_error
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self._count_call("nvmlShutdown")
        self.initialised = False

    def nvmlSystemGetDriverVersion(self) -> str:
        assert self.initialised, "NVML call before nvmlInit"
        return self.driver_version

    def nvmlDeviceGetCount(self) -> int:
        self._count_call("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        self._count_call("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.gpus):
            raise FakeNVMLError()
        return SimpleNamespace(index=index, mig=None)

    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> Any:
        self._count_call("nvmlDeviceGetHandleByUUID")
        assert self.initialised, "NVML call before nvmlInit"
        wanted = uuid.decode() if isinstance(uuid, bytes) else uuid
        for index, gpu in enumerate(self.gpus):
            if gpu.uuid == wanted:
                return SimpleNamespace(index=index, mig=None)
            for mig_index, mig in enumerate(gpu.migs):
                if mig.uuid == wanted:
                    return SimpleNamespace(index=index, mig=mig_index)
        raise NVMLError_NotFound()

    def nvmlDeviceIsMigDeviceHandle(self, handle: Any) -> int:
        return int(getattr(handle, "mig", None) is not None)

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, handle: Any) -> Any:
        if getattr(handle, "mig", None) is None:
            raise FakeNVMLError()  # NVML_ERROR_INVALID_ARGUMENT for a non-MIG handle
        return SimpleNamespace(index=handle.index, mig=None)

    def nvmlDeviceGetIndex(self, handle: Any) -> int:
        if getattr(handle, "mig", None) is not None:
            raise FakeNVMLError()  # MIG handles have no device index
        return int(handle.index)

    def nvmlDeviceGetName(self, handle: Any) -> str | bytes:
        return self._gpu(handle).name

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        return self._target(handle).uuid

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> Any:
        self._count_call("nvmlDeviceGetMemoryInfo")
        target = self._target(handle)
        if isinstance(target, FakeMig):
            return SimpleNamespace(
                version=version,
                total=target.total,
                reserved=0,
                free=target.total - target.used,
                used=target.used,
            )
        if target.memory_error is not None:
            raise target.memory_error
        if version:
            if not self.memory_v2:
                raise NVMLError_FunctionNotFound()
            assert version == self.nvmlMemory_v2
            return SimpleNamespace(
                version=version,
                total=target.total,
                reserved=target.reserved,
                free=target.total - target.used,
                used=target.used,
            )
        # v1 counts the reserved memory as used
        used = target.used + target.reserved
        return SimpleNamespace(total=target.total, free=target.total - used, used=used)

    @staticmethod
    def _procs(table: dict[int, int | None]) -> list[Any]:
        return [SimpleNamespace(pid=pid, usedGpuMemory=mem) for pid, mem in table.items()]

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]:
        self._count_call("nvmlDeviceGetComputeRunningProcesses")
        if not self.compute_v3:
            raise NVMLLibraryMismatchError("use a versioned function")
        return self._procs(self._target(handle).compute)

    def nvmlDeviceGetComputeRunningProcesses_v2(self, handle: Any) -> list[Any]:
        self._count_call("nvmlDeviceGetComputeRunningProcesses_v2")
        return self._procs(self._target(handle).compute)

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: Any) -> list[Any]:
        return self._procs(self._gpu(handle).graphics)

    def nvmlDeviceGetMPSComputeRunningProcesses(self, handle: Any) -> list[Any]:
        self._count_call("nvmlDeviceGetMPSComputeRunningProcesses")
        if not self.compute_v3:
            raise NVMLLibraryMismatchError("use a versioned function")
        return self._procs(self._gpu(handle).mps)

    def nvmlDeviceGetMPSComputeRunningProcesses_v2(self, handle: Any) -> list[Any]:
        self._count_call("nvmlDeviceGetMPSComputeRunningProcesses_v2")
        return self._procs(self._gpu(handle).mps)
