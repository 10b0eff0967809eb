"""A completion streamed as server-sent events (``EventStream``), and the helpers the
daemon's answers share with it: one pool stream per choice, read into a bounded queue so
that a client that stops reading stalls only its own request (``send_timeout_s``), tool
calls streamed as OpenAI's deltas, usage on every chunk when asked for, and large answers
built off the event loop (``off_loop_if``). ``app._generate`` makes one per streamed
request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi.responses import Response
from starlette.types import Receive, Scope, Send

from modelpool import tools
from modelpool.errors import PoolError
from modelpool.protocol import Prompt, TokenCounts
from modelpool.server.errors import pool_error_to_api, shutting_down
from modelpool.server.fair_share import Ticket
from modelpool.server.http import (
    STATUS_CLIENT_GONE,
    SendTimedOut,
    json_bytes,
    no_receive,
    off_loop_if,
    run_unless_disconnected,
)
from modelpool.server.openai.format import Job, choice_logprobs, total_usage, usage

if TYPE_CHECKING:
    from modelpool.pool import AsyncPoolStream, Result

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Events a streamed answer holds for a client that reads slower than the worker writes:
# past that, the pool's chunks wait (joined) until the client takes some.
STREAM_BUFFER_EVENTS = 64
# Answers whose runs produced more tokens than this are built and encoded off the loop.
ENCODE_OFF_LOOP_TOKENS = 4_096






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
            error = shutting_down()
            if self._complete:
                return
            if "status" in state:
                await self._send(send, _sse(error.body()), more=False)
            else:
                state["status"] = error.status
                await error.response()(scope, no_receive, send)
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
                    await error.response()(scope, no_receive, send)
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
            note_results(state, results.values())
            final = await off_loop_if(
                self._job.logprobs is not None and answer_tokens(item) > ENCODE_OFF_LOOP_TOKENS,
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






