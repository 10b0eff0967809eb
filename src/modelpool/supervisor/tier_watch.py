"""What the supervisor knows of its prefix cache tiers, kept current off the dispatcher
thread: their stats for ``PoolStats.prefix_tiers`` and the prefix fingerprints of their
entries, by which placement counts a tier hit for every worker
(``scheduling.placement``).

A tier is a directory of entries, each one file under one name per 16-token block, so a
walk of a full tier reads thousands of names. Neither ``stats()`` nor dispatch waits on
one: a :class:`TierWatch` thread (one per pool with tiers, started with the pool's
monitors) looks at each tier's directory every ``REFRESH_S``, walks it only when the
directory changed (an entry written, evicted or rejected, the counters updated), and
posts the resulting :class:`TierView` to the dispatcher, which keeps the latest
(:class:`TierState`). A walk is incremental: an entry it has seen before (the same inode,
size and last use) costs a ``stat``; a new one, a read of its header (its fingerprints),
never of its payload. The view is at most ``REFRESH_S`` plus one walk old: a
placement that believes an entry just evicted sends its request to a worker that then
misses the tier and prefills, as it would have without it.

The first walk runs when the pool starts, on the starting thread, so the stats a started
pool shows hold what the tiers held then (a disk tier from an earlier daemon).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from modelpool.shared.config import PoolConfig
from modelpool.shared.prefix_tier import (
    ENTRY_SUFFIX,
    TierSpec,
    TierStats,
    counted_stats,
    entry_header,
    tier_counters,
)
from modelpool.shared.prefixes import partition_unit
from modelpool.supervisor.prefix_tiers import tier_specs

logger = logging.getLogger(__name__)

REFRESH_S = 0.25
"""How often the watch looks for a change of the tiers' directories (a ``stat`` each)."""
SETTLE_NS = 100_000_000
"""A directory's modification time ticks coarsely (the kernel's coarse clock, a few ms):
a change within this of a walk could hide under the time the walk saw, so the directory
is walked again on the next look."""
MAX_TIER_FINGERPRINTS = 4096
"""Fingerprints a view holds, the most recently used entries' first (as a worker's
report is bounded): a full tier of short entries would otherwise cost the supervisor
memory in proportion to the tier's bytes."""


@dataclass(frozen=True)
class TierView:
    """The tiers as a walk found them: each tier's stats, and the prefix fingerprints of
    their entries (every partition's: a fingerprint chain starts from its partition, so a
    request matches only its own)."""

    stats: tuple[TierStats, ...] = ()
    fingerprints: frozenset[int] = frozenset()


def unscanned_view(specs: Iterable[TierSpec]) -> TierView:
    """The view before the first walk: each tier, empty."""
    return TierView(
        tuple(TierStats(tier=spec.name, limit_bytes=spec.limit_bytes) for spec in specs)
    )


class TierState:
    """The dispatcher's copy of the latest view; ``update`` is posted to its thread."""

    def __init__(self, config: PoolConfig) -> None:
        self.view = unscanned_view(tier_specs(config))

    def update(self, view: TierView) -> None:
        self.view = view


@dataclass(frozen=True)
class _Seen:
    """An entry as a walk found it: size, last use (ns) and the fingerprints its header
    names (None: a file that is not an entry of this format; its bytes still count)."""

    size: int
    used_ns: int
    fingerprints: tuple[int, ...] | None


class TierScanner:
    """One tier's directory, walked only when it changed, reading only new entries'
    headers."""

    def __init__(self, spec: TierSpec) -> None:
        self.spec = spec
        self.walks = 0
        self._stamp: int | None = None  # the directory's mtime at a settled walk
        # (inode, size, mtime) -> the entry: an inode reused by another file, or an
        # entry used since, has another key, and its header is read again.
        self._seen: dict[tuple[int, int, int], _Seen] = {}
        self._stats = TierStats(tier=spec.name, limit_bytes=spec.limit_bytes)

    def changed(self) -> bool:
        """Whether the directory may hold something the last walk did not see."""
        return self._stamp is None or self._stamp != _mtime_ns(self.spec.directory)

    def walk(self) -> None:
        """Walk the directory: sizes, counters and each entry's fingerprints."""
        self.walks += 1
        started = time.time_ns()
        stamp = _mtime_ns(self.spec.directory)
        # The counters before the entries: a store is counted after its entry has its
        # names, so a view that counts a store lists its entry.
        counters = tier_counters(self.spec.directory)
        listed: dict[int, os.DirEntry[str]] = {}
        with contextlib.suppress(OSError), os.scandir(self.spec.directory) as names:
            for item in names:
                if item.name.endswith(ENTRY_SUFFIX):
                    # One entry has a name per block: its inode (free from the listing on
                    # Linux) names it once.
                    listed.setdefault(item.inode(), item)
        seen: dict[tuple[int, int, int], _Seen] = {}
        for inode, item in listed.items():
            try:
                stat = item.stat()
            except OSError:
                continue  # evicted since the listing
            key = (inode, stat.st_size, stat.st_mtime_ns)
            entry = self._seen.get(key)
            if entry is None:
                entry = _Seen(stat.st_size, stat.st_mtime_ns, _held(item.path))
            seen[key] = entry
        self._seen = seen
        self._stats = counted_stats(
            self.spec.name, self.spec.limit_bytes, [entry.size for entry in seen.values()], counters
        )
        settled = stamp is not None and started - stamp > SETTLE_NS
        self._stamp = stamp if settled else None

    def stats(self) -> TierStats:
        return self._stats

    def entries(self) -> Iterable[_Seen]:
        return self._seen.values()


class TierWatch:
    """Walks the tiers that changed, every ``REFRESH_S``, and ``publish``-es each new view
    (the pool posts it to the dispatcher) until ``stopped`` is set."""

    def __init__(
        self,
        specs: Iterable[TierSpec],
        publish: Callable[[TierView], object],
        stopped: threading.Event,
        refresh_s: float = REFRESH_S,
    ) -> None:
        self.scanners = [TierScanner(spec) for spec in specs if spec.limit_bytes > 0]
        self._publish = publish
        self._stopped = stopped
        self._refresh_s = refresh_s

    def start(self) -> None:
        """Walk the tiers once, here, and publish that view; then watch them on a thread
        (nothing to do without tiers)."""
        if not self.scanners:
            return
        for scanner in self.scanners:
            scanner.walk()
        self._publish(self.view())
        thread = threading.Thread(target=self._watch, name="modelpool-prefix-tiers", daemon=True)
        thread.start()

    def refresh(self) -> TierView | None:
        """The view after walking the tiers that changed; None when none changed."""
        stale = [scanner for scanner in self.scanners if scanner.changed()]
        for scanner in stale:
            scanner.walk()
        return self.view() if stale else None

    def view(self) -> TierView:
        """The view of the latest walks."""
        return TierView(
            tuple(scanner.stats() for scanner in self.scanners),
            _recent_fingerprints(entry for scanner in self.scanners for entry in scanner.entries()),
        )

    def _watch(self) -> None:
        while not self._stopped.wait(self._refresh_s):
            try:
                view = self.refresh()
            except Exception:
                # The tiers only save work: a walk that failed leaves the last view.
                logger.warning("could not read the prefix cache tiers", exc_info=True)
                continue
            if view is not None:
                self._publish(view)


def _recent_fingerprints(entries: Iterable[_Seen]) -> frozenset[int]:
    """The entries' fingerprints, the most recently used entries' first, up to
    ``MAX_TIER_FINGERPRINTS``."""
    held: set[int] = set()
    for entry in sorted(entries, key=lambda entry: entry.used_ns, reverse=True):
        if entry.fingerprints is None:
            continue
        if len(held) + len(entry.fingerprints) > MAX_TIER_FINGERPRINTS:
            break
        held.update(entry.fingerprints)
    return frozenset(held)


def _held(path: str) -> tuple[int, ...] | None:
    """The fingerprints of the prompt an entry holds, from its header: without its
    partition's own unit (``prefixes.partition_unit``), which names the partition, not
    tokens, and which a worker that has served the partition (an adapter loaded) is
    preferred by; every worker would seem to hold it."""
    header = entry_header(path)
    if header is None:
        return None
    own = partition_unit(header.partition)
    return tuple(value for value in header.fingerprints if value != own)


def _mtime_ns(directory: str) -> int | None:
    try:
        return os.stat(directory).st_mtime_ns
    except OSError:
        return None
