"""scripts/gpu-smoke without a GPU: its verdict, pre-flight and limits, against the fake NVML.

The smoke's real run needs a CUDA GPU; what decides its verdict is tested here,
and the wrapper itself is run on this machine, where it must stop at the
pre-flight with a clear verdict rather than crash.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from fake_nvml import GIB, MIB, FakeGpu, FakeNvml, NVMLError_NoPermission
from modelpool.supervisor.gpu import GpuProbe

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def _load_smoke() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_smoke", SCRIPTS / "gpu_smoke.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


smoke = _load_smoke()


def verdict(**overrides: object) -> list[str]:
    """The verdict of a GPU run that went well, with ``overrides`` applied."""
    values: dict[str, object] = {
        "on_gpu": True,
        "releases_ok": 1,
        "release_method": "pid",
        "baseline_mb": 1024.0,
        "after_mb": 1030.0,
        "tolerance_mb": 256.0,
    }
    values.update(overrides)
    failures: list[str] = smoke.verdict_failures(**values)
    return failures


# ----------------------------------------------------------------------------- verdict (point 3)


@pytest.mark.parametrize("method", ["pid", "delta"])
def test_a_verified_release_with_the_memory_back_is_ok(method: str) -> None:
    assert verdict(release_method=method) == []


def test_a_release_that_measured_nothing_fails_on_a_gpu() -> None:
    failures = verdict(release_method="unavailable")
    assert len(failures) == 1 and "not verified (method unavailable)" in failures[0]


@pytest.mark.parametrize(("before", "after"), [(None, 1024.0), (1024.0, None), (None, None)])
def test_memory_not_read_before_or_after_fails_on_a_gpu(
    before: float | None, after: float | None
) -> None:
    failures = verdict(baseline_mb=before, after_mb=after)
    assert len(failures) == 1 and "not read" in failures[0]


def test_memory_not_back_fails() -> None:
    assert verdict(after_mb=1024.0 + 300.0) == ["memory not back: 300 MiB above the baseline"]


def test_no_release_reported_fails() -> None:
    assert "did not report" in verdict(releases_ok=0, release_method=None)[0]


def test_a_cpu_run_has_no_gpu_memory_to_read() -> None:
    assert verdict(on_gpu=False, release_method="psutil", baseline_mb=None, after_mb=None) == []


def test_an_unreadable_mig_parent_fails_the_smoke_instead_of_passing() -> None:
    # Under MIG without privileges the parent's memory cannot be read: the pool's check
    # then reports "unavailable" with ok=True, which the smoke used to count as a pass.
    probe = GpuProbe(FakeNvml([FakeGpu(memory_error=NVMLError_NoPermission())]))
    baseline = smoke._used_mb(probe, 0)
    report = probe.wait_released(0, 4242, None, timeout_s=0.0)
    assert report.ok and report.method == "unavailable"
    failures = verdict(
        releases_ok=int(report.ok),
        release_method=report.method,
        baseline_mb=baseline,
        after_mb=smoke._used_mb(probe, 0),
    )
    assert len(failures) == 2


# ----------------------------------------------------------------------------- pre-flight (point 4)


def test_the_pool_start_up_bound_leaves_the_wrapper_time_for_a_verdict() -> None:
    wrapper = (SCRIPTS / "gpu-smoke").read_text()
    match = re.search(r"^LIMIT_S=(\d+)", wrapper, re.MULTILINE)
    assert match is not None
    assert '"$LIMIT_S" "$PYTHON"' in wrapper  # the limit the wrapper applies
    source = (SCRIPTS / "gpu_smoke.py").read_text()
    assert "startup_timeout_s=POOL_STARTUP_TIMEOUT_S" in source
    # The pre-flight's CUDA check and a hung start-up, plus a minute for the rest of the run.
    worst_until_start = smoke.CUDA_CHECK_TIMEOUT_S + smoke.POOL_STARTUP_TIMEOUT_S
    assert worst_until_start + 60 <= float(match.group(1))


def test_the_transformers_names_the_hf_backend_uses_are_listed_and_present() -> None:
    names = smoke.imported_names(smoke.hf_sources())
    assert {
        ("transformers", "AutoModelForCausalLM"),
        ("transformers", "AutoTokenizer"),
        ("transformers", "StoppingCriteria"),
        ("transformers", "StoppingCriteriaList"),
        ("transformers.generation.streamers", "BaseStreamer"),
        ("transformers", "PreTrainedTokenizerFast"),  # the tiny model's tokenizer class
    } <= set(names)
    assert smoke.missing_names(names) == []


def test_missing_transformers_names_are_reported() -> None:
    missing = smoke.missing_names(
        [("transformers", "NoSuchStreamer"), ("transformers.no_such_module", "X")]
    )
    assert len(missing) == 2
    assert missing[0].startswith("transformers.NoSuchStreamer")
    assert missing[1].startswith("transformers.no_such_module (ModuleNotFoundError")


def test_module_versions_report_a_missing_module_without_raising() -> None:
    versions, problems = smoke.module_versions(
        {"psutil": "psutil", "no_such_module_17": "no-such-dist"}
    )
    assert versions["psutil"]
    assert problems == [
        "import no_such_module_17 (no-such-dist) failed: "
        "ModuleNotFoundError: No module named 'no_such_module_17'"
    ]


def test_cuda_problems() -> None:
    cpu_torch = {"torch": "2.13.0+cpu", "cuda_build": None, "available": False}
    assert smoke.cuda_problems(cpu_torch) == [
        "torch 2.13.0+cpu sees no CUDA device (CUDA build: none, a CPU-only torch)"
    ]
    assert "hangs" in smoke.cuda_problems({"error": "no answer within 60 s (hangs?)"})[0]
    assert smoke.cuda_problems({"available": True, "computes": True}) == []


def test_pid_visibility_against_the_fake_nvml() -> None:
    gpu = FakeGpu(used=2 * GIB, compute={111: 500 * MIB, 222: None})
    probe = GpuProbe(FakeNvml([gpu]))
    listed = probe.process_memory(0)
    assert smoke.pid_visibility(listed, [111, 222]) == "yes: pid 111 (500 MiB), pid 222 (N/A)"
    assert smoke.pid_visibility(listed, [111, 333]).startswith("partly: pids [111]")
    gpu.compute = {9111: 500 * MIB}  # gVisor: the driver's PIDs, not the workers'
    assert smoke.pid_visibility(probe.process_memory(0), [111, 222]) == (
        "no: NVML lists 9111; none of the workers' pids [111, 222]"
    )
    gpu.compute = {}
    gpu.mps = {111: MIB, 222: MIB}  # MPS clients count
    assert smoke.pid_visibility(probe.process_memory(0), [111, 222]).startswith("yes")


@pytest.mark.slow
def test_the_wrapper_on_a_machine_without_a_gpu_ends_in_a_clear_verdict() -> None:
    if GpuProbe().available:
        pytest.skip("this machine has an NVIDIA driver")
    env = dict(os.environ, PYTHON=sys.executable)
    done = subprocess.run(
        [str(SCRIPTS / "gpu-smoke")], capture_output=True, text=True, timeout=240, env=env
    )
    assert "Traceback" not in done.stdout + done.stderr
    assert done.returncode == 2, done.stdout
    lines = done.stdout.strip().splitlines()
    assert all(line.startswith("gpu-smoke | ") for line in lines), done.stdout
    steps = {line.split("|")[1].strip(): line.split("|", 2)[2].strip() for line in lines}
    assert steps["interpreter"].startswith(sys.executable)
    for fact in ("import torch", "import transformers", "import psutil", "import pynvml"):
        assert steps[fact] not in ("", "MISSING"), fact
    assert steps["NVML"] == "NVML library not found (no NVIDIA driver)"
    assert "available" in steps["torch CUDA (child process)"]
    assert lines[-1] == (
        "gpu-smoke | verdict                              | "
        "FAIL (pre-flight: the smoke cannot run on this machine)"
    )


def test_the_smoke_backend_passes_ordinary_prompts_to_the_hf_handler() -> None:
    class Inner:
        def generate(self, call: object) -> str:
            return "from hf"

    class Call:
        prompt = "Hello"

    handler = smoke._SmokeHandler(Inner(), "cuda:0,cuda:1")
    assert handler.generate(Call()) == "from hf"
    assert handler._device == "cuda:0"  # a group's faults are staged on its first GPU
