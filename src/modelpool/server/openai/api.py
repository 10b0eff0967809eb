"""``/v1/completions`` and ``/v1/chat/completions`` on the daemon's generation walk
(``generation.Api``)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from modelpool.server.core.generation_body import parse_chat, parse_completion
from modelpool.server.generation import Plain, RunsOnItsModel
from modelpool.server.http import json_bytes
from modelpool.server.openai.format import response_body
from modelpool.server.openai.stream import ChatChunks
from modelpool.server.streaming import StreamedChoice

if TYPE_CHECKING:
    from modelpool.supervisor.pool import Result


class CompletionsApi(RunsOnItsModel):
    """``/v1/completions``."""

    def parse(self, body: dict[str, Any]) -> Plain:
        return Plain(parse_completion(body))

    def answer(self, request: Plain, results: Mapping[int, Result], model: str) -> bytes:
        return json_bytes(response_body(request.job, dict(results), model, int(time.time())))

    def writer(self, request: Plain, choices: list[StreamedChoice], model: str) -> ChatChunks:
        return ChatChunks(request.job, choices, model)


class ChatApi(CompletionsApi):
    """``/v1/chat/completions``: the same answers, the chat body."""

    def parse(self, body: dict[str, Any]) -> Plain:
        return Plain(parse_chat(body))
