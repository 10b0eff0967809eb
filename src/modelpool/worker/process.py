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
thread, here. A batched backend (``protocol.BatchedHandler``) with a batch size
above 1 gets the stepping loop (:mod:`.batch_loop`). Both read their calls and
report their answers and failures through :mod:`.calls`, over the channel
(:mod:`.channel`).
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import socket
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

from modelpool.shared.context import check_max_model_len
from modelpool.shared.pooling_answers import handler_task
from modelpool.shared.processes import process_rss_bytes
from modelpool.shared.protocol import (
    PROTOCOL_VERSION,
    BatchedHandler,
    ControlBlock,
    Handler,
    WorkerSpec,
)
from modelpool.worker import cuda_faults, images
from modelpool.worker.answers import normalise
from modelpool.worker.backends import import_backend
from modelpool.worker.batch_loop import BatchLoop, is_batched
from modelpool.worker.calls import PrefixCacheReporter, read_attempt, send_failure
from modelpool.worker.channel import Channel

logger = logging.getLogger(__name__)

EXIT_LOAD_FAILED = 3


class _ForwardingHandler(logging.Handler):
    """Sends log records to the supervisor, which logs them under the worker's id."""

    def __init__(self, channel: Channel) -> None:
        super().__init__()
        self._channel = channel

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._channel.send(("log", record.levelno, record.name, self.format(record)))
        except OSError:
            pass  # The supervisor is gone; the lifeline is about to end this process.


def _leave_channel(root: logging.Logger, forwarding: logging.Handler, channel: Channel) -> None:
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


def _run_attempt(
    handler: Handler,
    message: tuple[Any, ...],
    control: ControlBlock,
    channel: Channel,
    defaults: dict[str, Any],
    report: Callable[[], None],
    baseline: cuda_faults.MemoryBaseline | None = None,
) -> None:
    """Run one attempt to its answer. ``report`` sends what the attempt changed in the
    worker's figures (its prefix cache) before the answer: the pool resolves a request
    when its answer arrives, and what its caller reads in ``stats()`` right after must
    already hold the request's effect."""
    call = read_attempt(handler, message, control, channel, defaults, checks_count=True)
    if call is None:
        return
    try:
        generation = normalise(handler.generate(call))
    except Exception as exc:
        report()
        send_failure(channel, call.attempt_id, exc, handler, baseline)
        return
    report()
    channel.send(("done", call.attempt_id, generation, process_rss_bytes()))


def serve(channel: Channel, control: ControlBlock) -> int:
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
    images.configure(spec.image_limits)

    try:
        factory = import_backend(spec.backend)
        handler = factory(model=spec.model, device=spec.device, **spec.backend_options)
        attach_tiers = getattr(handler, "attach_prefix_tiers", None)
        if spec.prefix_tiers and attach_tiers is not None:
            attach_tiers(spec.prefix_tiers, spec.model, spec.backend_options)
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
        return BatchLoop(batched, channel, control, spec.generation_defaults).serve()

    report_prefix_cache = PrefixCacheReporter(handler, channel)
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

    channel = Channel(socket.socket(fileno=args.channel))
    control = ControlBlock(args.control)
    code = serve(channel, control)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
