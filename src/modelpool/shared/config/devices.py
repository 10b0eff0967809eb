"""The ``devices`` and ``gpus_per_worker`` layouts: which device each worker runs on.

Checked without NVML when a :class:`~modelpool.PoolConfig` is built (whether the GPUs
exist is checked when the pool starts), so that a malformed layout fails at once, naming
the entry at fault.
"""

from __future__ import annotations

import re

_DEVICE_PATTERN = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
_GPU_PATTERN = re.compile(r"^cuda(:\d+)?$")

DeviceEntry = str | tuple[str, ...]
"""One entry of ``devices``: a device ("auto", "cpu", "cuda:N"), or one worker's GPUs."""


def check_devices(devices: object) -> tuple[DeviceEntry, ...]:
    """``devices`` as a tuple of device strings and GPU groups (tuples); ValueError if malformed."""
    entries = (devices,) if isinstance(devices, str) else devices
    if not isinstance(entries, (list, tuple)) or not entries:
        raise ValueError(f"devices must be a non-empty list, got {devices!r}")
    checked: list[DeviceEntry] = []
    for entry in entries:
        if isinstance(entry, str):
            if not _DEVICE_PATTERN.match(entry):
                raise ValueError(f"devices: {entry!r} is not 'auto', 'cpu', 'cuda' or 'cuda:N'")
            checked.append(entry)
            continue
        if not isinstance(entry, (list, tuple)) or not entry:
            raise ValueError(f"devices: a group must be a non-empty list of GPUs, got {entry!r}")
        for device in entry:
            if not isinstance(device, str) or not _GPU_PATTERN.match(device):
                raise ValueError(
                    f"devices: group {list(entry)!r}: {device!r} is not 'cuda' or 'cuda:N' "
                    "(a group holds GPUs only)"
                )
        checked.append(tuple(entry))
    return tuple(checked)


def _ordinal(device: str) -> int:
    return int(device.partition(":")[2] or 0)


def check_device_groups(devices: tuple[DeviceEntry, ...], gpus_per_worker: int, slots: int) -> None:
    """The rules of a layout in which a worker owns several GPUs (checked without NVML:
    whether the GPUs exist is checked when the pool starts)."""
    groups = [entry for entry in devices if isinstance(entry, tuple)]
    if gpus_per_worker > 1:
        if groups:
            raise ValueError(
                "gpus_per_worker: give either groups in devices or gpus_per_worker, not both"
            )
        if any(device == "cpu" for device in devices):
            raise ValueError("gpus_per_worker: a worker on 'cpu' cannot own several GPUs")
        if devices != ("auto",):
            if "auto" in devices:
                raise ValueError("gpus_per_worker: use devices = ['auto'] alone, or list GPUs")
            if len(devices) % gpus_per_worker:
                raise ValueError(
                    f"gpus_per_worker: {len(devices)} devices do not split into groups of "
                    f"{gpus_per_worker}"
                )
            plain = [str(device) for device in devices]
            groups = [
                tuple(plain[start : start + gpus_per_worker])
                for start in range(0, len(plain), gpus_per_worker)
            ]
    if not any(len(group) > 1 for group in groups):
        return  # one GPU per worker: several workers may share a GPU, as before
    if len(devices) != len(groups) and gpus_per_worker == 1:
        raise ValueError("devices: with GPU groups, every entry must be a group (a list of GPUs)")
    seen: dict[int, int] = {}
    for number, group in enumerate(groups):
        for device in group:
            ordinal = _ordinal(device)
            if ordinal in seen:
                first = list(groups[seen[ordinal]])
                raise ValueError(
                    f"devices: cuda:{ordinal} is in more than one place "
                    f"({first} and {list(group)}); worker GPU groups must not overlap"
                )
            seen[ordinal] = number
    if devices != ("auto",) and slots > len(groups):
        raise ValueError(
            f"devices: {slots} workers (workers + spares) but {len(groups)} GPU groups; "
            "a worker that owns several GPUs shares them with no other"
        )
