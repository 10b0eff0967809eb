"""OpenAI's completions and chat completions streamed: :class:`ChatChunks` writes the
``chat.completion.chunk`` / ``text_completion`` events that ``streaming.EventStream``
sends (tool calls as OpenAI's deltas, usage on every chunk when asked for, logprobs on a
choice's last chunk), ending with ``data: [DONE]``. ``app._generate`` makes one per
streamed request.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from fastapi.responses import Response

from modelpool.server.core.job import Job
from modelpool.server.http import ApiError, json_bytes
from modelpool.server.openai.format import choice_logprobs, total_usage, usage
from modelpool.server.reasoning import reasoning_delta
from modelpool.server.streaming import (
    ENCODE_OFF_LOOP_TOKENS,
    SSE_CONTENT_TYPE,
    StreamedChoice,
    StreamedText,
    answer_tokens,
    sse,
)
from modelpool.shared import tools
from modelpool.shared.protocol import TokenCounts

if TYPE_CHECKING:
    from modelpool.supervisor.pool import Result


class ChatChunks:
    """The :class:`~modelpool.server.streaming.StreamWriter` of OpenAI's completions and
    chat. With logprobs, a choice's last chunk (the one with its finish_reason) carries
    the logprobs of all its tokens: the pool streams text, and the scores of the tokens
    come with the result. An error after the first event is a ``data: {"error": ...}``
    event (what the OpenAI clients raise on), and the stream ends without ``[DONE]``."""

    content_type = SSE_CONTENT_TYPE

    def __init__(self, job: Job, choices: list[StreamedChoice], model: str) -> None:
        self._job = job
        self._choices = choices
        self._chat = job.chat
        self._model = model
        self._id = ""  # known once a choice has started
        self._created = int(time.time())
        # Tool calling: each choice's text read into content and calls as it streams.
        self._call_readers = {
            choice.index: tools.CallReader(job.tools, stream_arguments=True)
            for choice in choices
            if job.tools
        }

    def opening(self, request_id: str) -> list[bytes]:
        """Per choice, the chat role or the echoed prompt."""
        self._id = f"{'chatcmpl' if self._chat else 'cmpl'}-{request_id}"
        events = []
        for choice in self._choices:
            if self._chat:
                chunk = self._chunk(choice.index, "", None, role=True)
            elif self._job.echo and isinstance(choice.prompt, str) and choice.prompt:
                chunk = self._chunk(choice.index, choice.prompt, None)
            else:
                continue
            self._add_usage(chunk, None if choice.source is None else choice.source.token_counts)
            events.append(sse(chunk))
        return events

    def text(self, choice: StreamedChoice, item: StreamedText) -> list[bytes]:
        thinking = []
        if item.reasoning and self._chat:
            delta = reasoning_delta(item.reasoning)
            thinking.append(sse(self._chunk(choice.index, None, None, tool_delta=delta)))
        reader = self._call_readers.get(choice.index)
        if reader is not None:
            return thinking + self._tool_events(choice, reader.feed(item.text))
        if not item.text:
            return thinking
        chunk = self._chunk(choice.index, item.text, None)
        self._add_usage(chunk, item.counts)
        return [*thinking, sse(chunk)]

    def heavy(self, result: Result) -> bool:
        return self._job.logprobs is not None and answer_tokens(result) > ENCODE_OFF_LOOP_TOKENS

    def finished(self, choice: StreamedChoice, result: Result) -> list[bytes]:
        """The calls held back, then the choice's last event, with the logprobs of all its
        tokens when asked for."""
        events: list[bytes] = []
        reader = self._call_readers.get(choice.index)
        if reader is not None:
            events += self._tool_events(choice, reader.finish())
        logprobs = choice_logprobs(self._job, choice.prompt, result)
        finish_reason: str | None = result.finish_reason
        if self._job.tools is not None and self._call_readers[choice.index].calls:
            finish_reason = "function_call" if self._job.tools.legacy else "tool_calls"
        final = self._chunk(
            choice.index, None if self._chat else "", finish_reason, logprobs=logprobs
        )
        self._add_usage(final, None, result)
        if result.thinking_closed is not None:
            final["choices"][0]["thinking_closed"] = result.thinking_closed
        events.append(b"data: " + json_bytes(final) + b"\n\n")
        return events

    def closing(self, results: Mapping[int, Result]) -> list[bytes]:
        events = []
        if self._job.include_usage:
            usage_chunk = self._chunk(0, None, None)
            usage_chunk["choices"] = []
            usage_chunk["usage"] = total_usage(self._job, dict(results))
            events.append(sse(usage_chunk))
        events.append(sse("[DONE]"))
        return events

    def failed(self, error: ApiError) -> bytes:
        return sse(error.body())

    def refused(self, error: ApiError) -> Response:
        return error.response()

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

    def _tool_events(self, choice: StreamedChoice, events: list[tools.Event]) -> list[bytes]:
        """A tool-calling choice's content, and its calls as OpenAI streams them: the
        arguments piece by piece as written (a call read whole: in one piece)."""
        plan = self._job.tools
        assert plan is not None
        out = []
        for event in events:
            if isinstance(event, str):
                out.append(sse(self._chunk(choice.index, event, None)))
                continue
            if isinstance(event, tools.CallOpened):
                deltas = [tools.opened_delta(plan, event)]
            elif isinstance(event, tools.ArgumentsDelta):
                deltas = [tools.arguments_delta(plan, event.index, event.text)]
            elif event.streamed:
                continue
            else:
                deltas = tools.call_deltas(plan, event, event.index)
            for delta in deltas:
                out.append(sse(self._chunk(choice.index, None, None, tool_delta=delta)))
        return out
