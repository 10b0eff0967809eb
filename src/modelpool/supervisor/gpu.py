"""NVML probe, the GPU memory release check, and ``CUDA_VISIBLE_DEVICES`` read as entries
(``cvd_entries``; device naming, which uses them, is :mod:`modelpool.supervisor.devices`).

Nothing here imports torch: the supervisor uses this module to watch devices
it never touches itself. The CPU-side checks (process groups, a process's own
RSS) are in :mod:`modelpool.shared.processes`.

``GpuProbe`` reads NVML through ``nvidia-ml-py`` (import name ``pynvml``),
initialised once. Without a driver the probe is simply ``available = False``
with a human-readable ``reason`` and every method returns an empty answer at
once, so a CPU-only machine pays nothing.

Which PIDs NVML lists. The driver translates each client's PID into the
caller's PID namespace and leaves out clients it cannot translate (NVIDIA
drivers since at least 570, ``_gpuConvertPid``), so on bare metal, in VMs
and in Docker-style containers that hold both the pool and its workers, the
workers' own PIDs are listed. Where the driver cannot see the namespace
(gVisor's nvproxy passes the driver's PID list through untranslated), none
of the workers' PIDs is listed. MPS clients appear only in the MPS process list,
which is read with the compute and graphics lists.

A worker's GPU memory (:meth:`GpuProbe.worker_memory`) is attributed by PID
only. Without PID attribution there is no per-worker figure: the device's
used memory minus a baseline includes every neighbour on the same GPU, so
only the device-level figure (:meth:`GpuProbe.devices`) is reported.

Release after a kill (:meth:`GpuProbe.wait_released`) is polled, never
checked once: the driver can take seconds to tear a context down.

* by PID, when NVML listed the worker while it was alive, or lists another
  live pool worker on that GPU (then PIDs are visible there): released once
  the PID is gone from the list. A dying process closes its device files
  before it can be reaped, so the PID is usually gone before the first poll;
* else by delta, only when no other pool worker shares the GPU: the device's
  used memory back within a tolerance of the baseline read before the
  worker started (with :meth:`GpuProbe.used_bytes` of the same probe, so the
  same memory-info version);
* else unverified (method "unavailable", with the reason in ``detail``):
  beside neighbours whose PIDs are not listed, their memory cannot be told
  from the dead worker's, and a comparison would report it as not freed.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import re
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from modelpool.shared.processes import ReleaseMethod, ReleaseReport

log = logging.getLogger(__name__)

MIB = 1024 * 1024
DEFAULT_TOLERANCE_BYTES = 64 * MIB
"""Residual used memory (against the baseline) still counted as released."""

Clock = Callable[[], float]
Sleep = Callable[[float], None]
ReadingMethod = Literal["pid", "unavailable"]
PidsOrSource = Collection[int] | Callable[[], Collection[int]]

_NVML_NOT_AVAILABLE = 2**64 - 1  # NVML_VALUE_NOT_AVAILABLE_ulonglong, mapped to None by pynvml
_HOLDERS_LIMIT = 32


# ----------------------------------------------------------------------------- records


@dataclass(frozen=True)
class DeviceInfo:
    """One GPU as NVML sees it (``index`` is the NVML index). Memory in MiB."""

    index: int
    name: str
    used_mb: float
    total_mb: float


@dataclass(frozen=True)
class MemoryReading:
    """GPU memory attributed to one worker.

    ``method`` "pid": NVML lists the worker's PID; ``bytes`` is its figure, or
    None where NVML has none for it (N/A). "unavailable": not attributable.
    """

    bytes: int | None
    method: ReadingMethod


# ----------------------------------------------------------------------------- NVML probe


def cvd_entries(environ: Mapping[str, str] | None) -> list[str] | None:
    """CUDA_VISIBLE_DEVICES split into entries; None when unset."""
    env = os.environ if environ is None else environ
    value = env.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    if not value.strip():
        return []
    return [entry.strip() for entry in value.split(",")]


def _class_names(exc: BaseException) -> set[str]:
    return {cls.__name__ for cls in type(exc).__mro__}


def _safe_str(exc: BaseException) -> str:
    try:
        text = str(exc)
    except Exception:  # pynvml's __str__ may itself call into NVML
        text = ""
    return text or type(exc).__name__


def _describe_init_error(exc: BaseException) -> str:
    names = _class_names(exc)
    if isinstance(exc, ImportError):
        return f"nvidia-ml-py (pynvml) is not installed ({_safe_str(exc)})"
    if "NVMLError_LibraryNotFound" in names:
        return "NVML library not found (no NVIDIA driver)"
    if "NVMLError_DriverNotLoaded" in names:
        return "NVIDIA driver not loaded"
    if "NVMLError_NoPermission" in names:
        return "no permission to use NVML (NVIDIA driver)"
    if "NVMLError_LibRmVersionMismatch" in names:
        return "NVML library and loaded NVIDIA kernel driver versions differ"
    if "NVMLError_FunctionNotFound" in names or "NVMLLibraryMismatchError" in names:
        return f"NVML library too old for nvidia-ml-py ({_safe_str(exc)})"
    return f"NVML initialisation failed: {type(exc).__name__}: {_safe_str(exc)}"


def _to_str(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


class GpuProbe:
    """NVML, initialised once; every method answers empty/None fast when NVML is unavailable.

    ``nvml`` is the NVML binding module (``pynvml``) or a stand-in with the same
    function names (tests); None imports ``pynvml``. ``proc_root`` is where
    holders are looked up when a release check fails. ``dev_root`` is where the
    driver's device nodes (``nvidia0``, ``nvidiactl``) are looked for when NVML is
    unavailable (``driver_nodes``): a container given the compute libraries but
    not NVML still has a GPU. It defaults to "/dev" with the real NVML only: a
    stand-in describes a machine of its own.

    Thread-safety: NVML itself is thread-safe; the probe's caches are filled
    idempotently, so concurrent readers are harmless.
    """

    def __init__(
        self,
        nvml: Any | None = None,
        *,
        proc_root: str | os.PathLike[str] = "/proc",
        dev_root: str | os.PathLike[str] | None = None,
    ) -> None:
        self.available = False
        self.reason = ""
        if dev_root is None and nvml is None:
            dev_root = "/dev"
        self.driver_nodes = dev_root is not None and any(Path(dev_root).glob("nvidia[0-9c]*"))
        self.proc_root = Path(proc_root)
        self._nvml: Any = None
        self._count = 0
        self._handles: dict[int, Any] = {}
        self._uuids: dict[int, str | None] = {}
        self._mem_v2: bool | None = None  # decided by the first successful read, then fixed
        self._errors: tuple[type[BaseException], ...] = (OSError,)
        self._initialised = False

        started = time.monotonic()
        binding: Any = nvml
        try:
            if binding is None:
                binding = importlib.import_module("pynvml")
            self._errors = self._error_types(binding)
            binding.nvmlInit()
            self._initialised = True
            self._count = int(binding.nvmlDeviceGetCount())
        except Exception as exc:
            self.reason = _describe_init_error(exc)
            if self._initialised:
                with contextlib.suppress(Exception):
                    binding.nvmlShutdown()
                self._initialised = False
            log.debug("NVML unavailable: %s", self.reason)
            return
        self._nvml = binding
        self.available = True
        self.reason = f"NVML available, {self._count} device(s)"
        log.debug(
            "NVML initialised in %.3fs: %d device(s)", time.monotonic() - started, self._count
        )

    @staticmethod
    def _error_types(nvml: Any) -> tuple[type[BaseException], ...]:
        found: list[type[BaseException]] = [OSError]
        for name in ("NVMLError", "NVMLLibraryMismatchError"):
            cls = getattr(nvml, name, None)
            if isinstance(cls, type) and issubclass(cls, BaseException):
                found.append(cls)
        return tuple(found)

    def _errors_or(self, *extra: type[BaseException]) -> tuple[type[BaseException], ...]:
        return (*extra, *self._errors)

    def close(self) -> None:
        """Shut NVML down (idempotent); the probe is unavailable afterwards."""
        if self._initialised and self._nvml is not None:
            with contextlib.suppress(Exception):
                self._nvml.nvmlShutdown()
        self._initialised = False
        if self.available:
            self.available = False
            self.reason = "probe closed"
        self._handles.clear()

    def __enter__(self) -> GpuProbe:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- raw reads ---------------------------------------------------------------------

    def _handle(self, index: int) -> Any | None:
        if not self.available or not 0 <= index < self._count:
            return None
        handle = self._handles.get(index)
        if handle is None:
            try:
                handle = self._nvml.nvmlDeviceGetHandleByIndex(index)
            except self._errors as exc:
                log.debug("nvmlDeviceGetHandleByIndex(%d) failed: %s", index, _safe_str(exc))
                return None
            self._handles[index] = handle
        return handle

    def _memory(self, index: int) -> tuple[int, int, int] | None:
        """(used, free, total) in bytes, memory info v2 where the driver supports it."""
        handle = self._handle(index)
        if handle is None:
            return None
        nvml = self._nvml
        version = getattr(nvml, "nvmlMemory_v2", None)
        if self._mem_v2 is not False and version is not None:
            try:
                info = nvml.nvmlDeviceGetMemoryInfo(handle, version=version)
            except self._errors_or(TypeError) as exc:
                # Old driver (FunctionNotFound), NotSupported, or an old binding without version=.
                log.debug("memory info v2 failed on device %d: %s", index, _safe_str(exc))
            else:
                self._mem_v2 = True
                return int(info.used), int(info.free), int(info.total)
        try:
            info = nvml.nvmlDeviceGetMemoryInfo(handle)
        except self._errors as exc:
            log.debug("memory info failed on device %d: %s", index, _safe_str(exc))
            return None
        if self._mem_v2 is None:
            self._mem_v2 = False
        return int(info.used), int(info.free), int(info.total)

    def _process_list(self, handle: Any, kind: str) -> list[Any] | None:
        # The unversioned call maps to _v3 and raises NVMLLibraryMismatchError (not an
        # NVMLError) on drivers that lack _v3; _v2 works there.
        base = f"nvmlDeviceGet{kind}RunningProcesses"
        for name in (base, f"{base}_v2"):
            fn = getattr(self._nvml, name, None)
            if fn is None:
                continue
            try:
                return list(fn(handle))
            except self._errors as exc:
                log.debug("%s failed: %s", name, _safe_str(exc))
        return None

    def _processes(self, index: int) -> dict[int, int | None] | None:
        """pid -> used bytes (None: N/A), or None when the compute list cannot be read.

        Compute, graphics and MPS clients: under MPS a client's context is listed
        only by the MPS call (the compute list holds the MPS server).
        """
        handle = self._handle(index)
        if handle is None:
            return None
        compute = self._process_list(handle, "Compute")
        if compute is None:
            return None
        graphics = self._process_list(handle, "Graphics") or []
        mps = self._process_list(handle, "MPSCompute") or []
        result: dict[int, int | None] = {}
        for proc in (*compute, *graphics, *mps):
            try:
                pid = int(proc.pid)
            except (AttributeError, TypeError, ValueError):
                continue
            used = getattr(proc, "usedGpuMemory", None)
            value = None if used is None or int(used) >= _NVML_NOT_AVAILABLE else int(used)
            previous = result.get(pid)
            if pid not in result or (value is not None and (previous is None or value > previous)):
                result[pid] = value
        return result

    def _uuid(self, index: int) -> str | None:
        if index not in self._uuids:
            handle = self._handle(index)
            uuid: str | None = None
            if handle is not None:
                try:
                    uuid = _to_str(self._nvml.nvmlDeviceGetUUID(handle))
                except self._errors as exc:
                    log.debug("nvmlDeviceGetUUID(%d) failed: %s", index, _safe_str(exc))
            self._uuids[index] = uuid
        return self._uuids[index]

    # -- public reads ------------------------------------------------------------------

    def devices(self, indices: Iterable[int] | None = None) -> list[DeviceInfo]:
        """Name and memory of each device (all NVML devices, or just ``indices``).

        A device whose memory cannot be read is left out (and logged at debug).
        """
        if not self.available:
            return []
        wanted = range(self._count) if indices is None else indices
        result: list[DeviceInfo] = []
        for index in wanted:
            handle = self._handle(index)
            memory = self._memory(index)
            if handle is None or memory is None:
                continue
            try:
                name = _to_str(self._nvml.nvmlDeviceGetName(handle))
            except self._errors:
                name = "unknown"
            used, _free, total = memory
            result.append(
                DeviceInfo(
                    index=index,
                    name=name,
                    used_mb=round(used / MIB, 1),
                    total_mb=round(total / MIB, 1),
                )
            )
        return result

    def used_bytes(self, index: int) -> int | None:
        """Used memory of a device (NVML index), None when unknown. Use it for baselines."""
        memory = self._memory(index)
        return None if memory is None else memory[0]

    def free_bytes(self, index: int) -> int | None:
        memory = self._memory(index)
        return None if memory is None else memory[1]

    def process_memory(self, index: int) -> dict[int, int | None]:
        """pid -> used bytes (None where NVML says N/A) of compute, graphics and MPS clients.

        The PIDs are as the driver translates them into this process's PID
        namespace (see the module docstring). Empty when unknown.
        """
        return self._processes(index) or {}

    def worker_memory(self, index: int, pid: int) -> MemoryReading:
        """GPU memory of one worker, attributed by PID only.

        Method "pid" when NVML lists ``pid`` on the device (``bytes`` None where
        NVML has no figure for it), else ``MemoryReading(None, "unavailable")``:
        the device's memory against a baseline would include every other
        process on it, the pool's other workers first.
        """
        processes = self._processes(index) if self.available else None
        if processes is not None and pid in processes:
            return MemoryReading(processes[pid], "pid")
        return MemoryReading(None, "unavailable")

    def driver_version(self) -> str | None:
        """The NVIDIA driver's version as NVML reports it, None when unknown."""
        if not self.available:
            return None
        try:
            return _to_str(self._nvml.nvmlSystemGetDriverVersion())
        except self._errors_or(AttributeError) as exc:
            log.debug("nvmlSystemGetDriverVersion failed: %s", _safe_str(exc))
            return None

    # -- release -----------------------------------------------------------------------

    def wait_released(
        self,
        index: int,
        pid: int,
        baseline_used_bytes: int | None,
        *,
        timeout_s: float,
        listed_while_alive: bool = False,
        other_worker_pids: PidsOrSource = (),
        tolerance_bytes: int = DEFAULT_TOLERANCE_BYTES,
        poll_s: float = 0.05,
        clock: Clock = time.monotonic,
        sleep: Sleep = time.sleep,
    ) -> ReleaseReport:
        """Block until the killed worker ``pid``'s GPU memory is released, or ``timeout_s`` passes.

        ``listed_while_alive``: NVML listed ``pid`` on this device while the
        worker ran (the caller's sampler saw it). ``other_worker_pids``: the
        pool's other live workers on this device, or a callable that returns
        them (read at every poll, so that a worker started meanwhile counts).
        ``baseline_used_bytes``: the device's used memory read before the
        worker started, for the delta method.

        How the verdict is reached (by PID, by delta, or unverified) is in the
        module docstring. Blocks for up to ``timeout_s``: call it off the
        dispatcher thread. On failure the report names the processes that
        hold ``/dev/nvidia*`` open or sleep in state D, leaving out this
        process and ``other_worker_pids``.

        Typical use, on a thread of its own after the worker was reaped::

            report = probe.wait_released(
                index, pid, baseline, timeout_s=15.0,
                listed_while_alive=pid in listed_pids,
                other_worker_pids=lambda: live_pids_on(device) - {pid},
            )
            if not report.ok:
                log.error("GPU %d: %s", index, report.describe())
        """
        watch = _ReleaseWatch(
            self,
            index,
            pid,
            baseline_used_bytes,
            timeout_s=timeout_s,
            listed_while_alive=listed_while_alive,
            other_worker_pids=other_worker_pids,
            tolerance_bytes=tolerance_bytes,
            clock=clock,
        )
        while True:
            report = watch.poll()
            if report is not None:
                return report
            sleep(max(0.0, min(poll_s, watch.deadline - clock())))

    # -- visibility --------------------------------------------------------------------

    def _entry_index(self, entry: str) -> int | None:
        """NVML index of one CUDA_VISIBLE_DEVICES entry, None when CUDA would reject it."""
        if re.fullmatch(r"[+-]?\d+", entry):
            value = int(entry)
            return value if 0 <= value < self._count else None
        lowered = entry.lower()
        if lowered.startswith("gpu-"):
            matches = [
                index
                for index in range(self._count)
                if (self._uuid(index) or "").lower().startswith(lowered)
            ]
            return matches[0] if len(matches) == 1 else None
        if lowered.startswith("mig-"):
            return self._mig_parent_index(entry)
        return None

    def _mig_parent_index(self, entry: str) -> int | None:
        nvml = self._nvml
        try:
            mig = nvml.nvmlDeviceGetHandleByUUID(entry)
            parent = nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig)
            index = int(nvml.nvmlDeviceGetIndex(parent))
        except self._errors_or(AttributeError) as exc:
            log.debug("cannot map MIG device %s to its GPU: %s", entry, _safe_str(exc))
            return None
        return index if 0 <= index < self._count else None

    def _visible(self, environ: Mapping[str, str] | None) -> list[tuple[str, int]]:
        """(entry as written, NVML index) for each device CUDA would expose, in CUDA's order."""
        if not self.available:
            return []
        entries = cvd_entries(environ)
        if entries is None:
            return [(str(index), index) for index in range(self._count)]
        result: list[tuple[str, int]] = []
        seen: set[int] = set()
        for entry in entries:
            index = self._entry_index(entry)
            if index is None or index in seen:
                break  # CUDA ignores everything from the first invalid entry on
            seen.add(index)
            result.append((entry, index))
        return result

    def visible_device_indices(self, environ: Mapping[str, str] | None = None) -> list[int]:
        """NVML indices of the devices this process's CUDA would see, in CUDA's order.

        Honours ``CUDA_VISIBLE_DEVICES`` (``environ`` defaults to ``os.environ``):
        unset means all, "" means none, entries are integers (taken as NVML
        indices, i.e. ``CUDA_DEVICE_ORDER=PCI_BUS_ID``), GPU UUIDs or unique
        UUID prefixes ("GPU-..."), or MIG UUIDs (mapped to their parent GPU).
        As CUDA does, the list stops at the first invalid or repeated entry.
        """
        return [index for _entry, index in self._visible(environ)]


class _ReleaseWatch:
    """The state of one release check; :meth:`GpuProbe.wait_released` polls it until decided.

    Each ``poll()`` reads the device once and returns None (not decided yet)
    or the final :class:`ReleaseReport`; after the deadline it returns a
    failure naming the holders.
    """

    def __init__(
        self,
        probe: GpuProbe,
        index: int,
        pid: int,
        baseline_used_bytes: int | None,
        *,
        timeout_s: float,
        listed_while_alive: bool,
        other_worker_pids: PidsOrSource,
        tolerance_bytes: int,
        clock: Clock,
    ) -> None:
        self.probe = probe
        self.index = index
        self.pid = pid
        self.baseline_used_bytes = baseline_used_bytes
        self.tolerance_bytes = tolerance_bytes
        self._other_worker_pids = other_worker_pids
        self._clock = clock
        self.started = clock()
        self.deadline = self.started + timeout_s
        self.pid_seen = listed_while_alive
        self._judged_by_delta = False
        self._held: int | None = None
        self._others: set[int] = set()

    def _current_others(self) -> set[int]:
        source = self._other_worker_pids
        pids = source() if callable(source) else source
        return set(pids) - {self.pid}

    def poll(self) -> ReleaseReport | None:
        probe = self.probe
        if not probe.available:
            return self._finish(True, None, "unavailable", detail="NVML unavailable")
        self._others = others = self._current_others()
        processes = probe._processes(self.index)
        if processes is not None:
            if self.pid in processes:
                self.pid_seen = True
                listed = processes[self.pid]
                self._held = listed if listed is not None else self._lone_delta()
            elif self.pid_seen or others & processes.keys():
                # Listed while alive, or PIDs are visible here (a neighbour is listed):
                # absent from a list that could be read means its context is gone.
                return self._finish(True, 0, "pid")
        if not self.pid_seen:
            if others:
                return self._finish(
                    True,
                    None,
                    "unavailable",
                    detail=(
                        f"{len(others)} other pool worker(s) on GPU {self.index} "
                        f"(pid {', '.join(map(str, sorted(others)))}) and NVML lists none "
                        "of their PIDs: their memory cannot be told from the dead worker's"
                    ),
                )
            if processes is not None and self.baseline_used_bytes is None:
                return self._finish(
                    True,
                    None,
                    "unavailable",
                    detail="PID never listed and no baseline of the device's memory",
                )
            delta = self._lone_delta()
            if delta is not None:
                self._judged_by_delta = True
                if delta <= self.tolerance_bytes:
                    return self._finish(True, delta, "delta")
                self._held = delta
        if self._clock() >= self.deadline:
            return self._fail()
        return None

    def _lone_delta(self) -> int | None:
        """Used memory above the baseline; only meaningful without neighbours on the GPU."""
        if self.baseline_used_bytes is None or self._others:
            return None
        used = self.probe.used_bytes(self.index)
        return None if used is None else max(0, used - self.baseline_used_bytes)

    def _finish(
        self,
        ok: bool,
        held: int | None,
        method: ReleaseMethod,
        holders: list[str] | None = None,
        detail: str = "",
    ) -> ReleaseReport:
        report = ReleaseReport(
            ok=ok,
            seconds=max(0.0, self._clock() - self.started),
            held_bytes=held,
            method=method,
            holders=holders or [],
            detail=detail,
        )
        if ok and method == "unavailable" and self.probe.available:
            log.warning("GPU %d: worker pid %d: %s", self.index, self.pid, report.describe())
        return report

    def _fail(self) -> ReleaseReport:
        method: ReleaseMethod
        detail = ""
        if self.pid_seen:
            method = "pid"
        elif self._judged_by_delta:
            method = "delta"
        else:
            method = "unavailable"
            detail = "NVML kept failing"
        holders = find_device_holders(
            self.probe.proc_root, exclude_pids={os.getpid(), *self._others}
        )
        report = self._finish(False, self._held, method, holders, detail)
        log.warning("GPU %d: memory of worker pid %d %s", self.index, self.pid, report.describe())
        return report


# ----------------------------------------------------------------------------- holders


def _read_stat(proc_dir: Path) -> tuple[str, str] | None:
    """(comm, state) from /proc/<pid>/stat; comm may contain spaces and parentheses."""
    try:
        text = (proc_dir / "stat").read_text(errors="replace")
    except OSError:
        return None
    head, sep, tail = text.rpartition(")")
    if not sep:
        return None
    comm = head.partition("(")[2]
    fields = tail.split()
    return comm, (fields[0] if fields else "?")


def find_device_holders(
    proc_root: str | os.PathLike[str] = "/proc",
    *,
    device_prefix: str = "/dev/nvidia",
    exclude_pids: Collection[int] = (),
    limit: int = _HOLDERS_LIMIT,
) -> list[str]:
    """Best effort: processes with a descriptor open on ``/dev/nvidia*``, and any in state D.

    Processes we may not inspect (permissions) or that vanish meanwhile are
    skipped. At most ``limit`` lines, then one line counting the rest.
    """
    root = Path(proc_root)
    try:
        pids = sorted(int(entry.name) for entry in os.scandir(root) if entry.name.isdigit())
    except OSError as exc:
        return [f"cannot list {root}: {exc}"]
    holders: list[str] = []
    for pid in pids:
        if pid in exclude_pids:
            continue
        proc_dir = root / str(pid)
        stat = _read_stat(proc_dir)
        comm, state = stat if stat is not None else ("?", "?")
        devices: set[str] = set()
        try:
            with os.scandir(proc_dir / "fd") as fds:
                for fd in fds:
                    try:
                        target = os.readlink(fd.path)
                    except OSError:
                        continue
                    if target.startswith(device_prefix):
                        devices.add(target)
        except OSError:
            pass  # no permission, or the process is gone
        parts: list[str] = []
        if devices:
            parts.append("holds " + ", ".join(sorted(devices)))
        if state == "D":
            parts.append("in state D (uninterruptible sleep)")
        if parts:
            holders.append(f"pid {pid} ({comm}): " + "; ".join(parts))
    if len(holders) > limit:
        rest = len(holders) - limit
        holders = [*holders[:limit], f"... and {rest} more"]
    return holders


__all__ = [
    "DEFAULT_TOLERANCE_BYTES",
    "DeviceInfo",
    "GpuProbe",
    "MemoryReading",
    "ReleaseReport",
    "find_device_holders",
]
