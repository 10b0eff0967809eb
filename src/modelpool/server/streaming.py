"""A generation streamed as server-sent events, whatever API the client speaks.

:class:`EventStream` runs one pool stream per choice, reads them into a bounded queue (a
client that stops reading stalls only its own request, for ``send_timeout_s``), cancels
the pool requests when the client disconnects or the server stops, and holds the status
line until the first event, so that an error before any text still gets its own status
code. What the events say is a :class:`StreamWriter`'s: OpenAI's chat chunks
(``openai.stream``), the Responses API's typed events (``responses.stream``), Anthropic's
message events (``anthropic.stream``)::

    EventStream(choices, ChatChunks(job, model), on_error=..., send_timeout_s=30.0,
                start=start, ticket=ticket, heavy_work=semaphore)
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from fastapi.responses import Response
from starlette.types import Receive, Scope, Send

from modelpool.server.errors import pool_error_to_api, shutting_down
from modelpool.server.fair_share import Ticket
from modelpool.server.http import (
    STATUS_CLIENT_GONE,
    ApiError,
    SendTimedOut,
    no_receive,
    off_loop_if,
    run_unless_disconnected,
)
from modelpool.server.reasoning import split_result
from modelpool.shared.errors import PoolError
from modelpool.shared.protocol import Prompt, TokenCounts
from modelpool.shared.reasoning.parsers import ReturnedTextParser

if TYPE_CHECKING:
    from modelpool.supervisor.results import Result
    from modelpool.supervisor.streams import AsyncPoolStream

logger = logging.getLogger(__name__)

# Events a streamed answer holds for a client that reads slower than the worker writes:
# past that, the pool's chunks wait (joined) until the client takes some.
STREAM_BUFFER_EVENTS = 64
# Answers whose runs produced more tokens than this are built and encoded off the loop.
ENCODE_OFF_LOOP_TOKENS = 4_096
SSE_CONTENT_TYPE = b"text/event-stream; charset=utf-8"


def sse(payload: Mapping[str, Any] | str, event: str | None = None) -> bytes:
    """One server-sent event: ``data:`` only (OpenAI's chat), or named (``event:``, as the
    Responses and Anthropic streams are)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    head = f"event: {event}\n" if event is not None else ""
    return f"{head}data: {data}\n\n".encode()


@dataclass
class StreamedChoice:
    """One pool request of a streamed answer: its choice index, prompt and pool kwargs,
    and its stream once its turn came (``FairShare``)."""

    index: int
    prompt: Prompt
    params: dict[str, Any]
    source: AsyncPoolStream | None = None
    # A reasoning model's thinking split from its answer (modelpool.server.reasoning).
    split_reasoning: bool = False


@dataclass(frozen=True)
class StreamedText:
    """A chunk of one choice's text (its answer) and its worker's token counts as of that
    chunk; ``reasoning``: the thinking the chunk held (a family that shows thinking sends
    it, the others leave it out)."""

    text: str
    counts: TokenCounts | None
    reasoning: str = ""


class StreamWriter(Protocol):
    """The events one API sends for each step of a streamed answer, encoded, and the
    stream's ``content_type`` (server-sent events, or Ollama's NDJSON)."""

    content_type: bytes

    def opening(self, request_id: str) -> list[bytes]:
        """The first events, once the first choice has produced something."""

    def text(self, choice: StreamedChoice, item: StreamedText) -> list[bytes]:
        """The events of a chunk of a choice's text."""

    def heavy(self, result: Result) -> bool:
        """Whether :meth:`finished` is large work, to be done off the event loop."""

    def finished(self, choice: StreamedChoice, result: Result) -> list[bytes]:
        """The events that end a choice."""

    def closing(self, results: Mapping[int, Result]) -> list[bytes]:
        """The events that end the stream, every choice finished."""

    def failed(self, error: ApiError) -> bytes:
        """The event that ends a stream whose status line went out with 200."""

    def refused(self, error: ApiError) -> Response:
        """The answer to an error met before anything was sent."""


class EventStream(Response):
    """An answer streamed as server-sent events, one pool stream per choice.

    The first event of any choice is awaited before the status line goes out, so that an
    error before any text (overloaded, deadline, crash) still gets its own status code
    (``writer.refused``). After that, an error ends the stream with ``writer.failed``
    and every other choice is cancelled.
    """

    def __init__(
        self,
        choices: list[StreamedChoice],
        writer: StreamWriter,
        *,
        on_error: Callable[[PoolError], None],
        send_timeout_s: float,
        start: Callable[[StreamedChoice], AbstractAsyncContextManager[AsyncPoolStream]],
        ticket: Ticket,
        heavy_work: asyncio.Semaphore,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(status_code=200)
        self._route_headers = dict(headers or {})  # beside the stream's own
        self._ticket = ticket
        self._heavy_work = heavy_work
        self._choices = choices
        self._writer = writer
        self._start_choice = start
        self._on_error = on_error
        self._send_timeout_s = send_timeout_s
        self._request_id = ""  # known once a choice has started
        self._complete = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = scope.setdefault("state", {})
        try:
            finished, _ = await run_unless_disconnected(receive, self._pump(scope, send, state))
        except SendTimedOut as exc:
            # The client stopped reading: its request ends here, as a disconnect would.
            logger.info("%s", exc)
            finished = False
        except asyncio.CancelledError:
            # The server is stopping (see app._generate): end the response with a reason.
            error = shutting_down()
            if self._complete:
                return
            if "status" in state:
                await self._send(send, self._writer.failed(error), more=False)
            else:
                state["status"] = error.status
                await self._writer.refused(error)(scope, no_receive, send)
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
            if not isinstance(item, PoolError):
                if not started:
                    await self._start(send, state)
                    started = True
                try:
                    await self._write(send, choice, item, results, state)
                    continue
                except PoolError as exc:  # the writer's reading of it (a malformed tool call)
                    item = exc
            self._on_error(item)
            error = pool_error_to_api(item)
            if started:
                await self._send(send, self._writer.failed(error), more=False)
            else:
                state["status"] = error.status
                await self._writer.refused(error)(scope, no_receive, send)
                self._complete = True
            return
        closing = self._writer.closing(results)
        for number, data in enumerate(closing):
            await self._send(send, data, more=number < len(closing) - 1)

    async def _write(
        self,
        send: Send,
        choice: StreamedChoice,
        item: StreamedText | Result,
        results: dict[int, Result],
        state: dict[str, Any],
    ) -> None:
        """A choice's text, or its end, written; a PoolError of the writer's reading (a
        malformed tool call) is raised to end the stream as a pool error would."""
        if isinstance(item, StreamedText):
            for data in self._writer.text(choice, item):
                await self._send(send, data)
            return
        results[choice.index] = item
        note_results(state, results.values())
        final = await off_loop_if(
            self._writer.heavy(item), self._heavy_work, self._writer.finished, choice, item
        )
        for data in final:
            await self._send(send, data)

    async def _start(self, send: Send, state: dict[str, Any]) -> None:
        """The status line, then the writer's opening events."""
        # A client's runs take their turns in order: the first choice started first.
        request_id = next(c.source.request_id for c in self._choices if c.source is not None)
        self._request_id = request_id
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", self._writer.content_type),
                    (b"cache-control", b"no-cache"),
                    # Proxies such as nginx would otherwise buffer the whole stream.
                    (b"x-accel-buffering", b"no"),
                    (b"x-request-id", request_id.encode()),
                    *(
                        (name.encode(), value.encode())
                        for name, value in self._route_headers.items()
                    ),
                ],
            }
        )
        state["status"] = 200
        for data in self._writer.opening(request_id):
            await self._send(send, data)

    async def _send(self, send: Send, data: bytes, more: bool = True) -> None:
        # uvicorn's send waits while the socket's buffer is full: a client that stops
        # reading holds only this request, and only for send_timeout_s.
        try:
            async with asyncio.timeout(self._send_timeout_s):
                await send({"type": "http.response.body", "body": data, "more_body": more})
        except TimeoutError:
            raise SendTimedOut(
                f"{self._request_id}: the client read nothing for {self._send_timeout_s:g} s "
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
    parser = ReturnedTextParser() if choice.split_reasoning else None
    try:
        async with start(choice) as source:
            async for text in source:
                if parser is None:
                    await events.put((choice, StreamedText(text, source.token_counts)))
                    continue
                parsed = parser.feed(text)
                if parsed.reasoning or parsed.answer:
                    item = StreamedText(parsed.answer, source.token_counts, parsed.reasoning)
                    await events.put((choice, item))
            result = source.result
    except PoolError as exc:
        await events.put((choice, exc))
        return
    assert result is not None  # set once the stream has ended without an error
    if parser is not None:
        rest = parser.finish()
        if rest.reasoning or rest.answer:
            item = StreamedText(rest.answer, source.token_counts, rest.reasoning)
            await events.put((choice, item))
        result = split_result(result)
    await events.put((choice, result))


def note_results(state: dict[str, Any], results: Iterable[Result]) -> None:
    """What the access log says of a request served by one or more pool requests."""
    finished = list(results)
    state.update(
        request_id=finished[0].request_id,
        attempts=sum(result.attempts for result in finished),
        worker_pid=finished[-1].worker_pid,
    )


def answer_tokens(*results: Result) -> int:
    """Tokens in the answers of ``results``, prompts included (echo): what sizes it."""
    return sum((r.completion_tokens or 0) + (r.prompt_tokens or 0) for r in results)
