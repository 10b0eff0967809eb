"""The daemon's check of a llama.cpp LoRA GGUF (``adapter = FILE.gguf`` for a base served
by the llama_cpp backend), with the standard library only, as ``shared.lora`` checks a
PEFT directory: the GGUF header says ``general.type = "adapter"`` and
``adapter.type = "lora"``; every ``X.weight.lora_a`` has its ``.lora_b`` of the same
rank; the file holds every tensor's data (not truncated); and, when the base's GGUF is
at hand, the architecture and each adapted weight's shape are the base's.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

GGUF_MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q"}
_SCALARS.update({11: "<q", 12: "<d"})
_STRING, _ARRAY = 8, 9
# Bytes per block and elements per block of the tensor types a LoRA GGUF is written in
# (convert_lora_to_gguf.py: f32, f16, bf16, q8_0); other types' sizes are not checked.
_TYPE_SIZES = {0: (4, 1), 1: (2, 1), 30: (2, 1), 8: (34, 32)}
_MAX_STRING = 1 << 24

Bad = Callable[[str], Exception]


class _Corrupt(ValueError):
    """The header does not parse."""


def _read(stream: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize(fmt)
    data = stream.read(size)
    if len(data) < size:
        raise _Corrupt("the header ends early")
    return struct.unpack(fmt, data)[0]


def _string(stream: BinaryIO) -> str:
    length = _read(stream, "<Q")
    if length > _MAX_STRING:
        raise _Corrupt(f"a string of {length} bytes")
    data = stream.read(length)
    if len(data) < length:
        raise _Corrupt("the header ends early")
    return data.decode("utf-8", errors="replace")


def _value(stream: BinaryIO, kind: int) -> Any:
    if kind == _STRING:
        return _string(stream)
    if kind == _ARRAY:
        item, count = _read(stream, "<I"), _read(stream, "<Q")
        scalar = _SCALARS.get(item)
        if scalar is not None and count <= _MAX_STRING:
            # A vocabulary's scores and types: one read, not one per token.
            packed = f"<{count}{scalar[1:]}"
            data = stream.read(struct.calcsize(packed))
            if len(data) < struct.calcsize(packed):
                raise _Corrupt("the header ends early")
            return list(struct.unpack(packed, data))
        return [_value(stream, item) for _ in range(count)]
    fmt = _SCALARS.get(kind)
    if fmt is None:
        raise _Corrupt(f"a value of unknown type {kind}")
    return _read(stream, fmt)


def read_gguf_header(
    file: Path,
) -> tuple[dict[str, Any], dict[str, tuple[list[int], int, int]], int]:
    """The metadata, the tensors (name: ggml shape, type, offset) and the data's start;
    ValueError when it is not a GGUF file or its header is corrupt."""
    with file.open("rb") as stream:
        if stream.read(4) != GGUF_MAGIC:
            raise ValueError("not a GGUF file")
        try:
            _read(stream, "<I")  # the version
            n_tensors, n_kv = _read(stream, "<Q"), _read(stream, "<Q")
            metadata = {}
            for _ in range(n_kv):
                key = _string(stream)
                metadata[key] = _value(stream, _read(stream, "<I"))
            tensors = {}
            for _ in range(n_tensors):
                name = _string(stream)
                dims = [_read(stream, "<Q") for _ in range(_read(stream, "<I"))]
                tensors[name] = (dims, _read(stream, "<I"), _read(stream, "<Q"))
        except _Corrupt as exc:
            raise ValueError(f"a corrupt GGUF header ({exc})") from None
        alignment = int(metadata.get("general.alignment", 32)) or 32
        start = -(-stream.tell() // alignment) * alignment
    return metadata, tensors, start


def base_gguf(base: Path) -> Path | None:
    """The base model's GGUF: the file, or a directory's only ``.gguf``."""
    if base.is_file() and base.suffix == ".gguf":
        return base
    found = sorted(base.glob("*.gguf")) if base.is_dir() else []
    return found[0] if len(found) == 1 else None


def inspect_gguf_adapter(file: Path, base: Path | None, bad: Bad) -> tuple[tuple[str, ...], int]:
    """The weights a LoRA GGUF adapts and its rank; ``bad(why)`` raised otherwise."""
    try:
        metadata, tensors, start = read_gguf_header(file)
        size = file.stat().st_size
    except OSError as exc:
        raise bad(f"its file cannot be read: {exc.strerror}") from None
    except ValueError as exc:
        raise bad(f"its file: {exc}") from None
    kind, adapter = metadata.get("general.type"), metadata.get("adapter.type")
    if kind != "adapter" or adapter != "lora":
        raise bad(f"its file is not a LoRA GGUF (general.type {kind!r}, adapter.type {adapter!r})")
    pairs: dict[str, dict[str, list[int]]] = {}
    end = 0
    for key, (dims, kind_id, offset) in tensors.items():
        module, _, part = key.rpartition(".")
        if part not in ("lora_a", "lora_b"):
            raise bad(f"tensor {key!r} is not a LoRA A or B matrix")
        pairs.setdefault(module, {})[part] = dims
        block = _TYPE_SIZES.get(kind_id)
        if block is not None:
            count = 1
            for dim in dims:
                count *= dim
            end = max(end, offset + -(-count // block[1]) * block[0])
    if start + end > size:
        raise bad(f"its file is truncated: its tensors need {start + end} bytes, it has {size}")
    if not pairs:
        raise bad("the adapter holds no LoRA matrices")
    ranks = set()
    for module, parts in pairs.items():
        if set(parts) != {"lora_a", "lora_b"}:
            raise bad(f"weight {module} lacks its lora_a or lora_b matrix")
        a, b = parts["lora_a"], parts["lora_b"]
        if len(a) != 2 or len(b) != 2 or a[1] != b[0]:
            raise bad(f"weight {module}: lora_a {a} and lora_b {b} are not a rank-r pair")
        ranks.add(a[1])
    source = base_gguf(base) if base is not None else None
    if source is not None:
        _against_base(source, metadata, pairs, bad)
    return tuple(sorted(pairs)), max(ranks)


def _against_base(
    source: Path, metadata: dict[str, Any], pairs: dict[str, dict[str, list[int]]], bad: Bad
) -> None:
    try:
        base_meta, base_tensors, _ = read_gguf_header(source)
    except (OSError, ValueError):
        return  # the base's own load says what is wrong with it
    arch, base_arch = metadata.get("general.architecture"), base_meta.get("general.architecture")
    if arch != base_arch:
        raise bad(f"an adapter of a {arch} model, the base is {base_arch}")
    for module, parts in pairs.items():
        found = base_tensors.get(module)
        if found is None:
            raise bad(f"weight {module} is not a weight of the base model")
        shape = found[0]
        adapted = [parts["lora_a"][0], parts["lora_b"][1]]
        if shape[:2] != adapted:
            raise bad(
                f"weight {module}: the adapter is {adapted}, the base's weight is {shape[:2]}: "
                "an adapter of another base"
            )
