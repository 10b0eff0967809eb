"""CUDA faults rehearsed without a GPU: the testing backend raises what torch raises.

``cuda_oom:BYTES[:MB]`` is an out-of-memory (MB simulated megabytes left allocated),
``cuda_sticky`` an illegal memory access after which the worker's "context" stays
broken, ``cuda_error:MSG`` a CUDA error that leaves the device usable. Real workers,
a real pool; the worker-side recovery (cache emptied, memory against the post-load
baseline) runs as it would on a GPU, through the backend's hooks.
"""

from __future__ import annotations

import sys

import pytest

from helpers import counters, open_pool, wait_counters, wait_idle, wait_until
from modelpool import BackendError, CudaError, OutOfMemory, RetryPolicy

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux processes")

GIB = 2**30


def test_out_of_memory_is_typed_retried_once_and_the_cache_is_emptied() -> None:
    with open_pool(workers=2) as pool:
        pids = {w.pid for w in wait_idle(pool, 2)}
        with pytest.raises(OutOfMemory) as caught:
            pool.generate(f"cuda_oom:{GIB}")
        error = caught.value
        assert isinstance(error, BackendError)
        assert error.bytes_requested == GIB
        assert error.device == "cuda:0"
        # Retried once on the other worker (retry.oom_retries = 1), not max_retries times.
        assert [a.outcome for a in error.attempts] == ["oom", "oom"]
        assert {a.worker_pid for a in error.attempts} == pids
        assert "CUDA out of memory" in error.message
        # Memory came back to the baseline: both workers stay, and each emptied its cache.
        assert {w.pid for w in wait_idle(pool, 2)} == pids
        snapshot = counters(pool)
        assert (snapshot["cuda_oom"], snapshot["recycled"], snapshot["kills"]) == (2, 0, 0)
        allocated, releases = pool.generate("device_memory").text.split("/")
        assert int(releases) == 1 and int(allocated) == 100 * 2**20


def test_out_of_memory_retries_can_be_turned_off() -> None:
    with open_pool(workers=2, retry=RetryPolicy(max_retries=2, oom_retries=0)) as pool:
        with pytest.raises(OutOfMemory) as caught:
            pool.generate("cuda_oom:4096")
        assert [a.outcome for a in caught.value.attempts] == ["oom"]


def test_memory_not_back_to_baseline_after_an_oom_recycles_the_worker() -> None:
    with open_pool(workers=1) as pool:
        (before,) = wait_idle(pool, 1)
        with pytest.raises(OutOfMemory):
            pool.generate("cuda_oom:4096:300")  # 300 MiB stay allocated
        wait_counters(pool, recycled=1, respawns=1)
        (after,) = wait_idle(pool, 1)
        assert after.pid != before.pid
        assert pool.generate("echo:fresh").text == "fresh"


def test_a_sticky_cuda_error_replaces_the_worker_and_it_is_never_used_again() -> None:
    with open_pool(workers=2) as pool:
        wait_idle(pool, 2)
        with pytest.raises(CudaError) as caught:
            pool.generate("cuda_sticky")
        error = caught.value
        assert "illegal memory access" in error.message
        assert [a.outcome for a in error.attempts] == ["cuda_error"]  # not retried by default
        poisoned = error.attempts[0].worker_pid
        # Every later request succeeds: none reached the poisoned worker, which would
        # have failed it with the same error.
        futures = [pool.submit(f"echo:{n}") for n in range(20)]
        assert [f.result(timeout=10).text for f in futures] == [str(n) for n in range(20)]
        assert all(f.result().worker_pid != poisoned for f in futures)
        wait_counters(pool, cuda_errors=1, kills=1, respawns=1)
        assert pool.stats().kill_reasons == {"cuda_error": 1}
        # Its release was checked as for any kill before the slot was refilled.
        wait_until(lambda: pool.stats().gpu.releases.checked >= 1, message="release check")
        assert poisoned not in {w.pid for w in wait_idle(pool, 2)}


def test_a_sticky_cuda_error_is_retried_only_when_asked() -> None:
    policy = RetryPolicy(max_retries=2, on=("timeout", "crash", "cuda_error"))
    with open_pool(workers=2, retry=policy) as pool:
        wait_idle(pool, 2)
        with pytest.raises(CudaError) as caught:
            pool.generate("cuda_sticky")  # poisons every worker it reaches
        outcomes = [a.outcome for a in caught.value.attempts]
        assert outcomes == ["cuda_error"] * 3
        wait_counters(pool, cuda_errors=3)
        wait_idle(pool, 2)
        assert pool.generate("echo:ok").text == "ok"


def test_a_cuda_error_that_leaves_the_device_usable_is_an_ordinary_backend_error() -> None:
    with open_pool(workers=1) as pool:
        (worker,) = wait_idle(pool, 1)
        with pytest.raises(BackendError) as caught:
            pool.generate("cuda_error:invalid argument")
        assert type(caught.value) is BackendError
        assert [a.outcome for a in caught.value.attempts] == ["error"]
        assert pool.generate("pid").text == str(worker.pid)
        assert counters(pool)["cuda_errors"] == 0
