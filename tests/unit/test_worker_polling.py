"""A one-call worker's channel polls for the next request before it sleeps, only after a
request it had to wait for (``PoolConfig.worker_poll_s``): its CPU time shows which."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from modelpool.shared.protocol import encode_frame
from modelpool.worker.channel import Channel

POLL_S = 0.05


def _recv_cpu_s(channel: Channel, peer: socket.socket, send_after_s: float) -> float:
    """This thread's CPU seconds in one ``recv`` whose message comes ``send_after_s``
    later (0: already there)."""
    frame = encode_frame(("run", 1))
    if send_after_s == 0:
        peer.sendall(frame)
        sender = None
    else:
        # Sent well after the poll window: a poll spends it on this CPU, a sleep does not.
        sender = threading.Timer(send_after_s, peer.sendall, (frame,))
        sender.start()
    started = time.thread_time()
    assert channel.recv(POLL_S) == ("run", 1)
    spent = time.thread_time() - started
    if sender is not None:
        sender.join()
    return spent


@pytest.fixture
def pair() -> Iterator[tuple[Channel, socket.socket]]:
    ours, peer = socket.socketpair()
    yield Channel(ours), peer
    ours.close()
    peer.close()


def test_the_channel_polls_only_after_a_request_it_waited_for(
    pair: tuple[Channel, socket.socket],
) -> None:
    channel, peer = pair
    # The first request is waited for (a fresh channel has waited); the next recv polls.
    _recv_cpu_s(channel, peer, send_after_s=0.3)
    polled = _recv_cpu_s(channel, peer, send_after_s=0.3)
    assert polled >= POLL_S / 4, polled
    # One that was already there: the pool is sending ahead, so the next recv sleeps.
    _recv_cpu_s(channel, peer, send_after_s=0)
    slept = _recv_cpu_s(channel, peer, send_after_s=0.3)
    assert slept < POLL_S / 4, slept


def test_no_polling_when_it_is_off(pair: tuple[Channel, socket.socket]) -> None:
    channel, peer = pair
    frame = encode_frame(("run", 2))
    sender = threading.Timer(0.3, peer.sendall, (frame,))
    sender.start()
    started = time.thread_time()
    assert channel.recv(0.0) == ("run", 2)
    assert time.thread_time() - started < POLL_S / 4
    sender.join()
