"""The error hierarchy.

Every error a pool raises for a request carries the ``request_id`` and one
:class:`Attempt` record per attempt, so a caller (or a log line) can tell what
happened to each try::

    try:
        pool.generate(prompt, deadline_s=5)
    except DeadlineExceeded as exc:
        print(exc.request_id, [a.outcome for a in exc.attempts], exc.partial_text)

    PoolError
    ├── DeadlineExceeded      (also TimeoutError)
    ├── WorkerCrashed
    │   └── PoisonRequest     the suspect: its batches failed, then it failed alone
    ├── BackendError
    │   ├── OutOfMemory       (a CUDA out-of-memory; .device, .bytes_requested)
    │   └── CudaError         (the worker's CUDA context became unusable; it was replaced)
    ├── PoolOverloaded
    │   └── QueueFull         its predicted wait passes max_queue_time_s or its deadline
    ├── PoolClosed
    ├── ModelLoadFailed
    │   ├── ModelSourceError  found before any worker started (preflight.py)
    │   ├── ModelUnavailable  a registry's model failed; its load backs off (registry.py)
    │   │   └── MemoryNotReleased  the memory a swap freed for it was not verified back
    │   └── ModelTooLarge     a registry's model does not fit its memory budget
    ├── ModelNotFound         (also LookupError) a registry has no model of that name
    ├── DeviceError           (also ValueError) found before any worker started
    └── InvalidRequest        (also ValueError)
        ├── ContextLengthExceeded
        ├── WrongTask             embed on a generation model, generate on an embedding one
        └── GrammarError          a response_format or grammar that cannot be honoured
            ├── GrammarCompileTimeout   its compilation outlasted grammar_compile_timeout_s
            ├── SchemaTooComplex        past a bound on the work of checking it
            └── GrammarEngineMissing    llguidance is not installed

``ModelSourceError`` and ``DeviceError`` are both a ``PreflightError``: the checks
``ModelPool.start()`` runs before it spawns a worker (:mod:`modelpool.supervisor.preflight`).
Their message is one line that names the problem and what to change.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Outcome = Literal[
    "ok", "timeout", "crash", "cancelled", "error", "collateral", "preempted", "oom", "cuda_error"
]
"""What became of one attempt. "collateral": the request's worker died or was killed because of
something in its batch while the request had shown its caller nothing; it was retried at once
and the attempt is not charged to its retry budget. "preempted": a more urgent request took
its slot (``preempt_for_priority``); it was queued again, not charged either. "oom": the
backend ran out of GPU memory; "cuda_error": a CUDA error that leaves the worker's context
unusable. "ok" and "cancelled" end a request with a Result, so they are in the dispatcher's
records but never in an error's attempts."""


@dataclass(frozen=True)
class Attempt:
    """One try of a request on one worker."""

    worker_pid: int | None
    outcome: Outcome
    seconds: float


class PoolError(Exception):
    """Base class of every error modelpool raises."""

    def __init__(
        self,
        message: str,
        *,
        request_id: str | None = None,
        attempts: Sequence[Attempt] = (),
    ) -> None:
        super().__init__(message)
        self.message = message
        self.request_id = request_id
        self.attempts: list[Attempt] = list(attempts)

    def __reduce__(self) -> tuple[object, ...]:
        # Keyword-only arguments are lost by the default pickling of exceptions.
        return (_rebuild, (type(self), self.message, self.__dict__))


def _rebuild(cls: type[PoolError], message: str, state: dict[str, object]) -> PoolError:
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    error.__dict__.update(state)
    return error


class DeadlineExceeded(PoolError, TimeoutError):
    """The request's deadline passed (or its attempts ran out on timeouts).

    ``partial_text`` holds what the last attempt produced before it was stopped.
    """

    def __init__(
        self,
        message: str,
        *,
        request_id: str | None = None,
        attempts: Sequence[Attempt] = (),
        partial_text: str = "",
    ) -> None:
        super().__init__(message, request_id=request_id, attempts=attempts)
        self.partial_text = partial_text


class WorkerCrashed(PoolError):
    """The worker died on its own while running the request (exit code or signal in the message)."""

    def __init__(
        self,
        message: str,
        *,
        request_id: str | None = None,
        attempts: Sequence[Attempt] = (),
        exit_code: int | None = None,
    ) -> None:
        super().__init__(message, request_id=request_id, attempts=attempts)
        self.exit_code = exit_code


class PoisonRequest(WorkerCrashed):
    """The request is the suspect of repeated worker failures and is not retried again.

    With batching (``max_batch_size`` above 1), a request that was in two batches whose
    worker hung or crashed, or whose worker hung or crashed while it ran alone, is
    retried alone; if that fails too, it fails with this error. It never takes a third
    batch down.
    """


class BackendError(PoolError):
    """The backend raised while generating; ``remote_traceback`` is the worker's traceback."""

    def __init__(
        self,
        message: str,
        *,
        request_id: str | None = None,
        attempts: Sequence[Attempt] = (),
        remote_traceback: str = "",
    ) -> None:
        super().__init__(message, request_id=request_id, attempts=attempts)
        self.remote_traceback = remote_traceback


class OutOfMemory(BackendError):
    """CUDA ran out of memory for the request.

    ``device`` is the pool's name of the GPU ("cuda:1") and ``bytes_requested`` the
    allocation that failed, each None when torch did not say. The worker emptied its
    cache afterwards and was recycled if its memory did not come back to what it held
    after loading. Retried on another worker ``retry.oom_retries`` times (default 1).
    """

    def __init__(
        self,
        message: str,
        *,
        request_id: str | None = None,
        attempts: Sequence[Attempt] = (),
        remote_traceback: str = "",
        device: str | None = None,
        bytes_requested: int | None = None,
    ) -> None:
        super().__init__(
            message, request_id=request_id, attempts=attempts, remote_traceback=remote_traceback
        )
        self.device = device
        self.bytes_requested = bytes_requested


class CudaError(BackendError):
    """A CUDA error that left the worker's context unusable (an illegal memory access, a
    device-side assert): the worker was killed and replaced, never handed another request.
    Not retried unless ``retry.on`` names "cuda_error"."""


class MalformedToolCall(PoolError):
    """The model wrote text that opens a tool call in its family's syntax (``parser``) but
    cannot be read as a call of an offered tool with valid arguments: an error naming
    ``model``, never content, never a dropped call."""

    def __init__(
        self,
        message: str,
        *,
        model: str,
        parser: str,
        request_id: str | None = None,
        attempts: Sequence[Attempt] = (),
    ) -> None:
        super().__init__(message, request_id=request_id, attempts=attempts)
        self.model = model
        self.parser = parser


class PoolOverloaded(PoolError):
    """The queue is full (``max_queue``); the request was not accepted."""


class QueueFull(PoolOverloaded):
    """The request's predicted time to first token passes ``max_queue_time_s`` or its
    deadline: refused at once rather than accepted to time out later.
    ``predicted_ttft_s`` is the prediction; ``retry_after_s`` how much sooner it would
    have to be, that is how long to wait before trying again."""

    def __init__(self, message: str, *, predicted_ttft_s: float, retry_after_s: float) -> None:
        super().__init__(message)
        self.predicted_ttft_s = predicted_ttft_s
        self.retry_after_s = retry_after_s


class PoolClosed(PoolError):
    """The pool is closed, or closed before the request could finish."""


class ModelLoadFailed(PoolError):
    """Workers cannot start; ``worker_traceback`` is the last start-up failure's traceback."""

    def __init__(
        self,
        message: str,
        *,
        request_id: str | None = None,
        attempts: Sequence[Attempt] = (),
        worker_traceback: str = "",
    ) -> None:
        super().__init__(message, request_id=request_id, attempts=attempts)
        self.worker_traceback = worker_traceback

    def copy(self) -> ModelLoadFailed:
        """The same failure for another caller: each error carries its own ``request_id``."""
        return ModelLoadFailed(self.message, worker_traceback=self.worker_traceback)


class ModelNotFound(PoolError, LookupError):
    """A :class:`~modelpool.supervisor.registry.ModelRegistry` has no model (nor alias) of
    this name."""

    def __init__(self, message: str, *, model: str) -> None:
        super().__init__(message)
        self.model = model


class ModelUnavailable(ModelLoadFailed):
    """A registry's model is ``failed``: its last load failed (or its pool died), and the
    next load is not tried before ``retry_after_s`` (exponential backoff). Raised at once,
    never after a timeout; every other model keeps serving::

        except ModelUnavailable as exc:
            exc.model, exc.reason, exc.retry_after_s
    """

    def __init__(self, message: str, *, model: str, reason: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.model = model
        self.reason = reason
        self.retry_after_s = retry_after_s

    def copy(self) -> ModelUnavailable:
        return ModelUnavailable(
            self.message, model=self.model, reason=self.reason, retry_after_s=self.retry_after_s
        )


class MemoryNotReleased(ModelUnavailable):
    """A registry did not start a model's workers because memory it had to free first
    (an evicted model's processes, or GPU memory NVML still lists) was not verified
    released within the load's deadline. ``held_by`` names the models whose memory is
    not back; the next load is tried once it is (or after ``retry_after_s``)."""

    def __init__(
        self,
        message: str,
        *,
        model: str,
        reason: str,
        retry_after_s: float,
        held_by: tuple[str, ...],
    ) -> None:
        super().__init__(message, model=model, reason=reason, retry_after_s=retry_after_s)
        self.held_by = held_by

    def copy(self) -> MemoryNotReleased:
        return MemoryNotReleased(
            self.message,
            model=self.model,
            reason=self.reason,
            retry_after_s=self.retry_after_s,
            held_by=self.held_by,
        )


class ModelTooLarge(ModelLoadFailed):
    """A registry's model needs more of a resource than its budget leaves it, even with
    every model that may be evicted unloaded. ``resource`` is "memory" (host RAM, the
    workers' RSS) or a GPU ("cuda:0"); ``needed_bytes`` what the model was measured to
    take, ``available_bytes`` what the budget leaves beside the pinned models, and
    ``budget_bytes`` the whole budget."""

    def __init__(
        self,
        message: str,
        *,
        model: str,
        resource: str,
        needed_bytes: int,
        available_bytes: int,
        budget_bytes: int,
    ) -> None:
        super().__init__(message)
        self.model = model
        self.resource = resource
        self.needed_bytes = needed_bytes
        self.available_bytes = available_bytes
        self.budget_bytes = budget_bytes

    def copy(self) -> ModelTooLarge:
        return ModelTooLarge(
            self.message,
            model=self.model,
            resource=self.resource,
            needed_bytes=self.needed_bytes,
            available_bytes=self.available_bytes,
            budget_bytes=self.budget_bytes,
        )


class PreflightError(PoolError):
    """A check before any worker started found that the pool cannot run as configured."""


class ModelSourceError(PreflightError, ModelLoadFailed):
    """The model cannot be loaded from where it is said to be: a hub id that is neither
    cached nor downloadable, or a directory that lacks what a model needs. Also a
    ``ModelLoadFailed``, which is what the workers would have ended in, later."""


class DeviceError(PreflightError, ValueError):
    """``devices`` or ``gpus_per_worker`` names GPUs this machine does not have."""


class InvalidRequest(PoolError, ValueError):
    """The request was rejected before anything was dispatched."""


class ContextLengthExceeded(InvalidRequest):
    """The prompt plus the new tokens asked for do not fit in the model's context.

    Refused by the worker before generation starts; the numbers are kept for
    callers that shorten and resend::

        except ContextLengthExceeded as exc:
            room = exc.max_model_len - exc.prompt_tokens   # new tokens that would fit

    ``max_new_tokens`` is None when the caller asked for none and the prompt
    alone leaves no room for even one new token.
    """

    def __init__(
        self,
        message: str | None = None,
        *,
        prompt_tokens: int,
        max_new_tokens: int | None,
        max_model_len: int,
        request_id: str | None = None,
        attempts: Sequence[Attempt] = (),
    ) -> None:
        if message is None:
            message = context_length_message(prompt_tokens, max_new_tokens, max_model_len)
        super().__init__(message, request_id=request_id, attempts=attempts)
        self.prompt_tokens = prompt_tokens
        self.max_new_tokens = max_new_tokens
        self.max_model_len = max_model_len


def context_length_message(
    prompt_tokens: int, max_new_tokens: int | None, max_model_len: int
) -> str:
    """vLLM's wording, which clients parse for the numbers."""
    if max_new_tokens is None:
        return (
            f"This model's maximum context length is {max_model_len} tokens. However, "
            f"your prompt is {prompt_tokens} tokens, which leaves no room for a completion. "
            "Please reduce the length of the prompt."
        )
    return (
        f"This model's maximum context length is {max_model_len} tokens. However, you "
        f"requested {prompt_tokens + max_new_tokens} tokens ({prompt_tokens} in the prompt, "
        f"{max_new_tokens} for the completion). Please reduce the length of the prompt "
        "or max_new_tokens."
    )


class WrongTask(InvalidRequest):
    """The request asks the model for what it does not do: an embedding of a generation
    model, a generation of an embedding model, an embedding of a cross-encoder. ``task``
    is what the model does (``"generate"``, ``"embed"`` or ``"score"``)."""

    def __init__(
        self,
        message: str,
        *,
        task: str,
        request_id: str | None = None,
        attempts: Sequence[Attempt] = (),
    ) -> None:
        super().__init__(message, request_id=request_id, attempts=attempts)
        self.task = task


class ImageRefused(InvalidRequest):
    """An image in the request that is not served: over a limit, not an image, truncated,
    a remote URL the operator did not allow, or sent to a model that reads no images when
    ``unsupported_images = "refuse"``. ``part`` names it (``"messages[1].content[0]"``);
    ``reason`` is a short machine-readable word (``"too_many_pixels"``, ``"not_an_image"``,
    ``"model_not_multimodal"``, ...)::

        except ImageRefused as exc:
            print(exc.part, exc.reason)
    """

    def __init__(
        self,
        message: str,
        *,
        part: str,
        reason: str,
        request_id: str | None = None,
        attempts: Sequence[Attempt] = (),
    ) -> None:
        super().__init__(message, request_id=request_id, attempts=attempts)
        self.part = part
        self.reason = reason


class GrammarError(InvalidRequest):
    """A structured-output constraint (``response_format``, ``grammar``) that the grammar
    engine cannot honour: refused, never ignored.

    ``param`` says where in the request (``"response_format.json_schema.schema.properties.x
    .format"``), ``keyword`` the JSON-schema keyword refused when one is to blame.
    """

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        keyword: str | None = None,
        request_id: str | None = None,
        attempts: Sequence[Attempt] = (),
    ) -> None:
        super().__init__(message, request_id=request_id, attempts=attempts)
        self.param = param
        self.keyword = keyword


class SchemaTooComplex(GrammarError):
    """A structured-output constraint past one of the supervisor's bounds on the work of
    checking it (``bound`` names it: ``schema_nodes``, ``allof_branches``, ``choices``,
    ``grammar_bytes``, ``check_seconds``); refused before the grammar engine runs on it."""

    def __init__(self, message: str, *, bound: str, param: str | None = None) -> None:
        super().__init__(message, param=param)
        self.bound = bound


class GrammarCompileTimeout(GrammarError):
    """The grammar did not compile within ``grammar_compile_timeout_s`` (``bound_s``). The
    worker stays warm: the compilation runs off its decoding loop, which never waited."""

    def __init__(
        self,
        message: str,
        *,
        bound_s: float,
        param: str | None = None,
        request_id: str | None = None,
        attempts: Sequence[Attempt] = (),
    ) -> None:
        super().__init__(message, param=param, request_id=request_id, attempts=attempts)
        self.bound_s = bound_s


class GrammarEngineMissing(GrammarError):
    """Structured outputs need llguidance (``pip install 'modelpool[structured]'``)."""
