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

Request bodies are parsed and checked, field by field, in ``openai_request``
(every rejection names the OpenAI field the client sent; a field we cannot
honour is a 400, never ignored). A request becomes one pool request per choice
(``n``, a batch of prompts); the response shapes, logprobs included, are built
in ``openai_format``.

Status codes: 400 invalid (``context_length_exceeded`` when the prompt and
``max_tokens`` do not fit the model's context, which ``/v1/models`` reports as
``max_model_len``; ``request_too_expensive`` past ``max_request_tokens``), 401
missing/bad key, 403 Host or Origin not allowed (``http_guard``), 404/405 unknown
route or method, 413 body too large, 415 body not declared JSON, 429
``PoolOverloaded`` or a client past its share (``fair_share``), 503 ``PoolClosed`` /
``ModelLoadFailed`` / draining, 504 ``DeadlineExceeded``, 502 ``WorkerCrashed``
and ``CudaError``, 507 ``OutOfMemory`` (CUDA), 500 only for ``BackendError``
(the model code raised) or a bug here. Every error says ``x-should-retry``
(true only for 429 and 503, which also carry ``Retry-After``): the pool has
applied its own retry policy already.

A client that disconnects cancels its request in the worker: a task waits on
the ASGI ``receive`` channel for ``http.disconnect`` (no polling) and cancels
the generation, whose cancellation the pool forwards to the worker. A client that
stops reading a stream is treated the same after ``send_timeout_s``: the stream's
events wait in a bounded queue, and each is sent only once the socket took the last.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import time
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Iterable,
    Iterator,
    Mapping,
)
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Message, Receive, Scope, Send

from modelpool import tools
from modelpool.config import ServerConfig
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
    WorkerCrashed,
)
from modelpool.fair_share import FairShare, Ticket
from modelpool.http_guard import BrowserGuard, Gate, require_json
from modelpool.metrics import CONTENT_TYPE, PoolMetrics
from modelpool.openai_format import (
    Job,
    choice_logprobs,
    json_bytes,
    response_body,
    total_usage,
    usage,
)
from modelpool.openai_request import (
    ApiError,
    check_budget,
    deadline_from,
    parse_chat,
    parse_completion,
    parse_json_object,
)
from modelpool.openai_tokenize import parse_detokenize, parse_tokenize, tokenize_body
from modelpool.protocol import Prompt, TokenCounts

if TYPE_CHECKING:
    from modelpool.pool import AsyncPoolStream, ModelPool, Result

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Seconds a client should wait before trying again: an overloaded queue drains
# quickly; a pool that is not ready is starting or respawning workers.
RETRY_AFTER_OVERLOADED = 1
RETRY_AFTER_UNAVAILABLE = 5
# nginx's convention for "client closed the request": logged, never sent.
STATUS_CLIENT_GONE = 499
# Events a streamed answer holds for a client that reads slower than the worker writes:
# past that, the pool's chunks wait (joined) until the client takes some.
STREAM_BUFFER_EVENTS = 64
# Bodies larger than this are parsed and checked off the event loop.
PARSE_OFF_LOOP_BYTES = 65_536
# Answers whose runs produced more tokens than this are built and encoded off the loop.
ENCODE_OFF_LOOP_TOKENS = 4_096
READY_WORKER_STATES = frozenset({"idle", "busy", "spare"})


# --------------------------------------------------------------------------------------------
# Errors


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
    """One pool request of a streamed answer: its choice index, prompt and pool kwargs,
    and its stream once its turn came (``FairShare``)."""

    index: int
    prompt: Prompt
    params: dict[str, Any]
    source: AsyncPoolStream | None = None


@dataclass(frozen=True)
class StreamedText:
    """A chunk of one choice's text and its worker's token counts as of that chunk."""

    text: str
    counts: TokenCounts | None


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
        send_timeout_s: float,
        start: Callable[[StreamedChoice], AbstractAsyncContextManager[AsyncPoolStream]],
        ticket: Ticket,
        heavy_work: asyncio.Semaphore,
    ) -> None:
        super().__init__(status_code=200)
        self._ticket = ticket
        self._heavy_work = heavy_work
        self._choices = choices
        self._start_choice = start
        self._job = job
        self._chat = job.chat
        self._model = model
        self._on_error = on_error
        self._send_timeout_s = send_timeout_s
        self._id = ""  # known once a choice has started
        self._created = int(time.time())
        self._complete = False
        # Tool calling: each choice's text read into content and calls as it streams.
        self._call_readers = {
            choice.index: tools.CallReader(job.tools) for choice in choices if job.tools
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = scope.setdefault("state", {})
        try:
            finished, _ = await run_unless_disconnected(receive, self._pump(scope, send, state))
        except SendTimedOut as exc:
            # The client stopped reading: its request ends here, as a disconnect would.
            logger.info("%s", exc)
            finished = False
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
                if choice.source is not None:
                    await choice.source.aclose()
            self._ticket.close()
        if not finished:
            state["status"] = STATUS_CLIENT_GONE

    def _chunk(
        self,
        index: int,
        text: str | None,
        finish_reason: str | None,
        role: bool = False,
        logprobs: dict[str, Any] | None = None,
        tool_delta: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        if self._chat:
            delta: dict[str, Any] = dict(tool_delta or {})
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
        # Bounded: a client slower than the workers holds the readers (and the pool's
        # stream buffers join its text) instead of an ever longer queue here.
        events: asyncio.Queue[tuple[StreamedChoice, StreamedText | Result | PoolError]] = (
            asyncio.Queue(STREAM_BUFFER_EVENTS)
        )
        readers = [
            asyncio.ensure_future(_read_choice(c, self._start_choice, events))
            for c in self._choices
        ]
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
        events: asyncio.Queue[tuple[StreamedChoice, StreamedText | Result | PoolError]],
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
            if isinstance(item, StreamedText):
                reader = self._call_readers.get(choice.index)
                if reader is not None:
                    await self._send_tool_events(send, choice, reader.feed(item.text))
                elif item.text:
                    chunk = self._chunk(choice.index, item.text, None)
                    self._add_usage(chunk, item.counts)
                    await self._send(send, _sse(chunk))
                continue
            reader = self._call_readers.get(choice.index)
            if reader is not None:
                await self._send_tool_events(send, choice, reader.finish())
            results[choice.index] = item
            _note_results(state, results.values())
            final = await _off_loop_if(
                self._job.logprobs is not None and _answer_tokens(item) > ENCODE_OFF_LOOP_TOKENS,
                self._heavy_work,
                self._final_event,
                choice,
                item,
            )
            await self._send(send, final)
        if self._job.include_usage:
            usage_chunk = self._chunk(0, None, None)
            usage_chunk["choices"] = []
            usage_chunk["usage"] = total_usage(self._job, results)
            await self._send(send, _sse(usage_chunk))
        await self._send(send, _sse("[DONE]"), more=False)

    async def _start(self, send: Send, state: dict[str, Any]) -> None:
        """The status line, then per choice the chat role or the echoed prompt."""
        # A client's runs take their turns in order: the first choice started first.
        request_id = next(c.source.request_id for c in self._choices if c.source is not None)
        self._id = f"{'chatcmpl' if self._chat else 'cmpl'}-{request_id}"
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/event-stream; charset=utf-8"),
                    (b"cache-control", b"no-cache"),
                    # Proxies such as nginx would otherwise buffer the whole stream.
                    (b"x-accel-buffering", b"no"),
                    (b"x-request-id", request_id.encode()),
                ],
            }
        )
        state["status"] = 200
        for choice in self._choices:
            if self._chat:
                chunk = self._chunk(choice.index, "", None, role=True)
            elif self._job.echo and isinstance(choice.prompt, str) and choice.prompt:
                chunk = self._chunk(choice.index, choice.prompt, None)
            else:
                continue
            self._add_usage(chunk, None if choice.source is None else choice.source.token_counts)
            await self._send(send, _sse(chunk))

    def _add_usage(
        self, chunk: dict[str, Any], counts: TokenCounts | None, result: Result | None = None
    ) -> None:
        """``continuous_usage_stats``: the choice's token counts on every chunk, as its
        worker counted them when it sent that text (null where its backend does not)."""
        if not self._job.continuous_usage:
            return
        if result is not None:
            chunk["usage"] = usage(
                result.prompt_tokens, result.completion_tokens, result.cached_tokens
            )
            return
        if counts is None:
            chunk["usage"] = usage(None, None)
        else:
            chunk["usage"] = usage(
                counts.prompt_tokens, counts.completion_tokens, counts.cached_tokens
            )

    async def _send_tool_events(
        self, send: Send, choice: StreamedChoice, events: list[tools.Event]
    ) -> None:
        """A tool-calling choice's content, and each whole call as OpenAI streams it."""
        plan = self._job.tools
        assert plan is not None
        for event in events:
            if isinstance(event, str):
                await self._send(send, _sse(self._chunk(choice.index, event, None)))
                continue
            # Its place among the choice's calls (one feed may finish several).
            number = self._call_readers[choice.index].calls.index(event)
            for delta in tools.call_deltas(plan, event, number):
                chunk = self._chunk(choice.index, None, None, tool_delta=delta)
                await self._send(send, _sse(chunk))

    def _final_event(self, choice: StreamedChoice, result: Result) -> bytes:
        """A choice's last event, with the logprobs of all its tokens when asked for."""
        logprobs = choice_logprobs(self._job, choice.prompt, result)
        finish_reason: str | None = result.finish_reason
        if self._job.tools is not None and self._call_readers[choice.index].calls:
            finish_reason = "function_call" if self._job.tools.legacy else "tool_calls"
        final = self._chunk(
            choice.index, None if self._chat else "", finish_reason, logprobs=logprobs
        )
        self._add_usage(final, None, result)
        return b"data: " + json_bytes(final) + b"\n\n"

    async def _send(self, send: Send, data: bytes, more: bool = True) -> None:
        # uvicorn's send waits while the socket's buffer is full: a client that stops
        # reading holds only this request, and only for send_timeout_s.
        try:
            async with asyncio.timeout(self._send_timeout_s):
                await send({"type": "http.response.body", "body": data, "more_body": more})
        except TimeoutError:
            raise SendTimedOut(
                f"{self._id}: the client read nothing for {self._send_timeout_s:g} s "
                "(send_timeout_s); counted as disconnected"
            ) from None
        self._complete = not more


async def _read_choice(
    choice: StreamedChoice,
    start: Callable[[StreamedChoice], AbstractAsyncContextManager[AsyncPoolStream]],
    events: asyncio.Queue[tuple[StreamedChoice, StreamedText | Result | PoolError]],
) -> None:
    """Start one choice's pool stream (when its turn comes), forward its text, then its
    result or its error, to ``events``: waits while ``events`` is full, that is while
    the client reads slower than the worker."""
    try:
        async with start(choice) as source:
            async for text in source:
                await events.put((choice, StreamedText(text, source.token_counts)))
            result = source.result
    except PoolError as exc:
        await events.put((choice, exc))
        return
    assert result is not None  # set once the stream has ended without an error
    await events.put((choice, result))


def _note_results(state: dict[str, Any], results: Iterable[Result]) -> None:
    """What the access log says of a request served by one or more pool requests."""
    finished = list(results)
    state.update(
        request_id=finished[0].request_id,
        attempts=sum(result.attempts for result in finished),
        worker_pid=finished[-1].worker_pid,
    )


def _answer_tokens(*results: Result) -> int:
    """Tokens in the answers of ``results``, prompts included (echo): what sizes it."""
    return sum((r.completion_tokens or 0) + (r.prompt_tokens or 0) for r in results)


class SendTimedOut(Exception):
    """A response could not be sent for ``send_timeout_s``: the client stopped reading."""


async def _off_loop_if(
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


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}


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
    fair_share: FairShare
    # Parsing and building large bodies and answers, in a thread, one at a time.
    heavy_work: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(1))
    draining: bool = False
    loop_watch: LoopWatch = field(default_factory=LoopWatch)


def api_key_from_env(server_config: ServerConfig) -> str | None:
    """The bearer key, or None when no key is configured (an empty variable counts as none)."""
    if not server_config.api_key_env:
        return None
    return os.environ.get(server_config.api_key_env) or None


def create_app(
    pool: ModelPool,
    server_config: ServerConfig,
    model_name: str,
    *,
    api_key: str | None = None,
) -> FastAPI:
    """The daemon's ASGI app for a started ``pool``. The key is ``api_key``, or else read
    from the variable ``server_config.api_key_env`` names."""
    metrics = PoolMetrics(pool.stats)
    state = ServerState(
        pool=pool,
        config=server_config,
        model_name=model_name,
        metrics=metrics,
        started=int(time.time()),
        fair_share=FairShare(
            capacity=pool.config.workers * pool.config.max_batch_size,
            max_running=server_config.client_max_running,
            max_queued=server_config.client_max_queued,
            max_waiting=pool.config.max_queue,
        ),
    )
    app = FastAPI(title="modelpool", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.modelpool = state
    app.add_middleware(
        Gate,
        api_key=api_key or api_key_from_env(server_config),
        max_body_bytes=server_config.max_body_bytes,
        metrics=metrics,
        guard=BrowserGuard(server_config),
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
        return JSONResponse({**snapshot.to_dict(), "fair_share": state.fair_share.snapshot()})

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

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        body = await _read_json(request, state)
        job = parse_tokenize(body)
        deadline = deadline_from({}, request.headers, pool.config.deadline_s, None)
        tokens = await pool.atokenize(
            job.prompt, add_generation_prompt=job.add_generation_prompt, deadline_s=deadline
        )
        snapshot = await pool.astats()
        return JSONResponse(tokenize_body(tokens, snapshot.max_model_len))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        tokens = parse_detokenize(await _read_json(request, state))
        deadline = deadline_from({}, request.headers, pool.config.deadline_s, None)
        text = await pool.adetokenize(tokens, deadline_s=deadline) if tokens else ""
        return JSONResponse({"prompt": text})

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


def _check_not_draining(state: ServerState) -> None:
    if state.draining:
        raise ApiError(
            503,
            "the server is shutting down",
            type="unavailable_error",
            code="draining",
            headers={"Retry-After": str(RETRY_AFTER_UNAVAILABLE), "Connection": "close"},
        )


async def _read_json(request: Request, state: ServerState) -> dict[str, Any]:
    """A small JSON body (the tokenizer routes'), parsed off the loop when large."""
    _check_not_draining(state)
    require_json(request.headers.get("content-type"))
    raw = await read_body(request, state.config.max_body_bytes)
    return await _off_loop_if(
        len(raw) > PARSE_OFF_LOOP_BYTES, state.heavy_work, parse_json_object, raw
    )


async def _generate(request: Request, state: ServerState, *, chat: bool) -> Response:
    _check_not_draining(state)
    require_json(request.headers.get("content-type"))
    try:
        raw = await read_body(request, state.config.max_body_bytes)
    except ClientDisconnect:
        return _ClientGone()
    body, job = await _off_loop_if(
        len(raw) > PARSE_OFF_LOOP_BYTES, state.heavy_work, _parse, raw, chat
    )
    pool = state.pool
    check_budget(
        job,
        limit=state.config.max_request_tokens,
        default_max_tokens=pool.config.generation_defaults.get("max_new_tokens", 0),
    )
    deadline = deadline_from(
        body, request.headers, pool.config.deadline_s, state.config.max_request_timeout_s
    )
    # One pool request per choice (n > 1, several prompts), all with the same deadline,
    # each let into the pool when this client's turn comes.
    runs = job.choices()
    client = request.client.host if request.client is not None else "-"
    ticket = state.fair_share.reserve(client, len(runs))

    if job.stream:

        def note_error(exc: PoolError) -> None:
            _note_attempts(request.scope, exc.request_id, exc.attempts)

        @contextlib.asynccontextmanager
        async def start(choice: StreamedChoice) -> AsyncIterator[AsyncPoolStream]:
            async with ticket.slot(deadline) as left_s:
                choice.source = pool.astream(choice.prompt, deadline_s=left_s, **choice.params)
                yield choice.source

        return EventStream(
            [StreamedChoice(index, prompt, params) for index, prompt, params in runs],
            job,
            model=state.model_name,
            on_error=note_error,
            send_timeout_s=state.config.send_timeout_s,
            start=start,
            ticket=ticket,
            heavy_work=state.heavy_work,
        )

    async def run(prompt: Prompt, params: dict[str, Any]) -> Result:
        async with ticket.slot(deadline) as left_s:
            return await pool.agenerate(prompt, deadline_s=left_s, **params)

    try:
        finished, results = await run_unless_disconnected(
            request.receive, _all_or_none([run(prompt, params) for _, prompt, params in runs])
        )
    except asyncio.CancelledError:
        # Only the server cancels a handler: the drain timeout passed or a second signal
        # forced the exit. The pool requests are cancelled already; answering says why
        # (uvicorn would send a bare 500). Not re-raised, so that the answer goes out.
        raise _shutting_down() from None
    finally:
        ticket.close()
    if not finished or results is None:
        return _ClientGone()
    by_index = {index: result for (index, _, _), result in zip(runs, results, strict=True)}
    _note_results(request.scope.setdefault("state", {}), results)
    content = await _off_loop_if(
        _answer_tokens(*results) > ENCODE_OFF_LOOP_TOKENS,
        state.heavy_work,
        _render,
        job,
        by_index,
        state.model_name,
    )
    return Response(
        content,
        media_type="application/json",
        headers={"X-Request-Id": results[0].request_id},
    )


def _parse(raw: bytes, chat: bool) -> tuple[dict[str, Any], Job]:
    body = parse_json_object(raw)
    return body, parse_chat(body) if chat else parse_completion(body)


def _render(job: Job, by_index: dict[int, Result], model: str) -> bytes:
    return json_bytes(response_body(job, by_index, model, int(time.time())))


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
    requests in flight. A second signal stops at once (``forced``): the requests in
    flight are cancelled and answer 503 ``shutting_down``, on every Python version.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.app_state = state
        self.signals = 0
        self.forced = False

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if sockets is not None:
            # The daemon binds its port before the pool loads and hands the socket over;
            # uvicorn then leaves out its "Uvicorn running on ..." line (it expects its
            # own process manager to have said it), which says the port now listens.
            self._log_started_message(sockets)

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
            # force_exit only ends uvicorn's waiting loops; it then awaits
            # asyncio.Server.wait_closed(), which since Python 3.12 waits for every open
            # connection (it returned at once before). So the requests in flight are
            # cancelled here, as uvicorn does when the drain timeout passes: each answers
            # 503 shutting_down and closes its connection, and the server exits.
            for task in self.server_state.tasks:
                task.cancel(msg=f"{name} again: stopping now")
