"""The pool's background checks, each on its own thread: a dead worker's release, a
blocked GPU's free memory, periodic GPU sampling, and the prefix cache tiers' directories
(``tier_watch``).

They only read (processes, NVML) and wait; every result goes back to the dispatcher
thread as a command through ``post``, so the dispatcher stays the single owner of
state. A check that takes seconds (a process group that lingers, GPU memory that is
slow to come back) never holds up the event loop.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from modelpool.shared import processes
from modelpool.shared.config import PoolConfig
from modelpool.supervisor import gpu
from modelpool.supervisor.devices import group_devices, nvml_index_for
from modelpool.supervisor.prefix_tiers import tier_specs
from modelpool.supervisor.records import GpuWorker, Worker
from modelpool.supervisor.stats import DeviceStats
from modelpool.supervisor.tier_watch import TierView, TierWatch

logger = logging.getLogger(__name__)


class Monitors:
    """Starts the check threads; ``post(action, *args)`` hands results to the dispatcher.

    ``on_release_checked``, ``on_device_free``, ``on_gpu_sample`` and ``on_prefix_tiers``
    are the dispatcher's entry points that receive them.
    """

    def __init__(
        self,
        config: PoolConfig,
        probe: gpu.GpuProbe,
        post: Callable[..., bool],
        *,
        on_release_checked: Callable[..., None],
        on_device_free: Callable[[str], None],
        on_gpu_sample: Callable[..., None],
        on_prefix_tiers: Callable[[TierView], None],
        environ: Mapping[str, str],
    ) -> None:
        self.config = config
        self.probe = probe
        # The environment as it was at start: which GPU "cuda:N" means is decided once.
        self.environ = environ
        self._post = post
        self._on_release_checked = on_release_checked
        self._on_device_free = on_device_free
        self._on_gpu_sample = on_gpu_sample
        self._gpu_workers: list[GpuWorker] = []
        # (pid, GPU) pairs NVML has listed for live workers: a GPU of a group may hold none
        # of the worker's memory (a small model under device_map="auto"), so it is per GPU.
        self._gpu_pids_listed: set[tuple[int, str]] = set()
        # Processes a worker started (its children, in its process group or not) that NVML
        # listed on a GPU: worker pid -> their pids. A child that escaped the group (a new
        # session) outlives the worker's kill and keeps its memory; the release check names it.
        self._gpu_children: dict[int, set[int]] = {}
        self._not_started_by_workers: set[int] = set()
        self._stopped = threading.Event()
        self._sampler = threading.Thread(
            target=self._sample_gpu, name="modelpool-gpu-sampler", daemon=True
        )
        self._tiers = TierWatch(
            tier_specs(config), functools.partial(post, on_prefix_tiers), self._stopped
        )

    def start(self) -> None:
        if self.probe.available:
            self._sampler.start()
        self._tiers.start()

    def stop(self) -> None:
        self._stopped.set()

    def check_release(self, worker: Worker) -> None:
        listed = {device for pid, device in self._gpu_pids_listed if pid == worker.pid}
        children = set(self._gpu_children.pop(worker.pid, ())) if worker.pid is not None else set()
        args = (
            worker.id,
            worker.pid,
            worker.device,
            dict(worker.gpu_baselines),
            worker.rss_bytes,
            listed,
            children,
        )
        if not _start_thread(self._check_release, args, f"modelpool-release-{worker.id}"):
            # At interpreter exit: checked here, since close() waits for every report.
            self._check_release(*args)

    def watch_device_free(self, device: str, needed_bytes: int) -> None:
        _start_thread(self._wait_device_free, (device, needed_bytes), f"modelpool-watch-{device}")

    def gpu_workers_changed(self, workers: list[GpuWorker]) -> None:
        self._gpu_workers = workers
        live = {pid for _id, pid, _device in workers}
        self._gpu_pids_listed = {entry for entry in self._gpu_pids_listed if entry[0] in live}

    def _pids_on(self, device: str) -> list[int]:
        """The live workers whose group holds ``device`` (one GPU)."""
        return [pid for _id, pid, label in self._gpu_workers if device in group_devices(label)]

    def _check_release(
        self,
        worker_id: int,
        pid: int | None,
        label: str,
        baselines: dict[str, int | None],
        rss_bytes: int | None,
        listed_on: set[str],
        children: set[int],
    ) -> None:
        started = time.monotonic()
        ok, method, held = True, "psutil", None
        held_by_device: dict[str, int | None] = {}
        holders: dict[str, list[str]] = {}
        if pid is not None:
            # Orphaned members of the group are reaped by init, which in some containers
            # takes a couple of seconds; the pool does not make itself a subreaper because
            # that would change how the host application's own orphans are reaped.
            report = processes.wait_process_group_gone(
                pid, timeout_s=max(3.0, self.config.term_grace_s)
            )
            ok = report.ok
            if not ok:
                logger.error("worker pid %s: processes left in its group: %s", pid, report.holders)
            # Every GPU of the worker's group, against one deadline: a group is refilled
            # only when all of its GPUs are known to be free.
            deadline = time.monotonic() + self.config.gpu_release_timeout_s
            for device in group_devices(label):
                index = nvml_index_for(device, self.probe, self.environ)
                if index is None or not self.probe.available:
                    continue
                gpu_report = self.probe.wait_released(
                    index,
                    pid,
                    baselines.get(device),
                    timeout_s=max(0.0, deadline - time.monotonic()),
                    listed_while_alive=device in listed_on,
                    other_worker_pids=functools.partial(self._pids_on, device),
                )
                ok = ok and gpu_report.ok
                method = gpu_report.method if method == "psutil" else method
                if gpu_report.held_bytes is not None:
                    held = (held or 0) + gpu_report.held_bytes
                if not gpu_report.ok:
                    method = gpu_report.method
                    held_by_device[device] = gpu_report.held_bytes
                    logger.error(
                        "worker pid %s: %s bytes still held on %s after %.1fs; holders: %s",
                        pid,
                        gpu_report.held_bytes,
                        device,
                        gpu_report.seconds,
                        gpu_report.holders,
                    )
                    holders[device] = list(gpu_report.holders)
            if children:
                for device, (held_bytes, lines) in self._held_by_children(
                    pid, label, children, deadline
                ).items():
                    ok, method = False, "pid"
                    held = (held or 0) + held_bytes
                    held_by_device[device] = (held_by_device.get(device) or 0) + held_bytes
                    holders[device] = lines + holders.get(device, [])
                    logger.error(
                        "worker pid %s is gone but processes it started still hold %d bytes "
                        "on %s: %s",
                        pid,
                        held_bytes,
                        device,
                        "; ".join(lines),
                    )
        self._post(
            self._on_release_checked,
            worker_id,
            ok,
            time.monotonic() - started,
            method,
            rss_bytes,
            held,
            held_by_device,
            holders,
        )

    def _held_by_children(
        self, pid: int, label: str, children: set[int], deadline: float
    ) -> dict[str, tuple[int, list[str]]]:
        """GPU -> (bytes, one line per holder) for the dead worker's children that NVML still
        lists on its GPUs, polled until ``deadline`` (they may be exiting on their own)."""
        while True:
            found: dict[str, tuple[int, list[str]]] = {}
            for device in group_devices(label):
                index = nvml_index_for(device, self.probe)
                if index is None:
                    continue
                listed = self.probe.process_memory(index)
                held = {child: listed[child] for child in sorted(children) if child in listed}
                if held:
                    found[device] = (
                        sum(used or 0 for used in held.values()),
                        [
                            f"{processes.describe_process(child)}, started by worker pid {pid} "
                            "and alive after it (outside its process group), holds "
                            + ("an unknown amount" if used is None else f"{used / 2**20:.0f} MiB")
                            + f" on {device}"
                            for child, used in held.items()
                        ],
                    )
            if not found or self._stopped.wait(0.1) or time.monotonic() >= deadline:
                return found

    def _wait_device_free(self, device: str, needed_bytes: int) -> None:
        index = nvml_index_for(device, self.probe, self.environ)
        while index is not None and not self._stopped.wait(0.5):
            free = self.probe.free_bytes(index)
            if free is None or free >= needed_bytes:
                break
        self._post(self._on_device_free, device)

    def _sample_gpu(self) -> None:
        interval = self.config.gpu_sample_interval_s
        while not self._stopped.wait(interval):
            per_worker: dict[int, tuple[int | None, str, dict[str, int | None]]] = {}
            for worker_id, pid, label in self._gpu_workers:
                by_device: dict[str, int | None] = {}
                method = "unavailable"
                for device in group_devices(label):
                    index = nvml_index_for(device, self.probe, self.environ)
                    if index is None:
                        continue
                    reading = self.probe.worker_memory(index, pid)
                    by_device[device] = reading.bytes
                    if reading.method == "pid":
                        self._gpu_pids_listed.add((pid, device))
                        method = "pid"
                if not by_device:
                    continue
                # Summed over the GPUs that list the worker: a GPU of a group that holds
                # none of its memory has no entry for it, which is zero, not unknown.
                known = [used for used in by_device.values() if used is not None]
                total = sum(known) if method == "pid" and known else None
                per_worker[worker_id] = (total, method, by_device)
            self._note_children_on_gpus()
            devices = [
                DeviceStats(d.index, d.name, d.used_mb, d.total_mb)
                for d in self.probe.devices(self.probe.visible_device_indices(self.environ))
            ]
            self._post(self._on_gpu_sample, per_worker, devices)

    def _note_children_on_gpus(self) -> None:
        """Remember which processes NVML lists on the pool's GPUs were started by a worker."""
        workers = {pid for _id, pid, _label in self._gpu_workers}
        devices = {d for _id, _pid, label in self._gpu_workers for d in group_devices(label)}
        if len(self._not_started_by_workers) > 4096:
            self._not_started_by_workers.clear()  # PIDs are reused; keep the set bounded
        for device in sorted(devices):
            index = nvml_index_for(device, self.probe)
            if index is None:
                continue
            for listed in self.probe.process_memory(index):
                if listed in workers or listed in self._not_started_by_workers:
                    continue
                owner = processes.started_by(listed, workers)
                if owner is None:
                    self._not_started_by_workers.add(listed)
                else:
                    self._gpu_children.setdefault(owner, set()).add(listed)


def _start_thread(target: Callable[..., None], args: tuple[Any, ...], name: str) -> bool:
    """Start a daemon thread for one check; False if the interpreter is exiting: a pool
    closed by its exit hook reaps its workers then, and Python 3.12 refuses new threads
    at that point."""
    try:
        threading.Thread(target=target, args=args, name=name, daemon=True).start()
    except RuntimeError as refused:
        # 3.12's words; sys.is_finalizing() is still False in an exit hook there.
        if "interpreter shutdown" not in str(refused) and not sys.is_finalizing():
            raise
        logger.debug("%s not started: the interpreter is exiting", name)
        return False
    return True
