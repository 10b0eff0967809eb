"""The first-decode probe: one token of a model decoded in a child process, once per
llama.cpp build, CPU and model file, so that a build using CPU instructions this machine
does not run is named at load instead of killing every worker on its first decode.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from modelpool.worker.backends.llama_cpp.options import (
    BackendUnavailable,
    Options,
    Placement,
    import_llama_cpp,
    threads,
)
from modelpool.worker.backends.llama_cpp.runtime import Runtime

PROBE_DIR = "llama_cpp"
"""Where, under ``$MODELPOOL_HOME``, the outcomes are remembered."""
_PROBE_CODE = (
    "import sys; from modelpool.worker.backends.llama_cpp.probe import probe_decode; "
    "probe_decode(sys.argv[1], int(sys.argv[2]))"
)
_PROBE_TIMEOUT_S = 300.0


def probe_once(path: Path, layout: Placement) -> None:
    """Decode one token of ``path`` in a child process, once per build, CPU and model file,
    and raise :class:`BackendUnavailable` naming the signal if that child dies of it."""
    from modelpool.shared.embedded import modelpool_home

    stamp = modelpool_home() / PROBE_DIR / f"probe-ok-{_probe_key(path, layout)}"
    if stamp.is_file():
        return
    env = dict(os.environ)
    source_root = str(Path(__file__).resolve().parents[3])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [source_root, env.get("PYTHONPATH")]))
    started = time.monotonic()
    try:
        result = subprocess.run(
            [sys.executable, "-c", _PROBE_CODE, str(path), str(layout.n_gpu_layers)],
            capture_output=True,
            text=True,
            env=env,
            timeout=_PROBE_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise BackendUnavailable(
            f"llama.cpp did not decode one token of {path.name} within {_PROBE_TIMEOUT_S:.0f} s "
            "in a test process"
        ) from exc
    if result.returncode < 0:
        name = signal.Signals(-result.returncode).name
        raise BackendUnavailable(
            f"llama.cpp died of {name} decoding one token of {path.name} in a test process: "
            "this llama-cpp-python build likely uses CPU instructions this machine (or its "
            "sandbox) does not run; rebuild it with the portable flags of scripts/build-llama-cpp "
            "(docs/backends.md: The llama_cpp backend). Its last output: "
            f"{_last_line(result.stderr)}"
        )
    if result.returncode != 0:
        raise BackendUnavailable(
            f"llama.cpp could not decode one token of {path.name} in a test process "
            f"(exit {result.returncode}): {_last_line(result.stderr)}"
        )
    stamp.parent.mkdir(parents=True, exist_ok=True)
    stamp.write_text(f"decoded one token in {time.monotonic() - started:.2f} s\n")


def probe_decode(path: str, n_gpu_layers: int) -> None:
    """The probe child: load ``path`` and decode one token (exits by a signal if it cannot)."""
    llama = import_llama_cpp()
    layout = Placement(n_gpu_layers, 0, "none", ())
    settings = Options(
        threads=threads(None),
        chat_template=None,
        max_model_len=64,
        kv_cache_tokens=64,
        prefill_chunk_tokens=8,
        max_sequences=1,
        use_mmap=True,
        prefix_cache_tokens=0,
    )
    runtime = Runtime.open(llama, Path(path), layout, settings)
    code = runtime.decode([max(0, int(llama.llama_vocab_bos(runtime.vocab)))], [0], [0], [True])
    if code != 0:
        raise SystemExit(f"llama_decode returned {code}")
    float(runtime.logits(0).sum())


def _probe_key(path: Path, layout: Placement) -> str:
    """What the probe's outcome depends on: the llama.cpp build, the CPU, the model file."""
    import importlib.util

    digest = hashlib.sha256()
    spec = importlib.util.find_spec("llama_cpp")
    if spec is not None and spec.origin is not None:
        package = Path(spec.origin).parent
        for library in sorted(package.rglob("*.so*")):
            stat = library.stat()
            digest.update(f"{library}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    try:
        cpu = Path("/proc/cpuinfo").read_text()
        digest.update(
            next((line for line in cpu.splitlines() if line.startswith("flags")), "").encode()
        )
    except OSError:
        digest.update(os.uname().machine.encode())
    stat = path.stat()
    digest.update(
        f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{layout.n_gpu_layers}".encode()
    )
    return digest.hexdigest()[:24]


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(nothing)"
