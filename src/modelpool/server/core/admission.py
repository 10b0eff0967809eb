"""The admission step every walk that runs a model takes (generation, embeddings,
scoring), between choosing its model and taking its turn in the fair share.

Admission by predicted wait (``QueueFull``, a 429 ``queue_full``, when it would wait too
long), once, here: the runs wait in the fair share and then in the pool, so the
prediction counts both (in the fair share, the runs it would let in ahead of this
client's: another client's backlog counts one run per round), and the pool does not
judge again a request the daemon accepted (``admitted``: it promotes such runs before
their deadline as its own admitted requests, so that more urgent runs let in after them
do not keep them past it). The caller's W3C ``traceparent`` goes with every run, so that
the pool's trace of each is a child of the caller's span::

    admission = admit(served, request.headers, client, priority, None, deadline_s)
    ticket = served.share.reserve(client, runs, limits, admission.priority, admission.due_at)
    await served.pool.aembed(inputs, deadline_s=left_s, **admission.queue)
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from modelpool.server.core.served import Served
from modelpool.shared.validation import valid_traceparent

TRACEPARENT_HEADER = "traceparent"


@dataclass(frozen=True)
class Admission:
    """An admitted request: its ``priority``, when its runs waiting in the fair share
    count as the most urgent (``due_at``, monotonic: ``ModelPool.promotion_at``, before
    its deadline; never without a bound), and the queueing keywords each of its pool
    requests carries (``queue``: ``admitted`` or no bound, ``traceparent``)."""

    priority: int
    due_at: float
    queue: dict[str, Any] = field(default_factory=dict)


def admit(
    served: Served,
    headers: Mapping[str, str],
    client: str,
    priority: int,
    max_queue_time_s: float | None,
    deadline_s: float,
) -> Admission:
    """Judge a request of ``client`` at ``priority`` by its predicted wait against
    ``max_queue_time_s`` (None: its pool's setting) and ``deadline_s``; raises
    ``QueueFull`` past either (see the module docstring)."""
    pool = served.pool
    due_in_s = pool.check_admission(
        priority,
        max_queue_time_s,
        deadline_s,
        also_waiting=served.share.waiting_ahead(client, priority),
    )
    # Judged here: the pool must not judge it again, as if it had not waited already.
    queue: dict[str, Any] = (
        {"max_queue_time_s": math.inf} if due_in_s is None else {"admitted": True}
    )
    traceparent = headers.get(TRACEPARENT_HEADER)
    if traceparent is not None and valid_traceparent(traceparent):
        queue["traceparent"] = traceparent
    return Admission(priority, pool.promotion_at(time.monotonic(), due_in_s), queue)
