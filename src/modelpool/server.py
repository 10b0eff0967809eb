"""The HTTP daemon: OpenAI-compatible completions, health, stats and metrics.

``create_app(pool, server_config, model_name)`` builds a FastAPI app that talks
to a started :class:`~modelpool.ModelPool` only through its public API
(``agenerate``, ``astream``, ``stats``). ``modelpool serve`` (``cli.py``) runs it
on uvicorn::

    app = create_app(pool, ServerConfig(), "smollm2-135m-instruct")
    uvicorn.run(app, host="127.0.0.1", port=8000)

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true``
sends server-sent events ending with ``data: [DONE]``), ``GET /v1/models``,
``GET /healthz``, ``GET /readyz``, ``GET /stats``, ``GET /metrics``.

Request bodies are parsed and checked here, field by field, rather than by
pydantic models: every rejection names the OpenAI field the client sent (the
pool's own messages name its kwargs, e.g. ``max_new_tokens``), and a field we
cannot honour (``tools``, penalties...) is a 400, never ignored. A request
becomes one pool request per choice (``n``, a batch of prompts); the response
shapes, logprobs included, are built in ``openai_format``.

Status codes: 400 invalid (``context_length_exceeded`` when the prompt and
``max_tokens`` do not fit the model's context, which ``/v1/models`` reports as
``max_model_len``), 401 missing/bad key, 404/405 unknown route or
method, 413 body too large, 429 ``PoolOverloaded``, 503 ``PoolClosed`` /
``ModelLoadFailed`` / draining, 504 ``DeadlineExceeded``, 502 ``WorkerCrashed``
and ``CudaError``, 507 ``OutOfMemory`` (CUDA), 500 only for ``BackendError``
(the model code raised) or a bug here. Every error says ``x-should-retry``
(true only for 429 and 503, which also carry ``Retry-After``): the pool has
applied its own retry policy already.

A client that disconnects cancels its request in the worker: a task waits on
the ASGI ``receive`` channel for ``http.disconnect`` (no polling) and cancels
the generation, whose cancellation the pool forwards to the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from modelpool.config import ServerConfig
from modelpool.errors import (
    BackendError,
    ContextLengthExceeded,
    CudaError,
    DeadlineExceeded,
    InvalidRequest,
    ModelLoadFailed,
    OutOfMemory,
    PoolClosed,
    PoolError,
    PoolOverloaded,
    WorkerCrashed,
)
from modelpool.metrics import CONTENT_TYPE, PoolMetrics
from modelpool.openai_format import (
    MAX_CHOICES,
    Job,
    choice_logprobs,
    response_body,
    total_usage,
)
from modelpool.protocol import MAX_TOP_LOGPROBS, Prompt, TokenIds
from modelpool.validation import MAX_INT, is_int, is_number

if TYPE_CHECKING:
    from modelpool.pool import AsyncPoolStream, ModelPool, Result

logger = logging.getLogger(__name__)
access_logger = logging.getLogger("modelpool.access")

T = TypeVar("T")

OPEN_PATHS = frozenset({"/healthz", "/readyz"})
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
TIMEOUT_HEADER = "x-request-timeout"
# Seconds a client should wait before trying again: an overloaded queue drains
# quickly; a pool that is not ready is starting or respawning workers.
RETRY_AFTER_OVERLOADED = 1
RETRY_AFTER_UNAVAILABLE = 5
# Whether a client should send a failed request again, said on every error answer in
# the header the openai client obeys (x-should-retry) and, for the retryable ones, with
# Retry-After. Only "not now" answers are retryable: the pool was full or not ready.
# A deadline the caller set, a crash or a model error has been through the pool's own
# retry policy already; sending it again would multiply the work (and the wait).
SHOULD_RETRY_HEADER = "x-should-retry"
RETRYABLE_STATUSES = frozenset({429, 503})
# nginx's convention for "client closed the request": logged, never sent.
STATUS_CLIENT_GONE = 499
READY_WORKER_STATES = frozenset({"idle", "busy", "spare"})

# Fields accepted without effect: they do not change what is generated.
_IGNORED_FIELDS = frozenset(
    {
        "model",
        "user",
        "metadata",
        "store",
        "service_tier",
        "safety_identifier",
        "prompt_cache_key",
        "parallel_tool_calls",
    }
)
_COMMON_FIELDS = frozenset(
    {
        "max_tokens",
        "temperature",
        "top_p",
        "stop",
        "seed",
        "stream",
        "stream_options",
        "n",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "logprobs",
        "timeout",
    }
)
_COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "suffix", "echo", "best_of"}
_CHAT_FIELDS = _COMMON_FIELDS | {
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "response_format",
    "modalities",
    "audio",
    "prediction",
    "reasoning_effort",
    "web_search_options",
}
# Chat roles a plain chat template understands; "developer" is OpenAI's newer
# name for "system" and is passed on as such.
_CHAT_ROLES = frozenset({"system", "developer", "user", "assistant"})


# --------------------------------------------------------------------------------------------
# Errors


class ApiError(Exception):
    """An HTTP error with an OpenAI-style body: ``{"error": {message, type, param, code}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = {
            SHOULD_RETRY_HEADER: "true" if status in RETRYABLE_STATUSES else "false",
            **(headers or {}),
        }
        self.extra = dict(extra or {})

    def body(self) -> dict[str, Any]:
        error = {
            "message": self.message,
            "type": self.type,
            "param": self.param,
            "code": self.code,
            **self.extra,
        }
        return {"error": error}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def invalid(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


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
    if isinstance(error, InvalidRequest):
        return ApiError(400, error.message, code="invalid_value", extra=extra)
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


# --------------------------------------------------------------------------------------------
# Request parsing


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def parse_json_object(raw: bytes) -> dict[str, Any]:
    try:
        data = json.loads(raw, parse_constant=_reject_constant)
    except RecursionError:
        raise invalid("request body is nested too deeply", code="invalid_json") from None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors.
        raise invalid(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise invalid(
            f"request body must be a JSON object, got {type(data).__name__}", code="invalid_json"
        )
    where = _lone_surrogate_at(data, "")
    if where is not None:
        # Valid JSON ("\ud800") but not Unicode text: no worker could take it, and the
        # answer that echoes it could not be encoded.
        raise invalid(
            f"{where or 'the body'} contains a lone surrogate escape: not valid Unicode text",
            param=where or None,
        )
    return data


def _lone_surrogate_at(value: object, path: str) -> str | None:
    """The path of the first string holding a lone surrogate, or None."""
    stack: list[tuple[object, str]] = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return where
        elif isinstance(item, dict):
            for key, child in item.items():
                if _lone_surrogate_at(key, "") is not None:
                    return f"{where}.{key!r}" if where else repr(key)
                stack.append((child, f"{where}.{key}" if where else key))
        elif isinstance(item, list):
            stack.extend((child, f"{where}[{index}]") for index, child in enumerate(item))
    return None


def _check_fields(body: Mapping[str, Any], allowed: frozenset[str]) -> None:
    for name in body:
        if name not in allowed and name not in _IGNORED_FIELDS:
            raise invalid(f"unsupported field {name!r}", param=name, code="unsupported_field")
    if "model" in body and body["model"] is not None and not isinstance(body["model"], str):
        raise invalid("model must be a string", param="model")


def _opt_int(body: Mapping[str, Any], name: str, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not is_int(value, minimum=minimum):
        raise invalid(
            f"{name} must be an integer in [{minimum}, {MAX_INT}], got {value!r}", param=name
        )
    assert isinstance(value, int)
    return value


def _opt_number(body: Mapping[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if not is_number(value):
        raise invalid(f"{name} must be a number, got {value!r}", param=name)
    return float(value)


def _opt_bool(body: Mapping[str, Any], name: str) -> bool | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise invalid(f"{name} must be true or false, got {value!r}", param=name)
    return value


def _unsupported_unless(condition: bool, name: str, why: str) -> None:
    if not condition:
        raise invalid(f"{name}: {why}", param=name, code="unsupported_value")


def _common_params(body: Mapping[str, Any], max_tokens: int | None) -> dict[str, Any]:
    for name in ("presence_penalty", "frequency_penalty"):
        value = _opt_number(body, name)
        _unsupported_unless(value in (None, 0), name, "penalties are not supported (use 0)")
    logit_bias = body.get("logit_bias")
    _unsupported_unless(
        logit_bias is None or logit_bias == {}, "logit_bias", "logit_bias is not supported"
    )

    params: dict[str, Any] = {}
    if max_tokens is not None:
        params["max_new_tokens"] = max_tokens
    temperature = _opt_number(body, "temperature")
    if temperature is not None:
        if temperature < 0:
            raise invalid(f"temperature must be >= 0, got {temperature!r}", param="temperature")
        params["temperature"] = temperature
    top_p = _opt_number(body, "top_p")
    if top_p is not None:
        if not 0 < top_p <= 1:
            raise invalid(f"top_p must be in (0, 1], got {top_p!r}", param="top_p")
        params["top_p"] = top_p
    seed = _opt_int(body, "seed", 0)
    if seed is not None:
        params["seed"] = seed
    stop = body.get("stop")
    if isinstance(stop, str):
        if not stop:
            raise invalid("stop must not be an empty string", param="stop")
        params["stop"] = [stop]
    elif isinstance(stop, list):
        for index, item in enumerate(stop):
            if not isinstance(item, str) or not item:
                raise invalid(f"stop[{index}] must be a non-empty string", param="stop")
        if stop:
            params["stop"] = list(stop)
    elif stop is not None:
        raise invalid("stop must be a string or a list of strings", param="stop")
    return params


def _stream_flag(body: Mapping[str, Any]) -> bool:
    stream = bool(_opt_bool(body, "stream"))
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise invalid(
                "stream_options is only allowed with stream: true", param="stream_options"
            )
        if not isinstance(options, dict):
            raise invalid("stream_options must be an object", param="stream_options")
        for key, value in options.items():
            _unsupported_unless(
                key == "include_usage" and isinstance(value, bool),
                f"stream_options.{key}",
                "not supported when streaming",
            )
    return stream


def _include_usage(body: Mapping[str, Any]) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


def deadline_from(
    body: Mapping[str, Any], headers: Mapping[str, str], default_s: float, cap_s: float | None
) -> float:
    """Body ``timeout`` wins over the header; both are capped by the server's maximum."""
    value: object = body.get("timeout")
    name = "timeout"
    if value is None and TIMEOUT_HEADER in headers:
        name = "X-Request-Timeout"
        try:
            value = float(headers[TIMEOUT_HEADER])
        except ValueError:
            raise invalid(f"{name} must be a number of seconds", param=name) from None
    if value is None:
        value = default_s
    if not is_number(value) or value <= 0:  # type: ignore[operator]
        raise invalid(f"{name} must be a number of seconds > 0, got {value!r}", param=name)
    seconds = float(value)  # type: ignore[arg-type]
    return min(seconds, cap_s) if cap_s is not None else seconds


def _choice_count(body: Mapping[str, Any], prompts: int) -> tuple[int, int]:
    """``n`` and ``best_of`` (1 when absent), checked against the number of prompts."""
    n = _opt_int(body, "n", 1) or 1
    best_of = _opt_int(body, "best_of", 1) or n
    if best_of < n:
        raise invalid(f"best_of ({best_of}) must be >= n ({n})", param="best_of")
    if prompts * best_of > MAX_CHOICES:
        name = "best_of" if best_of > n else "n"
        raise invalid(
            f"{name}: at most {MAX_CHOICES} generations per request "
            f"({prompts} prompt(s) x {best_of})",
            param=name,
        )
    return n, best_of


def _token_prompt(value: list[Any], where: str) -> TokenIds:
    if not value:
        raise invalid(f"{where} must not be an empty list of token ids", param="prompt")
    for index, token_id in enumerate(value):
        if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
            raise invalid(
                f"{where}[{index}] must be a token id (an integer >= 0), got {token_id!r}",
                param="prompt",
            )
    return TokenIds(tuple(value))


def _completion_prompts(value: object) -> list[Prompt]:
    """A string, a list of strings, a list of token ids, or a list of such lists."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(item, str) for item in value):
            return list(value)
        if all(isinstance(item, list) for item in value):
            return [_token_prompt(item, f"prompt[{index}]") for index, item in enumerate(value)]
        if not any(isinstance(item, (str, list)) for item in value):
            return [_token_prompt(value, "prompt")]
    raise invalid(
        "prompt must be a string, a list of strings, a list of token ids "
        "or a list of lists of token ids",
        param="prompt",
    )


def parse_completion(body: Mapping[str, Any]) -> Job:
    _check_fields(body, _COMPLETION_FIELDS)
    if "prompt" not in body:
        raise invalid("missing field 'prompt'", param="prompt", code="missing_field")
    prompts = _completion_prompts(body["prompt"])
    suffix = body.get("suffix")
    _unsupported_unless(suffix in (None, ""), "suffix", "insertion is not supported")
    echo = bool(_opt_bool(body, "echo"))
    logprobs = _opt_int(body, "logprobs", 0)
    if logprobs is not None and logprobs > MAX_TOP_LOGPROBS:
        raise invalid(f"logprobs must be <= {MAX_TOP_LOGPROBS}, got {logprobs}", param="logprobs")
    max_tokens = _opt_int(body, "max_tokens", 0)
    if max_tokens == 0 and not echo:
        raise invalid("max_tokens 0 only makes sense with echo (scoring the prompt)", "max_tokens")
    params = _common_params(body, max_tokens)
    if logprobs is not None:
        params["logprobs"] = logprobs
        if echo:
            params["prompt_logprobs"] = logprobs
    if max_tokens == 0:
        params.setdefault("prompt_logprobs", 0)
    stream = _stream_flag(body)
    n, best_of = _choice_count(body, len(prompts))
    if stream and best_of > n:
        raise invalid("best_of > n cannot be streamed", param="best_of")
    if stream and echo and any(isinstance(prompt, TokenIds) for prompt in prompts):
        raise invalid(
            "echo with a token-id prompt cannot be streamed (the text of the tokens is known "
            "only at the end); send stream: false",
            param="echo",
            code="unsupported_value",
        )
    return Job(
        prompts,
        params,
        n=n,
        best_of=best_of,
        stream=stream,
        include_usage=_include_usage(body),
        logprobs=logprobs,
        echo=echo,
    )


def _message_content(content: object, index: int) -> str:
    where = f"messages[{index}].content"
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part_index, part in enumerate(content):
            part_where = f"{where}[{part_index}]"
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise invalid(f"{part_where} must be an object with a 'type'", param=part_where)
            if part["type"] != "text":
                raise invalid(
                    f"{part_where}: content of type {part['type']!r} is not supported",
                    param=part_where,
                    code="unsupported_value",
                )
            if not isinstance(part.get("text"), str):
                raise invalid(f"{part_where}.text must be a string", param=part_where)
            texts.append(part["text"])
        return "\n".join(texts)
    raise invalid(f"{where} must be a string or a list of text parts", param=where)


def parse_chat(body: Mapping[str, Any]) -> Job:
    _check_fields(body, _CHAT_FIELDS)
    messages = body.get("messages")
    if "messages" not in body:
        raise invalid("missing field 'messages'", param="messages", code="missing_field")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages must be a non-empty list", param="messages")
    prompt: list[Mapping[str, str]] = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise invalid(f"{where} must be an object", param=where)
        role = message.get("role")
        if not isinstance(role, str):
            raise invalid(f"{where}.role must be a string", param=f"{where}.role")
        if role not in _CHAT_ROLES:
            raise invalid(
                f"{where}.role {role!r} is not supported "
                f"(supported: {', '.join(sorted(_CHAT_ROLES))})",
                param=f"{where}.role",
                code="unsupported_value",
            )
        for key in message:
            if key not in ("role", "content", "name"):
                raise invalid(
                    f"{where}.{key} is not supported",
                    param=f"{where}.{key}",
                    code="unsupported_field",
                )
        content = _message_content(message.get("content"), index)
        prompt.append({"role": "system" if role == "developer" else role, "content": content})

    for name in ("tools", "functions"):
        _unsupported_unless(not body.get(name), name, "tool calling is not supported")
    for name in ("tool_choice", "function_call"):
        _unsupported_unless(body.get(name) in (None, "none"), name, "tool calling is not supported")
    response_format = body.get("response_format")
    _unsupported_unless(
        response_format is None or response_format == {"type": "text"},
        "response_format",
        "only {'type': 'text'} is supported",
    )
    modalities = body.get("modalities")
    _unsupported_unless(
        modalities is None or modalities == ["text"], "modalities", "only text output is supported"
    )
    for name in ("audio", "prediction", "reasoning_effort", "web_search_options"):
        _unsupported_unless(body.get(name) is None, name, "not supported by this server")
    wants_logprobs = bool(_opt_bool(body, "logprobs"))
    top_logprobs = _opt_int(body, "top_logprobs", 0)
    if top_logprobs is not None:
        if not wants_logprobs:
            raise invalid("top_logprobs needs logprobs: true", param="top_logprobs")
        if top_logprobs > MAX_TOP_LOGPROBS:
            raise invalid(
                f"top_logprobs must be <= {MAX_TOP_LOGPROBS}, got {top_logprobs}",
                param="top_logprobs",
            )
    logprobs = (top_logprobs or 0) if wants_logprobs else None

    max_tokens = _opt_int(body, "max_tokens", 1)
    max_completion = _opt_int(body, "max_completion_tokens", 1)
    if max_tokens is not None and max_completion is not None and max_tokens != max_completion:
        raise invalid(
            "max_tokens and max_completion_tokens disagree", param="max_completion_tokens"
        )
    params = _common_params(body, max_completion if max_tokens is None else max_tokens)
    if logprobs is not None:
        params["logprobs"] = logprobs
    n, _ = _choice_count({"n": body.get("n")}, 1)
    return Job(
        [prompt],
        params,
        n=n,
        stream=_stream_flag(body),
        include_usage=_include_usage(body),
        logprobs=logprobs,
        chat=True,
    )


# --------------------------------------------------------------------------------------------
# Disconnect-aware execution


async def _wait_for_disconnect(receive: Receive) -> None:
    """Return once the client is gone. Only called after the body has been read, so the
    next ASGI message is ``http.disconnect`` (uvicorn also sends it once the response is
    complete, by which time this task has been cancelled)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def run_unless_disconnected(receive: Receive, work: Awaitable[T]) -> tuple[bool, T | None]:
    """Run ``work``; if the client disconnects first, cancel it (which cancels the pool
    request) and return ``(False, None)``. Errors of ``work`` propagate, and so does a
    cancellation that did not come from the client."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        # Also reached when this coroutine itself is cancelled (uvicorn's drain timeout,
        # a forced shutdown): the work is cancelled and finished before anything else
        # may write to the connection. wait() never raises the task's own error.
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
    if not task.cancelled():
        return True, task.result()
    if watcher.done() and not watcher.cancelled():
        return False, None
    # Someone else cancelled the work: the server's shutdown cancels every task.
    raise asyncio.CancelledError


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, refusing more than ``limit`` bytes even without a Content-Length."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ApiError(
                413, f"request body is larger than {limit} bytes", code="request_too_large"
            )
    return bytes(body)


# --------------------------------------------------------------------------------------------
# Responses


class _ClientGone(Response):
    """Sends nothing: the client disconnected, so there is nobody to answer."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope.setdefault("state", {})["status"] = STATUS_CLIENT_GONE


def _sse(payload: Mapping[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


@dataclass
class StreamedChoice:
    """One pool request of a streamed answer: its choice index, prompt and stream."""

    index: int
    prompt: Prompt
    source: AsyncPoolStream


class EventStream(Response):
    """A completion streamed as server-sent events, one pool stream per choice.

    The first event of any choice is awaited before the status line goes out, so that an
    error before any text (overloaded, deadline, crash) still gets its own status code.
    After that, an error is sent as a ``data: {"error": ...}`` event (what the OpenAI
    clients raise on), every other choice is cancelled, and the stream ends without
    ``[DONE]``. With logprobs, a choice's last chunk (the one with its finish_reason)
    carries the logprobs of all its tokens: the pool streams text, and the scores of
    the tokens come with the result.
    """

    def __init__(
        self,
        choices: list[StreamedChoice],
        job: Job,
        *,
        model: str,
        on_error: Callable[[PoolError], None],
    ) -> None:
        super().__init__(status_code=200)
        self._choices = choices
        self._job = job
        self._chat = job.chat
        self._model = model
        self._on_error = on_error
        self._id = f"{'chatcmpl' if job.chat else 'cmpl'}-{choices[0].source.request_id}"
        self._created = int(time.time())
        self._complete = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = scope.setdefault("state", {})
        try:
            finished, _ = await run_unless_disconnected(receive, self._pump(scope, send, state))
        except asyncio.CancelledError:
            # The server is stopping (see _generate): end the response with a reason.
            error = _shutting_down()
            if self._complete:
                return
            if "status" in state:
                await self._send(send, _sse(error.body()), more=False)
            else:
                state["status"] = error.status
                await error.response()(scope, _no_receive, send)
            return
        finally:
            # Closing a stream cancels its pool request if it is still running; it is a
            # no-op for one that ran to its end.
            for choice in self._choices:
                await choice.source.aclose()
        if not finished:
            state["status"] = STATUS_CLIENT_GONE

    def _chunk(
        self,
        index: int,
        text: str | None,
        finish_reason: str | None,
        role: bool = False,
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        if self._chat:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {
                "index": index,
                "delta": delta,
                "finish_reason": finish_reason,
                "logprobs": logprobs,
            }
            kind = "chat.completion.chunk"
        else:
            choice = {
                "index": index,
                "text": text or "",
                "finish_reason": finish_reason,
                "logprobs": logprobs,
            }
            kind = "text_completion"
        return {
            "id": self._id,
            "object": kind,
            "created": self._created,
            "model": self._model,
            "choices": [choice],
        }

    async def _pump(self, scope: Scope, send: Send, state: dict[str, Any]) -> None:
        events: asyncio.Queue[tuple[StreamedChoice, str | Result | PoolError]] = asyncio.Queue()
        readers = [asyncio.ensure_future(_read_choice(c, events)) for c in self._choices]
        try:
            await self._relay(scope, send, state, events)
        finally:
            for reader in readers:
                reader.cancel()
            await asyncio.wait(readers)

    async def _relay(
        self,
        scope: Scope,
        send: Send,
        state: dict[str, Any],
        events: asyncio.Queue[tuple[StreamedChoice, str | Result | PoolError]],
    ) -> None:
        results: dict[int, Result] = {}
        started = False
        while len(results) < len(self._choices):
            choice, item = await events.get()
            if isinstance(item, PoolError):
                self._on_error(item)
                error = pool_error_to_api(item)
                if started:
                    await self._send(send, _sse(error.body()), more=False)
                else:
                    state["status"] = error.status
                    await error.response()(scope, _no_receive, send)
                    self._complete = True
                return
            if not started:
                await self._start(send, state)
                started = True
            if isinstance(item, str):
                if item:
                    await self._send(send, _sse(self._chunk(choice.index, item, None)))
                continue
            results[choice.index] = item
            _note_results(state, results.values())
            logprobs = choice_logprobs(self._job, choice.prompt, item)
            final = self._chunk(
                choice.index, None if self._chat else "", item.finish_reason, logprobs=logprobs
            )
            await self._send(send, _sse(final))
        if self._job.include_usage:
            usage_chunk = self._chunk(0, None, None)
            usage_chunk["choices"] = []
            usage_chunk["usage"] = total_usage(self._job, results)
            await self._send(send, _sse(usage_chunk))
        await self._send(send, _sse("[DONE]"), more=False)

    async def _start(self, send: Send, state: dict[str, Any]) -> None:
        """The status line, then per choice the chat role or the echoed prompt."""
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/event-stream; charset=utf-8"),
                    (b"cache-control", b"no-cache"),
                    # Proxies such as nginx would otherwise buffer the whole stream.
                    (b"x-accel-buffering", b"no"),
                    (b"x-request-id", self._choices[0].source.request_id.encode()),
                ],
            }
        )
        state["status"] = 200
        for choice in self._choices:
            if self._chat:
                await self._send(send, _sse(self._chunk(choice.index, "", None, role=True)))
            elif self._job.echo and isinstance(choice.prompt, str) and choice.prompt:
                await self._send(send, _sse(self._chunk(choice.index, choice.prompt, None)))

    async def _send(self, send: Send, data: bytes, more: bool = True) -> None:
        await send({"type": "http.response.body", "body": data, "more_body": more})
        self._complete = not more


async def _read_choice(
    choice: StreamedChoice,
    events: asyncio.Queue[tuple[StreamedChoice, str | Result | PoolError]],
) -> None:
    """Forward one pool stream's text, then its result or its error, to ``events``."""
    try:
        async for text in choice.source:
            events.put_nowait((choice, text))
    except PoolError as exc:
        events.put_nowait((choice, exc))
        return
    result = choice.source.result
    assert result is not None  # set once the stream has ended without an error
    events.put_nowait((choice, result))


def _note_results(state: dict[str, Any], results: Iterable[Result]) -> None:
    """What the access log says of a request served by one or more pool requests."""
    finished = list(results)
    state.update(
        request_id=finished[0].request_id,
        attempts=sum(result.attempts for result in finished),
        worker_pid=finished[-1].worker_pid,
    )


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}


# --------------------------------------------------------------------------------------------
# Middleware: auth, body size, access log, request-duration histogram


class Gate:
    """Pure ASGI middleware (not ``BaseHTTPMiddleware``, which buffers streams and breaks
    disconnect detection). Checks the key and the declared body size before routing, and
    writes one access-log line per request when the response is done."""

    def __init__(
        self, app: ASGIApp, *, api_key: str | None, max_body_bytes: int, metrics: PoolMetrics
    ) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        state: dict[str, Any] = scope.setdefault("state", {})
        sent_status: list[int] = []

        async def send_and_note(message: Message) -> None:
            if message["type"] == "http.response.start":
                sent_status.append(message["status"])
            await send(message)

        try:
            refusal = self._refusal(scope)
            if refusal is not None:
                await refusal.response()(scope, receive, send_and_note)
            else:
                await self.app(scope, receive, send_and_note)
        finally:
            seconds = time.perf_counter() - started
            status = state.get("status") or (sent_status[0] if sent_status else 500)
            path = scope["path"]
            if path in GENERATION_PATHS:
                self.metrics.observe_request(seconds)
            access_logger.info(
                "%s %s %s request_id=%s attempts=%s worker_pid=%s seconds=%.4f",
                scope["method"],
                path,
                status,
                state.get("request_id") or "-",
                state.get("attempts") or "-",
                state.get("worker_pid") or "-",
                seconds,
            )

    def _refusal(self, scope: Scope) -> ApiError | None:
        headers = dict(scope["headers"])  # ASGI header names are lower-case already
        if self.api_key is not None and scope["path"] not in OPEN_PATHS:
            given = headers.get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            # compare_digest on bytes: constant time in the key's content.
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key):
                return ApiError(
                    401,
                    "missing or invalid API key (Authorization: Bearer KEY)",
                    type="authentication_error",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
        length = headers.get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                return invalid("Content-Length is not a number", code="invalid_header")
            if declared > self.max_body_bytes:
                return ApiError(
                    413,
                    f"request body is larger than {self.max_body_bytes} bytes",
                    code="request_too_large",
                )
        return None


# --------------------------------------------------------------------------------------------
# The app


class LoopWatch:
    """How late this event loop runs a timer: the server's half of ``/healthz``.

    A task sleeps ``interval_s`` at a time and records how late it woke. A loop blocked
    by synchronous code shows either as that lateness or, while the block lasts, as a
    tick overdue, whichever the probe's handler sees first::

        watch = LoopWatch()
        watch.ensure_started()            # from a coroutine on the loop to watch
        watch.lag_s()                     # 0.0 on a loop that keeps up
    """

    def __init__(self, interval_s: float = 0.25) -> None:
        self.interval_s = interval_s
        self._task: asyncio.Task[None] | None = None
        self._last_tick: float | None = None
        self._last_lag = 0.0

    def ensure_started(self) -> None:
        if self._task is None or self._task.done():
            loop = asyncio.get_running_loop()
            self._last_tick = loop.time()
            self._task = loop.create_task(self._tick(), name="modelpool-loop-watch")

    async def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self.interval_s
            await asyncio.sleep(self.interval_s)
            now = loop.time()
            self._last_lag = max(0.0, now - due)
            self._last_tick = now

    def lag_s(self) -> float:
        """Seconds late: the latest tick's lateness, or how overdue the next one is."""
        if self._last_tick is None:
            return 0.0
        overdue = asyncio.get_running_loop().time() - self._last_tick - self.interval_s
        return round(max(self._last_lag, overdue, 0.0), 3)


@dataclass
class ServerState:
    """Mutable state shared by the routes and the CLI's signal handler."""

    pool: ModelPool
    config: ServerConfig
    model_name: str
    metrics: PoolMetrics
    started: int
    draining: bool = False
    loop_watch: LoopWatch = field(default_factory=LoopWatch)


def api_key_from_env(server_config: ServerConfig) -> str | None:
    """The bearer key, or None when no key is configured (an empty variable counts as none)."""
    if not server_config.api_key_env:
        return None
    return os.environ.get(server_config.api_key_env) or None


def create_app(pool: ModelPool, server_config: ServerConfig, model_name: str) -> FastAPI:
    """The daemon's ASGI app for a started ``pool``."""
    metrics = PoolMetrics(pool.stats)
    state = ServerState(
        pool=pool,
        config=server_config,
        model_name=model_name,
        metrics=metrics,
        started=int(time.time()),
    )
    app = FastAPI(title="modelpool", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.modelpool = state
    app.add_middleware(
        Gate,
        api_key=api_key_from_env(server_config),
        max_body_bytes=server_config.max_body_bytes,
        metrics=metrics,
    )

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, exc: ApiError) -> Response:
        return exc.response()

    @app.exception_handler(PoolError)
    async def on_pool_error(request: Request, exc: PoolError) -> Response:
        _note_attempts(request.scope, exc.request_id, exc.attempts)
        return pool_error_to_api(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 404:
            error = ApiError(
                404,
                f"no route {request.method} {request.url.path}",
                type="not_found_error",
                code="not_found",
            )
        elif exc.status_code == 405:
            error = ApiError(
                405,
                f"method {request.method} not allowed on {request.url.path}",
                code="method_not_allowed",
                headers=exc.headers,
            )
        else:
            error = ApiError(
                exc.status_code, str(exc.detail), code="http_error", headers=exc.headers
            )
        return error.response()

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> Response:
        # Starlette re-raises after sending this, so uvicorn logs the traceback once.
        return ApiError(
            500,
            f"internal server error: {type(exc).__name__}",
            type="server_error",
            code="internal_error",
        ).response()

    @app.get("/healthz")
    async def healthz() -> Response:
        # Liveness, not readiness: never waits on the dispatcher (a wedged one is what
        # this must report), and a pool that is starting or degraded is still alive.
        state.loop_watch.ensure_started()
        health = pool.health()
        lag = state.loop_watch.lag_s()
        reasons: list[str] = [] if health.alive else [health.reason or "the pool is not alive"]
        if lag > state.config.max_event_loop_lag_s:
            reasons.append(
                f"the HTTP server's event loop runs {lag:.1f} s late "
                f"(max_event_loop_lag_s = {state.config.max_event_loop_lag_s:g})"
            )
        body: dict[str, Any] = {
            "status": "unhealthy" if reasons else "ok",
            "pool": health.state,
            "heartbeat_age_s": health.heartbeat_age_s,
            "event_loop_lag_s": lag,
        }
        if reasons:
            body["reason"] = "; ".join(reasons)
            body["reasons"] = reasons
            logger.warning("/healthz: unhealthy: %s", "; ".join(reasons))
        return JSONResponse(body, status_code=503 if reasons else 200)

    @app.get("/readyz")
    async def readyz() -> Response:
        stats = await run_in_threadpool(pool.stats)
        ready_workers = sum(1 for w in stats.workers if w.state in READY_WORKER_STATES)
        ready = not state.draining and stats.state in ("ready", "degraded") and ready_workers > 0
        body = {
            "status": "ready" if ready else "not ready",
            "pool": stats.state,
            "ready_workers": ready_workers,
            "draining": state.draining,
        }
        headers = {} if ready else {"Retry-After": str(RETRY_AFTER_UNAVAILABLE)}
        return JSONResponse(body, status_code=200 if ready else 503, headers=headers)

    @app.get("/stats")
    async def stats() -> Response:
        snapshot = await pool.astats()
        return JSONResponse(snapshot.to_dict())

    @app.get("/metrics")
    async def prometheus() -> Response:
        body = await run_in_threadpool(metrics.render)
        return Response(body, media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        snapshot = await pool.astats()
        return {"object": "list", "data": [_model_card(state, snapshot.max_model_len)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != model_name:
            raise ApiError(
                404,
                f"model {model_id!r} is not served here (serving {model_name!r})",
                type="not_found_error",
                code="model_not_found",
                param="model",
            )
        snapshot = await pool.astats()
        return _model_card(state, snapshot.max_model_len)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate(request, state, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _generate(request, state, chat=True)

    return app


def _model_card(state: ServerState, max_model_len: int | None) -> dict[str, Any]:
    # max_model_len as vLLM reports it, so that clients can size their requests.
    return {
        "id": state.model_name,
        "object": "model",
        "created": state.started,
        "owned_by": "modelpool",
        "max_model_len": max_model_len,
    }


def _note_attempts(scope: Scope, request_id: str | None, attempts: list[Any]) -> None:
    note = scope.setdefault("state", {})
    note["request_id"] = request_id
    if attempts:
        note["attempts"] = len(attempts)
        note["worker_pid"] = attempts[-1].worker_pid


def _shutting_down() -> ApiError:
    return ApiError(
        503,
        "the server is shutting down; the request was cancelled",
        type="unavailable_error",
        code="shutting_down",
        headers={"Retry-After": str(RETRY_AFTER_UNAVAILABLE), "Connection": "close"},
    )


async def _generate(request: Request, state: ServerState, *, chat: bool) -> Response:
    if state.draining:
        raise ApiError(
            503,
            "the server is shutting down",
            type="unavailable_error",
            code="draining",
            headers={"Retry-After": str(RETRY_AFTER_UNAVAILABLE), "Connection": "close"},
        )
    try:
        raw = await read_body(request, state.config.max_body_bytes)
    except ClientDisconnect:
        return _ClientGone()
    body = parse_json_object(raw)
    job = parse_chat(body) if chat else parse_completion(body)
    pool = state.pool
    deadline = deadline_from(
        body, request.headers, pool.config.deadline_s, state.config.max_request_timeout_s
    )
    # One pool request per choice (n > 1, several prompts), all with the same deadline.
    runs = job.choices()

    if job.stream:

        def note_error(exc: PoolError) -> None:
            _note_attempts(request.scope, exc.request_id, exc.attempts)

        streamed: list[StreamedChoice] = []
        try:
            for index, prompt, params in runs:
                source = pool.astream(prompt, deadline_s=deadline, **params)
                streamed.append(StreamedChoice(index, prompt, source))
        except BaseException:
            # A later choice was refused (overloaded, say): the earlier ones stop too.
            for choice in streamed:
                await choice.source.aclose()
            raise
        return EventStream(streamed, job, model=state.model_name, on_error=note_error)

    try:
        finished, results = await run_unless_disconnected(
            request.receive,
            _all_or_none(
                [
                    pool.agenerate(prompt, deadline_s=deadline, **params)
                    for _, prompt, params in runs
                ]
            ),
        )
    except asyncio.CancelledError:
        # Only the server cancels a handler: the drain timeout passed or a second signal
        # forced the exit. The pool requests are cancelled already; answering says why
        # (uvicorn would send a bare 500). Not re-raised, so that the answer goes out.
        raise _shutting_down() from None
    if not finished or results is None:
        return _ClientGone()
    by_index = {index: result for (index, _, _), result in zip(runs, results, strict=True)}
    _note_results(request.scope.setdefault("state", {}), results)
    body_out = response_body(job, by_index, state.model_name, int(time.time()))
    return JSONResponse(body_out, headers={"X-Request-Id": results[0].request_id})


async def _all_or_none(work: list[Coroutine[Any, Any, Result]]) -> list[Result]:
    """Every result in order, or the first error with the other requests cancelled
    (asyncio.gather would leave them running). Cancelling this cancels them all."""
    tasks = [asyncio.ensure_future(item) for item in work]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        return [task.result() for task in tasks]
    finally:
        pending = [task for task in tasks if not task.done()]
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)


# --------------------------------------------------------------------------------------------
# Running it


class DrainingServer(uvicorn.Server):
    """uvicorn's Server with the daemon's signal handling.

    uvicorn's own handler re-raises the captured signal after shutdown (so the
    process would die of SIGTERM instead of exiting 0) and escalates only on a
    second SIGINT. Here the first SIGTERM or SIGINT marks the app as draining and
    stops accepting; uvicorn then waits up to ``timeout_graceful_shutdown`` for the
    requests in flight. A second signal stops at once (``forced``).
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.app_state = state
        self.signals = 0
        self.forced = False

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        for sig in self.SIGNALS:
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            yield
        finally:
            for sig in self.SIGNALS:
                loop.remove_signal_handler(sig)

    def _on_signal(self, sig: int) -> None:
        self.signals += 1
        name = signal.Signals(sig).name
        if self.signals == 1:
            logger.info(
                "%s: draining requests in flight (up to %.0f s), then stopping",
                name,
                self.config.timeout_graceful_shutdown or 0,
            )
            self.app_state.draining = True
            self.should_exit = True
        else:
            logger.warning("%s again: stopping now; requests in flight fail", name)
            self.forced = True
            self.force_exit = True
