"""An Anthropic answer as the Messages API's events, and the same answer whole.

:class:`MessageEvents` reads the generated text (through ``tools.CallReader`` when tools
are offered) into content blocks: ``text``, opened at the first text, and a ``tool_use``
per call that validated. Streamed, in Anthropic's order::

    message_start
    content_block_start (text), content_block_delta (text_delta)..., content_block_stop
    content_block_start (tool_use), content_block_delta (input_json_delta),
    content_block_stop
    message_delta (stop_reason, stop_sequence, usage), message_stop

and an ``error`` event where the answer fails after its first event. Not streamed, the
same reading gives the message (``whole``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from fastapi.responses import Response

from modelpool.server.anthropic.request import MessagesRequest
from modelpool.server.errors import anthropic_error_body, error_response
from modelpool.server.http import ApiError
from modelpool.server.streaming import SSE_CONTENT_TYPE, StreamedChoice, StreamedText, sse
from modelpool.shared import tools

if TYPE_CHECKING:
    from modelpool.supervisor.pool import Result


class MessageEvents:
    """The :class:`~modelpool.server.streaming.StreamWriter` of ``/v1/messages``."""

    content_type = SSE_CONTENT_TYPE

    def __init__(self, request: MessagesRequest, model: str) -> None:
        self._request = request
        self._model = model
        plan = request.job.tools
        self._reader = tools.CallReader(plan, stream_arguments=True) if plan is not None else None
        self._tool_blocks: dict[str, dict[str, Any]] = {}  # by call id, while streamed
        self._id = ""
        self.content: list[dict[str, Any]] = []
        self._open_text: dict[str, Any] | None = None
        self._open_thinking: dict[str, Any] | None = None
        self._input_tokens = 0

    def opening(self, request_id: str) -> list[bytes]:
        self._id = f"msg_{request_id}"
        return [
            _event(
                "message_start",
                message={**self._message(None, None), "content": []},
            )
        ]

    def text(self, choice: StreamedChoice, item: StreamedText) -> list[bytes]:
        if item.counts is not None:
            self._input_tokens = item.counts.prompt_tokens
        thinking = self._thinking(item.reasoning) if item.reasoning else []
        if not item.text:
            return thinking
        thinking += self._close_thinking()
        return thinking + self._write(self._reader.feed(item.text) if self._reader else [item.text])

    def heavy(self, result: Result) -> bool:
        return False

    def finished(self, choice: StreamedChoice, result: Result) -> list[bytes]:
        events = self._close_thinking()
        events += self._write(self._reader.finish() if self._reader else [])
        events += self._close_text()
        return events

    def closing(self, results: Mapping[int, Result]) -> list[bytes]:
        result = results[0]
        stop_reason = self._stop_reason(result)
        return [
            _event(
                "message_delta",
                delta={
                    "stop_reason": stop_reason,
                    "stop_sequence": _stop_sequence(stop_reason, result),
                    **_closed(result),
                },
                usage=_usage(result),
            ),
            _event("message_stop"),
        ]

    def failed(self, error: ApiError) -> bytes:
        body = anthropic_error_body(error)
        return sse(body, event="error")

    def refused(self, error: ApiError) -> Response:
        return error_response(error, "/v1/messages")

    def whole(self, result: Result) -> dict[str, Any]:
        self._id = f"msg_{result.request_id}"
        if result.reasoning:
            self._thinking(result.reasoning)
            self._close_thinking()
        self._write(self._reader.feed(result.text) if self._reader else [result.text])
        self.finished(StreamedChoice(0, "", {}), result)
        return self._message(self._stop_reason(result), result)

    def _stop_reason(self, result: Result) -> str:
        if any(block["type"] == "tool_use" for block in self.content):
            return "tool_use"
        if result.finish_reason == "length":
            return "max_tokens"
        return "stop_sequence" if result.stop_sequence is not None else "end_turn"

    def _message(self, stop_reason: str | None, result: Result | None) -> dict[str, Any]:
        closed = {} if result is None else _closed(result)
        return {
            **closed,
            "id": self._id,
            "type": "message",
            "role": "assistant",
            "model": self._model,
            "content": self.content,
            "stop_reason": stop_reason,
            "stop_sequence": None if result is None else _stop_sequence(stop_reason, result),
            "usage": (
                _usage(result)
                if result is not None
                else {
                    "input_tokens": self._input_tokens,
                    "output_tokens": 0,
                    "cache_creation_input_tokens": 0,
                    "cache_read_input_tokens": 0,
                }
            ),
        }

    def _write(self, events: list[tools.Event]) -> list[bytes]:
        out: list[bytes] = []
        for event in events:
            if isinstance(event, str):
                if event:
                    out += self._delta(event)
            elif isinstance(event, tools.CallOpened):
                out += self._close_text()
                out += self._tool_use_start(event.id, event.name)
            elif isinstance(event, tools.ArgumentsDelta):
                out.append(self._input_delta(event.id, event.text))
            else:
                if not event.streamed:  # read whole (qwen3_coder's): one delta
                    out += self._close_text()
                    out += self._tool_use_start(event.id, event.name)
                    out.append(self._input_delta(event.id, event.arguments))
                block = self._tool_blocks.pop(event.id)
                block["input"] = json.loads(event.arguments)
                out.append(_event("content_block_stop", index=self.content.index(block)))
        return out

    def _tool_use_start(self, call_id: str, name: str) -> list[bytes]:
        block = {"type": "tool_use", "id": call_id, "name": name, "input": {}}
        self.content.append(block)
        self._tool_blocks[call_id] = block
        index = len(self.content) - 1
        return [_event("content_block_start", index=index, content_block=dict(block))]

    def _input_delta(self, call_id: str, text: str) -> bytes:
        index = self.content.index(self._tool_blocks[call_id])
        delta = {"type": "input_json_delta", "partial_json": text}
        return _event("content_block_delta", index=index, delta=delta)

    def _delta(self, text: str) -> list[bytes]:
        out = []
        if self._open_text is None:
            self._open_text = {"type": "text", "text": ""}
            self.content.append(self._open_text)
            out.append(
                _event(
                    "content_block_start",
                    index=len(self.content) - 1,
                    content_block={"type": "text", "text": ""},
                )
            )
        self._open_text["text"] += text
        out.append(
            _event(
                "content_block_delta",
                index=len(self.content) - 1,
                delta={"type": "text_delta", "text": text},
            )
        )
        return out

    def _thinking(self, thinking: str) -> list[bytes]:
        """A thinking block's text (opened at its first), streamed as ``thinking_delta``."""
        out = []
        if self._open_thinking is None:
            self._open_thinking = {"type": "thinking", "thinking": "", "signature": ""}
            self.content.append(self._open_thinking)
            block = {"type": "thinking", "thinking": "", "signature": ""}
            out.append(
                _event("content_block_start", index=len(self.content) - 1, content_block=block)
            )
        self._open_thinking["thinking"] += thinking
        delta = {"type": "thinking_delta", "thinking": thinking}
        out.append(_event("content_block_delta", index=len(self.content) - 1, delta=delta))
        return out

    def _close_thinking(self) -> list[bytes]:
        if self._open_thinking is None:
            return []
        index = self.content.index(self._open_thinking)
        self._open_thinking = None
        # No signature: this thinking is the model's own text, sent back as it is.
        return [
            _event(
                "content_block_delta",
                index=index,
                delta={"type": "signature_delta", "signature": ""},
            ),
            _event("content_block_stop", index=index),
        ]

    def _close_text(self) -> list[bytes]:
        if self._open_text is None:
            return []
        index = self.content.index(self._open_text)
        self._open_text = None
        return [_event("content_block_stop", index=index)]


def _closed(result: Result) -> dict[str, str]:
    """The forced close of the thinking (server.reasoning), a field of the message whole
    or streamed (a stream's headers went out before it was known)."""
    return {} if result.thinking_closed is None else {"thinking_closed": result.thinking_closed}


def _stop_sequence(stop_reason: str | None, result: Result) -> str | None:
    """The stop string that ended the answer, named only when it is the stop reason (a
    tool call the text ended with is the reason instead)."""
    return result.stop_sequence if stop_reason == "stop_sequence" else None


def _usage(result: Result) -> dict[str, Any]:
    # Anthropic counts the prompt tokens read from its cache apart from input_tokens.
    prompt = result.prompt_tokens or 0
    return {
        "input_tokens": prompt - result.cached_tokens,
        "output_tokens": result.completion_tokens or 0,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": result.cached_tokens,
    }


def _event(kind: str, **fields: Any) -> bytes:
    return sse({"type": kind, **fields}, event=kind)
