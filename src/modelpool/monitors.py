"""The pool's background checks, each on its own thread: a dead worker's release, a
blocked GPU's free memory, and periodic GPU sampling.

They only read (processes, NVML) and wait; every result goes back to the dispatcher
thread as a command through ``post``, so the dispatcher stays the single owner of
state. A check that takes seconds (a process group that lingers, GPU memory that is
slow to come back) never holds up the event loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping

from modelpool import gpu, processes
from modelpool.config import PoolConfig
from modelpool.records import Worker
from modelpool.stats import DeviceStats

logger = logging.getLogger(__name__)


class Monitors:
    """Starts the check threads; ``post(action, *args)`` hands results to the dispatcher.

    ``on_release_checked``, ``on_device_free`` and ``on_gpu_sample`` are the dispatcher's
    entry points that receive them.
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
        self._gpu_workers: list[tuple[int, int, str, int | None]] = []
        self._gpu_pids_listed: set[int] = set()  # live workers' PIDs NVML has listed
        self._stopped = threading.Event()
        self._sampler = threading.Thread(
            target=self._sample_gpu, name="modelpool-gpu-sampler", daemon=True
        )

    def start(self) -> None:
        if self.probe.available:
            self._sampler.start()

    def stop(self) -> None:
        self._stopped.set()

    def check_release(self, worker: Worker) -> None:
        threading.Thread(
            target=self._check_release,
            args=(
                worker.id,
                worker.pid,
                worker.device,
                worker.gpu_baseline,
                worker.rss_bytes,
                worker.pid in self._gpu_pids_listed,
            ),
            name=f"modelpool-release-{worker.id}",
            daemon=True,
        ).start()

    def watch_device_free(self, device: str, needed_bytes: int) -> None:
        threading.Thread(
            target=self._wait_device_free,
            args=(device, needed_bytes),
            name=f"modelpool-watch-{device}",
            daemon=True,
        ).start()

    def gpu_workers_changed(self, workers: list[tuple[int, int, str, int | None]]) -> None:
        self._gpu_workers = workers
        self._gpu_pids_listed = self._gpu_pids_listed & {pid for _id, pid, _d, _b in workers}

    def _check_release(
        self,
        worker_id: int,
        pid: int | None,
        device: str,
        baseline: int | None,
        rss_bytes: int | None,
        listed_while_alive: bool,
    ) -> None:
        started = time.monotonic()
        ok, method, held = True, "psutil", None
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
            index = gpu.nvml_index_for(device, self.probe, self.environ)
            if index is not None and self.probe.available:
                gpu_report = self.probe.wait_released(
                    index,
                    pid,
                    baseline,
                    timeout_s=self.config.gpu_release_timeout_s,
                    listed_while_alive=listed_while_alive,
                    other_worker_pids=lambda: [
                        p for _id, p, d, _baseline in self._gpu_workers if d == device
                    ],
                )
                ok = ok and gpu_report.ok
                method, held = gpu_report.method, gpu_report.held_bytes
                if not gpu_report.ok:
                    logger.error(
                        "worker pid %s: %s bytes still held on %s after %.1fs; holders: %s",
                        pid,
                        gpu_report.held_bytes,
                        device,
                        gpu_report.seconds,
                        gpu_report.holders,
                    )
        self._post(
            self._on_release_checked,
            worker_id,
            ok,
            time.monotonic() - started,
            method,
            rss_bytes,
            held,
        )

    def _wait_device_free(self, device: str, needed_bytes: int) -> None:
        index = gpu.nvml_index_for(device, self.probe, self.environ)
        while index is not None and not self._stopped.wait(0.5):
            free = self.probe.free_bytes(index)
            if free is None or free >= needed_bytes:
                break
        self._post(self._on_device_free, device)

    def _sample_gpu(self) -> None:
        interval = self.config.gpu_sample_interval_s
        while not self._stopped.wait(interval):
            per_worker: dict[int, tuple[int | None, str]] = {}
            for worker_id, pid, device, _baseline in self._gpu_workers:
                index = gpu.nvml_index_for(device, self.probe, self.environ)
                if index is None:
                    continue
                reading = self.probe.worker_memory(index, pid)
                if reading.method == "pid":
                    self._gpu_pids_listed.add(pid)
                per_worker[worker_id] = (reading.bytes, reading.method)
            devices = [
                DeviceStats(d.index, d.name, d.used_mb, d.total_mb)
                for d in self.probe.devices(self.probe.visible_device_indices(self.environ))
            ]
            self._post(self._on_gpu_sample, per_worker, devices)
