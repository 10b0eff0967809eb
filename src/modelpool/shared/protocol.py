"""Messages between the supervisor and a worker, and the backend interface.

The wire is a Unix socket pair carrying length-prefixed pickles of plain
tuples whose first item is the message kind. Tuples keep the per-request
cost to a few microseconds; the kinds below are the whole vocabulary, and
``PROTOCOL_VERSION`` is checked once, in the ``ready`` handshake, so a worker
from another modelpool version is refused instead of misread.

supervisor -> worker::

    ("init", WorkerSpec)                    first message, once
    ("run", attempt_id, slot, payload)      start one attempt in batch slot ``slot`` (its
                                            cancel word in the control block); payload is
                                            pickle.dumps((prompt, params)), made once by
                                            the caller's thread (see encode_request); params
                                            are the caller's own: the worker adds the
                                            spec's generation_defaults
    ("withdraw", attempt_id)                give the attempt back if it still waits for KV
                                            room (another worker has room for it)
    ("stop",)                               finish and exit (close, recycling)

worker -> supervisor::

    ("ready", version, pid, rss_bytes, max_model_len, slots, task)
                                            backend loaded; max_model_len: its context
                                            length in tokens, or None if it has none;
                                            slots: how many attempts it runs at once
                                            (1 for a one-call backend); task: what its
                                            model does (Task)
    ("load_failed", traceback_text)         backend could not load; the worker exits
    ("chunk", attempt_id, text, counts)     streamed text; counts: the attempt's TokenCounts
                                            so far, or None when its backend does not say
    ("done", attempt_id, Generation, rss_bytes)
                                            its logprobs as TokenLogprobs columns
    ("error", attempt_id, kind, message, traceback_text, rss_bytes[, detail])
                                            kind: "invalid" (handler.validate refused),
                                            "context_length" (detail: prompt_tokens,
                                            max_new_tokens, max_model_len) or "backend"
    ("batch_error", [attempt_id, ...], kind, message, traceback_text, rss_bytes, detail)
                                            a batched step failed and no one request can
                                            be blamed: these attempts left the batch
                                            together (a lost batch, not each one's error);
                                            the worker goes on with the rest
    ("withdrawn", attempt_id)               given back unstarted, after a "withdraw"
    ("room", kv_free_tokens, [attempt_id, ...])
                                            a batched worker's free KV room and the
                                            attempts admitted but waiting for room, sent
                                            after a step that changed them
    ("log", levelno, logger_name, message)  a worker log record
    ("prefix_cache", PrefixCacheReport)     the backend's prefix cache, after a request that
                                            changed it (placement and stats read it)

The cancel flags and the progress counters are not messages: they live in a
small shared memory block (see ``ControlBlock``) so that the hot check in the
backend's decoding loop costs a memory read, not a system call.

Two backend forms (DESIGN: Backends)
------------------------------------
A **one-call** backend (:class:`Handler`) answers one request per
``generate(call)`` and is all most backends need. A **batched** backend
(:class:`BatchedHandler`) runs up to ``PoolConfig.max_batch_size`` requests
at once, one decoding step at a time, so that the worker loop can admit new
requests and retire finished or cancelled ones between steps::

    handler.admit(call)        # take a request; it produces tokens from the next step() on
    handler.step()             # one decoding step for every admitted request;
                               #   returns the (call, Generation | Exception) pairs that ended
    handler.retire(call)       # drop a request now (cancelled); returns what it has
    handler.abort()            # forget every request (after step() itself raised)

A handler that has these methods is batched when the pool asks for a batch
size above 1 (unless it sets ``batched = False`` for what it loaded), and is
otherwise driven through ``generate`` as before.
"""

from __future__ import annotations

import mmap
import operator
import os
import pickle
import socket
import struct
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal, Protocol, SupportsIndex

from modelpool.shared.images import ImageLimits
from modelpool.shared.prefix_tier import TierSpec

PROTOCOL_VERSION = 7

FinishReason = Literal["stop", "length", "cancelled"]
Task = Literal["generate", "embed", "score"]
"""What a worker's model does: generate text, embed (a bi-encoder, which also scores by
cosine), or score (a cross-encoder: a query and a document in, one relevance score out).
A handler says so in a ``task`` attribute; without one it generates."""
TASKS: tuple[Task, ...] = ("generate", "embed", "score")
ChatMessage = Mapping[str, Any]
"""``{"role", "content"}`` strings; in tool calling an assistant message may carry
``tool_calls`` and a ``tool`` message ``tool_call_id`` and ``name`` (see ``tools``)."""

MAX_TOP_LOGPROBS = 20
"""The most alternatives a request may ask for per token (``logprobs``, ``prompt_logprobs``)."""


@dataclass(frozen=True)
class TokenIds:
    """A prompt given as token ids of the model's own vocabulary, fed to the model as is
    (no template, no special tokens added): ``pool.generate(TokenIds((1, 2, 3)))``."""

    ids: tuple[int, ...]


Prompt = str | Sequence[ChatMessage] | TokenIds
"""What a request asks the model. Which form matters as much as the words:

- a list of chat messages, ``[{"role": "user", "content": "Hello"}]``: rendered with the
  model's chat template. What a chat (instruct) model such as the embedded default
  expects; ``modelpool generate`` and ``/v1/chat/completions`` send this.
- a string, ``"Hello"``: raw text, continued as it is, with no template. Right for a base
  model or a completion (``/v1/completions``, ``generate --raw``); a chat model given a
  bare string does not answer it, it rambles on from it.
- :class:`TokenIds`: token ids, fed to the model as they are.
"""


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
    both are None otherwise. A backend returns a list of :class:`TokenLogprob` or, built
    from its own columns, a ``modelpool.shared.logprob_columns.TokenLogprobs``; the worker sends
    either as the latter (columns, not objects: see that module).
    """

    text: str
    finish_reason: FinishReason = "stop"
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    logprobs: Sequence[TokenLogprob] | None = None
    prompt_logprobs: Sequence[TokenLogprob] | None = None
    # Prompt tokens whose KV came from the backend's prefix cache (not prefilled again).
    cached_tokens: int | None = None
    # A tokenize request's answer: the prompt's token ids (see TokenizeRequest).
    token_ids: list[int] | None = None
    # The stop string (one of the request's ``stop``) that ended the text, when one did.
    stop_sequence: str | None = None
    # An embed or score request's answer (see EmbedRequest, ScoreRequest).
    pooled: PooledAnswer | None = None
    # A reasoning model's thinking tokens (None: not one), and why the worker closed its
    # thinking, when it did ("budget", "reserve", "loop", "deadline"; see docs/reasoning.md).
    reasoning_tokens: int | None = None
    thinking_closed: str | None = None

    def __reduce_ex__(self, protocol: SupportsIndex) -> str | tuple[Any, ...]:
        # Pickled as its fields in order, a constructor call: every answer carries one,
        # and reading back a pickled dict of its ten names cost the dispatcher twice this.
        # A subclass, or an instance with attributes added or deleted, pickles as usual.
        if type(self) is Generation and len(self.__dict__) == len(_GENERATION_NAMES):
            return (Generation, _GENERATION_FIELDS(self))
        return super().__reduce_ex__(protocol)


_GENERATION_NAMES = tuple(field.name for field in fields(Generation))
_GENERATION_FIELDS = operator.attrgetter(*_GENERATION_NAMES)


@dataclass(frozen=True)
class TokenCounts:
    """An attempt's tokens so far, sent with each streamed chunk: its prompt's tokens, the
    tokens generated, and the prompt tokens read from the prefix cache."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@dataclass(frozen=True)
class TokenizeRequest:
    """Not a generation: the worker answers with the token ids its backend would feed the
    model for ``prompt`` (``Generation.token_ids``; ``prompt_tokens`` their count), through
    the same path, chat template included, as a generation's prompt. With
    ``add_generation_prompt`` False, chat messages are rendered without the assistant's
    opening (what vLLM's /tokenize takes)."""

    prompt: Prompt
    add_generation_prompt: bool = True


@dataclass(frozen=True)
class DetokenizeRequest:
    """Not a generation: the worker answers with the text of ``ids`` (``Generation.text``)."""

    ids: tuple[int, ...]


@dataclass(frozen=True)
class EmbedRequest:
    """Not a generation: the worker answers with one vector per input
    (``Generation.pooled.vectors``; ``prompt_tokens`` the tokens read). An input is a text
    or the token ids of one. An input longer than the model's context is refused
    (``ContextLengthExceeded``) unless ``truncate``. ``dimensions``: keep the first that
    many of each vector and renormalise it (Matryoshka); more than the model has is
    refused."""

    inputs: tuple[str | tuple[int, ...], ...]
    truncate: bool = False
    dimensions: int | None = None


@dataclass(frozen=True)
class ScoreRequest:
    """Not a generation: the worker answers with one relevance score of ``query`` per
    document (``Generation.pooled.scores``): a cross-encoder's (the sigmoid of its logit,
    or the logit itself with ``raw_scores``), or an embedding model's cosine similarity."""

    query: str
    documents: tuple[str, ...]
    raw_scores: bool = False
    truncate: bool = False


PoolingRequest = EmbedRequest | ScoreRequest
"""A request for a pooling model (embedding or scoring), not a generation."""


@dataclass(frozen=True)
class PooledAnswer:
    """What an embed or score request got: ``vectors`` (embed) or ``scores`` (score) and
    how they were scored (``method``: "cross-encoder" or "cosine")."""

    vectors: list[list[float]] | None = None
    scores: list[float] | None = None
    method: str = ""


@dataclass(frozen=True)
class PrefixCacheReport:
    """A worker's prefix cache as it last reported it (``handler.prefix_cache_report()``).

    ``fingerprints``: the prefix fingerprints (``modelpool.shared.prefixes``) of the prompts whose
    KV it holds, so that the pool can send a request where its prefix is cached; sent
    again on every change, evictions included, so it never names what is gone."""

    bytes: int = 0
    limit_bytes: int = 0
    entries: int = 0
    hits: int = 0
    lookups: int = 0
    evictions: int = 0
    cached_tokens: int = 0
    fingerprints: frozenset[int] = frozenset()


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


def note_prompt(call: Call, prompt_tokens: int, cached_tokens: int) -> None:
    """Tell ``call`` its prompt's size and how much of it came from the prefix cache, when
    it takes it (a pool's call does, for the token counts of its streamed chunks)."""
    note = getattr(call, "note_prompt", None)
    if note is not None:
        note(prompt_tokens, cached_tokens)


class BatchCall(Call, Protocol):
    """The per-request object a batched backend receives: a ``Call`` that also counts tokens."""

    def delivered(self, tokens: int = 1) -> None:
        """Count generated tokens (held-back text included): the pool's stall clock watches
        these. A one-call backend need not: its ``cancelled()`` checks count as progress."""
        ...

    def prefilled(self, tokens: int) -> None:
        """Count prompt tokens prefilled (a slice of a chunked prefill): progress for the
        pool's stall clock, so that an honest long prompt is never taken for a stall."""
        ...


class Handler(Protocol):
    """What a backend factory returns: one per worker, loaded once.

    A handler that knows its model's context length says so in a
    ``max_model_len`` attribute (int tokens, or None); the worker reports it to
    the pool when ready, and the handler refuses a request that does not fit
    (see ``modelpool.shared.context.fit_to_context``).
    """

    def generate(self, call: Call) -> str | Generation: ...


Finished = tuple[BatchCall, Generation | Exception]
"""A request that left the batch in a step: its Generation, or the exception that ended it
(that request's alone: an ``InvalidRequest`` is the request's fault, anything else a backend
error)."""


class RowsLost(Exception):
    """Raised out of ``BatchedHandler.step``: a forward pass over ``calls`` failed with
    ``cause`` and no one of them can be blamed. They are out of the backend's batch; every
    other request it holds goes on. ``finished``: what ended earlier in the same step,
    answered as a step's return value is."""

    def __init__(
        self,
        calls: list[BatchCall],
        cause: BaseException,
        finished: list[Finished] | None = None,
    ) -> None:
        super().__init__(f"a batched step over {len(calls)} requests failed: {cause!r}")
        self.calls = calls
        self.cause = cause
        self.finished = finished or []


class BatchedHandler(Handler, Protocol):
    """A backend that decodes many requests together (iteration-level batching).

    The worker loop is the only caller, from one thread, in this order per
    iteration: ``admit`` the requests that arrived, ``retire`` the ones whose
    cancel flag is set, then one ``step``. Rules a backend keeps:

    - ``step`` does one unit of work that ends quickly (a decoding step, or the
      prefill of newly admitted requests plus one step): cancel, deadlines and
      admission all wait for it to return.
    - Text goes out through ``call.emit``; every generated token is counted with
      ``call.delivered()``, which is what the pool's stall clock watches.
    - A failure of one request is returned as that request's exception and does
      not end the others. A forward pass over several rows that fails, where no
      one row can be blamed, is raised as :class:`RowsLost` naming the requests
      that were in it (already out of the batch; the others, waiting for room or
      still prefilling, stay). Any other exception raised out of ``step`` means
      the backend's state is unknown: every admitted request is lost with the
      batch and the worker calls ``abort``. Lost requests are not charged with
      the error: the pool retries them as collateral and tracks suspects.
    - ``room()``, optional, returns the free KV room in tokens and the requests
      admitted but waiting for it; the pool places new requests by it.
    - ``retire`` and ``abort`` free what the request held (its KV cache rows).
    - Generation parameters that cannot be honoured per request in a batch are
      never applied to the whole batch nor dropped: such a request waits and
      runs alone, or ``admit`` raises ``InvalidRequest`` naming the field.
    """

    def admit(self, call: BatchCall) -> None: ...

    def step(self) -> list[Finished]: ...

    def retire(self, call: BatchCall) -> Generation: ...

    def abort(self) -> None: ...


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
    max_batch_size: int = 1
    poll_s: float = 0.0  # PoolConfig.worker_poll_s
    # PoolConfig.image_limits: the worker decodes images (worker/images.py) within them.
    image_limits: ImageLimits = field(default_factory=ImageLimits)
    # The model's prefix cache tiers (shared.prefix_tier): the host tier's directory,
    # which the pool owns, and the disk tier's; a backend that keeps none ignores them.
    prefix_tiers: tuple[TierSpec, ...] = ()


MAX_FRAME_BYTES = 1 << 30


class ProtocolError(Exception):
    """A peer sent something that is not a well-formed modelpool message."""


def encode_frame(message: tuple[Any, ...]) -> bytes:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _FRAME_HEADER.pack(len(payload)) + payload


class _Pieces:
    """A pickler's file that keeps what it is given: the pickler hands a large bytes
    object (a request's payload) to ``write`` itself, never copied into its buffer."""

    def __init__(self) -> None:
        self.pieces: list[bytes] = []

    def write(self, data: bytes) -> int:
        self.pieces.append(data)
        return len(data)


def frame_pieces(message: tuple[Any, ...]) -> list[bytes]:
    """The frame of ``message`` (the same bytes as :func:`encode_frame`) in pieces, a large
    bytes item of the message among them as the object itself: a run's payload holding
    an image of 15 MB is not copied three times (pickled, framed, queued) on the
    supervisor's thread, each copy of which held the GIL ~35 ms on a loaded machine."""
    file = _Pieces()
    pickle.Pickler(file, protocol=pickle.HIGHEST_PROTOCOL).dump(message)
    size = sum(len(piece) for piece in file.pieces)
    return [_FRAME_HEADER.pack(size), *file.pieces]


def encode_request(
    prompt: Prompt | TokenizeRequest | DetokenizeRequest | PoolingRequest, params: dict[str, Any]
) -> bytes:
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
    """Shared memory between the supervisor and one worker: cancel flags and progress.

    Unsigned 64-bit words: ``progress`` (word 0, worker-wide), then one
    ``cancel`` word per batch slot, then one ``tokens`` word per slot. The
    supervisor cancels the attempt in slot ``s`` by writing its attempt id into
    that slot's cancel word; naming the attempt, rather than setting a boolean,
    means a late cancel can never stop the next request in the slot. The worker
    bumps ``progress`` for every token it delivers (a one-call worker also on
    every cancel check, as before) and ``tokens`` of the slot that got it; the
    supervisor's stall clock watches ``progress``, so a loop that keeps
    iterating without producing tokens still reads as stalled.
    Aligned 8-byte loads and stores are atomic on the platforms torch runs on.
    The block is an anonymous file (memfd where available) whose descriptor is
    inherited by the worker, so nothing is left in /dev/shm if either side dies;
    its size tells the worker how many slots there are.
    """

    WORD = 8

    def __init__(self, fd: int) -> None:
        self.fd = fd
        size = os.fstat(fd).st_size
        self.slots = max(1, (size // self.WORD - 1) // 2)
        self._map = mmap.mmap(fd, size)
        self._words = memoryview(self._map).cast("Q")

    @classmethod
    def size_for(cls, slots: int) -> int:
        return cls.WORD * (1 + 2 * slots)

    @classmethod
    def create(cls, slots: int = 1) -> ControlBlock:
        if slots < 1:
            raise ValueError(f"a control block needs at least one slot, got {slots}")
        if hasattr(os, "memfd_create"):
            # Close-on-exec: only the worker it is passed to (pass_fds) inherits it.
            fd = os.memfd_create("modelpool-control")
        else:
            with tempfile.TemporaryFile() as handle:
                fd = os.dup(handle.fileno())
        os.ftruncate(fd, cls.size_for(slots))
        return cls(fd)

    def cancel_attempt(self, slot: int) -> int:
        """The attempt id the supervisor wants stopped in ``slot`` (0: none)."""
        return int(self._words[1 + slot])

    def request_cancel(self, slot: int, attempt_id: int) -> None:
        self._words[1 + slot] = attempt_id

    @property
    def progress(self) -> int:
        return int(self._words[0])

    def bump_progress(self, count: int = 1) -> None:
        self._words[0] = (self._words[0] + count) & 0xFFFFFFFFFFFFFFFF

    def slot_tokens(self, slot: int) -> int:
        """Tokens delivered in ``slot`` since the worker started (all attempts)."""
        return int(self._words[1 + self.slots + slot])

    def deliver(self, slot: int, count: int = 1) -> None:
        index = 1 + self.slots + slot
        self._words[index] = (self._words[index] + count) & 0xFFFFFFFFFFFFFFFF
        self.bump_progress(count)

    def close(self) -> None:
        self._words.release()
        self._map.close()
        os.close(self.fd)
