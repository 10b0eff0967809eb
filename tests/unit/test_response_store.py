"""The Responses store's owners and fair shares (``server.responses.store``): an entry is
its owner's alone, and when a bound is passed the owner holding the most gives up its
oldest entry, so one owner filling the store evicts only its own."""

from __future__ import annotations

from typing import Any

from modelpool.server.responses.store import ResponseStore


def _store(**bounds: Any) -> ResponseStore:
    return ResponseStore(**{"max_entries": 8, "max_bytes": 1 << 20, "ttl_s": 60.0, **bounds})


def _put(store: ResponseStore, response_id: str, owner: str, size: int = 10) -> None:
    assert store.put(response_id, {"text": "x" * size}, [], owner=owner)


def _kept(store: ResponseStore, owner: str, ids: list[str]) -> list[str]:
    return [i for i in ids if store.get(i, owner=owner) is not None]


def test_an_entry_is_its_owners_alone() -> None:
    store = _store()
    _put(store, "resp_1", "alice")
    assert store.get("resp_1", owner="bob") is None
    assert not store.delete("resp_1", owner="bob")
    assert store.get("resp_1", owner="alice") is not None, "bob's delete left it"
    assert store.delete("resp_1", owner="alice")
    assert store.get("resp_1", owner="alice") is None


def test_one_owner_past_the_entry_bound_evicts_its_own_oldest() -> None:
    store = _store(max_entries=8)
    alice = [f"a{index}" for index in range(3)]
    for response_id in alice:
        _put(store, response_id, "alice")
    bob = [f"b{index}" for index in range(100)]
    for response_id in bob:
        _put(store, response_id, "bob")
    assert _kept(store, "alice", alice) == alice
    assert _kept(store, "bob", bob) == bob[-5:]
    assert store.snapshot() == {"entries": 8, "bytes": store.snapshot()["bytes"], "owners": 2}


def test_an_owner_within_its_share_takes_room_from_the_largest() -> None:
    store = _store(max_entries=8)
    bob = [f"b{index}" for index in range(8)]
    for response_id in bob:
        _put(store, response_id, "bob")
    alice = [f"a{index}" for index in range(6)]
    for response_id in alice:
        _put(store, response_id, "alice")
    # Each keeps an equal share of the bound: past hers, alice's new entries evict her own.
    assert _kept(store, "bob", bob) == bob[-4:]
    assert _kept(store, "alice", alice) == alice[-4:]


def test_the_byte_bound_is_shared_the_same_way() -> None:
    entry_bytes = len('{"text": ""}') + len("[]") + 1000
    store = _store(max_entries=1000, max_bytes=10 * entry_bytes)
    _put(store, "a0", "alice", size=1000)
    # One large entry of bob's takes his share, then evicts only his own.
    bob = [f"b{index}" for index in range(30)]
    for response_id in bob:
        _put(store, response_id, "bob", size=1000)
    assert _kept(store, "alice", ["a0"]) == ["a0"]
    assert _kept(store, "bob", bob) == bob[-9:]
    assert store.snapshot()["bytes"] <= 10 * entry_bytes


def test_without_owners_it_is_one_fifo() -> None:
    store = _store(max_entries=3)
    ids = [f"r{index}" for index in range(5)]
    for response_id in ids:
        _put(store, response_id, "")
    assert _kept(store, "", ids) == ids[-3:]
