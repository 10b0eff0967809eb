"""What each of the pool's typed errors answers over HTTP (docs/library.md's Errors table):
``pool_error_to_api`` for the daemon's routes and its streams alike; ``error_response``
writes an error in the shape of the route's API (Anthropic's under ``/v1/messages``,
Ollama's under ``/api/``).
"""

from __future__ import annotations

import math
from typing import Any

from fastapi.responses import JSONResponse

from modelpool.server.http import ApiError
from modelpool.shared.errors import (
    BackendError,
    ContextLengthExceeded,
    CudaError,
    DeadlineExceeded,
    GrammarCompileTimeout,
    GrammarError,
    ImageRefused,
    InvalidRequest,
    MalformedToolCall,
    ModelLoadFailed,
    ModelNotFound,
    ModelTooLarge,
    ModelUnavailable,
    OutOfMemory,
    PoolClosed,
    PoolError,
    PoolOverloaded,
    QueueFull,
    SchemaTooComplex,
    WorkerCrashed,
    WrongTask,
)

# Seconds a client should wait before trying again: an overloaded queue drains
# quickly; a pool that is not ready is starting or respawning workers.
RETRY_AFTER_OVERLOADED = 1
RETRY_AFTER_UNAVAILABLE = 5


def pool_error_to_api(error: PoolError) -> ApiError:
    """The HTTP status for each of the pool's typed errors (docs/library.md's Errors table)."""
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
    if isinstance(error, SchemaTooComplex):
        return ApiError(
            400,
            error.message,
            code="schema_too_complex",
            param=error.param,
            extra={**extra, "bound": error.bound},
        )
    if isinstance(error, GrammarError):
        return ApiError(
            400, error.message, code="unsupported_value", param=error.param, extra=extra
        )
    if isinstance(error, WrongTask):
        # The model does not do what the route asks (an embedding model asked to chat).
        extra["task"] = error.task
        return ApiError(400, error.message, code="wrong_task", param="model", extra=extra)
    if isinstance(error, ImageRefused):
        # The reason is the code ("too_many_images", "model_not_multimodal", ...).
        return ApiError(400, error.message, code=error.reason, param=error.part, extra=extra)
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
    if isinstance(error, ModelNotFound):
        # OpenAI's answer, naming no other model.
        return ApiError(
            404,
            f"The model {error.model!r} does not exist",
            code="model_not_found",
            param="model",
        )
    if isinstance(error, ModelTooLarge):
        # Not 503: it would not fit after any wait; the numbers say by how much.
        extra.update(
            model=error.model,
            resource=error.resource,
            needed_bytes=error.needed_bytes,
            available_bytes=error.available_bytes,
            budget_bytes=error.budget_bytes,
        )
        return ApiError(
            507,
            error.message,
            type="insufficient_memory_error",
            code="model_too_large",
            extra=extra,
        )
    if isinstance(error, ModelUnavailable):
        extra.update(model=error.model, reason=error.reason, retry_after_s=error.retry_after_s)
        return ApiError(
            503,
            error.message,
            type="unavailable_error",
            code="model_unavailable",
            headers={"Retry-After": str(max(1, math.ceil(error.retry_after_s)))},
            extra=extra,
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
    if isinstance(error, MalformedToolCall):
        # The model's output, not the request, is at fault: a bad gateway, naming both.
        extra.update(model=error.model, tool_parser=error.parser)
        return ApiError(
            502, error.message, type="model_output_error", code="malformed_tool_call", extra=extra
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


# Anthropic's error ``type`` for each status (its API reference, "Errors"): the anthropic
# clients raise by status and show the type and message.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}
# The routes whose clients read Anthropic's error shape.
ANTHROPIC_PREFIX = "/v1/messages"


def anthropic_error_body(error: ApiError) -> dict[str, Any]:
    """``{"type": "error", "error": {"type", "message"}}``, the daemon's code kept beside
    them. A request past the context says which part does not fit in Anthropic's own
    words, which Claude Code reads: the prompt alone ("prompt is too long: N tokens > M
    maximum": it compacts the conversation), or the prompt and the ``max_tokens`` asked
    ("input length and `max_tokens` exceed context limit: P + N > M": it asks again
    with fewer)."""
    kind = _ANTHROPIC_TYPES.get(error.status)
    if kind is None:
        kind = "api_error" if error.status >= 500 else "invalid_request_error"
    message = error.message
    if error.code == "context_length_exceeded":
        message = _context_message(error)
    body: dict[str, Any] = {"type": kind, "message": message, "code": error.code}
    if error.param is not None:
        body["param"] = error.param
    return {"type": "error", "error": body, "request_id": error.extra.get("request_id")}


def _context_message(error: ApiError) -> str:
    prompt = error.extra.get("prompt_tokens")
    asked = error.extra.get("max_new_tokens")
    limit = error.extra.get("max_model_len")
    if prompt is None or limit is None:
        return f"prompt is too long: {error.message}"
    if asked is None or prompt >= limit:
        return f"prompt is too long: {prompt} tokens > {limit} maximum"
    return (
        f"input length and `max_tokens` exceed context limit: {prompt} + {asked} > {limit}, "
        "decrease input length or `max_tokens` and try again"
    )


# The routes whose clients read Ollama's error shape.
OLLAMA_PREFIX = "/api/"


def ollama_error_body(error: ApiError) -> dict[str, Any]:
    """Ollama's ``{"error": "..."}`` (its clients raise with that string and the status),
    the daemon's code and field beside it."""
    body: dict[str, Any] = {"error": error.message, "code": error.code}
    if error.param is not None:
        body["param"] = error.param
    return body


def error_body(error: ApiError, path: str) -> dict[str, Any]:
    """The error in the shape the route's clients read: Anthropic's under
    ``/v1/messages``, Ollama's under ``/api/``, OpenAI's everywhere else."""
    if path.startswith(ANTHROPIC_PREFIX):
        return anthropic_error_body(error)
    if path.startswith(OLLAMA_PREFIX):
        return ollama_error_body(error)
    return error.body()


def error_response(error: ApiError, path: str) -> JSONResponse:
    """The error as the route's clients read it (``error_body``), with its status."""
    return JSONResponse(error_body(error, path), status_code=error.status, headers=error.headers)
