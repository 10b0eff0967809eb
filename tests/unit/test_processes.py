"""The worker's own RSS reading (sent with every result, for recycling by memory)."""

from __future__ import annotations

import mmap

import psutil

from modelpool.shared.processes import process_rss_bytes


def test_process_rss_bytes_is_this_process_resident_memory_and_follows_it() -> None:
    before = process_rss_bytes()
    assert abs(before - psutil.Process().memory_info().rss) < 16 * 2**20
    # A fresh anonymous mapping, written, so every page is new and resident: a plain
    # allocation may reuse heap pages that are resident already (it did, late in the suite,
    # in a process holding 2.4 GB), and the reading would not move.
    with mmap.mmap(-1, 64 * 2**20) as held:
        held.write(b"\x01" * len(held))
        assert process_rss_bytes() - before > 48 * 2**20
