"""The daemon's uvicorn server: the first signal drains, a second stops at once (see
:class:`DrainingServer`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import Iterator

import uvicorn

from modelpool.server.state import ServerState

logger = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    """uvicorn's Server with the daemon's signal handling.

    uvicorn's own handler re-raises the captured signal after shutdown (so the
    process would die of SIGTERM instead of exiting 0) and escalates only on a
    second SIGINT. Here the first SIGTERM or SIGINT marks the app as draining and
    stops accepting; uvicorn then waits up to ``timeout_graceful_shutdown`` for the
    requests in flight. A second signal stops at once (``forced``): the requests in
    flight are cancelled and answer 503 ``shutting_down``, on every Python version.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.app_state = state
        self.signals = 0
        self.forced = False

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if sockets is not None:
            # The daemon binds its port before the pool loads and hands the socket over;
            # uvicorn then leaves out its "Uvicorn running on ..." line (it expects its
            # own process manager to have said it), which says the port now listens.
            self._log_started_message(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        for sig in self.SIGNALS:
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            yield
        finally:
            for sig in self.SIGNALS:
                loop.remove_signal_handler(sig)

    def _on_signal(self, sig: int) -> None:
        self.signals += 1
        name = signal.Signals(sig).name
        if self.signals == 1:
            logger.info(
                "%s: draining requests in flight (up to %.0f s), then stopping",
                name,
                self.config.timeout_graceful_shutdown or 0,
            )
            self.app_state.draining = True
            self.should_exit = True
        else:
            logger.warning("%s again: stopping now; requests in flight fail", name)
            self.forced = True
            self.force_exit = True
            # force_exit only ends uvicorn's waiting loops; it then awaits
            # asyncio.Server.wait_closed(), which since Python 3.12 waits for every open
            # connection (it returned at once before). So the requests in flight are
            # cancelled here, as uvicorn does when the drain timeout passes: each answers
            # 503 shutting_down and closes its connection, and the server exits.
            for task in self.server_state.tasks:
                task.cancel(msg=f"{name} again: stopping now")
