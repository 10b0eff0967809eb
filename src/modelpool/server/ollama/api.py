"""``/api/chat`` and ``/api/generate`` on the daemon's generation walk (``generation.Api``),
with Ollama's load and unload requests (no messages, or an empty prompt) answered without
a run, and ``options.num_ctx`` checked against the loaded model's context."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal

from fastapi import Request
from fastapi.responses import Response

from modelpool.server import rights
from modelpool.server.core.served import Served
from modelpool.server.http import ApiError, invalid, json_bytes
from modelpool.server.lora import base_of
from modelpool.server.models import KEEP_ALIVE
from modelpool.server.ollama.answer import Clock, OllamaLines, done_line
from modelpool.server.ollama.request import (
    OllamaRequest,
    parse_chat_body,
    parse_generate_body,
)
from modelpool.server.state import client_of
from modelpool.server.streaming import StreamedChoice
from modelpool.supervisor.registry import parse_keep_alive

if TYPE_CHECKING:
    from modelpool.server.state import ServerState
    from modelpool.supervisor.pool import Result


class OllamaApi:
    """The Ollama family, one per request: ``kind`` says which route."""

    def __init__(
        self,
        kind: Literal["chat", "generate"],
        state: ServerState,
        clock: Clock,
        caller: Request,
    ) -> None:
        self._kind = kind
        self._state = state
        self._clock = clock
        # The HTTP request: who asks (an operator's unload is the model's, a tenant's its own).
        self._caller = caller

    def parse(self, body: dict[str, Any]) -> OllamaRequest:
        return parse_chat_body(body) if self._kind == "chat" else parse_generate_body(body)

    def answer(self, request: OllamaRequest, results: Mapping[int, Result], model: str) -> bytes:
        return OllamaLines(request, model, self._clock).whole(results[0])

    def writer(
        self, request: OllamaRequest, choices: list[StreamedChoice], model: str
    ) -> OllamaLines:
        return OllamaLines(request, model, self._clock)

    async def take_pool(
        self,
        request: OllamaRequest,
        body: dict[str, Any],
        serve: Callable[[], Awaitable[Served]],
    ) -> Served | Response:
        if not request.runs:
            return await self._load_or_unload(request, body, serve)
        served = await serve()
        self._clock = dataclasses.replace(self._clock, load_s=served.waited_s)
        if request.num_ctx is not None:
            context = (await served.pool.astats()).max_model_len
            if context is not None and request.num_ctx > context:
                raise invalid(
                    f"options.num_ctx is {request.num_ctx}, more than the model's context of "
                    f"{context} tokens (max_model_len, which its workers were started with)",
                    "options.num_ctx",
                    "context_length_exceeded",
                )
        return served

    async def _load_or_unload(
        self,
        request: OllamaRequest,
        body: Mapping[str, Any],
        serve: Callable[[], Awaitable[Served]],
    ) -> Response:
        """Ollama's way to load a model (no messages) or unload it (``keep_alive: 0``)."""
        unload = False
        if body.get(KEEP_ALIVE) is not None:
            try:
                unload = parse_keep_alive(body[KEEP_ALIVE]) == 0
            except ValueError as exc:
                raise invalid(str(exc), KEEP_ALIVE) from None
        registry = self._state.registry
        if registry is None:
            if unload:
                raise ApiError(
                    400,
                    "this daemon serves one model, loaded for its lifetime: keep_alive 0 "
                    "cannot unload it (a daemon with [models.NAME] tables loads and unloads)",
                    code="unsupported_value",
                    param=KEEP_ALIVE,
                )
            model = self._state.model_name
        else:
            model = registry.spec(base_of(registry, request.model)).name  # an adapter's base
            if unload and rights.operates(self._caller):
                registry.unload(model)
            elif unload:
                # A tenant's keep_alive 0 ends its own use: the model unloads once idle
                # only if no other client's use keeps it (docs/many-models.md).
                registry.let_go(model, client_of(self._caller, self._state).name)
        if not unload:
            await serve()
        line = done_line(self._kind, model, "unload" if unload else "load")
        return Response(json_bytes(line), media_type="application/json")
