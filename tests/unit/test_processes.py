"""The worker's own RSS reading (sent with every result, for recycling by memory)."""

from __future__ import annotations

import psutil

from modelpool.processes import process_rss_bytes


def test_process_rss_bytes_is_this_process_resident_memory_and_follows_it() -> None:
    before = process_rss_bytes()
    assert abs(before - psutil.Process().memory_info().rss) < 16 * 2**20
    held = b"\x01" * (64 * 2**20)  # written, so every page is resident
    try:
        assert process_rss_bytes() - before > 48 * 2**20
    finally:
        del held
