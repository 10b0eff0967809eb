"""The HTTP machinery every API family of the daemon shares.

- :class:`ApiError`, the daemon's one error answer (a JSON body plus ``x-should-retry``),
  and :func:`invalid` for a 400 that names the field;
- :func:`read_body` and :func:`parse_json_object`: a bounded body, read and parsed;
- :func:`run_unless_disconnected`: work that is cancelled when the client goes away;
- :func:`off_loop_if`: large work in a thread, one at a time;
- :func:`json_bytes`: compact JSON encoded a slice at a time (a large answer never holds
  the event loop for long).

A route's walk goes one way: ``app`` → its API family (``openai``, ``tokenize``...) →
this module; nothing here imports a family.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.types import Message, Receive, Scope, Send

from modelpool.server.large_bodies import MIN_PAYLOAD, loads_large

T = TypeVar("T")


# Whether a client should send a failed request again, said on every error answer in
# the header the openai client obeys (x-should-retry) and, for the retryable ones, with
# Retry-After. Only "not now" answers are retryable: the pool was full or not ready.
# A deadline the caller set, a crash or a model error has been through the pool's own
# retry policy already; sending it again would multiply the work (and the wait).
SHOULD_RETRY_HEADER = "x-should-retry"
RETRYABLE_STATUSES = frozenset({429, 503})


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


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def parse_json_object(raw: bytes) -> dict[str, Any]:
    try:
        if len(raw) > MIN_PAYLOAD:
            data = loads_large(raw, _reject_constant)  # an image's base64 kept out of the parser
        else:
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
            if item.isascii():  # known without a scan (a str's flag): an image's base64
                continue
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
            # Only what can hold text: a long list of numbers (token ids, say) costs no
            # path string per item.
            stack.extend(
                (child, f"{where}[{index}]")
                for index, child in enumerate(item)
                if isinstance(child, (str, dict, list))
            )
    return None


# nginx's convention for "client closed the request": logged, never sent.
STATUS_CLIENT_GONE = 499


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


class SendTimedOut(Exception):
    """A response could not be sent for ``send_timeout_s``: the client stopped reading."""


async def off_loop_if(
    condition: bool, one_at_a_time: asyncio.Semaphore, work: Callable[..., T], *args: Any
) -> T:
    """``work(*args)``, in a thread when ``condition`` says it is large: Python code in a
    thread gives the event loop the GIL every millisecond (sys.getswitchinterval). One
    such thread at a time, so that the loop shares the GIL with one, not with as many
    as clients send large requests (and only one large answer is being built)."""
    if condition:
        async with one_at_a_time:
            return await run_in_threadpool(work, *args)
    return work(*args)


async def no_receive() -> Message:
    return {"type": "http.disconnect"}


# A body larger than this is joined off the event loop (``read_body``).
JOIN_OFF_LOOP_BYTES = 1 << 20


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, refusing more than ``limit`` bytes even without a Content-Length.

    The chunks are joined once: a bytearray grown chunk by chunk was copied again at
    each of its reallocations, and with ``bytes()`` at the end that was the daemon's
    event loop's largest cost under an image flood (profiled: ~60 % of its busy time).
    A large body is joined in a thread, ``bytes.join`` copying without the GIL there."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(
                413, f"request body is larger than {limit} bytes", code="request_too_large"
            )
        chunks.append(chunk)
    if size <= JOIN_OFF_LOOP_BYTES:
        return b"".join(chunks)
    return await asyncio.to_thread(b"".join, chunks)


class ClientGone(Response):
    """Sends nothing: the client disconnected, so there is nobody to answer."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope.setdefault("state", {})["status"] = STATUS_CLIENT_GONE


# The JSON encoder (C, holding the GIL) is given at most this many list items at a time,
# so that encoding a large answer in a thread never holds the event loop for long.
JSON_SLICE_ITEMS = 256


class EncodedArray:
    """A JSON array encoded already: ``pieces`` are its items' JSON, each piece some
    items joined by commas. ``json_bytes`` writes it as it is."""

    __slots__ = ("pieces",)

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces


def json_bytes(value: Any) -> bytes:
    """``value`` as compact JSON (as JSONResponse writes it), encoded a slice at a time:
    the C encoder holds the GIL for a whole call, so that one call on an answer of tens
    of megabytes would stop the event loop even from another thread."""
    parts: list[str] = []
    _encode_into(value, parts)
    text = "".join(parts)
    parts.clear()  # before encoding: the answer is held twice at most, not three times
    return text.encode()


def compact_json(value: Any) -> str:
    text: str = json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return text


def _encode_into(value: Any, parts: list[str]) -> None:
    if isinstance(value, EncodedArray):
        parts.append("[")
        for number, piece in enumerate(value.pieces):
            parts.append("," + piece if number else piece)
        parts.append("]")
    elif isinstance(value, dict):
        parts.append("{")
        for number, (key, item) in enumerate(value.items()):
            parts.append(("," if number else "") + compact_json(str(key)) + ":")
            _encode_into(item, parts)
        parts.append("}")
    elif isinstance(value, list) and len(value) > JSON_SLICE_ITEMS:
        parts.append("[")
        for start in range(0, len(value), JSON_SLICE_ITEMS):
            piece = compact_json(value[start : start + JSON_SLICE_ITEMS])
            parts.append(("," if start else "") + piece[1:-1])
        parts.append("]")
    elif isinstance(value, list):
        parts.append("[")
        for number, item in enumerate(value):
            if number:
                parts.append(",")
            _encode_into(item, parts)
        parts.append("]")
    else:
        parts.append(compact_json(value))
