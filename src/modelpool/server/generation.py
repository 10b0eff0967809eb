"""What an API family gives the daemon's one generation walk (``app._generate``).

Every route that generates (completions, chat, Responses, Anthropic Messages) reads its
body, checks the budget, takes the client's fair share, runs its pool requests under one
deadline and cancels them on a disconnect in the same walk; a family only says how its
body becomes a :class:`~modelpool.server.openai.format.Job` and how the results are
written back, whole or streamed::

    class ChatApi:
        def parse(self, body): return ChatRequest(parse_chat(body))
        def answer(self, request, results, model): return json_bytes(...)
        def writer(self, request, choices, model): return ChatChunks(...)

``parse`` and ``answer`` may run in a thread (large bodies and answers, ``off_loop_if``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from modelpool.server.openai.format import Job

if TYPE_CHECKING:
    from modelpool.pool import Result
    from modelpool.server.streaming import StreamedChoice, StreamWriter


class Parsed(Protocol):
    """A family's parsed request: at least the pool's :class:`Job`."""

    @property
    def job(self) -> Job: ...


P = TypeVar("P", bound=Parsed)


class Api(Protocol[P]):
    """One API family's side of the walk."""

    def parse(self, body: dict[str, Any]) -> P:
        """The request, checked; an ``ApiError`` naming the field otherwise."""

    def answer(self, request: P, results: Mapping[int, Result], model: str) -> bytes:
        """The non-streamed answer's JSON body."""

    def writer(self, request: P, choices: list[StreamedChoice], model: str) -> StreamWriter:
        """The events of the streamed answer."""


@dataclass(frozen=True)
class Plain:
    """A request that is its job alone (completions, chat)."""

    job: Job
