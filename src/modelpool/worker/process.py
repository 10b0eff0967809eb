"""Worker process entry: load the backend once, then serve attempts until told to stop.

A worker is started by the supervisor as a new interpreter running :func:`main` (``python -c``
with a bootstrap that keeps the current directory off ``sys.path``), with
three inherited descriptors (see ``spawn.start_worker_process``):

- ``--channel``: its end of a Unix socket pair (framed pickles, see protocol.py);
- ``--control``: the shared ``ControlBlock`` (per-slot cancel flags, progress);
- ``--lifeline``: the read end of a pipe whose write end only the supervisor
  holds. When the supervisor dies, by any means including SIGKILL, the kernel
  closes that end and the read returns EOF at once; the lifeline thread then
  kills the worker's whole process group.

Starting the interpreter ourselves, rather than through
``multiprocessing``'s spawn, is what keeps the caller's ``__main__`` out of the
worker: spawn re-imports the parent's main module, so a script without an
``if __name__ == "__main__"`` guard would start pools recursively, and a
REPL or notebook main cannot be imported at all. This module imports no torch:
``CUDA_VISIBLE_DEVICES`` and thread counts arrive in the environment and must
be in place before the backend's first ``import torch``.

Two loops serve attempts. A one-call backend, or any backend when the pool's
``max_batch_size`` is 1, gets one ``generate(call)`` at a time on the main
thread, as always. A batched backend (``protocol.BatchedHandler``) with a
batch size above 1 gets the stepping loop (``_BatchLoop``): a reader thread
queues incoming messages, and between two decoding steps the loop admits what
arrived, retires what was cancelled, and answers what finished, so a long
generation never holds a short one back. A backend that batches pooling requests too
(``pooling_answers.batches_pooling``) is admitted embed and score requests as
``PoolingCall``s: one step embeds every admitted request's inputs together.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import logging
import os
import pickle
import queue
import select
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from modelpool.shared.context import check_max_model_len
from modelpool.shared.errors import ContextLengthExceeded, GrammarError, InvalidRequest, WrongTask
from modelpool.shared.pooling_answers import (
    answer_pooling_request,
    batches_pooling,
    check_task,
    checked_answer,
    handler_task,
    wrong_task,
)
from modelpool.shared.processes import process_rss_bytes
from modelpool.shared.protocol import (
    PROTOCOL_VERSION,
    BatchedHandler,
    ControlBlock,
    DetokenizeRequest,
    EmbedRequest,
    Finished,
    Generation,
    Handler,
    PrefixCacheReport,
    Prompt,
    RowsLost,
    ScoreRequest,
    TokenCounts,
    TokenizeRequest,
    WorkerSpec,
    encode_frame,
    recv_frame,
)
from modelpool.worker import cuda_faults
from modelpool.worker.answers import normalise as _normalise
from modelpool.worker.backends import import_backend

logger = logging.getLogger(__name__)

EXIT_LOAD_FAILED = 3


class _Channel:
    """The worker's end of the socket pair: blocking reads, locked writes.

    Inside :meth:`gathered` the thread that entered it queues its frames and writes them
    in one ``sendall`` at the end (other threads, a log record say, still write at once):
    the batched loop sends what a step ended (the room report, the prefix report, every
    answer) in one write, read by the supervisor in one wake-up. Chunks are written as
    they are emitted: a step that hangs after some rows streamed must not hold back text
    the pool keeps as their partial answers."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._send_lock = threading.Lock()
        self._gathering: int | None = None  # the thread id whose frames are held
        self._held = bytearray()
        self._poller = select.poll()
        self._poller.register(sock, select.POLLIN)
        self._waited = True  # whether the last message read had to be waited for

    def send(self, message: tuple[Any, ...]) -> None:
        frame = encode_frame(message)
        with self._send_lock:
            if self._gathering == threading.get_ident():
                self._held += frame
            else:
                self._sock.sendall(frame)

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        self._gathering = threading.get_ident()
        try:
            yield
        finally:
            with self._send_lock:
                self._gathering = None
                held, self._held = self._held, bytearray()
                if held:
                    self._sock.sendall(held)

    def recv(self, poll_s: float = 0.0) -> tuple[Any, ...] | None:
        """The next message; None at end of stream.

        With ``poll_s`` (``PoolConfig.worker_poll_s``), when nothing is there yet and the
        last message also had to be waited for, the socket is polled without sleeping for
        up to that long first: a request sent within it is read with no wake-up of this
        process, which on a virtual machine costs more than all the Python on a round
        trip. Not after a message that was already waiting: the pool is then sending
        work ahead (prefetch), and a worker polling while the supervisor catches up would
        take the CPU it needs. Each poll yields the CPU (``sched_yield``): a thread that is
        runnable on the same core (the dispatcher, its caller) runs at once instead of
        waiting for the spin's time slice to end, which set a sequential round trip's p99
        (0.38 ms with a plain spin, 0.14-0.16 yielding, on the project's 2-core VM)."""
        if poll_s <= 0:
            return recv_frame(self._sock)
        if self._poller.poll(0):
            self._waited = False
        else:
            if self._waited:
                give_up_at = time.monotonic() + poll_s
                while not self._poller.poll(0) and time.monotonic() < give_up_at:
                    os.sched_yield()
            self._waited = True
        return recv_frame(self._sock)

    def close(self) -> None:
        self._sock.close()


class _ForwardingHandler(logging.Handler):
    """Sends log records to the supervisor, which logs them under the worker's id."""

    def __init__(self, channel: _Channel) -> None:
        super().__init__()
        self._channel = channel

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._channel.send(("log", record.levelno, record.name, self.format(record)))
        except OSError:
            pass  # The supervisor is gone; the lifeline is about to end this process.


class WorkerCall:
    """The ``Call`` a backend receives: prompt, params (``defaulted``: those the pool filled
    in), a cheap cancel check, ``emit``.

    ``slot`` is the attempt's word in the control block. In the one-call loop
    every ``cancelled()`` check counts as progress (a backend that checks the
    flag is alive); in the batched loop only delivered tokens do, since a loop
    that keeps iterating without producing tokens is exactly a stall.
    """

    __slots__ = (
        "_cached_tokens",
        "_channel",
        "_checks_count",
        "_completion_tokens",
        "_control",
        "_prompt_tokens",
        "attempt_id",
        "defaulted",
        "params",
        "prompt",
        "slot",
    )

    def __init__(
        self,
        attempt_id: int,
        slot: int,
        prompt: Prompt,
        params: dict[str, Any],
        control: ControlBlock,
        channel: _Channel,
        defaulted: frozenset[str] = frozenset(),
        *,
        checks_count: bool = True,
    ) -> None:
        self.attempt_id = attempt_id
        self.slot = slot
        self.prompt = prompt
        self.params = params
        self.defaulted = defaulted
        self._control = control
        self._channel = channel
        self._checks_count = checks_count
        self._prompt_tokens: int | None = None
        self._cached_tokens = 0
        self._completion_tokens = 0

    def cancelled(self) -> bool:
        if self._checks_count:
            self._control.bump_progress()
        return self._control.cancel_attempt(self.slot) == self.attempt_id

    def emit(self, text: str) -> None:
        if not isinstance(text, str):
            raise TypeError(f"call.emit() takes str, not {type(text).__name__}")
        if text:
            if self._checks_count:
                self._control.bump_progress()
            counts = None
            if self._prompt_tokens is not None:
                counts = TokenCounts(
                    self._prompt_tokens, self._completion_tokens, self._cached_tokens
                )
            self._channel.send(("chunk", self.attempt_id, text, counts))

    def delivered(self, tokens: int = 1) -> None:
        self._completion_tokens += tokens
        self._control.deliver(self.slot, tokens)

    def note_prompt(self, prompt_tokens: int, cached_tokens: int) -> None:
        """The backend read the prompt: its streamed chunks carry token counts from now."""
        self._prompt_tokens = prompt_tokens
        self._cached_tokens = cached_tokens

    def prefilled(self, tokens: int) -> None:
        self._control.bump_progress(tokens)


class PoolingCall(WorkerCall):
    """An embed or score request admitted into a batch (``pooling_answers``): the call,
    with the request it answers (its prompt is empty)."""

    __slots__ = ("request",)

    def __init__(
        self,
        attempt_id: int,
        slot: int,
        request: EmbedRequest | ScoreRequest,
        control: ControlBlock,
        channel: _Channel,
    ) -> None:
        # Its cancel checks count as progress, in either loop: a pooling backend reads
        # the flag between micro-batches, and that is how the stall clock sees it alive.
        super().__init__(attempt_id, slot, "", {}, control, channel)
        self.request = request


def _leave_channel(root: logging.Logger, forwarding: logging.Handler, channel: _Channel) -> None:
    root.removeHandler(forwarding)
    channel.close()


def _watch_lifeline(lifeline_fd: int) -> None:
    try:
        while os.read(lifeline_fd, 1):
            pass
    except OSError:
        pass
    # The supervisor is gone: take down everything this worker started, and itself.
    try:
        os.killpg(os.getpgrp(), signal.SIGKILL)
    finally:
        os._exit(1)


def _read_attempt(
    handler: Handler,
    message: tuple[Any, ...],
    control: ControlBlock,
    channel: _Channel,
    defaults: dict[str, Any],
    *,
    checks_count: bool,
    admit_pooling: bool = False,
) -> WorkerCall | None:
    """The attempt's call, or None once it has been answered (unreadable, invalid, or
    cancelled while in flight to us). ``defaults``: the pool's generation defaults, under
    the request's own parameters. ``admit_pooling``: an embed or score request becomes a
    ``PoolingCall`` for the batch, rather than being answered here and now."""
    _, attempt_id, slot, payload = message
    try:
        prompt, own_params = pickle.loads(payload)
    except Exception as exc:
        # A class the caller defined in its own __main__, say: the request's fault, not ours.
        text = f"the request cannot be read in a worker: {exc!r}"
        channel.send(("error", attempt_id, "invalid", text, "", process_rss_bytes()))
        return None
    if control.cancel_attempt(slot) == attempt_id:
        # Cancelled while the request was in flight to us: do not start it at all. The flag
        # is read directly, not through call.cancelled(), so that progress stays at zero
        # until the backend itself reports some (the stall clock starts there).
        channel.send(
            ("done", attempt_id, Generation("", "cancelled", None, 0), process_rss_bytes())
        )
        return None
    if isinstance(prompt, (TokenizeRequest, DetokenizeRequest)):
        _answer_tokenizer_request(handler, attempt_id, prompt, channel)
        return None
    if isinstance(prompt, (EmbedRequest, ScoreRequest)):
        if admit_pooling:
            try:
                check_task(handler_task(handler), prompt, generation=False)
            except WrongTask as exc:
                _send_failure(channel, attempt_id, exc)
                return None
            return PoolingCall(attempt_id, slot, prompt, control, channel)
        # The request goes to the backend beside the call, which carries no prompt; its
        # cancel checks count as progress (see PoolingCall).
        call = WorkerCall(attempt_id, slot, "", {}, control, channel)
        try:
            answer = answer_pooling_request(handler, prompt, call)
        except Exception as exc:
            _send_failure(channel, attempt_id, exc, handler)
            return None
        channel.send(("done", attempt_id, answer, process_rss_bytes()))
        return None
    task = handler_task(handler)
    if task != "generate":
        _send_failure(channel, attempt_id, wrong_task(task, "generate text"))
        return None
    params = {**defaults, **own_params}
    defaulted = frozenset(defaults.keys() - own_params.keys())
    validate = getattr(handler, "validate", None)
    if validate is not None:
        try:
            validate(params)
        except Exception as exc:
            channel.send(("error", attempt_id, "invalid", str(exc), "", process_rss_bytes()))
            return None
    return WorkerCall(
        attempt_id, slot, prompt, params, control, channel, defaulted, checks_count=checks_count
    )


def _answer_tokenizer_request(
    handler: Handler,
    attempt_id: int,
    request: TokenizeRequest | DetokenizeRequest,
    channel: _Channel,
) -> None:
    """Tokenize or detokenize with the backend's own tokenizer (the one its generations
    use), between two generation steps: cheap, and never admitted into a batch."""
    name = "tokenize" if isinstance(request, TokenizeRequest) else "detokenize"
    method = getattr(handler, name, None)
    if method is None:
        text = f"this backend ({type(handler).__name__}) does not {name}"
        channel.send(("error", attempt_id, "invalid", text, "", process_rss_bytes()))
        return
    try:
        if isinstance(request, TokenizeRequest):
            ids = [int(token) for token in method(request.prompt, request.add_generation_prompt)]
            answer = Generation("", "stop", len(ids), 0, token_ids=ids)
        else:
            answer = Generation(str(method(list(request.ids))), "stop", len(request.ids), 0)
    except Exception as exc:
        _send_failure(channel, attempt_id, exc, handler)
        return
    channel.send(("done", attempt_id, answer, process_rss_bytes()))


class _PrefixCacheReporter:
    """Sends the backend's prefix cache report (``handler.prefix_cache_report()``) after a
    request, when it changed: the pool places requests and shows stats by it."""

    def __init__(self, handler: object, channel: _Channel) -> None:
        self._report = getattr(handler, "prefix_cache_report", None)
        self._channel = channel
        self._last: PrefixCacheReport | None = None

    def __call__(self) -> None:
        if self._report is None:
            return
        report = self._report()
        if report is not None and report != self._last:
            self._last = report
            self._channel.send(("prefix_cache", report))


def _run_attempt(
    handler: Handler,
    message: tuple[Any, ...],
    control: ControlBlock,
    channel: _Channel,
    defaults: dict[str, Any],
    report: Callable[[], None],
    baseline: cuda_faults.MemoryBaseline | None = None,
) -> None:
    """Run one attempt to its answer. ``report`` sends what the attempt changed in the
    worker's figures (its prefix cache) before the answer: the pool resolves a request
    when its answer arrives, and what its caller reads in ``stats()`` right after must
    already hold the request's effect."""
    call = _read_attempt(handler, message, control, channel, defaults, checks_count=True)
    if call is None:
        return
    try:
        generation = _normalise(handler.generate(call))
    except Exception as exc:
        report()
        _send_failure(channel, call.attempt_id, exc, handler, baseline)
        return
    report()
    channel.send(("done", call.attempt_id, generation, process_rss_bytes()))


def _send_failure(
    channel: _Channel,
    attempt_id: int,
    exc: BaseException,
    handler: object = None,
    baseline: cuda_faults.MemoryBaseline | None = None,
) -> None:
    if isinstance(exc, ContextLengthExceeded):
        detail = (exc.prompt_tokens, exc.max_new_tokens, exc.max_model_len)
        channel.send(
            ("error", attempt_id, "context_length", str(exc), "", process_rss_bytes(), detail)
        )
        return
    if isinstance(exc, GrammarError):
        # Typed on the other side too: the pool's caller learns the bound or the keyword.
        grammar_detail = {
            "bound_s": getattr(exc, "bound_s", None),
            "param": exc.param,
            "keyword": exc.keyword,
        }
        channel.send(
            ("error", attempt_id, "grammar", str(exc), "", process_rss_bytes(), grammar_detail)
        )
        return
    if isinstance(exc, WrongTask):
        task_detail = {"task": exc.task}
        channel.send(
            ("error", attempt_id, "invalid", str(exc), "", process_rss_bytes(), task_detail)
        )
        return
    if isinstance(exc, InvalidRequest):
        channel.send(("error", attempt_id, "invalid", str(exc), "", process_rss_bytes()))
        return
    kind, text, remote_traceback, details = _describe_failure(exc, handler, baseline)
    channel.send(("error", attempt_id, kind, text, remote_traceback, process_rss_bytes(), details))


def _describe_failure(
    exc: BaseException, handler: object, baseline: cuda_faults.MemoryBaseline | None = None
) -> tuple[str, str, str, dict[str, Any]]:
    """A backend's exception as (kind, text, traceback, details) for an error message; an
    out-of-memory's memory is recovered first."""
    fault = None if handler is None else cuda_faults.classify(exc, handler)
    text = f"{type(exc).__name__}: {exc}"
    remote_traceback = "".join(traceback.format_exception(exc))
    # The exception's frames (which hold the request's tensors) are let go before an
    # out-of-memory's cache is emptied, so that the memory can really come back.
    exc.__traceback__ = None
    details: dict[str, Any] = {}
    if fault is not None and fault.kind == "oom" and handler is not None:
        details = (baseline or cuda_faults.MemoryBaseline(None)).recover_after_oom(handler, fault)
    kind = "backend" if fault is None else fault.kind
    return kind, text, remote_traceback, details


class _BatchLoop:
    """Serves a batched backend: admit between steps, retire at once, answer as they end.

    Messages are read by a thread into a queue; the loop blocks on the queue
    only while nothing runs, and otherwise drains it before every step. One
    thread calls the backend, so a backend needs no locks.
    """

    def __init__(
        self,
        handler: BatchedHandler,
        channel: _Channel,
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
        self.report_prefix_cache = _PrefixCacheReporter(handler, channel)
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
            call = _read_attempt(
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
                _send_failure(self.channel, call.attempt_id, exc, self.handler)
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
            _send_failure(self.channel, attempt_id, exc, self.handler)
            return
        self.channel.send(("withdrawn", attempt_id))
        self._report_room()

    def _retire_cancelled(self) -> None:
        retired: list[Finished] = []
        for call in list(self.running.values()):
            if self.control.cancel_attempt(call.slot) != call.attempt_id:
                continue
            try:
                generation = _normalise(self.handler.retire(call))
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
        kind, text, remote_traceback, details = _describe_failure(exc, self.handler)
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
        write for all of it (``_Channel.gathered``)."""
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
                _send_failure(self.channel, attempt_id, outcome, self.handler)
                continue
            try:
                if isinstance(call, PoolingCall):
                    generation = checked_answer(call.request, outcome)
                else:
                    generation = _normalise(outcome)
            except Exception as exc:
                _send_failure(self.channel, attempt_id, exc, self.handler)
                continue
            self.channel.send(("done", attempt_id, generation, process_rss_bytes()))


def is_batched(handler: object) -> bool:
    """Does ``handler`` implement the batched form (``protocol.BatchedHandler``)? A handler
    may decline for what it loaded by setting ``batched = False``."""
    return getattr(handler, "batched", True) is not False and all(
        callable(getattr(handler, name, None)) for name in ("admit", "step", "retire", "abort")
    )


def serve(channel: _Channel, control: ControlBlock) -> int:
    """Handshake, load, serve; returns the process exit code."""
    first = channel.recv()
    if first is None or first[0] != "init":
        return 2
    spec: WorkerSpec = first[1]
    for entry in spec.sys_path:
        if entry not in sys.path:
            sys.path.append(entry)

    root = logging.getLogger()
    forwarding = _ForwardingHandler(channel)
    root.handlers[:] = [forwarding]
    root.setLevel(spec.log_level)
    # A process the backend forks (a tokenizer server, os.fork, multiprocessing's fork)
    # must not speak on the pool's channel: its frames would interleave with ours, and
    # it could keep the channel open after this worker died.
    os.register_at_fork(after_in_child=lambda: _leave_channel(root, forwarding, channel))

    try:
        factory = import_backend(spec.backend)
        handler = factory(model=spec.model, device=spec.device, **spec.backend_options)
        max_model_len = check_max_model_len(
            getattr(handler, "max_model_len", None), f"{spec.backend} backend's max_model_len"
        )
        task = handler_task(handler)
    except BaseException:
        channel.send(("load_failed", traceback.format_exc()))
        return EXIT_LOAD_FAILED
    baseline = cuda_faults.MemoryBaseline.measure(handler)
    slots = min(spec.max_batch_size, control.slots) if is_batched(handler) else 1
    channel.send(
        ("ready", PROTOCOL_VERSION, os.getpid(), process_rss_bytes(), max_model_len, slots, task)
    )
    if slots > 1:
        batched: BatchedHandler = handler  # type: ignore[assignment]
        return _BatchLoop(batched, channel, control, spec.generation_defaults).serve()

    report_prefix_cache = _PrefixCacheReporter(handler, channel)
    while True:
        message = channel.recv(spec.poll_s)
        if message is None or message[0] == "stop":
            return 0
        if message[0] == "run":
            _run_attempt(
                handler,
                message,
                control,
                channel,
                spec.generation_defaults,
                report_prefix_cache,
                baseline,
            )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="modelpool worker (started by the supervisor)")
    parser.add_argument("--channel", type=int, required=True)
    parser.add_argument("--control", type=int, required=True)
    parser.add_argument("--lifeline", type=int, required=True)
    parser.add_argument("--supervisor-pid", type=int, required=True)
    args = parser.parse_args(argv)

    # Ours alone: a program the backend executes must not inherit the pool's descriptors.
    for fd in (args.channel, args.control, args.lifeline):
        os.set_inheritable(fd, False)
    # Ctrl-C in a terminal is the supervisor's to handle; it stops workers in order.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    faulthandler.enable()
    threading.Thread(
        target=_watch_lifeline, args=(args.lifeline,), name="modelpool-lifeline", daemon=True
    ).start()
    if os.getppid() != args.supervisor_pid:
        os._exit(1)

    channel = _Channel(socket.socket(fileno=args.channel))
    control = ControlBlock(args.control)
    code = serve(channel, control)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
