"""A pooling request (embeddings, rerank, score) in bounded micro-batches, each taking its
own turn in the fair share.

One such request may hold 2,048 inputs up to the request budget. Sent to the pool as one
request it held a worker for a minute while every other client waited, and its deadline
killed that worker: a backend reads the cancel flag only between its own forward passes,
and one pass of a request that large outlasts ``cancel_grace_s`` (issue 58). So the
daemon splits it (:func:`spans`) into micro-batches of ``MICRO_BATCH_ITEMS`` items at
most and of budget units (a text's characters, a token-id input's ids: what
``max_request_tokens`` counts, a bound on the tokens a model reads) that its pool's
recent micro-batches took ``MICRO_BATCH_S`` over (:class:`Pace`: measured, since a
unit's time is the model's and the machine's), and :func:`in_turns` sends them one after
another:

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
    pool, job, results = answer                  # (piece, call's result), in order
"""

from __future__ import annotations

import math
import re
import time
import weakref
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

# What a micro-batch should take: what another client's request waits for at most
# behind it, and what a cancel waits for, well within cancel_grace_s (2 s by default).
MICRO_BATCH_S = 0.25
# A micro-batch's budget units before its pool's are measured (2,048 token ids take a
# small embedding model on two CPU cores 0.25-0.5 s: the review measured 16,384 at 2-4
# s), and the units of a run of a request's cost in the fair share.
MICRO_BATCH_UNITS = 2048
# The bounds of a measured size: below, a pool request's own cost would dominate; above,
# an answer's size would.
MIN_UNITS = 256
MAX_UNITS = 16384
# Weight of the newest micro-batch in the measured time of a unit.
PACE_WEIGHT = 0.3
# And in items: each item's vector crosses the worker's pipe; a micro-batch's answer
# stays small whatever the texts' lengths.
MICRO_BATCH_ITEMS = 256
# The fields the pool's own refusals of these requests may name (their first word).
POOL_FIELDS = ("dimensions", "input", "query", "documents")
_INDEXED = re.compile(r"^(input|documents)\[(\d+)\]")


class Pace:
    """A pool's seconds per budget unit of pooling work, a moving mean over its recent
    micro-batches, and the micro-batch size that takes ``MICRO_BATCH_S`` at it. A
    micro-batch's time counts from its turn to its answer: several clients' micro-batches
    answered in one batched step each count the step, so together they are sized to it.

    >>> pace = Pace()
    >>> pace.units(), pace.note(2048, 1.0), pace.units()
    (2048, None, 512)
    """

    def __init__(self) -> None:
        self.unit_s: float | None = None

    def units(self) -> int:
        if self.unit_s is None:
            return MICRO_BATCH_UNITS
        if self.unit_s * MAX_UNITS <= MICRO_BATCH_S:
            return MAX_UNITS
        return max(MIN_UNITS, min(MAX_UNITS, int(MICRO_BATCH_S / self.unit_s)))

    def note(self, units: int, seconds: float) -> None:
        per_unit = seconds / max(units, 1)
        last = self.unit_s
        self.unit_s = per_unit if last is None else last + PACE_WEIGHT * (per_unit - last)


# Each pool's, for as long as it lives (a registry's models come and go).
_PACES: weakref.WeakKeyDictionary[ModelPool, Pace] = weakref.WeakKeyDictionary()


def pace_of(pool: ModelPool) -> Pace:
    return _PACES.setdefault(pool, Pace())


@dataclass(frozen=True)
class Plan:
    """A request's micro-batches (each the request's indices of its items), each one's
    budget units, and its size, which its cost in the fair share is counted from."""

    pieces: Sequence[Sequence[int]]
    piece_units: Sequence[int]
    units: int

    @property
    def runs(self) -> int:
        """Runs of the client's share it reserves: one per ``MICRO_BATCH_UNITS``, not one
        per micro-batch (a score's pairs of several queries are a micro-batch each, a
        request of 2,048 short texts is eight by their count: neither costs more)."""
        return max(1, math.ceil(self.units / MICRO_BATCH_UNITS))

    @classmethod
    def of(cls, sizes: Sequence[int], units: int) -> Plan:
        """Consecutive items of these sizes in micro-batches of ``units`` (:func:`spans`)."""
        pieces = spans(sizes, units)
        return cls(pieces, [sum(sizes[index] for index in piece) for piece in pieces], sum(sizes))

    @classmethod
    def joined(cls, plans: Sequence[Plan]) -> Plan:
        """One request's plans of parts (a score's queries), one after another."""
        return cls(
            [piece for plan in plans for piece in plan.pieces],
            [units for plan in plans for units in plan.piece_units],
            sum(plan.units for plan in plans),
        )


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
    plan_of: Callable[[J, int], Plan],
    call: Callable[[ModelPool, J, Sequence[int], float], Awaitable[R]],
    *,
    priority_of: Callable[[J], int],
) -> tuple[ModelPool, J, list[tuple[Sequence[int], R]]] | None:
    """The pooling routes' walk (see the module docstring): the body parsed and checked in
    a check thread, its model's pool (``check`` refuses a model that does not do what the
    route asks), then ``call(pool, job, piece, seconds_left)`` for each of
    ``plan_of(job, units).pieces`` (the request's item indices of each micro-batch, of
    ``units`` each at most), one after another, each in the client's turn. None when
    the client went away first."""
    waiting_s = deadline_from({}, request.headers, state.default_deadline_s(), None)
    body, job = await read_checked(request, state, waiting_s, parse, state.config)
    pool = await state.pool_for(request, body)
    check(pool)
    deadline_s = state.time_left(
        request, deadline_from({}, request.headers, pool.config.deadline_s, None)
    )
    ends = time.monotonic() + deadline_s
    pace = pace_of(pool)
    plan = plan_of(job, pace.units())
    pieces = plan.pieces
    client = client_of(request, state)
    # A ticket's slots past its reserved runs take their turn as the others do.
    ticket = state.share_for(request).reserve(
        client.name, plan.runs, client.limits, priority_of(job)
    )

    async def each() -> list[tuple[Sequence[int], R]]:
        results: list[tuple[Sequence[int], R]] = []
        for done, piece in enumerate(pieces):
            left_s = ends - time.monotonic()
            if left_s <= 0:
                raise DeadlineExceeded(
                    f"the deadline ({deadline_s:g} s) passed after {done} of the request's "
                    f"{len(pieces)} micro-batches"
                )
            async with ticket.slot(left_s) as slot_left_s:
                started = time.monotonic()
                result = await _indexed(call(pool, job, piece, slot_left_s), piece)
                results.append((piece, result))
                pace.note(plan.piece_units[done], time.monotonic() - started)
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
