"""The model a request runs on, resolved once: :class:`Served`.

``ServerState.serve(request, body)`` makes it where the pool is chosen (the one pool, or
the registry's model of the body's ``model``, loaded if need be) and the walk passes it
to everything that needs the model: its fair share, the deadline left after the load,
the admission step and the name the answer gives::

    served = await state.serve(request, body)   # 404 model_not_found, 503, 504, 507
    ticket = served.share.reserve(client, runs, limits, priority, due_at)
    result = await served.pool.agenerate(prompt, deadline_s=served.time_left(deadline_s))
    body = answer(..., model=served.name)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from modelpool.server.fair_share import FairShare
    from modelpool.supervisor.pool import ModelPool
    from modelpool.supervisor.registry import ModelLease


@dataclass(frozen=True)
class Served:
    """A request's model: its ``pool``; its ``name`` (the registry's own name, which an
    alias answers with, or the one served model's); the fair ``share`` its runs take
    their turn in (the model's with a registry: each model has its own workers); the
    ``lease`` that keeps it loaded until the answer is out (None for the one pool,
    loaded for the daemon's lifetime); and ``waited_s``, the seconds it waited for the
    model to load, which count against its deadline."""

    pool: ModelPool
    name: str
    share: FairShare
    lease: ModelLease | None = None
    waited_s: float = 0.0

    def time_left(self, deadline_s: float) -> float:
        """``deadline_s`` less the wait for the model to load (a millisecond at least)."""
        return max(0.001, deadline_s - self.waited_s)
