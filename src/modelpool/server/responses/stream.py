"""A Responses answer as the API's typed events, and the same answer whole.

:class:`ResponseEvents` reads the generated text (through ``tools.CallReader`` when
tools are offered) into output items: a ``message`` with one ``output_text`` part, opened
at the first text, and a ``function_call`` per call that validated. Streamed, each step
is the OpenAI event of it, every one with the next ``sequence_number``::

    response.created, response.in_progress
    response.output_item.added (message), response.content_part.added,
    response.output_text.delta..., response.output_text.done,
    response.content_part.done, response.output_item.done
    response.output_item.added (function_call), response.function_call_arguments.delta,
    response.function_call_arguments.done, response.output_item.done
    response.completed | response.incomplete (max_output_tokens) | response.failed

Not streamed, the same reading gives the response object (``whole``), so that both
answers hold the same items. A finished response is stored for ``previous_response_id``
unless the request said ``store: false``.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from fastapi.responses import Response

from modelpool.server.http import ApiError
from modelpool.server.responses.format import Status, response_object
from modelpool.server.responses.request import ResponsesRequest
from modelpool.server.responses.store import ResponseStore
from modelpool.server.streaming import SSE_CONTENT_TYPE, StreamedChoice, StreamedText, sse
from modelpool.shared import tools

if TYPE_CHECKING:
    from modelpool.supervisor.pool import Result


class ResponseEvents:
    """The :class:`~modelpool.server.streaming.StreamWriter` of ``/v1/responses`` (one
    choice: the Responses API has no ``n``)."""

    content_type = SSE_CONTENT_TYPE

    def __init__(self, request: ResponsesRequest, model: str, store: ResponseStore) -> None:
        self._request = request
        self._model = model
        self._store = store
        plan = request.job.tools
        self._reader = tools.CallReader(plan, stream_arguments=True) if plan is not None else None
        self._call_items: dict[str, dict[str, Any]] = {}  # by call id, while streamed
        self._sequence = 0
        self.output: list[dict[str, Any]] = []
        self._message: dict[str, Any] | None = None
        self._text: list[str] = []
        self._reasoning: dict[str, Any] | None = None
        self._reasoning_text: list[str] = []
        self.response: dict[str, Any] | None = None

    # The stream writer's steps.

    def opening(self, request_id: str) -> list[bytes]:
        created = response_object(self._request, self._model, "in_progress", [])
        return [
            self._event("response.created", response=created),
            self._event("response.in_progress", response=created),
        ]

    def text(self, choice: StreamedChoice, item: StreamedText) -> list[bytes]:
        out = self._think(item.reasoning) if item.reasoning else []
        if not item.text:
            return out
        out += self._close_reasoning()
        return out + self._write(self._reader.feed(item.text) if self._reader else [item.text])

    def heavy(self, result: Result) -> bool:
        return False  # no logprobs here: the answer is its text

    def finished(self, choice: StreamedChoice, result: Result) -> list[bytes]:
        events = self._close_reasoning()
        events += self._write(self._reader.finish() if self._reader else [])
        status: Status = "incomplete" if result.finish_reason == "length" else "completed"
        events += self._close_message(status)
        self.response = response_object(
            self._request, self._model, status, self.output, result=result
        )
        if result.thinking_closed is not None:
            # The forced close (server.reasoning), whole or streamed (a stream's headers
            # went out before it was known).
            self.response["thinking_closed"] = result.thinking_closed
        if self._request.store:
            self._store.put(
                self._request.response_id,
                self.response,
                self.conversation(),
                owner=self._request.owner,
            )
        return events

    def closing(self, results: Mapping[int, Result]) -> list[bytes]:
        assert self.response is not None
        kind = "response.incomplete" if self.response["status"] == "incomplete" else None
        return [self._event(kind or "response.completed", response=self.response)]

    def failed(self, error: ApiError) -> bytes:
        failed = response_object(self._request, self._model, "failed", self.output, error=error)
        return self._event("response.failed", response=failed)

    def refused(self, error: ApiError) -> Response:
        return error.response()

    # The answer whole, and what is stored of it.

    def whole(self, result: Result) -> dict[str, Any]:
        if result.reasoning:
            self._think(result.reasoning)
        self._write(self._reader.feed(result.text) if self._reader else [result.text])
        self.finished(StreamedChoice(0, "", {}), result)
        assert self.response is not None
        return self.response

    def conversation(self) -> list[dict[str, Any]]:
        """The request's conversation, then this answer, as chat messages."""
        content = "".join(
            part["text"]
            for item in self.output
            if item["type"] == "message"
            for part in item["content"]
        )
        answer: dict[str, Any] = {"role": "assistant", "content": content}
        calls = [
            {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            for item in self.output
            if item["type"] == "function_call"
        ]
        if calls:
            answer["tool_calls"] = calls
        return [*self._request.messages, answer]

    # Output items.

    def _write(self, events: list[tools.Event]) -> list[bytes]:
        out: list[bytes] = []
        for event in events:
            if isinstance(event, str):
                if event:
                    out += self._delta(event)
            elif isinstance(event, tools.CallOpened):
                out += self._close_message("completed")
                out.append(self._call_added(event.id, event.name))
            elif isinstance(event, tools.ArgumentsDelta):
                out.append(self._arguments_delta(event.id, event.text))
            else:
                if not event.streamed:  # read whole (qwen3_coder's): one delta
                    out += self._close_message("completed")
                    out.append(self._call_added(event.id, event.name))
                    out.append(self._arguments_delta(event.id, event.arguments))
                out += self._call_done(event)
        return out

    def _delta(self, text: str) -> list[bytes]:
        out = []
        if self._message is None:
            self._message = {
                "id": f"msg_{uuid.uuid4().hex}",
                "type": "message",
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            self.output.append(self._message)
            out.append(self._item_event("response.output_item.added", self._message))
            out.append(self._part_event("response.content_part.added", _text_part("")))
        self._text.append(text)
        out.append(
            self._event(
                "response.output_text.delta",
                item_id=self._message["id"],
                output_index=len(self.output) - 1,
                content_index=0,
                delta=text,
                logprobs=[],
            )
        )
        return out

    def _think(self, text: str) -> list[bytes]:
        """A ``reasoning`` item (opened at its first text), before the message."""
        out = []
        if self._reasoning is None:
            self._reasoning = {
                "id": f"rs_{uuid.uuid4().hex}",
                "type": "reasoning",
                "status": "in_progress",
                "summary": [],
                "content": [],
            }
            self.output.append(self._reasoning)
            out.append(self._item_event("response.output_item.added", self._reasoning))
        self._reasoning_text.append(text)
        out.append(
            self._event(
                "response.reasoning_text.delta",
                item_id=self._reasoning["id"],
                output_index=len(self.output) - 1,
                content_index=0,
                delta=text,
            )
        )
        return out

    def _close_reasoning(self) -> list[bytes]:
        item = self._reasoning
        if item is None:
            return []
        text = "".join(self._reasoning_text)
        self._reasoning, self._reasoning_text = None, []
        item["content"] = [{"type": "reasoning_text", "text": text}]
        item["status"] = "completed"
        index = self.output.index(item)
        done = self._event(
            "response.reasoning_text.done",
            item_id=item["id"],
            output_index=index,
            content_index=0,
            text=text,
        )
        return [done, self._item_event("response.output_item.done", item, index)]

    def _close_message(self, status: str) -> list[bytes]:
        message = self._message
        if message is None:
            return []
        text = "".join(self._text)
        self._message, self._text = None, []
        part = _text_part(text)
        message["content"] = [part]
        message["status"] = status
        index = self.output.index(message)
        return [
            self._event(
                "response.output_text.done",
                item_id=message["id"],
                output_index=index,
                content_index=0,
                text=text,
                logprobs=[],
            ),
            self._part_event("response.content_part.done", part, message, index),
            self._item_event("response.output_item.done", message, index),
        ]

    def _call_added(self, call_id: str, name: str) -> bytes:
        item: dict[str, Any] = {
            "id": f"fc_{uuid.uuid4().hex}",
            "type": "function_call",
            "status": "in_progress",
            "call_id": call_id,
            "name": name,
            "arguments": "",
        }
        self.output.append(item)
        self._call_items[call_id] = item
        return self._item_event("response.output_item.added", dict(item), len(self.output) - 1)

    def _arguments_delta(self, call_id: str, text: str) -> bytes:
        item = self._call_items[call_id]
        return self._event(
            "response.function_call_arguments.delta",
            item_id=item["id"],
            output_index=self.output.index(item),
            delta=text,
        )

    def _call_done(self, call: tools.ToolCall) -> list[bytes]:
        item = self._call_items.pop(call.id)
        item["arguments"] = call.arguments
        item["status"] = "completed"
        index = self.output.index(item)
        return [
            self._event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                name=call.name,
                arguments=call.arguments,
            ),
            self._item_event("response.output_item.done", item, index),
        ]

    def _item_event(self, kind: str, item: dict[str, Any], index: int | None = None) -> bytes:
        position = len(self.output) - 1 if index is None else index
        return self._event(kind, output_index=position, item=item)

    def _part_event(
        self,
        kind: str,
        part: dict[str, Any],
        message: dict[str, Any] | None = None,
        index: int | None = None,
    ) -> bytes:
        message = message or self._message
        assert message is not None
        position = len(self.output) - 1 if index is None else index
        return self._event(
            kind, item_id=message["id"], output_index=position, content_index=0, part=part
        )

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return sse(payload, event=kind)


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
