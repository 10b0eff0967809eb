"""The daemon's state, shared by its routes, and the walk of its small routes.

:class:`ServerState` is what every route reads: the one pool or the registry
(``serve`` asks ``server.models`` for a request's model, resolved once into a
``core.served.Served``), the fair shares, the check threads, the keys, the metrics.
:func:`on_a_worker` is the walk of the tokenizer routes (in ``app``), which run one short
pool call: the body parsed and checked in a check thread, the model, then the call in
the client's turn of fair share (the embedding and scoring routes take the generation
routes' admission step too: ``micro_batches``)::

    pool, tokens = await on_a_worker(request, state, parse, run)

``app.create_app`` builds the state and wires the routes; the route modules import
this one, never ``app``.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request

from modelpool.server import models as multi
from modelpool.server import rights
from modelpool.server.checks import Checks
from modelpool.server.core.deadline import deadline_from
from modelpool.server.core.served import Served
from modelpool.server.errors import RETRY_AFTER_UNAVAILABLE
from modelpool.server.fair_share import FairShare, Limits
from modelpool.server.guard import require_json
from modelpool.server.http import ApiError, parse_json_object, read_body
from modelpool.server.metrics import PoolMetrics
from modelpool.server.priority_bound import PriorityBound
from modelpool.server.responses.api import ResponsesApi
from modelpool.server.tenants import Keys, Tenant
from modelpool.shared.config import PoolConfig, ServerConfig
from modelpool.supervisor.registry import ModelRegistry
from modelpool.supervisor.stats import PoolHealth

if TYPE_CHECKING:
    from modelpool.supervisor.pool import ModelPool

T = TypeVar("T")
R = TypeVar("R")


class LoopWatch:
    """How late this event loop runs a timer: the server's half of ``/healthz``.

    A task sleeps ``interval_s`` at a time and records how late it woke. A loop blocked
    by synchronous code shows either as that lateness or, while the block lasts, as a
    tick overdue, whichever the probe's handler sees first::

        watch = LoopWatch()
        watch.ensure_started()            # from a coroutine on the loop to watch
        watch.lag_s()                     # 0.0 on a loop that keeps up
    """

    def __init__(self, interval_s: float = 0.25) -> None:
        self.interval_s = interval_s
        self._task: asyncio.Task[None] | None = None
        self._last_tick: float | None = None
        self._last_lag = 0.0

    def ensure_started(self) -> None:
        if self._task is None or self._task.done():
            loop = asyncio.get_running_loop()
            self._last_tick = loop.time()
            self._task = loop.create_task(self._tick(), name="modelpool-loop-watch")

    async def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self.interval_s
            await asyncio.sleep(self.interval_s)
            now = loop.time()
            self._last_lag = max(0.0, now - due)
            self._last_tick = now

    def lag_s(self) -> float:
        """Seconds late: the latest tick's lateness, or how overdue the next one is."""
        if self._last_tick is None:
            return 0.0
        overdue = asyncio.get_running_loop().time() - self._last_tick - self.interval_s
        return round(max(self._last_lag, overdue, 0.0), 3)


@dataclass
class ServerState:
    """Mutable state shared by the routes and the CLI's signal handler. One of ``pool``
    (one model) and ``registry`` (many) is set."""

    pool: ModelPool | None
    config: ServerConfig
    model_name: str
    metrics: PoolMetrics
    started: int
    # The one pool's; with a registry it holds the requests being checked (their model
    # not known yet) and ``shares`` the runs, one per model (each has its own workers).
    fair_share: FairShare
    responses: ResponsesApi  # its store: previous_response_id, GET/DELETE
    keys: Keys
    checks: Checks
    # Parsing and building large bodies and answers, in a thread, one at a time.
    heavy_work: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(1))
    draining: bool = False
    loop_watch: LoopWatch = field(default_factory=LoopWatch)
    registry: ModelRegistry | None = None
    shares: dict[str, FairShare] = field(default_factory=dict)

    async def serve(self, request: Request, body: dict[str, Any]) -> Served:
        """The model for the body's ``model``, resolved once (``core.served.Served``) and
        held until the answer is sent (see ``server.models``): the one pool, or the
        registry's, loaded if need be."""
        return await multi.serve(self, request, body, client_of(request, self).name)

    def pool_config_for(self, body: dict[str, Any]) -> PoolConfig:
        """The configuration of the pool that serves the body's ``model``, without loading
        it (a check thread costs a request with it before its model is chosen)."""
        if self.registry is None:
            assert self.pool is not None
            return self.pool.config
        return multi.config_for(self.registry, body)

    def default_deadline_s(self) -> float:
        """The deadline of a request whose body does not say (yet): the pool's, or the
        longest of the registry's models."""
        if self.registry is None:
            assert self.pool is not None
            return self.pool.config.deadline_s
        return max(spec.pool.deadline_s for spec in self.registry.config.models)

    async def read_json(self, request: Request) -> dict[str, Any]:
        """A small JSON body (the admin routes'), parsed in a check thread."""
        deadline = deadline_from({}, request.headers, self.default_deadline_s(), None)
        body, _ = await read_checked(request, self, deadline, _no_parse)
        return body

    def health(self) -> PoolHealth:
        """The pool's liveness, or the registry's (its supervisor's heartbeat)."""
        if self.registry is not None:
            return self.registry.health()
        assert self.pool is not None
        return self.pool.health()


def check_not_draining(state: ServerState) -> None:
    """503 ``draining`` once a signal has asked the daemon to stop."""
    if state.draining:
        raise ApiError(
            503,
            "the server is shutting down",
            type="unavailable_error",
            code="draining",
            headers={"Retry-After": str(RETRY_AFTER_UNAVAILABLE), "Connection": "close"},
        )


@dataclass(frozen=True)
class Client:
    """Who a request counts against: its tenant when keys are set, else its address."""

    name: str
    tenant: Tenant | None

    @property
    def limits(self) -> Limits | None:
        if self.tenant is None:
            return None
        return (self.tenant.client_max_running, self.tenant.client_max_queued)

    def config(self, server: ServerConfig) -> ServerConfig:
        """``server`` with this client's own request budget: what its body is held to."""
        budget = self.tenant.max_request_tokens if self.tenant is not None else None
        return server if budget is None else dataclasses.replace(server, max_request_tokens=budget)


def client_of(request: Request, state: ServerState) -> Client:
    """Who ``request`` counts against in the fair share and the check threads: its
    tenant, or its address without a key or with the key every client shares."""
    address = request.client.host if request.client is not None else "-"
    if state.keys.required:
        # The key was checked already (the protocol, the Gate): it names a tenant.
        tenant = rights.caller(request)
        if tenant is not None:
            return Client(address if tenant.shared else f"tenant:{tenant.name}", tenant)
    return Client(address, None)


async def read_checked(
    request: Request, state: ServerState, deadline_s: float, parse: Callable[..., T], *args: Any
) -> tuple[dict[str, Any], T]:
    """A small route's body and what ``parse(body, *args)`` makes of it, both in a check
    thread (never on the loop, whatever its size)."""
    check_not_draining(state)
    require_json(request.headers.get("content-type"))
    raw = await read_body(request, state.config.max_body_bytes)
    client = client_of(request, state)
    checks = state.checks
    return await checks.run(client.name, client.limits, deadline_s, _parsed, raw, parse, *args)


def _parsed(raw: bytes, parse: Callable[..., T], *args: Any) -> tuple[dict[str, Any], T]:
    body = parse_json_object(raw)
    return body, parse(body, *args)


def _no_parse(body: dict[str, Any]) -> None:
    return None


async def on_a_worker(
    request: Request,
    state: ServerState,
    parse: Callable[[dict[str, Any], ServerConfig], T],
    call: Callable[[ModelPool, T, float], Awaitable[R]],
    *,
    priority_of: Callable[[T], int] | None = None,
) -> tuple[ModelPool, R]:
    """A tokenizer route's walk: its body parsed and checked in a check thread (against
    the tenant's own ``max_request_tokens`` where its table sets one), its model's pool,
    then ``call(pool, job, seconds_left)`` in the client's turn of fair share (tokenizing
    takes a worker, as a generation does) at the job's priority (``priority_of``; 0
    without it), within its tenant's bound (``priority_bound``)."""
    client = client_of(request, state)
    waiting_s = deadline_from({}, request.headers, state.default_deadline_s(), None)
    bound = PriorityBound(client.tenant)
    if priority_of is not None:
        parse = bound.parsing(parse)
    body, job = await read_checked(request, state, waiting_s, parse, client.config(state.config))
    served = await state.serve(request, body)
    pool = served.pool
    deadline = served.time_left(deadline_from({}, request.headers, pool.config.deadline_s, None))
    # A route whose body has no priority runs at 0, held to the tenant's bound too: a
    # tenant bounded at 5 must not pass others' priority 1-5 work with tokenizer runs.
    priority = bound.clamp(0 if priority_of is None else priority_of(job))
    bound.note(request.scope)
    ticket = served.share.reserve(client.name, 1, client.limits, priority)
    try:
        async with ticket.slot(deadline) as left_s:
            return pool, await call(pool, job, left_s)
    finally:
        ticket.close()
