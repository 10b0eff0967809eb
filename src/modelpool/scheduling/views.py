"""What the scheduling rules read: read-only views of the dispatcher's records.

The rules (``queueing``, ``preemption``, ``prefetch``, ``placement``, ``admission``,
``plan``) are functions over these protocols, never over the records themselves: the
records (``supervisor.records``) belong to the dispatcher, which alone writes them, and
this package imports nothing of the supervisor. Every member is a read-only property, so
a rule that tried to write one would not type-check; the records' dataclass fields
satisfy them as they are. A rule that must hand back a record it was given (the request
to dispatch, the run to preempt) is generic in its type, so the dispatcher gets its own
record back.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, Protocol, TypeVar

from modelpool.shared.protocol import PrefixCacheReport


class RequestView(Protocol):
    """A request as the rules read it."""

    @property
    def priority(self) -> int: ...

    @property
    def deadline(self) -> float: ...

    @property
    def waiting_since(self) -> float:
        """When it arrived: it ages from then (``ordering.promotion_at``)."""
        ...

    @property
    def due_at(self) -> float:
        """When it is promoted however long it waited (admitted by its predicted wait)."""
        ...

    @property
    def isolated(self) -> bool: ...

    @property
    def suspect(self) -> bool: ...

    @property
    def last_failed_worker(self) -> int | None: ...

    @property
    def prefix_fingerprints(self) -> tuple[int, ...]: ...

    @property
    def reproducible(self) -> bool: ...

    @property
    def streamed(self) -> bool: ...

    @property
    def preemptions(self) -> int: ...


class RunView(Protocol):
    """One attempt of a request on a worker."""

    @property
    def request(self) -> RequestView | None: ...

    @property
    def owner(self) -> RequestView: ...

    @property
    def worker(self) -> WorkerView[RunView]: ...

    @property
    def started_at(self) -> float: ...

    @property
    def alone(self) -> bool: ...

    @property
    def cancel_sent(self) -> bool: ...

    @property
    def prefetched(self) -> bool: ...

    @property
    def recalled(self) -> bool: ...

    @property
    def preempted(self) -> bool: ...


RunCo = TypeVar("RunCo", bound=RunView, covariant=True)


class WorkerView(Protocol[RunCo]):
    """One worker process, whose runs are ``RunCo``."""

    @property
    def id(self) -> int: ...

    @property
    def state(
        self,
    ) -> Literal["starting", "idle", "busy", "cancelling", "killing", "stopping", "dead"]: ...

    @property
    def role(self) -> Literal["serving", "spare"]: ...

    @property
    def slots(self) -> int: ...

    @property
    def runs(self) -> Mapping[int, RunCo]: ...

    @property
    def requests(self) -> int: ...

    @property
    def stopping(self) -> bool: ...

    @property
    def signalled(self) -> bool: ...

    @property
    def kv_free_tokens(self) -> int | None: ...

    @property
    def waiting_attempts(self) -> frozenset[int]: ...

    @property
    def prefix_cache(self) -> PrefixCacheReport | None: ...


RequestT = TypeVar("RequestT", bound=RequestView)
RunT = TypeVar("RunT", bound=RunView)
WorkerT = TypeVar("WorkerT", bound=WorkerView[RunView])
