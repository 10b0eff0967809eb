"""GpuProbe and device resolution against a scripted fake NVML; no GPU, no real sleeps."""

from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from fake_nvml import (
    GIB,
    MIB,
    FakeGpu,
    FakeMig,
    FakeNvml,
    FakeNVMLError,
    NVMLError_DriverNotLoaded,
    NVMLError_LibraryNotFound,
    NVMLError_NoPermission,
)
from helpers import slack
from modelpool.supervisor.devices import nvml_index_for, resolve_devices, worker_env_for
from modelpool.supervisor.gpu import (
    DeviceInfo,
    GpuProbe,
    MemoryReading,
    ReleaseReport,
    find_device_holders,
)


class FakeClock:
    """A clock and a sleep that advances it; ``on_sleep`` scripts the world between polls."""

    def __init__(self, on_sleep: Any = None) -> None:
        self.now = 1000.0
        self.sleeps = 0
        self.on_sleep = on_sleep

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.now += seconds
        self.sleeps += 1
        if self.on_sleep is not None:
            self.on_sleep(self.sleeps)


def two_gpus() -> FakeNvml:
    return FakeNvml(
        [
            FakeGpu(name="GPU Zero", uuid="GPU-aaaa1111-0000-0000-0000-000000000000"),
            FakeGpu(name=b"GPU One", uuid="GPU-bbbb2222-0000-0000-0000-000000000000"),
        ]
    )


NO_CVD: dict[str, str] = {}


# ----------------------------------------------------------------------------- availability


def test_available_probe_reads_devices() -> None:
    nvml = two_gpus()
    probe = GpuProbe(nvml)
    assert probe.available
    devices = probe.devices()
    assert devices == [
        DeviceInfo(index=0, name="GPU Zero", used_mb=1024.0, total_mb=81920.0),
        DeviceInfo(index=1, name="GPU One", used_mb=1024.0, total_mb=81920.0),  # bytes decoded
    ]
    assert probe.devices([1])[0].index == 1
    assert probe.used_bytes(0) == 1 * GIB
    assert probe.free_bytes(0) == 79 * GIB
    assert probe.used_bytes(5) is None
    assert nvml.calls["nvmlInit"] == 1


def test_memory_info_falls_back_to_v1_and_stays_there() -> None:
    nvml = FakeNvml([FakeGpu()], memory_v2=False)
    probe = GpuProbe(nvml)
    first = probe.used_bytes(0)
    assert first == 1 * GIB + 500 * MIB  # v1: reserved counted as used
    calls = nvml.calls["nvmlDeviceGetMemoryInfo"]
    assert probe.used_bytes(0) == first
    # v2 is not tried again once v1 was chosen, so baselines and later reads agree.
    assert nvml.calls["nvmlDeviceGetMemoryInfo"] == calls + 1


def test_close_shuts_down_once() -> None:
    nvml = two_gpus()
    with GpuProbe(nvml) as probe:
        assert probe.available
    assert not probe.available
    assert nvml.calls["nvmlShutdown"] == 1
    probe.close()
    assert nvml.calls["nvmlShutdown"] == 1
    assert probe.devices() == []


def assert_unavailable_and_fast(probe: GpuProbe) -> None:
    assert not probe.available
    assert probe.reason
    started = time.perf_counter()
    assert probe.devices() == []
    assert probe.used_bytes(0) is None
    assert probe.free_bytes(0) is None
    assert probe.process_memory(0) == {}
    assert probe.worker_memory(0, 123) == MemoryReading(None, "unavailable")
    assert probe.driver_version() is None
    assert probe.visible_device_indices(NO_CVD) == []
    report = probe.wait_released(0, 123, 0, timeout_s=30.0, sleep=_no_sleep)
    assert report.ok and report.method == "unavailable" and report.seconds < slack(0.1)
    assert resolve_devices(["auto"], probe, NO_CVD) == ["cpu"]
    assert time.perf_counter() - started < slack(0.1)


def _no_sleep(seconds: float) -> None:
    raise AssertionError("an unavailable probe must not sleep")


def test_library_not_found() -> None:
    nvml = FakeNvml([FakeGpu()], init_error=NVMLError_LibraryNotFound())
    probe = GpuProbe(nvml)
    assert probe.reason == "NVML library not found (no NVIDIA driver)"
    assert_unavailable_and_fast(probe)
    assert nvml.calls == {"nvmlInit": 1}  # no retries, nothing else called


def test_driver_not_loaded() -> None:
    probe = GpuProbe(FakeNvml([FakeGpu()], init_error=NVMLError_DriverNotLoaded()))
    assert probe.reason == "NVIDIA driver not loaded"
    assert_unavailable_and_fast(probe)


def test_other_nvml_error() -> None:
    probe = GpuProbe(FakeNvml([FakeGpu()], init_error=FakeNVMLError()))
    assert "NVML initialisation failed" in probe.reason
    assert "fake NVML error" in probe.reason
    assert_unavailable_and_fast(probe)


def test_count_failure_after_init_shuts_down() -> None:
    nvml = two_gpus()

    def broken_count() -> int:
        raise NVMLError_NoPermission()

    nvml.nvmlDeviceGetCount = broken_count  # type: ignore[method-assign]
    probe = GpuProbe(nvml)
    assert "no permission" in probe.reason
    assert nvml.calls["nvmlShutdown"] == 1
    assert_unavailable_and_fast(probe)


def test_import_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    probe = GpuProbe()
    assert "not installed" in probe.reason
    assert_unavailable_and_fast(probe)


def test_real_pynvml_without_a_driver_is_fast() -> None:
    started = time.perf_counter()
    probe = GpuProbe()
    elapsed = time.perf_counter() - started
    # With a driver, nvmlInit may take seconds (persistence mode off): only the
    # driverless case must cost nothing.
    if ctypes.util.find_library("nvidia-ml") is None and not Path("/dev/nvidiactl").exists():
        assert elapsed < slack(0.5), elapsed
        assert not probe.available
        assert probe.reason == "NVML library not found (no NVIDIA driver)"
        assert_unavailable_and_fast(probe)
    probe.close()


# ----------------------------------------------------------------------------- attribution


def test_process_memory_merges_compute_and_graphics() -> None:
    gpu = FakeGpu(compute={10: 2 * GIB, 11: None}, graphics={10: 1 * GIB, 12: 300 * MIB})
    probe = GpuProbe(FakeNvml([gpu]))
    assert probe.process_memory(0) == {10: 2 * GIB, 11: None, 12: 300 * MIB}
    assert probe.process_memory(3) == {}


def test_process_list_falls_back_to_v2_on_old_driver() -> None:
    nvml = FakeNvml([FakeGpu(compute={10: GIB})], compute_v3=False)
    probe = GpuProbe(nvml)
    assert probe.process_memory(0) == {10: GIB}
    assert nvml.calls["nvmlDeviceGetComputeRunningProcesses_v2"] == 1


def test_worker_memory_by_pid() -> None:
    gpu = FakeGpu(used=5 * GIB, compute={4242: 3 * GIB, 7: GIB})
    probe = GpuProbe(FakeNvml([gpu]))
    assert probe.worker_memory(0, 4242) == MemoryReading(3 * GIB, "pid")


def test_worker_memory_without_pid_attribution_is_not_guessed_from_the_device() -> None:
    # gVisor passes the sandbox's PIDs through: none of the workers' PIDs is listed. Each
    # worker's "used - own baseline" would include its neighbours (issue 17, point 2), so
    # there is no per-worker figure, only the device's.
    gpu = FakeGpu(used=1 * GIB)
    probe = GpuProbe(FakeNvml([gpu]))
    gpu.used = 3 * GIB
    gpu.compute = {987654: GIB, 987655: GIB}  # two workers, under PIDs that are not theirs
    assert probe.worker_memory(0, 111) == MemoryReading(None, "unavailable")
    assert probe.worker_memory(0, 222) == MemoryReading(None, "unavailable")
    assert probe.devices()[0].used_mb == 3072.0  # the device-level figure is still there


def test_worker_memory_pid_visible_but_usage_not_available() -> None:
    # Listed (so attributed by PID) but NVML has no per-process figure: no number is made up.
    gpu = FakeGpu(used=3 * GIB, compute={4242: None})
    probe = GpuProbe(FakeNvml([gpu]))
    assert probe.worker_memory(0, 4242) == MemoryReading(None, "pid")


def test_mps_clients_are_attributed_by_pid() -> None:
    # Under MPS, clients appear only in the MPS list; the compute list holds the server.
    gpu = FakeGpu(used=3 * GIB, compute={50: 200 * MIB}, mps={4242: 700 * MIB})
    nvml = FakeNvml([gpu])
    probe = GpuProbe(nvml)
    assert probe.process_memory(0) == {50: 200 * MIB, 4242: 700 * MIB}
    assert probe.worker_memory(0, 4242) == MemoryReading(700 * MIB, "pid")
    gpu.mps.clear()
    clock = FakeClock()
    report = probe.wait_released(
        0, 4242, GIB, timeout_s=5.0, listed_while_alive=True, clock=clock, sleep=clock.sleep
    )
    assert report.ok and report.method == "pid"
    nvml.compute_v3 = False  # an older driver: the _v2 call answers
    gpu.mps[4243] = MIB
    assert probe.process_memory(0)[4243] == MIB
    assert nvml.calls["nvmlDeviceGetMPSComputeRunningProcesses_v2"] == 1


def test_driver_version() -> None:
    assert GpuProbe(FakeNvml([FakeGpu()], driver_version="570.86.15")).driver_version() == (
        "570.86.15"
    )


# ----------------------------------------------------------------------------- release


def test_release_by_pid_after_some_polls() -> None:
    gpu = FakeGpu(used=5 * GIB, compute={4242: 4 * GIB})

    def world(polls: int) -> None:
        if polls == 3:
            gpu.compute.pop(4242)
            gpu.used = GIB

    clock = FakeClock(world)
    probe = GpuProbe(FakeNvml([gpu]))
    report = probe.wait_released(
        0, 4242, GIB, timeout_s=5.0, poll_s=0.05, clock=clock, sleep=clock.sleep
    )
    assert report == ReleaseReport(ok=True, seconds=report.seconds, held_bytes=0, method="pid")
    assert report.seconds == pytest.approx(0.15)
    assert clock.sleeps == 3


def test_release_by_pid_ignores_memory_owned_by_others() -> None:
    # The PID was visible and is gone: other processes' growth is not ours.
    gpu = FakeGpu(used=5 * GIB, compute={4242: 4 * GIB, 99: GIB})

    def world(polls: int) -> None:
        if polls == 2:
            gpu.compute.pop(4242)
            gpu.used = 3 * GIB  # someone else grew meanwhile

    clock = FakeClock(world)
    probe = GpuProbe(FakeNvml([gpu]))
    report = probe.wait_released(0, 4242, GIB, timeout_s=5.0, clock=clock, sleep=clock.sleep)
    assert report.ok and report.method == "pid"
    assert report.seconds == pytest.approx(0.10)


def test_release_by_delta_when_pid_hidden() -> None:
    gpu = FakeGpu(used=GIB)
    probe = GpuProbe(FakeNvml([gpu]))
    baseline = probe.used_bytes(0)
    assert baseline is not None
    gpu.used = 9 * GIB
    gpu.compute = {555555: 8 * GIB}  # host PID, not ours

    def world(polls: int) -> None:
        if polls == 2:
            gpu.used = 4 * GIB  # the driver frees in steps
        if polls == 5:
            gpu.used = GIB + 10 * MIB  # within tolerance
            gpu.compute = {}

    clock = FakeClock(world)
    report = probe.wait_released(
        0, 4242, baseline, timeout_s=5.0, poll_s=0.1, clock=clock, sleep=clock.sleep
    )
    assert report.ok
    assert report.method == "delta"
    assert report.seconds == pytest.approx(0.5)
    assert report.held_bytes == 10 * MIB


def test_release_with_pid_hidden_and_no_baseline_is_unverified() -> None:
    gpu = FakeGpu(used=9 * GIB, compute={555555: 8 * GIB})
    probe = GpuProbe(FakeNvml([gpu]))
    clock = FakeClock()
    report = probe.wait_released(0, 4242, None, timeout_s=5.0, clock=clock, sleep=clock.sleep)
    assert report.ok and report.method == "unavailable" and report.held_bytes is None


def write_fake_proc(root: Path) -> None:
    """A /proc with: 4242 holding /dev/nvidia0, 4243 in state D, 4244 unrelated, 4245 unreadable."""

    def proc(pid: int, comm: str, state: str, fds: dict[str, str]) -> None:
        proc_dir = root / str(pid)
        (proc_dir / "fd").mkdir(parents=True)
        (proc_dir / "stat").write_text(f"{pid} ({comm}) {state} 1 {pid} {pid} 0 -1 4194560 0 0\n")
        for fd, target in fds.items():
            os.symlink(target, proc_dir / "fd" / fd)

    proc(4242, "python worker", "S", {"0": "/dev/null", "7": "/dev/nvidia0", "8": "/dev/nvidiactl"})
    proc(4243, "nvidia-smi", "D", {"0": "/dev/null"})
    proc(4244, "bash", "S", {"0": "/dev/pts/0", "1": "socket:[1234]"})
    (root / "4245").mkdir()  # vanished / unreadable: no stat, no fd
    (root / "self").mkdir()
    (root / "meminfo").write_text("")


def test_release_never_happens_names_holders(tmp_path: Path) -> None:
    write_fake_proc(tmp_path)
    gpu = FakeGpu(used=5 * GIB, compute={4242: 4 * GIB})
    clock = FakeClock()
    probe = GpuProbe(FakeNvml([gpu]), proc_root=tmp_path)
    report = probe.wait_released(
        0, 4242, GIB, timeout_s=2.0, poll_s=0.05, clock=clock, sleep=clock.sleep
    )
    assert not report.ok
    assert report.method == "pid"
    assert report.held_bytes == 4 * GIB
    assert report.seconds == pytest.approx(2.0)
    assert clock.sleeps in (40, 41)  # float steps may need one short last sleep
    assert report.holders == [
        "pid 4242 (python worker): holds /dev/nvidia0, /dev/nvidiactl",
        "pid 4243 (nvidia-smi): in state D (uninterruptible sleep)",
    ]
    assert "NOT released" in report.describe()


def test_release_never_happens_by_delta(tmp_path: Path) -> None:
    write_fake_proc(tmp_path)
    gpu = FakeGpu(used=3 * GIB, compute={777: None})
    clock = FakeClock()
    probe = GpuProbe(FakeNvml([gpu]), proc_root=tmp_path)
    report = probe.wait_released(0, 4242, GIB, timeout_s=1.0, clock=clock, sleep=clock.sleep)
    assert not report.ok
    assert report.method == "delta"
    assert report.held_bytes == 2 * GIB
    assert len(report.holders) == 2


# -- two workers on one GPU (issue 17, point 1) --------------------------------------------


def two_workers_on_one_gpu() -> tuple[FakeGpu, GpuProbe, int]:
    """Worker 111 and its neighbour 222 (500 MiB each) on GPU 0, and 111's baseline.

    As in the pool, both baselines are read back to back before either worker has a
    context, so 111's baseline does not include 222's memory.
    """
    gpu = FakeGpu(used=GIB)
    probe = GpuProbe(FakeNvml([gpu]))
    baseline = probe.used_bytes(0)
    assert baseline == GIB
    gpu.compute = {111: 500 * MIB, 222: 500 * MIB}
    gpu.used = 2 * GIB
    return gpu, probe, baseline


def kill_111(gpu: FakeGpu) -> None:
    """The context is torn down before the worker is reaped: gone before the first poll."""
    gpu.compute.pop(111)
    gpu.used = GIB + 500 * MIB


def test_pid_listed_while_alive_and_gone_before_the_first_poll_is_released_by_pid() -> None:
    gpu, probe, baseline = two_workers_on_one_gpu()
    assert probe.worker_memory(0, 111).method == "pid"  # what the pool's sampler saw
    kill_111(gpu)
    clock = FakeClock()
    report = probe.wait_released(
        0,
        111,
        baseline,
        timeout_s=30.0,
        listed_while_alive=True,
        other_worker_pids={222},
        clock=clock,
        sleep=clock.sleep,
    )
    # Before the fix: "NOT released after 30.000s (method delta, held 500.0 MiB)".
    assert report == ReleaseReport(ok=True, seconds=0.0, held_bytes=0, method="pid")
    assert clock.sleeps == 0


def test_a_listed_neighbour_proves_pids_are_visible_when_the_dead_one_was_never_sampled() -> None:
    gpu, probe, baseline = two_workers_on_one_gpu()
    kill_111(gpu)  # died before the sampler ever read the list
    clock = FakeClock()
    report = probe.wait_released(
        0, 111, baseline, timeout_s=30.0, other_worker_pids={222}, clock=clock, sleep=clock.sleep
    )
    assert report.ok and report.method == "pid" and report.seconds == 0.0


def test_neighbours_can_be_given_as_a_callable_read_at_each_poll() -> None:
    gpu, probe, baseline = two_workers_on_one_gpu()
    kill_111(gpu)
    reads: list[int] = []

    def others() -> set[int]:
        reads.append(1)
        return {222}

    clock = FakeClock()
    report = probe.wait_released(
        0, 111, baseline, timeout_s=30.0, other_worker_pids=others, clock=clock, sleep=clock.sleep
    )
    assert report.ok and report.method == "pid" and reads


def test_delta_refuses_to_judge_beside_neighbours_whose_pids_are_hidden() -> None:
    gpu = FakeGpu(used=GIB)
    probe = GpuProbe(FakeNvml([gpu]))
    baseline = probe.used_bytes(0)
    gpu.compute = {9111: 500 * MIB, 9222: 500 * MIB}  # not the workers' PIDs (gVisor)
    gpu.used = 2 * GIB
    gpu.compute.pop(9111)
    gpu.used = GIB + 500 * MIB
    clock = FakeClock()
    report = probe.wait_released(
        0, 111, baseline, timeout_s=30.0, other_worker_pids={222}, clock=clock, sleep=clock.sleep
    )
    # The neighbour's 500 MiB would read as "not freed": unverified instead, and it says why.
    assert report.ok and report.method == "unavailable" and report.held_bytes is None
    assert "1 other pool worker" in report.detail and "222" in report.detail
    assert report.detail in report.describe()
    assert clock.sleeps == 0


def test_delta_still_judges_a_worker_alone_on_its_gpu() -> None:
    gpu = FakeGpu(used=GIB)
    probe = GpuProbe(FakeNvml([gpu]))
    baseline = probe.used_bytes(0)
    gpu.compute = {9111: 500 * MIB}
    gpu.used = GIB + 500 * MIB
    clock = FakeClock()
    report = probe.wait_released(
        0, 111, baseline, timeout_s=1.0, other_worker_pids=set(), clock=clock, sleep=clock.sleep
    )
    assert not report.ok and report.method == "delta" and report.held_bytes == 500 * MIB


def test_failed_release_does_not_name_the_live_workers_as_holders(tmp_path: Path) -> None:
    write_fake_proc(tmp_path)  # 4242 holds /dev/nvidia0, 4243 is in state D
    neighbour = tmp_path / "222"
    (neighbour / "fd").mkdir(parents=True)
    (neighbour / "stat").write_text("222 (python) S 1 222 222 0 -1 4194560 0 0\n")
    os.symlink("/dev/nvidia0", neighbour / "fd" / "9")
    gpu = FakeGpu(used=5 * GIB, compute={4242: 4 * GIB, 222: 500 * MIB})
    probe = GpuProbe(FakeNvml([gpu]), proc_root=tmp_path)
    clock = FakeClock()
    report = probe.wait_released(
        0,
        4242,
        GIB,
        timeout_s=1.0,
        listed_while_alive=True,
        other_worker_pids={222},
        clock=clock,
        sleep=clock.sleep,
    )
    assert not report.ok and report.method == "pid" and report.held_bytes == 4 * GIB
    assert [line.split(" (")[0] for line in report.holders] == ["pid 4242", "pid 4243"]


def test_holders_tolerates_missing_root(tmp_path: Path) -> None:
    lines = find_device_holders(tmp_path / "nope")
    assert len(lines) == 1 and "cannot list" in lines[0]


def test_holders_are_capped(tmp_path: Path) -> None:
    for pid in range(100, 140):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(f"{pid} (x) D 1\n")
    lines = find_device_holders(tmp_path, limit=5, exclude_pids={100})
    assert lines[0].startswith("pid 101 (x)")
    assert lines[-1] == "... and 34 more"
    assert len(lines) == 6


# ----------------------------------------------------------------------------- devices


def test_resolve_auto_without_driver() -> None:
    probe = GpuProbe(FakeNvml(init_error=NVMLError_LibraryNotFound()))
    assert resolve_devices(["auto"], probe, NO_CVD) == ["cpu"]
    assert resolve_devices(["cpu"], probe, NO_CVD) == ["cpu"]
    # No NVIDIA driver, no CUDA device: said before a worker starts, not by torch in each.
    with pytest.raises(ValueError, match=r"'cuda:3' does not exist: no NVIDIA GPU .*use \"cpu\""):
        resolve_devices(["cuda:3"], probe, NO_CVD)


def test_without_nvml_but_with_the_driver_nodes_cuda_devices_are_kept(tmp_path: Path) -> None:
    """A container given CUDA's libraries but not NVML's: CUDA will say whether N exists."""
    (tmp_path / "nvidia0").touch()
    (tmp_path / "nvidiactl").touch()
    probe = GpuProbe(FakeNvml(init_error=NVMLError_LibraryNotFound()), dev_root=tmp_path)
    assert probe.driver_nodes and not probe.available
    assert resolve_devices(["cuda", "cuda:3", "cpu"], probe, NO_CVD) == ["cuda:0", "cuda:3", "cpu"]
    assert resolve_devices(["auto"], probe, NO_CVD) == ["cpu"]


def test_resolve_auto_with_two_gpus() -> None:
    probe = GpuProbe(two_gpus())
    assert resolve_devices(["auto"], probe, NO_CVD) == ["cuda:0", "cuda:1"]
    assert resolve_devices(["cpu", "auto"], probe, NO_CVD) == ["cpu", "cuda:0", "cuda:1"]
    assert resolve_devices(["CUDA:1", " cuda "], probe, NO_CVD) == ["cuda:1", "cuda:0"]


def test_resolve_auto_with_zero_gpus() -> None:
    assert resolve_devices(["auto"], GpuProbe(FakeNvml([])), NO_CVD) == ["cpu"]


def test_resolve_rejects_missing_and_malformed_devices() -> None:
    probe = GpuProbe(two_gpus())
    with pytest.raises(ValueError, match="'cuda:2'"):
        resolve_devices(["cuda:2"], probe, NO_CVD)
    with pytest.raises(ValueError, match="'cuda:1'"):
        resolve_devices(["cuda:1"], probe, {"CUDA_VISIBLE_DEVICES": "0"})
    with pytest.raises(ValueError, match="'mps'"):
        resolve_devices(["mps"], probe, NO_CVD)
    with pytest.raises(ValueError, match="empty"):
        resolve_devices([], probe, NO_CVD)


@pytest.mark.parametrize(
    ("cvd", "indices"),
    [
        (None, [0, 1]),
        ("", []),
        ("  ", []),
        ("1", [1]),
        ("1,0", [1, 0]),
        ("GPU-bbbb2222-0000-0000-0000-000000000000", [1]),
        ("GPU-bbbb", [1]),  # a unique prefix is enough for CUDA
        ("GPU-aaaa1111-0000-0000-0000-000000000000,1", [0, 1]),
        ("0,7,1", [0]),  # CUDA stops at the first invalid entry
        ("-1", []),
        ("1,1", [1]),
        ("GPU-", []),  # ambiguous prefix
        ("garbage", []),
    ],
)
def test_visible_device_indices(cvd: str | None, indices: list[int]) -> None:
    env = {} if cvd is None else {"CUDA_VISIBLE_DEVICES": cvd}
    probe = GpuProbe(two_gpus())
    assert probe.visible_device_indices(env) == indices
    expected_auto = [f"cuda:{n}" for n in range(len(indices))] or ["cpu"]
    assert resolve_devices(["auto"], probe, env) == expected_auto


def test_visible_device_indices_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    probe = GpuProbe(two_gpus())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert probe.visible_device_indices() == [1]
    assert resolve_devices(["auto"], probe) == ["cuda:0"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert resolve_devices(["auto"], probe) == ["cpu"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert resolve_devices(["auto"], probe) == ["cuda:0", "cuda:1"]


def test_nvml_index_for() -> None:
    probe = GpuProbe(two_gpus())
    assert nvml_index_for("cpu", probe, NO_CVD) is None
    assert nvml_index_for("cuda", probe, NO_CVD) == 0
    assert nvml_index_for("cuda:1", probe, NO_CVD) == 1
    assert nvml_index_for("cuda:0", probe, {"CUDA_VISIBLE_DEVICES": "1"}) == 1
    uuid_env = {"CUDA_VISIBLE_DEVICES": "GPU-bbbb2222-0000-0000-0000-000000000000"}
    assert nvml_index_for("cuda:0", probe, uuid_env) == 1
    assert nvml_index_for("cuda:1", probe, uuid_env) is None
    unavailable = GpuProbe(FakeNvml(init_error=NVMLError_LibraryNotFound()))
    assert nvml_index_for("cuda:0", unavailable, NO_CVD) is None


UUID_0 = "GPU-aaaa1111-0000-0000-0000-000000000000"
UUID_1 = "GPU-bbbb2222-0000-0000-0000-000000000000"


def test_worker_env_for_passes_gpu_uuids() -> None:
    # A UUID names one GPU whatever CUDA's device order: no index to mistranslate.
    probe = GpuProbe(two_gpus())
    assert worker_env_for("cpu", probe, NO_CVD) == ({"CUDA_VISIBLE_DEVICES": ""}, "cpu")
    assert worker_env_for("cuda:1", probe, NO_CVD) == ({"CUDA_VISIBLE_DEVICES": UUID_1}, "cuda:0")
    # cuda:N counts in the parent's visible order, whatever CUDA_DEVICE_ORDER says.
    env = {"CUDA_VISIBLE_DEVICES": "1,0", "CUDA_DEVICE_ORDER": "FASTEST_FIRST"}
    assert worker_env_for("cuda:0", probe, env) == ({"CUDA_VISIBLE_DEVICES": UUID_1}, "cuda:0")
    assert worker_env_for("cuda:1", probe, env) == ({"CUDA_VISIBLE_DEVICES": UUID_0}, "cuda:0")
    assert worker_env_for("cuda", probe, {"CUDA_VISIBLE_DEVICES": "GPU-bbbb"}) == (
        {"CUDA_VISIBLE_DEVICES": UUID_1},
        "cuda:0",
    )
    uuid_env = {"CUDA_VISIBLE_DEVICES": UUID_1}
    assert worker_env_for("cuda", probe, uuid_env) == (uuid_env, "cuda:0")
    with pytest.raises(ValueError, match="'cuda:1'"):
        worker_env_for("cuda:1", probe, uuid_env)
    with pytest.raises(ValueError, match="'cuda:0'"):
        worker_env_for("cuda:0", probe, {"CUDA_VISIBLE_DEVICES": ""})


def test_worker_env_for_falls_back_to_the_index_when_the_uuid_cannot_be_read() -> None:
    nvml = two_gpus()

    def no_uuid(handle: Any) -> str:
        raise FakeNVMLError()

    nvml.nvmlDeviceGetUUID = no_uuid  # type: ignore[method-assign]
    probe = GpuProbe(nvml)
    assert worker_env_for("cuda:1", probe, NO_CVD) == (
        {"CUDA_VISIBLE_DEVICES": "1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"},
        "cuda:0",
    )


# -- MIG --------------------------------------------------------------------------------------

MIG_A = "MIG-11111111-0000-0000-0000-000000000000"
MIG_B = "MIG-22222222-0000-0000-0000-000000000000"


def mig_gpus() -> FakeNvml:
    """GPU 0 plain; GPU 1 in MIG mode with two instances."""
    return FakeNvml(
        [
            FakeGpu(uuid=UUID_0),
            FakeGpu(uuid=UUID_1, migs=[FakeMig(uuid=MIG_A), FakeMig(uuid=MIG_B)]),
        ]
    )


def test_mig_uuids_map_to_their_parent_gpu() -> None:
    probe = GpuProbe(mig_gpus())
    env = {"CUDA_VISIBLE_DEVICES": MIG_B}
    assert probe.visible_device_indices(env) == [1]
    assert nvml_index_for("cuda:0", probe, env) == 1
    assert resolve_devices(["auto"], probe, env) == ["cuda:0"]
    # The worker gets the MIG instance, never the whole parent GPU.
    assert worker_env_for("cuda:0", probe, env) == ({"CUDA_VISIBLE_DEVICES": MIG_B}, "cuda:0")
    both = {"CUDA_VISIBLE_DEVICES": f"{MIG_A},{UUID_0}"}
    assert probe.visible_device_indices(both) == [1, 0]


def test_unknown_mig_uuid_ends_the_visible_list() -> None:
    probe = GpuProbe(mig_gpus())
    env = {"CUDA_VISIBLE_DEVICES": f"{UUID_0},MIG-99999999-0000-0000-0000-000000000000,{MIG_A}"}
    assert probe.visible_device_indices(env) == [0]


def test_mig_parent_without_privileges_leaves_the_release_unverified() -> None:
    # NVML answers the parent's memory only to privileged callers under MIG: nothing to
    # compare with, so the check says "unavailable", which the smoke counts as a failure.
    nvml = mig_gpus()
    nvml.gpus[1].memory_error = NVMLError_NoPermission()
    probe = GpuProbe(nvml)
    assert probe.used_bytes(1) is None
    clock = FakeClock()
    report = probe.wait_released(1, 4242, None, timeout_s=5.0, clock=clock, sleep=clock.sleep)
    assert report.ok and report.method == "unavailable"


def test_worker_env_for_without_nvml() -> None:
    probe = GpuProbe(FakeNvml(init_error=NVMLError_LibraryNotFound()))
    assert worker_env_for("cuda:2", probe, NO_CVD) == (
        {"CUDA_VISIBLE_DEVICES": "2", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"},
        "cuda:0",
    )
    env = {"CUDA_VISIBLE_DEVICES": "GPU-x,GPU-y"}
    assert worker_env_for("cuda:1", probe, env) == ({"CUDA_VISIBLE_DEVICES": "GPU-y"}, "cuda:0")
    with pytest.raises(ValueError, match="'cuda:2'"):
        worker_env_for("cuda:2", probe, env)
    assert worker_env_for("cpu", probe, env) == ({"CUDA_VISIBLE_DEVICES": ""}, "cpu")


# ----------------------------------------------------------------------------- imports


def test_the_worker_reads_its_rss_without_importing_gpu_or_supervisor() -> None:
    code = (
        "import sys, modelpool.worker.process\n"
        "print(sorted(m for m in ('modelpool.supervisor.gpu', 'modelpool.supervisor.loop',"
        " 'pynvml')"
        " if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "[]"
