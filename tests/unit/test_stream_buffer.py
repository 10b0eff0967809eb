"""streams.StreamBuffer: a stream's chunks between the dispatcher thread and the event loop,
bounded in count for a reader that stalls (issue 25: an unbounded queue grew a daemon
from 57 to 485 MB under a client that stopped reading)."""

from __future__ import annotations

import asyncio
import threading

from modelpool.supervisor.streams import StreamBuffer

END = object()


def test_a_stalled_reader_gets_the_text_joined_and_a_fast_one_every_chunk() -> None:
    async def scenario() -> tuple[int, list[object], list[object]]:
        loop = asyncio.get_running_loop()
        buffer = StreamBuffer(loop, max_items=8)
        pieces = [f"t{index} " for index in range(10_000)]
        writer = threading.Thread(target=lambda: [buffer.put_threadsafe(p) for p in pieces])
        writer.start()
        await loop.run_in_executor(None, writer.join)
        held = len(buffer)
        buffer.put_threadsafe(END)
        stalled = [await buffer.get() for _ in range(held + 1)]
        assert "".join(str(item) for item in stalled[:-1]) == "".join(pieces)

        fast: list[object] = []
        for piece in ("a", "b", "c"):
            buffer.put_threadsafe(piece)
            fast.append(await buffer.get())
        return held, stalled, fast

    held, stalled, fast = asyncio.run(scenario())
    assert held <= 9  # max_items chunks, then one of joined text
    assert stalled[-1] is END
    assert fast == ["a", "b", "c"]
