"""A pooling request (embeddings, rerank, score) in bounded micro-batches, each taking its
own turn in the fair share.

One such request may hold 2,048 inputs up to the request budget. Sent to the pool as one
request it held a worker for a minute while every other client waited, and its deadline
killed that worker: a backend reads the cancel flag only between its own forward passes,
and one pass of a request that large outlasts ``cancel_grace_s`` (issue 58). So the
daemon splits it (:func:`spans`) into micro-batches of at most ``MICRO_BATCH_TOKENS``
tokens (a token-id input's ids, a text's characters over ``CHARS_PER_TOKEN``: an
estimate without the model) and ``MICRO_BATCH_ITEMS`` items, and :func:`in_turns` sends
them one after another:

- the request reserves one run of the client's fair share per ``MICRO_BATCH_TOKENS`` of
  its size up front (:class:`Plan`), so its cost in the share is its tokens: a client's
  share bounds how much it may have waiting (429 ``client_limit`` past it, as for a
  generation's ``n``), and so does the pool's ``max_queue`` (429 ``pool_overloaded``);
- the request is admitted once, by its predicted wait, as a generation is
  (``core.admission``: a 429 ``queue_full`` past its pool's ``max_queue_time_s`` or its
  deadline, counting what waits in the fair share ahead of it), and each of its pool
  requests carries that admission and the caller's ``traceparent``;
- each micro-batch is one pool request in the client's turn, so another client's request
  goes in between two of them and waits at most one micro-batch;
- the deadline is the request's: a micro-batch still waiting for its turn when it passes
  never starts, and the one running is cancelled and stops at its next pass boundary
  (hf's passes are of at most 4,096 padded tokens), without a kill; the answer is a 504;
- the pieces' answers are the whole's: each item's vector or score does not depend on the
  others in its micro-batch, and a refusal names the item by its index in the request::

    answer = await in_turns(request, state, parse, check, plan_of, call, priority_of=p)
    if answer is None: ...                      # the client went away; its work is cancelled
    served, job, results = answer                # (piece, call's result), in order
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request

from modelpool.server.core.admission import admit
from modelpool.server.core.deadline import deadline_from
from modelpool.server.core.served import Served
from modelpool.server.http import ApiError, run_unless_disconnected
from modelpool.server.priority_bound import PriorityBound
from modelpool.server.state import client_of, read_checked
from modelpool.shared.config import ServerConfig
from modelpool.shared.errors import DeadlineExceeded, InvalidRequest

if TYPE_CHECKING:
    from modelpool.server.state import ServerState
    from modelpool.supervisor.pool import ModelPool

J = TypeVar("J")
R = TypeVar("R")
# A pool request's queueing keywords (``core.admission.Admission.queue``).
Queue = Mapping[str, Any]

# A micro-batch's bound in estimated tokens: 2,048 take a small embedding model on two CPU
# cores 0.2-0.5 s (the review measured 16,384 at 2-4 s), what another client's request
# waits for behind it (with a batched worker, behind a step of every client's); a smaller
# one costs more in the pool request's own time, about 20 ms (sized by a measured time
# per unit, which that own time inflates at small sizes, micro-batches shrank to a
# document each and a 2,048-document rerank of MiniLM passed 60 s). Also the tokens of
# one run of a request's cost in the fair share.
MICRO_BATCH_TOKENS = 2048
# Characters of a text per token, for the estimate: about what a BPE or WordPiece
# vocabulary reads of English; a text that packs more tokens than that makes a longer
# micro-batch, whose passes still read the cancel flag.
CHARS_PER_TOKEN = 4
# And in items: each item's vector crosses the worker's pipe; a micro-batch's answer
# stays small whatever the texts' lengths.
MICRO_BATCH_ITEMS = 256
# The fields the pool's own refusals of these requests may name (their first word).
POOL_FIELDS = ("dimensions", "input", "query", "documents")
_INDEXED = re.compile(r"^(input|documents)\[(\d+)\]")


def tokens_of(item: str | Sequence[int]) -> int:
    """An item's tokens, estimated: a token-id input's ids, a text's characters over
    ``CHARS_PER_TOKEN`` (at least one)."""
    if isinstance(item, str):
        return max(1, math.ceil(len(item) / CHARS_PER_TOKEN))
    return len(item)


@dataclass(frozen=True)
class Plan:
    """A request's micro-batches (each the request's indices of its items) and its
    estimated tokens, which its cost in the fair share is counted from."""

    pieces: Sequence[Sequence[int]]
    tokens: int

    @property
    def runs(self) -> int:
        """Runs of the client's share it reserves: one per ``MICRO_BATCH_TOKENS``, not one
        per micro-batch (a score's pairs of several queries are a micro-batch each, a
        request of 2,048 short texts is eight by their count: neither costs more)."""
        return max(1, math.ceil(self.tokens / MICRO_BATCH_TOKENS))

    @classmethod
    def of(cls, tokens: Sequence[int]) -> Plan:
        """Consecutive items of these tokens in micro-batches (:func:`spans`)."""
        return cls(spans(tokens), sum(tokens))

    @classmethod
    def joined(cls, plans: Sequence[Plan]) -> Plan:
        """One request's plans of parts (a score's queries), one after another."""
        pieces = [piece for plan in plans for piece in plan.pieces]
        return cls(pieces, sum(plan.tokens for plan in plans))


def spans(
    sizes: Sequence[int], units: int = MICRO_BATCH_TOKENS, items: int = MICRO_BATCH_ITEMS
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
    check: Callable[[Served], None],
    plan_of: Callable[[J], Plan],
    call: Callable[[ModelPool, J, Sequence[int], float, Queue], Awaitable[R]],
    *,
    priority_of: Callable[[J], int],
) -> tuple[Served, J, list[tuple[Sequence[int], R]]] | None:
    """The pooling routes' walk (see the module docstring): the body parsed and checked in
    a check thread (against the tenant's own limits), its model (``check`` refuses a
    model that does not do what the route asks), the generation routes' admission step
    (``core.admission``: its predicted wait, a 429 ``queue_full`` past its pool's bound,
    and the caller's ``traceparent``), then ``call(pool, job, piece, seconds_left,
    queue)`` for each of ``plan_of(job).pieces`` (the request's item indices of each
    micro-batch), one after another, each in the client's turn, each pool request with
    the admission's queueing keywords (``queue``). None when the client went away
    first."""
    client = client_of(request, state)
    waiting_s = deadline_from({}, request.headers, state.default_deadline_s(), None)
    bound = PriorityBound(client.tenant)
    # Checked against the tenant's own max_request_tokens where its table sets one, its
    # priority clamped to the tenant's bound.
    body, job = await read_checked(
        request, state, waiting_s, bound.parsing(parse), client.config(state.config)
    )
    bound.note(request.scope)
    served = await state.serve(request, body)
    check(served)
    pool = served.pool
    deadline_s = served.time_left(deadline_from({}, request.headers, pool.config.deadline_s, None))
    ends = time.monotonic() + deadline_s
    plan = plan_of(job)
    pieces = plan.pieces
    admission = admit(served, request.headers, client.name, priority_of(job), None, deadline_s)
    # A ticket's slots past its reserved runs take their turn as the others do.
    ticket = served.share.reserve(
        client.name, plan.runs, client.limits, admission.priority, admission.due_at
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
            # Each micro-batch ages from when it starts waiting: on the request's first
            # clock, a long request's later pieces would be promoted past every other
            # client's fresh runs once it had run for priority_aging_s.
            ticket.arrived_at = time.monotonic()
            async with ticket.slot(left_s) as slot_left_s:
                work = call(pool, job, piece, slot_left_s, admission.queue)
                result = await _indexed(work, piece)
                results.append((piece, result))
        return results

    try:
        finished, results = await run_unless_disconnected(request.receive, each())
    finally:
        ticket.close()
    if not finished or results is None:
        return None
    return served, job, results


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
