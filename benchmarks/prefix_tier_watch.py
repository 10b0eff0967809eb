"""What the supervisor pays to know its prefix cache tiers (issue 56,
``supervisor.tier_watch``), on a tier of ``--entries`` entries of ``--tokens`` tokens each
(one name per 16-token block, as workers write them):

- **before**: every ``stats()`` walked each tier on the dispatcher thread, a ``stat`` per
  name (``PrefixTierStore.stats``);
- **the watch**: its first walk (every entry's header read), a walk after a change with
  no new entry (a ``stat`` per entry, headers remembered), the look that finds nothing
  changed (a ``stat`` per tier), all on the watch's thread; and placement's lookup of a
  request's prompt in the view (``placement.tier_held``), on the dispatcher thread;
- ``pool.stats()`` of a started pool over that tier (the testing backend), which now
  reads the dispatcher's copy of the view.

::

    python -m benchmarks.prefix_tier_watch --entries 200 --tokens 2000

Medians of ``--repeats``; a JSON line per figure.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.embeddings import p50_s
from modelpool import ModelPool, PoolConfig
from modelpool.scheduling.placement import tier_held
from modelpool.shared.prefix_tier import BLOCK_TOKENS, PrefixTierStore, TierSpec
from modelpool.shared.prefixes import prompt_fingerprints
from modelpool.shared.protocol import encode_request
from modelpool.supervisor.prefix_tiers import tier_specs
from modelpool.supervisor.records import Request
from modelpool.supervisor.results import PoolFuture
from modelpool.supervisor.tier_watch import TierScanner, TierWatch

SHARED_MEMORY = Path("/dev/shm")


def fill(spec: TierSpec, entries: int, tokens: int) -> None:
    """``entries`` entries of ``tokens`` ids each, a conversation's fingerprints with each."""
    store = PrefixTierStore.open([spec], "bench" * 6)
    for number in range(entries):
        ids = range(number * 1_000_000, number * 1_000_000 + tokens)
        messages = [
            {"role": "user", "content": f"conversation {number} turn {turn}"} for turn in range(10)
        ]
        store.store(ids, 0, b"\0" * 64, fingerprints=prompt_fingerprints(messages))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    parent = SHARED_MEMORY if SHARED_MEMORY.is_dir() else None
    with tempfile.TemporaryDirectory(dir=parent) as directory:
        config = PoolConfig(
            model="none", backend="testing", workers=1, devices=("cpu",), prefix_cache_dir=directory
        )
        (spec,) = tier_specs(config)
        started = time.perf_counter()
        fill(spec, args.entries, args.tokens)
        names = args.entries * (args.tokens // BLOCK_TOKENS)
        report = {"entries": args.entries, "names": names, "fill_s": time.perf_counter() - started}
        store = PrefixTierStore.open([spec], "")
        report["before_stats_walk_s"] = p50_s(store.stats, args.repeats)
        report["watch_first_walk_s"] = p50_s(lambda: TierScanner(spec).walk(), args.repeats)
        # A quiet tier: its last change well before the walk (tier_watch.SETTLE_NS).
        quiet = os.stat(spec.directory).st_mtime_ns - 10**9
        os.utime(spec.directory, ns=(quiet, quiet))
        watch = TierWatch([spec], lambda view: None, threading.Event())
        (scanner,) = watch.scanners
        scanner.walk()
        assert not scanner.changed()
        report["watch_walk_after_change_s"] = p50_s(scanner.walk, args.repeats)
        report["watch_unchanged_look_s"] = p50_s(scanner.changed, args.repeats)
        view = watch.view()
        report["view_fingerprints"] = len(view.fingerprints)
        messages = [
            {"role": "user", "content": f"conversation 7 turn {turn}"} for turn in range(11)
        ]
        request = Request(
            request_id="r",
            payload=encode_request(messages, {}),
            future=PoolFuture("r", lambda _: None),
            submitted_at=0.0,
            deadline=60.0,
            prefix_fingerprints=prompt_fingerprints(messages),
        )
        report["placement_tier_held"] = tier_held(request, view.fingerprints)
        report["placement_tier_held_s"] = p50_s(
            lambda: tier_held(request, view.fingerprints), max(args.repeats, 1000)
        )
        with ModelPool(config).start() as pool:
            report["pool_stats_s"] = p50_s(pool.stats, max(args.repeats, 50))
            report["pool_stats_entries"] = pool.stats().prefix_tiers[0].entries
    for name, value in report.items():
        print(json.dumps({name: value}))


if __name__ == "__main__":
    main()
