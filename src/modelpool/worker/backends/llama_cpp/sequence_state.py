"""One llama.cpp sequence's KV state as bytes, and back: what the prefix tiers keep of a
llama_cpp cache entry (``llama_state_seq_get_data``/``llama_state_seq_set_data``).

A saved state is framed: a header (magic, token count, state length, CRC-32), the token
ids its cells hold, then llama.cpp's own bytes. llama.cpp's format holds no tokens, and
it loads corrupted bytes without a word (flipped KV bytes give wrong answers, shuffled
positions a sequence with holes), so nothing reaches ``llama_state_seq_set_data`` before
the frame's length and checksum hold, and a restore is used only for the tokens it
shares with the prompt that asked for it. After llama.cpp took the bytes, the sequence
must hold exactly the positions 0..n-1 the frame claims.

The bytes are this build's and this model's: the tiers key them by the model's identity
and llama-cpp-python's version, never handing them to another.
"""

from __future__ import annotations

import ctypes
import struct
import zlib
from dataclasses import dataclass
from typing import Any, Literal, Protocol

MAGIC = b"MPLCSEQ1"
_HEADER = struct.Struct("<8sIQI")  # magic, token count, state bytes, CRC-32 of the rest
_TOKEN = struct.Struct("<i")

Refusal = Literal["truncated", "checksum", "tokens", "refused"]


class StateRefused(ValueError):
    """Bytes that are not a usable saved sequence; ``reason`` says which check failed
    (the tiers count refusals by it)."""

    def __init__(self, reason: Refusal, detail: str) -> None:
        super().__init__(f"saved sequence refused ({reason}): {detail}")
        self.reason: Refusal = reason


class StateContext(Protocol):
    """What saving and restoring need of a loaded model (``runtime.Runtime``)."""

    llama: Any
    context: Any
    memory: Any


@dataclass(frozen=True)
class SavedSequence:
    """A framed state, read and checked: the token ids its cells hold, llama.cpp's bytes."""

    tokens: tuple[int, ...]
    state: memoryview


def save_sequence(
    runtime: StateContext,
    seq_id: int,
    tokens: list[int] | tuple[int, ...],
    scratch: int | None = None,
) -> bytes:
    """The framed state of the first ``len(tokens)`` positions of sequence ``seq_id``,
    whose cells hold ``tokens`` from position 0 (``scratch``: see :func:`state_bytes`)."""
    state = state_bytes(runtime, seq_id, len(tokens), scratch)
    body = struct.pack(f"<{len(tokens)}i", *tokens) + bytes(state)
    return _HEADER.pack(MAGIC, len(tokens), len(state), zlib.crc32(body)) + body


def state_bytes(
    runtime: StateContext, seq_id: int, count: int, scratch: int | None = None
) -> memoryview:
    """llama.cpp's state of the first ``count`` positions of sequence ``seq_id``, unframed
    (the tiers' entries carry their own checksum and ids). When the sequence holds more,
    its prefix is shared into the empty sequence ``scratch`` (cells are shared in a
    unified cache, not copied), saved from there, and ``scratch`` emptied again."""
    llama, memory = runtime.llama, runtime.memory
    held = int(llama.llama_memory_seq_pos_max(memory, seq_id)) + 1
    if held == count or scratch is None:
        return _whole_state(runtime, seq_id, count)
    llama.llama_memory_seq_cp(memory, seq_id, scratch, 0, count)
    try:
        return _whole_state(runtime, scratch, count)
    finally:
        llama.llama_memory_seq_rm(memory, scratch, -1, -1)


def _whole_state(runtime: StateContext, seq_id: int, count: int) -> memoryview:
    llama, context = runtime.llama, runtime.context
    _check_positions(runtime, seq_id, count)
    size = int(llama.llama_state_seq_get_size(context, seq_id))
    out = bytearray(size)
    target = (ctypes.c_uint8 * size).from_buffer(out)
    written = int(llama.llama_state_seq_get_data(context, target, size, seq_id))
    del target  # the ctypes view of ``out`` ends here
    if written != size:
        raise RuntimeError(f"llama_state_seq_get_data wrote {written} of {size} bytes")
    return memoryview(out)


def read_saved(blob: bytes | bytearray | memoryview) -> SavedSequence:
    """The frame of ``blob`` checked (length, magic, checksum) and read; StateRefused when
    it is not whole."""
    view = memoryview(blob).cast("B")
    if len(view) < _HEADER.size:
        raise StateRefused("truncated", f"{len(view)} bytes, shorter than the header")
    magic, count, size, checksum = _HEADER.unpack_from(view, 0)
    if magic != MAGIC:
        raise StateRefused("checksum", "not a saved llama_cpp sequence (magic)")
    expected = _HEADER.size + count * _TOKEN.size + size
    if len(view) != expected:
        raise StateRefused("truncated", f"{len(view)} bytes where the header says {expected}")
    if zlib.crc32(view[_HEADER.size :]) != checksum:
        raise StateRefused("checksum", "the CRC-32 does not match")
    tokens_end = _HEADER.size + count * _TOKEN.size
    tokens = struct.unpack_from(f"<{count}i", view, _HEADER.size)
    return SavedSequence(tuple(tokens), view[tokens_end:])


def restore_sequence(
    runtime: StateContext,
    blob: bytes | bytearray | memoryview,
    seq_id: int,
    prompt: list[int],
    limit: int,
) -> int:
    """Load the framed state ``blob`` into the empty sequence ``seq_id`` and keep the
    longest prefix of it that ``prompt`` shares, at most ``limit`` tokens; return how many
    tokens the sequence then holds. StateRefused (the sequence left empty) when the frame
    is not whole, shares nothing with ``prompt`` or llama.cpp refuses it."""
    saved = read_saved(blob)
    shared = _shared_length(saved.tokens, prompt, limit)
    if shared == 0:
        raise StateRefused("tokens", "the saved tokens are not a prefix of the prompt")
    load_state(runtime, saved.state, seq_id, len(saved.tokens), shared)
    return shared


def load_state(
    runtime: StateContext, state: bytes | memoryview, seq_id: int, count: int, keep: int
) -> None:
    """Load llama.cpp's checked bytes ``state`` of ``count`` positions into the empty
    sequence ``seq_id`` and keep its first ``keep``; StateRefused (the sequence left
    empty) when llama.cpp refuses them or they do not hold positions 0..count-1."""
    import numpy as np

    llama, context, memory = runtime.llama, runtime.context, runtime.memory
    # llama.cpp only reads the buffer: it is passed in place, not copied.
    source = np.frombuffer(state, dtype=np.uint8)
    pointer = source.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
    read = int(llama.llama_state_seq_set_data(context, pointer, len(source), seq_id))
    if read != len(source):
        llama.llama_memory_seq_rm(memory, seq_id, -1, -1)
        raise StateRefused("refused", f"llama.cpp read {read} of {len(source)} bytes")
    try:
        _check_positions(runtime, seq_id, count)
    except RuntimeError as exc:
        llama.llama_memory_seq_rm(memory, seq_id, -1, -1)
        raise StateRefused("refused", str(exc)) from None
    if keep < count:
        llama.llama_memory_seq_rm(memory, seq_id, keep, -1)


def _shared_length(tokens: tuple[int, ...], prompt: list[int], limit: int) -> int:
    length = min(len(tokens), len(prompt), limit)
    for index in range(length):
        if tokens[index] != prompt[index]:
            return index
    return max(0, length)


def _check_positions(runtime: StateContext, seq_id: int, count: int) -> None:
    """RuntimeError unless sequence ``seq_id`` spans exactly positions 0..count-1."""
    llama, memory = runtime.llama, runtime.memory
    low = int(llama.llama_memory_seq_pos_min(memory, seq_id))
    high = int(llama.llama_memory_seq_pos_max(memory, seq_id))
    if (low, high) != (0, count - 1):
        raise RuntimeError(
            f"sequence {seq_id} holds positions {low}..{high}, not the 0..{count - 1} of its tokens"
        )
