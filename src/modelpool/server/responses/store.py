"""The answers ``previous_response_id`` continues from, kept in memory and bounded.

Each entry is a stored response: its object (``GET /v1/responses/{id}``) and the
conversation it ended, as chat messages (its input items and its output), which a
request naming it as ``previous_response_id`` puts before its own input. Bounded by
entries, by bytes (each entry's JSON size) and by age: the oldest go first, and an
evicted, expired or unknown id is a 404 ``previous_response_not_found``::

    store = ResponseStore(max_entries=1024, max_bytes=64 << 20, ttl_s=3600.0)
    store.put("resp_1", response_object, messages)
    store.get("resp_1").messages
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]
    messages: list[dict[str, Any]]  # the conversation so far, as chat messages
    size: int
    stored_at: float


class ResponseStore:
    """Thread-safe (requests are parsed and answered in threads when large)."""

    def __init__(
        self,
        *,
        max_entries: int,
        max_bytes: int,
        ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(
        self, response_id: str, response: dict[str, Any], messages: list[dict[str, Any]]
    ) -> bool:
        """Keep an answer; False when it alone is larger than the store (not kept)."""
        size = len(json.dumps(response)) + len(json.dumps(messages))
        if size > self.max_bytes or self.max_entries == 0:
            return False
        with self._lock:
            self._drop(response_id)
            self._entries[response_id] = StoredResponse(response, messages, size, self._clock())
            self._bytes += size
            while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
                self._drop(next(iter(self._entries)))
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is None:
                return None
            if self._clock() - entry.stored_at > self.ttl_s:
                self._drop(response_id)
                return None
            return entry

    def delete(self, response_id: str) -> bool:
        """True when a live entry was dropped (an expired one counts as unknown)."""
        with self._lock:
            entry = self._entries.get(response_id)
            self._drop(response_id)
            return entry is not None and self._clock() - entry.stored_at <= self.ttl_s

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {"entries": len(self._entries), "bytes": self._bytes}

    def _drop(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self._bytes -= entry.size
