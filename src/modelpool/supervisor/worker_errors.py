"""What a worker's error messages become: the typed errors of ``errors.py``.

The dispatcher reads a worker's ``("error", ...)`` and ``("batch_error", ...)`` messages
(kind, text, the remote traceback, details) and fails or retries the request with one
of these: a refusal (the request's own fault, never retried) or a backend's failure
(an out-of-memory, a CUDA error, an exception), with the attempt's outcome.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from modelpool.shared.errors import (
    BackendError,
    ContextLengthExceeded,
    CudaError,
    ImageRefused,
    InvalidRequest,
    Outcome,
    OutOfMemory,
    WrongTask,
)
from modelpool.shared.grammar import grammar_refusal
from modelpool.supervisor.records import Worker
from modelpool.supervisor.worker_manager import pool_device


def worker_refusal(
    text: str, detail: tuple[int, int | None, int] | Mapping[str, Any] | None
) -> InvalidRequest:
    """The typed error for a worker's refusal; ``detail`` carries a context refusal's numbers
    or a grammar refusal's bound, param and keyword, or the task of a model asked for another,
    or the part and reason of a refused image."""
    if isinstance(detail, Mapping):
        if "task" in detail:
            return WrongTask(text, task=str(detail["task"]))
        if "reason" in detail and "part" in detail:
            return ImageRefused(text, part=str(detail["part"]), reason=str(detail["reason"]))
        return grammar_refusal(text, detail)
    if detail is None:
        return InvalidRequest(text)
    prompt_tokens, max_new_tokens, max_model_len = detail
    return ContextLengthExceeded(
        text,
        prompt_tokens=prompt_tokens,
        max_new_tokens=max_new_tokens,
        max_model_len=max_model_len,
    )


def typed_backend_error(
    worker: Worker, kind: str, text: str, remote_traceback: str, details: Mapping[str, Any]
) -> tuple[Outcome, BackendError]:
    """The attempt's outcome and the typed error for what a worker's backend raised."""
    if kind == "oom":
        device = pool_device(worker, details.get("device"))
        return "oom", OutOfMemory(
            f"CUDA out of memory on worker pid {worker.pid} ({device or worker.device}): {text}",
            remote_traceback=remote_traceback,
            device=device,
            bytes_requested=details.get("bytes_requested"),
        )
    if kind == "cuda_error":
        return "cuda_error", CudaError(
            f"CUDA error on worker pid {worker.pid} ({worker.device}); the worker was "
            f"replaced: {text}",
            remote_traceback=remote_traceback,
        )
    return "error", BackendError(
        f"the backend raised on worker pid {worker.pid}: {text}",
        remote_traceback=remote_traceback,
    )
