"""The supervisor's view of its prefix cache tiers (supervisor.tier_watch): a walk gives
the store's own stats and its entries' fingerprints from their headers alone, walks a
directory only when it changed, reads each entry's header once, forgets evicted entries,
bounds the fingerprints it keeps (without a partition's own unit), and publishes a view
only when something changed."""

from __future__ import annotations

import io
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from modelpool.shared import prefix_tier
from modelpool.shared.prefix_tier import EntryHeader, PrefixTierStore, TierSpec, entry_header
from modelpool.shared.prefixes import (
    matched_units,
    partition_of,
    partition_unit,
    prompt_fingerprints,
)
from modelpool.supervisor import tier_watch
from modelpool.supervisor.tier_watch import TierScanner, TierView, TierWatch

IDENTITY = "b" * 32
PAYLOAD = b"\x07" * 200_000


def _spec(tmp_path: Path, limit: int = 1 << 24) -> TierSpec:
    return TierSpec("host", str(tmp_path / "host"), limit)


def _store(spec: TierSpec) -> PrefixTierStore:
    return PrefixTierStore.open([spec], IDENTITY)


def _settle(spec: TierSpec) -> None:
    """Date the directory's last change well before now, as a quiet tier's is (the watch
    walks again a directory changed within SETTLE_NS of its last walk)."""
    stamp = os.stat(spec.directory).st_mtime_ns - 10 * tier_watch.SETTLE_NS
    os.utime(spec.directory, ns=(stamp, stamp))


def test_a_walk_gives_the_stores_stats_and_its_entries_fingerprints(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    store = _store(spec)
    store.store(list(range(40)), 0, PAYLOAD, fingerprints=(1, 2))
    store.store(list(range(100, 164)), 5, PAYLOAD, fingerprints=(3, 4, 5))
    assert store.lookup(list(range(41)), 0) is not None
    scanner = TierScanner(spec)
    scanner.walk()
    assert scanner.stats() == store.stats()[0]
    watch = TierWatch([spec], lambda view: None, threading.Event())
    watch.scanners = [scanner]
    assert watch.view().fingerprints == {1, 2, 3, 4, 5}


def test_the_fingerprints_come_from_the_header_not_the_payload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = _spec(tmp_path)
    _store(spec).store(list(range(32)), 0, PAYLOAD, fingerprints=(9,))
    (entry,) = {path.stat().st_ino: path for path in Path(spec.directory).glob("*.kv")}.values()
    read: list[int] = []

    class Counted(io.BufferedReader):
        def read(self, size: int | None = -1, /) -> bytes:
            data = super().read(size)
            read.append(len(data))
            return data

    def counted_open(path: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        return Counted(io.FileIO(path, mode))

    monkeypatch.setattr(prefix_tier, "open", counted_open, raising=False)
    assert entry_header(entry) == EntryHeader(0, (9,))
    assert 0 < sum(read) < 4096 < len(PAYLOAD)
    entry.write_bytes(b"not an entry")
    assert entry_header(entry) is None


def test_a_directory_is_walked_when_it_changed_and_a_header_read_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = _spec(tmp_path)
    store = _store(spec)
    store.store(list(range(48)), 0, PAYLOAD, fingerprints=(1,))
    headers: list[str] = []

    def counted(path: str) -> EntryHeader | None:
        headers.append(path)
        return entry_header(path)

    monkeypatch.setattr(tier_watch, "entry_header", counted)
    published: list[TierView] = []
    watch = TierWatch([spec], published.append, threading.Event())
    _settle(spec)
    (scanner,) = watch.scanners
    scanner.walk()
    assert len(headers) == 1 and scanner.walks == 1
    assert watch.refresh() is None, "a settled directory that did not change is not walked"
    assert scanner.walks == 1
    # A new entry changes the directory: walked again, only the new header read.
    store.store(list(range(200, 232)), 0, PAYLOAD, fingerprints=(2,))
    view = watch.refresh()
    assert view is not None and view.fingerprints == {1, 2}
    assert len(headers) == 2 and view.stats[0].entries == 2
    # A directory changed just before its walk (here: dated after it) is walked again at
    # the next look: a change in the same tick of its coarse clock would not move its time.
    ahead = os.stat(spec.directory).st_mtime_ns + 10 * tier_watch.SETTLE_NS
    os.utime(spec.directory, ns=(ahead, ahead))
    scanner.walk()
    assert scanner.changed() and len(headers) == 2
    # An evicted entry's fingerprints go with it.
    for path in Path(spec.directory).glob("*.kv"):
        if entry_header(path) == EntryHeader(0, (1,)):
            path.unlink()
    view = watch.refresh()
    assert view is not None and view.fingerprints == {2} and view.stats[0].entries == 1
    assert len(headers) == 2


def test_the_fingerprints_kept_are_bounded_most_recently_used_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tier_watch, "MAX_TIER_FINGERPRINTS", 3)
    spec = _spec(tmp_path)
    store = _store(spec)
    store.store(list(range(16)), 0, b"old", fingerprints=(1, 2))
    store.store(list(range(50, 66)), 0, b"new", fingerprints=(3, 4))
    old = min(Path(spec.directory).glob("*.kv"), key=lambda path: path.stat().st_mtime_ns)
    stamp = old.stat().st_mtime_ns - 10**9
    os.utime(old, ns=(stamp, stamp))
    watch = TierWatch([spec], lambda view: None, threading.Event())
    (scanner,) = watch.scanners
    scanner.walk()
    assert watch.view().fingerprints == {3, 4}


def test_start_walks_once_then_the_thread_publishes_changes_until_stopped(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    store = _store(spec)
    store.store(list(range(16)), 0, b"first", fingerprints=(1,))
    published: list[TierView] = []
    arrived = threading.Condition()

    def publish(view: TierView) -> None:
        with arrived:
            published.append(view)
            arrived.notify_all()

    stopped = threading.Event()
    watch = TierWatch([spec, TierSpec("disk", str(tmp_path / "off"), 0)], publish, stopped, 0.01)
    watch.start()
    assert len(published) == 1 and published[0].fingerprints == {1}
    assert [stats.tier for stats in published[0].stats] == ["host"], "a tier of 0 bytes is off"
    store.store(list(range(100, 116)), 0, b"second", fingerprints=(2,))
    with arrived:
        assert arrived.wait_for(lambda: published[-1].fingerprints == {1, 2}, timeout=30.0)
    stopped.set()


def test_without_tiers_nothing_is_watched() -> None:
    def watching() -> set[int | None]:
        return {t.ident for t in threading.enumerate() if t.name == "modelpool-prefix-tiers"}

    before = watching()
    published: list[TierView] = []
    TierWatch([], published.append, threading.Event()).start()
    assert published == [] and watching() == before


def test_a_partitions_own_unit_is_no_tier_hit(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    tenant = partition_of({"cache_salt": "tenant"})
    garden = [{"role": "user", "content": "What grows by the wall?"}]
    _store(spec).store(
        list(range(32)), tenant, b"kv", fingerprints=prompt_fingerprints(garden, tenant)
    )
    watch = TierWatch([spec], lambda view: None, threading.Event())
    (scanner,) = watch.scanners
    scanner.walk()
    held = watch.view().fingerprints
    assert partition_unit(tenant) not in held
    # The same tenant's conversation is held; another of its conversations shares only the
    # partition's unit, which says nothing of its tokens.
    assert matched_units(prompt_fingerprints([*garden, garden[0]], tenant), held) == 2
    pond = [{"role": "user", "content": "And near the pond?"}]
    assert matched_units(prompt_fingerprints(pond, tenant), held) == 0
