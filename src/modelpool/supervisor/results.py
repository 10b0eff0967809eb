"""What a caller gets back: a :class:`Result`, through a :class:`PoolFuture`.

The dispatcher thread resolves each future exactly once (:func:`set_future`); the
caller's thread only waits on it or cancels it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from modelpool.shared.errors import PoolError
from modelpool.shared.protocol import FinishReason, PooledAnswer, TokenLogprob


@dataclass(frozen=True)
class Result:
    """A finished request. ``attempts`` counts the tries it took."""

    text: str
    finish_reason: FinishReason
    request_id: str
    attempts: int
    worker_pid: int | None
    latency_s: float
    queue_s: float
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    # Set when the request asked for logprobs / prompt_logprobs (see protocol.Generation):
    # from a worker, a TokenLogprobs (columns; a TokenLogprob is made as one is read).
    logprobs: Sequence[TokenLogprob] | None = None
    prompt_logprobs: Sequence[TokenLogprob] | None = None
    # Prompt tokens read from the worker's prefix cache rather than prefilled (0: none,
    # or a backend without one).
    cached_tokens: int = 0
    # ModelPool.tokenize's answer.
    token_ids: list[int] | None = None
    # The stop string that ended the text (finish_reason "stop"), None when none did.
    stop_sequence: str | None = None
    # An embed or score request's answer (ModelPool.embed and score read it).
    pooled: PooledAnswer | None = None
    # Seconds from submission to the first text a worker sent (None: it sent none): with
    # queue_s and latency_s, how long the prompt and the generation took.
    ttft_s: float | None = None
    # A reasoning model's thinking tokens (None: not one), and why the worker closed its
    # thinking when it did: "budget", "reserve", "loop" or "deadline" (docs/reasoning.md).
    reasoning_tokens: int | None = None
    thinking_closed: str | None = None
    # The thinking, apart from ``text`` (the answer), once the daemon split them
    # (modelpool.server.reasoning); None: not split, or no thinking.
    reasoning: str | None = None


class PoolFuture(concurrent.futures.Future[Result]):
    """A ``concurrent.futures.Future`` for one request, with its ``request_id``.

    Unlike a plain executor future, ``cancel()`` succeeds while the request runs:
    the worker is told to stop at its next token and the caller gets
    ``CancelledError``. ``running()`` is always False; the pool does not report
    the moment a worker picks a request up through the future.
    """

    def __init__(self, request_id: str, on_cancel: Callable[[str], None]) -> None:
        super().__init__()
        self.request_id = request_id
        self._on_cancel = on_cancel

    def cancel(self) -> bool:
        if self.done():
            return self.cancelled()
        cancelled = super().cancel()
        if cancelled:
            # CANCELLED_AND_NOTIFIED is what concurrent.futures.wait()/as_completed() count
            # as done; plain CANCELLED is only reached by executors that later notify.
            self.set_running_or_notify_cancel()
            self._on_cancel(self.request_id)
        return cancelled


def set_future(future: PoolFuture, outcome: Result | PoolError) -> None:
    try:
        if isinstance(outcome, Result):
            future.set_result(outcome)
        else:
            future.set_exception(outcome)
    except concurrent.futures.InvalidStateError:
        pass  # The caller cancelled the future in the meantime; the request is still counted.


def cancel_submitted(submitting: asyncio.Future[PoolFuture]) -> None:
    """The request a submission made, cancelled: its caller was cancelled meanwhile."""
    if not submitting.cancelled() and submitting.exception() is None:
        submitting.result().cancel()
