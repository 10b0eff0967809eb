"""The hf backend's load options: sizes, memory maps, dtypes and devices, read and checked
before torch is imported; and what both loaders (``handler.load``, ``pooling.load_pooling``)
do with them once it is (``use_torch_threads``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from modelpool.shared.validation import is_int
from modelpool.worker.backends.common.params import positive_int, threads_from_env

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

LOAD_OPTIONS = frozenset(
    {
        "dtype",
        "device_map",
        "max_memory",
        "gguf_file",
        "trust_remote_code",
        "torch_threads",
        "chat_template",
        "kv_cache_tokens",
        "prefill_chunk_tokens",
        "max_model_len",
        "prefix_cache_bytes",
        "max_loras",
    }
)
_MEMORY_SIZE = re.compile(r"^\d+(\.\d+)?\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)$", re.IGNORECASE)


def looks_like_a_path(model: str) -> bool:
    return model.startswith(("/", "./", "../", "~"))


def thread_count(option: object) -> int | None:
    """Torch intra-op threads: the ``torch_threads`` option, else
    ``$MODELPOOL_TORCH_THREADS``, else None (torch's own choice)."""
    if option is not None:
        return positive_int("torch_threads", option)
    return threads_from_env()


def trust_remote_code(options: Mapping[str, Any]) -> bool:
    """The ``trust_remote_code`` option: false unless it says true."""
    trusted = options.get("trust_remote_code", False)
    if not isinstance(trusted, bool):
        raise ValueError(f"trust_remote_code must be true or false, got {trusted!r}")
    return trusted


def use_torch_threads(threads: int | None) -> None:
    """Torch's intra-op threads set to ``threads`` (None: left to torch), and one
    inter-op thread where that can still be set."""
    if threads is None:
        return
    import torch

    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        # Only settable before the first inter-op parallel work in the process.
        logger.debug("torch inter-op threads already fixed; leaving them")


_SIZE_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def byte_size(name: str, option: object) -> int:
    """Bytes, from an int or a size such as "512MiB"."""
    if isinstance(option, int) and not isinstance(option, bool) and option >= 0:
        return option
    text = option.strip() if isinstance(option, str) else ""
    match = _MEMORY_SIZE.match(text)
    if match is None:
        raise ValueError(f"{name} must be bytes or a size like '512MiB', got {option!r}")
    return int(float(text[: match.start(2)]) * _SIZE_UNITS[match.group(2).lower()])


def max_memory(option: object) -> dict[int | str, int | str] | None:
    """``max_memory`` as accelerate takes it: GPU keys as ints ("0", "cuda:0" -> 0), "cpu",
    "disk"; sizes as bytes or strings such as "20GiB"."""
    if option is None:
        return None
    if not isinstance(option, Mapping) or not option:
        raise ValueError(
            f"max_memory must be a table of device -> size, e.g. {{'0': '20GiB'}}, got {option!r}"
        )
    result: dict[int | str, int | str] = {}
    for key, size in option.items():
        name = str(key).strip().lower()
        if name.startswith("cuda:"):
            name = name[len("cuda:") :]
        if name.isdigit():
            device: int | str = int(name)
        elif name in ("cpu", "disk", "mps"):
            device = name
        else:
            raise ValueError(f"max_memory: {key!r} is not a GPU number, 'cuda:N', 'cpu' or 'disk'")
        if is_int(size, minimum=1):
            result[device] = int(size)
        elif isinstance(size, str) and _MEMORY_SIZE.match(size.strip()):
            result[device] = size.strip()
        else:
            raise ValueError(
                f"max_memory[{key!r}] must be bytes or a size like '20GiB', got {size!r}"
            )
    return result


def torch_dtype(name: str) -> Any:
    if name == "auto":
        return name
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(
            f"dtype must be 'auto' or a torch dtype name (bfloat16, ...), not {name!r}"
        )
    return dtype


def torch_device(device: str) -> torch.device:
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"device must be cpu, cuda, cuda:N or auto, got {device!r}") from exc
