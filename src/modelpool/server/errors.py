"""What each of the pool's typed errors answers over HTTP (the README's error table):
``pool_error_to_api`` for the daemon's routes and its streams alike.
"""

from __future__ import annotations

import math
from typing import Any

from modelpool.errors import (
    BackendError,
    ContextLengthExceeded,
    CudaError,
    DeadlineExceeded,
    GrammarCompileTimeout,
    GrammarError,
    InvalidRequest,
    ModelLoadFailed,
    OutOfMemory,
    PoolClosed,
    PoolError,
    PoolOverloaded,
    QueueFull,
    WorkerCrashed,
)
from modelpool.server.http import ApiError

# Seconds a client should wait before trying again: an overloaded queue drains
# quickly; a pool that is not ready is starting or respawning workers.
RETRY_AFTER_OVERLOADED = 1
RETRY_AFTER_UNAVAILABLE = 5


def pool_error_to_api(error: PoolError) -> ApiError:
    """The HTTP status for each of the pool's typed errors (the README's error table)."""
    extra: dict[str, Any] = {
        "request_id": error.request_id,
        "attempts": [
            {"worker_pid": a.worker_pid, "outcome": a.outcome, "seconds": round(a.seconds, 4)}
            for a in error.attempts
        ],
    }
    if isinstance(error, ContextLengthExceeded):
        extra.update(
            prompt_tokens=error.prompt_tokens,
            max_new_tokens=error.max_new_tokens,
            max_model_len=error.max_model_len,
        )
        return ApiError(400, error.message, code="context_length_exceeded", extra=extra)
    if isinstance(error, GrammarCompileTimeout):
        return ApiError(
            400, error.message, code="grammar_compile_timeout", param=error.param, extra=extra
        )
    if isinstance(error, GrammarError):
        return ApiError(
            400, error.message, code="unsupported_value", param=error.param, extra=extra
        )
    if isinstance(error, InvalidRequest):
        return ApiError(400, error.message, code="invalid_value", extra=extra)
    if isinstance(error, QueueFull):
        return ApiError(
            429,
            error.message,
            type="overloaded_error",
            code="queue_full",
            headers={"Retry-After": str(max(1, math.ceil(error.retry_after_s)))},
            extra={**extra, "predicted_ttft_s": round(error.predicted_ttft_s, 3)},
        )
    if isinstance(error, PoolOverloaded):
        return ApiError(
            429,
            error.message,
            type="overloaded_error",
            code="pool_overloaded",
            headers={"Retry-After": str(RETRY_AFTER_OVERLOADED)},
            extra=extra,
        )
    if isinstance(error, DeadlineExceeded):
        extra["partial_text"] = error.partial_text
        return ApiError(
            504, error.message, type="timeout_error", code="deadline_exceeded", extra=extra
        )
    if isinstance(error, WorkerCrashed):
        return ApiError(502, error.message, type="worker_error", code="worker_crashed", extra=extra)
    if isinstance(error, (PoolClosed, ModelLoadFailed)):
        code = "pool_closed" if isinstance(error, PoolClosed) else "model_load_failed"
        return ApiError(
            503,
            error.message,
            type="unavailable_error",
            code=code,
            headers={"Retry-After": str(RETRY_AFTER_UNAVAILABLE)},
            extra=extra,
        )
    if isinstance(error, OutOfMemory):
        # Not 503: the same request would run out of memory again, so no Retry-After.
        extra["device"] = error.device
        extra["bytes_requested"] = error.bytes_requested
        return ApiError(
            507, error.message, type="insufficient_memory_error", code="out_of_memory", extra=extra
        )
    if isinstance(error, CudaError):
        # The worker's GPU context broke under the request; the worker was replaced.
        return ApiError(502, error.message, type="worker_error", code="cuda_error", extra=extra)
    if isinstance(error, BackendError):
        # The model code raised inside the worker: a server-side failure, kept as 500.
        return ApiError(500, error.message, type="backend_error", code="backend_error", extra=extra)
    # A bare PoolError (e.g. "not started"): the pool cannot take requests now.
    return ApiError(
        503,
        error.message,
        type="unavailable_error",
        code="pool_error",
        headers={"Retry-After": str(RETRY_AFTER_UNAVAILABLE)},
        extra=extra,
    )


def shutting_down() -> ApiError:
    return ApiError(
        503,
        "the server is shutting down; the request was cancelled",
        type="unavailable_error",
        code="shutting_down",
        headers={"Retry-After": str(RETRY_AFTER_UNAVAILABLE), "Connection": "close"},
    )
