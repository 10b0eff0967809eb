"""Backends for the reliability regressions (importable by workers: tests/ is on sys.path)."""

from __future__ import annotations

import logging
import os
import stat
import subprocess
from typing import Any

from modelpool.shared.protocol import Call


class _Forking:
    """``fork-and-log``: forks a child that logs a line (through whatever logging the
    worker has), waits for it, then logs a line of its own."""

    def generate(self, call: Call) -> str:
        child = os.fork()
        if child == 0:
            logging.getLogger("forked-helper").warning("HELPER-LINE from the forked child")
            os._exit(0)
        os.waitpid(child, 0)
        logging.getLogger("backend").warning("WORKER-LINE from the worker")
        return "forked"


def forking(model: str = "", device: str = "cpu", **options: Any) -> _Forking:
    return _Forking()


class _ChannelKeeper:
    """``keep``: starts a helper outside the worker's process group that holds every socket
    the worker has (its channel among them) and outlives it; returns the helper's pid."""

    def generate(self, call: Call) -> str:
        sockets = [fd for fd in map(int, os.listdir("/proc/self/fd")) if _is_socket(fd)]
        helper = subprocess.Popen(["sleep", "60"], pass_fds=sockets, start_new_session=True)
        return str(helper.pid)


def _is_socket(fd: int) -> bool:
    try:
        return stat.S_ISSOCK(os.fstat(fd).st_mode)
    except OSError:
        return False


def channel_keeper(model: str = "", device: str = "cpu", **options: Any) -> _ChannelKeeper:
    return _ChannelKeeper()


SLOW_LAYER_S = 0.05
"""How long each decoder layer of ``slow_prefill`` takes over a prompt (several tokens)."""


def slow_prefill(model: str, device: str = "cpu", **options: Any) -> Any:
    """``slow-prefill``: the hf backend whose decoder layers each sleep ``SLOW_LAYER_S``
    when they run over more than 8 positions, so that a prefill lasts layers x that,
    deterministically, while decoding steps and the warm-up stay fast."""
    import time

    from modelpool.worker.backends.hf import load

    handler = load(model, device, **options)

    def slow(module: Any, args: tuple[Any, ...]) -> None:
        hidden = args[0] if args else None
        if hidden is not None and hidden.dim() == 3 and hidden.shape[1] > 8:
            time.sleep(SLOW_LAYER_S)

    for layer in handler.model.model.layers:
        layer.register_forward_pre_hook(slow)
    return handler


SLOW_POOLING_LAYER_S = 0.1
"""How long each encoder layer of ``slow_pooling`` takes over more than
``SLOW_POOLING_ROWS`` rows."""
SLOW_POOLING_ROWS = 8


def slow_pooling(model: str, device: str = "cpu", **options: Any) -> Any:
    """``slow-pooling``: the hf backend's pooling model (a BERT) whose encoder layers each
    sleep ``SLOW_POOLING_LAYER_S`` in a forward pass over more than ``SLOW_POOLING_ROWS``
    rows, so that such a pass lasts at least layers x that whatever the machine's load,
    while the warm-up and small requests stay fast."""
    import time

    from modelpool.worker.backends.hf import load

    handler = load(model, device, **options)

    def slow(module: Any, args: tuple[Any, ...]) -> None:
        hidden = args[0] if args else None
        if hidden is not None and hidden.dim() == 3 and hidden.shape[0] > SLOW_POOLING_ROWS:
            time.sleep(SLOW_POOLING_LAYER_S)

    for layer in handler.network.encoder.layer:
        layer.register_forward_pre_hook(slow)
    return handler
