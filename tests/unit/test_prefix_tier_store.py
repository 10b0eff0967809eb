"""The prefix tier store (shared.prefix_tier): longest-prefix lookup, partitions, checks
that reject torn, corrupted and foreign entries, the byte bound and crash safety."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from modelpool.shared import prefix_tier
from modelpool.shared.prefix_tier import (
    ENTRY_SUFFIX,
    PrefixTierStore,
    TierSpec,
    entry_keys,
    model_identity,
)

IDENTITY = "a" * 32


def _store(tmp_path: Path, limit: int = 1 << 20, identity: str = IDENTITY) -> PrefixTierStore:
    return PrefixTierStore.open([TierSpec("host", str(tmp_path / "host"), limit)], identity)


def _entries(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "host").glob("*" + ENTRY_SUFFIX))


def test_lookup_finds_the_longest_stored_prefix_and_its_payload(tmp_path: Path) -> None:
    store = _store(tmp_path)
    ids = list(range(100))
    assert store.store(ids[:40], 0, b"forty", meta={"n": 40})
    assert store.store(ids[:70], 0, [b"seven", b"ty"], meta={"n": 70}, fingerprints=(7, 8))
    hit = store.lookup([*ids, 5], 0)
    assert hit is not None
    assert (hit.length, bytes(hit.payload), hit.meta["n"], hit.tier) == (70, b"seventy", 70, "host")
    assert hit.fingerprints == (7, 8)
    # The longer entry took over the names of the shorter one, which it holds all of.
    shorter = store.lookup(ids[:50], 0)
    assert shorter is not None and bytes(shorter.payload) == b"seventy"
    assert shorter.length == 49
    other = store.lookup([*ids[:40], 1000, 1001], 0)
    assert other is not None and other.length == 40
    # Fewer than a block of the prompt is never looked up; the last id is never restored.
    assert store.lookup(ids[:16], 0) is None
    stats = store.stats()[0]
    assert (stats.hits, stats.misses, stats.stores, stats.entries) == (3, 1, 2, 1)
    assert stats.restore_seconds > 0


def test_a_partition_never_sees_another_partitions_entry(tmp_path: Path) -> None:
    store = _store(tmp_path)
    ids = list(range(20))  # one block: one name
    store.store(ids, 11, b"salted")
    assert store.lookup([*ids, 1], 12) is None
    assert store.lookup([*ids, 1], 0) is None
    assert store.lookup([*ids, 1], 11) is not None
    # Even an entry copied under another partition's name is refused by its header.
    (entry,) = _entries(tmp_path)
    other = entry_keys(ids, 12, IDENTITY)[-1]
    entry.rename(entry.with_name(other + ENTRY_SUFFIX))
    assert store.lookup([*ids, 1], 12) is None
    assert store.stats()[0].rejected == 1
    assert _entries(tmp_path) == []


def test_corrupted_torn_and_foreign_entries_are_rejected_and_removed(tmp_path: Path) -> None:
    store = _store(tmp_path)
    ids = list(range(20))  # one block: one name
    store.store(ids, 0, b"x" * 1000)
    (entry,) = _entries(tmp_path)
    data = bytearray(entry.read_bytes())
    data[-10] ^= 0xFF
    entry.write_bytes(bytes(data))
    assert store.lookup([*ids, 1], 0) is None
    store.store(ids, 0, b"x" * 1000)
    (entry,) = _entries(tmp_path)
    entry.write_bytes(entry.read_bytes()[:-300])
    assert store.lookup([*ids, 1], 0) is None
    store.store(ids, 0, b"x" * 1000)
    (entry,) = _entries(tmp_path)
    entry.write_bytes(b"garbage")
    assert store.lookup([*ids, 1], 0) is None
    # Another model's entry under this model's name: refused by the identity.
    foreign = _store(tmp_path, identity="b" * 32)
    foreign.store(ids, 0, b"theirs")
    (entry,) = _entries(tmp_path)
    entry.rename(entry.with_name(entry_keys(ids, 0, IDENTITY)[-1] + ENTRY_SUFFIX))
    assert store.lookup([*ids, 1], 0) is None
    assert store.stats()[0].rejected == 4
    assert _entries(tmp_path) == []


def test_an_entry_is_found_by_a_prompt_sharing_only_its_first_blocks(tmp_path: Path) -> None:
    store = _store(tmp_path)
    answered = list(range(100))
    store.store(answered, 0, b"turn")
    # The next turn's prompt differs from the stored ids from id 90 on (a template's end
    # of turn in place of the answer's last token, say).
    prompt = [*answered[:90], 7, 7, 7, 7, 7, 7, 7, 7, 7, 7]
    hit = store.lookup(prompt, 0)
    assert hit is not None and hit.length == 90
    # A longer entry takes over the shared names; the shorter one is gone with its last.
    store.store([*answered, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5], 0, b"next")
    stats = store.stats()[0]
    assert stats.entries == 1
    hit = store.lookup(prompt, 0)
    assert hit is not None and bytes(hit.payload) == b"next"


def test_the_bound_evicts_the_least_recently_used_first(tmp_path: Path) -> None:
    store = _store(tmp_path, limit=5000)
    prompts = [[base + i for i in range(32)] for base in (1000, 2000, 3000)]
    store.store(prompts[0], 0, b"a" * 1500)
    store.store(prompts[1], 0, b"b" * 1500)
    assert store.lookup([*prompts[0], 1], 0) is not None  # now the most recently used
    # Its use stamped its modification time; the clock's tick may tie it with the other's.
    tier = store.tiers[0]
    os.utime(tier.path(entry_keys(prompts[1], 0, IDENTITY)[-1]), ns=(1, 1))
    store.store(prompts[2], 0, b"c" * 1500)
    assert store.lookup([*prompts[1], 1], 0) is None
    assert store.lookup([*prompts[0], 1], 0) is not None
    assert store.lookup([*prompts[2], 1], 0) is not None
    stats = store.stats()[0]
    assert stats.bytes <= 5000 and stats.evictions == 1
    # An entry larger than the bound is not kept.
    assert not store.store(list(range(32)), 0, b"z" * 6000)


def test_a_write_under_the_bytes_bound_walks_no_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tier of long prefixes is tens of thousands of names: a write that fits under the
    kept upper bound of the tier's bytes must not stat them all; one that would pass the
    limit walks the tier and evicts, and the bound never lets the tier grow past it."""
    store = _store(tmp_path, limit=8000)
    walks: list[str] = []
    real_scandir = os.scandir

    def counted(path: object) -> object:
        walks.append(str(path))
        return real_scandir(path)  # type: ignore[call-overload]

    monkeypatch.setattr(prefix_tier.os, "scandir", counted)
    prompts = [[base + i for i in range(32)] for base in range(1000, 9000, 1000)]
    assert store.store(prompts[0], 0, b"a" * 1500)
    first_walk = len(walks)
    assert first_walk > 0  # the first write of a tier finds no bound: it walks
    store.store(prompts[1], 0, b"b" * 1500)
    store.store(prompts[2], 0, b"c" * 1500)
    assert len(walks) == first_walk
    for prompt in prompts[3:]:
        store.store(prompt, 0, b"d" * 1500)
    assert len(walks) > first_walk  # past the limit: walked and evicted
    monkeypatch.setattr(prefix_tier.os, "scandir", real_scandir)
    stats = store.stats()[0]
    assert stats.bytes <= 8000 and stats.evictions >= 3


def test_a_writer_killed_mid_write_leaves_nothing_read(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import os, sys
        from modelpool.shared.prefix_tier import PrefixTierStore, TierSpec

        store = PrefixTierStore.open([TierSpec("host", {str(tmp_path / "host")!r}, 1 << 30)],
                                     {IDENTITY!r})
        def stalled(*args):
            sys.stdout.write("writing\\n"); sys.stdout.flush()
            sys.stdin.readline()
        os.replace = stalled
        store.store(list(range(64)), 0, b"p" * 100000)
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    with subprocess.Popen(
        [sys.executable, "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    ) as writer:
        assert writer.stdout is not None
        assert writer.stdout.readline() == "writing\n"
        writer.send_signal(signal.SIGKILL)
        writer.wait()
    temps = list((tmp_path / "host").glob(".tmp-*"))
    assert temps, "the killed writer's temporary file is there"
    store = _store(tmp_path)
    assert store.lookup(list(range(65)), 0) is None
    store.store(list(range(200, 232)), 0, b"next")
    assert not any(path.exists() for path in temps), "a dead writer's file is removed"


def test_model_identity_changes_with_the_files_dtype_and_backend(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "weights").write_bytes(b"1234")
    first = model_identity(str(model), backend="hf", dtype="float32")
    assert first == model_identity(str(model), backend="hf", dtype="float32")
    assert first != model_identity(str(model), backend="hf", dtype="bfloat16")
    assert first != model_identity(str(model), backend="llama_cpp", dtype="float32")
    (model / "weights").write_bytes(b"12345")
    assert first != model_identity(str(model), backend="hf", dtype="float32")


def test_a_lookup_reads_no_entry_the_worker_already_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = _store(tmp_path)
    ids = list(range(100))
    store.store(ids[:64], 0, b"sixty-four")
    reads: list[Path] = []
    read = prefix_tier._read

    def counted_read(path: Path) -> bytearray:
        reads.append(path)
        return read(path)

    monkeypatch.setattr(prefix_tier, "_read", counted_read)
    # The worker holds 64 ids already: the tier's entry (4 blocks) adds nothing, so it is
    # not read, and neither a hit nor a miss is counted.
    assert store.lookup(ids, 0, longer_than=64) is None
    assert store.lookup(ids, 0, longer_than=70) is None
    assert reads == []
    stats = store.stats()[0]
    assert (stats.hits, stats.misses, stats.restores) == (0, 0, 0)
    # Holding less than the entry's blocks: it is read and counted as a hit.
    hit = store.lookup(ids, 0, longer_than=40)
    assert hit is not None and hit.length == 64 and len(reads) == 1
    # A longer entry stored later is found past what the worker holds.
    store.store(ids[:96], 0, b"ninety-six")
    longer = store.lookup(ids, 0, longer_than=64)
    assert longer is not None and longer.length == 96
    stats = store.stats()[0]
    assert (stats.hits, stats.misses) == (2, 0)
    # Holding nothing, a prompt no entry starts with is a miss.
    assert store.lookup([7, *ids], 0) is None
    assert store.stats()[0].misses == 1
