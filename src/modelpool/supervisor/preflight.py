"""What ``ModelPool.start()`` checks once, in the supervisor, before it spawns a worker.

A mistake found by the workers costs a model load per worker, times the start-up
retries (``startup_failures_before_giving_up``), and ends in the last worker's
traceback: a hub id without a network took 100 s and 178 log lines, a directory
without a tokenizer 14.5 s and a message about sentencepiece, ``cuda:0`` on a
machine without a GPU three worker starts and "Torch not compiled with CUDA
enabled". Found here, each is one line, in well under a second, that names the
problem and what to change::

    devices = check_devices(config, probe)        # DeviceError (a ValueError)
    worker_environ = check_model_source(config.model, config.backend, config.backend_options)
                                                  # ModelSourceError (a ModelLoadFailed)

Only what is certain is refused: the model checks apply to the ``hf`` backend
(another backend gives ``model`` its own meaning), and a hub model is downloaded
here once, so that the workers load it from the cache with ``HF_HUB_OFFLINE=1``
and never reach the network, each on its own and each with its own retries.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from modelpool.shared.config import PoolConfig
from modelpool.shared.errors import DeviceError, ModelSourceError
from modelpool.supervisor import gpu
from modelpool.supervisor.devices import group_devices, resolve_worker_devices
from modelpool.worker.backends import resolve_backend

HF_BACKEND = "modelpool.worker.backends.hf:load"
HUB_OFFLINE_ENV = "HF_HUB_OFFLINE"

# Any one of these is a tokenizer transformers can load without converting another
# format (the conversion is what asks for sentencepiece or tiktoken).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "vocab.json",
    "vocab.txt",
    "tekken.json",
)
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "model.safetensors.index.json")
# What a worker reads from a hub repository: everything but other formats' weights
# (ONNX, GGUF, TensorFlow, Flax), which would multiply the download.
HUB_TEXT_PATTERNS = ("*.json", "*.jinja", "*.model", "*.txt", "*.tiktoken", "*.py")


# ---- devices -------------------------------------------------------------------------------


def check_devices(
    config: PoolConfig, probe: gpu.GpuProbe, environ: Mapping[str, str] | None = None
) -> list[str]:
    """Each slot's device label; ``DeviceError`` for GPUs this machine cannot give."""
    try:
        devices = resolve_worker_devices(
            config.devices,
            probe,
            environ,
            gpus_per_worker=config.gpus_per_worker,
            slots=config.workers + config.spares,
        )
    except ValueError as exc:
        raise DeviceError(str(exc)) from None
    gpus = sorted({d for label in devices for d in group_devices(label) if d != "cpu"})
    if gpus and resolve_backend(config.backend) == HF_BACKEND:
        build = _torch_version()
        if build is not None and build.endswith("+cpu"):
            raise DeviceError(
                f"devices: {', '.join(gpus)} but torch {build} is the CPU-only build: "
                'install a CUDA build of torch, or set devices = ["cpu"]'
            )
    return devices


def _torch_version() -> str | None:
    """The installed torch's version string, read from its metadata (importing torch takes
    seconds); None when it is not installed, which the workers then say themselves."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


# ---- the model -----------------------------------------------------------------------------


def check_model_source(model: str, backend: str, options: Mapping[str, Any]) -> dict[str, str]:
    """Check (and for a hub id, fetch) ``model`` for the ``hf`` backend; the environment the
    workers need to load it. ``ModelSourceError`` when it cannot be loaded."""
    if resolve_backend(backend) != HF_BACKEND:
        return {}
    gguf_file = options.get("gguf_file")
    path = Path(os.path.expanduser(model))
    if path.is_dir():
        check_model_dir(path, model, gguf_file if isinstance(gguf_file, str) else None)
        return {}
    if path.exists():
        raise ModelSourceError(
            f"model {model!r} is a file: give the directory that holds it "
            "(and backend_options.gguf_file = the file's name, for a GGUF file)"
        )
    if _looks_like_a_path(model) or _is_not_a_repo_id(model):
        raise ModelSourceError(
            f"model directory {model!r} does not exist (current directory {os.getcwd()})"
        )
    fetch_from_hub(model, gguf_file if isinstance(gguf_file, str) else None)
    # Cached now: the workers load from the cache and never reach the network.
    return {HUB_OFFLINE_ENV: "1"}


def _looks_like_a_path(model: str) -> bool:
    """As the hf backend tells a path from a hub id (``hf._looks_like_a_path``)."""
    return model.startswith(("/", "./", "../", "~"))


def _is_not_a_repo_id(model: str) -> bool:
    """A hub id is ``name`` or ``owner/name``; more slashes can only be a path."""
    return model.count("/") > 1 or model.endswith("/")


def check_model_dir(path: Path, model: str, gguf_file: str | None) -> None:
    """A directory must hold a config, a tokenizer and weights (or the GGUF file named)."""
    if gguf_file is not None:
        if not (path / gguf_file).is_file():
            raise ModelSourceError(
                f"model directory {model!r} has no file {gguf_file!r} "
                "(backend_options.gguf_file names a file inside it)"
            )
        return
    missing = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    if not _has_tokenizer(path):
        missing.append(f"tokenizer ({' or '.join(TOKENIZER_FILES[:3])}, ...)")
    if not any(any(path.glob(pattern)) for pattern in WEIGHT_PATTERNS):
        missing.append("weights (*.safetensors or pytorch_model*.bin)")
    if missing:
        raise ModelSourceError(
            f"model directory {model!r} has no {', no '.join(missing)}: copy what is missing "
            "from the model's source (save_pretrained() of the model and of its tokenizer)"
        )


def _has_tokenizer(path: Path) -> bool:
    if any((path / name).is_file() for name in TOKENIZER_FILES) or any(path.glob("*.tiktoken")):
        return True
    # A tokenizer of the model's own code (trust_remote_code) names its class here.
    config_file = path / "tokenizer_config.json"
    try:
        tokenizer_config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(tokenizer_config, dict) and "auto_map" in tokenizer_config


def fetch_from_hub(repo_id: str, gguf_file: str | None) -> Path:
    """Download ``repo_id``'s files a worker reads into the hub cache, once; or find them
    there when offline. ``ModelSourceError`` when neither is possible."""
    from modelpool.worker.backends.hf.handler import library_logs_through_root

    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HFValidationError
    except ImportError:  # transformers depends on it: only a broken install lacks it
        raise ModelSourceError(
            f"model {repo_id!r} is a hub id, and huggingface_hub is not installed"
        ) from None
    # The hub client's warnings (retries, a slow connection) are said once, here, as
    # the workers' are (see the hf backend), not twice through two handlers.
    library_logs_through_root()
    if gguf_file is not None:
        patterns = [*HUB_TEXT_PATTERNS, gguf_file]
    else:
        patterns = [*HUB_TEXT_PATTERNS, *WEIGHT_PATTERNS]
    try:
        snapshot = Path(snapshot_download(repo_id, allow_patterns=patterns))
    except HFValidationError:
        raise ModelSourceError(
            f"model {repo_id!r} is neither a directory here nor a hub id (owner/name)"
        ) from None
    except Exception as exc:
        raise ModelSourceError(_hub_failure(repo_id, exc)) from None
    if gguf_file is None and not any(
        any(snapshot.glob(pattern)) for pattern in WEIGHT_PATTERNS[:2]
    ):
        raise ModelSourceError(
            f"hub model {repo_id!r} has no *.safetensors or pytorch_model*.bin weights "
            "(a GGUF-only repository needs backend_options.gguf_file)"
        )
    return snapshot


def _hub_failure(repo_id: str, exc: Exception) -> str:
    """One line for why the hub could not give ``repo_id``, and what to do about it."""
    name = type(exc).__name__
    offline = os.environ.get(HUB_OFFLINE_ENV, "").strip().lower() in {"1", "true", "yes", "on"}
    if name in {"RepositoryNotFoundError", "GatedRepoError"}:
        return (
            f"hub model {repo_id!r} was not found, or needs a login (`hf auth login`): "
            "check the id, or give a local directory"
        )
    if offline or name == "LocalEntryNotFoundError":
        reason = f"{HUB_OFFLINE_ENV} is set" if offline else "the hub cannot be reached"
        return (
            f"hub model {repo_id!r} is not in the local cache and {reason}: download it "
            f"once where the hub is reachable (hf download {repo_id}), or give a local directory"
        )
    first_line = (str(exc).strip().splitlines() or [""])[0]
    return f"hub model {repo_id!r} could not be downloaded: {name}: {first_line}"
