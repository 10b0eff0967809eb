"""A request's chunks as its caller reads them: :class:`PoolStream` (a thread),
:class:`AsyncPoolStream` (an asyncio task) and the :class:`StreamBuffer` between the
dispatcher thread and an event loop.

``ModelPool.stream`` and ``astream`` make them: the dispatcher thread hands each chunk to
the request's ``on_chunk`` (a queue's ``put``, or ``StreamBuffer.put_threadsafe``), and
the future's done callback puts :data:`END` after the last; the stream then reads the
future's result, or raises its typed error.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import AsyncIterator, Callable, Iterator

from modelpool.shared.protocol import TokenCounts
from modelpool.supervisor.results import PoolFuture, Result

__all__ = ["END", "AsyncPoolStream", "PoolStream", "StreamBuffer"]

END = object()
"""Put after a stream's last chunk, once its future is done."""


class _Stream:
    """What :class:`PoolStream` and :class:`AsyncPoolStream` share: the request's id, its
    final result, and cancelling it when the consumer stops early."""

    def __init__(self, future: PoolFuture) -> None:
        self.future = future
        self.request_id = future.request_id
        self.result: Result | None = None
        self._finished = False

    def _accept(self, item: object) -> str | None:
        """The chunk; None at the end, where ``result`` is set or the typed error raised."""
        if item is END:
            self._finished = True
            self.result = self.future.result()
            return None
        assert isinstance(item, str)
        return item

    def close(self) -> None:
        self._finished = True
        if not self.future.done():
            self.future.cancel()

    def __del__(self) -> None:
        self.close()


class PoolStream(_Stream, Iterator[str]):
    """The chunks of one request (``ModelPool.stream``).

    ``request_id`` is known at once; ``result`` is the final :class:`Result` once
    the iterator is exhausted (a failed request raises its typed error instead).
    ``close()``, leaving a ``with`` block, or dropping the stream unfinished
    cancels the request in its worker.
    """

    def __init__(self, future: PoolFuture, next_item: Callable[[], object]) -> None:
        super().__init__(future)
        self._next_item = next_item

    def __iter__(self) -> PoolStream:
        return self

    def __next__(self) -> str:
        if self._finished:
            raise StopIteration
        try:
            item = self._next_item()
        except BaseException:
            self.close()  # KeyboardInterrupt while waiting: the worker should stop too.
            raise
        chunk = self._accept(item)
        if chunk is None:
            raise StopIteration
        return chunk

    def __enter__(self) -> PoolStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class StreamBuffer:
    """The chunks of one stream that its reader has not taken yet, bounded in count.

    Filled from the dispatcher thread, read on the event loop. The loop is woken once
    for all the chunks that arrive before it runs (a callback per chunk would flood it
    when a worker is fast: hundreds of thousands a second, still running after the
    reader has gone). The worker does not wait for the reader (the dispatcher thread
    serves every request), so a reader slower than the worker gets the text joined:
    past ``max_items`` waiting chunks, new text is appended to the last one. A stalled
    reader then holds the text itself, a few bytes per token, instead of one object per
    token; a reader that keeps up sees every chunk as the worker sent it.

    Each chunk keeps the worker's token counts as of that chunk (``TokenCounts``, when the
    backend gives them; a joined chunk those of its last piece): ``taken_counts`` is the
    count of the chunk :meth:`get` returned last.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, max_items: int = 64) -> None:
        self.max_items = max_items
        self._loop = loop
        self._lock = threading.Lock()
        self._items: collections.deque[tuple[object, TokenCounts | None]] = collections.deque()
        self._tail: list[str] = []  # pieces of the last item while text is being joined
        self._tail_counts: TokenCounts | None = None
        self._ready = asyncio.Event()
        self._wake_pending = False
        self.taken_counts: TokenCounts | None = None

    def put_threadsafe(self, item: object, counts: TokenCounts | None = None) -> None:
        """Add ``item`` (text, or the end marker) and its token counts; from any thread."""
        with self._lock:
            self._put(item, counts)
            if self._wake_pending:
                return
            self._wake_pending = True
        try:
            self._loop.call_soon_threadsafe(self._wake)
        except RuntimeError:
            pass  # The event loop is closed; nobody is listening any more.

    def _put(self, item: object, counts: TokenCounts | None) -> None:
        if isinstance(item, str) and (self._tail or len(self._items) >= self.max_items):
            if not self._tail and isinstance(self._items[-1][0], str):
                last, self._tail_counts = self._items.pop()
                self._tail.append(str(last))
            if self._tail:
                self._tail.append(item)
                self._tail_counts = counts or self._tail_counts
                if len(self._tail) >= self.max_items:
                    self._tail[:] = ["".join(self._tail)]
                return
        self._flush_tail()
        self._items.append((item, counts))

    def _flush_tail(self) -> None:
        if self._tail:
            self._items.append(("".join(self._tail), self._tail_counts))
            self._tail.clear()

    def _wake(self) -> None:
        with self._lock:
            self._wake_pending = False
        self._ready.set()

    async def get(self) -> object:
        while True:
            with self._lock:
                if not self._items:
                    self._flush_tail()
                if self._items:
                    item, counts = self._items.popleft()
                    if counts is not None:
                        self.taken_counts = counts
                    return item
                self._ready.clear()
            await self._ready.wait()

    def __len__(self) -> int:
        with self._lock:
            return len(self._items) + (1 if self._tail else 0)


class AsyncPoolStream(_Stream, AsyncIterator[str]):
    """The chunks of one request (``ModelPool.astream``); see :class:`PoolStream`."""

    def __init__(self, future: PoolFuture, chunks: StreamBuffer) -> None:
        super().__init__(future)
        self._chunks = chunks

    @property
    def token_counts(self) -> TokenCounts | None:
        """The worker's token counts as of the chunk returned last (None when its backend
        does not count)."""
        return self._chunks.taken_counts

    def __aiter__(self) -> AsyncPoolStream:
        return self

    async def __anext__(self) -> str:
        if self._finished:
            raise StopAsyncIteration
        try:
            item = await self._chunks.get()
        except BaseException:
            self.close()  # The consuming task was cancelled: so is the request.
            raise
        chunk = self._accept(item)
        if chunk is None:
            raise StopAsyncIteration
        return chunk

    async def aclose(self) -> None:
        self.close()

    async def __aenter__(self) -> AsyncPoolStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()
