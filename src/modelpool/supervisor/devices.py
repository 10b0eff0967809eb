"""Device naming: which devices a pool's workers get, and the environment that shows a
worker only its own.

``resolve_devices`` turns a configured device list ("auto", "cuda:1", "cpu"...) into
labels, ``resolve_worker_devices`` spreads them over workers (a label may name a group
of GPUs, "cuda:0+cuda:1"), and ``worker_env_for`` builds a worker's
``CUDA_VISIBLE_DEVICES`` in NVML's index order. Measuring those devices (NVML, release
checks) and reading ``CUDA_VISIBLE_DEVICES`` (``cvd_entries``) is :mod:`modelpool.supervisor.gpu`,
which this module imports and which does not import it; this module only reads names
and the environment, and asks NVML only through a ``GpuProbe``, so it imports neither
NVML nor torch.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping, Sequence

from modelpool.supervisor.gpu import GpuProbe, cvd_entries

log = logging.getLogger(__name__)

NVML_INDEX_ORDER = "PCI_BUS_ID"  # NVML enumerates devices in PCI bus order


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
    unavailable. "cpu", "cuda" (= "cuda:0") and "cuda:N" are kept; N must be
    below the visible count, and without NVML and without the driver's device
    nodes there is no CUDA device at all (ValueError naming the device
    otherwise; with the nodes but not NVML, N is not checked). Mixing is
    allowed; order (and repeats) are kept.
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
        if not probe.available:
            if probe.driver_nodes:
                # The driver is there without NVML: CUDA itself will say whether N exists.
                resolved.append(f"cuda:{ordinal}")
                continue
            raise ValueError(
                f"device {device!r} does not exist: no NVIDIA GPU is usable here "
                f'(NVML: {probe.reason}; no /dev/nvidia* device); use "cpu" or "auto"'
            )
        if ordinal >= len(visible):
            raise ValueError(_not_visible(device, len(visible), environ))
        resolved.append(f"cuda:{ordinal}")
    return resolved


def group_devices(label: str) -> list[str]:
    """The devices of a worker's device label: "cuda:0,cuda:1" -> ["cuda:0", "cuda:1"].

    A worker's ``device`` is one device ("cpu", "cuda:N") or, when the worker owns
    several GPUs, their names joined by commas, as ``CUDA_VISIBLE_DEVICES`` lists them.
    """
    return [part.strip() for part in label.split(",")]


def resolve_worker_devices(
    spec: Sequence[str | Sequence[str]],
    probe: GpuProbe,
    environ: Mapping[str, str] | None = None,
    *,
    gpus_per_worker: int = 1,
    slots: int | None = None,
) -> list[str]:
    """The device label of each worker slot in turn (slot N takes entry N modulo the length).

    Plain entries resolve as in :func:`resolve_devices`. A group (a list of GPUs)
    becomes one label "cuda:0,cuda:1"; ``gpus_per_worker`` > 1 splits the resolved
    GPUs ("auto": every visible GPU) into consecutive groups of that size. Groups are
    exclusive: ``slots`` (workers + spares) above the number of groups, a group
    that overlaps another, or a GPU that does not exist is a ValueError naming the key.
    """
    if isinstance(spec, str):
        spec = [spec]
    groups: list[list[str]] = []
    for entry in spec:
        if isinstance(entry, str):
            try:
                groups.extend([device] for device in resolve_devices([entry], probe, environ))
            except ValueError as exc:
                raise ValueError(f"devices: {exc}") from None
        else:
            try:
                groups.append(resolve_devices(list(entry), probe, environ))
            except ValueError as exc:
                raise ValueError(f"devices: group {list(entry)!r}: {exc}") from None
    if gpus_per_worker > 1:
        flat = [group[0] for group in groups]
        if "cpu" in flat:
            raise ValueError(
                "gpus_per_worker: no GPU visible (NVML: "
                f"{probe.reason}); a worker on 'cpu' cannot own {gpus_per_worker} GPUs: "
                "set gpus_per_worker = 1"
            )
        usable = len(flat) - len(flat) % gpus_per_worker
        if usable == 0:
            raise ValueError(
                f"gpus_per_worker: {gpus_per_worker} GPUs per worker but only {len(flat)} visible"
            )
        if usable < len(flat):
            log.warning(
                "gpus_per_worker=%d: %s left unused", gpus_per_worker, ", ".join(flat[usable:])
            )
        groups = [
            flat[start : start + gpus_per_worker] for start in range(0, usable, gpus_per_worker)
        ]
    if any(len(group) > 1 for group in groups):
        owner: dict[str, int] = {}
        for number, group in enumerate(groups):
            for device in group:
                if device in owner:
                    raise ValueError(
                        f"devices: {device} is in more than one place ({groups[owner[device]]} "
                        f"and {group}); worker GPU groups must not overlap"
                    )
                owner[device] = number
        if slots is not None and slots > len(groups):
            key = "gpus_per_worker" if gpus_per_worker > 1 else "devices"
            raise ValueError(
                f"{key}: {slots} workers (workers + spares) but {len(groups)} GPU groups; "
                "a worker that owns several GPUs shares them with no other"
            )
    return [",".join(group) for group in groups]


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

    GPU: ``CUDA_VISIBLE_DEVICES`` is just that device and the worker uses
    "cuda:0". With NVML the entry is the GPU's UUID, which names the same GPU
    to CUDA and NVML whatever the device order (NVML's index "may not
    correlate" with CUDA's), or the MIG instance's UUID as this process's
    ``CUDA_VISIBLE_DEVICES`` wrote it. Otherwise it is the entry as written
    there (or the ordinal when unset); where that entry is an integer and
    ``CUDA_DEVICE_ORDER`` is not set, it is set to ``PCI_BUS_ID`` so that the
    integer means the same GPU to CUDA as to NVML (CUDA's default order is
    fastest-first). CPU: ``CUDA_VISIBLE_DEVICES=""`` and "cpu".
    Raises ValueError for a CUDA ordinal that is not visible.

    A group label ("cuda:0,cuda:2") gives exactly those GPUs, in that order, and
    the worker uses "cuda:0,cuda:1" (its own numbering).
    """
    env = os.environ if environ is None else environ
    members = group_devices(device)
    if len(members) > 1:
        member_entries: list[str] = []
        group_env: dict[str, str] = {}
        for member in members:
            member_env, _ = worker_env_for(member, probe, env)
            member_entries.append(member_env["CUDA_VISIBLE_DEVICES"])
            group_env.update(member_env)
        group_env["CUDA_VISIBLE_DEVICES"] = ",".join(member_entries)
        return group_env, ",".join(f"cuda:{n}" for n in range(len(members)))
    ordinal = _cuda_ordinal(device)
    if ordinal is None:
        return {"CUDA_VISIBLE_DEVICES": ""}, "cpu"
    entry: str
    if probe.available:
        visible = probe._visible(env)
        if ordinal >= len(visible):
            raise ValueError(_not_visible(device, len(visible), env))
        entry, index = visible[ordinal]
        if not entry.lower().startswith("mig-"):
            entry = probe._uuid(index) or entry
    else:
        entries = cvd_entries(env)
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
        overrides["CUDA_DEVICE_ORDER"] = NVML_INDEX_ORDER
    return overrides, "cuda:0"
