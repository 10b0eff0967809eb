"""ModelRegistry's per-GPU budget, driven by real testing-backend workers and the fake NVML.

No GPU here: ``ModelRegistry(config, gpu_probe=GpuProbe(nvml=fake))`` gives every model's
pool, and the registry's own release checks, a scripted NVML that lists the test's worker
processes on "cuda:0" with the memory the test says (dropping a process once it is dead,
as a driver does, unless the test keeps it listed: memory a dead worker did not give back).

The docs, Many models: a budget that fits one model evicts the other before the load; a
model too big for the budget is refused naming both numbers; a GPU release NVML does not
confirm holds the next load back until it does.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from typing import Any

import psutil
import pytest

from fake_nvml import GIB, FakeGpu, FakeNvml
from helpers import make_config, slack, wait_until
from modelpool.shared.config import ModelSpec
from modelpool.shared.errors import MemoryNotReleased, ModelTooLarge
from modelpool.supervisor.gpu import GpuProbe
from modelpool.supervisor.registry import ModelRegistry, RegistryConfig

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux processes")

BUDGET = 4 * GIB
GPU = "cuda:0"


class WorkersNvml(FakeNvml):
    """One 16 GiB GPU on which every live child process of the test is listed, holding
    ``held[pid]`` bytes, or ``auto`` bytes (fixed at first sight) for one not yet held.
    A dead process is dropped unless it is in ``stuck`` (its memory not given back)."""

    def __init__(self) -> None:
        super().__init__([FakeGpu(total=16 * GIB, used=1 * GIB)])
        self.lock = threading.Lock()
        self.held: dict[int, int] = {}
        self.auto = 0
        self.stuck: set[int] = set()

    def _refresh(self) -> None:
        with self.lock:
            for child in psutil.Process().children(recursive=True):
                if child.pid not in self.held and self.auto:
                    self.held[child.pid] = self.auto
            for pid in list(self.held):
                if pid not in self.stuck and not _alive(pid):
                    del self.held[pid]
            gpu = self.gpus[0]
            gpu.compute = dict(self.held)
            gpu.used = 1 * GIB + sum(self.held.values())

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]:
        self._refresh()
        return super().nvmlDeviceGetComputeRunningProcesses(handle)

    def nvmlDeviceGetComputeRunningProcesses_v2(self, handle: Any) -> list[Any]:
        self._refresh()
        return super().nvmlDeviceGetComputeRunningProcesses_v2(handle)

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> Any:
        self._refresh()
        return super().nvmlDeviceGetMemoryInfo(handle, version)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def gpu_spec(name: str, **options: Any) -> ModelSpec:
    own = {k: options.pop(k) for k in ("load_timeout_s",) if k in options}
    pool = make_config(
        workers=1,
        devices=[GPU],
        gpu_sample_interval_s=0.05,
        gpu_release_timeout_s=0.3,
        backend_options=options,
    )
    return ModelSpec(name, pool, **own)


@pytest.fixture
def nvml() -> WorkersNvml:
    return WorkersNvml()


@pytest.fixture
def gpu_registry(nvml: WorkersNvml) -> Iterator[Any]:
    made: list[ModelRegistry] = []

    def build(*specs: ModelSpec, **config: Any) -> ModelRegistry:
        config.setdefault("gpu_memory_budget_bytes", BUDGET)
        registry = ModelRegistry(
            RegistryConfig(models=specs, **config), gpu_probe=GpuProbe(nvml=nvml)
        ).start()
        made.append(registry)
        return registry

    yield build
    for registry in made:
        registry.close(timeout=5.0)


def load_measured(registry: ModelRegistry, nvml: WorkersNvml, name: str, nbytes: int) -> None:
    """Load ``name`` with its workers holding ``nbytes`` on the GPU, measured by the registry."""
    nvml.auto = nbytes
    try:
        registry.acquire(name, deadline_s=slack(20)).release()
        wait_until(
            lambda: registry.model_stats(name).gpu_bytes.get(GPU) == nbytes,
            timeout=slack(5),
            message=f"{name}'s GPU memory measured",
        )
    finally:
        nvml.auto = 0


def test_a_gpu_budget_that_fits_one_model_evicts_the_other_before_the_load(
    gpu_registry: Any, nvml: WorkersNvml
) -> None:
    registry = gpu_registry(gpu_spec("a"), gpu_spec("b"))
    load_measured(registry, nvml, "a", 3 * GIB)
    load_measured(registry, nvml, "b", 3 * GIB)  # never measured: a is evicted first
    assert registry.model_stats("a").state == "unloaded"
    assert registry.model_stats("b").need_bytes is not None
    # Both measured now: 3 + 3 GiB do not fit 4, so b goes before a's workers start.
    nvml.auto = 3 * GIB
    registry.acquire("a", deadline_s=slack(20)).release()
    stats = registry.stats()
    assert stats.models["a"].state == "loaded" and stats.models["b"].state == "unloaded"
    assert stats.models["b"].evictions == 1 and stats.models["a"].evictions == 1
    assert stats.swaps == 2
    wait_until(
        lambda: registry.stats().gpu_bytes.get(GPU) == 3 * GIB,
        timeout=slack(5),
        message="a's GPU memory measured again",
    )
    assert registry.stats().peak_gpu_bytes[GPU] <= BUDGET


def test_a_model_too_large_for_the_gpu_budget_is_refused_naming_both_numbers(
    gpu_registry: Any, nvml: WorkersNvml
) -> None:
    registry = gpu_registry(gpu_spec("big"), gpu_spec("small"))
    nvml.auto = 5 * GIB
    # Refused when its load measures it, or (GPU memory is often taken after the load)
    # failed by the first sample that does, and closed: never evicted and reloaded.
    with contextlib.suppress(ModelTooLarge):
        registry.acquire("big", deadline_s=slack(20)).release()
    wait_until(
        lambda: registry.model_stats("big").state == "failed",
        timeout=slack(5),
        message="big refused",
    )
    with pytest.raises(ModelTooLarge) as refused:
        registry.acquire("big", deadline_s=slack(20))
    error = refused.value
    assert error.resource == GPU
    assert error.needed_bytes == 5 * GIB and error.budget_bytes == BUDGET
    assert str(5 * GIB) in str(error) and str(BUDGET) in str(error)
    assert registry.model_stats("big").loads <= 1 and registry.model_stats("big").evictions == 0
    wait_until(lambda: not registry.stats().gpu_bytes.get(GPU), message="big closed")
    nvml.auto = 0
    load_measured(registry, nvml, "small", 1 * GIB)
    assert registry.model_stats("small").state == "loaded"


def test_gpu_memory_nvml_still_lists_holds_back_the_next_load_until_it_is_freed(
    gpu_registry: Any, nvml: WorkersNvml
) -> None:
    registry = gpu_registry(gpu_spec("a"), gpu_spec("b", load_timeout_s=1.5), backoff_s=30.0)
    load_measured(registry, nvml, "a", 3 * GIB)
    pids = {w.pid for w in registry.model_stats("a", with_pool=True).pool.workers}  # type: ignore[union-attr]
    nvml.stuck |= {pid for pid in pids if pid is not None}  # dead, still listed: not released
    with pytest.raises(MemoryNotReleased) as refused:
        registry.acquire("b", deadline_s=slack(30))
    assert refused.value.held_by == ("a",) and GPU in refused.value.reason
    stats = registry.stats()
    assert stats.models["b"].state == "failed" and stats.models["b"].loads == 0
    assert stats.models["a"].gpu_bytes == {GPU: 3 * GIB}  # counted until it is back
    assert not any(m.state == "loading" for m in stats.models.values())
    nvml.stuck.clear()
    wait_until(
        lambda: registry.model_stats("b").state == "unloaded",
        timeout=slack(5),
        message="the GPU memory back",
    )
    registry.acquire("b", deadline_s=slack(20)).release()
    assert registry.model_stats("b").loads == 1
