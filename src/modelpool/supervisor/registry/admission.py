"""Answers a request gets at once instead of a wait that cannot succeed: a model failed
and backing off, a swap the client owes swap time for past its deadline (``swaps``), a
load predicted to end past its deadline. Each says when to try again."""

from __future__ import annotations

from modelpool.shared.errors import ModelLoadFailed, ModelTooLarge, ModelUnavailable, QueueFull
from modelpool.supervisor.registry.memory import Memory
from modelpool.supervisor.registry.records import Entry
from modelpool.supervisor.registry.swaps import DEFAULT_LOAD_S


class Admission(Memory):
    """The refusals of ``ModelRegistry._reserve`` (lock held)."""

    def _refuse_a_swap_past(self, entry: Entry, client: str, bound_s: float, now: float) -> None:
        """QueueFull when the load this request would ask for must evict a model another
        client is using and this client owes swap time past the request's deadline
        (``swaps``): answered at once, with when to try again (lock held)."""
        owes = self._swaps_ledger.owes(client, now)
        if owes <= bound_s or entry.waiting or entry.state not in ("unloaded", "failed"):
            return
        try:
            if self._budgets.plan(entry, client, now) is not None:
                return
        except ModelTooLarge:
            return  # the supervisor fails it, naming the numbers
        load_s = entry.last_load_s or DEFAULT_LOAD_S
        raise QueueFull(
            f"model {entry.spec.name!r} is not loaded, and loading it would evict a model "
            f"other clients are using: this client's earlier swaps cost it {owes:.1f} s more "
            f"of waiting, past this request's deadline ({bound_s:g} s)",
            predicted_ttft_s=round(owes + load_s, 3),
            retry_after_s=round(owes, 3),
        )

    def _refuse_a_load_past(self, entry: Entry, bound_s: float, now: float) -> None:
        """QueueFull when the model's load (asked for: it goes on) is predicted to end
        past the request's deadline (its last load time, less what this one has run):
        answered at once with when to try again, not after a wait that cannot succeed."""
        if entry.last_load_s is None:
            return
        left = entry.last_load_s
        for step in self._steps:
            if step.entry is entry and step.deadline is not None:
                started = step.deadline - entry.spec.load_deadline_s
                left = max(0.0, started + entry.last_load_s - now)
        if left > bound_s:
            raise QueueFull(
                f"model {entry.spec.name!r} is loading; its load takes about "
                f"{entry.last_load_s:g} s, {left:.1f} s from now, past this request's "
                f"deadline ({bound_s:g} s): it goes on, try again then",
                predicted_ttft_s=round(left, 3),
                retry_after_s=round(left, 3),
            )

    def _unavailable(self, entry: Entry, now: float) -> ModelLoadFailed:
        if isinstance(entry.error, ModelTooLarge):
            return entry.error.copy()  # a wait would not make it fit: the numbers say why
        if isinstance(entry.error, ModelUnavailable):
            error = entry.error.copy()
            error.retry_after_s = round(max(0.0, entry.retry_at - now), 3)
            return error
        reason = entry.reason or "its last load failed"
        return ModelUnavailable(
            f"model {entry.spec.name!r} is failed: {reason}",
            model=entry.spec.name,
            reason=reason,
            retry_after_s=round(max(0.0, entry.retry_at - now), 3),
        )
