"""LoRA adapters: what names one, and the checks an adapter passes before any worker
reads it.

An adapter is served by its base model's pool: a request carries the generation
parameter ``lora`` (:data:`LORA_PARAM`), ``{"name": NAME, "path": DIR}``, and the
worker applies that adapter to that request's rows alone (``worker.backends.hf.lora``)::

    pool.generate("Hello", lora={"name": "sql", "path": "/adapters/sql"})

The daemon never takes ``lora`` from a client: a request whose ``model`` names an
adapter (a ``[models.NAME]`` table with ``base`` and ``adapter``, or one loaded with
``POST /v1/load_lora_adapter``) is sent to its base's pool with the adapter's
registered path, set on the request's context (:data:`REQUEST_LORA`) and written into
its parameters by the pool (:func:`with_request_lora`), so that every route does so
without knowing of adapters.

:func:`inspect_adapter` reads a PEFT directory with the standard library only (the
``adapter_config.json``, the safetensors header and the file's size, the base's own
safetensors headers) and says what is wrong in one line naming the adapter: a truncated
or corrupt file, a target module or a shape the base lacks, a rank other than the
config's. :func:`check_adapter` runs it in a child process within a time bound, so a
read that hangs (a file on a dead mount) or crashes costs that adapter's requests a 503,
never the daemon or a worker.
"""

from __future__ import annotations

import contextvars
import json
import os
import struct
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modelpool.shared.errors import InvalidRequest, ModelUnavailable
from modelpool.shared.lora_gguf import inspect_gguf_adapter

LORA_PARAM = "lora"
"""The generation parameter naming a request's adapter: ``{"name": ..., "path": ...}``."""

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

DEFAULT_MAX_LORAS = 8
"""Adapters one worker holds when the ``max_loras`` load option is not given."""

CHECK_TIMEOUT_S = 30.0
"""How long the child that checks an adapter may take before the adapter is refused (503)."""

_MAX_HEADER_BYTES = 100 * 1024 * 1024
_DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}


@dataclass(frozen=True)
class LoraRef:
    """One adapter as a request names it."""

    name: str
    path: str

    def as_param(self) -> dict[str, str]:
        return {"name": self.name, "path": self.path}


@dataclass(frozen=True)
class AdapterSpec:
    """An adapter of the registry: ``[models.NAME]`` with ``base`` and ``adapter``."""

    name: str
    base: str
    path: str


REQUEST_LORA: contextvars.ContextVar[LoraRef | None] = contextvars.ContextVar(
    "modelpool_request_lora"
)
"""The adapter the daemon resolved a request's ``model`` to (None: the base itself); unset
outside the daemon's requests, where a library caller's own ``lora`` parameter counts."""


def lora_ref(params: Mapping[str, Any]) -> LoraRef | None:
    """The adapter a request's parameters name (None: none); InvalidRequest if malformed."""
    value = params.get(LORA_PARAM)
    if value is None:
        return None
    if isinstance(value, LoraRef):
        return value
    if (
        not isinstance(value, Mapping)
        or set(value) != {"name", "path"}
        or not all(isinstance(value[key], str) and value[key] for key in ("name", "path"))
    ):
        raise InvalidRequest(
            f'{LORA_PARAM} must be {{"name": NAME, "path": DIRECTORY}}, got {value!r}'
        )
    return LoraRef(value["name"], value["path"])


def with_request_lora(gen_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``gen_kwargs`` with the daemon's adapter for this request (see the module
    docstring): the daemon's choice replaces whatever the parameters said."""
    params = dict(gen_kwargs)
    try:
        resolved = REQUEST_LORA.get()
    except LookupError:
        ref = lora_ref(params)
        if ref is not None:
            params[LORA_PARAM] = ref.as_param()
        return params
    params.pop(LORA_PARAM, None)
    if resolved is not None:
        params[LORA_PARAM] = resolved.as_param()
    return params


def adapter_specs(tables: Mapping[str, Mapping[str, Any]], where: str) -> tuple[AdapterSpec, ...]:
    """The adapters among the ``[models.NAME]`` tables (those with ``adapter``)."""
    specs = []
    for name, table in tables.items():
        if "adapter" not in table:
            continue
        context = f"{where}: [models.{name}]"
        extra = sorted(set(table) - {"adapter", "base"})
        if extra:
            raise ValueError(
                f"{context}: an adapter's table holds only base and adapter, not {extra}"
            )
        base, path = table.get("base"), table["adapter"]
        if not isinstance(base, str) or not base:
            raise ValueError(f"{context}: an adapter needs base = NAME (the model it adapts)")
        if not isinstance(path, str) or not path:
            raise ValueError(f"{context}: adapter must be the adapter's directory")
        specs.append(AdapterSpec(name, base, str(Path(path).expanduser())))
    return tuple(specs)


def is_adapter_table(table: Mapping[str, Any]) -> bool:
    return "adapter" in table


@dataclass(frozen=True)
class AdapterInfo:
    """What :func:`inspect_adapter` found: the modules an adapter changes and its ranks."""

    modules: tuple[str, ...]
    rank: int


def inspect_adapter(name: str, path: str, base: str | None) -> AdapterInfo:
    """Check the PEFT LoRA directory ``path`` (and, when ``base`` is a directory holding
    safetensors, its shapes against the base's weights), or the LoRA GGUF file ``path``
    (``shared.lora_gguf``, against the base's GGUF); InvalidRequest naming ``name`` and
    what is wrong."""

    def bad(why: str) -> InvalidRequest:
        # The adapter's name, never its path: a tenant sees this message.
        return InvalidRequest(f"LoRA adapter {name!r}: {why}")

    folder = Path(path)
    if folder.is_file():
        # A llama.cpp LoRA GGUF, for a base served by the llama_cpp backend.
        modules, gguf_rank = inspect_gguf_adapter(folder, Path(base) if base else None, bad)
        return AdapterInfo(modules, gguf_rank)
    try:
        config = json.loads((folder / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise bad(f"no {ADAPTER_CONFIG} (a PEFT adapter directory holds one)") from None
    except (OSError, ValueError) as exc:
        raise bad(f"{ADAPTER_CONFIG} cannot be read: {exc}") from None
    if not isinstance(config, dict):
        raise bad(f"{ADAPTER_CONFIG} is not a JSON object")
    kind = str(config.get("peft_type", "LORA")).upper()
    if kind != "LORA":
        raise bad(f"peft_type {kind} is not LoRA")
    for key, off in (("use_dora", False), ("fan_in_fan_out", False), ("modules_to_save", None)):
        if config.get(key) not in (off, None, [], False):
            raise bad(f"{key} = {config[key]!r} is not supported (plain LoRA only)")
    if config.get("bias", "none") != "none":
        raise bad(f"bias = {config['bias']!r} is not supported (LoRA without biases only)")
    if config.get("alpha_pattern"):
        raise bad("alpha_pattern is not supported (one lora_alpha for every module)")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise bad(f"r must be a positive integer, got {rank!r}")
    ranks = config.get("rank_pattern") or {}
    tensors = _safetensors_header(folder / ADAPTER_WEIGHTS, bad)
    pairs: dict[str, dict[str, list[int]]] = {}
    for key, entry in tensors.items():
        module, sep, part = split_lora_key(key)
        if not sep:
            raise bad(f"tensor {key!r} is not a LoRA A or B matrix")
        pairs.setdefault(module, {})[part] = list(entry["shape"])
    if not pairs:
        raise bad("the adapter holds no LoRA matrices")
    base_shapes = _base_shapes(Path(base)) if base is not None else {}
    for module, parts in pairs.items():
        if set(parts) != {"lora_A", "lora_B"}:
            raise bad(f"module {module} lacks its lora_A or lora_B matrix")
        a, b = parts["lora_A"], parts["lora_B"]
        if len(a) != 2 or len(b) != 2 or a[0] != b[1]:
            raise bad(f"module {module}: lora_A {a} and lora_B {b} are not a rank-r pair")
        if not ranks and a[0] != rank:
            raise bad(f"module {module} has rank {a[0]}, the config says r = {rank}")
        if base_shapes:
            shape = base_shapes.get(f"{module}.weight")
            if shape is None:
                raise bad(f"target module {module} is not a weight of the base model")
            if len(shape) != 2 or [b[0], a[1]] != shape:
                raise bad(
                    f"module {module}: the adapter is [{b[0]} x {a[1]}], the base's weight is "
                    f"{shape}: an adapter of another base"
                )
    return AdapterInfo(tuple(sorted(pairs)), rank)


def split_lora_key(key: str) -> tuple[str, bool, str]:
    """``base_model.model.X.lora_A.weight`` -> ("X", True, "lora_A")."""
    for part in ("lora_A", "lora_B"):
        suffix = f".{part}.weight"
        if key.endswith(suffix):
            module = key[: -len(suffix)]
            return module.removeprefix("base_model.model."), True, part
    return key, False, ""


def _safetensors_header(file: Path, bad: Any) -> dict[str, dict[str, Any]]:
    """The tensors a safetensors file's header lists, once its size and offsets agree."""
    try:
        size = file.stat().st_size
        with file.open("rb") as stream:
            prefix = stream.read(8)
            if len(prefix) < 8:
                raise bad(f"{file.name} is truncated (no header)")
            (length,) = struct.unpack("<Q", prefix)
            if length > min(_MAX_HEADER_BYTES, size - 8):
                raise bad(f"{file.name} is truncated or corrupt (header of {length} bytes)")
            header = json.loads(stream.read(length))
    except FileNotFoundError:
        raise bad(f"no {file.name}") from None
    except OSError as exc:
        raise bad(f"{file.name} cannot be read: {exc}") from None
    except ValueError as exc:
        raise bad(f"{file.name} has a corrupt header: {exc}") from None
    if not isinstance(header, dict):
        raise bad(f"{file.name} has a corrupt header")
    header.pop("__metadata__", None)
    end = 0
    for key, entry in header.items():
        try:
            start, stop = (int(value) for value in entry["data_offsets"])
            count = 1
            for dim in entry["shape"]:
                count *= int(dim)
            width = _DTYPE_BYTES[entry["dtype"]]
        except (KeyError, TypeError, ValueError):
            raise bad(f"{file.name}: tensor {key!r} has a corrupt entry") from None
        if stop - start != count * width or start < 0:
            raise bad(f"{file.name}: tensor {key!r} does not match its shape")
        end = max(end, stop)
    if 8 + length + end > size:
        raise bad(
            f"{file.name} is truncated: its header needs {8 + length + end} bytes, "
            f"the file has {size}"
        )
    return header


def _base_shapes(folder: Path) -> dict[str, list[int]]:
    """Every weight's shape in the base's safetensors files (empty: none to read)."""
    shapes: dict[str, list[int]] = {}
    if not folder.is_dir():
        return shapes
    for file in sorted(folder.glob("*.safetensors")):
        try:
            header = _safetensors_header(file, lambda why: ValueError(why))
        except ValueError:
            continue
        for key, entry in header.items():
            shapes[key] = list(entry["shape"])
    return shapes


def check_adapter(
    name: str, path: str, base: str | None, timeout_s: float = CHECK_TIMEOUT_S
) -> None:
    """:func:`inspect_adapter` in a child process, bounded by ``timeout_s``: InvalidRequest
    for a bad adapter, ModelUnavailable (503) when the check hung or crashed."""
    command = [sys.executable, "-m", "modelpool.shared.lora", name, path, base or ""]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout_s, env=os.environ.copy()
        )
    except subprocess.TimeoutExpired:
        raise ModelUnavailable(
            f"LoRA adapter {name!r}: reading it took over {timeout_s:g} s",
            model=name,
            reason="adapter check timed out",
            retry_after_s=timeout_s,
        ) from None
    if done.returncode == 0:
        return
    if done.returncode == 2:
        raise InvalidRequest(done.stdout.strip())
    raise ModelUnavailable(
        f"LoRA adapter {name!r}: its check failed "
        f"(exit {done.returncode}): {done.stderr.strip()[-300:]}",
        model=name,
        reason="adapter check crashed",
        retry_after_s=1.0,
    )


def _main(argv: list[str]) -> int:
    name, path, base = argv
    try:
        inspect_adapter(name, path, base or None)
    except InvalidRequest as exc:
        print(exc.message)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
