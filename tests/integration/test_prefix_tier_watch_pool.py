"""A pool's prefix cache tiers are walked off its dispatcher thread
(``supervisor.tier_watch``): ``stats()`` on a pool whose disk tier holds many entries (a
name per 16-token block each) lists no tier directory, on the calling thread nor on the
dispatcher's; the watch's thread does, and the stats follow the tier."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest

from helpers import make_config, open_pool, wait_until
from modelpool.shared.prefix_tier import PrefixTierStore
from modelpool.supervisor.prefix_tiers import tier_specs
from modelpool.supervisor.tier_watch import REFRESH_S

ENTRIES = 200
BLOCKS = 2  # names per entry (a store walks them all to make room: kept few)


def test_stats_never_walk_a_tier_on_the_calling_or_the_dispatcher_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    overrides: dict[str, Any] = {"workers": 1, "prefix_cache_dir": str(tmp_path)}
    (spec,) = tier_specs(make_config(**overrides))
    store = PrefixTierStore.open([spec], "c" * 32)
    for number in range(ENTRIES):
        start = number * 10_000
        store.store(range(start, start + 16 * BLOCKS), 0, b"kv", fingerprints=(number,))
    walks: list[str] = []
    listing = os.scandir

    def counted(path: Any = ".") -> Any:
        if os.fspath(path) == spec.directory:
            walks.append(threading.current_thread().name)
        return listing(path)

    monkeypatch.setattr(os, "scandir", counted)
    with open_pool(**overrides) as pool:
        # The first walk runs as the pool starts, on the starting thread.
        assert walks[:1] == [threading.current_thread().name]
        walks.clear()
        for _ in range(20):
            assert pool.stats().prefix_tiers[0].entries == ENTRIES
        # A worker writes one more (on a thread of its own here: a store walks the tier
        # to make room).
        start = ENTRIES * 10_000
        ids = range(start, start + 16 * BLOCKS)
        writer = threading.Thread(target=store.store, args=(ids, 0, b"kv"), name="writer")
        writer.start()
        writer.join()
        wait_until(
            lambda: pool.stats().prefix_tiers[0].entries == ENTRIES + 1,
            max(5.0, 40 * REFRESH_S),
            message="the watch to see the new entry",
        )
    # Only the watch's thread walked it: neither stats() nor the dispatcher.
    assert set(walks) - {"writer"} == {"modelpool-prefix-tiers"}
