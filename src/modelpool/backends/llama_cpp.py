"""The llama.cpp backend: a GGUF model per worker, run by llama.cpp through llama-cpp-python.

The pool runs it as ``backend="llama_cpp"`` (install ``modelpool[llama]``; see the README,
"The llama_cpp backend", for the build flags)::

    from modelpool.backends.llama_cpp import load

    handler = load("/models/SmolLM2-135M-Instruct.Q4_1.gguf", threads=2)
    handler.generate(call)        # call.prompt, call.params, call.cancelled(), call.emit()

``model`` is a ``.gguf`` file, or a directory holding one (``gguf_file`` names
it when there are several). The request parameters and their meaning are the
hf backend's (``hf.GENERATION_PARAMS``): greedy unless the request samples,
``temperature``/``top_p``/``top_k``/``seed``, ``repetition_penalty``,
``no_repeat_ngram_size``, ``min_new_tokens``, ``presence_penalty``,
``frequency_penalty``, ``logit_bias``, ``ignore_eos``, ``stop``, grammars, ``logprobs`` and
``prompt_logprobs`` (both forms), token-id prompts, ``tools`` (offered through
``modelpool.tools.render_chat`` as on hf, each call constrained by its grammar).
Chat messages are rendered with the GGUF's own chat template
(``tokenizer.chat_template``) unless the ``chat_template`` option gives one. A
request that does not fit the context (``max_model_len``, default the model's
training context) is refused with
``ContextLengthExceeded`` before its prefill, as on hf.

Both backend forms run the same loop (``llama_cpp_engine``): ``generate`` is one
request alone, ``admit``/``step``/``retire``/``abort`` many at once, each its own
llama.cpp sequence, one ``llama_decode`` per step over all of them.

A backend that cannot run says so at load, in the one line the pool's
``ModelLoadFailed`` quotes: llama-cpp-python not installed, a file that is not a
GGUF llama.cpp can read, GPU layers asked of a CPU-only build, or a build that
uses CPU instructions this machine does not run. That last one would kill the
worker on its first decode (SIGILL, or SIGSEGV under some sandboxes) and the
pool would see crashes, not a reason, so the first load of a model with a given
build on a given CPU first decodes one token in a child process (a second or two,
once: the outcome is remembered under ``$MODELPOOL_HOME/llama_cpp``).

Importing this module costs nothing heavy: the supervisor imports it for
:func:`validate`; llama-cpp-python and numpy are imported by :func:`load`.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from modelpool.backends import hf
from modelpool.backends.llama_cpp_engine import (
    DEFAULT_PREFILL_CHUNK_TOKENS,
    LlamaEngine,
    run_alone,
)
from modelpool.context import check_max_model_len, fit_to_context
from modelpool.errors import GrammarError, InvalidRequest
from modelpool.grammar import (
    GRAMMAR_PARAM,
    GrammarCompiler,
    PendingGrammar,
    RowGrammar,
    compile_bound,
    import_llguidance,
)
from modelpool.protocol import (
    BatchCall,
    Call,
    Finished,
    Generation,
    PrefixCacheReport,
    Prompt,
    TokenIds,
)
from modelpool.tools import render_chat

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

logger = logging.getLogger(__name__)

GENERATION_PARAMS = hf.GENERATION_PARAMS
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
    }
)
DEFAULT_MAX_SEQUENCES = 64
INSTALL_HINT = (
    "pip install 'modelpool[llama]' (it compiles llama.cpp; README: The llama_cpp backend)"
)
PROBE_DIR = "llama_cpp"
_ALL_LAYERS = -1  # llama.cpp: a negative n_gpu_layers puts every layer on the GPU
SplitMode = Literal["none", "layer", "row"]
_SPLIT_MODES: dict[str, int] = {"none": 0, "layer": 1, "row": 2}


class BackendUnavailable(RuntimeError):
    """The llama_cpp backend cannot run here (missing package, build, or CPU support)."""


def validate(params: Mapping[str, Any]) -> None:
    """Reject generation parameters this backend does not take: the hf backend's rules."""
    unknown = sorted(set(params) - GENERATION_PARAMS)
    if unknown:
        raise InvalidRequest(
            f"unknown generation parameter(s) for the llama_cpp backend: {', '.join(unknown)}; "
            f"allowed: {', '.join(sorted(GENERATION_PARAMS))}"
        )
    hf.validate(params)


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
    layers = options.get("n_gpu_layers", _ALL_LAYERS if gpus else 0)
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
    if split_mode not in _SPLIT_MODES:
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


# ---- loading --------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Options:
    threads: int
    chat_template: str | None
    max_model_len: int | None
    kv_cache_tokens: int | None
    prefill_chunk_tokens: int
    max_sequences: int
    use_mmap: bool
    prefix_cache_tokens: int | None


def _options(options: Mapping[str, Any]) -> _Options:
    unknown = sorted(set(options) - LOAD_OPTIONS)
    if unknown:
        raise ValueError(
            f"unknown option(s) for the llama_cpp backend: {', '.join(unknown)}; "
            f"allowed: {', '.join(sorted(LOAD_OPTIONS))}"
        )
    chat_template = options.get("chat_template")
    if chat_template is not None and not isinstance(chat_template, str):
        raise ValueError("chat_template must be a Jinja template string")
    use_mmap = options.get("use_mmap", True)
    if not isinstance(use_mmap, bool):
        raise ValueError(f"use_mmap must be true or false, got {use_mmap!r}")
    kv_cache_tokens = options.get("kv_cache_tokens")
    if kv_cache_tokens is not None:
        kv_cache_tokens = _positive("kv_cache_tokens", kv_cache_tokens)
    prefix_cache_tokens = options.get("prefix_cache_tokens")
    if prefix_cache_tokens is not None and (
        not isinstance(prefix_cache_tokens, int)
        or isinstance(prefix_cache_tokens, bool)
        or prefix_cache_tokens < 0
    ):
        raise ValueError(
            f"prefix_cache_tokens must be a non-negative integer, got {prefix_cache_tokens!r}"
        )
    return _Options(
        threads=_threads(options.get("threads")),
        chat_template=chat_template,
        max_model_len=check_max_model_len(options.get("max_model_len")),
        kv_cache_tokens=kv_cache_tokens,
        prefill_chunk_tokens=_positive(
            "prefill_chunk_tokens",
            options.get("prefill_chunk_tokens", DEFAULT_PREFILL_CHUNK_TOKENS),
        ),
        max_sequences=_positive(
            "max_sequences", options.get("max_sequences", DEFAULT_MAX_SEQUENCES)
        ),
        use_mmap=use_mmap,
        prefix_cache_tokens=prefix_cache_tokens,
    )


def _positive(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _threads(option: object) -> int:
    if option is not None:
        return _positive("threads", option)
    from_env = os.environ.get(hf.THREADS_ENV, "").strip()
    if from_env:
        if not from_env.isdigit() or int(from_env) < 1:
            raise ValueError(f"{hf.THREADS_ENV} must be a positive integer, got {from_env!r}")
        return int(from_env)
    return max(1, len(os.sched_getaffinity(0)))


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


def load(model: str, device: str = "cpu", **options: Any) -> LlamaCppHandler:
    """Load the GGUF ``model`` once per worker and return its handler.

    Options (the pool's ``backend_options``): ``gguf_file`` (the file in a directory
    ``model``), ``threads`` (CPU threads; default ``$MODELPOOL_TORCH_THREADS``, which the
    pool sets per worker, else every CPU this process may use), ``chat_template`` (a
    Jinja template replacing the GGUF's), ``max_model_len`` (the context length in
    tokens, prompt and completion together; default the model's training context),
    ``kv_cache_tokens`` (KV cells of the worker, all its requests together; default
    and minimum ``max_model_len``), ``prefill_chunk_tokens`` (prompt tokens read per
    step, default 512), ``max_sequences`` (requests one worker may hold at once,
    default 64), ``prefix_cache_tokens`` (KV cells the prefix cache may keep of
    finished requests, default half of the KV cells, 0 turns it off; see
    ``llama_cpp_prefix``), ``use_mmap`` (default true), and the placement ones
    (:func:`placement`): ``n_gpu_layers``, ``main_gpu``, ``split_mode``,
    ``tensor_split``::

        handler = load("/models/qwen2.5-0.5b-instruct-q4_k_m.gguf", threads=4)
        handler = load("/models/llama", device="cuda:0", n_gpu_layers=-1)
    """
    settings = _options(options)
    path = gguf_path(model, options.get("gguf_file"))
    llama = import_llama_cpp()
    layout = placement(device, options, gpu_offload=bool(llama.llama_supports_gpu_offload()))
    probe_once(path, layout)
    started = time.monotonic()
    runtime = Runtime.open(llama, path, layout, settings)
    handler = LlamaCppHandler(runtime, settings)
    handler.warm_up()
    logger.info(
        "loaded %s with llama.cpp (%d threads, %s GPU layers, context %d tokens, %d KV cells) "
        "in %.2f s",
        path.name,
        settings.threads,
        "all" if layout.n_gpu_layers == _ALL_LAYERS else layout.n_gpu_layers,
        handler.max_model_len,
        runtime.kv_cells,
        time.monotonic() - started,
    )
    return handler


class Runtime:
    """One llama.cpp model, its context (a unified KV cache for every sequence) and a
    reusable batch, behind the few calls the engine makes."""

    def __init__(
        self,
        llama: Any,
        model: Any,
        context: Any,
        *,
        batch_capacity: int,
        kv_cells: int,
        max_sequences: int,
        max_model_len: int,
    ) -> None:
        import numpy as np

        self.llama = llama
        self.max_sequences = max_sequences
        self.max_model_len = max_model_len
        self.model = model
        self.context = context
        self.kv_cells = kv_cells
        self.vocab = llama.llama_model_get_vocab(model)
        self.n_vocab = int(llama.llama_vocab_n_tokens(self.vocab))
        self.memory = llama.llama_get_memory(context)
        self.batch_capacity = batch_capacity
        self._batch = llama.llama_batch_init(batch_capacity, 0, 1)
        ends = [t for t in range(self.n_vocab) if llama.llama_vocab_is_eog(self.vocab, t)]
        self.end_ids: npt.NDArray[np.int64] = np.array(ends, dtype=np.int64)
        self.end_id_set = frozenset(ends)
        self._pieces: dict[int, bytes] = {}
        self._texts: dict[int, str] = {}
        self._decoder = _Detokenizer(self)

    @classmethod
    def open(cls, llama: Any, path: Path, layout: Placement, settings: _Options) -> Runtime:
        llama.llama_backend_init()
        model_params = llama.llama_model_default_params()
        model_params.n_gpu_layers = layout.n_gpu_layers
        model_params.main_gpu = layout.main_gpu
        model_params.split_mode = _SPLIT_MODES[layout.split_mode]
        model_params.use_mmap = settings.use_mmap
        if layout.tensor_split:
            split = (ctypes.c_float * int(llama.llama_max_devices()))(*layout.tensor_split)
            model_params.tensor_split = split
        model = llama.llama_model_load_from_file(str(path).encode(), model_params)
        if not model:
            raise BackendUnavailable(
                f"llama.cpp could not load {str(path)!r} (an architecture or quantization this "
                "llama-cpp-python does not know, or a damaged file; its log says more)"
            )
        n_ctx_train = int(llama.llama_model_n_ctx_train(model))
        max_model_len = settings.max_model_len or n_ctx_train
        kv_cells = max(settings.kv_cache_tokens or 0, max_model_len)
        max_sequences = min(settings.max_sequences, int(llama.llama_max_parallel_sequences()))
        batch_capacity = settings.prefill_chunk_tokens + max_sequences
        context_params = llama.llama_context_default_params()
        # Never fewer cells than one step's batch: llama.cpp sizes its outputs from the
        # batch and aborts the process when the context is smaller. The admission
        # budget stays kv_cells.
        context_params.n_ctx = max(kv_cells, batch_capacity)
        context_params.n_batch = batch_capacity
        context_params.n_ubatch = min(batch_capacity, 512)
        context_params.n_seq_max = max_sequences
        context_params.n_threads = settings.threads
        context_params.n_threads_batch = settings.threads
        # One pool of cells for every sequence: a request may take up to the whole
        # context, and short ones share what is left (kv_cache_tokens bounds the sum).
        context_params.kv_unified = True
        context_params.no_perf = True
        context = llama.llama_init_from_model(model, context_params)
        if not context:
            raise BackendUnavailable(
                f"llama.cpp could not make a context of {kv_cells} KV cells for {path.name} "
                "(out of memory? lower kv_cache_tokens or max_model_len)"
            )
        return cls(
            llama,
            model,
            context,
            batch_capacity=batch_capacity,
            kv_cells=kv_cells,
            max_sequences=max_sequences,
            max_model_len=max_model_len,
        )

    # ---- the engine's calls ------------------------------------------------------------------

    def decode(
        self, tokens: list[int], positions: list[int], seq_ids: list[int], outputs: list[bool]
    ) -> int:
        batch = self._batch
        count = len(tokens)
        if count > self.batch_capacity:
            raise ValueError(f"{count} tokens in one step; the batch holds {self.batch_capacity}")
        token, pos, n_seq_id, seq_id, logits = (
            batch.token,
            batch.pos,
            batch.n_seq_id,
            batch.seq_id,
            batch.logits,
        )
        for index in range(count):
            token[index] = tokens[index]
            pos[index] = positions[index]
            n_seq_id[index] = 1
            seq_id[index][0] = seq_ids[index]
            logits[index] = outputs[index]
        batch.n_tokens = count
        return int(self.llama.llama_decode(self.context, batch))

    def logits(self, index: int) -> npt.NDArray[np.float32]:
        """The output of batch entry ``index`` (a view: valid until the next decode)."""
        import numpy as np

        pointer = self.llama.llama_get_logits_ith(self.context, index)
        view: npt.NDArray[np.float32] = np.ctypeslib.as_array(pointer, shape=(self.n_vocab,))
        return view

    def remove_sequence(self, seq_id: int) -> None:
        self.llama.llama_memory_seq_rm(self.memory, seq_id, -1, -1)

    def copy_prefix(self, source: int, target: int, length: int) -> None:
        # In the unified cache the cells are shared between the sequences, not copied.
        self.llama.llama_memory_seq_cp(self.memory, source, target, 0, length)

    def trim_sequence(self, seq_id: int, length: int) -> None:
        self.llama.llama_memory_seq_rm(self.memory, seq_id, length, -1)

    def cell_bytes(self) -> int:
        """Bytes of one KV cell, every layer's keys and values (f16, llama.cpp's default)."""
        llama, model = self.llama, self.model
        heads = int(llama.llama_model_n_head(model))
        head_dim = int(llama.llama_model_n_embd(model)) // max(1, heads)
        kv_width = head_dim * int(llama.llama_model_n_head_kv(model))
        return 2 * int(llama.llama_model_n_layer(model)) * kv_width * 2

    def prefix_cacheable(self) -> bool:
        """Whether a prefix of a sequence's cells holds all its prefix's state: not for
        recurrent or hybrid models (a state, not cells per position) nor sliding-window
        attention (cells out of the window are dropped)."""
        llama, model = self.llama, self.model
        return not (
            llama.llama_model_is_recurrent(model)
            or llama.llama_model_is_hybrid(model)
            or int(llama.llama_model_n_swa(model)) > 0
        )

    def clear(self) -> None:
        self.llama.llama_memory_clear(self.memory, True)

    def decoder(self) -> _Detokenizer:
        return self._decoder

    def token_text(self, token_id: int) -> str:
        """A token's own text, special tokens shown (logprobs' ``token``)."""
        text = self._texts.get(token_id)
        if text is None:
            text = self._piece(token_id, special=True).decode("utf-8", errors="replace")
            self._texts[token_id] = text
        return text

    # ---- text ------------------------------------------------------------------------------

    def tokenize(self, text: str, *, add_special: bool) -> list[int]:
        """Special tokens written in ``text`` are read as such (as a Hugging Face
        tokenizer does); ``add_special`` adds the BOS the model's vocabulary asks for."""
        data = text.encode("utf-8")
        room = len(data) + 8
        for _ in range(2):
            ids = (self.llama.llama_token * room)()
            count = int(
                self.llama.llama_tokenize(self.vocab, data, len(data), ids, room, add_special, True)
            )
            if count >= 0:
                return list(ids[:count])
            room = -count
        raise RuntimeError(f"llama_tokenize could not fit {len(data)} bytes in {room} tokens")

    def piece(self, token_id: int) -> bytes:
        """A token's bytes as generated text shows it (control tokens show nothing)."""
        piece = self._pieces.get(token_id)
        if piece is None:
            piece = self._piece(token_id, special=False)
            self._pieces[token_id] = piece
        return piece

    def _piece(self, token_id: int, *, special: bool) -> bytes:
        size = 32
        for _ in range(2):
            buffer = ctypes.create_string_buffer(size)
            count = int(
                self.llama.llama_token_to_piece(self.vocab, token_id, buffer, size, 0, special)
            )
            if count >= 0:
                return buffer.raw[:count]
            size = -count
        raise RuntimeError(f"llama_token_to_piece: token {token_id} does not fit {size} bytes")

    def metadata(self, key: str) -> str | None:
        size = 1 << 16
        buffer = ctypes.create_string_buffer(size)
        count = int(self.llama.llama_model_meta_val_str(self.model, key.encode(), buffer, size))
        if count < 0:
            return None
        if count >= size:
            buffer = ctypes.create_string_buffer(count + 1)
            self.llama.llama_model_meta_val_str(self.model, key.encode(), buffer, count + 1)
        return buffer.value.decode("utf-8", errors="replace")

    def special_text(self, token_id: int) -> str:
        if token_id < 0:
            return ""
        return self.token_text(token_id)


class _Detokenizer:
    """The tokenizer face ``hf_text.TextProgress`` decodes with: token ids to text, control
    tokens dropped, an unfinished UTF-8 character at the end shown as U+FFFD (which
    TextProgress holds back until the next token completes it)."""

    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime

    def decode(self, token_ids: list[int], **_: Any) -> str:
        piece = self._runtime.piece
        return b"".join(piece(token_id) for token_id in token_ids).decode("utf-8", errors="replace")


def _prefix_cache_tokens(runtime: Runtime, settings: _Options) -> int:
    """The prefix cache's bound in cells: the option, else half of the KV cells; 0 (off)
    for models whose prefix cells do not hold their prefix's whole state."""
    if not runtime.prefix_cacheable():
        return 0
    if settings.prefix_cache_tokens is None:
        return runtime.kv_cells // 2
    return min(settings.prefix_cache_tokens, runtime.kv_cells)


class LlamaCppHandler:
    """A loaded GGUF model; made by :func:`load`. Both backend forms, one engine."""

    def __init__(self, runtime: Runtime, settings: _Options) -> None:
        self.runtime = runtime
        self.max_model_len: int = runtime.max_model_len
        self.chat_template = settings.chat_template or runtime.metadata("tokenizer.chat_template")
        self._engine = LlamaEngine(
            runtime,
            self,
            kv_cells=runtime.kv_cells,
            max_sequences=runtime.max_sequences,
            prefill_chunk_tokens=settings.prefill_chunk_tokens,
            prefix_cache_tokens=_prefix_cache_tokens(runtime, settings),
            cell_bytes=runtime.cell_bytes(),
        )
        llama = runtime.llama
        self._bos = int(llama.llama_vocab_bos(runtime.vocab))
        self._eos = int(llama.llama_vocab_eos(runtime.vocab))
        self._render: Any = None
        self._grammars: LlamaGrammars | None = None

    def grammars(self) -> LlamaGrammars:
        """The grammar engine, made on the first constrained request."""
        if self._grammars is None:
            self._grammars = LlamaGrammars(self.runtime)
        return self._grammars

    # ---- one-call form -----------------------------------------------------------------------

    def generate(self, call: Call) -> Generation:
        validate(call.params)
        return run_alone(self._engine, call)

    def validate(self, params: Mapping[str, Any]) -> None:
        validate(params)

    def warm_up(self) -> None:
        """One token, so that the first request does not pay llama.cpp's first graph."""
        self.generate(_WarmUpCall())

    # ---- batched form ------------------------------------------------------------------------

    def admit(self, call: BatchCall) -> None:
        self._engine.admit(call)

    def step(self) -> list[Finished]:
        return self._engine.step()

    def retire(self, call: BatchCall) -> Generation:
        return self._engine.retire(call)

    def abort(self) -> None:
        self._engine.abort()

    def room(self) -> tuple[int, list[BatchCall]]:
        return self._engine.room()

    def prefix_cache_report(self) -> PrefixCacheReport | None:
        """The prefix cache's size, counters and fingerprints (None: it is off)."""
        return self._engine.prefix_cache_report()

    # ---- what the engine asks --------------------------------------------------------------

    def fit_new_tokens(self, call: Call, params: dict[str, Any], prompt_tokens: int) -> int:
        """This request's ``max_new_tokens``, fitted to the context as on hf."""
        asked = params.get("max_new_tokens")
        default = hf.DEFAULT_MAX_NEW_TOKENS
        if asked is not None and "max_new_tokens" in getattr(call, "defaulted", ()):
            default, asked = asked, None
        new_tokens = fit_to_context(prompt_tokens, asked, self.max_model_len, default=default)
        if params.get("min_new_tokens", 0) > new_tokens:
            fit_to_context(prompt_tokens, params["min_new_tokens"], self.max_model_len, default=0)
        return new_tokens

    def tokenize(self, prompt: Prompt, add_generation_prompt: bool = True) -> list[int]:
        """The token ids a generation of ``prompt`` feeds the model (``/tokenize``)."""
        return self.encode(prompt, add_generation_prompt=add_generation_prompt)

    def detokenize(self, token_ids: list[int]) -> str:
        """The text of ``token_ids``, special tokens included (``/detokenize``)."""
        self._check_vocabulary(token_ids)
        runtime = self.runtime
        text = b"".join(runtime.piece(token_id) for token_id in token_ids)
        return text.decode("utf-8", errors="replace")

    def _check_vocabulary(self, token_ids: Sequence[int]) -> None:
        outside = [token for token in token_ids if not 0 <= token < self.runtime.n_vocab]
        if outside:
            raise InvalidRequest(
                f"token id {outside[0]} is outside this model's vocabulary "
                f"(ids 0 to {self.runtime.n_vocab - 1})"
            )

    def encode(
        self,
        prompt: Prompt,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """The prompt's token ids; a chat prompt offers ``tools`` (OpenAI's shape) to the
        model as the hf backend does (``modelpool.tools.render_chat``)."""
        runtime = self.runtime
        if isinstance(prompt, TokenIds):
            self._check_vocabulary(prompt.ids)
            ids = list(prompt.ids)
        elif isinstance(prompt, str):
            ids = runtime.tokenize(prompt, add_special=True)
        else:
            # The template writes its own special tokens (BOS included).
            text = self.render_chat(prompt, tools, add_generation_prompt)
            ids = runtime.tokenize(text, add_special=False)
        if not ids:
            if self._bos < 0:
                raise InvalidRequest("the prompt is empty and the model has no BOS token")
            ids = [self._bos]
        return ids

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        if self.chat_template is None:
            raise InvalidRequest(
                "this GGUF has no chat template: send a string prompt, or give the "
                "llama_cpp backend a chat_template option"
            )
        if tools or any(len(message) > 2 for message in messages):
            # Tool definitions, calls and results: the one renderer both backends share.
            return render_chat(self, messages, tools, add_generation_prompt)
        return self.apply_chat_template(
            [dict(message) for message in messages],
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool,
        tokenize: bool,
        **template_variables: Any,
    ) -> str:
        """The GGUF's chat template rendered as a transformers tokenizer's
        ``apply_chat_template(..., tokenize=False)`` renders it (what
        ``modelpool.tools.render_chat`` calls, ``tools=`` included)."""
        if tokenize or self.chat_template is None:
            raise ValueError("apply_chat_template here renders text from the chat template")
        if self._render is None:
            self._render = _compile_template(self.chat_template)
        text: str = self._render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.runtime.special_text(self._bos),
            eos_token=self.runtime.special_text(self._eos),
            **template_variables,
        )
        return text


class LlamaGrammars:
    """Structured outputs on llama.cpp: the hf backend's llguidance grammars
    (``modelpool.grammar``), with llguidance's tokenizer made from the GGUF's own
    vocabulary (``llguidance.llamacpp``, about a second, on the first compilation) and the
    masks applied in numpy to each constrained row's logits."""

    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime
        self._tokenizer: Any = None
        self._tokenizer_lock = threading.Lock()
        self.compiler: GrammarCompiler[Any] = GrammarCompiler(self._compile)
        self._words = (runtime.n_vocab + 31) // 32

    def _llg_tokenizer(self) -> Any:
        with self._tokenizer_lock:
            if self._tokenizer is None:
                import_llguidance()
                llamacpp = importlib.import_module("llguidance.llamacpp")
                with warnings.catch_warnings():
                    # It reads each token's attributes through a binding that
                    # llama-cpp-python marks deprecated: one warning per token otherwise.
                    warnings.simplefilter("ignore", DeprecationWarning)
                    self._tokenizer = llamacpp.lltokenizer_from_vocab(
                        self._runtime.vocab,
                        n_vocab=self._runtime.n_vocab,
                        eos_token=sorted(self._runtime.end_id_set),
                    )
            return self._tokenizer

    def _compile(self, text: str) -> Any:
        llguidance = import_llguidance()
        matcher = llguidance.LLMatcher(self._llg_tokenizer(), text)
        if matcher.is_error():
            raise GrammarError(f"the grammar cannot be compiled: {matcher.get_error()}")
        return matcher

    def start(self, params: dict[str, Any]) -> PendingGrammar[Any]:
        return self.compiler.start(params[GRAMMAR_PARAM], compile_bound(params))

    def row(self, compiled: Any) -> RowGrammar:
        return RowGrammar(compiled.deep_copy(), self._runtime.end_id_set)

    def allowed(self, grammar: RowGrammar) -> npt.NDArray[np.bool_]:
        """The tokens ``grammar`` allows next, one bool per vocabulary entry."""
        import numpy as np

        bits = np.full(self._words, -1, dtype=np.int32)
        grammar.matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
        if grammar.matcher.is_error():
            raise GrammarError(f"grammar: {grammar.matcher.get_error()}")
        unpacked = np.unpackbits(bits.view(np.uint8), bitorder="little")
        allowed: npt.NDArray[np.bool_] = unpacked[: self._runtime.n_vocab].astype(bool)
        return allowed


def _compile_template(template: str) -> Any:
    """A chat template rendered as transformers renders one (a sandboxed Jinja
    environment with the same whitespace rules and helpers)."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
    return environment.from_string(template).render


class _WarmUpCall:
    prompt: Prompt = "Hello"
    params: dict[str, Any] = {"max_new_tokens": 1}

    def cancelled(self) -> bool:
        return False

    def emit(self, text: str) -> None:
        pass


# ---- the first-decode probe ---------------------------------------------------------------

_PROBE_CODE = (
    "import sys; from modelpool.backends.llama_cpp import probe_decode; "
    "probe_decode(sys.argv[1], int(sys.argv[2]))"
)
_PROBE_TIMEOUT_S = 300.0


def probe_once(path: Path, layout: Placement) -> None:
    """Decode one token of ``path`` in a child process, once per build, CPU and model file,
    and raise :class:`BackendUnavailable` naming the signal if that child dies of it."""
    from modelpool.embedded import modelpool_home

    stamp = modelpool_home() / PROBE_DIR / f"probe-ok-{_probe_key(path, layout)}"
    if stamp.is_file():
        return
    env = dict(os.environ)
    source_root = str(Path(__file__).resolve().parents[2])
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
            f"(README: The llama_cpp backend). Its last output: {_last_line(result.stderr)}"
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
    settings = _Options(
        threads=_threads(None),
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
