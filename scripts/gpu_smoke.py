"""GPU smoke check: real NVML, a real kill of a CUDA worker, real memory release.

Run on a machine with a CUDA GPU (see scripts/gpu-smoke). It builds a tiny
model, starts a pool on the device (one worker and one spare), records the
NVML baseline, serves requests, then hangs one worker inside a long CUDA
computation that ignores the cancel flag and SIGTERM, lets the deadline kill
it, and prints per step the device's used memory and the release time the
pool measured. Exits non-zero when memory does not come back.

This file is also the backend the workers run (``gpu_smoke:load``): the hf
backend plus one prompt, ``cuda_hang``, that never returns.
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MIB = 1024 * 1024


class _HangingHandler:
    """Wraps the hf handler; the prompt "cuda_hang" spins on the GPU forever."""

    def __init__(self, inner: Any, device: str) -> None:
        self._inner = inner
        self._device = device

    def generate(self, call: Any) -> Any:
        if call.prompt != "cuda_hang":
            return self._inner.generate(call)
        import torch

        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        # About 2 GiB held while it spins, so the kill has something to give back.
        ballast = torch.empty(2 * 1024 * MIB, dtype=torch.uint8, device=self._device)
        matrix = torch.randn(4096, 4096, device=self._device)
        while True:
            matrix = matrix @ matrix
            matrix = matrix / matrix.norm()
            ballast[0] = 1


def load(model: str, device: str = "cpu", **options: Any) -> _HangingHandler:
    from modelpool.backends.hf import load as load_hf

    return _HangingHandler(load_hf(model, device, **options), device)


def _used_mb(probe: Any, index: int | None) -> float | None:
    if index is None:
        return None
    used = probe.used_bytes(index)
    return None if used is None else used / MIB


def _line(step: str, value: object) -> None:
    print(f"gpu-smoke | {step:<34} | {value}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--tolerance-mb", type=float, default=256.0)
    args = parser.parse_args(argv)

    from modelpool import DeadlineExceeded, ModelPool, PoolConfig, RetryPolicy
    from modelpool.gpu import GpuProbe, nvml_index_for
    from modelpool.tinymodel import build_tiny_model

    started = time.monotonic()
    probe = GpuProbe()
    on_gpu = args.device.startswith("cuda")
    if on_gpu and not probe.available:
        _line("FAIL", f"NVML unavailable: {probe.reason}")
        return 2
    index = nvml_index_for(args.device, probe) if on_gpu else None
    _line("device", f"{args.device} (NVML index {index}); {probe.devices() if on_gpu else 'cpu'}")

    model_dir = build_tiny_model(Path(tempfile.mkdtemp(prefix="gpu-smoke-")) / "tiny")
    baseline = _used_mb(probe, index)
    _line("1. used before the pool (MiB)", baseline)

    config = PoolConfig(
        model=str(model_dir),
        backend="gpu_smoke:load",
        workers=1,
        spares=1,
        devices=[args.device],
        deadline_s=30.0,
        attempt_timeout_s=5.0,
        cancel_grace_s=1.0,
        term_grace_s=1.0,
        retry=RetryPolicy(max_retries=0),
        gpu_release_timeout_s=30.0,
        gpu_sample_interval_s=0.5,
        generation_defaults={"max_new_tokens": 16},
    )
    failures: list[str] = []
    with ModelPool(config) as pool:
        _line("2. used with 2 workers loaded (MiB)", _used_mb(probe, index))
        result = pool.generate("Hello")
        _line("3. normal request", f"{result.latency_s * 1000:.1f} ms on pid {result.worker_pid}")
        time.sleep(1.0)  # let the sampler record per-worker memory once
        for worker in pool.stats().workers:
            _line(f"   worker pid {worker.pid}", f"gpu_mb={worker.gpu_mb} ({worker.gpu_mb_method})")

        hung_at = time.monotonic()
        try:
            pool.generate("cuda_hang", deadline_s=6.0)
            failures.append("the hanging request returned")
        except DeadlineExceeded as exc:
            hung_pid = exc.attempts[-1].worker_pid
            _line(
                "4. hang -> DeadlineExceeded",
                f"after {time.monotonic() - hung_at:.2f} s, pid {hung_pid}",
            )
        _line("   used right after the deadline", _used_mb(probe, index))

        wait_until = time.monotonic() + 60
        while time.monotonic() < wait_until and pool.stats().gpu.releases.checked < 1:
            time.sleep(0.05)
        releases = pool.stats().gpu.releases
        _line(
            "5. release check (pool)",
            f"ok={releases.ok} failed={releases.failed} "
            f"time={releases.last_ms} ms method={releases.last_method}",
        )
        if releases.ok < 1:
            failures.append(f"the pool did not verify the release: {releases}")
        _line("   used after the kill (MiB)", _used_mb(probe, index))
        served = pool.generate("Hello again")
        _line(
            "6. next request (spare)",
            f"{served.latency_s * 1000:.1f} ms on pid {served.worker_pid}",
        )
        counters = pool.stats().counters
        _line("   counters", {k: counters[k] for k in ("kills", "timeouts", "respawns")})

    after = _used_mb(probe, index)
    _line("7. used after close (MiB)", after)
    if (
        on_gpu
        and baseline is not None
        and after is not None
        and after - baseline > args.tolerance_mb
    ):
        failures.append(f"memory not back: {after - baseline:.0f} MiB above the baseline")
    _line("wall time (s)", f"{time.monotonic() - started:.1f}")
    for failure in failures:
        _line("FAIL", failure)
    _line("verdict", "FAIL" if failures else "OK")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
