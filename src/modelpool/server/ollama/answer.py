"""Ollama's answers: NDJSON lines streamed, or one object whole, with its durations.

:class:`OllamaLines` reads the generated text (through ``tools.CallReader`` when tools
are offered) into Ollama's lines: one per piece of text (``message.content`` for
``/api/chat``, ``response`` for ``/api/generate``), one per tool call that validated
(``message.tool_calls``, its arguments an object), and a last one with ``done: true``,
``done_reason`` and the counts and durations. Not streamed, the same reading gives the
object whole. An error after the first line is a line ``{"error": "..."}``, which
Ollama's clients raise on.

The durations are measured, in nanoseconds: ``total_duration`` from the request's arrival
to its answer, ``load_duration`` the wait for the model to load (the registry's; 0 with
the one pool, loaded before the port opens), ``prompt_eval_duration`` from the run's
start on a worker to its first text, ``eval_duration`` from there to its end.
"""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from fastapi.responses import Response

from modelpool.server.errors import error_response
from modelpool.server.http import ApiError, json_bytes
from modelpool.server.ollama.models import timestamp
from modelpool.server.ollama.request import OllamaRequest
from modelpool.server.streaming import StreamedChoice, StreamedText
from modelpool.shared import tools

if TYPE_CHECKING:
    from modelpool.supervisor.pool import Result

NDJSON_CONTENT_TYPE = b"application/x-ndjson"
NS = 1_000_000_000


def created_at() -> str:
    """Now, as Ollama writes its ``created_at`` (RFC 3339, UTC)."""
    return timestamp(datetime.datetime.now(datetime.UTC))


@dataclass(frozen=True)
class Clock:
    """When the request arrived (``time.monotonic_ns``), and the seconds it waited for its
    model to load (``core.served.Served.waited_s``, known once its model is served)."""

    started_ns: int
    load_s: float = 0.0

    def load_ns(self) -> int:
        return int(self.load_s * NS)

    def durations(self, result: Result) -> dict[str, int]:
        queue = result.queue_s
        run = result.latency_s - queue
        prompt = run if result.ttft_s is None else max(0.0, result.ttft_s - queue)
        return {
            "total_duration": time.monotonic_ns() - self.started_ns,
            "load_duration": self.load_ns(),
            "prompt_eval_count": result.prompt_tokens or 0,
            "prompt_eval_duration": int(prompt * NS),
            "eval_count": result.completion_tokens or 0,
            "eval_duration": int(max(0.0, run - prompt) * NS),
        }


def done_line(kind: Literal["chat", "generate"], model: str, reason: str) -> dict[str, Any]:
    """The answer of a request that ran nothing (``reason``: "load" or "unload")."""
    line = _line(kind, model)
    line.update(done=True, done_reason=reason)
    return line


class OllamaLines:
    """The :class:`~modelpool.server.streaming.StreamWriter` of ``/api/chat`` and
    ``/api/generate``, and their whole answers (:meth:`whole`)."""

    content_type = NDJSON_CONTENT_TYPE

    def __init__(self, request: OllamaRequest, model: str, clock: Clock) -> None:
        self._request = request
        self._kind = request.kind
        self._model = model
        self._clock = clock
        plan = request.job.tools
        self._reader = tools.CallReader(plan) if plan is not None else None

    def opening(self, request_id: str) -> list[bytes]:
        return []

    def text(self, choice: StreamedChoice, item: StreamedText) -> list[bytes]:
        thinking = []
        if item.reasoning:
            line = _line(self._kind, self._model)
            _put_thinking(line, item.reasoning)
            line["done"] = False
            thinking.append(_encode(line))
        return thinking + self._write(self._reader.feed(item.text) if self._reader else [item.text])

    def heavy(self, result: Result) -> bool:
        return False

    def finished(self, choice: StreamedChoice, result: Result) -> list[bytes]:
        return self._write(self._reader.finish() if self._reader else [])

    def closing(self, results: Mapping[int, Result]) -> list[bytes]:
        return [_encode(self._last(results[0], _line(self._kind, self._model)))]

    def failed(self, error: ApiError) -> bytes:
        return _encode({"error": error.message})

    def refused(self, error: ApiError) -> Response:
        return error_response(error, f"/api/{self._kind}")

    def whole(self, result: Result) -> bytes:
        answer = _line(self._kind, self._model)
        if self._kind == "generate" or self._request.job.tools is None:
            _put_text(answer, result.text)
        else:
            content, calls = tools.read_answer(self._request.job.tools, result.text)
            answer["message"]["content"] = content or ""
            if calls:
                answer["message"]["tool_calls"] = [_ollama_call(call) for call in calls]
        if result.reasoning is not None:
            _put_thinking(answer, result.reasoning)
        return json_bytes(self._last(result, answer))

    def _last(self, result: Result, line: dict[str, Any]) -> dict[str, Any]:
        line["done"] = True
        line["done_reason"] = "length" if result.finish_reason == "length" else "stop"
        line.update(self._clock.durations(result))
        return line

    def _write(self, events: list[tools.Event]) -> list[bytes]:
        lines = []
        for event in events:
            if isinstance(event, str):
                if event:
                    line = _line(self._kind, self._model)
                    _put_text(line, event)
                    line["done"] = False
                    lines.append(_encode(line))
            elif isinstance(event, tools.ToolCall):  # whole calls only: no argument deltas
                line = _line(self._kind, self._model)
                line["message"]["tool_calls"] = [_ollama_call(event)]
                line["done"] = False
                lines.append(_encode(line))
        return lines


def _put_thinking(line: dict[str, Any], thinking: str) -> None:
    """A line's thinking: ``message.thinking`` for chat, ``thinking`` for generate."""
    if "message" in line:
        line["message"]["thinking"] = thinking
    else:
        line["thinking"] = thinking


def _line(kind: Literal["chat", "generate"], model: str) -> dict[str, Any]:
    """A line's head, its text empty: ``message`` for chat, ``response`` for generate."""
    line: dict[str, Any] = {"model": model, "created_at": created_at()}
    if kind == "chat":
        line["message"] = {"role": "assistant", "content": ""}
    else:
        line["response"] = ""
    return line


def _put_text(line: dict[str, Any], text: str) -> None:
    if "message" in line:
        line["message"]["content"] = text
    else:
        line["response"] = text


def _ollama_call(call: tools.ToolCall) -> dict[str, Any]:
    """A call as Ollama writes it: its arguments an object, not JSON text."""
    return {"id": call.id, "function": {"name": call.name, "arguments": json.loads(call.arguments)}}


def _encode(line: Mapping[str, Any]) -> bytes:
    return json.dumps(line, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"
