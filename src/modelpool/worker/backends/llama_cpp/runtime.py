"""The llama.cpp model and context behind the few ctypes calls the llama_cpp runner
makes: one unified KV cache for every sequence, a reusable batch, token text.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modelpool.worker.backends.llama_cpp.options import (
    SPLIT_MODES,
    BackendUnavailable,
    Options,
    Placement,
)

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt


class Runtime:
    """One llama.cpp model, its context (a unified KV cache for every sequence) and a
    reusable batch, behind the few calls the runner makes."""

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
        self._special_pieces: dict[int, bytes] = {}
        self._texts: dict[int, str] = {}
        self._decoder = Detokenizer(self)
        self._adapter: Any = None  # the adapter the context applies (use_adapter)

    @classmethod
    def open(cls, llama: Any, path: Path, layout: Placement, settings: Options) -> Runtime:
        llama.llama_backend_init()
        model_params = llama.llama_model_default_params()
        model_params.n_gpu_layers = layout.n_gpu_layers
        model_params.main_gpu = layout.main_gpu
        model_params.split_mode = SPLIT_MODES[layout.split_mode]
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

    # ---- the runner's calls ------------------------------------------------------------------

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

    # ---- LoRA adapters (llama_cpp.lora) -----------------------------------------------------

    def load_adapter(self, path: str) -> Any:
        """A LoRA GGUF read onto this model; None when llama.cpp refuses it (not a LoRA
        GGUF, another architecture, shapes of another base, a truncated file)."""
        handle = self.llama.llama_adapter_lora_init(self.model, path.encode())
        return handle if handle else None

    def free_adapter(self, handle: Any) -> None:
        if handle is self._adapter:
            self.use_adapter(None)
        self.llama.llama_adapter_lora_free(handle)

    def use_adapter(self, handle: Any) -> None:
        """Apply ``handle`` (None: no adapter) to the next decodes: llama.cpp applies
        adapters per context, not per sequence."""
        if handle is self._adapter:
            return
        llama = self.llama
        if handle is None:
            code = int(llama.llama_set_adapters_lora(self.context, None, 0, None))
        else:
            handles = (llama.llama_adapter_lora_p_ctypes * 1)(handle)
            scales = (ctypes.c_float * 1)(1.0)
            code = int(llama.llama_set_adapters_lora(self.context, handles, 1, scales))
        if code != 0:
            raise RuntimeError(f"llama_set_adapters_lora returned {code}")
        self._adapter = handle

    def decoder(self) -> Detokenizer:
        return self._decoder

    def token_text(self, token_id: int) -> str:
        """A token's own text, special tokens shown (logprobs' ``token``)."""
        text = self._texts.get(token_id)
        if text is None:
            text = self._piece(token_id, special=True).decode("utf-8", errors="replace")
            self._texts[token_id] = text
        return text

    # ---- text ------------------------------------------------------------------------------

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool = True) -> list[int]:
        """Special tokens written in ``text`` are read as such (as a Hugging Face
        tokenizer does) unless not ``parse_special``; ``add_special`` adds the BOS the
        model's vocabulary asks for."""
        data = text.encode("utf-8")
        room = len(data) + 8
        for _ in range(2):
            ids = (self.llama.llama_token * room)()
            count = int(
                self.llama.llama_tokenize(
                    self.vocab, data, len(data), ids, room, add_special, parse_special
                )
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

    def special_piece(self, token_id: int) -> bytes:
        """A token's bytes with a control token's text shown (what is decoded when some
        special tokens are kept)."""
        piece = self._special_pieces.get(token_id)
        if piece is None:
            piece = self._piece(token_id, special=True)
            self._special_pieces[token_id] = piece
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

    def control_ids(self) -> dict[int, str]:
        """Each token llama.cpp reads as special only when told to (control and unknown
        tokens), by id, with its text."""
        llama = self.llama
        special = int(llama.LLAMA_TOKEN_ATTR_CONTROL) | int(llama.LLAMA_TOKEN_ATTR_UNKNOWN)
        return {
            token_id: self.token_text(token_id)
            for token_id in range(self.n_vocab)
            if int(llama.llama_vocab_get_attr(self.vocab, token_id)) & special
        }

    def control_tokens(self) -> dict[str, int]:
        """The text of each control token and its id: what chat content may not write."""
        tokens: dict[str, int] = {}
        for token_id, text in self.control_ids().items():
            if text:
                tokens.setdefault(text, token_id)
        return tokens

    def special_text(self, token_id: int) -> str:
        if token_id < 0:
            return ""
        return self.token_text(token_id)


class Detokenizer:
    """The tokenizer face ``common.text.TextProgress`` decodes with: token ids to text, control
    tokens dropped, an unfinished UTF-8 character at the end shown as U+FFFD (which
    TextProgress holds back until the next token completes it)."""

    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True, **_: Any) -> str:
        runtime = self._runtime
        piece = runtime.piece if skip_special_tokens else runtime.special_piece
        return b"".join(piece(token_id) for token_id in token_ids).decode("utf-8", errors="replace")

    @functools.cached_property
    def added_tokens_decoder(self) -> dict[int, str]:
        """The control tokens by id, as a Hugging Face tokenizer lists its special tokens:
        what ``TextProgress`` keeps some of (tool-call markers, Harmony's tokens)."""
        return self._runtime.control_ids()
