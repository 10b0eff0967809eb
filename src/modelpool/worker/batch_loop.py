"""The stepping loop of a batched backend (``protocol.BatchedHandler``): a reader thread
queues incoming messages, and between two decoding steps the loop admits what arrived,
retires what was cancelled, and answers what finished, so a long generation never holds a
short one back. A backend that batches pooling requests too
(``pooling_answers.batches_pooling``) is admitted embed and score requests as
``PoolingCall``\\ s: one step embeds every admitted request's inputs together."""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

from modelpool.shared.pooling_answers import batches_pooling, checked_answer
from modelpool.shared.processes import process_rss_bytes
from modelpool.shared.protocol import BatchedHandler, ControlBlock, Finished, RowsLost
from modelpool.worker.answers import normalise
from modelpool.worker.calls import (
    PoolingCall,
    PrefixCacheReporter,
    WorkerCall,
    describe_failure,
    read_attempt,
    send_failure,
)
from modelpool.worker.channel import Channel

logger = logging.getLogger(__name__)


class BatchLoop:
    """Serves a batched backend: admit between steps, retire at once, answer as they end.

    Messages are read by a thread into a queue; the loop blocks on the queue
    only while nothing runs, and otherwise drains it before every step. One
    thread calls the backend, so a backend needs no locks.
    """

    def __init__(
        self,
        handler: BatchedHandler,
        channel: Channel,
        control: ControlBlock,
        defaults: dict[str, Any],
    ) -> None:
        self.handler = handler
        self.channel = channel
        self.control = control
        self.defaults = defaults
        self.inbox: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self.running: dict[int, WorkerCall] = {}
        self.stopping = False
        self.last_room: tuple[int, list[int]] | None = None
        self.report_prefix_cache = PrefixCacheReporter(handler, channel)
        self.admit_pooling = batches_pooling(handler)

    def _read(self) -> None:
        while True:
            message = self.channel.recv()
            self.inbox.put(message)
            if message is None or message[0] == "stop":
                return

    def serve(self) -> int:
        threading.Thread(target=self._read, name="modelpool-reader", daemon=True).start()
        while True:
            message: tuple[Any, ...] | None
            if not self.running:
                if self.stopping:
                    return 0
                message = self.inbox.get()
                if not self._take(message):
                    return 0
            while True:
                try:
                    message = self.inbox.get_nowait()
                except queue.Empty:
                    break
                if not self._take(message):
                    return 0
            self._retire_cancelled()
            if self.running:
                self._step()

    def _take(self, message: tuple[Any, ...] | None) -> bool:
        """Handle one message; False when the channel is gone (exit now)."""
        if message is None:
            return False
        if message[0] == "stop":
            self.stopping = True  # Sent to an idle worker; finish anything running first.
        elif message[0] == "run":
            call = read_attempt(
                self.handler,
                message,
                self.control,
                self.channel,
                self.defaults,
                checks_count=False,
                admit_pooling=self.admit_pooling,
            )
            if call is None:
                return True
            try:
                self.handler.admit(call)
            except Exception as exc:
                send_failure(self.channel, call.attempt_id, exc, self.handler)
                return True
            self.running[call.attempt_id] = call
        elif message[0] == "withdraw":
            self._withdraw(message[1])
        return True

    def _withdraw(self, attempt_id: int) -> None:
        """Give back an attempt that still waits for KV room; one that started goes on."""
        call = self.running.get(attempt_id)
        room = getattr(self.handler, "room", None)
        if call is None or room is None or call not in room()[1]:
            return
        del self.running[attempt_id]
        try:
            self.handler.retire(call)
        except Exception as exc:
            send_failure(self.channel, attempt_id, exc, self.handler)
            return
        self.channel.send(("withdrawn", attempt_id))
        self._report_room()

    def _retire_cancelled(self) -> None:
        retired: list[Finished] = []
        for call in list(self.running.values()):
            if self.control.cancel_attempt(call.slot) != call.attempt_id:
                continue
            try:
                generation = normalise(self.handler.retire(call))
            except Exception as exc:
                retired.append((call, exc))
                continue
            generation.finish_reason = "cancelled"
            retired.append((call, generation))
        if retired:
            self._answer(retired)

    def _step(self) -> None:
        try:
            finished = self.handler.step()
        except RowsLost as lost:
            # One forward pass over these rows failed; the backend kept the others.
            self._answer(lost.finished)
            lost_ids = [getattr(call, "attempt_id", None) for call in lost.calls]
            self._batch_failed([i for i in lost_ids if i is not None], lost.cause)
            return
        except Exception as exc:
            # The backend's batch state is unknown: every request in it is lost with it.
            self.handler.abort()
            self._batch_failed(list(self.running), exc)
            return
        self._answer(finished)

    def _batch_failed(self, attempt_ids: list[int], exc: BaseException) -> None:
        """These attempts left the batch together through ``exc``: one ``batch_error``, so
        the pool settles them as a lost batch (retries, suspects) rather than charging
        each one the error."""
        lost = [attempt_id for attempt_id in attempt_ids if self.running.pop(attempt_id, None)]
        logger.error("a batched step failed for %d request(s): %r", len(lost), exc)
        kind, text, remote_traceback, details = describe_failure(exc, self.handler)
        if lost:
            self.channel.send(
                ("batch_error", lost, kind, text, remote_traceback, process_rss_bytes(), details)
            )
        self._report_room()

    def _report_room(self) -> None:
        """Tell the pool the backend's free KV room and who waits for it, when it changed."""
        room = getattr(self.handler, "room", None)
        if room is None:
            return
        free_tokens, waiting_calls = room()
        waiting = sorted(
            attempt_id
            for call in waiting_calls
            if (attempt_id := getattr(call, "attempt_id", None)) in self.running
        )
        report = (int(free_tokens), waiting)
        if report != self.last_room:
            self.last_room = report
            self.channel.send(("room", report[0], report[1]))

    def _answer(self, finished: list[Finished]) -> None:
        """Send each finished attempt's answer, after the reports of what the step changed
        (KV room, the prefix cache): the pool resolves a request when its answer arrives,
        and what its caller reads in ``stats()`` right after must hold that effect. One
        write for all of it (``Channel.gathered``)."""
        with self.channel.gathered():
            self._send_answers(finished)

    def _send_answers(self, finished: list[Finished]) -> None:
        self._report_room()
        if finished:
            self.report_prefix_cache()
        for call, outcome in finished:
            attempt_id = getattr(call, "attempt_id", None)
            if attempt_id is None or self.running.pop(attempt_id, None) is None:
                continue
            if isinstance(outcome, Exception):
                send_failure(self.channel, attempt_id, outcome, self.handler)
                continue
            try:
                if isinstance(call, PoolingCall):
                    generation = checked_answer(call.request, outcome)
                else:
                    generation = normalise(outcome)
            except Exception as exc:
                send_failure(self.channel, attempt_id, exc, self.handler)
                continue
            self.channel.send(("done", attempt_id, generation, process_rss_bytes()))


def is_batched(handler: object) -> bool:
    """Does ``handler`` implement the batched form (``protocol.BatchedHandler``)? A handler
    may decline for what it loaded by setting ``batched = False``."""
    return getattr(handler, "batched", True) is not False and all(
        callable(getattr(handler, name, None)) for name in ("admit", "step", "retire", "abort")
    )
