"""Messages between the supervisor and a worker, and the backend interface.

The wire is a Unix socket pair carrying length-prefixed pickles of plain
tuples whose first item is the message kind. Tuples keep the per-request
cost to a few microseconds; the kinds below are the whole vocabulary, and
``PROTOCOL_VERSION`` is checked once, in the ``ready`` handshake, so a worker
from another modelpool version is refused instead of misread.

supervisor -> worker::

    ("init", WorkerSpec)                    first message, once
    ("run", attempt_id, payload)            start one attempt; payload is
                                            pickle.dumps((prompt, params)), made once by
                                            the caller's thread (see encode_request); params
                                            are the caller's own: the worker adds the
                                            spec's generation_defaults
    ("stop",)                               finish and exit (close, recycling)

worker -> supervisor::

    ("ready", version, pid, rss_bytes, max_model_len)
                                            backend loaded; max_model_len: its context
                                            length in tokens, or None if it has none
    ("load_failed", traceback_text)         backend could not load; the worker exits
    ("chunk", attempt_id, text)             streamed text
    ("done", attempt_id, Generation, rss_bytes)
    ("error", attempt_id, kind, message, traceback_text, rss_bytes[, detail])
                                            kind: "invalid" (handler.validate refused),
                                            "context_length" (detail: prompt_tokens,
                                            max_new_tokens, max_model_len) or "backend"
    ("log", levelno, logger_name, message)  a worker log record

The cancel flag and the progress counter are not messages: they live in a
small shared memory block (see ``ControlBlock``) so that the hot check in the
backend's decoding loop costs a memory read, not a system call.
"""

from __future__ import annotations

import mmap
import os
import pickle
import socket
import struct
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

PROTOCOL_VERSION = 2

FinishReason = Literal["stop", "length", "cancelled"]
ChatMessage = Mapping[str, str]

MAX_TOP_LOGPROBS = 20
"""The most alternatives a request may ask for per token (``logprobs``, ``prompt_logprobs``)."""


@dataclass(frozen=True)
class TokenIds:
    """A prompt given as token ids of the model's own vocabulary, fed to the model as is
    (no template, no special tokens added): ``pool.generate(TokenIds((1, 2, 3)))``."""

    ids: tuple[int, ...]


Prompt = str | Sequence[ChatMessage] | TokenIds


@dataclass(frozen=True)
class TokenLogprob:
    """One token and its log probability under the model (before any sampling settings).

    ``top`` holds the most likely alternatives at that position, most likely first, as
    ``(token_id, token_text, logprob)``. A prompt's first token has no logprob (nothing
    precedes it): ``logprob`` is None and ``top`` is empty.
    """

    token_id: int
    token: str
    logprob: float | None
    top: tuple[tuple[int, str, float], ...] = ()


_FRAME_HEADER = struct.Struct("!I")


@dataclass
class Generation:
    """What a backend returns for one request (a plain ``str`` means finish_reason "stop").

    ``logprobs`` (one per generated token) is set when the request asked for
    ``logprobs=N``, ``prompt_logprobs`` (one per prompt token) for ``prompt_logprobs=N``;
    both are None otherwise.
    """

    text: str
    finish_reason: FinishReason = "stop"
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None


class Call(Protocol):
    """The per-request object a backend's ``generate`` receives.

    A pool's call also has ``defaulted``: the names in ``params`` that came from
    the pool's ``generation_defaults`` rather than from the caller. A
    backend may shrink those to fit (a default ``max_new_tokens`` capped to the
    context left) where it must refuse the caller's own. It is not a member here
    so that a Call built by hand stays one; read it with ``getattr(call,
    "defaulted", ())``.
    """

    prompt: Prompt
    params: dict[str, Any]

    def cancelled(self) -> bool:
        """True once the supervisor asked this request to stop. Cheap: call it every token."""
        ...

    def emit(self, text: str) -> None:
        """Send a chunk of generated text to the caller as soon as it exists."""
        ...


class Handler(Protocol):
    """What a backend factory returns: one per worker, loaded once.

    A handler that knows its model's context length says so in a
    ``max_model_len`` attribute (int tokens, or None); the worker reports it to
    the pool when ready, and the handler refuses a request that does not fit
    (see ``modelpool.context.fit_to_context``).
    """

    def generate(self, call: Call) -> str | Generation: ...


BackendFactory = Callable[..., Handler]


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a fresh worker process needs to become ready."""

    model: str
    backend: str
    backend_options: dict[str, Any]
    device: str
    sys_path: list[str]
    log_level: int
    # Merged under each request's own params in the worker, which can then tell a
    # default from the caller's choice (see Call) at no cost to the dispatch path.
    generation_defaults: dict[str, Any]


MAX_FRAME_BYTES = 1 << 30


class ProtocolError(Exception):
    """A peer sent something that is not a well-formed modelpool message."""


def encode_frame(message: tuple[Any, ...]) -> bytes:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _FRAME_HEADER.pack(len(payload)) + payload


def encode_request(prompt: Prompt, params: dict[str, Any]) -> bytes:
    """The run payload. Pickled on the caller's thread so that an argument that cannot be
    pickled is the caller's error, and the dispatcher and every retry reuse the bytes."""
    return pickle.dumps((prompt, params), protocol=pickle.HIGHEST_PROTOCOL)


def recv_frame(sock: socket.socket) -> tuple[Any, ...] | None:
    """Blocking read of one message (the worker's side); None at end of stream."""
    header = _recv_exactly(sock, _FRAME_HEADER.size)
    if header is None:
        return None
    (length,) = _FRAME_HEADER.unpack(header)
    payload = _recv_exactly(sock, length)
    if payload is None:
        return None
    message: tuple[Any, ...] = pickle.loads(payload)
    return message


def _recv_exactly(sock: socket.socket, size: int) -> bytearray | None:
    buffer = bytearray(size)
    view = memoryview(buffer)
    received = 0
    while received < size:
        count = sock.recv_into(view[received:])
        if not count:
            return None
        received += count
    return buffer


class FrameDecoder:
    """Accumulates bytes read from a non-blocking socket and yields complete messages.

    Raises ProtocolError for a frame that cannot be a message (oversized, not a
    tuple, not unpicklable here); the caller treats that worker as broken.
    """

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[tuple[Any, ...]]:
        self._buffer += data
        messages: list[tuple[Any, ...]] = []
        offset = 0
        header_size = _FRAME_HEADER.size
        while len(self._buffer) - offset >= header_size:
            (length,) = _FRAME_HEADER.unpack_from(self._buffer, offset)
            if length > MAX_FRAME_BYTES:
                raise ProtocolError(f"a frame of {length} bytes")
            end = offset + header_size + length
            if len(self._buffer) < end:
                break
            try:
                message = pickle.loads(self._buffer[offset + header_size : end])
            except Exception as exc:
                raise ProtocolError(f"a message that cannot be unpickled: {exc!r}") from exc
            if not isinstance(message, tuple) or not message:
                raise ProtocolError(f"a message that is not a tuple: {type(message).__name__}")
            messages.append(message)
            offset = end
        if offset:
            del self._buffer[:offset]
        return messages


class ControlBlock:
    """Shared memory between the supervisor and one worker.

    Two unsigned 64-bit words: ``cancel_attempt`` (the attempt id the
    supervisor wants stopped) and ``progress`` (bumped by the worker on every
    cancel check and every emitted chunk). Naming the attempt, rather than
    setting a boolean, means a late cancel can never stop the next request.
    Aligned 8-byte loads and stores are atomic on the platforms torch runs on.
    The block is an anonymous file (memfd where available) whose descriptor is
    inherited by the worker, so nothing is left in /dev/shm if either side dies.
    """

    SIZE = 16

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._map = mmap.mmap(fd, self.SIZE)
        self._words = memoryview(self._map).cast("Q")

    @classmethod
    def create(cls) -> ControlBlock:
        if hasattr(os, "memfd_create"):
            # Close-on-exec: only the worker it is passed to (pass_fds) inherits it.
            fd = os.memfd_create("modelpool-control")
        else:
            with tempfile.TemporaryFile() as handle:
                fd = os.dup(handle.fileno())
        os.ftruncate(fd, cls.SIZE)
        return cls(fd)

    @property
    def cancel_attempt(self) -> int:
        return int(self._words[0])

    @cancel_attempt.setter
    def cancel_attempt(self, attempt_id: int) -> None:
        self._words[0] = attempt_id

    @property
    def progress(self) -> int:
        return int(self._words[1])

    def bump_progress(self) -> None:
        self._words[1] = (self._words[1] + 1) & 0xFFFFFFFFFFFFFFFF

    def close(self) -> None:
        self._words.release()
        self._map.close()
        os.close(self.fd)
