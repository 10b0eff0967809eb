"""Each model's need kept across restarts, and estimated before it was ever measured.

The need measured for a model is saved by *identity*: its name and a digest of its
whole pool configuration (model, backend, workers, devices, options...), since any of
those changes what it takes. The file is a small JSON object::

    {"version": 1, "models": {"chat/3f2a...": {"name": "chat", "need": {"memory": 1253000000}}}}

written whole (to a temporary file, then renamed) after each load and unload, and read
when the registry starts: a restart plans its first loads from the needs the last run
measured instead of evicting everything. A file that cannot be read or written is
logged and ignored: the needs are then measured again, as on a first start.

A model never measured nor saved is *estimated* from its files: each worker holds the
weights' bytes (the model directory's weight files: ``WEIGHT_SUFFIXES``) times
``WEIGHTS_FACTOR``, plus its backend's runtime (``RUNTIME_BYTES``: an interpreter with
torch for ``hf``, the llama.cpp server for ``llama_cpp``). A model whose files are not
on disk (an ``embedded:`` or hub name, the testing backend's ``none``) has no estimate.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
import threading
from pathlib import Path

from modelpool.shared.config import ModelSpec
from modelpool.supervisor.registry.records import MEMORY

logger = logging.getLogger("modelpool.registry")

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".onnx", ".h5", ".ckpt")
WEIGHTS_FACTOR = 1.2
RUNTIME_BYTES = {"hf": 450 * 2**20, "llama_cpp": 64 * 2**20, "testing": 32 * 2**20}
DEFAULT_RUNTIME_BYTES = 256 * 2**20


def identity(spec: ModelSpec) -> str:
    """The key a model's need is saved under: its name and its pool configuration's digest."""
    settings = json.dumps(dataclasses.asdict(spec.pool), sort_keys=True, default=str)
    return f"{spec.name}/{hashlib.sha256(settings.encode()).hexdigest()[:16]}"


def estimate(spec: ModelSpec) -> dict[str, int] | None:
    """The host memory ``spec`` is estimated to need from its files (None: no files)."""
    path = Path(spec.pool.model).expanduser()
    try:
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        weights = sum(p.stat().st_size for p in files if p.suffix.lower() in WEIGHT_SUFFIXES)
    except OSError:
        return None
    if not weights:
        return None
    runtime = RUNTIME_BYTES.get(spec.pool.backend, DEFAULT_RUNTIME_BYTES)
    workers = spec.pool.workers * (int(weights * WEIGHTS_FACTOR) + runtime)
    return {MEMORY: workers + spec.pool.prefix_cache_host_bytes}


class NeedStore:
    """The needs file (``path`` None: nothing is kept)."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._lock = threading.Lock()

    def load(self) -> dict[str, dict[str, int]]:
        """The saved needs by identity ({} when there is no file or it cannot be read)."""
        if self.path is None or not os.path.exists(self.path):
            return {}
        try:
            with open(self.path, encoding="utf-8") as file:
                data = json.load(file)
            return {
                key: {str(r): int(v) for r, v in record["need"].items() if int(v) > 0}
                for key, record in data["models"].items()
            }
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            logger.warning("registry: the needs file %s was not read: %s", self.path, exc)
            return {}

    def save(self, spec: ModelSpec, need: dict[str, int]) -> None:
        """Keep ``need`` as ``spec``'s (off the registry's lock: this writes a file)."""
        if self.path is None:
            return
        with self._lock:
            try:
                models: dict[str, object] = {}
                if os.path.exists(self.path):
                    with open(self.path, encoding="utf-8") as file:
                        found = json.load(file).get("models")
                    models = found if isinstance(found, dict) else {}
                models[identity(spec)] = {"name": spec.name, "need": need}
                folder = os.path.dirname(os.path.abspath(self.path))
                os.makedirs(folder, exist_ok=True)
                with tempfile.NamedTemporaryFile(
                    "w", dir=folder, prefix=".needs-", delete=False, encoding="utf-8"
                ) as out:
                    json.dump({"version": 1, "models": models}, out, indent=1, sort_keys=True)
                os.replace(out.name, self.path)
            except (OSError, ValueError, AttributeError) as exc:
                logger.warning("registry: the needs file %s was not written: %s", self.path, exc)
