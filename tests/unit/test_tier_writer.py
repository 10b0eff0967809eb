"""The prefix tier writer (worker.backends.common.tier_writer): a bounded queue, entries
a tier already holds not rebuilt, failures swallowed."""

from __future__ import annotations

import functools
import threading
from pathlib import Path

from modelpool.shared.prefix_tier import PrefixTierStore, TierSpec
from modelpool.worker.backends.common.tier_writer import MAX_PENDING_WRITES, TierWriter


def _writer(tmp_path: Path) -> TierWriter:
    spec = TierSpec("host", str(tmp_path / "host"), 1 << 20)
    return TierWriter(PrefixTierStore.open([spec], "a" * 32))


def test_past_the_bound_entries_are_dropped_and_held_ones_not_rebuilt(tmp_path: Path) -> None:
    writer = _writer(tmp_path)
    gate = threading.Event()
    built: list[int] = []

    def payload(number: int) -> tuple[list[bytes], dict[str, int]]:
        gate.wait(30)
        built.append(number)
        return [b"x" * 8], {"n": number}

    for number in range(MAX_PENDING_WRITES + 2):
        writer.submit(list(range(16 * (number + 1))), 0, (), functools.partial(payload, number))
    assert writer.full()
    gate.set()
    writer.flush()
    assert built == list(range(MAX_PENDING_WRITES)) and not writer.full()
    # The same ids again: a tier holds them, so the payload is never built.
    writer.submit(list(range(16)), 0, (), lambda: payload(99))
    writer.flush()
    assert 99 not in built


def test_a_failing_payload_costs_only_its_entry(tmp_path: Path) -> None:
    writer = _writer(tmp_path)

    def broken() -> tuple[list[bytes], dict[str, str]]:
        raise RuntimeError("the state could not be read")

    writer.submit(list(range(16)), 0, (), broken)
    writer.submit(list(range(100, 132)), 0, (), lambda: ([b"ok"], {}))
    writer.flush()
    assert writer.store.lookup(list(range(17)), 0) is None
    assert writer.store.lookup(list(range(100, 133)), 0) is not None
