"""A tenant's bound on the priority of its requests (``most_urgent_priority`` in the keys
file, ``server.tenants``).

``priority`` is vLLM's: an integer, lower runs first, 0 by default. Without a bound any
client may send the most urgent one and, with ``preempt_for_priority``, take every
worker from the others until aging promotes their runs (the third review: another
tenant's p50 12x). A tenant's ``most_urgent_priority`` is the lowest number its requests
may run at: one that asks for less (or, with a bound above 0, says none) runs at the
bound, and its answer says so in ``X-Priority-Clamped`` (the priority it ran at)::

    bound = PriorityBound(client.tenant)
    bound.clamp_field(job.params)      # a generation's parameters, in place
    bound.note(request.scope)          # ClampedHeader writes the header
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from typing import Any, TypeVar

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from modelpool.server.tenants import Tenant
from modelpool.shared.validation import MAX_PRIORITY, is_int

T = TypeVar("T")

CLAMPED_HEADER = b"x-priority-clamped"
# Where a request's clamped priority waits for its answer's first message (scope state).
_NOTE = "priority_clamped"


class PriorityBound:
    """One request's bound: its tenant's ``most_urgent_priority`` (None: none), and the
    priority it was clamped to, if it was."""

    def __init__(self, tenant: Tenant | None) -> None:
        self.most_urgent = None if tenant is None else tenant.most_urgent_priority
        self.clamped_to: int | None = None

    def clamp(self, priority: int) -> int:
        """``priority``, or the bound when ``priority`` is more urgent than it."""
        if self.most_urgent is None or priority >= self.most_urgent:
            return priority
        self.clamped_to = self.most_urgent
        return self.most_urgent

    def clamp_field(self, body: MutableMapping[str, Any]) -> None:
        """Clamp ``body["priority"]`` (a request's parameters, or a body whose parser
        reads it) in place; absent is 0. A value that is not a priority is left for the
        parser to refuse."""
        asked = body.get("priority")
        asked = 0 if asked is None else asked
        if is_int(asked, minimum=-MAX_PRIORITY, maximum=MAX_PRIORITY):
            used = self.clamp(asked)
            if used != asked:
                body["priority"] = used

    def parsing(self, parse: Callable[..., T]) -> Callable[..., T]:
        """``parse`` of a body whose ``priority`` is clamped first (in a check thread)."""

        def bounded(body: MutableMapping[str, Any], *args: Any) -> T:
            self.clamp_field(body)
            return parse(body, *args)

        return bounded

    def note(self, scope: Scope) -> None:
        """Have the answer say the priority the request was clamped to (if it was)."""
        if self.clamped_to is not None:
            scope.setdefault("state", {})[_NOTE] = self.clamped_to


class ClampedHeader:
    """ASGI middleware: ``X-Priority-Clamped: P`` on the answer of a request whose
    priority its tenant's bound clamped to P (:meth:`PriorityBound.note`)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_noted(message: Message) -> None:
            if message["type"] == "http.response.start":
                clamped = scope.get("state", {}).get(_NOTE)
                if clamped is not None:
                    header = (CLAMPED_HEADER, str(clamped).encode())
                    message = {**message, "headers": [*message.get("headers", []), header]}
            await send(message)

        await self.app(scope, receive, send_noted)
