"""The llama_cpp backend's load options, where its layers go (GPU placement), the GGUF
file a model names, and the bindings' import: all checked before anything heavy loads.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from modelpool.shared.context import check_max_model_len
from modelpool.shared.lora import DEFAULT_MAX_LORAS
from modelpool.worker.backends.common.params import (
    chat_template_option,
    check_load_options,
    positive_int,
    threads_from_env,
)

DEFAULT_PREFILL_CHUNK_TOKENS = 512
LOAD_OPTIONS = frozenset(
    {
        "gguf_file",
        "threads",
        "chat_template",
        "max_model_len",
        "kv_cache_tokens",
        "prefill_chunk_tokens",
        "max_sequences",
        "prefix_cache_tokens",
        "n_gpu_layers",
        "main_gpu",
        "split_mode",
        "tensor_split",
        "use_mmap",
        "embedding",
        "max_loras",
        "mmproj",
    }
)
DEFAULT_MAX_SEQUENCES = 64
INSTALL_HINT = (
    "pip install 'modelpool[llama]' (it compiles llama.cpp; "
    "docs/backends.md: The llama_cpp backend)"
)
ALL_LAYERS = -1  # llama.cpp: a negative n_gpu_layers puts every layer on the GPU
SplitMode = Literal["none", "layer", "row"]
SPLIT_MODES: dict[str, int] = {"none": 0, "layer": 1, "row": 2}


class BackendUnavailable(RuntimeError):
    """The llama_cpp backend cannot run here (missing package, build, or CPU support)."""


# ---- placement: n_gpu_layers and devices ------------------------------------------------


@dataclass(frozen=True)
class Placement:
    """Where llama.cpp puts the model's layers (``llama_model_params``)."""

    n_gpu_layers: int
    main_gpu: int
    split_mode: SplitMode
    tensor_split: tuple[float, ...]


def placement(device: str, options: Mapping[str, Any], *, gpu_offload: bool) -> Placement:
    """The layers' placement for a worker on ``device`` ("cpu", "cuda", "cuda:N", a
    comma-separated group "cuda:0,cuda:1", or "auto") with the backend options, for a
    llama.cpp build that can (``gpu_offload``) or cannot offload to a GPU.

    On a GPU every layer goes there unless ``n_gpu_layers`` says how many; a group of
    GPUs splits the layers across them (``split_mode`` "layer", evenly unless
    ``tensor_split`` gives proportions, one per GPU of the group); ``main_gpu`` is the
    device's own number. On the CPU ``n_gpu_layers`` must be 0::

        placement("cuda:1", {}, gpu_offload=True)            # all layers on GPU 1
        placement("cuda:0,cuda:1", {"n_gpu_layers": 20}, gpu_offload=True)
    """
    devices = [part.strip() for part in device.split(",") if part.strip()]
    if devices == ["auto"]:
        devices = ["cuda"] if gpu_offload else ["cpu"]
    gpus: list[int] = []
    for name in devices:
        if name == "cpu":
            continue
        if name == "cuda":
            gpus.append(0)
        elif name.startswith("cuda:") and name[5:].isdigit():
            gpus.append(int(name[5:]))
        else:
            raise ValueError(f"device must be cpu, cuda, cuda:N or auto, got {device!r}")
    if gpus and len(gpus) != len(devices):
        raise ValueError(f"a worker's devices are all GPUs or the CPU, got {device!r}")
    layers = options.get("n_gpu_layers", ALL_LAYERS if gpus else 0)
    if not isinstance(layers, int) or isinstance(layers, bool) or layers < -1:
        raise ValueError(f"n_gpu_layers must be an integer >= -1 (-1: all), got {layers!r}")
    if not gpus and layers != 0:
        raise ValueError(
            f"n_gpu_layers={layers} needs a GPU device; this worker's device is {device!r}"
        )
    if gpus and layers != 0 and not gpu_offload:
        raise BackendUnavailable(
            "this llama-cpp-python build cannot offload to a GPU (a CPU build): rebuild it "
            "with CMAKE_ARGS=-DGGML_CUDA=on, or set n_gpu_layers=0"
        )
    split_mode = options.get("split_mode", "layer" if len(gpus) > 1 else "none")
    if split_mode not in SPLIT_MODES:
        raise ValueError(f"split_mode must be none, layer or row, got {split_mode!r}")
    main_gpu = options.get("main_gpu", gpus[0] if gpus else 0)
    if not isinstance(main_gpu, int) or isinstance(main_gpu, bool) or main_gpu < 0:
        raise ValueError(f"main_gpu must be a GPU number, got {main_gpu!r}")
    return Placement(layers, main_gpu, split_mode, _tensor_split(options, gpus))


def _tensor_split(options: Mapping[str, Any], gpus: list[int]) -> tuple[float, ...]:
    """Proportions per GPU number (llama.cpp's ``tensor_split``), () for llama.cpp's own."""
    given = options.get("tensor_split")
    if given is None:
        if len(gpus) < 2:
            return ()
        given = [1.0] * len(gpus)
    if (
        not isinstance(given, Sequence)
        or isinstance(given, str)
        or len(given) != len(gpus)
        or not all(isinstance(part, (int, float)) and part >= 0 for part in given)
    ):
        raise ValueError(
            f"tensor_split must be one proportion >= 0 per GPU of the worker ({len(gpus)}), "
            f"got {given!r}"
        )
    split = [0.0] * (max(gpus) + 1)
    for gpu, part in zip(gpus, given, strict=True):
        split[gpu] = float(part)
    return tuple(split)


# ---- options --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Options:
    """The load options, checked."""

    threads: int
    chat_template: str | None
    max_model_len: int | None
    kv_cache_tokens: int | None
    prefill_chunk_tokens: int
    max_sequences: int
    use_mmap: bool
    prefix_cache_tokens: int | None
    max_loras: int = DEFAULT_MAX_LORAS
    mmproj: str | None = None
    """The multimodal projector GGUF (``llama_cpp.vision``); None: a text model."""


def parse_options(options: Mapping[str, Any]) -> Options:
    check_load_options(options, LOAD_OPTIONS, "llama_cpp")
    chat_template = chat_template_option(options)
    use_mmap = options.get("use_mmap", True)
    if not isinstance(use_mmap, bool):
        raise ValueError(f"use_mmap must be true or false, got {use_mmap!r}")
    kv_cache_tokens = options.get("kv_cache_tokens")
    if kv_cache_tokens is not None:
        kv_cache_tokens = positive_int("kv_cache_tokens", kv_cache_tokens)
    prefix_cache_tokens = options.get("prefix_cache_tokens")
    if prefix_cache_tokens is not None and (
        not isinstance(prefix_cache_tokens, int)
        or isinstance(prefix_cache_tokens, bool)
        or prefix_cache_tokens < 0
    ):
        raise ValueError(
            f"prefix_cache_tokens must be a non-negative integer, got {prefix_cache_tokens!r}"
        )
    mmproj = options.get("mmproj")
    if mmproj is not None and (not isinstance(mmproj, str) or not mmproj):
        raise ValueError(f"mmproj must be the path of a projector GGUF, got {mmproj!r}")
    return Options(
        threads=threads(options.get("threads")),
        chat_template=chat_template,
        max_model_len=check_max_model_len(options.get("max_model_len")),
        kv_cache_tokens=kv_cache_tokens,
        prefill_chunk_tokens=positive_int(
            "prefill_chunk_tokens",
            options.get("prefill_chunk_tokens", DEFAULT_PREFILL_CHUNK_TOKENS),
        ),
        max_sequences=positive_int(
            "max_sequences", options.get("max_sequences", DEFAULT_MAX_SEQUENCES)
        ),
        use_mmap=use_mmap,
        prefix_cache_tokens=prefix_cache_tokens,
        max_loras=positive_int("max_loras", options.get("max_loras", DEFAULT_MAX_LORAS)),
        mmproj=mmproj,
    )


def threads(option: object) -> int:
    """CPU threads: the option, else ``$MODELPOOL_TORCH_THREADS``, else every CPU this
    process may use."""
    if option is not None:
        return positive_int("threads", option)
    from_env = threads_from_env()
    return from_env if from_env is not None else max(1, len(os.sched_getaffinity(0)))


def gguf_path(model: str, gguf_file: object = None) -> Path:
    """The GGUF file ``model`` names: the file itself, or the one ``.gguf`` in a directory
    (``gguf_file`` picks one when there are several)."""
    path = Path(model).expanduser()
    if gguf_file is not None:
        if not isinstance(gguf_file, str):
            raise ValueError(f"gguf_file must be a file name, got {gguf_file!r}")
        path = path / gguf_file
    if path.is_dir():
        found = sorted(path.glob("*.gguf"))
        if len(found) != 1:
            raise FileNotFoundError(
                f"{str(path)!r} holds {len(found)} .gguf files"
                + (
                    f" ({', '.join(p.name for p in found)}): name one with gguf_file"
                    if found
                    else ""
                )
            )
        path = found[0]
    if not path.is_file():
        raise FileNotFoundError(f"GGUF model file {str(path)!r} does not exist")
    with path.open("rb") as file:
        if file.read(4) != b"GGUF":
            raise ValueError(f"{str(path)!r} is not a GGUF file (no GGUF magic bytes)")
    return path


def llama_cpp_missing() -> str | None:
    """Why the llama_cpp backend cannot be imported here, or None when it can (a cheap
    check: nothing is imported)."""
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed"
    return None


def import_llama_cpp() -> Any:
    """The low-level ``llama_cpp`` bindings, or :class:`BackendUnavailable` saying how to get
    them. Typed Any: they are ctypes declarations, and the package may be absent when
    this module is type-checked."""
    try:
        module = importlib.import_module("llama_cpp")
    except ImportError as exc:
        raise BackendUnavailable(
            f"the llama_cpp backend needs llama-cpp-python ({exc}): {INSTALL_HINT}"
        ) from exc
    # llama.cpp logs every load step on stderr; its warnings and errors still show.
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    return module
