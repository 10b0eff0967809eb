"""What workers send, and what the dispatcher does with it: chunks streamed to callers,
answers, errors and refusals, failed batched steps, room reports and withdrawn attempts.

Part of the dispatcher (``dispatcher.py``), on its thread, sharing its records: the
dispatcher hands every message of a worker's channel to :meth:`WorkerMessages.on_message`
and keeps the attempts' life cycle (``end_attempt``, ``run_ended``, ``soft_cancel``),
which these handlers call back; requests end through ``resolution.py``, retries and lost
batches through ``retries.py``. A rerun after a preemption does not stream again what its
caller saw (``Run.continue_stream``); one that says otherwise fails.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from modelpool.scheduling import placement
from modelpool.scheduling.prediction import WaitPredictor
from modelpool.shared.errors import BackendError, Outcome
from modelpool.shared.protocol import Generation, PrefixCacheReport, TokenCounts
from modelpool.supervisor.records import Request, Run, Worker
from modelpool.supervisor.resolution import Resolution
from modelpool.supervisor.retries import Retries
from modelpool.supervisor.worker_errors import typed_backend_error, worker_refusal
from modelpool.supervisor.worker_manager import WorkerManager

logger = logging.getLogger(__name__)
worker_logger = logging.getLogger("modelpool.worker")


class WorkerMessages:
    """The handlers of workers' messages (see the module docstring)."""

    def __init__(
        self,
        *,
        clock: Callable[[], float],
        counters: dict[str, int],
        workers: dict[int, Worker],
        predictor: WaitPredictor,
        resolution: Resolution,
        retries: Retries,
        worker_manager: WorkerManager,
        end_attempt: Callable[[Run, Outcome | None], Request],
        run_ended: Callable[[Worker, Run], None],
        soft_cancel: Callable[[Worker, Run, str], None],
    ) -> None:
        self.clock = clock
        self.counters = counters
        self.workers = workers
        self.predictor = predictor
        self.resolution = resolution
        self.retries = retries
        self.worker_manager = worker_manager
        self.end_attempt = end_attempt
        self.run_ended = run_ended
        self.soft_cancel = soft_cancel

    def on_message(self, worker: Worker, message: tuple[Any, ...]) -> None:
        """One message of ``worker`` (its kinds: ``worker.process``)."""
        kind = message[0]
        if kind == "chunk":
            self._on_chunk(worker, *message[1:])
        elif kind == "done":
            self._on_done(worker, message[1], message[2], message[3])
        elif kind == "error":
            self._on_error(worker, *message[1:])
        elif kind == "batch_error":
            self._on_batch_error(worker, *message[1:])
        elif kind == "room":
            self._on_room(worker, message[1], message[2])
        elif kind == "withdrawn":
            self._on_withdrawn(worker, message[1])
        elif kind == "prefix_cache" and isinstance(message[1], PrefixCacheReport):
            worker.prefix_cache = message[1]
        elif kind == "log":
            _, levelno, name, text = message
            worker_logger.log(
                levelno, "[worker %d pid %s] %s: %s", worker.id, worker.pid, name, text
            )
        elif kind == "ready":
            self.worker_manager.on_ready(worker, *message[1:])
        elif kind == "load_failed":
            worker.load_error = message[1]
        else:
            logger.warning("worker %d sent an unknown message kind %r", worker.id, kind)

    def _current_run(self, worker: Worker, attempt_id: int) -> Run | None:
        return worker.runs.get(attempt_id)

    def _on_chunk(
        self, worker: Worker, attempt_id: int, text: str, counts: TokenCounts | None = None
    ) -> None:
        run = self._current_run(worker, attempt_id)
        if run is None:
            return
        run.chunks.append(text)
        if run.first_token_at is None:
            run.first_token_at = now = self.clock()
            if run.record is not None:
                run.record.first_token_at = now
            if run.owner.first_token_at is None:
                run.owner.first_token_at = now
        if run.request is None:
            return
        if run.skip:  # a rerun after a preemption: what its caller saw is not sent twice
            verdict, text = run.continue_stream(text)
            if verdict == "diverged":
                self.soft_cancel(worker, run, "diverged")
                self._rerun_diverged(run)
                return
            if not text:
                return
        self._deliver_chunk(run.request, text, counts)

    def _rerun_diverged(self, run: Run) -> None:
        """A preempted request's rerun gave other text than its caller was shown: its
        stream cannot go on as one answer, so the request fails (and is not retried)."""
        request = self.end_attempt(run, "error")
        message = f"preempted, then rerun on worker pid {run.worker.pid} with other text"
        error = BackendError(f"{message} than it had streamed (not deterministic)")
        self.resolution.fail(request, error)

    def _deliver_chunk(
        self, request: Request, text: str, counts: TokenCounts | None = None
    ) -> None:
        if request.on_chunk is None or request.caller_gone:
            return
        request.streamed = True
        try:
            if request.counted_chunks:
                request.on_chunk(text, counts)
            else:
                request.on_chunk(text)
        except Exception:
            logger.exception(
                "request %s: the stream consumer's callback failed", request.request_id
            )

    def _on_done(
        self, worker: Worker, attempt_id: int, generation: Generation, rss_bytes: int
    ) -> None:
        worker.rss_bytes = rss_bytes
        run = self._current_run(worker, attempt_id)
        if run is None:
            return
        if not run.recalled or generation.finish_reason != "cancelled":
            # Taken back but already started there (its cancel word came too late): a
            # request it served all the same, for max_requests_per_worker.
            worker.requests += 1
        self.run_ended(worker, run)
        request = run.request
        if request is None:
            return
        cancelled = request.cancel_requested or generation.finish_reason == "cancelled"
        if not cancelled and run.skip and not generation.text.startswith(run.skip):
            self._rerun_diverged(run)
            return
        self.end_attempt(run, "cancelled" if cancelled else "ok")
        if not cancelled:
            self.predictor.observe(
                run_s=self.clock() - run.started_at,
                ttft_s=None if run.first_token_at is None else run.first_token_at - run.started_at,
                prompt_tokens=generation.prompt_tokens,
                completion_tokens=generation.completion_tokens,
                prompt_chars=request.size.prompt_chars,
                cut=generation.finish_reason == "length",
            )
            if request.predicted_ttft_s is not None:
                first_token_at = request.first_token_at or self.clock()
                self.predictor.observe_wait(
                    predicted_s=request.predicted_ttft_s,
                    waited_s=first_token_at - request.submitted_at,
                )
        if cancelled:
            self.resolution.cancelled(request, generation.text, worker.pid, generation)
            return
        if request.on_chunk is not None:
            # A backend may return text it never emitted; a stream still gets all of it.
            sent = run.skip or run.partial_text()
            if len(generation.text) > len(sent) and generation.text.startswith(sent):
                self._deliver_chunk(request, generation.text[len(sent) :])
        self.resolution.succeed(request, generation, worker.pid)

    def _on_room(self, worker: Worker, kv_free_tokens: int, waiting: list[int]) -> None:
        """A batched worker's room report. A request that waits there for KV room while
        another worker has a free slot and nobody waiting is asked back, to be placed
        again: it must not wait behind another request's generation."""
        worker.kv_free_tokens = kv_free_tokens
        worker.waiting_attempts = frozenset(waiting)
        if not waiting or worker.io is None:
            return
        if not placement.room_elsewhere(
            worker, self.workers.values(), self.worker_manager.retire_reason
        ):
            return
        for attempt_id in waiting:
            run = worker.runs.get(attempt_id)
            if run is not None and run.request is not None and not run.withdraw_sent:
                run.withdraw_sent = True
                worker.io.send(("withdraw", attempt_id))

    def _on_withdrawn(self, worker: Worker, attempt_id: int) -> None:
        """The worker gave back an unstarted attempt: no attempt is recorded, the request
        goes back to the front of the queue, to another worker than that one."""
        run = self._current_run(worker, attempt_id)
        if run is None:
            return
        self.run_ended(worker, run)
        request = run.request
        if request is None:
            return
        self.end_attempt(run, None)
        self.counters["withdrawn"] += 1
        request.last_failed_worker = worker.id
        self.retries.requeue(request)

    def _on_error(
        self,
        worker: Worker,
        attempt_id: int,
        kind: str,
        text: str,
        remote_traceback: str,
        rss_bytes: int,
        detail: tuple[int, int | None, int] | Mapping[str, Any] | None = None,
    ) -> None:
        worker.rss_bytes = rss_bytes
        run = self._current_run(worker, attempt_id)
        if run is None:
            return
        worker.requests += 1
        details: Mapping[str, Any] = detail if isinstance(detail, Mapping) else {}
        self.worker_manager.after_backend_error(worker, kind, text, details)
        self.run_ended(worker, run)
        request = run.request
        if request is None:
            return
        if kind in ("invalid", "context_length", "grammar"):
            # A refusal is the request's fault, not the attempt's: no failed attempt is
            # recorded and nothing is retried (another worker would refuse it the same way).
            self.end_attempt(run, None)
            self.resolution.fail(request, worker_refusal(text, detail))
            return
        outcome, error = typed_backend_error(worker, kind, text, remote_traceback, details)
        self.end_attempt(run, outcome)
        self.retries.attempt_failed(request, worker, outcome, error)

    def _on_batch_error(
        self,
        worker: Worker,
        attempt_ids: list[int],
        kind: str,
        text: str,
        remote_traceback: str,
        rss_bytes: int,
        details: Mapping[str, Any],
    ) -> None:
        """A batched step failed and the worker could not blame one request: those that
        were in it are a lost batch (retried as collateral, suspects tracked, as after a
        death), never each one's charged error. The worker stays warm for the rest."""
        worker.rss_bytes = rss_bytes
        runs = [run for i in attempt_ids if (run := self._current_run(worker, i)) is not None]
        if not runs:
            return
        worker.requests += len(runs)
        self.worker_manager.after_backend_error(worker, kind, text, details)
        self.retries.batch_lost(
            worker,
            typed_backend_error(worker, kind, text, remote_traceback, details)[0],
            f"a batched step failed on worker pid {worker.pid}: {text}",
            None,
            runs=runs,
            backend_error=lambda: typed_backend_error(
                worker, kind, text, remote_traceback, details
            )[1],
        )
        for run in runs:
            self.run_ended(worker, run)
