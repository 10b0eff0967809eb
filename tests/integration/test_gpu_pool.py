"""The pool's GPU paths, driven by real worker processes and a scripted fake NVML.

No GPU here: ``ModelPool(gpu_probe=GpuProbe(nvml=fake))`` makes the pool place
workers on "cuda:0", sample their memory and verify its release through the
fake, whose process list the test controls.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any

import psutil
import pytest

from fake_nvml import GIB, MIB, FakeGpu, FakeNvml, NVMLError_LibraryNotFound
from helpers import make_config, wait_until
from modelpool import ModelPool
from modelpool.supervisor.gpu import GpuProbe

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux processes")


class HoldingNvml(FakeNvml):
    """Reports each registered pid as holding memory on GPU 0, and used memory to match."""

    def __init__(self) -> None:
        super().__init__([FakeGpu(total=8 * GIB, used=1 * GIB)])
        self._lock = threading.Lock()
        self.base_used = 1 * GIB

    def hold(self, pid: int, nbytes: int) -> None:
        with self._lock:
            self.gpus[0].compute[pid] = nbytes
            self.gpus[0].used = self.base_used + sum(v or 0 for v in self.gpus[0].compute.values())

    def release(self, pid: int) -> None:
        with self._lock:
            self.gpus[0].compute.pop(pid, None)
            self.gpus[0].used = self.base_used + sum(v or 0 for v in self.gpus[0].compute.values())


READY = ("idle", "spare")


class HiddenPidNvml(HoldingNvml):
    """As under gVisor: each worker's memory is listed under a PID that is not the worker's."""

    def hold(self, pid: int, nbytes: int) -> None:
        super().hold(pid + 100_000, nbytes)

    def release(self, pid: int) -> None:
        super().release(pid + 100_000)


def gpu_pool(nvml: FakeNvml, **overrides: Any) -> ModelPool:
    config = make_config(
        devices=["cuda:0"],
        gpu_sample_interval_s=0.05,
        gpu_release_timeout_s=0.3,
        **overrides,
    )
    return ModelPool(config, gpu_probe=GpuProbe(nvml=nvml))


def test_workers_are_placed_on_the_gpu_and_their_memory_is_sampled() -> None:
    nvml = HoldingNvml()
    with gpu_pool(nvml, workers=1) as pool:
        worker = pool.stats().workers[0]
        assert worker.device == "cuda:0"
        assert pool.stats().gpu.available
        assert pool.stats().gpu.reason == "NVML available, 1 device(s)"
        nvml.hold(worker.pid, 300 * MIB)
        sampled = wait_until(
            lambda: pool.stats().workers[0].gpu_mb, timeout=5, message="a gpu_mb sample"
        )
        assert sampled == 300.0
        assert pool.stats().workers[0].gpu_mb_method == "pid"
        assert pool.generate("pid").text == str(worker.pid)


def test_a_kill_whose_memory_comes_back_is_a_verified_release() -> None:
    nvml = HoldingNvml()
    with gpu_pool(nvml, workers=1) as pool:
        pid = pool.stats().workers[0].pid
        rss_mb = pool.stats().workers[0].rss_mb
        nvml.hold(pid, 200 * MIB)
        wait_until(lambda: pool.stats().workers[0].gpu_mb, timeout=5)
        os.kill(pid, signal.SIGKILL)
        nvml.release(pid)
        releases = wait_until(
            lambda: (r := pool.stats().gpu.releases).checked and r,
            timeout=5,
            message="the release check",
        )
        assert releases.ok == 1 and releases.failed == 0
        # Gone from the process list before the first poll, but listed while alive.
        assert releases.last_method == "pid"
        # What the dead worker held in host memory (its last RSS), as the pool reports it.
        assert rss_mb is not None and releases.last_freed_mb == pytest.approx(rss_mb, abs=0.1)
        wait_until(lambda: pool.stats().workers and pool.stats().workers[0].state == "idle")
        assert pool.stats().state == "ready"


def test_one_of_two_workers_on_a_gpu_killed_and_unlisted_before_the_first_poll() -> None:
    # Issue 17, point 1: the dead worker's PID is gone before the release check's first
    # poll, and its neighbour's memory must not count against it.
    nvml = HoldingNvml()
    with gpu_pool(nvml, workers=1, spares=1) as pool:
        pids = [w.pid for w in pool.stats().workers]
        assert len(pids) == 2
        for pid in pids:
            nvml.hold(pid, 500 * MIB)
        wait_until(
            lambda: [w.gpu_mb for w in pool.stats().workers] == [500.0, 500.0],
            timeout=5,
            message="both workers sampled",
        )
        victim, neighbour = pids
        nvml.release(victim)  # the driver tears the context down before the reap
        os.kill(victim, signal.SIGKILL)
        releases = wait_until(
            lambda: (r := pool.stats().gpu.releases).checked and r,
            timeout=5,
            message="the release check",
        )
        assert (releases.ok, releases.failed, releases.last_method) == (1, 0, "pid")
        workers = wait_until(
            lambda: len(ws := [w for w in pool.stats().workers if w.state in READY]) == 2 and ws,
            timeout=5,
            message="the slot refilled",
        )
        assert neighbour in [w.pid for w in workers] and victim not in [w.pid for w in workers]
        assert pool.stats().state == "ready"


def test_without_pid_attribution_no_worker_is_recycled_on_gpu_memory() -> None:
    # Issue 17, point 2: with PIDs hidden, "used - own baseline" counts the neighbours too
    # (600 MiB each here, over the 400 MiB limit): every worker was recycled in a loop.
    nvml = HiddenPidNvml()
    with gpu_pool(nvml, workers=2, max_worker_gpu_mb=400) as pool:
        pids = sorted(w.pid for w in pool.stats().workers)
        for pid in pids:
            nvml.hold(pid, 300 * MIB)
        sampled = nvml.calls.get("nvmlDeviceGetComputeRunningProcesses", 0)
        wait_until(
            lambda: (
                nvml.calls.get("nvmlDeviceGetComputeRunningProcesses", 0) >= sampled + 3 * len(pids)
            ),
            timeout=5,
            message="three sampling rounds",
        )
        snapshot = pool.stats()
        assert snapshot.counters["recycled"] == 0
        assert sorted(w.pid for w in snapshot.workers) == pids
        assert [(w.gpu_mb, w.gpu_mb_method) for w in snapshot.workers] == [
            (None, "unavailable"),
            (None, "unavailable"),
        ]
        assert snapshot.gpu.devices[0].used_mb == 1024.0 + 600.0  # the device-level figure


def test_memory_not_released_degrades_the_pool_until_the_device_frees() -> None:
    nvml = HoldingNvml()
    with gpu_pool(nvml, workers=1) as pool:
        pid = pool.stats().workers[0].pid
        nvml.hold(pid, 6 * GIB)
        wait_until(lambda: pool.stats().workers[0].gpu_mb, timeout=5)
        os.kill(pid, signal.SIGKILL)  # NVML keeps listing it: its memory is "stuck"

        wait_until(lambda: pool.stats().state == "degraded", timeout=5, message="degraded")
        snapshot = pool.stats()
        assert snapshot.gpu.releases.failed == 1
        assert snapshot.gpu.blocked_devices == ["cuda:0"]
        assert snapshot.workers == []  # no replacement piled onto a GPU that is still full
        assert snapshot.counters["respawns"] == 0

        nvml.release(pid)
        wait_until(lambda: pool.stats().state == "ready", timeout=5, message="ready again")
        replacement = wait_until(
            lambda: [w for w in pool.stats().workers if w.state == "idle"], timeout=5
        )
        assert replacement[0].pid != pid
        assert pool.stats().counters["respawns"] == 1
        assert pool.generate("echo:back").text == "back"


def test_auto_devices_resolve_to_cpu_without_a_driver() -> None:
    # A fake NVML without a driver: the same answer on a host that has a GPU.
    no_driver = GpuProbe(FakeNvml(init_error=NVMLError_LibraryNotFound()))
    with ModelPool(make_config(devices=["auto"], workers=2), gpu_probe=no_driver) as pool:
        assert [w.device for w in pool.stats().workers] == ["cpu", "cpu"]
        assert pool.stats().gpu.available is False
        assert pool.stats().gpu.reason == "NVML library not found (no NVIDIA driver)"


def test_auto_devices_spread_workers_round_robin_over_visible_gpus() -> None:
    nvml = FakeNvml([FakeGpu(uuid="GPU-a"), FakeGpu(uuid="GPU-b")])
    config = make_config(devices=["auto"], workers=4, gpu_sample_interval_s=0.05)
    with ModelPool(config, gpu_probe=GpuProbe(nvml=nvml)) as pool:
        devices = sorted(w.device for w in pool.stats().workers)
        assert devices == ["cuda:0", "cuda:0", "cuda:1", "cuda:1"]


# ----------------------------------------------------------------------------- device groups


class GroupNvml(FakeNvml):
    """Four GPUs; a worker's memory is held per GPU, and freed when its process is gone,
    as a driver does, unless the test made it stick (a context that outlives the process)."""

    UUIDS = [f"GPU-{n}{n}{n}{n}0000-0000-0000-0000-000000000000" for n in range(4)]

    def __init__(self) -> None:
        super().__init__([FakeGpu(uuid=uuid, total=8 * GIB, used=1 * GIB) for uuid in self.UUIDS])
        self._lock = threading.Lock()
        self.stuck: set[int] = set()

    def hold(self, index: int, pid: int, nbytes: int) -> None:
        with self._lock:
            self.gpus[index].compute[pid] = nbytes
            self._recount(index)

    def release(self, pid: int) -> None:
        with self._lock:
            self.stuck.discard(pid)
            for index, gpu in enumerate(self.gpus):
                gpu.compute.pop(pid, None)
                self._recount(index)

    def _recount(self, index: int) -> None:
        gpu = self.gpus[index]
        gpu.used = 1 * GIB + sum(v or 0 for v in gpu.compute.values())

    def _free_the_dead(self, handle: Any) -> None:
        with self._lock:
            gpu = self.gpus[handle.index]
            for pid in list(gpu.compute):
                if pid not in self.stuck and not _alive(pid):
                    del gpu.compute[pid]
            self._recount(handle.index)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]:
        self._free_the_dead(handle)
        return super().nvmlDeviceGetComputeRunningProcesses(handle)

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> Any:
        self._free_the_dead(handle)
        return super().nvmlDeviceGetMemoryInfo(handle, version)


def _alive(pid: int) -> bool:
    """A zombie's context is gone too: the driver frees it when the process exits."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def group_pool(nvml: GroupNvml, **overrides: Any) -> ModelPool:
    values: dict[str, Any] = {
        "devices": [["cuda:0", "cuda:1"], ["cuda:2", "cuda:3"]],
        "workers": 2,
        "gpu_sample_interval_s": 0.05,
        "gpu_release_timeout_s": 0.3,
    }
    values.update(overrides)
    return ModelPool(make_config(**values), gpu_probe=GpuProbe(nvml=nvml))


def test_a_worker_owns_its_group_and_sees_exactly_its_gpus() -> None:
    nvml = GroupNvml()
    with group_pool(nvml, workers=1, spares=1, backend_options={"env_command": True}) as pool:
        by_device = {w.device: w for w in pool.stats().workers}
        assert sorted(by_device) == ["cuda:0,cuda:1", "cuda:2,cuda:3"]  # the spare has a group
        served = pool.generate("env:CUDA_VISIBLE_DEVICES")
        label = next(d for d, w in by_device.items() if w.pid == served.worker_pid)
        first, second = (int(device[-1]) for device in label.split(","))
        assert served.text == f"{GroupNvml.UUIDS[first]},{GroupNvml.UUIDS[second]}"
        assert pool.generate("device").text == "cuda:0,cuda:1"  # the worker's own numbering


def test_group_memory_is_sampled_per_gpu_and_max_worker_gpu_mb_compares_the_sum() -> None:
    nvml = GroupNvml()
    with group_pool(nvml, max_worker_gpu_mb=500) as pool:
        low = next(w for w in pool.stats().workers if w.device == "cuda:0,cuda:1")
        high = next(w for w in pool.stats().workers if w.device == "cuda:2,cuda:3")
        nvml.hold(0, low.pid, 200 * MIB)  # 200 + 200 = 400 MiB: under the limit
        nvml.hold(1, low.pid, 200 * MIB)
        nvml.hold(2, high.pid, 300 * MIB)  # 300 + 300 = 600 MiB: over it, each GPU under
        nvml.hold(3, high.pid, 300 * MIB)
        wait_until(lambda: pool.stats().counters["recycled"] == 1, timeout=5, message="recycle")
        sampled = wait_until(
            lambda: next((w for w in pool.stats().workers if w.pid == low.pid and w.gpu_mb), None),
            timeout=5,
        )
        assert sampled.gpu_mb == 400.0
        assert sampled.gpu_mb_by_device == {"cuda:0": 200.0, "cuda:1": 200.0}
        replacement = wait_until(
            lambda: [
                w
                for w in pool.stats().workers
                if w.device == "cuda:2,cuda:3" and w.state == "idle" and w.pid != high.pid
            ],
            timeout=5,
            message="the recycled worker's replacement",
        )
        assert replacement and pool.stats().counters["recycled"] == 1
        assert pool.stats().gpu.releases.ok >= 1 and pool.stats().gpu.releases.failed == 0


def test_a_gpu_of_a_group_that_keeps_memory_blocks_the_group_and_is_named() -> None:
    nvml = GroupNvml()
    with group_pool(nvml) as pool:
        victim = next(w for w in pool.stats().workers if w.device == "cuda:0,cuda:1")
        other = next(w for w in pool.stats().workers if w.device == "cuda:2,cuda:3")
        nvml.hold(0, victim.pid, 100 * MIB)
        nvml.hold(1, victim.pid, 3 * GIB)
        wait_until(lambda: pool.stats().workers[0].gpu_mb, timeout=5)
        # GPU 1 keeps the dead worker's memory; GPU 0 frees it as the process goes.
        nvml.stuck.add(victim.pid)
        nvml.gpus[0].compute.pop(victim.pid)
        os.kill(victim.pid, signal.SIGKILL)

        wait_until(lambda: pool.stats().state == "degraded", timeout=5, message="degraded")
        snapshot = pool.stats()
        assert snapshot.gpu.blocked_devices == ["cuda:1"]
        assert snapshot.gpu.blocked_held_mb == {"cuda:1": 3072.0}
        assert [w.pid for w in snapshot.workers] == [other.pid]  # nothing on the blocked group
        assert snapshot.counters["respawns"] == 0
        assert pool.generate("pid").text == str(other.pid)  # the other group still serves

        nvml.release(victim.pid)
        wait_until(lambda: pool.stats().state == "ready", timeout=5, message="ready again")
        assert pool.stats().gpu.blocked_held_mb == {}
        wait_until(lambda: len([w for w in pool.stats().workers if w.state == "idle"]) == 2)
        assert pool.stats().counters["respawns"] == 1


def test_a_child_that_escaped_the_workers_group_and_holds_memory_is_named_and_blocks() -> None:
    nvml = GroupNvml()
    child = 0
    with group_pool(nvml, devices=["cuda:0"], workers=1) as pool:
        try:
            (worker,) = pool.stats().workers
            child = int(pool.generate("detach:60").text)  # a new session: killpg misses it
            nvml.hold(0, worker.pid, 200 * MIB)
            nvml.hold(0, child, 300 * MIB)
            wait_until(lambda: pool.stats().workers[0].gpu_mb == 200.0, timeout=5)
            os.kill(worker.pid, signal.SIGKILL)

            wait_until(lambda: pool.stats().state == "degraded", timeout=5, message="degraded")
            gpu = pool.stats().gpu
            assert gpu.blocked_devices == ["cuda:0"]
            assert gpu.blocked_held_mb == {"cuda:0": 300.0}
            (line,) = gpu.blocked_holders["cuda:0"]
            assert line.startswith(f"pid {child} (")
            assert f"started by worker pid {worker.pid}" in line and "300 MiB on cuda:0" in line
            assert pool.stats().workers == []

            os.kill(child, signal.SIGKILL)  # its context goes with it: the GPU has room again
            wait_until(lambda: pool.stats().state == "ready", timeout=10, message="ready again")
            assert pool.generate("echo:back").text == "back"
        finally:
            if child and _alive(child):
                os.kill(child, signal.SIGKILL)


def test_explicit_devices_spread_workers_round_robin_in_the_given_order() -> None:
    nvml = FakeNvml([FakeGpu(uuid="GPU-a"), FakeGpu(uuid="GPU-b")])
    config = make_config(devices=["cuda:1", "cuda:0"], workers=3, gpu_sample_interval_s=0.05)
    with ModelPool(config, gpu_probe=GpuProbe(nvml=nvml)) as pool:
        by_id = sorted(pool.stats().workers, key=lambda w: w.id)
        assert [w.device for w in by_id] == ["cuda:1", "cuda:0", "cuda:1"]
