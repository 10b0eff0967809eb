"""GPU smoke check: real NVML, a real kill of a CUDA worker, real memory release.

Run it through ``scripts/gpu-smoke`` on a machine with a CUDA GPU; every line
it prints starts with ``gpu-smoke |`` and the last one is the verdict, so its
output alone tells whether release verification works on that machine.

0. Pre-flight, recorded even when the run stops there: the interpreter, the
   versions of psutil, nvidia-ml-py, torch, transformers, tokenizers and
   safetensors, the transformers names the hf backend and the tiny model
   import (checked against the installed version), NVML and the driver, and
   in a child process whether torch reaches the device and whether NVML
   lists that process's own PID. Missing pieces end the run with exit 2.
1-6. A tiny model built from a config (random weights, bf16 on the GPU), a pool
   with two workers and a spare on the device (three processes share the GPU,
   as in production), the NVML baseline, whether NVML lists the workers' PIDs,
   requests served, then one worker hung inside a CUDA computation that ignores
   the cancel flag and SIGTERM; the deadline kills it, and the pool's release
   check must verify the memory came back by PID or by delta. Then a request on
   the spare.
7. A real CUDA out-of-memory (a request that asks for twice the device): it must
   be ``OutOfMemory`` (retried once on another worker), no worker recycled (each
   found its allocated memory back near its post-load baseline) and the device's
   used memory back within the tolerance.
8. A device-side assert (an out-of-bounds index on the GPU): ``CudaError``, the
   worker killed and replaced, its release checked, the next request elsewhere.
9. A worker's child in a session of its own keeps 1 GiB on the GPU and the worker
   is killed by its deadline: the GPU must be reported blocked with the child
   named; once the child is killed the pool refills the slot.
10. The device's memory after close, against the baseline of step 1.

The verdict is OK only when, on a GPU, the release was verified ("pid" or
"delta": "unavailable" means nothing was measured) and the device's memory
was read before and after and is back within the tolerance. Exit codes: 0
OK, 1 the run failed, 2 the pre-flight failed (the smoke cannot run here).

On a machine without a GPU, ``--device cpu`` runs steps 1-6 and 10. This file is
also the backend the workers run (``gpu_smoke:load``): the hf backend plus the
prompts of :class:`_SmokeHandler`.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

MIB = 1024 * 1024

POOL_STARTUP_TIMEOUT_S = 150.0
"""The pool's start-up bound: well under the wrapper's limit, so a hung CUDA start-up
still ends in a verdict (the pool raises ModelLoadFailed) rather than being killed."""
CUDA_CHECK_TIMEOUT_S = 60.0
RELEASE_WAIT_S = 60.0
GPU_RELEASE_TIMEOUT_S = 15.0
SAMPLE_INTERVAL_S = 0.5
SHOWN_COUNTERS = ("kills", "timeouts", "respawns", "recycled", "cuda_oom", "cuda_errors")
VERIFIED_METHODS = ("pid", "delta")

# import name -> distribution name, in the order they are checked
REQUIRED_MODULES = {
    "psutil": "psutil",
    "pynvml": "nvidia-ml-py",
    "torch": "torch",
    "transformers": "transformers",
    "tokenizers": "tokenizers",
    "safetensors": "safetensors",
}
# Modules whose ``from transformers... import name`` lines the run depends on.
HF_MODULES = (
    "modelpool.worker.backends.hf.handler",
    "modelpool.worker.backends.hf.generation",
    "modelpool.worker.backends.hf.runner",
    "modelpool.worker.backends.hf.packed",
    "modelpool.worker.backends.hf.padded",
    "modelpool.worker.backends.hf.pooling",
    "modelpool.worker.backends.hf.prefix_cache",
    "modelpool.tinymodel",
)

# Run in a child so that this process, the pool's supervisor, never creates a CUDA context.
CUDA_CHECK = r"""
import json, os, sys
facts = {}
try:
    import torch
    facts.update(torch=torch.__version__, cuda_build=torch.version.cuda,
                 available=torch.cuda.is_available())
    device = sys.argv[1]
    if facts["available"]:
        facts["device_count"] = torch.cuda.device_count()
        facts["name"] = torch.cuda.get_device_name(device)
        ones = torch.ones(1024, device=device)
        facts["computes"] = float(ones.sum().item()) == 1024.0
        from modelpool.supervisor.devices import nvml_index_for
        from modelpool.supervisor.gpu import GpuProbe
        with GpuProbe() as probe:
            index = nvml_index_for(device, probe)
            listed = probe.process_memory(index) if index is not None else {}
        facts["nvml_index"] = index
        facts["own_pid"] = os.getpid()
        facts["own_pid_listed"] = os.getpid() in listed
        facts["listed_pids"] = sorted(listed)
except Exception as exc:
    facts["error"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(facts))
"""


# A child the worker starts in a session of its own (so the pool's kill of the worker's
# process group misses it) that keeps a CUDA allocation: the held-memory case.
ORPHAN_CHILD = r"""
import sys, time, torch
held = torch.empty(1024 * 1024 * 1024, dtype=torch.uint8, device="cuda:0")
held.fill_(1)
torch.cuda.synchronize()
print("ready", flush=True)
time.sleep(float(sys.argv[1]))
"""


class _SmokeHandler:
    """Wraps the hf handler; a few prompts do what the smoke needs on the GPU itself:

    ``cuda_hang`` spins on the GPU forever, ignoring the cancel flag and SIGTERM;
    ``cuda_oom`` holds a working set, then asks for twice the device's memory (a real
    ``torch.OutOfMemoryError``); ``cuda_assert`` indexes out of bounds on the device (a
    device-side assert: the context is unusable afterwards); ``cuda_orphan:PATH``
    starts a child outside the worker's process group that holds 1 GiB, writes its
    pid to PATH, then hangs like ``cuda_hang``.
    """

    def __init__(self, inner: Any, device: str) -> None:
        self._inner = inner
        self._device = device.split(",")[0]

    def generate(self, call: Any) -> Any:
        command, _, argument = str(call.prompt).partition(":")
        if command not in ("cuda_hang", "cuda_oom", "cuda_assert", "cuda_orphan"):
            return self._inner.generate(call)
        import torch

        if command == "cuda_oom":
            working_set = torch.ones(256 * MIB, dtype=torch.uint8, device=self._device)
            total = torch.cuda.get_device_properties(self._device).total_memory
            oversized = torch.empty(2 * total, dtype=torch.uint8, device=self._device)
            return str(int(working_set.sum()) + oversized.numel())  # never reached
        if command == "cuda_assert":
            values = torch.zeros(4, device=self._device)
            index = torch.tensor([1 << 20], device=self._device)
            values[index] += 1  # out of bounds: a device-side assert
            torch.cuda.synchronize()
            return "the out-of-bounds index did not fail"
        if command == "cuda_orphan":
            child = subprocess.Popen(
                [sys.executable, "-c", ORPHAN_CHILD, "300"],
                start_new_session=True,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                text=True,
            )
            assert child.stdout is not None
            child.stdout.readline()  # "ready": its 1 GiB is allocated
            Path(argument).write_text(str(child.pid))
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        # About 2 GiB held while it spins, so the kill has something to give back.
        ballast = torch.empty(2 * 1024 * MIB, dtype=torch.uint8, device=self._device)
        matrix = torch.randn(4096, 4096, device=self._device)
        while True:
            matrix = matrix @ matrix
            matrix = matrix / matrix.norm()
            ballast[0] = 1


def load(model: str, device: str = "cpu", **options: Any) -> _SmokeHandler:
    from modelpool.worker.backends.hf import load as load_hf

    return _SmokeHandler(load_hf(model, device, **options), device)


def _line(step: str, value: object) -> None:
    print(f"gpu-smoke | {step:<36} | {value}", flush=True)


# ----------------------------------------------------------------------------- pre-flight


def module_versions(modules: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """Import each module; (import name -> version) of those that import, and one problem each
    for those that do not. ``modules`` maps import names to distribution names."""
    versions: dict[str, str] = {}
    problems: list[str] = []
    for name, distribution in modules.items():
        try:
            module = importlib.import_module(name)
        except Exception as exc:
            problems.append(f"import {name} ({distribution}) failed: {type(exc).__name__}: {exc}")
            continue
        try:
            versions[name] = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = str(getattr(module, "__version__", "unknown version"))
    return versions, problems


def imported_names(sources: Iterable[Path], package: str = "transformers") -> list[tuple[str, str]]:
    """(module, name) for every ``from <package>[.x] import name`` in the given source files."""
    found: set[tuple[str, str]] = set()
    for source in sources:
        tree = ast.parse(source.read_text(), str(source))
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or node.module is None:
                continue
            if node.module == package or node.module.startswith(package + "."):
                found.update((node.module, alias.name) for alias in node.names)
    return sorted(found)


def missing_names(names: Iterable[tuple[str, str]]) -> list[str]:
    """The ``module.name`` of each pair that the installed packages do not provide."""
    missing: list[str] = []
    for module_name, name in names:
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:
            missing.append(f"{module_name} ({type(exc).__name__}: {exc})")
            continue
        try:
            getattr(module, name)
        except Exception as exc:  # transformers resolves names lazily: any error means absent
            missing.append(f"{module_name}.{name} ({type(exc).__name__})")
    return missing


def hf_sources(modules: Sequence[str] = HF_MODULES) -> list[Path]:
    """The source files of ``modules``, found without importing them."""
    paths: list[Path] = []
    for name in modules:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            raise ModuleNotFoundError(f"cannot find the source of {name}")
        paths.append(Path(spec.origin))
    return paths


def cuda_facts(device: str, timeout_s: float = CUDA_CHECK_TIMEOUT_S) -> dict[str, Any]:
    """What a child interpreter sees of ``device`` through torch, and whether NVML lists it."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", CUDA_CHECK, device],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"no answer within {timeout_s:.0f} s (CUDA initialisation hangs?)"}
    lines = done.stdout.strip().splitlines()
    try:
        facts: dict[str, Any] = json.loads(lines[-1])
    except (IndexError, ValueError):
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return {"error": f"exit code {done.returncode}: {' / '.join(tail)}"}
    return facts


def cuda_problems(facts: Mapping[str, Any]) -> list[str]:
    if "error" in facts:
        return [f"torch cannot use the device: {facts['error']}"]
    if not facts.get("available"):
        return [
            f"torch {facts.get('torch')} sees no CUDA device "
            f"(CUDA build: {facts.get('cuda_build') or 'none, a CPU-only torch'})"
        ]
    if not facts.get("computes"):
        return ["a computation on the device gave a wrong result"]
    return []


def pid_visibility(listed: Mapping[int, int | None], pids: Sequence[int]) -> str:
    """Whether NVML's process list (pid -> used bytes) shows the given worker PIDs."""
    shown = [pid for pid in pids if pid in listed]

    def mib(value: int | None) -> str:
        return "N/A" if value is None else f"{value / MIB:.0f} MiB"

    if shown and len(shown) == len(pids):
        return "yes: " + ", ".join(f"pid {pid} ({mib(listed[pid])})" for pid in shown)
    others = ", ".join(str(pid) for pid in sorted(listed)) or "nothing"
    if shown:
        return f"partly: pids {shown} of {list(pids)} listed (NVML lists {others})"
    return f"no: NVML lists {others}; none of the workers' pids {list(pids)}"


# ----------------------------------------------------------------------------- verdict


def verdict_failures(
    *,
    on_gpu: bool,
    releases_ok: int,
    release_method: str | None,
    baseline_mb: float | None,
    after_mb: float | None,
    tolerance_mb: float,
) -> list[str]:
    """What keeps the run from an OK verdict, judged from what the pool and NVML reported."""
    failures: list[str] = []
    if releases_ok < 1:
        failures.append("the pool did not report the killed worker's memory released")
    elif on_gpu and release_method not in VERIFIED_METHODS:
        failures.append(
            f"the release was not verified (method {release_method}): nothing was measured"
        )
    if not on_gpu:
        return failures
    if baseline_mb is None or after_mb is None:
        failures.append(
            f"the device's used memory was not read (before: {baseline_mb}, after: {after_mb})"
        )
    elif after_mb - baseline_mb > tolerance_mb:
        failures.append(f"memory not back: {after_mb - baseline_mb:.0f} MiB above the baseline")
    return failures


# ----------------------------------------------------------------------------- the run


def _used_mb(probe: Any, index: int | None) -> float | None:
    if index is None:
        return None
    used = probe.used_bytes(index)
    return None if used is None else used / MIB


def preflight(args: argparse.Namespace) -> tuple[list[str], Any, int | None]:
    """Print the facts; returns (problems, the NVML probe or None, the device's NVML index)."""
    on_gpu = args.device.startswith("cuda")
    _line("python", f"{sys.executable} ({sys.version.split()[0]})")
    limits = f"pool start-up {POOL_STARTUP_TIMEOUT_S:.0f} s"
    if args.wrapper_timeout is not None:
        limits += f" < wrapper {args.wrapper_timeout:.0f} s"
    _line("limits", limits)
    versions, problems = module_versions(REQUIRED_MODULES)
    for name in REQUIRED_MODULES:
        _line(f"import {name}", versions.get(name, "MISSING"))
    if "transformers" in versions:
        try:
            names = imported_names(hf_sources())
        except (OSError, SyntaxError, ModuleNotFoundError) as exc:
            problems.append(f"cannot list the transformers names the hf backend uses: {exc}")
        else:
            missing = missing_names(names)
            _line(
                "transformers names used",
                f"{len(names) - len(missing)}/{len(names)} present"
                + (f"; MISSING {', '.join(missing)}" if missing else ""),
            )
            problems.extend(f"transformers lacks {name}" for name in missing)
    probe: Any = None
    index: int | None = None
    try:
        from modelpool.supervisor.devices import nvml_index_for
        from modelpool.supervisor.gpu import GpuProbe
    except Exception as exc:
        problems.append(f"import modelpool.supervisor.gpu failed: {type(exc).__name__}: {exc}")
        return problems, probe, index
    probe = GpuProbe()
    _line("NVML", probe.reason)
    _line("driver", probe.driver_version() or "unknown")
    _line("devices", probe.devices() or "none")
    _line("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES", "(unset)"))
    if not on_gpu:
        return problems, probe, index
    if not probe.available:
        problems.append(f"NVML unavailable: {probe.reason}")
    else:
        index = nvml_index_for(args.device, probe)
        if index is None:
            problems.append(f"{args.device} is not a device NVML can see")
    if "torch" in versions:
        facts = cuda_facts(args.device)
        _line("torch CUDA (child process)", facts)
        if "own_pid_listed" in facts:
            _line(
                "NVML lists a CUDA process's PID",
                "yes" if facts["own_pid_listed"] else f"no (lists {facts.get('listed_pids')})",
            )
        problems.extend(cuda_problems(facts))
    return problems, probe, index


def run(args: argparse.Namespace) -> int:
    problems, probe, index = preflight(args)
    try:
        return _run_pool(args, problems, probe, index)
    finally:
        if probe is not None:
            probe.close()


def _run_pool(args: argparse.Namespace, problems: list[str], probe: Any, index: int | None) -> int:
    started = time.monotonic()
    on_gpu = args.device.startswith("cuda")
    if problems:
        for problem in problems:
            _line("FAIL", problem)
        _line("verdict", "FAIL (pre-flight: the smoke cannot run on this machine)")
        return 2

    from modelpool import DeadlineExceeded, ModelPool, PoolConfig, PoolError, RetryPolicy
    from modelpool.tinymodel import build_tiny_model

    # Built from a config with random weights: nothing is downloaded.
    model_dir = build_tiny_model(Path(tempfile.mkdtemp(prefix="gpu-smoke-")) / "tiny")
    baseline = _used_mb(probe, index)
    _line("1. used before the pool (MiB)", baseline)

    config = PoolConfig(
        model=str(model_dir),
        backend="gpu_smoke:load",
        backend_options={"dtype": "bfloat16"} if on_gpu else {},
        workers=2,
        spares=1,
        devices=(args.device,),
        deadline_s=30.0,
        attempt_timeout_s=5.0,
        cancel_grace_s=1.0,
        term_grace_s=1.0,
        startup_timeout_s=POOL_STARTUP_TIMEOUT_S,
        retry=RetryPolicy(max_retries=1, on=(), oom_retries=1),  # only an OOM is retried
        gpu_release_timeout_s=GPU_RELEASE_TIMEOUT_S,
        gpu_sample_interval_s=SAMPLE_INTERVAL_S,
        generation_defaults={"max_new_tokens": 16},
    )
    failures: list[str] = []
    releases_ok, release_method = 0, None
    try:
        with ModelPool(config) as pool:
            pids = [w.pid for w in pool.stats().workers if w.pid is not None]
            _line("2. used with 3 workers loaded (MiB)", _used_mb(probe, index))
            if index is not None:
                listed = probe.process_memory(index)
                _line("   NVML lists the workers' PIDs", pid_visibility(listed, pids))
            futures = [pool.submit(f"Hello {n}") for n in range(4)]
            served = [future.result() for future in futures]
            _line(
                "3. requests served",
                ", ".join(f"{r.latency_s * 1000:.0f} ms on pid {r.worker_pid}" for r in served),
            )
            time.sleep(2 * SAMPLE_INTERVAL_S)  # let the sampler read each worker
            for worker in pool.stats().workers:
                _line(
                    f"   worker pid {worker.pid} ({worker.role})",
                    f"gpu_mb={worker.gpu_mb} ({worker.gpu_mb_method})",
                )

            hung_at = time.monotonic()
            try:
                pool.generate("cuda_hang", deadline_s=6.0)
                failures.append("4. the hanging request returned")
            except DeadlineExceeded as exc:
                _line(
                    "4. hang -> DeadlineExceeded",
                    f"after {time.monotonic() - hung_at:.2f} s, pid {exc.attempts[-1].worker_pid}",
                )
            _line("   used right after the deadline", _used_mb(probe, index))

            releases = _wait_releases(pool, 1)
            releases_ok, release_method = releases.ok, releases.last_method
            _line("5. release check (pool)", _describe_releases(releases))
            _line("   used after the kill (MiB)", _used_mb(probe, index))
            again = pool.generate("Hello again", deadline_s=120.0)
            _line(
                "6. next request (a spare)",
                f"{again.latency_s * 1000:.1f} ms on pid {again.worker_pid}",
            )
            if on_gpu:
                failures += _out_of_memory_step(pool, probe, index, args.tolerance_mb)
                failures += _sticky_error_step(pool)
                failures += _held_memory_step(pool)
            else:
                _line("7-9. CUDA faults", "skipped: a cpu run has no CUDA to fault")
            counters = pool.stats().counters
            _line("   counters", {key: counters[key] for key in SHOWN_COUNTERS})
    except PoolError as exc:
        failures.append(f"the pool failed: {type(exc).__name__}: {exc}")

    after = _used_mb(probe, index)
    _line("10. used after close (MiB)", after)
    failures += verdict_failures(
        on_gpu=on_gpu,
        releases_ok=releases_ok,
        release_method=release_method,
        baseline_mb=baseline,
        after_mb=after,
        tolerance_mb=args.tolerance_mb,
    )
    _line("wall time (s)", f"{time.monotonic() - started:.1f}")
    for failure in failures:
        _line("FAIL", failure)
    if failures:
        _line("verdict", "FAIL")
        return 1
    _line("verdict", f"OK: release verified by {release_method}" if on_gpu else "OK (cpu run)")
    return 0


def _describe_releases(releases: Any) -> str:
    ms = None if releases.last_ms is None else round(releases.last_ms)
    return (
        f"checked={releases.checked} ok={releases.ok} failed={releases.failed} "
        f"method={releases.last_method} time={ms} ms"
    )


def _wait_releases(pool: Any, checked: int, timeout_s: float = RELEASE_WAIT_S) -> Any:
    """The pool's release stats once ``checked`` checks are done (or the timeout passed)."""
    until = time.monotonic() + timeout_s
    while time.monotonic() < until and pool.stats().gpu.releases.checked < checked:
        time.sleep(0.05)
    return pool.stats().gpu.releases


def _wait_state(pool: Any, state: str, timeout_s: float) -> float | None:
    """Seconds until the pool's state is ``state`` with every slot filled, None on timeout."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        snapshot = pool.stats()
        ready = [w for w in snapshot.workers if w.state in ("idle", "spare", "busy")]
        if snapshot.state == state and len(ready) == len(snapshot.workers) == 3:
            return time.monotonic() - started
        time.sleep(0.05)
    return None


def _out_of_memory_step(pool: Any, probe: Any, index: int | None, tolerance_mb: float) -> list[str]:
    """A real CUDA OOM: typed, retried once elsewhere, and each worker's memory back after it."""
    from modelpool import OutOfMemory, PoolError

    before = pool.stats()
    used_before = _used_mb(probe, index)
    try:
        pool.generate("cuda_oom", deadline_s=60.0)
        return ["7. the oversized request did not run out of memory"]
    except OutOfMemory as exc:
        attempts = [(a.worker_pid, a.outcome) for a in exc.attempts]
        _line(
            "7. CUDA OOM -> OutOfMemory",
            f"device={exc.device} bytes_requested={exc.bytes_requested} attempts={attempts}",
        )
    except PoolError as exc:
        return [f"7. the OOM was {type(exc).__name__}, not OutOfMemory: {exc}"]
    time.sleep(2 * SAMPLE_INTERVAL_S)
    used_after = _used_mb(probe, index)
    after = pool.stats()
    _line("   used before -> after the OOM (MiB)", f"{used_before} -> {used_after}")
    for worker in after.workers:
        _line(f"   worker pid {worker.pid}", f"gpu_mb={worker.gpu_mb} ({worker.gpu_mb_method})")
    failures: list[str] = []
    if after.counters["recycled"] != before.counters["recycled"]:
        failures.append(
            "7. a worker's allocated memory was not back near its post-load baseline after "
            "the OOM (it was recycled)"
        )
    if used_before is None or used_after is None:
        failures.append("7. the device's used memory was not read around the OOM")
    elif used_after - used_before > tolerance_mb:
        failures.append(f"7. {used_after - used_before:.0f} MiB more in use after the OOM")
    return failures


def _sticky_error_step(pool: Any) -> list[str]:
    """A device-side assert: typed, the worker killed and replaced, its release checked."""
    from modelpool import CudaError, PoolError

    before = pool.stats()
    try:
        pool.generate("cuda_assert", deadline_s=60.0)
        return ["8. the out-of-bounds index on the device did not fail"]
    except CudaError as exc:
        poisoned = exc.attempts[-1].worker_pid
        _line("8. device-side assert -> CudaError", f"pid {poisoned}: {exc.message[:120]}")
    except PoolError as exc:
        return [f"8. the device-side assert was {type(exc).__name__}, not CudaError: {exc}"]
    releases = _wait_releases(pool, before.gpu.releases.checked + 1)
    _line("   release check of the killed worker", _describe_releases(releases))
    refilled = _wait_state(pool, "ready", POOL_STARTUP_TIMEOUT_S)
    _line("   replaced, pool ready again after (s)", refilled)
    failures: list[str] = []
    if refilled is None:
        failures.append("8. the worker with the broken CUDA context was not replaced")
    if releases.failed != before.gpu.releases.failed:
        failures.append("8. the killed worker's memory was not released")
    served = pool.generate("Hello after the assert", deadline_s=60.0)
    _line("   next request", f"on pid {served.worker_pid}")
    if served.worker_pid == poisoned or poisoned in [w.pid for w in pool.stats().workers]:
        failures.append("8. the worker with the broken CUDA context is still serving")
    return failures


def _held_memory_step(pool: Any) -> list[str]:
    """A child of a worker, outside its process group, keeps 1 GiB: the GPU is blocked and the
    child named; once it is gone the pool refills the slot."""
    from modelpool import DeadlineExceeded

    pid_file = Path(tempfile.mkdtemp(prefix="gpu-smoke-orphan-")) / "child.pid"
    before = pool.stats()
    child: int | None = None
    failures: list[str] = []
    try:
        try:
            pool.generate(f"cuda_orphan:{pid_file}", deadline_s=8.0)
            failures.append("9. the request that leaves a child behind returned")
        except DeadlineExceeded:
            pass
        child = int(pid_file.read_text()) if pid_file.exists() else None
        releases = _wait_releases(pool, before.gpu.releases.checked + 1)
        gpu = pool.stats().gpu
        _line(
            "9. held by a child -> blocked",
            f"state={pool.stats().state} {_describe_releases(releases)}",
        )
        _line("   blocked GPUs (held MiB)", gpu.blocked_held_mb or "none")
        for device, lines in gpu.blocked_holders.items():
            for line in lines:
                _line(f"   holder on {device}", line)
        named = any(
            f"pid {child} " in line for lines in gpu.blocked_holders.values() for line in lines
        )
        if child is None:
            failures.append("9. the worker did not start its child")
        elif not named:
            failures.append(
                f"9. the child pid {child} holding GPU memory was not named as blocking"
            )
    finally:
        if child is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
    refilled = _wait_state(pool, "ready", RELEASE_WAIT_S + POOL_STARTUP_TIMEOUT_S / 2)
    _line("   child killed -> pool ready again after (s)", refilled)
    if refilled is None:
        failures.append("9. the pool did not refill the slot once the child's memory was freed")
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--tolerance-mb", type=float, default=256.0)
    parser.add_argument(
        "--wrapper-timeout", type=float, default=None, help="the wrapper's limit, for the record"
    )
    args = parser.parse_args(argv)
    # The tiny model is built here: nothing to download, and no progress bars in the record.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    # The probe's fallbacks (memory-info version, process-list version) log at debug.
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stdout,
        format="gpu-smoke | log %(name)-32s | %(levelname)s %(message)s",
    )
    logging.getLogger("modelpool.gpu").setLevel(logging.DEBUG)
    try:
        return run(args)
    except Exception as exc:
        traceback.print_exc(file=sys.stdout)
        _line("FAIL", f"the smoke itself failed: {type(exc).__name__}: {exc}")
        _line("verdict", "FAIL")
        return 1


if __name__ == "__main__":
    sys.exit(main())
