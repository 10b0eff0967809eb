"""NVML probe, device resolution, and release checks (GPU memory and CPU process groups).

Nothing here imports torch: the supervisor uses this module to watch devices
it never touches itself.

GPU side (``GpuProbe``): NVML through ``nvidia-ml-py`` (import name
``pynvml``), initialised once. Without a driver the probe is simply
``available = False`` with a human-readable ``reason`` and every method
returns an empty answer at once, so a CPU-only machine pays nothing.

Attribution of a worker's GPU memory:

* by PID, when the worker's PID is in the device's running-process list
  (the driver knows nothing of PID namespaces: inside a container the list
  carries host PIDs, so the worker's own PID is usually absent there);
* otherwise by the device's used memory against a baseline read before the
  worker started (``max(0, used - baseline)``). The baseline must be read
  with :meth:`GpuProbe.used_bytes` of the same probe (same memory-info
  version).

Release after a kill is polled, never checked once: the driver can take
seconds to tear a context down. :class:`ReleaseWatch` is the non-blocking
form (one ``poll()`` per timer tick of the caller's event loop);
:meth:`GpuProbe.wait_released` is the blocking loop around it.

CPU side: a worker runs in its own process group. ``os.killpg(pgid, 0)``
failing with ``ProcessLookupError`` proves that no process of the group is
left, zombies included (a zombie keeps its group until it is reaped, so the
group leader must be reaped by whoever spawned it, and orphaned members by
init or a child subreaper; see :func:`set_child_subreaper`).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import logging
import os
import re
import sys
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import psutil

log = logging.getLogger(__name__)

MIB = 1024 * 1024
DEFAULT_TOLERANCE_BYTES = 64 * MIB
"""Residual used memory (against the baseline) still counted as released."""

Clock = Callable[[], float]
Sleep = Callable[[float], None]
ReadingMethod = Literal["pid", "delta", "unavailable"]
ReleaseMethod = Literal["pid", "delta", "psutil", "unavailable"]

_NVML_NOT_AVAILABLE = 2**64 - 1  # NVML_VALUE_NOT_AVAILABLE_ulonglong, mapped to None by pynvml
_HOLDERS_LIMIT = 32
_NVML_INDEX_ORDER = "PCI_BUS_ID"  # NVML enumerates devices in PCI bus order


# ----------------------------------------------------------------------------- records


@dataclass(frozen=True)
class DeviceInfo:
    """One GPU as NVML sees it (``index`` is the NVML index). Memory in MiB."""

    index: int
    name: str
    used_mb: float
    total_mb: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "name": self.name,
            "used_mb": self.used_mb,
            "total_mb": self.total_mb,
        }


@dataclass(frozen=True)
class MemoryReading:
    """GPU memory attributed to one worker, and how it was attributed."""

    bytes: int | None
    method: ReadingMethod


@dataclass(frozen=True)
class ReleaseReport:
    """Outcome of a release check after a worker was killed.

    ``ok``: the memory (GPU) or the process group (CPU) is gone.
    ``seconds``: from the start of the check to the verdict.
    ``held_bytes``: on success, what is left over (0 for "pid" and "psutil",
    the residual delta for "delta"); on failure, what is still held (None
    when unknown).
    ``method``: "pid", "delta", "psutil" or "unavailable" (NVML missing or
    nothing to compare against: nothing was verified; ``ok`` is True then
    unless NVML kept failing until the timeout).
    ``holders``: on failure, best-effort descriptions of who holds on.
    """

    ok: bool
    seconds: float
    held_bytes: int | None
    method: ReleaseMethod
    holders: list[str] = field(default_factory=list)

    def describe(self) -> str:
        """One line for a log message."""
        held = "?" if self.held_bytes is None else f"{self.held_bytes / MIB:.1f} MiB"
        verdict = "released" if self.ok else "NOT released"
        text = f"{verdict} after {self.seconds:.3f}s (method {self.method}, held {held})"
        if self.holders:
            text += "; holders: " + "; ".join(self.holders)
        return text


# ----------------------------------------------------------------------------- NVML probe


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
    holders are looked up when a release check fails.

    Thread-safety: NVML itself is thread-safe; the probe's caches are filled
    idempotently, so concurrent readers are harmless.
    """

    def __init__(
        self, nvml: Any | None = None, *, proc_root: str | os.PathLike[str] = "/proc"
    ) -> None:
        self.available = False
        self.reason = ""
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
        """pid -> used bytes (None: N/A), or None when the compute list cannot be read."""
        handle = self._handle(index)
        if handle is None:
            return None
        compute = self._process_list(handle, "Compute")
        if compute is None:
            return None
        graphics = self._process_list(handle, "Graphics") or []
        result: dict[int, int | None] = {}
        for proc in (*compute, *graphics):
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

    def device_count(self) -> int:
        """Number of devices NVML sees (all of them, whatever CUDA_VISIBLE_DEVICES says)."""
        return self._count if self.available else 0

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
        """pid -> used bytes (None where NVML says N/A) of compute and graphics processes.

        The PIDs are whatever the driver reports: host PIDs, even inside a container.
        Empty when unknown.
        """
        return self._processes(index) or {}

    def worker_memory(self, index: int, pid: int, baseline_used_bytes: int | None) -> MemoryReading:
        """GPU memory of one worker: by PID where visible, else by used-memory delta."""
        if not self.available:
            return MemoryReading(None, "unavailable")
        processes = self._processes(index)
        if processes is not None and processes.get(pid) is not None:
            return MemoryReading(processes[pid], "pid")
        if baseline_used_bytes is not None:
            used = self.used_bytes(index)
            if used is not None:
                return MemoryReading(max(0, used - baseline_used_bytes), "delta")
        return MemoryReading(None, "unavailable")

    # -- release -----------------------------------------------------------------------

    def wait_released(
        self,
        index: int,
        pid: int,
        baseline_used_bytes: int | None,
        *,
        timeout_s: float,
        tolerance_bytes: int = DEFAULT_TOLERANCE_BYTES,
        poll_s: float = 0.05,
        clock: Clock = time.monotonic,
        sleep: Sleep = time.sleep,
    ) -> ReleaseReport:
        """Block until the killed worker's GPU memory is released, or ``timeout_s`` passes.

        Released: ``pid`` is gone from the device's process list and, when the
        PID was never seen there (container), used memory is back within
        ``tolerance_bytes`` of ``baseline_used_bytes``. Blocks for up to
        ``timeout_s``: call it off the dispatcher thread, or use
        :class:`ReleaseWatch` from an event loop.
        """
        watch = ReleaseWatch(
            self,
            index,
            pid,
            baseline_used_bytes,
            timeout_s=timeout_s,
            tolerance_bytes=tolerance_bytes,
            clock=clock,
        )
        return _run_watch(watch.poll, watch.deadline, poll_s, clock, sleep)

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
        entries = _cvd_entries(environ)
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


def _run_watch(
    poll: Callable[[], ReleaseReport | None],
    deadline: float,
    poll_s: float,
    clock: Clock,
    sleep: Sleep,
) -> ReleaseReport:
    while True:
        report = poll()
        if report is not None:
            return report
        sleep(max(0.0, min(poll_s, deadline - clock())))


class ReleaseWatch:
    """Non-blocking GPU release check for one killed worker.

    Each ``poll()`` reads the process list and used memory once and returns
    None (not decided yet) or the final :class:`ReleaseReport`; after the
    deadline it returns a failure naming the holders. Reports are final:
    later polls return the same one.
    """

    def __init__(
        self,
        probe: GpuProbe,
        index: int,
        pid: int,
        baseline_used_bytes: int | None,
        *,
        timeout_s: float,
        tolerance_bytes: int = DEFAULT_TOLERANCE_BYTES,
        clock: Clock = time.monotonic,
    ) -> None:
        self.probe = probe
        self.index = index
        self.pid = pid
        self.baseline_used_bytes = baseline_used_bytes
        self.tolerance_bytes = tolerance_bytes
        self._clock = clock
        self.started = clock()
        self.deadline = self.started + timeout_s
        self.pid_seen = False
        self._held: int | None = None
        self._report: ReleaseReport | None = None

    def poll(self) -> ReleaseReport | None:
        if self._report is not None:
            return self._report
        probe = self.probe
        if not probe.available:
            return self._finish(True, None, "unavailable")
        processes = probe._processes(self.index)
        pid_listed = processes is not None and self.pid in processes
        if pid_listed:
            self.pid_seen = True
        delta = self._delta()
        if pid_listed:
            assert processes is not None
            listed = processes[self.pid]
            self._held = listed if listed is not None else delta
        elif processes is not None and self.pid_seen:
            return self._finish(True, 0, "pid")
        elif processes is not None and self.baseline_used_bytes is None:
            # Never listed, nothing to compare with: nothing can be verified.
            return self._finish(True, None, "unavailable")
        elif delta is not None:
            if delta <= self.tolerance_bytes:
                return self._finish(True, delta, "delta")
            self._held = delta
        if self._clock() >= self.deadline:
            return self._fail()
        return None

    def _delta(self) -> int | None:
        if self.baseline_used_bytes is None:
            return None
        used = self.probe.used_bytes(self.index)
        return None if used is None else max(0, used - self.baseline_used_bytes)

    def _finish(
        self, ok: bool, held: int | None, method: ReleaseMethod, holders: list[str] | None = None
    ) -> ReleaseReport:
        self._report = ReleaseReport(
            ok=ok,
            seconds=max(0.0, self._clock() - self.started),
            held_bytes=held,
            method=method,
            holders=holders or [],
        )
        return self._report

    def _fail(self) -> ReleaseReport:
        method: ReleaseMethod
        if self.pid_seen:
            method = "pid"
        elif self.baseline_used_bytes is not None and self._held is not None:
            method = "delta"
        else:
            method = "unavailable"
        holders = find_device_holders(self.probe.proc_root, exclude_pids={os.getpid()})
        report = self._finish(False, self._held, method, holders)
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


# ----------------------------------------------------------------------------- devices


def _cvd_entries(environ: Mapping[str, str] | None) -> list[str] | None:
    """CUDA_VISIBLE_DEVICES split into entries; None when unset."""
    env = os.environ if environ is None else environ
    value = env.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    if not value.strip():
        return []
    return [entry.strip() for entry in value.split(",")]


_CUDA_PATTERN = re.compile(r"cuda(?::(\d+))?")


def _cuda_ordinal(device: str) -> int | None:
    """N for "cuda:N" ("cuda" is 0), None for "cpu"; ValueError for anything else."""
    normalised = device.strip().lower()
    if normalised == "cpu":
        return None
    match = _CUDA_PATTERN.fullmatch(normalised)
    if match is None:
        raise ValueError(f"device {device!r} is not 'cpu', 'cuda' or 'cuda:N'")
    return int(match.group(1) or 0)


def _not_visible(device: str, count: int, environ: Mapping[str, str] | None) -> str:
    env = os.environ if environ is None else environ
    return (
        f"device {device!r} does not exist: {count} CUDA device(s) visible "
        f"(CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES')!r})"
    )


def resolve_devices(
    spec: Sequence[str], probe: GpuProbe, environ: Mapping[str, str] | None = None
) -> list[str]:
    """Turn a ``devices`` setting into concrete device strings.

    "auto" becomes every CUDA device visible to this process ("cuda:N", N in
    CUDA's visible order) or ["cpu"] when there is none or NVML is
    unavailable. "cpu", "cuda" (= "cuda:0") and "cuda:N" are kept; with NVML
    available, N must be below the visible count (ValueError naming the
    device otherwise). Mixing is allowed; order (and repeats) are kept.
    """
    if isinstance(spec, str):
        spec = [spec]
    if not spec:
        raise ValueError("devices is empty")
    visible = probe.visible_device_indices(environ) if probe.available else []
    resolved: list[str] = []
    for device in spec:
        if device.strip().lower() == "auto":
            resolved.extend([f"cuda:{n}" for n in range(len(visible))] or ["cpu"])
            continue
        ordinal = _cuda_ordinal(device)
        if ordinal is None:
            resolved.append("cpu")
            continue
        if probe.available and ordinal >= len(visible):
            raise ValueError(_not_visible(device, len(visible), environ))
        resolved.append(f"cuda:{ordinal}")
    return resolved


def nvml_index_for(
    device: str, probe: GpuProbe, environ: Mapping[str, str] | None = None
) -> int | None:
    """NVML index of "cuda:N" (N in this process's visible order); None for cpu or unknown."""
    ordinal = _cuda_ordinal(device)
    if ordinal is None:
        return None
    visible = probe.visible_device_indices(environ)
    return visible[ordinal] if ordinal < len(visible) else None


def worker_env_for(
    device: str, probe: GpuProbe, environ: Mapping[str, str] | None = None
) -> tuple[dict[str, str], str]:
    """Environment overrides for a worker on ``device``, and the device the worker should use.

    GPU: ``CUDA_VISIBLE_DEVICES`` is just that device, written as it appeared
    in this process's ``CUDA_VISIBLE_DEVICES`` (index or UUID; the NVML index
    when unset), and the worker uses "cuda:0". Where the entry is an integer
    and ``CUDA_DEVICE_ORDER`` is not set, it is set to ``PCI_BUS_ID`` so that
    the integer means the same GPU to CUDA as to NVML (CUDA's default order
    is fastest-first). CPU: ``CUDA_VISIBLE_DEVICES=""`` and "cpu".
    Raises ValueError for a CUDA ordinal that is not visible.
    """
    env = os.environ if environ is None else environ
    ordinal = _cuda_ordinal(device)
    if ordinal is None:
        return {"CUDA_VISIBLE_DEVICES": ""}, "cpu"
    entry: str
    if probe.available:
        visible = probe._visible(env)
        if ordinal >= len(visible):
            raise ValueError(_not_visible(device, len(visible), env))
        entry = visible[ordinal][0]
    else:
        entries = _cvd_entries(env)
        if entries is None:
            entry = str(ordinal)
        elif ordinal < len(entries) and entries[ordinal]:
            entry = entries[ordinal]
        else:
            raise ValueError(
                f"device {device!r} does not exist: CUDA_VISIBLE_DEVICES="
                f"{env.get('CUDA_VISIBLE_DEVICES')!r}"
            )
    overrides = {"CUDA_VISIBLE_DEVICES": entry}
    if re.fullmatch(r"[+-]?\d+", entry) and "CUDA_DEVICE_ORDER" not in env:
        overrides["CUDA_DEVICE_ORDER"] = _NVML_INDEX_ORDER
    return overrides, "cuda:0"


# ----------------------------------------------------------------------------- CPU side


def _check_pgid(pgid: int) -> None:
    # killpg(0) would signal our own group and killpg(1) is meaningless here.
    if pgid <= 1:
        raise ValueError(f"refusing to act on process group {pgid}")


def process_group_exists(pgid: int) -> bool:
    """True while any process (zombies included) is in process group ``pgid``."""
    _check_pgid(pgid)
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def _group_members(pgid: int) -> list[psutil.Process]:
    members: list[psutil.Process] = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid:
                members.append(proc)
        except (ProcessLookupError, PermissionError, OSError):
            continue
    return members


def _rss(proc: psutil.Process) -> int:
    try:
        return int(proc.memory_info().rss)
    except (psutil.Error, OSError):
        return 0  # zombies have none; vanished processes neither


def rss_bytes_of_group(pgid: int) -> int:
    """Summed RSS of the processes in group ``pgid`` (call before the kill, to report it)."""
    _check_pgid(pgid)
    return sum(_rss(proc) for proc in _group_members(pgid))


def _describe_member(proc: psutil.Process) -> str:
    try:
        status = proc.status()
    except psutil.ZombieProcess:
        status = "zombie"
    except (psutil.Error, OSError):
        status = "?"
    try:
        name = proc.name()
    except (psutil.Error, OSError):
        name = "?"
    return f"pid {proc.pid} ({name}) status={status}"


def reap_group_children(pgid: int) -> int:
    """Reap our own exited children in group ``pgid``; returns how many were reaped.

    Only call it once the group leader's exit status has been collected by
    its owner (``Popen.wait``, ``Process.join``): it would steal it otherwise.
    """
    _check_pgid(pgid)
    reaped = 0
    while True:
        try:
            pid, _status = os.waitpid(-pgid, os.WNOHANG)
        except ChildProcessError:
            return reaped
        if pid == 0:
            return reaped
        reaped += 1


class GroupReleaseWatch:
    """Non-blocking check that a killed worker's process group is gone (method "psutil")."""

    def __init__(
        self,
        pgid: int,
        *,
        timeout_s: float,
        reap: bool = False,
        clock: Clock = time.monotonic,
    ) -> None:
        _check_pgid(pgid)
        self.pgid = pgid
        self.reap = reap
        self._clock = clock
        self.started = clock()
        self.deadline = self.started + timeout_s
        self._report: ReleaseReport | None = None

    def poll(self) -> ReleaseReport | None:
        if self._report is not None:
            return self._report
        if self.reap:
            reap_group_children(self.pgid)
        if not process_group_exists(self.pgid):
            return self._finish(True, 0, [])
        if self._clock() < self.deadline:
            return None
        members = _group_members(self.pgid)
        if not members and not process_group_exists(self.pgid):
            return self._finish(True, 0, [])
        holders = [_describe_member(proc) for proc in members] or [
            f"process group {self.pgid} still exists (members not visible)"
        ]
        report = self._finish(False, sum(_rss(proc) for proc in members), holders)
        log.warning("process group %d: %s", self.pgid, report.describe())
        return report

    def _finish(self, ok: bool, held: int, holders: list[str]) -> ReleaseReport:
        self._report = ReleaseReport(
            ok=ok,
            seconds=max(0.0, self._clock() - self.started),
            held_bytes=held,
            method="psutil",
            holders=holders,
        )
        return self._report


def wait_process_group_gone(
    pgid: int,
    *,
    timeout_s: float,
    poll_s: float = 0.005,
    reap: bool = False,
    clock: Clock = time.monotonic,
    sleep: Sleep = time.sleep,
) -> ReleaseReport:
    """Block until no process (zombies included) is left in group ``pgid``, or timeout.

    Reap the group leader first: its zombie keeps the group alive. Orphaned
    members are reaped by init (some container inits take seconds) or by a
    child subreaper; with ``reap=True`` this call reaps those that are our
    own children (see :func:`set_child_subreaper`, :func:`reap_group_children`).
    On timeout the report lists the survivors (pid, name, status) and their RSS.
    """
    watch = GroupReleaseWatch(pgid, timeout_s=timeout_s, reap=reap, clock=clock)
    return _run_watch(watch.poll, watch.deadline, poll_s, clock, sleep)


_PR_SET_CHILD_SUBREAPER = 36


def set_child_subreaper(enabled: bool = True) -> bool:
    """Make this process the reaper of its orphaned descendants (Linux); False if not possible.

    With it, the members of a killed worker's group become our zombies
    instead of init's, and ``wait_process_group_gone(..., reap=True)`` can
    clear them at once instead of waiting on init.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        result = libc.prctl(_PR_SET_CHILD_SUBREAPER, 1 if enabled else 0, 0, 0, 0)
    except (OSError, AttributeError):
        return False
    return int(result) == 0


def _page_size() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 4096


_PAGE_SIZE = _page_size()


def process_rss_bytes() -> int:
    """RSS of the calling process: /proc/self/statm (cheap); peak RSS where there is no /proc."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * _PAGE_SIZE
    except (OSError, IndexError, ValueError):
        pass
    try:
        import resource
    except ImportError:
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


__all__ = [
    "DEFAULT_TOLERANCE_BYTES",
    "DeviceInfo",
    "GpuProbe",
    "GroupReleaseWatch",
    "MemoryReading",
    "ReleaseReport",
    "ReleaseWatch",
    "find_device_holders",
    "nvml_index_for",
    "process_group_exists",
    "process_rss_bytes",
    "reap_group_children",
    "resolve_devices",
    "rss_bytes_of_group",
    "set_child_subreaper",
    "wait_process_group_gone",
    "worker_env_for",
]
