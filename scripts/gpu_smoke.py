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
1-7. A tiny model, a pool on the device with one worker and one spare (so
   two workers share the GPU, as in production), the NVML baseline, whether
   NVML lists the workers' PIDs, a normal request, then one worker hung
   inside a CUDA computation that ignores the cancel flag and SIGTERM; the
   deadline kills it, and the pool's release check must verify the memory
   came back by PID or by delta. Then a request on the spare, and the
   device's memory after close.

The verdict is OK only when, on a GPU, the release was verified ("pid" or
"delta": "unavailable" means nothing was measured) and the device's memory
was read before and after and is back within the tolerance. Exit codes: 0
OK, 1 the run failed, 2 the pre-flight failed (the smoke cannot run here).

This file is also the backend the workers run (``gpu_smoke:load``): the hf
backend plus one prompt, ``cuda_hang``, that never returns.
"""

from __future__ import annotations

import argparse
import ast
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
HF_MODULES = ("modelpool.backends.hf", "modelpool.tinymodel")

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
        from modelpool.gpu import GpuProbe, nvml_index_for
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
        from modelpool.gpu import GpuProbe, nvml_index_for
    except Exception as exc:
        problems.append(f"import modelpool.gpu failed: {type(exc).__name__}: {exc}")
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

    model_dir = build_tiny_model(Path(tempfile.mkdtemp(prefix="gpu-smoke-")) / "tiny")
    baseline = _used_mb(probe, index)
    _line("1. used before the pool (MiB)", baseline)

    config = PoolConfig(
        model=str(model_dir),
        backend="gpu_smoke:load",
        workers=1,
        spares=1,
        devices=(args.device,),
        deadline_s=30.0,
        attempt_timeout_s=5.0,
        cancel_grace_s=1.0,
        term_grace_s=1.0,
        startup_timeout_s=POOL_STARTUP_TIMEOUT_S,
        retry=RetryPolicy(max_retries=0),
        gpu_release_timeout_s=30.0,
        gpu_sample_interval_s=0.5,
        generation_defaults={"max_new_tokens": 16},
    )
    failures: list[str] = []
    releases_ok, release_method = 0, None
    try:
        with ModelPool(config) as pool:
            pids = [w.pid for w in pool.stats().workers if w.pid is not None]
            _line("2. used with 2 workers loaded (MiB)", _used_mb(probe, index))
            if index is not None:
                listed = probe.process_memory(index)
                _line("   NVML lists the workers' PIDs", pid_visibility(listed, pids))
            result = pool.generate("Hello")
            _line(
                "3. normal request", f"{result.latency_s * 1000:.1f} ms on pid {result.worker_pid}"
            )
            time.sleep(2 * config.gpu_sample_interval_s)  # let the sampler read each worker
            for worker in pool.stats().workers:
                _line(
                    f"   worker pid {worker.pid}",
                    f"gpu_mb={worker.gpu_mb} ({worker.gpu_mb_method})",
                )

            hung_at = time.monotonic()
            try:
                pool.generate("cuda_hang", deadline_s=6.0)
                failures.append("the hanging request returned")
            except DeadlineExceeded as exc:
                _line(
                    "4. hang -> DeadlineExceeded",
                    f"after {time.monotonic() - hung_at:.2f} s, pid {exc.attempts[-1].worker_pid}",
                )
            _line("   used right after the deadline", _used_mb(probe, index))

            wait_until = time.monotonic() + RELEASE_WAIT_S
            while time.monotonic() < wait_until and pool.stats().gpu.releases.checked < 1:
                time.sleep(0.05)
            releases = pool.stats().gpu.releases
            releases_ok, release_method = releases.ok, releases.last_method
            _line(
                "5. release check (pool)",
                f"ok={releases.ok} failed={releases.failed} method={releases.last_method} "
                f"time={releases.last_ms if releases.last_ms is None else round(releases.last_ms)}"
                " ms",
            )
            _line("   used after the kill (MiB)", _used_mb(probe, index))
            served = pool.generate("Hello again", deadline_s=120.0)
            _line(
                "6. next request (spare)",
                f"{served.latency_s * 1000:.1f} ms on pid {served.worker_pid}",
            )
            counters = pool.stats().counters
            _line("   counters", {k: counters[k] for k in ("kills", "timeouts", "respawns")})
    except PoolError as exc:
        failures.append(f"the pool failed: {type(exc).__name__}: {exc}")

    after = _used_mb(probe, index)
    _line("7. used after close (MiB)", after)
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
