"""Worker process entry: load the backend once, then serve attempts until told to stop.

A worker is started by the supervisor as a new interpreter running :func:`main` (``python -c``
with a bootstrap that keeps the current directory off ``sys.path``), with
three inherited descriptors (see ``spawn.start_worker_process``):

- ``--channel``: its end of a Unix socket pair (framed pickles, see protocol.py);
- ``--control``: the shared ``ControlBlock`` (cancel flag, progress counter);
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
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import pickle
import signal
import socket
import sys
import threading
import traceback
from typing import Any

from modelpool import cuda_faults
from modelpool.backends import import_backend
from modelpool.context import check_max_model_len
from modelpool.errors import ContextLengthExceeded, InvalidRequest
from modelpool.processes import process_rss_bytes
from modelpool.protocol import (
    PROTOCOL_VERSION,
    ControlBlock,
    Generation,
    Handler,
    Prompt,
    TokenLogprob,
    WorkerSpec,
    encode_frame,
    recv_frame,
)

logger = logging.getLogger(__name__)

EXIT_LOAD_FAILED = 3


class _Channel:
    """The worker's end of the socket pair: blocking reads, locked writes."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._send_lock = threading.Lock()

    def send(self, message: tuple[Any, ...]) -> None:
        frame = encode_frame(message)
        with self._send_lock:
            self._sock.sendall(frame)

    def recv(self) -> tuple[Any, ...] | None:
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
    in), a cheap cancel check, ``emit``."""

    __slots__ = ("_channel", "_control", "attempt_id", "defaulted", "params", "prompt")

    def __init__(
        self,
        attempt_id: int,
        prompt: Prompt,
        params: dict[str, Any],
        control: ControlBlock,
        channel: _Channel,
        defaulted: frozenset[str],
    ) -> None:
        self.attempt_id = attempt_id
        self.prompt = prompt
        self.params = params
        self.defaulted = defaulted
        self._control = control
        self._channel = channel

    def cancelled(self) -> bool:
        self._control.bump_progress()
        return self._control.cancel_attempt == self.attempt_id

    def emit(self, text: str) -> None:
        if not isinstance(text, str):
            raise TypeError(f"call.emit() takes str, not {type(text).__name__}")
        if text:
            self._control.bump_progress()
            self._channel.send(("chunk", self.attempt_id, text))


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


def _run_attempt(
    handler: Handler,
    message: tuple[Any, ...],
    control: ControlBlock,
    channel: _Channel,
    defaults: dict[str, Any],
    baseline: cuda_faults.MemoryBaseline | None = None,
) -> None:
    _, attempt_id, payload = message
    try:
        prompt, own_params = pickle.loads(payload)
    except Exception as exc:
        # A class the caller defined in its own __main__, say: the request's fault, not ours.
        text = f"the request cannot be read in a worker: {exc!r}"
        channel.send(("error", attempt_id, "invalid", text, "", process_rss_bytes()))
        return
    params = {**defaults, **own_params}
    defaulted = frozenset(defaults.keys() - own_params.keys())
    call = WorkerCall(attempt_id, prompt, params, control, channel, defaulted)
    try:
        if control.cancel_attempt == attempt_id:
            # Cancelled while the request was in flight to us: do not start it at all. The flag
            # is read directly, not through call.cancelled(), so that progress stays at zero
            # until the backend itself reports some (the stall clock starts there).
            generation = Generation("", "cancelled", None, 0)
        else:
            validate = getattr(handler, "validate", None)
            if validate is not None:
                try:
                    validate(params)
                except Exception as exc:
                    channel.send(
                        ("error", attempt_id, "invalid", str(exc), "", process_rss_bytes())
                    )
                    return
            generation = _normalise(handler.generate(call))
    except ContextLengthExceeded as exc:
        detail = (exc.prompt_tokens, exc.max_new_tokens, exc.max_model_len)
        channel.send(
            ("error", attempt_id, "context_length", str(exc), "", process_rss_bytes(), detail)
        )
        return
    except InvalidRequest as exc:
        channel.send(("error", attempt_id, "invalid", str(exc), "", process_rss_bytes()))
        return
    except Exception as exc:
        fault = cuda_faults.classify(exc, handler)
        text, remote_traceback = f"{type(exc).__name__}: {exc}", traceback.format_exc()
    else:
        channel.send(("done", attempt_id, generation, process_rss_bytes()))
        return
    # Out of the except block: the exception and its frames (which hold the request's
    # tensors) are gone, so an out-of-memory's cache can really be emptied now.
    details: dict[str, Any] = {}
    if fault is not None and fault.kind == "oom":
        details = (baseline or cuda_faults.MemoryBaseline(None)).recover_after_oom(handler, fault)
    kind = "backend" if fault is None else fault.kind
    channel.send(("error", attempt_id, kind, text, remote_traceback, process_rss_bytes(), details))


def _normalise(output: object) -> Generation:
    """Plain types only cross the pipe: the supervisor never imports what a backend used
    (a torch tensor as a token count would drag torch into it) and never sees a bad field."""
    if not isinstance(output, Generation):
        if not isinstance(output, str):
            raise TypeError(f"generate() returned {type(output).__name__}, not str or Generation")
        return Generation(output)
    if not isinstance(output.text, str):
        raise TypeError(f"Generation.text is {type(output.text).__name__}, not str")
    if output.finish_reason not in ("stop", "length", "cancelled"):
        raise ValueError(
            f"Generation.finish_reason {output.finish_reason!r} is not one of "
            "'stop', 'length', 'cancelled'"
        )
    return Generation(
        output.text,
        output.finish_reason,
        None if output.prompt_tokens is None else int(output.prompt_tokens),
        None if output.completion_tokens is None else int(output.completion_tokens),
        _plain_logprobs(output.logprobs, "logprobs"),
        _plain_logprobs(output.prompt_logprobs, "prompt_logprobs"),
    )


def _plain_logprobs(entries: object, name: str) -> list[TokenLogprob] | None:
    if entries is None:
        return None
    if not isinstance(entries, list) or not all(isinstance(e, TokenLogprob) for e in entries):
        raise TypeError(f"Generation.{name} must be a list of TokenLogprob or None")
    return entries


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
    except BaseException:
        channel.send(("load_failed", traceback.format_exc()))
        return EXIT_LOAD_FAILED
    baseline = cuda_faults.MemoryBaseline.measure(handler)
    channel.send(("ready", PROTOCOL_VERSION, os.getpid(), process_rss_bytes(), max_model_len))

    while True:
        message = channel.recv()
        if message is None or message[0] == "stop":
            return 0
        if message[0] == "run":
            _run_attempt(handler, message, control, channel, spec.generation_defaults, baseline)


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
