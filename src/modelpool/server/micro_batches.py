"""A pooling request (embeddings, rerank, score) in bounded micro-batches, each taking its
own turn in the fair share.

One such request may hold 2,048 inputs up to the request budget. Sent to the pool as one
request it held a worker for a minute while every other client waited, and its deadline
killed that worker: a backend reads the cancel flag only between its own forward passes,
and one pass of a request that large outlasts ``cancel_grace_s`` (issue 58). So the
daemon splits it (:func:`spans`) into micro-batches of at most ``MICRO_BATCH_UNITS``
budget units (a text's characters, a token-id input's ids: what ``max_request_tokens``
counts, a bound on the tokens a model reads) and ``MICRO_BATCH_ITEMS`` items, and
:func:`in_turns` sends them one after another:

- the request reserves one run of the client's fair share per ``MICRO_BATCH_UNITS`` of
  its size up front (:class:`Plan`), so its cost in the share is its tokens: a client's
  share bounds how much it may have waiting (429 ``client_limit`` past it, as for a
  generation's ``n``), and so does the pool's ``max_queue`` (429 ``pool_overloaded``);
- each micro-batch is one pool request in the client's turn, so another client's request
  goes in between two of them and waits at most one micro-batch;
- the deadline is the request's: a micro-batch still waiting for its turn when it passes
  never starts, and the one running is cancelled and stops at its next pass boundary
  (a micro-batch is a pass or two), without a kill; the answer is a 504;
- the pieces' answers are the whole's: each item's vector or score does not depend on the
  others in its micro-batch, and a refusal names the item by its index in the request::

    answer = await in_turns(request, state, parse, check, plan_of, call, priority_of=p)
    if answer is None: ...                      # the client went away; its work is cancelled
    pool, job, results = answer                  # results[i]: call's for plan_of(job).pieces[i]
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request

from modelpool.config import ServerConfig
from modelpool.errors import DeadlineExceeded, InvalidRequest
from modelpool.server.http import ApiError, run_unless_disconnected
from modelpool.server.openai.request import deadline_from
from modelpool.server.state import client_of, read_checked

if TYPE_CHECKING:
    from modelpool.pool import ModelPool
    from modelpool.server.state import ServerState

J = TypeVar("J")
R = TypeVar("R")

# A micro-batch's bound in budget units: 4,096 token ids take a small embedding model on
# two CPU cores about 0.5-1 s (the review measured 16,384 at 2-4 s), well within
# cancel_grace_s; as characters, about a quarter of that.
MICRO_BATCH_UNITS = 4096
# And in items: each item's vector crosses the worker's pipe; a micro-batch's answer
# stays small whatever the texts' lengths.
MICRO_BATCH_ITEMS = 256
# The fields the pool's own refusals of these requests may name (their first word).
POOL_FIELDS = ("dimensions", "input", "query", "documents")
_INDEXED = re.compile(r"^(input|documents)\[(\d+)\]")


@dataclass(frozen=True)
class Plan:
    """A request's micro-batches (each the request's indices of its items) and its size in
    budget units, which its cost in the fair share is counted from."""

    pieces: Sequence[Sequence[int]]
    units: int

    @property
    def runs(self) -> int:
        """Runs of the client's share it reserves: one per ``MICRO_BATCH_UNITS``, not one
        per micro-batch (a score's pairs of several queries are a micro-batch each, a
        request of 2,048 short texts is eight by their count: neither costs more)."""
        return max(1, math.ceil(self.units / MICRO_BATCH_UNITS))

    @classmethod
    def of(cls, sizes: Sequence[int]) -> Plan:
        """Consecutive items of these sizes in micro-batches (:func:`spans`)."""
        return cls(spans(sizes), sum(sizes))


def spans(
    sizes: Sequence[int], units: int = MICRO_BATCH_UNITS, items: int = MICRO_BATCH_ITEMS
) -> list[range]:
    """Consecutive items, in order, ``units`` of size and ``items`` at most each (an item
    larger than ``units`` alone).

    >>> spans([3, 3, 3, 9, 1], units=6)
    [range(0, 2), range(2, 3), range(3, 4), range(4, 5)]
    >>> spans([1, 1, 1], items=2)
    [range(0, 2), range(2, 3)]
    """
    pieces: list[range] = []
    start = packed = 0
    for index, size in enumerate(sizes):
        if index > start and (packed + size > units or index - start >= items):
            pieces.append(range(start, index))
            start, packed = index, 0
        packed += size
    if start < len(sizes):
        pieces.append(range(start, len(sizes)))
    return pieces


async def in_turns(
    request: Request,
    state: ServerState,
    parse: Callable[[dict[str, Any], ServerConfig], J],
    check: Callable[[ModelPool], None],
    plan_of: Callable[[J], Plan],
    call: Callable[[ModelPool, J, Sequence[int], float], Awaitable[R]],
    *,
    priority_of: Callable[[J], int],
) -> tuple[ModelPool, J, list[R]] | None:
    """The pooling routes' walk (see the module docstring): the body parsed and checked in
    a check thread, its model's pool (``check`` refuses a model that does not do what the
    route asks), then ``call(pool, job, piece, seconds_left)`` for each of
    ``plan_of(job).pieces`` (the request's item indices of each micro-batch), one after
    another, each in the client's turn. None when the client went away first."""
    waiting_s = deadline_from({}, request.headers, state.default_deadline_s(), None)
    body, job = await read_checked(request, state, waiting_s, parse, state.config)
    pool = await state.pool_for(request, body)
    check(pool)
    deadline_s = state.time_left(
        request, deadline_from({}, request.headers, pool.config.deadline_s, None)
    )
    ends = time.monotonic() + deadline_s
    plan = plan_of(job)
    pieces = plan.pieces
    client = client_of(request, state)
    # A ticket's slots past its reserved runs take their turn as the others do.
    ticket = state.share_for(request).reserve(
        client.name, plan.runs, client.limits, priority_of(job)
    )

    async def each() -> list[R]:
        results: list[R] = []
        for done, piece in enumerate(pieces):
            left_s = ends - time.monotonic()
            if left_s <= 0:
                raise DeadlineExceeded(
                    f"the deadline ({deadline_s:g} s) passed after {done} of the request's "
                    f"{len(pieces)} micro-batches"
                )
            async with ticket.slot(left_s) as slot_left_s:
                results.append(await _indexed(call(pool, job, piece, slot_left_s), piece))
        return results

    try:
        finished, results = await run_unless_disconnected(request.receive, each())
    finally:
        ticket.close()
    if not finished or results is None:
        return None
    return pool, job, results


async def _indexed(work: Awaitable[R], piece: Sequence[int]) -> R:
    """``work``, a plain ``InvalidRequest`` of the pool a 400 naming the field its message
    opens with (the pool's refusals say the field first: "dimensions is 512, but ...";
    the HTTP field names are the library's), and the item it names by its index in the
    request, not in the micro-batch. Typed subclasses (ContextLengthExceeded, WrongTask)
    keep their own answers, with the index corrected too."""
    try:
        return await work
    except InvalidRequest as exc:
        exc.message = _INDEXED.sub(lambda named: _in_request(named, piece), exc.message, 1)
        exc.args = (exc.message,)
        if type(exc) is not InvalidRequest:
            raise
        field = exc.message.split(" ", 1)[0].split("[", 1)[0]
        raise ApiError(
            400,
            exc.message,
            param=field if field in POOL_FIELDS else None,
            code="invalid_value",
            extra={"request_id": exc.request_id},
        ) from None


def _in_request(named: re.Match[str], piece: Sequence[int]) -> str:
    field, index = named[1], int(named[2])
    return f"{field}[{piece[index]}]" if index < len(piece) else named[0]
