"""What an API family gives the daemon's one generation walk (``app._generate``).

Every route that generates (completions, chat, Responses, Anthropic Messages) reads its
body, checks the budget, takes the client's fair share, runs its pool requests under one
deadline and cancels them on a disconnect in the same walk; a family only says how its
body becomes a :class:`~modelpool.server.core.job.Job` and how the results are
written back, whole or streamed::

    class ChatApi:
        def parse(self, body): return ChatRequest(parse_chat(body))
        def answer(self, request, results, model): return json_bytes(...)
        def writer(self, request, choices, model): return ChatChunks(...)

``parse`` and ``answer`` may run in a thread (large bodies and answers, ``off_loop_if``).
``take_pool`` is the family's say between the parse and the runs: the model is the body's
model (``RunsOnItsModel``) unless the family answers without a run (Ollama's load and
unload requests) or checks the request against the loaded model (its context).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from modelpool.server.core.cost import output_ceiling
from modelpool.server.core.job import Job
from modelpool.server.core.served import Served
from modelpool.shared.config import PoolConfig
from modelpool.shared.validation import FIT_PARAM

if TYPE_CHECKING:
    from fastapi.responses import Response

    from modelpool.server.streaming import StreamedChoice, StreamWriter
    from modelpool.supervisor.pool import ModelPool, Result


def bound_by_deadline(job: Job, pool: ModelPool, deadline_s: float, budget: int) -> None:
    """A request that set no maximum gets what fits in the context (``fit_to_context``),
    but no more than its client's ``max_request_tokens`` pays for (``budget``: it was
    costed at the default 128) and, once its pool measured its rates, no more than it can
    decode before its deadline: it answers with ``finish_reason: "length"`` instead of a
    504. A model's own ``generation_defaults.max_new_tokens`` still caps it."""
    if FIT_PARAM not in job.params or "max_new_tokens" in job.params:
        return
    bounds = [output_ceiling(job, budget)]
    within = pool.tokens_within(deadline_s)
    if within is not None:
        bounds.append(within)
    configured = pool.config.generation_defaults.get("max_new_tokens")
    if isinstance(configured, int):
        bounds.append(configured)
    job.params["max_new_tokens"] = min(bounds)


def bind_tool_syntax(job: Job, config: PoolConfig, model: str) -> None:
    """A request's tools in its model's own call syntax (``tool_parser``, detected from the
    chat template for ``auto``): the grammar written in it and the calls read in it."""
    plan = job.tools
    if plan is None:
        return
    job.tools = plan.for_model(config, model)
    if plan.choice != "none":
        job.params["grammar"] = job.tools.grammar()


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

    async def take_pool(
        self, request: P, body: dict[str, Any], serve: Callable[[], Awaitable[Served]]
    ) -> Served | Response:
        """The model the runs go to (``serve()``: the body's model, loaded if need be,
        resolved once), or the whole answer of a request that runs nothing; an
        ``ApiError`` for a request the loaded model cannot serve."""


class RunsOnItsModel:
    """``take_pool`` of a family whose every request runs on its model's pool."""

    async def take_pool(
        self, request: object, body: dict[str, Any], serve: Callable[[], Awaitable[Served]]
    ) -> Served | Response:
        return await serve()


@dataclass(frozen=True)
class Plain:
    """A request that is its job alone (completions, chat)."""

    job: Job
