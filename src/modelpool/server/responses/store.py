"""The answers ``previous_response_id`` continues from, kept in memory and bounded.

Each entry is a stored response: its object (``GET /v1/responses/{id}``) and the
conversation it ended, as chat messages (its input items and its output), which a
request naming it as ``previous_response_id`` puts before its own input. Each belongs
to the tenant that made it (``owner``: the tenant's name, "" without keys): another
owner's id reads as unknown. Bounded by entries, by bytes (each entry's JSON size) and
by age; an evicted, expired, unknown or another owner's id is a 404.

The bounds are shared fairly between owners: when one is passed, the oldest entry of
the owner that holds the most (entries, or bytes for the byte bound) goes, the newcomer
counted. So an owner filling the store evicts its own entries first, and no owner loses
one while another holds more than it: each keeps at least an equal share of the bound
(the bound divided among the owners storing), whatever the others send::

    store = ResponseStore(max_entries=1024, max_bytes=64 << 20, ttl_s=3600.0)
    store.put("resp_1", response_object, messages, owner="alice")
    store.get("resp_1", owner="alice").messages        # None for owner="bob"
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]
    messages: list[dict[str, Any]]  # the conversation so far, as chat messages
    size: int
    stored_at: float
    owner: str


@dataclass
class _Holding:
    """One owner's entries, oldest first, and their bytes."""

    ids: OrderedDict[str, None] = field(default_factory=OrderedDict)
    bytes: int = 0


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
        self._entries: dict[str, StoredResponse] = {}
        self._owners: dict[str, _Holding] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    def put(
        self,
        response_id: str,
        response: dict[str, Any],
        messages: list[dict[str, Any]],
        *,
        owner: str,
    ) -> bool:
        """Keep an answer for ``owner``; False when it alone is larger than the store (not
        kept)."""
        # An image part's bytes count as themselves (JSON has no bytes to write).
        images = sum(len(part["data"]) for message in messages for part in _images(message))
        size = len(json.dumps(response)) + len(json.dumps(messages, default=_no_text)) + images
        if size > self.max_bytes or self.max_entries == 0:
            return False
        with self._lock:
            self._drop(response_id)
            entry = StoredResponse(response, messages, size, self._clock(), owner)
            self._entries[response_id] = entry
            holding = self._owners.setdefault(owner, _Holding())
            holding.ids[response_id] = None
            holding.bytes += size
            self._bytes += size
            while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
                self._drop(next(iter(self._victim().ids)))
        return True

    def get(self, response_id: str, *, owner: str) -> StoredResponse | None:
        """``owner``'s live entry of that id, else None."""
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is None or entry.owner != owner:
                return None
            if self._clock() - entry.stored_at > self.ttl_s:
                self._drop(response_id)
                return None
            return entry

    def delete(self, response_id: str, *, owner: str) -> bool:
        """True when ``owner``'s live entry was dropped (an expired one counts as unknown,
        another owner's is not touched)."""
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is None or entry.owner != owner:
                return False
            self._drop(response_id)
            return self._clock() - entry.stored_at <= self.ttl_s

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {
                "entries": len(self._entries),
                "bytes": self._bytes,
                "owners": len(self._owners),
            }

    def _victim(self) -> _Holding:
        """The holding that gives up its oldest entry: the largest by the bound passed."""
        if len(self._entries) > self.max_entries:
            return max(self._owners.values(), key=lambda holding: len(holding.ids))
        return max(self._owners.values(), key=lambda holding: holding.bytes)

    def _drop(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return
        self._bytes -= entry.size
        holding = self._owners[entry.owner]
        del holding.ids[response_id]
        holding.bytes -= entry.size
        if not holding.ids:
            del self._owners[entry.owner]


def _images(message: dict[str, Any]) -> list[dict[str, Any]]:
    content = message.get("content")
    if not isinstance(content, list):
        return []
    return [part for part in content if isinstance(part.get("data"), bytes)]


def _no_text(value: object) -> str:
    """An image's bytes in the size's JSON: counted apart (``put``)."""
    return ""
