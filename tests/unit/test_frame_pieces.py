"""A run's frame in pieces (``protocol.frame_pieces``) and the worker's outbox of them:
the same bytes as one encoded frame, the payload never copied, sent through a real
socket pair in any split the kernel takes."""

from __future__ import annotations

import os
import select
import socket
import threading

from modelpool.shared.protocol import encode_frame, encode_request, frame_pieces, recv_frame
from modelpool.supervisor.spawn import Outbox


def _run_message(size: int) -> tuple[object, ...]:
    image = {"type": "image", "data": os.urandom(size), "media_type": "image/png"}
    payload = encode_request([{"role": "user", "content": [image]}], {"max_new_tokens": 4})
    return ("run", 7, 0, payload)


def test_the_pieces_are_the_frame_and_the_payload_is_not_copied() -> None:
    for message in (_run_message(3_000_000), _run_message(10), ("stop",)):
        pieces = frame_pieces(message)
        assert b"".join(pieces) == encode_frame(message)
    big = _run_message(3_000_000)
    assert any(piece is big[3] for piece in frame_pieces(big))


def test_an_outbox_sends_its_pieces_whole_through_a_socket() -> None:
    message = _run_message(2_000_000)
    outbox = Outbox()
    outbox.extend(frame_pieces(message))
    outbox.extend(frame_pieces(("stop",)))
    sender, receiver = socket.socketpair()
    received: list[object] = []
    # The reader takes whole frames while the non-blocking writer sends what fits.
    reader = threading.Thread(
        target=lambda: received.extend([recv_frame(receiver), recv_frame(receiver)])
    )
    with sender, receiver:
        reader.start()
        writable = select.poll()
        writable.register(sender, select.POLLOUT)
        sender.setblocking(False)
        while outbox:
            writable.poll()
            try:
                outbox.consume(sender.sendmsg(outbox.head()))
            except BlockingIOError:
                continue
        reader.join(timeout=60)
    assert received == [message, ("stop",)]
